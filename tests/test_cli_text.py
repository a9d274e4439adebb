"""The command line's text edges (issue 14 items 8, 9, 12, 13), run as a user runs them.

Names and paths are data: rich markup in them is shown literally, control characters and lone
surrogates are shown as escapes, and the JSON keeps the true strings. Usage errors are one line
on stderr with exit status 2. A reader that closes the pipe early ends the run quietly with
status 141. Every run is ``python -m gradstat`` in a subprocess whose stdout is encoded
strictly, as in a UTF-8 terminal, so a lone surrogate that reached it would fail the run.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from gradstat.cli.render import visible
from gradstat.snapshot import save_rank
from tests._cli import SAMPLE_DATA, run_gradstat
from tests._params import param_with

SAMPLE = SAMPLE_DATA / "gtp2-pp2-dp2-ep2"
NAN_SAMPLE = SAMPLE_DATA / "tp2-pp2-dp2-ep2-distopt-nan"

# Each replicated parameter's name, and how a table shows it.
REPLICATED = {
    "close[/]tag": "close[/]tag",  # rich raised MarkupError
    "x[i]y": "x[i]y",  # rich ate [i] and [exp1]
    "[exp1]": "[exp1]",
    "[bold red]alarm[/]": "[bold red]alarm[/]",
    "back\\[i]slash": "back\\[i]slash",
    "emoji:thumbs_up:code": "emoji:thumbs_up:code",
    "csi\x1b[31mred": "csi\\x1b[31mred",  # reached the terminal raw
    "osc\x1b]0;title\x07end": "osc\\x1b]0;title\\x07end",
    "c1\x9bcsi": "c1\\x9bcsi",
    "new\nline": "new\\nline",
}
SPLIT, SPLIT_SHOWN = "tp[/]split\x1b[0m", "tp[/]split\\x1b[0m"
NO_GRAD, NO_GRAD_SHOWN = "lone\udcffsurrogate", "lone\\udcffsurrogate"  # in the metadata only
SHOWN = {**REPLICATED, SPLIT: SPLIT_SHOWN}
# A path with markup, an undecodable byte (a lone surrogate in Python) and ESC; "[/]" makes
# it two directories.
DIR_NAME, DIR_SHOWN = os.fsdecode(b"snap[/][i]\xff\x1b[2J"), "snap[/][i]\\udcff\\x1b[2J"
OUT_NAME, OUT_SHOWN = "clipped[i]\x1b[0m", "clipped[i]\\x1b[0m"


def _grad(index: int) -> torch.Tensor:
    return torch.linspace(-1.0, 1.0, 6) * (index + 1)


def _split_grad() -> torch.Tensor:
    return torch.arange(8, dtype=torch.float32) - 3.5


def write_hostile(directory: Path, defect: str | None = None) -> Path:
    """Two TP ranks with hostile names: replicated params, a TP-split one, one without a grad.

    ``defect``: "nan" puts a NaN in the first replicated gradient, "replica" makes rank 1's
    copy of it differ from rank 0's.
    """
    for rank in range(2):
        params = []
        for index, name in enumerate(REPLICATED):
            grad = _grad(index)
            if index == 0 and defect == "nan":
                grad[2] = math.nan
            if index == 0 and defect == "replica" and rank == 1:
                grad[2] += 1.0
            params.append((name, param_with(grad)))
        shard = _split_grad().chunk(2)[rank].clone()
        params.append((SPLIT, param_with(shard, tensor_model_parallel=True, partition_dim=0)))
        params.append((NO_GRAD, param_with(None)))
        save_rank(directory, params, rank=rank, world_size=2, coords={"tp": [rank, 2]})
    return directory


def _float64_total() -> float:
    grads = [_grad(index) for index in range(len(REPLICATED))] + [_split_grad()]
    return math.sqrt(sum(float(grad.double().square().sum()) for grad in grads))


@pytest.fixture(scope="module")
def hostile(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_hostile(tmp_path_factory.mktemp("hostile") / DIR_NAME)


def _shown_path(path: Path) -> str:
    return str(path).replace(DIR_NAME, DIR_SHOWN).replace(OUT_NAME, OUT_SHOWN)


def _gradstat(*args: str | Path) -> subprocess.CompletedProcess[str]:
    return run_gradstat(*args, env={"PYTHONIOENCODING": "utf-8:strict"}, timeout=120)


def _digest(directory: Path) -> dict[str, bytes]:
    return {path.name: path.read_bytes() for path in sorted(directory.iterdir())}


def _assert_shown(stdout: str, names: dict[str, str]) -> None:
    """Every name appears as shown, and nothing reaches the terminal as a control character."""
    for name, shown in names.items():
        assert shown in stdout, (name, stdout)
    assert not any(char in stdout for char in "\x1b\x07\x9b"), stdout


# ---------------------------------------------------------------------------------------------
# Names and paths are data (item 9)
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "shown"),
    [
        ("decoder.layers.0.mlp", "decoder.layers.0.mlp"),
        ("x[/]y[i]é", "x[/]y[i]é"),  # markup is escaped for rich, not here
        ("\x1b]8;;http://x\x07link", "\\x1b]8;;http://x\\x07link"),
        ("a\nb\tc\r", "a\\nb\\tc\\r"),
        ("lone\udcff", "lone\\udcff"),
        ("rtl\u202eoverride", "rtl\\u202eoverride"),
    ],
)
def test_visible_writes_unprintable_characters_as_escapes(text: str, shown: str) -> None:
    assert visible(text) == shown


@pytest.mark.parametrize("command", ["norm", "zeros", "inspect", "audit"])
def test_tables_show_names_and_paths_literally(hostile: Path, command: str) -> None:
    result = _gradstat(command, hostile)
    assert result.returncode == 0, result.stderr
    assert result.stderr == ""
    lines = result.stdout.splitlines()
    assert lines[0].startswith(f"{_shown_path(hostile)}: 2 ranks, plain optimizer")
    if command in ("norm", "zeros", "inspect"):
        names = {**SHOWN, NO_GRAD: NO_GRAD_SHOWN} if command == "inspect" else SHOWN
        _assert_shown(result.stdout, names)
    if command == "norm":
        shown_total = float(lines[1].split()[3])  # total L2 norm X (dense ...
        assert math.isclose(shown_total, _float64_total(), rel_tol=1e-6)


def test_nonfinite_and_audit_findings_show_names_literally(tmp_path: Path) -> None:
    with_nan = write_hostile(tmp_path / "nan" / DIR_NAME, defect="nan")
    result = _gradstat("norm", with_nan)
    assert result.returncode == 1 and result.stderr == ""
    table = result.stdout[result.stdout.index("non-finite gradients") :]
    _assert_shown(table, {"close[/]tag": "close[/]tag"})

    differing = write_hostile(tmp_path / "replica" / DIR_NAME, defect="replica")
    result = _gradstat("audit", differing)
    assert result.returncode == 1 and result.stderr == ""
    findings = result.stdout[result.stdout.index("1 finding") :]  # one, singular
    _assert_shown(findings, {"close[/]tag": "close[/]tag"})


def test_clip_with_hostile_names_writes_its_copy_and_exits_0(hostile: Path, tmp_path: Path) -> None:
    before = _digest(hostile)
    out = tmp_path / OUT_NAME
    result = _gradstat("clip", hostile, "--max-norm", "1", "--out", out)
    assert result.returncode == 0, result.stderr
    assert result.stderr == ""
    assert f"{_shown_path(hostile)}: total L2 norm" in result.stdout
    assert result.stdout.splitlines()[-1] == f"wrote {_shown_path(out)}"
    assert _digest(hostile) == before
    assert sorted(_digest(out)) == sorted(before)

    again = _gradstat("norm", out, "--json")
    assert again.returncode == 0, again.stderr
    report = json.loads(again.stdout)
    total = _float64_total()
    assert math.isclose(report["total_norm"], total / (total + 1e-6), rel_tol=1e-6)
    assert {row["name"] for row in report["params"]} == set(SHOWN)

    compared = _gradstat("compare", hostile, out, "--all")
    assert compared.returncode == 1, compared.stderr  # every norm differs: flagged
    assert compared.stdout.startswith(f"A: {_shown_path(hostile)}: 2 ranks")
    _assert_shown(compared.stdout, SHOWN)


@pytest.mark.parametrize("command", ["norm", "inspect"])
def test_json_keeps_the_true_strings(hostile: Path, command: str) -> None:
    result = _gradstat(command, hostile, "--json")
    assert result.returncode == 0, result.stderr
    assert result.stdout.isascii()  # a lone surrogate is the escape \udcff
    report = json.loads(result.stdout)
    assert report["snapshot"]["path"] == str(hostile)
    expected = set(SHOWN) | ({NO_GRAD} if command == "inspect" else set())
    assert {row["name"] for row in report["params"]} == expected
    if command == "inspect":
        paths = [row["path"] for row in report["files"]]
        assert [os.fsencode(path) for path in paths] == [
            os.fsencode(hostile / f"rank-{rank:05d}.safetensors") for rank in range(2)
        ]


def test_error_line_shows_a_hostile_path_as_escapes(tmp_path: Path) -> None:
    empty = tmp_path / DIR_NAME
    empty.mkdir(parents=True)
    result = _gradstat("zeros", empty)
    assert result.returncode == 2 and result.stdout == ""
    assert result.stderr == (
        f"gradstat: error: {tmp_path}/{DIR_SHOWN}: no rank files (*.safetensors) in the "
        "directory, nor a Megatron wgrads dump (mp_rank_*.pth)\n"
    )


# ---------------------------------------------------------------------------------------------
# Usage errors: one line, exit 2 (items 8 and 12)
# ---------------------------------------------------------------------------------------------

PROG = "python -m gradstat"
TIMEOUT_ARGS = {
    "norm": ["norm", SAMPLE],
    "zeros": ["zeros", SAMPLE],
    "clip": ["clip", SAMPLE, "--max-norm", "1", "--out", "unused"],
    "compare": ["compare", SAMPLE, SAMPLE],
    "audit": ["audit", SAMPLE],
}


def _one_usage_line(result: subprocess.CompletedProcess[str]) -> str:
    assert result.returncode == 2, result.stderr
    assert result.stdout == ""
    assert result.stderr.endswith("\n") and result.stderr.count("\n") == 1, result.stderr
    assert "Traceback" not in result.stderr and "─" not in result.stderr
    return result.stderr.rstrip("\n")


@pytest.mark.parametrize(
    ("args", "line"),
    [
        (["norm"], "missing argument 'snapshot_dir'; see 'PROG norm --help'"),
        (["norm", SAMPLE, "--bogus"], "no such option: --bogus; see 'PROG norm --help'"),
        (["frobnicate", SAMPLE], "no such command 'frobnicate'; see 'PROG --help'"),
        (["--bogus"], "no such option: --bogus (Possible options: --verbose); see 'PROG --help'"),
        (["clip", SAMPLE, "--out", "x"], "missing option '--max-norm'; see 'PROG clip --help'"),
        (
            ["audit", SAMPLE, "--rtol", "inf"],
            "invalid value for '--rtol': inf is not a finite number; see 'PROG audit --help'",
        ),
    ],
)
def test_usage_error_is_one_line(args: list[Any], line: str) -> None:
    assert _one_usage_line(_gradstat(*args)) == "gradstat: error: " + line.replace("PROG", PROG)


@pytest.mark.parametrize("command", sorted(TIMEOUT_ARGS))
@pytest.mark.parametrize("value", ["inf", "1e400", "-inf"])
def test_timeout_must_be_finite(command: str, value: str) -> None:
    line = _one_usage_line(_gradstat(*TIMEOUT_ARGS[command], "--timeout", value))
    if value == "-inf":  # typer's own range check comes first
        assert line.startswith("gradstat: error: invalid value for '--timeout': ")
    else:
        assert line == (
            f"gradstat: error: invalid value for '--timeout': inf is not a finite number; "
            f"see '{PROG} {command} --help'"
        )


@pytest.mark.parametrize(
    "args",
    [
        ["norm", SAMPLE, "--max-norm", "abc"],
        ["norm", SAMPLE, "--timeout", "0"],
        ["norm", SAMPLE, "--timeout", "nan"],
        ["norm", SAMPLE, "--top", "0"],
        ["compare", SAMPLE, SAMPLE, "--rtol", "nan"],
    ],
)
def test_bad_option_value_is_one_line(args: list[Any]) -> None:
    option = args[-2]
    line = _one_usage_line(_gradstat(*args))
    assert line.startswith(f"gradstat: error: invalid value for '{option}': ")
    assert line.endswith(f"; see '{PROG} {args[0]} --help'")


def test_usage_error_does_not_import_torch() -> None:
    code = (
        "import sys\n"
        "from gradstat.cli import app\n"
        "try:\n"
        "    app(['norm', '--timeout', 'inf', 'DIR'])\n"
        "except SystemExit as exit:\n"
        "    assert exit.code == 2, exit.code\n"
        "assert 'torch' not in sys.modules, 'torch was imported'\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=False
    )
    assert result.returncode == 0, result.stderr
    assert result.stderr.startswith("gradstat: error: invalid value for '--timeout': inf ")


def test_usage_error_shows_control_characters_as_escapes() -> None:
    line = _one_usage_line(_gradstat("norm", SAMPLE, "extra\x1b[2J"))
    assert "(extra\\x1b[2J)" in line and "\x1b" not in line


# ---------------------------------------------------------------------------------------------
# A closed pipe on stdout (item 13)
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("as_json", [False, True])
def test_closed_pipe_exits_141_quietly(as_json: bool) -> None:
    """``gradstat norm ... | head -1``; the NaN snapshot would otherwise exit 1 (findings)."""
    args = ["norm", str(NAN_SAMPLE), *(["--json"] if as_json else [])]
    process = subprocess.Popen(
        [sys.executable, "-m", "gradstat", *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    assert process.stdout is not None and process.stderr is not None
    process.stdout.close()  # the reader is gone before gradstat writes anything
    stderr = process.stderr.read()
    assert process.wait(timeout=120) == 141
    assert stderr == b""


def test_the_norm_report_keeps_the_first_rows_of_the_whole_order() -> None:
    """``--top k`` shows the first k rows of the order the whole list takes (non-finite first,
    then largest; ties in parameter order), and counts the rest as left out."""
    from gradstat.analysis.report import norm_report
    from gradstat.analysis.stats import ParamStats, SnapshotStats
    from gradstat.snapshot import Snapshot

    snapshot = Snapshot.open(Path(__file__).parent.parent / "sample_data" / "gtp2-pp2-dp2-ep2")
    norms = [1.0, 3.0, math.nan, 3.0, 0.0, math.inf, 2.0, 3.0, 1.0, 0.0, math.nan, 2.0]
    params = tuple(
        ParamStats(f"p{index}", index % 3 == 0, numel=4, norms={2.0: norm}, ranks=[index % 2])
        for index, norm in enumerate(norms)
    )
    stats = SnapshotStats(params, (2.0,))
    whole = norm_report(snapshot, stats, 2.0).params
    assert [row.name for row in whole[:5]] == ["p2", "p5", "p10", "p1", "p3"]
    for top in range(1, len(norms) + 2):
        report = norm_report(snapshot, stats, 2.0, top=top)
        assert [repr(row) for row in report.params] == [repr(row) for row in whole[:top]]
        assert report.params_left_out == max(len(norms) - top, 0)


def test_json_rows_are_one_a_line_and_read_back_whatever_their_names() -> None:
    """The report's JSON puts each row on a line of its own (encoded in C: the indenting
    encoder is pure Python, 2x the time for 16,384 rows); a name holding the text between two
    rows, nested rows and empty containers read back as they were."""
    import json

    from gradstat.cli.app import json_text

    rows = [{"name": 'a}, {"b', "norm": 1.5}, {"name": "c\n}, {", "norm": 0.25}]
    document = {"params": rows, "nested": [{"x": [1, {"y": 2}]}, {}], "empty": [], "none": {}}
    text = json_text(document)
    assert json.loads(text) == document
    lines = text.splitlines()
    assert [json.loads(line.strip().rstrip(",")) for line in lines[2:4]] == rows

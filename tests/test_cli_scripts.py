"""The CLI for scripts and for people (issue 13), run as a user runs it.

Every run is a subprocess: the console script or torchrun, from a directory outside the
checkout, with stderr on a pipe, or on a pseudo-terminal where a progress bar is expected
(forked from tests/_cli.py's server where the environment allows; the runs without numpy, and
those on a terminal, are fresh interpreters). The
JSON lists every parameter, finding and mismatch; torchrun runs ``-m gradstat`` from anywhere;
under torchrun an error is said once and ``--status-file`` keeps gradstat's exit status;
``clip`` creates missing parents; a Python without numpy starts clean; all-zero gradients are
a finding; progress bars appear on a terminal only, on process 0 only.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from rich.filesize import decimal

from gradstat.snapshot import save_rank
from tests._cli import DOCUMENTS, ROOT, SAMPLE_DATA, run_gradstat
from tests._oracle import float64_norm
from tests._params import param_with

SAMPLE = SAMPLE_DATA / "tp2-pp2-dp2-ep2-distopt"
NAN_SAMPLE = SAMPLE_DATA / "tp2-pp2-dp2-ep2-distopt-nan"
BIN = Path(sys.executable).parent
GRADSTAT, TORCHRUN = str(BIN / "gradstat"), str(BIN / "torchrun")
# The launcher's banner about OMP_NUM_THREADS is torch's, not gradstat's: set it, no banner.
ENV = {**os.environ, "OMP_NUM_THREADS": "1"}
NUMPY_WARNING = "Failed to initialize NumPy"
PARAMS = 25  # more than the table's 20


def _run(
    command: list[str], cwd: Path, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        command, cwd=cwd, env=env or ENV, capture_output=True, text=True, timeout=300, check=False
    )


def _gradstat(*args: str | Path, cwd: Path) -> subprocess.CompletedProcess[str]:
    return run_gradstat(*args, script=True, cwd=cwd, env={"OMP_NUM_THREADS": "1"})


def _torchrun(
    *args: str | Path, processes: int, cwd: Path, launcher: list[str] | None = None
) -> subprocess.CompletedProcess[str]:
    """``torchrun --standalone --nproc-per-node N -m gradstat ARGS``, as the README says."""
    return run_gradstat(
        *args, nproc=processes, launcher=launcher or [], cwd=cwd, env={"OMP_NUM_THREADS": "1"}
    )


def _error_lines(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if line.startswith("gradstat: error:")]


def _write_snapshot(directory: Path, grads: dict[str, list[torch.Tensor]], tp: int = 1) -> Path:
    """A snapshot of replicated parameters: ``grads[name][r]`` is TP rank r's copy."""
    for rank in range(tp):
        params = [(name, param_with(copies[rank])) for name, copies in grads.items()]
        save_rank(directory, params, rank=rank, world_size=tp, coords={"tp": [rank, tp]})
    return directory


def _many() -> dict[str, torch.Tensor]:
    """PARAMS parameters of distinct norms (parameter i holds i + 1 in every element)."""
    return {f"layer{index:02d}.weight": torch.full((4,), index + 1.0) for index in range(PARAMS)}


# ---------------------------------------------------------------------------------------------
# The JSON carries every parameter, finding and mismatch; --top limits the table
# ---------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def many(tmp_path_factory: pytest.TempPathFactory) -> Path:
    directory = tmp_path_factory.mktemp("many") / "snapshot"
    return _write_snapshot(directory, {name: [grad] for name, grad in _many().items()})


def test_norm_json_lists_every_parameter_and_the_table_twenty(many: Path, tmp_path: Path) -> None:
    result = _gradstat("norm", many, "--json", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    grads = _many()
    assert [row["name"] for row in report["params"]] == sorted(grads, reverse=True)
    for row in report["params"]:
        assert row["norm"] == pytest.approx(float64_norm([grads[row["name"]]], 2), rel=1e-12)
    assert report["params_left_out"] == 0
    table = _gradstat("norm", many, cwd=tmp_path)
    assert table.returncode == 0, table.stderr
    assert f"parameters by contribution (20 of {PARAMS} shown)" in table.stdout
    shown = re.findall(r"layer\d\d\.weight", table.stdout)
    assert shown == sorted(grads, reverse=True)[:20]


def test_norm_json_with_top_says_how_many_were_left_out(many: Path, tmp_path: Path) -> None:
    result = _gradstat("norm", many, "--json", "--top", "7", cwd=tmp_path)
    report = json.loads(result.stdout)
    assert [row["name"] for row in report["params"]] == sorted(_many(), reverse=True)[:7]
    assert report["params_left_out"] == PARAMS - 7
    table = _gradstat("norm", many, "--top", "30", cwd=tmp_path)
    assert f"({PARAMS} of {PARAMS} shown)" in table.stdout


def test_compare_and_audit_json_list_every_mismatch_and_finding(tmp_path: Path) -> None:
    """Every one of 25 parameters differs: 25 mismatches, and 25 TP copies that differ."""
    grads = _many()
    a = _write_snapshot(tmp_path / "a", {name: [grad, grad] for name, grad in grads.items()}, tp=2)
    b = _write_snapshot(
        tmp_path / "b", {name: [grad * 2, grad * 2] for name, grad in grads.items()}, tp=2
    )
    compared = _gradstat("compare", a, b, "--json", cwd=tmp_path)
    assert compared.returncode == 1, compared.stderr
    report = json.loads(compared.stdout)
    assert sorted(report["mismatches"]) == sorted(grads)
    assert len(report["params"]) == PARAMS
    odd = _write_snapshot(
        tmp_path / "odd", {name: [grad, grad + 1] for name, grad in grads.items()}, tp=2
    )
    audited = _gradstat("audit", odd, "--json", cwd=tmp_path)
    assert audited.returncode == 1, audited.stderr
    findings = json.loads(audited.stdout)["findings"]
    assert sorted(finding["name"] for finding in findings) == sorted(grads)
    assert {finding["kind"] for finding in findings} == {"tp_replicas_differ"}


# ---------------------------------------------------------------------------------------------
# torchrun from any directory
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("processes", [2, 3])
@pytest.mark.multiprocess
@pytest.mark.slow
def test_torchrun_module_form_works_from_another_directory(tmp_path: Path, processes: int) -> None:
    alone = _gradstat("norm", SAMPLE, "--json", cwd=tmp_path)
    launched = _torchrun("norm", SAMPLE, "--json", processes=processes, cwd=tmp_path)
    assert launched.returncode == 0, launched.stderr
    assert launched.stdout == alone.stdout
    assert json.loads(launched.stdout)["total_norm"] == pytest.approx(5.4156357, rel=1e-7)


@pytest.mark.multiprocess
@pytest.mark.slow
def test_the_script_form_fails_outside_the_checkout(tmp_path: Path) -> None:
    """Why the README says ``-m gradstat``: torchrun takes a bare name for a script path."""
    start = [TORCHRUN, "--standalone", "--nproc-per-node=2", "gradstat", "norm", str(SAMPLE)]
    result = _run(start, tmp_path)
    assert result.returncode != 0
    assert "can't open file" in result.stderr and "gradstat" in result.stderr


def test_help_gives_the_torchrun_command(tmp_path: Path) -> None:
    result = _gradstat("--help", cwd=tmp_path)
    assert result.returncode == 0
    text = " ".join(result.stdout.replace("│", " ").split())
    assert "torchrun --standalone --nproc-per-node N -m gradstat norm SNAPSHOT" in text
    assert "--status-file PATH" in text


# ---------------------------------------------------------------------------------------------
# Under torchrun: one error line, and the exit status kept in --status-file
# ---------------------------------------------------------------------------------------------


def _broken_copy(tmp_path: Path) -> tuple[Path, Path]:
    snapshot = tmp_path / "broken"
    shutil.copytree(SAMPLE_DATA / "gtp2-pp2-dp2-ep2", snapshot)
    victim = snapshot / "rank-00003.safetensors"
    victim.write_bytes(victim.read_bytes()[:100])
    return snapshot, victim


@pytest.mark.parametrize("processes", [2, 3])
@pytest.mark.multiprocess
@pytest.mark.slow
def test_an_error_every_process_meets_is_said_once(tmp_path: Path, processes: int) -> None:
    snapshot, victim = _broken_copy(tmp_path)
    status = tmp_path / "status"
    result = _torchrun(
        "zeros", snapshot, "--status-file", status, processes=processes, cwd=tmp_path
    )
    assert result.returncode == 1  # torchrun's, whatever gradstat's was
    assert "ChildFailedError" in result.stderr  # torchrun's own report, as the README says
    [line] = _error_lines(result.stderr)
    assert line.startswith(f"gradstat: error: {victim}: header length ")
    assert line.endswith(" exceeds the file's 100 bytes (truncated, or not a safetensors file)")
    assert status.read_text() == "2\n"
    assert result.stdout == ""


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["norm", "{sample}", "--bogus"], "no such option: --bogus"),
        (["norm", "{sample}", "-p", "-1"], "--norm-type '-1' is not supported"),
        (["norm", "{missing}"], "{missing}: no such directory"),
        (["clip", "{sample}", "--max-norm", "1", "--out", "{sample}/inside"], "{sample}/inside"),
    ],
    ids=["usage", "norm type", "missing snapshot", "clip into the input"],
)
@pytest.mark.multiprocess
@pytest.mark.slow
def test_errors_before_and_after_joining_are_said_once(
    tmp_path: Path, args: list[str], message: str
) -> None:
    """A usage error and an argument refused before the processes join, and a snapshot that
    is not there, found after: each process meets it, process 0 alone says it."""
    places = {"sample": str(SAMPLE), "missing": str(tmp_path / "missing")}
    status = tmp_path / "status"
    given = [arg.format(**places) for arg in args]
    result = _torchrun(*given, "--status-file", status, processes=2, cwd=tmp_path)
    assert result.returncode == 1
    [line] = _error_lines(result.stderr)
    assert message.format(**places) in line
    assert status.read_text() == "2\n"
    assert not (SAMPLE / "inside").exists()


@pytest.mark.parametrize(
    ("snapshot", "torchrun_status", "gradstat_status"),
    [(SAMPLE, 0, 0), (NAN_SAMPLE, 1, 1)],
    ids=["clean", "nan"],
)
@pytest.mark.multiprocess
@pytest.mark.slow
def test_status_file_keeps_gradstats_status_under_torchrun(
    tmp_path: Path, snapshot: Path, torchrun_status: int, gradstat_status: int
) -> None:
    status = tmp_path / "status"
    status.write_text("stale\n")
    result = _torchrun(
        "norm", snapshot, "--json", "--status-file", status, processes=2, cwd=tmp_path
    )
    assert result.returncode == torchrun_status, result.stderr
    assert status.read_text() == f"{gradstat_status}\n"
    found = [
        (row["rank"], row["nan"], row["inf"]) for row in json.loads(result.stdout)["nonfinite"]
    ]
    assert found == ([] if gradstat_status == 0 else [(5, 1, 0), (6, 0, 1)])


# The run dies halfway (as a killed process would): no status at all, not the last run's.
DIES_WHILE_READING = """
import os, sys
import gradstat.analysis.stats
from gradstat.cli import main

gradstat.analysis.stats.gather_pieces = lambda *args, **kwargs: os._exit(9)
sys.argv = ["gradstat", *sys.argv[1:]]
main()
"""


def test_a_run_that_dies_leaves_no_status_file(tmp_path: Path) -> None:
    status = tmp_path / "status"
    status.write_text("0\n")
    script = tmp_path / "dies.py"
    script.write_text(DIES_WHILE_READING)
    command = [sys.executable, str(script), "norm", str(SAMPLE), "--status-file", str(status)]
    result = _run(command, tmp_path)
    assert result.returncode == 9, result.stderr
    assert not status.exists()
    usage = _gradstat("norm", SAMPLE, "--bogus", "--status-file", status, cwd=tmp_path)
    assert usage.returncode == 2 and status.read_text() == "2\n"


# ---------------------------------------------------------------------------------------------
# clip creates missing parents, still refusing the input and existing paths
# ---------------------------------------------------------------------------------------------


def _files(directory: Path) -> dict[str, bytes]:
    return {path.name: path.read_bytes() for path in sorted(directory.iterdir())}


def test_clip_creates_missing_parents(tmp_path: Path) -> None:
    out = tmp_path / "a" / "b" / "clipped"
    result = _gradstat("clip", SAMPLE, "--max-norm", "1", "--out", out, "--json", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout)["clipped"] is True
    flat = tmp_path / "flat"
    _gradstat("clip", SAMPLE, "--max-norm", "1", "--out", flat, cwd=tmp_path)
    assert _files(out) == _files(flat)
    assert sorted(path.name for path in (tmp_path / "a").iterdir()) == ["b"]
    again = _gradstat("norm", out, "--json", cwd=tmp_path)
    assert json.loads(again.stdout)["total_norm"] == pytest.approx(1.0, rel=1e-6)


@pytest.mark.multiprocess
@pytest.mark.slow
def test_clip_under_torchrun_creates_missing_parents(tmp_path: Path) -> None:
    out = tmp_path / "x" / "y"
    result = _torchrun("clip", SAMPLE, "--max-norm", "1", "--out", out, processes=2, cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert sorted(_files(out)) == sorted(path.name for path in SAMPLE.glob("*.safetensors"))


@pytest.mark.parametrize("where", ["inside the input", "under a file"])
def test_clip_with_missing_parents_still_refuses(tmp_path: Path, where: str) -> None:
    snapshot = tmp_path / "snapshot"
    shutil.copytree(SAMPLE, snapshot)
    before = _files(snapshot)
    (tmp_path / "file").write_text("mine")
    out = snapshot / "new" / "out" if where == "inside the input" else tmp_path / "file" / "out"
    result = _gradstat("clip", snapshot, "--max-norm", "1", "--out", out, cwd=tmp_path)
    assert result.returncode == 2
    [line] = result.stderr.splitlines()
    problem = (
        "the output must not be the input snapshot or inside it"
        if where == "inside the input"
        else f"cannot create it ({tmp_path / 'file'} is not a directory)"
    )
    assert line == f"gradstat: error: {out}: {problem}"
    assert _files(snapshot) == before and (tmp_path / "file").read_text() == "mine"
    assert sorted(path.name for path in tmp_path.iterdir()) == ["file", "snapshot"]


# ---------------------------------------------------------------------------------------------
# A Python without numpy: torch warns at import; gradstat's processes stay clean
# ---------------------------------------------------------------------------------------------


@pytest.fixture
def without_numpy(tmp_path: Path) -> dict[str, str]:
    """An environment where ``import numpy`` fails as it does where numpy is not installed."""
    shim = tmp_path / "shim" / "numpy"
    shim.mkdir(parents=True)
    (shim / "__init__.py").write_text(
        "raise ModuleNotFoundError(\"No module named 'numpy'\", name='numpy')\n"
    )
    return {**ENV, "PYTHONPATH": str(shim.parent)}


def test_without_numpy_torch_warns_but_gradstat_does_not(
    tmp_path: Path, without_numpy: dict[str, str]
) -> None:
    plain = _run([sys.executable, "-c", "import torch"], tmp_path, without_numpy)
    assert NUMPY_WARNING in plain.stderr  # the shim does hide numpy from torch
    for args in (["norm", str(SAMPLE)], ["zeros", str(SAMPLE), "--json"]):
        result = _run([GRADSTAT, *args], tmp_path, without_numpy)
        assert result.returncode == 0 and result.stderr == "", result.stderr
        assert result.stdout


@pytest.mark.multiprocess
@pytest.mark.slow
def test_without_numpy_under_torchrun_only_the_launcher_warns(
    tmp_path: Path, without_numpy: dict[str, str]
) -> None:
    """The launcher is torch's own process; its 2 workers are gradstat's and keep quiet.
    ``python -W 'ignore:Failed to initialize NumPy' -m torch.distributed.run`` quiets it too."""
    start = [TORCHRUN, "--standalone", "--nproc-per-node=2", "-m", "gradstat"]
    result = _run([*start, "norm", str(SAMPLE), "--json"], tmp_path, without_numpy)
    assert result.returncode == 0, result.stderr
    assert result.stderr.count(NUMPY_WARNING) == 1, result.stderr
    quiet = [sys.executable, "-W", f"ignore:{NUMPY_WARNING}", "-m", "torch.distributed.run"]
    result = _run([*quiet, *start[1:], "norm", str(SAMPLE), "--json"], tmp_path, without_numpy)
    assert result.returncode == 0 and result.stderr == "", result.stderr


# ---------------------------------------------------------------------------------------------
# All-zero gradients are a finding
# ---------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def zero(tmp_path_factory: pytest.TempPathFactory) -> Path:
    directory = tmp_path_factory.mktemp("zero") / "snapshot"
    grads = {name: [torch.zeros_like(grad)] * 2 for name, grad in _many().items()}
    return _write_snapshot(directory, grads, tp=2)


ALL_ZERO = "every counted gradient is zero: dumped before the backward pass, or after zero_grad?"


@pytest.mark.parametrize("command", ["norm", "zeros", "clip"])
def test_all_zero_gradients_are_said_plainly_and_exit_1(
    zero: Path, tmp_path: Path, command: str
) -> None:
    clip = ["--max-norm", "1", "--out", str(tmp_path / "out")] if command == "clip" else []
    result = _gradstat(command, zero, *clip, cwd=tmp_path)
    assert result.returncode == 1, result.stderr
    assert ALL_ZERO in " ".join(result.stdout.split())
    shutil.rmtree(tmp_path / "out", ignore_errors=True)
    result = _gradstat(command, zero, *clip, "--json", cwd=tmp_path)
    assert result.returncode == 1, result.stderr
    report = json.loads(result.stdout)
    assert report["all_zero"] is True
    if command == "zeros":
        assert report["num_zeros"] == report["num_elements"] == PARAMS * 4
    else:
        assert report["total_norm"] == 0.0
    if command == "clip":
        assert _files(tmp_path / "out") == _files(zero)  # written, unchanged


@pytest.mark.parametrize("command", ["norm", "zeros"])
def test_one_tiny_gradient_is_not_all_zero(tmp_path: Path, command: str) -> None:
    """The negative control: one element of 1e-30 (its square underflows fp32)."""
    grads = {name: torch.zeros_like(grad) for name, grad in _many().items()}
    grads["layer07.weight"][2] = 1e-30
    snapshot = _write_snapshot(tmp_path / "snapshot", {name: [g] for name, g in grads.items()})
    result = _gradstat(command, snapshot, "--json", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    assert report["all_zero"] is False
    if command == "norm":
        assert report["total_norm"] == pytest.approx(float64_norm([grads["layer07.weight"]], 2))
    else:
        assert report["num_zeros"] == PARAMS * 4 - 1
    assert json.loads(_gradstat("norm", SAMPLE, "--json", cwd=tmp_path).stdout)["all_zero"] is False


@pytest.mark.multiprocess
@pytest.mark.slow
def test_all_zero_under_torchrun_keeps_status_1(zero: Path, tmp_path: Path) -> None:
    status = tmp_path / "status"
    result = _torchrun("norm", zero, "--json", "--status-file", status, processes=2, cwd=tmp_path)
    assert result.returncode == 1
    assert json.loads(result.stdout)["all_zero"] is True and status.read_text() == "1\n"


# ---------------------------------------------------------------------------------------------
# Progress bars: on a terminal, process 0 only, never in JSON mode or on a pipe
# ---------------------------------------------------------------------------------------------


def _on_a_terminal(command: list[str], cwd: Path) -> tuple[int, str, str]:
    """Run ``command`` with stderr on a pseudo-terminal; its status, stdout and the terminal."""
    master, terminal = os.openpty()
    with (cwd / "stdout").open("w+") as stdout:
        process = subprocess.Popen(command, cwd=cwd, env=ENV, stdout=stdout, stderr=terminal)
        os.close(terminal)
        drawn = bytearray()
        while True:
            try:
                chunk = os.read(master, 1 << 16)
            except OSError:  # EIO: every end of the terminal is closed
                break
            if not chunk:
                break
            drawn += chunk
        os.close(master)
        status = process.wait(timeout=300)
        stdout.seek(0)
        return status, stdout.read(), drawn.decode()


def _plain(text: str) -> str:
    """``text`` without colours and cursor moves."""
    return re.sub(r"\x1b\[[0-9;?]*[A-Za-z]", "", text)


def _frames(drawn: str) -> list[str]:
    """The lines the terminal was given, colours, cursor moves and the bars themselves (box
    drawing characters) taken out."""
    plain = re.sub("[\u2500-\u257f]", "", _plain(drawn))
    return [" ".join(line.split()) for line in re.split(r"[\r\n]+", plain) if line.strip()]


def _size(*snapshots: Path) -> str:
    return decimal(sum(path.stat().st_size for s in snapshots for path in s.glob("*.safetensors")))


def test_progress_bar_on_a_terminal(tmp_path: Path) -> None:
    status, stdout, drawn = _on_a_terminal([GRADSTAT, "norm", str(SAMPLE)], tmp_path)
    assert status == 0
    frames = _frames(drawn)
    size = _size(SAMPLE)
    assert any(f"reading rank files 0/8 rank files 0 bytes of {size}" in f for f in frames), frames
    assert any(f"8/8 rank files {size} of {size}" in frame for frame in frames), frames
    assert "total L2 norm 5.41563" in stdout and "\x1b" not in stdout


@pytest.mark.parametrize(
    ("args", "stages"),
    [
        (["zeros", "{sample}"], ["reading rank files 8/8 rank files"]),
        (
            ["clip", "{sample}", "--max-norm", "1", "--out", "{out}"],
            ["reading rank files 8/8 rank files", "writing 8/8 rank files"],
        ),
        (
            ["compare", "{sample}", "{nan}"],
            ["reading A 8/8 rank files", "reading B 8/8 rank files", "comparing 33/33 parameters"],
        ),
        (["audit", "{sample}"], ["reading rank files 8/8 rank files", "checking "]),
    ],
    ids=["zeros", "clip", "compare", "audit"],
)
def test_every_command_that_reads_data_shows_its_stages(
    tmp_path: Path, args: list[str], stages: list[str]
) -> None:
    places = {"sample": str(SAMPLE), "nan": str(NAN_SAMPLE), "out": str(tmp_path / "out")}
    command = [GRADSTAT, *(arg.format(**places) for arg in args)]
    _, _, drawn = _on_a_terminal(command, tmp_path)
    frames = _frames(drawn)
    for stage in stages:
        assert any(stage in frame for frame in frames), (stage, frames)


def test_no_progress_bar_in_json_mode_or_on_a_pipe(tmp_path: Path) -> None:
    status, stdout, drawn = _on_a_terminal([GRADSTAT, "norm", str(SAMPLE), "--json"], tmp_path)
    assert status == 0 and drawn == "" and json.loads(stdout)["total_norm"]
    piped = _gradstat("norm", SAMPLE, cwd=tmp_path)
    assert piped.returncode == 0 and piped.stderr == ""


@pytest.mark.multiprocess
@pytest.mark.slow
def test_under_torchrun_process_0_alone_draws_everyones_progress(tmp_path: Path) -> None:
    """Each process's stderr goes to its own log file, which rich is told is a terminal
    (TTY_COMPATIBLE, TTY_INTERACTIVE); process 0 counts the 8 rank files of both processes."""
    logs = tmp_path / "logs"
    env = {**ENV, "TTY_COMPATIBLE": "1", "TTY_INTERACTIVE": "1"}
    start = [TORCHRUN, "--standalone", "--nproc-per-node=2", "-r", "2", "--log-dir", str(logs)]
    result = _run([*start, "-m", "gradstat", "norm", str(SAMPLE)], tmp_path, env)
    assert result.returncode == 0, result.stderr
    [first] = logs.glob("*/attempt_0/0/stderr.log")
    [second] = logs.glob("*/attempt_0/1/stderr.log")
    size = _size(SAMPLE)
    assert any(f"8/8 rank files {size} of {size}" in frame for frame in _frames(first.read_text()))
    assert second.read_text() == ""
    assert "total L2 norm 5.41563" in _plain(result.stdout)  # rich colours it there too


# ---------------------------------------------------------------------------------------------
# The README's CLI examples are what the CLI prints
# ---------------------------------------------------------------------------------------------


def _readme_examples() -> list[tuple[str, list[str]]]:
    """Each ``$ gradstat ...`` block of the README and docs/: its command and the lines shown."""
    examples = []
    for document in DOCUMENTS:
        for block in re.findall(r"```\n(\$ gradstat .*?)```", document.read_text(), re.S):
            command, *lines = block.rstrip("\n").split("\n")
            examples.append((command.removeprefix("$ "), lines))
    return examples


@pytest.mark.parametrize(
    ("command", "lines"), _readme_examples(), ids=[command for command, _ in _readme_examples()]
)
def test_readme_examples_are_what_the_cli_prints(command: str, lines: list[str]) -> None:
    """Lines elided with ``...`` are skipped; what is shown appears in order."""
    result = _gradstat(*command.split()[1:], cwd=ROOT)
    printed = result.stdout.split("\n")
    position = 0
    for part in ("\n" + "\n".join(lines) + "\n").split("\n...\n"):
        if not part.strip("\n"):
            continue
        shown = part.strip("\n").split("\n")
        while printed[position : position + len(shown)] != shown:
            position += 1
            assert position < len(printed), (shown, result.stdout)
        position += len(shown)

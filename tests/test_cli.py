"""The CLI end to end: numbers against the float64 statistics of the unsharded gradients."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from gradstat.cli import app
from tests import _cli
from tests._cli import SAMPLE_DATA, run_gradstat
from tests._jobs import Job, dump_layout, full_grads, model_specs
from tests._oracle import float64_norm, rel_err, zeros_in

LAYOUT = Job("tp2_pp2_ep2_gtp2_moe", tp=2, pp=2, gtp=2, ep=2, moe=True, align=8)


@pytest.fixture(scope="module")
def snapshot_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    directory = tmp_path_factory.mktemp("snapshot")
    dump_layout(LAYOUT, directory)
    return directory


def _grads() -> dict[str, Any]:
    grads = full_grads(LAYOUT.moe)
    return {spec.name: grads[spec.name] for spec in model_specs(LAYOUT.moe)}


def _json(*args: str) -> tuple[int, dict[str, Any]]:
    result = CliRunner().invoke(app, [*args, "--json"])
    return result.exit_code, json.loads(result.stdout)


@pytest.mark.parametrize("norm_type", ["2", "1", "3", "inf"])
def test_norm_json_equals_float64(snapshot_dir: Path, norm_type: str) -> None:
    code, report = _json("norm", str(snapshot_dir), "--norm-type", norm_type, "--top", "1000")
    assert code == 0
    p = math.inf if norm_type == "inf" else float(norm_type)
    grads = _grads()
    expected = float64_norm(list(grads.values()), p)
    if p == math.inf:
        assert report["norm_type"] == "inf" and report["total_norm"] == expected
    else:
        assert report["norm_type"] == p
        assert rel_err(report["total_norm"], expected) <= 1e-6
    rows = {row["name"]: row for row in report["params"]}
    assert sorted(rows) == sorted(grads)
    for name, grad in grads.items():
        assert math.isclose(rows[name]["norm"], float64_norm([grad], p), rel_tol=1e-6)
    experts = [grad for name, grad in grads.items() if "experts" in name]
    assert math.isclose(report["expert_norm"], float64_norm(experts, p), rel_tol=1e-6)
    if p != math.inf:
        assert math.isclose(sum(row["share"] for row in rows.values()), 1.0, rel_tol=1e-9)
    assert report["nonfinite"] == []


def test_norm_clip_coefficient_and_top(snapshot_dir: Path) -> None:
    code, report = _json("norm", str(snapshot_dir), "--max-norm", "0.5", "--top", "3")
    assert code == 0
    expected = float64_norm(list(_grads().values()), 2)
    assert math.isclose(report["clip_coeff"], 0.5 / (expected + 1e-6), rel_tol=1e-6)
    norms = [row["norm"] for row in report["params"]]
    assert len(norms) == 3 and norms == sorted(norms, reverse=True)


def test_zeros_json_equals_exact_count(snapshot_dir: Path) -> None:
    code, report = _json("zeros", str(snapshot_dir))
    assert code == 0
    grads = _grads()
    assert report["num_zeros"] == zeros_in(grads.values())
    assert report["num_elements"] == sum(grad.numel() for grad in grads.values())
    assert report["padding_excluded"] > 0
    rows = {row["name"]: row for row in report["params"]}
    for name, grad in grads.items():
        assert rows[name]["num_zeros"] == zeros_in([grad]), name
        assert rows[name]["num_elements"] == grad.numel(), name


def test_inspect_json(snapshot_dir: Path) -> None:
    code, report = _json("inspect", str(snapshot_dir))
    assert code == 0
    assert report["snapshot"]["world_size"] == LAYOUT.world_size
    assert report["axes"]["tp"] == 2 and report["axes"]["gtp"] == 2 and report["axes"]["ep"] == 2
    assert [row["rank"] for row in report["files"]] == list(range(LAYOUT.world_size))
    rows = {row["name"]: row for row in report["params"]}
    assert rows["output_layer.weight"]["shared"] is True
    assert any(row["gtp_pad_length"] > 0 for row in rows.values())
    assert all(row["expert"] == ("experts" in name) for name, row in rows.items())


@pytest.mark.parametrize("norm_type", ["2", "inf", "1"])
def test_nonfinite_gradients_are_located_and_exit_1(norm_type: str) -> None:
    """Whatever the norm: the inf-norm alone took the NaN from the native pass's max and
    neither located it nor exited 1."""
    nan_snapshot = str(SAMPLE_DATA / "tp2-pp2-dp2-ep2-distopt-nan")
    result = run_gradstat("norm", nan_snapshot, "--norm-type", norm_type, "--json")
    assert result.returncode == 1
    report = json.loads(result.stdout)  # exactly one JSON document on stdout
    assert report["total_norm"] == "nan"
    assert report["nonfinite"] == [
        {
            "rank": 5,
            "name": "decoder.layers.1.self_attention.linear_qkv.weight",
            "nan": 1,
            "inf": 0,
        },
        {
            "rank": 6,
            "name": "decoder.layers.1.mlp.experts.local_experts.1.linear_fc2.weight",
            "nan": 0,
            "inf": 1,
        },
    ]
    assert result.stderr == ""


def test_table_output_names_the_nonfinite_rank() -> None:
    result = run_gradstat("norm", str(SAMPLE_DATA / "tp2-pp2-dp2-ep2-distopt-nan"))
    assert result.returncode == 1
    assert "non-finite gradients" in result.stdout
    assert "decoder.layers.1.self_attention.linear_qkv.weight" in result.stdout


def _one_error_line(result: subprocess.CompletedProcess[str]) -> str:
    """The README's promise for bad input: exit 2, nothing on stdout, one line on stderr."""
    assert result.returncode == 2, result.stderr
    assert result.stdout == ""
    assert result.stderr.endswith("\n") and result.stderr.count("\n") == 1, result.stderr
    return result.stderr.removesuffix("\n")


NORM_TYPES_TOLD = "use 2, 1, inf or a number p > 0"


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["norm", "/nonexistent/snapshot"], "/nonexistent/snapshot: no such directory"),
        (
            ["norm", "SAMPLE", "--norm-type", "0"],
            f"--norm-type '0' is not supported; {NORM_TYPES_TOLD}",
        ),
        (
            ["norm", "SAMPLE", "--norm-type", "two"],
            f"--norm-type 'two' is not supported; {NORM_TYPES_TOLD}",
        ),
        (["norm", "SAMPLE", "--max-norm", "-1"], "--max-norm must be a positive number, got -1.0"),
        (
            ["zeros", "EMPTY"],
            "EMPTY: no rank files (*.safetensors) in the directory, nor a Megatron wgrads dump "
            "(mp_rank_*.pth)",
        ),
    ],
)
def test_bad_input_is_one_line_and_exit_2(args: list[str], message: str, tmp_path: Path) -> None:
    substitutions = {"SAMPLE": str(SAMPLE_DATA / "gtp2-pp2-dp2-ep2"), "EMPTY": str(tmp_path)}
    result = run_gradstat(*[substitutions.get(arg, arg) for arg in args])
    expected = "gradstat: error: " + message.replace("EMPTY", str(tmp_path))
    assert _one_error_line(result) == expected


def test_unknown_command_is_a_usage_error() -> None:
    assert _one_error_line(run_gradstat("nonsense")) == (
        "gradstat: error: no such command 'nonsense'; see 'python -m gradstat --help'"
    )


def _digest(directory: Path) -> dict[str, bytes]:
    return {path.name: path.read_bytes() for path in sorted(directory.iterdir())}


def test_clip_writes_a_scaled_copy_and_leaves_the_input(snapshot_dir: Path, tmp_path: Path) -> None:
    from safetensors import safe_open

    before = _digest(snapshot_dir)
    out = tmp_path / "clipped"
    code, report = _json("clip", str(snapshot_dir), "--max-norm", "0.25", "--out", str(out))
    assert code == 0
    assert _digest(snapshot_dir) == before
    total = float64_norm(list(_grads().values()), 2)
    coefficient = 0.25 / (total + 1e-6)
    assert math.isclose(report["clip_coeff"], coefficient, rel_tol=1e-6)
    assert report["clipped"] is True
    assert sorted(path.name for path in out.iterdir()) == sorted(before)
    for name in before:
        with (
            safe_open(str(snapshot_dir / name), "pt") as src,
            safe_open(str(out / name), "pt") as dst,
        ):
            assert dst.metadata() == src.metadata()
            for key in src.keys():  # noqa: SIM118
                original, clipped = src.get_tensor(key), dst.get_tensor(key)
                assert clipped.dtype == original.dtype
                expected = original.double() * report["clip_coeff"]
                assert (clipped.double() - expected).abs().max() <= 1e-6 * expected.abs().max()
    code, again = _json("norm", str(out))
    assert math.isclose(again["total_norm"], total * coefficient, rel_tol=1e-6)


def test_clip_below_max_norm_copies_unchanged(snapshot_dir: Path, tmp_path: Path) -> None:
    out = tmp_path / "same"
    out.mkdir()  # an existing empty directory is fine
    code, report = _json("clip", str(snapshot_dir), "--max-norm", "1e9", "--out", str(out))
    assert code == 0 and report["clipped"] is False
    assert _digest(out) == _digest(snapshot_dir)


def test_clip_refuses_nonfinite_unless_asked(tmp_path: Path) -> None:
    source = SAMPLE_DATA / "tp2-pp2-dp2-ep2-distopt-nan"
    out = tmp_path / "out"
    result = run_gradstat("clip", str(source), "--max-norm", "1", "--out", str(out))
    assert _one_error_line(result) == (
        f"gradstat: error: {source}: the 2 norm is nan; refusing to write a clipped copy of "
        "non-finite gradients (gradstat norm locates them; --allow-nonfinite writes it anyway)"
    )
    assert not out.exists() and list(tmp_path.iterdir()) == []
    result = run_gradstat(
        "clip", str(source), "--max-norm", "1", "--out", str(out), "--allow-nonfinite"
    )
    assert result.returncode == 0, result.stderr
    assert _digest(out) == _digest(source)


@pytest.mark.parametrize("where", ["nonempty", "inside", "same"])
def test_clip_refuses_unsafe_outputs(snapshot_dir: Path, tmp_path: Path, where: str) -> None:
    out = {
        "nonempty": tmp_path / "full",
        "inside": snapshot_dir / "nested",
        "same": snapshot_dir,
    }[where]
    if where == "nonempty":
        out.mkdir()
        (out / "keep.txt").write_text("mine")
    before = _digest(snapshot_dir)
    result = run_gradstat("clip", str(snapshot_dir), "--max-norm", "1", "--out", str(out))
    problem = {
        "nonempty": "exists and is not an empty directory; choose a new one",
        "inside": "the output must not be the input snapshot or inside it",
        "same": "the output must not be the input snapshot or inside it",
    }[where]
    assert _one_error_line(result) == f"gradstat: error: {out}: {problem}"
    assert _digest(snapshot_dir) == before
    if where == "nonempty":
        assert _digest(out) == {"keep.txt": b"mine"}


def test_interrupted_clip_leaves_no_output(
    snapshot_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import gradstat.snapshot.reader as reader_module

    calls = []
    real = reader_module.write_container

    def fail_on_third(*args: Any) -> None:
        calls.append(1)
        if len(calls) == 3:
            raise OSError(28, "No space left on device")
        real(*args)

    monkeypatch.setattr(reader_module, "write_container", fail_on_third)
    out = tmp_path / "out"
    result = CliRunner().invoke(
        app, ["clip", str(snapshot_dir), "--max-norm", "0.1", "--out", str(out)]
    )
    assert result.exit_code == 2 and result.stdout == ""
    assert result.stderr == (
        f"gradstat: error: {out}: cannot write the clipped snapshot "
        "([Errno 28] No space left on device)\n"
    )
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize(
    "args",
    [
        ["norm", str(SAMPLE_DATA / "gtp2-pp2-dp2-ep2"), "--json"],
        ["zeros", str(SAMPLE_DATA / "tp2-pp2-dp2-ep2-distopt-nan")],
        ["norm", "/nonexistent"],
        ["nonsense"],
        ["--help"],
    ],
    ids=["json", "table, exit 1", "exit 2", "usage", "help"],
)
def test_a_forked_run_is_what_a_fresh_interpreter_does(
    args: list[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """tests/_cli.py forks the CLI's runs from a process that imported torch: the same exit
    status, stdout and stderr as ``python -m gradstat`` started afresh."""
    assert _cli._ForkServer.serves()
    forked = run_gradstat(*args)
    monkeypatch.setenv("GRADSTAT_TEST_FORK", "0")
    fresh = run_gradstat(*args)
    assert (forked.returncode, forked.stdout, forked.stderr) == (
        fresh.returncode,
        fresh.stdout,
        fresh.stderr,
    )
    assert forked.stdout or forked.stderr


@pytest.mark.parametrize(
    "args",
    [
        ["zeros", str(SAMPLE_DATA / "tp2-pp2-dp2-ep2-distopt-nan"), "--json"],
        ["norm", "/nonexistent"],
        ["nonsense"],
    ],
    ids=["json, exit 1", "exit 2", "usage"],
)
def test_a_forked_console_script_elsewhere_is_what_a_fresh_one_does(
    args: list[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The console script run from another directory with a thread count of its own (as
    tests/test_cli_scripts.py runs it) is forked too, and does what it does started afresh."""
    threads = {"OMP_NUM_THREADS": "1"}
    assert _cli._ForkServer.serves({**os.environ, **threads})
    forked = run_gradstat(*args, script=True, cwd=tmp_path, env=threads)
    monkeypatch.setenv("GRADSTAT_TEST_FORK", "0")
    fresh = run_gradstat(*args, script=True, cwd=tmp_path, env=threads)
    assert (forked.returncode, forked.stdout, forked.stderr) == (
        fresh.returncode,
        fresh.stdout,
        fresh.stderr,
    )
    assert forked.stdout or forked.stderr


def _gradstat_lines(stderr: str) -> list[str]:
    """gradstat's own lines (torchrun's launcher stamps its lines with times and pids)."""
    return [line for line in stderr.splitlines() if line.startswith(("gradstat:", "gradstat["))]


@pytest.mark.multiprocess
@pytest.mark.parametrize(
    "args",
    [
        ["norm", str(SAMPLE_DATA / "tp2-pp2-dp2-ep2-distopt-nan"), "--json"],
        ["zeros", str(SAMPLE_DATA / "gtp2-pp2-dp2-ep2")],
        ["norm", "/nonexistent"],
    ],
    ids=["json, exit 1", "table", "exit 2"],
)
def test_a_forked_torchrun_is_what_a_fresh_one_does(
    args: list[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Under torchrun, the launcher and its workers forked from the server (tests/_cli.py)
    exit, print and say what torchrun's fresh interpreters do."""
    forked = run_gradstat(*args, nproc=2)
    monkeypatch.setenv("GRADSTAT_TEST_FORK", "0")
    fresh = run_gradstat(*args, nproc=2)
    assert (forked.returncode, forked.stdout) == (fresh.returncode, fresh.stdout), forked.stderr
    assert _gradstat_lines(forked.stderr) == _gradstat_lines(fresh.stderr)
    assert forked.stdout or _gradstat_lines(forked.stderr)


# A script that says whether torch was imported before it started (then it was forked), and
# what a fresh interpreter's start would have set: its thread count, directory and sys.path[0].
_SCRIPT = """
import os, sys
started_with = sorted(name for name in ("torch", "gradstat.cli.app") if name in sys.modules)
import torch
print(started_with, torch.get_num_threads(), os.getcwd(), sys.path[0])
"""


def test_a_script_forked_elsewhere_has_a_fresh_starts_directory_and_threads(
    tmp_path: Path,
) -> None:
    """The negative control of the console-script test above: the run was forked, not refused
    and started afresh, in its own directory and with the thread count it asked for."""
    script, elsewhere = tmp_path / "bin" / "script.py", tmp_path / "elsewhere"
    script.parent.mkdir()
    elsewhere.mkdir()
    script.write_text(_SCRIPT)
    environ = {**os.environ, "OMP_NUM_THREADS": "1"}
    forked = _cli._ForkServer.run({"script": str(script)}, [], 60, elsewhere, environ)
    fresh = subprocess.run(
        [sys.executable, str(script)],
        cwd=elsewhere,
        env=environ,
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    tail = f"1 {elsewhere} {script.parent}"
    assert forked.stdout == f"['gradstat.cli.app', 'torch'] {tail}\n", forked.stderr
    assert fresh.stdout == f"[] {tail}\n"


# What python -c sets up, and whether the code is compiled as its own (no future import of the
# server's: an annotation is evaluated).
_CODE = """
import sys
def f(x: int) -> None: ...
print(sys.argv, repr(sys.path[0]), __name__, f.__annotations__["x"], "__file__" in globals())
"""


def test_forked_python_c_is_what_a_fresh_one_does(monkeypatch: pytest.MonkeyPatch) -> None:
    forked = _cli.run_python(_CODE, "a", "b")
    monkeypatch.setenv("GRADSTAT_TEST_FORK", "0")
    fresh = _cli.run_python(_CODE, "a", "b")
    assert forked.stdout == fresh.stdout == "['-c', 'a', 'b'] '' __main__ <class 'int'> False\n"
    assert (forked.returncode, forked.stderr) == (fresh.returncode, fresh.stderr) == (0, "")


# A torchrun worker that says whether torch was imported before it started (then it was forked)
# and what a fresh interpreter's start would have set: its thread count and unbuffered output.
_WORKER = """
import os, sys
started_with = sorted(name for name in ("torch", "gradstat.cli.app") if name in sys.modules)
import torch
print(os.environ["RANK"], started_with, torch.get_num_threads(), sys.stdout.write_through)
"""


@pytest.mark.multiprocess
def test_torchruns_workers_are_forked_with_what_a_fresh_start_sets(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The negative control of the test above: the workers were forked, not refused and started
    afresh (torchrun sets variables of its own in their environment), with torch's thread count
    taken from OMP_NUM_THREADS, as torch takes it when it loads, and python -u's streams."""
    worker = tmp_path / "worker.py"
    worker.write_text(_WORKER)
    lines = sorted(_cli.run_torchrun(2, str(worker)).stdout.splitlines())
    assert lines == [
        "0 ['gradstat.cli.app', 'torch'] 1 True",
        "1 ['gradstat.cli.app', 'torch'] 1 True",
    ]
    monkeypatch.setenv("GRADSTAT_TEST_FORK", "0")
    lines = sorted(_cli.run_torchrun(2, str(worker)).stdout.splitlines())
    assert lines == ["0 [] 1 True", "1 [] 1 True"]

"""History across the snapshots of one run: series against float64, the first jump of each
parameter, incomplete snapshots skipped."""

from __future__ import annotations

import json
import math
import shutil
import subprocess
from pathlib import Path

import pytest
import torch

import gradstat
from gradstat.analysis.history import read_history
from gradstat.cli.render import sparkline
from gradstat.errors import SnapshotError
from tests._cli import SAMPLE_DATA, run_gradstat
from tests._oracle import float64_norm, zeros_in

SPIKE_AT, ZEROED_AT, NAN_AT, STEPS = 5, 8, 10, 11


def _run(root: Path) -> dict[int, dict[str, torch.Tensor]]:
    """A loop dumping every step: the first layer's weight spikes at SPIKE_AT, the second's
    bias goes all zero at ZEROED_AT, the last weight gets a NaN at NAN_AT."""
    torch.manual_seed(1)
    model = torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.ReLU(), torch.nn.Linear(5, 3))
    recorder = gradstat.Recorder(model, root, every=1, keep=100, spike=None)
    inputs = torch.randn(16, 6)
    seen = {}
    for step in range(1, STEPS + 1):
        model.zero_grad()
        model(inputs).square().mean().backward()
        grads = dict(model.named_parameters())
        if step == SPIKE_AT:
            grads["0.weight"].grad.mul_(1000.0)
        if step >= ZEROED_AT:
            grads["2.bias"].grad.zero_()
        if step == NAN_AT:
            grads["2.weight"].grad[0, 0] = math.nan
        recorder.step(step)
        seen[step] = {name: param.grad.clone() for name, param in grads.items()}
    return seen


@pytest.mark.parametrize("source", ["log", "snapshots"])
def test_series_and_first_jumps(tmp_path: Path, source: str) -> None:
    seen = _run(tmp_path)
    # A snapshot left incomplete (hidden) is skipped, not read as a step.
    shutil.copytree(tmp_path / "step-00000003", tmp_path / ".step-00000012.partial")
    history = read_history(tmp_path, source=source)
    assert history.source == source
    assert history.steps == list(range(1, STEPS + 1))
    for index, step in enumerate(history.steps):
        for name, grad in seen[step].items():
            series = history.params[name]
            expected = float64_norm([grad], 2)
            if math.isnan(expected):
                assert math.isnan(series.norms[index])
            else:
                assert math.isclose(series.norms[index], expected, rel_tol=1e-7)
            assert series.zeros[index] == zeros_in([grad])
    jumps = {name: (s.jump_step, s.jump_kind) for name, s in history.params.items()}
    assert jumps["0.weight"] == (SPIKE_AT, "norm")
    assert jumps["2.bias"][0] == ZEROED_AT and jumps["2.bias"][1] in ("zeros", "norm")
    assert jumps["2.weight"] == (NAN_AT, "nonfinite")
    assert jumps["0.bias"] == (None, None)
    document = json.loads(json.dumps(history.to_json(), allow_nan=False))
    assert document["snapshots"][NAN_AT - 1]["total_norm"] == "nan"
    assert [row["step"] for row in document["snapshots"]] == list(range(1, STEPS + 1))
    assert len(document["params"]) == 4
    nan_row = next(row for row in document["params"] if row["name"] == "2.weight")
    assert nan_row["num_nan"][NAN_AT - 1] == 1 and sum(nan_row["num_nan"]) == 1


def test_two_snapshots_of_one_step_are_refused(tmp_path: Path) -> None:
    _run(tmp_path)
    shutil.copytree(tmp_path / "step-00000003", tmp_path / "copy-of-3")
    with pytest.raises(SnapshotError, match="step 3 is also the step of"):
        read_history(tmp_path, source="snapshots")


def test_an_unreadable_snapshot_is_skipped_with_one_line_and_the_others_read(
    tmp_path: Path,
) -> None:
    """One snapshot of a run cut short (a rank file truncated: a full disk, a copy stopped
    midway) used to stop the whole history; the others are read, and the line says which."""
    seen = _run(tmp_path)
    victim = sorted((tmp_path / "step-00000004").glob("rank-*.safetensors"))[0]
    victim.write_bytes(victim.read_bytes()[:100])
    lines: list[str] = []
    history = read_history(tmp_path, source="snapshots", report=lines.append)
    assert history.steps == [step for step in range(1, STEPS + 1) if step != 4]
    for index, step in enumerate(history.steps):
        expected = float64_norm([seen[step]["0.weight"]], 2)
        assert math.isclose(history.params["0.weight"].norms[index], expected, rel_tol=1e-7)
    assert len(lines) == 1 and lines == history.problems
    assert lines[0].startswith(f"{tmp_path / 'step-00000004'}: skipped, unreadable: {victim}")
    result = _gradstat("history", str(tmp_path), "--source", "snapshots", "--json")
    assert result.returncode == 1  # the NaN at step NAN_AT, as without the cut snapshot
    assert json.loads(result.stdout)["problems"] == lines
    assert json.loads(result.stdout)["warnings"] == lines  # as every document's, on stderr
    assert result.stderr == f"gradstat: warning: {lines[0]}\n"
    for step in range(1, STEPS + 1):  # none readable: the first one's error
        if step != 4:
            shutil.rmtree(tmp_path / f"step-{step:08d}")
    with pytest.raises(SnapshotError, match=f"^{victim}"):
        read_history(tmp_path, source="snapshots")


def test_no_snapshots_is_an_error(tmp_path: Path) -> None:
    with pytest.raises(SnapshotError, match="no snapshot directories"):
        read_history(tmp_path)
    with pytest.raises(SnapshotError, match="no telemetry log"):
        read_history(tmp_path, source="log")


def test_one_snapshot_given_for_a_run_names_its_directory(tmp_path: Path) -> None:
    shutil.copytree(SAMPLE_DATA / "tp2-pp2-dp2-ep2-distopt", tmp_path / "step-7")
    with pytest.raises(SnapshotError, match=r"it is one snapshot; pass the directory that holds"):
        read_history(tmp_path / "step-7")


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")
def test_a_run_of_two_kinds_of_tensor_is_refused(tmp_path: Path) -> None:
    """Gradient snapshots beside a checkpoint's weights: a series of their norms would jump
    between kinds, not steps (it read 26.9 then 0.1 as one parameter's history)."""
    import torch.distributed.checkpoint as dcp

    shutil.copytree(SAMPLE_DATA / "tp2-pp2-dp2-ep2-distopt", tmp_path / "step-100")
    weights = {"model.w": torch.ones(4, 3)}
    dcp.save(weights, checkpoint_id=str(tmp_path / "step-200"))
    done = run_gradstat("history", tmp_path)
    assert done.returncode == 2 and done.stdout == ""
    assert done.stderr == (
        f"gradstat: error: {tmp_path / 'step-200'}: holds model weights, "
        f"{tmp_path / 'step-100'} gradients: a history follows one kind of tensor (keep each "
        "kind in a directory of its own; --kind chooses a checkpoint's)\n"
    )


def test_sparkline() -> None:
    assert sparkline([1.0, 2.0, 3.0]) == "▁▅█"
    assert sparkline([1.0, math.nan, 1.0]) == "▁!▁"
    assert sparkline([1.0, 1000.0, 10.0])[1] == "█"  # log scale past two decades
    assert sparkline([]) == ""


def _gradstat(*args: str) -> subprocess.CompletedProcess[str]:
    return run_gradstat(*args)


@pytest.mark.parametrize(
    ("source", "first_line"),
    [
        ("log", f"{STEPS} steps in the log, steps 1 .. {STEPS}, {STEPS} snapshots kept"),
        ("snapshots", f"{STEPS} snapshots, steps 1 .. {STEPS}"),
    ],
)
def test_the_history_command_names_the_step_and_the_parameter(
    tmp_path: Path, source: str, first_line: str
) -> None:
    _run(tmp_path)
    table = _gradstat("history", str(tmp_path), "--source", source)
    assert table.returncode == 1, "a parameter went NaN: findings"
    lines = table.stdout.splitlines()
    assert first_line in lines[0]
    spike_row = next(line for line in lines if "0.weight" in line)
    assert f"norm at {SPIKE_AT}" in spike_row
    assert f"nonfinite at {NAN_AT}" in next(line for line in lines if "2.weight" in line)
    document = json.loads(_gradstat("history", str(tmp_path), "--json", "--source", source).stdout)
    jumps = {row["name"]: row["first_jump"] for row in document["params"]}
    assert jumps["0.weight"]["step"] == SPIKE_AT and jumps["0.weight"]["kind"] == "norm"
    assert jumps["0.weight"]["ratio"] > 100
    assert len(document["snapshots"]) == STEPS


def test_the_history_command_refuses_a_bad_root_in_one_line(tmp_path: Path) -> None:
    result = _gradstat("history", str(tmp_path / "missing"))
    assert result.returncode == 2 and result.stdout == ""
    assert result.stderr.count("\n") == 1 and "no such directory" in result.stderr

"""History of a run resumed after a kill: the killed attempt's snapshots stay listed when the
resume replays their steps; a log a newer gradstat wrote is refused, not misread."""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import pytest
import torch

import gradstat
from gradstat.analysis.history import read_history
from gradstat.errors import SnapshotError
from gradstat.recorder import log as log_module
from gradstat.recorder.log import FORMAT_VERSION, LOG_NAME, read_log
from tests._cli import run_gradstat
from tests._oracle import float64_norm, zeros_in

SPIKE = 1000.0  # the killed attempt's gradients at its snapshot's step
INPUTS = torch.tensor([[0.0, 1.0, 2.0, 3.0]])  # the weight's first column: zeros every step


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Linear(4, 3)


def _attempt(
    model: torch.nn.Module,
    run: Path,
    steps: range,
    snapshot_at: tuple[int, ...] = (),
    spiked_at: int | None = None,
) -> dict[int, list[torch.Tensor]]:
    """One Recorder on ``run`` (a new attempt) recording ``steps``; each step's gradients."""
    recorder = gradstat.Recorder(model, run, steps=list(snapshot_at), spike=None, keep=10)
    seen = {}
    for step in steps:
        model.zero_grad()
        model(INPUTS * 0.1 * step).sum().backward()
        grads = [param.grad for param in model.parameters() if param.grad is not None]
        if step == spiked_at:
            for grad in grads:
                grad.mul_(SPIKE)
        recorder.step(step)
        seen[step] = [grad.clone() for grad in grads]
    return seen


def _close(got: float, expected: float) -> bool:
    return math.isclose(got, expected, rel_tol=1e-7)


def test_a_replay_without_a_trigger_keeps_the_killed_runs_snapshot_listed(
    tmp_path: Path,
) -> None:
    model = _model()
    killed = _attempt(model, tmp_path, range(1, 9), snapshot_at=(6,), spiked_at=6)
    resumed = _attempt(model, tmp_path, range(4, 11))  # replays 4..8, no trigger at 6
    # A hidden snapshot (being written, or a lost rank's) is never listed.
    shutil.copytree(tmp_path / "step-00000006", tmp_path / ".step-00000009.ab12-1.partial")
    history = read_history(tmp_path, report=lambda line: pytest.fail(line))
    assert history.steps == list(range(1, 11))
    # The norms: a replayed step keeps its latest record, the resumed run's.
    assert _close(history.totals[5], float64_norm(resumed[6], 2))
    assert history.triggers[5] == ()
    # The snapshot: the killed attempt's, with the numbers of the step that took it.
    (kept,) = history.snapshots
    assert (kept.path, kept.step, kept.triggers) == (tmp_path / "step-00000006", 6, ("step",))
    assert _close(kept.total_norm, float64_norm(killed[6], 2))
    assert kept.num_zeros == zeros_in(killed[6]) == 3
    assert history.snapshot_rows() == [5]
    assert history.paths[5] == tmp_path / "step-00000006"

    done = run_gradstat("history", tmp_path, "--json")
    assert done.returncode == 0, done.stderr
    (entry,) = json.loads(done.stdout)["snapshots"]
    assert entry["path"] == str(tmp_path / "step-00000006")
    assert (entry["step"], entry["num_zeros"], entry["triggers"]) == (6, 3, ["step"])
    assert _close(entry["total_norm"], float64_norm(killed[6], 2))


def test_each_attempts_snapshot_of_a_replayed_step_is_listed_with_its_own_norm(
    tmp_path: Path,
) -> None:
    model = _model()
    killed = _attempt(model, tmp_path, range(1, 9), snapshot_at=(6,), spiked_at=6)
    resumed = _attempt(model, tmp_path, range(4, 11), snapshot_at=(6,))
    history = read_history(tmp_path)
    names = [(kept.step, kept.path.name) for kept in history.snapshots]
    assert names == [(6, "step-00000006"), (6, "step-00000006.1")]
    first, second = history.snapshots
    assert _close(first.total_norm, float64_norm(killed[6], 2))
    assert _close(second.total_norm, float64_norm(resumed[6], 2))
    assert history.paths[5] == tmp_path / "step-00000006.1", "the latest record's own"
    document = json.loads(json.dumps(history.to_json(), allow_nan=False))
    assert [entry["path"] for entry in document["snapshots"]] == [
        str(tmp_path / "step-00000006"),
        str(tmp_path / "step-00000006.1"),
    ]


def test_a_snapshot_whose_record_the_kill_lost_is_read_for_its_own_numbers(
    tmp_path: Path,
) -> None:
    model = _model()
    killed = _attempt(model, tmp_path, range(1, 9), snapshot_at=(6,), spiked_at=6)
    log = tmp_path / LOG_NAME
    # Killed after the snapshot was renamed complete, before step 6 reached the log.
    ends = {record.step: record.end_offset for _, record in read_log(log, pytest.fail)}
    log.write_bytes(log.read_bytes()[: ends[5]])
    _attempt(model, tmp_path, range(4, 11))
    history = read_history(tmp_path, report=lambda line: pytest.fail(line))
    (kept,) = history.snapshots
    assert (kept.path, kept.step, kept.triggers) == (tmp_path / "step-00000006", 6, ("step",))
    assert _close(kept.total_norm, float64_norm(killed[6], 2))
    assert kept.num_zeros == zeros_in(killed[6])
    # Outside the steps asked for, it is not listed.
    assert read_history(tmp_path, since=7).snapshots == []


# --- the log's format version -----------------------------------------------------------------


def _logged_run(run: Path, version: int, steps: range) -> None:
    with pytest.MonkeyPatch.context() as patched:
        patched.setattr(log_module, "FORMAT_VERSION", version)
        _attempt(_model(), run, steps)


@pytest.mark.parametrize("version", [1, 2])
def test_a_log_of_a_known_version_reads(tmp_path: Path, version: int) -> None:
    _logged_run(tmp_path, version, range(1, 4))
    assert read_history(tmp_path, report=lambda line: pytest.fail(line)).steps == [1, 2, 3]


@pytest.mark.parametrize("resumed", [False, True])
def test_a_log_a_newer_gradstat_wrote_is_refused_in_one_line(tmp_path: Path, resumed: bool) -> None:
    newer = FORMAT_VERSION + 1
    if resumed:  # an older run resumed by a newer gradstat: its attempt is newer
        _logged_run(tmp_path, FORMAT_VERSION, range(1, 4))
    _logged_run(tmp_path, newer, range(4, 7))
    log = tmp_path / LOG_NAME
    with pytest.raises(SnapshotError) as raised:
        read_history(tmp_path)
    message = str(raised.value)
    assert message.startswith(f"{log}: ")
    assert f"format version {newer}" in message
    assert f"up to {FORMAT_VERSION}" in message

    done = run_gradstat("history", tmp_path, "--json")
    assert done.returncode != 0 and done.stdout == ""
    (line,) = done.stderr.strip().splitlines()
    assert str(log) in line and f"format version {newer}" in line
    assert f"up to {FORMAT_VERSION}" in line

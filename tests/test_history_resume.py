"""History of a run resumed after a kill: the killed attempt's snapshots stay listed when the
resume replays their steps; a log a newer gradstat wrote is refused, not misread; attempts of
another norm type are never mixed; damage never puts a value under another parameter's name;
every snapshot listed opens."""

from __future__ import annotations

import json
import math
import shutil
import struct
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
    norm_type: float = 2.0,
    keep: int = 10,
) -> dict[int, list[torch.Tensor]]:
    """One Recorder on ``run`` (a new attempt) recording ``steps``; each step's gradients."""
    recorder = gradstat.Recorder(
        model, run, steps=list(snapshot_at), spike=None, keep=keep, norm_type=norm_type
    )
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
    # Resumed by this gradstat, whose step records name their attempt: both read, every row.
    _logged_run(tmp_path, FORMAT_VERSION, range(4, 7))
    history = read_history(tmp_path, report=lambda line: pytest.fail(line))
    assert history.steps == [1, 2, 3, 4, 5, 6]
    assert all(series.steps == history.steps for series in history.params.values())


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


# --- a run resumed with another norm type --------------------------------------------------


def _two_norm_types(run: Path) -> tuple[dict[int, list[torch.Tensor]], ...]:
    """Attempt 1 records steps 1..3 with the L2 norm (a snapshot at 2), attempt 2 resumes and
    records 4..6 with the max norm (a snapshot at 5)."""
    model = _model()
    first = _attempt(model, run, range(1, 4), snapshot_at=(2,))
    second = _attempt(model, run, range(4, 7), snapshot_at=(5,), norm_type=math.inf)
    return first, second


def test_a_run_resumed_with_another_norm_type_is_read_in_the_latest_attempts(
    tmp_path: Path,
) -> None:
    first, second = _two_norm_types(tmp_path)
    lines: list[str] = []
    history = read_history(tmp_path, report=lines.append)
    assert history.norm_type == math.inf
    assert history.steps == [4, 5, 6]
    for step, total in zip(history.steps, history.totals, strict=True):
        assert _close(total, float64_norm(second[step], math.inf)), step
    (line,) = lines
    assert line.startswith(f"{tmp_path / LOG_NAME}: left out 3 steps (1 .. 3)")
    assert "2 norm" in line and "-p 2" in line
    assert history.problems == lines
    # The L2 attempt's per-parameter rows are left out with its steps.
    assert all(series.steps == [4, 5, 6] for series in history.params.values())
    # Its snapshot is listed with its max norm, read from it, never the L2 norm of its record.
    totals = {kept.path.name: kept.total_norm for kept in history.snapshots}
    assert totals.keys() == {"step-00000002", "step-00000005"}
    assert _close(totals["step-00000002"], float64_norm(first[2], math.inf))
    assert _close(totals["step-00000005"], float64_norm(second[5], math.inf))

    done = run_gradstat("history", tmp_path, "--json")
    assert done.returncode == 0, done.stderr
    document = json.loads(done.stdout)
    assert (document["norm_type"], document["steps"]) == ("inf", [4, 5, 6])
    assert done.stderr.count("\n") == 1 and "left out 3 steps (1 .. 3)" in done.stderr
    by_path = {entry["path"]: entry["total_norm"] for entry in document["snapshots"]}
    for entry in document["snapshots"]:  # what gradstat norm says of each
        norm = run_gradstat("norm", entry["path"], "--json", "--norm-type", "inf")
        assert _close(by_path[entry["path"]], json.loads(norm.stdout)["total_norm"])


def test_a_norm_type_asked_for_reads_the_attempts_that_recorded_it(tmp_path: Path) -> None:
    first, second = _two_norm_types(tmp_path)
    lines: list[str] = []
    history = read_history(tmp_path, 2.0, report=lines.append)
    assert (history.norm_type, history.steps) == (2.0, [1, 2, 3])
    for step, total in zip(history.steps, history.totals, strict=True):
        assert _close(total, float64_norm(first[step], 2)), step
    (line,) = lines
    assert "left out 3 steps (4 .. 6)" in line and "-p inf" in line
    totals = {kept.path.name: kept.total_norm for kept in history.snapshots}
    assert _close(totals["step-00000002"], float64_norm(first[2], 2))
    assert _close(totals["step-00000005"], float64_norm(second[5], 2))
    # A norm type no attempt recorded is refused in one line.
    with pytest.raises(SnapshotError, match=r"logged the 2 and inf norm.*-p 1 needs the snap"):
        read_history(tmp_path, 1.0)


def test_steps_a_later_attempt_replayed_with_another_norm_type_are_left_out(
    tmp_path: Path,
) -> None:
    """Attempt 1 records steps 1..3 with L2; a rollback replays 2..4 with the max norm. The L2
    history showed attempt 1's steps 2 and 3, replaced by the replay, without a word."""
    model = _model()
    first = _attempt(model, tmp_path, range(1, 4))
    _attempt(model, tmp_path, range(2, 5), norm_type=math.inf)
    lines: list[str] = []
    history = read_history(tmp_path, 2.0, report=lines.append)
    assert (history.norm_type, history.steps) == (2.0, [1])
    assert _close(history.totals[0], float64_norm(first[1], 2))
    assert all(series.steps == [1] for series in history.params.values())
    (line,) = lines
    assert "left out 3 steps (2 .. 4)" in line and "-p inf" in line, line


@pytest.mark.parametrize("resumed_by", ["this gradstat", "a version 2 gradstat"])
@pytest.mark.parametrize("damaged", ["payload", "head"])
def test_records_after_a_damaged_start_record_are_left_out_not_given_another_attempts(
    tmp_path: Path, damaged: str, resumed_by: str
) -> None:
    """The second attempt's start record damaged: in its payload (its head still says "start"),
    or in its magic (the bytes may have held any record). Format version 2's step records
    named no attempt, so with its head damaged attempt 2's max norms were read as attempt 1's
    L2 norms (history: steps 1 .. 6 of the L2 norm, without a word of it). Each step record
    now names its attempt: those of an attempt whose start was not read are left out, one
    line; so are the unnamed ones of an older gradstat's resume after this one's."""
    if resumed_by == "this gradstat":
        first, _ = _two_norm_types(tmp_path)
    else:
        model = _model()
        first = _attempt(model, tmp_path, range(1, 4))
        with pytest.MonkeyPatch.context() as patched:
            patched.setattr(log_module, "FORMAT_VERSION", 2)
            _attempt(model, tmp_path, range(4, 7), norm_type=math.inf)
    log = tmp_path / LOG_NAME
    data = bytearray(log.read_bytes())
    second_start = _frames(bytes(data), kind=1)[1]
    data[second_start + (13 + 5 if damaged == "payload" else 0)] ^= 0xFF
    log.write_bytes(bytes(data))
    lines: list[str] = []
    history = read_history(tmp_path, report=lines.append)
    assert (history.norm_type, history.steps) == (2.0, [1, 2, 3])
    for step, total in zip(history.steps, history.totals, strict=True):
        assert _close(total, float64_norm(first[step], 2)), step
    assert all(series.steps == [1, 2, 3] for series in history.params.values())
    skipped, left_out = lines
    assert "skipped" in skipped, skipped
    assert "left out 3 step records (steps 4 .. 6)" in left_out, left_out
    assert "start record" in left_out, left_out


def test_a_first_record_whose_head_is_damaged_is_one_line_not_one_per_step(
    tmp_path: Path,
) -> None:
    """A byte of the log's magic flipped: its kind unreadable, each of the 6 step records after
    it was a line of its own ("a step record before any start record"): thousands on a long
    run. One line names them all, and the refusal says how to read the snapshots alone."""
    model = _model()
    seen = _attempt(model, tmp_path, range(1, 7), snapshot_at=(2, 5))
    log = tmp_path / LOG_NAME
    data = bytearray(log.read_bytes())
    data[2] ^= 0xFF
    log.write_bytes(bytes(data))
    done = run_gradstat("history", tmp_path)
    assert done.returncode == 2 and done.stdout == "", done.stderr
    skipped, left_out, refused = done.stderr.splitlines()
    assert "skipped" in skipped and "offset 0" in skipped, skipped
    assert "left out 6 step records (steps 1 .. 6)" in left_out, left_out
    assert "no start record" in refused and "--source snapshots" in refused, refused
    alone = run_gradstat("history", tmp_path, "--source", "snapshots", "--json")
    assert alone.returncode == 0, alone.stderr
    totals = {entry["step"]: entry["total_norm"] for entry in json.loads(alone.stdout)["snapshots"]}
    assert totals.keys() == {2, 5}
    assert all(_close(totals[step], float64_norm(seen[step], 2)) for step in totals)


def test_a_log_that_is_no_file_is_refused_not_read_as_absent(tmp_path: Path) -> None:
    """A directory in the log's place: history read the snapshots alone, exit 0, the log's
    steps lost without a word."""
    _attempt(_model(), tmp_path, range(1, 4), snapshot_at=(2,))
    log = tmp_path / LOG_NAME
    log.unlink()
    log.mkdir()
    done = run_gradstat("history", tmp_path)
    assert done.returncode == 2 and done.stdout == "", done.stderr
    assert done.stderr == f"gradstat: error: {log}: is a directory, not the telemetry log\n"
    alone = run_gradstat("history", tmp_path, "--source", "snapshots", "--json")
    assert alone.returncode == 0, alone.stderr
    assert [entry["step"] for entry in json.loads(alone.stdout)["snapshots"]] == [2]


# --- damage and the layout of the per-parameter statistics ------------------------------------


def _frames(data: bytes, kind: int) -> list[int]:
    """The offsets of the intact log's frames of ``kind``."""
    found, offset = [], 0
    while offset < len(data):
        _, frame_kind, length = struct.unpack_from("<4sBI", data, offset)
        if frame_kind == kind:
            found.append(offset)
        offset += 13 + length + 4
    return found


def _swapped_module_run(run: Path) -> None:
    """Steps 1..3 of a Linear(4, 3) at ``a``, then ``a`` replaced by a module of as many
    parameters (``enc.weight``, ``enc.bias``) for steps 4..6: a second layout record. Each
    gradient is filled with its step."""
    torch.manual_seed(0)
    holder = torch.nn.ModuleDict({"a": torch.nn.Linear(4, 3)})
    recorder = gradstat.Recorder(holder, run, spike=None)
    for step in range(1, 7):
        if step == 4:
            replacement = torch.nn.Module()
            replacement.enc = torch.nn.Linear(2, 2)
            holder["a"] = replacement
        for param in holder.parameters():
            param.grad = torch.full(param.shape, float(step))
        recorder.step(step)


def _filled_norm(numel: int, step: int) -> float:
    return math.sqrt(numel * float(step) ** 2)


def test_a_damaged_layout_record_leaves_its_steps_rows_unnamed(tmp_path: Path) -> None:
    intact, damaged = tmp_path / "intact", tmp_path / "damaged"
    _swapped_module_run(intact)
    shutil.copytree(intact, damaged)
    log = damaged / LOG_NAME
    data = bytearray(log.read_bytes())
    layouts = _frames(bytes(data), kind=2)
    assert len(layouts) == 2
    data[layouts[1] + 13 + 5] ^= 0xFF  # in the second layout's payload
    log.write_bytes(bytes(data))

    # The negative control: the intact log names the new module's parameters.
    whole = read_history(intact, report=pytest.fail)
    assert whole.params["a.enc.weight"].steps == [4, 5, 6]

    lines: list[str] = []
    history = read_history(damaged, report=lines.append)
    assert history.steps == [1, 2, 3, 4, 5, 6]
    for step, total in zip(history.steps, history.totals, strict=True):  # 15 or 6 elements
        assert _close(total, _filled_norm(15 if step < 4 else 6, step)), step
    assert history.total_zeros[3:] == [None, None, None]
    # Nothing of steps 4..6 under the old module's names.
    assert history.params.keys() == {"a.weight", "a.bias"}
    assert history.params["a.weight"].steps == [1, 2, 3]
    for step, norm in zip([1, 2, 3], history.params["a.weight"].norms, strict=True):
        assert _close(norm, _filled_norm(12, step)), step
    assert len(lines) == 2 and "checksum fails" in lines[0]
    assert "per-parameter statistics of 3 step records (steps 4 .. 6)" in lines[1]
    assert "their totals kept" in lines[1]


def test_bytes_of_unknown_kind_leave_the_rows_after_them_unnamed(tmp_path: Path) -> None:
    """A head that does not read may have been a layout's: the rows after it, up to the next
    layout record, are left out (a resume writes its own layout: its rows are read)."""
    model = _model()
    _attempt(model, tmp_path, range(1, 5))
    log = tmp_path / LOG_NAME
    data = bytearray(log.read_bytes())
    data[_frames(bytes(data), kind=4)[1]] ^= 0xFF  # step 2's magic
    log.write_bytes(bytes(data))
    _attempt(model, tmp_path, range(5, 7))
    lines: list[str] = []
    history = read_history(tmp_path, report=lines.append)
    assert history.steps == [1, 3, 4, 5, 6]
    assert {tuple(series.steps) for series in history.params.values()} == {(1, 5, 6)}
    assert len(lines) == 2 and "steps 3 .. 4" in lines[1]


def test_a_torn_record_and_a_resume_lose_no_rows(tmp_path: Path) -> None:
    model = _model()
    _attempt(model, tmp_path, range(1, 5))
    log = tmp_path / LOG_NAME
    log.write_bytes(log.read_bytes()[:-10])  # killed mid-write of step 4's record
    _attempt(model, tmp_path, range(4, 7))
    lines: list[str] = []
    history = read_history(tmp_path, report=lines.append)
    assert history.steps == [1, 2, 3, 4, 5, 6]
    assert {tuple(series.steps) for series in history.params.values()} == {(1, 2, 3, 4, 5, 6)}
    (line,) = lines
    assert "a torn record" in line


# --- snapshots without a step in the log, and snapshots that do not open ---------------------


def test_a_snapshot_whose_only_record_was_torn_is_listed(tmp_path: Path) -> None:
    seen = _attempt(_model(), tmp_path, range(1, 2), snapshot_at=(1,))
    log = tmp_path / LOG_NAME
    log.write_bytes(log.read_bytes()[:-30])  # killed during step 1's record
    history = read_history(tmp_path, report=lambda line: None)
    assert history.steps == []
    (kept,) = history.snapshots
    assert (kept.path.name, kept.step, kept.triggers) == ("step-00000001", 1, ("step",))
    assert _close(kept.total_norm, float64_norm(seen[1], 2))

    done = run_gradstat("history", tmp_path)
    assert done.returncode == 0, done.stderr
    assert "no step in the log, 1 snapshot kept" in done.stdout
    assert "taken by the flight recorder's triggers: step at 1" in done.stdout
    document = json.loads(run_gradstat("history", tmp_path, "--json").stdout)
    assert document["steps"] == [] and len(document["snapshots"]) == 1


def test_a_range_whose_only_record_was_lost_lists_its_snapshot(tmp_path: Path) -> None:
    seen = _attempt(_model(), tmp_path, range(1, 6), snapshot_at=(3, 5))
    log = tmp_path / LOG_NAME
    ends = {record.step: record.end_offset for _, record in read_log(log, pytest.fail)}
    log.write_bytes(log.read_bytes()[: ends[4]])  # step 5's record lost, its snapshot kept
    history = read_history(tmp_path, since=5, report=pytest.fail)
    assert history.steps == []
    (kept,) = history.snapshots
    assert kept.path.name == "step-00000005"
    assert _close(kept.total_norm, float64_norm(seen[5], 2))
    with pytest.raises(SnapshotError) as raised:
        read_history(tmp_path, since=6)
    assert str(raised.value) == f"{log}: no step recorded from step 6 on"


@pytest.mark.parametrize("damage", ["truncated", "missing"])
def test_a_snapshot_that_does_not_open_is_not_listed(tmp_path: Path, damage: str) -> None:
    _attempt(_model(), tmp_path, range(1, 6), snapshot_at=(3, 5))
    (rank_file,) = (tmp_path / "step-00000003").glob("*.safetensors")
    if damage == "truncated":
        rank_file.write_bytes(rank_file.read_bytes()[:100])
    else:
        rank_file.unlink()
    assert run_gradstat("norm", tmp_path / "step-00000003").returncode == 2
    lines: list[str] = []
    history = read_history(tmp_path, report=lines.append)
    assert [kept.path.name for kept in history.snapshots] == ["step-00000005"]
    assert history.paths[2] is None and history.paths[4] == tmp_path / "step-00000005"
    (line,) = lines
    assert line.startswith(f"{tmp_path / 'step-00000003'}: skipped, unreadable: ")


# --- the text: the triggers of the snapshots kept --------------------------------------------


def test_the_text_names_a_killed_runs_snapshot_a_replay_did_not_take(tmp_path: Path) -> None:
    model = _model()
    _attempt(model, tmp_path, range(1, 9), snapshot_at=(6,), spiked_at=6)
    _attempt(model, tmp_path, range(4, 11))  # replays 6 without a trigger
    done = run_gradstat("history", tmp_path)
    assert done.returncode == 0, done.stderr
    assert "taken by the flight recorder's triggers: step at 6\n" in done.stdout


def test_the_text_leaves_out_a_snapshot_retention_removed(tmp_path: Path) -> None:
    _attempt(_model(), tmp_path, range(1, 8), snapshot_at=(2, 4, 6), keep=2)
    on_disk = sorted(path.name for path in tmp_path.glob("step-*"))
    assert on_disk == ["step-00000004", "step-00000006"]
    done = run_gradstat("history", tmp_path)
    assert done.returncode == 0, done.stderr
    assert "taken by the flight recorder's triggers: step at 4, 6\n" in done.stdout


@pytest.mark.parametrize("source", ["log", "snapshots"])
def test_the_text_counts_a_replayed_steps_snapshots(tmp_path: Path, source: str) -> None:
    model = _model()
    _attempt(model, tmp_path, range(1, 9), snapshot_at=(6,))
    _attempt(model, tmp_path, range(4, 11), snapshot_at=(6, 9))
    done = run_gradstat("history", tmp_path, "--source", source)
    assert done.returncode == 0, done.stderr
    assert "triggers: step at 6 (2 snapshots), 9\n" in done.stdout
    if source == "snapshots":  # each snapshot is a row
        document = json.loads(
            run_gradstat("history", tmp_path, "--source", source, "--json").stdout
        )
        assert document["steps"] == [6, 6, 9]

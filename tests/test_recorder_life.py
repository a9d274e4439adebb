"""The flight recorder in a real job's life (issue 25 items 8-13): a model that changes under it,
a resume into the same directory, retention that keeps the snapshots that matter, ranks on
different steps, arguments checked at construction, and a peer that never arrives.

Norms are held against float64 computed here from the gradients; snapshots are read back with
safetensors (their tensors) and gradstat's reader (their step and triggers)."""

from __future__ import annotations

import contextlib
import io
import json
import math
import time
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from safetensors import safe_open

import gradstat
from gradstat.errors import GradstatError, PeerTimeoutError, SnapshotError
from gradstat.recorder import complete_snapshots
from gradstat.recorder import snapshots as recorder_module
from gradstat.recorder.log import LOG_NAME
from gradstat.testing import Case, launch


def _exact_norm(grads: list[torch.Tensor]) -> float:
    return sum(float(value) ** 2 for g in grads for value in g.double().flatten().tolist()) ** 0.5


def _backward(model: torch.nn.Module, inputs: torch.Tensor) -> None:
    model.zero_grad()
    model(inputs).square().sum().backward()


def _grads(model: torch.nn.Module) -> list[torch.Tensor]:
    return [param.grad for param in model.parameters() if param.grad is not None]


def _saved(snapshot: Path, rank: int = 0) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """A rank file's gradstat header and its tensors."""
    with safe_open(str(snapshot / f"rank-{rank:05d}.safetensors"), "pt") as handle:
        header = json.loads(handle.metadata()["gradstat"])
        tensors = {name: handle.get_tensor(name) for name in handle.keys()}  # noqa: SIM118
    return header, tensors


def _snapshots_in(directory: Path) -> list[Path]:
    """What the directory holds besides the telemetry log."""
    return [path for path in directory.iterdir() if path.name != LOG_NAME]


def _close(a: float, b: float) -> bool:
    return abs(a - b) <= 1e-9 * max(abs(b), 1e-300)


# --- item 8: the parameters as they are at each step -----------------------------------------


def test_a_layer_appended_after_construction_counts_and_is_dumped(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 4))
    recorder = gradstat.Recorder(model, tmp_path, steps=[2], spike=None)
    inputs = torch.randn(3, 4)
    _backward(model, inputs)
    assert _close(recorder.step(1), _exact_norm(_grads(model)))
    model.append(torch.nn.Linear(4, 2))
    _backward(model, inputs)
    norm = recorder.step(2)
    assert _close(norm, _exact_norm(_grads(model)))
    assert len(_grads(model)) == 4
    header, tensors = _saved(recorder.records[-1].snapshot)  # type: ignore[arg-type]
    assert sorted(tensors) == ["0.bias", "0.weight", "1.bias", "1.weight"]
    assert header["step"] == 2


def test_a_replaced_module_no_longer_counts(tmp_path: Path) -> None:
    torch.manual_seed(1)
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Tanh(), torch.nn.Linear(4, 3))
    recorder = gradstat.Recorder(model, tmp_path, spike=None)
    inputs = torch.randn(5, 4)
    _backward(model, inputs)
    recorder.step(1)
    old = model[2]
    model[2] = torch.nn.Linear(4, 3)
    old.weight.grad = torch.full_like(old.weight, 100.0)  # gradients left on the old module
    _backward(model, inputs)
    assert old.weight.grad is not None
    assert _close(recorder.step(2), _exact_norm(_grads(model)))


def test_frozen_and_unfrozen_parameters_count_as_total_norm_counts_them(tmp_path: Path) -> None:
    torch.manual_seed(2)
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 4))
    recorder = gradstat.Recorder(model, tmp_path, spike=None)
    inputs = torch.randn(5, 4)
    for step, frozen in enumerate((False, True, False), start=1):
        for param in model[0].parameters():
            param.requires_grad_(not frozen)
        model.zero_grad(set_to_none=True)
        model(inputs).square().sum().backward()
        grads = _grads(model)
        assert len(grads) == (2 if frozen else 4)
        assert _close(recorder.step(step), _exact_norm(grads)), step


def test_per_parameter_statistics_follow_a_parameter_given_another_shape(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """``param.data`` of another shape: the step that meets it skips its per-parameter rows, as
    its warning says, and the next steps have them again (they stopped until something else
    changed the parameter list)."""
    torch.manual_seed(3)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 3))
    recorder = gradstat.Recorder(model, tmp_path, spike=None)
    inputs = torch.randn(5, 4)

    def rows(step: int) -> dict[str, float | None] | None:
        model.zero_grad(set_to_none=True)
        model(inputs).square().sum().backward()
        recorder.step(step)
        found = recorder.params
        return None if found is None else dict(zip(found.layout.names, found.norms, strict=True))

    assert rows(1) is not None
    model[0].weight.data, model[0].bias.data = torch.randn(6, 4), torch.randn(6)
    model[1].weight.data = torch.randn(3, 6)
    assert rows(2) is None
    assert "shape [6, 4] changed" in caplog.text
    for step in (3, 4):
        got = rows(step)
        assert got is not None, step
        for name, param in model.named_parameters():
            norm = got[name]
            assert norm is not None and _close(norm, _exact_norm([param.grad])), (step, name)


def test_pairs_a_tensor_that_requires_grad_stands_for_its_gradient(tmp_path: Path) -> None:
    weights = torch.tensor([3.0, 4.0], requires_grad=True)
    (weights * weights).sum().backward()  # gradient [6, 8]: norm 10, the weights' 5
    recorder = gradstat.Recorder([("w", weights)], tmp_path, spike=None)
    assert _close(recorder.step(1), 10.0)


def test_pairs_a_plain_tensor_is_the_gradient_and_is_dumped(tmp_path: Path) -> None:
    gradient = torch.tensor([[1.0, -2.0], [0.5, 0.25]])
    recorder = gradstat.Recorder([("g", gradient)], tmp_path, steps=[3], spike=None)
    assert _close(recorder.step(3), _exact_norm([gradient]))
    (snapshot,) = [path for _, path in complete_snapshots(tmp_path)]
    assert recorder.records[-1].snapshot == snapshot
    _, tensors = _saved(snapshot)
    assert torch.equal(tensors["g"], gradient)


# --- item 9: resume into the same directory ----------------------------------------------------


def _leftovers_of_a_killed_run(directory: Path) -> None:
    """What a run killed while dumping step 5 leaves: the old-style partial with its rank 1
    file and a torn temporary file, and a partial of another attempt."""
    old = directory / ".step-00000005.partial"
    old.mkdir(parents=True)
    (old / "rank-00001.safetensors").write_bytes(b"killed run's rank 1")
    (old / ".rank-00000.safetensors.1a2b3c").write_bytes(b"\0" * 4096)
    other = directory / ".step-00000010.00ab12cd34-3.partial"
    other.mkdir()
    (other / "rank-00000.safetensors").write_bytes(b"another attempt")


def test_a_resume_never_completes_a_killed_runs_partial_snapshot(
    tmp_path: Path, recorder_warnings: Callable[[], list[str]]
) -> None:
    _leftovers_of_a_killed_run(tmp_path)
    model = torch.nn.Linear(3, 2)
    recorder = gradstat.Recorder(model, tmp_path, steps=[5], spike=None)
    _backward(model, torch.ones(2, 3))
    recorder.step(5)
    (snapshot,) = [path for _, path in complete_snapshots(tmp_path)]
    assert sorted(path.name for path in snapshot.iterdir()) == [
        ".recorder.json",
        "rank-00000.safetensors",
    ]
    assert not [path for path in tmp_path.iterdir() if path.name.startswith(".")]
    (line,) = recorder_warnings()
    assert "removed 2 incomplete snapshot(s) of an earlier run" in line


def test_a_replayed_step_keeps_both_snapshots_and_each_record_points_at_its_own(
    tmp_path: Path, recorder_warnings: Callable[[], list[str]]
) -> None:
    model = torch.nn.Linear(3, 2)
    first = gradstat.Recorder(model, tmp_path, steps=[5], spike=None)
    snapshots = []
    for scale in (1.0, 2.0, 3.0):  # twice in one recorder, then in a resumed one
        if scale == 3.0:
            recorder = gradstat.Recorder(model, tmp_path, steps=[5], spike=None)
        else:
            recorder = first
        _backward(model, scale * torch.ones(2, 3))
        norm = recorder.step(5)
        snapshot = recorder.records[-1].snapshot
        assert snapshot is not None
        _, tensors = _saved(snapshot)
        assert _close(norm, _exact_norm(list(tensors.values())))
        assert _close(norm, _exact_norm(_grads(model)))
        snapshots.append(snapshot.name)
    assert snapshots == ["step-00000005", "step-00000005.1", "step-00000005.2"]
    assert [path.name for _, path in complete_snapshots(tmp_path)] == snapshots
    assert recorder_warnings() == []


def test_history_reads_a_replayed_steps_snapshots_in_the_order_written(tmp_path: Path) -> None:
    from gradstat.analysis.history import read_history

    model = torch.nn.Linear(3, 2)
    expected = []
    for scale in (1.0, 2.0, 3.0):  # step 6 once in a run, twice in its resumes
        recorder = gradstat.Recorder(model, tmp_path, steps=[5, 6], keep=10, spike=None)
        for step in (5, 6) if scale == 1.0 else (6,):
            _backward(model, scale * torch.ones(2, 3))
            recorder.step(step)
            expected.append((step, _exact_norm(_grads(model))))
    history = read_history(tmp_path, source="snapshots")
    assert [path.name for path in history.paths if path is not None] == [
        "step-00000005",
        "step-00000006",
        "step-00000006.1",
        "step-00000006.2",
    ]
    assert history.steps == [5, 6, 6, 6]
    for total, (_, norm) in zip(history.totals, sorted(expected, key=lambda e: e[0]), strict=True):
        assert math.isclose(total, norm, rel_tol=1e-7)
    # The log keeps a replayed step's latest record, linked to the snapshot that record took.
    logged = read_history(tmp_path)
    assert logged.steps == [5, 6]
    assert [path.name for path in logged.paths if path] == ["step-00000005", "step-00000006.2"]
    assert math.isclose(logged.totals[1], expected[-1][1], rel_tol=1e-12)


def test_every_failure_on_the_writer_thread_is_one_warning_line(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    recorder_warnings: Callable[[], list[str]],
) -> None:
    def broken(*args: Any, **kwargs: Any) -> Path:
        raise RuntimeError("an unexpected failure inside the dump")

    monkeypatch.setattr(recorder_module, "dump_rank", broken)
    model = torch.nn.Linear(3, 2)
    recorder = gradstat.Recorder(model, tmp_path, steps=[1], spike=None)
    _backward(model, torch.ones(2, 3))
    recorder.step(1)
    assert "Traceback" not in capsys.readouterr().err
    (line,) = recorder_warnings()
    assert "step 1: rank 0 could not dump (an unexpected failure inside the dump)" in line


# --- item 10: retention keeps what the recorder exists for ------------------------------------


def test_routine_snapshots_never_push_out_the_spike_and_the_nan(tmp_path: Path) -> None:
    torch.manual_seed(3)
    model = torch.nn.Linear(4, 3)
    recorder = gradstat.Recorder(model, tmp_path, every=5, keep=3, spike=10.0)
    inputs = torch.randn(6, 4)
    for step in range(1, 31):
        _backward(model, inputs)
        if step == 9:
            model.weight.grad.mul_(1000.0)
        if step == 17:
            model.bias.grad[0] = math.nan
        recorder.step(step)
    fired = {record.step: record.triggers for record in recorder.records if record.triggers}
    assert fired[9] == ("spike",) and fired[17] == ("nonfinite",)
    assert [step for step, _ in complete_snapshots(tmp_path)] == [9, 17, 20, 25, 30]


def test_a_run_of_mismatches_never_pushes_out_the_nan(tmp_path: Path) -> None:
    """Triggered snapshots were one kind: with keep=2, mismatches at steps 6, 8 and 10 (a loop
    that logs another norm) left steps 7 and 9, and the NaN of step 3 was gone. Each trigger
    now keeps its own; a spike-and-mismatch snapshot stays while either keeps it."""
    model = torch.nn.Linear(2, 2)
    recorder = gradstat.Recorder(model, tmp_path, keep=2, spike=10.0, warmup=1)
    for step in range(1, 11):
        _backward(model, torch.ones(1, 2))
        if step == 3:
            model.bias.grad[0] = math.nan
        if step == 4:
            model.weight.grad.mul_(1000.0)  # a spike, logged wrong too
        exact = gradstat.total_norm(model.parameters())
        logged = exact * 2.0 if step in (4, 6, 8, 10) else exact
        recorder.step(step, logged_norm=logged)
    recorder.wait()
    fired = {record.step: record.triggers for record in recorder.records if record.triggers}
    assert fired == {
        3: ("nonfinite",),
        4: ("spike", "mismatch"),
        6: ("mismatch",),
        8: ("mismatch",),
        10: ("mismatch",),
    }, fired
    # nonfinite keeps 3; spike keeps 4 (mismatch keeps 8 and 10 only)
    assert [step for step, _ in complete_snapshots(tmp_path)] == [3, 4, 8, 10]


def test_after_a_resume_the_new_snapshots_are_kept_over_the_old_runs_larger_steps(
    tmp_path: Path,
) -> None:
    model = torch.nn.Linear(3, 2)
    for steps in (range(1, 31), range(6, 16)):  # a run, then its resume from step 6
        recorder = gradstat.Recorder(model, tmp_path, every=5, keep=2, spike=None)
        for step in steps:
            _backward(model, torch.ones(2, 3))
            recorder.step(step)
    assert [step for step, _ in complete_snapshots(tmp_path)] == [10, 15]


def test_a_name_retention_freed_is_never_another_snapshots(tmp_path: Path) -> None:
    """Resumes that replay step 4 with keep=1: each run's snapshot of step 4 pushes out the
    one before. The new one took the name its removal freed (within a step, or a resume later),
    and the earlier run's log record then named other numbers."""
    model = torch.nn.Linear(3, 2)
    named: list[str] = []
    for steps in (range(1, 5), range(3, 5), range(3, 5), range(4, 5)):
        recorder = gradstat.Recorder(model, tmp_path, every=4, keep=1, spike=None)
        for step in steps:
            _backward(model, torch.ones(2, 3) * step)
            recorder.step(step)
        recorder.wait()
        named += [record.snapshot.name for record in recorder.records if record.snapshot]
    assert len(named) == 4 and len(set(named)) == 4, named
    assert [path.name for _, path in complete_snapshots(tmp_path)] == [named[-1]]


def test_a_disk_that_holds_keep_snapshots_keeps_recording(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A disk with room for ``keep`` snapshots: a write while ``keep`` are on it fails."""
    real_dump = recorder_module.dump_rank

    def dump_on_a_small_disk(*args: Any, **kwargs: Any) -> Path:
        if len(complete_snapshots(tmp_path)) >= 2:
            raise SnapshotError("rank-00000.safetensors: cannot write (No space left on device)")
        return real_dump(*args, **kwargs)

    monkeypatch.setattr(recorder_module, "dump_rank", dump_on_a_small_disk)
    model = torch.nn.Linear(3, 2)
    recorder = gradstat.Recorder(model, tmp_path, every=1, keep=2, spike=None)
    for step in range(1, 8):
        _backward(model, torch.ones(2, 3))
        recorder.step(step)
    assert [step for step, _ in complete_snapshots(tmp_path)] == [6, 7]
    assert all(record.snapshot is not None for record in recorder.records)


def test_a_snapshot_without_the_recorders_marker_is_classed_by_its_triggers(
    tmp_path: Path,
) -> None:
    """Snapshots written before the marker existed: a spike one is never pushed out by
    routine ones."""
    model = torch.nn.Linear(3, 2)
    _backward(model, torch.ones(2, 3))
    for step, triggers in ((1, ("spike",)), (2, ("every",))):
        gradstat.snapshot.dump_rank(
            tmp_path / f"step-{step:08d}", model, step=step, triggers=triggers
        )
    recorder = gradstat.Recorder(model, tmp_path, every=1, keep=1, spike=None)
    for step in (3, 4):
        recorder.step(step)
    assert [step for step, _ in complete_snapshots(tmp_path)] == [1, 4]


# --- item 12: arguments checked at construction ------------------------------------------------


@pytest.mark.parametrize(
    ("kwargs", "kind", "says"),
    [
        ({"warmup": 30, "window": 20}, ValueError, "warmup=30 is more than window=20"),
        ({"spike": "10"}, TypeError, "spike must be a number"),
        ({"spike": 0.5}, ValueError, "spike must be a factor > 1"),
        ({"every": "5"}, TypeError, "every must be an integer"),
        ({"every": 0}, ValueError, "every must be >= 1"),
        ({"keep": 2.5}, TypeError, "keep must be an integer"),
        ({"keep": 0}, ValueError, "keep must be >= 1"),
        ({"window": "20"}, TypeError, "window must be an integer"),
        ({"warmup": True}, TypeError, "warmup must be an integer"),
        ({"steps": "7"}, TypeError, "steps must be a list of integers"),
        ({"steps": [4.7]}, TypeError, "step must be an integer"),
        ({"steps": [-1]}, ValueError, "step must be >= 0"),
        ({"steps": [2**63]}, ValueError, "step must be < 2**63"),  # the log's int64
        ({"max_dump_s": math.inf}, ValueError, "max_dump_s must be a finite number"),
        ({"agree_timeout_s": "5"}, TypeError, "agree_timeout_s must be a number"),
        ({"norm_type": -1}, ValueError, "norm"),
        ({"coords": {"tp": [0]}}, ValueError, "coords['tp'] is [0]; expected [rank_on_axis"),
        ({"coords": {"tp": [2, 2]}}, ValueError, "coords['tp'] is [2, 2]"),
        ({"coords": {"tp": "ab"}}, ValueError, "coords={'tp': 'ab'}: coords['tp'] is"),
        ({"coords": {"dpp": [0, 2]}}, ValueError, "unknown axis 'dpp'"),
        ({"telemetry_groups": "layers"}, TypeError, "a list of regular expressions"),
        ({"telemetry_groups": [r"layers\.("]}, ValueError, "is no regular expression"),
        ({"telemetry_groups": [3]}, TypeError, "3 is no regular expression"),
        # A DeviceMesh without names: every snapshot was lost, one warning per rank each.
        ({"mesh": SimpleNamespace(mesh_dim_names=None)}, ValueError, "needs mesh_dim_names"),
    ],
)
def test_bad_arguments_are_refused_in_one_line(
    tmp_path: Path, kwargs: dict[str, Any], kind: type[Exception], says: str
) -> None:
    with pytest.raises(GradstatError) as raised:
        gradstat.Recorder(torch.nn.Linear(2, 2), tmp_path, **kwargs)
    assert isinstance(raised.value, kind)
    assert says in str(raised.value) and "\n" not in str(raised.value)


def test_pairs_that_name_a_parameter_twice_are_refused(tmp_path: Path) -> None:
    """Two gradients under one name: their per-parameter rows merged into one without a word,
    and every snapshot was lost (one warning each)."""
    first, second = torch.nn.Parameter(torch.ones(2)), torch.nn.Parameter(torch.ones(3))
    with pytest.raises(GradstatError) as raised:
        gradstat.Recorder([("w", first), ("w", second)], tmp_path, spike=None)
    assert isinstance(raised.value, ValueError)
    assert "the name 'w' is given twice" in str(raised.value)
    assert not (tmp_path / LOG_NAME).exists()


@pytest.mark.parametrize(
    ("step", "kind"),
    [
        (4.7, TypeError),
        (torch.tensor(4.7), TypeError),
        ("7", TypeError),
        (True, TypeError),
        (torch.tensor([1, 2]), TypeError),
        (-1, ValueError),
        (torch.tensor(-1), ValueError),
        (2**63, ValueError),  # raised struct.error out of the log, the snapshot written
    ],
)
def test_a_step_that_is_not_a_non_negative_integer_is_refused(
    tmp_path: Path, step: Any, kind: type[Exception]
) -> None:
    model = torch.nn.Linear(2, 2)
    recorder = gradstat.Recorder(model, tmp_path, every=1)
    _backward(model, torch.ones(1, 2))
    with pytest.raises(GradstatError) as raised:
        recorder.step(step)
    assert isinstance(raised.value, kind) and "\n" not in str(raised.value)
    assert recorder.records == [] and _snapshots_in(tmp_path) == []


def test_integer_steps_are_taken_as_they_are(tmp_path: Path) -> None:
    model = torch.nn.Linear(2, 2)
    recorder = gradstat.Recorder(model, tmp_path, steps=[7], spike=None)
    _backward(model, torch.ones(1, 2))
    recorder.step(torch.tensor(7))
    recorder.step(8)
    assert [(r.step, r.triggers) for r in recorder.records] == [(7, ("step",)), (8, ())]


# --- items 9, 11, 13 on 2 gloo ranks --------------------------------------------------------


def _stderr_of(fn: Any) -> tuple[Any, list[str]]:
    captured = io.StringIO()
    with contextlib.redirect_stderr(captured):
        value = fn()
    return value, captured.getvalue().splitlines()


def _resume_over_leftovers(rank: int, world_size: int, directory: str) -> Any:
    """A resumed 2-rank job dumps step 5 where the killed run left its step 5 partial."""
    if rank == 0:
        _leftovers_of_a_killed_run(Path(directory))
    torch.distributed.barrier()
    torch.manual_seed(0)  # data-parallel replicas: the same weights and gradients
    model = torch.nn.Linear(3, 2)

    def run() -> Any:
        recorder = gradstat.Recorder(model, directory, steps=[5], spike=None, finalize_timeout_s=5)
        _backward(model, torch.ones(2, 3))
        norm = recorder.step(5)
        return norm, recorder.records[-1].snapshot

    (norm, snapshot), lines = _stderr_of(run)
    torch.distributed.barrier()  # rank 0 has finished the snapshot
    return norm, str(snapshot), lines


def _steps_apart(rank: int, world_size: int, directory: str) -> Any:
    """Rank 1 counts its steps one ahead of rank 0."""
    model = torch.nn.Linear(3, 2)

    def run() -> Any:
        recorder = gradstat.Recorder(
            model, directory, steps=[3], every=2, spike=None, finalize_timeout_s=2
        )
        for step in range(1, 5):
            _backward(model, torch.ones(2, 3))
            recorder.step(step + rank)
        return [(r.step, r.triggers, r.snapshot) for r in recorder.records]

    records, lines = _stderr_of(run)
    return records, lines


def _a_peer_that_never_comes(rank: int, world_size: int, arg: tuple[int, str]) -> Any:
    """Rank ``missing`` builds its recorder, then raises in its own code and lives on."""
    missing, directory = arg
    model = torch.nn.Linear(3, 2)
    recorder = gradstat.Recorder(model, directory, spike=None, agree_timeout_s=0.5)
    if rank == missing:
        time.sleep(2.0)  # alive, and elsewhere, while the other waits at its step
        return None
    _backward(model, torch.ones(2, 3))
    started = time.monotonic()
    errors = []
    for step in (1, 2):  # the second call says the same at once
        try:
            recorder.step(step)
        except PeerTimeoutError as error:
            errors.append(str(error))
    return errors, time.monotonic() - started


_FULL = torch.arange(8, dtype=torch.float32).reshape(4, 2) + 1


def _uneven_dtensor_lists(rank: int, world_size: int, directory: str) -> Any:
    """A Shard(0) DTensor parameter whose gradient is None on rank 1 at step 2 only."""
    return _uneven(rank, world_size, directory, agree_timeout_s=30)


def _uneven_unbounded(rank: int, world_size: int, directory: str) -> Any:
    """The same with ``agree_timeout_s=None``: the agreement is the default group's all-reduce."""
    return _uneven(rank, world_size, directory, agree_timeout_s=None)


def _uneven(rank: int, world_size: int, directory: str, agree_timeout_s: float | None) -> Any:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard

    mesh = init_device_mesh("cpu", (world_size,))
    local = _FULL[2 * rank : 2 * rank + 2]
    weight = torch.nn.Parameter(DTensor.from_local(local.clone(), mesh, [Shard(0)]))
    recorder = gradstat.Recorder(
        [("w", weight)], directory, steps=[2], spike=None, agree_timeout_s=agree_timeout_s
    )
    norms = []
    for step in (1, 2, 3):
        present = rank == 0 or step != 2
        grad = DTensor.from_local(local * step, mesh, [Shard(0)], run_check=False)
        weight.grad = grad if present else None
        norms.append(recorder.step(step))
    return norms, str(recorder.records[1].snapshot)


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, Any]:
    """One launch of 2 gloo ranks for the three cases (a process start costs seconds)."""
    root = tmp_path_factory.mktemp("two_ranks")
    resumed, apart, run = root / "resumed", root / "apart", root / "run"
    resumed.mkdir()
    run.mkdir()
    cases = [
        Case("resume", _resume_over_leftovers, str(resumed)),
        Case("apart", _steps_apart, str(apart)),
        Case("uneven", _uneven_dtensor_lists, str(root / "uneven")),
        Case("uneven, unbounded", _uneven_unbounded, str(root / "unbounded")),
        Case("rank 1 missing", _a_peer_that_never_comes, (1, str(root / "missing1"))),
        Case("rank 0 missing", _a_peer_that_never_comes, (0, str(root / "missing0"))),
    ]
    return resumed, apart, launch(2, run, cases, timeout_s=120)


@pytest.mark.multiprocess
@pytest.mark.slow
def test_two_ranks_resumed_over_a_killed_runs_leftovers(two_ranks: tuple[Path, Path, Any]) -> None:
    """Item 9: the killed run's rank 1 file is never part of the new snapshot, and no rank
    meets an existing rank file."""
    resumed, _, report = two_ranks
    outcomes = report.values("resume")
    assert not [path for path in resumed.iterdir() if path.name.startswith(".")]
    (snapshot,) = [path for _, path in complete_snapshots(resumed)]
    assert [Path(path) for _, path, _ in outcomes] == [snapshot, snapshot]
    for rank in (0, 1):
        header, tensors = _saved(snapshot, rank)
        assert header["rank"] == rank and header["world_size"] == 2
        assert _close(outcomes[rank][0], _exact_norm(list(tensors.values())))
    assert not any("rank file exists" in line for _, _, lines in outcomes for line in lines)


@pytest.mark.multiprocess
@pytest.mark.slow
def test_two_ranks_on_different_steps_say_so_and_take_no_snapshot(
    two_ranks: tuple[Path, Path, Any],
) -> None:
    """Item 11: one line naming the steps, then one per skipped trigger; no partial left."""
    _, apart, report = two_ranks
    for rank, (records, lines) in enumerate(report.values("apart")):
        assert [step for step, _, _ in records] == [1 + rank, 2 + rank, 3 + rank, 4 + rank]
        assert all(snapshot is None for _, _, snapshot in records)
        assert lines[0] == (
            f"gradstat recorder: the ranks are on different steps (from 1 to 2; this rank at "
            f"{1 + rank}): no snapshot is taken while they differ (is step counted the same way "
            f"on every rank?)"
        )
        assert all("skipped" in line for line in lines[1:]) and len(lines) == 5, lines
    assert not apart.exists() or _snapshots_in(apart) == []


@pytest.mark.multiprocess
@pytest.mark.slow
def test_ranks_whose_gradient_lists_differ_agree_and_complete_the_snapshot(
    two_ranks: tuple[Path, Path, Any],
) -> None:
    """Items 2 and 8: a gradient None on one rank only (DTensor lists that differ) gives every
    rank the same norm of the gradients there are, the collectives stay in step, and the rank
    without a gradient still writes its file."""
    _, _, report = two_ranks
    rows = _FULL.double()
    expected = [
        _exact_norm([rows]),
        _exact_norm([2 * rows[:2]]),  # rank 0's shard only
        _exact_norm([3 * rows]),
    ]
    for case in ("uneven", "uneven, unbounded"):  # agree_timeout_s 30, then None
        outcomes = report.values(case)
        for norms, _ in outcomes:
            assert all(_close(got, want) for got, want in zip(norms, expected, strict=True)), (
                case,
                norms,
            )
        snapshot = Path(outcomes[0][1])
        assert outcomes[1][1] == str(snapshot) and snapshot.name == "step-00000002", case
        header, tensors = _saved(snapshot, 1)
        assert tensors == {} and [record["grad"] for record in header["params"]] == [False]
        _, tensors = _saved(snapshot, 0)
        assert _close(_exact_norm(list(tensors.values())), expected[1]), case


@pytest.mark.multiprocess
@pytest.mark.slow
def test_a_peer_that_never_comes_is_named_after_agree_timeout_s(
    two_ranks: tuple[Path, Path, Any],
) -> None:
    """Item 13: the rank that came names the one that did not, and the recorder stays
    stopped (its second call says the same at once)."""
    _, _, report = two_ranks
    for case, waiting, message in (
        ("rank 1 missing", 0, "rank 0: rank 1 did not reach recorder.step (step 1) within 0.5 s"),
        ("rank 0 missing", 1, "rank 1: rank 0 did not answer at recorder.step (step 1) within 1 s"),
    ):
        errors, _elapsed = report.values(case)[waiting]
        assert len(errors) == 2 and errors[0] == errors[1]
        assert errors[0].startswith(message) and "\n" not in errors[0], errors[0]


_DIES_BETWEEN_STEPS = """
import os, sys, time, torch, torch.distributed as dist, gradstat
from gradstat.errors import PeerTimeoutError
dist.init_process_group("gloo")
model = torch.nn.Linear(3, 2)
recorder = gradstat.Recorder(model, sys.argv[1], spike=None, agree_timeout_s=5)
for param in model.parameters():
    param.grad = torch.ones_like(param)
recorder.step(1)
if dist.get_rank() == 1:
    os._exit(0)  # killed between steps: its connections close
time.sleep(1)
try:
    recorder.step(2)
    print("no error", flush=True)
except PeerTimeoutError as error:
    print("PeerTimeoutError:", error, flush=True)
except Exception as error:
    print("other:", type(error).__name__, flush=True)
os._exit(0)
"""


@pytest.mark.multiprocess
def test_a_peer_killed_between_steps_is_named_as_the_peer_that_did_not_come(
    tmp_path: Path,
) -> None:
    """gloo's "Connection closed by peer" came out of step() as a RuntimeError (posting the
    receive from a rank whose process is gone), not the documented PeerTimeoutError."""
    import subprocess
    import sys

    script = tmp_path / "dies.py"
    script.write_text(_DIES_BETWEEN_STEPS)
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
    command += ["--nproc-per-node", "2", str(script), str(tmp_path / "run")]
    done = subprocess.run(command, capture_output=True, text=True, timeout=120)
    said = [line for line in done.stdout.splitlines() if line.strip()]
    assert said and said[-1].startswith("PeerTimeoutError: rank 0: rank 1 did not reach"), (
        done.stdout + done.stderr[-2000:]
    )


# A one-rank job that ends its distributed part while its recorder and GradNorm live on.
_OUTLIVED = """
import gc, sys, weakref, torch, torch.distributed as dist
import gradstat
dist.init_process_group("gloo", init_method="file://" + sys.argv[1], rank=0, world_size=1)
world = weakref.ref(dist.group.WORLD)
model = torch.nn.Linear(2, 1)
model(torch.ones(1, 2)).sum().backward()
recorder = gradstat.Recorder(model, sys.argv[2], group=dist.group.WORLD)
norm = gradstat.GradNorm(list(model.parameters()), 2.0, dist.group.WORLD)
print(recorder.norm() == norm())
dist.destroy_process_group()
gc.collect()
print(world() is None)
for use in (recorder.norm, norm):
    try:
        use()
    except gradstat.GradstatError as error:
        print(error)
"""


def test_the_default_group_dies_with_the_jobs_groups_not_with_the_recorder(
    tmp_path: Path,
) -> None:
    """A recorder given ``group=dist.group.WORLD`` held it past ``destroy_process_group()``;
    destroyed at the interpreter's exit, it aborted 3 in 8 runs of a 3-rank gloo job ("terminate
    called without an active exception", exit -6, after the loop had ended). The recorder and
    GradNorm hold their group weakly: it dies where the job drops its groups, and a later use
    says the group is gone."""
    from tests._cli import run_python

    done = run_python(_OUTLIVED, str(tmp_path / "store"), str(tmp_path / "run"))
    assert done.returncode == 0, done.stderr
    same, freed, *said = done.stdout.splitlines()
    assert (same, freed) == ("True", "True"), done.stdout
    assert len(said) == 2 and all("process group was destroyed" in line for line in said), said

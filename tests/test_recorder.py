"""The flight recorder: triggers, one snapshot per trigger, retention, lost ranks, in real
training loops (one process, FSDP2 on 2 gloo ranks, a Megatron TP=2 layout with Megatron's own
parallel_state), with norms held against float64 and snapshots read back by the CLI."""

from __future__ import annotations

import importlib.util
import json
import math
import os
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors import safe_open

import gradstat
from gradstat.recorder import complete_snapshots
from gradstat.testing import Case, launch
from tests import _jobs, _torch_native
from tests._cli import norm_json, recipe
from tests._jobs import Job
from tests._oracle import float64_norm, rel_err

NAN_STEP, SPIKE_STEP, STEPS = 7, 12, 14


def _triggers_of(snapshot: Path) -> list[str]:
    with safe_open(str(next(snapshot.glob("*.safetensors"))), "pt") as handle:
        header = json.loads(handle.metadata()["gradstat"])
    return list(header.get("triggers", []))


def _run_dir(tmp_path: Path) -> Path:
    run = tmp_path / "run"
    run.mkdir()
    return run


def _plant(grads: list[torch.Tensor], step: int) -> None:
    """A NaN at NAN_STEP, a 1000x blow-up at SPIKE_STEP, ordinary gradients otherwise."""
    if step == NAN_STEP:
        grads[0].view(-1)[0] = math.nan
    if step == SPIKE_STEP:
        for grad in grads:
            grad.mul_(1000.0)


def test_one_snapshot_per_trigger_in_a_single_process_loop(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4))
    inputs = torch.randn(32, 8)
    recorder = gradstat.Recorder(model, tmp_path / "dumps", steps=[3], keep=5)
    expected = {}
    for step in range(1, STEPS + 1):
        model.zero_grad()
        model(inputs).square().mean().backward()
        _plant([param.grad for param in model.parameters()], step)
        norm = recorder.step(step)
        expected[step] = float64_norm([param.grad for param in model.parameters()], 2)
        if step == NAN_STEP:
            assert math.isnan(norm)
        else:
            assert rel_err(norm, expected[step]) <= 1e-9, step
    fired = {record.step: record.triggers for record in recorder.records if record.triggers}
    assert fired == {3: ("step",), NAN_STEP: ("nonfinite",), SPIKE_STEP: ("spike",)}
    snapshots = dict(complete_snapshots(tmp_path / "dumps"))
    assert sorted(snapshots) == [3, NAN_STEP, SPIKE_STEP]
    assert not [path for path in (tmp_path / "dumps").iterdir() if path.name.startswith(".")]
    assert _triggers_of(snapshots[SPIKE_STEP]) == ["spike"]
    code, document, _ = norm_json(snapshots[SPIKE_STEP])
    assert code == 0 and document is not None
    assert rel_err(document["total_norm"], expected[SPIKE_STEP]) <= 1e-7
    assert norm_json(snapshots[NAN_STEP])[0] == 1, "the NaN snapshot shows the NaN"


def test_the_oldest_snapshots_go_first(tmp_path: Path) -> None:
    model = torch.nn.Linear(4, 4)
    recorder = gradstat.Recorder(model, tmp_path, every=2, keep=2, spike=None)
    for step in range(1, 10):
        model.zero_grad()
        model(torch.ones(2, 4)).sum().backward()
        recorder.step(step)
    assert [step for step, _ in complete_snapshots(tmp_path)] == [6, 8]


def test_bad_arguments_are_refused() -> None:
    model = torch.nn.Linear(2, 2)
    for kwargs in ({"spike": 0.5}, {"keep": 0}, {"every": 0}, {"norm_type": -1}):
        with pytest.raises(ValueError):
            gradstat.Recorder(model, "unused", **kwargs)


# --- FSDP2 on 2 gloo ranks -----------------------------------------------------------------


def _fsdp2_loop(rank: int, world_size: int, directory: str) -> dict[str, Any]:
    """The README's recorder recipes in an FSDP2 loop."""
    model, _mesh = _torch_native.build("fsdp2")
    # A torch optimizer changes nothing (only Megatron's distributed one does).
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    namespace = {"model": model, "directory": directory, "optimizer": optimizer}
    exec(recipe("recorder_setup"), namespace)
    norms, expected = {}, {}
    for step in range(1, STEPS + 1):
        model.zero_grad()
        _torch_native.loss_of(model).backward()
        local = [param.grad.to_local() for param in model.parameters()]
        if step != NAN_STEP or rank == 0:  # the NaN lands on one rank's shard only
            _plant(local, step)
        exec(recipe("recorder_step"), namespace | {"step": step})
        norms[step] = namespace["recorder"].records[-1].norm
        full = _torch_native.full_gradients(model)
        expected[step] = float64_norm(list(full.values()), 2)
    records = namespace["recorder"].records
    fired = [(r.step, r.triggers, str(r.snapshot)) for r in records if r.triggers]
    return {"norms": norms, "expected": expected, "records": fired}


@pytest.mark.multiprocess
@pytest.mark.slow
def test_fsdp2_loop_catches_the_nan_and_the_spike(tmp_path: Path) -> None:
    dumps = tmp_path / "dumps"
    case = Case("loop", _fsdp2_loop, str(dumps))
    ranks = launch(2, _run_dir(tmp_path), [case], timeout_s=300).values("loop")
    for result in ranks:
        for step, norm in result["norms"].items():
            if step == NAN_STEP:
                assert math.isnan(norm), "a NaN on one rank's shard reaches every rank"
            else:
                assert rel_err(norm, result["expected"][step]) <= 1e-9, step
        assert [(step, triggers) for step, triggers, _ in result["records"]] == [
            (NAN_STEP, ("nonfinite",)),
            (SPIKE_STEP, ("spike",)),
        ]
    snapshots = dict(complete_snapshots(dumps))
    assert sorted(snapshots) == [NAN_STEP, SPIKE_STEP]
    code, document, stderr = norm_json(snapshots[SPIKE_STEP])
    assert code == 0 and document is not None, stderr
    assert rel_err(document["total_norm"], ranks[0]["norms"][SPIKE_STEP]) <= 1e-7


# --- a rank lost while dumping ----------------------------------------------------------------


def _lost_while_dumping(rank: int, world_size: int, directory: str) -> list[Any]:
    from gradstat.recorder import snapshots as recorder_module

    model = torch.nn.Linear(4, 3)
    recorder = gradstat.Recorder(model, directory, steps=[2], finalize_timeout_s=2.0)
    if rank == 1:
        recorder_module.dump_rank = lambda *args, **kwargs: os._exit(3)  # type: ignore[assignment]
    for step in (1, 2):
        model.zero_grad()
        model(torch.ones(2, 4)).sum().backward()
        recorder.step(step)
    return [(record.step, record.triggers, record.snapshot) for record in recorder.records]


@pytest.mark.multiprocess
@pytest.mark.slow
def test_a_rank_lost_while_dumping_leaves_no_snapshot_that_reads_as_complete(
    tmp_path: Path,
) -> None:
    dumps = tmp_path / "dumps"
    report = launch(2, _run_dir(tmp_path), [Case("lost", _lost_while_dumping, str(dumps))])
    assert report.outcomes[0]["lost"].value == [(1, (), None), (2, ("step",), None)]
    assert any("rank 1 exited with code 3" in problem for problem in report.problems)
    assert complete_snapshots(dumps) == []
    (partial,) = (path for path in dumps.iterdir() if path.is_dir())
    assert re.fullmatch(r"\.step-00000002\.[0-9a-f]+-1\.partial", partial.name)
    code, _document, stderr = norm_json(partial)
    assert code == 2 and "1 of 2 rank files missing" in stderr


# --- a Megatron TP=2 layout with Megatron's own parallel_state ------------------------------

LAYOUT = Job("tp2", tp=2)


def _megatron_loop(rank: int, world_size: int, directory: str) -> dict[str, Any]:
    """The README's recorder recipes on a Megatron TP=2 layout under Megatron's parallel_state:
    a NaN at NAN_STEP on rank 0's embedding shard, a 1000x blow-up at SPIKE_STEP."""
    from megatron.core import parallel_state

    from tests._megatron import megatron_view

    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=2, create_gloo_process_groups=False
    )
    try:
        params = _jobs.local_params(LAYOUT, megatron_view(LAYOUT))
        clean = [param.grad.clone() for param in params]
        named = [(param._gradstat_name, param) for param in params]
        namespace: dict[str, Any] = {"model": named, "directory": directory, "optimizer": None}
        exec(recipe("recorder_setup"), namespace)
        recorder = namespace["recorder"]
        norms = {}
        for step in range(1, STEPS + 1):
            for param, grad in zip(params, clean, strict=True):
                param.grad.copy_(grad)
            if step != NAN_STEP or rank == 0:
                _plant([param.grad for param in params], step)
            exec(recipe("recorder_step"), namespace | {"step": step})
            norms[step] = recorder.records[-1].norm
        fired = [(r.step, r.triggers) for r in recorder.records if r.triggers]
        return {"norms": norms, "fired": fired}
    finally:
        parallel_state.destroy_model_parallel()


@pytest.mark.skipif(importlib.util.find_spec("megatron") is None, reason="needs megatron-core")
@pytest.mark.filterwarnings("ignore:Transformer Engine and Apex are not installed:UserWarning")
@pytest.mark.multiprocess
@pytest.mark.slow
def test_megatron_loop_catches_the_nan_and_the_spike(tmp_path: Path) -> None:
    dumps = tmp_path / "dumps"
    case = Case("megatron", _megatron_loop, str(dumps))
    ranks = launch(2, _run_dir(tmp_path), [case], timeout_s=300).values("megatron")
    full = float64_norm(_jobs.oracle_grads(moe=False)["total"], 2)
    for result in ranks:
        for step, norm in result["norms"].items():
            if step == NAN_STEP:
                assert math.isnan(norm)
            elif step == SPIKE_STEP:  # each fp32 element rounded once by the x1000
                assert rel_err(norm, 1000.0 * full) <= 1e-6
            else:
                assert rel_err(norm, full) <= 1e-9, step
        assert result["fired"] == [(NAN_STEP, ("nonfinite",)), (SPIKE_STEP, ("spike",))]
    snapshots = dict(complete_snapshots(dumps))
    assert sorted(snapshots) == [NAN_STEP, SPIKE_STEP]
    code, document, stderr = norm_json(snapshots[SPIKE_STEP])
    assert code == 0 and document is not None, stderr
    assert rel_err(document["total_norm"], ranks[0]["norms"][SPIKE_STEP]) <= 1e-7


def test_a_write_slower_than_max_dump_s_is_abandoned_and_training_goes_on(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    recorder_warnings: Callable[[], list[str]],
) -> None:
    """A slow disk, made deterministic: the dump waits on an event that the test sets only
    after the recorder has given up waiting and a second trigger has been skipped."""
    import threading

    from gradstat.recorder import snapshots as recorder_module

    release, real_dump = threading.Event(), recorder_module.dump_rank

    def slow_dump(*args: Any, **kwargs: Any) -> Path:
        release.wait()
        return real_dump(*args, **kwargs)

    monkeypatch.setattr(recorder_module, "dump_rank", slow_dump)
    model = torch.nn.Linear(4, 3)
    recorder = gradstat.Recorder(model, tmp_path, steps=[1, 2], spike=None, max_dump_s=0.2)
    for step in (1, 2):
        model.zero_grad()
        model(torch.ones(2, 4)).sum().backward()
        recorder.step(step)
    assert [(r.step, r.triggers, r.snapshot) for r in recorder.records] == [
        (1, ("step",), None),
        (2, ("step",), None),
    ]
    messages = recorder_warnings()
    assert "still writing after 0.2 s" in messages[0] and "stays incomplete" in messages[0]
    assert "still writing the snapshot of step 1; this one is skipped" in messages[1]
    release.set()
    recorder.wait()
    assert complete_snapshots(tmp_path) == [], "an abandoned write is never renamed complete"
    (partial,) = (path for path in tmp_path.iterdir() if path.is_dir())
    assert re.fullmatch(r"\.step-00000001\.[0-9a-f]+-1\.partial", partial.name)
    assert (partial / ".abandoned-rank-00000").exists()

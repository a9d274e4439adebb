"""The flight recorder's per-parameter telemetry, every step, on real multi-rank layouts, held
against float64 statistics of the logical gradients computed here without gradstat.

Three jobs on gloo CPU ranks:

- FSDP2 on 2 ranks (tests/_torch_native.py's Llama-style model, tied embedding), 8 steps with
  planted events: a NaN on one rank's shard, an Inf on the other's, a 1000x blow-up of one
  parameter, one parameter's gradient zeroed. Each rank's ``recorder.params``, the log rank 0
  wrote (read back by ``read_history``) and ``gradstat norm --json`` of a snapshot of one step
  are held against float64 of the full gradients (``full_tensor()``).
- megatron-core GPTModel chunks under Megatron's own parallel_state (tests/_wgrads_jobs.py):
  TP2 x PP2 with the output layer tied to the embedding, and EP2 MoE, on 4 ranks. Each step
  the known gradients are scaled by a per-step, per-parameter power of two (one layer blown up
  1000x at one step) before Megatron's finalize_model_grads; the truth is ``true_grads`` scaled
  the same way. The gradients are chosen so that Megatron's fp32 arithmetic on them is exact.
- A rank killed mid-run: the other is told which rank is missing, and the log it wrote holds
  every step before, whole.
"""

from __future__ import annotations

import importlib.util
import math
import os
import warnings
import zlib
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import Tensor

import gradstat
from gradstat.analysis.history import History, read_history
from gradstat.errors import PeerTimeoutError
from gradstat.recorder import ParamsAtStep, complete_snapshots
from gradstat.testing import Case, launch
from tests import _torch_native
from tests._cli import norm_json
from tests._oracle import rel_err

STEPS = 8
NAN_STEP, INF_STEP, BLOWUP_STEP, ZEROED_STEP = 2, 3, 5, 6
SNAPSHOT_STEP = ZEROED_STEP  # the step gradstat norm reads a snapshot of
NAN_PARAM = "tok_embeddings.weight"  # rank 0's shard gets the NaN
INF_PARAM = "layers.1.feed_forward.w2.weight"  # rank 1's shard gets the Inf
BLOWN_PARAM = "layers.0.attention.wq.weight"
ZEROED_PARAM = "layers.1.ffn_norm.weight"
RTOL = 1e-6  # per-parameter L2 against float64


# --- the float64 oracle -----------------------------------------------------------------------


def _expected(grad: Tensor) -> dict[str, Any]:
    """A logical gradient's statistics in float64, as gradstat defines them: L2 and max |x|
    NaN when it holds a NaN (else inf when it holds an Inf), exact counts."""
    flat = grad.detach().double().reshape(-1)
    nan, inf = int(flat.isnan().sum()), int(flat.isinf().sum())
    finite = flat[flat.isfinite()]
    squares = math.fsum((finite * finite).tolist())
    peak = float(finite.abs().max()) if finite.numel() else 0.0
    if nan:
        l2 = peak = math.nan
    elif inf:
        l2 = peak = math.inf
    else:
        l2 = math.sqrt(squares)
    return {
        "norm": l2,
        "max_abs": peak,
        "zeros": int((flat == 0).sum()),
        "nan": nan,
        "inf": inf,
        "numel": flat.numel(),
    }


def _close(value: float, expected: float, rtol: float) -> bool:
    """Within ``rtol`` (relative); NaN, an infinity and zero must be met exactly."""
    if math.isnan(expected):
        return math.isnan(value)
    if math.isinf(expected) or expected == 0:
        return value == expected
    return rel_err(value, expected) <= rtol


def _check_params(
    params: ParamsAtStep, truth: dict[str, Tensor], where: str, max_abs_rtol: float
) -> None:
    """Every agreed name with a gradient is a logical tensor of ``truth`` and every logical
    tensor is one; each one's statistics are the float64 ones."""
    names = params.layout.names
    held = {name for name, norm in zip(names, params.norms, strict=True) if norm is not None}
    assert held == set(truth), (where, sorted(held ^ set(truth)))
    for index, name in enumerate(names):
        if name not in truth:
            continue
        expected = _expected(truth[name])
        norm = params.norms[index]
        assert norm is not None
        got = {
            "zeros": params.zeros[index],
            "nan": params.nan[index],
            "inf": params.inf[index],
            "numel": params.numel[index],
        }
        assert got == {key: expected[key] for key in got}, (where, name, got, expected)
        assert _close(norm, expected["norm"], RTOL), (where, name, norm, expected["norm"])
        peak = params.max_abs[index]
        assert _close(peak, expected["max_abs"], max_abs_rtol), (where, name, peak, expected)


def _check_log(
    history: History, truths: dict[int, dict[str, Tensor]], where: str, max_abs_rtol: float
) -> None:
    """The log's steps are those of ``truths``, each parameter's series its float64 values."""
    steps = sorted(truths)
    assert history.source == "log" and history.steps == steps, (where, history.steps)
    assert history.problems == [], (where, history.problems)
    names = set().union(*(truth.keys() for truth in truths.values()))
    assert set(history.params) == names, (where, sorted(set(history.params) ^ names))
    for name, series in history.params.items():
        assert series.steps == [step for step in steps if name in truths[step]], (where, name)
        assert series.max_abs is not None, (where, name)
        for index, step in enumerate(series.steps):
            expected = _expected(truths[step][name])
            at = (where, name, step)
            assert series.zeros[index] == expected["zeros"], (*at, series.zeros[index], expected)
            assert series.nan[index] == expected["nan"], (*at, series.nan[index], expected)
            assert series.inf[index] == expected["inf"], (*at, series.inf[index], expected)
            assert _close(series.norms[index], expected["norm"], RTOL), (
                *at,
                series.norms[index],
                expected["norm"],
            )
            assert _close(series.max_abs[index], expected["max_abs"], max_abs_rtol), (
                *at,
                series.max_abs[index],
                expected["max_abs"],
            )


def _same_on_every_rank(ranks: list[dict[str, Any]], where: str) -> None:
    """Every rank holds the same statistics at every step (repr: exact, NaN included)."""
    first = {step: repr(params) for step, params in ranks[0]["params"].items()}
    for rank, result in enumerate(ranks[1:], 1):
        other = {step: repr(params) for step, params in result["params"].items()}
        assert other == first, (where, rank)


def _run_dir(tmp_path: Path) -> Path:
    run = tmp_path / "launch"
    run.mkdir()
    return run


# --- FSDP2 on 2 gloo ranks --------------------------------------------------------------------


def _plant(model: torch.nn.Module, rank: int, step: int) -> None:
    """This step's planted event, on the local shards of the gradients."""
    local = {
        _torch_native.logical_name(name): param.grad.to_local()
        for name, param in model.named_parameters()
    }
    if step == NAN_STEP and rank == 0:
        local[NAN_PARAM].view(-1)[3] = math.nan
    if step == INF_STEP and rank == 1:
        local[INF_PARAM].view(-1)[-1] = -math.inf
    if step == BLOWUP_STEP:
        local[BLOWN_PARAM].mul_(1000.0)
    if step == ZEROED_STEP:
        local[ZEROED_PARAM].zero_()


def _fsdp2_telemetry(rank: int, world_size: int, directory: str) -> dict[str, Any]:
    """Each step's statistics on this rank; rank 0 also brings the full gradients."""
    model, _mesh = _torch_native.build("fsdp2")
    recorder = gradstat.Recorder(
        model, directory, telemetry_every=1, spike=None, steps=[SNAPSHOT_STEP]
    )
    params, norms, full = {}, {}, {}
    for step in range(1, STEPS + 1):
        model.zero_grad()
        # A different gradient each step: the loss scaled by the step.
        (_torch_native.loss_of(model) * step).backward()
        _plant(model, rank, step)
        norms[step] = recorder.step(step)
        params[step] = recorder.params
        grads = _torch_native.full_gradients(model)  # a collective: every rank
        if rank == 0:
            full[step] = grads
    return {"params": params, "norms": norms, "full": full}


@pytest.mark.multiprocess
@pytest.mark.slow
def test_fsdp2_telemetry_is_float64_every_step_in_the_recorder_the_log_and_the_cli(
    tmp_path: Path,
) -> None:
    directory = tmp_path / "run"
    case = Case("fsdp2", _fsdp2_telemetry, str(directory))
    ranks = launch(2, _run_dir(tmp_path), [case], timeout_s=300).values("fsdp2")
    truths: dict[int, dict[str, Tensor]] = ranks[0]["full"]
    assert sorted(truths) == list(range(1, STEPS + 1))
    # The plants took: the oracle sees what the ranks hold.
    assert _expected(truths[NAN_STEP][NAN_PARAM])["nan"] == 1
    assert _expected(truths[INF_STEP][INF_PARAM])["inf"] == 1
    assert _expected(truths[ZEROED_STEP][ZEROED_PARAM])["norm"] == 0.0
    blown, before = truths[BLOWUP_STEP][BLOWN_PARAM], truths[BLOWUP_STEP - 1][BLOWN_PARAM]
    assert _expected(blown)["norm"] > 500 * _expected(before)["norm"]

    _same_on_every_rank(ranks, "fsdp2")
    for rank, result in enumerate(ranks):
        assert sorted(result["params"]) == list(range(1, STEPS + 1)), rank
        for step, params in result["params"].items():
            assert params is not None, (rank, step)
            # fp32 values' max |x| is exact in float64.
            _check_params(params, truths[step], f"rank {rank} step {step}", 0.0)
            assert sorted(params.layout.names) == sorted(truths[step]), (rank, step)
            assert rel_err(result["norms"][step], params.total()) <= 1e-9 or step in (
                NAN_STEP,
                INF_STEP,
            ), (rank, step)

    _check_log(read_history(directory, source="log"), truths, "fsdp2 log", 0.0)

    # The names are those gradstat norm prints for a snapshot of a step, with its norms.
    snapshots = dict(complete_snapshots(directory))
    # The NaN and the Inf steps take a snapshot of their own (the nonfinite trigger).
    assert sorted(snapshots) == sorted([NAN_STEP, INF_STEP, SNAPSHOT_STEP])
    code, document, stderr = norm_json(snapshots[SNAPSHOT_STEP])
    assert code == 0 and document is not None, stderr
    printed = {entry["name"]: entry["norm"] for entry in document["params"]}
    params = ranks[0]["params"][SNAPSHOT_STEP]
    recorded = {
        name: norm
        for name, norm in zip(params.layout.names, params.norms, strict=True)
        if norm is not None
    }
    assert set(printed) == set(recorded), sorted(set(printed) ^ set(recorded))
    for name, norm in printed.items():
        assert _close(norm, recorded[name], 1e-9), (name, norm, recorded[name])


# --- Megatron: TP2 x PP2 (tied embedding) and EP2 MoE, under Megatron's parallel_state --------

MEGATRON_STEPS = 3
MEGATRON_BLOWUP_STEP = 2
BLOWN_LAYER = "decoder.layers.2."  # on the second pipeline stage: a global index


def _factor(name: str, step: int) -> float:
    """The step's scale of a logical tensor's known gradient: a power of two from 1/4 to 4
    (fp32-exact), and 1000 for the blown-up layer at its step (exact on these values, whose
    magnitudes are multiples of 2**-8 below 2**6). The tied output copy is scaled as the
    embedding, so that their sum is the embedding's gradient scaled."""
    from tests._wgrads_jobs import EMBEDDING, OUTPUT_COPY

    logical = EMBEDDING if name == OUTPUT_COPY else name
    scale = 2.0 ** (zlib.crc32(f"{logical}/{step}".encode()) % 5 - 2)
    if step == MEGATRON_BLOWUP_STEP and logical.startswith(BLOWN_LAYER):
        scale *= 1000.0
    return scale


def _megatron_telemetry(rank: int, world_size: int, arg: tuple[Any, str]) -> dict[str, Any]:
    """One rank of a megatron-core job: each step the known gradients, scaled, reduced by
    Megatron's finalize_model_grads, then recorded."""
    from megatron.core.distributed import finalize_model_grads

    from tests._megatron import _use_cpu_clip_grads, megatron_clip_grads, point_megatron_at_cpu
    from tests._wgrads_jobs import _build, _fill_main_grads, parallel_state

    job, directory = arg
    assert world_size == job.world_size, (job.name, world_size)
    with parallel_state(job):
        if point_megatron_at_cpu():  # once per process
            _use_cpu_clip_grads(megatron_clip_grads())
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            model, optimizer = _build(job)
        recorder = gradstat.Recorder(
            model,
            directory,
            telemetry_every=1,
            spike=None,
            optimizer=optimizer if job.distributed_optimizer else None,
        )
        params: dict[int, ParamsAtStep | None] = {}
        norms: dict[int, float] = {}
        tensors: dict[str, Any] = {}
        misnumbered: list[str] = []
        for step in range(1, MEGATRON_STEPS + 1):
            tensors, names, misnumbered = _fill_main_grads(job, model)
            for chunk, wrapped in enumerate(model):
                for local, param in wrapped.module.named_parameters():
                    param.main_grad.mul_(_factor(names[f"model_chunk{chunk}"][local], step))
            finalize_model_grads(model, force_all_reduce=True)
            norms[step] = recorder.step(step)
            params[step] = recorder.params
        return {
            "params": params,
            "norms": norms,
            "tensors": tensors,
            "misnumbered": misnumbered,
            "grad_attr": recorder.grad_attr,
        }


@pytest.mark.skipif(importlib.util.find_spec("megatron") is None, reason="needs megatron-core")
@pytest.mark.filterwarnings("ignore:Transformer Engine and Apex are not installed:UserWarning")
@pytest.mark.multiprocess
@pytest.mark.slow
def test_megatron_telemetry_is_float64_every_step_by_global_names(tmp_path: Path) -> None:
    from tests._wgrads_jobs import OUTPUT_COPY, Logical, WgradsJob, true_grads

    jobs = (
        WgradsJob("tp2-pp2-tied", tp=2, pp=2, etp=2),
        WgradsJob("ep2-dp4", ep=2, etp=1),
        # Megatron's distributed optimizer: each rank's fragments summed into their parameter.
        WgradsJob("tp2-dp2-distopt", tp=2, etp=2, distributed_optimizer=True),
    )
    cases = [Case(job.name, _megatron_telemetry, (job, str(tmp_path / job.name))) for job in jobs]
    report = launch(4, _run_dir(tmp_path), cases, timeout_s=600, pg_timeout_s=120)
    layouts: dict[str, tuple[ParamsAtStep, set[str]]] = {}
    for job in jobs:
        ranks = report.values(job.name)
        tensors: dict[str, Logical] = {}
        for result in ranks:
            assert result["misnumbered"] == [] and result["grad_attr"] == "main_grad", job.name
            tensors |= result["tensors"]
        assert (OUTPUT_COPY in tensors) == (job.pp > 1), job.name
        truth = true_grads(job, tensors)
        layers = {name.split(".")[2] for name in truth if name.startswith("decoder.layers.")}
        assert layers == {"0", "1", "2", "3"}, (job.name, layers)
        truths = {
            step: {name: grad * _factor(name, step) for name, grad in truth.items()}
            for step in range(1, MEGATRON_STEPS + 1)
        }
        _same_on_every_rank(ranks, job.name)
        for rank, result in enumerate(ranks):
            for step, params in result["params"].items():
                assert params is not None, (job.name, rank, step)
                # The fp32 values are exact (see _factor): so is their max |x|.
                _check_params(params, truths[step], f"{job.name} rank {rank} step {step}", 0.0)
                experts = dict(zip(params.layout.names, params.layout.expert, strict=True))
                for name in truth:
                    assert experts[name] is tensors[name].expert, (job.name, name)
                expected = math.sqrt(
                    math.fsum(float(grad.square().sum()) for grad in truths[step].values())
                )
                assert rel_err(result["norms"][step], expected) <= RTOL, (job.name, rank, step)
        history = read_history(tmp_path / job.name, source="log")
        _check_log(history, truths, f"{job.name} log", 0.0)
        layouts[job.name] = (ranks[0]["params"][1], set(truth))
    # The agreed names are the logical tensors (global layer and expert indices), with no row
    # for the tied output copy: it counts in the embedding, and gradstat norm prints none.
    for name, (params, logical) in layouts.items():
        rows = dict(
            zip(params.layout.names, zip(params.norms, params.numel, strict=True), strict=True)
        )
        extra = {row: rows[row] for row in set(rows) - logical}  # (norm, numel) of each
        assert set(rows) == logical, (name, extra, sorted(logical - set(rows)))


# --- a rank killed mid-run --------------------------------------------------------------------

KILL_STEP = 4


def _killed_at(rank: int, world_size: int, directory: str) -> dict[str, Any]:
    """Rank 1 dies at KILL_STEP, before its recorder.step; rank 0 reports what it met."""
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 3)
    recorder = gradstat.Recorder(
        model, directory, telemetry_every=1, spike=None, agree_timeout_s=1.0
    )
    grads: dict[int, dict[str, Tensor]] = {}
    for step in range(1, STEPS + 1):
        model.zero_grad()
        # The same inputs on both ranks: data-parallel replicas, counted once.
        inputs = torch.arange(8, dtype=torch.float32).reshape(2, 4) * step - 3.0
        model(inputs).square().sum().backward()
        if step == KILL_STEP and rank == 1:
            os._exit(3)
        try:
            recorder.step(step)
        except PeerTimeoutError as error:
            return {"step": step, "error": str(error), "grads": grads}
        grads[step] = {
            name: param.grad.detach().clone() for name, param in model.named_parameters()
        }
    return {"step": None, "error": None, "grads": grads}


@pytest.mark.multiprocess
@pytest.mark.slow
def test_a_rank_killed_mid_run_is_named_and_the_log_holds_every_step_before(
    tmp_path: Path,
) -> None:
    directory = tmp_path / "run"
    case = Case("killed", _killed_at, str(directory))
    report = launch(2, _run_dir(tmp_path), [case], timeout_s=120, grace_s=6.0)
    assert any("rank 1 exited with code 3" in problem for problem in report.problems)
    outcome = report.outcomes[0]["killed"]
    assert outcome.error is None, outcome.error
    result = outcome.value
    assert result["step"] == KILL_STEP, result
    assert result["error"].startswith(
        f"rank 0: rank 1 did not reach recorder.step (step {KILL_STEP}) within 1 s"
    ), result["error"]
    truths = result["grads"]
    assert sorted(truths) == list(range(1, KILL_STEP))
    history = read_history(directory, source="log")
    assert history.steps[-1] == KILL_STEP - 1
    _check_log(history, truths, "killed run's log", 0.0)

"""Real megatron-core jobs with GTP and EGTP on gloo CPU processes, dumped by the README's recipes.

What tests/test_megatron_capture.py does for megatron-core 0.16.1 (which has no GTP), for the
newest megatron-core: its ``GPTModel`` (local spec; GTP weight remat on, so every
``ColumnParallelLinear``, ``RowParallelLinear`` and ``VocabParallelEmbedding`` weight is a padded
``GTPShardedParam`` of its GTP group; MoE layers whose expert weights are sharded over EGTP),
its ``DistributedDataParallel``, ``finalize_model_grads`` and ``get_megatron_optimizer`` with the
plain and the distributed optimizer, under its ``parallel_state``.

No forward or backward runs: GTP's weight all-gather and its gradient reduce-scatter live on CUDA
streams. Each rank writes into its DDP ``main_grad`` what GTP's backward leaves there: for a
GTP-sharded weight, this rank's rows of the mean over its GTP (EGTP) group of every member's
gradient, padded as Megatron pads the weight (the reduce-scatter's mean, padding rows zero); for
any other parameter, the rank's own gradient. Every data rank's gradient of a logical tensor is
drawn from a seed of its global name and the rank's (replica, GTP) place, so the truth is known
in float64 without Megatron. Megatron then reduces: DDP's all-reduce or reduce-scatter over the
replica data-parallel group, and ``finalize_model_grads``' mean over the GTP group of the
replicated parameters.

megatron-core 0.19.2 drops ``allreduce=False`` from the expert weights it wraps for EGTP with
its own layers (:func:`restore_expert_allreduce`): its DDP then reduces them over the dense
data-parallel group, other EGTP shards of the same expert. The jobs put the attribute back
before DDP is built; one more job keeps the model as built and reports what Megatron computes
then, and whether gradstat refuses the snapshot (its expert weights say dense but carry an EGTP
group).

The CUDA-only spots are tests/_megatron.py's ``MEGATRON_JOB_SPOTS`` (the same text in 0.16.1 and
0.19.2) and :data:`SPOTS_0_19`, all recompiled from Megatron's own source pointed at the CPU,
counted, failing loudly when the source changes; Megatron's norm and zero count run through its
CPU-pointed ``clip_grads`` (ranks.megatron_clip_grads_on_cpu).
"""

from __future__ import annotations

import json
import math
import re
import warnings
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import ranks
import torch
from torch import Tensor

from gradstat.snapshot import dump_rank
from gradstat.snapshot.capture import gradients_to_dump
from tests._cli import recipe, run_gradstat
from tests._megatron import (
    MEGATRON_JOB_SPOTS,
    CudaSpot,
    GptSize,
    megatron_gpt_job,
    point_megatron_at_cpu,
)
from tests._oracle import float64_norm, rel_err, zeros_in

# FFN, VOCAB and EXPERT_FFN are not multiples of GTP's alignment (pad_for_alignment 16 x the
# group size): Megatron pads those weights, and the second expert fc1 shard is all padding.
LAYERS, HIDDEN, HEADS, FFN, VOCAB, SEQUENCE = 2, 32, 4, 40, 72, 16
EXPERTS, EXPERT_FFN = 4, 16
ITERATION = 1000
EMBEDDING = "embedding.word_embeddings.weight"
UNSEEN_TOKENS = (3, 17, 40, 60)  # embedding rows no token touched: zeros in every replica
ZERO_EXPERT = 1  # an expert no token was routed to
ZERO_BIAS = "decoder.layers.1.self_attention.linear_qkv.bias"
BUCKET_SIZE = 3000  # several buckets per buffer: fragments from more than one bucket
SIZE = GptSize(LAYERS, HIDDEN, HEADS, FFN, VOCAB, SEQUENCE, EXPERTS, EXPERT_FFN, BUCKET_SIZE)
LIVE_RTOL = 1e-6  # Megatron reduces in fp32; gradstat reads the fp32 main_grads it left

# megatron-core 0.19's own CUDA-only spots on that path, beyond tests/_megatron.py's:
# - finalize_model_grads fences the current CUDA stream against GTP's backward streams (none
#   exist without a forward and backward; a CUDA stream left there would fail loudly);
# - a bucket group's start_grad_sync makes the current CUDA stream wait for CUDA-graph replay
#   events (none on the CPU).
SPOTS_0_19 = (
    CudaSpot(
        "megatron.core.tensor_parallel.generalized_tensor_parallelism",
        "",
        "wait_for_gtp_grad_reduction_on_current_stream",
        (("torch.cuda.current_stream()", "torch.cpu.current_stream()", 1),),
        rebind="megatron.core.tensor_parallel.gtp_api",
    ),
    CudaSpot(
        "megatron.core.distributed.param_and_grad_buffer",
        "_ParamAndGradBucketGroup",
        "start_grad_sync",
        (
            (
                "current_stream = torch.cuda.current_stream()",
                "current_stream = torch.cpu.current_stream()",
                1,
            ),
        ),
    ),
)


@dataclass(frozen=True)
class LiveJob:
    """A Megatron layout with GTP (and EGTP for the MoE layers); TP and PP 1."""

    name: str
    gtp: int
    dp: int
    ep: int = 1
    egtp: int = 1
    distributed_optimizer: bool = False
    # The model as megatron-core builds it, expert GTP weights without allreduce=False (see
    # restore_expert_allreduce): Megatron's own numbers against float64, and gradstat's verdict.
    as_built: bool = False

    @property
    def world_size(self) -> int:
        return self.gtp * self.dp

    @property
    def moe(self) -> bool:
        return self.ep > 1

    @property
    def edp(self) -> int:
        return self.world_size // (self.ep * self.egtp)

    @property
    def optimizer(self) -> str:
        return "distopt" if self.distributed_optimizer else "plain"

    @property
    def case(self) -> str:
        return f"{self.name} {self.optimizer}" + (" as-built" if self.as_built else "")

    @property
    def folder(self) -> str:
        return self.case.replace(" ", "_")


# GTP and EGTP groups of the same size: Megatron scales expert gradients by 1/(dp x egtp) and
# dense ones by 1/(dp x gtp), the mean over data ranks only when the two agree.
LIVE_JOBS = (
    *(
        LiveJob(name, gtp=2, dp=2, distributed_optimizer=distributed, **expert)
        for name, expert in (("gtp2-dp2", {}), ("gtp2-dp2+ep2-egtp2", {"ep": 2, "egtp": 2}))
        for distributed in (False, True)
    ),
    LiveJob("gtp2-dp2+ep2-egtp2", gtp=2, dp=2, ep=2, egtp=2, as_built=True),
)


# --- known gradients ----------------------------------------------------------------------------


def replica_grad(name: str, place: str, shape: list[int]) -> Tensor:
    """One data rank's float64 gradient (fp32 values) of the logical tensor ``name``, with the
    structural zeros a real batch leaves; ``place`` is the rank's "replica.gtp" place."""
    generator = torch.Generator().manual_seed(zlib.crc32(f"{name}/{place}".encode()))
    grad = torch.randn(shape, generator=generator, dtype=torch.float64).float().double()
    if name == EMBEDDING:
        grad[list(UNSEEN_TOKENS)] = 0.0
    if f"local_experts.{ZERO_EXPERT}." in name or name == ZERO_BIAS:
        grad.zero_()
    return grad


def _global_name(local: str, job: LiveJob, ep_rank: int) -> str:
    """Megatron's parameter name with the rank's experts numbered globally and DDP's
    ``module.`` dropped (worked out here, not by gradstat)."""
    return re.sub(
        r"\.local_experts\.(\d+)\.",
        lambda m: f".local_experts.{int(m[1]) + ep_rank * EXPERTS // job.ep}.",
        local.removeprefix("module."),
    )


def _fill_main_grads(model: list[Any], job: LiveJob) -> dict[str, dict[str, Any]]:
    """Each parameter's ``main_grad`` gets what GTP's backward leaves there (see the module
    docstring); returns {global name: its full shape, whether an expert, padding elements in
    this rank's shard when it is the first replica (so that summing over ranks counts each
    once)}."""
    from megatron.core import parallel_state as ps

    groups = {
        False: (
            ps.get_data_parallel_group(with_gtp_remat=False),
            ps.get_gtp_weight_remat_group(),
        ),
        True: (
            ps.get_expert_data_parallel_group(with_gtp_remat=False),
            ps.get_expert_gtp_weight_remat_group(),
        ),
    }
    ep_rank = ps.get_expert_model_parallel_rank()
    tensors = {}
    for local, param in model[0].named_parameters():
        name = _global_name(local, job, ep_rank)
        # By name, not by Megatron's attributes (see restore_expert_allreduce).
        expert = ".local_experts." in name
        replica_group, remat_group = groups[expert]
        replica, remat, remat_size = replica_group.rank(), remat_group.rank(), remat_group.size()
        sharded = getattr(param, "is_gtp_weight_remat", False)
        shape = list(param.shape)
        pad_rows = int(param.pad_length) if sharded else 0
        if sharded:
            shape[0] = shape[0] * remat_size - pad_rows
        if sharded:
            padded = [
                torch.nn.functional.pad(
                    replica_grad(name, f"{replica}.{peer}", shape), _rows(pad_rows, shape)
                )
                for peer in range(remat_size)
            ]
            rows = param.shape[0]
            mean = torch.stack(padded).sum(0) / remat_size
            grad = mean[remat * rows : (remat + 1) * rows]
            real_rows = max(0, min(rows, shape[0] - remat * rows))
            pad_here = (rows - real_rows) * math.prod(shape[1:])
        else:
            grad = replica_grad(name, f"{replica}.{remat}", shape)
            pad_here = 0
        param.main_grad.copy_(grad)
        tensors[name] = {
            "shape": shape,
            "expert": expert,
            "gtp_sharded": sharded,
            "padding": pad_here if replica == 0 else 0,
        }
    return tensors


def _rows(pad_rows: int, shape: list[int]) -> tuple[int, ...]:
    """torch.nn.functional.pad's argument that appends ``pad_rows`` zero rows (dim 0)."""
    return (0, 0) * (len(shape) - 1) + (0, pad_rows)


def true_grads(job: LiveJob, tensors: dict[str, dict[str, Any]]) -> dict[str, Tensor]:
    """The float64 gradient of every logical tensor of the global batch's mean loss: the sum of
    the gradients of every data rank that holds it (dense: dp x gtp places; an expert: the
    edp x egtp places of its EP rank, which together saw every token routed to it) over the
    number of data ranks, dp x gtp."""
    truth = {}
    for name, spec in tensors.items():
        replicas, remat = (job.edp, job.egtp) if spec["expert"] else (job.dp, job.gtp)
        total = torch.zeros(spec["shape"], dtype=torch.float64)
        for replica in range(replicas):
            for peer in range(remat):
                total += replica_grad(name, f"{replica}.{peer}", spec["shape"])
        truth[name] = total / (job.dp * job.gtp)
    return truth


def expert_weight_error(model: list[Any], job: LiveJob, tensors: dict[str, Any]) -> float:
    """How far Megatron's reduced ``main_grad`` of this rank's GTP-sharded expert weights is
    from their float64 truth (L2 of the difference over L2 of the truth, this rank's shards);
    whole ``main_grad``s hold reduced values with the plain optimizer only."""
    from megatron.core import parallel_state as ps

    ep_rank, place = ps.get_expert_model_parallel_rank(), ps.get_expert_gtp_weight_remat_rank()
    squared_error = squared_truth = 0.0
    for local, param in model[0].named_parameters():
        name = _global_name(local, job, ep_rank)
        if ".local_experts." not in name or not getattr(param, "is_gtp_weight_remat", False):
            continue
        shape = tensors[name]["shape"]
        truth = true_grads(job, {name: tensors[name]})[name]
        padded = torch.nn.functional.pad(truth, _rows(int(param.pad_length), shape))
        rows = param.shape[0]
        expected = padded[place * rows : (place + 1) * rows]
        squared_error += float((param.main_grad.double() - expected).square().sum())
        squared_truth += float(expected.square().sum())
    return math.sqrt(squared_error / squared_truth) if squared_truth else 0.0


# --- one rank -----------------------------------------------------------------------------------


def restore_expert_allreduce(chunk: torch.nn.Module) -> int:
    """``allreduce=False`` put back on the expert weights GTP wrapped; returns how many.

    megatron-core 0.19.2's ``ColumnParallelLinear``/``RowParallelLinear`` set ``allreduce=False``
    on an expert's weight, then ``wrap_module_params_gtp`` replaces the weight with a
    ``GTPShardedParam`` that ``_gtp_slice_one_param`` gives only the TP attributes: the expert
    weight reads as dense. Megatron's DDP then puts it in the dense buffer and reduces it over
    the dense data-parallel group (other EGTP shards of the same expert), and the parameter's
    ``group`` (its EGTP group) contradicts its dense kind. Restored here as those layers set it
    (``is_expert`` with expert parallelism), before DDP builds its buffers.
    """
    restored = 0
    for module in chunk.modules():
        weight = getattr(module, "weight", None)
        if not getattr(module, "is_expert", False) or not getattr(
            weight, "is_gtp_weight_remat", False
        ):
            continue
        if not hasattr(weight, "allreduce"):
            weight.allreduce = False
            restored += 1
    return restored


def _build(job: LiveJob) -> tuple[list[Any], Any, int]:
    """Megatron's GPT model of this rank (GTP on) wrapped in its DDP, its optimizer, and how
    many expert weights got allreduce=False back (none for an ``as_built`` job)."""
    restored = []

    def restore(chunk: Any) -> None:
        restored.append(0 if job.as_built else restore_expert_allreduce(chunk))

    model, optimizer = megatron_gpt_job(
        SIZE,
        moe=job.moe,
        distributed_optimizer=job.distributed_optimizer,
        before_ddp=restore,
        expert_model_parallel_size=job.ep,
        gtp_weight_remat_size=job.gtp,
        expert_gtp_weight_remat_size=job.egtp,
    )
    return model, optimizer, restored[0]


def run_live_job(rank: int, world_size: int, arg: tuple[LiveJob, str]) -> dict[str, Any]:
    """One rank of one job: gradients reduced by Megatron, the README's recipes (``megatron``,
    ``recorder_setup``, ``recorder_step``), and Megatron's own grad norm and zero count."""
    from megatron.core import parallel_state as ps
    from megatron.core.distributed import finalize_model_grads

    job, root = arg
    assert world_size == job.world_size, (world_size, job)
    ps.initialize_model_parallel(
        expert_model_parallel_size=job.ep,
        expert_tensor_parallel_size=1,
        gtp_remat_size=job.gtp,
        expert_gtp_remat_size=job.egtp,
        create_gloo_process_groups=False,
    )
    try:
        ranks.megatron_clip_grads_on_cpu()
        point_megatron_at_cpu((*MEGATRON_JOB_SPOTS, *SPOTS_0_19))
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            model, optimizer, restored = _build(job)
        tensors = _fill_main_grads(model, job)
        finalize_model_grads(model)
        result: dict[str, Any] = {"tensors": tensors, "optimizer": type(optimizer).__name__}
        result["restored_allreduce"] = restored
        if job.moe and not job.distributed_optimizer:
            result["expert_weight_error"] = expert_weight_error(model, job, tensors)
        result["gtp_params"] = sum(
            getattr(param, "is_gtp_weight_remat", False) for param in model[0].parameters()
        )
        namespace = {"model": model, "optimizer": optimizer, "iteration": ITERATION}
        exec(recipe("megatron"), namespace | {"directory": f"{root}/{job.name}"})
        if not job.as_built:
            # The README's flight-recorder recipes, the step listed so that it dumps.
            looped = namespace | {"directory": f"{root}/{job.name}-recorder", "step": ITERATION}
            exec(recipe("recorder_setup"), looped)
            looped["recorder"].steps = frozenset({ITERATION})
            exec(recipe("recorder_step"), looped)
            result["recorder_norm"] = looped["recorder"].records[-1].norm
            dumped, _, _ = gradients_to_dump(model, optimizer)
            result["dumped_gtp_pad_zeros"] = sum(
                int(getattr(param, "gtp_pad_zeros", 0)) for _, param in dumped
            )
            # Issue 18's trap: dp read with GTP folded in (parallel_state's default) must make
            # a snapshot the reader refuses, not one it merges.
            folded = [ps.get_data_parallel_rank(), ps.get_data_parallel_world_size()]
            dump_rank(
                f"{root}/{job.name}-gtp-folded-dp",
                model,
                optimizer=optimizer,
                step=ITERATION,
                coords={"dp": folded},
            )
        # Megatron's own numbers, as its training step computes them before stepping.
        optimizer.prepare_grads()
        result["megatron_norm"] = float(optimizer.get_grad_norm())
        result["megatron_zeros"] = int(optimizer.count_zeros())
        return result
    finally:
        ps.destroy_model_parallel()


# --- the rows of the report ---------------------------------------------------------------------


class Report(Protocol):
    lines: list[str]

    def check(self, ok: bool, failure: str) -> bool: ...

    def row(self, *cells: str, widths: tuple[int, ...]) -> None: ...


LIVE_WIDTHS = (20, 9, 9, 9, 9, 9, 7, 7, 7, 8, 6, 0)
LIVE_HEADER = (
    "layout", "optimizer", "L2 gstat", "vs mcore", "recorder", "per-param", "gstat", "float64",
    "mcore", "padding", "audit", "zeros verdict",
)  # fmt: skip


def _cli(*args: str) -> tuple[int, dict[str, Any]]:
    """gradstat's exit status and JSON document ({"error": its stderr} when it refused)."""
    result = run_gradstat(*args, "--json")
    if not result.stdout:
        if result.returncode == 2:
            return 2, {"error": result.stderr.strip()}
        raise RuntimeError(f"gradstat {' '.join(args)} exited {result.returncode}: {result.stderr}")
    return result.returncode, json.loads(result.stdout)


def _as_built_row(report: Report, job: LiveJob, values: list[dict[str, Any]], root: Path) -> None:
    """The model as megatron-core builds it: Megatron's own norm against float64, and whether
    gradstat refuses the snapshot whose expert weights say dense but carry an EGTP group."""
    tensors = {name: spec for value in values for name, spec in value["tensors"].items()}
    truth = true_grads(job, tensors)
    expected_norm = float64_norm(truth.values(), 2)
    megatron = max(rel_err(value["megatron_norm"], expected_norm) for value in values)
    experts = max(value["expert_weight_error"] for value in values)
    report.check(
        experts > 1e-3 and all(value["restored_allreduce"] == 0 for value in values),
        f"{job.case}: Megatron's expert gradients are right without allreduce=False restored "
        f"({experts:.1e} off float64): restore_expert_allreduce is no longer needed",
    )
    code, norm = _cli("norm", str(root / job.name / f"grads-{ITERATION}"))
    refused = code == 2 and "does not match" in norm.get("error", "")
    report.check(refused, f"{job.case}: gradstat did not refuse the inconsistent snapshot")
    reason = norm.get("error", "").rpartition(": ")[2] if refused else f"exit {code}"
    report.lines.append(
        f"{job.case}: expert GTP weights left dense (no allreduce=False): Megatron's reduced "
        f"expert weight gradients {experts:.1e} off float64 (L2 of the difference), its L2 "
        f"norm {megatron:.1e} off; gradstat norm exits {code} ({reason})"
    )


def _fmt(error: float) -> str:
    return "0" if error == 0 else f"{error:.0e}"


def live_rows(report: Report, job: LiveJob, values: list[dict[str, Any]], root: Path) -> None:
    """The CLI on the job's snapshots against float64 and Megatron's live numbers: one row."""
    tensors: dict[str, dict[str, Any]] = {}
    padding = 0
    for value in values:
        for name, spec in value["tensors"].items():
            padding += spec["padding"]
            tensors[name] = spec
    where = job.case
    if job.as_built:
        _as_built_row(report, job, values, root)
        return
    report.check(
        all(value["gtp_params"] > 0 for value in values), f"{where}: no GTP-sharded weight"
    )
    report.check(padding > 0, f"{where}: no GTP padding: the zero counts prove nothing")
    truth = true_grads(job, tensors)
    expected_norm = float64_norm(truth.values(), 2)
    expected_zeros = zeros_in(truth.values())

    snapshot = str(root / job.name / f"grads-{ITERATION}")  # where the recipe dumps
    code, norm = _cli("norm", snapshot)
    report.check(code == 0, f"{where}: norm exited {code}")
    report.check(
        norm["snapshot"]["distributed_optimizer"] is job.distributed_optimizer,
        f"{where}: the snapshot's distributed_optimizer is not {job.distributed_optimizer}",
    )
    error = rel_err(norm["total_norm"], expected_norm)
    report.check(error <= LIVE_RTOL, f"{where}: L2 {norm['total_norm']} vs float64 {expected_norm}")
    per_param = {entry["name"]: entry["norm"] for entry in norm["params"]}
    report.check(
        set(per_param) == set(truth), f"{where}: the snapshot's tensors are not the model's"
    )
    worst_param = 0.0
    for name, grad in truth.items():
        expected = float64_norm([grad], 2)
        off = abs(per_param.get(name, math.nan) - expected) / max(expected, 1e-3)
        worst_param = off if math.isnan(off) else max(worst_param, off)
    report.check(worst_param <= LIVE_RTOL, f"{where}: a parameter's norm is off float64")
    _, zeros = _cli("zeros", snapshot)
    report.check(
        zeros["num_zeros"] == expected_zeros,
        f"{where}: zeros {zeros['num_zeros']} vs float64 {expected_zeros}",
    )
    elements = sum(grad.numel() for grad in truth.values())
    report.check(
        zeros["num_elements"] == elements,
        f"{where}: {zeros['num_elements']} elements vs the model's {elements} (padding excluded)",
    )
    code, audit = _cli("audit", snapshot)
    findings = [finding.get("kind", str(finding)) for finding in audit["findings"]]
    report.check(code == 0 and not findings, f"{where}: audit exited {code}, {findings}")

    megatron_norms = [value["megatron_norm"] for value in values]
    vs_megatron = max(rel_err(norm["total_norm"], m) for m in megatron_norms)
    report.check(vs_megatron <= LIVE_RTOL, f"{where}: L2 vs Megatron's optimizer {vs_megatron:.1e}")
    megatron_zeros = {value["megatron_zeros"] for value in values}
    if megatron_zeros == {expected_zeros}:
        verdict = "agree"
    elif megatron_zeros == {expected_zeros + padding}:
        verdict = "gradstat right: Megatron counts the padding"
    else:
        verdict = "UNEXPLAINED"
    report.check(verdict != "UNEXPLAINED", f"{where}: Megatron zeros {megatron_zeros}")

    recorder = max(rel_err(value["recorder_norm"], expected_norm) for value in values)
    recorded = root / f"{job.name}-recorder" / f"step-{ITERATION:08d}"
    _, from_recorder = _cli("norm", str(recorded))
    recorder = max(recorder, rel_err(from_recorder["total_norm"], expected_norm))
    report.check(recorder <= LIVE_RTOL, f"{where}: the recorder's norm is off float64")
    code, _ = _cli("norm", str(root / f"{job.name}-gtp-folded-dp"))
    report.check(code == 2, f"{where}: a snapshot with dp read with GTP folded in was not refused")
    if job.moe and not job.distributed_optimizer:
        experts = max(value["expert_weight_error"] for value in values)
        report.check(
            experts <= LIVE_RTOL, f"{where}: Megatron's expert gradients {experts:.1e} off"
        )
    if job.moe:
        restored = {value["restored_allreduce"] for value in values}
        report.check(
            restored == {LAYERS * EXPERTS // job.ep * 2},
            f"{where}: allreduce=False restored on {restored} expert weights per rank",
        )
    if job.distributed_optimizer:
        stamped = sum(value["dumped_gtp_pad_zeros"] for value in values)
        report.check(
            stamped == padding, f"{where}: fragments stamped {stamped} pad zeros of {padding}"
        )

    cells = [job.name, job.optimizer, _fmt(error), _fmt(vs_megatron), _fmt(recorder)]
    cells += [_fmt(worst_param), str(zeros["num_zeros"]), str(expected_zeros)]
    cells += [",".join(map(str, sorted(megatron_zeros))), str(padding)]
    report.row(*cells, ", ".join(findings) or "clean", verdict, widths=LIVE_WIDTHS)

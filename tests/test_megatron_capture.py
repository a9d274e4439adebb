"""The README's Megatron recipe in real Megatron jobs: megatron-core's ``GPTModel``,
``DistributedDataParallel``, ``finalize_model_grads`` and ``get_megatron_optimizer`` (plain and
distributed optimizer) under its ``parallel_state``, on gloo CPU processes.

Each rank writes known per-replica gradients into its DDP ``main_grad`` buffer (what backward
would accumulate there), then Megatron reduces them: all-reduce or reduce-scatter over data
parallelism, and the tied embedding's all-reduce across pipeline stages. Every replica's
gradient of a logical tensor is drawn from a seed of its global name, so the test process
computes the true gradient (the mean over replicas, the tied copies summed) in float64 without
Megatron. The snapshot the README's recipe dumps must give, through ``norm``, ``zeros`` and
``audit``, the float64 statistics and Megatron's own (its optimizer's grad norm and zero count);
dumped without ``optimizer=``, a distributed-optimizer job must be refused, while its whole
``main_grad`` buffers, forced through as pairs, read as a wrong norm.

megatron-core 0.16.1 runs on the CPU but for a few spots that allocate on CUDA or test for
CUDA tensor types: tests/_megatron.py's ``point_megatron_at_cpu`` recompiles exactly those
functions from their own source with the device strings pointed at the CPU, and fails when a
spot is not where expected, so the workaround never silently stops applying.
"""

from __future__ import annotations

import importlib.util
import json
import re
import warnings
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import Tensor

import gradstat
from gradstat.errors import SnapshotError
from gradstat.snapshot import dump_rank
from gradstat.testing import Case, launch
from tests._cli import recipe, run_gradstat
from tests._megatron import GptSize, megatron_gpt_job
from tests._oracle import float64_norm, rel_err, zeros_in

pytestmark = [
    pytest.mark.multiprocess,
    pytest.mark.slow,
    pytest.mark.skipif(importlib.util.find_spec("megatron") is None, reason="needs megatron-core"),
    pytest.mark.filterwarnings("ignore:Transformer Engine and Apex are not installed:UserWarning"),
]

LAYERS, HIDDEN, HEADS, FFN, VOCAB, SEQUENCE = 4, 32, 4, 64, 64, 16
EXPERTS, EXPERT_FFN = 4, 16
ITERATION = 1000
EMBEDDING = "embedding.word_embeddings.weight"
OUTPUT_COPY = "output_layer.weight"
UNSEEN_TOKENS = (3, 17, 40)  # embedding rows no token touched: exact zeros in every replica
ZERO_EXPERT = 1  # an expert no token was routed to
ZERO_BIAS = "decoder.layers.1.self_attention.linear_qkv.bias"
# Several buckets per buffer, so fragments' ranges come from more than one bucket.
BUCKET_SIZE = 3000
SIZE = GptSize(LAYERS, HIDDEN, HEADS, FFN, VOCAB, SEQUENCE, EXPERTS, EXPERT_FFN, BUCKET_SIZE)


@dataclass(frozen=True)
class Job:
    """A Megatron parallel layout; dp follows from the world size."""

    name: str
    tp: int = 1
    pp: int = 1
    ep: int = 1
    distributed_optimizer: bool = False

    @property
    def moe(self) -> bool:
        return self.ep > 1


# --- Megatron on the CPU ----------------------------------------------------------------------


def _point_megatron_at_cpu() -> None:
    """megatron-core's CUDA-only spots on the path from GPTModel to the optimizer, on the CPU
    (tests/_megatron.py's MEGATRON_JOB_SPOTS), and its clip_grads wired in pointed at the CPU."""
    from tests._megatron import _use_cpu_clip_grads, megatron_clip_grads, point_megatron_at_cpu

    if point_megatron_at_cpu():
        _use_cpu_clip_grads(megatron_clip_grads())


# --- known gradients ----------------------------------------------------------------------------


def replica_grad(name: str, replica: int, shape: tuple[int, ...]) -> Tensor:
    """One data-parallel replica's fp32 gradient of the logical tensor ``name`` (global name),
    with the structural zeros a real batch leaves."""
    generator = torch.Generator().manual_seed(zlib.crc32(f"{name}/{replica}".encode()))
    grad = torch.randn(shape, generator=generator, dtype=torch.float64).to(torch.float32)
    if name in (EMBEDDING, OUTPUT_COPY):
        grad[list(UNSEEN_TOKENS)] = 0.0
    if f"local_experts.{ZERO_EXPERT}." in name or name == ZERO_BIAS:
        grad.zero_()
    return grad


def _global_name(local: str, job: Job, stage: int, ep_rank: int) -> str:
    """Megatron's parameter name with the stage's layers and the rank's experts numbered
    globally and DDP's ``module.`` dropped (worked out here, not by gradstat)."""
    name = local.removeprefix("module.")
    name = re.sub(
        r"^decoder\.layers\.(\d+)\.",
        lambda m: f"decoder.layers.{int(m[1]) + stage * LAYERS // job.pp}.",
        name,
    )
    return re.sub(
        r"\.local_experts\.(\d+)\.",
        lambda m: f".local_experts.{int(m[1]) + ep_rank * EXPERTS // job.ep}.",
        name,
    )


# --- one rank -----------------------------------------------------------------------------------


def _build(job: Job) -> tuple[Any, Any]:
    """Megatron's GPT chunk of this rank wrapped in its DDP, and its optimizer."""
    return megatron_gpt_job(
        SIZE,
        moe=job.moe,
        distributed_optimizer=job.distributed_optimizer,
        tensor_model_parallel_size=job.tp,
        pipeline_model_parallel_size=job.pp,
        expert_model_parallel_size=job.ep,
    )


def _fill_main_grads(model: list[Any], job: Job) -> dict[str, tuple[list[int], bool]]:
    """Each parameter's ``main_grad`` gets this replica's TP shard of its known gradient, as
    backward leaves it before the reduction; returns {global name: (full shape, expert)}."""
    from megatron.core import parallel_state as ps

    stage, ep_rank = ps.get_pipeline_model_parallel_rank(), ps.get_expert_model_parallel_rank()
    tensors = {}
    for local, param in model[0].named_parameters():
        name = _global_name(local, job, stage, ep_rank)
        expert = not getattr(param, "allreduce", True)
        if expert:
            replica = ps.get_expert_data_parallel_rank()
            tp_rank = ps.get_expert_tensor_parallel_rank()
            tp_size = ps.get_expert_tensor_parallel_world_size()
        else:
            replica = ps.get_data_parallel_rank()
            tp_rank = ps.get_tensor_model_parallel_rank()
            tp_size = ps.get_tensor_model_parallel_world_size()
        shape = list(param.shape)
        split = getattr(param, "tensor_model_parallel", False)
        if split:
            shape[param.partition_dim] *= tp_size
        full = replica_grad(name, replica, tuple(shape))
        local_grad = full.chunk(tp_size, dim=param.partition_dim)[tp_rank] if split else full
        param.main_grad.copy_(local_grad)
        tensors[name] = (shape, expert)
    return tensors


def _megatron_job(rank: int, world_size: int, arg: tuple[Job, str]) -> dict[str, Any]:
    """One rank of one job: gradients reduced by Megatron, the README's recipe, Megatron's own
    statistics, and the two ways of dumping a distributed-optimizer job wrongly."""
    from megatron.core import parallel_state as ps
    from megatron.core.distributed import finalize_model_grads

    job, root = arg
    ps.initialize_model_parallel(
        tensor_model_parallel_size=job.tp,
        pipeline_model_parallel_size=job.pp,
        expert_model_parallel_size=job.ep,
        expert_tensor_parallel_size=1,
        create_gloo_process_groups=False,
    )
    try:
        _point_megatron_at_cpu()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            model, optimizer = _build(job)
        tensors = _fill_main_grads(model, job)
        finalize_model_grads(model)
        namespace = {"model": model, "optimizer": optimizer, "iteration": ITERATION}
        exec(recipe("megatron"), namespace | {"directory": f"{root}/{job.name}"})
        result: dict[str, Any] = {"tensors": tensors, "optimizer": type(optimizer).__name__}
        # The README's flight-recorder recipes, the step listed so that it dumps.
        looped = namespace | {"directory": f"{root}/{job.name}-recorder", "step": ITERATION}
        exec(recipe("recorder_setup"), looped)
        looped["recorder"].steps = frozenset({ITERATION})
        exec(recipe("recorder_step"), looped)
        result["recorder_norm"] = looped["recorder"].records[-1].norm
        if job.distributed_optimizer:
            try:
                dump_rank(f"{root}/{job.name}-no-optimizer", model, step=ITERATION)
            except SnapshotError as error:
                result["refused"] = str(error)
            stage, ep_rank = (
                ps.get_pipeline_model_parallel_rank(),
                ps.get_expert_model_parallel_rank(),
            )
            whole = [
                (_global_name(local, job, stage, ep_rank), param)
                for local, param in model[0].named_parameters()
            ]
            dump_rank(f"{root}/{job.name}-whole-main-grad", whole, step=ITERATION)
            try:
                gradstat.Recorder(model, f"{root}/{job.name}-recorder-no-optimizer")
            except SnapshotError as error:
                result["recorder_refused"] = str(error)
        # Megatron's own numbers, as its training step computes them before stepping.
        optimizer.prepare_grads()
        result["megatron_norm"] = float(optimizer.get_grad_norm())
        result["megatron_zeros"] = int(optimizer.count_zeros())
        return result
    finally:
        ps.destroy_model_parallel()


# --- the truth and the CLI ----------------------------------------------------------------------


def true_grads(
    job: Job, world_size: int, tensors: dict[str, tuple[list[int], bool]]
) -> dict[str, Tensor]:
    """The float64 gradient of every logical tensor of the global batch's mean loss.

    Each replica's gradient is summed over the replicas that hold the tensor (the data-parallel
    ones; for an expert, the expert-data-parallel ones, which together saw every token routed to
    it) and divided by the dense data-parallel size, the number of local losses averaged. The
    tied output copy's gradient adds to the embedding's (the copy is not a tensor of its own).
    """
    dense_replicas = world_size // (job.tp * job.pp)
    expert_replicas = world_size // (job.ep * job.pp)
    truth = {}
    for name, (shape, expert) in tensors.items():
        if name == OUTPUT_COPY:
            continue
        replicas = expert_replicas if expert else dense_replicas
        parts = [name, OUTPUT_COPY] if name == EMBEDDING and OUTPUT_COPY in tensors else [name]
        total = torch.zeros(shape, dtype=torch.float64)
        for replica in range(replicas):
            for part in parts:
                total += replica_grad(part, replica, tuple(shape)).double()
        truth[name] = total / dense_replicas
    return truth


def _cli(*args: str) -> tuple[int, dict[str, Any]]:
    result = run_gradstat(*args, "--json")
    assert result.stdout, f"gradstat {' '.join(args)} printed nothing: {result.stderr}"
    return result.returncode, json.loads(result.stdout)


def _params(document: dict[str, Any], key: str) -> dict[str, float]:
    return {entry["name"]: entry[key] for entry in document["params"]}


GROUPS = {
    4: [
        Job("tp2-dp2", tp=2),
        Job("tp2-dp2-distopt", tp=2, distributed_optimizer=True),
        Job("ep2-dp4", ep=2),
        Job("ep2-dp4-distopt", ep=2, distributed_optimizer=True),
    ],
    8: [
        Job("tp2-pp2-dp2-tied", tp=2, pp=2),
        Job("tp2-pp2-dp2-tied-distopt", tp=2, pp=2, distributed_optimizer=True),
    ],
}


@pytest.mark.parametrize("world_size", sorted(GROUPS))
def test_the_readme_recipe_in_megatron_jobs(world_size: int, tmp_path: Path) -> None:
    run_dir, root = tmp_path / "run", tmp_path / "snapshots"
    run_dir.mkdir()
    jobs = GROUPS[world_size]
    cases = [Case(job.name, _megatron_job, (job, str(root))) for job in jobs]
    report = launch(world_size, run_dir, cases, timeout_s=900, pg_timeout_s=120)
    for job in jobs:
        ranks = report.values(job.name)
        tensors: dict[str, tuple[list[int], bool]] = {}
        for result in ranks:
            tensors |= result["tensors"]
        truth = true_grads(job, world_size, tensors)
        expected_norm = float64_norm(truth.values(), 2)
        expected_zeros = zeros_in(truth.values())
        assert expected_zeros > 0 and (job.pp == 1) == (OUTPUT_COPY not in tensors)
        kind = "ChainedOptimizer"
        assert {result["optimizer"] for result in ranks} == {kind}, job.name

        snapshot = str(root / job.name / f"grads-{ITERATION}")  # where the recipe dumps
        code, norm = _cli("norm", snapshot)
        assert code == 0, (job.name, norm)
        assert norm["snapshot"]["distributed_optimizer"] is job.distributed_optimizer
        per_param = _params(norm, "norm")
        assert rel_err(norm["total_norm"], expected_norm) <= 1e-6, job.name
        assert set(per_param) == set(truth), job.name
        for name, grad in truth.items():
            expected = float64_norm([grad], 2)
            assert abs(per_param[name] - expected) <= 1e-6 * max(expected, 1e-3), (job.name, name)
        code, zeros = _cli("zeros", snapshot)
        assert zeros["num_zeros"] == expected_zeros, job.name
        assert zeros["num_elements"] == sum(grad.numel() for grad in truth.values()), job.name
        code, audit = _cli("audit", snapshot)
        # The one finding of a clean MoE job: ZERO_EXPERT, which no token reaches, per layer.
        unrouted = [
            ("expert_never_routed", f"decoder.layers.{layer}.mlp.experts[{ZERO_EXPERT}]")
            for layer in range(LAYERS if job.moe else 0)
        ]
        found = [(finding["kind"], finding["name"]) for finding in audit["findings"]]
        assert code == (1 if unrouted else 0) and sorted(found) == unrouted, (job.name, found)

        megatron_norm = ranks[0]["megatron_norm"]
        print(
            f"{job.name}: L2 {norm['total_norm']:.6f}, rel. error vs float64 "
            f"{rel_err(norm['total_norm'], expected_norm):.1e}, vs Megatron "
            f"{rel_err(norm['total_norm'], megatron_norm):.1e}; zeros {zeros['num_zeros']} "
            f"(float64 {expected_zeros}, Megatron {ranks[0]['megatron_zeros']})"
        )
        # Megatron's own numbers on every rank, the same as the snapshot's.
        for result in ranks:
            assert rel_err(result["megatron_norm"], norm["total_norm"]) <= 1e-6, job.name
            assert result["megatron_zeros"] == expected_zeros, job.name

        # The flight recorder's norm, and the snapshot it dumped, are the same numbers.
        for result in ranks:
            assert rel_err(result["recorder_norm"], expected_norm) <= 1e-6, job.name
        recorded = root / f"{job.name}-recorder" / f"step-{ITERATION:08d}"
        code, from_recorder = _cli("norm", str(recorded))
        assert code == 0 and rel_err(from_recorder["total_norm"], expected_norm) <= 1e-6, job.name
        assert from_recorder["snapshot"]["distributed_optimizer"] is job.distributed_optimizer

        if job.distributed_optimizer:
            # Without optimizer= the job is refused on every rank, by dump_rank and the
            # recorder alike ...
            for result in ranks:
                for key in ("refused", "recorder_refused"):
                    message = result.get(key, "")
                    assert "pass optimizer=optimizer" in message, (job.name, key)
                    assert "\n" not in message, (job.name, key)
            assert not (root / f"{job.name}-no-optimizer").exists()
            # ... because the whole main_grad buffers hold unreduced values outside each
            # rank's range: the number they give is wrong.
            code, whole = _cli("norm", str(root / f"{job.name}-whole-main-grad"))
            assert rel_err(whole["total_norm"], expected_norm) > 1e-3, job.name

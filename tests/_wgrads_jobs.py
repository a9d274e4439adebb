"""Real megatron-core jobs that dump their gradients as Megatron's ``--save-wgrads-interval``
does, and the float64 truth of those gradients computed without Megatron.

Each rank builds megatron-core's ``GPTModel`` chunks (local layer spec, output layer tied to the
embedding), wraps them in its ``DistributedDataParallel``, writes known per-replica gradients
into ``main_grad`` (what backward would accumulate there), lets ``finalize_model_grads`` reduce
them, and then writes ``<root>/wgrads/iter_NNNNNNN/mp_rank_TT[_PPP][_EEE].pth`` in the layout
megatron-core 0.19.2 writes (facts read from its ``megatron/training/training.py``,
``train_step``'s ``_save_state_dict``, and ``megatron/training/checkpointing.py``,
``save_grads``; the code here is this project's own):

- only ranks whose expert-data-parallel rank is 0 write;
- one ``torch.save`` of ``{"model_chunk{i}": {name: param.main_grad.cpu()}}``, names from each
  chunk's unwrapped module's ``named_parameters()`` (no DDP ``module.``), parameters that have
  a ``main_grad`` only;
- the file is ``mp_rank_{tp:02d}``, then ``_{pp:03d}`` when PP > 1, then ``_{ep:03d}`` when
  EP > 1, ``.pth``.

The same rank also computes Megatron's own statistics of those gradients (its optimizer's
``get_grad_norm`` and ``count_zeros`` after ``prepare_grads``, and ``get_grad_norm_fp32`` for
the norm types of :data:`NORM_TYPES`) and dumps gradstat's own snapshot with the README's
``# recipe: megatron`` block.
"""

from __future__ import annotations

import math
import re
import warnings
import zlib
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from tests._cli import recipe

LAYERS, HIDDEN, HEADS, FFN, VOCAB, SEQUENCE = 4, 32, 4, 64, 64, 16
EXPERTS, EXPERT_FFN = 4, 16
BUCKET_SIZE = 3000
ITERATION = 1000
NORM_TYPES = (2.0, 1.0, math.inf)
EMBEDDING = "embedding.word_embeddings.weight"
OUTPUT_COPY = "output_layer.weight"
UNSEEN_TOKENS = (3, 17, 40)  # embedding rows no token touched: exact zeros in every replica
ZERO_EXPERT = 1  # an expert (global index) no token was routed to
ZERO_BIAS = "decoder.layers.1.self_attention.linear_qkv.bias"
_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.")
_EXPERT = re.compile(r"\.local_experts\.(\d+)\.")


@dataclass(frozen=True)
class WgradsJob:
    """A Megatron parallel layout on ``world_size`` ranks; DP follows from it.

    Attributes:
        vpp: model chunks per pipeline stage (None: no virtual pipeline).
        etp: the expert tensor-parallel size, always stated. With ETP = 1 and TP > 1 the writers
            (expert-data-parallel rank 0) are the ranks r < EP, which do not cover the TP x EP
            grid of file names; with ETP = TP every TP x EP file exists.
        first_layers, last_layers: TransformerConfig's num_layers_in_first_pipeline_stage and
            num_layers_in_last_pipeline_stage (an uneven pipeline), None for even.
        distributed_optimizer: Megatron's distributed optimizer (the dump's iteration forces an
            all-reduce, so every rank's main_grad is whole all the same).
    """

    name: str
    world_size: int = 4
    tp: int = 1
    pp: int = 1
    vpp: int | None = None
    ep: int = 1
    etp: int = 1
    first_layers: int | None = None
    last_layers: int | None = None
    distributed_optimizer: bool = False

    @property
    def moe(self) -> bool:
        return self.ep > 1

    @property
    def chunks(self) -> int:
        return self.vpp or 1

    @property
    def dp(self) -> int:
        return self.world_size // (self.tp * self.pp)

    @property
    def edp(self) -> int:
        return self.world_size // (self.etp * self.ep * self.pp)

    def layers(self, stage: int, chunk: int) -> range:
        """The global indices of the layers chunk ``chunk`` of stage ``stage`` holds: virtual
        stage ``chunk * PP + stage`` of an even split, or the uneven first and last stages."""
        if self.first_layers is not None or self.last_layers is not None:
            assert self.vpp is None, "an uneven pipeline is built without virtual stages here"
            first = self.first_layers or 0
            last = self.last_layers or 0
            middle = (LAYERS - first - last) // max(self.pp - 2, 1) if self.pp > 2 else 0
            sizes = [first, *[middle] * (self.pp - 2), last]
            start = sum(sizes[:stage])
            return range(start, start + sizes[stage])
        per_virtual_stage = LAYERS // (self.pp * self.chunks)
        start = (chunk * self.pp + stage) * per_virtual_stage
        return range(start, start + per_virtual_stage)

    def file_names(self) -> list[str]:
        """The files Megatron's writers make, worked out from the layout (sorted)."""
        # Megatron numbers the expert grid ETP first, then EP, then EDP: the writers of a
        # stage are its ranks r < ETP * EP; r % TP is the TP rank in their name, r // ETP the
        # EP rank.
        names = set()
        for stage in range(self.pp):
            for r in range(self.etp * self.ep):
                name = f"mp_rank_{r % self.tp:02d}"
                if self.pp > 1:
                    name += f"_{stage:03d}"
                if self.ep > 1:
                    name += f"_{r // self.etp:03d}"
                names.add(f"{name}.pth")
        return sorted(names)


def wgrads_dir(root: str | Path, job: WgradsJob) -> Path:
    return Path(root) / job.name / "wgrads" / f"iter_{ITERATION:07d}"


def snapshot_dir(root: str | Path, job: WgradsJob) -> Path:
    return Path(root) / job.name / "gradstat" / f"grads-{ITERATION}"


# --- known gradients ----------------------------------------------------------------------------


def replica_grad(name: str, replica: int, shape: tuple[int, ...]) -> Tensor:
    """One replica's fp32 gradient of the logical tensor ``name`` (global name), with the
    structural zeros a real batch leaves.

    Its values are multiples of 2**-8 below 2**6 in magnitude, so Megatron's fp32 sums over a
    few replicas, its division by a power-of-two DP size and the tied copies' sum are exact:
    the dumped values equal the float64 truth bit for bit, and a statistic of them can be held
    to 1e-12 against float64.
    """
    generator = torch.Generator().manual_seed(zlib.crc32(f"wgrads/{name}/{replica}".encode()))
    normal = torch.randn(shape, generator=generator, dtype=torch.float64)
    grad = (normal * 256).round().clamp(-(2**14), 2**14).div(256).to(torch.float32)
    if name in (EMBEDDING, OUTPUT_COPY):
        grad[list(UNSEEN_TOKENS)] = 0.0
    if f"local_experts.{ZERO_EXPERT}." in name or name == ZERO_BIAS:
        grad.zero_()
    return grad


def global_name(job: WgradsJob, local: str, stage: int, chunk: int, ep_rank: int) -> str:
    """A chunk's parameter name with its layer and expert numbered globally (from the layout
    alone, not from Megatron or gradstat)."""
    layers = job.layers(stage, chunk)
    name = _LAYER.sub(lambda m: f"decoder.layers.{layers[int(m[1])]}.", local)
    per_rank = EXPERTS // job.ep
    return _EXPERT.sub(lambda m: f".local_experts.{ep_rank * per_rank + int(m[1])}.", name)


@dataclass(frozen=True)
class Logical:
    """A logical tensor: its full shape, whether it is an expert's, its TP split (None: a full
    copy on every TP rank)."""

    shape: tuple[int, ...]
    expert: bool
    split_dim: int | None


def true_grads(job: WgradsJob, tensors: dict[str, Logical]) -> dict[str, Tensor]:
    """The float64 gradient of every logical tensor of the global batch's mean loss: each
    replica's gradient summed over the replicas that hold the tensor (the data-parallel ones;
    an expert's, the expert-data-parallel ones) and divided by the dense data-parallel size,
    the number of local losses averaged. The tied output copy adds to the embedding's and is
    not a tensor of its own."""
    truth = {}
    for name, logical in tensors.items():
        if name == OUTPUT_COPY:
            continue
        replicas = job.edp if logical.expert else job.dp
        parts = [name, OUTPUT_COPY] if name == EMBEDDING and OUTPUT_COPY in tensors else [name]
        total = torch.zeros(logical.shape, dtype=torch.float64)
        for replica in range(replicas):
            for part in parts:
                total += replica_grad(part, replica, logical.shape).double()
        truth[name] = total / job.dp
    return truth


# --- one rank -----------------------------------------------------------------------------------


def _build(job: WgradsJob) -> tuple[list[Any], Any]:
    """This rank's GPTModel chunks, each wrapped in Megatron's DDP, and its optimizer."""
    from megatron.core import parallel_state as ps
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.transformer import TransformerConfig

    torch.manual_seed(0)
    experts = EXPERTS if job.moe else None
    config = TransformerConfig(
        num_layers=LAYERS,
        hidden_size=HIDDEN,
        num_attention_heads=HEADS,
        ffn_hidden_size=FFN,
        num_moe_experts=experts,
        moe_ffn_hidden_size=EXPERT_FFN if job.moe else None,
        moe_router_topk=2,
        # megatron-core refuses biases in MoE layers whose experts are TP-split (ETP > 1).
        add_bias_linear=not (job.moe and job.etp > 1),
        tensor_model_parallel_size=job.tp,
        pipeline_model_parallel_size=job.pp,
        virtual_pipeline_model_parallel_size=job.vpp,
        expert_model_parallel_size=job.ep,
        expert_tensor_parallel_size=job.etp,
        num_layers_in_first_pipeline_stage=job.first_layers,
        num_layers_in_last_pipeline_stage=job.last_layers,
        pipeline_dtype=torch.float32,
        use_cpu_initialization=True,
    )
    chunks = []
    for chunk in range(job.chunks):
        vp_stage = chunk if job.vpp else None
        chunks.append(
            GPTModel(
                config=config,
                transformer_layer_spec=get_gpt_layer_local_spec(num_experts=experts),
                vocab_size=VOCAB,
                max_sequence_length=SEQUENCE,
                pre_process=ps.is_pipeline_first_stage(ignore_virtual=False, vp_stage=vp_stage),
                post_process=ps.is_pipeline_last_stage(ignore_virtual=False, vp_stage=vp_stage),
                share_embeddings_and_output_weights=True,
                vp_stage=vp_stage,
            )
        )
    distributed = job.distributed_optimizer
    ddp_config = DistributedDataParallelConfig(
        bucket_size=BUCKET_SIZE, use_distributed_optimizer=distributed
    )
    model = [DistributedDataParallel(config, ddp_config, chunk) for chunk in chunks]
    optimizer_config = OptimizerConfig(
        optimizer="adam", lr=1e-3, log_num_zeros_in_grad=True, use_distributed_optimizer=distributed
    )
    optimizer = get_megatron_optimizer(optimizer_config, model, use_gloo_process_groups=False)
    return model, optimizer


def _fill_main_grads(
    job: WgradsJob, model: list[Any]
) -> tuple[dict[str, Logical], dict[str, dict[str, str]], list[str]]:
    """Each ``main_grad`` gets this replica's TP shard of its known gradient.

    Returns:
        {global name: Logical}, {chunk key: {local name: global name}}, and the layers whose
        Megatron ``layer_number`` disagrees with the layout's numbering (empty when right).
    """
    from megatron.core import parallel_state as ps

    stage, ep_rank = ps.get_pipeline_model_parallel_rank(), ps.get_expert_model_parallel_rank()
    tensors: dict[str, Logical] = {}
    names: dict[str, dict[str, str]] = {}
    misnumbered = []
    for chunk, wrapped in enumerate(model):
        module = wrapped.module
        for path, sub in module.named_modules():
            match = re.fullmatch(r"decoder\.layers\.(\d+)", path)
            if match and sub.layer_number - 1 != job.layers(stage, chunk)[int(match[1])]:
                misnumbered.append(f"chunk {chunk} {path}: layer_number {sub.layer_number}")
        chunk_names = names.setdefault(f"model_chunk{chunk}", {})
        for local, param in module.named_parameters():
            name = global_name(job, local, stage, chunk, ep_rank)
            chunk_names[local] = name
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
            split = param.partition_dim if getattr(param, "tensor_model_parallel", False) else None
            if split is not None:
                shape[split] *= tp_size
            full = replica_grad(name, replica, tuple(shape))
            param.main_grad.copy_(full if split is None else full.chunk(tp_size, split)[tp_rank])
            tensors[name] = Logical(tuple(shape), expert, split)
    return tensors, names, misnumbered


def _write_wgrads(job: WgradsJob, model: list[Any], root: str) -> str | None:
    """This rank's file, as megatron-core 0.19.2's save_grads writes it (see the module doc);
    returns its name, None on a rank that does not write."""
    from megatron.core import parallel_state as ps

    if ps.get_expert_data_parallel_rank() != 0:
        return None
    grads: dict[str, dict[str, Tensor]] = {}
    for chunk, wrapped in enumerate(model):
        for name, param in wrapped.module.named_parameters():
            if getattr(param, "main_grad", None) is not None:
                grads.setdefault(f"model_chunk{chunk}", {})[name] = param.main_grad.cpu()
    name = f"mp_rank_{ps.get_tensor_model_parallel_rank():02d}"
    if ps.get_pipeline_model_parallel_world_size() > 1:
        name += f"_{ps.get_pipeline_model_parallel_rank():03d}"
    if ps.get_expert_model_parallel_world_size() > 1:
        name += f"_{ps.get_expert_model_parallel_rank():03d}"
    folder = wgrads_dir(root, job)
    folder.mkdir(parents=True, exist_ok=True)
    torch.save(dict(grads), folder / f"{name}.pth")
    return f"{name}.pth"


def _megatron_statistics(optimizer: Any) -> dict[str, Any]:
    """Megatron's own numbers, as its training step computes them before stepping, and its
    get_grad_norm_fp32 for each norm type, combined over the chained optimizers as
    ChainedOptimizer combines its L2 (one call when they share a group, else per optimizer)."""
    from megatron.core.optimizer import optimizer as optimizers

    optimizer.prepare_grads()
    norms = {}
    parts = optimizer.chained_optimizers
    for p in NORM_TYPES:
        if optimizer.grads_states_parallel_group_is_shared():
            grads = [grad for part in parts for grad in part.get_main_grads_for_grad_norm()]
            group = optimizer.get_grad_stats_parallel_group()
            norms[p] = float(optimizers.get_grad_norm_fp32(grads, p, group))
            continue
        each = [
            float(
                optimizers.get_grad_norm_fp32(
                    part.get_main_grads_for_grad_norm(), p, part.get_grad_stats_parallel_group()
                )
            )
            for part in parts
        ]
        if p == math.inf:
            norms[p] = max(each)
        else:
            norms[p] = sum(norm**p for norm in each) ** (1.0 / p)
    return {
        "norm": float(optimizer.get_grad_norm()),
        "zeros": int(optimizer.count_zeros()),
        "norms": norms,
        "optimizer": type(optimizer).__name__,
    }


@contextmanager
def parallel_state(job: WgradsJob) -> Iterator[None]:
    """Megatron's parallel_state for ``job`` on this rank, torn down at the end."""
    from megatron.core import parallel_state as ps

    ps.initialize_model_parallel(
        tensor_model_parallel_size=job.tp,
        pipeline_model_parallel_size=job.pp,
        virtual_pipeline_model_parallel_size=job.vpp,
        expert_model_parallel_size=job.ep,
        expert_tensor_parallel_size=job.etp,
        create_gloo_process_groups=False,
    )
    try:
        yield
    finally:
        ps.destroy_model_parallel()


def run_wgrads_job(rank: int, world_size: int, arg: tuple[WgradsJob, str]) -> dict[str, Any]:
    """One rank of one job: gradients reduced by Megatron, written as Megatron's wgrads dump
    and as gradstat's snapshot (the README recipe), and Megatron's statistics of them."""
    from megatron.core import parallel_state as ps
    from megatron.core.distributed import finalize_model_grads

    from tests._megatron import _use_cpu_clip_grads, megatron_clip_grads, point_megatron_at_cpu

    job, root = arg
    assert world_size == job.world_size, (job.name, world_size)
    with parallel_state(job):
        if point_megatron_at_cpu():  # once per process: later cases find it done
            _use_cpu_clip_grads(megatron_clip_grads())
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            model, optimizer = _build(job)
        tensors, names, misnumbered = _fill_main_grads(job, model)
        # A wgrads iteration of 0.19.2 forces the all-reduce (never a reduce-scatter).
        finalize_model_grads(model, force_all_reduce=True)
        written = _write_wgrads(job, model, root)
        folder = snapshot_dir(root, job).parent
        namespace = {"model": model, "optimizer": optimizer, "iteration": ITERATION}
        exec(recipe("megatron"), namespace | {"directory": str(folder)})
        result = {
            "tensors": tensors,
            "names": names,
            "file": written,
            "misnumbered": misnumbered,
            "coords": {
                "tp": ps.get_tensor_model_parallel_rank(),
                "pp": ps.get_pipeline_model_parallel_rank(),
                "ep": ps.get_expert_model_parallel_rank(),
                "etp": ps.get_expert_tensor_parallel_rank(),
                "edp": ps.get_expert_data_parallel_rank(),
                "dp": ps.get_data_parallel_rank(),
            },
        }
        return result | {"megatron": _megatron_statistics(optimizer)}

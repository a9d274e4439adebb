"""The tests' small GPT and its Megatron jobs, sharded by gradstat.testing.

The model is a small GPT with tied embeddings and optional MoE layers. Its full, unsharded
gradients come from a seeded generator, so the test process builds the same tensors as every
rank; the float64 oracle (tests/_oracle.py) reads those, never a shard. A :class:`Job` is one
layout of the model, with a name and the negative controls that break it on purpose.

Each rank of a multi-process test cuts out its share with ``gradstat.testing.shard_rank`` at the
coordinates it is given (its own, or Megatron's parallel_state's), makes the real process groups
and computes the statistics with gradstat. ``dump_layout`` writes every rank with ``save_rank``.

:func:`gtp_geometry` is the tests' own account of GTP padding, written without the sharder, so
the padding the layouts exercise (spilling or not) is checked independently.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

import gradstat
from gradstat import testing
from tests._params import param_with

NORM_TYPES: tuple[float, ...] = (2.0, 1.0, 3.0, math.inf)

# ---------------------------------------------------------------------------------------------
# The model and its unsharded gradients
# ---------------------------------------------------------------------------------------------

VOCAB, HIDDEN, LAYERS, FFN = 16, 8, 4, 36
EXPERTS, EXPERT_FFN = 4, 6
UNSEEN_TOKENS = (3, 7, 12)  # embedding rows whose gradient is exactly zero
ZERO_EXPERT = 1  # an expert no token was routed to: all-zero gradients
SEED = 20260829
# Frequent tokens give the embedding the largest gradients, so counting it twice shows.
EMBEDDING_SCALE = 10.0

EMBEDDING = "embedding.word_embeddings.weight"
OUTPUT_COPY = "output_layer.weight"


@dataclass(frozen=True)
class ParamSpec:
    """One logical parameter: shape, how TP splits it, where it lives, whether GTP shards it.

    ``split`` is "column" (dim 0 over TP: column-parallel or vocab-parallel), "row" (dim 1) or
    "none" (replicated over TP). ``layer`` is None for the embedding (first stage) and
    ``LAYERS`` for the final layernorm (last stage). Expert params split over ETP/EGTP instead.
    """

    name: str
    shape: tuple[int, ...]
    split: testing.Split
    layer: int | None = None
    expert: int | None = None
    gtp: bool = False


# (name, shape, TP split, sharded over GTP when GTP is on), per layer or per expert.
_ATTENTION: list[tuple[str, tuple[int, ...], testing.Split, bool]] = [
    ("input_layernorm.weight", (HIDDEN,), "none", False),
    ("input_layernorm.bias", (HIDDEN,), "none", False),
    ("self_attention.linear_qkv.weight", (3 * HIDDEN, HIDDEN), "column", True),
    ("self_attention.linear_qkv.bias", (3 * HIDDEN,), "column", False),
    ("self_attention.linear_proj.weight", (HIDDEN, HIDDEN), "row", True),
    ("self_attention.linear_proj.bias", (HIDDEN,), "none", False),
    ("pre_mlp_layernorm.weight", (HIDDEN,), "none", False),
]
_DENSE_MLP: list[tuple[str, tuple[int, ...], testing.Split, bool]] = [
    ("mlp.linear_fc1.weight", (FFN, HIDDEN), "column", True),
    ("mlp.linear_fc2.weight", (HIDDEN, FFN), "row", False),
]
_ROUTER: list[tuple[str, tuple[int, ...], testing.Split, bool]] = [
    ("mlp.router.weight", (EXPERTS, HIDDEN), "none", False)
]
_EXPERT: list[tuple[str, tuple[int, ...], testing.Split, bool]] = [
    ("linear_fc1.weight", (EXPERT_FFN, HIDDEN), "column", True),
    ("linear_fc2.weight", (HIDDEN, EXPERT_FFN), "row", False),
    ("linear_fc2.bias", (HIDDEN,), "none", False),
]


def model_params(moe: bool) -> list[ParamSpec]:
    """The model's logical parameters, in module order (the tied output layer is the embedding)."""
    specs = [ParamSpec(EMBEDDING, (VOCAB, HIDDEN), "column")]
    for layer in range(LAYERS):
        prefix = f"decoder.layers.{layer}."
        for name, shape, split, gtp in _ATTENTION + (_ROUTER if moe else _DENSE_MLP):
            specs.append(ParamSpec(prefix + name, shape, split, layer, gtp=gtp))
        for expert in range(EXPERTS if moe else 0):
            local = f"{prefix}mlp.experts.local_experts.{expert}."
            for name, shape, split, gtp in _EXPERT:
                specs.append(ParamSpec(local + name, shape, split, layer, expert, gtp))
    for name in ("decoder.final_layernorm.weight", "decoder.final_layernorm.bias"):
        specs.append(ParamSpec(name, (HIDDEN,), "none", LAYERS))
    return specs


def _stage(spec: ParamSpec, pp: int) -> int:
    if spec.layer is None:
        return 0
    if spec.layer == LAYERS:
        return pp - 1
    return spec.layer // (LAYERS // pp)


def model_specs(moe: bool, pp: int = 1) -> list[testing.ParamLayout]:
    """Where Megatron puts each parameter on ``pp`` stages, in module order; with ``pp > 1`` the
    output layer on the last stage is the embedding's tied copy."""
    specs = [
        testing.ParamLayout(
            spec.name,
            spec.split,
            stage=_stage(spec, pp),
            expert=spec.expert,
            num_experts=EXPERTS if spec.expert is not None else 0,
            gtp=spec.gtp,
        )
        for spec in model_params(moe)
    ]
    if pp > 1:
        specs.append(
            testing.ParamLayout(OUTPUT_COPY, "column", stage=pp - 1, tied_copy_of=EMBEDDING)
        )
    return specs


def full_grads(moe: bool) -> dict[str, Tensor]:
    """The unsharded fp32 gradients, the same in every process: ~25% exact zeros, scaled rows."""
    generator = torch.Generator().manual_seed(SEED)
    grads = {}
    for spec in model_params(moe):
        values = torch.randn(spec.shape, generator=generator, dtype=torch.float64)
        keep = torch.rand(spec.shape, generator=generator, dtype=torch.float64) > 0.25
        scale = 10.0 ** torch.randint(-2, 1, (), generator=generator).item()
        if spec.name == EMBEDDING:
            scale = EMBEDDING_SCALE
        grads[spec.name] = (values * keep * scale).to(torch.float32)
        if spec.expert == ZERO_EXPERT:
            grads[spec.name].zero_()
    grads[EMBEDDING][list(UNSEEN_TOKENS)] = 0.0
    return grads


def oracle_grads(moe: bool) -> dict[str, list[Tensor]]:
    """The unsharded gradients, each logical parameter once: dense, expert and all of them."""
    grads = full_grads(moe)
    specs = model_params(moe)
    dense = [grads[spec.name] for spec in specs if spec.expert is None]
    expert = [grads[spec.name] for spec in specs if spec.expert is not None]
    return {"dense": dense, "expert": expert, "total": dense + expert}


# ---------------------------------------------------------------------------------------------
# Jobs
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Job:
    """The model in one Megatron layout, named for the test that uses it.

    The rank order is gradstat.testing's (Megatron's): dense tp, cp, gtp, dp, pp; experts etp,
    ep, egtp, edp, pp. ``axis_places`` hands the tp/gtp filters and GTP ``group`` attributes
    over as AxisPlace objects instead of process groups. The last three fields break the job on
    purpose (negative controls): the tied output copy loses ``shared``, fragments are stamped
    with 0 padding, or the plain optimizer's statistics are also summed over the CP ranks.
    """

    name: str
    tp: int = 1
    pp: int = 1
    dp: int = 1
    gtp: int = 1
    ep: int = 1
    etp: int = 1
    egtp: int = 1
    cp: int = 1
    moe: bool = False
    distopt: bool = False
    align: int = 4
    axis_places: bool = False
    untie_output_copy: bool = False
    stamp_pad_zeros: bool = True
    stats_over_cp: bool = False

    @property
    def layout(self) -> testing.Layout:
        sizes = {axis: getattr(self, axis) for axis in ("tp", "pp", "dp", "gtp", "cp", "ep")}
        return testing.Layout(
            **sizes,
            etp=self.etp,
            egtp=self.egtp,
            distributed_optimizer=self.distopt,
            gtp_align=self.align,
        )

    @property
    def world_size(self) -> int:
        return self.layout.world_size

    @property
    def edp(self) -> int:
        return self.layout.edp

    def view_coords(self, rank: int) -> tuple[dict[str, int], dict[str, int]]:
        """``rank``'s dense (tp, cp when split, gtp, dp, pp) and expert (etp, ep, egtp, edp, pp)
        coordinates."""
        coords = {axis: place[0] for axis, place in self.layout.coords(rank).items()}
        dense_axes = ["tp", *(["cp"] if self.cp > 1 else []), "gtp", "dp", "pp"]
        dense = {axis: coords[axis] for axis in dense_axes}
        return dense, {axis: coords[axis] for axis in ("etp", "ep", "egtp", "edp", "pp")}

    def dp_cp_place(self, dense: dict[str, int]) -> tuple[int, int]:
        """(rank, size) among the ranks the distributed optimizer shards dense params over."""
        return dense["dp"] * self.cp + dense.get("cp", 0), self.dp * self.cp


@dataclass(frozen=True)
class GtpGeometry:
    """How one TP-local weight is padded and split over its GTP group."""

    name: str
    tp_parts: int
    rows: int
    columns: int
    pad_rows: int
    rows_per_shard: int

    @property
    def pad_elements(self) -> int:
        """Padding elements over all TP parts: what a count without pad subtraction adds."""
        return self.tp_parts * self.pad_rows * self.columns

    @property
    def spills(self) -> bool:
        """Padding longer than a shard: it reaches into lower GTP ranks' shards."""
        return self.pad_rows > self.rows_per_shard


def gtp_geometry(job: Job) -> list[GtpGeometry]:
    """The padding of every GTP-sharded weight in ``job``, worked out here, not by the sharder."""
    geometry = []
    for spec in model_params(job.moe):
        tp, gtp = (job.etp, job.egtp) if spec.expert is not None else (job.tp, job.gtp)
        if not spec.gtp or gtp == 1:
            continue
        rows, columns = spec.shape
        rows, columns = (rows // tp, columns) if spec.split == "column" else (rows, columns // tp)
        multiple = job.align * gtp
        padded_rows = math.ceil(rows / multiple) * multiple
        pad = padded_rows - rows
        geometry.append(GtpGeometry(spec.name, tp, rows, columns, pad, padded_rows // gtp))
    return geometry


# ---------------------------------------------------------------------------------------------
# One rank's view: coordinates, groups, shards, fragments
# ---------------------------------------------------------------------------------------------


@dataclass
class RankView:
    """One rank's coordinates and groups. Axes of size 1 have no group (None: not split)."""

    dense: dict[str, int]
    expert: dict[str, int]
    groups: dict[str, Any]

    def axis(self, name: str) -> Any:
        """The group handed to the duplicate filters: a ProcessGroup, an AxisPlace or None."""
        return self.groups.get(name)


def group_containing(job: Job, axes: set[str], rank: int) -> list[int]:
    """The ranks of ``rank``'s group along ``axes``, as make_rank_view makes it."""
    (ranks,) = [ranks for ranks in job.layout.groups(axes) if rank in ranks]
    return ranks


def _my_group(rank: int, partition: list[list[int]]) -> dist.ProcessGroup:
    """Make every group of the partition (every rank must, in the same order); return ours."""
    mine = None
    for ranks in partition:
        group = dist.new_group(ranks)
        if rank in ranks:
            mine = group
    assert mine is not None, (rank, partition)
    return mine


def make_rank_view(job: Job, rank: int) -> RankView:
    """Coordinates and real process groups of ``rank`` (collective: every rank calls it)."""
    layout = job.layout
    groups: dict[str, Any] = {}
    for key, grouped in (
        ("tp", {"tp"}),
        ("gtp", {"gtp"}),
        ("cp", {"cp"}),
        ("dp", {"dp"}),
        ("dp_cp", {"dp", "cp"}),
        ("etp", {"etp"}),
        ("egtp", {"egtp"}),
        ("edp", {"edp"}),
    ):
        if math.prod(getattr(layout, axis) for axis in grouped) > 1:
            groups[key] = _my_group(rank, layout.groups(grouped))
    if job.distopt:
        groups["dense_stats"] = groups["expert_stats"] = dist.group.WORLD
    else:
        # Plain optimizer: reduce over the model-parallel ranks of one data-parallel replica
        # (CP ranks are replicas too; the negative control sums over them as well).
        model_parallel = {"tp", "gtp", "pp"} | ({"cp"} if job.stats_over_cp else set())
        groups["dense_stats"] = _my_group(rank, layout.groups(model_parallel))
        if job.moe:
            groups["expert_stats"] = _my_group(rank, layout.groups({"etp", "egtp", "ep", "pp"}))
    dense, expert = job.view_coords(rank)
    if job.axis_places:
        coords = dense | expert
        for key in ("tp", "gtp", "etp", "egtp"):
            if key in groups:
                groups[key] = gradstat.AxisPlace(coords[key], getattr(layout, key))
    return RankView(dense, expert, groups)


def offline_view(job: Job, rank: int) -> RankView:
    """A rank's coordinates, with AxisPlace objects standing in for its TP/GTP groups."""
    dense, expert = job.view_coords(rank)
    coords, layout = dense | expert, job.layout
    groups = {
        axis: gradstat.AxisPlace(coords[axis], getattr(layout, axis))
        for axis in ("tp", "gtp", "etp", "egtp")
        if getattr(layout, axis) > 1
    }
    return RankView(dense, expert, groups)


def _named(pairs: list[tuple[str, torch.nn.Parameter]]) -> list[torch.nn.Parameter]:
    # gradstat's statistics take bare params; the name rides along for the snapshot.
    for name, param in pairs:
        param._gradstat_name = name  # type: ignore[attr-defined]
    return [param for _, param in pairs]


def local_params(job: Job, view: RankView) -> list[torch.nn.Parameter]:
    """The model params ``view``'s rank holds at its coordinates, with Megatron's attributes,
    each named by ``_gradstat_name``; GTP shards' ``group`` is the view's GTP group."""
    layout = dataclasses.replace(job.layout, distributed_optimizer=False)
    # An axis the job does not split has one place, whatever a live job calls it (Megatron's
    # expert TP rank follows TP when the model has no experts).
    places = view.dense | view.expert
    coords = {
        axis: (places.get(axis, 0) if size > 1 else 0, size)
        for axis, size in ((axis, getattr(layout, axis)) for axis in layout.coords(0))
    }
    gtp_groups = {axis: view.axis(axis) for axis in ("gtp", "egtp") if view.axis(axis) is not None}
    share = testing.shard_rank(
        layout,
        model_specs(job.moe, job.pp),
        full_grads(job.moe),
        dist.get_rank() if dist.is_initialized() else 0,
        coords=coords,
        gtp_groups=gtp_groups,
    )
    params = _named(share.params)
    if job.untie_output_copy:
        for param in params:
            if param._gradstat_name == OUTPUT_COPY:  # type: ignore[attr-defined]
                param.shared = False  # type: ignore[attr-defined]
    return params


def fragments(
    params: list[torch.nn.Parameter], dp_rank: int, dp_size: int, stamp: bool
) -> list[torch.nn.Parameter]:
    """The distributed optimizer's main params of ``dp_rank`` (gradstat.testing.fragments);
    with ``stamp=False`` (a negative control) each claims 0 padding elements."""
    named = [(param._gradstat_name, param) for param in params]  # type: ignore[attr-defined]
    pieces = _named(testing.fragments(named, dp_rank, dp_size))
    if not stamp:
        for piece in pieces:
            if hasattr(piece, "gtp_pad_zeros"):
                piece.gtp_pad_zeros = 0  # type: ignore[attr-defined]
    return pieces


def split_by_optimizer(
    params: list[torch.nn.Parameter],
) -> tuple[list[torch.nn.Parameter], list[torch.nn.Parameter]]:
    """(dense, expert) params: Megatron gives each its own optimizer."""
    dense = [param for param in params if getattr(param, "allreduce", True)]
    experts = [param for param in params if not getattr(param, "allreduce", True)]
    return dense, experts


def rank_params(job: Job, rank: int, view: RankView | None = None) -> list[torch.nn.Parameter]:
    """What ``rank`` hands to the optimizer's statistics: its shards, or with the distributed
    optimizer its fragments (dense over DP x CP, expert over EDP)."""
    view = offline_view(job, rank) if view is None else view
    params = local_params(job, view)
    if not job.distopt:
        return params
    dense, experts = split_by_optimizer(params)
    stamp = job.stamp_pad_zeros
    return fragments(dense, *job.dp_cp_place(view.dense), stamp) + fragments(
        experts, view.expert["edp"], job.edp, stamp
    )


def dump_layout(
    job: Job,
    directory: Path,
    step: int = 7,
    plant: Callable[[int, list[torch.nn.Parameter]], None] | None = None,
) -> Path:
    """What every rank of ``job`` writes with save_rank. ``plant(rank, params)`` may edit a
    rank's params before they are saved."""
    from gradstat.snapshot import save_rank

    layout = job.layout
    for rank in range(layout.world_size):
        params = rank_params(job, rank)
        if plant is not None:
            plant(rank, params)
        save_rank(
            directory,
            [(param._gradstat_name, param) for param in params],  # type: ignore[attr-defined]
            rank=rank,
            world_size=layout.world_size,
            coords=layout.coords(rank),
            distributed_optimizer=job.distopt,
            step=step,
        )
    return directory


# ---------------------------------------------------------------------------------------------
# Statistics on one rank
# ---------------------------------------------------------------------------------------------


def category_stats(params: list[Any], view: RankView, stats_group: Any) -> dict[str, Any]:
    """gradstat's norms and zero count of one optimizer's params (dense or expert), with the
    rank's TP/GTP groups as filters and ``stats_group`` as Megatron's grad_stats_parallel_group."""
    filters = {
        "tp_group": view.axis("tp"),
        "expert_tp_group": view.axis("etp"),
        "gtp_group": view.axis("gtp"),
        "expert_gtp_group": view.axis("egtp"),
    }
    selected = gradstat.grads_for_norm(params, **filters)
    norms = {p: gradstat.get_grad_norm_fp32(selected, p, stats_group) for p in NORM_TYPES}
    zeros = gradstat.count_zeros_fp32(params, stats_group, **filters)
    return {"norms": norms, "zeros": zeros}


def combine(dense: dict[str, Any], expert: dict[str, Any]) -> dict[str, Any]:
    """Dense and expert optimizers' statistics as one model's (Megatron's ChainedOptimizer)."""
    norms = {}
    for p in NORM_TYPES:
        d, e = dense["norms"][p], expert["norms"][p]
        norms[p] = max(d, e) if p == math.inf else (d**p + e**p) ** (1.0 / p)
    return {"norms": norms, "zeros": dense["zeros"] + expert["zeros"]}


def run_layout(rank: int, world_size: int, job: Job) -> dict[str, Any]:
    """A rank's norms and zero count for ``job``: dense, expert and combined."""
    assert world_size == job.world_size, (world_size, job)
    view = make_rank_view(job, rank)
    dense, experts = split_by_optimizer(rank_params(job, rank, view))
    result: dict[str, Any] = {
        "dense": category_stats(dense, view, view.groups["dense_stats"]),
        # (padding, elements) of each stamped fragment, to check what the layout exercised.
        "stamped": [
            (int(param.gtp_pad_zeros), param.numel())  # type: ignore[attr-defined]
            for param in dense + experts
            if hasattr(param, "gtp_pad_zeros")
        ],
    }
    if job.moe:
        result["expert"] = category_stats(experts, view, view.groups["expert_stats"])
        result["total"] = combine(result["dense"], result["expert"])
    else:
        result["total"] = result["dense"]
    return result


# ---------------------------------------------------------------------------------------------
# DTensor gradients (Megatron-FSDP style): Shard(0) on a 1-D mesh, or HSDP's 2-D mesh
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class DTensorCase:
    """Gradients split over ``tp`` TP ranks, then Shard(0) over a 1-D DeviceMesh of ``dp``
    ranks; with ``replicate`` > 1, (Replicate, Shard(0)) over a 2-D mesh of ``replicate`` x
    ``dp / replicate`` ranks, as HSDP lays them out."""

    name: str
    tp: int
    dp: int
    replicate: int = 1

    @property
    def world_size(self) -> int:
        return self.tp * self.dp


def dtensor_grads() -> dict[str, tuple[Tensor, str]]:
    """Unsharded grads and their TP split; shapes make uneven and empty Shard(0) pieces."""
    generator = torch.Generator().manual_seed(SEED + 1)
    shapes = {
        "w_column": ((6, 5), "column"),
        "w_row": ((5, 4), "row"),
        "norm": ((3,), "none"),
        "tiny": ((1, 4), "none"),
    }
    grads = {}
    for name, (shape, split) in shapes.items():
        values = torch.randn(shape, generator=generator)
        grads[name] = (values * (torch.rand(shape, generator=generator) > 0.3), split)
    return grads


def run_dtensor(rank: int, world_size: int, case: DTensorCase) -> dict[str, Any]:
    """Norms and zero count of DTensor grads sharded over a DP mesh, reduced over TP."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    assert world_size == case.world_size, (world_size, case)
    if case.replicate > 1:
        shape = (case.tp, case.replicate, case.dp // case.replicate)
        mesh = init_device_mesh("cpu", shape, mesh_dim_names=("tp", "dp_replicate", "dp_shard"))
        dp_mesh = mesh["dp_replicate", "dp_shard"]
        placements: list[Any] = [Replicate(), Shard(0)]
    else:
        mesh = init_device_mesh("cpu", (case.tp, case.dp), mesh_dim_names=("tp", "dp"))
        dp_mesh = mesh["dp"]
        placements = [Shard(0)]
    # The stats group is the model-parallel group: TP here, a single rank when tp == 1.
    tp_group = mesh["tp"].get_group()
    tp_rank = mesh.get_local_rank("tp")
    params = []
    for grad, split in dtensor_grads().values():
        local = grad
        if split != "none" and case.tp > 1:
            local = grad.chunk(case.tp, dim=0 if split == "column" else 1)[tp_rank]
        sharded = distribute_tensor(local.contiguous(), dp_mesh, placements, src_data_rank=None)
        params.append(
            param_with(
                sharded,
                tensor_model_parallel=split != "none",
                partition_dim={"column": 0, "row": 1}.get(split, -1),
            )
        )
    selected = gradstat.grads_for_norm(params, tp_group=tp_group)
    norms = {p: gradstat.get_grad_norm_fp32(selected, p, tp_group) for p in NORM_TYPES}
    zeros = gradstat.count_zeros_fp32(params, tp_group, tp_group=tp_group)
    local_sizes = [param.grad.to_local().shape[0] for param in params]
    return {
        "norms": norms,
        "zeros": zeros,
        "dp_size": dp_mesh.size(),
        "mesh_dims": dp_mesh.ndim,
        "local_rows": local_sizes,
    }

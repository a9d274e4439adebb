"""Shard a model's full gradients into a Megatron parallel layout, offline.

Given every logical parameter's unsharded gradient and where Megatron puts it (which TP split,
which pipeline stage, which expert, whether GTP shards it, which weight it is a tied copy of),
``shard_gradients`` builds what each rank of a job in that layout holds: its coordinates and its
``(name, param)`` pairs, each param carrying Megatron's attributes and its local gradient as
``.grad``. ``write_snapshot`` saves them as a gradstat snapshot, one file per rank.

Rank order follows Megatron's: ``tp-cp-ep-dp-pp``, with GTP injected after ep
(``tp-cp-ep-gtp_remat-dp-pp``, megatron-core 0.19): dense ranks tp (fastest), cp, gtp, dp, pp;
each stage's ranks regroup for experts as etp (fastest), ep, egtp, edp, so expert data
parallelism takes in the context-parallel ranks, as Megatron's expert groups do
(scripts/megatron_parity_latest.sh checks the coordinates against Megatron's own).

Slicing rules (what Megatron does, reduced to what the statistics depend on):

- TP: "column" splits dim 0 (column-parallel and vocab-parallel), "row" splits dim 1, "none"
  is replicated; expert params split over ETP instead and carry ``allreduce=False``.
- GTP: dim 0 of the TP-local weight is padded with zero rows to a multiple of
  ``gtp_align * gtp_size`` and split evenly (EGTP for experts), as ``is_gtp_weight_remat``
  shards with ``pad_length`` and ``group``.
- Pipeline: a tied copy on another stage than its original (the output layer of a tied
  embedding) holds the original's gradient with ``shared=True``; both carry
  ``shared_embedding=True``. On the same stage there is no copy: Megatron uses one parameter.
- Context parallelism: CP ranks hold identical copies of every gradient (Megatron all-reduces
  gradients over DP x CP), like DP replicas.
- Distributed optimizer: each rank holds 1-D fragments ``grad.view(-1)[start:end]`` of one
  flat buffer per category (dense, expert), params laid end to end in the given order and the
  buffer split into equal ranges over Megatron's data-parallel group with context parallelism
  (DP x CP, cp the faster; EDP for experts). Fragments copy the attributes;
  fragments of GTP shards are stamped with ``gtp_pad_zeros``, and every fragment with its
  ``fragment_offset`` and ``fragment_shape``.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import torch
from torch import Tensor

from .errors import GradstatError
from .groups import AxisPlace
from .predicates import gtp_local_pad_zero_count
from .snapshot.format import PLAIN_ATTRS

__all__ = [
    "FRAGMENT_ATTRS",
    "Layout",
    "LayoutError",
    "ParamLayout",
    "RankParams",
    "Split",
    "data_parallel_with_cp",
    "shard_gradients",
    "write_snapshot",
]

Split = Literal["column", "row", "none"]

# Attributes a distributed-optimizer fragment copies from its model param (its own
# gtp_pad_zeros stamp is computed for its range).
FRAGMENT_ATTRS = (
    *(key for key in PLAIN_ATTRS if not key.startswith(("gtp_pad_zeros", "fragment_"))),
    "group",
)


class LayoutError(GradstatError, ValueError):
    """A layout or parameter description that Megatron could not shard this way."""


@dataclass(frozen=True)
class Layout:
    """Sizes of a Megatron job's parallel axes.

    Each pipeline stage has ``tp * gtp * cp * dp`` ranks; for expert params they regroup as
    ``etp * egtp * ep * edp``, so ``edp`` is what is left of the stage (CP included).
    """

    tp: int = 1
    pp: int = 1
    dp: int = 1
    gtp: int = 1
    cp: int = 1
    ep: int = 1
    etp: int = 1
    egtp: int = 1
    distributed_optimizer: bool = False
    gtp_align: int = 16

    def __post_init__(self) -> None:
        for axis in ("tp", "pp", "dp", "gtp", "cp", "ep", "etp", "egtp", "gtp_align"):
            if getattr(self, axis) < 1:
                raise LayoutError(f"layout: {axis} is {getattr(self, axis)}, must be >= 1")
        expert_ranks = self.etp * self.egtp * self.ep
        if self.stage_size % expert_ranks:
            raise LayoutError(
                f"layout: a stage's {self.stage_size} ranks (tp x gtp x cp x dp) cannot be "
                f"regrouped as etp x egtp x ep = {expert_ranks} times an expert-data-parallel size"
            )

    @property
    def stage_size(self) -> int:
        return self.tp * self.gtp * self.cp * self.dp

    @property
    def world_size(self) -> int:
        return self.stage_size * self.pp

    @property
    def edp(self) -> int:
        return self.stage_size // (self.etp * self.egtp * self.ep)

    def coords(self, rank: int) -> dict[str, tuple[int, int]]:
        """``{axis: (rank_on_axis, axis_size)}`` of ``rank``, as ``save_rank`` takes them."""
        if not 0 <= rank < self.world_size:
            raise LayoutError(f"rank {rank} is outside world size {self.world_size}")
        dense = _unravel(
            rank, (("tp", self.tp), ("cp", self.cp), ("gtp", self.gtp), ("dp", self.dp))
        )
        expert = _unravel(
            rank % self.stage_size,
            (("etp", self.etp), ("ep", self.ep), ("egtp", self.egtp), ("edp", self.edp)),
        )
        return dense | expert | {"pp": (rank // self.stage_size, self.pp)}


def data_parallel_with_cp(coords: Mapping[str, Sequence[int]]) -> tuple[int, int]:
    """(rank, size) in Megatron's data-parallel group with context parallelism (DP x CP).

    The distributed optimizer shards dense parameters over this group
    (``get_data_parallel_group(with_context_parallel=True)``); its ranks are in global rank
    order, where cp runs faster than dp.
    """
    (dp_rank, dp_size), (cp_rank, cp_size) = coords["dp"], coords.get("cp", (0, 1))
    return dp_rank * cp_size + cp_rank, dp_size * cp_size


def _unravel(rank: int, axes: Sequence[tuple[str, int]]) -> dict[str, tuple[int, int]]:
    places = {}
    for axis, size in axes:
        places[axis], rank = (rank % size, size), rank // size
    return places


@dataclass(frozen=True)
class ParamLayout:
    """Where Megatron puts one logical parameter.

    Attributes:
        name: the parameter's name (also the name of its gradient in ``grads``).
        split: how TP (ETP for experts) splits it: "column" (dim 0), "row" (dim 1), "none".
        stage: the pipeline stage holding it.
        expert: the expert's index within its MoE layer, or None for a dense parameter.
        num_experts: the number of experts of that MoE layer (split evenly over EP).
        gtp: GTP (EGTP for experts) shards it, with alignment padding, when that axis is > 1.
        tied_copy_of: this is a copy of another parameter (a tied output layer): it has no
            gradient of its own in ``grads`` and holds the original's.
    """

    name: str
    split: Split = "none"
    stage: int = 0
    expert: int | None = None
    num_experts: int = 0
    gtp: bool = False
    tied_copy_of: str | None = None


@dataclass(frozen=True)
class RankParams:
    """What one rank holds: its coordinates and its ``(name, param)`` pairs."""

    rank: int
    coords: dict[str, tuple[int, int]]
    params: list[tuple[str, torch.nn.Parameter]]


def gtp_pad_rows(rows: int, align: int, gtp_size: int) -> int:
    """Zero rows that make ``rows`` a multiple of ``align * gtp_size``."""
    return -rows % (align * gtp_size)


def _check(layout: Layout, specs: Sequence[ParamLayout], grads: Mapping[str, Tensor]) -> None:
    by_name: dict[str, ParamLayout] = {}
    for spec in specs:
        if spec.name in by_name:
            raise LayoutError(f"parameter {spec.name!r} is described twice")
        by_name[spec.name] = spec
    for spec in specs:
        where = f"parameter {spec.name!r}"
        if spec.split not in ("column", "row", "none"):
            raise LayoutError(f"{where}: split {spec.split!r} is not column, row or none")
        if not 0 <= spec.stage < layout.pp:
            raise LayoutError(f"{where}: stage {spec.stage} is outside pp size {layout.pp}")
        if spec.expert is not None and (
            not 0 <= spec.expert < spec.num_experts or spec.num_experts % layout.ep
        ):
            raise LayoutError(
                f"{where}: expert {spec.expert} of {spec.num_experts} cannot be placed over "
                f"ep size {layout.ep} (num_experts must be a multiple of ep)"
            )
        source = spec
        if spec.tied_copy_of is not None:
            original = by_name.get(spec.tied_copy_of)
            if original is None or original.tied_copy_of is not None:
                raise LayoutError(f"{where}: tied to {spec.tied_copy_of!r}, not a parameter")
            if (original.split, original.gtp, original.expert) != (
                spec.split,
                spec.gtp,
                spec.expert,
            ):
                raise LayoutError(f"{where}: split, gtp and expert must match {original.name!r}")
            if spec.name in grads:
                raise LayoutError(f"{where}: a tied copy takes its original's gradient; drop it")
            source = original
        grad = grads.get(source.name)
        if grad is None:
            raise LayoutError(f"{where}: no gradient for {source.name!r} in grads")
        tp = layout.etp if spec.expert is not None else layout.tp
        dim = {"column": 0, "row": 1, "none": None}[spec.split]
        if dim is not None and (grad.dim() <= dim or grad.shape[dim] % tp):
            raise LayoutError(
                f"{where}: a {spec.split} split needs dim {dim} divisible by TP size {tp}, "
                f"got shape {list(grad.shape)}"
            )
        if spec.gtp and grad.dim() == 0:
            raise LayoutError(f"{where}: GTP shards dim 0; a 0-dim gradient has none")
    unknown = sorted(set(grads) - set(by_name))
    if unknown:
        raise LayoutError(f"grads: {unknown[0]!r} is not a described parameter")


def _param(grad: Tensor, attrs: Mapping[str, Any]) -> torch.nn.Parameter:
    # The parameter's values never matter: a broadcast zero gives it a shape without memory.
    param = torch.nn.Parameter(grad.new_zeros(()).expand(grad.shape), requires_grad=False)
    param.grad = grad
    for key, value in attrs.items():
        setattr(param, key, value)
    return param


def _model_params(
    layout: Layout,
    specs: Sequence[ParamLayout],
    grads: Mapping[str, Tensor],
    coords: Mapping[str, tuple[int, int]],
) -> list[tuple[str, torch.nn.Parameter]]:
    """The model params one rank holds: TP/GTP shards with attributes, in ``specs`` order."""
    stage_of = {spec.name: spec.stage for spec in specs}
    copied_across_stages = {
        spec.tied_copy_of
        for spec in specs
        if spec.tied_copy_of is not None and spec.stage != stage_of[spec.tied_copy_of]
    }
    params = []
    for spec in specs:
        if spec.stage != coords["pp"][0]:
            continue
        source = spec.name if spec.tied_copy_of is None else spec.tied_copy_of
        if source != spec.name and spec.stage == stage_of[source]:
            continue  # same stage: Megatron uses the original parameter itself
        attrs: dict[str, Any] = {}
        tp_axis, gtp_axis = "tp", "gtp"
        if spec.expert is not None:
            per_rank = spec.num_experts // layout.ep
            if spec.expert // per_rank != coords["ep"][0]:
                continue
            tp_axis, gtp_axis = "etp", "egtp"
            attrs["allreduce"] = False
        grad = grads[source]
        tp_rank, tp_size = coords[tp_axis]
        if spec.split == "none":
            attrs.update(tensor_model_parallel=False, partition_dim=-1)
        else:
            dim = 0 if spec.split == "column" else 1
            grad = grad.chunk(tp_size, dim=dim)[tp_rank]
            attrs.update(tensor_model_parallel=True, partition_dim=dim, partition_stride=1)
        gtp_rank, gtp_size = coords[gtp_axis]
        if spec.gtp and gtp_size > 1:
            pad = gtp_pad_rows(grad.shape[0], layout.gtp_align, gtp_size)
            padded = torch.cat([grad, grad.new_zeros((pad, *grad.shape[1:]))])
            grad = padded.chunk(gtp_size)[gtp_rank]
            attrs.update(
                is_gtp_weight_remat=True, pad_length=pad, group=AxisPlace(gtp_rank, gtp_size)
            )
        if source != spec.name:
            attrs.update(shared=True, shared_embedding=True)
        elif spec.name in copied_across_stages:
            attrs["shared_embedding"] = True
        # Each rank owns its shard: editing one rank's gradient must not reach another's.
        params.append((spec.name, _param(grad.clone(memory_format=torch.contiguous_format), attrs)))
    return params


def _fragments(
    params: Sequence[tuple[str, torch.nn.Parameter]], dp_rank: int, dp_size: int
) -> list[tuple[str, torch.nn.Parameter]]:
    """The distributed optimizer's main params of ``dp_rank``: its range of the flat buffer."""
    total = sum(param.numel() for _, param in params)
    per_rank = -(-total // dp_size)
    low, high = dp_rank * per_rank, min(total, (dp_rank + 1) * per_rank)
    fragments, offset = [], 0
    for name, param in params:
        start, end = max(low, offset) - offset, min(high, offset + param.numel()) - offset
        offset += param.numel()
        if start >= end:
            continue
        attrs = {key: getattr(param, key) for key in FRAGMENT_ATTRS if hasattr(param, key)}
        if getattr(param, "is_gtp_weight_remat", False):
            attrs["gtp_pad_zeros"] = gtp_local_pad_zero_count(param, start, end)
        attrs.update(fragment_offset=start, fragment_shape=list(param.shape))
        assert param.grad is not None
        fragments.append((name, _param(param.grad.view(-1)[start:end], attrs)))
    return fragments


def shard_gradients(
    layout: Layout, specs: Sequence[ParamLayout], grads: Mapping[str, Tensor]
) -> list[RankParams]:
    """Every rank's share of the model's gradients in ``layout``, in rank order.

    Args:
        layout: the parallel layout.
        specs: every logical parameter (and tied copy), in module order.
        grads: each logical parameter's full gradient, by name (none for tied copies).

    Returns:
        One ``RankParams`` per rank; every gradient is the rank's own copy.

    Raises:
        LayoutError: a description that does not fit the layout or the gradients.
    """
    _check(layout, specs, grads)
    ranks = []
    for rank in range(layout.world_size):
        coords = layout.coords(rank)
        params = _model_params(layout, specs, grads, coords)
        if layout.distributed_optimizer:
            dense = [(name, p) for name, p in params if getattr(p, "allreduce", True)]
            expert = [(name, p) for name, p in params if not getattr(p, "allreduce", True)]
            dense_fragments = _fragments(dense, *data_parallel_with_cp(coords))
            params = dense_fragments + _fragments(expert, *coords["edp"])
        ranks.append(RankParams(rank, coords, params))
    return ranks


def write_snapshot(
    directory: str | os.PathLike[str],
    layout: Layout,
    ranks: Sequence[RankParams],
    *,
    step: int | None = None,
) -> list[Path]:
    """Save every rank's params of ``layout`` with ``save_rank``; existing files are kept.

    Returns:
        The rank files' paths, in rank order.

    Raises:
        SnapshotError: a rank file exists already or cannot be written.
    """
    from .snapshot import save_rank

    return [
        save_rank(
            directory,
            share.params,
            rank=share.rank,
            world_size=layout.world_size,
            coords=share.coords,
            distributed_optimizer=layout.distributed_optimizer,
            step=step,
        )
        for share in ranks
    ]

"""Shard a model's full gradients into a Megatron parallel layout: the one sharder of gradstat.

Given every logical parameter's unsharded gradient and where Megatron puts it (which TP split,
which pipeline stage, which expert, whether GTP shards it, which weight it is a tied copy of),
``shard_gradients`` builds what each rank of a job in that layout holds: its coordinates and its
``(name, param)`` pairs, each param carrying Megatron's attributes and its local gradient as
``.grad``; ``shard_rank`` builds one rank's share (in a multi-process test, each rank its own,
with its real GTP groups). ``write_snapshot`` saves them as a gradstat snapshot, one file per rank.
``Layout.groups`` lists the ranks of Megatron's groups along any axes, to make real ones.

The sharder uses none of the predicates it helps to test: GTP padding is found by padding and
splitting a real mask (``padding_mask``), never by gradstat's arithmetic.

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
  fragments of GTP shards are stamped with ``gtp_pad_zeros`` (the padding their mask holds),
  and every fragment with its ``fragment_offset`` and ``fragment_shape``.
"""

from __future__ import annotations

import os
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import torch
from torch import Tensor

from gradstat.core.axes import DENSE_AXES, EXPERT_AXES
from gradstat.core.groups import AxisPlace
from gradstat.errors import GradstatError
from gradstat.snapshot.format import FRAGMENT_INHERITED_ATTRS

__all__ = [
    "Layout",
    "LayoutError",
    "ParamLayout",
    "RankParams",
    "Split",
    "data_parallel_with_cp",
    "fragments",
    "gtp_pad_rows",
    "padding_mask",
    "shard_gradients",
    "shard_rank",
    "write_snapshot",
]

Split = Literal["column", "row", "none"]

# Attributes a distributed-optimizer fragment copies from its model param (its own
# gtp_pad_zeros stamp is computed for its range).
_FRAGMENT_ATTRS = (*FRAGMENT_INHERITED_ATTRS, "group")

# Where a GTP shard (or a fragment of one) keeps its padding mask; save_rank never writes it.
_PAD_MASK = "_gradstat_pad_mask"


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
        dense = _unravel(rank, [(axis, getattr(self, axis)) for axis in DENSE_AXES])
        expert = _unravel(
            rank % self.stage_size, [(axis, getattr(self, axis)) for axis in EXPERT_AXES]
        )
        return dense | expert | {"pp": (rank // self.stage_size, self.pp)}

    def groups(self, axes: Collection[str]) -> list[list[int]]:
        """The ranks of every Megatron group along ``axes``, as ``dist.new_group`` takes them.

        A group is the ranks whose coordinates differ on ``axes`` only, among the dense axes
        (tp, cp, gtp, dp, pp) or among the expert ones (etp, ep, egtp, edp, pp); groups come in
        the order of their lowest rank, so every process makes them in the same order.

        Raises:
            LayoutError: ``axes`` mixes dense and expert axes or names an unknown one.
        """
        family = next(
            ((*names, "pp") for names in (DENSE_AXES, EXPERT_AXES) if set(axes) <= {*names, "pp"}),
            None,
        )
        if family is None:
            raise LayoutError(
                f"layout: axes {sorted(axes)} are not all dense ({', '.join(DENSE_AXES)}, pp) "
                f"or all expert ({', '.join(EXPERT_AXES)}, pp)"
            )
        others = [axis for axis in family if axis not in axes]
        groups: dict[tuple[int, ...], list[int]] = {}
        for rank in range(self.world_size):
            coords = self.coords(rank)
            groups.setdefault(tuple(coords[axis][0] for axis in others), []).append(rank)
        return list(groups.values())


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


def padding_mask(param: Any) -> Tensor | None:
    """Which elements of a GTP shard's (or its fragment's) gradient are padding, as booleans.

    The mask is cut from a padded tensor the way the gradient was, so it shows where padding
    really is, independently of gradstat's padding arithmetic. None for any other parameter.
    """
    mask: Tensor | None = getattr(param, _PAD_MASK, None)
    return mask


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


def _gtp_shard(grad: Tensor, pad: int, gtp_rank: int, gtp_size: int) -> tuple[Tensor, Tensor]:
    """Rank ``gtp_rank``'s shard of ``grad`` padded with ``pad`` zero rows, and its padding
    mask, made by padding and splitting a real mask the same way."""
    padded = torch.cat([grad, grad.new_zeros((pad, *grad.shape[1:]))])
    is_pad = torch.zeros(padded.shape, dtype=torch.bool)
    is_pad[grad.shape[0] :] = True
    return padded.chunk(gtp_size)[gtp_rank], is_pad.chunk(gtp_size)[gtp_rank].clone()


def _model_params(
    layout: Layout,
    specs: Sequence[ParamLayout],
    grads: Mapping[str, Tensor],
    coords: Mapping[str, tuple[int, int]],
    gtp_groups: Mapping[str, Any],
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
            grad, mask = _gtp_shard(grad, pad, gtp_rank, gtp_size)
            group = gtp_groups.get(gtp_axis)
            attrs.update(
                is_gtp_weight_remat=True,
                pad_length=pad,
                group=AxisPlace(gtp_rank, gtp_size) if group is None else group,
            )
            attrs[_PAD_MASK] = mask
        if source != spec.name:
            attrs.update(shared=True, shared_embedding=True)
        elif spec.name in copied_across_stages:
            attrs["shared_embedding"] = True
        # Each rank owns its shard: editing one rank's gradient must not reach another's.
        params.append((spec.name, _param(grad.clone(memory_format=torch.contiguous_format), attrs)))
    return params


def fragments(
    params: Sequence[tuple[str, torch.nn.Parameter]], dp_rank: int, dp_size: int
) -> list[tuple[str, torch.nn.Parameter]]:
    """The distributed optimizer's main params of ``dp_rank``: its range of the flat buffer.

    ``params`` (one category, dense or expert, in order) are laid end to end in one flat buffer
    split into ``dp_size`` equal ranges; each fragment is ``grad.view(-1)[start:end]`` of a param
    overlapping this rank's range, with the param's attributes, ``gtp_pad_zeros`` for fragments
    of GTP shards, ``fragment_offset`` and ``fragment_shape``.

    Args:
        params: ``(name, param)`` pairs as ``shard_rank`` makes them (model params, not
            fragments).
        dp_rank: this rank's place in the group the optimizer shards over.
        dp_size: that group's size.

    Returns:
        ``(name, fragment)`` pairs; a fragment's gradient is a view of its param's.
    """
    total = sum(param.numel() for _, param in params)
    per_rank = -(-total // dp_size)
    low, high = dp_rank * per_rank, min(total, (dp_rank + 1) * per_rank)
    pieces, offset = [], 0
    for name, param in params:
        start, end = max(low, offset) - offset, min(high, offset + param.numel()) - offset
        offset += param.numel()
        if start >= end:
            continue
        attrs = {key: getattr(param, key) for key in _FRAGMENT_ATTRS if hasattr(param, key)}
        mask = padding_mask(param)
        if mask is not None:
            attrs[_PAD_MASK] = mask.reshape(-1)[start:end]
            attrs["gtp_pad_zeros"] = int(attrs[_PAD_MASK].sum())
        attrs.update(fragment_offset=start, fragment_shape=list(param.shape))
        assert param.grad is not None
        pieces.append((name, _param(param.grad.view(-1)[start:end], attrs)))
    return pieces


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
    return [
        _shard(layout, specs, grads, rank, layout.coords(rank), {})
        for rank in range(layout.world_size)
    ]


def shard_rank(
    layout: Layout,
    specs: Sequence[ParamLayout],
    grads: Mapping[str, Tensor],
    rank: int,
    *,
    coords: Mapping[str, tuple[int, int]] | None = None,
    gtp_groups: Mapping[str, Any] | None = None,
) -> RankParams:
    """What ``rank`` of a job in ``layout`` holds: ``shard_gradients``'s entry for one rank.

    Args:
        layout: the parallel layout.
        specs: every logical parameter (and tied copy), in module order.
        grads: each logical parameter's full gradient, by name (none for tied copies).
        rank: the global rank.
        coords: where the rank sits, ``{axis: (rank_on_axis, axis_size)}`` for every axis,
            when a live job says so (Megatron's parallel_state); ``layout.coords(rank)`` if
            None. Sizes must be the layout's.
        gtp_groups: the ``group`` attribute of GTP shards, by axis ("gtp", "egtp"): a live
            process group in a multi-process test; ``AxisPlace(rank, size)`` where missing.

    Returns:
        The rank's coordinates and ``(name, param)`` pairs; every gradient is its own copy.

    Raises:
        LayoutError: a description that does not fit the layout or the gradients, a rank
            outside the layout, or coordinates that are not the layout's.
    """
    _check(layout, specs, grads)
    expected = layout.coords(rank)
    if coords is None:
        coords = expected
    for axis, (_, size) in expected.items():
        place = coords.get(axis)
        if place is None or place[1] != size or not 0 <= place[0] < size:
            raise LayoutError(
                f"rank {rank}: coordinates {dict(coords)} give {axis} {place}, not a place on "
                f"the layout's {axis} axis of size {size}"
            )
    return _shard(layout, specs, grads, rank, dict(coords), gtp_groups or {})


def _shard(
    layout: Layout,
    specs: Sequence[ParamLayout],
    grads: Mapping[str, Tensor],
    rank: int,
    coords: dict[str, tuple[int, int]],
    gtp_groups: Mapping[str, Any],
) -> RankParams:
    params = _model_params(layout, specs, grads, coords, gtp_groups)
    if layout.distributed_optimizer:
        dense = [(name, p) for name, p in params if getattr(p, "allreduce", True)]
        expert = [(name, p) for name, p in params if not getattr(p, "allreduce", True)]
        params = fragments(dense, *data_parallel_with_cp(coords)) + fragments(
            expert, *coords["edp"]
        )
    return RankParams(rank, coords, params)


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
    from gradstat.snapshot import save_rank

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

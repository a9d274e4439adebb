"""Which gradients count: Megatron's parameter-attribute predicates and GTP padding.

A parameter is counted once per logical tensor: ``shared`` copies of tied weights are skipped,
replicas over tensor parallelism (TP, or ETP for expert parameters) count only on TP rank 0, and
replicas over generalized tensor parallelism (GTP, or EGTP) only on GTP rank 0. GTP shards carry
alignment padding: zero rows that were never gradients and must not count as zero gradients.
"""

from __future__ import annotations

import math
from typing import Any

from gradstat.core.groups import (
    RankLike,
    group_rank,
    group_size,
    megatron_gtp_group,
    megatron_state,
)
from gradstat.errors import AttributeMismatchError

__all__ = [
    "gtp_local_pad_zero_count",
    "gtp_pad_start",
    "gtp_pad_zero_count",
    "is_expert",
    "param_is_not_gtp_duplicate",
    "param_is_not_shared",
    "param_is_not_tensor_parallel_duplicate",
    "param_is_unique",
]


def is_expert(param: Any) -> bool:
    """Expert (MoE) parameters are marked ``allreduce=False``."""
    return not getattr(param, "allreduce", True)


def param_is_not_shared(param: Any) -> bool:
    """False for the second copy of a tied weight (``shared=True``), which must not count."""
    return not getattr(param, "shared", False)


# Megatron's parallel_state getters of a TP axis's rank in a live job.
_MEGATRON_RANKS = {"tp": "get_tensor_model_parallel_rank", "etp": "get_expert_tensor_parallel_rank"}


def megatron_rank(axis: str) -> int:
    """This process's rank on ``axis`` ("tp", "etp", "gtp", "egtp") in a live Megatron job.

    Read from ``megatron.core.parallel_state`` when the job has imported and initialised it, as
    Megatron's own predicates do when no group is given; 0 (the axis is not split) anywhere
    else. gradstat never imports Megatron itself.
    """
    state = megatron_state()
    if state is None:
        return 0
    if axis in _MEGATRON_RANKS:
        return int(getattr(state, _MEGATRON_RANKS[axis])())
    group = megatron_gtp_group(state, axis)
    return 0 if group is None else int(group.rank())


def _axis_rank(group: RankLike | None, axis: str) -> int:
    return megatron_rank(axis) if group is None else group_rank(group)


def param_is_not_tensor_parallel_duplicate(
    param: Any, tp_group: RankLike | None = None, expert_tp_group: RankLike | None = None
) -> bool:
    """True unless ``param`` is a TP replica held by a TP rank other than 0.

    Args:
        param: a tensor carrying Megatron's attributes.
        tp_group: the dense TP group, or anything with rank()/size(). None: read from Megatron's
            ``parallel_state`` inside a live Megatron job (as Megatron does), else not split.
        expert_tp_group: the expert TP group, used for ``allreduce=False`` params (None: the
            same, with the expert TP rank).
    """
    if getattr(param, "tensor_model_parallel", False):
        return True
    if is_expert(param):
        return _axis_rank(expert_tp_group, "etp") == 0
    return _axis_rank(tp_group, "tp") == 0


def param_is_not_gtp_duplicate(
    param: Any, gtp_group: RankLike | None = None, expert_gtp_group: RankLike | None = None
) -> bool:
    """True unless ``param`` is replicated over GTP and held by a GTP rank other than 0.

    GTP shards carry ``is_gtp_weight_remat``; everything else is a full copy on every GTP rank.
    A group left None is read from Megatron's ``parallel_state`` inside a live Megatron job (its
    GTP groups, where the version has them), else GTP is not split.
    """
    if getattr(param, "is_gtp_weight_remat", False):
        return True
    if is_expert(param):
        return _axis_rank(expert_gtp_group, "egtp") == 0
    return _axis_rank(gtp_group, "gtp") == 0


def param_is_unique(
    param: Any,
    tp_group: RankLike | None = None,
    expert_tp_group: RankLike | None = None,
    gtp_group: RankLike | None = None,
    expert_gtp_group: RankLike | None = None,
) -> bool:
    """Whether ``param`` holds values no other rank's copy counts: not a ``shared`` copy, not a
    TP/ETP duplicate, not a GTP/EGTP duplicate (groups as the three predicates take them)."""
    return (
        param_is_not_shared(param)
        and param_is_not_tensor_parallel_duplicate(param, tp_group, expert_tp_group)
        and param_is_not_gtp_duplicate(param, gtp_group, expert_gtp_group)
    )


def _param_label(param: Any) -> str:
    # Rebuilt snapshot params carry their logical name; live ones are named by shape.
    name = getattr(param, "_gradstat_name", None)
    shape = tuple(getattr(param, "shape", ()))
    return f"GTP shard {name!r} {shape}" if name else f"GTP shard of shape {shape}"


def gtp_local_pad_zero_count(gtp_shard: Any, range_start: int, range_end: int) -> int:
    """Padding elements of a GTP shard inside its flat element range [range_start, range_end).

    The padded tensor has ``rows * gtp_size`` rows, the last ``pad_length`` of them padding; this
    shard holds rows ``[gtp_rank * rows, (gtp_rank + 1) * rows)``. Padding longer than one
    shard spills into lower ranks' shards, so a shard can be partly or entirely padding.

    Args:
        gtp_shard: the rank's GTP shard, carrying ``pad_length`` and ``group`` (rank()/size()).
        range_start: first flat element of the range (a distributed-optimizer fragment's start).
        range_end: one past its last element.

    Returns:
        The number of padding elements in the range.

    Raises:
        AttributeMismatchError: pad_length beyond the padded tensor, or a range outside the shard.
    """
    numel = int(gtp_shard.numel())
    if not 0 <= range_start <= range_end <= numel:
        raise AttributeMismatchError(
            f"{_param_label(gtp_shard)}: range [{range_start}, {range_end}) is outside its "
            f"{numel} elements"
        )
    shape = tuple(int(size) for size in gtp_shard.shape)
    return _pad_in_range(gtp_shard, shape, range_start, range_end)


def _pad_in_range(gtp_shard: Any, shape: tuple[int, ...], range_start: int, range_end: int) -> int:
    """:func:`gtp_local_pad_zero_count` of a shard of ``shape`` (``gtp_shard`` carries its
    ``pad_length`` and ``group``; the range is inside the shard)."""
    numel = math.prod(shape)
    pad_length = int(getattr(gtp_shard, "pad_length", 0) or 0)
    if pad_length == 0 or numel == 0:
        return 0
    rows = shape[0] if shape else 1
    if not hasattr(gtp_shard, "group"):
        # Which rank of its GTP group it is decides where its padding lies; without it rank 0
        # was assumed, its data rows taken for padding (a zero count of -1).
        raise AttributeMismatchError(
            f"{_param_label(gtp_shard)}: a GTP shard with pad_length {pad_length} but no .group: "
            "where its padding lies depends on its rank in the GTP group; set .group (Megatron's "
            "GTP shards carry it; None for a GTP size of 1)"
        )
    group = gtp_shard.group
    gtp_rank, gtp_size = group_rank(group), group_size(group)
    padded_rows = rows * gtp_size
    if not 0 <= pad_length <= padded_rows:
        raise AttributeMismatchError(
            f"{_param_label(gtp_shard)}: pad_length {pad_length} exceeds the {padded_rows} rows "
            f"of the padded tensor ({rows} rows x GTP size {gtp_size})"
        )
    pad_start = gtp_pad_start(rows, numel // rows, pad_length, gtp_rank, gtp_size)
    return max(0, min(range_end, numel) - max(range_start, pad_start))


def gtp_pad_start(rows: int, row_numel: int, pad_length: int, gtp_rank: int, gtp_size: int) -> int:
    """The first flat element of a GTP shard that is padding (``rows * row_numel``: none).

    The padded tensor has ``rows * gtp_size`` rows, the last ``pad_length`` of them padding;
    the shard of ``gtp_rank`` holds rows ``[gtp_rank * rows, (gtp_rank + 1) * rows)``.
    """
    first_pad_row = min(max(rows * gtp_size - pad_length - gtp_rank * rows, 0), rows)
    return first_pad_row * row_numel


def gtp_pad_zero_count(param: Any, grad: Any) -> int:
    """Structural GTP padding zeros to subtract from ``grad``'s raw zero count.

    A distributed-optimizer fragment carries the count stamped as ``gtp_pad_zeros`` (only the
    optimizer knows the fragment's offset), or, rebuilt from a snapshot, its place in its shard
    (``fragment_offset`` in a shard of ``fragment_shape``), from which the count is computed. A
    whole, unstamped GTP shard gets it computed from ``pad_length`` and its GTP rank (a 1-D one
    only where it is known to be whole). Anything else, an unstamped flat fragment without its
    place, has no padding that can be placed. Nothing is written onto ``param``: the
    computation is a few integer operations.
    """
    stamped = getattr(param, "gtp_pad_zeros", None)
    if stamped is not None:
        return int(stamped)
    if not getattr(param, "is_gtp_weight_remat", False):
        return 0
    offset, whole = getattr(param, "fragment_offset", None), getattr(param, "fragment_shape", None)
    if offset is not None and whole is not None:
        shape = tuple(int(size) for size in whole)
        return _pad_in_range(param, shape, int(offset), int(offset) + int(grad.numel()))
    # Only a whole shard can be placed: a flat fragment carrying copied attributes but no stamp
    # has lost the offset its padding count depends on. A live fragment's parameter is the
    # fragment itself (Megatron's distributed optimizer shards are views of their own shape),
    # so a 1-D gradient is a whole shard only where the parameter says so (a snapshot of a
    # plain optimizer's job).
    if tuple(grad.shape) != tuple(param.shape):
        return 0
    if grad.dim() < 2 and not getattr(param, "_gradstat_whole_shard", False):
        return 0
    return gtp_local_pad_zero_count(param, 0, int(param.numel()))

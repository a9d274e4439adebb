"""DTensor shards that other ranks hold copies of, counted by their largest copy.

A ``Replicate`` mesh dimension, and a root-mesh dimension that a mesh slice leaves out (see
:mod:`gradstat.core.placements`), hold copies of a shard that ought to be equal; a norm counts
one of them, the copy at coordinate 0. Where they differ (a spike or a NaN on one replica group
of an HSDP job, a gradient one rank holds and the rank at coordinate 0 does not), counting
coordinate 0 alone would hide it. So, as for plain data-parallel replicas
(:mod:`gradstat.core.replicas`), a statistic that sums (a p-norm's sums, a zero count) counts
each shard by its largest copy, and one that maximises takes every copy in.

Telling costs almost nothing. Each rank groups its shards by where their copies are (the root
mesh, the dimensions holding copies, its coordinates on the others: the same on every copy),
and the statistic's first all-reduce also sums four numbers over the groups: each copy group's
statistic and its square, and each counted group's times the number of its other copies. Equal
copies make those sums agree (to rounding). Only where they differ (a fault) does every rank
gather each shard's statistic from every other, to count each by its largest copy.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from gradstat.core.placements import MeshPlacement

__all__ = ["CopyGroup", "copy_group_key", "differ", "largest_copies", "moments"]

GroupKey = tuple[Any, ...]

# Sums of equal copies agree to rounding; copies that differ (a fault) by far more.
_TOLERANCE = 1e-9


@dataclass
class CopyGroup:
    """One rank's shards of one group: those whose copies lie along the same dimensions.

    Attributes:
        key: equal on every copy of the group's shards (:func:`copy_group_key`).
        size: how many ranks hold a copy of each shard (this one included).
        is_copy: whether this rank's copies are counted elsewhere (not at coordinate 0).
        places: each shard's place in the caller's list.
        tensors: the local shards.
    """

    key: GroupKey
    size: int
    is_copy: bool
    places: list[int] = field(default_factory=list)
    tensors: list[Tensor] = field(default_factory=list)


def copy_group_key(
    place: MeshPlacement, root: Any, root_key: Any, tensor_parallel: bool
) -> tuple[GroupKey, int, bool] | None:
    """The group of a DTensor shard with copies on other ranks: its key (equal on every copy
    of the shard, distinct for any other shard), the number of copies and whether this one is
    counted elsewhere; None when no other rank holds a copy.

    Args:
        place: where the shard lies (:func:`gradstat.core.placements.describe`).
        root: the root mesh of the shard's mesh.
        root_key: an identity of ``root`` that every rank computes alike.
        tensor_parallel: the parameter is Megatron tensor-parallel (a TP dimension splits it).
    """
    dims = place.copy_dims(tensor_parallel)
    if not dims:
        return None
    copied = frozenset(name for name, _, _ in dims)
    names = root.mesh_dim_names or tuple(f"dim {dim}" for dim in range(root.ndim))
    coordinate = root.get_coordinate()
    held_at = tuple(
        -1 if name in copied else int(index) for name, index in zip(names, coordinate, strict=True)
    )
    key = (root_key, tuple(sorted(copied)), held_at)
    return key, math.prod(size for _, _, size in dims), any(index for _, index, _ in dims)


Compute = Callable[[list[Tensor], torch.device], Tensor]


def moments(
    groups: Sequence[CopyGroup],
    stats: Sequence[Tensor],
    shape: torch.Size,
    device: torch.device,
) -> tuple[Tensor, Tensor]:
    """The counted groups' statistic, and the sums that tell whether copies differ.

    Args:
        groups: this rank's groups.
        stats: each group's statistic, of ``shape``.
        shape: the statistic's shape.
        device: where the sums live.

    Returns:
        The sum of ``compute`` over this rank's counted groups, and a flat tensor of two
        halves: over the copy groups, then over the counted groups each times the number of
        other copies: the statistic and its square, each weighted by a number drawn from the
        group's key (so that differences in two groups do not cancel), and the weights of the
        places the groups hold (so that a shard missing here and another there do not
        cancel). Summed over the ranks, the halves agree where every copy equals the counted.
    """
    counted = torch.zeros(shape, dtype=torch.float64, device=device)
    found = torch.zeros((2, 2, *shape), dtype=torch.float64, device=device)
    held = [0.0, 0.0]
    for group, found_here in zip(groups, stats, strict=True):
        stat = found_here.to(torch.float64)
        side, times = (0, 1) if group.is_copy else (1, group.size - 1)
        if not group.is_copy:
            counted += stat
        digest = hash_key(group.key)
        weight = times * _draw(digest)
        found[side, 0] += weight * stat
        found[side, 1] += weight * stat * stat
        held[side] += times * math.fsum(_draw(_mix(digest, place)) for place in group.places)
    halves = [found[side].reshape(-1) for side in (0, 1)]
    places = torch.tensor(held, dtype=torch.float64, device=device)
    return counted, torch.cat([halves[0], places[:1], halves[1], places[1:]])


def hash_key(key: Any) -> int:
    """A 64-bit digest of a key every rank builds alike (``hash`` of text varies by process)."""
    digest = hashlib.blake2b(repr(key).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little")


def _mix(digest: int, place: int) -> int:
    """A digest of a place in the list within a group (Fibonacci hashing, then xorshift)."""
    mixed = (digest ^ ((place + 1) * 0x9E3779B97F4A7C15)) & _BITS
    mixed ^= mixed >> 29
    return (mixed * 0xBF58476D1CE4E5B9) & _BITS


_BITS = (1 << 64) - 1


def _draw(digest: int) -> float:
    """A number in [1, 2) drawn from ``digest``."""
    return 1.0 + (digest >> 12) / float(1 << 52)


def differ(found: Sequence[float]) -> bool:
    """Whether :func:`moments`' sums (reduced over the ranks) say some copy differs from the
    one counted."""
    half = len(found) // 2
    for ours, theirs in zip(found[:half], found[half:], strict=True):
        if math.isnan(ours) or math.isnan(theirs):
            return True
        if abs(ours - theirs) > _TOLERANCE * max(abs(ours), abs(theirs)):
            return True
    return False


def largest_copies(
    groups: Sequence[CopyGroup], compute: Compute, shape: torch.Size, device: torch.device
) -> Tensor:
    """The statistic of every shard with copies, each counted by its largest copy (a NaN by
    the NaN): a collective over the default group, which every rank calls.

    Each rank sends each of its shards' statistic under the shard's group key and place in the
    list; a shard held nowhere at coordinate 0 (a gradient missing there) counts by a copy.
    """
    mine = []
    for group in groups:
        for place, tensor in zip(group.places, group.tensors, strict=True):
            mine.append(((group.key, place), compute([tensor], device).flatten().tolist()))
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, mine)
    largest: dict[Any, list[float]] = {}
    for sent in gathered:
        for piece, values in sent:
            known = largest.setdefault(piece, values)
            largest[piece] = [_larger(a, b) for a, b in zip(known, values, strict=True)]
    total = [math.fsum(column) for column in zip(*largest.values(), strict=True)]
    flat = torch.tensor(total or [0.0] * math.prod(shape), dtype=torch.float64, device=device)
    return flat.reshape(shape)


def _larger(a: float, b: float) -> float:
    return math.nan if math.isnan(a) or math.isnan(b) else max(a, b)

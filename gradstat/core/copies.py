"""DTensor shards that other ranks hold copies of, counted by their largest copy.

A ``Replicate`` mesh dimension, and a root-mesh dimension that a mesh slice leaves out (see
:mod:`gradstat.core.placements`), hold copies of a shard that ought to be equal; a norm counts
one of them, the copy at coordinate 0. Where they differ (a spike or a NaN on one replica group
of an HSDP job, a gradient one rank holds and the rank at coordinate 0 does not), counting
coordinate 0 alone would hide it. So, as for plain data-parallel replicas
(:mod:`gradstat.core.replicas`), a statistic that sums (a p-norm's sums, a zero count) counts
each shard by its largest copy, and one that maximises takes every copy in.

Telling costs no collective of its own. Each rank groups its shards by the ranks that hold
their copies (the same set on every copy), and the statistic's first all-reduce also sums, over
the copies and over the counted shards (times their number of other copies), each shard's
statistic and its square root, weighted by a number drawn from its group, its place in the list
and its shapes, and the weights themselves. Equal copies make the two agree (to rounding); a
difference, even two that would cancel in a plain sum, does not. Only then (a fault) does every
rank gather each shard's statistic from every other, to count each by its largest copy.

A shard's copies are told by their place in the caller's list, which ``total_norm(model.
parameters())`` keeps on every rank (a gradient None is a place too). Where the ranks' lists do
not line up (of other lengths: ``[p.grad for p in params if p.grad is not None]`` with a None
on one rank; or shards of other shapes at one place: another order), a shard is told by its
shapes and, among a group's shards of the same shapes, by its statistic (equal copies agree bit
for bit), those that differ in their order. Lists of one length that hold shards of the same
shapes in other orders cannot be told from copies that differ: give every rank the same list.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from gradstat.core.placements import MeshPlacement, root_mesh

__all__ = ["CopyGroup", "copy_group_key", "differ", "largest_copies", "moments", "moments_size"]

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
        shapes: each shard's :func:`shapes` (equal on its copies).
    """

    key: GroupKey
    size: int
    is_copy: bool
    places: list[int] = field(default_factory=list)
    tensors: list[Tensor] = field(default_factory=list)
    shapes: list[Shapes] = field(default_factory=list)

    def add(self, place: int, dtensor: Any, local: Tensor) -> None:
        """Add a shard: its place, and the DTensor's local tensor ``local`` (its statistic is
        computed or its tensor kept by the caller)."""
        self.places.append(place)
        self.shapes.append(shapes(dtensor, local))


Shapes = tuple[tuple[int, ...], tuple[int, ...], str]


def shapes(dtensor: Any, local: Tensor) -> Shapes:
    """What every copy of a shard shares and most other shards do not: the DTensor's global
    shape, its local shape and its dtype."""
    return tuple(dtensor.shape), tuple(local.shape), str(local.dtype)


def copy_group_key(
    place: MeshPlacement, mesh: Any, root_key: Any, tensor_parallel: bool
) -> tuple[GroupKey, int, bool] | None:
    """The group of a DTensor shard with copies on other ranks: its key (equal on every copy
    of the shard, distinct for any other shard), the number of copies and whether this one is
    counted elsewhere; None when no other rank holds a copy.

    The key is the set of ranks that hold the copies, read off the meshes themselves: a
    flattened mesh dimension, or a slice's, names no dimension of the root, but its ranks are
    the same on every copy.

    Args:
        place: where the shard lies (:func:`gradstat.core.placements.describe`).
        mesh: the shard's own mesh.
        root_key: an identity of its root mesh that every rank computes alike.
        tensor_parallel: the parameter is Megatron tensor-parallel (a TP dimension splits it).
    """
    dims = place.copy_dims(tensor_parallel)
    if not dims:
        return None
    holders = _holders(place, mesh, {name for name, _, _ in dims})
    return (root_key, holders), len(holders), any(index for _, index, _ in dims)


def _holders(place: MeshPlacement, mesh: Any, copied: set[str]) -> tuple[int, ...]:
    """The ranks that hold a copy of the shard (this one included), in rank order: those of
    its mesh along its copy dimensions, each spread along the root's copy dimensions."""
    line = tuple(
        slice(None) if place.dim_name(dim) in copied else index
        for dim, index in enumerate(place.coordinate)
    )
    ranks = set(mesh.mesh[line].flatten().tolist())
    root = root_mesh(mesh)
    names = root.mesh_dim_names or ()
    for dim, name in enumerate(names):
        if name not in copied or name in (mesh.mesh_dim_names or ()):
            continue
        grid = root.mesh
        spread = set()
        for rank in ranks:
            at = [int(index) for index in (grid == rank).nonzero()[0]]
            for position in range(grid.shape[dim]):
                at[dim] = position
                spread.add(int(grid[tuple(at)]))
        ranks = spread
    return tuple(sorted(ranks))


def moments(
    groups: Sequence[CopyGroup],
    stats: Sequence[Tensor],
    shape: torch.Size,
    device: torch.device,
) -> tuple[Tensor, Tensor]:
    """The counted groups' statistic, and the sums that tell whether copies differ.

    Args:
        groups: this rank's groups.
        stats: per group, its shards' statistics, stacked (``(len(group.tensors), *shape)``).
        shape: the statistic's shape.
        device: where the sums live.

    Returns:
        The sum of the statistics of this rank's counted groups, and a flat tensor of two
        halves: over the copy groups, then over the counted groups each times the number of
        other copies: each shard's statistic and its square root, weighted by a number drawn
        from the shard's group and place (so that differences in two shards do not cancel),
        and the weights themselves (so that a shard missing here and another there do not
        cancel). Summed over the ranks, the halves agree where every copy equals the counted.
    """
    counted = torch.zeros(shape, dtype=torch.float64, device=device)
    found = torch.zeros((2, 2, *shape), dtype=torch.float64, device=device)
    held = [0.0, 0.0]
    digests: dict[Shapes, int] = {}
    for group, each in zip(groups, stats, strict=True):
        values = each.to(device=device, dtype=torch.float64)
        side, times = (0, 1) if group.is_copy else (1, group.size - 1)
        if not group.is_copy:
            counted += values.sum(0)
        digest = hash_key(group.key)
        drawn = [
            times * _draw(_mix(digest ^ _shapes_digest(its, digests), place))
            for place, its in zip(group.places, group.shapes, strict=True)
        ]
        weights = torch.tensor(drawn, dtype=torch.float64, device=device)
        weights = weights.reshape(-1, *([1] * len(shape)))
        found[side, 0] += (weights * values).sum(0)
        found[side, 1] += (weights * values.abs().sqrt()).sum(0)
        held[side] += math.fsum(drawn)
    halves = [found[side].reshape(-1) for side in (0, 1)]
    places = torch.tensor(held, dtype=torch.float64, device=device)
    return counted, torch.cat([halves[0], places[:1], halves[1], places[1:]])


def moments_size(width: int) -> int:
    """How many numbers :func:`moments` gives for a statistic of ``width`` numbers."""
    return 2 * (2 * width + 1)


def _shapes_digest(held: Shapes, known: dict[Shapes, int]) -> int:
    found = known.get(held)
    if found is None:
        found = known[held] = hash_key(held)
    return found


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
    one counted. A sum past float64's range tells nothing, so it counts as a difference (the
    exact way is then taken)."""
    half = len(found) // 2
    for ours, theirs in zip(found[:half], found[half:], strict=True):
        gap = abs(ours - theirs)
        if not math.isfinite(gap) or gap > _TOLERANCE * max(abs(ours), abs(theirs)):
            return True
    return False


def largest_copies(
    groups: Sequence[CopyGroup],
    stats: Sequence[Tensor],
    shape: torch.Size,
    device: torch.device,
    length: int,
    without: Sequence[int] = (),
) -> Tensor:
    """The statistic of every shard with copies, each counted by its largest copy (a NaN by
    the NaN): a collective over the default group, which every rank calls.

    Each rank sends each of its shards' statistic (``stats`` as :func:`moments` takes them)
    with the shard's group key, place in the list and shapes, the length of its list
    (``length``) and its places that hold no gradient (``without``); a shard held nowhere at
    coordinate 0 (a gradient missing there) counts by a copy. Copies are told by their place,
    or by their shapes where the lists do not line up (see the module's docstring).
    """
    mine = []
    for group, each in zip(groups, stats, strict=True):
        rows = each.reshape(len(group.places), -1).tolist()
        held = zip(group.places, group.shapes, rows, strict=True)
        mine += [(group.key, place, its, row) for place, its, row in held]
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, (length, frozenset(without), mine))
    unaligned = _unaligned(gathered)
    largest: dict[Any, list[float]] = {}
    by_shapes: dict[tuple[GroupKey, Shapes], list[list[list[float]]]] = {}
    for _, _, sent in gathered:
        held_here: dict[tuple[GroupKey, Shapes], list[list[float]]] = {}
        for key, place, its, values in sent:
            if key in unaligned:
                held_here.setdefault((key, its), []).append(values)
                continue
            known = largest.setdefault((key, place), values)
            largest[key, place] = [_larger(a, b) for a, b in zip(known, values, strict=True)]
        for kind, rows in held_here.items():
            by_shapes.setdefault(kind, []).append(rows)
    for kind, ranks_rows in by_shapes.items():
        for which, values in enumerate(_matched(ranks_rows)):
            largest[(*kind, which)] = values
    total = [math.fsum(column) for column in zip(*largest.values(), strict=True)]
    flat = torch.tensor(total or [0.0] * math.prod(shape), dtype=torch.float64, device=device)
    return flat.reshape(shape)


def _unaligned(gathered: Sequence[Any]) -> set[GroupKey] | _Every:
    """The groups whose copies the ranks' places do not tell: every group where the lists are
    of other lengths, else those where a place holds shards of other shapes, or a shard on one
    copy and another gradient (not nothing) on another (another order)."""
    if len({length for length, _, _ in gathered}) > 1:
        return _EVERY
    at: dict[tuple[GroupKey, int], Shapes] = {}
    held_by: dict[GroupKey, dict[int, set[int]]] = {}
    found = set()
    for rank, (_, _, sent) in enumerate(gathered):
        for key, place, its, _ in sent:
            if at.setdefault((key, place), its) != its:
                found.add(key)
            held_by.setdefault(key, {}).setdefault(place, set()).add(rank)
    for key, places in held_by.items():
        holders = key[1]  # the ranks holding the group's copies (see copy_group_key)
        for place, ranks in places.items():
            if any(rank not in ranks and place not in gathered[rank][1] for rank in holders):
                found.add(key)
    return found


def _matched(held: Sequence[list[list[float]]]) -> list[list[float]]:
    """The largest copy of each shard of one group and shapes, given each rank's statistics of
    its shards (in its list's order) where the lists do not line up: the rank holding the most
    is the reference; another rank's shard is the reference's shard whose statistic it equals
    (equal copies agree bit for bit), and those left over (copies that differ) are the shards
    left over, in order."""
    reference = max(held, key=len)
    largest = [list(row) for row in reference]
    for rows in held:
        if rows is reference:
            continue
        free = list(range(len(reference)))
        left = []
        for row in rows:
            match = next((index for index in free if reference[index] == row), None)
            if match is None:
                left.append(row)
            else:
                free.remove(match)
        for index, row in zip(free, left, strict=False):
            largest[index] = [_larger(a, b) for a, b in zip(largest[index], row, strict=True)]
    return largest


class _Every:
    """Every group (``key in _EVERY``)."""

    def __contains__(self, key: object) -> bool:
        return True


_EVERY = _Every()


def _larger(a: float, b: float) -> float:
    return math.nan if math.isnan(a) or math.isnan(b) else max(a, b)

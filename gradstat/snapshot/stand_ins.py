"""Replicas that stand in for the counted copy when it holds no gradient.

With a plain optimizer a parameter's data-parallel (and context-parallel) replicas are equal,
and a snapshot counts the copy at coordinate 0 (expert parameters: at expert-data-parallel
coordinate 0), as Megatron does. A job whose ranks lack different gradients (None on rank 0
and not on rank 1: a batch that never reached a parameter there) leaves that copy empty; the
gradient is then counted at the first replica that holds it, as the library's
:func:`gradstat.total_norm` counts a live job's replicas (their union). A replica that lacks
it as well defers to the next.

What decides it is the records without a gradient of every rank file, which the processes
reading a share of a snapshot exchange with the files' summaries (usually none).
"""

from __future__ import annotations

import operator
import zlib
from collections import defaultdict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import replace
from typing import Any, NamedTuple

from gradstat.core.axes import DENSE_AXES, EXPERT_AXES, Axis
from gradstat.errors import SnapshotError
from gradstat.snapshot.format import RankHeader

__all__ = [
    "Listing",
    "copy_rows",
    "copy_stand_ins",
    "lacked_names",
    "lacking",
    "listing",
    "names_digest",
    "with_stand_ins",
]

_REPLICA_AXES = {False: (Axis.dp, Axis.cp), True: (Axis.edp,)}
_SITE_AXES = {
    expert: tuple(axis for axis in (*axes, Axis.pp) if axis not in _REPLICA_AXES[expert])
    for expert, axes in ((False, DENSE_AXES), (True, EXPERT_AXES))
}

Lacking = tuple[tuple[str, bool], ...]  # (name, expert) of each record without a gradient


class Listing(NamedTuple):
    """What deciding the stand-ins reads of one rank file: its header (its records need not be
    there), its records without a gradient, and a digest of its records' names."""

    name: str  # the file's, for messages
    header: RankHeader
    lacking: Lacking
    names: tuple[int, int]  # names_digest: dense, expert


def lacking(header: RankHeader) -> Lacking:
    """The records of a plain-optimizer rank file that hold no gradient (a distributed
    optimizer's fragments are no replicas: none)."""
    missing: Lacking = ()
    if header.distributed_optimizer:
        return missing
    for record in header.params:  # a loop: once per rank file, 8192 of them (a generator: 2x)
        if not record.has_grad:
            missing += ((record.name, record.is_expert),)
    return missing


def names_digest(header: RankHeader) -> tuple[int, int]:
    """Digests of the file's dense and of its expert parameter names, in any order: replicas
    list the same (expert-parallel ranks hold other experts: the expert names are compared among
    expert-data-parallel replicas alone)."""
    dense = "\0".join(sorted(record.name for record in header.params if not record.is_expert))
    expert = "\0".join(sorted(record.name for record in header.params if record.is_expert))
    # A name read from a file may hold lone surrogates (bytes that were no UTF-8): kept as such.
    return (
        zlib.crc32(dense.encode("utf-8", "surrogatepass")),
        zlib.crc32(expert.encode("utf-8", "surrogatepass")),
    )


_NO_NAMES = zlib.crc32(b"")


def listing(name: str, header: RankHeader) -> Listing:
    return Listing(name, header, lacking(header), names_digest(header))


def _getter(axes: Sequence[str]) -> Callable[[Mapping[str, tuple[int, int]]], Place]:
    """The ``(rank, size)`` of each of ``axes`` in a file's coordinates, as one tuple (one C
    call: every process does this for every rank file, 2 us a file as a generator)."""
    if len(axes) == 1:
        (axis,) = axes
        return lambda coords: (coords[axis],)
    return operator.itemgetter(*axes)


# A file's site and its place among a site's replicas, by expert (False, True): (rank, size)
# on each axis (the sizes are every file's, checked before).
Place = tuple[tuple[int, int], ...]
_SITE = (_getter(_SITE_AXES[False]), _getter(_SITE_AXES[True]))
_PLACE = (_getter(_REPLICA_AXES[False]), _getter(_REPLICA_AXES[True]))


def _lowest(place: Place) -> bool:
    """Whether ``place`` is coordinate 0 on every axis."""
    return not any(rank for rank, _ in place)


def with_stand_ins(
    files: Sequence[Any],
    everyone: Sequence[Listing],
    copies: Mapping[int, set[str]] | None = None,
) -> list[Any]:
    """``files`` (rank files), each whose gradients stand in for a lower replica's given their
    names in its header's ``stand_ins``.

    Replicas must list the same parameters: where they do not, a parameter one lists and
    another does not is counted by neither or by both depending on which is at coordinate 0,
    so the snapshot is refused.

    Args:
        files: the rank files to mark (all of a snapshot's, or a process's share).
        everyone: :func:`listing` of every rank file.
        copies: the DTensor stand-ins by rank (:func:`copy_stand_ins` of every rank file's
            :func:`copy_rows`), where ``everyone`` holds no records (a process's share); None:
            found from ``everyone``'s records.

    Raises:
        SnapshotError: replicas that list different parameters; two files holding experts at
            the same expert coordinates.
    """
    places: dict[tuple[bool, Place], set[Place]] = defaultdict(set)
    lists: dict[tuple[bool, Place], tuple[int, str]] = {}  # first digest, its file
    without: dict[tuple[bool, Place, str], set[Place]] = defaultdict(set)
    expert_places: dict[Place, str] = {}
    # Every process runs this loop over every rank file: its steps are C calls where they can be.
    for found in everyone:
        header = found.header
        if header.distributed_optimizer:
            continue
        coords, digests = header.coords, found.names
        if digests[1] != _NO_NAMES:
            # Each copy of an expert is counted at expert-data-parallel coordinate 0: two files
            # at one expert place (edp left out of coords over dp ranks) would count it twice.
            where = _SITE[True](coords) + _PLACE[True](coords)
            if where in expert_places:
                raise SnapshotError(
                    f"{found.name} and {expert_places[where]} hold expert parameters at the "
                    "same expert coordinates (etp, ep, egtp, edp, pp): each would count its "
                    "copy; give the expert axes (edp) as the job has them"
                )
            expert_places[where] = found.name
        for expert in (False, True):
            site, place = _SITE[expert](coords), _PLACE[expert](coords)
            seen = places[expert, site]
            # Replicas are files at other places of one site (files at one expert place that
            # hold no expert are none: their expert lists are empty, not different).
            digest, first = lists.setdefault((expert, site), (digests[expert], found.name))
            if place not in seen and digests[expert] != digest:
                other = found.name
                raise SnapshotError(
                    f"{first} and {other} are data-parallel replicas (their coordinates "
                    "differ in dp, cp or edp alone) yet list different parameters: which "
                    "copy counts is unknown; dump every parameter on every rank, as "
                    "dump_rank does"
                )
            seen.add(place)
        for name, expert in found.lacking:
            without[expert, _SITE[expert](coords), name].add(_PLACE[expert](coords))
    if not without:
        return list(files)
    if copies is None:
        lacked = lacked_names(everyone)
        copies = copy_stand_ins(copy_rows([found.header for found in everyone], lacked))
    marked = []
    for file in files:
        header = file.header
        names = set(copies.get(header.rank, ()))
        for record in () if header.distributed_optimizer else header.params:
            if record.dtensor is not None:
                continue  # placements decide: its copies are _copy_stand_ins'
            expert = record.is_expert
            site = _SITE[expert](header.coords)
            empty = without.get((expert, site, record.name))
            if not record.has_grad or not empty:
                continue
            holders = sorted(places[expert, site] - empty)
            place = _PLACE[expert](header.coords)
            if holders and holders[0] == place and not _lowest(place):
                names.add(record.name)
        if names:
            file = replace(file, header=replace(header, stand_ins=frozenset(names)))
        marked.append(file)
    return marked


def lacked_names(everyone: Sequence[Any]) -> set[str]:
    """The names of the records some rank file holds no gradient of (``everyone``: listings or
    summaries, each with its ``lacking``)."""
    return {name for found in everyone for name, _ in found.lacking}


def copy_rows(headers: Sequence[RankHeader], names: set[str]) -> list[list[Any]]:
    """What deciding the DTensor stand-ins reads of ``headers``: each DTensor record of one of
    ``names`` (those some rank file lacks) that holds a gradient, as ``[rank, shard, along]``
    (JSON data: processes reading a share of a snapshot exchange them). ``shard`` tells the
    shard from every other (its name, shapes, offset and its place on its mesh but along its
    Replicate dimensions, which tells a record without offsets); ``along`` is its coordinate
    along the dimensions that hold its copies (all 0: the copy that counts)."""
    rows: list[list[Any]] = []
    if not names:
        return rows
    for header in headers:
        for record in header.params:
            place = record.dtensor
            if place is None or not record.has_grad or record.name not in names:
                continue
            site = [
                0 if code == "R" else index
                for code, index in zip(place.placements, place.coordinate, strict=True)
            ]
            offset = None if place.global_offset is None else list(place.global_offset)
            shard = [record.name, list(place.global_shape), offset, list(record.shape), site]
            along = place.copy_dims(bool(record.attr("tensor_model_parallel")))
            rows.append([header.rank, shard, [index for _, index, _ in along]])
    return rows


def copy_stand_ins(rows: Sequence[Sequence[Any]]) -> dict[int, set[str]]:
    """Per rank file (by rank), the DTensor records that stand in for their shard's copy at
    coordinate 0, which holds no gradient (its rank's gradient was None): of the copies that
    hold one (``rows``, :func:`copy_rows`'), the one at the lowest coordinate along the copies'
    dimensions, as :func:`gradstat.total_norm` counts such a shard by a copy that holds it."""
    counted = set()
    held: dict[str, list[tuple[tuple[int, ...], int, str]]] = defaultdict(list)
    for rank, shard, along in rows:
        key = repr(shard)  # lists from JSON: their text is the key
        if any(along):
            held[key].append((tuple(along), rank, shard[0]))
        else:
            counted.add(key)
    found_by_rank: dict[int, set[str]] = defaultdict(set)
    for key, copies in held.items():
        if key not in counted:
            _, rank, name = min(copies)
            found_by_rank[rank].add(name)
    return found_by_rank

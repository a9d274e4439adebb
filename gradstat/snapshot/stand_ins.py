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

from collections import defaultdict
from collections.abc import Mapping, Sequence
from dataclasses import replace
from typing import Any

from gradstat.core.axes import DENSE_AXES, EXPERT_AXES, Axis
from gradstat.snapshot.format import RankHeader

__all__ = ["lacking", "with_stand_ins"]

_REPLICA_AXES = {False: (Axis.dp, Axis.cp), True: (Axis.edp,)}
_SITE_AXES = {
    expert: tuple(axis for axis in (*axes, Axis.pp) if axis not in _REPLICA_AXES[expert])
    for expert, axes in ((False, DENSE_AXES), (True, EXPERT_AXES))
}

Lacking = tuple[tuple[str, bool], ...]  # (name, expert) of each record without a gradient


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


def _site(coords: Mapping[str, tuple[int, int]], expert: bool) -> tuple[int, ...]:
    return tuple(coords[axis][0] for axis in _SITE_AXES[expert])


def _place(coords: Mapping[str, tuple[int, int]], expert: bool) -> tuple[int, ...]:
    return tuple(coords[axis][0] for axis in _REPLICA_AXES[expert])


def with_stand_ins(
    files: Sequence[Any], everyone: Sequence[tuple[RankHeader, Lacking]]
) -> list[Any]:
    """``files`` (rank files), each whose gradients stand in for a lower replica's given their
    names in its header's ``stand_ins``.

    Args:
        files: the rank files to mark (all of a snapshot's, or a process's share).
        everyone: every rank file's header (its records need not be there) and
            :func:`lacking` of it.
    """
    if not any(missing for _, missing in everyone):
        return list(files)
    places: dict[tuple[bool, tuple[int, ...]], set[tuple[int, ...]]] = defaultdict(set)
    without: dict[tuple[bool, tuple[int, ...], str], set[tuple[int, ...]]] = defaultdict(set)
    for header, missing in everyone:
        if header.distributed_optimizer:
            continue
        for expert in (False, True):
            places[expert, _site(header.coords, expert)].add(_place(header.coords, expert))
        for name, expert in missing:
            without[expert, _site(header.coords, expert), name].add(_place(header.coords, expert))
    marked = []
    for file in files:
        header = file.header
        names = set()
        for record in () if header.distributed_optimizer else header.params:
            expert = record.is_expert
            site = _site(header.coords, expert)
            empty = without.get((expert, site, record.name))
            if not record.has_grad or not empty:
                continue
            holders = sorted(places[expert, site] - empty)
            place = _place(header.coords, expert)
            if holders and holders[0] == place and any(place):
                names.add(record.name)
        if names:
            file = replace(file, header=replace(header, stand_ins=frozenset(names)))
        marked.append(file)
    return marked

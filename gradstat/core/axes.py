"""The parallel axes of a training job, named once.

A rank's place in a Megatron-style job is its ``[rank_on_axis, axis_size]`` on each axis;
snapshots record it per rank file under these names, and a DeviceMesh whose dimensions carry
them maps onto them. Dense parameters are split over the dense axes, expert parameters over the
expert ones; both share the pipeline axis:

====  ==========================================================================
tp    tensor parallel: a dense layer's weight split across ranks
pp    pipeline parallel: each stage holds other layers
dp    data parallel: replicas of the dense parameters (or, with a distributed optimizer,
      disjoint fragments of them)
cp    context parallel: the sequence split; the parameters are replicas
ep    expert parallel: each rank holds other experts
etp   expert tensor parallel: an expert's weight split across ranks
edp   expert data parallel: replicas (or fragments) of the expert parameters
gtp   generalized tensor parallel: a dense weight's rows split with alignment padding
egtp  the same for expert weights
====  ==========================================================================
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from enum import Enum

__all__ = ["AXES", "DENSE_AXES", "EXPERT_AXES", "Axis", "too_many_places"]


class Axis(str, Enum):
    """A parallel axis, by the name snapshots and meshes use. Members are their names (a str
    subclass with the name's hash), so they index the same dicts as plain strings."""

    tp = "tp"
    pp = "pp"
    dp = "dp"
    cp = "cp"
    ep = "ep"
    etp = "etp"
    edp = "edp"
    gtp = "gtp"
    egtp = "egtp"

    def __str__(self) -> str:
        return self.value


# Every axis, in the order a snapshot's header lists them.
AXES: tuple[str, ...] = tuple(axis.value for axis in Axis)

# Within a pipeline stage, Megatron numbers ranks along these axes, the first varying fastest
# (megatron-core 0.19's rank generators): the dense and the expert views of the same ranks.
DENSE_AXES = (Axis.tp, Axis.cp, Axis.gtp, Axis.dp)
EXPERT_AXES = (Axis.etp, Axis.ep, Axis.egtp, Axis.edp)


def too_many_places(
    coords: Mapping[str, Sequence[int]], world_size: int, holder: str = "the job"
) -> str | None:
    """What is wrong with ``coords`` (every axis, ``[rank_on_axis, size]``) when the dense or
    the expert axes describe more places than ``holder``'s ``world_size`` ranks: such
    coordinates would merge ranks as replicas that are not (a dp size with GTP folded in, or
    ``tp`` given by hand beside a data-parallel size found over the whole world). None: they
    fit."""
    for family in (DENSE_AXES, EXPERT_AXES):
        axes = (*family, Axis.pp)
        places = math.prod(coords[axis][1] for axis in axes)
        if places > world_size:
            sizes = " x ".join(f"{axis} {coords[axis][1]}" for axis in axes)
            return (
                f"the coordinates describe {places} places ({sizes}) but {holder} has "
                f"{world_size} ranks"
            )
    return None

"""Whether the counted tensors of each parameter hold each of its elements once.

The statistics add up what the filters count, trusting the snapshot's attributes and its
``distributed_optimizer`` flag. Where those are wrong the total is wrong with no other sign: a
snapshot marked ``distributed_optimizer`` whose data-parallel ranks each hold the whole
gradient counts it once per rank (sqrt(DP) too large), and fragments that overlap count their
overlap twice. This check costs three fields per counted tensor's piece (its site, its
extent, whether that is guessed), and holds under a launcher too, as they travel with its
statistics.

A *site* is where the ranks hold different elements of a parameter: its pipeline stage, expert
rank, TP and GTP rank (ETP and EGTP for expert parameters), or for a DTensor the TP ranks of a
root mesh outside its own that split it. Its *extent* is how many elements the site holds in
all: the TP/GTP-local tensor (a fragment's ``fragment_shape``), or a DTensor's global shape.
Within one site the counted tensors must hold exactly the extent: more is counted twice, fewer
is missing. Two extents are guessed, as the tensor's own size: a tensor of two or more
dimensions in a ``distributed_optimizer`` snapshot without ``fragment_offset`` (a whole
parameter, or a shard named by hand), and a DTensor in a file that places no pipeline stage
(stages may hold parameters of one name). Holding more than a guessed extent is counted twice
only where the tensors are copies of one another (their statistics alike, and not all zero):
a plain optimizer's replicas; shards and stages hold different values.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, NamedTuple, Protocol

from gradstat.core.axes import Axis
from gradstat.core.placements import is_tensor_parallel_dim
from gradstat.errors import DumpWarning, SnapshotError
from gradstat.snapshot.format import ParamRecord, RankHeader

if TYPE_CHECKING:
    from gradstat.analysis.stats import Piece  # which imports this module

__all__ = ["UNKNOWN", "Miscount", "Site", "Tally", "check", "extent", "site"]

# (pp, ep, tp, gtp) rank; -1 where the parameter is not split along that role.
Site = tuple[int, int, int, int]
UNKNOWN = -1  # the extent of a tensor that does not say which parameter's range it is
_ROLES = ("PP", "EP", "TP", "GTP")


class _Placed(Protocol):
    @property
    def header(self) -> RankHeader: ...


def site(rank_file: _Placed, record: ParamRecord) -> Site:
    """The site of a counted tensor of ``rank_file`` (see the module's docstring)."""
    coords = rank_file.header.coords
    stage = _rank(coords[Axis.pp])
    tensor_parallel = bool(record.attr("tensor_model_parallel"))
    dtensor = record.dtensor
    if dtensor is not None:
        # Its placements place it in its global shape; a TP dimension of the root mesh outside
        # its own splits a tensor_model_parallel DTensor further.
        copies = dtensor.copies
        splits = [_rank(place) for name, *place in copies if is_tensor_parallel_dim(name)]
        return stage, -1, splits[0] if tensor_parallel and splits else -1, -1
    expert = record.is_expert
    tp = _rank(coords[Axis.etp if expert else Axis.tp]) if tensor_parallel else -1
    gtp = -1
    if record.attr("is_gtp_weight_remat"):
        group = record.attr("gtp_group")
        gtp = _rank(group if group is not None else coords[Axis.egtp if expert else Axis.gtp])
    return stage, _rank(coords[Axis.ep]) if expert else -1, tp, gtp


def _rank(place: Sequence[int]) -> int:
    """The rank on an axis, -1 on an axis of one rank (which splits nothing)."""
    return place[0] if place[1] > 1 else -1


def extent(rank_file: _Placed, record: ParamRecord) -> tuple[int, bool]:
    """The elements of the site a counted tensor of ``rank_file`` is part of (UNKNOWN where
    nothing tells), and whether that is a guess (see the module's docstring)."""
    header = rank_file.header
    if record.dtensor is not None:
        return math.prod(record.dtensor.global_shape), header.coords[Axis.pp][1] == 1
    shape = record.attr("fragment_shape")
    if shape is not None:
        return math.prod(shape), False
    if record.attr("fsdp_param"):
        return UNKNOWN, False  # a flat FSDP shard: its parameter's shape is not recorded
    if not header.distributed_optimizer:
        return record.numel, False
    # A flat fragment that does not say where it lies tells nothing.
    return (UNKNOWN, False) if len(record.shape) < 2 else (record.numel, True)


class Miscount(NamedTuple):
    """A site whose counted tensors do not hold its elements once."""

    name: str
    site: Site
    held: int  # elements the counted tensors hold, in all
    extent: int

    def line(self) -> str:
        return f"parameter {self.name!r}{'' if self._where() else ':'} {self.detail()}"

    def detail(self) -> str:
        """What :meth:`line` says after the parameter's name."""
        where = self._where()
        counted = f"{f'at {where}: ' if where else ''}its counted tensors hold {self.held} elements"
        if self.held > self.extent:
            return (
                f"{counted}, {self.held - self.extent} more than its {self.extent}: some are "
                "counted twice (fragments that overlap, or a snapshot marked "
                "distributed_optimizer whose data-parallel ranks each hold the whole gradient)"
            )
        return (
            f"{counted} of its {self.extent}: the rest have no gradient in any rank file, and "
            "count nowhere"
        )

    def _where(self) -> str:
        placed = zip(_ROLES, self.site, strict=True)
        return " ".join(f"{role} {rank}" for role, rank in placed if rank >= 0)


class _Held:
    """What the counted tensors of one site hold so far."""

    def __init__(self, extent: int, guessed: bool, signature: tuple[Any, ...]) -> None:
        self.extent, self.guessed = extent, guessed
        self.held = 0
        self.signature: tuple[Any, ...] | None = signature  # None once two differ

    def add(self, numel: int, signature: tuple[Any, ...]) -> None:
        self.held += numel
        if signature != self.signature:
            self.signature = None

    def counted_twice(self) -> bool:
        if self.held <= self.extent:
            return False
        if not self.guessed:
            return True
        # Past a guessed extent, only copies of one tensor with something in them are twice.
        if self.signature is None:
            return False
        numel, zeros, peak, norms = self.signature
        if norms or peak is not None:
            return bool(peak) or any(norms)
        return bool(zeros < numel)  # only zeros were counted


class Tally:
    """The elements the counted tensors of each site hold, as the pieces are merged."""

    def __init__(self) -> None:
        self._sites: dict[tuple[str, bool, Site, int], _Held] = {}

    def add(self, piece: Piece) -> None:
        """A counted tensor's piece, at its site."""
        if piece.extent == UNKNOWN:
            return
        # Dense and expert copies apart: a parameter an attribute makes both is counted by
        # both optimizers, as Megatron counts it (audit's ``attributes`` finding).
        key = piece.name, piece.expert, piece.site, piece.extent
        signature = (piece.numel, piece.zeros, piece.max_abs, piece.norms)
        held = self._sites.get(key)
        if held is None:
            held = self._sites[key] = _Held(piece.extent, piece.guessed, signature)
        held.add(piece.numel + piece.pad_zeros, signature)

    def miscounts(self) -> tuple[Miscount, ...]:
        return tuple(
            Miscount(name, where, held.held, size)
            for (name, _, where, size), held in self._sites.items()
            if held.held < size or held.counted_twice()
        )


def check(where: Path, miscounts: Sequence[Miscount]) -> None:
    """Refuse statistics that count elements twice; warn of elements no rank file holds.

    Raises:
        SnapshotError: a site's counted tensors hold more elements than it has (the first
            named; ``gradstat audit`` lists every one).
    """
    twice = [miscount for miscount in miscounts if miscount.held > miscount.extent]
    missing = [miscount for miscount in miscounts if miscount.held < miscount.extent]
    if twice:
        raise SnapshotError(f"{where}: {twice[0].line()}{_others(twice)}")
    if missing:
        warnings.warn(f"{where}: {missing[0].line()}{_others(missing)}", DumpWarning, stacklevel=2)


def _others(found: Sequence[Miscount]) -> str:
    if len(found) == 1:
        return ""
    return f"; {len(found) - 1} more like it (gradstat audit lists them)"

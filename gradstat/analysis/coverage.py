"""Whether the counted tensors of each parameter hold each of its elements once.

The statistics add up what the filters count, trusting the snapshot's attributes and its
``distributed_optimizer`` flag. Where those are wrong the total is wrong with no other sign: a
snapshot marked ``distributed_optimizer`` whose data-parallel ranks each hold the whole
gradient counts it once per rank (sqrt(DP) too large), and fragments that overlap count their
overlap twice. This check costs four fields per counted tensor's piece (its site, its extent,
whether that is guessed, its box where its record places it), and holds under a launcher too,
as they travel with its statistics.

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

Totals alone miss an overlap that a gap of its size hides (fragments [0, 8) and [4, 8) of 12
elements; a DTensor shard written twice, another not at all). Where every counted tensor of a
site says where it lies, its *box* (a fragment's range of the flattened parameter from its
``fragment_offset``; a DTensor shard's ``global_offset`` and shape in its global shape), the
boxes tell: elements two of them hold are counted twice, those none holds are missing. Under a
guessed extent the stages of one local name may lie in global shapes of their own, so only
copies are told: two tensors at one box with alike statistics, not all zero, are counted
twice. A DTensor that shards one dimension on two mesh dimensions has no box (a
``_StridedShard``'s rows are not one block from its offset), and a site whose boxes cut its
elements into more than ``MOST_CELLS`` cells is judged by its totals alone.
"""

from __future__ import annotations

import itertools
import math
import warnings
from bisect import bisect_left
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, NamedTuple, Protocol

from gradstat.core.axes import Axis
from gradstat.core.placements import is_tensor_parallel_dim
from gradstat.errors import DumpWarning, SnapshotError
from gradstat.snapshot.format import ParamRecord, RankHeader

if TYPE_CHECKING:
    from gradstat.analysis.stats import Piece  # which imports this module

__all__ = [
    "MOST_CELLS",
    "UNKNOWN",
    "Box",
    "Miscount",
    "Site",
    "Tally",
    "box",
    "check",
    "extent",
    "site",
]

# (pp, ep, tp, gtp) rank; -1 where the parameter is not split along that role.
Site = tuple[int, int, int, int]
UNKNOWN = -1  # the extent of a tensor that does not say which parameter's range it is
# Where a counted tensor lies among its site's elements: (offset, shape).
Box = tuple[tuple[int, ...], tuple[int, ...]]
# The most pieces a site's boxes may cut its elements into for them to be compared: a grid of
# shards is cut into one per shard; past it (boxes askew to each other) the totals judge alone.
MOST_CELLS = 1 << 20
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


def box(record: ParamRecord) -> Box | None:
    """Where a counted tensor lies among its site's elements, where its record says: a DTensor
    shard's box in its global shape, a fragment's range of its flattened parameter (None for
    a 0-dim DTensor: its one element, its count tells)."""
    dtensor = record.dtensor
    if dtensor is not None:
        offset = dtensor.global_offset
        # A dimension sharded on two mesh dimensions may be a _StridedShard's, whose rows are
        # not one block from its offset (its code is S(d) too): no box.
        sharded = [code for code in dtensor.placements if code.startswith("S")]
        if not offset or len(set(sharded)) < len(sharded):
            return None
        return offset, record.shape
    start = record.attr("fragment_offset")  # the format checks it comes with fragment_shape
    return None if start is None else ((start,), record.shape)


class Miscount(NamedTuple):
    """A site whose counted tensors do not hold its elements once."""

    name: str
    site: Site
    held: int  # elements the counted tensors hold, in all
    extent: int
    twice: bool  # some elements are counted twice (else: some count nowhere)
    # What the counted tensors' boxes tell that the totals do not ("": the totals tell).
    placed: str = ""

    def line(self) -> str:
        return f"parameter {self.name!r}{'' if self._where() else ':'} {self.detail()}"

    def detail(self) -> str:
        """What :meth:`line` says after the parameter's name."""
        where = self._where()
        counted = f"{f'at {where}: ' if where else ''}its counted tensors hold {self.held} elements"
        if self.placed:
            more = self.held - self.extent
            size = f", {more} more than its {self.extent}" if more > 0 else f" of its {self.extent}"
            return f"{counted}{size}, but {self.placed}"
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

    __slots__ = ("extent", "guessed", "held", "in_order", "pieces", "reach", "signature")

    def __init__(self, extent: int, guessed: bool, signature: tuple[Any, ...]) -> None:
        self.extent, self.guessed = extent, guessed
        self.held = 0
        self.signature: tuple[Any, ...] | None = signature  # None once two differ
        # Its pieces, each with a box; None once one does not say where it lies.
        self.pieces: list[Piece] | None = []
        # Whether each box starts past the one before along the first dimension, and where
        # the last stops: a data-parallel group's fragments and FSDP's shards come so, in rank
        # order, and are then apart without a second look (which cost 0.5 us a piece, the
        # pieces of all sites coming in turn and no longer in a cache).
        self.in_order, self.reach = True, 0

    def add(self, piece: Piece, numel: int, signature: tuple[Any, ...]) -> None:
        self.held += numel
        if signature != self.signature:
            self.signature = None
        box = piece.box
        if box is None:
            self.pieces = None
        elif numel and self.pieces is not None:  # an empty shard holds nothing
            self.pieces.append(piece)
            offset = box[0]
            if self.in_order and offset and offset[0] >= self.reach:
                self.reach = offset[0] + box[1][0]
            else:
                self.in_order = False

    def verdict(self) -> tuple[bool, str] | None:
        """Whether some elements are counted twice (else some are missing), and what the boxes
        tell beyond the totals; None where the site's elements are held once."""
        if self.pieces is not None and not self.in_order:
            placed = _placed(self.pieces, self.extent, self.guessed)
            if placed is not None:
                return True, placed
        if self.held < self.extent:
            return False, ""
        return (True, "") if self.counted_twice() else None

    def counted_twice(self) -> bool:
        if self.held <= self.extent:
            return False
        if not self.guessed:
            return True
        # Past a guessed extent, only copies of one tensor with something in them are twice.
        return self.signature is not None and _something(self.signature)


def _something(signature: tuple[Any, ...]) -> bool:
    """Whether a tensor of these statistics is not all zeros."""
    numel, zeros, peak, norms = signature
    if norms or peak is not None:
        return bool(peak) or any(norms)
    return bool(zeros < numel)  # only zeros were counted


def _signature(piece: Piece) -> tuple[Any, ...]:
    """A piece's statistics: alike for copies of one tensor."""
    return piece.numel, piece.zeros, piece.max_abs, piece.norms


def _placed(pieces: Sequence[Piece], extent: int, guessed: bool) -> str | None:
    """What a site's boxes tell that its totals do not, in words: elements two tensors hold
    (under a guessed extent, two copies at one box); None where they tell nothing more (no
    element held twice), or cut the site too finely."""
    if guessed:
        # Stages of one local name may lie in global shapes of their own (a [24] norm weight
        # on one, a [6, 4] linear on another): their boxes are no one grid's. Two tensors at
        # one box with alike statistics, not all zero, are copies of one all the same.
        alike: dict[tuple[Box | None, tuple[Any, ...]], Piece] = {}
        for piece in pieces:
            signature = _signature(piece)
            first = alike.setdefault((piece.box, signature), piece)
            if first is not piece and _something(signature):
                return (
                    f"{_both(first, piece)}, copies of one tensor (their statistics alike): "
                    "the copies are counted twice"
                )
        return None
    places = [piece.box for piece in pieces if piece.box is not None]
    if _disjoint(places):
        return None
    grid = _Grid.of(places)
    if grid is None or grid.most < 2:
        return None
    first, second = grid.sharing(places, pieces)
    twice = f"{_both(first, second)}: {_are(grid.held - grid.covered)} counted twice"
    if grid.covered < extent:
        twice += f", and {_are(extent - grid.covered)} in no rank file"
    return f"{twice} (fragments or shards that overlap)"


def _disjoint(boxes: Sequence[Box]) -> bool:
    """Whether no two boxes share an element, where that is quick to tell (False: either):
    along each dimension their spans are the same or apart (a grid of shards), and no two
    boxes are alike, or apart along one dimension alone (shards of one dimension)."""
    for dim in range(len(boxes[0][0])):
        spans = sorted([(offset[dim], shape[dim]) for offset, shape in boxes])
        prior, reach, distinct = spans[0], sum(spans[0]), 1
        for span in spans:
            if span != prior:
                if span[0] < reach:
                    return False
                prior, reach, distinct = span, sum(span), distinct + 1
        if distinct == len(boxes):
            return True
    return len(set(boxes)) == len(boxes)


def _are(count: int) -> str:
    return f"{count} {'is' if count == 1 else 'are'}"


def _both(first: Piece, second: Piece) -> str:
    assert first.box is not None and second.box is not None
    region = _region(_meet(first.box, second.box))
    if first.rank == second.rank:
        return f"rank {first.rank} holds its elements {region} twice"
    return f"ranks {first.rank} and {second.rank} both hold its elements {region}"


def _meet(first: Box, second: Box) -> Box:
    starts = tuple(map(max, first[0], second[0]))
    stops = [min(a + n, b + m) for a, n, b, m in zip(*first, *second, strict=True)]
    return starts, tuple(stop - start for start, stop in zip(starts, stops, strict=True))


def _region(place: Box) -> str:
    spans = (f"{start}:{start + size}" for start, size in zip(*place, strict=True))
    return f"[{', '.join(spans)}]"


class _Grid:
    """How many of a site's boxes hold each element: the boxes' edges cut the elements into
    cells, each held by the same boxes throughout."""

    def __init__(self, cuts: list[list[int]], depth: dict[tuple[int, ...], int]) -> None:
        self.cuts, self.depth = cuts, depth
        self.most = max(depth.values())

    @classmethod
    def of(cls, boxes: Sequence[Box]) -> _Grid | None:
        """None where the boxes cut their elements into more than ``MOST_CELLS`` cells."""
        cuts = [_edges(boxes, dim) for dim in range(len(boxes[0][0]))]
        if math.prod(len(edges) - 1 for edges in cuts) > MOST_CELLS:
            return None
        depth: dict[tuple[int, ...], int] = {}
        for offset, shape in boxes:
            spans = [
                range(bisect_left(edges, start), bisect_left(edges, start + size))
                for edges, start, size in zip(cuts, offset, shape, strict=True)
            ]
            for cell in itertools.product(*spans):
                depth[cell] = depth.get(cell, 0) + 1
        return cls(cuts, depth)

    def place(self, cell: tuple[int, ...]) -> Box:
        """The box of a cell."""
        edges = [(cut[index], cut[index + 1]) for cut, index in zip(self.cuts, cell, strict=True)]
        return tuple(start for start, _ in edges), tuple(stop - start for start, stop in edges)

    def size(self, cell: tuple[int, ...]) -> int:
        return math.prod(self.place(cell)[1])

    @property
    def covered(self) -> int:
        """Elements some box holds."""
        return sum(map(self.size, self.depth))

    @property
    def held(self) -> int:
        """Elements the boxes hold, each as often as they hold it."""
        return sum(self.size(cell) * depth for cell, depth in self.depth.items())

    def sharing(self, places: Sequence[Box], pieces: Sequence[Piece]) -> tuple[Piece, Piece]:
        """The first two pieces (at ``places``) that hold one element, in element order."""
        cell = min(cell for cell, depth in self.depth.items() if depth > 1)
        start = self.place(cell)[0]
        held = zip(places, pieces, strict=True)
        first, second, *_ = (piece for place, piece in held if _inside(start, place))
        return first, second


def _edges(boxes: Sequence[Box], dim: int) -> list[int]:
    """Where the boxes start and stop along ``dim``, in order."""
    return sorted(
        {edge for offset, shape in boxes for edge in (offset[dim], offset[dim] + shape[dim])}
    )


def _inside(point: tuple[int, ...], place: Box) -> bool:
    return all(start <= at < start + size for at, start, size in zip(point, *place, strict=True))


class Tally:
    """The elements the counted tensors of each site hold, as the pieces are merged."""

    def __init__(self) -> None:
        # A site's first piece alone until a second comes: most sites hold one tensor (a TP
        # shard, a pipeline stage's layer), and process 0 tallies every rank file's pieces.
        self._sites: dict[tuple[str, bool, Site, int], _Held | Piece] = {}

    def add(self, piece: Piece) -> None:
        """A counted tensor's piece, at its site."""
        if piece.extent == UNKNOWN:
            return
        # Dense and expert copies apart: a parameter an attribute makes both is counted by
        # both optimizers, as Megatron counts it (audit's ``attributes`` finding).
        key = piece.name, piece.expert, piece.site, piece.extent
        held = self._sites.get(key)
        if held is None:
            self._sites[key] = piece
            return
        if not isinstance(held, _Held):
            held = self._sites[key] = _held([held])
        held.add(piece, piece.numel + piece.pad_zeros, _signature(piece))

    def miscounts(self) -> tuple[Miscount, ...]:
        found = []
        for (name, _, where, size), held in self._sites.items():
            if not isinstance(held, _Held):
                if _alone_fills(held, size):
                    continue  # what _held([held]).verdict() says, without making it
                held = _held([held])
            verdict = held.verdict()
            if verdict is not None:
                found.append(Miscount(name, where, held.held, size, *verdict))
        return tuple(found)


def _held(pieces: Sequence[Piece]) -> _Held:
    """What ``pieces`` (of one site) hold."""
    held = _Held(pieces[0].extent, pieces[0].guessed, _signature(pieces[0]))
    for piece in pieces:
        held.add(piece, piece.numel + piece.pad_zeros, _signature(piece))
    return held


def _alone_fills(piece: Piece, extent: int) -> bool:
    """Whether one piece alone holds its site's elements once: it holds as many as the site
    has, and its box (if it has one) starts somewhere along a first dimension (a boxed piece
    of no dimension is placed by :func:`_placed`), as :meth:`_Held.add` takes one in order."""
    if piece.numel + piece.pad_zeros != extent:
        return False
    box = piece.box
    return box is None or not extent or bool(box[0] and box[0][0] >= 0)


def check(where: Path, miscounts: Sequence[Miscount]) -> None:
    """Refuse statistics that count elements twice; warn of elements no rank file holds.

    Raises:
        SnapshotError: a site's counted tensors hold some of its elements twice (the first
            named; ``gradstat audit`` lists every one).
    """
    twice = [miscount for miscount in miscounts if miscount.twice]
    missing = [miscount for miscount in miscounts if not miscount.twice]
    if twice:
        raise SnapshotError(f"{where}: {twice[0].line()}{_others(twice)}")
    if missing:
        warnings.warn(f"{where}: {missing[0].line()}{_others(missing)}", DumpWarning, stacklevel=2)


def _others(found: Sequence[Miscount]) -> str:
    if len(found) == 1:
        return ""
    return f"; {len(found) - 1} more like it (gradstat audit lists them)"

"""Where each rank file's tensor lies in its logical parameter, and full tensors rebuilt from them.

From a full gradient down to what one rank holds, Megatron's layouts compose in this order: TP
(ETP for expert parameters) splits along ``partition_dim``; GTP (EGTP) pads dim 0 of the
TP-local tensor with ``pad_length`` zero rows and splits it evenly; the distributed optimizer
cuts the flattened TP/GTP-local tensor into fragments (``fragment_offset``, ``fragment_shape``).
A :class:`Tile` is one rank file's tensor in those terms. :func:`plan` checks that the counted
tiles of a parameter cover it exactly once; :func:`assemble` copies them into the full
tensor, GTP padding stripped.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Iterator, Mapping, Sequence
from contextlib import ExitStack
from dataclasses import dataclass
from itertools import product
from types import TracebackType

import torch
from torch import Tensor

from gradstat.analysis.stats import counts
from gradstat.core.axes import Axis
from gradstat.core.predicates import gtp_pad_start
from gradstat.snapshot import RankFile, Snapshot
from gradstat.snapshot.format import DTYPES, ParamRecord

__all__ = [
    "ROLES",
    "BoxPlan",
    "MappedFiles",
    "Plan",
    "Tile",
    "assemble",
    "box",
    "chunks",
    "differences",
    "finite_peak",
    "plan",
    "segments",
    "snapshot_tiles",
    "squares",
    "wide_chunks",
]

# The roles of the parallel axes for a parameter, in the order a tile's site lists them.
ROLES = ("pp", "ep", "tp", "gtp", "dp", "cp")
# The axis playing each role for a dense and for an expert parameter (None: no axis does).
_DENSE_ROLES = {
    "pp": Axis.pp, "ep": None, "tp": Axis.tp, "gtp": Axis.gtp, "dp": Axis.dp, "cp": Axis.cp
}  # fmt: skip
_EXPERT_ROLES = {
    "pp": Axis.pp, "ep": Axis.ep, "tp": Axis.etp, "gtp": Axis.egtp, "dp": Axis.edp, "cp": None
}  # fmt: skip


@dataclass(frozen=True)
class Tile:
    """One rank file's tensor of a parameter, and where it lies in the parameter."""

    rank_file: RankFile
    record: ParamRecord
    counted: bool

    @property
    def name(self) -> str:
        return self.record.name

    @property
    def rank(self) -> int:
        return self.rank_file.rank

    def axis(self, role: str) -> Axis | None:
        """The axis playing ``role`` (tp, gtp, dp, ...) for this parameter: etp for experts."""
        return (_EXPERT_ROLES if self.record.is_expert else _DENSE_ROLES)[role]

    def role_place(self, role: str) -> tuple[int, int]:
        """(rank, size) on the axis playing ``role``; (0, 1) where no axis does."""
        axis = self.axis(role)
        if role == "gtp" and self.record.attr("gtp_group") is not None:
            rank, size = self.record.attr("gtp_group")
            return rank, size
        return (0, 1) if axis is None else self.rank_file.header.coords[axis]

    def site(self, *skip: str) -> tuple[int, ...]:
        """Coordinates on every role but ``skip``: tiles with equal sites are copies of each
        other along the skipped roles."""
        return tuple(self.role_place(role)[0] for role in ROLES if role not in skip)

    @property
    def tp_sharded(self) -> bool:
        return bool(self.record.attr("tensor_model_parallel"))

    @property
    def gtp_sharded(self) -> bool:
        return bool(self.record.attr("is_gtp_weight_remat"))

    @property
    def local_shape(self) -> tuple[int, ...] | None:
        """Shape of the TP/GTP-local tensor this tile is (part of); None: a fragment that does
        not say."""
        shape = self.record.attr("fragment_shape")
        if shape is not None:
            return tuple(shape)
        return None if self.rank_file.header.distributed_optimizer else self.record.shape

    @property
    def start(self) -> int | None:
        """First element of the tile in the flattened local tensor; None when unknown."""
        offset = self.record.attr("fragment_offset")
        if offset is not None:
            return int(offset)
        return None if self.rank_file.header.distributed_optimizer else 0

    @property
    def stop(self) -> int | None:
        return None if self.start is None else self.start + self.record.numel

    def pad_range(self) -> tuple[int, int] | None:
        """The GTP padding's flat element range in the local tensor (None: none, or unknown)."""
        shape, pad_length = self.local_shape, int(self.record.attr("pad_length") or 0)
        if not self.gtp_sharded or not pad_length or not shape:
            return None
        rows, row_numel = shape[0], math.prod(shape[1:])
        start = gtp_pad_start(rows, row_numel, pad_length, *self.role_place("gtp"))
        end = rows * row_numel
        return (start, end) if start < end else None


def snapshot_tiles(snapshot: Snapshot) -> dict[str, list[Tile]]:
    """Every tensor of the snapshot as a tile, by parameter name (first-seen order), rank order."""
    tiles: dict[str, list[Tile]] = {}
    for rank_file in snapshot.files:
        # Mapping reads no gradient: the filters look at attributes, coordinates and shapes.
        with rank_file.params() as params:
            for param in params:
                if param.record.has_grad:
                    tile = Tile(rank_file, param.record, counts(rank_file, param))
                    tiles.setdefault(param.name, []).append(tile)
    return tiles


@dataclass(frozen=True)
class Plan:
    """How the counted tiles of a parameter make up its full tensor."""

    name: str
    tiles: tuple[Tile, ...]
    local_shape: tuple[int, ...]
    tp_size: int
    partition_dim: int
    gtp_size: int
    pad_length: int
    dtype: torch.dtype

    @property
    def local_rows(self) -> int:
        """Rows of the TP-local tensor once GTP padding is stripped."""
        if self.gtp_size == 1 and not self.pad_length:
            return self.local_shape[0] if self.local_shape else 1
        return self.local_shape[0] * self.gtp_size - self.pad_length

    @property
    def tp_local_shape(self) -> tuple[int, ...]:
        if not self.local_shape:
            return ()
        return (self.local_rows, *self.local_shape[1:])

    @property
    def full_shape(self) -> tuple[int, ...]:
        shape = list(self.tp_local_shape)
        if self.tp_size > 1:
            shape[self.partition_dim] *= self.tp_size
        return tuple(shape)


_LAYOUT_ATTRS = (
    "tensor_model_parallel",
    "partition_dim",
    "partition_stride",
    "is_gtp_weight_remat",
    "pad_length",
)


@dataclass(frozen=True)
class BoxPlan:
    """How the counted DTensor shards of a parameter make up its full tensor: each is a box of
    it, at the offset its placements give."""

    name: str
    tiles: tuple[Tile, ...]
    full_shape: tuple[int, ...]
    dtype: torch.dtype


def box(tile: Tile) -> tuple[tuple[int, ...], tuple[int, ...]] | None:
    """A DTensor shard's (offset, shape) in its full tensor; None when no offset was recorded."""
    dtensor = tile.record.dtensor
    if dtensor is None or dtensor.global_offset is None:
        return None
    return dtensor.global_offset, tile.record.shape


def _box_plan(name: str, counted: Sequence[Tile]) -> BoxPlan | str:
    full_shape = counted[0].record.dtensor.global_shape if counted[0].record.dtensor else ()
    boxes = set()
    for tile in counted:
        found = box(tile)
        if found is None:
            return "DTensor shards without a recorded global_offset are not placed"
        if tile.record.dtensor is None or tile.record.dtensor.global_shape != full_shape:
            return f"its global shape differs between rank {counted[0].rank} and {tile.rank}"
        if found in boxes and tile.record.numel:  # empty shards (uneven FSDP2) hold nothing
            return f"two counted shards hold the same box (rank {tile.rank})"
        boxes.add(found)
    covered = sum(tile.record.numel for tile in counted)
    if covered != math.prod(full_shape):
        return f"its shards hold {covered} of its {math.prod(full_shape)} elements"
    return BoxPlan(name, tuple(counted), full_shape, _common_dtype(counted))


def _common_dtype(tiles: Sequence[Tile]) -> torch.dtype:
    dtypes = {tile.record.dtype for tile in tiles}
    if "float64" in dtypes:
        return torch.float64
    if len(dtypes) == 1:
        return DTYPES[str(tiles[0].record.dtype)][0]
    return torch.float32


def plan(name: str, tiles: Sequence[Tile]) -> Plan | BoxPlan | str:
    """The plan that rebuilds ``name`` from its counted ``tiles``, or why there is none."""
    counted = [tile for tile in tiles if tile.counted]
    if not counted:
        return "no counted tensor"
    first = counted[0]
    if all(tile.record.dtensor is not None for tile in counted):
        return _box_plan(name, counted)
    for tile in counted:
        if tile.record.dtensor is not None or tile.record.attr("fsdp_param"):
            return "FSDP shards without placements are not placed"
        if tile.start is None:
            return "fragments without fragment_offset/fragment_shape cannot be placed"
        if any(tile.record.attr(key) != first.record.attr(key) for key in _LAYOUT_ATTRS):
            return f"its attributes differ between rank {first.rank} and rank {tile.rank}"
        if tile.local_shape != first.local_shape:
            return f"its shape differs between rank {first.rank} and rank {tile.rank}"
    local_shape = first.local_shape
    assert local_shape is not None  # a known start comes with a known shape
    tp_size = first.role_place("tp")[1] if first.tp_sharded else 1
    partition_dim = int(first.record.attr("partition_dim"))
    if tp_size > 1 and not 0 <= partition_dim < len(local_shape):
        return f"partition_dim {partition_dim} is outside its {len(local_shape)} dimensions"
    if first.record.attr("partition_stride") != 1 and tp_size > 1:
        return "strided TP partitions are not placed"
    gtp_size = first.role_place("gtp")[1] if first.gtp_sharded else 1
    pad_length = int(first.record.attr("pad_length") or 0) if first.gtp_sharded else 0
    if (gtp_size > 1 or pad_length) and not local_shape:
        return "a 0-dim GTP shard has no rows"
    by_site: dict[tuple[int, int], list[Tile]] = defaultdict(list)
    for tile in counted:
        by_site[_shard(tile, tp_size, gtp_size)].append(tile)
    numel = math.prod(local_shape)
    for tp_rank, gtp_rank in product(range(tp_size), range(gtp_size)):
        covered = 0
        for tile in sorted(by_site.get((tp_rank, gtp_rank), []), key=lambda tile: tile.start or 0):
            if tile.start != covered:
                problem = "overlap" if (tile.start or 0) < covered else "gap"
                return f"its tiles {problem} at element {covered} of TP {tp_rank} GTP {gtp_rank}"
            covered = tile.stop or 0
        if covered != numel:
            return f"elements {covered}..{numel} of TP {tp_rank} GTP {gtp_rank} are missing"
    dtype = _common_dtype(counted)
    return Plan(
        name=name,
        tiles=tuple(counted),
        local_shape=local_shape,
        tp_size=tp_size,
        partition_dim=partition_dim,
        gtp_size=gtp_size,
        pad_length=pad_length,
        dtype=dtype,
    )


def _shard(tile: Tile, tp_size: int, gtp_size: int) -> tuple[int, int]:
    """Which TP/GTP-local tensor the tile belongs to: (TP rank, GTP rank), 0 where unsplit."""
    tp_rank = tile.role_place("tp")[0] if tp_size > 1 else 0
    return tp_rank, tile.role_place("gtp")[0] if gtp_size > 1 else 0


class MappedFiles:
    """Rank files mapped on first use and kept mapped until the ``with`` block ends."""

    def __init__(self) -> None:
        self._stack = ExitStack()
        # By rank file, not by path: a checkpoint's data file holding two chunks of one
        # tensor is two rank files of one path, each chunk under the same record name.
        self._maps: dict[int, tuple[RankFile, Mapping[str, Tensor]]] = {}

    def tensor(self, tile: Tile) -> Tensor:
        """The tile's tensor, read-only, flattened."""
        found = self._maps.get(id(tile.rank_file))
        if found is None:  # the rank file is held with its map: its id is not reused
            tensors = self._stack.enter_context(tile.rank_file.tensors())
            found = self._maps[id(tile.rank_file)] = (tile.rank_file, tensors)
        return found[1][tile.name].reshape(-1)

    def __enter__(self) -> MappedFiles:
        return self

    def __exit__(
        self,
        kind: type[BaseException] | None,
        error: BaseException | None,
        trace: TracebackType | None,
    ) -> None:
        self._maps.clear()
        self._stack.close()


def assemble(layout: Plan | BoxPlan, files: MappedFiles) -> Tensor:
    """The parameter's full gradient, rebuilt from its tiles (GTP padding stripped).

    It may be a read-only view of a mapped file: use it inside the ``files`` block only.
    """
    if isinstance(layout, BoxPlan):
        full = torch.empty(layout.full_shape, dtype=layout.dtype)
        for tile in layout.tiles:
            offset, shape = box(tile) or ((), ())
            region = tuple(
                slice(start, start + size) for start, size in zip(offset, shape, strict=True)
            )
            full[region] = files.tensor(tile).view(shape)
        return full
    if not math.prod(layout.local_shape):
        return torch.empty(layout.full_shape, dtype=layout.dtype)
    if layout.tp_size == 1:
        return _tp_local(layout, layout.tiles, files)
    full = torch.empty(layout.full_shape, dtype=layout.dtype)
    by_tp: dict[int, list[Tile]] = defaultdict(list)
    for tile in layout.tiles:
        by_tp[_shard(tile, layout.tp_size, layout.gtp_size)[0]].append(tile)
    size = layout.tp_local_shape[layout.partition_dim]
    for tp_rank, tiles in sorted(by_tp.items()):
        local = _tp_local(layout, tiles, files)
        full.narrow(layout.partition_dim, tp_rank * size, size).copy_(local)
    return full


def segments(layout: Plan | BoxPlan, files: MappedFiles) -> list[Tensor] | None:
    """The full gradient's elements in order, as flat views of the mapped tiles (no copy).

    Possible when the shards concatenate along dim 0 (column-parallel TP, GTP, fragments, or
    no split), which is then the flat order too; None for other TP splits: assemble those.
    """
    if isinstance(layout, BoxPlan) or (layout.tp_size > 1 and layout.partition_dim != 0):
        return None
    numel = math.prod(layout.local_shape)
    rows = layout.local_shape[0] if layout.local_shape else 1
    kept = layout.local_rows * (numel // rows if rows else 0)  # before the padding
    found: list[tuple[int, int, Tensor]] = []
    for tile in layout.tiles:
        tp_rank, gtp_rank = _shard(tile, layout.tp_size, layout.gtp_size)
        assert tile.start is not None
        start = gtp_rank * numel + tile.start
        length = min(tile.record.numel, kept - start)
        if length > 0:
            found.append((tp_rank, start, files.tensor(tile)[:length]))
    found.sort(key=lambda item: item[:2])
    return [tensor for _, _, tensor in found]


def _tp_local(layout: Plan, tiles: Sequence[Tile], files: MappedFiles) -> Tensor:
    """One TP rank's tensor: its GTP shards (or fragments) in place, the padding cut off."""
    numel = math.prod(layout.local_shape)
    whole = tiles[0]
    if len(tiles) == 1 and layout.gtp_size == 1 and not layout.pad_length and whole.start == 0:
        tensor = files.tensor(whole)
        if tensor.dtype == layout.dtype:
            return tensor.view(layout.tp_local_shape)  # the mapped tensor itself: no copy
    padded = torch.empty(layout.gtp_size * numel, dtype=layout.dtype)
    for tile in tiles:
        base = _shard(tile, layout.tp_size, layout.gtp_size)[1] * numel
        assert tile.start is not None and tile.stop is not None
        padded[base + tile.start : base + tile.stop].copy_(files.tensor(tile))
    rows = layout.gtp_size * layout.local_shape[0] if layout.local_shape else 1
    # A contiguous prefix of the padded rows: a view, not a copy.
    return padded.view(rows, -1)[: layout.local_rows].reshape(layout.tp_local_shape)


def chunks(*tensors: Tensor, size: int = 1 << 22) -> Iterator[tuple[Tensor, ...]]:
    """Matching slices of flat tensors, ``size`` elements at a time."""
    total = tensors[0].numel()
    for start in range(0, total, size):
        yield tuple(tensor[start : start + size] for tensor in tensors)


def wide_chunks(*tensors: Tensor, size: int = 1 << 22) -> Iterator[tuple[Tensor, ...]]:
    """:func:`chunks` in float64, or in complex128 where any of the tensors is complex (a
    difference or a magnitude keeps the imaginary parts; see :func:`squares`)."""
    wide = torch.complex128 if any(tensor.is_complex() for tensor in tensors) else torch.float64
    for blocks in chunks(*tensors, size=size):
        yield tuple(block.to(wide) for block in blocks)


def differences(wide_a: Tensor, wide_b: Tensor) -> Tensor:
    """|a - b| of each element of two :func:`wide_chunks` blocks, in float64, taken part by part
    for complex ones: a part equal on both sides (the same infinity too) or NaN on both differs
    by 0, a part NaN on one side only by NaN."""
    real_a, real_b = (
        (torch.view_as_real(wide_a), torch.view_as_real(wide_b))
        if wide_a.is_complex()
        else (wide_a, wide_b)
    )
    parts = real_a - real_b
    parts.masked_fill_((real_a == real_b) | (real_a.isnan() & real_b.isnan()), 0.0)
    if not wide_a.is_complex():
        return parts.abs_()
    return torch.view_as_complex(parts).abs()


def finite_peak(block: Tensor) -> float:
    """The largest |x| of a block's finite elements (0 where none is): the scale a difference
    is judged against, which an infinity, the same on both sides, must not make infinite."""
    if not block.numel():
        return 0.0
    return float(block.abs().nan_to_num_(0.0, posinf=0.0).max())


def squares(block: Tensor) -> float:
    """The sum of |x|^2 over a float64 or complex128 block."""
    return float((block.abs() if block.is_complex() else block).square().sum())

"""Statistics of a snapshot: each logical parameter once, aggregated over shards and fragments.

A plain tensor of a rank file counts when the core's filters keep it for its own rank (not
shared, not a TP/ETP or GTP/EGTP duplicate) and it is not a data-parallel replica: with a plain
optimizer only data-parallel rank 0 (context-parallel rank 0 too; expert-data-parallel rank 0
for expert params) counts, with the distributed optimizer every rank's fragments do. A DTensor
gradient counts by its placements alone (:mod:`gradstat.core.placements`): Shard pieces all count,
Replicate copies and copies along the root mesh once; coordinates and the optimizer flag do not
change that.
"""

from __future__ import annotations

import itertools
import logging
import math
from collections.abc import Callable, Iterable, Sequence
from dataclasses import astuple, dataclass, field
from pathlib import Path
from typing import Any, NamedTuple, Protocol

import torch

from gradstat.analysis import coverage
from gradstat.clip_grads import check_norm_type
from gradstat.core import kernels, native, staging
from gradstat.core.groups import AxisPlace
from gradstat.core.predicates import gtp_pad_zero_count, param_is_not_shared, param_is_unique
from gradstat.distributed.runner import Processes, Progress, gather
from gradstat.errors import SnapshotError
from gradstat.snapshot import RankFile, RebuiltParam, Snapshot, SnapshotShare
from gradstat.snapshot.container import kept_fp32
from gradstat.snapshot.format import DTYPES, RankHeader
from gradstat.snapshot.reader import FileSummary

__all__ = [
    "NonFinite",
    "ParamStats",
    "Piece",
    "Placed",
    "Request",
    "SnapshotStats",
    "counts",
    "file_pieces",
    "gather_pieces",
    "merge",
    "nan_max",
    "relative_to",
    "snapshot_pieces",
    "snapshot_stats",
    "tensor_piece",
]

_CPU = torch.device("cpu")
# A mapped rank file's gradients taken at once, at most (a larger tensor alone): copied to a
# GPU together and reduced there, before the next run is copied (see _runs).
RUN_BYTES = 1 << 30
_log = logging.getLogger(__name__)


@dataclass
class ParamStats:
    """One logical parameter's statistics over every counted shard and fragment."""

    name: str
    expert: bool
    numel: int = 0
    zeros: int = 0
    pad_zeros: int = 0
    norms: dict[float, float] = field(default_factory=dict)  # finite norm type: its norm
    max_abs: float | None = None  # None when the inf norm was not asked for
    ranks: list[int] = field(default_factory=list)

    def norm(self, norm_type: float) -> float:
        if norm_type == math.inf:
            if self.max_abs is None:
                raise KeyError("the inf norm was not computed; ask for it in norm_types")
            return self.max_abs
        return self.norms[norm_type]


def nan_max(values: Iterable[float]) -> float:
    """The largest value, NaN if any is NaN (Python's max() drops a NaN after a number)."""
    peak = 0.0
    for value in values:
        if math.isnan(value):
            return math.nan
        peak = max(peak, value)
    return peak


def _nan_max2(first: float, second: float) -> float:
    """``nan_max((first, second))``, without its loop: merge takes it per piece."""
    if math.isnan(first) or math.isnan(second):
        return math.nan
    return max(max(0.0, first), second)


def relative_to(difference: float, scale: float) -> float:
    """``difference`` (a largest |a - b|) relative to ``scale`` (the largest finite |element|
    compared): 0 when there is none, inf for a difference where every finite element compared
    is zero."""
    if scale:
        return difference / scale
    return 0.0 if difference == 0 else math.inf


@dataclass(frozen=True)
class NonFinite:
    """NaN and Inf elements of one parameter's gradient on one rank."""

    rank: int
    name: str
    nan: int
    inf: int


@dataclass(frozen=True)
class SnapshotStats:
    """The whole snapshot's statistics and their per-parameter breakdown (module order)."""

    params: tuple[ParamStats, ...]
    norm_types: tuple[float, ...]
    nonfinite: tuple[NonFinite, ...] = ()
    # Asked for with ``Request.split_experts``: each stacked [E, ...] expert tensor's rows, one
    # per expert, named ``<tensor>[<global index>]`` (no part of the totals: ``params`` holds
    # the tensor whole).
    expert_rows: tuple[ParamStats, ...] = ()
    # Sites whose counted tensors do not hold each element once (gradstat.analysis.coverage).
    miscounts: tuple[coverage.Miscount, ...] = ()

    def norm(self, norm_type: float, expert: bool | None = None) -> float:
        """The global norm; of dense (``expert=False``) or expert params only if asked.

        Megatron reduces dense and expert statistics in separate optimizers and combines them
        (sqrt(dense^2 + expert^2) for L2): combining all parameters' norms is the same.
        """
        params = [param for param in self.params if expert is None or param.expert == expert]
        if norm_type == math.inf:
            return nan_max(param.norm(math.inf) for param in params)
        return kernels.combine_norms((param.norms[norm_type] for param in params), norm_type)

    @property
    def zeros(self) -> int:
        return sum(param.zeros for param in self.params)

    @property
    def numel(self) -> int:
        return sum(param.numel for param in self.params)

    @property
    def pad_zeros(self) -> int:
        return sum(param.pad_zeros for param in self.params)


class Placed(Protocol):
    """What counting a tensor reads of where it lies: its rank file's header, the rank's
    places on the duplicate filters' axes, and a path to name in messages (a rank file, or a
    live rank of the flight recorder)."""

    @property
    def header(self) -> RankHeader: ...

    @property
    def path(self) -> Path: ...

    @property
    def rank(self) -> int: ...

    @property
    def filter_places(self) -> tuple[AxisPlace, AxisPlace, AxisPlace, AxisPlace]: ...


def counts(rank_file: Placed, param: RebuiltParam) -> bool:
    """Whether ``param`` of ``rank_file`` holds values no other counted tensor holds."""
    record = param.record
    if not record.has_grad:
        return False
    if record.dtensor is not None:
        # Placements decide, whatever the coordinates and the optimizer flag say.
        partial = record.dtensor.partial_dims()
        if partial:
            raise SnapshotError(
                f"{rank_file.path}: parameter {record.name!r} is Partial on mesh dimension "
                f"{partial[0]!r}: a gradient pending its reduction has no norm; dump it after "
                "the gradients are reduced"
            )
        tensor_parallel = bool(record.attr("tensor_model_parallel"))
        if not param_is_not_shared(param):
            return False
        # A copy counts where the one at coordinate 0 holds no gradient (see stand_ins).
        return (
            not record.dtensor.is_replica(tensor_parallel)
            or record.name in rank_file.header.stand_ins
        )
    if record.attr("fsdp_param"):
        return True
    # The core's filters, as grads_for_norm applies them (the gradient is not looked up).
    if not param_is_unique(param, *rank_file.filter_places):
        return False
    header = rank_file.header
    if header.distributed_optimizer or record.name in header.stand_ins:
        return True
    coords = header.coords
    if record.is_expert:
        return coords["edp"][0] == 0
    return coords["dp"][0] == 0 and coords["cp"][0] == 0


class Piece(NamedTuple):
    """The statistics of one counted tensor (a shard or fragment) of one rank file.

    Pieces are what crosses processes under a launcher: a few numbers per tensor. Merging them
    in rank-file order gives bitwise the same totals however the files were split. Norms, not
    sums of p-th powers, cross: a norm fits in float64 where its p-th power may not (2.7e-3 to
    the 150th), and :func:`kernels.add_norms` combines two without forming either power. A
    tuple: one is made per tensor, and 8192 rank files of 4 small tensors make 32768.
    """

    rank: int
    name: str
    expert: bool
    numel: int
    pad_zeros: int
    zeros: int
    norms: tuple[float, ...]  # for Request.finite
    max_abs: float | None
    nonfinite: NonFinite | None
    # One expert's row of a stacked [E, ...] tensor (Request.split_experts): the tensor's name;
    # its statistics are the tensor's piece's too, so the row is no part of the totals.
    row_of: str | None = None
    # Where it lies, for the check that the counted tensors hold each element once (see
    # gradstat.analysis.coverage): its site, the elements the site holds in all, and where
    # among them it lies (None: its record does not say).
    site: coverage.Site = (-1, -1, -1, -1)
    extent: int = coverage.UNKNOWN
    guessed: bool = False
    box: coverage.Box | None = None

    @classmethod
    def to_columns(cls, pieces: Sequence[Piece]) -> list[list[Any]]:
        """``pieces`` as JSON data, one list per field: what crosses processes. Every process
        decodes every rank file's pieces, so that part does not shrink with more processes:
        8192 rank files of 4 tensors took 12.2 us a file to decode as an object per piece, 4.1
        as lists."""
        columns = [list(values) for values in zip(*pieces, strict=True)]
        columns = columns or [[] for _ in cls._fields]
        found = cls._fields.index("nonfinite")
        columns[found] = [None if item is None else astuple(item) for item in columns[found]]
        return columns

    @classmethod
    def from_columns(cls, columns: Sequence[Sequence[Any]]) -> list[Piece]:
        """The pieces :meth:`to_columns` made, as another process sent them."""
        fields = dict(zip(cls._fields, columns, strict=True))
        fields["norms"] = [tuple(norms) for norms in fields["norms"]]
        fields["site"] = [tuple(site) for site in fields["site"]]
        fields["box"] = [
            None if box is None else (tuple(box[0]), tuple(box[1])) for box in fields["box"]
        ]
        fields["nonfinite"] = [
            None if item is None else NonFinite(*item) for item in fields["nonfinite"]
        ]
        return list(itertools.starmap(cls, zip(*fields.values(), strict=True)))


@dataclass(frozen=True)
class Request:
    """What to compute: finite norm types, the inf norm, the zero count, and where."""

    finite: tuple[float, ...]
    with_inf: bool
    zeros: bool
    device: torch.device = _CPU
    split_experts: bool = False  # also each expert's row of stacked [E, ...] expert tensors

    @classmethod
    def make(
        cls,
        norm_types: Iterable[float],
        zeros: bool = True,
        device: str | torch.device = "cpu",
        split_experts: bool = False,
    ) -> Request:
        asked = {check_norm_type(p) for p in norm_types}
        finite = tuple(sorted(asked - {math.inf}, key=lambda p: (p != 2, p)))
        return cls(finite, math.inf in asked, zeros, torch.device(device), split_experts)

    @property
    def one_pass(self) -> bool:
        """Whether the native kernel's one pass gives some of it."""
        return kernels.one_pass_serves(self.finite, self.with_inf, self.zeros)


def _grads(
    rank_file: Placed, params: Sequence[RebuiltParam], request: Request
) -> list[torch.Tensor]:
    """The gradients of counted ``params``, where the request computes: those elsewhere are
    copied there together (through pinned buffers to a GPU, see :mod:`gradstat.core.staging`).
    The params keep their own: a copy lives as long as the caller holds it (one run, see
    :func:`_runs`), not as long as the file's params.

    Raises:
        SnapshotError: the device has no room for them (naming the file and the largest).
    """
    grads = []
    for param in params:
        grad = param.grad
        assert grad is not None
        grads.append(grad)
    away = [index for index, grad in enumerate(grads) if grad.device != request.device]
    if not away:
        return grads
    try:
        moved = staging.to_device([grads[index] for index in away], request.device)
    except torch.OutOfMemoryError as error:
        largest = max(away, key=lambda index: grads[index].nbytes)
        name, size = params[largest].name, grads[largest].nbytes
        what = f"tensor {name!r} ({size} bytes) does not fit"
        if len(away) > 1:
            total = sum(grads[index].nbytes for index in away)
            what = f"{len(away)} tensors of {total} bytes (the largest {name!r}, {size}) do not fit"
        raise SnapshotError(
            f"{rank_file.path}: {what} in the free memory of {request.device}: free some, or "
            "use --device cpu"
        ) from error
    for index, grad in zip(away, moved, strict=True):
        grads[index] = grad
    return grads


def _runs(counted: Sequence[RebuiltParam]) -> list[Sequence[RebuiltParam]]:
    """``counted`` in runs of at most ``RUN_BYTES`` of gradients (a larger tensor alone): a GPU
    holds one run at a time, so that a rank file larger than its memory is still read."""
    runs: list[Sequence[RebuiltParam]] = []
    run: list[RebuiltParam] = []
    taken = 0
    for param in counted:
        record = param.record
        dtype = DTYPES[record.dtype][0] if record.dtype in DTYPES else torch.float64
        size = record.numel * dtype.itemsize
        if run and taken + size > RUN_BYTES:
            runs.append(run)
            run, taken = [], 0
        run.append(param)
        taken += size
    return [*runs, run] if run else runs


def tensor_piece(
    rank_file: Placed,
    param: RebuiltParam,
    grad: torch.Tensor,
    request: Request,
    fused: native.FusedStats | None,
) -> Piece:
    stats = kernels.tensor_stats(
        grad, request.finite, request.with_inf, request.zeros, request.device, fused
    )
    partials = _partials(stats)
    nonfinite = None
    # NaN and Inf propagate into every norm: only a non-finite partial needs the extra passes.
    if not all(map(math.isfinite, partials)):
        # A complex element is what its |z| is: infinite where a part is, else NaN where one is.
        values = kernels.magnitudes(grad) if grad.is_complex() else grad
        nan, inf = int(torch.isnan(values).sum()), int(torch.isinf(values).sum())
        if nan or inf:
            nonfinite = NonFinite(rank_file.rank, param.name, nan, inf)
    return _piece(rank_file, param, grad.numel(), gtp_pad_zero_count(param, grad), stats, nonfinite)


def _fused_piece(
    rank_file: Placed, param: RebuiltParam, numel: int, fused: native.FusedStats, request: Request
) -> Piece | None:
    """:func:`tensor_piece` of a tensor of ``numel`` elements from its native pass alone, where
    that is all it needs: None where it needs the tensor itself (a norm the pass does not give,
    a non-finite value to locate, a GTP shard's padding, placed by its shape)."""
    if param.record.attr("is_gtp_weight_remat"):
        return None
    stats = kernels.fused_stats(fused, request.finite, request.with_inf, request.zeros)
    # None where a NaN or an inf made a sum non-finite; the inf-norm alone is the NaN or the
    # inf itself: either way the tensor is read to count and name them.
    if stats is None or not all(map(math.isfinite, _partials(stats))):
        return None
    # Not a GTP shard: the padding is the stamped count or none, and the tensor is not read.
    return _piece(rank_file, param, numel, gtp_pad_zero_count(param, None), stats, None)


def _partials(stats: kernels.TensorStats) -> tuple[float, ...]:
    return stats.norms if stats.max_abs is None else (*stats.norms, stats.max_abs)


def _piece(
    rank_file: Placed,
    param: RebuiltParam,
    numel: int,
    pad: int,
    stats: kernels.TensorStats,
    nonfinite: NonFinite | None,
) -> Piece:
    # count_zeros_fp32 without its reduction: this runs per tensor, also under a launcher whose
    # processes hold different numbers of tensors (``counts`` applied the filters).
    zeros = 0 if stats.zeros is None else stats.zeros - pad
    extent, guessed = coverage.extent(rank_file, param.record)
    return Piece(
        rank=rank_file.rank,
        name=param.name,
        expert=param.record.expert,
        numel=numel - pad,
        pad_zeros=pad,
        zeros=zeros,
        norms=stats.norms,
        max_abs=stats.max_abs,
        nonfinite=nonfinite,
        site=coverage.site(rank_file, param.record),
        extent=extent,
        guessed=guessed,
        box=coverage.box(param.record),
    )


def file_pieces(rank_file: RankFile, request: Request) -> list[Piece]:
    """The pieces of one rank file, in the file's parameter order (it is mapped meanwhile)."""
    with rank_file.params() as params:
        counted = [param for param in params if counts(rank_file, param)]
        if rank_file.one_tensor_at_a_time:
            pieces = [p for param in counted for p in _one_piece(rank_file, param, request)]
        elif (kept := _kept_pieces(rank_file, counted, request)) is not None:
            pieces = kept
        else:
            pieces = _mapped_pieces(rank_file, counted, request)
        _log.debug("%s: %d of %d tensors counted", rank_file.path, len(pieces), len(params))
        return pieces


def _mapped_pieces(
    rank_file: RankFile, counted: Sequence[RebuiltParam], request: Request
) -> list[Piece]:
    """The pieces of a mapped file's counted tensors, their expert rows too when asked (after
    them), one run at a time (see :func:`_runs`)."""
    pieces, rows = [], []
    for run in _runs(counted):
        run_pieces, run_rows = _run_pieces(rank_file, run, request)
        pieces += run_pieces
        rows += run_rows
    return pieces + rows


def _run_pieces(
    rank_file: RankFile, run: Sequence[RebuiltParam], request: Request
) -> tuple[list[Piece], list[Piece]]:
    """The pieces and expert rows of one run; its gradients' copies go with its return."""
    grads = _grads(rank_file, run, request)
    # One native call for the run's fp32 tensors: small ones cost less than the call.
    passes = native.fused_many_f32(grads) if request.one_pass else [None] * len(grads)
    pieces = [
        tensor_piece(rank_file, param, grad, request, fused)
        for param, grad, fused in zip(run, grads, passes, strict=True)
    ]
    rows = _expert_row_pieces(rank_file, run, grads, request) if request.split_experts else []
    return pieces, rows


def _kept_pieces(
    rank_file: RankFile, counted: Sequence[RebuiltParam], request: Request
) -> list[Piece] | None:
    """The pieces of a small file read whole (see ``open_rank_files``) whose counted tensors
    are all fp32, from one native pass over its bytes: no tensor is made unless a piece needs
    it (see :func:`_fused_piece`). None where that does not apply (the caller makes tensors).

    A snapshot of thousands of such files spends more on Python than on their bytes: a tensor
    view costs about as much as the pass over a small tensor (7 against 5 us, 2048 elements).
    """
    if not (request.one_pass and request.device == _CPU and not request.split_experts):
        return None
    found = kept_fp32(rank_file.container, [param.name for param in counted])
    passes = None if found is None else native.fused_many_at(*found)
    if found is None or passes is None:
        return None
    pieces = []
    for param, numel, fused in zip(counted, found[1], passes, strict=True):
        piece = _fused_piece(rank_file, param, numel, fused, request)
        if piece is None:
            (grad,) = _grads(rank_file, [param], request)
            piece = tensor_piece(rank_file, param, grad, request, fused)
        pieces.append(piece)
    return pieces


def _one_piece(rank_file: RankFile, param: RebuiltParam, request: Request) -> list[Piece]:
    """The pieces of one tensor read into memory (its expert rows too when asked), dropped
    before the next is read."""
    (grad,) = _grads(rank_file, [param], request)
    fused = native.fused_many_f32([grad])[0] if request.one_pass else None
    pieces = [tensor_piece(rank_file, param, grad, request, fused)]
    if request.split_experts:
        pieces += _expert_row_pieces(rank_file, [param], [grad], request)
    return pieces


def _expert_row_pieces(
    rank_file: RankFile,
    params: Sequence[RebuiltParam],
    grads: Sequence[torch.Tensor],
    request: Request,
) -> list[Piece]:
    """Each expert's row of the stacked [E, ...] expert tensors among ``params``, as pieces
    named ``<tensor>[<global expert index>]`` (see :func:`experts.stacked_first_expert`)."""
    from gradstat.analysis.experts import stacked_first_expert  # it imports this module

    rows = []
    for param, grad in zip(params, grads, strict=True):
        first = stacked_first_expert(rank_file.header, param.record, tuple(grad.shape))
        if first is None:
            continue
        for row in range(grad.shape[0]):
            piece = tensor_piece(rank_file, param, grad[row], request, None)
            rows.append(piece._replace(name=f"{param.name}[{first + row}]", row_of=param.name))
    return rows


def merge(pieces: Iterable[Piece], request: Request) -> SnapshotStats:
    """Aggregate pieces per parameter name, in the order given (rank-file order); expert rows
    (``Piece.row_of``) into ``expert_rows``, apart from the totals."""
    by_name: dict[str, ParamStats] = {}
    by_row: dict[str, ParamStats] = {}
    tally = coverage.Tally()
    nonfinite = []
    first_peak = 0.0 if request.with_inf else None
    finite = request.finite
    (only,) = finite if len(finite) == 1 else (None,)
    for piece in pieces:
        if piece.row_of is None:
            if piece.nonfinite is not None:
                nonfinite.append(piece.nonfinite)
            tally.add(piece)
        peak = piece.max_abs
        found = by_name if piece.row_of is None else by_row
        stats = found.get(piece.name)
        if stats is None:
            # Its first piece, made whole at once (a third of merge's time went to adding it
            # to an empty ParamStats): each norm as add_norms(0, norm) gives it (-0.0 made
            # 0.0), its peak as nan_max gives it.
            if only is not None:  # one norm type (process 0 merges every file's pieces)
                norms = {only: piece.norms[0] + 0.0}
            else:
                norms = dict(zip(finite, [norm + 0.0 for norm in piece.norms], strict=True))
            found[piece.name] = ParamStats(
                piece.name,
                piece.expert,
                piece.numel,
                piece.zeros,
                piece.pad_zeros,
                norms,
                first_peak if peak is None else _nan_max2(first_peak or 0.0, peak),
                [piece.rank],
            )
            continue
        for norm_type, value in zip(finite, piece.norms, strict=True):
            stats.norms[norm_type] = kernels.add_norms(stats.norms[norm_type], value, norm_type)
        if peak is not None:
            stats.max_abs = _nan_max2(stats.max_abs or 0.0, peak)
        stats.numel += piece.numel
        stats.pad_zeros += piece.pad_zeros
        stats.zeros += piece.zeros
        stats.ranks.append(piece.rank)
    norm_types = (*request.finite, math.inf) if request.with_inf else request.finite
    return SnapshotStats(
        tuple(by_name.values()),
        norm_types,
        tuple(nonfinite),
        tuple(by_row.values()),
        tally.miscounts(),
    )


def snapshot_stats(
    snapshot: Snapshot,
    norm_types: Iterable[float] = (2.0,),
    ranks: Sequence[int] | None = None,
    *,
    zeros: bool = True,
    on_file: Callable[[RankFile], None] | None = None,
    device: str | torch.device = "cpu",
) -> SnapshotStats:
    """Norms and zero counts of a snapshot, streaming one rank file at a time.

    Each norm type costs one pass over the data, the zero count another. Tensors whose norms
    come out non-finite are located (rank, parameter, NaN and Inf counts).

    Args:
        snapshot: an opened (validated) snapshot.
        norm_types: the norm types to compute (2, 1, inf or any finite p > 0); may be empty.
        ranks: only these ranks' files (a process's share under a launcher); None: all.
        zeros: count zero gradients.
        on_file: called after each rank file is done (progress reporting).
        device: where the reductions run ("cuda:0" loads each tensor onto that GPU first).
    """
    request = Request.make(norm_types, zeros, device)
    return merge(snapshot_pieces(snapshot, request, ranks, on_file), request)


def snapshot_pieces(
    snapshot: Snapshot | SnapshotShare,
    request: Request,
    ranks: Sequence[int] | None = None,
    on_file: Callable[[RankFile], None] | None = None,
) -> list[Piece]:
    """The pieces of the selected rank files (all by default), in rank-file order."""
    wanted = None if ranks is None else set(ranks)
    chosen = [file for file in snapshot.files if wanted is None or file.rank in wanted]
    megabytes = sum(file.size_bytes for file in chosen) / 1e6
    where = f"{megabytes:.1f} MB, on {request.device}"
    _log.info(
        "%s: reading %d of %d rank files (%s)",
        snapshot.directory,
        len(chosen),
        snapshot.world_size,
        where,
    )
    pieces = []
    for rank_file in chosen:
        pieces += file_pieces(rank_file, request)
        if on_file is not None:
            on_file(rank_file)
    return pieces


def gather_pieces(
    snapshot: Snapshot | SnapshotShare,
    request: Request,
    processes: Processes,
    on_file: Callable[[RankFile], None] | None = None,
    stage: str = "reading rank files",
) -> list[Piece]:
    """Every rank file's pieces, computed by the processes in turn (files i, i+N, ...).

    Process 0 reports the rank files and bytes all the processes have read, as ``stage``
    (:meth:`Processes.report`); ``on_file`` is called in each process after each of its files.

    Raises:
        StoppedTogether: any process's error (the first, by process rank), on every process.
        GradstatError: some processes stopped moving (named by number), or, alone, the error.
    """
    everyone: Sequence[RankFile | FileSummary]
    if isinstance(snapshot, SnapshotShare):
        mine, everyone = snapshot.files, snapshot.summaries
    else:
        mine, everyone = tuple(processes.share(snapshot.files)), snapshot.files
    ranks = [rank_file.rank for rank_file in mine]
    total_bytes = sum(rank_file.size_bytes for rank_file in everyone)

    def report(done: int, done_bytes: int) -> None:
        progress = Progress(stage, done, len(everyone), "rank files", done_bytes, total_bytes)
        processes.report(progress)

    report(0, 0)
    if processes.size == 1:
        done = [0, 0]

        def after_one(rank_file: RankFile) -> None:
            done[0] += 1
            done[1] += rank_file.size_bytes
            report(*done)
            if on_file is not None:
                on_file(rank_file)

        return snapshot_pieces(snapshot, request, ranks, after_one)

    def compute(beat: Callable[[int], None]) -> list[list[Any]]:
        def after_file(rank_file: RankFile) -> None:
            beat(rank_file.size_bytes)
            if on_file is not None:
                on_file(rank_file)

        return Piece.to_columns(snapshot_pieces(snapshot, request, ranks, after_file))

    shares = gather(processes, compute, report if processes.is_first else None)
    report(len(everyone), total_bytes)
    pieces = [piece for share in shares for piece in Piece.from_columns(share)]
    # Stable: each file's pieces stay in their order, files come in rank order.
    pieces.sort(key=lambda piece: piece.rank)
    return pieces

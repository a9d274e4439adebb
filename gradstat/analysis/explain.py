"""Explain a logged number: which miscount of the snapshot's own gradients gives it.

A framework's logged gradient norm (or zero count) that differs from the exact one is most often
off by a known mistake: a kind of copy counted as well (TP replicas, the tied embedding, DP
replicas of a plain optimizer), a group left out (experts, a pipeline stage), per-rank norms
averaged instead of combined, partial sums rounded to bf16 before the reduction. This module
reads the snapshot's pieces (every tensor of every rank file, counted or not, with the reasons
it is not), in one process or split over torchrun's, and ranks what each mistake predicts by
its distance to the logged number; the mistakes themselves are
:data:`gradstat.analysis.hypotheses.HYPOTHESES`.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from gradstat.analysis import coverage
from gradstat.analysis.hypotheses import (
    COPY_KINDS,
    HYPOTHESES,
    Hypothesis,
    Prediction,
    TensorPiece,
    counted_pieces,
    measure,
    names,
)
from gradstat.analysis.report import SnapshotInfo, as_dict, json_number, snapshot_info
from gradstat.analysis.stats import Piece, Request, counts, tensor_piece
from gradstat.core.predicates import (
    param_is_not_gtp_duplicate,
    param_is_not_shared,
    param_is_not_tensor_parallel_duplicate,
)
from gradstat.snapshot import RankFile, RebuiltParam, Snapshot, SnapshotShare

if TYPE_CHECKING:
    from gradstat.distributed.runner import Processes

__all__ = [
    "COPY_KINDS",
    "HYPOTHESES",
    "ExplainReport",
    "ExplainRow",
    "Prediction",
    "TensorPiece",
    "explain_pieces",
    "explain_snapshot",
    "gather_tensor_pieces",
    "reasons_not_counted",
    "snapshot_tensor_pieces",
]

_COORD_AXES = ("tp", "pp", "dp", "cp", "ep", "etp")


def reasons_not_counted(rank_file: RankFile, param: RebuiltParam) -> tuple[str, ...]:
    """Every reason ``counts`` has (or would have, past its first) to leave ``param`` out.

    The same predicates ``counts`` applies, each applied on its own; a tensor without a
    gradient is the caller's to skip.
    """
    record = param.record
    found: list[str] = []
    if not param_is_not_shared(param):
        found.append("shared")
    if record.dtensor is not None:
        tensor_parallel = bool(record.attr("tensor_model_parallel"))
        stands_in = record.name in rank_file.header.stand_ins
        if record.dtensor.is_replica(tensor_parallel) and not stands_in:
            found.append("dtensor_replica")
        return tuple(found)
    if record.attr("fsdp_param"):
        return ()
    tp, etp, gtp, egtp = rank_file.filter_places
    if not param_is_not_tensor_parallel_duplicate(param, tp, etp):
        found.append("etp_duplicate" if record.is_expert else "tp_duplicate")
    if not param_is_not_gtp_duplicate(param, gtp, egtp):
        found.append("gtp_duplicate")
    if rank_file.header.distributed_optimizer or record.name in rank_file.header.stand_ins:
        return tuple(found)
    coords = rank_file.header.coords
    if record.is_expert:
        if coords["edp"][0] != 0:
            found.append("edp_replica")
    else:
        if coords["dp"][0] != 0:
            found.append("dp_replica")
        if coords["cp"][0] != 0:
            found.append("cp_replica")
    return tuple(found)


def _dense_tp_duplicate(rank_file: RankFile, param: RebuiltParam) -> bool:
    """Whether Megatron's filter, handed the dense TP group for an expert tensor too, drops it."""
    record = param.record
    if not record.is_expert or record.dtensor is not None or record.attr("fsdp_param"):
        return False
    tp = rank_file.filter_places[0]
    return not param_is_not_tensor_parallel_duplicate(param, tp, tp)


def snapshot_tensor_pieces(
    snapshot: Snapshot | SnapshotShare,
    norm_type: float,
    files: Sequence[RankFile] | None = None,
) -> list[TensorPiece]:
    """Every tensor with a gradient of the given rank files (default: the snapshot's), in
    rank-file order, one pass each."""
    return _read_pieces(snapshot, norm_type, files)[0]


def _read_pieces(
    snapshot: Snapshot | SnapshotShare,
    norm_type: float,
    files: Sequence[RankFile] | None = None,
) -> tuple[list[TensorPiece], list[Piece]]:
    """:func:`snapshot_tensor_pieces`, and the statistics' pieces of the counted tensors (which
    the coverage check reads)."""
    request = Request.make([norm_type], zeros=True)
    pieces, counted = [], []
    for rank_file in snapshot.files if files is None else files:
        coords = rank_file.header.coords
        places = {axis: coords[axis][0] for axis in _COORD_AXES if axis in coords}
        sizes = {axis: size for axis, (_, size) in coords.items()}
        with rank_file.params() as params:
            for param in params:
                if not param.record.has_grad:
                    continue
                reasons = reasons_not_counted(rank_file, param)
                # The label re-applies ``counts``'s predicates: they must agree on every tensor.
                assert counts(rank_file, param) == (not reasons), param.name
                grad = param.grad
                assert grad is not None
                piece = tensor_piece(rank_file, param, grad, request, None)
                if not reasons:
                    counted.append(piece)
                norm = piece.max_abs if norm_type == math.inf else piece.norms[0]
                assert norm is not None
                pieces.append(
                    TensorPiece(
                        rank=rank_file.rank,
                        name=param.name,
                        reasons=reasons,
                        expert=piece.expert,
                        dense_tp_duplicate=_dense_tp_duplicate(rank_file, param),
                        dtype=str(grad.dtype).removeprefix("torch."),
                        coords=places,
                        sizes=sizes,
                        numel=piece.numel,
                        pad_zeros=piece.pad_zeros,
                        zeros=piece.zeros,
                        norm=norm,
                    )
                )
    return pieces, counted


def gather_tensor_pieces(
    snapshot: Snapshot | SnapshotShare, norm_type: float, processes: Processes
) -> tuple[list[TensorPiece], list[Piece]]:
    """:func:`_read_pieces` of every rank file, each process reading its share (rank files
    i, i+N, ...); every process gets them all, in rank-file order.

    Raises:
        StoppedTogether: any process's error (the first, by process rank), on every process.
    """
    if processes.size == 1:
        return _read_pieces(snapshot, norm_type)
    from gradstat.distributed.runner import gather

    if isinstance(snapshot, SnapshotShare):
        mine = list(snapshot.files)
    else:
        mine = processes.share(snapshot.files)

    def compute(beat: Callable[[int], None]) -> tuple[list[dict[str, Any]], list[list[Any]]]:
        found, counted = [], []
        for rank_file in mine:
            pieces, counted_here = _read_pieces(snapshot, norm_type, [rank_file])
            found += [piece.to_json() for piece in pieces]
            counted += counted_here
            beat(rank_file.size_bytes)
        return found, Piece.to_columns(counted)

    shares = gather(processes, compute)
    pieces = [TensorPiece.from_json(data) for found, _ in shares for data in found]
    counted = [piece for _, columns in shares for piece in Piece.from_columns(columns)]
    # Stable: each file's tensors stay in their order, files come in rank order.
    pieces.sort(key=lambda piece: piece.rank)
    counted.sort(key=lambda piece: piece.rank)
    return pieces, counted


@dataclass(frozen=True)
class ExplainRow:
    """One prediction (or the exact value), its distance to the logged number and whether it
    is within tolerance."""

    name: str
    value: float
    distance: float
    match: bool
    params: tuple[str, ...]
    description: str

    def to_json(self) -> dict[str, Any]:
        return dict(as_dict(self))


@dataclass(frozen=True)
class ExplainReport:
    """The exact value, the logged one and every prediction, matches first, closest first."""

    snapshot: SnapshotInfo
    quantity: str  # "norm" or "zeros"
    norm_type: float | None
    exact: float
    logged: float
    rtol: float
    rows: tuple[ExplainRow, ...]

    @property
    def matches(self) -> tuple[ExplainRow, ...]:
        return tuple(row for row in self.rows if row.match)

    @property
    def exact_matches(self) -> bool:
        return any(row.name == "exact" for row in self.matches)

    def to_json(self) -> dict[str, Any]:
        return {
            "snapshot": as_dict(self.snapshot),
            "quantity": self.quantity,
            "norm_type": None if self.norm_type is None else json_number(self.norm_type),
            "exact": json_number(self.exact),
            "logged": json_number(self.logged),
            "rtol": self.rtol,
            "explained": bool(self.matches),
            "best": self.matches[0].name if self.matches else None,
            "rows": [row.to_json() for row in self.rows],
        }


def _distance(value: float, logged: float) -> float:
    """How far ``value`` is from ``logged``, relative to it; a NaN or an infinity logged is met
    by the same alone."""
    if not math.isfinite(logged):
        same = math.isnan(value) if math.isnan(logged) else value == logged
        return 0.0 if same else math.inf
    if logged == 0:
        return 0.0 if value == 0 else math.inf
    if math.isnan(value):
        return math.inf
    return abs(value - logged) / abs(logged)


def explain_snapshot(
    snapshot: Snapshot | SnapshotShare,
    logged: float,
    norm_type: float | None = 2.0,
    rtol: float = 1e-3,
    hypotheses: Sequence[Hypothesis] = HYPOTHESES,
    processes: Processes | None = None,
) -> ExplainReport:
    """Rank every hypothesis by its distance to ``logged``.

    Args:
        snapshot: an opened snapshot (under a launcher, this process's share of it).
        logged: the number the framework logged.
        norm_type: the norm it logged (2, 1, inf, p > 0); None: ``logged`` is a zero count.
        rtol: a prediction within ``rtol * logged`` matches.
        hypotheses: the miscounts to try (default: all of :data:`HYPOTHESES`).
        processes: the processes reading the snapshot together (None: this one alone).
    """
    measured = 2.0 if norm_type is None else norm_type
    if processes is None:
        pieces, counted = _read_pieces(snapshot, measured)
    else:
        pieces, counted = gather_tensor_pieces(snapshot, measured, processes)
    _check_coverage(snapshot.directory, counted, processes)
    return explain_pieces(snapshot_info(snapshot), pieces, logged, norm_type, rtol, hypotheses)


def _check_coverage(where: Path, counted: Sequence[Piece], processes: Processes | None) -> None:
    """Refuse a snapshot whose counted tensors hold elements twice, as ``norm`` refuses it: its
    exact value would count them twice (see :mod:`gradstat.analysis.coverage`)."""
    tally = coverage.Tally()
    for piece in counted:
        tally.add(piece)
    miscounts = tally.miscounts()
    if processes is None:
        coverage.check(where, miscounts)
    else:
        from gradstat.distributed.runner import together

        together(processes, lambda: coverage.check(where, miscounts))


def explain_pieces(
    info: SnapshotInfo,
    pieces: Sequence[TensorPiece],
    logged: float,
    norm_type: float | None = 2.0,
    rtol: float = 1e-3,
    hypotheses: Sequence[Hypothesis] = HYPOTHESES,
) -> ExplainReport:
    """:func:`explain_snapshot` of tensor pieces already read (their norms of ``norm_type``,
    or of 2 for a zero count)."""
    counted = counted_pieces(pieces)
    exact = measure(counted, norm_type)
    predictions = [Prediction("exact", exact, names(counted), "the exact value (Megatron's count)")]
    for hypothesis in hypotheses:
        predictions += hypothesis(pieces, norm_type)
    rows = []
    for prediction in predictions:
        distance = _distance(prediction.value, logged)
        rows.append(
            ExplainRow(
                prediction.name,
                prediction.value,
                distance,
                distance <= rtol,
                prediction.params,
                prediction.description,
            )
        )
    # Stable: at one distance the exact value, then the registry's order.
    # The exact value first when it matches: a logged number rounded for the log also lies
    # within rtol of the reduced-precision hypotheses, which must not be named best then.
    rows.sort(
        key=lambda row: (not row.match, not (row.match and row.name == "exact"), row.distance)
    )
    return ExplainReport(
        info,
        "norm" if norm_type is not None else "zeros",
        norm_type,
        exact,
        logged,
        rtol,
        tuple(rows),
    )

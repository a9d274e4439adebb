"""Explain a logged number: which miscount of the snapshot's own gradients gives it.

A framework's logged gradient norm (or zero count) that differs from the exact one is most often
off by a known mistake: a kind of copy counted as well (TP replicas, the tied embedding, DP
replicas of a plain optimizer), a group left out (experts, a pipeline stage), per-rank norms
averaged instead of combined, partial sums rounded to bf16 before the reduction. Each mistake
is a small function over the snapshot's pieces (every tensor of every rank file, counted or
not, with the reason it is not); :data:`HYPOTHESES` is their one list, so the next reported bug
is a few lines here and a test.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any

import torch

from gradstat.analysis.report import SnapshotInfo, json_number, jsonable, snapshot_info
from gradstat.analysis.stats import Request, counts, nan_max, tensor_piece
from gradstat.core import kernels
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

# Why a tensor does not count, in the order ``counts`` decides it.
COPY_KINDS = (
    "shared",
    "tp_duplicate",
    "etp_duplicate",
    "gtp_duplicate",
    "dp_replica",
    "cp_replica",
    "edp_replica",
    "dtensor_replica",
)
_COORD_AXES = ("tp", "pp", "dp", "cp", "ep", "etp")


@dataclass(frozen=True)
class TensorPiece:
    """One tensor of one rank file, counted or not: its statistics and where it lies.

    ``reasons`` holds every copy kind that keeps it from counting (empty: it counts), so that a
    hypothesis counting one kind as well adds the tensors held back by that kind alone.
    ``dense_tp_duplicate`` says whether an expert tensor would be a duplicate if judged by the
    dense TP rank instead of the expert TP rank (Megatron-LM PR #6470's bug).
    """

    rank: int
    name: str
    reasons: tuple[str, ...]
    expert: bool
    dense_tp_duplicate: bool
    dtype: str
    coords: dict[str, int]
    sizes: dict[str, int]
    numel: int
    pad_zeros: int
    zeros: int
    norm: float  # of the asked norm type (max |g| for inf)

    @property
    def label(self) -> str:
        return self.reasons[0] if self.reasons else "counted"

    @property
    def counted(self) -> bool:
        return not self.reasons

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> TensorPiece:
        return cls(**{**data, "reasons": tuple(data["reasons"])})


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
        if record.dtensor.is_replica(tensor_parallel):
            found.append("dtensor_replica")
        return tuple(found)
    if record.attr("fsdp_param"):
        return ()
    tp, etp, gtp, egtp = rank_file.filter_places
    if not param_is_not_tensor_parallel_duplicate(param, tp, etp):
        found.append("etp_duplicate" if record.is_expert else "tp_duplicate")
    if not param_is_not_gtp_duplicate(param, gtp, egtp):
        found.append("gtp_duplicate")
    if rank_file.header.distributed_optimizer:
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
    request = Request.make([norm_type], zeros=True)
    pieces = []
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
    return pieces


def gather_tensor_pieces(
    snapshot: Snapshot | SnapshotShare, norm_type: float, processes: Processes
) -> list[TensorPiece]:
    """:func:`snapshot_tensor_pieces` of every rank file, each process reading its share
    (rank files i, i+N, ...); every process gets them all, in rank-file order.

    Raises:
        StoppedTogether: any process's error (the first, by process rank), on every process.
    """
    if processes.size == 1:
        return snapshot_tensor_pieces(snapshot, norm_type)
    from gradstat.distributed.runner import gather

    if isinstance(snapshot, SnapshotShare):
        mine = list(snapshot.files)
    else:
        mine = processes.share(snapshot.files)

    def compute(beat: Callable[[int], None]) -> list[dict[str, Any]]:
        found = []
        for rank_file in mine:
            found += [
                piece.to_json()
                for piece in snapshot_tensor_pieces(snapshot, norm_type, [rank_file])
            ]
            beat(rank_file.size_bytes)
        return found

    pieces = [TensorPiece.from_json(data) for share in gather(processes, compute) for data in share]
    # Stable: each file's tensors stay in their order, files come in rank order.
    pieces.sort(key=lambda piece: piece.rank)
    return pieces


@dataclass(frozen=True)
class Prediction:
    """What one hypothesis predicts the framework logged."""

    name: str
    value: float
    params: tuple[str, ...]
    description: str


def _norm_of(pieces: Iterable[TensorPiece], norm_type: float) -> float:
    norms = [piece.norm for piece in pieces]
    if norm_type == math.inf:
        return nan_max(norms)
    return kernels.combine_norms(norms, norm_type)


def _measure(pieces: Iterable[TensorPiece], norm_type: float | None) -> float:
    """The norm of ``pieces`` (``norm_type`` None: their zero count)."""
    if norm_type is None:
        return float(sum(piece.zeros for piece in pieces))
    return _norm_of(pieces, norm_type)


def _names(pieces: Iterable[TensorPiece]) -> tuple[str, ...]:
    return tuple(dict.fromkeys(piece.name for piece in pieces))


def _counted(pieces: Sequence[TensorPiece]) -> list[TensorPiece]:
    return [piece for piece in pieces if piece.counted]


def _size(pieces: Sequence[TensorPiece], axis: str) -> int:
    return max((piece.sizes.get(axis, 1) for piece in pieces), default=1)


# How the copies of a kind are said where their name alone says too little.
_COPY_WHAT = {
    "shared": "the shared (tied) copies",  # the tied output layer, as if `shared` were not set
    "dtensor_replica": "the DTensor Replicate copies",
}

Hypothesis = Callable[[Sequence[TensorPiece], "float | None"], list[Prediction]]


def copies_counted(pieces: Sequence[TensorPiece], norm_type: float | None) -> list[Prediction]:
    """Each kind of copy counted as well: the tensors held back by that kind alone."""
    counted = _counted(pieces)
    found = []
    for kind in COPY_KINDS:
        extra = [piece for piece in pieces if piece.reasons == (kind,)]
        if not extra:
            continue
        what = _COPY_WHAT.get(kind, f"the {kind.replace('_', ' ')} copies")
        found.append(
            Prediction(
                f"{kind}_counted",
                _measure(counted + extra, norm_type),
                _names(extra),
                f"{what} counted as well ({len(extra)} tensors)",
            )
        )
    if len(found) > 1:  # with one kind of copy, it is that kind's prediction again
        every = [piece for piece in pieces if set(piece.reasons) <= set(COPY_KINDS)]
        found.append(
            Prediction(
                "every_copy_counted",
                _measure(every, norm_type),
                _names(piece for piece in every if not piece.counted),
                "every tensor of every rank file counted, no duplicate filtered",
            )
        )
    return found


def experts_left_out(pieces: Sequence[TensorPiece], norm_type: float | None) -> list[Prediction]:
    """The experts (or the dense parameters) left out of the total."""
    counted = _counted(pieces)
    experts = [piece for piece in counted if piece.expert]
    dense = [piece for piece in counted if not piece.expert]
    if not experts or not dense:
        return []
    return [
        Prediction(
            "experts_left_out",
            _measure(dense, norm_type),
            _names(experts),
            "the expert parameters left out (dense only)",
        ),
        Prediction(
            "dense_left_out",
            _measure(experts, norm_type),
            _names(dense),
            "the dense parameters left out (experts only)",
        ),
    ]


def stage_local(pieces: Sequence[TensorPiece], norm_type: float | None) -> list[Prediction]:
    """One pipeline stage's total: a norm logged before the reduction over stages."""
    stages = _size(pieces, "pp")
    if stages < 2:
        return []
    counted = _counted(pieces)
    found = []
    for stage in range(stages):
        mine = [piece for piece in counted if piece.coords.get("pp", 0) == stage]
        found.append(
            Prediction(
                f"stage_{stage}_only",
                _measure(mine, norm_type),
                _names(mine),
                f"pipeline stage {stage} alone (a stage-local total)",
            )
        )
    return found


def ep_rank_left_out(pieces: Sequence[TensorPiece], norm_type: float | None) -> list[Prediction]:
    """One expert-parallel rank's experts left out."""
    ranks = _size(pieces, "ep")
    if ranks < 2:
        return []
    counted = _counted(pieces)
    found = []
    for ep_rank in range(ranks):
        left = [piece for piece in counted if piece.expert and piece.coords.get("ep") == ep_rank]
        if not left:
            continue
        kept = [
            piece for piece in counted if not (piece.expert and piece.coords.get("ep") == ep_rank)
        ]
        found.append(
            Prediction(
                f"ep_rank_{ep_rank}_left_out",
                _measure(kept, norm_type),
                _names(left),
                f"the experts of EP rank {ep_rank} left out",
            )
        )
    return found


def _tp_rank(piece: TensorPiece) -> int:
    return piece.coords.get("etp" if piece.expert else "tp", 0)


def tp_ranks_left_out(pieces: Sequence[TensorPiece], norm_type: float | None) -> list[Prediction]:
    """Only TP rank 0's shards (ETP rank 0's for experts): the other TP ranks left out; and,
    with more than two TP ranks, each one TP rank's shards left out."""
    size = max(_size(pieces, "tp"), _size(pieces, "etp"))
    if size < 2:
        return []
    counted = _counted(pieces)
    found = [
        Prediction(
            "tp_rank_0_only",
            _measure([piece for piece in counted if _tp_rank(piece) == 0], norm_type),
            _names(piece for piece in counted if _tp_rank(piece)),
            "only TP rank 0's shards counted (the other TP ranks' left out)",
        )
    ]
    for tp_rank in range(1, size) if size > 2 else ():  # with 2, rank 1 left out is the above
        left = [piece for piece in counted if _tp_rank(piece) == tp_rank]
        if left:
            found.append(
                Prediction(
                    f"tp_rank_{tp_rank}_left_out",
                    _measure([piece for piece in counted if _tp_rank(piece) != tp_rank], norm_type),
                    _names(left),
                    f"TP rank {tp_rank}'s shards left out",
                )
            )
    return found


def experts_judged_by_dense_tp(
    pieces: Sequence[TensorPiece], norm_type: float | None
) -> list[Prediction]:
    """Expert tensors deduplicated by the dense TP rank instead of the expert TP rank
    (Megatron-LM PR #6470): with TP4 x EP4 x ETP1 the unsplit expert tensors of dense TP ranks
    1-3 are dropped although each is another expert's, and with ETP > 1 the ETP copies held by
    dense TP rank 0 are kept."""

    def judged_dense(piece: TensorPiece) -> bool:
        if not piece.expert:
            return piece.counted
        return set(piece.reasons) <= {"etp_duplicate"} and not piece.dense_tp_duplicate

    kept = [piece for piece in pieces if judged_dense(piece)]
    changed = [piece for piece in pieces if judged_dense(piece) != piece.counted]
    if not changed:
        return []
    return [
        Prediction(
            "experts_judged_by_dense_tp",
            _measure(kept, norm_type),
            _names(changed),
            "expert copies told apart by the dense TP rank, not the expert TP rank "
            f"({len(changed)} tensors counted otherwise)",
        )
    ]


def rank_local(pieces: Sequence[TensorPiece], norm_type: float | None) -> list[Prediction]:
    """The first or the last rank's own number, never reduced over the ranks: the rank a
    framework logs from (Megatron prints from the last) computed it alone.

    ``rank_R_local`` is every tensor the rank holds (a DTensor's ``to_local()`` norm, or a
    local norm of a rank's own gradients); ``rank_R_unreduced`` is what the rank counts after
    the duplicate filters, the all-reduce left out. A rank whose number is the exact one
    (it holds every counted tensor) predicts nothing new and is left out, as is one that
    counts nothing (0 is no prediction).
    """
    ranks = sorted({piece.rank for piece in pieces})
    if len(ranks) < 2:
        return []
    exact = _measure(_counted(pieces), norm_type)
    found = []
    for rank in dict.fromkeys((ranks[0], ranks[-1])):
        held = [piece for piece in pieces if piece.rank == rank]
        kept = _counted(held)
        variants = [
            ("local", held, f"rank {rank}'s local tensors alone, not reduced over the ranks"),
        ]
        if len(kept) != len(held):
            what = f"rank {rank}'s counted tensors alone (filtered, the all-reduce left out)"
            variants.append(("unreduced", kept, what))
        for suffix, chosen, description in variants:
            value = _measure(chosen, norm_type)
            if not chosen or math.isclose(value, exact, rel_tol=1e-12, abs_tol=0.0):
                continue
            found.append(Prediction(f"rank_{rank}_{suffix}", value, _names(chosen), description))
    return found


def _rank_norms(pieces: Sequence[TensorPiece], norm_type: float) -> list[float]:
    ranks = sorted({piece.rank for piece in pieces})
    counted = _counted(pieces)
    return [
        _norm_of((piece for piece in counted if piece.rank == rank), norm_type) for rank in ranks
    ]


def per_rank_combined(pieces: Sequence[TensorPiece], norm_type: float | None) -> list[Prediction]:
    """Each rank's local norm of its counted tensors, averaged or summed instead of combined."""
    if norm_type is None or len({piece.rank for piece in pieces}) < 2:
        return []
    local = _rank_norms(pieces, norm_type)
    everything = _names(_counted(pieces))
    return [
        Prediction(
            "rank_norms_averaged",
            math.fsum(local) / len(local),
            everything,
            f"the mean of the {len(local)} ranks' local norms",
        ),
        Prediction(
            "rank_norms_summed",
            math.fsum(local),
            everything,
            f"the sum of the {len(local)} ranks' local norms (not their root-sum-square)",
        ),
    ]


def group_norms_combined(
    pieces: Sequence[TensorPiece], norm_type: float | None
) -> list[Prediction]:
    """The dense and the expert norms (Megatron's two optimizers), or the pipeline stages'
    norms, summed or averaged instead of combined."""
    if norm_type is None:
        return []
    counted = _counted(pieces)
    groupings = []
    dense = [piece for piece in counted if not piece.expert]
    experts = [piece for piece in counted if piece.expert]
    if dense and experts:
        groupings.append(("dense_and_expert", "the dense and the expert norms", [dense, experts]))
    stages = _size(pieces, "pp")
    if stages > 1:
        by_stage = [
            [piece for piece in counted if piece.coords.get("pp", 0) == s] for s in range(stages)
        ]
        groupings.append(("stage", f"the {stages} stages' norms", by_stage))
    everything = _names(counted)
    found = []
    for name, what, groups in groupings:
        norms = [_norm_of(group, norm_type) for group in groups]
        found.append(
            Prediction(f"{name}_norms_summed", math.fsum(norms), everything, f"{what} summed")
        )
        found.append(
            Prediction(
                f"{name}_norms_averaged",
                math.fsum(norms) / len(norms),
                everything,
                f"{what} averaged",
            )
        )
    return found


def dp_scaling(pieces: Sequence[TensorPiece], norm_type: float | None) -> list[Prediction]:
    """Gradients not yet divided by the data-parallel size, or divided twice."""
    dp = _size(pieces, "dp")
    if norm_type is None or dp < 2:
        return []
    exact = _norm_of(_counted(pieces), norm_type)
    everything = _names(_counted(pieces))
    return [
        Prediction(
            "not_divided_by_dp",
            exact * dp,
            everything,
            f"gradients summed over the {dp} data-parallel ranks, not averaged (x {dp})",
        ),
        Prediction(
            "divided_by_dp_twice",
            exact / dp,
            everything,
            f"gradients divided by the data-parallel size twice (/ {dp})",
        ),
    ]


def _rounded(value: float, dtype: torch.dtype) -> float:
    return float(torch.tensor(value, dtype=torch.float64).to(dtype).to(torch.float64))


def low_precision_partials(
    pieces: Sequence[TensorPiece], norm_type: float | None
) -> list[Prediction]:
    """Each tensor's partial (its p-th power sum, or max for inf) rounded to bf16 or fp16
    before the reduction."""
    if norm_type is None:
        return []
    counted = _counted(pieces)
    found = []
    for dtype, short in ((torch.bfloat16, "bf16"), (torch.float16, "fp16")):
        if norm_type == math.inf:
            value = nan_max(_rounded(piece.norm, dtype) for piece in counted)
        else:
            try:
                powers = [_rounded(piece.norm**norm_type, dtype) for piece in counted]
            except OverflowError:
                continue
            value = math.fsum(powers) ** (1 / norm_type)
        found.append(
            Prediction(
                f"{short}_partials",
                value,
                _names(counted),
                f"each tensor's partial sum rounded to {short} before the reduction",
            )
        )
    return found


def padding_counted(pieces: Sequence[TensorPiece], norm_type: float | None) -> list[Prediction]:
    """GTP alignment padding counted as zero gradients."""
    counted = _counted(pieces)
    padded = [piece for piece in counted if piece.pad_zeros]
    if norm_type is not None or not padded:
        return []
    value = sum(piece.zeros + piece.pad_zeros for piece in counted)
    return [
        Prediction(
            "gtp_padding_counted",
            float(value),
            _names(padded),
            f"GTP padding counted as zeros (+{sum(piece.pad_zeros for piece in padded)})",
        )
    ]


HYPOTHESES: tuple[Hypothesis, ...] = (
    copies_counted,
    experts_left_out,
    stage_local,
    ep_rank_left_out,
    tp_ranks_left_out,
    experts_judged_by_dense_tp,
    rank_local,
    per_rank_combined,
    group_norms_combined,
    dp_scaling,
    low_precision_partials,
    padding_counted,
)


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
        return dict(jsonable(asdict(self)))


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
            "snapshot": jsonable(asdict(self.snapshot)),
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
        pieces = snapshot_tensor_pieces(snapshot, measured)
    else:
        pieces = gather_tensor_pieces(snapshot, measured, processes)
    return explain_pieces(snapshot_info(snapshot), pieces, logged, norm_type, rtol, hypotheses)


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
    counted = _counted(pieces)
    exact = _measure(counted, norm_type)
    predictions = [
        Prediction("exact", exact, _names(counted), "the exact value (Megatron's count)")
    ]
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
    rows.sort(key=lambda row: (not row.match, row.distance))
    return ExplainReport(
        info,
        "norm" if norm_type is not None else "zeros",
        norm_type,
        exact,
        logged,
        rtol,
        tuple(rows),
    )

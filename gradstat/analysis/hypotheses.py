"""The catalogue of miscounts that frameworks make of a gradient norm or a zero count.

Each hypothesis is a small function over a snapshot's tensor pieces (every tensor of every
rank file, counted or not, with the reasons it is not: :class:`TensorPiece`) that returns what
the framework would have logged, as :class:`Prediction` rows; :data:`HYPOTHESES` is their one
list. The next reported bug is a few lines here and a test (``tests/test_explain.py``).
:mod:`gradstat.analysis.explain` reads the pieces and ranks the predictions.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict, dataclass
from typing import Any

import torch

from gradstat.analysis.stats import nan_max
from gradstat.core import kernels

__all__ = [
    "COPY_KINDS",
    "HYPOTHESES",
    "Hypothesis",
    "Prediction",
    "TensorPiece",
    "counted_pieces",
    "measure",
    "names",
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


def measure(pieces: Iterable[TensorPiece], norm_type: float | None) -> float:
    """The norm of ``pieces`` (``norm_type`` None: their zero count)."""
    if norm_type is None:
        return float(sum(piece.zeros for piece in pieces))
    return _norm_of(pieces, norm_type)


def names(pieces: Iterable[TensorPiece]) -> tuple[str, ...]:
    return tuple(dict.fromkeys(piece.name for piece in pieces))


def counted_pieces(pieces: Sequence[TensorPiece]) -> list[TensorPiece]:
    return [piece for piece in pieces if piece.counted]


# The copies a rank's own filters keep: Megatron leaves the data-parallel replicas to the
# all-reduce's group (they hold the same values), not to a filter.
_REPLICA_KINDS = frozenset(("dp_replica", "cp_replica", "edp_replica"))


def _rank_counted(pieces: Sequence[TensorPiece]) -> list[TensorPiece]:
    """What each rank counts before any reduction: its tensors the filters keep (TP, GTP and
    tied copies left out), a data-parallel replica's as much as rank 0's."""
    return [piece for piece in pieces if _REPLICA_KINDS.issuperset(piece.reasons)]


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
    counted = counted_pieces(pieces)
    found = []
    for kind in COPY_KINDS:
        extra = [piece for piece in pieces if piece.reasons == (kind,)]
        if not extra:
            continue
        what = _COPY_WHAT.get(kind, f"the {kind.replace('_', ' ')} copies")
        found.append(
            Prediction(
                f"{kind}_counted",
                measure(counted + extra, norm_type),
                names(extra),
                f"{what} counted as well ({len(extra)} tensors)",
            )
        )
    if len(found) > 1:  # with one kind of copy, it is that kind's prediction again
        every = [piece for piece in pieces if set(piece.reasons) <= set(COPY_KINDS)]
        found.append(
            Prediction(
                "every_copy_counted",
                measure(every, norm_type),
                names(piece for piece in every if not piece.counted),
                "every tensor of every rank file counted, no duplicate filtered",
            )
        )
    return found


def experts_left_out(pieces: Sequence[TensorPiece], norm_type: float | None) -> list[Prediction]:
    """The experts (or the dense parameters) left out of the total."""
    counted = counted_pieces(pieces)
    experts = [piece for piece in counted if piece.expert]
    dense = [piece for piece in counted if not piece.expert]
    if not experts or not dense:
        return []
    return [
        Prediction(
            "experts_left_out",
            measure(dense, norm_type),
            names(experts),
            "the expert parameters left out (dense only)",
        ),
        Prediction(
            "dense_left_out",
            measure(experts, norm_type),
            names(dense),
            "the dense parameters left out (experts only)",
        ),
    ]


def stage_local(pieces: Sequence[TensorPiece], norm_type: float | None) -> list[Prediction]:
    """One pipeline stage's total: a norm logged before the reduction over stages."""
    stages = _size(pieces, "pp")
    if stages < 2:
        return []
    counted = counted_pieces(pieces)
    found = []
    for stage in range(stages):
        mine = [piece for piece in counted if piece.coords.get("pp", 0) == stage]
        found.append(
            Prediction(
                f"stage_{stage}_only",
                measure(mine, norm_type),
                names(mine),
                f"pipeline stage {stage} alone (a stage-local total)",
            )
        )
    return found


def ep_rank_left_out(pieces: Sequence[TensorPiece], norm_type: float | None) -> list[Prediction]:
    """One expert-parallel rank's experts left out."""
    ranks = _size(pieces, "ep")
    if ranks < 2:
        return []
    counted = counted_pieces(pieces)
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
                measure(kept, norm_type),
                names(left),
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
    counted = counted_pieces(pieces)
    found = [
        Prediction(
            "tp_rank_0_only",
            measure([piece for piece in counted if _tp_rank(piece) == 0], norm_type),
            names(piece for piece in counted if _tp_rank(piece)),
            "only TP rank 0's shards counted (the other TP ranks' left out)",
        )
    ]
    for tp_rank in range(1, size) if size > 2 else ():  # with 2, rank 1 left out is the above
        left = [piece for piece in counted if _tp_rank(piece) == tp_rank]
        if left:
            found.append(
                Prediction(
                    f"tp_rank_{tp_rank}_left_out",
                    measure([piece for piece in counted if _tp_rank(piece) != tp_rank], norm_type),
                    names(left),
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
            measure(kept, norm_type),
            names(changed),
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
    exact = measure(counted_pieces(pieces), norm_type)
    found = []
    for rank in dict.fromkeys((ranks[0], ranks[-1])):
        held = [piece for piece in pieces if piece.rank == rank]
        kept = _rank_counted(held)
        variants = [
            ("local", held, f"rank {rank}'s local tensors alone, not reduced over the ranks"),
        ]
        if len(kept) != len(held):
            what = f"rank {rank}'s counted tensors alone (filtered, the all-reduce left out)"
            variants.append(("unreduced", kept, what))
        for suffix, chosen, description in variants:
            value = measure(chosen, norm_type)
            # 0 is no prediction (a rank whose counted tensors are all GTP padding, or none).
            if not chosen or value == 0 or math.isclose(value, exact, rel_tol=1e-12, abs_tol=0):
                continue
            found.append(Prediction(f"rank_{rank}_{suffix}", value, names(chosen), description))
    return found


def _rank_norms(
    pieces: Sequence[TensorPiece], chosen: Sequence[TensorPiece], norm_type: float
) -> list[float]:
    """Each rank's norm of its ``chosen`` pieces (0 where it has none), in rank order."""
    ranks = sorted({piece.rank for piece in pieces})
    return [
        _norm_of((piece for piece in chosen if piece.rank == rank), norm_type) for rank in ranks
    ]


def per_rank_combined(pieces: Sequence[TensorPiece], norm_type: float | None) -> list[Prediction]:
    """Each rank's local norm of what it counts, averaged or summed instead of combined.

    The mean is over every rank, a data-parallel replica's norm being rank 0's (the same
    over one model-parallel group); the sum is over the ranks that count (a sum over every
    rank is that times the replicas, which ``not_divided_by_dp`` says of the whole norm).
    """
    if norm_type is None or len({piece.rank for piece in pieces}) < 2:
        return []
    counted = counted_pieces(pieces)
    everything = names(counted)
    each = _rank_norms(pieces, _rank_counted(pieces), norm_type)
    counting = _rank_norms(counted, counted, norm_type)
    return [
        Prediction(
            "rank_norms_averaged",
            math.fsum(each) / len(each),
            everything,
            f"the mean of the {len(each)} ranks' local norms",
        ),
        Prediction(
            "rank_norms_summed",
            math.fsum(counting),
            everything,
            f"the sum of the {len(counting)} ranks' local norms (not their root-sum-square)",
        ),
    ]


def group_norms_combined(
    pieces: Sequence[TensorPiece], norm_type: float | None
) -> list[Prediction]:
    """The dense and the expert norms (Megatron's two optimizers), or the pipeline stages'
    norms, summed or averaged instead of combined."""
    if norm_type is None:
        return []
    counted = counted_pieces(pieces)
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
    everything = names(counted)
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
    exact = _norm_of(counted_pieces(pieces), norm_type)
    everything = names(counted_pieces(pieces))
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
    counted = counted_pieces(pieces)
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
                names(counted),
                f"each tensor's partial sum rounded to {short} before the reduction",
            )
        )
    return found


def padding_counted(pieces: Sequence[TensorPiece], norm_type: float | None) -> list[Prediction]:
    """GTP alignment padding counted as zero gradients."""
    counted = counted_pieces(pieces)
    padded = [piece for piece in counted if piece.pad_zeros]
    if norm_type is not None or not padded:
        return []
    value = sum(piece.zeros + piece.pad_zeros for piece in counted)
    return [
        Prediction(
            "gtp_padding_counted",
            float(value),
            names(padded),
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

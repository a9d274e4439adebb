"""Statistics of a snapshot: each logical parameter once, aggregated over shards and fragments.

A rank file's tensor counts when the core's filters keep it for its own rank (not shared, not a
TP/ETP or GTP/EGTP duplicate) and it is not a data-parallel replica: with a plain optimizer only
data-parallel rank 0 (context-parallel rank 0 too; expert-data-parallel rank 0 for expert
params) counts, with the distributed optimizer every rank's fragments do. DTensor gradients
count once per Replicate mesh dimension.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field

import torch

from . import kernels
from .clip_grads import check_norm_type, count_zeros_fp32, grads_for_norm
from .predicates import gtp_pad_zero_count
from .snapshot import RankFile, RebuiltParam, Snapshot

__all__ = ["NonFinite", "ParamStats", "SnapshotStats", "counts", "nan_max", "snapshot_stats"]

_CPU = torch.device("cpu")


@dataclass
class ParamStats:
    """One logical parameter's statistics over every counted shard and fragment."""

    name: str
    expert: bool
    numel: int = 0
    zeros: int = 0
    pad_zeros: int = 0
    power_sums: dict[float, float] = field(default_factory=dict)
    max_abs: float | None = None  # None when the inf norm was not asked for
    ranks: list[int] = field(default_factory=list)

    def norm(self, norm_type: float) -> float:
        if norm_type == math.inf:
            if self.max_abs is None:
                raise KeyError("the inf norm was not computed; ask for it in norm_types")
            return self.max_abs
        return _root(self.power_sums[norm_type], norm_type)


def nan_max(values: Iterable[float]) -> float:
    """The largest value, NaN if any is NaN (Python's max() drops a NaN after a number)."""
    peak = 0.0
    for value in values:
        if math.isnan(value):
            return math.nan
        peak = max(peak, value)
    return peak


def _root(power_sum: float, norm_type: float) -> float:
    return math.sqrt(power_sum) if norm_type == 2 else power_sum ** (1.0 / norm_type)


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

    def norm(self, norm_type: float, expert: bool | None = None) -> float:
        """The global norm; of dense (``expert=False``) or expert params only if asked.

        Megatron reduces dense and expert statistics in separate optimizers and combines them
        (sqrt(dense^2 + expert^2) for L2): summing powers over all parameters is the same.
        """
        params = [param for param in self.params if expert is None or param.expert == expert]
        if norm_type == math.inf:
            return nan_max(param.norm(math.inf) for param in params)
        return _root(sum(param.power_sums[norm_type] for param in params), norm_type)

    @property
    def zeros(self) -> int:
        return sum(param.zeros for param in self.params)

    @property
    def numel(self) -> int:
        return sum(param.numel for param in self.params)

    @property
    def pad_zeros(self) -> int:
        return sum(param.pad_zeros for param in self.params)


def counts(rank_file: RankFile, param: RebuiltParam) -> bool:
    """Whether ``param`` of ``rank_file`` holds values no other counted tensor holds."""
    record = param.record
    if not record.has_grad:
        return False
    if record.dtensor is not None and record.dtensor.is_replica():
        return False
    if record.attr("fsdp_param"):
        return True
    kept = grads_for_norm(
        [param],
        tp_group=rank_file.place("tp"),
        expert_tp_group=rank_file.place("etp"),
        gtp_group=rank_file.place("gtp"),
        expert_gtp_group=rank_file.place("egtp"),
    )
    if not kept:
        return False
    if rank_file.header.distributed_optimizer:
        return True
    coords = rank_file.header.coords
    if record.is_expert:
        return coords["edp"][0] == 0
    return coords["dp"][0] == 0 and coords["cp"][0] == 0


def _add(
    stats: ParamStats, rank_file: RankFile, param: RebuiltParam, with_zeros: bool
) -> NonFinite | None:
    """Add one counted tensor to its parameter's statistics; report its NaN/Inf if any."""
    grad = param.grad
    assert grad is not None
    partials = []
    for norm_type in stats.power_sums:
        partials.append(float(kernels.power_sum([grad], norm_type, _CPU)))
        stats.power_sums[norm_type] += partials[-1]
    if stats.max_abs is not None:
        partials.append(float(kernels.abs_max([grad], _CPU)))
        stats.max_abs = nan_max((stats.max_abs, partials[-1]))
    pad = gtp_pad_zero_count(param, grad)
    stats.pad_zeros += pad
    stats.numel += grad.numel() - pad
    if with_zeros:
        stats.zeros += int(
            count_zeros_fp32(
                [param],
                None,
                tp_group=rank_file.place("tp"),
                expert_tp_group=rank_file.place("etp"),
                gtp_group=rank_file.place("gtp"),
                expert_gtp_group=rank_file.place("egtp"),
            )
        )
    stats.ranks.append(rank_file.rank)
    # NaN and Inf propagate into every norm: only a non-finite partial needs the extra passes.
    if all(math.isfinite(partial) for partial in partials):
        return None
    nan, inf = int(torch.isnan(grad).sum()), int(torch.isinf(grad).sum())
    return NonFinite(rank_file.rank, param.name, nan, inf) if nan or inf else None


def snapshot_stats(
    snapshot: Snapshot,
    norm_types: Iterable[float] = (2.0,),
    ranks: Sequence[int] | None = None,
    *,
    zeros: bool = True,
    on_file: Callable[[RankFile], None] | None = None,
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
    """
    asked = {check_norm_type(p) for p in norm_types}
    finite = tuple(sorted(asked - {math.inf}, key=lambda p: (p != 2, p)))
    with_inf = math.inf in asked
    by_name: dict[str, ParamStats] = {}
    nonfinite: list[NonFinite] = []
    wanted = None if ranks is None else set(ranks)
    for rank_file in snapshot.files:
        if wanted is not None and rank_file.rank not in wanted:
            continue
        with rank_file.params() as params:
            for param in params:
                if not counts(rank_file, param):
                    continue
                stats = by_name.get(param.name)
                if stats is None:
                    stats = by_name[param.name] = ParamStats(
                        param.name,
                        param.record.is_expert,
                        power_sums=dict.fromkeys(finite, 0.0),
                        max_abs=0.0 if with_inf else None,
                    )
                found = _add(stats, rank_file, param, zeros)
                if found is not None:
                    nonfinite.append(found)
        if on_file is not None:
            on_file(rank_file)
    norm_types_done = (*finite, math.inf) if with_inf else finite
    return SnapshotStats(tuple(by_name.values()), norm_types_done, tuple(nonfinite))

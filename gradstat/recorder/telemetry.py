"""Per-parameter statistics of the live job, every recorded step, in one vector per step.

Each rank describes its gradients as :func:`gradstat.snapshot.dump_rank` would write them (the
same records, coordinates and placements) and counts them as ``gradstat norm`` counts a
snapshot (:func:`gradstat.analysis.stats.counts`): TP/ETP, GTP/EGTP and shared copies once,
DTensor gradients by their placements, data-parallel replicas once (a plain optimizer's at
data-parallel rank 0), distributed-optimizer fragments summed into their parameter. So a
parameter's numbers at a step are those ``gradstat norm`` prints for a snapshot of that step.

The names are those of the tensors some rank counts (a tied copy or a TP duplicate is none of
its own). They are agreed once, and again only when some rank's parameters change (a layer
added or replaced, a gradient that appears or goes): every rank sends a digest of its names, each
distinct list is broadcast once by its first owner, and every rank takes their union in rank
order, the order ``gradstat norm`` lists a snapshot's parameters. A name may stand for a group
(``groups``: regular expressions; a parameter whose name one matches counts under the matched
text, ``r"layers\\.\\d+"`` giving one row per layer).

At a recorded step every rank adds its counted tensors into two vectors, one entry per agreed
name: maxima (|x|) and sums (squares, zeros, NaN, Inf, elements), reduced over the world in a
MAX and then a SUM all-reduce: two collectives per step whatever the number of parameters (no
reduction op does both). A parameter whose largest element would make squares overflow or
underflow float64 (a float64 gradient beyond 1e100) has its squares summed relative to that
element, which the MAX made known to every rank. Squares are summed in float64 (the native
kernel's float64 lanes on the CPU): each statistic is float64-exact.
"""

from __future__ import annotations

import hashlib
import math
import re
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from gradstat._cached import cached
from gradstat.analysis.stats import Request, counts, tensor_piece
from gradstat.clip_grads import readable_values
from gradstat.core import copies, kernels, native
from gradstat.core.groups import AxisPlace, copy_group, is_dtensor, stats_device, to_local
from gradstat.core.kernels import UNDERFLOW_GUARD
from gradstat.core.replicas import lacking_digest
from gradstat.errors import GradstatError
from gradstat.recorder.agreement import ready
from gradstat.recorder.messages import warn
from gradstat.recorder.model import Gradients
from gradstat.snapshot.capture import rank_coords
from gradstat.snapshot.format import RankHeader
from gradstat.snapshot.reader import RebuiltParam, filter_places_of
from gradstat.snapshot.stand_ins import listing, with_stand_ins
from gradstat.snapshot.writer import check_coords, param_record

__all__ = ["Layout", "NativeTotal", "ParamsAtStep", "Telemetry"]

_SUMS = 5  # per name: squares, zeros, NaN, Inf, elements
# After the names' entries: the sums' DTensor squares, the sums that tell whether DTensor
# copies differ (gradstat.core.copies.moments of one number) and failed ranks; the maxima's
# plain squares, NaN, Inf, out of float64's range, and the lacking digest (and its negation).
_MOMENTS = copies.moments_size(1)
_SUM_EXTRAS = 2 + _MOMENTS
_MAX_EXTRAS = 6
_OUTSIZED = 1e100


@dataclass(frozen=True)
class Layout:
    """The agreed names (parameters, or groups of them) and whether each is an expert's."""

    names: tuple[str, ...]
    expert: tuple[bool, ...]


@dataclass(frozen=True)
class ParamsAtStep:
    """Every agreed name's statistics at one step, the same on every rank.

    ``norms`` holds each L2 norm, None where no rank has a gradient for it at this step.
    """

    layout: Layout
    norms: tuple[float | None, ...]
    max_abs: tuple[float, ...]
    zeros: tuple[int, ...]
    nan: tuple[int, ...]
    inf: tuple[int, ...]
    numel: tuple[int, ...]

    def total(self) -> float:
        """The L2 norm of everything counted: the root of the per-name squares, summed
        relative to the largest norm (a norm past 1e154 has no float64 square)."""
        present = [norm for norm in self.norms if norm is not None]
        peak = max(present, default=0.0)
        if not (math.isfinite(peak) and peak > 0) or any(map(math.isnan, present)):
            return math.fsum(present) if present else 0.0  # NaN or inf, as it is
        return peak * math.sqrt(math.fsum((norm / peak) ** 2 for norm in present))


@dataclass(frozen=True)
class NativeTotal:
    """What :func:`gradstat.total_norm` (group None) makes of a step's gradients, from the
    statistics' own pass: the DTensor shards' squares summed over the ranks, the plain
    gradients' as the largest rank's (replicas), and whether any rank's gradient, counted in
    the rows or not (another replica, a copy), holds a NaN or an Inf.

    The pass cannot stand for ``total_norm`` where the ranks lack different gradients
    (``total_norm`` matches replicas by place there), where a DTensor's copies differ
    (``total_norm`` counts each shard by its largest copy there) or a sum left float64's
    range."""

    dtensor_squares: float
    plain_squares: float
    nan: bool
    inf: bool
    in_range: bool
    lacking_differs: bool
    copies_differ: bool = False

    def norm(self) -> float | None:
        """The L2 norm ``total_norm`` gives, or None where this pass cannot tell it."""
        if self.nan:
            return math.nan
        if self.inf:
            return math.inf
        if self.lacking_differs or self.copies_differ or not self.in_range:
            return None
        return math.sqrt(self.dtensor_squares + self.plain_squares)


@dataclass(frozen=True)
class _LiveRank:
    """This rank's gradients described as its rank file would describe them (no file)."""

    header: RankHeader
    path: Path

    @property
    def rank(self) -> int:
        return self.header.rank

    @cached
    def filter_places(self) -> tuple[AxisPlace, AxisPlace, AxisPlace, AxisPlace]:
        return filter_places_of(self.header.coords)


@dataclass
class _Local:
    """What this rank counts, worked out when its parameters last changed: for each counted
    tensor its position among the items, its rebuilt parameter and its agreed slot."""

    items: tuple[int, ...]  # the items' ids: when they change, the names are agreed again
    held: tuple[bool, ...]  # which hold a gradient: when that changes, this is worked out again
    names: list[str]  # the slot names this rank holds, in its order
    expert: list[bool]
    live: _LiveRank
    counted: list[tuple[int, RebuiltParam, str]]  # (item position, param, slot name)
    padded: list[bool]  # whether a counted tensor may hold GTP padding (not counted)
    slots: list[int]  # agreed slot of each counted tensor
    uncounted: list[int]  # the other items' positions (copies counted elsewhere)
    failure: str | None = None  # why this rank could not describe its gradients
    # The gradients' dtypes and placements when it failed: a Partial gradient reduced, a
    # dtype changed, and it is described again.
    failed_on: tuple[Any, ...] = ()
    stale: bool = False  # a gradient's shape changed under the same parameter: describe again


def _scale(peak: float) -> float:
    """What a parameter's squares are summed relative to: 1, or its largest |x| where squares
    of its elements could overflow or underflow float64 (a float64 gradient beyond 1e100 or
    below 1e-100: never one of fp32, bf16 or fp16)."""
    if math.isfinite(peak) and (peak > _OUTSIZED or 0.0 < peak < 1.0 / _OUTSIZED):
        return peak
    return 1.0


def _plain(fused: native.FusedStats) -> bool:
    """Whether a native pass's sums stand as they are: finite, and not so small that fp32
    squares may have lost precision (``tensor_stats`` then recomputes in float64)."""
    if fused.has_nan:
        return False
    if fused.max_abs == 0.0:
        return True
    return UNDERFLOW_GUARD <= fused.sum_squares < math.inf


def _may_pad(param: RebuiltParam) -> bool:
    return bool(getattr(param, "is_gtp_weight_remat", False)) or (
        getattr(param, "gtp_pad_zeros", None) is not None
    )


def _digest(names: Sequence[str], expert: Sequence[bool]) -> str:
    text = "\0".join(f"{name}\1{int(flag)}" for name, flag in zip(names, expert, strict=True))
    return hashlib.sha1(text.encode(), usedforsecurity=False).hexdigest()


def _copy_moments(
    items: Sequence[Any],
    shards: Sequence[tuple[int, Any]],
    squares: Sequence[float],
    held_copies: Sequence[tuple[int, Any]],
) -> tuple[list[float], float, float]:
    """What tells whether the copies of this rank's DTensor shards differ from the counted ones
    (:func:`gradstat.core.copies.moments` of each one's squares), and whether its copies hold
    a NaN, an Inf.

    Args:
        items: the step's items.
        shards: the counted DTensor gradients, as (place, gradient).
        squares: each one's sum of squares.
        held_copies: the DTensor gradients counted elsewhere, as (place, gradient).
    """
    if not (shards or held_copies):  # no DTensor: nothing to tell, no tensor to make
        return [0.0] * _MOMENTS, 0.0, 0.0
    groups: dict[Any, copies.CopyGroup] = {}
    values: dict[Any, list[float]] = {}

    def add(place: int, held: Any, square: float | None) -> None:
        tensor_parallel = bool(getattr(items[place], "tensor_model_parallel", False))
        found = copy_group(held, tensor_parallel)
        if found is None:
            return
        key, size, is_copy = found
        group = groups.setdefault(key, copies.CopyGroup(key, size, is_copy))
        local = to_local(held)
        group.add(place, held, local)
        if is_copy:  # read below; a counted shard's squares are known
            group.tensors.append(local)
        values.setdefault(key, []).append(math.nan if square is None else square)

    for (place, held), square in zip(shards, squares, strict=True):
        add(place, held, square)
    for place, held in held_copies:
        add(place, held, None)
    nan = inf = 0.0
    for key, group in groups.items():
        if not group.is_copy:
            continue
        device = stats_device(group.tensors, None)
        for index, tensor in enumerate(group.tensors):
            total, scaled, infinite, bad = kernels.norm_partials([tensor], 2.0, device).tolist()
            nan, inf = nan + bad, inf + infinite
            values[key][index] = math.nan if scaled or infinite or bad else total
    stats = [torch.tensor(values[key], dtype=torch.float64) for key in groups]
    _, told = copies.moments(list(groups.values()), stats, torch.Size(), torch.device("cpu"))
    return told.tolist(), nan, inf


class Telemetry:
    """Per-parameter statistics every ``every`` steps (see the module's docstring).

    Args:
        gradients: the model as the recorder reads it.
        directory: the run directory, named in messages.
        every: record the statistics at steps divisible by this.
        groups: regular expressions; a parameter whose name one matches (the first, searched)
            counts under the matched text.
        coords, mesh: as :func:`gradstat.snapshot.dump_rank` takes them.
        group: where the names are agreed (the recorder's own gloo group, or None: the
            default group).
    """

    def __init__(
        self,
        gradients: Gradients,
        directory: Path,
        every: int,
        groups: Sequence[str],
        coords: Any,
        mesh: Any,
        group: dist.ProcessGroup | None,
    ) -> None:
        self.gradients = gradients
        self.directory = directory
        self.every = every
        self.patterns = tuple(re.compile(pattern) for pattern in groups)
        self.coords, self.mesh, self.group = coords, mesh, group
        self.layout = Layout((), ())
        self.version = 0  # counts what was worked out again: the same on every rank
        self._said_failed = False
        self._local: _Local | None = None
        self._slot: dict[str, int] = {}
        self.native_total: NativeTotal | None = None  # of the latest measure()

    def due(self, step: int) -> bool:
        return step % self.every == 0

    def _held(self, items: Sequence[Any]) -> tuple[bool, ...]:
        return tuple(self.gradients.gradient(item) is not None for item in items)

    def changed(self, items: Sequence[Any]) -> bool:
        """Whether this rank's parameters (``items``, as the model holds them now), or which of
        them hold a gradient, changed since the names were last agreed."""
        local = self._local
        if local is None or local.stale or local.items != tuple(map(id, items)):
            return True
        if local.failure is not None and local.failed_on != self._kinds(items):
            return True
        return local.held != self._held(items)

    def _kinds(self, items: Sequence[Any]) -> tuple[Any, ...]:
        """Each gradient's dtype and placements (what may make it describable again)."""
        found = []
        for item in items:
            grad = self.gradients.gradient(item)
            placements = getattr(grad, "placements", None)
            found.append(None if grad is None else (grad.dtype, str(placements)))
        return tuple(found)

    def _slot_name(self, name: str) -> str:
        for pattern in self.patterns:
            found = pattern.search(name)
            if found and found.group(0):  # an empty match names no group
                return found.group(0)
        return name

    def _header(self) -> RankHeader:
        """This rank's header as its rank file would hold it."""
        pairs = self.gradients.dumped_pairs()
        rank, world_size, coords = rank_coords(self.coords, self.mesh)
        records = [param_record(name, item, self.gradients.grad_attr)[0] for name, item in pairs]
        return RankHeader(
            rank=rank,
            world_size=world_size,
            step=None,
            coords=check_coords(coords),
            distributed_optimizer=self.gradients.distributed_optimizer,
            grad_attr=self.gradients.grad_attr,
            params=tuple(records),
        )

    def _describe(self, items: Sequence[Any], header: RankHeader) -> _Local:
        """What this rank counts of its records (``header``'s), and its slot names."""
        records = header.params
        live = _LiveRank(header, self.directory)
        names: dict[str, bool] = {}
        counted = []
        for position, record in enumerate(records):
            param = RebuiltParam(record)
            if counts(live, param):  # a copy counted elsewhere (shared, TP) is no name of its own
                slot = self._slot_name(record.name)
                names.setdefault(slot, record.expert)
                counted.append((position, param, slot))
        return _Local(
            tuple(map(id, items)),
            self._held(items),
            list(names),
            list(names.values()),
            live,
            counted,
            padded=[_may_pad(param) for _, param, _ in counted],
            slots=[self._slot.get(slot, -1) for _, _, slot in counted],
            uncounted=sorted(set(range(len(records))) - {position for position, _, _ in counted}),
        )

    def _undescribed(self, items: Sequence[Any], error: Exception) -> _Local:
        """A rank that could not describe its gradients: it holds no name, and every
        measurement says it failed (no rank reports numbers that leave this one's out)."""
        warn(
            f"per-parameter statistics stopped on this rank until its gradients change (a "
            f"dtype, a placement, a parameter): {error}"
        )
        header = RankHeader(0, 1, None, check_coords({}), False, self.gradients.grad_attr, ())
        live = _LiveRank(header, self.directory)
        ids = tuple(map(id, items))
        return _Local(
            ids,
            self._held(items),
            [],
            [],
            live,
            [],
            [],
            [],
            [],
            failure=str(error),
            failed_on=self._kinds(items),
        )

    def agree(self, items: Sequence[Any]) -> None:
        """Agree on the names (a collective: every rank calls, when any rank changed)."""
        header: RankHeader | None = None
        try:
            header = self._header()
        except Exception as error:  # every rank still joins the agreements below
            failure: Exception | None = error
        else:
            failure = None
        # A replica counts what a lower one lacks (gradstat.snapshot.stand_ins): every rank's
        # records without a gradient decide it, as they decide it in a snapshot.
        mine = None
        if header is not None:
            found = listing(f"rank {header.rank}", header)
            mine = found._replace(header=replace(header, params=()))
        everyone = [mine]
        if ready() and dist.get_world_size() > 1:
            everyone = [None] * dist.get_world_size()
            dist.all_gather_object(everyone, mine, group=self.group)
        try:
            if failure is not None:
                raise failure
            assert header is not None
            known = [listed for listed in everyone if listed is not None]
            (live,) = with_stand_ins([_LiveRank(header, self.directory)], known)
            local = self._describe(items, live.header)
        except Exception as error:  # every rank still joins the agreement below
            local = self._undescribed(items, error)
        self._local = local
        self.version += 1
        lists = [(local.names, local.expert)]
        if ready() and dist.get_world_size() > 1:
            digests: list[Any] = [None] * dist.get_world_size()
            dist.all_gather_object(digests, _digest(local.names, local.expert), group=self.group)
            lists = []
            first = {digest: rank for rank, digest in reversed(list(enumerate(digests)))}
            for owner in sorted(first.values()):
                sent: list[Any] = [
                    (local.names, local.expert) if dist.get_rank() == owner else None
                ]
                dist.broadcast_object_list(sent, src=owner, group=self.group)
                lists.append(sent[0])
        union: dict[str, bool] = {}
        for names, expert in lists:
            for name, flag in zip(names, expert, strict=True):
                union.setdefault(name, flag)
        self.layout = Layout(tuple(union), tuple(union.values()))
        self._slot = {name: index for index, name in enumerate(union)}
        local.slots = [self._slot[slot] for _, _, slot in local.counted]

    def measure(self, items: Sequence[Any]) -> ParamsAtStep | None:
        """This step's statistics of every agreed name (a collective: every rank calls); also
        sets :attr:`native_total`.

        None when some rank could not compute its part (its reason is one warning line there):
        every rank still joins the reductions, so none waits for another.
        """
        local = self._local
        assert local is not None, "agree() comes first"
        width = len(self.layout.names)
        sums = [0.0] * (width * _SUMS + _SUM_EXTRAS)
        maxima = [0.0] * (width + _MAX_EXTRAS)
        failure = None
        norms: list[tuple[int, float]] = []
        self.native_total = None
        try:
            if local.failure is not None:
                raise GradstatError(local.failure)
            norms = self._add_local(local, items, sums, maxima)
        except Exception as error:  # every rank still joins the reductions below
            failure = error
            sums = [0.0] * (width * _SUMS + _SUM_EXTRAS)
            sums[-1] = 1.0
            maxima = [0.0] * (width + _MAX_EXTRAS)
        maxed = self._reduced(maxima, dist.ReduceOp.MAX)
        scales = [_scale(peak) for peak in maxed[:width]]
        outsized = {slot for slot, scale in enumerate(scales) if scale != 1.0}
        if outsized and failure is None:
            # Squares that would overflow (or underflow) float64: summed relative to the
            # largest element of their parameter, which every rank knows now.
            for slot in outsized:
                sums[slot * _SUMS] = 0.0
            for slot, norm in norms:
                if slot in outsized:
                    sums[slot * _SUMS] += (norm / scales[slot]) ** 2
        summed = self._reduced(sums, dist.ReduceOp.SUM)
        if failure is not None or summed[-1] > 0:
            if not self._said_failed:  # once until a step succeeds again
                self._said_failed = True
                reason = f" ({failure})" if failure is not None else ""
                warn(f"per-parameter statistics skipped from this step: a rank failed{reason}")
            return None
        self._said_failed = False
        plain, nan, inf, out_of_range, digest, negated = maxed[width:]
        extras = width * _SUMS
        self.native_total = NativeTotal(
            dtensor_squares=summed[extras],
            plain_squares=plain,
            nan=bool(nan),
            inf=bool(inf),
            in_range=not (outsized or out_of_range),
            lacking_differs=digest != -negated,
            copies_differ=copies.differ(summed[extras + 1 : extras + 1 + _MOMENTS]),
        )
        uncounted = None
        if nan or inf:  # decided from reduced values: every rank joins, or none
            uncounted = self._reduced(self._copies_nonfinite(local, items), dist.ReduceOp.MAX)
        return self._result(summed, maxed[:width], scales, uncounted)

    def _copies_nonfinite(self, local: _Local, items: Sequence[Any]) -> list[float]:
        """Per agreed name, the NaN and then the Inf elements of this rank's uncounted copies
        of it (another replica's, a TP copy's): a step whose norm went non-finite on a copy the
        rows do not count names its parameter. Zeros where this rank cannot tell."""
        width = len(self.layout.names)
        found = [0.0] * (2 * width)
        try:
            for position in local.uncounted:
                held = self.gradients.gradient(items[position])
                slot = self._slot.get(self._slot_name(local.live.header.params[position].name))
                if held is None or slot is None:
                    continue
                values = readable_values(to_local(held), f"gradient {position}")[0]
                found[slot] = max(found[slot], float(values.isnan().sum()))
                found[width + slot] = max(found[width + slot], float(values.isinf().sum()))
        except Exception as error:  # every rank still joins the reduction
            warn(f"per-parameter statistics: cannot read an uncounted copy ({error})")
        return found

    def _add_local(
        self, local: _Local, items: Sequence[Any], sums: list[float], maxima: list[float]
    ) -> list[tuple[int, float]]:
        """Add this rank's counted tensors into ``sums`` and ``maxima``, and what
        :class:`NativeTotal` needs of all its gradients into their extra entries; each counted
        tensor's slot and L2 norm."""
        width = len(self.layout.names)
        grads, plain, shards = [], [], []
        for position, param, _ in local.counted:
            held = self.gradients.gradient(items[position])
            grad = to_local(held)
            if tuple(grad.shape) != param.record.shape:
                local.stale = True
                raise GradstatError(
                    f"{param.name!r}: its gradient's shape {list(grad.shape)} changed without "
                    "its parameter changing; re-agreed at the next step"
                )
            grads.append(grad if grad.layout == torch.strided else grad.to_dense())
            plain.append(not is_dtensor(held))
            if not plain[-1]:
                shards.append((position, held))
        others, rank_sums, held_copies = self._uncounted(local, items)
        norms: list[tuple[int, float]] = []
        shard_squares: list[float] = []  # each counted tensor's, DTensor or not
        squares = {True: 0.0, False: 0.0}  # plain or not: each counted tensor's squares
        device = grads[0].device if grads else torch.device("cpu")
        request = Request.make((2.0, math.inf), zeros=True, device=device)
        passes = native.fused_many_f32(grads) if request.one_pass else [None] * len(grads)
        for (_, param, _), slot, padded, grad, fused, is_plain in zip(
            local.counted, local.slots, local.padded, grads, passes, plain, strict=True
        ):
            base = slot * _SUMS
            if fused is not None and not padded and _plain(fused):
                # The native pass's float64 sums as they are: what tensor_piece would take.
                sums[base] += fused.sum_squares
                sums[base + 1] += fused.zeros
                sums[base + 4] += grad.numel()
                maxima[slot] = max(maxima[slot], fused.max_abs)
                norms.append((slot, math.sqrt(fused.sum_squares)))
                squares[is_plain] += fused.sum_squares
                shard_squares.append(fused.sum_squares)
                continue
            param.grad = grad
            found = tensor_piece(local.live, param, grad, request, fused)
            param.grad = None  # hold no gradient past the step
            norm = found.norms[0]
            sums[base] += norm * norm  # inf past float64: then summed scaled (measure)
            sums[base + 1] += found.zeros
            if found.nonfinite is not None:
                sums[base + 2] += found.nonfinite.nan
                sums[base + 3] += found.nonfinite.inf
                rank_sums[1] += found.nonfinite.nan
                rank_sums[2] += found.nonfinite.inf
            sums[base + 4] += found.numel
            norms.append((slot, norm))
            if math.isfinite(norm):
                squares[is_plain] += norm * norm
            shard_squares.append(norm * norm)
            # A NaN is counted, not maximised: MAX over ranks does not propagate it.
            if found.max_abs is not None and not math.isnan(found.max_abs):
                maxima[slot] = max(maxima[slot], found.max_abs)
        sums[width * _SUMS] = squares[False]
        counted = [
            square for square, is_plain in zip(shard_squares, plain, strict=True) if not is_plain
        ]
        told, nan, inf = _copy_moments(items, shards, counted, held_copies)
        sums[width * _SUMS + 1 : width * _SUMS + 1 + _MOMENTS] = told
        rank_sums[0] += squares[True]
        rank_sums[1] += nan
        rank_sums[2] += inf
        maxima[width:] = [*rank_sums, others, -others]
        return norms

    def _uncounted(
        self, local: _Local, items: Sequence[Any]
    ) -> tuple[float, list[float], list[tuple[int, Any]]]:
        """The lacking digest of this rank's list, its uncounted plain gradients' squares,
        NaN, Inf and out-of-range flags (:class:`NativeTotal`: total_norm reads them all), and
        its DTensor copies counted elsewhere with their places."""
        lacking, grads, held_copies = [], [], []
        for position in local.uncounted:
            item = items[position]
            held = self.gradients.gradient(item)
            if held is None:
                if getattr(item, "requires_grad", False) and not is_dtensor(item):
                    lacking.append(position)
            elif not is_dtensor(held):
                grads.append(readable_values(held, f"gradient {position}")[0])
            else:  # a DTensor copy counted on another rank: total_norm reads it too
                held_copies.append((position, held))
        found = [0.0, 0.0, 0.0, 0.0]
        if grads:
            device = stats_device(grads, None)
            total, scaled, inf, nan = kernels.norm_partials(grads, 2.0, device).tolist()
            found = [total, nan, inf, scaled]
        return lacking_digest(len(items), lacking), found, held_copies

    @staticmethod
    def _reduced(values: list[float], op: Any) -> list[float]:
        if not (ready() and dist.get_world_size() > 1):
            return values
        reduced = torch.tensor(values, dtype=torch.float64, device=stats_device([], None))
        dist.all_reduce(reduced, op=op)
        return list(reduced.tolist())

    def _result(
        self,
        summed: list[float],
        maxed: list[float],
        scales: list[float],
        copies: list[float] | None,
    ) -> ParamsAtStep:
        """The rows; ``copies``: the uncounted copies' NaN and Inf elements per name (their
        most on one rank), which make a row's norm NaN or inf as they make the step's."""
        width = len(self.layout.names)
        columns = [summed[offset : width * _SUMS : _SUMS] for offset in range(_SUMS)]
        squares, zeros, nan, inf, numel = columns
        if copies is not None:
            nan = [max(pair) for pair in zip(nan, copies[:width], strict=True)]
            inf = [max(pair) for pair in zip(inf, copies[width:], strict=True)]
        norms = tuple(
            (math.nan if bad else math.inf if infinite else scale * math.sqrt(square))
            if elements > 0 or square > 0
            else None
            for square, elements, scale, bad, infinite in zip(
                squares, numel, scales, nan, inf, strict=True
            )
        )
        return ParamsAtStep(
            self.layout,
            norms,
            tuple(math.nan if found else peak for peak, found in zip(maxed, nan, strict=True)),
            tuple(int(value) for value in zeros),
            tuple(int(value) for value in nan),
            tuple(int(value) for value in inf),
            tuple(int(value) for value in numel),
        )

"""gradstat compare: two snapshots of the same model, possibly in different layouts.

Each logical parameter's L2 norm and zero count come from the same pieces as ``gradstat norm``
and ``zeros``, so they are what Megatron would compute in each layout. Where both sides can be
rebuilt into full tensors (TP shards placed along their partition dim, GTP padding stripped,
fragments placed by offset), the largest elementwise difference is measured too: it catches what
norms cannot, such as TP shards in the wrong order.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from functools import partial
from typing import Any

import torch
from torch import Tensor

from gradstat.analysis import coverage
from gradstat.analysis.report import (
    CompareReport,
    ParamDiff,
    SnapshotInfo,
    TotalDiff,
    snapshot_info,
)
from gradstat.analysis.stats import (
    ParamStats,
    Request,
    SnapshotStats,
    gather_pieces,
    merge,
    nan_max,
    relative_to,
)
from gradstat.analysis.tiles import (
    MappedFiles,
    Tile,
    assemble,
    differences,
    finite_peak,
    plan,
    segments,
    snapshot_tiles,
    wide_chunks,
)
from gradstat.distributed.runner import Processes, gather_jobs, together
from gradstat.errors import SnapshotError
from gradstat.snapshot import Snapshot
from gradstat.snapshot.checkpoint import kind_said

__all__ = ["CompareReport", "ParamDiff", "TotalDiff", "compare_snapshots", "ratio", "rel_diff"]

DEFAULT_RTOL = 1e-5


def rel_diff(a: float, b: float) -> float:
    """|a - b| relative to the larger magnitude; 0 for equal values, NaN if either is NaN."""
    if a == b:
        return 0.0
    if math.isnan(a) or math.isnan(b):
        return math.nan
    if math.isinf(a) or math.isinf(b):
        return math.inf
    return abs(a - b) / max(abs(a), abs(b))


def ratio(a: float, b: float) -> float:
    """b / a: 1 for equal values (two zeros too), inf for a zero A under a non-zero B, NaN if
    either is NaN. Unlike ``rel_diff``, which nears 1 for any large change, it tells a 100x
    jump (100) from a 10x one (10)."""
    if a == b:
        return 1.0
    if math.isnan(a) or math.isnan(b):
        return math.nan
    if a == 0:
        return math.copysign(math.inf, b)
    return b / a


def _beyond(diff: float | None, rtol: float) -> bool:
    return diff is not None and not diff <= rtol  # NaN is beyond any tolerance


def _elementwise(tiles_a: list[Tile], tiles_b: list[Tile]) -> dict[str, Any]:
    """Rebuild one parameter on both sides and measure their largest elementwise difference."""
    name = tiles_a[0].name
    plans = plan(name, tiles_a), plan(name, tiles_b)
    result: dict[str, Any] = {
        "shape_a": None,
        "shape_b": None,
        "max_abs_diff": None,
        "scale": None,
        "diff_norm": None,
    }
    reasons = []
    for side, found in zip("ab", plans, strict=True):
        if isinstance(found, str):
            reasons.append(f"{side.upper()}: {found}")
        else:
            result[f"shape_{side}"] = list(found.full_shape)
    result["not_rebuilt"] = "; ".join(reasons) or None
    plan_a, plan_b = plans
    if isinstance(plan_a, str) or isinstance(plan_b, str):
        return result
    if plan_a.full_shape != plan_b.full_shape:
        result["not_rebuilt"] = "the full shapes differ"
        return result
    with MappedFiles() as files_a, MappedFiles() as files_b:
        # Flat views of the mapped tiles where the layout allows it; else one rebuilt tensor.
        pieces_a, pieces_b = (
            segments(layout, files) or [assemble(layout, files).reshape(-1)]
            for layout, files in ((plan_a, files_a), (plan_b, files_b))
        )
        result["max_abs_diff"], result["scale"], result["diff_norm"] = _differences(
            pieces_a, pieces_b
        )
        del pieces_a, pieces_b  # they view the maps, which close with the block
    return result


def _aligned(pieces_a: list[Tensor], pieces_b: list[Tensor]) -> Iterator[tuple[Tensor, Tensor]]:
    """Equally long slices of two sequences of flat tensors that hold the same elements."""
    index_a = index_b = offset_a = offset_b = 0
    while index_a < len(pieces_a) and index_b < len(pieces_b):
        piece_a, piece_b = pieces_a[index_a], pieces_b[index_b]
        length = min(piece_a.numel() - offset_a, piece_b.numel() - offset_b)
        yield piece_a[offset_a : offset_a + length], piece_b[offset_b : offset_b + length]
        offset_a, offset_b = offset_a + length, offset_b + length
        if offset_a == piece_a.numel():
            index_a, offset_a = index_a + 1, 0
        if offset_b == piece_b.numel():
            index_b, offset_b = index_b + 1, 0


def _differences(pieces_a: list[Tensor], pieces_b: list[Tensor]) -> tuple[float, float, float]:
    """max |a - b| (NaN where only one side is NaN; see :func:`differences`), the largest
    |element| of either, and ||a - b||_2 (between two checkpoints, the update), in float64."""
    pairs = list(_aligned(pieces_a, pieces_b))
    if all(a.dtype == b.dtype and torch.equal(a, b) for a, b in pairs):
        return 0.0, 0.0, 0.0  # the usual case, in one pass (the scale matters for a difference)
    largest_diff, largest = 0.0, 0.0
    sums = []
    for wide_a, wide_b in (block for a, b in pairs for block in wide_chunks(a, b)):
        diff = differences(wide_a, wide_b)
        # max() propagates NaN: a NaN on one side only is a NaN difference.
        largest_diff = nan_max((largest_diff, float(diff.max()) if diff.numel() else 0.0))
        sums.append(float(diff.square_().sum()))
        largest = max(largest, finite_peak(wide_a), finite_peak(wide_b))
    return largest_diff, largest, math.sqrt(math.fsum(sums))


def is_update(a: SnapshotInfo, b: SnapshotInfo) -> bool:
    """Whether A and B are two checkpoints' weights: their difference is the update, expected."""
    return a.source == b.source == "dcp" and a.kind == b.kind == "weight"


def _totals(
    stats_a: SnapshotStats, stats_b: SnapshotStats, rtol: float, updates: bool = False
) -> tuple[TotalDiff, ...]:
    figures: list[tuple[str, float | int, float | int]] = [
        ("total_norm", stats_a.norm(2.0), stats_b.norm(2.0)),
        ("dense_norm", stats_a.norm(2.0, expert=False), stats_b.norm(2.0, expert=False)),
        ("expert_norm", stats_a.norm(2.0, expert=True), stats_b.norm(2.0, expert=True)),
        ("num_zeros", stats_a.zeros, stats_b.zeros),
        ("num_elements", stats_a.numel, stats_b.numel),
    ]
    totals = []
    for measure, a, b in figures:
        diff = rel_diff(float(a), float(b))
        exact = isinstance(a, int)
        if updates and measure in ("total_norm", "dense_norm", "expert_norm", "num_zeros"):
            flagged = False  # a step changes the weights: only their number must stay
        else:
            flagged = a != b if exact else _beyond(diff, rtol)
        totals.append(TotalDiff(measure, a, b, diff, flagged, ratio(float(a), float(b))))
    return tuple(totals)


def _param_diff(
    name: str,
    stats: tuple[dict[str, ParamStats], dict[str, ParamStats]],
    elementwise: dict[str, Any] | None,
    rtol: float,
    updates: bool = False,
) -> ParamDiff:
    a, b = (side.get(name) for side in stats)
    flags = []
    # A parameter of no elements holds nothing to miss: a distributed optimizer has no
    # fragment of it, so its snapshot lists none.
    present = b if a is None else a
    if (a is None or b is None) and present is not None and present.numel:
        flags.append("only_in_a" if b is None else "only_in_b")
    norm_a = None if a is None else a.norm(2.0)
    norm_b = None if b is None else b.norm(2.0)
    diff = None if norm_a is None or norm_b is None else rel_diff(norm_a, norm_b)
    if _beyond(diff, rtol) and not updates:
        flags.append("norm")
    if a is not None and b is not None:
        if a.zeros != b.zeros and not updates:
            flags.append("zeros")
        if a.numel != b.numel:
            flags.append("num_elements")
    found = elementwise or {}
    shape_a, shape_b = found.get("shape_a"), found.get("shape_b")
    if shape_a is not None and shape_b is not None and shape_a != shape_b:
        flags.append("shape")
    max_abs_diff, scale = found.get("max_abs_diff"), found.get("scale")
    diff_norm = found.get("diff_norm")
    rel_max = None
    if max_abs_diff is not None and scale is not None:
        rel_max = relative_to(max_abs_diff, scale)
        if updates:
            # Between two checkpoints of weights a difference is the update: what is flagged
            # is a parameter that did not change (frozen, or never given a gradient).
            if max_abs_diff == 0:
                flags.append("unchanged")
        elif _beyond(rel_max, rtol):
            flags.append("values")
    return ParamDiff(
        name=name,
        norm_a=norm_a,
        norm_b=norm_b,
        rel_diff=diff,
        ratio=None if norm_a is None or norm_b is None else ratio(norm_a, norm_b),
        zeros_a=None if a is None else a.zeros,
        zeros_b=None if b is None else b.zeros,
        num_elements_a=None if a is None else a.numel,
        num_elements_b=None if b is None else b.numel,
        shape_a=None if shape_a is None else tuple(shape_a),
        shape_b=None if shape_b is None else tuple(shape_b),
        max_abs_diff=max_abs_diff,
        rel_max_diff=rel_max,
        diff_norm=diff_norm,
        rel_diff_norm=None if diff_norm is None or not norm_a else diff_norm / norm_a,
        not_rebuilt=found.get("not_rebuilt") if elementwise is not None else None,
        flags=tuple(flags),
    )


def _of_one_kind(snapshot_a: Snapshot, snapshot_b: Snapshot) -> tuple[SnapshotInfo, SnapshotInfo]:
    """What the two snapshots say of themselves; refused when they hold different kinds of
    tensor (a gradient snapshot against a checkpoint's weights): every parameter would be
    flagged, and no flag would mean anything."""
    info_a, info_b = snapshot_info(snapshot_a), snapshot_info(snapshot_b)
    if info_a.tensor_kind != info_b.tensor_kind:
        raise SnapshotError(
            f"{info_b.path}: holds {kind_said(info_b.tensor_kind)}, {info_a.path} "
            f"{kind_said(info_a.tensor_kind)}: compare compares one kind of tensor (--kind "
            "chooses a checkpoint's)"
        )
    return info_a, info_b


def compare_snapshots(
    snapshot_a: Snapshot,
    snapshot_b: Snapshot,
    processes: Processes,
    rtol: float = DEFAULT_RTOL,
    device: torch.device | str = "cpu",
) -> CompareReport:
    """Compare two snapshots parameter by parameter, in this process or over torchrun's.

    Norms and zeros are reduced as by ``gradstat norm``/``zeros`` (rank files split over the
    processes); the full-tensor comparisons are split over the processes by parameter.

    Args:
        snapshot_a: the first snapshot (its parameter order is the report's).
        snapshot_b: the second snapshot.
        processes: this process among torchrun's (or alone).
        rtol: relative tolerance for norms and for elementwise differences.
        device: where norms and zeros are reduced.
    """
    info_a, info_b = together(processes, partial(_of_one_kind, snapshot_a, snapshot_b))
    request = Request.make((2.0,), True, device)
    stats_a = merge(gather_pieces(snapshot_a, request, processes, stage="reading A"), request)
    stats_b = merge(gather_pieces(snapshot_b, request, processes, stage="reading B"), request)
    for snapshot, stats in ((snapshot_a, stats_a), (snapshot_b, stats_b)):
        together(processes, partial(coverage.check, snapshot.directory, stats.miscounts))
    by_name = ({p.name: p for p in stats_a.params}, {p.name: p for p in stats_b.params})
    names = list(by_name[0]) + [name for name in by_name[1] if name not in by_name[0]]
    tiles_a, tiles_b = snapshot_tiles(snapshot_a), snapshot_tiles(snapshot_b)
    common = [name for name in names if name in by_name[0] and name in by_name[1]]
    found = gather_jobs(
        processes,
        common,
        lambda name: _elementwise(tiles_a[name], tiles_b[name]),
        stage="comparing",
        unit="parameters",
    )
    elementwise = dict(zip(common, found, strict=True))
    updates = is_update(info_a, info_b)
    params = tuple(
        _param_diff(name, by_name, elementwise.get(name), rtol, updates) for name in names
    )
    if updates:  # the largest update first
        params = tuple(sorted(params, key=lambda param: -(param.diff_norm or 0.0)))
    return CompareReport(
        a=info_a,
        b=info_b,
        rtol=rtol,
        totals=_totals(stats_a, stats_b, rtol, updates),
        params=params,
        mismatches=tuple(param.name for param in params if param.flags),
        has_experts=any(param.expert for stats in (stats_a, stats_b) for param in stats.params),
        updates=updates,
    )

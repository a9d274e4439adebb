"""gradstat audit: check a snapshot's gradients against what their attributes promise.

Megatron deduplicates by attributes: it counts a parameter that is not tensor-parallel once, on
TP rank 0, trusting the copies on the other TP ranks to be equal; it skips the ``shared`` tied
copy, trusting it to equal the original; with a plain optimizer it trusts the data-parallel
and context-parallel replicas to be equal (gradients are all-reduced over DP x CP); it counts
GTP padding rows in the norm, trusting them to be zero. When a promise is broken, the global
norm depends on which copy happened to be counted. Each finding names the parameter and the
ranks, measures the difference, and gives the global L2 norm had the tensor been counted the
other way.

Kinds of finding:

- ``tp_replicas_differ``: not tensor-parallel, but its copies differ across TP (ETP) ranks;
- ``gtp_replicas_differ``: not GTP-sharded, but its copies differ across GTP (EGTP) ranks;
- ``dp_replicas_differ``: plain optimizer, but data-parallel replicas differ;
- ``cp_replicas_differ``: plain optimizer, but context-parallel replicas differ;
- ``tied_copies_differ``: a tied copy (``shared``) differs from its original;
- ``tied_copy_counted_twice``: two tied copies on different stages, neither marked ``shared``;
- ``tp_shards_identical``: marked tensor-parallel, yet every TP rank holds the same values
  (a replicated weight counted once per TP rank);
- ``gtp_padding_nonzero``: GTP padding elements that are not zero;
- ``attributes``: attributes that disagree across ranks or with the shapes;
- ``elements_counted_twice``: the counted tensors of a parameter hold more elements than it
  has (fragments that overlap; a snapshot marked ``distributed_optimizer`` whose data-parallel
  ranks each hold the whole gradient): ``norm``, ``zeros`` and ``clip`` refuse it;
- ``elements_missing``: they hold fewer: the rest have no gradient in any rank file.

And what the gradients of MoE layers say (experts recognised by name, as
:mod:`gradstat.analysis.experts` does):

- ``expert_never_routed``: every gradient element of an expert is exactly zero while other
  experts of its layer have non-zero ones (no token reached it);
- ``no_gradient``: an expert parameter or a router (every parameter of an expert: one
  finding) has no gradient on any rank; a dense parameter without one is frozen, not a finding;
- ``router_zero``: a router's gradient is all zero while its layer's experts have gradients.

And of a PyTorch distributed checkpoint's tensors (``--kind``):

- ``moment_zero``: an Adam moment (``exp_avg``, ``exp_avg_sq``) that is zero in every element:
  its parameter never got a non-zero gradient (frozen, or outside the loss);
- ``nonfinite``: a tensor (weight, moment, gradient) holding NaN or Inf, counted by rank file;
- ``stored_copies_differ``: a chunk stored more than once (every rank's copy, in rank-local
  metadata) whose copies differ: the first is the one read.
"""

from __future__ import annotations

import math
from collections import Counter, defaultdict
from collections.abc import Callable, Hashable, Iterable, Sequence
from dataclasses import dataclass, replace
from typing import Any

import torch
from torch import Tensor

from gradstat.analysis.experts import expert_issues
from gradstat.analysis.report import AuditReport, Finding, snapshot_info
from gradstat.analysis.stats import (
    NonFinite,
    Request,
    SnapshotStats,
    counts,
    gather_pieces,
    merge,
    nan_max,
    relative_to,
)
from gradstat.analysis.tiles import (
    MappedFiles,
    Tile,
    box,
    differences,
    finite_peak,
    snapshot_tiles,
    squares,
    wide_chunks,
)
from gradstat.core import kernels
from gradstat.distributed.runner import Processes, gather_jobs
from gradstat.snapshot import RebuiltParam, Snapshot

__all__ = ["KINDS", "AuditReport", "Finding", "audit_snapshot"]

KINDS = (
    "tp_replicas_differ",
    "gtp_replicas_differ",
    "dp_replicas_differ",
    "cp_replicas_differ",
    "replicas_differ",
    "tied_copies_differ",
    "tied_copy_counted_twice",
    "tp_shards_identical",
    "gtp_padding_nonzero",
    "attributes",
    "elements_counted_twice",
    "elements_missing",
    "expert_never_routed",
    "no_gradient",
    "router_zero",
)

# Attributes every copy and shard of a parameter must agree on.
_AGREED = (
    "tensor_model_parallel",
    "partition_dim",
    "partition_stride",
    "allreduce",
    "is_gtp_weight_remat",
    "pad_length",
    "shared",
    "shared_embedding",
)


@dataclass
class _Gap:
    """How two equally long segments differ, and their sums of squares (float64)."""

    elements: int = 0
    differing: int = 0
    max_abs_diff: float = 0.0
    scale: float = 0.0
    squares_ref: float = 0.0
    squares_other: float = 0.0

    def beyond(self, rtol: float) -> bool:
        return self.differing > 0 and not self.max_abs_diff <= rtol * self.scale


def _measure(ref: Tensor, other: Tensor) -> _Gap:
    gap = _Gap(elements=ref.numel())
    for wide_ref, wide_other in wide_chunks(ref, other):
        diff = differences(wide_ref, wide_other)
        differing = int(torch.count_nonzero(diff))  # NaN too: NaN on one side only
        if differing:
            gap.differing += differing
            gap.max_abs_diff = nan_max((gap.max_abs_diff, float(diff.max())))
        for block in (wide_ref, wide_other):
            gap.scale = max(gap.scale, finite_peak(block))
        gap.squares_ref += squares(wide_ref)
        gap.squares_other += squares(wide_other)
    return gap


def _squares(tensor: Tensor) -> float:
    return sum(squares(block) for (block,) in wide_chunks(tensor))


def _overlap(ref: Tile, other: Tile, same_buffer: bool) -> tuple[slice, slice] | None:
    """The elements both tiles hold, as slices of each one's flat tensor.

    Fragments without offsets are taken to cover the same range only when ``same_buffer`` (the
    copies sit in equally laid out optimizer buffers: ranks of one stage) and shapes match.
    """
    if ref.start is not None and other.start is not None:
        if ref.local_shape != other.local_shape:
            return None
        low = max(ref.start, other.start)
        high = min(ref.start + ref.record.numel, other.start + other.record.numel)
        if low >= high:
            return None
        return slice(low - ref.start, high - ref.start), slice(
            low - other.start, high - other.start
        )
    if same_buffer and ref.record.shape == other.record.shape:
        whole = slice(0, ref.record.numel)
        return whole, whole
    return None


def _raw(
    kind: str,
    name: str,
    ranks: Iterable[int],
    detail: str,
    max_abs_diff: float | None = None,
    scale: float | None = None,
    power_delta: float | None = None,
) -> dict[str, Any]:
    rel = None if max_abs_diff is None or scale is None else relative_to(max_abs_diff, scale)
    return {
        "kind": kind,
        "name": name,
        "ranks": sorted(set(ranks)),
        "detail": detail,
        "max_abs_diff": max_abs_diff,
        "rel_diff": rel,
        "power_delta": power_delta,
    }


def _axis_label(tile: Tile, role: str) -> str:
    return (tile.axis(role) or role).upper()


def _largest_change(changes: Iterable[float]) -> float | None:
    """The change of the largest magnitude (None if none), NaN if any is: the same whatever
    their order."""
    found = list(changes)
    if any(math.isnan(change) for change in found):
        return math.nan
    return max(found, key=abs, default=None)


def _copies_differ(
    kind: str,
    what: str,
    pairs: Iterable[tuple[Tile, Tile]],
    files: MappedFiles,
    rtol: float,
    same_buffer: bool,
    replica: Callable[[Tile], Hashable] | None = None,
) -> list[dict[str, Any]]:
    """One finding for the (reference, copy) pairs that differ beyond ``rtol``, if any.

    Its ``power_delta`` is the change of the counted sum of squares had another replica been
    counted, the largest over the replicas: a copy's changes are added up with those of the
    other copies of its ``replica`` (the shards of one data-parallel replica of a TP-sharded
    weight all count instead of the counted ones); each pair alone where ``replica`` is None.
    """
    ranks: set[int] = set()
    differing = elements = 0
    largest, scale = 0.0, 0.0
    changes: dict[Hashable, float] = defaultdict(float)
    name = ""
    for index, (ref, other) in enumerate(pairs):
        name = other.name  # the copy: for a tied pair, the one that should equal the other
        overlap = _overlap(ref, other, same_buffer)
        if overlap is None:
            continue
        ref_values, other_values = files.tensor(ref)[overlap[0]], files.tensor(other)[overlap[1]]
        if torch.equal(ref_values, other_values):
            continue  # the usual case, in one cheap pass
        gap = _measure(ref_values, other_values)
        if not gap.beyond(rtol):
            continue
        ranks |= {ref.rank, other.rank}
        differing, elements = differing + gap.differing, elements + gap.elements
        largest, scale = nan_max((largest, gap.max_abs_diff)), max(scale, gap.scale)
        if ref.counted:  # counting this copy instead of the reference
            changes[index if replica is None else replica(other)] += (
                gap.squares_other - gap.squares_ref
            )
    if not ranks:
        return []
    detail = f"{what} in {differing} of {elements} element{'' if elements == 1 else 's'}"
    return [_raw(kind, name, ranks, detail, largest, scale, _largest_change(changes.values()))]


def _place_along(roles: tuple[str, ...]) -> Callable[[Tile], Hashable]:
    """A tile's replica among those :func:`_replica_pairs` pairs along ``roles``: its places
    there."""
    return lambda tile: tuple(tile.role_place(role)[0] for role in roles)


def _dtensor_replica(tile: Tile) -> Hashable:
    """A DTensor shard's replica: its coordinates on the mesh dimensions it is replicated on."""
    dtensor = tile.record.dtensor
    assert dtensor is not None
    placed = zip(dtensor.placements, dtensor.coordinate, strict=True)
    return tuple(index for code, index in placed if code == "R")


def _replica_pairs(tiles: Sequence[Tile], roles: tuple[str, ...]) -> list[tuple[Tile, Tile]]:
    """(reference, copy) pairs of tiles that differ only along ``roles``; the reference is the
    copy at coordinate 0 there (the one Megatron counts)."""
    groups: dict[tuple[int, ...], list[Tile]] = defaultdict(list)
    for tile in tiles:
        groups[tile.site(*roles)].append(tile)
    pairs = []
    for group in groups.values():
        ref = min(group, key=lambda tile: tuple(tile.role_place(role)[0] for role in roles))
        pairs += [(ref, other) for other in group if other is not ref]
    return pairs


def _dtensor_copy_pairs(tiles: Sequence[Tile]) -> list[tuple[Tile, Tile]]:
    """(reference, copy) pairs of DTensor shards that hold the same box of their parameter; the
    reference is the counted one."""
    groups: dict[Any, list[Tile]] = defaultdict(list)
    for tile in tiles:
        dtensor = tile.record.dtensor
        assert dtensor is not None
        key = box(tile)
        if key is None:  # no offset recorded: the coordinate off the Replicate dimensions
            coordinate = tuple(
                0 if code == "R" else index
                for code, index in zip(dtensor.placements, dtensor.coordinate, strict=True)
            )
            key = (coordinate, tile.record.shape)
        groups[key].append(tile)
    pairs = []
    for group in groups.values():
        ref = min(group, key=lambda tile: (not tile.counted, tile.rank))
        pairs += [(ref, other) for other in group if other is not ref]
    return pairs


def _data_parallel_findings(
    tiles: Sequence[Tile], files: MappedFiles, rtol: float
) -> list[dict[str, Any]]:
    """Plain optimizer: every data- and context-parallel replica against the counted copy.

    A copy on the counted copy's DP rank is a context-parallel replica (``cp_replicas_differ``);
    any other is a data-parallel one. Megatron all-reduces over DP x CP jointly, so a copy off
    both axes is named by its DP rank.
    """
    by_cp: list[tuple[Tile, Tile]] = []
    by_dp: list[tuple[Tile, Tile]] = []
    for ref, other in _replica_pairs(tiles, ("dp", "cp")):
        same_dp = other.role_place("dp")[0] == ref.role_place("dp")[0]
        (by_cp if same_dp else by_dp).append((ref, other))
    dp_what = "plain optimizer, yet its data-parallel replicas differ"
    cp_what = "plain optimizer, yet its context-parallel replicas differ"
    replica = _place_along(("dp", "cp"))
    return _copies_differ("dp_replicas_differ", dp_what, by_dp, files, rtol, True, replica) + (
        _copies_differ("cp_replicas_differ", cp_what, by_cp, files, rtol, True, replica)
    )


def _attribute_value(tile: Tile, label: str) -> str | None:
    if label == "shape":
        # DTensor shards may be uneven (FSDP2 pads the last ones): their full shape must agree.
        dtensor = tile.record.dtensor
        value = tile.local_shape if dtensor is None else dtensor.global_shape
        return None if value is None else repr(list(value))
    value = tile.record.attr(label)
    return None if value is None else repr(value)


def _attribute_findings(
    name: str, tiles: Sequence[Tile], files: MappedFiles
) -> list[dict[str, Any]]:
    found = []
    for label in (*_AGREED, "shape"):
        values = Counter(_attribute_value(tile, label) for tile in tiles)
        values.pop(None, None)
        if len(values) < 2:
            continue
        usual = values.most_common(1)[0][0]
        odd = [tile for tile in tiles if _attribute_value(tile, label) not in (usual, None)]
        shown = sorted({str(_attribute_value(tile, label)) for tile in odd})
        where = f"{len(odd)} rank{'' if len(odd) == 1 else 's'}"
        detail = f"{label} is {', '.join(shown)} on {where} but {usual} on the others"
        delta = None
        if label != "shape":
            held = next(tile for tile in tiles if _attribute_value(tile, label) == usual)
            delta = _recounted(odd, label, held.record.attr(label), files)
        ranks = (tile.rank for tile in odd)
        found.append(_raw("attributes", name, ranks, detail, power_delta=delta))
    first = tiles[0]
    shape, dim = first.local_shape, first.record.attr("partition_dim")
    if first.tp_sharded and shape is not None and not 0 <= dim < len(shape):
        detail = f"tensor-parallel along partition_dim {dim}, but its shape is {list(shape)}"
        found.append(_raw("attributes", name, (tile.rank for tile in tiles), detail))
    return found


def _recounted(odd: Sequence[Tile], label: str, usual: Any, files: MappedFiles) -> float:
    """Change of the global sum of squares had ``odd`` tiles carried the usual ``label``."""
    delta = 0.0
    for tile in odd:
        record = replace(tile.record, attrs={**tile.record.attrs, label: usual})
        recounted = counts(tile.rank_file, RebuiltParam(record, files.tensor(tile)))
        if recounted != tile.counted:
            squares = _squares(files.tensor(tile))
            delta += squares if recounted else -squares
    return delta


def _identical_shards(
    name: str, tiles: Sequence[Tile], files: MappedFiles, same_buffer: bool
) -> list[dict[str, Any]]:
    """A tensor-parallel parameter whose TP shards are all bitwise equal (and not all zero)."""
    tp_size = tiles[0].role_place("tp")[1]
    pairs = _replica_pairs(tiles, ("tp",))
    groups = {tile.site("tp") for tile in tiles}
    if tp_size < 2 or len(pairs) != len(groups) * (tp_size - 1):
        return []
    for ref, other in pairs:
        overlap = _overlap(ref, other, same_buffer)
        if overlap is None or overlap[0] != slice(0, ref.record.numel):
            return []
        # Bitwise equal, NaN included: the shards of a real TP weight differ at once.
        ref_bits, other_bits = (kernels.bits(files.tensor(tile)) for tile in (ref, other))
        if not torch.equal(ref_bits, other_bits):
            return []
    scale = max(float(files.tensor(tile).abs().nan_to_num(0.0).max()) for tile in tiles)
    if scale == 0.0:
        return []
    counted = sum(_squares(files.tensor(tile)) for tile in tiles if tile.counted)
    label = _axis_label(tiles[0], "tp")
    detail = (
        f"marked tensor-parallel, but all {tp_size} {label} shards are identical: a replicated "
        f"weight counted {tp_size} times"
    )
    delta = -counted * (tp_size - 1) / tp_size
    return [_raw("tp_shards_identical", name, (t.rank for t in tiles), detail, 0.0, scale, delta)]


def _padding(name: str, tiles: Sequence[Tile], files: MappedFiles) -> list[dict[str, Any]]:
    ranks, nonzero, elements = set(), 0, 0
    largest, squares = 0.0, 0.0
    for tile in tiles:
        pad = tile.pad_range()
        if not tile.counted or pad is None or tile.start is None or tile.stop is None:
            continue
        low, high = max(pad[0], tile.start), min(pad[1], tile.stop)
        if low >= high:
            continue
        segment = files.tensor(tile)[low - tile.start : high - tile.start]
        elements += segment.numel()
        found = int(torch.count_nonzero(segment.nan_to_num(nan=1.0)))  # NaN is not zero
        if found:
            ranks.add(tile.rank)
            nonzero += found
            wide = kernels.magnitudes(segment) if segment.is_complex() else segment.double().abs()
            largest = nan_max((largest, float(wide.max())))
            squares += _squares(segment)
    if not ranks:
        return []
    detail = (
        f"{nonzero} of {elements} GTP padding elements {'is' if nonzero == 1 else 'are'} not "
        "zero: counted in the norm, and subtracted from num_zeros as if zero"
    )
    return [_raw("gtp_padding_nonzero", name, ranks, detail, largest, largest, -squares)]


def _audit_param(tiles: Sequence[Tile], distributed_optimizer: bool, rtol: float) -> list[Any]:
    name, first = tiles[0].name, tiles[0]
    found = []
    with MappedFiles() as files:
        attributes = _attribute_findings(name, tiles, files)
        if attributes:
            return attributes  # the other checks would compare unlike things
        if all(tile.record.dtensor is not None for tile in tiles):
            what = "a copy by its placements (Replicate, or outside a TP plan), yet copies differ"
            pairs = _dtensor_copy_pairs(tiles)
            return _copies_differ(
                "replicas_differ", what, pairs, files, rtol, True, _dtensor_replica
            )
        tp, gtp = first.role_place("tp")[1], first.role_place("gtp")[1]
        if not first.tp_sharded and tp > 1:
            what = f"not tensor-parallel, yet its {_axis_label(first, 'tp')} copies differ"
            pairs = _replica_pairs(tiles, ("tp",))
            replica = _place_along(("tp",))
            found += _copies_differ("tp_replicas_differ", what, pairs, files, rtol, True, replica)
        if not first.gtp_sharded and gtp > 1:
            what = f"not GTP-sharded, yet its {_axis_label(first, 'gtp')} copies differ"
            pairs = _replica_pairs(tiles, ("gtp",))
            replica = _place_along(("gtp",))
            found += _copies_differ("gtp_replicas_differ", what, pairs, files, rtol, True, replica)
        if not distributed_optimizer:
            found += _data_parallel_findings(tiles, files, rtol)
        if first.tp_sharded and tp > 1:
            found += _identical_shards(name, tiles, files, True)
        found += _padding(name, tiles, files)
    return found


def _tied_jobs(tiles: dict[str, list[Tile]]) -> list[tuple[str, str, str]]:
    """(mode, original, other) for tied copies: "copy" (a ``shared`` copy of the original) or
    "twice" (another stage's tied weight that is not marked ``shared``)."""
    tied = [name for name, held in tiles.items() if held[0].record.attr("shared_embedding")]
    originals = [name for name in tied if not tiles[name][0].record.attr("shared")]
    copies = [name for name in tied if tiles[name][0].record.attr("shared")]

    def stage(name: str) -> int:
        return tiles[name][0].role_place("pp")[0]

    def shape(name: str) -> tuple[int, ...] | None:
        return tiles[name][0].local_shape

    jobs = []
    for copy in copies:
        match = [name for name in originals if stage(name) != stage(copy)]
        match.sort(key=lambda name: shape(name) != shape(copy))
        if match:
            jobs.append(("copy", match[0], copy))
    if originals:
        first = min(originals, key=stage)
        for other in originals:
            if stage(other) != stage(first) and shape(other) == shape(first):
                jobs.append(("twice", first, other))
    return jobs


def _audit_tied(
    mode: str, original: list[Tile], other: list[Tile], rtol: float
) -> list[dict[str, Any]]:
    by_site = {tile.site("pp"): tile for tile in original}
    pairs = [(by_site[tile.site("pp")], tile) for tile in other if tile.site("pp") in by_site]
    with MappedFiles() as files:
        if mode == "copy":
            what = f"tied copy (shared) of {original[0].name}, yet they differ"
            return _copies_differ("tied_copies_differ", what, pairs, files, rtol, False)
        squares = sum(_squares(files.tensor(tile)) for tile in other if tile.counted)
    detail = (
        f"tied to {original[0].name} (shared_embedding on both stages), but neither is "
        f"marked shared: counted twice"
    )
    ranks = [tile.rank for tile in (*original, *other) if tile.counted]
    return [_raw("tied_copy_counted_twice", other[0].name, ranks, detail, power_delta=-squares)]


def audit_snapshot(
    snapshot: Snapshot, processes: Processes, rtol: float = 0.0, device: torch.device | str = "cpu"
) -> AuditReport:
    """Every check on every parameter, in this process or split over torchrun's by parameter.

    Args:
        snapshot: an opened (validated) snapshot.
        processes: this process among torchrun's (or alone).
        rtol: copies count as equal when max |a - b| <= rtol * max |x| (0: bitwise equal).
        device: where the global norm is reduced.
    """
    # Zero counts too: an expert or router whose gradient is all zero is a finding; so is a
    # stacked expert tensor's row.
    request = Request.make((2.0,), True, device, split_experts=True)
    stats = merge(gather_pieces(snapshot, request, processes), request)
    total = stats.norm(2.0)
    tiles = snapshot_tiles(snapshot)
    distributed = snapshot.distributed_optimizer
    jobs: list[tuple[str, ...]] = [("param", name) for name in tiles]
    jobs += _tied_jobs(tiles)

    def work(job: tuple[str, ...]) -> list[Any]:
        if job[0] == "param":
            return _audit_param(tiles[job[1]], distributed, rtol)
        return _audit_tied(job[0], tiles[job[1]], tiles[job[2]], rtol)

    findings = [
        _finding(raw, total) for results in gather_jobs(processes, jobs, work) for raw in results
    ]
    ranks = {param.name: param.ranks for param in stats.params}
    for miscount in stats.miscounts:
        kind = "elements_counted_twice" if miscount.twice else "elements_missing"
        raw = _raw(kind, miscount.name, ranks[miscount.name], miscount.detail())
        findings.append(_finding(raw, total))
    headers = [(rank_file.rank, rank_file.header) for rank_file in snapshot.files]
    for issue in expert_issues(stats, headers):
        # Nothing is miscounted: the norm is what it is, only the model's training is off.
        findings.append(_finding(_raw(issue.kind, issue.name, issue.ranks, issue.detail), total))
    info = snapshot_info(snapshot)
    if info.source == "dcp":
        findings += [_finding(raw, total) for raw in _checkpoint_issues(stats, info.kind or "")]
        findings += [_finding(raw, total) for raw in _stored_copies(snapshot.files, rtol)]
    return AuditReport(
        snapshot=info,
        rtol=rtol,
        total_norm=total,
        params_checked=len(tiles),
        findings=tuple(findings),
    )


def _stored_copies(files: Sequence[Any], rtol: float) -> list[dict[str, Any]]:
    """A checkpoint's chunks stored more than once, each copy against the one read."""
    from gradstat.snapshot.dcp import read_chunk

    found = []
    compared = set()
    for file in files:
        for name, chunk in file.chunks.items():
            if not chunk.others or chunk.storage in compared:
                continue  # a stacked tensor's rows share their chunk: compared once
            compared.add(chunk.storage)
            ref, gaps = read_chunk(file.directory, chunk), []
            for storage in chunk.others:
                other = read_chunk(file.directory, replace(chunk, storage=storage))
                if not torch.equal(ref, other):
                    gaps.append((storage.relative_path, _measure(ref, other)))
            gaps = [(path, gap) for path, gap in gaps if gap.beyond(rtol)]
            if not gaps:
                continue
            largest = nan_max([gap.max_abs_diff for _, gap in gaps])
            scale = max(gap.scale for _, gap in gaps)
            change = _largest_change(gap.squares_other - gap.squares_ref for _, gap in gaps)
            places = ", ".join(sorted({path for path, _ in gaps}))
            detail = (
                f"stored {chunk.copies} times (rank-local metadata), and the copies in {places} "
                f"differ from the one read ({chunk.storage.relative_path}) in "
                f"{max(gap.differing for _, gap in gaps)} of {ref.numel()} elements"
            )
            found.append(
                _raw("stored_copies_differ", name, [file.rank], detail, largest, scale, change)
            )
    return found


def _checkpoint_issues(stats: SnapshotStats, kind: str) -> list[dict[str, Any]]:
    """A checkpoint's moments that are zero throughout, and its tensors holding NaN or Inf."""
    from gradstat.snapshot.checkpoint import classify_key, kind_said

    found = []
    for param in stats.params:
        held = classify_key(param.name).kind if kind == "all" else kind
        if held in ("exp_avg", "exp_avg_sq") and param.numel and param.zeros == param.numel:
            detail = (
                f"its {held} is zero in all {param.numel} elements: the parameter never got a "
                "non-zero gradient (frozen, or outside the loss)"
            )
            found.append(_raw("moment_zero", param.name, param.ranks, detail))
    by_name: dict[str, list[NonFinite]] = defaultdict(list)
    for item in stats.nonfinite:
        by_name[item.name].append(item)
    for name, items in by_name.items():
        nan, inf = sum(item.nan for item in items), sum(item.inf for item in items)
        what = "the tensor" if kind == "all" else f"its {kind_said(kind)}"
        detail = f"{nan} NaN and {inf} Inf elements in {what}"
        found.append(_raw("nonfinite", name, [item.rank for item in items], detail))
    return found


def _finding(raw: dict[str, Any], total: float) -> Finding:
    delta = raw.pop("power_delta")
    norm_if = change = None
    if delta is not None and math.isfinite(total):
        norm_if = math.sqrt(max(total * total + delta, 0.0))
        change = norm_if / total - 1.0 if total else None
    raw["ranks"] = tuple(raw["ranks"])
    return Finding(**raw, norm_if_miscounted=norm_if, norm_change=change)

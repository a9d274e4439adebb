"""Every report gradstat makes, as frozen dataclasses with their JSON: norm, zeros, clip,
inspect, compare and audit (the CLI's tables, ``gradstat.cli.render``, draw the same rows).

Building a report needs computed statistics, but importing this module imports no torch, so
the CLI can load it before deciding whether any work is needed.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Iterable
from dataclasses import dataclass, fields, is_dataclass, replace
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from gradstat.analysis.experts import ExpertStats
    from gradstat.analysis.stats import NonFinite, SnapshotStats
    from gradstat.core.placements import MeshPlacement
    from gradstat.snapshot.format import RankHeader
from gradstat.snapshot import Snapshot, SnapshotShare
from gradstat.snapshot.dcp import is_dcp_directory
from gradstat.snapshot.format import is_wgrads_name, recorded_norm

__all__ = [
    "ZEROS_ORDERS",
    "AuditReport",
    "ClipReport",
    "CompareReport",
    "ExpertNormRow",
    "ExpertZerosRow",
    "Finding",
    "InspectReport",
    "NormReport",
    "ParamDiff",
    "SnapshotInfo",
    "TotalDiff",
    "ZerosReport",
    "inspect_report",
    "json_number",
    "jsonable",
    "norm_report",
    "snapshot_info",
    "zeros_report",
]


def recorded_differs(recorded: float | None, total: float) -> bool:
    """Whether the flight recorder's norm of a step (``recorded``; None: not recorded) is not
    its snapshot's ``total``: the recorder counts every copy (the largest data-parallel replica,
    each DTensor shard's largest copy) where a snapshot counts one, so a copy the snapshot does
    not count differs (``gradstat audit`` names it); or the recorder and the snapshot were told
    of different parallel layouts."""
    if recorded is None or (math.isnan(recorded) and math.isnan(total)) or recorded == total:
        return False
    return not (math.isfinite(recorded) and abs(recorded - total) <= 1e-6 * abs(recorded))


def json_number(value: float) -> float | str:
    """A float for JSON: non-finite values become the strings "nan", "inf", "-inf"."""
    if math.isfinite(value):
        return value
    return "nan" if math.isnan(value) else ("inf" if value > 0 else "-inf")


def jsonable(data: Any) -> Any:
    if isinstance(data, float):
        return json_number(data)
    if isinstance(data, dict):
        return {key: jsonable(value) for key, value in data.items()}
    if isinstance(data, (list, tuple)):
        return [jsonable(value) for value in data]
    return data


_FIELDS: dict[type, tuple[str, ...]] = {}


def as_dict(data: Any) -> Any:
    """``data`` as JSON data: a dataclass as a dict of its fields, tuples as lists, floats as
    :func:`json_number` gives them. ``dataclasses.asdict`` deep-copies every value first: a
    report of 16,384 parameter rows took 0.3 s there."""
    kind = type(data)
    if kind is float:
        return json_number(data)
    if kind in (int, str, bool) or data is None:
        return data
    if kind in (list, tuple):
        return [as_dict(value) for value in data]
    if kind is dict:
        return {key: as_dict(value) for key, value in data.items()}
    names = _FIELDS.get(kind)
    if names is None and is_dataclass(kind):
        names = _FIELDS[kind] = tuple(field.name for field in fields(kind))
    if names is None:
        return jsonable(data)
    found = {}
    for name in names:  # a report's rows are flat: their scalars without a call each
        value = getattr(data, name)
        if type(value) is float:
            value = json_number(value)
        elif not (type(value) in _SCALARS or value is None):
            value = as_dict(value)
        found[name] = value
    return found


_SCALARS = frozenset((int, str, bool))


def _count(number: int, noun: str) -> str:
    """``1 rank``, ``2 ranks``: a number and its noun, singular or plural."""
    return f"{number} {noun}{'' if number == 1 else 's'}"


def _are(number: int) -> str:
    return "is" if number == 1 else "are"


@dataclass(frozen=True)
class SnapshotInfo:
    """What a snapshot says of itself, at the top of every report."""

    path: str
    world_size: int
    step: int | None
    distributed_optimizer: bool
    triggers: tuple[str, ...] = ()  # why the flight recorder took it ("spike", ...); () by hand
    # Every gradient is a DTensor: its placements decide what counts, and the header's
    # optimizer flag says nothing of the job's optimizer unless it was set.
    dtensor: bool = False
    # "gradstat" (rank files), "megatron-wgrads" (a --save-wgrads-interval dump, whose
    # attributes gradstat rebuilt: ``inspect`` says by which rule) or "dcp" (a PyTorch
    # distributed checkpoint).
    source: str = "gradstat"
    # A checkpoint's tensors read: "grad", "weight", "exp_avg", "exp_avg_sq" or "all"; None
    # for a gradient snapshot.
    kind: str | None = None

    @property
    def tensor_kind(self) -> str:
        """What its tensors are: a checkpoint's kind read, else ``grad``. Two snapshots of
        different kinds neither compare nor make one history."""
        return self.kind or "grad"


def _first_header(snapshot: Snapshot | SnapshotShare) -> RankHeader:
    """Rank 0's header: every rank file's for what they share (checked by the reader), and on
    process 0 under torchrun the one file of the share whose parameter records are read."""
    if isinstance(snapshot, SnapshotShare) and not (snapshot.files and snapshot.files[0].rank == 0):
        return snapshot.summaries[0].header
    return snapshot.files[0].header


def snapshot_info(snapshot: Snapshot | SnapshotShare) -> SnapshotInfo:
    header = _first_header(snapshot)
    source = _source(snapshot)
    with_grad = [record for record in header.params if record.has_grad]
    return SnapshotInfo(
        str(snapshot.directory),
        snapshot.world_size,
        snapshot.step,
        snapshot.distributed_optimizer,
        triggers=header.triggers,
        # A checkpoint's chunks are read as shards: they say nothing of the job's tensors.
        dtensor=source != "dcp"
        and bool(with_grad)
        and all(record.dtensor is not None for record in with_grad),
        source=source,
        # A checkpoint's rank files name the kind they hold where others name the gradient's
        # attribute.
        kind=header.grad_attr if source == "dcp" else None,
    )


def _source(snapshot: Snapshot | SnapshotShare) -> str:
    if is_dcp_directory(snapshot.directory):
        return "dcp"
    if isinstance(snapshot, SnapshotShare):
        first = snapshot.summaries[0].path
    else:
        first = snapshot.files[0].path
    return "megatron-wgrads" if is_wgrads_name(first.name) else "gradstat"


@dataclass(frozen=True)
class ParamNormRow:
    name: str
    norm: float
    # Its part of total_norm^p, which the parts sum to; None for the inf norm, where a
    # parameter's max |g| is no part of a sum (see ``ratio``). NaN where a norm is not finite.
    share: float | None
    num_elements: int
    expert: bool
    ranks: int  # how many rank files hold a counted piece of it
    ratio: float = math.nan  # norm / total_norm (for inf: its max |g| over the largest one)


@dataclass(frozen=True)
class ExpertNormRow:
    """One expert's part in the norm (``--by expert``), or a summary row's: ``layer`` and
    ``expert`` are null for the dense parameters' row and the unplaced expert parameters'."""

    name: str  # ``decoder.layers.1.mlp.experts[2]``, or a summary row's label
    layer: str | None  # the expert module
    expert: int | None  # the global expert index
    norm: float
    share: float | None  # as ParamNormRow's
    ratio: float
    num_elements: int
    params: int  # how many parameters the row combines
    ranks: int


@dataclass(frozen=True)
class NormReport:
    snapshot: SnapshotInfo
    norm_type: float
    total_norm: float
    dense_norm: float
    expert_norm: float
    params: tuple[ParamNormRow, ...]
    nonfinite: tuple[NonFinite, ...]  # by rank, then name
    max_norm: float | None
    clip_coeff: float | None
    params_left_out: int = 0  # rows cut by ``top``
    has_experts: bool = False  # any counted parameter is an expert's: the split means something
    # Per expert (``--by expert``), by contribution; None unless asked (absent from the JSON).
    by_expert: tuple[ExpertNormRow, ...] | None = None
    experts_left_out: int = 0  # expert rows cut by ``top``
    # The flight recorder's norm of the step, of this norm type, where it took the snapshot.
    recorded_norm: float | None = None

    @property
    def all_zero(self) -> bool:
        """Every counted gradient element is zero (or none was counted): a snapshot dumped
        before the backward pass, or after zero_grad, rather than a model with no gradient."""
        return self.total_norm == 0.0

    @property
    def nonfinite_not_counted(self) -> bool:
        """The flight recorder took the snapshot for a non-finite norm, yet every counted copy
        is finite: a copy the norm does not count holds the NaN or Inf (another data-parallel
        replica: the recorder's norm takes every replica's; ``gradstat audit`` names it)."""
        return (
            "nonfinite" in self.snapshot.triggers
            and not self.nonfinite
            and math.isfinite(self.total_norm)
        )

    @property
    def recorded_norm_differs(self) -> bool:
        """The flight recorder's norm of the step is not the snapshot's (see
        :func:`recorded_differs`); the non-finite case is :attr:`nonfinite_not_counted`'s."""
        if self.nonfinite_not_counted:
            return False  # the same fact, said already
        return recorded_differs(self.recorded_norm, self.total_norm)

    def to_json(self) -> dict[str, Any]:
        data = as_dict(self)
        data["norm_type"] = json_number(self.norm_type)
        data["all_zero"] = self.all_zero
        data["nonfinite_not_counted"] = self.nonfinite_not_counted
        data["recorded_norm_differs"] = self.recorded_norm_differs
        _drop_unasked(data)
        return dict(data)


def _drop_unasked(data: dict[str, Any]) -> None:
    """Without ``--by expert`` the document is what it was before the option existed."""
    if data["by_expert"] is None:
        del data["by_expert"], data["experts_left_out"]


def _ratio(norm: float, total: float) -> float:
    if not (math.isfinite(norm) and math.isfinite(total)):
        return math.nan
    return 0.0 if total == 0 else norm / total


def _share(norm: float, total: float, norm_type: float) -> float | None:
    """The parameter's part of ``total^p``; None for the inf norm, which is a max, not a sum."""
    if norm_type == math.inf:
        return None
    return float(_ratio(norm, total) ** norm_type)


def _by_contribution(row: ParamNormRow | ExpertNormRow) -> tuple[bool, float]:
    return _contribution(row.norm)


def _contribution(norm: float) -> tuple[bool, float]:
    # Non-finite parameters first (they are what the user is looking for), then largest first.
    finite = math.isfinite(norm)
    return finite, -norm if finite else 0.0


def norm_report(
    snapshot: Snapshot | SnapshotShare,
    stats: SnapshotStats,
    norm_type: float,
    max_norm: float | None = None,
    top: int | None = None,
    by_expert: bool = False,
) -> NormReport:
    """The global norm as Megatron computes it, and each parameter's part in it.

    Args:
        top: keep the ``top`` largest parameters (non-finite first); None keeps every one.
        by_expert: also each expert's part (:func:`gradstat.analysis.experts.expert_stats`),
            its rows cut by ``top`` too.
    """
    from gradstat.clip_grads import clip_coefficient  # torch is loaded by now: stats were computed

    total = stats.norm(norm_type)
    # Rows for the parameters shown alone: a snapshot of 8192 rank files of 4 tensors has
    # 32768 parameters, whose rows took 14.3 us a rank file where 20 are shown (now 3.2).
    params = stats.params
    norms = [param.norm(norm_type) for param in params]
    shown: Iterable[int] = range(len(params))
    if top is not None:  # the first ``top`` in the stable order below, in parameter order
        keys = [_contribution(norm) for norm in norms]
        shown = sorted(heapq.nsmallest(top, shown, key=keys.__getitem__))
    rows = [
        ParamNormRow(
            name=params[at].name,
            norm=norms[at],
            share=_share(norms[at], total, norm_type),
            num_elements=params[at].numel,
            expert=params[at].expert,
            ranks=len(set(params[at].ranks)),
            ratio=_ratio(norms[at], total),
        )
        for at in shown
    ]
    rows.sort(key=_by_contribution)
    nonfinite = tuple(sorted(stats.nonfinite, key=lambda item: (item.rank, item.name)))
    clip_coeff = None if max_norm is None else clip_coefficient(max_norm, total)
    experts = _expert_norm_rows(stats, total, norm_type) if by_expert else None
    return NormReport(
        snapshot=snapshot_info(snapshot),
        norm_type=norm_type,
        total_norm=total,
        dense_norm=stats.norm(norm_type, expert=False),
        expert_norm=stats.norm(norm_type, expert=True),
        params=tuple(rows),
        nonfinite=nonfinite,
        max_norm=max_norm,
        clip_coeff=clip_coeff,
        params_left_out=len(params) - len(rows),
        has_experts=any(param.expert for param in stats.params),
        by_expert=None if experts is None else tuple(experts if top is None else experts[:top]),
        experts_left_out=0 if experts is None or top is None else max(len(experts) - top, 0),
        recorded_norm=recorded_norm(snapshot.directory, norm_type),
    )


def _expert_rows(stats: SnapshotStats) -> list[ExpertStats]:
    from gradstat.analysis.experts import expert_stats  # torch is loaded: stats were computed

    return expert_stats(stats)


def _expert_norm_rows(stats: SnapshotStats, total: float, norm_type: float) -> list[ExpertNormRow]:
    rows = [
        ExpertNormRow(
            name=row.label,
            layer=row.module,
            expert=row.index,
            norm=row.norm(norm_type),
            share=_share(row.norm(norm_type), total, norm_type),
            ratio=_ratio(row.norm(norm_type), total),
            num_elements=row.numel,
            params=len(row.params),
            ranks=len(row.ranks),
        )
        for row in _expert_rows(stats)
    ]
    rows.sort(key=_by_contribution)
    return rows


@dataclass(frozen=True)
class ClipReport:
    snapshot: str
    out: str
    norm_type: float
    max_norm: float
    total_norm: float
    clip_coeff: float

    @property
    def clipped(self) -> bool:
        return self.clip_coeff < 1.0

    @property
    def all_zero(self) -> bool:
        """Every counted gradient element is zero: the copy is the input, unchanged."""
        return self.total_norm == 0.0

    def to_json(self) -> dict[str, Any]:
        data = as_dict(self)
        data["clipped"] = self.clipped
        data["all_zero"] = self.all_zero
        return dict(data)


@dataclass(frozen=True)
class ParamZerosRow:
    name: str
    num_zeros: int
    num_elements: int
    padding_excluded: int
    sparsity: float


@dataclass(frozen=True)
class ExpertZerosRow:
    """One expert's zeros (``--by expert``), or a summary row's (``layer``, ``expert`` null)."""

    name: str
    layer: str | None
    expert: int | None
    num_zeros: int
    num_elements: int
    padding_excluded: int
    sparsity: float
    params: int


@dataclass(frozen=True)
class ZerosReport:
    snapshot: SnapshotInfo
    num_zeros: int
    num_elements: int
    padding_excluded: int
    sparsity: float
    params: tuple[ParamZerosRow, ...]
    sort: str = "zeros"  # the order of ``params``: one of ZEROS_ORDERS
    params_left_out: int = 0  # rows cut by ``top``
    # Per expert (``--by expert``), in ``sort`` order; None unless asked (absent from the JSON).
    by_expert: tuple[ExpertZerosRow, ...] | None = None
    experts_left_out: int = 0  # expert rows cut by ``top``

    @property
    def all_zero(self) -> bool:
        """Every counted gradient element is zero (or none was counted)."""
        return self.num_zeros == self.num_elements

    def to_json(self) -> dict[str, Any]:
        data = as_dict(self)
        data["all_zero"] = self.all_zero
        _drop_unasked(data)
        return dict(data)


def _sparsity(zeros: int, elements: int) -> float:
    return zeros / elements if elements else 0.0


# How ``gradstat zeros`` orders its parameters: most zeros first, highest sparsity first, or
# the snapshot's own (module) order. Ties keep the module order.
ZEROS_ORDERS = ("zeros", "sparsity", "module")


def zeros_report(
    snapshot: Snapshot | SnapshotShare,
    stats: SnapshotStats,
    sort: str = "zeros",
    top: int | None = None,
    by_expert: bool = False,
) -> ZerosReport:
    """num_zeros as Megatron counts it (GTP padding excluded), and per parameter.

    Args:
        sort: one of ``ZEROS_ORDERS``.
        top: keep the first ``top`` parameters in that order; None keeps every one.
        by_expert: also each expert's zeros, in the same order (``module``: the experts'
            order, then the summary rows), cut by ``top`` too.
    """
    if sort not in ZEROS_ORDERS:
        raise ValueError(f"sort must be one of {', '.join(ZEROS_ORDERS)}, got {sort!r}")
    rows = [
        ParamZerosRow(
            name=param.name,
            num_zeros=param.zeros,
            num_elements=param.numel,
            padding_excluded=param.pad_zeros,
            sparsity=_sparsity(param.zeros, param.numel),
        )
        for param in stats.params
    ]
    _sort_zeros(rows, sort)
    experts = None
    if by_expert:
        experts = [
            ExpertZerosRow(
                name=row.label,
                layer=row.module,
                expert=row.index,
                num_zeros=row.zeros,
                num_elements=row.numel,
                padding_excluded=row.pad_zeros,
                sparsity=_sparsity(row.zeros, row.numel),
                params=len(row.params),
            )
            for row in _expert_rows(stats)
        ]
        _sort_zeros(experts, sort)
    return ZerosReport(
        snapshot=snapshot_info(snapshot),
        num_zeros=stats.zeros,
        num_elements=stats.numel,
        padding_excluded=stats.pad_zeros,
        sparsity=_sparsity(stats.zeros, stats.numel),
        params=tuple(rows if top is None else rows[:top]),
        sort=sort,
        params_left_out=0 if top is None else max(len(rows) - top, 0),
        by_expert=None if experts is None else tuple(experts if top is None else experts[:top]),
        experts_left_out=0 if experts is None or top is None else max(len(experts) - top, 0),
    )


def _sort_zeros(rows: list[ParamZerosRow] | list[ExpertZerosRow], sort: str) -> None:
    """In ``sort`` order, in place; ties (and ``module``) keep the given order."""
    if sort == "zeros":
        rows.sort(key=lambda row: -row.num_zeros)
    elif sort == "sparsity":
        rows.sort(key=lambda row: -row.sparsity)


@dataclass(frozen=True)
class FileRow:
    rank: int
    path: str
    bytes: int


@dataclass(frozen=True)
class ParamInspectRow:
    name: str
    dtype: str
    local_shape: tuple[int, ...]
    ranks: int
    kind: str  # "tensor-parallel", "replicated", "fragment", "fsdp shard", "dtensor"
    tensor_parallel: bool
    partition_dim: int
    shared: bool
    expert: bool
    gtp_pad_length: int
    no_grad: bool
    placements: str | None = None  # a DTensor's, with its mesh dimension names
    # A Megatron wgrads dump's: what decided its attributes (a name rule, the shapes, an
    # option), and the file:chunk/local name of each tensor it was read from.
    rule: str | None = None
    sources: tuple[str, ...] = ()


@dataclass(frozen=True)
class InspectReport:
    snapshot: SnapshotInfo
    format_version: int
    axes: dict[str, int]
    files: tuple[FileRow, ...]
    params: tuple[ParamInspectRow, ...]
    notes: tuple[str, ...] = ()  # where the placements overrule the coordinates

    def to_json(self) -> dict[str, Any]:
        return dict(as_dict(self))


def inspect_report(snapshot: Snapshot) -> InspectReport:
    """What gradstat rebuilt from the headers alone (no gradient is read)."""
    rows: dict[str, ParamInspectRow] = {}
    holders: dict[str, int] = {}
    sources: dict[str, list[str]] = {}
    origin = _source(snapshot)
    for rank_file in snapshot.files:
        for record in rank_file.header.params:
            holders[record.name] = holders.get(record.name, 0) + 1
            source = rank_file.source(record.name)
            if source is not None:
                where = f"{rank_file.path.name}:{source.chunk}/{source.local_name}"
                sources.setdefault(record.name, []).append(where)
            known = rows.get(record.name)
            # The first record with a gradient describes the parameter: a replica may hold
            # the gradient its rank 0 copy lacks (it is counted there).
            if known is not None and (not known.no_grad or not record.has_grad):
                continue
            placements = None
            if origin == "dcp":
                kind = "checkpoint chunk"
            elif record.dtensor is not None:
                kind = "dtensor"
                placements = _placements_label(record.dtensor)
            elif record.attr("fsdp_param"):
                kind = "fsdp shard"
            elif rank_file.header.distributed_optimizer:
                kind = "fragment"
            elif record.attr("tensor_model_parallel"):
                kind = "tensor-parallel"
            else:
                kind = "replicated"
            rows[record.name] = ParamInspectRow(
                name=record.name,
                dtype=record.dtype or "-",
                local_shape=record.shape,
                ranks=0,
                kind=kind,
                tensor_parallel=bool(record.attr("tensor_model_parallel")),
                partition_dim=int(record.attr("partition_dim")),
                shared=bool(record.attr("shared")),
                expert=record.expert,
                gtp_pad_length=int(record.attr("pad_length"))
                if record.attr("is_gtp_weight_remat")
                else 0,
                no_grad=not record.has_grad,
                placements=placements,
                rule=None if source is None else source.rule,
            )
    params = tuple(
        replace(row, ranks=holders[name], sources=tuple(sources.get(name, ())))
        for name, row in rows.items()
    )
    files = tuple(FileRow(file.rank, str(file.path), file.size_bytes) for file in snapshot.files)
    first = snapshot.files[0].header
    return InspectReport(
        snapshot=snapshot_info(snapshot),
        format_version=first.version,
        axes=snapshot.axis_sizes,
        files=files,
        params=params,
        # A checkpoint's coordinates and chunk placements are gradstat's own: nothing to weigh.
        notes=_checkpoint_notes(snapshot) or _placement_notes(snapshot),
    )


def _placements_label(dtensor: MeshPlacement) -> str:
    """``S(0) on dp_shard, R on tp``, and the root mesh's copies (``copy over tp``)."""
    dims = [f"{code} on {dtensor.dim_name(dim)}" for dim, code in enumerate(dtensor.placements)]
    dims += [f"copy over {name}" for name, _, _ in dtensor.copies]
    return ", ".join(dims)


def _checkpoint_notes(snapshot: Snapshot) -> tuple[str, ...]:
    """What a DCP checkpoint holds besides the kind read (``inspect`` says it plainly)."""
    from gradstat.snapshot.checkpoint import CheckpointFile, kind_said

    first = snapshot.files[0]
    if not isinstance(first, CheckpointFile):
        return ()
    held = ", ".join(f"{kind_said(kind)} ({count})" for kind, count in first.holds)
    objects = f"; and {first.bytes_entries} non-tensor entries (never read)"
    notes = [
        f"the checkpoint holds {held}{objects if first.bytes_entries else ''}; read: "
        f"{kind_said(first.kind)} (--kind grad|weight|exp_avg|exp_avg_sq|all)"
    ]
    if first.left_out:
        shown = ", ".join(first.left_out[:3]) + (", ..." if len(first.left_out) > 3 else "")
        notes.append(
            f"{len(first.left_out)} tensors of that kind not read (step counters, or buffers "
            f"of a type gradstat does not read): {shown}"
        )
    return tuple(notes)


def _placement_notes(snapshot: Snapshot) -> tuple[str, ...]:
    """Where the coordinates say one thing and the DTensor placements another: they win."""
    notes = []
    first = snapshot.files[0].header
    dtensors = {
        record.name
        for file in snapshot.files
        for record in file.header.params
        if record.dtensor is not None and record.has_grad
    }
    if not dtensors:
        return ()
    dp_size = first.coords["dp"][1]
    # A Shard over a mesh dimension of size 1 leaves the whole tensor on each rank: no shard.
    sharded = {
        record.name
        for file in snapshot.files
        for record in file.header.params
        if record.dtensor is not None
        and any(
            code.startswith("S") and record.dtensor.mesh_shape[dim] > 1
            for dim, code in enumerate(record.dtensor.placements)
        )
    }
    if dp_size > 1 and not first.distributed_optimizer and sharded:
        notes.append(
            f"the coordinates say data-parallel replicas (dp size {dp_size}), but "
            f"{_count(len(sharded), 'DTensor gradient')} {_are(len(sharded))} sharded by "
            "their placements: every DTensor counts by its placements, not by the dp "
            "coordinate"
        )
    tp_size = first.coords["tp"][1]
    if tp_size > 1:
        notes.append(
            f"{_count(len(dtensors), 'DTensor gradient')} count"
            f"{'s' if len(dtensors) == 1 else ''} by "
            f"{'its' if len(dtensors) == 1 else 'their'} placements, not by the tp coordinate "
            f"(tp size {tp_size})"
        )
    return tuple(notes)


# --- compare and audit ---------------------------------------------------------------------


@dataclass(frozen=True)
class ParamDiff:
    """One logical parameter in both snapshots (None where a side lacks it)."""

    name: str
    norm_a: float | None
    norm_b: float | None
    rel_diff: float | None
    ratio: float | None  # norm_b / norm_a: how many times A's norm B's is (rel_diff saturates)
    zeros_a: int | None
    zeros_b: int | None
    num_elements_a: int | None
    num_elements_b: int | None
    shape_a: tuple[int, ...] | None  # the full shape, where the side could be rebuilt
    shape_b: tuple[int, ...] | None
    max_abs_diff: float | None  # largest elementwise |a - b|, where both were rebuilt
    rel_max_diff: float | None  # max_abs_diff relative to the largest |element| of both
    not_rebuilt: str | None  # why there is no elementwise difference
    flags: tuple[str, ...]
    diff_norm: float | None = None  # ||a - b||_2, where both were rebuilt (the update)
    rel_diff_norm: float | None = None  # diff_norm / norm_a (None where norm_a is 0)


@dataclass(frozen=True)
class TotalDiff:
    """A whole-model figure in both snapshots."""

    measure: str
    a: float | int  # counts are ints
    b: float | int
    rel_diff: float
    flagged: bool
    ratio: float = 1.0  # b / a


@dataclass(frozen=True)
class CompareReport:
    a: SnapshotInfo
    b: SnapshotInfo
    rtol: float
    totals: tuple[TotalDiff, ...]
    params: tuple[ParamDiff, ...]
    mismatches: tuple[str, ...]  # the flagged parameters, in module order
    has_experts: bool = False  # either side counts an expert parameter
    # A and B are two checkpoints' weights: params come largest update (diff_norm) first, and
    # what is flagged is a parameter that did not change, not one that did.
    updates: bool = False

    @property
    def flagged(self) -> bool:
        return bool(self.mismatches) or any(total.flagged for total in self.totals)

    def to_json(self) -> dict[str, Any]:
        data = as_dict(self)
        data["flagged"] = self.flagged
        return dict(data)


@dataclass(frozen=True)
class Finding:
    """One broken promise: which parameter, which ranks, how large, what it does to the norm."""

    kind: str
    name: str
    ranks: tuple[int, ...]
    detail: str
    max_abs_diff: float | None  # the largest elementwise difference (from zero for padding)
    rel_diff: float | None  # max_abs_diff relative to the largest |element| compared
    norm_if_miscounted: float | None  # the global L2 norm, counted the other way
    norm_change: float | None  # norm_if_miscounted / total_norm - 1


@dataclass(frozen=True)
class AuditReport:
    snapshot: SnapshotInfo
    rtol: float
    total_norm: float
    params_checked: int
    findings: tuple[Finding, ...]

    def to_json(self) -> dict[str, Any]:
        return dict(as_dict(self))

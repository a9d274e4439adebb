"""History of one run: the total norm and per-parameter statistics over steps, and the step
where each parameter first jumped, ordered by who moved first.

Two sources, one result:

- the flight recorder's telemetry log (``telemetry.gslog`` in the run directory,
  :mod:`gradstat.recorder.log`): every recorded step's norm, the norm the job logged, the
  triggers, and the per-parameter L2 norm, max |x|, zero, NaN and Inf counts. A step a resumed
  run replayed keeps its latest record (the run as it went on). The totals are of one norm
  type, never mixed: the one asked for, else that of the latest attempt that recorded a step
  in the range; the steps an attempt of a resumed run recorded with another norm type (and
  no attempt with this one) are left out, one line naming them and the ``norm_type`` that
  reads them. Every complete snapshot of the directory is listed with the record that took
  it, an earlier attempt's too (the record names it: its step and repeat index), so a replay
  never hides the snapshot a killed run took; one whose record was lost (the job killed
  between the two) or holds another norm type is read for its own numbers, so a log with no
  step in the range still lists its snapshots there. A snapshot that does not open (a rank
  file cut short or missing) is skipped with one line. Torn or damaged records are skipped,
  one line each, and so are the per-parameter statistics that the damage may have parted
  from their layout record (their totals kept; :mod:`gradstat.recorder.log`).
- the snapshots under a directory (the flight recorder's ``step-N``, a Megatron ``wgrads/``
  folder, or any other), read one at a time in step order, each once, each its own row (a
  step the flight recorder replayed has a row per snapshot); hidden ones (``.step-*.partial``:
  being written, or left by a lost rank) are skipped.

A parameter jumps at the first step where its norm is non-finite (or it holds a NaN or Inf),
or more than ``factor`` times the median of its previous ``window`` finite norms, or its zero
count moved away from its baseline (the median of its previous ``window`` counts) by more than
``zeros_change`` of its elements and to at least twice or at most half the baseline. A high
count alone is no jump: an embedding's rows that no token of a batch used are zeros in every
step, more or fewer with each batch. The parameters that jumped are ordered by their first
jump's step: the one that led comes first, not the biggest.
"""

from __future__ import annotations

import math
import os
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from gradstat.analysis import coverage
from gradstat.analysis.report import json_number, recorded_differs, snapshot_info
from gradstat.analysis.stats import SnapshotStats, snapshot_stats
from gradstat.errors import SnapshotError
from gradstat.snapshot.format import recorded_norm
from gradstat.snapshot.reader import Snapshot, holds_rank_files

if TYPE_CHECKING:
    from gradstat.recorder.log import StartRecord
    from gradstat.snapshot.wgrads import WgradsOptions

__all__ = [
    "JUMP_KINDS",
    "SOURCES",
    "History",
    "KeptSnapshot",
    "ParamSeries",
    "find_snapshots",
    "read_history",
]

# The kinds of a first jump, the most telling first: how jumps of one step are ordered.
JUMP_KINDS = ("nonfinite", "norm", "zeros")
SOURCES = ("auto", "log", "snapshots")
_PROGRESS_BYTES = 1 << 20  # how often reading a log reports its progress
_MIN_BASELINE = 3  # earlier finite values a median needs before a norm or zero jump counts


def find_snapshots(root: Path) -> list[Path]:
    """The snapshot directories under ``root`` (not hidden, holding rank files), by name."""
    if not root.is_dir():
        raise SnapshotError(f"{root}: no such directory")
    found = [
        path
        for path in sorted(root.iterdir())
        if path.is_dir() and not path.name.startswith(".") and holds_rank_files(path)
    ]
    if not found:
        hint = ""
        if holds_rank_files(root):
            hint = f": it is one snapshot; pass the directory that holds it ({root.parent})"
        raise SnapshotError(
            f"{root}: no snapshot directories (with *.safetensors, a Megatron wgrads dump's "
            f"mp_rank_*.pth, or a DCP checkpoint's .metadata) inside, and no telemetry log{hint}"
        )
    return found


@dataclass
class ParamSeries:
    """One parameter over the steps where it had a gradient: its norm and zero count, and
    from the log its max |x| and NaN and Inf counts."""

    name: str
    numel: int
    expert: bool = False
    steps: list[int] = field(default_factory=list)
    norms: list[float] = field(default_factory=list)
    zeros: list[int] = field(default_factory=list)
    max_abs: list[float] | None = None  # None: a snapshot history (not computed)
    nan: list[int] = field(default_factory=list)
    inf: list[int] = field(default_factory=list)
    jump_step: int | None = None
    jump_kind: str | None = None  # one of JUMP_KINDS
    jump_ratio: float | None = None  # a norm jump: the norm over its baseline

    @property
    def went_nonfinite(self) -> bool:
        """Whether a NaN or an Inf reached it at some step (its first jump may be another)."""
        finite = all(math.isfinite(norm) for norm in self.norms if norm is not None)
        return any(self.nan) or any(self.inf) or not finite

    def add(
        self,
        step: int,
        norm: float,
        zeros: int,
        max_abs: float | None = None,
        nan: int = 0,
        inf: int = 0,
    ) -> None:
        self.steps.append(step)
        self.norms.append(norm)
        self.zeros.append(zeros)
        if max_abs is not None:
            if self.max_abs is None:
                self.max_abs = [math.nan] * (len(self.steps) - 1)
            self.max_abs.append(max_abs)
        self.nan.append(nan)
        self.inf.append(inf)

    def peak(self) -> float:
        return max((norm for norm in self.norms if math.isfinite(norm)), default=0.0)


@dataclass(frozen=True)
class KeptSnapshot:
    """A complete snapshot of the run, with the total norm, zero count and triggers of the step
    that took it (from a log: the record that named it, which may be an earlier attempt's)."""

    path: Path
    step: int
    total_norm: float
    num_zeros: int | None  # None: a log record without per-parameter statistics
    triggers: tuple[str, ...]
    # Read from a snapshot: the flight recorder's norm of its step, noted beside it (None:
    # none, or of another norm type).
    recorded_norm: float | None = None

    @property
    def recorder_differs(self) -> bool:
        """The flight recorder's norm of the step is not what the snapshot counts (a NaN, Inf
        or spike on a copy it does not count; ``gradstat audit`` names it)."""
        return recorded_differs(self.recorded_norm, self.total_norm)


@dataclass
class History:
    """The run's steps (each with its total norm, zero count, logged norm, triggers and
    snapshot), every complete snapshot, and every parameter's series, in step order."""

    norm_type: float
    source: str = "snapshots"  # "log" or "snapshots"
    root: Path | None = None  # the directory read
    steps: list[int] = field(default_factory=list)
    totals: list[float] = field(default_factory=list)
    total_zeros: list[int | None] = field(default_factory=list)
    logged: list[float | None] = field(default_factory=list)
    triggers: list[tuple[str, ...]] = field(default_factory=list)  # what took each snapshot
    # Each step's snapshot, if kept: the one its record took, else its latest on disk.
    paths: list[Path | None] = field(default_factory=list)
    # Every complete snapshot that opens, in step order (a replayed step's in the order
    # written): a step may have several, from the attempts that ran it, and one may have no
    # row (its record lost, or of another norm type).
    snapshots: list[KeptSnapshot] = field(default_factory=list)
    params: dict[str, ParamSeries] = field(default_factory=dict)
    param_norm_type: float = 2.0  # the per-parameter norms' (the log's are L2)
    problems: list[str] = field(default_factory=list)  # lines about what was skipped

    def jumped(self) -> list[ParamSeries]:
        """The parameters that jumped, the one that moved first first; at one step the most
        telling kind first (non-finite, then norm, then zero count), then the larger jump."""
        found = [series for series in self.params.values() if series.jump_step is not None]
        return sorted(
            found,
            key=lambda series: (
                series.jump_step,
                JUMP_KINDS.index(series.jump_kind or "zeros"),
                -(series.jump_ratio or 0.0),
            ),
        )

    def snapshot_rows(self) -> list[int]:
        """The indices of the steps that have a snapshot (one each: ``snapshots`` lists them
        all)."""
        return [index for index, path in enumerate(self.paths) if path is not None]

    def to_json(self) -> dict[str, Any]:
        return {
            "source": self.source,
            "norm_type": json_number(self.norm_type),
            "param_norm_type": json_number(self.param_norm_type),
            "steps": self.steps,
            "total_norm": [json_number(value) for value in self.totals],
            "num_zeros": self.total_zeros,
            "logged_norm": [None if value is None else json_number(value) for value in self.logged],
            "triggers": [list(triggers) for triggers in self.triggers],
            "snapshots": [
                {
                    "path": str(kept.path),
                    "step": kept.step,
                    "total_norm": json_number(kept.total_norm),
                    "num_zeros": kept.num_zeros,
                    "triggers": list(kept.triggers),
                    "recorder_differs": kept.recorder_differs,
                }
                for kept in self.snapshots
            ],
            "params": [_series_json(series) for series in self.params.values()],
            "problems": self.problems,
        }


def _series_json(series: ParamSeries) -> dict[str, Any]:
    jump: dict[str, Any] | None = None
    if series.jump_step is not None:
        jump = {"step": series.jump_step, "kind": series.jump_kind}
        if series.jump_ratio is not None:
            jump["ratio"] = json_number(series.jump_ratio)
    return {
        "name": series.name,
        "num_elements": series.numel,
        "expert": series.expert,
        "steps": series.steps,
        "norms": [json_number(norm) for norm in series.norms],
        "num_zeros": series.zeros,
        "max_abs": None
        if series.max_abs is None
        else [json_number(value) for value in series.max_abs],
        "num_nan": series.nan,
        "num_inf": series.inf,
        "first_jump": jump,
    }


# The flight recorder's names: step-N, and step-N.1, step-N.2, ... for a step replayed.
_RECORDER_NAME = re.compile(r"^step-(\d+)(?:\.(\d+))?$")


def _repeat_of(path: Path, step: int) -> int | None:
    """Which of a replayed step's snapshots ``path`` is (0, 1, ...) when the flight recorder
    named it for ``step``; None for any other name."""
    match = _RECORDER_NAME.match(path.name)
    if match is None or int(match.group(1)) != step:
        return None
    return int(match.group(2) or 0)


def _step_of(snapshot: Snapshot, index: int) -> int:
    step = snapshot.files[0].header.step
    return index if step is None else step


def _within(step: int, since: int | None, until: int | None) -> bool:
    return (since is None or step >= since) and (until is None or step <= until)


def read_history(
    root: Path,
    norm_type: float | None = None,
    *,
    factor: float = 10.0,
    window: int = 50,
    zeros_change: float = 0.1,
    since: int | None = None,
    until: int | None = None,
    source: str = "auto",
    on_progress: Callable[[int, int, str], None] | None = None,
    report: Callable[[str], None] | None = None,
    options: WgradsOptions | None = None,
) -> History:
    """Read a run's history: its telemetry log when it has one (``source="auto"``), else its
    snapshots; then find each parameter's first jump.

    Args:
        root: the run directory (the flight recorder's), or any directory of snapshots; a
            Megatron job's ``wgrads/`` folder (its ``iter_*`` dumps read with ``options``).
        norm_type: the norm of the snapshots' statistics (None: 2); a log holds its own (the
            recorder's for the total, L2 per parameter): this one picks the steps of the
            attempts that recorded it (None: the latest attempt's), and refuses one that none
            recorded.
        factor, window, zeros_change: what makes a jump (the module's docstring).
        since, until: only the steps from ``since`` to ``until`` (inclusive).
        source: "auto", "log" or "snapshots".
        on_progress: called with (done, total, unit): "bytes" of the log, or "snapshots".
        report: called with one line per skipped log record (a torn tail, damage) or
            unreadable snapshot (the others are read).

    Raises:
        SnapshotError: no log and no snapshots, no snapshot readable (the first named), two
            snapshots of the same step (but a step the flight recorder replayed: ``step-N``,
            then ``step-N.1``, ...), a log asked for and absent, a log with neither a step nor
            a snapshot in the range, a log that is no regular file (not taken for none), a log
            none of whose records can be read (with ``auto``, saying that ``--source
            snapshots`` reads the snapshots alone).
    """
    from gradstat.recorder.log import LOG_NAME, UnreadableLog

    if source not in SOURCES:
        raise ValueError(f"source must be one of {', '.join(SOURCES)}, got {source!r}")
    log = root / LOG_NAME
    if source != "snapshots" and os.path.lexists(log) and not log.is_file():
        # Not read as no log (its steps would be lost without a word); asked for the
        # snapshots alone, the log is not read at all.
        what = "a directory" if log.is_dir() else "not a regular file (a dangling link?)"
        raise SnapshotError(f"{log}: is {what}, not the telemetry log")
    if source == "log" or (source == "auto" and log.is_file()):
        if not log.is_file():
            raise SnapshotError(f"{root}: no telemetry log ({LOG_NAME}) inside")
        try:
            history = _from_log(root, log, norm_type, since, until, on_progress, report)
        except UnreadableLog as error:
            if source == "log" or not any(root.glob("step-*")):
                raise
            raise SnapshotError(f"{error}; --source snapshots reads the snapshots alone") from error
    else:
        history = _from_snapshots(
            root, norm_type or 2.0, since, until, on_progress, _Problems(report), options
        )
    history.root = root
    for series in history.params.values():
        _find_jump(series, factor, window, zeros_change)
    return history


class _Problems:
    """The lines about what a history skipped, each reported as it is met."""

    def __init__(self, report: Callable[[str], None] | None) -> None:
        self.lines: list[str] = []
        self._report = report

    def __call__(self, line: str) -> None:
        self.lines.append(line)
        if self._report is not None:
            self._report(line)


def _from_snapshots(
    root: Path,
    norm_type: float,
    since: int | None,
    until: int | None,
    on_progress: Callable[[int, int, str], None] | None,
    skipped: _Problems,
    options: WgradsOptions | None,
) -> History:
    opened, unreadable = [], []
    for index, path in enumerate(find_snapshots(root)):
        try:
            snapshot = Snapshot.open(path, options)
        except SnapshotError as error:  # one bad snapshot does not hide the run's others
            unreadable.append(error)
            skipped(f"{path}: skipped, unreadable: {error}")
            continue
        opened.append((_step_of(snapshot, index), path, snapshot))
    if unreadable and not opened:
        raise unreadable[0]
    _check_one_kind(opened)
    opened.sort(key=lambda entry: (entry[0], _repeat_of(entry[1], entry[0]) or 0, entry[1].name))
    for (step, path, _), (other, earlier, _) in zip(opened[1:], opened, strict=False):
        replayed = _repeat_of(path, step) is not None and _repeat_of(earlier, step) is not None
        if step == other and not replayed:
            raise SnapshotError(f"{path}: step {step} is also the step of {earlier}")
    chosen = [entry for entry in opened if _within(entry[0], since, until)]
    if not chosen:
        raise SnapshotError(f"{root}: no snapshot{_span(since, until)}")
    history = History(norm_type, "snapshots", param_norm_type=norm_type, problems=skipped.lines)
    for done, (step, path, snapshot) in enumerate(chosen, 1):
        try:
            kept = _add_snapshot(history, step, path, snapshot, norm_type)
        except SnapshotError as error:  # changed since it was opened: cut, rewritten
            skipped(f"{path}: skipped, unreadable: {error}")
            continue
        if kept.recorder_differs:
            skipped(
                f"{path}: the recorder's norm of step {step} was {kept.recorded_norm:.9g}, the "
                f"snapshot counts {kept.total_norm:.9g}: a copy it does not count holds another "
                "value (gradstat audit names it)"
            )
        if on_progress is not None:
            on_progress(done, len(chosen), "snapshots")
    if not history.steps:
        raise SnapshotError(f"{root}: none of its {len(chosen)} snapshots could be read")
    return history


def _check_one_kind(opened: Sequence[tuple[int, Path, Snapshot]]) -> None:
    """Refuse a series of two kinds of tensor (gradient snapshots beside a checkpoint's
    weights): its norms would jump between kinds, not steps."""
    from gradstat.snapshot.checkpoint import kind_said

    _, first_path, first = opened[0]
    expected = snapshot_info(first).tensor_kind
    for _, path, snapshot in opened[1:]:
        kind = snapshot_info(snapshot).tensor_kind
        if kind != expected:
            raise SnapshotError(
                f"{path}: holds {kind_said(kind)}, {first_path} {kind_said(expected)}: a "
                "history follows one kind of tensor (keep each kind in a directory of its own; "
                "--kind chooses a checkpoint's)"
            )


def _read_kept(
    path: Path, step: int, snapshot: Snapshot, norm_type: float
) -> tuple[KeptSnapshot, SnapshotStats]:
    """A snapshot read for its own numbers, and whether they are the recorder's of its step."""
    stats = snapshot_stats(snapshot, (norm_type,))
    coverage.check(path, stats.miscounts)
    triggers = snapshot.files[0].header.triggers
    total = stats.norm(norm_type)
    recorded = recorded_norm(path, norm_type)
    kept = KeptSnapshot(path, step, total, stats.zeros, triggers, recorded)
    return kept, stats


def _add_snapshot(
    history: History, step: int, path: Path, snapshot: Snapshot, norm_type: float
) -> KeptSnapshot:
    kept, stats = _read_kept(path, step, snapshot, norm_type)
    history.steps.append(step)
    history.paths.append(path)
    history.totals.append(kept.total_norm)
    history.total_zeros.append(kept.num_zeros)
    history.logged.append(None)
    history.triggers.append(kept.triggers)
    history.snapshots.append(kept)
    for param in stats.params:
        series = history.params.get(param.name)
        if series is None:
            series = history.params[param.name] = ParamSeries(param.name, param.numel, param.expert)
        nan = sum(found.nan for found in stats.nonfinite if found.name == param.name)
        inf = sum(found.inf for found in stats.nonfinite if found.name == param.name)
        series.add(step, param.norm(norm_type), param.zeros, nan=nan, inf=inf)
    return kept


def _from_log(
    root: Path,
    log: Path,
    norm_type: float | None,
    since: int | None,
    until: int | None,
    on_progress: Callable[[int, int, str], None] | None,
    report: Callable[[str], None] | None,
) -> History:
    from gradstat.recorder.log import read_log

    problems = _Problems(report)
    starts: list[StartRecord] = []
    # norm type: step: that step's latest record of that norm type (a replay's last one wins).
    latest: dict[float, dict[int, Any]] = {}
    # step: the norm type of its latest record, any attempt's (the step as the run went on).
    newest_of: dict[int, float] = {}
    # (step, repeat): the norm type and what the latest record that took that snapshot says of
    # its step. Any attempt's: a replay without a trigger must not hide a killed run's snapshot.
    took: dict[tuple[int, int], tuple[float, float, int | None, tuple[str, ...]]] = {}
    newest_in_range = newest = None  # the norm type of the latest record (in the range)
    size, told = log.stat().st_size, 0
    for start, record in read_log(log, problems, starts.append):
        newest = start.norm_type
        if _within(record.step, since, until):
            newest_in_range = start.norm_type
            latest.setdefault(start.norm_type, {})[record.step] = record
            newest_of[record.step] = start.norm_type
            if record.repeat >= 0:
                took[record.step, record.repeat] = (
                    start.norm_type,
                    record.norm,
                    _total_zeros(record),
                    _trigger_names(record.triggers),
                )
        if on_progress is not None and record.end_offset - told >= _PROGRESS_BYTES:
            told = record.end_offset
            on_progress(told, size, "bytes")
    if on_progress is not None:
        on_progress(size, size, "bytes")
    recorded = sorted({start.norm_type for start in starts})
    if norm_type is not None and norm_type not in recorded:
        logged = " and ".join(_p(value) for value in recorded)
        raise SnapshotError(
            f"{log}: the recorder logged the {logged} norm (and L2 per parameter); "
            f"-p {_p(norm_type)} needs the snapshots: --source snapshots"
        )
    asked = norm_type is not None
    if norm_type is None:  # the latest attempt's: the run as it went on
        norm_type = next(
            value for value in (newest_in_range, newest, starts[-1].norm_type) if value is not None
        )
    # A step a later attempt replayed with another norm type is that attempt's: left out.
    chosen = {
        step: record
        for step, record in latest.get(norm_type, {}).items()
        if newest_of[step] == norm_type
    }
    _report_left_out(log, newest_of, norm_type, asked, problems)
    kept = _kept_snapshots(root, since, until, norm_type, took, problems)
    if not chosen and not kept:
        other = f" with the {_p(norm_type)} norm" if latest else ""
        raise SnapshotError(f"{log}: no step recorded{other}{_span(since, until)}")
    history = History(norm_type, "log", param_norm_type=2.0, problems=problems.lines)
    history.snapshots = kept
    by_step: dict[int, list[Path]] = {}
    for snapshot in kept:
        by_step.setdefault(snapshot.step, []).append(snapshot.path)
    for step in sorted(chosen):
        record = chosen[step]
        at_step = by_step.get(step, [])
        own = [path for path in at_step if _repeat_of(path, step) == record.repeat]
        # Else an earlier attempt's snapshot of the step, the latest written.
        path = own[0] if own else at_step[-1] if at_step else None
        history.steps.append(step)
        history.totals.append(record.norm)
        history.logged.append(record.logged)
        history.triggers.append(_trigger_names(record.triggers))
        history.paths.append(path)
        history.total_zeros.append(_add_params(history, record))
    return history


def _report_left_out(
    log: Path,
    newest_of: dict[int, float],
    norm_type: float,
    asked: bool,
    problems: _Problems,
) -> None:
    """One line for the steps whose latest attempt recorded them with another norm type than
    ``norm_type`` (an earlier attempt's record of the step, replaced, is not shown): a history
    never mixes the two."""
    left_out = sorted(step for step, other in newest_of.items() if other != norm_type)
    if not left_out:
        return
    others = sorted({other for other in newest_of.values() if other != norm_type})
    names = " and ".join(_p(other) for other in others)
    options = " or ".join(f"-p {_p(other)}" for other in others)
    why = "the one asked for" if asked else "the latest attempt's"
    problems(
        f"{log}: left out {_count_steps(left_out)}, recorded with the {names} norm by another "
        f"attempt: this history is of the {_p(norm_type)} norm ({why}); {options} reads them"
    )


def _kept_snapshots(
    root: Path,
    since: int | None,
    until: int | None,
    norm_type: float,
    took: dict[tuple[int, int], tuple[float, float, int | None, tuple[str, ...]]],
    problems: _Problems,
) -> list[KeptSnapshot]:
    """The run's complete snapshots from ``since`` to ``until`` that open, each with the
    numbers of the record that took it; read for its own numbers where that record was lost
    (the job killed between the two) or holds another norm type. An unreadable one (a rank
    file cut short or missing) is skipped with one line."""
    kept = []
    for step, repeat, path in _recorder_snapshots(root, since, until):
        try:
            snapshot = Snapshot.open(path)
            record = took.get((step, repeat))
            if record is not None and record[0] == norm_type:
                kept.append(KeptSnapshot(path, step, *record[1:]))
                continue
            kept.append(_read_kept(path, step, snapshot, norm_type)[0])
        except SnapshotError as error:
            problems(f"{path}: skipped, unreadable: {error}")
    return kept


def _count_steps(steps: list[int]) -> str:
    if len(steps) == 1:
        return f"step {steps[0]}"
    return f"{len(steps)} steps ({steps[0]} .. {steps[-1]})"


def _span(since: int | None, until: int | None) -> str:
    """`` from step 5 to 9``, `` from step 5 on``, `` up to step 9``, or nothing."""
    if since is not None and until is not None:
        return f" from step {since} to {until}"
    if since is not None:
        return f" from step {since} on"
    return "" if until is None else f" up to step {until}"


def _recorder_snapshots(
    root: Path, since: int | None, until: int | None
) -> list[tuple[int, int, Path]]:
    """The flight recorder's complete snapshots from ``since`` to ``until`` as (step, repeat
    index, path), in step order, a replayed step's in the order written (hidden ``.partial``
    ones are not complete)."""
    from gradstat.recorder.snapshots import complete_snapshots

    return [
        (step, _repeat_of(path, step) or 0, path)
        for step, path in complete_snapshots(root)
        if _within(step, since, until)
    ]


def _trigger_names(bits: int) -> tuple[str, ...]:
    from gradstat.recorder.triggers import TRIGGERS

    return tuple(name for bit, name in enumerate(TRIGGERS) if bits >> bit & 1)


def _total_zeros(record: Any) -> int | None:
    """A log record's zero count over the parameters with a gradient (None: none held)."""
    if record.norms is None:
        return None
    total: int = sum(
        zeros for norm, zeros in zip(record.norms, record.zeros, strict=True) if norm >= 0
    )
    return total


def _add_params(history: History, record: Any) -> int | None:
    """Add a log record's per-parameter statistics; its total zero count (None: none held)."""
    if record.norms is None:
        return None
    for index, name in enumerate(record.names):
        norm = record.norms[index]
        if norm < 0:
            continue  # no gradient at this step
        series = history.params.get(name)
        if series is None:
            series = history.params[name] = ParamSeries(name, 0, record.expert[index])
        nan, inf = record.nan.get(index, 0), record.inf.get(index, 0)
        series.numel = max(series.numel, record.numel[index] if record.numel else 0)
        series.add(record.step, norm, record.zeros[index], record.max_abs[index], nan, inf)
    return _total_zeros(record)


def _p(norm_type: float) -> str:
    return "inf" if norm_type == math.inf else f"{norm_type:g}"


def _rolling_median(values: torch.Tensor, window: int) -> tuple[torch.Tensor, torch.Tensor]:
    """For each position, the median of the previous ``window`` non-NaN values and how many
    there were (NaN and 0 at the start)."""
    padded = torch.cat([torch.full((window,), math.nan, dtype=values.dtype), values[:-1]])
    windows = padded.unfold(0, window, 1)  # windows[i]: values[i - window : i]
    finite = (~windows.isnan()).sum(dim=1)
    return windows.nanmedian(dim=1).values, finite


def _find_jump(series: ParamSeries, factor: float, window: int, zeros_change: float) -> None:
    """Set the series' first jump (module's docstring)."""
    if not series.steps:
        return
    norms = torch.tensor(series.norms, dtype=torch.float64)
    bad = ~torch.isfinite(norms) | (torch.tensor(series.nan) > 0) | (torch.tensor(series.inf) > 0)
    baseline, count = _rolling_median(torch.where(bad, math.nan, norms), window)
    enough = count >= _MIN_BASELINE
    above = enough & ~bad & (norms > factor * baseline)
    zeros = torch.tensor(series.zeros, dtype=torch.float64)
    zero_base, zero_count = _rolling_median(zeros, window)
    moved = (zeros - zero_base).abs() > zeros_change * max(series.numel, 1)
    doubled = (zeros >= 2 * zero_base) | (2 * zeros <= zero_base)
    shifted = (zero_count >= _MIN_BASELINE) & moved & doubled
    kinds = (("nonfinite", bad), ("norm", above), ("zeros", shifted))
    first = [(int(mask.nonzero()[0]), kind) for kind, mask in kinds if bool(mask.any())]
    if not first:
        return
    index, kind = min(first, key=lambda found: (found[0], JUMP_KINDS.index(found[1])))
    series.jump_step, series.jump_kind = series.steps[index], kind
    if kind == "norm":
        base = float(baseline[index])
        series.jump_ratio = float(norms[index]) / base if base > 0 else math.inf

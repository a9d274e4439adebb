"""History across the snapshots of one run: per-parameter norms and zero counts over steps, and
the step where each parameter first jumped.

The snapshots are the directories under a root that hold rank files (the flight recorder's
``step-N``, or any other); hidden ones (``.step-*.partial``, still being written or left by a
lost rank) are skipped. They are read one at a time, in step order, each once: what is kept is
a few numbers per parameter and snapshot.

A parameter jumps at the first snapshot where its norm is non-finite, or more than ``factor``
times the median of its earlier finite norms, or its zero count moved away from its baseline
(the median of its earlier counts) by more than ``zeros_change`` of its elements and to at
least twice or at most half the baseline. A high count alone is no jump: an embedding's rows
that no token of a batch used are zeros in every snapshot, more or fewer with each batch.
"""

from __future__ import annotations

import math
import re
import statistics
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from gradstat.analysis.report import json_number
from gradstat.analysis.stats import snapshot_stats
from gradstat.errors import SnapshotError
from gradstat.snapshot.reader import Snapshot, holds_rank_files

if TYPE_CHECKING:
    from gradstat.snapshot.wgrads import WgradsOptions

__all__ = [
    "JUMP_KINDS",
    "History",
    "ParamSeries",
    "find_snapshots",
    "read_history",
]


# The kinds of a first jump, the most telling first: how findings are ordered.
JUMP_KINDS = ("nonfinite", "norm", "zeros")


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
        raise SnapshotError(
            f"{root}: no snapshot directories (with *.safetensors, or a Megatron wgrads dump's "
            "mp_rank_*.pth) inside"
        )
    return found


@dataclass
class ParamSeries:
    """One parameter over the snapshots: its norm and zero count at each step."""

    name: str
    numel: int
    norms: list[float] = field(default_factory=list)
    zeros: list[int] = field(default_factory=list)
    jump_step: int | None = None
    jump_kind: str | None = None  # one of JUMP_KINDS


@dataclass
class History:
    """Steps, total norms and zero counts, and every parameter's series, in step order."""

    norm_type: float
    steps: list[int] = field(default_factory=list)
    paths: list[Path] = field(default_factory=list)
    totals: list[float] = field(default_factory=list)
    total_zeros: list[int] = field(default_factory=list)
    triggers: list[tuple[str, ...]] = field(default_factory=list)  # what took each snapshot
    params: dict[str, ParamSeries] = field(default_factory=dict)

    def jumped(self) -> list[ParamSeries]:
        """The parameters that jumped, the most telling kind first (non-finite, then norm,
        then zero count), each kind in step order: a real norm jump is never listed below a
        zero count's move."""
        found = [series for series in self.params.values() if series.jump_step is not None]
        return sorted(
            found,
            key=lambda series: (JUMP_KINDS.index(series.jump_kind or "zeros"), series.jump_step),
        )

    def to_json(self) -> dict[str, Any]:
        return {
            "norm_type": json_number(self.norm_type),
            "snapshots": [
                {
                    "path": str(path),
                    "step": step,
                    "total_norm": json_number(total),
                    "num_zeros": zeros,
                    "triggers": list(triggers),
                }
                for path, step, total, zeros, triggers in zip(
                    self.paths,
                    self.steps,
                    self.totals,
                    self.total_zeros,
                    self.triggers,
                    strict=True,
                )
            ],
            "params": [
                {
                    "name": series.name,
                    "num_elements": series.numel,
                    "norms": [json_number(norm) for norm in series.norms],
                    "num_zeros": series.zeros,
                    "first_jump": None
                    if series.jump_step is None
                    else {"step": series.jump_step, "kind": series.jump_kind},
                }
                for series in self.params.values()
            ],
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


def read_history(
    root: Path,
    norm_type: float = 2.0,
    *,
    factor: float = 10.0,
    zeros_change: float = 0.1,
    on_snapshot: Callable[[Path], None] | None = None,
    options: WgradsOptions | None = None,
) -> History:
    """Read every snapshot under ``root`` once, in step order, and find each parameter's jump.

    ``root`` may be a Megatron job's ``wgrads/`` folder: its ``iter_*`` dumps are read with
    ``options``, the iteration from each folder's name.

    Raises:
        SnapshotError: no snapshots, a bad snapshot (named), two snapshots of the same step
            (but a step the flight recorder replayed: ``step-N``, then ``step-N.1``, ...).
    """
    opened = []
    for index, path in enumerate(find_snapshots(root)):
        snapshot = Snapshot.open(path, options)
        opened.append((_step_of(snapshot, index), path, snapshot))
    opened.sort(key=lambda entry: (entry[0], _repeat_of(entry[1], entry[0]) or 0, entry[1].name))
    for (step, path, _), (other, earlier, _) in zip(opened[1:], opened, strict=False):
        replayed = _repeat_of(path, step) is not None and _repeat_of(earlier, step) is not None
        if step == other and not replayed:
            raise SnapshotError(f"{path}: step {step} is also the step of {earlier}")
    history = History(norm_type)
    for step, path, snapshot in opened:
        stats = snapshot_stats(snapshot, (norm_type,))
        history.steps.append(step)
        history.paths.append(path)
        history.totals.append(stats.norm(norm_type))
        history.total_zeros.append(stats.zeros)
        history.triggers.append(snapshot.files[0].header.triggers)
        for param in stats.params:
            series = history.params.setdefault(param.name, ParamSeries(param.name, param.numel))
            _extend(series, step, param.norm(norm_type), param.zeros, factor, zeros_change)
        if on_snapshot is not None:
            on_snapshot(path)
    return history


def _extend(
    series: ParamSeries, step: int, norm: float, zeros: int, factor: float, zeros_change: float
) -> None:
    if series.jump_step is None:
        kind = None
        earlier = [value for value in series.norms if math.isfinite(value)]
        if not math.isfinite(norm):
            kind = "nonfinite"
        elif earlier and norm > factor * statistics.median(earlier):
            kind = "norm"
        elif series.zeros and _zeros_moved(series.zeros, zeros, zeros_change * series.numel):
            kind = "zeros"
        if kind is not None:
            series.jump_step, series.jump_kind = step, kind
    series.norms.append(norm)
    series.zeros.append(zeros)


def _zeros_moved(earlier: list[int], zeros: int, elements: float) -> bool:
    """Whether ``zeros`` left the baseline of the ``earlier`` counts: by more than ``elements``
    and by a factor of two at least (a count that doubles or halves, or leaves zero)."""
    baseline = statistics.median(earlier)
    if abs(zeros - baseline) <= elements:
        return False
    return zeros >= 2 * baseline or 2 * zeros <= baseline

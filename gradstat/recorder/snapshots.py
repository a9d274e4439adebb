"""The recorder's snapshots: names, writing on a thread, and retention.

Each Recorder is an attempt, with an id rank 0 draws at construction. A snapshot is written into
``.step-N.<attempt>-<k>.partial/`` and renamed ``step-N`` by rank 0 once every rank file is
there; a step that already has one gets ``step-N.1``, ``step-N.2``, ... Routine snapshots
(``every``, ``step``) and those of each trigger (``nonfinite``, ``spike``, ``mismatch``) are kept
apart, the ``keep`` newest-written of each kind: a run of mismatches never pushes out the
snapshot of a NaN. A snapshot of several triggers stays while one of its kinds keeps it; one
whose triggers are unknown (no marker, no readable header: not the recorder's) is never removed.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import secrets
import shutil
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from gradstat.errors import SnapshotError
from gradstat.recorder.messages import warn
from gradstat.recorder.triggers import ROUTINE_TRIGGERS
from gradstat.snapshot.capture import dump_rank
from gradstat.snapshot.format import FILE_PATTERN, RECORDER_MARKER
from gradstat.snapshot.reader import open_rank_file

__all__ = ["Snapshots", "complete_snapshots", "snapshot_name"]

_ABANDONED = ".abandoned-rank-{rank:05d}"
_COMPLETE = re.compile(r"^step-(\d+)(?:\.(\d+))?$")
_PARTIAL = re.compile(r"^\.step-\d+\.(?:([0-9a-f]+)-\d+\.)?partial$")
# The names of the snapshots retention removed, one a line: never given to another snapshot,
# since a log record of an earlier run may name one.
_REMOVED = ".removed-snapshots"


def complete_snapshots(directory: str | os.PathLike[str]) -> list[tuple[int, Path]]:
    """The recorder's complete snapshots under ``directory`` as (step, path), in step order;
    a repeated step's later snapshots (``step-N.1``, ...) after its first."""
    found = []
    for path in Path(directory).iterdir():
        match = _COMPLETE.match(path.name)
        if match and path.is_dir():
            found.append((int(match.group(1)), int(match.group(2) or 0), path))
    return [(step, path) for step, _, path in sorted(found)]


def snapshot_name(step: int, repeat: int) -> str:
    """The name of a step's snapshot: ``step-N``, then ``step-N.1``, ... for a repeated step."""
    suffix = f".{repeat}" if repeat else ""
    return f"step-{step:08d}{suffix}"


def _header_triggers(snapshot: Path) -> tuple[str, ...] | None:
    """The triggers in the rank 0 file's header, as the reader reads it; None if it cannot be
    read."""
    try:
        return open_rank_file(snapshot, FILE_PATTERN.format(rank=0)).header.triggers
    except SnapshotError:
        return None


_UNKNOWN = "unknown"


def kinds_of(triggers: Sequence[str] | None) -> frozenset[str]:
    """The retention kinds of a snapshot taken for ``triggers``: ``routine`` when every one
    is, else each other trigger; ``unknown`` (never removed) without any."""
    if not triggers:
        return frozenset({_UNKNOWN})
    found = set(triggers) - ROUTINE_TRIGGERS
    return frozenset(found or {"routine"})


def _kinds_and_time(snapshot: Path) -> tuple[frozenset[str], int]:
    """The retention kinds of ``snapshot`` (see :func:`kinds_of`) and when it was written (ns):
    from its marker, else from its rank 0 file."""
    try:
        marker = json.loads((snapshot / RECORDER_MARKER).read_text())
        return kinds_of([str(name) for name in marker["triggers"]]), int(marker["written_ns"])
    except (OSError, ValueError, KeyError, TypeError):
        pass
    triggers = _header_triggers(snapshot)
    try:
        written = snapshot.stat().st_mtime_ns
    except OSError:
        written = 0
    return kinds_of(triggers), written


class Snapshots:
    """One attempt's snapshots in ``directory``: rank 0's decisions before a write, every
    rank's write on a thread, rank 0's rename once the write is whole."""

    def __init__(
        self,
        directory: Path,
        keep: int,
        finalize_timeout_s: float,
        max_dump_s: float,
        rank: int,
        world_size: int,
    ) -> None:
        self.directory = directory
        self.keep = keep
        self.finalize_timeout_s = finalize_timeout_s
        self.max_dump_s = max_dump_s
        self.rank, self.world_size = rank, world_size
        self.attempt = ""  # set once the ranks agreed on it
        self.writing: int | None = None  # the step of the latest write
        self._removed: set[str] = set()  # rank 0's: names retention took, in any run
        self._writer: threading.Thread | None = None
        self._dumps = 0

    @property
    def busy(self) -> bool:
        """Whether this rank's latest write is still going."""
        return self._writer is not None and self._writer.is_alive()

    def join(self, timeout_s: float | None = None) -> None:
        """Wait for this rank's latest write (at most ``timeout_s``)."""
        if self._writer is not None:
            self._writer.join(timeout_s)

    # --- rank 0's decisions, made before any rank writes --------------------------------------

    def begin(self) -> int:
        """Rank 0 at construction: draw this attempt's id, remove earlier attempts' partial
        snapshots (their ranks are gone: they can never complete)."""
        attempt = secrets.randbits(40)
        with contextlib.suppress(OSError):  # none yet, or unreadable: this run's own, then
            self._removed = set((self.directory / _REMOVED).read_text().split())
        try:
            leftovers = sorted(
                path for path in self.directory.iterdir() if _PARTIAL.match(path.name)
            )
        except OSError:
            return attempt  # no directory yet
        for path in leftovers:
            shutil.rmtree(path, ignore_errors=True)
        if leftovers:
            warn(
                f"{self.directory}: removed {len(leftovers)} incomplete snapshot(s) of an "
                f"earlier run ({', '.join(path.name for path in leftovers[:3])}"
                f"{', ...' if len(leftovers) > 3 else ''})"
            )
        return attempt

    def prepare(self, step: int, triggers: tuple[str, ...]) -> int:
        """Rank 0, before the others write: pick the snapshot's free name (its repeat index),
        then make room for it (the oldest of its kind goes when the kind holds ``keep``).

        Named first: the snapshot the room is made from may be this step's of an earlier run
        (a resume replays steps), whose log record names it; the new one must not take its
        name, or that record would point at other numbers."""
        repeat = 0
        while (path := self.final(step, repeat)).exists() or path.name in self._removed:
            repeat += 1
        try:
            self._trim(kinds_of(triggers), self.keep - 1)
        except OSError as error:
            warn(f"step {step}: cannot remove old snapshots ({error}); training goes on")
        return repeat

    def final(self, step: int, repeat: int) -> Path:
        return self.directory / snapshot_name(step, repeat)

    def _trim(self, kinds: frozenset[str], bound: int) -> None:
        """Remove the complete snapshots no kind keeps: each of ``kinds`` keeps its ``bound``
        newest-written, every other kind its ``keep``."""
        if not self.directory.is_dir():
            return
        found = []
        by_kind: dict[str, list[tuple[int, str]]] = {}
        for _, path in complete_snapshots(self.directory):
            held, written = _kinds_and_time(path)
            found.append((held, path))
            for kind in held:
                by_kind.setdefault(kind, []).append((written, path.name))
        kept: set[str] = set()
        for kind, ages in by_kind.items():
            ages.sort(reverse=True)  # the newest first
            limit = len(ages) if kind == _UNKNOWN else bound if kind in kinds else self.keep
            kept.update(name for _, name in ages[: max(limit, 0)])
        removed = [path for _, path in found if path.name not in kept]
        if not removed:
            return
        self._removed.update(path.name for path in removed)
        with open(self.directory / _REMOVED, "a") as ledger:  # before: a crash loses no name
            ledger.write("".join(f"{path.name}\n" for path in removed))
        for path in removed:
            shutil.rmtree(path, ignore_errors=True)

    # --- the dump ----------------------------------------------------------------------------

    def dump(
        self,
        step: int,
        triggers: tuple[str, ...],
        repeat: int,
        pairs: Sequence[tuple[str, Any]],
        options: Mapping[str, Any],
        on_write: Callable[[], None],
        on_complete: Callable[[Path], None] | None = None,
        norm: tuple[float, float] | None = None,
    ) -> Path | None:
        """Write this rank's file (rank 0 then finalizes) on a thread, and wait for it at most
        ``max_dump_s``: past that, training goes on and the snapshot is abandoned, marked so
        that it is never renamed complete (its gradients change from here on).

        ``on_complete`` is called on rank 0's thread with the snapshot once it is complete.

        ``options`` go to :func:`dump_rank`; ``on_write`` is called as the write starts.
        ``norm``: the recorder's norm of the step, as (norm type, norm), noted beside the
        triggers (``gradstat norm`` of the snapshot compares its own with it).
        """
        self._dumps += 1
        on_write()
        final = self.final(step, repeat)
        partial = self.directory / f".step-{step:08d}.{self.attempt}-{self._dumps}.partial"
        rank, world_size = self.rank, self.world_size

        def write() -> None:
            try:
                dump_rank(
                    partial,
                    pairs,
                    step=step,
                    triggers=triggers,
                    empty_ok=True,  # a rank without gradients still completes the snapshot
                    **options,
                )
                if rank == 0 and self._wait_for_all(partial, world_size):
                    if any(partial.glob(".abandoned-rank-*")):
                        return  # a rank gave up waiting for its write: its file may be torn
                    marker: dict[str, Any] = {
                        "triggers": list(triggers),
                        "written_ns": time.time_ns(),
                    }
                    if norm is not None:
                        marker["norm"] = {"type": norm[0], "value": norm[1]}
                    (partial / RECORDER_MARKER).write_text(json.dumps(marker))
                    os.rename(partial, final)
                    self._trim(kinds_of(triggers), self.keep)
                    if on_complete is not None:
                        on_complete(final)
            except Exception as error:  # a thread's traceback would be lost in the job's log
                warn(f"step {step}: rank {rank} could not dump ({error}); training goes on")

        self._writer = threading.Thread(target=write, name=f"gradstat-dump-{step}", daemon=True)
        self.writing = step
        self._writer.start()
        self._writer.join(self.max_dump_s)
        if self._writer.is_alive():
            partial.mkdir(parents=True, exist_ok=True)
            (partial / _ABANDONED.format(rank=rank)).touch()
            warn(
                f"step {step}: rank {rank} still writing after {self.max_dump_s:g} s (a slow "
                f"disk?); training goes on and {partial.name} stays incomplete"
            )
            return None
        return final if rank != 0 or final.exists() else None

    def _wait_for_all(self, partial: Path, world_size: int) -> bool:
        deadline = time.monotonic() + self.finalize_timeout_s
        expected = [partial / FILE_PATTERN.format(rank=rank) for rank in range(world_size)]
        while True:
            present = sum(path.exists() for path in expected)
            if present == world_size:
                return True
            if time.monotonic() >= deadline:
                warn(
                    f"{partial}: {present} of {world_size} rank files after "
                    f"{self.finalize_timeout_s:g} s; the snapshot stays incomplete "
                    f"(a rank was lost, or the disk is slow); training goes on"
                )
                return False
            time.sleep(0.05)

"""One process or many: torchrun's processes join, open a snapshot in shares, and gather.

Each process does its share of the work (rank files i, i+N, ...; or jobs) and sends back JSON
data (``analysis.stats.gather_pieces``: a few numbers per counted tensor); it travels over a
gloo group, so a failure raises instead of aborting, and the callers merge it in rank-file or
job order: every number is bitwise what one process computes alone. A process that hits bad
input sends its error instead, and every process raises it (:class:`StoppedTogether`: process
0 says it, the others keep quiet). Before anything is computed the processes check that they
were all started with the same arguments on the same snapshot; a process that stops (killed,
frozen, hung) is named by the others, whenever it stops. Process 0 also reports how far all of
them are (:class:`Progress`).
"""

from __future__ import annotations

import ctypes
import hashlib
import itertools
import json
import math
import os
import shlex
import socket
import stat
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager, suppress
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Any, NoReturn, TypeVar

import torch
import torch.distributed as dist

# Public and documented; torch re-exports them from its C extension under a condition that
# type checkers do not follow.
from torch.distributed import PrefixStore, TCPStore  # type: ignore[attr-defined]

from gradstat.distributed.launcher import launch_rank, launched
from gradstat.errors import GradstatError, StoppedTogether
from gradstat.snapshot import RankFile, Snapshot, SnapshotShare
from gradstat.snapshot.container import MAX_HEADER_BYTES
from gradstat.snapshot.dcp import is_dcp_directory
from gradstat.snapshot.format import is_wgrads_name
from gradstat.snapshot.reader import (
    FileSummary,
    open_rank_files,
    rank_file_names,
    refuse_kind,
)
from gradstat.snapshot.stand_ins import copy_rows, copy_stand_ins, lacked_names

if TYPE_CHECKING:
    from gradstat.snapshot.wgrads import WgradsOptions

T = TypeVar("T")

# How often a process tells the store how far it is (see ``_Heartbeat.beat``).
BEAT_INTERVAL_S = 0.2

__all__ = [
    "Processes",
    "Progress",
    "agree",
    "gather",
    "gather_jobs",
    "join",
    "launch_rank",
    "launched",
    "leave",
    "open_shared",
    "pick_device",
    "process_group",
    "together",
]


@dataclass(frozen=True)
class Progress:
    """How far all the processes together are with one stage of a command.

    ``done`` of ``total`` units (rank files, checks); ``bytes_done`` of ``bytes_total`` bytes
    where the stage reads whole rank files (both 0 where it does not count bytes).
    """

    stage: str
    done: int
    total: int
    unit: str
    bytes_done: int = 0
    bytes_total: int = 0


@dataclass(frozen=True)
class Processes:
    """This process's rank and the number of processes (0 of 1 without a launcher)."""

    rank: int
    size: int
    timeout_s: float = 30.0
    # Told how far the processes are; process 0 alone calls it, speaking for all of them.
    on_progress: Callable[[Progress], None] | None = field(default=None, repr=False, compare=False)
    # The launcher's key-value store (None alone), where the processes say how far they are.
    store: Any = field(default=None, repr=False, compare=False)
    # Numbers the exchanges: every process makes the same ones in the same order, so that each
    # exchange has its own keys in the launcher's store.
    _exchanges: Iterator[int] = field(default_factory=itertools.count, repr=False, compare=False)

    @property
    def is_first(self) -> bool:
        return self.rank == 0

    def share(self, items: Sequence[T]) -> list[T]:
        """This process's share of ``items``: items rank, rank + size, ..."""
        return list(items[self.rank :: self.size])

    def report(self, progress: Progress) -> None:
        """Pass ``progress`` on to ``on_progress``, on process 0 only."""
        if self.is_first and self.on_progress is not None:
            self.on_progress(progress)


def join(timeout_s: float, on_progress: Callable[[Progress], None] | None = None) -> Processes:
    """Join torchrun's processes in a gloo group (:func:`leave` leaves it); alone, do nothing.

    Args:
        timeout_s: how long to wait for the other processes, to join and at every exchange.
        on_progress: told how far the processes are, on process 0 (see :class:`Progress`).

    Raises:
        GradstatError: the other processes did not all join within ``timeout_s``.
    """
    if not launched():
        return Processes(0, 1, timeout_s, on_progress)
    rank, size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    timeout = timedelta(seconds=timeout_s)
    try:
        store = _launcher_store(rank, size, timeout)
        group = PrefixStore("gradstat/group", store)
        dist.init_process_group("gloo", store=group, rank=rank, world_size=size, timeout=timeout)
    except (RuntimeError, ValueError) as error:
        raise GradstatError(
            f"process {rank} of {size}: the processes did not all join within {timeout_s:g} s "
            f"({_last_line(error)})"
        ) from error
    return Processes(rank, size, timeout_s, on_progress, store)


def _launcher_store(rank: int, size: int, timeout: timedelta) -> Any:
    """The key-value store at the launcher's ``MASTER_ADDR:MASTER_PORT``: torchrun's agent
    hosts it (it says so in ``TORCHELASTIC_USE_AGENT_STORE``), else process 0 does.

    Raises:
        ValueError: the launcher did not say where the store is.
    """
    where = os.environ.get("MASTER_ADDR"), os.environ.get("MASTER_PORT")
    if where[0] is None or where[1] is None or not where[1].isdigit():
        raise ValueError("the launcher set no MASTER_ADDR and MASTER_PORT")
    hosted_by_agent = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
    return TCPStore(
        where[0],
        int(where[1]),
        size,
        is_master=rank == 0 and not hosted_by_agent,
        timeout=timeout,
    )


def leave(processes: Processes) -> None:
    """Leave the group :func:`join` joined. The processes waiting for process 0 to stop
    (:class:`StoppedTogether`, quiet) go once it has left: leave last."""
    if processes.size > 1 and dist.is_initialized():
        dist.destroy_process_group()


@contextmanager
def process_group(
    timeout_s: float,
    arguments: Sequence[str] = (),
    snapshot_dirs: Sequence[str | os.PathLike[str]] = (),
    on_progress: Callable[[Progress], None] | None = None,
) -> Iterator[Processes]:
    """:func:`join`, :func:`agree`, and :func:`leave` at the end.

    Raises:
        GradstatError: the other processes did not all join within ``timeout_s``.
        StoppedTogether: they did not agree (see :func:`agree`).
    """
    processes = join(timeout_s, on_progress)
    try:
        agree(processes, arguments, snapshot_dirs)
        yield processes
    finally:
        leave(processes)


def agree(
    processes: Processes,
    arguments: Sequence[str] = (),
    snapshot_dirs: Sequence[str | os.PathLike[str]] = (),
) -> None:
    """Stop unless every process was started as process 0 was, on the same snapshot.

    Each process sends its ``arguments`` (the command line it was started with) and what
    identifies its view of ``snapshot_dirs`` (see :func:`_view`). Processes that share a view
    (one node's) see the same files; where there are several views (nodes, or directories
    given by other paths), the rank files are digested, each view's share split among its
    processes: their names, sizes and headers, no gradient read. So pieces computed for another
    norm or from another snapshot are never merged.

    Raises:
        StoppedTogether: other arguments or other rank files; quiet but on process 0.
    """
    if processes.size == 1:
        return
    rank = processes.rank
    everyone = gather(
        processes, lambda _: {"arguments": list(arguments), "view": _view(snapshot_dirs, rank)}
    )
    started = everyone[0]["arguments"]
    others = [member for member, theirs in enumerate(everyone) if theirs["arguments"] != started]
    if others:
        example = everyone[others[0]]["arguments"]
        _stop_together(
            processes,
            f"{_processes(others)} of {processes.size} {'was' if len(others) == 1 else 'were'} "
            f"started with other arguments than process 0 (process {others[0]} ran "
            f'"gradstat {shlex.join(example)}", process 0 "gradstat '
            f'{shlex.join(started)}"); start every process with the same command',
        )
    views: dict[str, list[int]] = {}
    for member, theirs in enumerate(everyone):
        views.setdefault(theirs["view"], []).append(member)
    if len(views) == 1:
        return  # one view of the files: every process reads what process 0 reads
    mine = views[everyone[rank]["view"]]
    portion = (mine.index(rank), len(mine))
    parts = gather(processes, lambda beat: _snapshot_identities(snapshot_dirs, portion, beat))
    digests = {
        view: _view_digest([parts[member] for member in members]) for view, members in views.items()
    }
    first = digests[everyone[0]["view"]]
    others = [member for member, theirs in enumerate(everyone) if digests[theirs["view"]] != first]
    if not others:
        return
    shown = ", ".join(str(directory) for directory in snapshot_dirs)
    _stop_together(
        processes,
        f"{_processes(others)} of {processes.size} {'sees' if len(others) == 1 else 'see'} other "
        f"rank files in {shown} than process 0 (names, sizes or headers differ); every process "
        f"must read the same snapshot",
    )


def _view(snapshot_dirs: Sequence[str | os.PathLike[str]], rank: int) -> str:
    """What identifies the files this process sees in ``snapshot_dirs``: the host's name, the
    machine's boot, the process's mount namespace and each directory's device and inode.
    Processes with the same view read the same files; one whose view cannot be told (no
    ``/proc``) has its own, and digests every file. The host's name is one more guard, where a
    sandbox may not give each machine a boot id of its own."""
    try:
        boot = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
        mounts = os.readlink("/proc/self/ns/mnt")
    except OSError:
        return f"process {rank}"
    places = []
    for directory in snapshot_dirs:
        try:
            status = os.stat(directory)
        except OSError as error:
            places.append(f"unreadable: {error.errno}")
        else:
            places.append(f"{status.st_dev}:{status.st_ino}")
    return "\0".join((socket.gethostname(), boot, mounts, *places))


def _snapshot_identities(
    directories: Sequence[str | os.PathLike[str]],
    portion: tuple[int, int],
    beat: Callable[[int], None],
) -> dict[str, Any]:
    """A digest of the rank files' names, and a digest of each file of this process's portion
    (``index, count``: files index, index + count, ... of all, in order) of its name, size and
    header bytes, the data section unread (``beat`` after each file). A directory or file that
    cannot be read is digested as such; the reader reports what is wrong with it later.

    Each process of a view digests its portion, so this is paid per file once per view: paths
    joined as bytes and one read for a small header took it from 15 to 10 us a file (8192
    small rank files).
    """
    names_digest = hashlib.sha256()
    files: list[bytes] = []
    for directory in directories:
        names_digest.update(b"\0directory\0")
        folder = os.fsencode(directory)
        try:
            names = sorted(
                entry.name for entry in os.scandir(folder) if entry.name.endswith(b".safetensors")
            )
        except OSError as error:
            names_digest.update(f"unreadable: {error.errno}".encode())
            continue
        names_digest.update(b"\0".join(names))
        files += (os.path.join(folder, name) for name in names)
    index, count = portion
    digests = []
    for path in files[index::count]:
        identity = _rank_file_identity(path)
        digests.append(hashlib.sha256(b"%s\0%s" % (os.path.basename(path), identity)).hexdigest())
        beat(0)
    return {"names": names_digest.hexdigest(), "files": digests}


def _view_digest(parts: Sequence[dict[str, Any]]) -> str:
    """The digest of a view's rank files from its processes' :func:`_snapshot_identities`, in
    their order (process i's portion: files i, i + count, ...). Processes of one view that
    listed other names (the directory changed meanwhile) give a digest of their own."""
    names = {part["names"] for part in parts}
    if len(names) != 1:
        return f"changing: {sorted(names)}"
    digest = hashlib.sha256(names.pop().encode())
    count = len(parts)
    total = sum(len(part["files"]) for part in parts)
    for position in range(total):
        digest.update(parts[position % count]["files"][position // count].encode())
    return digest.hexdigest()


def together(processes: Processes, work: Callable[[], T]) -> T:
    """``work()`` in every process, stopping them all if it fails in any.

    For work whose errors every process meets alike (opening the snapshot): process 0 says the
    error once instead of every process saying it.

    Raises:
        StoppedTogether: ``work`` raised a GradstatError or an OSError in some process (the
            first, by process rank); quiet but on process 0.
    """
    if processes.size == 1:
        return work()
    done: list[T] = []

    def compute(beat: Callable[[int], None]) -> None:
        done.append(work())

    gather(processes, compute)
    return done[0]


def open_shared(
    processes: Processes,
    directory: str | os.PathLike[str],
    options: WgradsOptions | None = None,
) -> Snapshot | SnapshotShare:
    """The snapshot in ``directory``, each process validating its share of the rank files.

    Alone: :meth:`Snapshot.open`. Under a launcher each process reads and checks the headers
    of its share (rank files i, i+N, ... by name), the processes exchange every file's summary
    (its header without the parameter records), and each checks the whole from those as
    :meth:`Snapshot.open` does: each header is parsed once, by one process, instead of once
    per process. A Megatron wgrads dump is opened whole by each process (``options`` apply to
    it), which then reduces its share of the files.

    Raises:
        StoppedTogether: what is wrong with the snapshot (the first error, by process rank),
            on every process; quiet but on process 0.
    """
    if processes.size == 1:
        return Snapshot.open(directory, options)
    folder = Path(directory)
    # A dump's attributes are rebuilt from every file's names and shapes: each process reads
    # every file's pickle (no tensor) and reduces its share. A checkpoint's metadata is one
    # file: each process reads it, and the chunks of its share of the data files.
    whole = together(processes, lambda: _whole_dump(folder, options))
    if whole is not None:
        every = tuple(FileSummary.of(rank_file) for rank_file in whole.files)
        return SnapshotShare(folder, tuple(processes.share(whole.files)), every)
    files: list[RankFile] = []

    def compute(beat: Callable[[int], None]) -> list[list[Any]]:
        for rank_file in open_rank_files(folder, processes.share(rank_file_names(folder))):
            files.append(rank_file)
            beat(0)
        return FileSummary.to_columns(files)

    shares = gather(processes, compute)
    summaries = [summary for share in shares for summary in FileSummary.from_columns(folder, share)]
    # A DTensor shard whose copy at coordinate 0 lacks its gradient counts by another copy: the
    # summaries hold no records, so the processes exchange those of the names some file lacks.
    lacked = lacked_names(summaries)
    copies = None
    if lacked:
        headers = [rank_file.header for rank_file in files]
        rows = gather(processes, lambda _beat: copy_rows(headers, lacked))
        copies = copy_stand_ins([row for share in rows for row in share])
    return together(processes, lambda: SnapshotShare.assemble(folder, files, summaries, copies))


def _whole_dump(folder: Path, options: WgradsOptions | None) -> Snapshot | None:
    """The Megatron wgrads dump or the DCP checkpoint in ``folder``, opened whole; None for
    gradstat's rank files (``--kind``, which only a checkpoint takes, refused for them as
    :meth:`Snapshot.open` refuses it)."""
    if is_dcp_directory(folder) or is_wgrads_name(rank_file_names(folder)[0]):
        return Snapshot.open(folder, options)
    refuse_kind(folder, options)
    return None


def _stop_together(processes: Processes, message: str) -> NoReturn:
    """Raise ``message`` on every process, to be said by process 0 alone.

    A quiet process first waits for process 0 to leave the group (or ``timeout_s``): one that
    left before process 0 said it could get it killed first (torchrun stops every process when
    one fails).
    """
    if processes.is_first:
        raise StoppedTogether(message)
    _wait_for_first()
    raise StoppedTogether(message, quiet=True)


def _processes(ranks: Sequence[int]) -> str:
    return f"process {ranks[0]}" if len(ranks) == 1 else f"processes {', '.join(map(str, ranks))}"


def _wait_for_first() -> None:
    """Return once process 0 has left the group, or after ``timeout_s``.

    A receive from process 0, which sends nothing, ends when its connection closes; the store
    would do as well, but its client logs a stack trace when its server goes.
    """
    with suppress(RuntimeError):
        dist.recv(torch.zeros(1), src=0)


# A file's identity is read in one read of this many bytes where its header fits (the small
# rank files of a many-file snapshot), else in two; a larger first read copied more than it saved.
_IDENTITY_READ = 4 << 10


def _rank_file_identity(path: bytes) -> bytes:
    """The file's size and header (at most what the reader accepts), or what else it is."""
    try:
        # Non-blocking: opening a FIFO that no one writes must not hang.
        descriptor = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0))
    except OSError as error:
        return f"cannot open: {error.errno}".encode()
    try:
        status = os.fstat(descriptor)
        if not stat.S_ISREG(status.st_mode):
            return f"not a file: {stat.S_IFMT(status.st_mode)}".encode()
        start = os.pread(descriptor, _IDENTITY_READ, 0)
        length = int.from_bytes(start[:8], "little") if len(start) >= 8 else 0
        end = 8 + min(length, status.st_size, MAX_HEADER_BYTES)  # a shorter file: all of it
        if end > len(start) and len(start) == _IDENTITY_READ:
            start += os.pread(descriptor, end - len(start), len(start))
    except OSError as error:
        return f"cannot read: {error.errno}".encode()
    finally:
        os.close(descriptor)
    return b"%d\0%s" % (status.st_size, start[:end])


def _last_line(error: BaseException) -> str:
    text = str(error).strip()
    return text.splitlines()[-1] if text else type(error).__name__


def pick_device(choice: str) -> torch.device:
    """ "cpu", "cuda" (this process's GPU: LOCAL_RANK) or "auto" (cuda when there is one).

    Raises:
        GradstatError: "cuda" asked for on a machine without one.
    """
    if choice == "auto":
        choice = "cuda" if torch.cuda.is_available() else "cpu"
    if choice == "cpu":
        return torch.device("cpu")
    if choice != "cuda":
        raise GradstatError(f"--device {choice!r}: use cpu, cuda or auto")
    if not torch.cuda.is_available():
        raise GradstatError("--device cuda: no CUDA device is available")
    index = int(os.environ.get("LOCAL_RANK", "0")) % torch.cuda.device_count()
    torch.cuda.set_device(index)
    return torch.device("cuda", index)


def gather_jobs(
    processes: Processes,
    jobs: Sequence[T],
    work: Callable[[T], Any],
    stage: str = "checking",
    unit: str = "checks",
) -> list[Any]:
    """``work(job)`` for every job, the jobs split over the processes (i, i+N, ...).

    ``work`` returns JSON data; every result comes back through JSON, in one process too, so
    that the results are the same objects however the jobs were split. Process 0 reports the
    jobs all the processes have done, as ``stage`` counted in ``unit``.

    Returns:
        The results in job order, on every process.

    Raises:
        StoppedTogether: any process's error (the first, by process rank), on every process.
        GradstatError: some processes stopped moving (named by number), or, alone, the error.
    """
    mine = processes.share(range(len(jobs)))

    def report(done: int, _bytes: int = 0) -> None:
        processes.report(Progress(stage, done, len(jobs), unit))

    def compute(beat: Callable[[int], None]) -> list[list[Any]]:
        done = []
        for index in mine:
            done.append([index, work(jobs[index])])
            beat(0)
        return done

    report(0)
    if processes.size == 1:
        finished = itertools.count(1)
        shares = [json.loads(json.dumps(compute(lambda _: report(next(finished)))))]
    else:
        shares = gather(processes, compute, report if processes.is_first else None)
    report(len(jobs))
    results: list[Any] = [None] * len(jobs)
    for share in shares:
        for index, result in share:
            results[index] = result
    return results


def gather(
    processes: Processes,
    compute: Callable[[Callable[[int], None]], Any],
    watch: Callable[[int, int], None] | None = None,
) -> list[Any]:
    """Every process's ``compute(beat)`` (JSON data), in process order, on every process.

    ``beat(nbytes)`` tells the other processes this one has done one more unit of work (of
    ``nbytes`` bytes). ``watch(done, bytes)`` is told the units and bytes done by all the
    processes together, after each of this process's units and about once a second while it
    waits for the others.

    Raises:
        StoppedTogether: a process's error (the first, by process rank), on every process.
        GradstatError: the processes that stopped moving, by number, wherever they stopped.
    """
    heartbeat = _Heartbeat(processes, next(processes._exchanges), watch)
    payload: dict[str, Any]
    try:
        payload = {"ok": compute(heartbeat.beat)}
    except GradstatError as error:
        payload = {"error": str(error)}
    except OSError as error:  # a rank file that fails to read: named, as the CLI names it
        where = f"{error.filename}: " if error.filename else ""
        payload = {"error": f"{where}{error.strerror or error}"}
    blob = json.dumps(payload).encode()
    lengths = heartbeat.finish(len(blob))
    try:
        blobs = _all_gather_bytes(blob, lengths)
    except RuntimeError as error:  # gloo: a peer died or timed out
        raise heartbeat.lost_while_gathering(error) from error
    heartbeat.gathered()
    gathered = [json.loads(blob) for blob in blobs]
    errors = [share["error"] for share in gathered if "error" in share]
    if errors:
        _stop_together(processes, errors[0])
    return [share["ok"] for share in gathered]


class _Heartbeat:
    """Progress of every process in the launcher's key-value store, to name a lost one.

    Each process counts the work it has finished (rank files, jobs) and its bytes; a process
    whose count has not moved for ``timeout_s`` seconds while the others wait for it is declared
    lost, by every process that waits for it (each says so: process 0 may be stopped first).
    The others wait for it at three marks, each a key in the store that it sets: its work done
    (with the length of what it sends), and the gather over, gone right or wrong. A process
    that stops after its work is done therefore fails the gather for the others, and is then
    found missing at the last mark instead of being lost among the gather's errors. ``watch``,
    where given, is told the work done by all the processes together.
    """

    def __init__(
        self, processes: Processes, exchange: int, watch: Callable[[int, int], None] | None = None
    ) -> None:
        self.processes = processes
        self.exchange = exchange
        self.watch = watch
        self.store = processes.store
        self.done = self.done_bytes = 0
        self.said = -math.inf
        self._set("progress", "0 0")

    def _key(self, kind: str, rank: int) -> str:
        return f"gradstat/{self.exchange}/{kind}/{rank}"

    def _set(self, kind: str, value: str) -> None:
        self.store.set(self._key(kind, self.processes.rank), value)

    def beat(self, nbytes: int = 0) -> None:
        """One more unit of work done, of ``nbytes`` bytes.

        The store hears of it at most every ``BEAT_INTERVAL_S``: each word with the store is a
        round trip (about 0.1 ms), dearer than a small rank file's whole work, and nothing
        that listens (the lost-process watch, a progress bar) needs it sooner.
        """
        self.done += 1
        self.done_bytes += nbytes
        now = time.monotonic()
        if now - self.said < BEAT_INTERVAL_S:
            return
        self.said = now
        self._set("progress", f"{self.done} {self.done_bytes}")
        with suppress(RuntimeError):  # a store that is gone is named at the next wait
            self._tell_watch()

    def _tell_watch(self) -> None:
        """Tell ``watch`` the units and bytes every process has done (those it has said)."""
        if self.watch is None:
            return
        done, done_bytes = self.done, self.done_bytes
        for rank in range(self.processes.size):
            key = self._key("progress", rank)
            if rank != self.processes.rank and self.store.check([key]):
                units, nbytes = self.store.get(key).split()
                done, done_bytes = done + int(units), done_bytes + int(nbytes)
        self.watch(done, done_bytes)

    def finish(self, length: int) -> list[int]:
        """Say this process is done and sends ``length`` bytes, then wait for the others.

        Returns:
            Every process's length, in process order.

        Raises:
            GradstatError: some processes made no progress for ``timeout_s`` seconds.
        """
        self._set("progress", f"{self.done} {self.done_bytes}")
        self._set("done", str(length))
        self._wait_for("done", self.processes.timeout_s)
        return [int(self.store.get(self._key("done", rank))) for rank in range(self.processes.size)]

    def gathered(self) -> None:
        """Say the gather went right for this process."""
        self._set("gathered", "ok")

    def lost_while_gathering(self, error: RuntimeError) -> GradstatError:
        """The error to raise when the gather failed here: the processes that never came out
        of it, found as the others are (this waits up to twice ``timeout_s`` for them)."""
        try:
            self._set("gathered", "failed")
            # The others' gathers time out up to timeout_s after this one failed (at once, when
            # the lost process is dead): only a process silent for longer is lost.
            self._wait_for("gathered", 2 * self.processes.timeout_s)
        except GradstatError as lost:
            return lost
        except RuntimeError:
            pass  # the store went with the process that held it
        return GradstatError(
            f"process {self.processes.rank} of {self.processes.size}: another process failed or "
            f"was lost while gathering results ({_last_line(error)})"
        )

    def _wait_for(self, kind: str, patience_s: float) -> None:
        """Wait until every process has set ``kind``, naming those that stopped moving.

        The store is polled with ``check``: a timed-out ``wait`` would log a warning each time.

        Raises:
            GradstatError: some processes made no progress for ``patience_s`` seconds (said
                as ``timeout_s``, the user's figure), or the store is gone.
        """
        size, timeout_s = self.processes.size, self.processes.timeout_s
        keys = [self._key(kind, rank) for rank in range(size)]
        seen: dict[int, tuple[bytes, float]] = {}
        pause, looked = 0.001, time.monotonic()
        try:
            while not self.store.check(keys):
                time.sleep(pause)
                pause = min(2 * pause, 0.01)  # a round trip costs ~0.1 ms; oversleeping, more
                now = time.monotonic()
                if now - looked < 1.0:
                    continue
                looked = now
                self._tell_watch()
                lost = []
                for rank, key in enumerate(keys):
                    if self.store.check([key]):
                        continue
                    progress_key = self._key("progress", rank)
                    has_progress = self.store.check([progress_key])
                    progress = self.store.get(progress_key) if has_progress else b""
                    if seen.get(rank, (None, 0.0))[0] != progress:
                        seen[rank] = (progress, now)
                    elif now - seen[rank][1] > patience_s:
                        lost.append(rank)
                if lost:
                    raise GradstatError(
                        f"process {self.processes.rank} of {size}: process "
                        f"{', '.join(map(str, lost))} made no progress for {timeout_s:g} s "
                        f"(killed or hung?); stopping"
                    )
        except RuntimeError as error:  # DistNetworkError: the store's host is gone
            raise GradstatError(
                f"process {self.processes.rank} of {size}: lost the launcher's key-value store "
                f"({_last_line(error)}); the process holding it (process 0 without torchrun) "
                f"failed or was lost"
            ) from error


def _all_gather_bytes(blob: bytes, lengths: Sequence[int]) -> list[bytes]:
    """Every process's bytes, in process order, over the default (gloo) group.

    ``lengths`` holds every process's length (they travel with the heartbeat). Plain tensors
    rather than all_gather_object, which needs numpy in some torch builds; JSON rather than
    pickle, so that nothing a peer sends is ever unpickled. Python's JSON floats round-trip
    exactly, NaN and Inf included.
    """
    size = dist.get_world_size()
    longest = max(lengths)
    mine = torch.zeros(longest, dtype=torch.uint8)
    if blob:
        mine[: len(blob)] = torch.frombuffer(bytearray(blob), dtype=torch.uint8)
    buffers = [torch.zeros(longest, dtype=torch.uint8) for _ in range(size)]
    dist.all_gather(buffers, mine)
    return [
        ctypes.string_at(buffer.data_ptr(), int(count))
        for buffer, count in zip(buffers, lengths, strict=True)
    ]

"""One process or many: split rank files over torchrun's processes and gather their pieces.

Each process computes the pieces (a few numbers per counted tensor) of its share of the rank
files, on its CPU or on ``cuda:LOCAL_RANK``; the pieces travel over a gloo group, so a failure
raises instead of aborting, and rank 0 merges them in rank-file order: every number is bitwise
what one process computes alone. A process that hits bad input sends its error instead, and
every process raises it.
"""

from __future__ import annotations

import ctypes
import json
import os
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from datetime import timedelta
from typing import Any, TypeVar

import torch
import torch.distributed as dist

from .analysis import NonFinite, Piece, Request, snapshot_pieces
from .errors import GradstatError
from .snapshot import RankFile, Snapshot

T = TypeVar("T")

__all__ = ["Place", "gather_jobs", "gather_pieces", "launched", "pick_device", "process_group"]


def launched() -> bool:
    """True under a launcher (torchrun) with more than one process."""
    return "RANK" in os.environ and int(os.environ.get("WORLD_SIZE", "1")) > 1


@dataclass(frozen=True)
class Place:
    """This process's rank and the number of processes (0 of 1 without a launcher)."""

    rank: int
    size: int
    timeout_s: float = 30.0

    @property
    def is_first(self) -> bool:
        return self.rank == 0

    def share(self, items: Sequence[T]) -> list[T]:
        """This process's share of ``items``: items rank, rank + size, ..."""
        return list(items[self.rank :: self.size])


@contextmanager
def process_group(timeout_s: float) -> Iterator[Place]:
    """Join torchrun's processes in a gloo group for the duration; alone, do nothing.

    Raises:
        GradstatError: the other processes did not all join within ``timeout_s``.
    """
    if not launched():
        yield Place(0, 1, timeout_s)
        return
    size = int(os.environ["WORLD_SIZE"])
    try:
        dist.init_process_group("gloo", timeout=timedelta(seconds=timeout_s))
    except (RuntimeError, ValueError) as error:
        raise GradstatError(
            f"process {os.environ.get('RANK')} of {size}: the processes did not all join within "
            f"{timeout_s:g} s ({_last_line(error)})"
        ) from error
    try:
        yield Place(dist.get_rank(), dist.get_world_size(), timeout_s)
    finally:
        dist.destroy_process_group()


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


def gather_pieces(
    snapshot: Snapshot,
    request: Request,
    place: Place,
    on_file: Callable[[RankFile], None] | None = None,
) -> list[Piece]:
    """Every rank file's pieces, computed by the processes in turn (files i, i+N, ...).

    Raises:
        GradstatError: any process's error (the first, by process rank), on every process.
    """
    mine = [rank_file.rank for rank_file in place.share(snapshot.files)]
    if place.size == 1:
        return snapshot_pieces(snapshot, request, mine, on_file)

    def compute(beat: Callable[[], None]) -> list[dict[str, Any]]:
        def after_file(rank_file: RankFile) -> None:
            beat()
            if on_file is not None:
                on_file(rank_file)

        return [asdict(piece) for piece in snapshot_pieces(snapshot, request, mine, after_file)]

    pieces = [_piece_from(data) for share in _gathered(place, compute) for data in share]
    # Stable: each file's pieces stay in their order, files come in rank order.
    pieces.sort(key=lambda piece: piece.rank)
    return pieces


def gather_jobs(place: Place, jobs: Sequence[T], work: Callable[[T], Any]) -> list[Any]:
    """``work(job)`` for every job, the jobs split over the processes (i, i+N, ...).

    ``work`` returns JSON data; every result comes back through JSON, in one process too, so
    that the results are the same objects however the jobs were split.

    Returns:
        The results in job order, on every process.

    Raises:
        GradstatError: any process's error (the first, by process rank), on every process.
    """
    mine = place.share(range(len(jobs)))

    def compute(beat: Callable[[], None]) -> list[list[Any]]:
        done = []
        for index in mine:
            done.append([index, work(jobs[index])])
            beat()
        return done

    if place.size == 1:
        shares = [json.loads(json.dumps(compute(lambda: None)))]
    else:
        shares = _gathered(place, compute)
    results: list[Any] = [None] * len(jobs)
    for share in shares:
        for index, result in share:
            results[index] = result
    return results


def _gathered(place: Place, compute: Callable[[Callable[[], None]], Any]) -> list[Any]:
    """Every process's ``compute(beat)`` (JSON data), in process order, on every process.

    ``beat`` tells the other processes this one is still making progress.
    """
    heartbeat = _Heartbeat(place)
    payload: dict[str, Any]
    try:
        payload = {"ok": compute(heartbeat.beat)}
    except GradstatError as error:
        payload = {"error": str(error)}
    heartbeat.finish()
    try:
        gathered = [json.loads(blob) for blob in _all_gather_bytes(json.dumps(payload).encode())]
    except RuntimeError as error:  # gloo: a peer died or timed out
        raise GradstatError(
            f"process {place.rank} of {place.size}: another process failed or was lost "
            f"while gathering results ({_last_line(error)})"
        ) from error
    errors = [share["error"] for share in gathered if "error" in share]
    if errors:
        raise GradstatError(errors[0])
    return [share["ok"] for share in gathered]


class _Heartbeat:
    """Progress of every process in the launcher's key-value store, to name a lost one.

    Each process counts the work it has finished (rank files, jobs); a process whose count has
    not moved for ``timeout_s`` seconds and that has not finished is declared lost, by every
    other process.
    """

    def __init__(self, place: Place) -> None:
        self.place = place
        self.store = dist.distributed_c10d._get_default_store()
        self.done = 0
        self.store.set(self._key("progress", place.rank), "0")

    @staticmethod
    def _key(kind: str, rank: int) -> str:
        return f"gradstat/{kind}/{rank}"

    def beat(self) -> None:
        """One more unit of work done."""
        self.done += 1
        self.store.set(self._key("progress", self.place.rank), str(self.done))

    def finish(self) -> None:
        """Say this process is done, then wait for the others or name the ones lost.

        Raises:
            GradstatError: some processes made no progress for ``timeout_s`` seconds.
        """
        self.store.set(self._key("done", self.place.rank), "1")
        done = [self._key("done", rank) for rank in range(self.place.size)]
        seen: dict[int, tuple[bytes, float]] = {}
        while True:
            try:
                self.store.wait(done, timedelta(seconds=1))
                return
            except RuntimeError:
                pass  # not all done yet: look for processes that stopped moving
            now = time.monotonic()
            lost = []
            for rank in range(self.place.size):
                if self.store.check([self._key("done", rank)]):
                    continue
                key = self._key("progress", rank)
                progress = self.store.get(key) if self.store.check([key]) else b""
                if seen.get(rank, (None, 0.0))[0] != progress:
                    seen[rank] = (progress, now)
                elif now - seen[rank][1] > self.place.timeout_s:
                    lost.append(rank)
            if lost:
                raise GradstatError(
                    f"process {self.place.rank} of {self.place.size}: process "
                    f"{', '.join(map(str, lost))} made no progress for "
                    f"{self.place.timeout_s:g} s (killed or hung?); stopping"
                )


def _piece_from(data: dict[str, Any]) -> Piece:
    found = data["nonfinite"]
    return Piece(
        **{
            **data,
            "norms": tuple(data["norms"]),
            "nonfinite": None if found is None else NonFinite(**found),
        }
    )


def _all_gather_bytes(blob: bytes) -> list[bytes]:
    """Every process's bytes, in process order, over the default (gloo) group.

    Plain tensors rather than all_gather_object, which needs numpy in some torch builds; JSON
    rather than pickle, so that nothing a peer sends is ever unpickled. Python's JSON floats
    round-trip exactly, NaN and Inf included.
    """
    size = dist.get_world_size()
    length = torch.tensor([len(blob)], dtype=torch.int64)
    lengths = [torch.zeros(1, dtype=torch.int64) for _ in range(size)]
    dist.all_gather(lengths, length)
    longest = max(int(item) for item in lengths)
    mine = torch.zeros(longest, dtype=torch.uint8)
    if blob:
        mine[: len(blob)] = torch.frombuffer(bytearray(blob), dtype=torch.uint8)
    buffers = [torch.zeros(longest, dtype=torch.uint8) for _ in range(size)]
    dist.all_gather(buffers, mine)
    return [
        ctypes.string_at(buffer.data_ptr(), int(count))
        for buffer, count in zip(buffers, lengths, strict=True)
    ]

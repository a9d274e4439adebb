"""The recorder's agreements: a few integers every rank sends, bounded waits, the missing named."""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from contextlib import suppress
from datetime import timedelta

import torch
import torch.distributed as dist

from gradstat.core.groups import stats_device
from gradstat.errors import PeerTimeoutError

__all__ = ["Agreement", "ready"]

_NAMED_MISSING = 8  # ranks named in a timeout message (and how many more)


def _posted(work: dist.Work | None) -> dist.Work:
    assert work is not None, "every rank is in the recorder's group"
    return work


def ready() -> bool:
    return dist.is_available() and dist.is_initialized()


class Agreement:
    """The recorder's own exchanges of a few integers: every rank sends its values to rank 0,
    which takes the element-wise maximum, adds what it alone decides and answers; every wait
    bounded, on a gloo group made at construction (a collective: every rank builds its
    Recorder). A rank that does not arrive is named.

    Rank 0 exchanges with every rank, so an exchange costs O(world size) messages there. With
    ``timeout_s`` None the values are instead all-reduced over the default group (NCCL's on a
    GPU job, one logarithmic collective) and rank 0's decision broadcast: no bound on the wait,
    and no rank named, as before issue 25."""

    def __init__(self, timeout_s: float | None, dump_s: float) -> None:
        self.bounded = timeout_s is not None
        self.timeout_s = math.inf if timeout_s is None else timeout_s
        # After a dump, a rank may still be in its own wait for it (up to max_dump_s).
        self.dump_s = dump_s
        self.grace_s = 0.0
        self.rank = dist.get_rank() if ready() else 0
        self.size = dist.get_world_size() if ready() else 1
        self.failure: str | None = None
        self.group = None
        if self.size > 1 and self.bounded:
            # The group's own timeout stays above the waits below, which come first.
            limit = timedelta(seconds=2 * self.timeout_s + dump_s + 30)
            self.group = dist.new_group(backend="gloo", timeout=limit)

    def exchange(
        self,
        what: str,
        values: list[int],
        decide: Callable[[list[int]], list[int]] | None = None,
        extra: int = 0,
    ) -> list[int]:
        """The maximum over ranks of each of ``values``, then the ``extra`` integers of rank 0's
        ``decide(maxima)``.

        Raises:
            PeerTimeoutError: some ranks did not arrive within ``timeout_s`` (or, seen from
                the others, rank 0 did not answer); the recorder then stays stopped.
        """
        if self.failure is not None:
            raise PeerTimeoutError(self.failure)
        if self.size > 1 and not self.bounded:
            return self._all_reduce(values, decide, extra)
        if self.group is None:
            return values + (decide(values) if decide else [])
        # One answer of a fixed length: a status, then the result or the missing ranks.
        length = 1 + max(len(values) + extra, 1 + _NAMED_MISSING)
        if self.rank == 0:
            answer = self._gather(what, values, decide, length)
        else:
            answer = self._answer_from_zero(what, values, length)
        self.grace_s = 0.0
        return answer[1 : 1 + len(values) + extra]

    @staticmethod
    def _all_reduce(
        values: list[int], decide: Callable[[list[int]], list[int]] | None, extra: int
    ) -> list[int]:
        device = stats_device([], None)
        maxima = torch.tensor(values, dtype=torch.int64, device=device)
        dist.all_reduce(maxima, op=dist.ReduceOp.MAX)
        result = maxima.tolist()
        if decide is None:
            return result
        decided = decide(result) if dist.get_rank() == 0 else [0] * extra
        told = torch.tensor(decided, dtype=torch.int64, device=device)
        dist.broadcast(told, src=0)
        return result + told.tolist()

    def _fail(self, message: str) -> PeerTimeoutError:
        self.failure = f"rank {self.rank}: {message}; the recorder has stopped"
        return PeerTimeoutError(self.failure)

    def _missing(self, what: str, count: int, named: Sequence[int]) -> PeerTimeoutError:
        more = f" and {count - len(named)} more" if count > len(named) else ""
        return self._fail(
            f"rank {', '.join(map(str, named))}{more} did not reach recorder.step ({what}) "
            f"within {self.timeout_s:g} s (it raised and lives on, hangs, or took another path)"
        )

    def _gather(
        self,
        what: str,
        values: list[int],
        decide: Callable[[list[int]], list[int]] | None,
        length: int,
    ) -> list[int]:
        deadline = time.monotonic() + self.timeout_s + self.grace_s
        received = {src: torch.zeros(len(values), dtype=torch.int64) for src in range(1, self.size)}
        works = {}
        missing = []
        for src, buffer in received.items():
            try:
                works[src] = _posted(dist.irecv(buffer, src=src, group=self.group))
            except RuntimeError:  # gloo: the peer's connection is closed already (it died)
                missing.append(src)
        for src, work in works.items():
            remaining = max(deadline - time.monotonic(), 0.001)
            try:
                work.wait(timedelta(seconds=remaining))
            except RuntimeError:  # gloo: timed out, or the peer's connection closed
                missing.append(src)
        if missing:
            missing.sort()
            named = missing[:_NAMED_MISSING]
            self._send_all([1, len(missing), *named], length, skip=set(missing))
            raise self._missing(what, len(missing), named)
        maxima = torch.stack([torch.tensor(values), *received.values()]).amax(0).tolist()
        answer = [0, *maxima, *(decide(maxima) if decide else [])]
        self._send_all(answer, length, skip=set())
        return answer

    def _send_all(self, answer: list[int], length: int, skip: set[int]) -> None:
        message = torch.zeros(length, dtype=torch.int64)
        message[: len(answer)] = torch.tensor(answer, dtype=torch.int64)
        works = []
        for dst in range(1, self.size):
            if dst not in skip:
                with suppress(RuntimeError):  # a rank that left: nothing to tell it
                    works.append(_posted(dist.isend(message, dst=dst, group=self.group)))
        for work in works:
            with suppress(RuntimeError):  # a rank that left finds out at its own wait
                work.wait(timedelta(seconds=self.timeout_s))

    def _answer_from_zero(self, what: str, values: list[int], length: int) -> list[int]:
        values_tensor = torch.tensor(values, dtype=torch.int64)
        answer = torch.zeros(length, dtype=torch.int64)
        # Rank 0 may wait timeout_s for another rank before it answers.
        patience = 2 * self.timeout_s + self.grace_s
        try:
            sent = _posted(dist.isend(values_tensor, dst=0, group=self.group))
            received = _posted(dist.irecv(answer, src=0, group=self.group))
            received.wait(timedelta(seconds=patience))
            sent.wait(timedelta(seconds=patience))
        except RuntimeError as error:
            raise self._fail(
                f"rank 0 did not answer at recorder.step ({what}) within {patience:g} s (it "
                f"raised and lives on, hangs, or was lost)"
            ) from error
        result = answer.tolist()
        if result[0]:
            raise self._missing(what, result[1], result[2 : 2 + min(result[1], _NAMED_MISSING)])
        return result

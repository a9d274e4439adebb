"""A flight recorder for the training loop: the exact global norm every step, a full snapshot
when a step goes wrong.

Two lines in a loop, after backward and before the optimizer step::

    recorder = gradstat.Recorder(model, "dumps/", spike=10.0, keep=3)
    ...
    norm = recorder.step(step)  # the exact global norm; clip with it if you like

Every step the recorder computes the norm with gradstat's core (:func:`gradstat.total_norm` for
torch-native jobs; in a live Megatron job, Megatron's selection and
:func:`gradstat.get_grad_norm_fp32` over its model-parallel group) of the parameters as they are
at that step (a module is walked again each step: a layer appended or replaced, a parameter
frozen or unfrozen, counts as ``total_norm(model.parameters())`` counts it; the fragments of
Megatron's distributed optimizer are views of buffers it allocates once, taken at construction).

The ranks agree twice per step on a gloo group of the recorder's own, each time through rank 0
and each wait bounded by ``agree_timeout_s``: before the norm, on the step number and whether a
rank is still writing (a rank that does not arrive, because it raised and lives on or hangs, is
named in a :class:`~gradstat.errors.PeerTimeoutError` on every rank that did, instead of a wait
in the norm's collective until the process group's timeout); after it, on the triggers, so a
snapshot is never partial because one rank decided otherwise. Ranks on different step numbers
take no snapshot and say so in one line.

When a trigger fires, every rank dumps its gradients (:func:`gradstat.snapshot.dump_rank`) on a
thread into ``.step-N.<attempt>-<k>.partial/``, and the step waits for it at most
``max_dump_s``; rank 0 then waits a bounded time for all rank files and renames the directory
to ``step-N``. A write that outlasts ``max_dump_s`` (a slow disk) is abandoned: training goes
on, the rank marks the directory, and it is never renamed, since its gradients change from then
on; triggers are skipped (all ranks agree) until the write is over. A snapshot that stays
``.partial`` (a rank killed, a write abandoned) never reads as complete: its rank files are
missing or it is hidden, and ``gradstat history`` skips it. Whatever fails on the writer thread
is one warning line; training goes on.

Resuming into the same directory (after a preemption): each Recorder is an attempt, with an id
rank 0 draws at construction and sends to every rank. Partial directories carry it, so a new
attempt never writes into an old one's; rank 0 removes the partial directories of earlier
attempts at construction (their ranks are gone: they can never complete) with one line. A
step that already has a snapshot (a restart replays steps, or a loop repeats a number) gets the
next free name, ``step-N.1``, ``step-N.2``, ..., so both are kept and each record points at its
own.

Retention: routine snapshots (``every``, ``step``) and triggered ones (``nonfinite``,
``spike``) are kept apart, the ``keep`` newest of each, newest by when they were written (not
by step number, which a resumed run repeats): a run of routine snapshots never pushes out the
spike that mattered. Before writing, when its kind already holds ``keep``, rank 0 removes the
oldest of that kind, so a disk that holds ``keep`` snapshots of each kind keeps recording. Each
snapshot holds a small ``.recorder.json`` (its triggers and when it was written); one without
(written by hand, or by an older gradstat) is classed by the triggers in its rank 0 file.

Triggers, each named in the snapshot's metadata: ``nonfinite`` (the norm is NaN or inf),
``spike`` (the norm is above ``spike`` times the median of the last ``window`` finite norms),
``step`` (a step the user listed), ``every`` (every N steps).
"""

from __future__ import annotations

import json
import math
import numbers
import os
import re
import secrets
import shutil
import statistics
import sys
import threading
import time
import types
from collections import deque
from collections.abc import Callable, Iterable, Mapping, Sequence
from contextlib import suppress
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from gradstat.clip_grads import check_norm_type, get_grad_norm_fp32, is_parameter, total_norm
from gradstat.core.groups import megatron_state, megatron_stats_groups, stats_device
from gradstat.core.kernels import combine_norms
from gradstat.core.predicates import (
    param_is_not_gtp_duplicate,
    param_is_not_shared,
    param_is_not_tensor_parallel_duplicate,
)
from gradstat.errors import ArgumentError, ArgumentTypeError, PeerTimeoutError, SnapshotError
from gradstat.snapshot.capture import dump_rank, gradients_to_dump, named_gradients
from gradstat.snapshot.format import FILE_PATTERN
from gradstat.snapshot.reader import open_rank_file

__all__ = ["ROUTINE_TRIGGERS", "TRIGGERS", "Recorder", "StepRecord", "complete_snapshots"]

TRIGGERS = ("nonfinite", "spike", "step", "every")
ROUTINE_TRIGGERS = frozenset({"step", "every"})  # the others mark a step that went wrong
_ABANDONED = ".abandoned-rank-{rank:05d}"
_COMPLETE = re.compile(r"^step-(\d+)(?:\.(\d+))?$")
_PARTIAL = re.compile(r"^\.step-\d+\.(?:([0-9a-f]+)-\d+\.)?partial$")
_MARKER = ".recorder.json"
_NAMED_MISSING = 8  # ranks named in a timeout message (and how many more)


@dataclass(frozen=True)
class StepRecord:
    """What the recorder saw at one step."""

    step: int
    norm: float
    triggers: tuple[str, ...]
    snapshot: Path | None  # where the step's snapshot lands (None: no trigger, or skipped)


def complete_snapshots(directory: str | os.PathLike[str]) -> list[tuple[int, Path]]:
    """The recorder's complete snapshots under ``directory`` as (step, path), in step order;
    a repeated step's later snapshots (``step-N.1``, ...) after its first."""
    found = []
    for path in Path(directory).iterdir():
        match = _COMPLETE.match(path.name)
        if match and path.is_dir():
            found.append((int(match.group(1)), int(match.group(2) or 0), path))
    return [(step, path) for step, _, path in sorted(found)]


def _counts_in_megatron(param: Any) -> bool:
    """Megatron's optimizer's filters, with its groups read from its parallel_state."""
    return (
        param_is_not_shared(param)
        and param_is_not_tensor_parallel_duplicate(param)
        and param_is_not_gtp_duplicate(param)
    )


def _warn(message: str) -> None:
    print(f"gradstat recorder: {message}", file=sys.stderr, flush=True)


def _is_gradient(item: Any) -> bool:
    """A tensor given as the gradient itself: one that is no parameter by the rule
    :func:`gradstat.total_norm` follows (:func:`gradstat.clip_grads.is_parameter`)."""
    return isinstance(item, torch.Tensor) and not is_parameter(item)


def _whole(name: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise ArgumentTypeError(f"{name} must be an integer, got {value!r}")
    return int(value)


def _count(name: str, value: Any) -> int:
    number = _whole(name, value)
    if number < 1:
        raise ArgumentError(f"{name} must be >= 1, got {number}")
    return number


def _seconds(name: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise ArgumentTypeError(f"{name} must be a number of seconds, got {value!r}")
    seconds = float(value)
    if not (math.isfinite(seconds) and seconds > 0):
        raise ArgumentError(f"{name} must be a finite number of seconds > 0, got {value!r}")
    return seconds


def step_number(step: Any) -> int:
    """``step`` as a non-negative int: an int or a 0-d integer tensor, nothing else.

    Raises:
        ArgumentTypeError: a float, a string, a bool, a float tensor or a tensor of more than
            one element (a float step would be recorded rounded down).
        ArgumentError: a negative step.
    """
    if isinstance(step, torch.Tensor):
        if step.numel() != 1 or step.dtype.is_floating_point or step.dtype.is_complex:
            raise ArgumentTypeError(
                f"step must be an integer or a one-element integer tensor, got {step!r}"
            )
        if step.dtype == torch.bool:
            raise ArgumentTypeError(f"step must be an integer, got {step!r}")
        number = int(step.item())
    else:
        number = _whole("step", step)
    if number < 0:
        raise ArgumentError(f"step must be >= 0, got {number}")
    return number


def _header_triggers(snapshot: Path) -> tuple[str, ...] | None:
    """The triggers in the rank 0 file's header, as the reader reads it; None if it cannot be
    read."""
    try:
        return open_rank_file(snapshot, FILE_PATTERN.format(rank=0)).header.triggers
    except SnapshotError:
        return None


def _kind_and_time(snapshot: Path) -> tuple[bool, int]:
    """Whether ``snapshot`` is routine, and when it was written (ns): from its marker, else
    from its rank 0 file (triggers unknown: kept as triggered, never pushed out by routine
    ones)."""
    try:
        marker = json.loads((snapshot / _MARKER).read_text())
        return set(marker["triggers"]) <= ROUTINE_TRIGGERS, int(marker["written_ns"])
    except (OSError, ValueError, KeyError, TypeError):
        pass
    triggers = _header_triggers(snapshot)
    try:
        written = snapshot.stat().st_mtime_ns
    except OSError:
        written = 0
    routine = triggers is not None and bool(triggers) and set(triggers) <= ROUTINE_TRIGGERS
    return routine, written


def _posted(work: dist.Work | None) -> dist.Work:
    assert work is not None, "every rank is in the recorder's group"
    return work


def _ready() -> bool:
    return dist.is_available() and dist.is_initialized()


class _Agreement:
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
        self.rank = dist.get_rank() if _ready() else 0
        self.size = dist.get_world_size() if _ready() else 1
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
        works = {
            src: _posted(dist.irecv(buffer, src=src, group=self.group))
            for src, buffer in received.items()
        }
        missing = []
        for src, work in works.items():
            remaining = max(deadline - time.monotonic(), 0.001)
            try:
                work.wait(timedelta(seconds=remaining))
            except RuntimeError:  # gloo: timed out, or the peer's connection closed
                missing.append(src)
        if missing:
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
        works = [
            _posted(dist.isend(message, dst=dst, group=self.group))
            for dst in range(1, self.size)
            if dst not in skip
        ]
        for work in works:
            with suppress(RuntimeError):  # a rank that left finds out at its own wait
                work.wait(timedelta(seconds=self.timeout_s))

    def _answer_from_zero(self, what: str, values: list[int], length: int) -> list[int]:
        values_tensor = torch.tensor(values, dtype=torch.int64)
        sent = _posted(dist.isend(values_tensor, dst=0, group=self.group))
        answer = torch.zeros(length, dtype=torch.int64)
        # Rank 0 may wait timeout_s for another rank before it answers.
        patience = 2 * self.timeout_s + self.grace_s
        try:
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


class Recorder:
    """Records the global gradient norm every step and dumps a snapshot when a trigger fires.

    Args:
        model: a module, a list of model chunks, or ``(name, tensor)`` pairs. A module or chunk
            list is walked again each step. In pairs, a Parameter, or a leaf tensor that
            requires grad or holds a ``.grad``, stands for its gradient; any other tensor is
            the gradient itself.
        directory: where the snapshots go, the same on every rank (``step-N`` inside).
        norm_type: 2, 1, ``math.inf`` or any finite p > 0.
        spike: dump when the norm exceeds this many times the running median (None: never).
        window: how many recent finite norms the median looks at.
        warmup: finite norms needed before ``spike`` can fire (at most ``window``).
        steps: steps to dump whatever the norm (non-negative integers).
        every: dump every this many steps (None: never).
        keep: snapshots kept on disk of each kind, routine (``every``, ``step``) and triggered
            (``nonfinite``, ``spike``), the oldest written removed first (>= 1).
        group: the group the norm is reduced over. None: Megatron's model-parallel group in a
            live Megatron job, else the torch-native default (see :func:`gradstat.total_norm`).
        grad_attr: "grad", "main_grad" or "decoupled_grad"; None: "main_grad" when any
            parameter has one (Megatron's DDP), else "grad".
        distributed_optimizer: the gradients are disjoint shards across data-parallel ranks
            (fragments named by hand); set for you with a distributed ``optimizer``.
        optimizer: Megatron's optimizer; with its distributed optimizer the recorder reads and
            dumps the fragments each rank owns (see :func:`gradstat.snapshot.dump_rank`).
            Needed when the model's DDP uses the distributed optimizer. The fragments are
            views of the gradient buffers Megatron allocates once: they are taken once, here.
        coords: coordinates for :func:`gradstat.snapshot.dump_rank`, when it cannot find them.
        mesh: a DeviceMesh for :func:`gradstat.snapshot.dump_rank`.
        finalize_timeout_s: how long rank 0 waits for the other ranks' files before leaving
            the snapshot incomplete with a one-line warning.
        max_dump_s: how long a step waits for its rank's dump (written on a thread); past
            that, training goes on, the snapshot is abandoned (never renamed complete) with a
            one-line warning, and triggers are skipped until the write is over.
        agree_timeout_s: how long a rank waits for the others at each of the recorder's
            agreements before a :class:`~gradstat.errors.PeerTimeoutError` names the ranks that
            did not come. Rank 0 exchanges with every rank, O(world size) small messages per
            agreement on a gloo group of the recorder's own; None: one all-reduce over the
            default group instead (NCCL's in a GPU job), unbounded and naming no one, for jobs
            of thousands of ranks.

    Raises:
        ArgumentError: an argument out of range (a ValueError).
        ArgumentTypeError: an argument of the wrong type (a TypeError).
        NormTypeError: a bad ``norm_type``.
        SnapshotError: the model's DDP uses the distributed optimizer and no distributed
            ``optimizer`` was given.
        PeerTimeoutError: a rank did not build its Recorder within ``agree_timeout_s``.
    """

    def __init__(
        self,
        model: torch.nn.Module | Sequence[torch.nn.Module] | Iterable[tuple[str, Any]],
        directory: str | os.PathLike[str],
        *,
        norm_type: float = 2.0,
        spike: float | None = 10.0,
        window: int = 20,
        warmup: int = 5,
        steps: Iterable[int] = (),
        every: int | None = None,
        keep: int = 3,
        group: dist.ProcessGroup | None = None,
        grad_attr: str | None = None,
        distributed_optimizer: bool = False,
        coords: Mapping[str, Sequence[int]] | None = None,
        mesh: Any = None,
        optimizer: Any = None,
        finalize_timeout_s: float = 60.0,
        max_dump_s: float = 120.0,
        agree_timeout_s: float | None = 300.0,
    ) -> None:
        if spike is not None:
            if isinstance(spike, bool) or not isinstance(spike, numbers.Real):
                raise ArgumentTypeError(
                    f"spike must be a number (a factor > 1) or None, got {spike!r}"
                )
            if not spike > 1.0:
                raise ArgumentError(f"spike must be a factor > 1, got {spike!r}")
        window, warmup, keep = (
            _count("window", window),
            _count("warmup", warmup),
            _count("keep", keep),
        )
        if warmup > window:
            raise ArgumentError(
                f"warmup={warmup} is more than window={window}: the median of {window} norms "
                f"never holds {warmup}, so spike could never fire; make warmup <= window"
            )
        if every is not None:
            every = _count("every", every)
        if isinstance(steps, str | bytes) or not isinstance(steps, Iterable):
            raise ArgumentTypeError(f"steps must be a list of integers, got {steps!r}")
        listed = frozenset(step_number(step) for step in steps)
        self.finalize_timeout_s = _seconds("finalize_timeout_s", finalize_timeout_s)
        self.max_dump_s = _seconds("max_dump_s", max_dump_s)
        if agree_timeout_s is not None:
            agree_timeout_s = _seconds("agree_timeout_s", agree_timeout_s)
        self.norm_type = check_norm_type(norm_type)
        if isinstance(model, torch.nn.Module):
            self._modules: list[torch.nn.Module] | None = [model]
        elif (
            isinstance(model, Sequence)
            and model
            and all(isinstance(item, torch.nn.Module) for item in model)
        ):
            self._modules = list(model)
        else:
            self._modules = None
        # Pairs may come as a generator: read them once.
        given: Any = model
        if self._modules is None and not isinstance(model, torch.nn.Module):
            given = list(model)
        pairs, self.grad_attr, self.distributed_optimizer = gradients_to_dump(
            given, optimizer, grad_attr, distributed_optimizer
        )
        if self.distributed_optimizer and optimizer is not None:
            self._modules = None  # fragments of buffers allocated once: fixed
        self._pairs = pairs
        self.directory = Path(directory)
        self.spike, self.warmup = spike, warmup
        self.steps, self.every, self.keep = listed, every, keep
        self.group = group
        self.coords, self.mesh = coords, mesh
        self._writer: threading.Thread | None = None
        self._writing: int | None = None
        self._dumps = 0
        self._said_mismatch = False
        self.history: deque[float] = deque(maxlen=window)
        self.records: list[StepRecord] = []
        self._agreement = _Agreement(agree_timeout_s, self.max_dump_s)
        _, attempt = self._agreement.exchange("construction", [0], lambda _: [self._begin()], 1)
        self.attempt = f"{attempt:010x}"

    @property
    def pairs(self) -> list[tuple[str, Any]]:
        """The ``(name, param)`` pairs as they are now (a module is walked again)."""
        if self._modules is None:
            return self._pairs
        return named_gradients(self._modules)

    def _items(self) -> list[Any]:
        """The parameters (or given gradients) as they are now, without names (names cost a
        walk of the modules' paths; only a dump needs them)."""
        if self._modules is None:
            return [item for _, item in self._pairs]
        if len(self._modules) == 1:
            return list(self._modules[0].parameters())
        return [param for module in self._modules for param in module.parameters()]

    def _gradient(self, item: Any) -> Any:
        return item if _is_gradient(item) else getattr(item, self.grad_attr, None)

    def norm(self) -> float:
        """The global norm of the gradients as they are now (a collective: every rank calls)."""
        items = self._items()
        megatron = megatron_state()
        if megatron is None:
            if self.grad_attr == "grad":
                # Parameters go as they are (total_norm reads their attributes and .grad).
                given = [
                    item if isinstance(item, torch.nn.Parameter) else self._gradient(item)
                    for item in items
                ]
                return total_norm(
                    [item for item in given if item is not None], self.norm_type, group=self.group
                )
            held = [self._gradient(item) for item in items]
            present = [grad for grad in held if grad is not None]
            return total_norm(present, self.norm_type, group=self.group)
        # Megatron: the gradients its optimizer counts. Distributed-optimizer fragments hold
        # each element once across the job; whole gradients are reduced as its plain optimizers
        # reduce them, the dense ones over the model-parallel group and the expert ones over
        # the expert group (a replica of the data-parallel axes holds the same numbers), and
        # the two norms combined as its ChainedOptimizer combines them.
        counted = [
            item for item in items if self._gradient(item) is not None and _counts_in_megatron(item)
        ]
        if self.group is not None or self.distributed_optimizer:
            grads = [self._gradient(item) for item in counted]
            return get_grad_norm_fp32(grads, self.norm_type, self.group or dist.group.WORLD)
        norms = []
        for expert, group in zip((False, True), megatron_stats_groups(megatron), strict=True):
            grads = [
                self._gradient(item)
                for item in counted
                if (not getattr(item, "allreduce", True)) == expert
            ]
            norms.append(get_grad_norm_fp32(grads, self.norm_type, group))
        return combine_norms(norms, self.norm_type)

    def step(self, step: int | torch.Tensor) -> float:
        """Record ``step``: compute the norm, check the triggers, dump if one fires.

        Call it on every rank after backward (and the gradient reduction) and before the
        optimizer step. Returns the norm, the same on every rank, which the loop may clip with.

        Raises:
            ArgumentTypeError, ArgumentError: a step that is not a non-negative integer.
            PeerTimeoutError: a rank did not reach this step within ``agree_timeout_s``.
        """
        number = step_number(step)
        busy = self._writer is not None and self._writer.is_alive()
        # Before the norm, whose collective would wait for a missing rank without a bound.
        top, negative_low, anyone_busy = self._agreement.exchange(
            f"step {number}", [number, -number, int(busy)]
        )
        low = -negative_low
        norm = self.norm()
        agreed = low == top and not anyone_busy

        def decide(fired: list[int]) -> list[int]:
            names = tuple(name for name, on in zip(TRIGGERS, fired, strict=True) if on)
            if not (names and agreed):
                return [-1]
            try:
                return [self._prepare(number, names)]
            except Exception as error:  # the others wait for this answer: never leave them
                _warn(f"step {number}: cannot prepare the snapshot ({error}); it is skipped")
                return [-1]

        flags = [int(flag) for flag in self._triggers(number, norm)]
        *fired, repeat = self._agreement.exchange(f"step {number}", flags, decide, 1)
        triggers = tuple(name for name, on in zip(TRIGGERS, fired, strict=True) if on)
        if math.isfinite(norm):
            self.history.append(norm)
        if low != top and not self._said_mismatch:
            self._said_mismatch = True
            _warn(
                f"the ranks are on different steps (from {low} to {top}; this rank at "
                f"{number}): no snapshot is taken while they differ (is step counted the same "
                f"way on every rank?)"
            )
        elif low == top:
            self._said_mismatch = False
        snapshot = None
        if triggers and low != top:
            _warn(f"step {number} ({', '.join(triggers)}): ranks on steps {low} to {top}; skipped")
        elif triggers and anyone_busy:
            _warn(
                f"step {number} ({', '.join(triggers)}): a rank is still writing the snapshot "
                f"of step {self._writing}; this one is skipped"
            )
        elif triggers and repeat >= 0:
            snapshot = self._dump(number, triggers, repeat)
        self.records.append(StepRecord(number, norm, triggers, snapshot))
        return norm

    def _triggers(self, step: int, norm: float) -> list[bool]:
        spiked = False
        if self.spike is not None and len(self.history) >= self.warmup and math.isfinite(norm):
            spiked = norm > self.spike * statistics.median(self.history)
        every = self.every is not None and step % self.every == 0
        return [not math.isfinite(norm), spiked, step in self.steps, every]

    # --- rank 0's decisions, made before any rank writes --------------------------------------

    def _begin(self) -> int:
        """Rank 0 at construction: draw this attempt's id, remove earlier attempts' partial
        snapshots (their ranks are gone: they can never complete)."""
        attempt = secrets.randbits(40)
        try:
            leftovers = sorted(
                path for path in self.directory.iterdir() if _PARTIAL.match(path.name)
            )
        except OSError:
            return attempt  # no directory yet
        for path in leftovers:
            shutil.rmtree(path, ignore_errors=True)
        if leftovers:
            _warn(
                f"{self.directory}: removed {len(leftovers)} incomplete snapshot(s) of an "
                f"earlier run ({', '.join(path.name for path in leftovers[:3])}"
                f"{', ...' if len(leftovers) > 3 else ''})"
            )
        return attempt

    def _prepare(self, step: int, triggers: tuple[str, ...]) -> int:
        """Rank 0, before the others write: make room for the snapshot (the oldest of its kind
        goes when the kind holds ``keep``) and pick its free name (its repeat index)."""
        routine = set(triggers) <= ROUTINE_TRIGGERS
        try:
            self._trim(routine, self.keep - 1)
        except OSError as error:
            _warn(f"step {step}: cannot remove old snapshots ({error}); training goes on")
        repeat = 0
        while self._final(step, repeat).exists():
            repeat += 1
        return repeat

    def _final(self, step: int, repeat: int) -> Path:
        suffix = f".{repeat}" if repeat else ""
        return self.directory / f"step-{step:08d}{suffix}"

    def _trim(self, routine: bool, bound: int) -> None:
        """Remove the oldest-written complete snapshots of one kind beyond ``bound``."""
        if not self.directory.is_dir():
            return
        same_kind = []
        for _, path in complete_snapshots(self.directory):
            kind, written = _kind_and_time(path)
            if kind == routine:
                same_kind.append((written, path.name, path))
        same_kind.sort()
        for _, _, path in same_kind[: max(0, len(same_kind) - bound)]:
            shutil.rmtree(path, ignore_errors=True)

    # --- the dump ----------------------------------------------------------------------------

    def _dump(self, step: int, triggers: tuple[str, ...], repeat: int) -> Path | None:
        """Write this rank's file (rank 0 then finalizes) on a thread, and wait for it at most
        ``max_dump_s``: past that, training goes on and the snapshot is abandoned, marked so
        that it is never renamed complete (its gradients change from here on)."""
        self._dumps += 1
        self._agreement.grace_s = self.max_dump_s  # the next agreement waits for this dump too
        final = self._final(step, repeat)
        partial = self.directory / f".step-{step:08d}.{self.attempt}-{self._dumps}.partial"
        rank, world_size = self._agreement.rank, self._agreement.size
        pairs = self._dumped_pairs()

        def write() -> None:
            try:
                dump_rank(
                    partial,
                    pairs,
                    step=step,
                    grad_attr=self.grad_attr,
                    distributed_optimizer=self.distributed_optimizer,
                    coords=self.coords,
                    mesh=self.mesh,
                    triggers=triggers,
                    empty_ok=True,  # a rank without gradients still completes the snapshot
                )
                if rank == 0 and self._wait_for_all(partial, world_size):
                    if any(partial.glob(".abandoned-rank-*")):
                        return  # a rank gave up waiting for its write: its file may be torn
                    marker = {"triggers": list(triggers), "written_ns": time.time_ns()}
                    (partial / _MARKER).write_text(json.dumps(marker))
                    os.rename(partial, final)
                    self._trim(set(triggers) <= ROUTINE_TRIGGERS, self.keep)
            except Exception as error:  # a thread's traceback would be lost in the job's log
                _warn(f"step {step}: rank {rank} could not dump ({error}); training goes on")

        self._writer = threading.Thread(target=write, name=f"gradstat-dump-{step}", daemon=True)
        self._writing = step
        self._writer.start()
        self._writer.join(self.max_dump_s)
        if self._writer.is_alive():
            partial.mkdir(parents=True, exist_ok=True)
            (partial / _ABANDONED.format(rank=rank)).touch()
            _warn(
                f"step {step}: rank {rank} still writing after {self.max_dump_s:g} s (a slow "
                f"disk?); training goes on and {partial.name} stays incomplete"
            )
            return None
        return final if rank != 0 or final.exists() else None

    def _dumped_pairs(self) -> list[tuple[str, Any]]:
        """The named parameters to dump; a tensor given as the gradient is held as one."""
        held = []
        for name, item in self.pairs:
            if _is_gradient(item):
                item = types.SimpleNamespace(**{self.grad_attr: item}, shape=item.shape)
            held.append((name, item))
        return held

    def _wait_for_all(self, partial: Path, world_size: int) -> bool:
        deadline = time.monotonic() + self.finalize_timeout_s
        expected = [partial / FILE_PATTERN.format(rank=rank) for rank in range(world_size)]
        while True:
            present = sum(path.exists() for path in expected)
            if present == world_size:
                return True
            if time.monotonic() >= deadline:
                _warn(
                    f"{partial}: {present} of {world_size} rank files after "
                    f"{self.finalize_timeout_s:g} s; the snapshot stays incomplete "
                    f"(a rank was lost, or the disk is slow); training goes on"
                )
                return False
            time.sleep(0.05)

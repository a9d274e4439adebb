"""A flight recorder for the training loop: the exact global norm every step, a full snapshot
when a step goes wrong.

Two lines in a loop, after backward and before the optimizer step::

    recorder = gradstat.Recorder(model, "dumps/", spike=10.0, keep=3)
    ...
    norm = recorder.step(step)  # the exact global norm; clip with it if you like

Every step the recorder computes the norm with gradstat's core (:func:`gradstat.total_norm` for
torch-native jobs; in a live Megatron job, Megatron's selection and
:func:`gradstat.get_grad_norm_fp32` over its model-parallel group), checks its triggers, and all
ranks agree on them with one all-reduce of four integers, so a snapshot is never partial because
one rank decided otherwise. When a trigger fires, every rank dumps its gradients
(:func:`gradstat.snapshot.dump_rank`) into ``.step-N.partial/`` on a thread, and the step waits
for it at most ``max_dump_s``; rank 0 then waits a bounded time for all rank files and renames
the directory to ``step-N``. A write that outlasts ``max_dump_s`` (a slow disk) is abandoned:
training goes on, the rank marks the directory, and it is never renamed, since its gradients
change from then on; triggers are skipped (all ranks agree) until the write is over. A snapshot
that stays ``.partial`` (a rank killed, a write abandoned) never reads as complete: its rank
files are missing or it is hidden, and ``gradstat history`` skips it. Rank 0 keeps the ``keep``
newest complete snapshots.

Triggers, each named in the snapshot's metadata: ``nonfinite`` (the norm is NaN or inf),
``spike`` (the norm is above ``spike`` times the median of the last ``window`` finite norms),
``step`` (a step the user listed), ``every`` (every N steps).
"""

from __future__ import annotations

import math
import os
import re
import shutil
import statistics
import sys
import threading
import time
from collections import deque
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from gradstat.clip_grads import check_norm_type, get_grad_norm_fp32, total_norm
from gradstat.core.groups import megatron_state, megatron_stats_groups, stats_device
from gradstat.core.kernels import combine_norms
from gradstat.core.predicates import (
    param_is_not_gtp_duplicate,
    param_is_not_shared,
    param_is_not_tensor_parallel_duplicate,
)
from gradstat.errors import GradstatError
from gradstat.snapshot.capture import dump_rank, gradients_to_dump
from gradstat.snapshot.format import FILE_PATTERN

__all__ = ["TRIGGERS", "Recorder", "StepRecord", "complete_snapshots"]

TRIGGERS = ("nonfinite", "spike", "step", "every")
_ABANDONED = ".abandoned-rank-{rank:05d}"
_COMPLETE = re.compile(r"^step-(\d+)$")


@dataclass(frozen=True)
class StepRecord:
    """What the recorder saw at one step."""

    step: int
    norm: float
    triggers: tuple[str, ...]
    snapshot: Path | None  # where the step's snapshot lands (None: no trigger, or skipped)


def complete_snapshots(directory: str | os.PathLike[str]) -> list[tuple[int, Path]]:
    """The recorder's complete snapshots under ``directory`` as (step, path), oldest first."""
    found = []
    for path in Path(directory).iterdir():
        match = _COMPLETE.match(path.name)
        if match and path.is_dir():
            found.append((int(match.group(1)), path))
    return sorted(found)


def _counts_in_megatron(param: Any) -> bool:
    """Megatron's optimizer's filters, with its groups read from its parallel_state."""
    return (
        param_is_not_shared(param)
        and param_is_not_tensor_parallel_duplicate(param)
        and param_is_not_gtp_duplicate(param)
    )


def _warn(message: str) -> None:
    print(f"gradstat recorder: {message}", file=sys.stderr, flush=True)


class Recorder:
    """Records the global gradient norm every step and dumps a snapshot when a trigger fires.

    Args:
        model: a module, a list of model chunks, or ``(name, param)`` pairs.
        directory: where the snapshots go, the same on every rank (``step-N`` inside).
        norm_type: 2, 1, ``math.inf`` or any finite p > 0.
        spike: dump when the norm exceeds this many times the running median (None: never).
        window: how many recent finite norms the median looks at.
        warmup: finite norms needed before ``spike`` can fire.
        steps: steps to dump whatever the norm.
        every: dump every this many steps (None: never).
        keep: complete snapshots kept on disk, the oldest deleted first (>= 1).
        group: the group the norm is reduced over. None: Megatron's model-parallel group in a
            live Megatron job, else the torch-native default (see :func:`gradstat.total_norm`).
        grad_attr: "grad", "main_grad" or "decoupled_grad"; None: "main_grad" when any
            parameter has one (Megatron's DDP), else "grad".
        distributed_optimizer: the gradients are disjoint shards across data-parallel ranks
            (fragments named by hand); set for you with a distributed ``optimizer``.
        optimizer: Megatron's optimizer; with its distributed optimizer the recorder reads and
            dumps the fragments each rank owns (see :func:`gradstat.snapshot.dump_rank`).
            Needed when the model's DDP uses the distributed optimizer. The fragments are
            views of the gradient buffers Megatron allocates once.
        coords: coordinates for :func:`gradstat.snapshot.dump_rank`, when it cannot find them.
        mesh: a DeviceMesh for :func:`gradstat.snapshot.dump_rank`.
        finalize_timeout_s: how long rank 0 waits for the other ranks' files before leaving
            the snapshot incomplete with a one-line warning.
        max_dump_s: how long a step waits for its rank's dump (written on a thread); past
            that, training goes on, the snapshot is abandoned (never renamed complete) with a
            one-line warning, and triggers are skipped until the write is over.

    Raises:
        ValueError: bad arguments.
        SnapshotError: the model's DDP uses the distributed optimizer and no distributed
            ``optimizer`` was given.
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
    ) -> None:
        if spike is not None and not spike > 1.0:
            raise ValueError(f"spike must be a factor > 1, got {spike!r}")
        if window < 1 or warmup < 1 or keep < 1 or (every is not None and every < 1):
            raise ValueError("window, warmup, keep and every must be >= 1")
        if not (finalize_timeout_s > 0 and max_dump_s > 0):
            raise ValueError("finalize_timeout_s and max_dump_s must be > 0")
        self.pairs, self.grad_attr, self.distributed_optimizer = gradients_to_dump(
            model, optimizer, grad_attr, distributed_optimizer
        )
        self.directory = Path(directory)
        self.norm_type = check_norm_type(norm_type)
        self.spike, self.warmup = spike, warmup
        self.steps, self.every, self.keep = frozenset(steps), every, keep
        self.group = group
        self.coords, self.mesh = coords, mesh
        self.finalize_timeout_s, self.max_dump_s = finalize_timeout_s, max_dump_s
        self._writer: threading.Thread | None = None
        self._writing: int | None = None
        self.history: deque[float] = deque(maxlen=window)
        self.records: list[StepRecord] = []

    def norm(self) -> float:
        """The global norm of the gradients as they are now (a collective: every rank calls)."""
        params = [param for _, param in self.pairs]
        megatron = megatron_state()
        if megatron is None:
            if self.grad_attr == "grad":
                return total_norm(params, self.norm_type, group=self.group)
            held = [getattr(param, self.grad_attr, None) for param in params]
            present = [grad for grad in held if grad is not None]
            return total_norm(present, self.norm_type, group=self.group)
        # Megatron: the gradients its optimizer counts. Distributed-optimizer fragments hold
        # each element once across the job; whole gradients are reduced as its plain optimizers
        # reduce them, the dense ones over the model-parallel group and the expert ones over
        # the expert group (a replica of the data-parallel axes holds the same numbers), and
        # the two norms combined as its ChainedOptimizer combines them.
        counted = [
            param
            for param in params
            if getattr(param, self.grad_attr, None) is not None and _counts_in_megatron(param)
        ]
        if self.group is not None or self.distributed_optimizer:
            grads = [getattr(param, self.grad_attr) for param in counted]
            return get_grad_norm_fp32(grads, self.norm_type, self.group or dist.group.WORLD)
        norms = []
        for expert, group in zip((False, True), megatron_stats_groups(megatron), strict=True):
            grads = [
                getattr(param, self.grad_attr)
                for param in counted
                if (not getattr(param, "allreduce", True)) == expert
            ]
            norms.append(get_grad_norm_fp32(grads, self.norm_type, group))
        return combine_norms(norms, self.norm_type)

    def step(self, step: int | torch.Tensor) -> float:
        """Record ``step``: compute the norm, check the triggers, dump if one fires.

        Call it on every rank after backward (and the gradient reduction) and before the
        optimizer step. Returns the norm, the same on every rank, which the loop may clip with.
        """
        number = int(step.item()) if isinstance(step, torch.Tensor) else int(step)
        norm = self.norm()
        busy = self._writer is not None and self._writer.is_alive()
        *wanted, anyone_busy = self._agree([*self._triggers(number, norm), busy])
        triggers = tuple(name for name, on in zip(TRIGGERS, wanted, strict=True) if on)
        if math.isfinite(norm):
            self.history.append(norm)
        snapshot = None
        if triggers and anyone_busy:
            _warn(
                f"step {number} ({', '.join(triggers)}): a rank is still writing the snapshot "
                f"of step {self._writing}; this one is skipped"
            )
        elif triggers:
            snapshot = self._dump(number, triggers)
        self.records.append(StepRecord(number, norm, triggers, snapshot))
        return norm

    def _triggers(self, step: int, norm: float) -> list[bool]:
        spiked = False
        if self.spike is not None and len(self.history) >= self.warmup and math.isfinite(norm):
            spiked = norm > self.spike * statistics.median(self.history)
        every = self.every is not None and step % self.every == 0
        return [not math.isfinite(norm), spiked, step in self.steps, every]

    def _agree(self, flags: list[bool]) -> list[bool]:
        """Every rank takes a trigger any rank saw, and knows whether any rank is still writing:
        one all-reduce of five integers."""
        if not (dist.is_available() and dist.is_initialized()):
            return flags
        device = stats_device([], None)
        tensor = torch.tensor([int(flag) for flag in flags], dtype=torch.int64, device=device)
        dist.all_reduce(tensor, op=dist.ReduceOp.MAX)
        return [bool(value) for value in tensor.tolist()]

    def _dump(self, step: int, triggers: tuple[str, ...]) -> Path | None:
        """Write this rank's file (rank 0 then finalizes) on a thread, and wait for it at most
        ``max_dump_s``: past that, training goes on and the snapshot is abandoned, marked so
        that it is never renamed complete (its gradients change from here on)."""
        final = self.directory / f"step-{step:08d}"
        partial = self.directory / f".step-{step:08d}.partial"
        rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
        world_size = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1

        def write() -> None:
            try:
                dump_rank(
                    partial,
                    self.pairs,
                    step=step,
                    grad_attr=self.grad_attr,
                    distributed_optimizer=self.distributed_optimizer,
                    coords=self.coords,
                    mesh=self.mesh,
                    triggers=triggers,
                )
            except (GradstatError, OSError, ValueError) as error:
                _warn(f"step {step}: rank {rank} could not dump ({error}); training goes on")
                return
            if rank == 0 and self._wait_for_all(partial, world_size):
                if any(partial.glob(".abandoned-rank-*")):
                    return  # a rank gave up waiting for its write: its file may be torn
                os.replace(partial, final)
                self._retain()

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

    def _retain(self) -> None:
        complete = complete_snapshots(self.directory)
        for _, path in complete[: max(0, len(complete) - self.keep)]:
            shutil.rmtree(path, ignore_errors=True)

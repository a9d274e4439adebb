"""The Recorder: each step the exact global norm, per-parameter statistics into the run's log,
and a full snapshot when a trigger fires (the package's docstring tells the whole story)."""

from __future__ import annotations

import math
import os
import struct
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from gradstat._collector import collector_paused
from gradstat.clip_grads import check_norm_type
from gradstat.core.groups import HeldGroup, megatron_state
from gradstat.errors import ArgumentError, GradstatError
from gradstat.recorder.agreement import Agreement
from gradstat.recorder.arguments import (
    count,
    logged_value,
    patterns,
    seconds,
    spike_factor,
    step_number,
    step_set,
    tolerance,
)
from gradstat.recorder.log import LogWriter, step_payload
from gradstat.recorder.messages import warn
from gradstat.recorder.model import Gradients
from gradstat.recorder.snapshots import Snapshots
from gradstat.recorder.telemetry import Layout, ParamsAtStep, Telemetry
from gradstat.recorder.triggers import TRIGGERS, Triggers
from gradstat.snapshot.capture import job_coords

__all__ = ["Recorder", "StepRecord"]

# The agreement before the norm: the step (max, and min negated), a rank still writing, a rank
# whose parameters (or gradients present) changed, the logged norm's bits (max, min negated)
# and whether one was given.
_BEFORE = (
    "top",
    "low",
    "busy",
    "changed",
    "logged_top",
    "logged_low",
    "given_top",
    "given_low",
)
_TELEMETRY_RTOL = 1e-6  # per-parameter squares against the recorder's norm
# The norm is taken from the per-parameter sums once both ways agreed for the parameters as
# they are, and computed both ways again every this many recorded steps.
_CHECK_EVERY = 100


@dataclass(frozen=True)
class StepRecord:
    """What the recorder saw at one step."""

    step: int
    norm: float
    triggers: tuple[str, ...]
    snapshot: Path | None  # where the step's snapshot lands (None: no trigger, or skipped)
    logged_norm: float | None = None  # what the job passed as logged_norm


def _check_coords(coords: Mapping[str, Sequence[int]] | None, mesh: Any) -> None:
    """Refuse coordinates every snapshot would refuse, at construction, not at each dump."""
    if mesh is not None and not getattr(mesh, "mesh_dim_names", None):
        raise ArgumentError(
            "mesh= needs mesh_dim_names (init_device_mesh(..., mesh_dim_names=(...))): they "
            "name the snapshot's parallel axes"
        )
    if coords is None:
        return
    try:
        job_coords(coords, mesh)
    except (TypeError, ValueError) as error:
        raise ArgumentError(f"coords={dict(coords)!r}: {error}") from error


def _close(a: float, b: float) -> bool:
    return abs(a - b) <= _TELEMETRY_RTOL * max(a, b)


def _bits(value: float) -> int:
    """A norm (>= 0, or a positive NaN) as an int64 whose order is the float's."""
    return int(struct.unpack("<q", struct.pack("<d", value))[0])


def _from_bits(bits: int) -> float:
    return float(struct.unpack("<d", struct.pack("<q", bits))[0])


def _logged_range(before: dict[str, int]) -> tuple[float, float]:
    """The lowest and highest logged norm the ranks passed (from the agreed bits)."""
    return _from_bits(-before["logged_low"]), _from_bits(before["logged_top"])


class Recorder:
    """Records the global gradient norm every step, per-parameter statistics into the run's
    telemetry log, and dumps a snapshot when a trigger fires.

    Args:
        model: a module, a list of model chunks, or ``(name, tensor)`` pairs. A module or chunk
            list is walked again each step. In pairs, a Parameter, or a leaf tensor that
            requires grad or holds a ``.grad``, stands for its gradient; any other tensor is
            the gradient itself.
        directory: the run directory, the same on every rank: ``step-N`` snapshots and the
            telemetry log (``telemetry.gslog``) inside.
        norm_type: 2, 1, ``math.inf`` or any finite p > 0.
        spike: dump when the norm exceeds this many times the running median (None: never).
        window: how many recent finite norms the median looks at.
        warmup: finite norms needed before ``spike`` can fire (at most ``window``).
        steps: steps to dump whatever the norm (non-negative integers).
        every: dump every this many steps (None: never).
        keep: snapshots kept on disk of each kind, routine (``every``, ``step``) and each
            trigger (``nonfinite``, ``spike``, ``mismatch``), the oldest written removed first
            (>= 1); a snapshot of several triggers stays while one of its kinds keeps it.
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
        telemetry_every: per-parameter statistics (L2 norm, max |x|, zeros, NaN, Inf) every
            this many steps, into the log; None: the log holds the norm of each step only.
        telemetry_groups: regular expressions; a parameter whose name one matches (the first,
            searched) is recorded under the matched text, so that ``r"layers\\.\\d+"`` records
            one row per layer (16 bytes per row and step).
        logged_rtol: how far (relative) the ``logged_norm`` given to :meth:`step` may be from
            the exact norm before the ``mismatch`` trigger fires.

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
        telemetry_every: int | None = 1,
        telemetry_groups: Sequence[str] = (),
        logged_rtol: float = 1e-3,
    ) -> None:
        spike = spike_factor("spike", spike)
        window, warmup, keep = count("window", window), count("warmup", warmup), count("keep", keep)
        if warmup > window:
            raise ArgumentError(
                f"warmup={warmup} is more than window={window}: the median of {window} norms "
                f"never holds {warmup}, so spike could never fire; make warmup <= window"
            )
        if every is not None:
            every = count("every", every)
        if telemetry_every is not None:
            telemetry_every = count("telemetry_every", telemetry_every)
        listed = step_set("steps", steps)
        groups = patterns("telemetry_groups", telemetry_groups)
        finalize_timeout_s = seconds("finalize_timeout_s", finalize_timeout_s)
        max_dump_s = seconds("max_dump_s", max_dump_s)
        if agree_timeout_s is not None:
            agree_timeout_s = seconds("agree_timeout_s", agree_timeout_s)
        logged_rtol = tolerance("logged_rtol", logged_rtol)
        self.norm_type = check_norm_type(norm_type)
        _check_coords(coords, mesh)
        self._gradients = Gradients(model, optimizer, grad_attr, distributed_optimizer)
        self.grad_attr = self._gradients.grad_attr
        self.distributed_optimizer = self._gradients.distributed_optimizer
        self.directory = Path(directory)
        self._group = HeldGroup(group, "Recorder")
        self.records: list[StepRecord] = []
        self.params: ParamsAtStep | None = None  # the latest per-parameter statistics
        self._triggers = Triggers(spike, window, warmup, listed, every, logged_rtol)
        self._agreement = Agreement(agree_timeout_s, max_dump_s)
        rank, size = self._agreement.rank, self._agreement.size
        self._snapshots = Snapshots(
            self.directory, keep, finalize_timeout_s, max_dump_s, rank, size
        )
        self._telemetry = None
        if telemetry_every is not None:
            self._telemetry = Telemetry(
                self._gradients,
                self.directory,
                telemetry_every,
                groups,
                coords,
                mesh,
                self._agreement.group,
            )
        self._dump_options = {
            "grad_attr": self.grad_attr,
            "distributed_optimizer": self.distributed_optimizer,
            "coords": coords,
            "mesh": mesh,
        }
        self._said_steps_differ = False
        self._said_totals_differ = False
        self._said_no_norm = False
        self._measured = 0  # recorded steps with per-parameter statistics
        self._verified = -1  # the telemetry's version for which both norms agreed
        _, attempt = self._agreement.exchange(
            "construction", [0], lambda _: [self._snapshots.begin()], 1
        )
        self.attempt = self._snapshots.attempt = f"{attempt:010x}"
        self._log = None
        self._layout_numel: tuple[Layout, tuple[int, ...]] | None = None
        if rank == 0:
            start = {
                "attempt": self.attempt,
                "time_ns": time.time_ns(),
                "norm_type": self.norm_type if math.isfinite(self.norm_type) else "inf",
                "world_size": size,
                "every": telemetry_every,
                "groups": list(groups),
            }
            self._log = LogWriter(self.directory, start)

    @property
    def group(self) -> dist.ProcessGroup | None:
        """The group the norm is reduced over, as given; held weakly (see ``HeldGroup``)."""
        return self._group()

    @property
    def steps(self) -> frozenset[int]:
        """The steps to dump whatever the norm; may be set (the same on every rank)."""
        return self._triggers.steps

    @steps.setter
    def steps(self, steps: Iterable[int]) -> None:
        self._triggers.steps = step_set("steps", steps)

    @property
    def pairs(self) -> list[tuple[str, Any]]:
        """The ``(name, param)`` pairs as they are now (a module is walked again)."""
        return self._gradients.pairs

    def norm(self) -> float:
        """The global norm of the gradients as they are now (a collective: every rank calls)."""
        return self._gradients.norm(self.norm_type, self.group)

    def wait(self, timeout_s: float | None = None) -> None:
        """Wait for this rank's latest snapshot write (at most ``timeout_s``)."""
        self._snapshots.join(timeout_s)

    def step(
        self, step: int | torch.Tensor, logged_norm: float | torch.Tensor | None = None
    ) -> float:
        """Record ``step``: compute the norm (and the per-parameter statistics, when due), check
        the triggers, dump if one fires, append the step to the log.

        Call it on every rank after backward (and the gradient reduction) and before the
        optimizer step. Returns the norm, the same on every rank, which the loop may clip with.

        Args:
            step: the training step, a non-negative int or one-element integer tensor.
            logged_norm: the norm the framework computed (and will log and clip with), the
                same on every rank; the ``mismatch`` trigger fires where it is not the exact
                norm within ``logged_rtol``, or where the ranks passed different values.

        Raises:
            ArgumentTypeError, ArgumentError: a step that is not a non-negative integer, a
                logged norm that is not a number >= 0.
            PeerTimeoutError: a rank did not reach this step within ``agree_timeout_s``.
        """
        with collector_paused():  # a step makes objects by the gradient (see gradstat._collector)
            return self._step(step, logged_norm)

    def _step(self, step: int | torch.Tensor, logged_norm: float | torch.Tensor | None) -> float:
        number = step_number(step)
        logged = logged_value(logged_norm)
        telemetry = self._telemetry
        bits = -1 if logged is None else _bits(logged)
        given = int(logged is not None)
        items = self._gradients.items()  # the model walked once this step
        changed = telemetry is not None and telemetry.changed(items)
        # Before the norm, whose collective would wait for a missing rank without a bound.
        values = [number, -number, int(self._snapshots.busy), int(changed)]
        before = dict(
            zip(
                _BEFORE,
                self._agreement.exchange(f"step {number}", [*values, bits, -bits, given, -given]),
                strict=True,
            )
        )
        low, top = -before["low"], before["top"]
        steps_agree = low == top
        if telemetry is not None and before["changed"]:
            telemetry.agree(items)
        due = telemetry is not None and steps_agree and telemetry.due(number)
        try:
            norm, params = self._norm_and_params(number, items, due)
        except GradstatError as error:  # raised on every rank together: all take this way
            return self._without_norm(number, logged, error)
        self._said_no_norm = False
        mismatch, why = self._mismatch(norm, logged, before)
        agreed = steps_agree and not before["busy"]

        def decide(fired: list[int]) -> list[int]:
            names = tuple(name for name, on in zip(TRIGGERS, fired, strict=True) if on)
            if not (names and agreed):
                return [-1]
            try:
                return [self._snapshots.prepare(number, names)]
            except Exception as error:  # the others wait for this answer: never leave them
                warn(f"step {number}: cannot prepare the snapshot ({error}); it is skipped")
                return [-1]

        flags = [int(flag) for flag in self._triggers.fired(number, norm, mismatch)]
        *fired, repeat = self._agreement.exchange(f"step {number}", flags, decide, 1)
        triggers = tuple(name for name, on in zip(TRIGGERS, fired, strict=True) if on)
        self._triggers.after(norm, mismatch)
        explained = None
        if "mismatch" in triggers and self._agreement.rank == 0:
            warn(f"step {number}: {why}")
            lowest, highest = _logged_range(before)
            if logged is not None and not self._triggers.disagrees(lowest, highest):
                explained = self._explainer(number, highest)
        snapshot = self._snapshot(
            number, triggers, repeat, (low, top, before["busy"]), explained, norm
        )
        self.records.append(StepRecord(number, norm, triggers, snapshot, logged))
        if self._log is not None:
            mask = sum(1 << TRIGGERS.index(name) for name in triggers)
            written = repeat if triggers and repeat >= 0 else -1
            payload = step_payload(number, norm, logged, mask, written, params)
            self._log.step(payload, params is not None)
        return norm

    def _without_norm(self, number: int, logged: float | None, error: GradstatError) -> float:
        """A step whose gradients give no norm (a Partial DTensor, a meta gradient): said once
        until a step has one again, recorded with a NaN norm and no trigger, and the job goes
        on (the recorder never stops it)."""
        if not self._said_no_norm:
            self._said_no_norm = True
            warn(
                f"step {number}: no norm ({error}); steps without one are recorded as NaN, "
                "with no trigger and no snapshot"
            )
        self.records.append(StepRecord(number, math.nan, (), None, logged))
        if self._log is not None:  # the log holds every step, as the records do
            self._log.step(step_payload(number, math.nan, logged, 0, -1), False)
        return math.nan

    def _norm_and_params(
        self, step: int, items: list[Any], due: bool
    ) -> tuple[float, ParamsAtStep | None]:
        """The step's norm, and its per-parameter statistics when ``due`` (collectives: every
        rank decides alike, from agreed values).

        An L2 norm over the default groups comes from the statistics' own pass once the two
        were computed both ways and agreed for the parameters as they are: one pass over the
        gradients, not two. Both ways again every ``_CHECK_EVERY`` recorded steps."""
        telemetry = self._telemetry
        if telemetry is None or not due:
            return self._gradients.norm(self.norm_type, self.group, items), None
        self._measured += 1
        derivable = self.norm_type == 2 and self.group is None
        if derivable and self._verified == telemetry.version and self._measured % _CHECK_EVERY != 0:
            params = self._measure(telemetry, items)
            derived = self._derived(telemetry, params)
            if derived is not None:
                return derived, params
            return self._gradients.norm(self.norm_type, self.group, items), params
        norm = self._gradients.norm(self.norm_type, self.group, items)
        params = self._measure(telemetry, items)
        if params is None or self.norm_type != 2 or not math.isfinite(norm):
            return norm, params
        derived = self._derived(telemetry, params) if derivable else None
        if derived is not None and _close(derived, norm):
            self._verified = telemetry.version
        total = params.total()
        if not _close(total, norm) and not self._said_totals_differ:
            self._said_totals_differ = True
            if self._agreement.rank == 0:
                warn(
                    f"step {step}: the per-parameter statistics (counted as gradstat norm counts "
                    f"a snapshot of this step) make a norm of {total:.9g}, the recorder's norm "
                    f"is {norm:.9g}: {self._why_totals_differ(telemetry)}"
                )
        return norm, params

    @staticmethod
    def _derived(telemetry: Telemetry, params: ParamsAtStep | None) -> float | None:
        """The norm from the statistics' pass: ``total_norm``'s in a torch-native job;
        Megatron's (the rows' total, each copy once) in a live Megatron job, NaN or inf where
        any rank's copy holds one. None where the pass cannot tell it."""
        found = telemetry.native_total
        if params is None or found is None:
            return None
        if megatron_state() is None:
            return found.norm()
        if found.nan or found.inf:
            return math.nan if found.nan else math.inf
        return params.total()

    @staticmethod
    def _why_totals_differ(telemetry: Telemetry) -> str:
        found = telemetry.native_total
        if found is not None and megatron_state() is None and found.lacking_differs:
            return (
                "the ranks lack different gradients (None on some ranks only), which the "
                "norm takes from every rank and the statistics from data-parallel rank 0"
            )
        if found is not None and megatron_state() is None and found.copies_differ:
            return (
                "the copies of a DTensor gradient differ between ranks (a Replicate "
                "dimension's), which the norm counts by the largest copy and the statistics "
                "at coordinate 0"
            )
        return "pass group=, coords= or mesh= so that both count the same copies"

    def _measure(self, telemetry: Telemetry, items: list[Any]) -> ParamsAtStep | None:
        params = self.params = telemetry.measure(items)
        if params is not None and self._log is not None:
            self._log_layout(self._log, params)
        return params

    def _log_layout(self, log: LogWriter, params: ParamsAtStep) -> None:
        """Give the log the layout of ``params`` where it changed: other names, or a name
        with more elements than before (a gradient absent somewhere, numel 0, changes none)."""
        known = self._layout_numel
        if known is None or known[0] is not params.layout:
            numel = params.numel
        else:
            numel = tuple(max(pair) for pair in zip(known[1], params.numel, strict=True))
            if numel == known[1]:
                return
        self._layout_numel = (params.layout, numel)
        log.layout(params.layout.names, params.layout.expert, numel)

    def _mismatch(
        self, norm: float, logged: float | None, before: dict[str, int]
    ) -> tuple[bool, str]:
        """Whether the logged norms disagree (with each other, or with ``norm``), and how;
        the same on every rank (from agreed values)."""
        if before["given_top"] != -before["given_low"]:
            return True, "some ranks passed a logged_norm and others none"
        if not before["given_top"]:
            return False, ""
        lowest, highest = _logged_range(before)
        if self._triggers.disagrees(lowest, highest):  # an ulp apart is one norm, reduced apart
            return True, (
                f"the ranks passed different logged norms, from {lowest!r} to {highest!r} "
                f"(do they clip with different norms?); the exact norm is {norm:.9g}"
            )
        assert logged is not None
        logged = highest  # every rank decides alike
        if not self._triggers.disagrees(norm, logged):
            return False, ""
        if not (math.isfinite(logged) and math.isfinite(norm)):
            return True, f"the logged norm is {logged:.9g}, the exact norm {norm:.9g}"
        ratio = logged / norm if norm else math.inf
        return True, (
            f"the logged norm {logged:.9g} is {ratio:.6g}x the exact norm {norm:.9g} "
            f"(beyond logged_rtol={self._triggers.logged_rtol:g})"
        )

    def _explainer(self, step: int, logged: float) -> Callable[[Path], None]:
        """What rank 0's writer thread does with a ``mismatch`` snapshot once it is complete:
        name the miscount that gives the logged norm, as ``gradstat explain`` would."""

        def explain(snapshot: Path) -> None:
            from gradstat.analysis.explain import explain_snapshot
            from gradstat.snapshot.reader import Snapshot

            try:
                report = explain_snapshot(
                    Snapshot.open(snapshot), logged, self.norm_type, self._triggers.logged_rtol
                )
            except Exception as error:  # on the writer thread: one line, training goes on
                warn(f"step {step}: cannot explain the logged norm ({error})")
                return
            fitting = [row for row in report.matches if row.name != "exact"]
            command = f"gradstat explain {snapshot} --logged {logged!r}"
            if fitting:
                best = fitting[0]
                warn(
                    f"step {step}: the logged norm is what {best.name} gives ({best.description}: "
                    f"{best.value:.9g}); {command} lists every hypothesis"
                )
            else:
                warn(f"step {step}: no miscount gradstat knows gives the logged norm ({command})")

        return explain

    def _snapshot(
        self,
        step: int,
        triggers: tuple[str, ...],
        repeat: int,
        agreed: tuple[int, int, int],
        on_complete: Callable[[Path], None] | None = None,
        norm: float | None = None,
    ) -> Path | None:
        """The step's snapshot, when its triggers fired and every rank can take it.

        ``agreed``: the lowest and highest step of the ranks, and whether one is still writing;
        ``norm``: the step's norm, noted in the snapshot."""
        low, top, busy = agreed
        if low != top and not self._said_steps_differ:
            self._said_steps_differ = True
            warn(
                f"the ranks are on different steps (from {low} to {top}; this rank at "
                f"{step}): no snapshot is taken while they differ (is step counted the same "
                f"way on every rank?)"
            )
        elif low == top:
            self._said_steps_differ = False
        if not triggers:
            return None
        if low != top:
            warn(f"step {step} ({', '.join(triggers)}): ranks on steps {low} to {top}; skipped")
            return None
        if busy:
            warn(
                f"step {step} ({', '.join(triggers)}): a rank is still writing the snapshot "
                f"of step {self._snapshots.writing}; this one is skipped"
            )
            return None
        if repeat < 0:
            return None

        def started() -> None:
            self._agreement.grace_s = self._snapshots.max_dump_s  # the next agreement waits too

        return self._snapshots.dump(
            step,
            triggers,
            repeat,
            self._gradients.dumped_pairs(),
            self._dump_options,
            started,
            on_complete,
            None if norm is None else (float(self.norm_type), norm),
        )

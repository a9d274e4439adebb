"""A flight recorder for the training loop: the exact global norm every step, per-parameter
statistics in a log that survives the job, a full snapshot when a step goes wrong.

Two lines in a loop, after backward and before the optimizer step::

    recorder = gradstat.Recorder(model, "run/", spike=10.0, keep=3)
    ...
    norm = recorder.step(step)  # the exact global norm; clip with it if you like

Every step the recorder computes the norm with gradstat's core (:func:`gradstat.total_norm` for
torch-native jobs; in a live Megatron job, Megatron's selection and
:func:`gradstat.get_grad_norm_fp32` over its model-parallel group) of the parameters as they are
at that step (a module is walked again each step: a layer appended or replaced, a parameter
frozen or unfrozen, counts as ``total_norm(model.parameters())`` counts it; the fragments of
Megatron's distributed optimizer are views of buffers it allocates once, taken at construction).

Per-parameter statistics (:mod:`~gradstat.recorder.telemetry`): every ``telemetry_every``
steps, each logical parameter's L2 norm, max |x|, zero, NaN and Inf counts, counted as
``gradstat norm`` counts a snapshot, in two all-reduces of one vector. Rank 0 appends each step
to ``telemetry.gslog`` in the run directory (:mod:`~gradstat.recorder.log`: framed records
with CRCs, a torn tail skipped by the reader); ``gradstat history RUN_DIR`` reads it.

The ranks agree twice per step (:mod:`~gradstat.recorder.agreement`) on a gloo group of the
recorder's own, each time through rank 0 and each wait bounded by ``agree_timeout_s``: before
the norm, on the step number, whether a rank is still writing, whether a rank's parameters
changed and the norm the job logged (a rank that does not arrive, because it raised and lives
on or hangs, is named in a :class:`~gradstat.errors.PeerTimeoutError` on every rank that did,
instead of a wait in the norm's collective until the process group's timeout); after it, on
the triggers, so a snapshot is never partial because one rank decided otherwise. Ranks on
different step numbers take no snapshot and say so in one line.

When a trigger fires (:mod:`~gradstat.recorder.triggers`), every rank dumps its gradients
(:func:`gradstat.snapshot.dump_rank`) on a thread into ``.step-N.<attempt>-<k>.partial/``, and
the step waits for it at most ``max_dump_s``; rank 0 then waits a bounded time for all rank
files and renames the directory to ``step-N`` (:mod:`~gradstat.recorder.snapshots`). A write
that outlasts ``max_dump_s`` (a slow disk) is abandoned: training goes on, the rank marks the
directory, and it is never renamed, since its gradients change from then on; triggers are
skipped (all ranks agree) until the write is over. A snapshot that stays ``.partial`` (a rank
killed, a write abandoned) never reads as complete: its rank files are missing or it is hidden,
and ``gradstat history`` skips it. Whatever fails on the writer thread is one warning line;
training goes on.

Resuming into the same directory (after a preemption): each Recorder is an attempt, with an id
rank 0 draws at construction and sends to every rank. Partial directories carry it, so a new
attempt never writes into an old one's; rank 0 removes the partial directories of earlier
attempts at construction (their ranks are gone: they can never complete) with one line. A
step that already has a snapshot (a restart replays steps, or a loop repeats a number) gets the
next free name, ``step-N.1``, ``step-N.2``, ..., so both are kept and each record points at its
own. The log gets a start record per attempt; a replayed step's later record wins in history.

Retention: routine snapshots (``every``, ``step``) and triggered ones (``nonfinite``,
``spike``, ``mismatch``) are kept apart, the ``keep`` newest of each, newest by when they were
written (not by step number, which a resumed run repeats): a run of routine snapshots never
pushes out the spike that mattered. Before writing, when its kind already holds ``keep``, rank
0 removes the oldest of that kind, so a disk that holds ``keep`` snapshots of each kind keeps
recording. Each snapshot holds a small ``.recorder.json`` (its triggers and when it was
written); one without (written by hand, or by an older gradstat) is classed by the triggers in
its rank 0 file.

Triggers, each named in the snapshot's metadata: ``nonfinite`` (the norm is NaN or inf),
``spike`` (the norm is above ``spike`` times the median of the last ``window`` finite norms),
``step`` (a step the user listed), ``every`` (every N steps), ``mismatch`` (the
``logged_norm`` passed to :meth:`Recorder.step` is not the exact norm, or differs across
ranks; it fires where a run of such steps begins).

Warnings are single lines through ``logging`` (logger ``gradstat.recorder``): on stderr when
the job configured no logging, else where its handlers send them.
"""

from gradstat.recorder.recorder import Recorder, StepRecord
from gradstat.recorder.snapshots import complete_snapshots
from gradstat.recorder.telemetry import ParamsAtStep
from gradstat.recorder.triggers import ROUTINE_TRIGGERS, TRIGGERS

__all__ = [
    "ROUTINE_TRIGGERS",
    "TRIGGERS",
    "ParamsAtStep",
    "Recorder",
    "StepRecord",
    "complete_snapshots",
]

"""Run a function on N fresh gloo ranks and bring back every rank's result (CPU, no ports).

In the spirit of torchtnt's ``spawn_multi_process``: ``spawn(2, fn, arg)`` runs
``fn(rank, world_size, arg)`` in two spawned processes joined by a gloo process group (file
rendezvous) and returns each rank's value, or raises naming the rank that failed, with its
traceback. ``launch`` runs several cases one after the other in the same processes (a process
start costs seconds on a small machine) and reports each case on its own.

A rank that fails or hangs fails the run, never hangs it: once one rank has failed the others
get ``grace_s`` to finish, and the whole run is bounded by ``timeout_s``. Functions and their
arguments must be picklable (defined at a module's top level).
"""

from __future__ import annotations

import os
import pickle
import tempfile
import time
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from datetime import timedelta
from functools import cache
from multiprocessing.connection import wait
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

__all__ = ["PRELOAD", "Case", "LaunchReport", "Outcome", "launch", "spawn"]


@dataclass(frozen=True)
class Case:
    """One computation every rank runs: ``fn(rank, world_size, arg)`` returns a picklable value."""

    case_id: str
    fn: Callable[[int, int, Any], Any]
    arg: Any = None


@dataclass(frozen=True)
class Outcome:
    """What one rank brought back from one case: its value, or the traceback it raised."""

    value: Any = None
    error: str | None = None


@dataclass(frozen=True)
class LaunchReport:
    """Every rank's outcomes, and what went wrong with the processes themselves."""

    outcomes: list[dict[str, Outcome]]
    problems: list[str] = field(default_factory=list)

    def values(self, case_id: str) -> list[Any]:
        """The case's value on every rank, in rank order.

        Raises:
            AssertionError: a rank raised in this case (its traceback is in the message), or a
                rank never finished it (the process problems are in the message).
        """
        errors, missing = [], []
        for rank, outcomes in enumerate(self.outcomes):
            outcome = outcomes.get(case_id)
            if outcome is None:
                missing.append(rank)
            elif outcome.error is not None:
                errors.append(f"--- rank {rank} raised in case {case_id!r}:\n{outcome.error}")
        if errors or missing:
            lines = [*errors]
            if missing:
                lines.append(f"--- ranks {missing} have no outcome for case {case_id!r}")
                for rank, outcomes in enumerate(self.outcomes):
                    for other, outcome in outcomes.items():
                        if outcome.error is not None and other != case_id:
                            lines.append(
                                f"--- rank {rank} raised in case {other!r}:\n{outcome.error}"
                            )
            lines.extend(f"--- {problem}" for problem in self.problems)
            raise AssertionError("\n".join(lines))
        return [outcomes[case_id].value for outcomes in self.outcomes]


def _result_path(run_dir: Path, rank: int) -> Path:
    return run_dir / f"rank{rank}.pkl"


def _save(run_dir: Path, rank: int, outcomes: dict[str, Outcome]) -> None:
    # Written after every case and renamed into place, so a killed rank leaves whole files.
    path = _result_path(run_dir, rank)
    partial = path.with_suffix(".partial")
    partial.write_bytes(pickle.dumps(outcomes))
    os.replace(partial, path)


def _rank_main(
    rank: int, world_size: int, run_dir: Path, cases: Sequence[Case], pg_timeout_s: float
) -> None:
    """One rank: join the gloo world, run the cases in order, stop at the first failure."""
    torch.set_num_threads(1)
    outcomes: dict[str, Outcome] = {}
    try:
        dist.init_process_group(
            "gloo",
            init_method=f"file://{run_dir}/rendezvous",
            rank=rank,
            world_size=world_size,
            timeout=timedelta(seconds=pg_timeout_s),
        )
    except BaseException:
        outcomes["<init_process_group>"] = Outcome(error=traceback.format_exc())
        _save(run_dir, rank, outcomes)
        raise SystemExit(1) from None
    failed = False
    try:
        for case in cases:
            try:
                outcomes[case.case_id] = Outcome(value=case.fn(rank, world_size, case.arg))
            except Exception:
                outcomes[case.case_id] = Outcome(error=traceback.format_exc())
                failed = True
            _save(run_dir, rank, outcomes)
            if failed:
                # The other ranks' collectives are out of step with ours from here on.
                break
    finally:
        dist.destroy_process_group()
    # The results are on disk: skip the interpreter's teardown, seconds per rank on two cores.
    os._exit(1 if failed else 0)


# What every rank has imported before it starts: a test suite may add its own modules, before
# its first launch (they are imported once, by multiprocessing's fork server).
PRELOAD: list[str] = ["torch", "torch.distributed"]


@cache
def _context() -> Any:
    """Where ranks start: forked from a server process that has imported ``PRELOAD``.

    Every rank is a fresh process that has run nothing but those imports (no thread, no
    process group, no CUDA context), as a spawned one would be, without importing torch again:
    a second of CPU per rank, which on a small machine is most of a short launch.
    """
    if "forkserver" not in mp.get_all_start_methods():  # not on Windows: each rank imports
        return mp.get_context("spawn")
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(PRELOAD)
    return ctx


def launch(
    world_size: int,
    run_dir: Path,
    cases: Sequence[Case],
    *,
    timeout_s: float = 150.0,
    pg_timeout_s: float = 30.0,
    grace_s: float = 3.0,
) -> LaunchReport:
    """Run ``cases`` on ``world_size`` fresh gloo ranks and collect every rank's outcomes.

    Args:
        world_size: number of ranks (processes) to spawn.
        run_dir: an empty directory for the rendezvous file and the result files.
        cases: computations to run in every rank, in this order.
        timeout_s: wall-clock limit for the whole run; ranks still alive then are killed.
        pg_timeout_s: gloo's collective timeout, so a rank whose peer died raises.
        grace_s: once a rank has failed, how long the others get to finish before being killed.

    Returns:
        The outcomes of every rank and the process-level problems (exit codes, kills).
    """
    ctx = _context()
    procs = [
        ctx.Process(
            target=_rank_main,
            args=(rank, world_size, run_dir, list(cases), pg_timeout_s),
            name=f"gradstat-rank{rank}",
        )
        for rank in range(world_size)
    ]
    for proc in procs:
        proc.start()
    problems: list[str] = []
    deadline = time.monotonic() + timeout_s
    kill_at = deadline
    try:
        while True:
            alive = [proc for proc in procs if proc.is_alive()]
            if not alive:
                break
            if any(proc.exitcode not in (None, 0) for proc in procs):
                kill_at = min(kill_at, time.monotonic() + grace_s)
            remaining = kill_at - time.monotonic()
            if remaining <= 0:
                reason = "timed out" if kill_at == deadline else "outlived a failed rank"
                for proc in alive:
                    problems.append(f"rank {procs.index(proc)} {reason} and was killed")
                    proc.kill()
                break
            wait([proc.sentinel for proc in alive], timeout=min(remaining, 0.5))
    finally:
        for proc in procs:
            if proc.is_alive():
                proc.kill()
            proc.join()
    outcomes = []
    for rank, proc in enumerate(procs):
        if proc.exitcode != 0:
            problems.append(f"rank {rank} exited with code {proc.exitcode}")
        path = _result_path(run_dir, rank)
        outcomes.append(pickle.loads(path.read_bytes()) if path.exists() else {})
    return LaunchReport(outcomes=outcomes, problems=problems)


def spawn(
    world_size: int,
    fn: Callable[[int, int, Any], Any],
    arg: Any = None,
    *,
    timeout_s: float = 150.0,
    pg_timeout_s: float = 30.0,
) -> list[Any]:
    """``fn(rank, world_size, arg)`` on ``world_size`` fresh gloo ranks; their values in order.

    Args:
        world_size: number of ranks (processes) to spawn.
        fn: a picklable function of (rank, world_size, arg) returning a picklable value.
        arg: passed to every rank.
        timeout_s: wall-clock limit for the whole run.
        pg_timeout_s: gloo's collective timeout.

    Returns:
        Every rank's value, in rank order.

    Raises:
        AssertionError: a rank raised (its traceback is in the message) or never finished.
    """
    with tempfile.TemporaryDirectory(prefix="gradstat-spawn-") as run_dir:
        report = launch(
            world_size,
            Path(run_dir),
            [Case("spawn", fn, arg)],
            timeout_s=timeout_s,
            pg_timeout_s=pg_timeout_s,
        )
        return report.values("spawn")

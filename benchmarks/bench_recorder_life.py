"""What the recorder's life-cycle checks (issue 25 items 8, 11, 13) cost a step, against named
peers measured in the same run.

Two figures:

- walk: a model of ``--params`` parameters (``--params / 2`` small Linear layers), walked again
  each step (``list(model.parameters())``, item 8) against the recorder's whole step on it
  (norm, triggers, no snapshot) and against ``gradstat.total_norm`` on the same gradients.
- agree: on 2 gloo ranks (CPU, file rendezvous), the recorder's two bounded exchanges through
  rank 0 (step and busy before the norm; the triggers after it) against one
  ``all_reduce`` of five integers on the default group, what the recorder did before.

Usage::

    python benchmarks/bench_recorder_life.py [--params 1000] [--steps 2000]
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from collections.abc import Callable

import torch
import torch.distributed as dist
from torch.multiprocessing.spawn import spawn

import gradstat


def _best_us(fn: Callable[[], object], steps: int, repeats: int = 7) -> float:
    """Microseconds per call, the best of ``repeats``: other load on the machine only adds."""
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(steps):
            fn()
        times.append((time.perf_counter() - start) / steps * 1e6)
    return min(times)


def _walk(params: int, steps: int) -> None:
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(8, 8) for _ in range(params // 2)])
    model(torch.randn(4, 8)).square().sum().backward()
    grads = [param.grad for param in model.parameters()]
    with tempfile.TemporaryDirectory() as directory:
        recorder = gradstat.Recorder(model, directory, spike=None)
        counter = iter(range(1 << 40))
        walk = _best_us(lambda: list(model.parameters()), steps)
        step = _best_us(lambda: recorder.step(next(counter)), max(steps // 10, 10))
        norm = _best_us(lambda: gradstat.total_norm(grads), max(steps // 10, 10))
    print(f"walk: {params} parameters: list(model.parameters()) {walk:.0f} us per step")
    print(f"      recorder.step {step:.0f} us, gradstat.total_norm {norm:.0f} us")
    share, ratio = walk / step, step / norm
    print(f"      the walk is {share:.1%} of the step; step / total_norm = {ratio:.2f}x")


def _agree_rank(rank: int, rendezvous: str, steps: int) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{rendezvous}", rank=rank, world_size=2)
    # The recorder's directory beside the rendezvous file: nothing is written where it runs.
    run = os.path.join(os.path.dirname(rendezvous), "recorder")
    agreement = gradstat.Recorder(torch.nn.Linear(2, 2), run)._agreement
    values = torch.zeros(5, dtype=torch.int64)

    def ours() -> None:
        agreement.exchange("bench", [1, -1, 0])
        agreement.exchange("bench", [0, 0, 0, 0], lambda _: [0], 1)

    def peer() -> None:
        dist.all_reduce(values, op=dist.ReduceOp.MAX)

    results = []
    for _ in range(7):  # alternately, both ranks in step
        dist.barrier()
        results.append((_best_us(ours, steps, 1), _best_us(peer, steps, 1)))
    if rank == 0:
        ours_us = min(r[0] for r in results)
        peer_us = min(r[1] for r in results)
        print(f"agree: 2 gloo ranks: the two bounded exchanges {ours_us:.0f} us per step, one")
        print(f"       all_reduce of 5 integers {peer_us:.0f} us: {ours_us / peer_us:.2f}x")
    dist.destroy_process_group()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--params", type=int, default=1000)
    parser.add_argument("--steps", type=int, default=2000)
    args = parser.parse_args()
    _walk(args.params, args.steps)
    with tempfile.TemporaryDirectory() as run:
        rendezvous = os.path.join(run, "rendezvous")
        spawn(_agree_rank, args=(rendezvous, args.steps // 4), nprocs=2)  # type: ignore[no-untyped-call]
    return 0


if __name__ == "__main__":
    sys.exit(main())

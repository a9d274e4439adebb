"""What issue 25's live statistics cost per call, against what the same call paid before.

``GradNorm`` given parameters re-reads their ``.grad`` every call; given parameters or
gradients, the CUDA graph checks the gradients' addresses, sizes and dtypes (until 2026-12-05,
given gradients it read their addresses only). Both are timed on 1000 parameters against that
address read (the peer), then whole CPU calls, parameters against gradients. ``--ranks``: on
2 gloo ranks, ``total_norm`` of plain gradients (a DDP job) against one gloo all-reduce of five
float64 numbers, what each of its reductions now adds.

Usage::

    python benchmarks/bench_live_stats.py [--params 1000] [--ranks]
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch

from gradstat import GradNorm, total_norm
from gradstat.core import kernels


def _per_call_us(fn: Callable[[], object], number: int, repeats: int = 7) -> float:
    fn()
    runs = []
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(number):
            fn()
        runs.append((time.perf_counter() - start) / number * 1e6)
    return statistics.median(runs)


def _gradnorm(count: int) -> None:
    params = [torch.nn.Parameter(torch.zeros(10)) for _ in range(count)]
    grads = [torch.randn(10) for _ in params]
    for param, grad in zip(params, grads, strict=True):
        param.grad = grad
    live, held = GradNorm(params), GradNorm(grads)
    peer = _per_call_us(lambda: tuple(map(torch.Tensor.data_ptr, grads)), 200)
    read = _per_call_us(live._current, 200)
    key = _per_call_us(lambda: kernels.layout(grads), 200)
    whole_live, whole_held = _per_call_us(live, 20), _per_call_us(held, 20)
    print(
        f"{count} parameters, per call: re-reading .grad {read / peer:.2f}x and the graph's "
        f"address+size+dtype check {key / peer:.2f}x of reading held gradients' addresses "
        f"({read:.0f} / {key:.0f} / {peer:.0f} us); a whole CPU call, parameters against "
        f"gradients: {whole_live / whole_held:.2f}x"
    )


def _rank(_rank: int, _world: int, _arg: Any) -> tuple[float, float]:
    import torch.distributed as dist

    grads = [torch.randn(1000) for _ in range(10)]
    numbers = torch.zeros(5, dtype=torch.float64)
    norm = _per_call_us(lambda: total_norm(grads), 100)
    reduce = _per_call_us(lambda: dist.all_reduce(numbers), 100)
    return norm, reduce


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--params", type=int, default=1000)
    parser.add_argument("--ranks", action="store_true")
    args = parser.parse_args()
    torch.set_num_threads(1)
    _gradnorm(args.params)
    if args.ranks:
        from gradstat.testing import spawn

        norm, reduce = spawn(2, _rank)[0]
        print(
            f"2 gloo ranks, total_norm of 10 plain fp32 tensors of 1000: {norm:.0f} us per "
            f"call; one all-reduce of five float64 {reduce:.0f} us ({reduce / norm:.2f}x of it)"
        )


if __name__ == "__main__":
    main()

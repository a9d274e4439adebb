"""What the flight recorder costs a training step, against the step's own norm computation.

A small MLP trains on random data in one process. Each step is backward, a norm, clipping and
the optimizer step; the peer takes its norm with ``torch.nn.utils.clip_grad_norm_`` (what a
torch-native loop does), ours with ``gradstat.Recorder.step`` (exact, float64 partials, the
triggers checked) and clips with that norm. The two loops run alternately, repeat by repeat;
the table gives the median ratios of the whole step and of the norm part alone (the recorder's
step against ``torch.nn.utils.get_total_norm`` on the same gradients). No trigger fires, so no
snapshot is written: this is the every-step cost.

Usage::

    python benchmarks/bench_recorder.py [--width 2048] [--depth 8] [--steps 20] [--repeats 7]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from collections.abc import Callable

import torch

import gradstat


def _model(width: int, depth: int) -> torch.nn.Module:
    torch.manual_seed(0)
    layers: list[torch.nn.Module] = []
    for _ in range(depth):
        layers += [torch.nn.Linear(width, width), torch.nn.GELU()]
    return torch.nn.Sequential(*layers)


def _timed(fn: Callable[[], object], steps: int) -> float:
    start = time.perf_counter()
    for _ in range(steps):
        fn()
    return (time.perf_counter() - start) / steps


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--width", type=int, default=2048)
    parser.add_argument("--depth", type=int, default=8)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args()
    model = _model(args.width, args.depth)
    params = list(model.parameters())
    optimizer = torch.optim.SGD(params, lr=1e-6)
    inputs = torch.randn(64, args.width)
    with tempfile.TemporaryDirectory() as directory:
        recorder = gradstat.Recorder(model, directory, spike=None)
        counter = iter(range(1 << 40))

        def backward() -> None:
            optimizer.zero_grad()
            model(inputs).square().mean().backward()

        def peer_step() -> None:
            backward()
            torch.nn.utils.clip_grad_norm_(params, 1.0)
            optimizer.step()

        def ours_step() -> None:
            backward()
            norm = recorder.step(next(counter))
            gradstat.clip_grad_by_total_norm_fp32(params, 1.0, norm)
            optimizer.step()

        def grads() -> list[torch.Tensor]:
            return [grad for param in params if (grad := param.grad) is not None]

        backward()
        sides = {
            "step": (ours_step, peer_step),
            "norm": (
                lambda: recorder.step(next(counter)),
                lambda: float(torch.nn.utils.get_total_norm(grads())),
            ),
        }
        ratios: dict[str, list[float]] = {name: [] for name in sides}
        for ours, peer in sides.values():
            ours(), peer()  # warm-up
        for _ in range(args.repeats):
            for name, (ours, peer) in sides.items():
                first = _timed(ours, args.steps)
                second = _timed(peer, args.steps)
                third = _timed(ours, args.steps)
                ratios[name].append((first + third) / 2 / second)
    numel = sum(param.numel() for param in params)
    print(
        f"MLP {args.depth} x {args.width}: {numel / 1e6:.1f}M fp32 parameters, "
        f"{torch.get_num_threads()} threads, {args.repeats} repeats of {args.steps} steps"
    )
    step, norm = statistics.median(ratios["step"]), statistics.median(ratios["norm"])
    print("| measure | peer | ours/peer (median) |")
    print("|---|---|---:|")
    print(f"| training step with the recorder | clip_grad_norm_ | {step:.2f}x |")
    print(f"| the norm alone: Recorder.step | get_total_norm | {norm:.2f}x |")
    return 0


if __name__ == "__main__":
    sys.exit(main())

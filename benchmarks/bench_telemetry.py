"""What the recorder's per-parameter telemetry costs a CPU training step, against the same step
recording the total norm only, and against ``torch.nn.utils.clip_grad_norm_``.

A small Llama-style transformer (RMSNorm, attention and a SwiGLU feed-forward with biases, an
untied output layer) trains with AdamW on a fixed random batch. Four loops share the model and
run in the same process, interleaved block by block (each repeat runs ``--steps`` steps of each,
the order rotated from repeat to repeat, so that noise falls on all alike):

- telemetry: forward, backward, ``Recorder(telemetry_every=1).step``, AdamW;
- total: the same with ``Recorder(telemetry_every=None)``, the norm alone (one small record);
- clip: ``torch.nn.utils.clip_grad_norm_`` (a max norm never reached) in the recorder's place,
  what a torch-native loop does anyway;
- bare: forward, backward, AdamW.

Each recorder writes its own run directory (a temporary one) and fires no trigger
(``spike=None``): this is the every-step cost. The tables give each loop's median step, the
medians of the per-repeat ratios (the issue's target: telemetry/total <= 1.05x), what the
recorder adds to the bare step (the difference of the loops, and ``Recorder.step`` timed
inside the loop), the cyclic collector's collections per step of each loop, and the log's
bytes per step, held against ``gradstat/recorder/log.py``'s documented sizes. A second
scenario, ``--tensors`` tiny parameters, shows the per-tensor cost; a third runs the transformer
under DDP on 2 gloo ranks (one thread each).

Usage::

    python benchmarks/bench_telemetry.py [--layers 12] [--width 128] [--steps 3]
        [--repeats 9] [--tensors 10000] [--ranks 2] [--rank-repeats 5]
"""

from __future__ import annotations

import argparse
import gc
import os
import platform
import statistics
import struct
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

import gradstat
from gradstat.testing import spawn

LOOPS = ("telemetry", "total", "clip", "bare")
_HUGE = 1e30  # clip_grad_norm_'s max norm: the norm is computed, the gradients stay as they are
_FRAME = struct.Struct("<4sBII")  # magic, kind, length, head CRC (log.py's frame head)
_STEP_KIND = 4  # version 3's step record, which names its attempt


class _Block(nn.Module):
    def __init__(self, width: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.attention_norm = nn.RMSNorm(width)
        self.wq, self.wk, self.wv, self.wo = (nn.Linear(width, width) for _ in range(4))
        self.ffn_norm = nn.RMSNorm(width)
        hidden = 4 * width
        self.w1, self.w3 = nn.Linear(width, hidden), nn.Linear(width, hidden)
        self.w2 = nn.Linear(hidden, width)

    def forward(self, x: Tensor) -> Tensor:
        batch, seq, width = x.shape

        def split(t: Tensor) -> Tensor:
            return t.view(batch, seq, self.heads, width // self.heads).transpose(1, 2)

        h = self.attention_norm(x)
        out = F.scaled_dot_product_attention(
            split(self.wq(h)), split(self.wk(h)), split(self.wv(h)), is_causal=True
        )
        x = x + self.wo(out.transpose(1, 2).reshape(batch, seq, width))
        h = self.ffn_norm(x)
        result: Tensor = x + self.w2(F.silu(self.w1(h)) * self.w3(h))
        return result


class _Transformer(nn.Module):
    def __init__(self, layers: int, width: int, vocab: int) -> None:
        super().__init__()
        self.embedding = nn.Embedding(vocab, width)
        self.layers = nn.ModuleList(_Block(width, max(width // 32, 1)) for _ in range(layers))
        self.norm = nn.RMSNorm(width)
        self.output = nn.Linear(width, vocab, bias=False)

    def forward(self, tokens: Tensor) -> Tensor:
        x = self.embedding(tokens)
        for layer in self.layers:
            x = layer(x)
        result: Tensor = self.output(self.norm(x))
        return result


class _Tiny(nn.Module):
    """Many tiny parameters: the per-tensor cost of every loop shows, the arithmetic does not."""

    def __init__(self, tensors: int, numel: int) -> None:
        super().__init__()
        self.pieces = nn.ParameterList(nn.Parameter(torch.randn(numel)) for _ in range(tensors))

    def forward(self, inputs: Tensor) -> Tensor:
        result: Tensor = (torch.stack(list(self.pieces)) * inputs).square().mean()
        return result


@dataclass(frozen=True)
class _Job:
    """A model and the loss of its fixed batch."""

    label: str
    model: nn.Module
    loss: Callable[[], Tensor]


def _transformer_job(layers: int, width: int, batch: int, seq: int) -> _Job:
    torch.manual_seed(0)
    vocab = 1024
    model = _Transformer(layers, width, vocab)
    tokens = torch.randint(vocab, (batch, seq + 1))

    def loss() -> Tensor:
        logits = model(tokens[:, :-1])
        return F.cross_entropy(logits.reshape(-1, vocab), tokens[:, 1:].reshape(-1))

    return _Job(f"transformer {layers} x {width}, batch {batch} x {seq}", model, loss)


def _tiny_job(tensors: int, numel: int) -> _Job:
    torch.manual_seed(0)
    model = _Tiny(tensors, numel)
    inputs = torch.randn(tensors, numel)
    return _Job(f"{tensors} tensors of {numel} elements", model, lambda: model(inputs))


class _Loops:
    """The four loops over one model and optimizer, each recorder in its own run directory."""

    def __init__(self, job: _Job, directory: Path) -> None:
        self.job = job
        self.params = list(job.model.parameters())
        self.optimizer = torch.optim.AdamW(self.params, lr=1e-5)
        self.recorders = {
            "telemetry": gradstat.Recorder(job.model, directory / "telemetry", spike=None),
            "total": gradstat.Recorder(
                job.model, directory / "total", spike=None, telemetry_every=None
            ),
        }
        self.steps = dict.fromkeys(LOOPS, 0)
        self.inside = dict.fromkeys(LOOPS, 0.0)  # seconds spent in Recorder.step
        # The cyclic collector's collections started during each loop's steps (the recorder
        # pauses it for its step: gradstat/_collector.py).
        self.collections = dict.fromkeys(LOOPS, 0)
        self.running = "bare"

    def _collected(self, phase: str, info: dict[str, Any]) -> None:
        if phase == "start":
            self.collections[self.running] += 1

    def step(self, loop: str) -> None:
        self.optimizer.zero_grad()
        torch.autograd.backward(self.job.loss())
        recorder = self.recorders.get(loop)
        if recorder is not None:
            start = time.perf_counter()
            recorder.step(self.steps[loop])
            self.inside[loop] += time.perf_counter() - start
        elif loop == "clip":
            torch.nn.utils.clip_grad_norm_(self.params, _HUGE)
        self.optimizer.step()
        self.steps[loop] += 1

    def timed(self, loop: str, steps: int) -> tuple[float, float]:
        """Seconds per step of ``loop`` over ``steps`` steps, and of its Recorder.step."""
        self.inside[loop] = 0.0
        self.running = loop
        gc.callbacks.append(self._collected)
        try:
            start = time.perf_counter()
            for _ in range(steps):
                self.step(loop)
            seconds = time.perf_counter() - start
        finally:
            gc.callbacks.remove(self._collected)
        return seconds / steps, self.inside[loop] / steps


@dataclass(frozen=True)
class _Result:
    times: dict[str, list[float]]  # seconds per step, one per repeat
    inside: dict[str, list[float]]  # Recorder.step's seconds per step, one per repeat
    log_bytes: dict[str, tuple[int, int]]  # loop: (step records, their bytes)
    names: int  # per-parameter names in the telemetry log
    collections: dict[str, float]  # the collector's collections per step, by loop


def _step_frames(path: Path) -> tuple[int, int]:
    """How many step records the log holds and their bytes, frames included (read by hand,
    from the layout log.py documents, not with gradstat's reader)."""
    data = path.read_bytes()
    offset = records = size = 0
    while offset < len(data):
        magic, kind, length, _ = _FRAME.unpack_from(data, offset)
        assert magic == b"GSTL", f"{path}: no frame at offset {offset}"
        frame = _FRAME.size + length + 4
        if kind == _STEP_KIND:
            records, size = records + 1, size + frame
        offset += frame
    return records, size


def _measure(job: _Job, steps: int, repeats: int, directory: Path) -> _Result:
    loops = _Loops(job, directory)
    for loop in LOOPS:  # warm-up: the first step agrees on the names and writes the layout
        loops.step(loop)
    times: dict[str, list[float]] = {loop: [] for loop in LOOPS}
    inside: dict[str, list[float]] = {loop: [] for loop in LOOPS}
    for repeat in range(repeats):
        for index in range(len(LOOPS)):
            loop = LOOPS[(index + repeat) % len(LOOPS)]
            step, recorder = loops.timed(loop, steps)
            times[loop].append(step)
            inside[loop].append(recorder)
    log_bytes = {
        loop: _step_frames(directory / loop / "telemetry.gslog") for loop in loops.recorders
    }
    params = loops.recorders["telemetry"].params
    names = len(params.norms) if params is not None else 0
    collections = {loop: count / (steps * repeats) for loop, count in loops.collections.items()}
    return _Result(times, inside, log_bytes, names, collections)


def _ratio(result: _Result, ours: str, peer: str) -> float:
    return statistics.median(
        a / b for a, b in zip(result.times[ours], result.times[peer], strict=True)
    )


def _added_ms(result: _Result, loop: str) -> float:
    """The median per-repeat difference against the bare loop, in ms."""
    pairs = zip(result.times[loop], result.times["bare"], strict=True)
    return statistics.median(a - b for a, b in pairs) * 1e3


def _report(title: str, result: _Result) -> None:
    median = {loop: statistics.median(values) for loop, values in result.times.items()}
    inside = {loop: statistics.median(values) for loop, values in result.inside.items()}
    bare = median["bare"]
    print(f"\n{title}")
    print(
        "| loop | median step | added to bare (loops' difference) | Recorder.step inside "
        "| collections a step |"
    )
    print("|---|---:|---:|---:|---:|")
    for loop in LOOPS:
        added = inside_text = ""
        if loop != "bare":
            added_ms = _added_ms(result, loop)
            added = f"{added_ms:+.2f} ms ({added_ms / 1e3 / bare:+.1%})"
        if loop in ("telemetry", "total"):
            inside_text = f"{inside[loop] * 1e3:.2f} ms ({inside[loop] / bare:.1%} of bare)"
        collections = f"{result.collections[loop]:.1f}"
        print(f"| {loop} | {median[loop] * 1e3:.1f} ms | {added} | {inside_text} | {collections} |")
    # Other load on the machine comes in bursts that hit a whole repeat: the fastest repeats
    # of each loop are a second view, less exposed to it than the medians.
    print("\n| ratio | median of per-repeat ratios | fastest / fastest |")
    print("|---|---:|---:|")
    for ours, peer in (("telemetry", "total"), ("telemetry", "clip"), ("total", "clip")):
        fastest = min(result.times[ours]) / min(result.times[peer])
        print(f"| {ours} / {peer} | {_ratio(result, ours, peer):.3f}x | {fastest:.3f}x |")
    # The loops' own times carry the whole step's noise; the recorder's part, timed inside
    # the loop, carries only its own: the same target from the bare step and that part.
    from_inside = (bare + inside["telemetry"]) / (bare + inside["total"])
    print(f"| (bare + telemetry's Recorder.step) / (bare + total's) | {from_inside:.3f}x | |")
    target = _ratio(result, "telemetry", "total")
    verdict = "within" if target <= 1.05 else "ABOVE"
    print(f"\ntarget telemetry / total <= 1.05x: {target:.3f}x, {verdict}")
    _report_bytes(result)


def _report_bytes(result: _Result) -> None:
    # log.py: "A step record costs 17 + 44 = 61 bytes, and when it holds the per-parameter
    # statistics 4 bytes more and 16 per name" (no extras here: nothing non-finite, every
    # maximum an fp32 value, zero counts below 2**32). Held against the step head as packed.
    head = 17 + struct.calcsize("<Qqd8sIiI")
    for loop, names in (("telemetry", result.names), ("total", 0)):
        records, size = result.log_bytes[loop]
        per_step = size / records
        documented = 61 + (4 + 16 * names if names else 0)
        formula = f"61 + 4 + 16 x {names}" if names else "61"
        match = "matches" if per_step == documented else "does NOT match"
        packed = head + (4 + 16 * names if names else 0)
        print(
            f"log bytes per step ({loop}, {names} names, {records} step records): "
            f"{per_step:.1f}; documented {formula} = {documented}: {match} "
            f"(17-byte frame + {head - 17}-byte packed head{' + columns' if names else ''} "
            f"= {packed})"
        )


def _rank_loops(rank: int, world_size: int, arg: dict[str, Any]) -> dict[str, Any]:
    """On one gloo rank: the transformer under DDP, the same interleaved loops."""
    job = _transformer_job(arg["layers"], arg["width"], arg["batch"], arg["seq"])
    ddp = nn.parallel.DistributedDataParallel(job.model)
    job = _Job(job.label, ddp, job.loss)
    # Every rank names the same run directories: rank 0 writes the logs.
    result = _measure(job, arg["steps"], arg["repeats"], Path(arg["directory"]))
    return {"result": result, "threads": torch.get_num_threads()}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--width", type=int, default=128)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--steps", type=int, default=3, help="steps per loop per repeat")
    parser.add_argument("--repeats", type=int, default=9)
    parser.add_argument("--tensors", type=int, default=10000, help="0: no tiny-tensor scenario")
    parser.add_argument("--tensor-numel", type=int, default=16)
    parser.add_argument("--ranks", type=int, default=2, help="0: no gloo scenario")
    parser.add_argument("--rank-repeats", type=int, default=5)
    args = parser.parse_args()
    transformer = _transformer_job(args.layers, args.width, args.batch, args.seq)
    params = list(transformer.model.parameters())
    numel = sum(param.numel() for param in params)
    print(
        f"{platform.machine()} {platform.system()}, {os.cpu_count()} cores, "
        f"{torch.get_num_threads()} threads, torch {torch.__version__}, "
        f"gradstat {gradstat.__version__}; AdamW; {args.repeats} repeats of {args.steps} "
        f"steps per loop, interleaved"
    )
    with tempfile.TemporaryDirectory() as directory:
        result = _measure(transformer, args.steps, args.repeats, Path(directory) / "model")
        _report(
            f"{transformer.label}: {len(params)} tensors, {numel / 1e6:.2f}M fp32 parameters",
            result,
        )
        if args.tensors:
            tiny = _tiny_job(args.tensors, args.tensor_numel)
            result = _measure(tiny, args.steps, args.repeats, Path(directory) / "tiny")
            _report(tiny.label, result)
        if args.ranks:
            arg = {
                "layers": args.layers,
                "width": args.width,
                "batch": args.batch,
                "seq": args.seq,
                "steps": args.steps,
                "repeats": args.rank_repeats,
                "directory": str(Path(directory) / "ranks"),
            }
            values = spawn(args.ranks, _rank_loops, arg, timeout_s=1200)
            first = values[0]
            _report(
                f"{transformer.label} under DDP on {args.ranks} gloo ranks "
                f"({first['threads']} thread each; rank 0's times, "
                f"{args.rank_repeats} repeats)",
                first["result"],
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())

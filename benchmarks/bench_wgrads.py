"""Reading a Megatron wgrads dump: ``gradstat norm`` against a bare mmap-and-sum process.

Writes (once) a synthetic dump of ``--gib`` GiB as megatron-core 0.19's ``save_grads`` lays it
out (``--tp`` x ``--pp`` files ``mp_rank_TT[_PPP].pth`` in ``wgrads/iter_0000100``, each one
``torch.save({"model_chunk0": {name: fp32 gradient}})``, GPT names local to the stage: the
vocab-parallel embedding on the first stage, column-parallel ``linear_qkv``/``linear_fc1``,
row-parallel ``linear_proj``/``linear_fc2``, layernorms equal in every TP file, and on the last
stage the final layernorm and an untied ``output_layer.weight`` whose values differ from the
embedding's), then times, alternately and each as a whole fresh process, from launch to exit,
as a user waits for it (peak RSS from ``wait4``):

- ours: ``python -m gradstat norm DIR --json`` (its total is checked against the float64 norm
  of the logical gradient computed while writing);
- peer: a bare ``python -c`` process that imports torch, ``torch.load(path, mmap=True,
  weights_only=True)``s each file and sums each tensor once (``t.sum()``, fp32, the cheapest
  pass that touches every byte; ``--peer sumsq`` makes it a float64 sum of squares instead).

Both sides run once before the timed repeats, so the files are in the page cache (warm): this
measures reading and reducing, not the disk. Prints the median of per-repeat time ratios
ours/peer, the ratio of the fastest runs, and each side's peak RSS against the largest file
(the one-file working set) and an idle ``import torch`` process. With mmap, the pages of a
mapped file a process touches count in its RSS while mapped (as file-backed, shared pages the
page cache holds anyway), so peak RSS here is the mapped bytes resident at once plus the
process's own memory, not memory taken from others. (The dump is written by a child process,
so that this one stays small: wait4's peak RSS of a child is at least its parent's resident set
at the fork.) ``--peer-only`` times the peer alone (to
test the script where gradstat cannot read the dump).

Usage::

    python benchmarks/bench_wgrads.py [--gib 2] [--tp 2] [--pp 2] [--repeats 5] [--dir PATH]
        [--peer sum|sumsq] [--peer-only]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ENV = {name: value for name, value in os.environ.items() if name != "PYTHONDONTWRITEBYTECODE"}
ITERATION = 100
PEERS = {
    "sum": "total += float(tensor.sum())",
    "sumsq": "total += float(tensor.double().square().sum())",
}
_PEER = """\
import sys, torch
total = 0.0
for path in sys.argv[1:]:
    for chunk in torch.load(path, mmap=True, weights_only=True).values():
        for tensor in chunk.values():
            {step}
print(total)
"""


def _geometry(gib: float, tp: int, pp: int, layers: int = 8) -> tuple[int, int, int]:
    """(hidden, vocab, layers) of a GPT whose fp32 gradients total about ``gib`` GiB: vocab
    16 x hidden, about ``layers`` layers (a multiple of ``pp``), hidden a multiple of 64 x
    ``tp``."""
    elements = gib * (1 << 30) / 4
    # Per layer 12 h^2 (qkv 3h^2, proj h^2, fc1 and fc2 4h^2 each), embedding + output 32 h^2.
    step = 64 * tp
    hidden = max(step, round(math.sqrt(elements / (32 + 12 * layers)) / step) * step)
    layers = max(pp, round((elements - 32 * hidden**2) / (12 * hidden**2) / pp) * pp)
    return hidden, 16 * hidden, layers


def write_dump(directory: Path, gib: float, tp: int, pp: int) -> float:
    """Write the dump (seeded); return the float64 L2 norm of the logical gradient."""
    import torch

    hidden, vocab, layers = _geometry(gib, tp, pp)
    per_stage = layers // pp
    gen = torch.Generator().manual_seed(0)
    squares = 0.0

    def logical(*shape: int) -> torch.Tensor:
        nonlocal squares
        grad = torch.randn(shape, generator=gen)
        squares += float(grad.double().square().sum())
        return grad

    # (local name, logical gradient, dimension split over TP or None for a copy in every file);
    # each shard is cloned: a slice saved as it is would write its whole storage.
    for stage in range(pp):
        params: list[tuple[str, torch.Tensor, int | None]] = []
        if stage == 0:
            params.append(("embedding.word_embeddings.weight", logical(vocab, hidden), 0))
        for local in range(per_stage):
            prefix = f"decoder.layers.{local}."
            params += [
                (prefix + "input_layernorm.weight", logical(hidden), None),
                (prefix + "self_attention.linear_qkv.weight", logical(3 * hidden, hidden), 0),
                (prefix + "self_attention.linear_proj.weight", logical(hidden, hidden), 1),
                (prefix + "pre_mlp_layernorm.weight", logical(hidden), None),
                (prefix + "mlp.linear_fc1.weight", logical(4 * hidden, hidden), 0),
                (prefix + "mlp.linear_fc2.weight", logical(hidden, 4 * hidden), 1),
            ]
        if stage == pp - 1:
            params.append(("decoder.final_layernorm.weight", logical(hidden), None))
            params.append(("output_layer.weight", logical(vocab, hidden), 0))
        for rank in range(tp):
            chunk = {
                name: (grad if dim is None else grad.chunk(tp, dim)[rank]).clone()
                for name, grad, dim in params
            }
            suffix = f"_{stage:03d}" if pp > 1 else ""
            torch.save({"model_chunk0": chunk}, directory / f"mp_rank_{rank:02d}{suffix}.pth")
        del params
    return math.sqrt(squares)


def _run(command: list[str]) -> dict[str, float | str]:
    """One fresh process, timed from launch to exit as a user waits for it, with its own peak
    RSS in bytes (``wait4``'s, not the largest of all children's)."""
    start = time.perf_counter()
    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
        process = subprocess.Popen(command, stdout=out, stderr=err, env=ENV, text=True)
        _, status, usage = os.wait4(process.pid, 0)
        seconds = time.perf_counter() - start
        process.returncode = os.waitstatus_to_exitcode(status)
        out.seek(0), err.seek(0)
        stdout, stderr = out.read(), err.read()
    if process.returncode not in (0, 1):
        raise SystemExit(f"{' '.join(command)} exited {process.returncode}: {stderr.strip()}")
    return {"seconds": seconds, "stdout": stdout, "peak_rss": usage.ru_maxrss * 1024.0}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--gib", type=float, default=2.0)
    parser.add_argument("--tp", type=int, default=2)
    parser.add_argument("--pp", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--dir", type=Path, default=None, help="write the dump under here")
    parser.add_argument("--peer", choices=sorted(PEERS), default="sum", help="the peer's pass")
    parser.add_argument("--peer-only", action="store_true", help="time the peer alone")
    parser.add_argument("--write", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.write:
        import torch

        expected = write_dump(args.write, args.gib, args.tp, args.pp)
        version, threads = torch.__version__, torch.get_num_threads()
        print(json.dumps({"expected": expected, "torch": version, "threads": threads}))
        return 0
    root = Path(tempfile.mkdtemp(prefix="gradstat-bench-wgrads-", dir=args.dir))
    try:
        dump = root / "wgrads" / f"iter_{ITERATION:07d}"
        dump.mkdir(parents=True)
        hidden, vocab, layers = _geometry(args.gib, args.tp, args.pp)
        print(
            f"writing {args.gib} GiB: TP{args.tp} x PP{args.pp}, hidden {hidden}, vocab "
            f"{vocab}, {layers} layers, in {dump}",
            file=sys.stderr,
        )
        # Written by a child: this process stays small (no torch), because a child's peak RSS
        # as wait4 reports it is at least its parent's resident set at the fork.
        writer = [sys.executable, __file__, "--write", str(dump), "--gib", str(args.gib)]
        writer += ["--tp", str(args.tp), "--pp", str(args.pp)]
        written = json.loads(subprocess.run(writer, check=True, stdout=subprocess.PIPE).stdout)
        files = sorted(str(path) for path in dump.glob("*.pth"))
        sizes = [Path(path).stat().st_size for path in files]
        commands = {
            "ours": [sys.executable, "-m", "gradstat", "norm", str(dump), "--json"],
            "peer": [sys.executable, "-c", _PEER.format(step=PEERS[args.peer]), *files],
        }
        sides = ("peer",) if args.peer_only else ("ours", "peer")
        for side in sides:
            _run(commands[side])  # warm the page cache (and bytecode caches)
        runs: dict[str, list[dict[str, float | str]]] = {side: [] for side in sides}
        for repeat in range(args.repeats):
            for side in sides if repeat % 2 == 0 else sides[::-1]:
                runs[side].append(_run(commands[side]))
        idle = _run([sys.executable, "-c", "import torch"])["peak_rss"]
        _report(args, runs, written, sizes, float(idle))
    finally:
        shutil.rmtree(root, ignore_errors=True)
    return 0


def _report(
    args: argparse.Namespace,
    runs: dict[str, list[dict[str, float | str]]],
    written: dict[str, Any],
    sizes: list[int],
    idle: float,
) -> None:
    gib, mib = 1 << 30, 1 << 20
    expected = float(written["expected"])
    peer_name = f"torch.load(mmap) + {'t.sum()' if args.peer == 'sum' else 'float64 sum(t*t)'}"
    print(
        f"torch {written['torch']}, {written['threads']} threads, {os.cpu_count()} CPUs; "
        f"dump {sum(sizes) / gib:.2f} GiB in {len(sizes)} files (largest "
        f"{max(sizes) / gib:.2f} GiB), page cache warm (both read once first), "
        f"{args.repeats} repeats alternating\n"
    )
    fastest = {side: min(float(run["seconds"]) for run in found) for side, found in runs.items()}
    median = {
        side: statistics.median(float(run["seconds"]) for run in found)
        for side, found in runs.items()
    }
    rss = {side: max(float(run["peak_rss"]) for run in found) for side, found in runs.items()}
    if "ours" not in runs:
        print(f"| measure | peer ({peer_name}) |\n|---|---:|")
        print(f"| time, fastest | {fastest['peer']:.2f} s |")
        print(f"| time, median | {median['peer']:.2f} s |")
        print(f"| peak RSS | {rss['peer'] / mib:.0f} MiB (idle import torch {idle / mib:.0f}) |")
        return
    ratios = [
        float(o["seconds"]) / float(p["seconds"])
        for o, p in zip(runs["ours"], runs["peer"], strict=True)
    ]
    print(f"| measure | ours (gradstat norm --json) | peer ({peer_name}) | ours/peer |")
    print("|---|---:|---:|---:|")
    print(f"| time, median of per-repeat ratios | | | {statistics.median(ratios):.2f}x |")
    print(f"| time, smallest per-repeat ratio | | | {min(ratios):.2f}x |")
    print(
        f"| time, fastest runs | {fastest['ours']:.2f} s | {fastest['peer']:.2f} s | "
        f"{fastest['ours'] / fastest['peer']:.2f}x |"
    )
    print(
        f"| time, median runs | {median['ours']:.2f} s | {median['peer']:.2f} s | "
        f"{median['ours'] / median['peer']:.2f}x |"
    )
    print(
        f"| peak RSS | {rss['ours'] / mib:.0f} MiB | {rss['peer'] / mib:.0f} MiB | "
        f"{rss['ours'] / rss['peer']:.2f}x |"
    )
    print(
        f"| peak RSS above an idle import torch ({idle / mib:.0f} MiB) | "
        f"{(rss['ours'] - idle) / mib:.0f} MiB | {(rss['peer'] - idle) / mib:.0f} MiB | |"
    )
    totals = {float(json.loads(str(run["stdout"]))["total_norm"]) for run in runs["ours"]}
    errors = [abs(total - expected) / expected for total in totals]
    print(
        f"\ngradstat's total_norm against float64 of the logical gradient ({expected:.6g}): "
        f"relative error {max(errors):.1e}; largest file {max(sizes) / gib:.2f} GiB "
        "(one file's working set); target (issue 26): ours/peer <= 1.2x"
    )


if __name__ == "__main__":
    sys.exit(main())

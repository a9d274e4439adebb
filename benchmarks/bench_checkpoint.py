"""Reading a PyTorch distributed checkpoint: ``gradstat norm`` against DCP's own reader.

Writes (once, in a child process) a synthetic checkpoint of ``--gib`` GiB with
``torch.distributed.checkpoint.save`` and a ``FileSystemWriter`` of ``--files`` threads (one data
file each): ``{"model": {name: fp32 weight}}`` of a GPT-shaped model (embedding, ``--layers``
layers of 6 tensors: qkv/proj/fc1/fc2 and layernorms), then times, alternately and each as a
whole fresh process, from launch to exit, as a user waits for it (peak RSS from ``wait4``):

- ours: ``python -m gradstat norm DIR --json`` (its total is checked against the float64 norm
  computed while writing);
- peer: a bare ``python -c`` process that imports torch, reads the metadata with DCP's
  ``FileSystemReader``, allocates every tensor, ``dcp.load``s the checkpoint into them (each
  chunk read once) and sums each tensor once (``t.sum()``, fp32, the cheapest pass that
  touches every element).

Both sides run once before the timed repeats, so the files are in the page cache (warm): this
measures reading and reducing, not the disk. Prints the median of per-repeat time ratios
ours/peer, the ratio of the fastest runs, and each side's peak RSS (the peer holds the whole
checkpoint in memory; gradstat about one chunk at a time).

Usage::

    python benchmarks/bench_checkpoint.py [--gib 1] [--files 4] [--layers 8] [--repeats 5]
        [--dir PATH]
"""

from __future__ import annotations

import argparse
import json
import math
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_wgrads import _geometry, _run  # the same GPT shapes and process timer

_PEER = """\
import sys, warnings, torch
import torch.distributed.checkpoint as dcp
warnings.filterwarnings("ignore")
reader = dcp.FileSystemReader(sys.argv[1])
metadata = reader.read_metadata()
state = {
    key: torch.empty(entry.size, dtype=entry.properties.dtype)
    for key, entry in metadata.state_dict_metadata.items()
    if hasattr(entry, "chunks")
}
dcp.load(state, storage_reader=reader)
total = 0.0
for tensor in state.values():
    total += float(tensor.sum())
print(total)
"""


def write_checkpoint(directory: Path, gib: float, files: int, layers: int = 8) -> float:
    """Write the checkpoint (seeded); return the float64 L2 norm of every weight."""
    import warnings

    import torch
    from torch.distributed.checkpoint.filesystem import FileSystemWriter
    from torch.distributed.checkpoint.state_dict_saver import save

    warnings.filterwarnings("ignore")  # dcp.save without a process group says so
    hidden, vocab, layers = _geometry(gib, 1, 1, layers)
    generator = torch.Generator().manual_seed(0)
    squares = 0.0
    weights: dict[str, torch.Tensor] = {}

    def weight(name: str, *shape: int) -> None:
        nonlocal squares
        tensor = torch.randn(shape, generator=generator)
        squares += float(tensor.double().square().sum())
        weights[name] = tensor

    weight("embedding.word_embeddings.weight", vocab, hidden)
    for layer in range(layers):
        prefix = f"decoder.layers.{layer}."
        weight(prefix + "input_layernorm.weight", hidden)
        weight(prefix + "self_attention.linear_qkv.weight", 3 * hidden, hidden)
        weight(prefix + "self_attention.linear_proj.weight", hidden, hidden)
        weight(prefix + "pre_mlp_layernorm.weight", hidden)
        weight(prefix + "mlp.linear_fc1.weight", 4 * hidden, hidden)
        weight(prefix + "mlp.linear_fc2.weight", hidden, 4 * hidden)
    weight("decoder.final_layernorm.weight", hidden)
    weight("output_layer.weight", vocab, hidden)
    save({"model": weights}, storage_writer=FileSystemWriter(str(directory), thread_count=files))
    return math.sqrt(squares)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--gib", type=float, default=1.0)
    parser.add_argument("--files", type=int, default=4)
    parser.add_argument("--layers", type=int, default=8, help="about this many layers")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--dir", type=Path, default=None, help="write the checkpoint under here")
    parser.add_argument("--write", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.write:
        import torch

        expected = write_checkpoint(args.write, args.gib, args.files, args.layers)
        threads = torch.get_num_threads()
        print(json.dumps({"expected": expected, "torch": torch.__version__, "threads": threads}))
        return 0
    root = Path(tempfile.mkdtemp(prefix="gradstat-bench-checkpoint-", dir=args.dir))
    try:
        checkpoint = root / "step-100"
        checkpoint.mkdir()
        writer = [sys.executable, __file__, "--write", str(checkpoint), "--gib", str(args.gib)]
        writer += ["--files", str(args.files), "--layers", str(args.layers)]
        print(f"writing {args.gib} GiB in {args.files} data files to {checkpoint}", file=sys.stderr)
        written = json.loads(subprocess.run(writer, check=True, stdout=subprocess.PIPE).stdout)
        sizes = [path.stat().st_size for path in checkpoint.glob("*.distcp")]
        commands = {
            "ours": [sys.executable, "-m", "gradstat", "norm", str(checkpoint), "--json"],
            "peer": [sys.executable, "-c", _PEER, str(checkpoint)],
        }
        for side in commands:
            _run(commands[side])  # warm the page cache (and bytecode caches)
        runs: dict[str, list[dict[str, float | str]]] = {side: [] for side in commands}
        sides = list(commands)
        for repeat in range(args.repeats):
            for side in sides if repeat % 2 == 0 else sides[::-1]:
                runs[side].append(_run(commands[side]))
        _report(args, runs, written, sizes)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    return 0


def _report(
    args: argparse.Namespace,
    runs: dict[str, list[dict[str, float | str]]],
    written: dict[str, float | str],
    sizes: list[int],
) -> None:
    gib, mib = 1 << 30, 1 << 20
    expected = float(written["expected"])
    print(
        f"torch {written['torch']}, {written['threads']} threads; checkpoint "
        f"{sum(sizes) / gib:.2f} GiB in {len(sizes)} data files, page cache warm (both read "
        f"once first), {args.repeats} repeats alternating\n"
    )
    ratios = [
        float(o["seconds"]) / float(p["seconds"])
        for o, p in zip(runs["ours"], runs["peer"], strict=True)
    ]
    fastest = {side: min(float(run["seconds"]) for run in found) for side, found in runs.items()}
    rss = {side: max(float(run["peak_rss"]) for run in found) for side, found in runs.items()}
    print("| measure | ours (gradstat norm --json) | peer (FileSystemReader + dcp.load + sum) "
          "| ours/peer |")  # fmt: skip
    print("|---|---:|---:|---:|")
    print(f"| time, median of per-repeat ratios | | | {statistics.median(ratios):.2f}x |")
    print(f"| time, smallest per-repeat ratio | | | {min(ratios):.2f}x |")
    print(
        f"| time, fastest runs | {fastest['ours']:.2f} s | {fastest['peer']:.2f} s | "
        f"{fastest['ours'] / fastest['peer']:.2f}x |"
    )
    print(
        f"| peak RSS | {rss['ours'] / mib:.0f} MiB | {rss['peer'] / mib:.0f} MiB | "
        f"{rss['ours'] / rss['peer']:.2f}x |"
    )
    totals = {float(json.loads(str(run["stdout"]))["total_norm"]) for run in runs["ours"]}
    errors = [abs(total - expected) / expected for total in totals]
    print(
        f"\ngradstat's total_norm against float64 of the weights ({expected:.6g}): relative "
        f"error {max(errors):.1e}; target (issue 29): ours/peer <= 1.3x"
    )


if __name__ == "__main__":
    sys.exit(main())

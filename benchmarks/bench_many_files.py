"""Many small rank files: gradstat's cost per file against the cheapest pass over the same files.

Writes (once) a seeded fp32 snapshot of ``--files`` rank files, each holding 4 small tensors,
and a one-file snapshot of the same kind. ``--layout tp8`` (the default): TP=8 x PP=files/8,
every file's tensors count in the norm, and the 8 TP ranks of a stage hold the same parameter
list (as the ranks of a real job repeat theirs: gradstat checks each distinct list once).
``--layout distinct``: PP=files, every file's list its own (nothing repeats). The layouts whose
files hold shards of the same parameters, each file's records its own numbers:
``--layout distopt``, a distributed optimizer over DP=files (each file a flat fragment of every
parameter, at its own ``fragment_offset``); ``--layout fsdp2``, FSDP2 over files ranks (each file
a ``Shard(0)`` DTensor record of every parameter, at its own coordinate and ``global_offset``).
Each side runs as a whole fresh process, alternately, on both snapshots:

- peer: a Python process that opens each file with ``safetensors.safe_open`` and sums each
  tensor once;
- ours: ``python -m gradstat norm DIR`` (``--command`` zeros, audit, ...), or with ``--nproc N``
  ``torchrun --standalone --nproc-per-node N -m gradstat norm DIR``;
- with ``--nproc N``, also ours in one process, so that the N processes' time per file is
  given against one process's too (issue 30 item 3: at least 4x faster with 8 processes on 16
  cores; with 2 on 2 cores, not slower).

The time per file is the difference between the run on many files and the run on one file,
divided by the number of files less one: the fixed cost of starting Python and importing torch
cancels out. Prints medians over the repeats and the ratio ours/peer. Both sides may cache
bytecode, as an installed package has its ``.pyc`` files.

Usage::

    python benchmarks/bench_many_files.py [--files 8192] [--repeats 3] [--dir PATH]
        [--command norm|zeros|audit] [--nproc N] [--layout tp8|distinct|distopt|fsdp2]
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

ENV = {name: value for name, value in os.environ.items() if name != "PYTHONDONTWRITEBYTECODE"}
_TP = 8
_SHAPES = ((64, 32), (32,), (128, 16), (16,))


def write_snapshot(directory: Path, files: int, layout: str = "tp8") -> None:
    """``files`` rank files of 4 small fp32 tensors, laid out as ``layout`` (see above)."""
    from gradstat.snapshot import save_rank

    if layout in ("distopt", "fsdp2"):
        _write_shards(directory, files, layout)
        return
    directory.mkdir(parents=True, exist_ok=True)
    gen = torch.Generator().manual_seed(0)
    tp_size = _TP if layout == "tp8" else 1
    stages = max(files // tp_size, 1)
    for rank in range(files):
        tp, stage = rank % tp_size, rank // tp_size
        params = []
        for index, shape in enumerate(_SHAPES):
            holder = type("Shard", (), {})()
            holder.grad = torch.randn(shape, generator=gen)
            holder.shape = holder.grad.shape
            holder.tensor_model_parallel, holder.partition_dim = len(shape) == 2, 0
            params.append((f"layers.{stage}.w{index}", holder))
        coords = {"tp": [tp, min(tp_size, files)], "pp": [stage, stages]}
        save_rank(directory, params, rank=rank, world_size=files, coords=coords)


def _write_shards(directory: Path, files: int, layout: str) -> None:
    """Rank ``r`` holds shard ``r`` of each of the 4 parameters (rows ``r * rows`` on of a
    ``[files * rows, ...]`` parameter): a distributed optimizer's flat fragment (DP=files), or
    an FSDP2 ``Shard(0)`` DTensor (the records written as a DTensor's are, without a mesh)."""
    from gradstat.core.placements import MeshPlacement
    from gradstat.snapshot.container import write_container
    from gradstat.snapshot.format import METADATA_KEY, ParamRecord, RankHeader
    from gradstat.snapshot.writer import check_coords

    directory.mkdir(parents=True, exist_ok=True)
    gen = torch.Generator().manual_seed(0)
    distopt = layout == "distopt"
    for rank in range(files):
        records, tensors = [], []
        for index, shape in enumerate(_SHAPES):
            name = f"layers.0.w{index}"
            grad = torch.randn(shape, generator=gen)
            full = (files * shape[0], *shape[1:])
            if distopt:
                grad = grad.flatten()
                attrs = {"fragment_offset": rank * grad.numel(), "fragment_shape": list(full)}
                record = ParamRecord(name, True, tuple(grad.shape), "float32", full, attrs)
            else:
                offset = (rank * shape[0], *(0 for _ in shape[1:]))
                mesh = MeshPlacement((files,), (rank,), ("S(0)",), full, ("dp_shard",), offset)
                record = ParamRecord(name, True, shape, "float32", full, {}, mesh)
            records.append(record)
            tensors.append((name, grad))
        coords = check_coords({"dp": [rank, files]})
        header = RankHeader(rank, files, None, coords, distopt, "grad", tuple(records))
        with open(directory / f"rank-{rank:05d}.safetensors", "wb") as file:
            write_container(file, {METADATA_KEY: header.to_json()}, tensors)


def peer(directory: Path) -> float:
    """The bare pass, in this process: open each file with safe_open, sum each tensor once."""
    from safetensors import safe_open

    total = 0.0
    for path in sorted(directory.glob("*.safetensors")):
        with safe_open(str(path), framework="pt") as file:
            for key in file.keys():  # noqa: SIM118 (safe_open is not iterable)
                total += float(file.get_tensor(key).sum())
    return total


def _seconds(command: list[str]) -> float:
    start = time.perf_counter()
    result = subprocess.run(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env=ENV)
    if result.returncode not in (0, 1):
        raise SystemExit(f"{' '.join(command)} failed: {result.stderr.decode()}")
    return time.perf_counter() - start


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--files", type=int, default=8192)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--dir", type=Path, default=None, help="keep the snapshots here")
    parser.add_argument("--command", choices=("norm", "zeros", "audit"), default="norm")
    parser.add_argument("--nproc", type=int, default=0, help="run ours under torchrun")
    parser.add_argument("--layout", choices=("tp8", "distinct", "distopt", "fsdp2"), default="tp8")
    parser.add_argument("--peer", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.peer:
        print(peer(args.peer))
        return 0
    # Each side's command, the snapshot's directory to follow.
    commands = {
        "peer": [sys.executable, __file__, "--peer"],
        "alone": [sys.executable, "-m", "gradstat", args.command],
    }
    if args.nproc:  # torchrun, as its module: found wherever this Python's torch is
        commands["ours"] = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
        commands["ours"] += [f"--nproc-per-node={args.nproc}", "-m", "gradstat", args.command]
    else:
        commands["ours"] = commands["alone"]
    temporary = args.dir is None
    root = Path(tempfile.mkdtemp(prefix="gradstat-bench-")) if temporary else args.dir
    suffix = "" if args.layout == "tp8" else f"-{args.layout}"
    many, one = root / f"files-{args.files}{suffix}", root / f"files-1{suffix}"
    try:
        for directory, files in ((many, args.files), (one, 1)):
            if not any(directory.glob("*.safetensors")):
                print(f"writing {files} rank files to {directory}", file=sys.stderr)
                write_snapshot(directory, files, args.layout)
        sides = ("peer", "ours", "alone") if args.nproc else ("peer", "ours")
        per_file: dict[str, list[float]] = {side: [] for side in sides}
        whole: dict[str, list[float]] = {side: [] for side in sides}
        for side in sides:  # warm the page cache and the kernel cache
            _seconds([*commands[side], str(many)])
        for repeat in range(args.repeats):
            turn = repeat % len(sides)
            for side in sides[turn:] + sides[:turn]:
                small = _seconds([*commands[side], str(one)])
                large = _seconds([*commands[side], str(many)])
                per_file[side].append((large - small) / (args.files - 1))
                whole[side].append(large)
        ours_ms = statistics.median(per_file["ours"]) * 1e3
        peer_ms = statistics.median(per_file["peer"]) * 1e3
        ours_s, peer_s = statistics.median(whole["ours"]), statistics.median(whole["peer"])
        launcher = f"torchrun, {args.nproc} processes" if args.nproc else "one process"
        print(
            f"torch {torch.__version__}, {os.cpu_count()} CPUs, {args.files} rank files of "
            f"4 tensors ({args.layout}), {args.repeats} repeats, ours: gradstat {args.command} "
            f"({launcher})\n"
        )
        print("| measure | ours | peer (safe_open + sum) | ours/peer |")
        print("|---|---:|---:|---:|")
        print(f"| time per file | {ours_ms:.3f} ms | {peer_ms:.3f} ms | {ours_ms / peer_ms:.2f}x |")
        print(f"| whole command | {ours_s:.2f} s | {peer_s:.2f} s | {ours_s / peer_s:.2f}x |")
        if args.nproc:
            alone_ms = statistics.median(per_file["alone"]) * 1e3
            alone_s = statistics.median(whole["alone"])
            print(
                f"| ours, one process | {alone_ms:.3f} ms | | {alone_ms / peer_ms:.2f}x |\n"
                f"| ours, one process: whole command | {alone_s:.2f} s | | |\n\n"
                f"{args.nproc} processes against one, time per file beyond the start: "
                f"{ours_ms / alone_ms:.2f}x ({alone_ms / ours_ms:.2f} times as fast)"
            )
        print("\ntarget (issue 12): time per file <= 1.3x the peer's")
    finally:
        if temporary:
            shutil.rmtree(root, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

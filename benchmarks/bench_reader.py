"""gradstat's safetensors reader against the safetensors library's own, on the same files.

Two passes over every rank file of a snapshot, each timed for both readers alternately (CPU
time of this process, median of the repeats):

- header: ours (``read_container``: the header parsed and checked, tensor slots with their byte
  ranges) against ``safe_open`` with its metadata and every tensor's dtype and shape (what the
  reader's checks need; safe_open gives no byte ranges);
- tensors: ours (the file mapped, every tensor a view of the map, the size checked before each
  lookup) against ``safe_open(...).get_tensor`` for every tensor (also zero-copy views).

Usage::

    python benchmarks/bench_reader.py DIR [--repeats 5]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

from safetensors import safe_open

from gradstat.snapshot.container import mapped, read_container


def ours_header(paths: list[Path]) -> None:
    for path in paths:
        read_container(path)


def library_header(paths: list[Path]) -> None:
    for path in paths:
        with safe_open(str(path), framework="pt") as file:
            file.metadata()
            for key in file.keys():  # noqa: SIM118 (safe_open is not iterable)
                piece = file.get_slice(key)
                piece.get_dtype(), piece.get_shape()


def ours_tensors(paths: list[Path]) -> None:
    for container in [read_container(path) for path in paths]:
        with mapped(container) as tensors:
            for name in container.slots:
                tensors[name]


def library_tensors(paths: list[Path]) -> None:
    for path in paths:
        with safe_open(str(path), framework="pt") as file:
            for key in file.keys():  # noqa: SIM118
                file.get_tensor(key)


def _seconds(work: Callable[[list[Path]], None], paths: list[Path]) -> float:
    start = time.process_time()
    work(paths)
    return time.process_time() - start


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("directory", type=Path)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    paths = sorted(args.directory.glob("*.safetensors"))
    tensors = sum(len(read_container(path).slots) for path in paths)
    print(f"{len(paths)} rank files, {tensors} tensors, {args.repeats} repeats (CPU time)\n")
    print("| pass | ours per file | safetensors per file | ours/safetensors |")
    print("|---|---:|---:|---:|")
    for label, ours, theirs in (
        ("header and checks", ours_header, library_header),
        ("header, then every tensor", ours_tensors, library_tensors),
    ):
        mine: list[float] = []
        library: list[float] = []
        for repeat in range(args.repeats):
            order = ((ours, mine), (theirs, library))
            for work, times in order if repeat % 2 == 0 else order[::-1]:
                times.append(_seconds(work, paths) / len(paths))
        a, b = statistics.median(mine), statistics.median(library)
        print(f"| {label} | {a * 1e3:.3f} ms | {b * 1e3:.3f} ms | {a / b:.2f}x |")
    return 0


if __name__ == "__main__":
    sys.exit(main())

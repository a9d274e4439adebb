"""The fixed cost of a command: ``gradstat norm`` on the small sample snapshot, in a fresh
process, against a fresh ``python -c "import torch"`` (what any torch tool pays first).

The two run alternately (ABBA), each timed from the launch to the exit, so a drift in the
machine's load cancels out of each repeat's difference. Both may cache bytecode
(``PYTHONDONTWRITEBYTECODE`` is dropped from their environment), as an installed package has its
``.pyc`` files: torch's are there, and an editable checkout's would otherwise be compiled anew
on every run. Prints the median of the per-repeat
differences (ours - peer, seconds) and of the ratios.

Usage::

    python benchmarks/bench_startup.py [--repeats 15] [--snapshot sample_data/gtp2-pp2-dp2-ep2]
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
ENV = {name: value for name, value in os.environ.items() if name != "PYTHONDONTWRITEBYTECODE"}


def _seconds(command: list[str]) -> float:
    start = time.perf_counter()
    subprocess.run(command, check=True, stdout=subprocess.DEVNULL, cwd=ROOT, env=ENV)
    return time.perf_counter() - start


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--snapshot", default="sample_data/gtp2-pp2-dp2-ep2")
    args = parser.parse_args()
    commands = {
        "ours": [sys.executable, "-m", "gradstat", "norm", args.snapshot],
        "peer": [sys.executable, "-c", "import torch"],
    }
    for command in commands.values():
        _seconds(command)  # warm the page cache and the native kernel's cache
    differences, ratios = [], []
    for repeat in range(args.repeats):
        order = (
            ("ours", "peer", "peer", "ours")
            if repeat % 2 == 0
            else ("peer", "ours", "ours", "peer")
        )
        spent = {"ours": 0.0, "peer": 0.0}
        for side in order:
            spent[side] += _seconds(commands[side]) / 2
        differences.append(spent["ours"] - spent["peer"])
        ratios.append(spent["ours"] / spent["peer"])
    print(f"gradstat norm {args.snapshot} vs python -c 'import torch', {args.repeats} repeats")
    print(f"median extra time: {statistics.median(differences):+.2f} s")
    print(f"median ratio: {statistics.median(ratios):.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())

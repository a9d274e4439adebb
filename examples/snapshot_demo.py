"""The sample snapshots: the same gradients in two Megatron layouts give the same statistics.

Reads every snapshot under sample_data/ (one rank file at a time), prints its global norms and
zero count, then the largest parameters of the first one. Run: python examples/snapshot_demo.py
"""

from __future__ import annotations

import math
import sys
from pathlib import Path

from rich.console import Console
from rich.table import Table

from gradstat.analysis import snapshot_stats
from gradstat.snapshot import Snapshot

SAMPLES = Path(__file__).resolve().parent.parent / "sample_data"
NORM_TYPES = (2.0, 1.0, math.inf)


def main() -> int:
    console = Console(width=120)
    table = Table(title="sample_data/: one backward pass of a tiny GPT, dumped by 8 ranks")
    for column in ("snapshot", "optimizer", "L2", "L1", "inf", "zeros", "padding excluded"):
        table.add_column(column, justify="right")
    results = {}
    for directory in sorted(path for path in SAMPLES.iterdir() if path.is_dir()):
        snapshot = Snapshot.open(directory)
        stats = snapshot_stats(snapshot, NORM_TYPES)
        results[directory.name] = stats
        optimizer = "distributed" if snapshot.distributed_optimizer else "plain"
        table.add_row(
            directory.name,
            optimizer,
            *(f"{stats.norm(p):.8g}" for p in NORM_TYPES),
            str(stats.zeros),
            str(stats.pad_zeros),
        )
    console.print(table)
    first = results["tp2-pp2-dp2-ep2-distopt"]
    total = first.norm(2) ** 2
    top = Table(title="tp2-pp2-dp2-ep2-distopt: largest parameters (shards and fragments merged)")
    for column in ("parameter", "L2", "share of L2^2", "zeros", "elements"):
        top.add_column(column, justify="right")
    for param in sorted(first.params, key=lambda p: -p.norm(2))[:8]:
        top.add_row(
            param.name,
            f"{param.norm(2):.6g}",
            f"{param.norm(2) ** 2 / total:.1%}",
            str(param.zeros),
            str(param.numel),
        )
    console.print(top)
    broken = results["tp2-pp2-dp2-ep2-distopt-nan"]
    for param in broken.params:
        if not math.isfinite(param.norm(2)) or not math.isfinite(param.norm(math.inf)):
            held_by = sorted(set(param.ranks))
            console.print(f"non-finite gradient in {param.name} (held by ranks {held_by})")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""A seeded byte-mutation fuzzer over rank files: gradstat's own error or a result, nothing else.

``python tests/test_fuzz.py 100000`` runs a longer campaign than the test suite's.
"""

from __future__ import annotations

import math
import random
import shutil
import signal
import sys
from pathlib import Path
from types import FrameType

import torch

from gradstat.analysis import snapshot_stats
from gradstat.audit import audit_snapshot
from gradstat.compare import compare_snapshots
from gradstat.errors import GradstatError
from gradstat.runner import Place
from gradstat.snapshot import Snapshot, save_rank

MUTANTS = 2000
SEED = 20261129


def _good_snapshot(directory: Path) -> None:
    gen = torch.Generator().manual_seed(0)
    for rank in range(2):
        weight = torch.randn(6, 5, generator=gen)
        weight[1] = 0.0
        params = []
        for name, grad, attrs in (
            ("w", weight, {"tensor_model_parallel": True, "partition_dim": 0}),
            ("b", torch.randn(7, generator=gen).bfloat16(), {}),
        ):
            holder = type("Param", (), {})()
            holder.grad, holder.shape = grad, grad.shape
            for key, value in attrs.items():
                setattr(holder, key, value)
            params.append((name, holder))
        save_rank(directory, params, rank=rank, world_size=2, coords={"tp": [rank, 2]}, step=1)


def _mutate(raw: bytes, rng: random.Random) -> bytes:
    data = bytearray(raw)
    kind = rng.randrange(5)
    if kind == 0:  # flip bytes, header and data alike
        for _ in range(rng.randint(1, 8)):
            data[rng.randrange(len(data))] ^= 1 << rng.randrange(8)
    elif kind == 1:  # overwrite a byte inside the header (where structure lives)
        (length,) = (int.from_bytes(data[:8], "little"),)
        end = min(len(data), 8 + length) if length < len(data) else len(data)
        data[rng.randrange(0, max(1, end))] = rng.randrange(256)
    elif kind == 2:  # truncate
        del data[rng.randrange(len(data)) :]
    elif kind == 3:  # insert junk
        position = rng.randrange(len(data) + 1)
        data[position:position] = rng.randbytes(rng.randint(1, 16))
    else:  # duplicate a slice
        start = rng.randrange(len(data))
        data[start:start] = data[start : start + rng.randint(1, 64)]
    return bytes(data)


def _on_alarm(signum: int, frame: FrameType | None) -> None:
    raise TimeoutError("a mutant made gradstat hang")


def campaign(workdir: Path, mutants: int, seed: int = SEED) -> dict[str, int]:
    """Run ``mutants`` mutants; returns how many ended in an error and in a result."""
    good = workdir / "good"
    _good_snapshot(good)
    originals = {path.name: path.read_bytes() for path in good.iterdir()}
    rng = random.Random(seed)
    outcome = {"error": 0, "result": 0}
    trial = workdir / "trial"
    previous = signal.signal(signal.SIGALRM, _on_alarm)
    try:
        for _ in range(mutants):
            shutil.rmtree(trial, ignore_errors=True)
            shutil.copytree(good, trial)
            victim = rng.choice(sorted(originals))
            (trial / victim).write_bytes(_mutate(originals[victim], rng))
            signal.alarm(10)
            try:
                snapshot = Snapshot.open(trial)
                stats = snapshot_stats(snapshot, (2.0, math.inf))
                assert stats.zeros >= 0 and stats.numel >= 0
                # What survives validation must survive the diagnostics too.
                audit_snapshot(snapshot, Place(0, 1))
                compare_snapshots(Snapshot.open(good), snapshot, Place(0, 1))
                outcome["result"] += 1
            except GradstatError:
                outcome["error"] += 1
            finally:
                signal.alarm(0)
    finally:
        signal.signal(signal.SIGALRM, previous)
    return outcome


def test_mutants_end_in_an_error_or_a_result(tmp_path: Path) -> None:
    outcome = campaign(tmp_path, MUTANTS)
    assert sum(outcome.values()) == MUTANTS
    assert outcome["error"] > MUTANTS // 2  # most mutants break something and are caught


if __name__ == "__main__":
    import tempfile

    count = int(sys.argv[1]) if len(sys.argv) > 1 else 100_000
    with tempfile.TemporaryDirectory() as temporary:
        print(campaign(Path(temporary), count))

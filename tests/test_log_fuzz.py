"""A seeded mutation fuzzer over a resumed run's telemetry log: whatever the damage, `history`
gives its own one-line error or numbers that are right, never a value of another attempt's
norm type or of another step.

The run: attempt 1 records steps 1..8 with the L2 norm, attempt 2 replays 5..12 with the max
norm, attempt 3 records 13..16 with L2 again. Mutants are bits flipped, bytes scrambled, the log
cut short, bytes inserted or deleted. Each mutant's history is read with the latest attempt's
norm type, then with each asked for; every total it gives for a step must be the float64 norm,
of the norm type it says, of an attempt that recorded the step with that norm type, and every
per-parameter row the L2 norm of that parameter's gradient at its step.

``python -m tests.test_log_fuzz 5000`` runs a longer campaign than the test suite's.
"""

from __future__ import annotations

import math
import random
import sys
from pathlib import Path

from gradstat.analysis.history import read_history
from gradstat.errors import SnapshotError
from gradstat.recorder.log import LOG_NAME
from tests._oracle import float64_norm
from tests.test_history_resume import _attempt, _model

SUITE_MUTANTS = 150
# Attempts as (steps, norm type); each attempt resumes the run directory of the one before.
ATTEMPTS = ((range(1, 9), 2.0), (range(5, 13), math.inf), (range(13, 17), 2.0))
NAMES = ("weight", "bias")  # the parameters of _model(), in order
ByStep = dict[int, list[float]]  # a step's values, one per attempt that recorded it


def _recorded_run(run: Path) -> tuple[dict[float, ByStep], dict[str, ByStep]]:
    """Write the run; return the float64 totals each norm type's attempts recorded at each step,
    and each parameter's L2 norms at each step (any attempt's)."""
    model = _model()
    totals: dict[float, ByStep] = {2.0: {}, math.inf: {}}
    rows: dict[str, ByStep] = {name: {} for name in NAMES}
    for steps, norm_type in ATTEMPTS:
        for step, grads in _attempt(model, run, steps, norm_type=norm_type).items():
            totals[norm_type].setdefault(step, []).append(float64_norm(grads, norm_type))
            for name, grad in zip(NAMES, grads, strict=True):
                rows[name].setdefault(step, []).append(float64_norm([grad], 2.0))
    return totals, rows


def _mutant(data: bytes, rng: random.Random) -> bytes:
    mutated = bytearray(data)
    how = rng.choice(("flip", "scramble", "cut", "insert", "delete"))
    for _ in range(rng.randint(1, 3)):
        at = rng.randrange(len(mutated))
        if how == "flip":
            mutated[at] ^= 1 << rng.randrange(8)
        elif how == "scramble":
            mutated[at : at + 8] = rng.randbytes(len(mutated[at : at + 8]))
        elif how == "cut":
            del mutated[at:]
            break
        elif how == "insert":
            mutated[at:at] = rng.randbytes(rng.randint(1, 40))
        else:
            del mutated[at : at + rng.randint(1, 40)]
    return bytes(mutated)


def _is_one_of(value: float, expected: list[float] | None) -> bool:
    return expected is not None and any(math.isclose(value, e, rel_tol=1e-9) for e in expected)


def _wrong_numbers(run: Path, totals: dict[float, ByStep], rows: dict[str, ByStep]) -> list[str]:
    """What a mutant's history gives that is not right, for each norm type it is read with."""
    wrong = []
    for asked in (None, 2.0, math.inf):
        try:
            history = read_history(run, asked, report=lambda line: None)
        except SnapshotError:
            continue  # its own one-line error (no log left, a norm type no attempt recorded)
        for step, total in zip(history.steps, history.totals, strict=True):
            if not _is_one_of(total, totals[history.norm_type].get(step)):
                wrong.append(f"-p {asked}: step {step} total {total} ({history.norm_type})")
        for name, series in history.params.items():
            for step, value in zip(series.steps, series.norms, strict=True):
                if not _is_one_of(value, rows.get(name, {}).get(step)):
                    wrong.append(f"-p {asked}: {name} at step {step}: {value}")
    return wrong


def campaign(workdir: Path, mutants: int, seed: int = 0) -> list[str]:
    """The findings of ``mutants`` mutants of the run's log: each a line, none when all is right."""
    original = workdir / "original"
    totals, rows = _recorded_run(original)
    data = (original / LOG_NAME).read_bytes()
    rng = random.Random(seed)
    findings = []
    for index in range(mutants):
        run = workdir / f"mutant-{index}"
        run.mkdir()
        (run / LOG_NAME).write_bytes(_mutant(data, rng))
        findings += [f"mutant {index}: {line}" for line in _wrong_numbers(run, totals, rows)]
        (run / LOG_NAME).unlink()
        run.rmdir()
    return findings


def test_a_damaged_log_gives_right_numbers_or_its_own_error(tmp_path: Path) -> None:
    assert campaign(tmp_path, SUITE_MUTANTS) == []


def test_the_oracle_tells_the_attempts_apart(tmp_path: Path) -> None:
    """Where the attempts overlap, the max-norm attempt's totals are none of the L2 attempt's:
    a step of one read as the other's (the defect of format 2's logs) is a finding."""
    totals, _ = _recorded_run(tmp_path)
    overlap = totals[2.0].keys() & totals[math.inf].keys()
    assert overlap == set(range(5, 9))
    for step in overlap:
        assert not any(_is_one_of(value, totals[2.0][step]) for value in totals[math.inf][step])


if __name__ == "__main__":
    import tempfile

    with tempfile.TemporaryDirectory() as directory:
        found = campaign(Path(directory), int(sys.argv[1]) if len(sys.argv) > 1 else 5000)
    print("\n".join(found) or "no wrong number")
    sys.exit(1 if found else 0)

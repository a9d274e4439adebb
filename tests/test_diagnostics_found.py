"""What an adversarial review of the diagnostics found (2026-12-05), each held here:

- ``history`` exited 0 when a parameter went NaN after it had jumped for another reason (only
  its first jump was looked at);
- under torchrun, ``inspect`` and a log's ``history`` printed from every process (two JSON
  documents on stdout);
- ``explain --logged 0`` matched a rank whose counted tensors are all GTP padding (its 0 is no
  prediction);
- ``explain`` named a reduced-precision bug ``best`` for a right norm rounded for the log.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

import gradstat
from tests._cli import SAMPLE_DATA, run_gradstat


def test_history_exits_1_for_a_nan_after_an_earlier_jump(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 3)
    recorder = gradstat.Recorder(model, tmp_path, every=5, keep=3, spike=None)
    inputs = torch.randn(6, 4)
    for step in range(1, 21):
        model.zero_grad()
        model(inputs).square().sum().backward()
        if step == 9:
            model.weight.grad.mul_(1000.0)  # the weight's first jump: its norm
        if step == 17:
            model.weight.grad[0, 0] = math.nan
        recorder.step(step)
    recorder.wait()
    result = run_gradstat("history", tmp_path, "--json")
    assert result.returncode == 1, result.stderr
    series = {row["name"]: row for row in json.loads(result.stdout)["params"]}
    assert series["weight"]["first_jump"]["kind"] != "nonfinite"


@pytest.mark.multiprocess
def test_inspect_under_torchrun_prints_once() -> None:
    sample = SAMPLE_DATA / "gtp2-pp2-dp2-ep2"
    alone = run_gradstat("inspect", sample, "--json")
    launched = run_gradstat("inspect", sample, "--json", nproc=2)
    assert launched.returncode == 0, launched.stderr
    assert launched.stdout == alone.stdout


def test_a_logged_zero_is_explained_by_no_rank_that_counts_only_padding() -> None:
    result = run_gradstat("explain", SAMPLE_DATA / "gtp2-pp2-dp2-ep2", "--logged", "0", "--json")
    report = json.loads(result.stdout)
    assert result.returncode == 1 and report["best"] is None, report["best"]


def test_a_norm_within_rtol_of_the_exact_one_is_best_explained_as_exact() -> None:
    """5.4158 for an exact 5.41564: fp16 partials (5.41577) lie closer, but the text said the
    number is right while the JSON's best named the precision bug."""
    sample = SAMPLE_DATA / "tp2-pp2-dp2-ep2-distopt"
    result = run_gradstat("explain", sample, "--logged", "5.4158", "--json")
    report = json.loads(result.stdout)
    assert abs(report["exact"] - 5.4158) <= 1e-3 * 5.4158  # within the default rtol
    rows = {row["name"]: row for row in report["rows"]}
    assert rows["fp16_partials"]["distance"] < rows["exact"]["distance"]
    assert result.returncode == 0 and report["best"] == "exact"

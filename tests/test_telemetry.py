"""Per-parameter telemetry in one process: every parameter, every recorded step, against
float64; through a model that changes, gradients set to None and groups; the log it writes,
torn, damaged, on a full disk and after a resume; the logged-norm check; first jumps in order."""

from __future__ import annotations

import errno
import gc
import json
import logging
import math
import os
import struct
import subprocess
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

import gradstat
from gradstat.analysis.history import read_history
from gradstat.errors import GradstatError
from gradstat.recorder import log as log_module
from gradstat.recorder.log import LOG_NAME
from gradstat.testing import Case, launch
from tests import _torch_native
from tests._cli import recipe, run_gradstat
from tests._oracle import float64_norm, zeros_in


def _max_abs(grad: torch.Tensor) -> float:
    values = grad.detach().double().abs()
    return math.nan if bool(values.isnan().any()) else float(values.max())


def _oracle(grads: list[torch.Tensor]) -> dict[str, Any]:
    """float64 statistics of one logical parameter (or group) made of ``grads``."""
    return {
        "norm": float64_norm(grads, 2),
        "zeros": zeros_in(grads),
        "nan": sum(int(grad.isnan().sum()) for grad in grads),
        "inf": sum(int(grad.isinf().sum()) for grad in grads),
        "max": _max_abs(torch.cat([grad.detach().flatten() for grad in grads])),
    }


def _same(got: float | None, expected: float) -> bool:
    if got is None:
        return False
    if math.isnan(expected) or math.isinf(expected):
        return got == expected or (math.isnan(got) and math.isnan(expected))
    return abs(got - expected) <= 1e-9 * max(expected, 1e-300) or got == expected


def _check(params: Any, expected: dict[str, dict[str, Any]]) -> None:
    names = list(params.layout.names)
    for name, truth in expected.items():
        index = names.index(name)
        assert _same(params.norms[index], truth["norm"]), (name, params.norms[index], truth)
        assert params.zeros[index] == truth["zeros"], name
        assert params.nan[index] == truth["nan"] and params.inf[index] == truth["inf"], name
        assert _same(params.max_abs[index], truth["max"]), (name, params.max_abs[index], truth)


class _Net(torch.nn.Module):
    """Layers with a tied weight (one Parameter twice), a frozen one and a bf16 one."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(12, 6)
        self.layers = torch.nn.ModuleList(torch.nn.Linear(6, 6) for _ in range(3))
        self.frozen = torch.nn.Linear(6, 6)
        self.frozen.requires_grad_(False)
        self.bf16 = torch.nn.Linear(6, 6).to(torch.bfloat16)
        self.head = torch.nn.Linear(6, 12, bias=False)
        self.head.weight = self.embed.weight  # tied: counted once

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        hidden = self.embed(tokens)
        for layer in self.layers:
            hidden = torch.tanh(layer(hidden))
        hidden = self.frozen(hidden) + self.bf16(hidden.bfloat16()).float()
        return self.head(hidden)


def _backward(model: torch.nn.Module, step: int) -> None:
    torch.manual_seed(step)
    model.zero_grad(set_to_none=True)
    tokens = torch.randint(0, 8, (4, 5))  # rows 8..11 of the embedding stay exactly zero
    model(tokens).square().mean().backward()


def _truth(model: torch.nn.Module) -> dict[str, dict[str, Any]]:
    return {
        name: _oracle([param.grad])
        for name, param in model.named_parameters()
        if param.grad is not None
    }


def test_every_parameter_every_step_equals_float64(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = _Net()
    recorder = gradstat.Recorder(model, tmp_path, spike=None)
    seen = {}
    for step in range(1, 7):
        _backward(model, step)
        if step == 3:
            model.layers[1].weight.grad[0, 0] = math.nan
            model.layers[2].bias.grad[1] = math.inf
        if step == 5:
            model.layers[0].weight.grad.zero_()
        recorder.step(step)
        seen[step] = _truth(model)
        _check(recorder.params, seen[step])
        assert recorder.params is not None
        assert "head.weight" not in recorder.params.layout.names, "a tied weight counts once"
        assert "frozen.weight" not in recorder.params.layout.names, "no gradient: no row"
    history = read_history(tmp_path)
    assert history.steps == list(range(1, 7))
    for name, series in history.params.items():
        for step, norm, zeros, peak, nan, inf in zip(
            series.steps,
            series.norms,
            series.zeros,
            series.max_abs or [],
            series.nan,
            series.inf,
            strict=True,
        ):
            truth = seen[step][name]
            assert _same(norm, truth["norm"]) and zeros == truth["zeros"], (name, step)
            assert _same(peak, truth["max"]) and (nan, inf) == (truth["nan"], truth["inf"])
    assert "frozen.weight" not in history.params
    assert history.params["layers.1.weight"].jump_kind == "nonfinite"


def test_every_n_steps_and_groups_by_pattern(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = _Net()
    recorder = gradstat.Recorder(
        model, tmp_path, spike=None, telemetry_every=2, telemetry_groups=[r"layers\.\d+"]
    )
    for step in range(1, 6):
        _backward(model, step)
        recorder.step(step)
        if step % 2:
            continue
        assert recorder.params is not None
        names = recorder.params.layout.names
        assert names[:4] == ("embed.weight", "layers.0", "layers.1", "layers.2")
        layers = model.layers
        expected = {
            f"layers.{index}": _oracle([layers[index].weight.grad, layers[index].bias.grad])
            for index in range(3)
        }
        _check(recorder.params, expected)
    history = read_history(tmp_path)
    assert history.steps == [1, 2, 3, 4, 5], "the norm of every step"
    assert history.params["layers.0"].steps == [2, 4], "per-parameter every 2 steps"
    assert history.params["layers.0"].numel == 6 * 6 + 6
    size = (tmp_path / LOG_NAME).stat().st_size
    assert size < 4096, "five steps of six rows: a few hundred bytes"


def test_a_pattern_that_matches_empty_text_names_no_group(tmp_path: Path) -> None:
    """``layers\\.\\d*|`` matches "" in every name: such a name falls to the next pattern, or
    is its own row, never one row named ""."""
    torch.manual_seed(0)
    model = _Net()
    recorder = gradstat.Recorder(
        model, tmp_path, spike=None, telemetry_groups=[r"x*", r"layers\.\d+"]
    )
    _backward(model, 1)
    recorder.step(1)
    assert recorder.params is not None
    names = recorder.params.layout.names
    assert "" not in names and names[:4] == ("embed.weight", "layers.0", "layers.1", "layers.2")


def test_a_model_that_changes_is_recorded_under_its_new_names(tmp_path: Path) -> None:
    model = torch.nn.Sequential(torch.nn.Linear(4, 4))
    recorder = gradstat.Recorder(model, tmp_path, spike=None)
    for step in range(1, 7):
        if step == 3:
            model.append(torch.nn.Linear(4, 2))  # a layer added
        if step == 5:
            model[0] = torch.nn.Linear(4, 4)  # a module replaced: the old gradient goes
        model.zero_grad(set_to_none=True)
        model(torch.ones(3, 4) * step).sum().backward()
        recorder.step(step)
        _check(recorder.params, _truth(model))
    history = read_history(tmp_path)
    assert history.params["1.weight"].steps == [3, 4, 5, 6]
    assert history.params["0.weight"].steps == [1, 2, 3, 4, 5, 6]


def test_a_gradient_set_to_none_is_absent_at_that_step(tmp_path: Path) -> None:
    model = torch.nn.ModuleDict({"used": torch.nn.Linear(3, 3), "skipped": torch.nn.Linear(3, 3)})
    recorder = gradstat.Recorder(model, tmp_path, spike=None)
    for step in range(1, 5):
        model.zero_grad(set_to_none=True)
        branch = model["skipped"] if step == 2 else model["used"]
        branch(torch.ones(2, 3)).sum().backward()
        recorder.step(step)
        _check(recorder.params, _truth(model))
    history = read_history(tmp_path)
    assert history.params["skipped.weight"].steps == [2]
    assert history.params["used.weight"].steps == [1, 3, 4]


# --- the log ----------------------------------------------------------------------------------


def _loop(directory: Path, steps: range, scale: Callable[[int], float] = lambda _: 1.0) -> Any:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2))
    recorder = gradstat.Recorder(model, directory, spike=None)
    for step in steps:
        model.zero_grad()
        model(torch.ones(3, 4) * 0.1 * step).sum().backward()
        for param in model.parameters():
            param.grad.mul_(scale(step))
        recorder.step(step)
    return recorder


def _gradstat(*args: str) -> subprocess.CompletedProcess[str]:
    return run_gradstat(*args)


def test_a_torn_last_record_is_skipped_with_one_line(tmp_path: Path) -> None:
    _loop(tmp_path, range(1, 6))
    log = tmp_path / LOG_NAME
    whole = log.read_bytes()
    log.write_bytes(whole[:-7])  # the job killed mid-write
    result = _gradstat("history", str(tmp_path), "--json")
    assert result.returncode == 0, result.stderr
    (line,) = result.stderr.splitlines()
    assert "torn last record" in line and str(log) in line and "Traceback" not in line
    document = json.loads(result.stdout)
    assert document["steps"] == [1, 2, 3, 4]
    assert len(document["problems"]) == 1


def test_a_resumed_run_appends_after_a_torn_tail_and_its_replayed_steps_win(
    tmp_path: Path,
) -> None:
    _loop(tmp_path, range(1, 6))
    log = tmp_path / LOG_NAME
    log.write_bytes(log.read_bytes()[:-7])
    _loop(tmp_path, range(4, 8), scale=lambda _: 2.0)  # resumed from a checkpoint at step 4
    lines: list[str] = []
    history = read_history(tmp_path, report=lines.append)
    assert len(lines) == 1 and "torn" in lines[0]
    assert history.steps == [1, 2, 3, 4, 5, 6, 7]
    first = read_history(tmp_path, until=3, report=lambda _: None).totals
    assert history.totals[:3] == first
    # Steps 4 and 5 come from the resumed attempt (gradients doubled).
    again = _loop(tmp_path / "again", range(4, 6), scale=lambda _: 2.0)
    assert [record.norm for record in again.records] == history.totals[3:5]


def test_damaged_bytes_inside_the_log_are_skipped_and_the_rest_read(tmp_path: Path) -> None:
    _loop(tmp_path, range(1, 9))
    log = tmp_path / LOG_NAME
    data = bytearray(log.read_bytes())
    middle = len(data) // 2
    data[middle] ^= 0xFF
    log.write_bytes(bytes(data))
    lines: list[str] = []
    history = read_history(tmp_path, report=lines.append)
    assert len(lines) == 1 and "skipped" in lines[0], lines
    assert 6 <= len(history.steps) <= 7 and history.steps[0] == 1 and history.steps[-1] == 8


def test_a_full_disk_while_appending_keeps_training_and_warns_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, recorder_warnings: Callable[[], list[str]]
) -> None:
    real_write = os.write
    full = {"on": False}

    def write(fd: int, data: bytes) -> int:
        if full["on"] and data[:4] == b"GSTL":
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_write(fd, data)

    monkeypatch.setattr(log_module.os, "write", write)
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 3)
    recorder = gradstat.Recorder(model, tmp_path, spike=None)
    for step in range(1, 9):
        full["on"] = step in (3, 4, 5)
        model.zero_grad()
        model(torch.ones(2, 4) * step).sum().backward()
        assert math.isfinite(recorder.step(step))
    lines = recorder_warnings()
    assert len(lines) == 2, lines
    assert "cannot append to the telemetry log" in lines[0] and "No space left" in lines[0]
    assert "appending again; 3 record(s) were lost" in lines[1]
    history = read_history(tmp_path, report=lambda line: pytest.fail(line))
    assert history.steps == [1, 2, 6, 7, 8]
    assert history.params["weight"].steps == [1, 2, 6, 7, 8], "the layout was written again"


# --- the logged norm --------------------------------------------------------------------------


def test_a_logged_norm_that_disagrees_fires_mismatch_where_the_run_of_them_begins(
    tmp_path: Path, recorder_warnings: Callable[[], list[str]]
) -> None:
    torch.manual_seed(0)
    model = torch.nn.Linear(5, 3)
    recorder = gradstat.Recorder(model, tmp_path, spike=None)
    for step in range(1, 9):
        model.zero_grad()
        model(torch.randn(4, 5)).sum().backward()
        grads = [param.grad for param in model.parameters()]
        exact = float64_norm(grads, 2)
        # What a framework logs: its own fp32 norm (right), then twice it (a replica counted
        # twice in L2 squares gives sqrt(2); twice is plain wrong) for steps 4 to 6.
        logged = torch.nn.utils.get_total_norm(grads)
        if 4 <= step <= 6:
            logged = logged * 2
        recorder.step(step, logged_norm=logged)
        assert recorder.records[-1].logged_norm == pytest.approx(float(logged))
        assert math.isclose(recorder.records[-1].norm, exact, rel_tol=1e-12)
    fired = [(record.step, record.triggers) for record in recorder.records if record.triggers]
    assert fired == [(4, ("mismatch",))]
    line, explained = recorder_warnings()
    assert "step 4: the logged norm" in line and "2x the exact norm" in line
    # One process, one copy of each tensor: no miscount gradstat knows gives twice the norm.
    assert "step 4: no miscount gradstat knows gives the logged norm" in explained, explained
    assert recorder.records[3].snapshot is not None and recorder.records[3].snapshot.is_dir()
    document = json.loads(_gradstat("history", str(tmp_path), "--json").stdout)
    assert document["triggers"][3] == ["mismatch"]
    assert document["snapshots"][0]["step"] == 4
    assert all(value is not None for value in document["logged_norm"])


@pytest.mark.parametrize(
    ("logged", "why"),
    [("a", "must be a number"), (-1.0, "must be a norm"), (torch.ones(2), "one-element")],
)
def test_a_logged_norm_that_is_not_a_norm_is_refused(tmp_path: Path, logged: Any, why: str) -> None:
    model = torch.nn.Linear(2, 2)
    recorder = gradstat.Recorder(model, tmp_path, spike=None)
    model(torch.ones(1, 2)).sum().backward()
    with pytest.raises((TypeError, ValueError), match=why):
        recorder.step(1, logged_norm=logged)


def test_a_nan_logged_for_a_nan_norm_agrees(tmp_path: Path) -> None:
    model = torch.nn.Linear(2, 2)
    recorder = gradstat.Recorder(model, tmp_path, spike=None)
    model(torch.ones(1, 2)).sum().backward()
    model.weight.grad[0, 0] = math.nan
    recorder.step(1, logged_norm=math.nan)
    assert recorder.records[-1].triggers == ("nonfinite",)


def test_a_nan_logged_for_a_finite_norm_is_said_plainly(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """No "nanx the exact norm": a ratio of a NaN is no ratio."""
    model = torch.nn.Linear(2, 2)
    recorder = gradstat.Recorder(model, tmp_path, spike=None)
    model(torch.ones(1, 2)).sum().backward()
    norm = recorder.step(1, logged_norm=math.nan)
    recorder.wait()
    assert recorder.records[-1].triggers == ("mismatch",)
    lines = [line for line in caplog.messages if "step 1: the logged" in line]
    assert lines[0] == (
        f"gradstat recorder: step 1: the logged norm is nan, the exact norm {norm:.9g}"
    ), lines


def _log_logged_norms(directory: Path, logged: list[Any]) -> None:
    """A recorder's run over one gradient whose job logged ``logged[i]`` at step i + 1."""
    model = torch.nn.Linear(2, 2)
    recorder = gradstat.Recorder(model, directory, spike=None)
    model(torch.ones(1, 2)).sum().backward()
    for step, value in enumerate(logged, start=1):
        recorder.step(step, logged_norm=value)
    recorder.wait()


def test_a_logged_nan_reads_back_as_nan_and_none_as_none(tmp_path: Path) -> None:
    """A job that logged NaN is the one to look at: the log says NaN, not "logged none" (it
    wrote the two alike before format version 2). torch's 0/0 is a NaN with its sign set."""
    torch_nan = torch.zeros(()) / 0
    assert struct.pack("<d", float(torch_nan)) != struct.pack("<d", math.nan)  # another NaN
    _log_logged_norms(tmp_path, [1.5, torch_nan, None, math.inf, math.nan, 0.0])
    logged = read_history(tmp_path, report=lambda line: pytest.fail(line)).logged
    assert logged[0] == 1.5 and logged[2] is None and logged[3] == math.inf and logged[5] == 0.0
    assert all(value is not None and math.isnan(value) for value in (logged[1], logged[4]))
    document = json.loads(_gradstat("history", str(tmp_path), "--json").stdout)
    assert document["logged_norm"] == [1.5, "nan", None, "inf", "nan", 0.0]


def test_a_version_1_log_reads_its_nan_as_none(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Version 1 wrote a plain NaN where the job logged none (and where it logged NaN)."""
    with monkeypatch.context() as patched:
        patched.setattr(log_module, "FORMAT_VERSION", 1)
        patched.setattr(log_module, "_NO_LOGGED", struct.pack("<d", math.nan))
        _log_logged_norms(tmp_path, [2.5, None, math.nan])
    logged = read_history(tmp_path, report=lambda line: pytest.fail(line)).logged
    assert logged == [2.5, None, None]


# --- first jumps, in the order they began -----------------------------------------------------


def test_a_slow_rise_in_one_layer_comes_before_the_spike_it_led_to(tmp_path: Path) -> None:
    """Layer 1 rises 15% a step from step 60; layer 3 spikes 1000x at step 100, the largest
    move of all. The one that moved first is listed first."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(*(torch.nn.Linear(6, 6) for _ in range(4)))
    recorder = gradstat.Recorder(model, tmp_path, spike=None)
    inputs = torch.randn(8, 6)
    for step in range(1, 121):
        model.zero_grad()
        model(inputs * (1 + 0.01 * math.sin(step))).square().mean().backward()
        if step >= 60:
            model[1].weight.grad.mul_(1.15 ** (step - 59))
        if step == 100:
            model[3].weight.grad.mul_(1000.0)
        recorder.step(step)
    history = read_history(tmp_path)
    jumped = [(series.name, series.jump_kind) for series in history.jumped()]
    assert jumped[:2] == [("1.weight", "norm"), ("3.weight", "norm")], jumped
    rise, spike = history.params["1.weight"], history.params["3.weight"]
    assert rise.jump_step is not None and 60 < rise.jump_step < 100
    assert spike.jump_step == 100
    assert spike.jump_ratio is not None and spike.jump_ratio > 100
    table = _gradstat("history", str(tmp_path), "--top", "3").stdout
    rows = [line for line in table.splitlines() if "weight" in line]
    assert "1.weight" in rows[0] and "3.weight" in rows[1], table
    window = read_history(tmp_path, since=90, until=110)
    assert window.steps == list(range(90, 111))
    assert _gradstat("history", str(tmp_path), "--since", "9", "--until", "3").returncode == 2


# --- two ranks --------------------------------------------------------------------------------


def _ranks_log_different_norms(rank: int, world_size: int, directory: str) -> Any:
    """Replicas (plain data parallelism) whose loop logs its norm; at step 3 rank 1 logs
    another one (the ranks disagree on the norm they clip with)."""
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 3)
    lines: list[str] = []
    handler = _Lines(lines)
    logging.getLogger("gradstat.recorder").addHandler(handler)
    recorder = gradstat.Recorder(model, directory, spike=None, finalize_timeout_s=10)
    for step in range(1, 6):
        model.zero_grad()
        model(torch.ones(2, 4) * step).sum().backward()
        logged = torch.nn.utils.get_total_norm([param.grad for param in model.parameters()])
        if step == 3 and rank == 1:
            logged = logged * 1.5
        if step == 4 and rank == 1:  # an ulp apart (reduced in another order): one norm
            logged = math.nextafter(float(logged), math.inf)
        if step == 5:  # both replicas counted: what a loop summing over data parallelism logs
            logged = logged * math.sqrt(2.0)
        recorder.step(step, logged_norm=logged)
    recorder.wait()
    logging.getLogger("gradstat.recorder").removeHandler(handler)
    return [(record.step, record.triggers) for record in recorder.records], lines


def _stages(rank: int, world_size: int, directory: str) -> Any:
    """Two pipeline stages of plain tensors, each rank its own parameters (named by hand):
    the names agreed are both ranks' lists, each value from the rank that holds it."""
    torch.manual_seed(rank)
    weight = torch.nn.Parameter(torch.randn(3 + rank, 2))
    pairs = [(f"stage{rank}.weight", weight)]
    recorder = gradstat.Recorder(
        pairs,
        directory,
        spike=None,
        group=dist.group.WORLD,
        coords={"pp": [rank, world_size], "dp": [0, 1]},
    )
    grads = {}
    for step in range(1, 4):
        weight.grad = torch.randn(3 + rank, 2) * step
        if step == 2 and rank == 1:
            weight.grad[0, 0] = 0.0
        norm = recorder.step(step)
        assert recorder.params is not None
        grads[step] = weight.grad.clone()
        everyone: list[Any] = [None] * world_size
        dist.all_gather_object(everyone, grads[step])
        expected = {f"stage{index}.weight": _oracle([grad]) for index, grad in enumerate(everyone)}
        _check(recorder.params, expected)
        assert math.isclose(norm, float64_norm(everyone, 2), rel_tol=1e-12)
    return recorder.params.layout.names


def _recipes_in_fsdp2(rank: int, world_size: int, directory: str) -> Any:
    """The docs' recipes (setup, then the logged norm) in an FSDP2 loop: torch's own norm of
    the DTensor gradients is logged and clipped with; it agrees with the exact one."""
    model, _mesh = _torch_native.build("fsdp2")
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    namespace = {"model": model, "directory": directory, "optimizer": optimizer, "torch": torch}
    exec(recipe("recorder_setup"), namespace)
    results = []
    for step in range(1, 4):
        model.zero_grad()
        _torch_native.loss_of(model).backward()
        full = _torch_native.full_gradients(model)
        exec(recipe("recorder_logged"), namespace | {"step": step, "max_norm": 1e-3})
        record = namespace["recorder"].records[-1]
        results.append((record.norm, float64_norm(list(full.values()), 2), record.triggers))
        after = _torch_native.full_gradients(model)
        results[-1] += (float64_norm(list(after.values()), 2),)
        optimizer.step()
    return results


class _Lines(logging.Handler):
    def __init__(self, lines: list[str]) -> None:
        super().__init__()
        self.lines = lines

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


@pytest.mark.multiprocess
@pytest.mark.slow
def test_two_ranks_logged_norms_and_stages(tmp_path: Path) -> None:
    logged_run, stages_run = tmp_path / "logged", tmp_path / "stages"
    (tmp_path / "launch").mkdir()
    report = launch(
        2,
        tmp_path / "launch",
        [
            Case("logged", _ranks_log_different_norms, str(logged_run)),
            Case("stages", _stages, str(stages_run)),
            Case("fsdp2", _recipes_in_fsdp2, str(tmp_path / "fsdp2")),
        ],
        timeout_s=180,
    )
    (records0, lines0), (records1, lines1) = report.values("logged")
    expected = [(1, ()), (2, ()), (3, ("mismatch",)), (4, ()), (5, ("mismatch",))]
    assert records0 == expected and records1 == expected, "every rank alike"
    assert len(lines0) == 3, lines0
    assert "step 3: the ranks passed different logged norms" in lines0[0]
    assert "step 5: the logged norm" in lines0[1] and "1.41421" in lines0[1]
    # Rank 0 reads the step's snapshot and names the miscount (as gradstat explain does).
    assert "step 5: the logged norm is what dp_replica_counted gives" in lines0[2], lines0
    assert lines1 == [], "rank 0 says it"
    snapshots = sorted(path for path in logged_run.iterdir() if path.is_dir())
    assert [path.name for path in snapshots] == ["step-00000003", "step-00000005"]
    assert sorted(path.name for path in snapshots[0].glob("rank-*")) == [
        "rank-00000.safetensors",
        "rank-00001.safetensors",
    ]
    for names in report.values("stages"):
        assert names == ("stage0.weight", "stage1.weight")
    history = read_history(stages_run)
    assert sorted(history.params) == ["stage0.weight", "stage1.weight"]
    assert history.params["stage1.weight"].numel == 4 * 2
    for results in report.values("fsdp2"):
        for norm, expected, triggers, clipped in results:
            assert math.isclose(norm, expected, rel_tol=1e-9) and triggers == ()
            assert math.isclose(clipped, 1e-3, rel_tol=1e-4), "clipped with the logged norm"


def test_values_the_columns_cannot_hold_are_logged_exactly(
    tmp_path: Path, recorder_warnings: Callable[[], list[str]]
) -> None:
    """A float64 gradient's max outside float32's range, and one float32 rounds: the log keeps
    both exact (its ``extras``), and the norm of 1e300-sized elements too."""
    huge = torch.nn.Parameter(torch.zeros(3, dtype=torch.float64))
    fine = torch.nn.Parameter(torch.zeros(2, dtype=torch.float64))
    recorder = gradstat.Recorder([("huge", huge), ("fine", fine)], tmp_path, spike=None)
    huge.grad = torch.tensor([1e300, -3e299, 0.0], dtype=torch.float64)
    fine.grad = torch.tensor([0.1, -0.3], dtype=torch.float64)
    recorder.step(1)
    history = read_history(tmp_path)
    big, small = history.params["huge"], history.params["fine"]
    assert big.max_abs == [1e300] and small.max_abs == [0.3]
    assert big.zeros == [1] and small.zeros == [0]
    assert math.isclose(big.norms[0], 1e300 * math.sqrt(1 + 0.3**2), rel_tol=1e-12)
    assert math.isclose(small.norms[0], math.sqrt(0.1**2 + 0.3**2), rel_tol=1e-12)
    assert math.isclose(recorder.records[-1].norm, math.hypot(big.norms[0], small.norms[0]))
    huge.grad = torch.tensor([3e-200, 4e-200, 0.0], dtype=torch.float64)  # squares underflow
    recorder.step(2)
    assert recorder.params is not None
    assert math.isclose(recorder.params.norms[0] or 0.0, 5e-200, rel_tol=1e-12)
    assert recorder_warnings() == [], "the norm and the per-parameter squares agree"


def test_a_rank_that_cannot_describe_its_gradients_stops_the_statistics_not_the_job(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, recorder_warnings: Callable[[], list[str]]
) -> None:
    from gradstat.recorder import telemetry

    def broken(*args: Any, **kwargs: Any) -> Any:
        raise TypeError("an attribute no record can hold")

    monkeypatch.setattr(telemetry, "param_record", broken)
    model = torch.nn.Linear(3, 2)
    recorder = gradstat.Recorder(model, tmp_path, spike=None)
    for step in range(1, 4):
        model.zero_grad()
        model(torch.ones(2, 3) * step).sum().backward()
        norm = recorder.step(step)
        assert math.isclose(norm, float64_norm([p.grad for p in model.parameters()], 2))
        assert recorder.params is None
    lines = recorder_warnings()
    assert len(lines) == 2, lines  # why, and that the statistics are skipped (once)
    assert "an attribute no record can hold" in lines[0]
    history = read_history(tmp_path)
    assert history.steps == [1, 2, 3] and history.params == {}


class _Watched(torch.nn.Module):
    """Parameters whose walk notes whether Python's cyclic collector was running."""

    def __init__(self, count: int) -> None:
        super().__init__()
        self.pieces = torch.nn.ParameterList(
            torch.nn.Parameter(torch.ones(4)) for _ in range(count)
        )
        self.collector_running: list[bool] = []

    def named_parameters(self, *args: Any, **kwargs: Any) -> Any:
        self.collector_running.append(gc.isenabled())
        return super().named_parameters(*args, **kwargs)


@pytest.mark.parametrize("running", [True, False])
def test_a_step_pauses_the_collector_and_leaves_it_as_it_was(tmp_path: Path, running: bool) -> None:
    """A step makes objects by the gradient; the collector, paused while it runs (see
    ``gradstat._collector``), is as the loop had it after the step, and after a step that
    raises."""
    model = _Watched(50)
    for param in model.parameters():
        param.grad = torch.full((4,), 0.5)
    recorder = gradstat.Recorder(model, tmp_path / "run", spike=None)
    was = gc.isenabled()
    (gc.enable if running else gc.disable)()
    try:
        model.collector_running.clear()
        norm = recorder.step(0)
        with pytest.raises(GradstatError):
            recorder.step(-1)
        after = gc.isenabled()
    finally:
        (gc.enable if was else gc.disable)()
    assert model.collector_running and not any(model.collector_running)  # step 0 paused it
    assert after is running
    assert math.isclose(norm, math.sqrt(50 * 4 * 0.25), rel_tol=1e-12)

"""What the commands say of PyTorch distributed checkpoints saved in one process: the kinds,
the update between two checkpoints, the audit's moment and NaN findings, inspect's account.

Each checkpoint is written by the real ``dcp.save`` of a small model's ``get_state_dict`` after
AdamW steps; every expected number is computed here in float64 from the tensors that were
saved (``math.fsum`` of squares), never by gradstat.
"""

from __future__ import annotations

import json
import math
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
from typer.testing import CliRunner

from gradstat.cli import app

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")


def _l2(tensor: torch.Tensor) -> float:
    return math.sqrt(math.fsum(tensor.double().reshape(-1).square().tolist()))


def _model() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(1)
    model = torch.nn.Sequential(torch.nn.Linear(6, 7), torch.nn.ReLU(), torch.nn.Linear(7, 3))
    return model, torch.optim.AdamW(model.parameters(), lr=0.05)


def _step(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
    optimizer.zero_grad()
    model(torch.randn(5, 6)).square().sum().backward()
    optimizer.step()


def _save(directory: Path, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> Any:
    """dcp.save of the model and optimizer state; returns the state dicts saved (copies)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    weights, states = get_state_dict(model, optimizer)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save({"model": weights, "optimizer": states}, checkpoint_id=str(directory))
    saved = {name: tensor.detach().clone() for name, tensor in weights.items()}
    moments = {
        (name, stat): value.detach().clone()
        for name, state in states["state"].items()
        for stat, value in state.items()
        if stat in ("exp_avg", "exp_avg_sq")
    }
    return saved, moments


def _cli(*args: Any) -> tuple[int, dict[str, Any]]:
    result = CliRunner().invoke(app, [*map(str, args), "--json"])
    assert result.exit_code in (0, 1), result.output
    return result.exit_code, json.loads(result.stdout)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """step-1 and step-2 (one AdamW step apart), the tensors each holds, and a grads dump."""
    import torch.distributed.checkpoint as dcp

    root = tmp_path_factory.mktemp("checkpoints")
    model, optimizer = _model()
    _step(model, optimizer)
    first = _save(root / "step-1", model, optimizer)
    _step(model, optimizer)
    second = _save(root / "step-2", model, optimizer)
    grads = {name: param.grad.detach().clone() for name, param in model.named_parameters()}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save({"grads": grads}, checkpoint_id=str(root / "grads"))
    return {"root": root, "step-1": first, "step-2": second, "grads": grads}


@pytest.mark.parametrize("kind", ["weight", "exp_avg", "exp_avg_sq"])
def test_each_kind_by_parameter_against_float64(checkpoints: dict[str, Any], kind: str) -> None:
    weights, moments = checkpoints["step-2"]
    expected = weights if kind == "weight" else {n: t for (n, s), t in moments.items() if s == kind}
    code, report = _cli("norm", checkpoints["root"] / "step-2", "--kind", kind)
    assert code == 0 and report["snapshot"]["kind"] == kind
    assert report["snapshot"]["source"] == "dcp" and report["snapshot"]["step"] == 2
    assert report["snapshot"]["dtensor"] is False  # plain tensors saved: chunks say no more
    rows = {row["name"]: row["norm"] for row in report["params"]}
    assert sorted(rows) == sorted(expected)  # named by parameter, not by key
    for name, tensor in expected.items():
        assert math.isclose(rows[name], _l2(tensor), rel_tol=1e-12), name
    total = math.sqrt(math.fsum(_l2(tensor) ** 2 for tensor in expected.values()))
    assert math.isclose(report["total_norm"], total, rel_tol=1e-12)
    _, inf = _cli("norm", checkpoints["root"] / "step-2", "--kind", kind, "-p", "inf")
    assert inf["total_norm"] == max(float(t.abs().max()) for t in expected.values())


def test_a_grads_dump_is_read_as_gradients_and_all_by_key(checkpoints: dict[str, Any]) -> None:
    grads = checkpoints["grads"]
    code, report = _cli("norm", checkpoints["root"] / "grads")
    assert code == 0 and report["snapshot"]["kind"] == "grad"  # the default where it has grads
    total = math.sqrt(math.fsum(_l2(tensor) ** 2 for tensor in grads.values()))
    assert math.isclose(report["total_norm"], total, rel_tol=1e-12)
    _, everything = _cli("norm", checkpoints["root"] / "step-2", "--kind", "all", "--top", "99")
    names = {row["name"] for row in everything["params"]}
    assert "model.0.weight" in names and "optimizer.state.0.weight.exp_avg_sq" in names
    assert not any(name.endswith(".step") for name in names)  # counters are no statistic's


def test_explain_a_grads_dump(checkpoints: dict[str, Any]) -> None:
    grads = checkpoints["grads"]
    doubled = math.sqrt(2 * math.fsum(_l2(tensor) ** 2 for tensor in grads.values()))
    code, report = _cli("explain", checkpoints["root"] / "grads", "--logged", repr(doubled))
    assert code == 1 and report["best"] is None  # one copy of everything: nothing doubles it
    exact = math.sqrt(math.fsum(_l2(tensor) ** 2 for tensor in grads.values()))
    code, report = _cli("explain", checkpoints["root"] / "grads", "--logged", repr(exact))
    assert code == 0 and report["best"] == "exact"


def test_compare_two_checkpoints_gives_each_update_largest_first(
    checkpoints: dict[str, Any],
) -> None:
    before, _ = checkpoints["step-1"]
    after, _ = checkpoints["step-2"]
    root = checkpoints["root"]
    code, report = _cli("compare", root / "step-1", root / "step-2")
    assert code == 0 and report["updates"] and report["mismatches"] == []
    updates = {name: _l2(after[name].double() - before[name].double()) for name in before}
    for row in report["params"]:
        assert math.isclose(row["diff_norm"], updates[row["name"]], rel_tol=1e-12), row["name"]
        relative = updates[row["name"]] / _l2(before[row["name"]])
        assert math.isclose(row["rel_diff_norm"], relative, rel_tol=1e-12)
        expected_max = float(
            (after[row["name"]].double() - before[row["name"]].double()).abs().max()
        )
        assert row["max_abs_diff"] == expected_max
    shown = [row["diff_norm"] for row in report["params"]]
    assert shown == sorted(shown, reverse=True)
    # The same checkpoint twice: every weight unchanged, flagged, exit 1.
    code, report = _cli("compare", root / "step-1", root / "step-1")
    assert code == 1 and sorted(report["mismatches"]) == sorted(before)
    assert all(row["flags"] == ["unchanged"] for row in report["params"])
    table = CliRunner().invoke(app, ["compare", str(root / "step-1"), str(root / "step-1")])
    assert "4 parameters did not change" in table.stdout


def test_compare_a_checkpoints_grads_with_another_kind_passes_nothing_silently(
    checkpoints: dict[str, Any],
) -> None:
    """Gradients against weights (the same names, other values): neither an update
    comparison nor a list of every parameter flagged, but one line naming both kinds."""
    root = checkpoints["root"]
    result = CliRunner().invoke(app, ["compare", str(root / "grads"), str(root / "step-2")])
    assert result.exit_code == 2 and result.stdout == ""
    assert result.stderr == (
        f"gradstat: error: {root / 'step-2'}: holds model weights, {root / 'grads'} gradients: "
        "compare compares one kind of tensor (--kind chooses a checkpoint's)\n"
    )


def test_audit_finds_a_moment_zero_throughout_and_a_nan_weight(tmp_path: Path) -> None:
    model, optimizer = _model()
    model(torch.randn(5, 6)).square().sum().backward()
    model[0].bias.grad.zero_()  # a parameter whose gradient is zero: its moments stay zero
    optimizer.step()
    with torch.no_grad():
        model[2].weight[1, 2] = float("nan")
    _save(tmp_path, model, optimizer)
    for kind, expected in (
        ("exp_avg", [("moment_zero", "0.bias")]),
        ("exp_avg_sq", [("moment_zero", "0.bias")]),
        ("weight", [("nonfinite", "2.weight")]),
    ):
        code, report = _cli("audit", tmp_path, "--kind", kind)
        found = [(finding["kind"], finding["name"]) for finding in report["findings"]]
        assert code == 1 and found == expected, (kind, found)
    (finding,) = _cli("audit", tmp_path, "--kind", "weight")[1]["findings"]
    assert "1 NaN and 0 Inf" in finding["detail"]


def test_a_clean_checkpoints_audit_has_no_finding(checkpoints: dict[str, Any]) -> None:
    for kind in ("weight", "exp_avg", "exp_avg_sq"):
        code, report = _cli("audit", checkpoints["root"] / "step-2", "--kind", kind)
        assert code == 0 and report["findings"] == [], kind


def test_inspect_says_what_the_checkpoint_holds(checkpoints: dict[str, Any]) -> None:
    code, report = _cli("inspect", checkpoints["root"] / "step-2")
    assert code == 0 and report["snapshot"]["kind"] == "weight"
    assert {row["kind"] for row in report["params"]} == {"checkpoint chunk"}
    (note,) = report["notes"]
    assert "model weights (4)" in note and "Adam second moments (exp_avg_sq) (4)" in note
    assert "step (4)" in note
    keys = {row["name"]: row["sources"] for row in report["params"]}
    assert keys["0.weight"] == ["__0_0.distcp:offset [0, 0]/model.0.weight"]


def test_history_over_checkpoints(checkpoints: dict[str, Any], tmp_path: Path) -> None:
    import shutil

    run = tmp_path / "run"
    for name in ("step-1", "step-2"):
        shutil.copytree(checkpoints["root"] / name, run / name)
    code, report = _cli("history", run, "--source", "snapshots")
    assert code == 0 and report["steps"] == [1, 2]
    for index, name in enumerate(("step-1", "step-2")):
        weights, _ = checkpoints[name]
        total = math.sqrt(math.fsum(_l2(tensor) ** 2 for tensor in weights.values()))
        assert math.isclose(report["total_norm"][index], total, rel_tol=1e-12)


def test_a_gradient_snapshot_and_a_checkpoint_name_what_one_lacks(
    checkpoints: dict[str, Any], tmp_path: Path
) -> None:
    """A gradstat snapshot of the gradients without one parameter against the checkpoint's
    grads dump: the others agree bit for bit, the missing one is flagged only_in_b."""
    from gradstat.snapshot import save_rank
    from tests._params import param_with

    grads = checkpoints["grads"]
    kept = [(name, param_with(grad.clone())) for name, grad in grads.items() if name != "2.bias"]
    save_rank(tmp_path / "snapshot", kept, rank=0, world_size=1, coords={}, step=2)
    code, report = _cli("compare", tmp_path / "snapshot", checkpoints["root"] / "grads")
    assert code == 1 and report["mismatches"] == ["2.bias"]
    rows = {row["name"]: row for row in report["params"]}
    assert rows["2.bias"]["flags"] == ["only_in_b"] and rows["2.bias"]["norm_a"] is None
    assert all(rows[name]["max_abs_diff"] == 0.0 for name in grads if name != "2.bias")

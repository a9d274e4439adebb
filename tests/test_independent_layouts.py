"""compare and audit on the tests' GPT in many layouts, against whole tensors and float64.

Each layout (tests/_jobs.py over gradstat.testing's sharder; ranks written with save_rank alone)
is compared with a reference whose rank files hold whole tensors (only pipeline stages split
it, so nothing needs placing) and checked against the float64 statistics of the unsharded
gradients, so a convention that the sharder and the rebuilder (gradstat/analysis/tiles.py)
shared wrongly would show; pairs of different layouts must agree element by element; then
single planted differences, in a shard, a fragment or a replica, must be found and named. GTP
padding is planted where the padding mask (cut from a really padded tensor) says it is.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest
import torch
from typer.testing import CliRunner

from gradstat import testing
from gradstat.cli import app
from tests._jobs import (
    EMBEDDING,
    LAYERS,
    OUTPUT_COPY,
    ZERO_EXPERT,
    Job,
    dump_layout,
    full_grads,
    gtp_geometry,
    model_specs,
    offline_view,
)
from tests._oracle import float64_norm, rel_err, zeros_in

LAYOUTS = [
    Job("tp2", tp=2),
    Job("tp2_pp2_tied", tp=2, pp=2),
    Job("tp2_dp2_distopt", tp=2, dp=2, distopt=True),
    Job("pp2_dp2_distopt_tied", pp=2, dp=2, distopt=True),
    Job("tp2_dp2_ep2_etp2_moe", tp=2, dp=2, ep=2, etp=2, moe=True),
    Job("gtp4_spill", gtp=4, align=8),
    Job("gtp2_dp2_distopt", gtp=2, dp=2, distopt=True),
    Job("gtp2_dp2_ep2_egtp2_moe_spill", gtp=2, dp=2, ep=2, egtp=2, moe=True, align=8),
    Job("tp2_gtp2_pp2_ep2_moe_distopt", tp=2, gtp=2, pp=2, ep=2, moe=True, distopt=True),
    Job("tp2_cp2_plain", tp=2, cp=2),
    Job("cp2_dp2_ep2_moe_distopt", cp=2, dp=2, ep=2, moe=True, distopt=True),
]

LAYERNORM = "decoder.layers.0.input_layernorm.weight"
QKV = "decoder.layers.0.self_attention.linear_qkv.weight"
EXPERT_BIAS = "decoder.layers.1.mlp.experts.local_experts.2.linear_fc2.bias"


def _cli(*args: str) -> tuple[int, dict[str, Any]]:
    result = CliRunner().invoke(app, [*args, "--json"])
    assert result.exit_code in (0, 1), result.output
    return result.exit_code, json.loads(result.stdout)


def _rows(report: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {row["name"]: row for row in report["params"]}


def _logical(moe: bool) -> dict[str, torch.Tensor]:
    grads = full_grads(moe)
    return {spec.name: grads[spec.name] for spec in model_specs(moe)}


def _reference(layout: Job, directory: Path) -> Path:
    """The same model on ``layout.pp`` stages and nothing else: every tensor whole."""
    return dump_layout(Job("reference", pp=layout.pp, moe=layout.moe), directory)


def _squares(tensor: torch.Tensor) -> float:
    return float(tensor.double().square().sum())


@pytest.mark.parametrize("layout", LAYOUTS, ids=lambda layout: layout.name)
def test_independent_layout_rebuilds_to_the_full_gradients(layout: Job, tmp_path: Path) -> None:
    sharded = dump_layout(layout, tmp_path / "sharded")
    reference = _reference(layout, tmp_path / "reference")
    code, report = _cli("compare", str(sharded), str(reference), "--all")
    assert code == 0 and report["mismatches"] == [] and not report["flagged"]
    grads = _logical(layout.moe)
    rows = _rows(report)
    assert sorted(rows) == sorted(grads)
    for name, grad in grads.items():
        row = rows[name]
        assert row["max_abs_diff"] == 0.0 and row["not_rebuilt"] is None, row
        assert row["shape_a"] == list(grad.shape), name
        assert math.isclose(row["norm_a"], float64_norm([grad], 2), rel_tol=1e-6), name
        assert row["zeros_a"] == zeros_in([grad]), name
    code, audit = _cli("audit", str(sharded))
    unrouted = _unrouted(layout.moe)
    assert code == (1 if unrouted else 0), audit["findings"]
    assert [(item["kind"], item["name"]) for item in audit["findings"]] == unrouted
    assert rel_err(audit["total_norm"], float64_norm(list(grads.values()), 2)) <= 1e-6


def _unrouted(moe: bool) -> list[tuple[str, str]]:
    """audit's finding of the expert no token reaches (ZERO_EXPERT, in every MoE layer)."""
    if not moe:
        return []
    expert = f"mlp.experts[{ZERO_EXPERT}]"
    return [("expert_never_routed", f"decoder.layers.{layer}.{expert}") for layer in range(LAYERS)]


def _without_unrouted(findings: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [item for item in findings if item["kind"] != "expert_never_routed"]


def _layout_snapshot(directory: Path, moe: bool, layout: testing.Layout) -> Path:
    """The tests' model in ``layout``, written with gradstat.testing.write_snapshot."""
    specs = model_specs(moe, layout.pp)
    testing.write_snapshot(
        directory, layout, testing.shard_gradients(layout, specs, _logical(moe)), step=7
    )
    return directory


@pytest.mark.parametrize(
    ("ours", "theirs"),
    [
        (
            Job("tp2_gtp2_dp2_distopt", tp=2, gtp=2, dp=2, distopt=True, align=8),
            testing.Layout(tp=4),
        ),
        (
            Job("cp2_dp2_ep2_moe_distopt", cp=2, dp=2, ep=2, moe=True, distopt=True),
            testing.Layout(tp=2, gtp=2, dp=2, ep=2, etp=2, egtp=2, gtp_align=4),
        ),
        (Job("tp2_pp2_tied", tp=2, pp=2), testing.Layout(gtp=2, cp=2, pp=2, gtp_align=4)),
    ],
    ids=["gtp-distopt-vs-tp4", "cp-moe-distopt-vs-gtp-egtp", "tp-pp-vs-gtp-cp-pp"],
)
def test_two_layouts_of_the_same_gradients_agree(
    ours: Job, theirs: testing.Layout, tmp_path: Path
) -> None:
    a = dump_layout(ours, tmp_path / "a")
    assert ours.pp == theirs.pp  # a tied output layer exists on both sides or on neither
    b = _layout_snapshot(tmp_path / "b", ours.moe, theirs)
    code, report = _cli("compare", str(a), str(b), "--all")
    assert code == 0 and report["mismatches"] == []
    assert sorted(_rows(report)) == sorted(_logical(ours.moe))
    for row in report["params"]:
        assert row["max_abs_diff"] == 0.0 and row["zeros_a"] == row["zeros_b"], row


def _plant(layout: Job, name: str, where: dict[str, int], element: int, value: float) -> Any:
    """A ``plant`` for dump_layout setting one element of ``name`` on the ranks at ``where``
    (coordinates of the dense or expert axes); it records the ranks and the old values."""
    planted: dict[str, Any] = {"ranks": [], "old": []}

    def plant(rank: int, params: list[torch.nn.Parameter]) -> None:
        view = offline_view(layout, rank)
        coords = view.dense | view.expert
        if not all(coords.get(axis, 0) == value for axis, value in where.items()):
            return
        for param in params:
            if param._gradstat_name == name and element < param.numel():
                flat = param.grad.view(-1)
                planted["old"].append(float(flat[element]))
                flat[element] = value
                planted["ranks"].append(rank)

    plant.planted = planted  # type: ignore[attr-defined]
    return plant


def test_a_changed_tp_shard_is_found_and_named(tmp_path: Path) -> None:
    """A shard of a column-parallel weight on TP rank 1: compare names it and measures it;
    audit has nothing to say (a shard has no copy to disagree with)."""
    layout = Job("tp2", tp=2)
    plant = _plant(layout, QKV, {"tp": 1}, element=5, value=7.5)
    changed = dump_layout(layout, tmp_path / "changed", plant=plant)
    assert plant.planted["ranks"] == [1]
    code, report = _cli("compare", str(_reference(layout, tmp_path / "ref")), str(changed))
    assert code == 1 and report["mismatches"] == [QKV]
    row = _rows(report)[QKV]
    assert "values" in row["flags"] and "norm" in row["flags"]
    assert row["max_abs_diff"] == abs(7.5 - plant.planted["old"][0])
    grad = _logical(False)[QKV].clone()
    grad.chunk(2)[1].reshape(-1)[5] = 7.5
    assert rel_err(row["norm_b"], float64_norm([grad], 2)) <= 1e-6
    code, audit = _cli("audit", str(changed))
    assert code == 0 and audit["findings"] == []


def test_a_changed_fragment_on_a_cp_rank_is_found_and_named(tmp_path: Path) -> None:
    """Distributed optimizer: CP rank 1's fragment of the flat buffer, its last element."""
    layout = Job("cp2_dp2_distopt", cp=2, dp=2, distopt=True)
    planted: dict[str, Any] = {}

    def plant(rank: int, params: list[torch.nn.Parameter]) -> None:
        view = offline_view(layout, rank)
        if (view.dense["cp"], view.dense["dp"]) == (1, 0):
            fragment = params[-1]
            planted.update(name=fragment._gradstat_name, old=float(fragment.grad.view(-1)[-1]))
            fragment.grad.view(-1)[-1] = -3.0

    changed = dump_layout(layout, tmp_path / "changed", plant=plant)
    code, report = _cli("compare", str(dump_layout(layout, tmp_path / "clean")), str(changed))
    assert code == 1 and report["mismatches"] == [planted["name"]]
    row = _rows(report)[planted["name"]]
    assert "values" in row["flags"] and row["max_abs_diff"] == abs(-3.0 - planted["old"])


@pytest.mark.parametrize(
    ("layout", "name", "where", "kind", "axis"),
    [
        (Job("tp2", tp=2), LAYERNORM, {"tp": 1}, "tp_replicas_differ", "TP"),
        (Job("tp2_dp2", tp=2, dp=2), LAYERNORM, {"dp": 1}, "dp_replicas_differ", None),
        (Job("tp2_cp2", tp=2, cp=2), LAYERNORM, {"cp": 1}, "cp_replicas_differ", None),
        (
            Job("tp2_dp2_ep2_etp2_moe", tp=2, dp=2, ep=2, etp=2, moe=True),
            EXPERT_BIAS,
            {"etp": 1},
            "tp_replicas_differ",
            "ETP",
        ),
        (Job("gtp2", gtp=2, align=8), LAYERNORM, {"gtp": 1}, "gtp_replicas_differ", "GTP"),
    ],
    ids=["tp-replica", "dp-replica", "cp-replica", "etp-replica", "gtp-replica"],
)
def test_a_replica_that_differs_is_found_by_audit_not_by_compare(
    layout: Job, name: str, where: dict[str, int], kind: str, axis: str | None, tmp_path: Path
) -> None:
    """An uncounted copy leaves every number as it was (compare agrees with the reference); the
    broken promise is audit's finding, naming the parameter, the copies and the counted one."""
    plant = _plant(layout, name, where, element=2, value=9.0)
    changed = dump_layout(layout, tmp_path / "changed", plant=plant)
    assert plant.planted["ranks"]
    code, report = _cli("compare", str(changed), str(_reference(layout, tmp_path / "ref")))
    assert code == 0 and report["mismatches"] == []
    code, audit = _cli("audit", str(changed))
    # Besides the MoE layout's expert that no token reaches, one finding: the planted one.
    found = _without_unrouted(audit["findings"])
    assert code == 1 and len(found) == 1, audit["findings"]
    (finding,) = found
    assert finding["kind"] == kind and finding["name"] == name
    assert set(plant.planted["ranks"]) < set(finding["ranks"])
    assert finding["max_abs_diff"] == abs(9.0 - plant.planted["old"][0])
    if axis is not None:
        assert axis in finding["detail"]
    grad = _logical(layout.moe)[name]
    miscounted = grad.clone()
    miscounted.view(-1)[2] = 9.0
    total = float64_norm(list(_logical(layout.moe).values()), 2)
    expected = math.sqrt(total**2 - _squares(grad) + _squares(miscounted))
    assert rel_err(finding["norm_if_miscounted"], expected) <= 1e-6


def test_gtp_padding_that_is_not_zero_is_found(tmp_path: Path) -> None:
    """The padding mask comes from a padded tensor, not from gradstat's arithmetic."""
    layout = Job("gtp4_spill", gtp=4, align=8)
    assert any(shard.spills for shard in gtp_geometry(layout))
    holder: dict[str, Any] = {}

    def plant(rank: int, params: list[torch.nn.Parameter]) -> None:
        for param in params:
            mask = testing.padding_mask(param)
            if not holder and mask is not None and bool(mask.any()):
                index = int(mask.reshape(-1).nonzero()[0])
                param.grad.view(-1)[index] = 0.25
                holder.update(rank=rank, name=param._gradstat_name)

    changed = dump_layout(layout, tmp_path / "changed", plant=plant)
    code, audit = _cli("audit", str(changed))
    assert code == 1 and len(audit["findings"]) == 1, audit["findings"]
    (finding,) = audit["findings"]
    assert finding["kind"] == "gtp_padding_nonzero" and finding["name"] == holder["name"]
    assert finding["ranks"] == [holder["rank"]] and finding["max_abs_diff"] == 0.25
    code, report = _cli("compare", str(changed), str(_reference(layout, tmp_path / "ref")))
    assert code == 1 and report["mismatches"] == [holder["name"]]
    row = _rows(report)[holder["name"]]
    assert set(row["flags"]) == {"norm", "zeros"} and row["max_abs_diff"] == 0.0  # stripped


def test_a_tied_copy_that_differs_is_found(tmp_path: Path) -> None:
    layout = Job("tp2_pp2_tied", tp=2, pp=2)
    plant = _plant(layout, OUTPUT_COPY, {"tp": 0}, element=9, value=4.0)
    changed = dump_layout(layout, tmp_path / "changed", plant=plant)
    code, audit = _cli("audit", str(changed))
    assert code == 1 and len(audit["findings"]) == 1, audit["findings"]
    (finding,) = audit["findings"]
    assert finding["kind"] == "tied_copies_differ" and finding["name"] == OUTPUT_COPY
    assert finding["max_abs_diff"] == abs(4.0 - plant.planted["old"][0])
    assert EMBEDDING in finding["detail"]

"""gradstat audit: clean snapshots give no finding; each planted defect is found and measured.

Each expected norm comes from float64 sums of squares of the unsharded gradients, with the
defect applied the way Megatron would count it.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest
import torch
from typer.testing import CliRunner

from gradstat.cli import app
from gradstat.testing import Layout, RankParams
from tests import _model
from tests._cli import SAMPLE_DATA
from tests._model import EMBEDDING, LAYERNORM, OUTPUT, PROJ, QKV, expert, full_grads, params_named
from tests._oracle import float64_norm, rel_err


def _audit(directory: Path, *args: str) -> tuple[int, dict[str, Any]]:
    result = CliRunner().invoke(app, ["audit", str(directory), "--json", *args])
    assert result.exit_code in (0, 1), result.output
    return result.exit_code, json.loads(result.stdout)


def _squares(tensor: torch.Tensor) -> float:
    return float(tensor.double().square().sum())


def _true_norm() -> float:
    return float64_norm(list(full_grads().values()), 2)


def _only_finding(report: dict[str, Any]) -> dict[str, Any]:
    assert len(report["findings"]) == 1, report["findings"]
    return report["findings"][0]


def _on(ranks: list[RankParams], name: str, **coords: int) -> list[torch.nn.Parameter]:
    """The params called ``name`` on the ranks at ``coords`` (axis: rank on it)."""
    return [
        param
        for share, param in params_named(ranks, name)
        if all(share.coords[axis][0] == value for axis, value in coords.items())
    ]


@pytest.mark.parametrize(
    "layout",
    [
        Layout(tp=2, dp=2),
        Layout(tp=2, pp=2, dp=2, distributed_optimizer=True),
        Layout(gtp=4, gtp_align=8),
        Layout(tp=2, gtp=2, dp=2, ep=2, egtp=2, gtp_align=8),
        Layout(pp=2, dp=4, ep=2, etp=2),
        Layout(gtp=2, pp=2, dp=2, distributed_optimizer=True, gtp_align=8),
    ],
    ids=[
        "tp2-dp2",
        "tp2-pp2-dp2-distopt",
        "gtp4-spill",
        "tp2-gtp2-ep2-egtp2",
        "pp2-dp4-ep2-etp2",
        "gtp2-pp2-dp2-distopt",
    ],
)
def test_clean_snapshot_has_no_finding(tmp_path: Path, layout: Layout) -> None:
    code, report = _audit(_model.write(tmp_path, layout))
    assert code == 0 and report["findings"] == []
    tied_copy = 1 if layout.pp > 1 else 0  # on one stage, the embedding is the output layer
    assert report["params_checked"] == len(full_grads()) + tied_copy
    assert rel_err(report["total_norm"], _true_norm()) <= 1e-6


@pytest.mark.parametrize("sample", ["tp2-pp2-dp2-ep2-distopt", "gtp2-pp2-dp2-ep2"])
def test_sample_snapshots_are_clean(sample: str) -> None:
    """No broken promise: the one finding is the MoE layer's expert 2, which no token reaches
    (sample_data/make_sample_data.py masks it out of the router)."""
    code, report = _audit(SAMPLE_DATA / sample)
    finding = _only_finding(report)
    assert code == 1 and finding["kind"] == "expert_never_routed"
    assert finding["name"] == "decoder.layers.1.mlp.experts[2]"


def test_layernorm_differing_across_tp_ranks(tmp_path: Path) -> None:
    """Megatron-LM#1446: a replicated weight's gradient differs between TP ranks (the same on
    both data-parallel replicas). Megatron counts TP rank 0's copy."""
    grads = full_grads()
    changed = grads[LAYERNORM].clone()
    changed[3] += 0.5

    def plant(ranks: list[RankParams]) -> None:
        for param in _on(ranks, LAYERNORM, tp=1):
            param.grad.copy_(changed)

    code, report = _audit(_model.write(tmp_path, Layout(tp=2, dp=2), plant=plant))
    assert code == 1
    finding = _only_finding(report)
    assert finding["kind"] == "tp_replicas_differ" and finding["name"] == LAYERNORM
    assert finding["ranks"] == [0, 1, 2, 3]
    assert finding["max_abs_diff"] == float(changed[3].double() - grads[LAYERNORM][3].double())
    total = _true_norm()
    expected = math.sqrt(total**2 - _squares(grads[LAYERNORM]) + _squares(changed))
    assert rel_err(finding["norm_if_miscounted"], expected) <= 1e-6
    assert math.isclose(finding["norm_change"], expected / total - 1, rel_tol=0, abs_tol=1e-7)
    assert "TP" in finding["detail"]


def test_expert_bias_differing_across_etp_ranks(tmp_path: Path) -> None:
    name = expert(1, "fc1", "bias")

    def plant(ranks: list[RankParams]) -> None:
        (param,) = _on(ranks, name, etp=1)
        param.grad[0] = -4.0

    code, report = _audit(_model.write(tmp_path, Layout(tp=2, etp=2), plant=plant))
    finding = _only_finding(report)
    assert code == 1 and finding["kind"] == "tp_replicas_differ" and finding["name"] == name
    assert finding["ranks"] == [0, 1] and "ETP" in finding["detail"]
    assert finding["max_abs_diff"] == abs(-4.0 - float(full_grads()[name][0]))


def test_replica_differing_across_gtp_ranks(tmp_path: Path) -> None:
    def plant(ranks: list[RankParams]) -> None:
        (param,) = _on(ranks, LAYERNORM, gtp=1)
        param.grad.mul_(2.0)

    code, report = _audit(_model.write(tmp_path, Layout(gtp=2, gtp_align=8), plant=plant))
    finding = _only_finding(report)
    assert code == 1 and finding["kind"] == "gtp_replicas_differ" and finding["ranks"] == [0, 1]
    grad = full_grads()[LAYERNORM]
    expected = math.sqrt(_true_norm() ** 2 + 3 * _squares(grad))
    assert rel_err(finding["norm_if_miscounted"], expected) <= 1e-6


@pytest.mark.parametrize("name", [EMBEDDING, expert(3)])
def test_data_parallel_replicas_differ_under_a_plain_optimizer(tmp_path: Path, name: str) -> None:
    grads = full_grads()

    def plant(ranks: list[RankParams]) -> None:
        (param,) = [p for share, p in params_named(ranks, name) if share.rank == 1]
        param.grad.zero_()

    code, report = _audit(_model.write(tmp_path, Layout(dp=2), plant=plant))
    finding = _only_finding(report)
    assert code == 1 and finding["kind"] == "dp_replicas_differ" and finding["name"] == name
    assert finding["ranks"] == [0, 1]
    assert finding["max_abs_diff"] == float64_norm([grads[name]], math.inf)
    expected = math.sqrt(_true_norm() ** 2 - _squares(grads[name]))
    assert rel_err(finding["norm_if_miscounted"], expected) <= 1e-6


@pytest.mark.parametrize("distributed", [False, True], ids=["plain", "distopt"])
def test_tied_copy_differing_from_its_original(tmp_path: Path, distributed: bool) -> None:
    grads = full_grads()
    layout = Layout(pp=2, dp=2, distributed_optimizer=distributed)
    element = 5 * 16 + 7  # a non-zero element of the embedding, flat

    def plant(ranks: list[RankParams]) -> None:
        for _, param in params_named(ranks, OUTPUT):
            start = getattr(param, "fragment_offset", 0)
            if start <= element < start + param.grad.numel():
                param.grad.view(-1)[element - start] += 2.0

    code, report = _audit(_model.write(tmp_path, layout, plant=plant))
    finding = _only_finding(report)
    assert code == 1 and finding["kind"] == "tied_copies_differ" and finding["name"] == OUTPUT
    original = float(grads[EMBEDDING].view(-1)[element])
    assert finding["max_abs_diff"] == pytest.approx(2.0, rel=1e-6)
    expected = math.sqrt(_true_norm() ** 2 - original**2 + (original + 2.0) ** 2)
    assert rel_err(finding["norm_if_miscounted"], expected) <= 1e-6
    assert EMBEDDING in finding["detail"]


def test_tied_copy_not_marked_shared_is_counted_twice(tmp_path: Path) -> None:
    """The tied embedding counted on both stages: the norm is inflated; the finding gives the
    norm counted once."""

    def plant(ranks: list[RankParams]) -> None:
        for _, param in params_named(ranks, OUTPUT):
            param.shared = False

    code, report = _audit(_model.write(tmp_path, Layout(tp=2, pp=2), plant=plant))
    finding = _only_finding(report)
    assert code == 1 and finding["kind"] == "tied_copy_counted_twice"
    assert finding["name"] == OUTPUT and finding["ranks"] == [0, 1, 2, 3]
    embedding = _squares(full_grads()[EMBEDDING])
    inflated = math.sqrt(_true_norm() ** 2 + embedding)
    assert rel_err(report["total_norm"], inflated) <= 1e-6
    assert rel_err(finding["norm_if_miscounted"], _true_norm()) <= 1e-6


def test_replicated_weight_marked_tensor_parallel(tmp_path: Path) -> None:
    """A replicated layernorm marked tensor-parallel is counted once per TP rank."""

    def plant(ranks: list[RankParams]) -> None:
        for _, param in params_named(ranks, LAYERNORM):
            param.tensor_model_parallel, param.partition_dim = True, 0

    code, report = _audit(_model.write(tmp_path, Layout(tp=4), plant=plant))
    finding = _only_finding(report)
    assert code == 1 and finding["kind"] == "tp_shards_identical" and finding["name"] == LAYERNORM
    assert finding["ranks"] == [0, 1, 2, 3]
    layernorm = _squares(full_grads()[LAYERNORM])
    assert rel_err(report["total_norm"], math.sqrt(_true_norm() ** 2 + 3 * layernorm)) <= 1e-6
    assert rel_err(finding["norm_if_miscounted"], _true_norm()) <= 1e-6


@pytest.mark.parametrize("distributed", [False, True], ids=["plain", "distopt"])
def test_gtp_padding_that_is_not_zero(tmp_path: Path, distributed: bool) -> None:
    # QKV's 40 rows, TP-local 20, are padded to 32 for GTP 2 (align 8): GTP rank 1 holds local
    # rows 16..31 of which rows 4..15 are padding.
    layout = Layout(tp=2, gtp=2, dp=2, gtp_align=8, distributed_optimizer=distributed)
    element = 10 * 16 + 3  # row 10 of GTP rank 1's shard: padding

    def plant(ranks: list[RankParams]) -> None:
        for param in _on(ranks, QKV, tp=0, gtp=1):
            start = getattr(param, "fragment_offset", 0)
            if start <= element < start + param.grad.numel():
                param.grad.view(-1)[element - start] = 3.0

    code, report = _audit(_model.write(tmp_path, layout, plant=plant))
    finding = _only_finding(report)
    assert code == 1 and finding["kind"] == "gtp_padding_nonzero" and finding["name"] == QKV
    assert finding["max_abs_diff"] == 3.0 and len(finding["ranks"]) == 1
    assert rel_err(report["total_norm"], math.sqrt(_true_norm() ** 2 + 9.0)) <= 1e-6
    assert rel_err(finding["norm_if_miscounted"], _true_norm()) <= 1e-6
    assert "1 of" in finding["detail"]


def test_attributes_that_disagree_across_ranks(tmp_path: Path) -> None:
    def plant(ranks: list[RankParams]) -> None:
        (param,) = _on(ranks, PROJ, tp=1)
        param.tensor_model_parallel = False

    code, report = _audit(_model.write(tmp_path, Layout(tp=2), plant=plant))
    finding = _only_finding(report)
    assert code == 1 and finding["kind"] == "attributes" and finding["name"] == PROJ
    assert finding["ranks"] == [1] and "tensor_model_parallel is False" in finding["detail"]
    # Rank 1's half, marked replicated on TP rank 1, is dropped as a duplicate: the norm as
    # counted misses it, and counting it as the other rank's attributes say gives the truth.
    missing = _squares(full_grads()[PROJ].chunk(2, dim=1)[1])
    assert rel_err(report["total_norm"], math.sqrt(_true_norm() ** 2 - missing)) <= 1e-6
    assert rel_err(finding["norm_if_miscounted"], _true_norm()) <= 1e-6


def test_partition_dim_outside_the_shape(tmp_path: Path) -> None:
    def plant(ranks: list[RankParams]) -> None:
        for _, param in params_named(ranks, PROJ):
            param.partition_dim = 2

    code, report = _audit(_model.write(tmp_path, Layout(tp=2), plant=plant))
    finding = _only_finding(report)
    assert code == 1 and finding["kind"] == "attributes" and finding["ranks"] == [0, 1]
    assert "partition_dim 2, but its shape is [16, 16]" in finding["detail"]


def test_rtol_tolerates_small_replica_differences(tmp_path: Path) -> None:
    def plant(ranks: list[RankParams]) -> None:
        (param,) = _on(ranks, LAYERNORM, tp=1)
        param.grad.mul_(1 + 1e-6)

    directory = _model.write(tmp_path, Layout(tp=2), plant=plant)
    code, report = _audit(directory)
    assert code == 1 and _only_finding(report)["rel_diff"] < 2e-6
    code, report = _audit(directory, "--rtol", "1e-5")
    assert code == 0 and report["findings"] == []


def test_table_lists_findings_and_a_clean_verdict(tmp_path: Path) -> None:
    def plant(ranks: list[RankParams]) -> None:
        for _, param in params_named(ranks, OUTPUT):
            param.shared = False

    planted = _model.write(tmp_path / "planted", Layout(pp=2), plant=plant)
    result = CliRunner().invoke(app, ["audit", str(planted)])
    assert result.exit_code == 1
    assert "tied_copy_counted_twice" in result.stdout and OUTPUT in result.stdout
    clean = _model.write(tmp_path / "clean", Layout(pp=2))
    result = CliRunner().invoke(app, ["audit", str(clean)])
    assert result.exit_code == 0 and "no findings" in result.stdout

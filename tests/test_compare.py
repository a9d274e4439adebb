"""gradstat compare: one model in two layouts agrees; each planted difference is flagged."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest
import torch
from typer.testing import CliRunner

from gradstat.cli import app
from gradstat.snapshot import save_rank
from gradstat.testing import Layout, RankParams
from tests import _model
from tests._cli import SAMPLE_DATA
from tests._model import EMBEDDING, LAYERNORM, PROJ, QKV, expert, full_grads, params_named
from tests._oracle import float64_norm, rel_err, zeros_in
from tests._params import param_with


def _compare(a: Path, b: Path, *args: str) -> tuple[int, dict[str, Any]]:
    result = CliRunner().invoke(app, ["compare", str(a), str(b), "--json", *args])
    assert result.exit_code in (0, 1), result.output
    return result.exit_code, json.loads(result.stdout)


def _rows(report: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {row["name"]: row for row in report["params"]}


@pytest.mark.parametrize(
    ("layout_a", "layout_b"),
    [
        (Layout(tp=4), Layout(tp=8)),
        (Layout(gtp=2, pp=2, gtp_align=8), Layout(tp=2, pp=2)),
        (Layout(tp=2, dp=2, distributed_optimizer=True), Layout(tp=2, dp=2)),
        (Layout(dp=4, ep=4, distributed_optimizer=True), Layout(dp=4)),
        (Layout(tp=2, gtp=2, dp=2, ep=2, egtp=2, gtp_align=8), Layout(pp=2, dp=2, etp=2)),
    ],
    ids=["tp4-tp8", "gtp-3d", "distopt-plain", "ep4-noep", "gtp-egtp-etp"],
)
def test_one_model_in_two_layouts_agrees(
    tmp_path: Path, layout_a: Layout, layout_b: Layout
) -> None:
    a = _model.write(tmp_path / "a", layout_a)
    b = _model.write(tmp_path / "b", layout_b)
    code, report = _compare(a, b)
    assert code == 0 and report["mismatches"] == [] and not report["flagged"]
    grads = full_grads()
    rows = _rows(report)
    assert sorted(rows) == sorted(grads)
    for name, grad in grads.items():
        row = rows[name]
        expected = float64_norm([grad], 2)
        assert rel_err(row["norm_a"], expected) <= 1e-6 and rel_err(row["norm_b"], expected) <= 1e-6
        assert row["zeros_a"] == row["zeros_b"] == zeros_in([grad])
        assert row["num_elements_a"] == row["num_elements_b"] == grad.numel()
        # Every side rebuilds to the full tensor, padding stripped, fragments placed.
        assert row["shape_a"] == row["shape_b"] == list(grad.shape), name
        assert row["max_abs_diff"] == 0.0 and row["not_rebuilt"] is None, name
    totals = {row["measure"]: row for row in report["totals"]}
    expected_total = float64_norm(list(grads.values()), 2)
    assert rel_err(totals["total_norm"]["a"], expected_total) <= 1e-6
    assert totals["num_zeros"]["a"] == totals["num_zeros"]["b"] == zeros_in(grads.values())


def test_a_changed_element_is_flagged_with_its_size(tmp_path: Path) -> None:
    grads = full_grads()
    a = _model.write(tmp_path / "a", Layout(tp=2, gtp=2, gtp_align=8), grads)
    changed = {name: grad.clone() for name, grad in grads.items()}
    changed[QKV][3, 5] = 0.75
    changed[QKV][30, 1] = 0.0  # also one more zero
    b = _model.write(tmp_path / "b", Layout(tp=4), changed)
    code, report = _compare(a, b)
    assert code == 1 and report["flagged"]
    assert report["mismatches"] == [QKV]
    row = _rows(report)[QKV]
    assert set(row["flags"]) == {"norm", "zeros", "values"}
    original, new = grads[QKV].double(), changed[QKV].double()
    assert row["max_abs_diff"] == float((original - new).abs().max())
    expected_rel = abs(float64_norm([grads[QKV]], 2) - float64_norm([changed[QKV]], 2))
    expected_rel /= max(float64_norm([grads[QKV]], 2), float64_norm([changed[QKV]], 2))
    assert math.isclose(row["rel_diff"], expected_rel, rel_tol=1e-4)
    assert row["zeros_b"] == row["zeros_a"] + 1
    totals = {total["measure"]: total for total in report["totals"]}
    assert totals["total_norm"]["flagged"] and totals["num_zeros"]["flagged"]
    assert not totals["expert_norm"]["flagged"]


def test_swapped_tp_shards_keep_the_norm_but_are_flagged(tmp_path: Path) -> None:
    """A layout bug norms cannot see: the TP shards of one weight in the wrong order."""
    grads = full_grads()
    a = _model.write(tmp_path / "a", Layout(tp=1), grads)

    def swap(ranks: list[RankParams]) -> None:
        (_, first), (_, second) = params_named(ranks, PROJ)
        first.grad, second.grad = second.grad, first.grad

    b = _model.write(tmp_path / "b", Layout(tp=2), grads, plant=swap)
    code, report = _compare(a, b)
    assert code == 1 and report["mismatches"] == [PROJ]
    row = _rows(report)[PROJ]
    assert row["flags"] == ["values"]
    assert row["rel_diff"] <= 1e-6
    halves = grads[PROJ].double().chunk(2, dim=1)
    assert row["max_abs_diff"] == float((halves[0] - halves[1]).abs().max())


def test_small_differences_follow_rtol(tmp_path: Path) -> None:
    grads = full_grads()
    nudged = {name: grad.clone() for name, grad in grads.items()}
    nudged[LAYERNORM] *= 1 + 1e-6
    a = _model.write(tmp_path / "a", Layout(tp=2), grads)
    b = _model.write(tmp_path / "b", Layout(tp=2), nudged)
    code, report = _compare(a, b)
    assert code == 0 and report["mismatches"] == []
    assert 0 < _rows(report)[LAYERNORM]["rel_diff"] < 1e-5
    code, report = _compare(a, b, "--rtol", "1e-8")
    assert code == 1 and report["mismatches"] == [LAYERNORM]


def test_parameters_in_one_snapshot_only(tmp_path: Path) -> None:
    grads = full_grads()
    fewer = {name: grad for name, grad in grads.items() if name != expert(2)}
    a = _model.write(tmp_path / "a", Layout(dp=2, ep=2), grads)
    b = _model.write(tmp_path / "b", Layout(dp=2, ep=2), fewer)
    code, report = _compare(a, b)
    assert code == 1 and report["mismatches"] == [expert(2)]
    row = _rows(report)[expert(2)]
    assert row["flags"] == ["only_in_a"] and row["norm_b"] is None
    code, report = _compare(b, a)
    assert _rows(report)[expert(2)]["flags"] == ["only_in_b"]


def test_a_parameter_of_no_elements_missing_from_one_side_is_no_mismatch(tmp_path: Path) -> None:
    """A distributed optimizer has no fragment of a parameter of no elements, so its snapshot
    lists none: against a plain optimizer's, that is not a parameter only one side has."""
    weight = torch.arange(8.0).reshape(4, 2) - 3
    for name, params in (
        ("plain", [("w", param_with(weight.clone())), ("empty", param_with(torch.zeros(0, 3)))]),
        ("distopt", [("w", param_with(weight.clone()))]),
    ):
        save_rank(tmp_path / name, params, rank=0, world_size=1, coords={})
    for a, b in (("plain", "distopt"), ("distopt", "plain")):
        code, report = _compare(tmp_path / a, tmp_path / b)
        assert code == 0 and report["mismatches"] == [], report["mismatches"]
        rows = _rows(report)
        assert rows["w"]["max_abs_diff"] == 0.0 and rows["empty"]["flags"] == []
    fewer = tmp_path / "fewer"
    save_rank(fewer, [("empty", param_with(torch.zeros(0, 3)))], rank=0, world_size=1, coords={})
    code, report = _compare(tmp_path / "plain", fewer)
    assert code == 1 and report["mismatches"] == ["w"]  # a parameter with elements still is


def test_fragments_without_offsets_are_compared_by_norm_only(tmp_path: Path) -> None:
    def forget_offsets(ranks: list[RankParams]) -> None:
        for share in ranks:
            for _, param in share.params:
                del param.fragment_offset, param.fragment_shape

    a = _model.write(tmp_path / "a", Layout(tp=2))
    b = _model.write(tmp_path / "b", Layout(dp=2, distributed_optimizer=True), plant=forget_offsets)
    code, report = _compare(a, b)
    assert code == 0
    for row in report["params"]:
        assert row["max_abs_diff"] is None
        assert row["not_rebuilt"].startswith("B: fragments without fragment_offset")
        assert row["rel_diff"] <= 1e-6


def test_sample_layouts_agree_and_the_nan_copy_is_flagged() -> None:
    code, report = _compare(
        SAMPLE_DATA / "tp2-pp2-dp2-ep2-distopt", SAMPLE_DATA / "gtp2-pp2-dp2-ep2"
    )
    assert code == 0 and all(row["max_abs_diff"] == 0.0 for row in report["params"])
    code, report = _compare(
        SAMPLE_DATA / "tp2-pp2-dp2-ep2-distopt", SAMPLE_DATA / "tp2-pp2-dp2-ep2-distopt-nan"
    )
    assert code == 1
    assert report["mismatches"] == [
        "decoder.layers.1.self_attention.linear_qkv.weight",
        "decoder.layers.1.mlp.experts.local_experts.1.linear_fc2.weight",
    ]
    assert report["params"][0]["norm_b"] == report["params"][0]["norm_a"]
    rows = _rows(report)
    assert rows[report["mismatches"][0]]["norm_b"] == "nan"
    assert rows[report["mismatches"][1]]["max_abs_diff"] == "inf"


def test_table_names_the_flagged_parameters(tmp_path: Path) -> None:
    grads = full_grads()
    changed = {name: grad.clone() for name, grad in grads.items()}
    changed[EMBEDDING][0, 0] += 1.0
    a = _model.write(tmp_path / "a", Layout(tp=2, pp=2), grads)
    b = _model.write(tmp_path / "b", Layout(tp=2, pp=2), changed)
    result = CliRunner().invoke(app, ["compare", str(a), str(b)])
    assert result.exit_code == 1
    assert EMBEDDING in result.stdout and "norm, zeros, values" in result.stdout  # [0, 0] was 0
    assert "differ beyond rtol 1e-05" in result.stdout
    assert LAYERNORM not in result.stdout  # agreeing rows only with --all
    result = CliRunner().invoke(app, ["compare", str(a), str(b), "--all"])
    assert LAYERNORM in result.stdout


def test_bad_second_snapshot_is_one_line(tmp_path: Path) -> None:
    result = CliRunner().invoke(
        app, ["compare", str(SAMPLE_DATA / "gtp2-pp2-dp2-ep2"), str(tmp_path)]
    )
    assert result.exit_code == 2
    assert (
        result.stderr.strip()
        == f"gradstat: error: {tmp_path}: no rank files (*.safetensors) in the directory, nor a "
        "Megatron wgrads dump (mp_rank_*.pth)"
    )


def test_compare_reads_no_more_than_it_needs(tmp_path: Path) -> None:
    """Both inputs are left byte-identical."""
    a = _model.write(tmp_path / "a", Layout(tp=2))
    b = _model.write(tmp_path / "b", Layout(gtp=2, gtp_align=8))
    before = {path: path.read_bytes() for path in [*a.iterdir(), *b.iterdir()]}
    _compare(a, b)
    assert {path: path.read_bytes() for path in [*a.iterdir(), *b.iterdir()]} == before

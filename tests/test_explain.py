"""gradstat explain: each miscount planted by construction is the one named, against float64.

The logged numbers are computed here from the full, unsharded gradients of the test model
(tests/_jobs.py), as the buggy framework would have counted them: each TP-replicated parameter
counted tp times, the dense parameters alone, one stage's parameters, and so on. explain must
rank the planted hypothesis first and within tolerance, and claim nothing for a number no
mistake gives.
"""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from torch import Tensor
from typer.testing import CliRunner

from gradstat.analysis.explain import explain_snapshot
from gradstat.cli import app
from gradstat.snapshot import Snapshot
from tests._jobs import (
    EMBEDDING,
    EXPERTS,
    LAYERS,
    Job,
    ParamSpec,
    dump_layout,
    full_grads,
    model_params,
)

TP2_PP2 = Job("tp2_pp2_tied", tp=2, pp=2)
DP2 = Job("dp2_plain", dp=2)
EP2 = Job("dp2_ep2_moe", dp=2, ep=2, moe=True)
GTP2 = Job("gtp2", gtp=2, align=4)
# Two kinds of copy at once: a TP replica on DP rank 1 is held back by both.
TP2_DP2 = Job("tp2_dp2_plain", tp=2, dp=2)
CP2 = Job("cp2", cp=2)
DP2_MOE = Job("dp2_moe", dp=2, moe=True)  # two EDP ranks: expert replicas
TP2_ETP2 = Job("tp2_etp2_moe", tp=2, etp=2, moe=True)
# ETP 1 under TP 2: rank 1 is dense TP rank 1 but expert TP rank 0, holding experts 2 and 3.
TP2_EP2 = Job("tp2_ep2_moe", tp=2, ep=2, moe=True)
TP4 = Job("tp4", tp=4)
JOBS = {
    job.name: job
    for job in (TP2_PP2, DP2, EP2, GTP2, TP2_DP2, CP2, DP2_MOE, TP2_ETP2, TP2_EP2, TP4)
}


@pytest.fixture(scope="module")
def snapshots(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    found = {}
    for name, job in JOBS.items():
        found[name] = dump_layout(job, tmp_path_factory.mktemp(name))
    return found


def _square_sum(grad: Tensor) -> float:
    return float((grad.to(torch.float64) ** 2).sum())


def _zeros(grad: Tensor) -> int:
    return int((grad == 0).sum())


def _sum_squares(job: Job, weight: Any = lambda spec: 1) -> float:
    """sum over the logical parameters of weight(spec) * |g|^2, in float64."""
    grads = full_grads(job.moe)
    return math.fsum(weight(spec) * _square_sum(grads[spec.name]) for spec in model_params(job.moe))


def _zero_sum(job: Job, weight: Any = lambda spec: 1) -> int:
    grads = full_grads(job.moe)
    return sum(weight(spec) * _zeros(grads[spec.name]) for spec in model_params(job.moe))


def _stage(spec: ParamSpec, pp: int) -> int:
    # The embedding opens the first stage, the final layernorm closes the last; layers evenly.
    if spec.layer is None:
        return 0
    return pp - 1 if spec.layer == LAYERS else spec.layer // (LAYERS // pp)


def _ep_rank(spec: ParamSpec, ep: int) -> int | None:
    return None if spec.expert is None else spec.expert // (EXPERTS // ep)


def _unsplit_expert(spec: ParamSpec) -> bool:
    return spec.expert is not None and spec.split == "none"


def _dropped_by_dense_tp(spec: ParamSpec) -> bool:
    # TP2 x EP2 on 2 ranks: EP rank e is rank e, whose dense TP rank is e too.
    return _unsplit_expert(spec) and _ep_rank(spec, 2) == 1


def _first(snapshot_dir: Path, logged: float, norm_type: float | None = 2.0) -> Any:
    report = explain_snapshot(Snapshot.open(snapshot_dir), logged, norm_type)
    return report, report.rows[0]


def _cli(*args: str) -> tuple[int, dict[str, Any]]:
    result = CliRunner().invoke(app, ["explain", *args, "--json"])
    return result.exit_code, json.loads(result.stdout)


def _planted_norms() -> list[tuple[str, str, float]]:
    """(layout, planted hypothesis, the norm the buggy framework logs)."""
    tied = {EMBEDDING: 1}
    return [
        (
            "tp2_pp2_tied",
            "tp_duplicate_counted",
            _sum_squares(TP2_PP2, lambda spec: 2 if spec.split == "none" else 1) ** 0.5,
        ),
        (
            "tp2_pp2_tied",
            "shared_counted",
            _sum_squares(TP2_PP2, lambda spec: 1 + tied.get(spec.name, 0)) ** 0.5,
        ),
        (
            "tp2_pp2_tied",
            "stage_0_only",
            _sum_squares(TP2_PP2, lambda spec: _stage(spec, 2) == 0) ** 0.5,
        ),
        (
            "tp2_pp2_tied",
            "stage_1_only",
            _sum_squares(TP2_PP2, lambda spec: _stage(spec, 2) == 1) ** 0.5,
        ),
        ("dp2_plain", "dp_replica_counted", (2 * _sum_squares(DP2)) ** 0.5),
        ("dp2_plain", "not_divided_by_dp", 2 * _sum_squares(DP2) ** 0.5),
        (
            "dp2_ep2_moe",
            "experts_left_out",
            _sum_squares(EP2, lambda spec: spec.expert is None) ** 0.5,
        ),
        (
            "dp2_ep2_moe",
            "ep_rank_1_left_out",
            _sum_squares(EP2, lambda spec: _ep_rank(spec, 2) != 1) ** 0.5,
        ),
        (
            "gtp2",
            "gtp_duplicate_counted",
            _sum_squares(GTP2, lambda spec: 1 + (not spec.gtp)) ** 0.5,
        ),
        # Counting one kind adds the copies that kind alone holds back: the TP replicas of DP
        # rank 0 (x2, not x4), or every DP rank 1 tensor but the TP replicas' second copies.
        (
            "tp2_dp2_plain",
            "tp_duplicate_counted",
            _sum_squares(TP2_DP2, lambda spec: 2 if spec.split == "none" else 1) ** 0.5,
        ),
        ("tp2_dp2_plain", "dp_replica_counted", (2 * _sum_squares(TP2_DP2)) ** 0.5),
        ("cp2", "cp_replica_counted", (2 * _sum_squares(CP2)) ** 0.5),
        (
            "dp2_moe",
            "edp_replica_counted",
            _sum_squares(DP2_MOE, lambda spec: 1 + (spec.expert is not None)) ** 0.5,
        ),
        (
            "tp2_etp2_moe",
            "etp_duplicate_counted",
            _sum_squares(TP2_ETP2, lambda spec: 1 + _unsplit_expert(spec)) ** 0.5,
        ),
        # The dense TP rank judges the expert tensors no TP splits: rank 1's are dropped.
        (
            "tp2_ep2_moe",
            "experts_judged_by_dense_tp",
            _sum_squares(TP2_EP2, lambda spec: not _dropped_by_dense_tp(spec)) ** 0.5,
        ),
        (
            "tp2_dp2_plain",
            "every_copy_counted",
            _sum_squares(TP2_DP2, lambda spec: 4 if spec.split == "none" else 2) ** 0.5,
        ),
    ]


@pytest.mark.parametrize(("layout", "planted", "logged"), _planted_norms())
def test_the_planted_norm_miscount_is_ranked_first(
    snapshots: dict[str, Path], layout: str, planted: str, logged: float
) -> None:
    report, best = _first(snapshots[layout], logged)
    assert (best.name, best.match) == (planted, True)
    assert math.isclose(best.value, logged, rel_tol=1e-6)
    assert not report.exact_matches
    code, document = _cli(str(snapshots[layout]), "--logged", repr(logged))
    assert code == 0
    assert (document["best"], document["explained"]) == (planted, True)
    assert document["rows"][0]["name"] == planted


def _tp_shards(grad: Tensor, split: str, tp: int) -> list[Tensor]:
    if split == "column":
        return list(torch.chunk(grad, tp, dim=0))
    if split == "row":
        return list(torch.chunk(grad, tp, dim=1))
    return [grad] + [grad[:0]] * (tp - 1)  # a replica counts on TP rank 0 only


def test_rank_norms_averaged_over_tp_and_pp_ranks(snapshots: dict[str, Path]) -> None:
    grads = full_grads(False)
    rank_sums = {(tp, pp): 0.0 for tp in range(2) for pp in range(2)}
    for spec in model_params(False):
        for tp, shard in enumerate(_tp_shards(grads[spec.name], spec.split, 2)):
            rank_sums[tp, _stage(spec, 2)] += _square_sum(shard)
    local = [value**0.5 for value in rank_sums.values()]
    for planted, logged in (
        ("rank_norms_averaged", math.fsum(local) / 4),
        ("rank_norms_summed", math.fsum(local)),
    ):
        _, best = _first(snapshots["tp2_pp2_tied"], logged)
        assert (best.name, best.match) == (planted, True)
        assert math.isclose(best.value, logged, rel_tol=1e-6)


def test_a_data_parallel_replicas_own_norm_is_its_model_parallel_peers(
    snapshots: dict[str, Path],
) -> None:
    # TP2 x DP2, plain optimizer: rank 3 (TP 1, DP 1) is a replica, which counts nothing once
    # reduced, yet computes TP rank 1's norm alone (a mean over every rank took it for 0, and
    # the last rank's unreduced norm, the one Megatron prints, was no hypothesis).
    grads = full_grads(False)
    tp_sums = [0.0, 0.0]
    for spec in model_params(False):
        for tp, shard in enumerate(_tp_shards(grads[spec.name], spec.split, 2)):
            tp_sums[tp] += _square_sum(shard)
    local = [value**0.5 for value in tp_sums]
    for planted, logged in (
        ("rank_norms_averaged", math.fsum(local) / 2),
        ("rank_norms_summed", math.fsum(local)),
        ("rank_3_unreduced", local[1]),
    ):
        _, best = _first(snapshots["tp2_dp2_plain"], logged)
        assert (best.name, best.match) == (planted, True)
        assert math.isclose(best.value, logged, rel_tol=1e-6)


def test_one_tp_rank_left_out_of_four(snapshots: dict[str, Path]) -> None:
    grads = full_grads(False)
    kept = 0.0
    for spec in model_params(False):
        shards = _tp_shards(grads[spec.name], spec.split, 4)
        kept += math.fsum(_square_sum(shard) for tp, shard in enumerate(shards) if tp != 2)
    _, best = _first(snapshots["tp4"], kept**0.5)
    assert (best.name, best.match) == ("tp_rank_2_left_out", True)
    assert math.isclose(best.value, kept**0.5, rel_tol=1e-6)


def test_group_norms_summed_or_averaged(snapshots: dict[str, Path]) -> None:
    dense = _sum_squares(EP2, lambda spec: spec.expert is None) ** 0.5
    experts = _sum_squares(EP2, lambda spec: spec.expert is not None) ** 0.5
    stages = [_sum_squares(TP2_PP2, lambda spec, s=s: _stage(spec, 2) == s) ** 0.5 for s in (0, 1)]
    for layout, planted, logged in (
        ("dp2_ep2_moe", "dense_and_expert_norms_summed", dense + experts),
        ("dp2_ep2_moe", "dense_and_expert_norms_averaged", (dense + experts) / 2),
        ("tp2_pp2_tied", "stage_norms_summed", math.fsum(stages)),
        ("tp2_pp2_tied", "stage_norms_averaged", math.fsum(stages) / 2),
    ):
        _, best = _first(snapshots[layout], logged)
        assert (best.name, best.match) == (planted, True), layout
        assert math.isclose(best.value, logged, rel_tol=1e-6)


def test_one_ranks_norm_never_reduced(snapshots: dict[str, Path]) -> None:
    # TP2 x PP2: rank 0 (TP 0, stage 0) counts all it holds; rank 3 (TP 1, stage 1) also holds
    # TP replicas and the tied output layer's shard, which its filtered count leaves out.
    grads = full_grads(False)
    first = last_held = last_counted = 0.0
    for spec in model_params(False):
        shards = _tp_shards(grads[spec.name], spec.split, 2)
        if _stage(spec, 2) == 0:
            first += _square_sum(shards[0])
        else:
            last_counted += _square_sum(shards[1])
            last_held += _square_sum(grads[spec.name] if spec.split == "none" else shards[1])
    last_held += _square_sum(torch.chunk(grads[EMBEDDING], 2, dim=0)[1])  # the output copy
    for planted, logged in (
        ("rank_0_local", first**0.5),
        ("rank_3_local", last_held**0.5),
        ("rank_3_unreduced", last_counted**0.5),
    ):
        report, best = _first(snapshots["tp2_pp2_tied"], logged)
        assert (best.name, best.match) == (planted, True)
        assert math.isclose(best.value, logged, rel_tol=1e-6)
    names = {row.name for row in report.rows}
    assert "rank_0_unreduced" not in names  # rank 0 counts every tensor it holds


def test_bf16_partials_are_told_from_the_exact_norm(snapshots: dict[str, Path]) -> None:
    # DP2 with a plain optimizer: rank 0 holds every whole tensor, one partial each.
    grads = full_grads(False)
    rounded = [
        float(torch.tensor(_square_sum(grads[spec.name]), dtype=torch.float64).to(torch.bfloat16))
        for spec in model_params(False)
    ]
    logged = math.fsum(rounded) ** 0.5
    exact = _sum_squares(DP2) ** 0.5
    assert logged != exact  # else the test could not tell them apart
    report = explain_snapshot(Snapshot.open(snapshots["dp2_plain"]), logged, 2.0, rtol=1e-7)
    assert report.rows[0].name == "bf16_partials" and report.rows[0].match
    assert not report.exact_matches


@pytest.mark.parametrize("layout", list(JOBS))
def test_the_exact_value_explains_itself(snapshots: dict[str, Path], layout: str) -> None:
    job = JOBS[layout]
    exact = _sum_squares(job) ** 0.5
    report, best = _first(snapshots[layout], exact)
    assert best.name == "exact" and best.match and report.exact_matches
    assert math.isclose(report.exact, exact, rel_tol=1e-9)
    code, document = _cli(str(snapshots[layout]), "--logged", repr(exact))
    assert code == 0 and document["best"] == "exact"


@pytest.mark.parametrize("layout", list(JOBS))
def test_an_unrelated_number_is_claimed_by_no_hypothesis(
    snapshots: dict[str, Path], layout: str
) -> None:
    # 1.29 x exact: no mistake in these layouts gives it (the tied embedding of TP2 x PP2, counted
    # twice, gives 1.3695 x, so 1.37 would be too close to tell).
    logged = 1.29 * _sum_squares(JOBS[layout]) ** 0.5
    report, _ = _first(snapshots[layout], logged)
    assert report.matches == ()
    code, document = _cli(str(snapshots[layout]), "--logged", repr(logged))
    assert code == 1
    assert (document["explained"], document["best"]) == (False, None)
    result = CliRunner().invoke(app, ["explain", str(snapshots[layout]), "--logged", repr(logged)])
    assert result.exit_code == 1 and "no hypothesis explains" in result.stdout


def _pad_zeros(job: Job) -> int:
    """GTP alignment padding of the GTP-sharded parameters: zero rows up to a multiple of
    align x gtp."""
    grads = full_grads(job.moe)
    total = 0
    for spec in model_params(job.moe):
        if spec.gtp:
            rows = grads[spec.name].shape[0]
            total += (-rows % (job.align * job.gtp)) * (grads[spec.name].numel() // rows)
    return total


def _planted_zeros() -> list[tuple[str, str, int]]:
    return [
        (
            "tp2_pp2_tied",
            "tp_duplicate_counted",
            _zero_sum(TP2_PP2, lambda spec: 2 if spec.split == "none" else 1),
        ),
        (
            "tp2_pp2_tied",
            "shared_counted",
            _zero_sum(TP2_PP2, lambda spec: 2 if spec.name == EMBEDDING else 1),
        ),
        ("dp2_plain", "dp_replica_counted", 2 * _zero_sum(DP2)),
        ("gtp2", "gtp_duplicate_counted", _zero_sum(GTP2, lambda spec: 1 + (not spec.gtp))),
        ("gtp2", "gtp_padding_counted", _zero_sum(GTP2) + _pad_zeros(GTP2)),
        (
            "tp2_ep2_moe",
            "experts_judged_by_dense_tp",
            _zero_sum(TP2_EP2, lambda spec: not _dropped_by_dense_tp(spec)),
        ),
        (
            "dp2_moe",
            "edp_replica_counted",
            _zero_sum(DP2_MOE, lambda s: 1 + (s.expert is not None)),
        ),
    ]


@pytest.mark.parametrize(("layout", "planted", "logged"), _planted_zeros())
def test_the_planted_zero_miscount_is_ranked_first(
    snapshots: dict[str, Path], layout: str, planted: str, logged: int
) -> None:
    report, best = _first(snapshots[layout], float(logged), None)
    assert (best.name, best.match, best.value) == (planted, True, logged)
    assert report.quantity == "zeros" and not report.exact_matches
    code, document = _cli(str(snapshots[layout]), "--logged-zeros", str(logged))
    assert code == 0 and document["best"] == planted and document["norm_type"] is None


def test_the_exact_zero_count_explains_itself(snapshots: dict[str, Path]) -> None:
    exact = _zero_sum(GTP2)
    assert _pad_zeros(GTP2) > 0  # the padding is there, and not counted
    code, document = _cli(str(snapshots["gtp2"]), "--logged-zeros", str(exact))
    assert code == 0 and document["best"] == "exact" and document["exact"] == exact


def test_a_logged_nan_or_inf_is_explained_by_the_same_alone(
    snapshots: dict[str, Path], tmp_path: Path
) -> None:
    """A job that logged NaN is explained by gradients holding NaN (every hypothesis predicts
    NaN then, the exact value first), and by nothing where they hold none; so is inf."""
    clean = snapshots["dp2_plain"]
    for logged in ("nan", "inf"):
        code, document = _cli(str(clean), "--logged", logged)
        assert code == 1 and (document["explained"], document["best"]) == (False, None)
        assert {row["distance"] for row in document["rows"]} == {"inf"}
    poisoned = tmp_path / "poisoned"
    shutil.copytree(clean, poisoned)
    first = sorted(poisoned.glob("rank-*.safetensors"))[0]
    tensors = load_file(first)
    name = next(iter(tensors))
    tensors[name].view(-1)[0] = math.nan
    save_file(tensors, first, metadata=safe_open(first, "pt").metadata())
    code, document = _cli(str(poisoned), "--logged", "nan")
    assert code == 0 and document["best"] == "exact" and document["exact"] == "nan"
    code, document = _cli(str(poisoned), "--logged", "inf")
    assert code == 1 and document["explained"] is False
    result = CliRunner().invoke(app, ["explain", str(clean), "--logged", "-1"])
    assert result.exit_code == 2 and "--logged must be a norm (>= 0, nan or inf)" in result.stderr


def test_explain_takes_exactly_one_logged_number(snapshots: dict[str, Path]) -> None:
    for extra in ([], ["--logged", "1", "--logged-zeros", "1"]):
        result = CliRunner().invoke(app, ["explain", str(snapshots["dp2_plain"]), *extra])
        assert result.exit_code == 2
        assert "exactly one of --logged" in result.stderr


def test_every_hypothesis_predicts_something_on_some_layout(snapshots: dict[str, Path]) -> None:
    # A registry entry no test layout reaches would go untested.
    reached = set()
    for path in snapshots.values():
        snapshot = Snapshot.open(path)
        for norm_type in (2.0, None):
            report = explain_snapshot(snapshot, 1.0, norm_type)
            reached |= {row.name for row in report.rows}
    expected = {
        "exact",
        "tp_duplicate_counted",
        "shared_counted",
        "dp_replica_counted",
        "gtp_duplicate_counted",
        "every_copy_counted",
        "experts_left_out",
        "dense_left_out",
        "stage_0_only",
        "stage_1_only",
        "ep_rank_0_left_out",
        "ep_rank_1_left_out",
        "tp_rank_0_only",
        "rank_norms_averaged",
        "rank_norms_summed",
        "not_divided_by_dp",
        "divided_by_dp_twice",
        "bf16_partials",
        "fp16_partials",
        "gtp_padding_counted",
        "cp_replica_counted",
        "edp_replica_counted",
        "etp_duplicate_counted",
        "experts_judged_by_dense_tp",
        "rank_0_local",
        "rank_1_local",
        "rank_3_local",
        "rank_1_unreduced",
        "tp_rank_2_left_out",
        "dense_and_expert_norms_summed",
        "dense_and_expert_norms_averaged",
        "stage_norms_summed",
        "stage_norms_averaged",
    }
    assert expected <= reached

"""Context parallelism (CP > 1) as a first-class layout: snapshots, compare, audit, Megatron.

What the tests hold gradstat to is Megatron's: gradients are all-reduced over DP x CP, so after
the step's reduction every CP rank holds the same full gradient of each parameter and a CP
replica counts once, like a DP replica; the plain optimizer reduces its statistics over the
model-parallel group (TP x PP), which leaves CP out; the distributed optimizer shards its
buffers over the data-parallel group with context parallelism (DP x CP, cp the faster) and
reduces over every rank. Expected values are float64 statistics of the unsharded gradients.
Where megatron-core is installed, 8 gloo processes initialize Megatron's own ``parallel_state``
with CP = 2, and its groups and coordinates are held against ``gradstat.testing``'s rank order
and groups and gradstat's statistics. (The live API over real groups with CP is in
tests/test_layouts.py.)
"""

from __future__ import annotations

import importlib.util
import json
import math
from pathlib import Path
from typing import Any

import pytest
import torch
from typer.testing import CliRunner

from gradstat.cli import app
from gradstat.testing import (
    Case,
    Layout,
    RankParams,
    data_parallel_with_cp,
    launch,
    shard_gradients,
)
from tests import _jobs, _model
from tests._model import LAYERNORM, QKV, expert, full_grads, params_named
from tests._oracle import float64_norm, rel_err, zeros_in


def _cli(*args: str) -> tuple[int, dict[str, Any]]:
    result = CliRunner().invoke(app, [*args, "--json"])
    assert result.exit_code in (0, 1), result.output
    return result.exit_code, json.loads(result.stdout)


def _squares(tensor: torch.Tensor) -> float:
    return float(tensor.double().square().sum())


CP_LAYOUTS = [
    Layout(tp=2, cp=2),
    Layout(cp=2, dp=2, distributed_optimizer=True),
    Layout(tp=2, cp=2, pp=2, ep=2, distributed_optimizer=True),
    Layout(cp=4, dp=2, ep=4, etp=2),
    Layout(gtp=2, cp=2, dp=2, ep=2, egtp=2, gtp_align=8),
]
CP_IDS = ["tp2-cp2", "cp2-dp2-distopt", "tp2-cp2-pp2-ep2-distopt", "cp4-dp2-ep4-etp2", "gtp-cp2"]


@pytest.mark.parametrize("layout", CP_LAYOUTS, ids=CP_IDS)
def test_cp_snapshot_statistics_equal_float64(tmp_path: Path, layout: Layout) -> None:
    """Each CP replica counts once, in total and per parameter."""
    directory = _model.write(tmp_path, layout)
    grads = full_grads()
    everything = list(grads.values())
    for norm_type, p in (("2", 2.0), ("1", 1.0), ("inf", math.inf)):
        code, report = _cli("norm", str(directory), "--norm-type", norm_type, "--top", "1000")
        assert code == 0
        expected = float64_norm(everything, p)
        if p == math.inf:
            assert report["total_norm"] == expected
        else:
            assert rel_err(report["total_norm"], expected) <= 1e-6, (norm_type, report)
        rows = {row["name"]: row for row in report["params"]}
        for name, grad in grads.items():
            assert rows[name]["num_elements"] == grad.numel(), name
            if p == 2.0:
                assert rel_err(rows[name]["norm"], float64_norm([grad], p)) <= 1e-6, name
    code, zeros = _cli("zeros", str(directory))
    assert code == 0 and zeros["num_zeros"] == zeros_in(everything)
    assert zeros["num_elements"] == sum(grad.numel() for grad in everything)


def _model_ranks(layout: Layout) -> list[RankParams]:
    wanted = [spec for spec in _model.specs(layout.pp) if spec.name in full_grads()]
    return shard_gradients(layout, wanted, full_grads())


@pytest.mark.parametrize(
    ("layout_a", "layout_b"),
    [
        (Layout(tp=2, cp=2, dp=2, distributed_optimizer=True), Layout(tp=4)),
        (Layout(cp=2, pp=2, ep=2, distributed_optimizer=True), Layout(tp=2, cp=2, pp=2, ep=2)),
        (Layout(gtp=2, cp=2, ep=2, egtp=2, gtp_align=8), Layout(cp=4, dp=2, ep=4, etp=2)),
    ],
    ids=["cp-distopt-vs-tp4", "cp-distopt-vs-cp-plain", "gtp-cp-vs-cp4"],
)
def test_cp_layouts_compare_equal_element_by_element(
    tmp_path: Path, layout_a: Layout, layout_b: Layout
) -> None:
    a = _model.write(tmp_path / "a", layout_a)
    b = _model.write(tmp_path / "b", layout_b)
    code, report = _cli("compare", str(a), str(b), "--all")
    assert code == 0 and report["mismatches"] == []
    grads = full_grads()
    assert sorted(row["name"] for row in report["params"]) == sorted(grads)  # tied copy uncounted
    for row in report["params"]:
        assert row["max_abs_diff"] == 0.0 and row["not_rebuilt"] is None, row
        assert row["shape_a"] == row["shape_b"] == list(grads[row["name"]].shape)
    for directory in (a, b):
        code, audit = _cli("audit", str(directory))
        assert code == 0 and audit["findings"] == [], audit["findings"]
        assert rel_err(audit["total_norm"], float64_norm(list(grads.values()), 2)) <= 1e-6


def _counted_copy(layout: Layout, rank: int, is_expert: bool) -> int:
    """The rank whose copy a plain optimizer counts for ``rank``'s: DP and CP rank 0 (expert
    data-parallel rank 0 for an expert), everything else the same."""
    coords = layout.coords(rank)
    same = ("etp", "egtp", "ep", "pp") if is_expert else ("tp", "gtp", "pp")
    copies = ("edp",) if is_expert else ("dp", "cp")
    (found,) = [
        other
        for other in range(layout.world_size)
        if all(layout.coords(other)[axis] == coords[axis] for axis in same)
        and all(layout.coords(other)[axis][0] == 0 for axis in copies)
    ]
    return found


@pytest.mark.parametrize(
    ("name", "where", "kind"),
    [
        (LAYERNORM, {"cp": 1, "dp": 0}, "cp_replicas_differ"),
        (LAYERNORM, {"cp": 0, "dp": 1}, "dp_replicas_differ"),
        (QKV, {"tp": 0, "cp": 1, "dp": 0}, "cp_replicas_differ"),
        (QKV, {"tp": 0, "cp": 1, "dp": 1}, "dp_replicas_differ"),
        (expert(2), {"edp": 3}, "dp_replicas_differ"),
    ],
    ids=["cp-replica", "dp-replica", "cp-replica-of-a-tp-shard", "off-dp-and-cp", "expert-edp"],
)
def test_audit_names_a_replica_that_differs_under_cp(
    tmp_path: Path, name: str, where: dict[str, int], kind: str
) -> None:
    """A plain optimizer counts the copy at DP rank 0 and CP rank 0; a copy elsewhere that
    differs is a finding, named by the axis it is a copy along (DP when it is off both), with
    the norm had it been the one counted."""
    grads = full_grads()
    layout = Layout(tp=2, cp=2, dp=2, ep=2)
    element = 3
    changed = grads[name].clone()
    planted: list[int] = []

    def plant(ranks: list[RankParams]) -> None:
        for share, param in params_named(ranks, name):
            if all(share.coords[axis][0] == value for axis, value in where.items()):
                param.grad.view(-1)[element] += 2.0
                planted.append(share.rank)
                # The full tensor as counted had this copy been: TP rank 0's half for QKV.
                target = changed.chunk(2)[0] if name == QKV else changed
                target.view(-1)[element] = param.grad.view(-1)[element]

    directory = _model.write(tmp_path, layout, plant=plant)
    code, report = _cli("audit", str(directory))
    assert code == 1 and len(report["findings"]) == 1, report["findings"]
    (finding,) = report["findings"]
    assert finding["kind"] == kind and finding["name"] == name
    is_expert = "experts" in name
    counted = {_counted_copy(layout, rank, is_expert) for rank in planted}
    assert planted and not counted & set(planted)
    assert finding["ranks"] == sorted({*planted, *counted})
    original = grads[name]
    assert finding["max_abs_diff"] == float((changed.double() - original.double()).abs().max())
    # The counted copies are intact: the norm is the true one; the finding gives the other.
    total = float64_norm(list(grads.values()), 2)
    assert rel_err(report["total_norm"], total) <= 1e-6
    expected = math.sqrt(total**2 - _squares(original) + _squares(changed))
    assert rel_err(finding["norm_if_miscounted"], expected) <= 1e-6


def test_a_changed_fragment_on_a_cp_rank_is_found_by_compare(tmp_path: Path) -> None:
    """Distributed optimizer: the CP ranks hold disjoint fragments, each counted once."""
    layout = Layout(cp=2, dp=2, pp=2, distributed_optimizer=True)
    clean = _model.write(tmp_path / "clean", layout)
    planted: dict[str, Any] = {}

    def plant(ranks: list[RankParams]) -> None:
        for share in ranks:
            if data_parallel_with_cp(share.coords) != (1, 4) or share.coords["pp"][0] != 0:
                continue
            name, param = share.params[-1]
            before = float(param.grad.view(-1)[0])
            param.grad.view(-1)[0] = before + 0.5
            after = float(param.grad.view(-1)[0])
            planted.update(name=name, diff=abs(after - before), rank=share.rank)

    changed = _model.write(tmp_path / "changed", layout, plant=plant)
    assert _model_ranks(layout)[planted["rank"]].coords["cp"] == (1, 2)
    code, report = _cli("compare", str(clean), str(changed))
    assert code == 1 and report["mismatches"] == [planted["name"]]
    (row,) = [row for row in report["params"] if row["name"] == planted["name"]]
    assert "values" in row["flags"] and row["max_abs_diff"] == planted["diff"]


# ---------------------------------------------------------------------------------------------
# Megatron's own parallel_state with CP = 2, on 8 gloo processes
# ---------------------------------------------------------------------------------------------

MEGATRON = _jobs.Job("megatron_tp2_cp2_dp2_ep2_etp2", tp=2, cp=2, dp=2, ep=2, etp=2, moe=True)
GRADSTAT_LAYOUT = Layout(tp=2, cp=2, dp=2, ep=2, etp=2)


def _under_megatron(rank: int, world_size: int, root: str) -> dict[str, Any]:
    """One rank of a Megatron job with TP 2 x CP 2 x DP 2, EP 2 x ETP 2: its coordinates, groups
    from parallel_state, gradstat's statistics over Megatron's groups (plain and distributed
    optimizer), and a snapshot of each dumped with the coordinates dump_rank finds."""
    import warnings

    import torch.distributed as dist

    warnings.filterwarnings("ignore", message=".*(Transformer Engine|Apex).*")
    from megatron.core import parallel_state as ps

    from gradstat.snapshot import dump_rank
    from gradstat.snapshot.capture import coords_from_megatron

    ps.initialize_model_parallel(
        tensor_model_parallel_size=2,
        context_parallel_size=2,
        expert_model_parallel_size=2,
        expert_tensor_parallel_size=2,
        create_gloo_process_groups=False,
    )
    try:

        def ranks(group: Any) -> list[int]:
            return sorted(dist.get_process_group_ranks(group))

        groups = {
            "tp": ranks(ps.get_tensor_model_parallel_group()),
            "cp": ranks(ps.get_context_parallel_group()),
            "dp": ranks(ps.get_data_parallel_group()),
            "dp_cp": ranks(ps.get_data_parallel_group(with_context_parallel=True)),
            "model_parallel": ranks(ps.get_model_parallel_group()),
            "ep": ranks(ps.get_expert_model_parallel_group()),
            "edp": ranks(ps.get_expert_data_parallel_group()),
            "expert_model_parallel": ranks(ps.get_expert_tensor_model_pipeline_parallel_group()),
            "distributed_optimizer": ranks(ps.get_intra_distributed_optimizer_instance_group()),
        }
        dp_cp = (
            ps.get_data_parallel_rank(with_context_parallel=True),
            ps.get_data_parallel_world_size(with_context_parallel=True),
        )
        pp = ps.get_pipeline_model_parallel_rank()
        view = _jobs.RankView(
            dense={
                "tp": ps.get_tensor_model_parallel_rank(),
                "gtp": 0,
                "cp": ps.get_context_parallel_rank(),
                "dp": ps.get_data_parallel_rank(),
                "pp": pp,
            },
            expert={
                "etp": ps.get_expert_tensor_parallel_rank(),
                "egtp": 0,
                "ep": ps.get_expert_model_parallel_rank(),
                "edp": ps.get_expert_data_parallel_rank(),
                "pp": pp,
            },
            groups={
                "tp": ps.get_tensor_model_parallel_group(),
                "etp": ps.get_expert_tensor_parallel_group(),
            },
        )
        params = _jobs.local_params(MEGATRON, view)
        dense = [param for param in params if getattr(param, "allreduce", True)]
        experts = [param for param in params if not getattr(param, "allreduce", True)]
        plain = _jobs.combine(
            _jobs.category_stats(dense, view, ps.get_model_parallel_group()),
            _jobs.category_stats(
                experts, view, ps.get_expert_tensor_model_pipeline_parallel_group()
            ),
        )
        dense_fragments = _jobs.fragments(dense, *dp_cp, stamp=True)
        expert_fragments = _jobs.fragments(
            experts,
            ps.get_expert_data_parallel_rank(),
            ps.get_expert_data_parallel_world_size(),
            stamp=True,
        )
        optimizer_group = ps.get_intra_distributed_optimizer_instance_group()
        distopt = _jobs.combine(
            _jobs.category_stats(dense_fragments, view, optimizer_group),
            _jobs.category_stats(expert_fragments, view, optimizer_group),
        )
        named = [(param._gradstat_name, param) for param in params]
        dump_rank(f"{root}/plain", named, step=5)
        fragments = [(param._gradstat_name, param) for param in dense_fragments + expert_fragments]
        dump_rank(f"{root}/distopt", fragments, distributed_optimizer=True, step=5)
        return {
            "coords": coords_from_megatron(),
            "groups": groups,
            "dp_cp": dp_cp,
            "plain": plain,
            "distopt": distopt,
        }
    finally:
        ps.destroy_model_parallel()


@pytest.fixture(scope="module")
def megatron(tmp_path_factory: pytest.TempPathFactory) -> tuple[list[dict[str, Any]], Path]:
    # Looked up, not imported: Megatron is imported only by the ranks, never by the test process.
    if importlib.util.find_spec("megatron") is None:
        pytest.skip("megatron-core is not installed (the parity extra)")
    root = tmp_path_factory.mktemp("megatron-cp")
    case = Case("megatron", _under_megatron, str(root))
    report = launch(MEGATRON.world_size, root, [case], timeout_s=400, pg_timeout_s=120)
    return report.values("megatron"), root


@pytest.mark.multiprocess
@pytest.mark.slow
def test_megatron_coordinates_are_gradstat_layouts(
    megatron: tuple[list[dict[str, Any]], Path],
) -> None:
    """Megatron's rank order (tp, cp, dp) and its DP x CP group are gradstat.testing's."""
    per_rank, _ = megatron
    assert GRADSTAT_LAYOUT.world_size == len(per_rank)
    for rank, got in enumerate(per_rank):
        ours = GRADSTAT_LAYOUT.coords(rank)
        assert got["coords"] == {axis: list(ours[axis]) for axis in got["coords"]}, rank
        assert tuple(got["dp_cp"]) == data_parallel_with_cp(ours), rank
        assert got["coords"]["cp"] == [(rank // 2) % 2, 2]


@pytest.mark.multiprocess
@pytest.mark.slow
def test_megatron_groups_are_the_independent_sharders(
    megatron: tuple[list[dict[str, Any]], Path],
) -> None:
    """Every group the tests' sharder builds for CP is the one Megatron builds."""
    per_rank, _ = megatron
    expected_axes = {
        "tp": {"tp"},
        "cp": {"cp"},
        "dp": {"dp"},
        "dp_cp": {"dp", "cp"},
        "model_parallel": {"tp", "gtp", "pp"},
        "ep": {"ep"},
        "edp": {"edp"},
        "expert_model_parallel": {"etp", "egtp", "ep", "pp"},
    }
    for rank, got in enumerate(per_rank):
        for key, grouped in expected_axes.items():
            assert got["groups"][key] == _jobs.group_containing(MEGATRON, grouped, rank), (
                rank,
                key,
            )
        assert got["groups"]["distributed_optimizer"] == list(range(MEGATRON.world_size))
        assert len(got["groups"]["dp_cp"]) == 4 and rank in got["groups"]["dp_cp"]


@pytest.mark.parametrize("optimizer", ["plain", "distopt"])
@pytest.mark.multiprocess
@pytest.mark.slow
def test_live_statistics_over_megatrons_groups_equal_float64(
    megatron: tuple[list[dict[str, Any]], Path], optimizer: str
) -> None:
    per_rank, _ = megatron
    grads = _jobs.oracle_grads(moe=True)["total"]
    for rank, got in enumerate(per_rank):
        stats = got[optimizer]
        for p in _jobs.NORM_TYPES:
            expected = float64_norm(grads, p)
            if p == math.inf:
                assert stats["norms"][p] == expected, (rank, p)
            else:
                assert rel_err(stats["norms"][p], expected) <= 1e-6, (rank, p)
        assert stats["zeros"] == zeros_in(grads), rank


@pytest.mark.multiprocess
@pytest.mark.slow
def test_snapshots_dumped_under_megatron_give_float64_and_agree(
    megatron: tuple[list[dict[str, Any]], Path], tmp_path: Path
) -> None:
    _, root = megatron
    grads = _jobs.oracle_grads(moe=True)["total"]
    independent = _jobs.dump_layout(
        _jobs.Job("cp2_dp4_ep2_distopt", cp=2, dp=4, ep=2, moe=True, distopt=True),
        tmp_path / "independent",
    )
    for snapshot in (root / "plain", root / "distopt"):
        code, report = _cli("norm", str(snapshot))
        assert code == 0 and rel_err(report["total_norm"], float64_norm(grads, 2)) <= 1e-6
        code, zeros = _cli("zeros", str(snapshot))
        assert code == 0 and zeros["num_zeros"] == zeros_in(grads)
        code, audit = _cli("audit", str(snapshot))
        # The one finding: the tests' GPT routes no token to ZERO_EXPERT, in each layer.
        found = [(item["kind"], item["name"]) for item in audit["findings"]]
        unrouted = f"mlp.experts[{_jobs.ZERO_EXPERT}]"
        assert code == 1 and found == [
            ("expert_never_routed", f"decoder.layers.{layer}.{unrouted}")
            for layer in range(_jobs.LAYERS)
        ]
        code, compared = _cli("compare", str(snapshot), str(independent), "--all")
        assert code == 0 and compared["mismatches"] == []
        assert all(row["max_abs_diff"] == 0.0 for row in compared["params"])
    code, compared = _cli("compare", str(root / "plain"), str(root / "distopt"), "--all")
    assert code == 0 and all(row["max_abs_diff"] == 0.0 for row in compared["params"])

"""Experts of a torch-native MoE (FSDP2 DTensors, or DDP's plain replicas): dense and expert
norms by name.

torch-native parallelism sets no Megatron ``allreduce=False`` on expert parameters. A DCP
checkpoint and a wgrads dump tell experts by name (under an ``experts`` module); a DTensor
snapshot told none, so the same gradients gave ``expert_norm`` 0 there and the true one in a
checkpoint: ``compare`` flagged them as differing (exit 1), and ``explain`` could not name a
norm that left the experts out. The snapshot here is written as ``dump_rank`` writes an FSDP2
job's (``Shard(0)`` records over 2 data-parallel ranks, 2 pipeline stages whose lists hold the
same shapes in another order) or a DDP job's (each rank a full replica, no attribute), the
checkpoint by ``dcp.save`` of the full gradients; the expected norms are ``math.fsum`` of the
full tensors' squares. A Megatron parameter is an expert by its ``allreduce=False`` alone
(``tests/test_experts.py``).
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from typer.testing import CliRunner

from gradstat.cli import app
from gradstat.core.placements import MeshPlacement
from gradstat.snapshot.container import write_container
from gradstat.snapshot.format import METADATA_KEY, ParamRecord, RankHeader
from gradstat.snapshot.writer import check_coords

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")

SHAPE = (3, 4, 2)  # a stacked [E, ...] expert weight, and a dense one of the same shape
# Each stage's list: the same shapes, the expert first on one stage and second on the other.
STAGES = (
    ("layers.0.moe.experts.w1", "layers.0.attention.wq"),
    ("layers.1.attention.wq", "layers.1.moe.experts.w1"),
)
DP = 2


def _full_gradients() -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(5)
    grads = {name: torch.randn(SHAPE, generator=gen) for stage in STAGES for name in stage}
    grads["layers.1.moe.experts.w1"][1] = 0.0  # expert 1 of layer 1 never routed to
    return grads


def _write_fsdp2_snapshot(directory: Path, grads: dict[str, torch.Tensor]) -> None:
    """Rank ``stage * DP + d`` holds rows 0-1 (d = 0) or row 2 (d = 1) of its stage's tensors."""
    directory.mkdir()
    rows = ((0, 2), (2, 3))
    for stage, names in enumerate(STAGES):
        for d in range(DP):
            rank = stage * DP + d
            start, stop = rows[d]
            records, tensors = [], []
            for name in names:
                local = grads[name][start:stop].clone()
                mesh = MeshPlacement((DP,), (d,), ("S(0)",), SHAPE, ("dp_shard",), (start, 0, 0))
                records.append(
                    ParamRecord(name, True, tuple(local.shape), "float32", SHAPE, {}, mesh)
                )
                tensors.append((name, local))
            coords = check_coords({"dp": [d, DP], "pp": [stage, len(STAGES)]})
            header = RankHeader(rank, DP * len(STAGES), 3, coords, False, "grad", tuple(records))
            with open(directory / f"rank-{rank:05d}.safetensors", "wb") as file:
                write_container(file, {METADATA_KEY: header.to_json()}, tensors)


def _write_ddp_snapshot(directory: Path, grads: dict[str, torch.Tensor]) -> None:
    """Rank ``stage * DP + d`` holds its stage's full gradients, a data-parallel replica (as
    ``dump_rank`` writes a DDP job's: plain tensors, no Megatron attribute)."""
    directory.mkdir()
    for stage, names in enumerate(STAGES):
        for d in range(DP):
            rank = stage * DP + d
            records = tuple(ParamRecord(name, True, SHAPE, "float32", SHAPE) for name in names)
            coords = check_coords({"dp": [d, DP], "pp": [stage, len(STAGES)]})
            header = RankHeader(rank, DP * len(STAGES), 3, coords, False, "grad", records)
            tensors = [(name, grads[name].clone()) for name in names]
            with open(directory / f"rank-{rank:05d}.safetensors", "wb") as file:
                write_container(file, {METADATA_KEY: header.to_json()}, tensors)


def _l2(tensors: list[torch.Tensor]) -> float:
    return math.sqrt(math.fsum(v * v for t in tensors for v in t.double().reshape(-1).tolist()))


def _json(*args: str) -> tuple[int, dict[str, Any]]:
    result = CliRunner().invoke(app, [*args, "--json"])
    assert result.stdout, (result.exit_code, result.stderr)
    return result.exit_code, json.loads(result.stdout)


@pytest.fixture(scope="module", params=["fsdp2", "ddp"])
def moe(
    tmp_path_factory: pytest.TempPathFactory, request: pytest.FixtureRequest
) -> tuple[Path, Path, dict[str, torch.Tensor]]:
    root = tmp_path_factory.mktemp(f"torch-native-moe-{request.param}")
    grads = _full_gradients()
    write = _write_fsdp2_snapshot if request.param == "fsdp2" else _write_ddp_snapshot
    write(root / "snapshot", grads)
    dcp.save({"grads": grads}, checkpoint_id=str(root / "checkpoint"))
    return root / "snapshot", root / "checkpoint", grads


def test_dense_and_expert_norms_split_by_name(
    moe: tuple[Path, Path, dict[str, torch.Tensor]],
) -> None:
    snapshot, checkpoint, grads = moe
    experts = [tensor for name, tensor in grads.items() if ".experts." in name]
    dense = [tensor for name, tensor in grads.items() if ".experts." not in name]
    for source in (snapshot, checkpoint):
        code, report = _json("norm", str(source))
        assert code == 0, report
        assert report["has_experts"] is True
        assert math.isclose(report["total_norm"], _l2(experts + dense), rel_tol=1e-12)
        assert math.isclose(report["dense_norm"], _l2(dense), rel_tol=1e-12)
        assert math.isclose(report["expert_norm"], _l2(experts), rel_tol=1e-12)
        flags = {row["name"]: row["expert"] for row in report["params"]}
        assert flags == {name: ".experts." in name for name in grads}, flags


def test_the_snapshot_and_the_checkpoint_of_one_step_compare_equal(
    moe: tuple[Path, Path, dict[str, torch.Tensor]],
) -> None:
    snapshot, checkpoint, _ = moe
    code, report = _json("compare", str(snapshot), str(checkpoint))
    assert report["mismatches"] == [] and code == 0, report["mismatches"]
    assert not any(total["flagged"] for total in report["totals"]), report["totals"]


def test_explain_names_a_norm_that_left_the_experts_out(
    moe: tuple[Path, Path, dict[str, torch.Tensor]],
) -> None:
    snapshot, _, grads = moe
    dense = _l2([tensor for name, tensor in grads.items() if ".experts." not in name])
    code, report = _json("explain", str(snapshot), "--logged", repr(dense))
    assert code == 0
    assert report["explained"] and report["best"] == "experts_left_out", report["rows"][:3]
    best = report["rows"][0]
    assert best["name"] == "experts_left_out" and best["match"], report["rows"][:3]
    assert sorted(best["params"]) == sorted(name for name in grads if ".experts." in name)


@pytest.mark.parametrize(
    ("name", "attrs", "dtensor", "expert"),
    [
        ("layers.0.moe.experts.w1", {}, False, True),  # DDP: no Megatron attribute at all
        ("layers.0.moe.experts.w1", {}, True, True),  # FSDP2
        ("layers.0.moe.experts.w1", {"tensor_model_parallel": True}, True, True),
        # Megatron's attributes say it: a plain tensor carrying them is an expert by allreduce
        ("layers.0.mlp.experts.w1", {"tensor_model_parallel": False}, False, False),
        ("layers.0.mlp.router.weight", {"allreduce": False}, False, True),
        ("layers.0.mlp.shared_experts.fc1.weight", {}, False, False),  # shared experts: dense
    ],
)
def test_which_records_are_experts(
    name: str, attrs: dict[str, Any], dtensor: bool, expert: bool
) -> None:
    mesh = MeshPlacement((DP,), (0,), ("S(0)",), SHAPE, ("dp_shard",), (0, 0, 0))
    record = ParamRecord(name, True, SHAPE, "float32", SHAPE, attrs, mesh if dtensor else None)
    assert record.expert is expert
    assert record.is_expert is (attrs.get("allreduce") is False)  # what counts: unchanged

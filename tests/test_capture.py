"""dump_rank in a live job: coordinates from Megatron, a DeviceMesh or the world; global names."""

from __future__ import annotations

import json
import math
import sys
import types
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors import safe_open

from gradstat import AxisPlace
from gradstat.analysis.stats import snapshot_stats
from gradstat.errors import SnapshotError
from gradstat.snapshot import Snapshot, dump_rank
from gradstat.snapshot.capture import coords_from_megatron, logical_name, named_gradients
from gradstat.testing import Case, launch
from tests._oracle import float64_norm, zeros_in


def _header(path: Path) -> dict[str, Any]:
    with safe_open(str(path), framework="pt") as file:
        return dict(json.loads(file.metadata()["gradstat"]))


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 2))
    model(torch.randn(5, 4)).square().sum().backward()
    return model


def test_single_process_module_defaults(tmp_path: Path) -> None:
    model = _model()
    path = dump_rank(tmp_path, model, step=5)
    header = _header(path)
    assert header["rank"] == 0 and header["world_size"] == 1 and header["step"] == 5
    assert header["grad_attr"] == "grad"
    assert header["coords"]["dp"] == [0, 1]
    assert [entry["name"] for entry in header["params"]] == [
        "0.weight",
        "0.bias",
        "1.weight",
        "1.bias",
    ]
    stats = snapshot_stats(Snapshot.open(tmp_path))
    grads = [param.grad for param in model.parameters()]
    assert math.isclose(stats.norm(2), float64_norm(grads, 2), rel_tol=1e-6)


def test_main_grad_is_preferred_when_present(tmp_path: Path) -> None:
    model = _model()
    for param in model.parameters():
        param.main_grad = torch.full_like(param, 0.5)
    header = _header(dump_rank(tmp_path, model))
    assert header["grad_attr"] == "main_grad"


def _fake_parallel_state() -> types.ModuleType:
    state = types.ModuleType("megatron.core.parallel_state")
    values = {
        "tensor_model_parallel": (1, 2),
        "pipeline_model_parallel": (1, 4),
        "data_parallel": (3, 4),
        "context_parallel": (0, 1),
        "expert_model_parallel": (1, 2),
        "expert_tensor_parallel": (0, 1),
        "expert_data_parallel": (1, 4),
    }
    for stem, (rank, size) in values.items():
        setattr(state, f"get_{stem}_rank", lambda rank=rank, **_: rank)
        setattr(state, f"get_{stem}_world_size", lambda size=size, **_: size)
    state.model_parallel_is_initialized = lambda: True  # type: ignore[attr-defined]
    return state


def test_coordinates_from_megatron_parallel_state(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    state = _fake_parallel_state()
    for name in ("megatron", "megatron.core"):
        monkeypatch.setitem(sys.modules, name, types.ModuleType(name))
    monkeypatch.setitem(sys.modules, "megatron.core.parallel_state", state)
    coords = coords_from_megatron()
    assert coords == {
        "tp": [1, 2],
        "pp": [1, 4],
        "dp": [3, 4],
        "cp": [0, 1],
        "ep": [1, 2],
        "etp": [0, 1],
        "edp": [1, 4],
    }
    header = _header(dump_rank(tmp_path, _model(), coords={"gtp": [1, 2]}))
    assert header["coords"]["tp"] == [1, 2] and header["coords"]["gtp"] == [1, 2]


def _gtp_parallel_state() -> types.ModuleType:
    """A parallel_state with GTP (megatron-core 0.17+): rank 5 of TP=1 x GTP=2 x DP=2 x PP=2,
    whose data-parallel getters fold GTP in unless told ``with_gtp_remat=False``."""
    state = _fake_parallel_state()
    gtp_rank, dp_rank = 1, 0

    def dp_rank_fn(with_context_parallel: bool = False, with_gtp_remat: bool = True) -> int:
        return dp_rank * 2 + gtp_rank if with_gtp_remat else dp_rank

    def dp_size_fn(with_context_parallel: bool = False, with_gtp_remat: bool = True) -> int:
        return 4 if with_gtp_remat else 2

    def no_expert_gtp() -> None:
        raise AssertionError("expert GTP group is not initialized")

    state.get_data_parallel_rank = dp_rank_fn  # type: ignore[attr-defined]
    state.get_data_parallel_world_size = dp_size_fn  # type: ignore[attr-defined]
    state.get_gtp_weight_remat_group = lambda: AxisPlace(gtp_rank, 2)  # type: ignore[attr-defined]
    state.get_expert_gtp_weight_remat_group = no_expert_gtp  # type: ignore[attr-defined]
    return state


def test_gtp_coordinates_come_from_megatron_and_dp_leaves_gtp_out(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Issue 18: dp read with GTP folded in ([1, 4]) made the snapshot 1.7% low; the replica
    axis is dp without GTP, and GTP is its own axis, with no hint needed."""
    for name in ("megatron", "megatron.core"):
        monkeypatch.setitem(sys.modules, name, types.ModuleType(name))
    monkeypatch.setitem(sys.modules, "megatron.core.parallel_state", _gtp_parallel_state())
    coords = coords_from_megatron()
    assert coords is not None
    assert coords["dp"] == [0, 2] and coords["gtp"] == [1, 2] and "egtp" not in coords


def test_no_megatron_means_no_megatron_coordinates() -> None:
    assert "megatron" not in sys.modules
    assert coords_from_megatron() is None


class _Layer(torch.nn.Module):
    def __init__(self, layer_number: int, experts: list[int]) -> None:
        super().__init__()
        self.layer_number = layer_number
        self.norm = torch.nn.LayerNorm(2)
        self.mlp = torch.nn.Module()
        self.mlp.experts = torch.nn.Module()
        self.mlp.experts.local_expert_indices = experts
        self.mlp.experts.local_experts = torch.nn.ModuleList(
            [torch.nn.Linear(2, 2, bias=False) for _ in experts]
        )


def test_layer_and_expert_indices_become_global() -> None:
    """A second pipeline stage holding global layers 2-3, and experts 2-3 of an EP group."""
    stage = torch.nn.Module()
    stage.decoder = torch.nn.Module()
    stage.decoder.layers = torch.nn.ModuleList([_Layer(3, [2, 3]), _Layer(4, [2, 3])])
    names = [name for name, _ in named_gradients(stage)]
    assert names == [
        "decoder.layers.2.norm.weight",
        "decoder.layers.2.norm.bias",
        "decoder.layers.2.mlp.experts.local_experts.2.weight",
        "decoder.layers.2.mlp.experts.local_experts.3.weight",
        "decoder.layers.3.norm.weight",
        "decoder.layers.3.norm.bias",
        "decoder.layers.3.mlp.experts.local_experts.2.weight",
        "decoder.layers.3.mlp.experts.local_experts.3.weight",
    ]


def test_grouped_gemm_experts_get_global_indices() -> None:
    """TEGroupedMLP holds an fc's experts as weight0..weightK of one module; the MoE layer lists
    their global indices (EP rank 1 of 2, 2 experts each): as a Megatron wgrads dump names them
    once made global, so that compare pairs the two."""
    stage = torch.nn.Module()
    stage.decoder = torch.nn.Module()
    layer = _Layer(1, [])
    layer.mlp = torch.nn.Module()
    layer.mlp.local_expert_indices = [2, 3]
    layer.mlp.experts = torch.nn.Module()
    layer.mlp.experts.linear_fc1 = torch.nn.Module()
    for index in range(2):
        setattr(layer.mlp.experts.linear_fc1, f"weight{index}", torch.nn.Parameter(torch.ones(1)))
    stage.decoder.layers = torch.nn.ModuleList([layer])
    names = [name for name, _ in named_gradients(stage)]
    assert names[-2:] == [
        "decoder.layers.0.mlp.experts.linear_fc1.weight2",
        "decoder.layers.0.mlp.experts.linear_fc1.weight3",
    ]


def _full_tensors() -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(4)
    weight = torch.randn(7, 5, generator=gen)
    weight[2] = 0.0
    return {"w": weight, "b": torch.randn(5, generator=gen)}


def _dump_fsdp_rank(rank: int, world_size: int, directory: str) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world_size,), mesh_dim_names=("dp_shard",))
    full = _full_tensors()
    grads = {
        "w": distribute_tensor(full["w"], mesh, [Shard(0)]),
        "b": distribute_tensor(full["b"], mesh, [Replicate()]),
    }
    pairs = [
        (name, types.SimpleNamespace(grad=grad, shape=grad.shape)) for name, grad in grads.items()
    ]
    dump_rank(directory, pairs, mesh=mesh, distributed_optimizer=True, step=1)


@pytest.mark.multiprocess
@pytest.mark.slow
def test_fsdp2_dtensor_gradients_count_once(tmp_path: Path) -> None:
    """Shard(0) pieces (one of them short) count each; the Replicate bias counts once."""
    snapshot_dir = tmp_path / "snapshot"
    report = launch(3, tmp_path, [Case("dump", _dump_fsdp_rank, str(snapshot_dir))])
    report.values("dump")
    snapshot = Snapshot.open(snapshot_dir)
    header = snapshot.files[2].header
    assert header.coords["dp"] == (2, 3)
    placements = {record.name: record.dtensor.placements for record in header.params}
    assert placements == {"w": ("S(0)",), "b": ("R",)}
    stats = snapshot_stats(snapshot, (2.0, 1.0))
    full = list(_full_tensors().values())
    assert math.isclose(stats.norm(2), float64_norm(full, 2), rel_tol=1e-6)
    assert math.isclose(stats.norm(1), float64_norm(full, 1), rel_tol=1e-6)
    assert stats.zeros == zeros_in(full)


@pytest.mark.parametrize(
    ("wrapped", "logical"),
    [
        ("module.0.weight", "0.weight"),  # DDP
        ("module.module.decoder.w", "decoder.w"),  # Megatron's DDP around Float16Module
        ("_orig_mod.layers.0.w", "layers.0.w"),  # torch.compile
        ("layers.0._checkpoint_wrapped_module.attention.wq.weight", "layers.0.attention.wq.weight"),
        ("_fsdp_wrapped_module.layers.1._fsdp_wrapped_module.w", "layers.1.w"),  # FSDP1
        ("encoder.module.w", "encoder.module.w"),  # a module really named "module" stays
    ],
)
def test_wrapper_prefixes_are_stripped(wrapped: str, logical: str, tmp_path: Path) -> None:
    assert logical_name(wrapped) == logical
    param = types.SimpleNamespace(grad=torch.ones(2), shape=(2,))
    header = _header(dump_rank(tmp_path, [(wrapped, param)]))
    assert [entry["name"] for entry in header["params"]] == [logical]


def test_a_ddp_model_is_dumped_under_its_logical_names(tmp_path: Path) -> None:
    model = _model()
    wrapper = torch.nn.Module()
    wrapper.module = model  # what DistributedDataParallel looks like from outside
    header = _header(dump_rank(tmp_path, wrapper))
    assert [entry["name"] for entry in header["params"]] == [
        name for name, _ in model.named_parameters()
    ]


def test_step_may_be_a_zero_dim_tensor(tmp_path: Path) -> None:
    header = _header(dump_rank(tmp_path / "a", _model(), step=torch.tensor(1200)))
    assert header["step"] == 1200
    for bad in (torch.tensor(1.5), torch.tensor([1, 2]), 2.0, "3", True):
        with pytest.raises(ValueError, match="step must be an integer"):
            dump_rank(tmp_path / "b", _model(), step=bad)  # type: ignore[arg-type]
    assert not (tmp_path / "b").exists()


@pytest.mark.parametrize("when", ["before backward", "after zero_grad"])
def test_a_model_without_gradients_is_refused_and_leaves_nothing(when: str, tmp_path: Path) -> None:
    if when == "before backward":
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(4, 3))
    else:
        model = _model()
        model.zero_grad()
    target = tmp_path / "deep" / "grads"
    with pytest.raises(SnapshotError, match=r"rank 0: none of the \d parameters has a \.grad"):
        dump_rank(target, model, step=1)
    assert list(tmp_path.iterdir()) == []


def test_a_failed_write_leaves_no_directory_it_created(tmp_path: Path) -> None:
    target = tmp_path / "new" / "grads"
    (tmp_path / "new").mkdir()
    (tmp_path / "new" / "grads").mkdir()
    (target / "rank-00000.safetensors").write_bytes(b"the user's")
    with pytest.raises(SnapshotError, match="rank file exists"):
        dump_rank(target, _model())
    assert (target / "rank-00000.safetensors").read_bytes() == b"the user's"
    fresh = tmp_path / "fresh" / "grads"
    with pytest.raises(ValueError, match="appears twice"):
        dump_rank(fresh, [("w", _model()[0].weight), ("w", _model()[0].bias)])
    assert not (tmp_path / "fresh").exists()


def _partial_gradient(rank: int, world_size: int, directory: str) -> str:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Partial

    import gradstat

    mesh = init_device_mesh("cpu", (world_size,), mesh_dim_names=("dp_shard",))
    grad = DTensor.from_local(torch.ones(3), mesh, [Partial()], run_check=False)
    param = types.SimpleNamespace(grad=grad, shape=grad.shape)
    dump_rank(directory, [("w", param)], step=1)
    try:
        gradstat.total_norm([grad])
    except gradstat.GradstatError as error:
        return str(error)
    return "no error"


@pytest.mark.multiprocess
@pytest.mark.slow
def test_a_partial_gradient_is_refused_live_and_in_a_snapshot(tmp_path: Path) -> None:
    from typer.testing import CliRunner

    from gradstat.cli import app

    snapshot_dir = tmp_path / "snapshot"
    report = launch(2, tmp_path, [Case("partial", _partial_gradient, str(snapshot_dir))])
    for message in report.values("partial"):
        assert "is Partial on mesh dimension 'dp_shard'" in message
    result = CliRunner().invoke(app, ["norm", str(snapshot_dir)])
    assert result.exit_code == 2 and result.stdout == ""
    assert result.stderr == (
        f"gradstat: error: {snapshot_dir / 'rank-00000.safetensors'}: parameter 'w' is Partial "
        "on mesh dimension 'dp_shard': a gradient pending its reduction has no norm; dump it "
        "after the gradients are reduced\n"
    )

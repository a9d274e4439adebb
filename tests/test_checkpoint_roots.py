"""Where a checkpoint keeps its optimizer's state: any root, any parameter name.

DCP's tutorial saves ``{"app": AppState}`` whose state dict is ``{"model": ..., "optim": ...}``;
other trainers save ``{"model", "optim"}`` at the top. Their moments were read as model weights
(the weights' norm 70% high, exp_avg "not in the checkpoint"), and a parameter named ``param``
or a module named ``step`` lost its moments to Megatron's ``state.<stat>.<param>`` reading.
Each kind's norm is held against float64 of the tensors saved, computed here with math.fsum.
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


class _Named(torch.nn.Module):
    """Names that are also optimizer words: a parameter ``param``, a module ``step``."""

    def __init__(self) -> None:
        super().__init__()
        self.param = torch.nn.Parameter(torch.randn(4, 4))
        self.step = torch.nn.Linear(4, 5)
        self.lin = torch.nn.Linear(5, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(self.step(x @ self.param))


class _AppState:
    """The tutorial's Stateful: the model's and optimizer's state dicts, one tree."""

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
        self.model, self.optimizer = model, optimizer

    def state_dict(self) -> dict[str, Any]:
        from torch.distributed.checkpoint.state_dict import get_state_dict

        weights, states = get_state_dict(self.model, self.optimizer)
        return {"model": weights, "optim": states}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        raise NotImplementedError


def _trained() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = _Named()
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
    for _ in range(2):
        optimizer.zero_grad()
        model(torch.randn(6, 4)).square().sum().backward()
        optimizer.step()
    return model, optimizer


def _l2(tensors: list[torch.Tensor]) -> float:
    return math.sqrt(math.fsum(float(x) ** 2 for t in tensors for x in t.double().flatten()))


def _norm(directory: Path, kind: str) -> float:
    result = CliRunner().invoke(app, ["norm", str(directory), "--kind", kind, "--json"])
    assert result.exit_code == 0, result.stderr
    return float(json.loads(result.stdout)["total_norm"])


@pytest.mark.parametrize("layout", ["app-state", "model-and-optim"])
def test_each_kind_is_its_own_tensors_under_any_root(layout: str, tmp_path: Path) -> None:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model, optimizer = _trained()
    if layout == "app-state":
        state: dict[str, Any] = {"app": _AppState(model, optimizer)}
    else:
        weights, states = get_state_dict(model, optimizer)
        state = {"model": weights, "optim": states}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save(state, checkpoint_id=str(tmp_path))
    params = list(model.parameters())
    moments = [optimizer.state[param] for param in params]
    expected = {
        "weight": _l2([param.detach() for param in params]),
        "exp_avg": _l2([moment["exp_avg"] for moment in moments]),
        "exp_avg_sq": _l2([moment["exp_avg_sq"] for moment in moments]),
    }
    for kind, truth in expected.items():
        got = _norm(tmp_path, kind)
        assert abs(got - truth) <= 1e-6 * truth, (kind, got, truth)
        # Each kind names its tensors by their parameter (app.model.<p> was named so whole).
        result = CliRunner().invoke(app, ["norm", str(tmp_path), "--kind", kind, "--json"])
        rows = {row["name"] for row in json.loads(result.stdout)["params"]}
        assert rows == {name for name, _ in model.named_parameters()}, (kind, rows)


_ROWS = torch.arange(8 * 3, dtype=torch.float32).reshape(8, 3) / 10


def _two_shards_a_rank(rank: int, _world_size: int, directory: str) -> None:
    """Each rank's data file holds two chunks of one tensor (a ShardedTensor of two shards)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed._shard.sharded_tensor import (
        Shard,
        ShardMetadata,
        init_from_local_shards,
    )

    rows = [(0, 2), (4, 2)] if rank == 0 else [(2, 2), (6, 2)]
    shards = [
        Shard(
            _ROWS[start : start + count].clone(),
            ShardMetadata([start, 0], [count, 3], f"rank:{rank}/cpu"),
        )
        for start, count in rows
    ]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save({"model": {"w": init_from_local_shards(shards, [8, 3])}}, checkpoint_id=directory)


@pytest.mark.multiprocess
def test_two_chunks_of_a_tensor_in_one_data_file_compare_as_themselves(tmp_path: Path) -> None:
    """compare read the second chunk of a data file from the first one's map (its rank files
    share the file's path): the same values saved whole gave diff_norm 4.16, not unchanged."""
    import torch.distributed.checkpoint as dcp

    from gradstat.testing import spawn

    sharded, whole = tmp_path / "sharded", tmp_path / "whole"
    spawn(2, _two_shards_a_rank, str(sharded))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save({"model": {"w": _ROWS.clone()}}, checkpoint_id=str(whole))
    assert len(list(sharded.glob("*.distcp"))) == 2
    result = CliRunner().invoke(app, ["compare", str(sharded), str(whole), "--json"])
    (row,) = json.loads(result.stdout)["params"]
    assert row["diff_norm"] == 0.0 and row["max_abs_diff"] == 0.0 and "unchanged" in row["flags"]
    assert abs(row["norm_a"] - _l2([_ROWS])) <= 1e-12 * _l2([_ROWS])
    # Chunks are placed as gradstat made them: no note weighs its own coordinates against them.
    result = CliRunner().invoke(app, ["inspect", str(sharded), "--json"])
    notes = json.loads(result.stdout)["notes"]
    assert notes and not any("coordinates" in note for note in notes), notes


class _TrainerWords(torch.nn.Module):
    """torchtitan saves model keys at the top level: modules named as trainer state is."""

    def __init__(self) -> None:
        super().__init__()
        self.state = torch.nn.Linear(3, 3)
        self.extra = torch.nn.Linear(3, 4)
        self.scheduler = torch.nn.Sequential(torch.nn.Linear(4, 2))
        self.rng = torch.nn.Linear(2, 2)
        self.layers = torch.nn.ModuleList([torch.nn.Module()])
        self.layers[0].state = torch.nn.Module()
        self.layers[0].state.step = torch.nn.Linear(2, 2)  # "layers.0.state.step.weight"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.scheduler(self.extra(self.state(x)))
        return self.layers[0].state.step(self.rng(x))


@pytest.mark.parametrize("with_optimizer", [True, False])
def test_top_level_modules_named_as_trainer_state_are_weights(
    with_optimizer: bool, tmp_path: Path
) -> None:
    """Their weights were read as trainer state and dropped from the weights' norm (34% low,
    exit 0); ``layers.0.state.step.weight`` was read as a step counter. The trainer's own state
    beside them (an RNG state, integers; a step) is still left out."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    torch.manual_seed(0)
    model = _TrainerWords()
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
    model(torch.randn(5, 3)).square().sum().backward()
    optimizer.step()
    weights, states = get_state_dict(model, optimizer)
    state: dict[str, Any] = dict(weights)  # the model's keys at the top, as torchtitan's
    state["train_state"] = {"step": torch.tensor(1.0)}
    state["dataloader"] = {"position": torch.tensor([7, 3], dtype=torch.int64)}
    if with_optimizer:
        state["optimizer"] = states
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save(state, checkpoint_id=str(tmp_path))
    params = list(model.parameters())
    expected = {"weight": _l2([param.detach() for param in params])}
    if with_optimizer:
        moments = [optimizer.state[param] for param in params]
        expected["exp_avg"] = _l2([moment["exp_avg"] for moment in moments])
        expected["exp_avg_sq"] = _l2([moment["exp_avg_sq"] for moment in moments])
        everything = [param.detach() for param in params]
        everything += [moment[key] for moment in moments for key in ("exp_avg", "exp_avg_sq")]
        # every floating-point tensor but the optimizer's step counters: the trainer's too
        expected["all"] = _l2([*everything, state["train_state"]["step"]])
    for kind, truth in expected.items():
        got = _norm(tmp_path, kind)
        assert abs(got - truth) <= 1e-6 * truth, (kind, got, truth)


def test_a_checkpoints_experts_count_as_experts(tmp_path: Path) -> None:
    """A checkpoint's expert gradients (named as Megatron's and torchtitan's) were counted as
    dense: its expert norm was 0 and `compare` against a wgrads dump of the same values failed."""
    import torch.distributed.checkpoint as dcp

    torch.manual_seed(0)
    grads = {
        "layers.0.attention.wq.weight": torch.randn(4, 4),
        "layers.0.moe.experts.w1": torch.randn(2, 4, 3),
        "decoder.layers.1.mlp.experts.local_experts.1.linear_fc1.weight": torch.randn(3, 4),
        "decoder.layers.1.mlp.experts.linear_fc2.weight0": torch.randn(4, 3),
        "decoder.layers.1.mlp.router.weight": torch.randn(2, 4),
    }
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save({"grads": grads}, checkpoint_id=str(tmp_path))
    result = CliRunner().invoke(app, ["norm", str(tmp_path), "--json"])
    assert result.exit_code == 0, result.stderr
    found = json.loads(result.stdout)
    experts = [grad for name, grad in grads.items() if ".experts." in name]
    dense = [grad for name, grad in grads.items() if ".experts." not in name]
    for key, truth in (("expert_norm", _l2(experts)), ("dense_norm", _l2(dense))):
        assert abs(found[key] - truth) <= 1e-9 * truth, (key, found[key], truth)
    assert abs(found["total_norm"] - _l2(list(grads.values()))) <= 1e-9 * found["total_norm"]

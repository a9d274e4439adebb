"""Sparse gradients in snapshots: stored dense (coalesced, duplicates summed), so that a
snapshot's norms and zero count are those of the dense gradient, through dump_rank, the CLI and
the flight recorder."""

from __future__ import annotations

import json
import math
import types
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors import safe_open
from typer.testing import CliRunner

import gradstat
from gradstat.analysis.stats import snapshot_stats
from gradstat.cli import app
from gradstat.recorder import complete_snapshots
from gradstat.snapshot import Snapshot, dump_rank
from tests._oracle import float64_norm, zeros_in

NORM_TYPES = (2.0, 1.0, math.inf)

pytestmark = pytest.mark.filterwarnings("ignore:Sparse CSR tensor support is in beta state")


def _embedding_model() -> torch.nn.Sequential:
    """An embedding with a sparse gradient (hybrid COO: sparse_dim 1, dense_dim 1, index 2
    looked up twice, uncoalesced) and a dense linear layer after it."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Embedding(10, 4, sparse=True), torch.nn.Linear(4, 3))
    model(torch.tensor([1, 2, 2, 7])).square().sum().backward()
    return model


def _embedding_grad(model: torch.nn.Module) -> torch.Tensor | None:
    return model.get_parameter("0.weight").grad


def _cancelling_coo() -> torch.Tensor:
    """A 3x4 COO gradient, uncoalesced, whose duplicates at (0, 1) cancel and at (2, 3) add."""
    indices = torch.tensor([[0, 0, 1, 2, 2], [1, 1, 2, 3, 3]])
    values = torch.tensor([3.0, -3.0, 5.0, 0.25, 0.5])
    return torch.sparse_coo_tensor(indices, values, (3, 4), check_invariants=True)


def _cancelling_hybrid() -> torch.Tensor:
    """A 4x3 hybrid COO gradient (sparse_dim 1, dense_dim 1): row 1 given twice, cancelling,
    row 3 given twice, adding."""
    indices = torch.tensor([[1, 3, 1, 3]])
    values = torch.tensor([[1.0, -2.0, 4.0], [0.5, 0.0, 1.0], [-1.0, 2.0, -4.0], [2.0, 3.0, -8.0]])
    return torch.sparse_coo_tensor(indices, values, (4, 3), check_invariants=True)


def _csr() -> torch.Tensor:
    """A compressed (CSR) gradient: densified too."""
    return torch.tensor([[0.0, 2.0, 0.0], [-7.0, 0.0, 0.5]]).to_sparse_csr()


SPARSE_GRADS: dict[str, Callable[[], torch.Tensor]] = {
    "coo-cancelling": _cancelling_coo,
    "hybrid-cancelling": _cancelling_hybrid,
    "csr": _csr,
}


def _pairs_with(grad: torch.Tensor) -> list[tuple[str, Any]]:
    """A dense linear layer's parameters and a parameter ``table`` holding ``grad`` (a COO
    gradient on a Parameter, as autograd leaves one; torch refuses to assign a compressed one,
    which goes as a stand-in with ``.grad``)."""
    torch.manual_seed(1)
    linear = torch.nn.Linear(3, 2)
    linear(torch.randn(5, 3)).sum().backward()
    if grad.layout == torch.sparse_coo:
        table: Any = torch.nn.Parameter(torch.zeros(grad.shape))
        table.grad = grad
    else:
        table = types.SimpleNamespace(grad=grad, shape=grad.shape)
    return [*linear.named_parameters(), ("table", table)]


def _dense_grads(pairs: Iterable[tuple[str, Any]]) -> dict[str, torch.Tensor]:
    """The oracle's gradients: each densified (to_dense sums duplicates) in float64."""
    return {name: param.grad.to_dense().double() for name, param in pairs}


def _stored(rank_file: Path) -> dict[str, torch.Tensor]:
    with safe_open(str(rank_file), framework="pt") as file:
        return {key: file.get_tensor(key) for key in file.keys()}  # noqa: SIM118 (safe_open is not a mapping)


def _check_snapshot(directory: Path, pairs: Iterable[tuple[str, Any]]) -> None:
    """The snapshot's norms, zero count and stored tensors against the dense float64 oracle,
    through the library and the CLI."""
    expected = _dense_grads(pairs)
    grads = list(expected.values())
    stats = snapshot_stats(Snapshot.open(directory), NORM_TYPES)
    for p in NORM_TYPES:
        assert math.isclose(stats.norm(p), float64_norm(grads, p), rel_tol=1e-12), p
    assert stats.zeros == zeros_in(grads)
    assert stats.numel == sum(grad.numel() for grad in grads)
    for norm_type in ("2", "1", "inf"):
        args = ["norm", str(directory), "--norm-type", norm_type, "--json"]
        result = CliRunner().invoke(app, args)
        assert result.exit_code == 0, result.output
        report = json.loads(result.stdout)
        p = math.inf if norm_type == "inf" else float(norm_type)
        assert math.isclose(report["total_norm"], float64_norm(grads, p), rel_tol=1e-12)
    zeros = CliRunner().invoke(app, ["zeros", str(directory), "--json"])
    assert zeros.exit_code == 0, zeros.output
    assert json.loads(zeros.stdout)["num_zeros"] == zeros_in(grads)
    (rank_file,) = directory.glob("rank-*.safetensors")
    stored = _stored(rank_file)
    assert sorted(stored) == sorted(expected)
    for name, grad in expected.items():
        assert torch.equal(stored[name].double(), grad), name


def _snapshot_of_sparse(grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, bool]:
    """What must not change of ``grad``: its indices (or compressed ones), values, coalesced."""
    if grad.layout == torch.sparse_coo:
        return grad._indices().clone(), grad._values().clone(), grad.is_coalesced()
    return grad.crow_indices().clone(), grad.values().clone(), False


def _unchanged(grad: torch.Tensor, before: tuple[torch.Tensor, torch.Tensor, bool]) -> bool:
    indices, values, coalesced = _snapshot_of_sparse(grad)
    return (
        torch.equal(indices, before[0])
        and torch.equal(values, before[1])
        and coalesced == before[2]
    )


def test_an_embeddings_sparse_gradient_dumps_as_its_dense_gradient(tmp_path: Path) -> None:
    model = _embedding_model()
    grad = _embedding_grad(model)
    assert grad is not None
    assert grad.layout == torch.sparse_coo and not grad.is_coalesced()
    assert (grad.sparse_dim(), grad.dense_dim()) == (1, 1)
    before = _snapshot_of_sparse(grad)
    dump_rank(tmp_path, model, step=1, coords={"dp": [0, 1]})
    _check_snapshot(tmp_path, model.named_parameters())
    assert _embedding_grad(model) is grad and _unchanged(grad, before)
    assert grad.layout == torch.sparse_coo and not grad.is_coalesced()


@pytest.mark.parametrize("make", SPARSE_GRADS.values(), ids=SPARSE_GRADS.keys())
def test_a_sparse_gradient_dumps_coalesced_and_dense(
    tmp_path: Path, make: Callable[[], torch.Tensor]
) -> None:
    grad = make()
    pairs = _pairs_with(grad)
    before = _snapshot_of_sparse(grad)
    dump_rank(tmp_path, pairs, coords={"dp": [0, 1]})
    _check_snapshot(tmp_path, pairs)
    assert pairs[-1][1].grad is grad and _unchanged(grad, before)


@pytest.mark.parametrize("make", [_cancelling_coo, _cancelling_hybrid])
def test_the_cancelling_cases_tell_summed_duplicates_from_stored_values(
    make: Callable[[], torch.Tensor],
) -> None:
    """Negative control: the stored values alone, duplicates not summed, give another norm and
    another zero count, so the tests above would catch a writer that skipped coalescing."""
    grad = make()
    raw = grad._values().double()
    dense = grad.to_dense().double()
    assert float64_norm([raw], 2.0) != float64_norm([dense], 2.0)
    assert float64_norm([raw], 1.0) != float64_norm([dense], 1.0)
    assert zeros_in([dense]) != zeros_in([raw]) + grad.numel() - raw.numel()


def test_the_flight_recorder_snapshots_a_sparse_gradient(tmp_path: Path) -> None:
    model = _embedding_model()
    grad = _embedding_grad(model)
    assert grad is not None
    before = _snapshot_of_sparse(grad)
    recorder = gradstat.Recorder(model, tmp_path, steps=[1], telemetry_every=None)
    recorder.step(1)
    recorder.wait()
    snapshots = dict(complete_snapshots(tmp_path))
    assert sorted(snapshots) == [1]
    _check_snapshot(snapshots[1], model.named_parameters())
    assert _embedding_grad(model) is grad and _unchanged(grad, before)


def test_the_flight_recorders_statistics_read_a_sparse_gradient_as_its_dense_one(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Per-parameter statistics every step and the snapshot, the gradient left as it was."""
    model = _embedding_model()
    grad = _embedding_grad(model)
    assert grad is not None
    before = _snapshot_of_sparse(grad)
    dense = _dense_grads(model.named_parameters())
    recorder = gradstat.Recorder(model, tmp_path, steps=[1], spike=None)
    norm = recorder.step(1)
    recorder.wait()
    assert abs(norm - float64_norm(dense.values(), 2.0)) <= 1e-12 * norm
    params = recorder.params
    assert params is not None and list(params.layout.names) == list(dense)
    for index, (name, tensor) in enumerate(dense.items()):
        found = params.norms[index]
        assert found is not None and abs(found - float64_norm([tensor], 2.0)) <= 1e-12 * found
        assert params.zeros[index] == zeros_in([tensor]), name
        assert params.numel[index] == tensor.numel(), name
    assert "gradstat recorder" not in capsys.readouterr().err
    assert sorted(dict(complete_snapshots(tmp_path))) == [1]
    assert _embedding_grad(model) is grad and _unchanged(grad, before)

"""Data-parallel replicas in a real job's life: a gradient None on some ranks only, and a NaN or
a spike on one replica only.

The norm of plain gradients is their union over the replicas: a rank lacking a gradient (None
after ``zero_grad()``, a parameter its batch never used) takes another rank's. Where rank 0
lacks one parameter's gradient and rank 1 another's, no rank's total is that union; the
library matches the lists by place. The flight recorder takes its norm from the statistics'
own pass once it agreed with ``total_norm``: that pass must see every rank's replicas, or a
NaN on rank 1 only is dropped (the recorder counted replicas at data-parallel rank 0).

Expected values are float64 sums over the gradients written here, never gradstat's."""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch

import gradstat
from gradstat.testing import Case, launch

pytestmark = [pytest.mark.multiprocess]

_PS = (2.0, 1.0, math.inf, 3.0)
_NAMES = ("0.weight", "0.bias", "1.weight", "1.bias")


def _model() -> torch.nn.Sequential:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(3, 3), torch.nn.Linear(3, 2))


def _grad_of(name: str, shape: torch.Size) -> torch.Tensor:
    """A gradient every rank builds alike (replicas), with a zero in each."""
    values = torch.arange(1, math.prod(shape) + 1, dtype=torch.float32) * (_NAMES.index(name) + 1)
    values[0] = 0.0
    return (values / 7).reshape(shape)


def _oracle(grads: list[torch.Tensor], p: float) -> float:
    values = [abs(float(value)) for grad in grads for value in grad.double().flatten()]
    if p == math.inf:
        return max(values)
    return float(sum(value**p for value in values) ** (1.0 / p))


def _close(a: float, b: float) -> bool:
    return abs(a - b) <= 1e-9 * max(abs(b), 1e-300)


# Per rank, the parameters whose gradient is None.
_LACKING = {
    "apart": ({"0.weight"}, {"1.weight"}),
    "rank 0 lacks two": ({"0.bias", "1.bias"}, set()),
    "alike": ({"1.bias"}, {"1.bias"}),
}


def _lacking(rank: int, _world_size: int, case: str) -> dict[str, Any]:
    model = _model()
    for name, param in model.named_parameters():
        missing = name in _LACKING[case][rank]
        param.grad = None if missing else _grad_of(name, param.shape)
    params = list(model.parameters())
    by_attr = [param.grad for param in params]  # None kept in place, as the recorder passes
    return {
        "norms": [gradstat.total_norm(params, p) for p in _PS],
        "norms of gradients": [gradstat.total_norm(by_attr, p) for p in _PS],
        "zeros": gradstat.total_zeros(params),
    }


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory: pytest.TempPathFactory) -> Any:
    root = tmp_path_factory.mktemp("replicas")
    (root / "run").mkdir()
    cases = [Case(case, _lacking, case) for case in _LACKING]
    cases += [
        Case("nan on rank 1", _recorded, ("nan", str(root / "nan"))),
        Case("spike on rank 1", _recorded, ("spike", str(root / "spike"))),
        Case("recorder apart", _recorded, ("apart", str(root / "apart"))),
    ]
    return root, launch(2, root / "run", cases, timeout_s=150)


@pytest.mark.parametrize("case", list(_LACKING))
def test_replicas_that_lack_different_gradients_count_their_union(
    two_ranks: Any, case: str
) -> None:
    """total_norm and total_zeros count every gradient some replica holds, once."""
    _, report = two_ranks
    model = _model()
    missing_everywhere = set.intersection(*_LACKING[case])
    union = [
        _grad_of(name, param.shape)
        for name, param in model.named_parameters()
        if name not in missing_everywhere
    ]
    expected = [_oracle(union, p) for p in _PS]
    zeros = sum(int((grad == 0).sum()) for grad in union)
    for found in report.values(case):
        for key in ("norms", "norms of gradients"):
            assert all(map(_close, found[key], expected)), (case, key, found[key], expected)
        assert found["zeros"] == zeros, case


def _recorded(rank: int, _world_size: int, arg: tuple[str, str]) -> dict[str, Any]:
    """Five steps of a replicated 2-layer model through the recorder; what goes wrong on rank
    1 only from step 3 (after the statistics' pass agreed with total_norm at steps 1 and 2)."""
    kind, directory = arg
    model = _model()
    recorder = gradstat.Recorder(model, directory, spike=None, steps=[5] if kind == "apart" else [])
    passes = []
    counted = recorder._gradients.norm

    def norm(*args: Any, **kwargs: Any) -> float:
        passes.append(len(recorder.records) + 1)
        return counted(*args, **kwargs)

    recorder._gradients.norm = norm  # type: ignore[method-assign]
    for step in range(1, 6):
        for name, param in model.named_parameters():
            param.grad = _grad_of(name, param.shape) * step
        if step >= 3 and rank == 1:
            grad = model.get_parameter("0.weight").grad
            assert grad is not None
            if kind == "nan":
                grad[1, 1] = math.nan
            elif kind == "spike":
                grad.mul_(1000.0)
        if step == 5 and kind == "apart":
            lacking = "0.weight" if rank == 0 else "1.weight"
            model.get_parameter(lacking).grad = None
        recorder.step(step)
    recorder.wait()
    return {
        "norms": [record.norm for record in recorder.records],
        "triggers": [list(record.triggers) for record in recorder.records],
        "passes": passes,
    }


def _replica_norms(step: int, spiked: bool) -> float:
    model = _model()
    grads = []
    for name, param in model.named_parameters():
        grad = _grad_of(name, param.shape) * step
        grads.append(grad * 1000.0 if spiked and name == "0.weight" else grad)
    return _oracle(grads, 2.0)


def test_a_nan_on_one_replica_is_every_steps_norm_and_fires_nonfinite(two_ranks: Any) -> None:
    _, report = two_ranks
    for found in report.values("nan on rank 1"):
        norms = found["norms"]
        assert all(_close(norms[index], _replica_norms(index + 1, False)) for index in (0, 1))
        assert all(math.isnan(norm) for norm in norms[2:]), norms
        assert found["triggers"][2:] == [["nonfinite"]] * 3, found["triggers"]


def test_a_spike_on_one_replica_is_the_norm_and_one_pass_serves(two_ranks: Any) -> None:
    """The norm is the largest replica's, as total_norm gives it, while the recorder computes
    it from the statistics' pass alone (total_norm at the first step only)."""
    _, report = two_ranks
    for found in report.values("spike on rank 1"):
        expected = [_replica_norms(step, spiked=step >= 3) for step in range(1, 6)]
        assert all(map(_close, found["norms"], expected)), (found["norms"], expected)
        assert found["passes"] == [1], found["passes"]


def test_the_recorder_counts_the_union_when_replicas_lack_different_gradients(
    two_ranks: Any,
) -> None:
    _, report = two_ranks
    model = _model()
    union = [_grad_of(name, param.shape) * 5 for name, param in model.named_parameters()]
    for found in report.values("recorder apart"):
        assert _close(found["norms"][4], _oracle(union, 2.0)), found["norms"]

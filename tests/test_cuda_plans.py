"""The bookkeeping of the CUDA graph plans, on CPU tensors with a stand-in graph.

The real graphs run in tests/test_cuda.py where a GPU exists; here a fake graph recomputes the
partials on replay, so the tests see which calls replay, which capture and which launch.
"""

from __future__ import annotations

import os
import subprocess
import sys
import weakref
from collections.abc import Callable, Sequence

import pytest
import torch
from torch import Tensor

from gradstat.core import kernels


class _FakeGraph:
    def __init__(self, grads: Sequence[Tensor], p: int, out: Tensor) -> None:
        # Weak, as a real graph holds only addresses: it must not keep a gradient alive.
        self.grads, self.p, self.out = [weakref.ref(grad) for grad in grads], p, out
        # What a real graph reads: the memory, elements and dtype each gradient had at capture.
        self.captured = [grad.detach() for grad in grads]
        self.replays = 0

    def replay(self) -> None:
        self.replays += 1
        assert all(ref() is not None for ref in self.grads), "replayed over a freed gradient"
        self.out.copy_(kernels._device_partials(self.captured, self.p))


@pytest.fixture
def plans(monkeypatch: pytest.MonkeyPatch) -> kernels._CudaPlans:
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    plans = kernels._CudaPlans()

    def capture(plan: kernels.CudaPlan, grads: Sequence[Tensor], p: int) -> None:
        out = kernels._device_partials(grads, p)
        plan.graph, plan.out = _FakeGraph(grads, p, out), out  # type: ignore[assignment]

    monkeypatch.setattr(kernels.CudaPlan, "_capture", capture)
    return plans


def _grads() -> list[Tensor]:
    gen = torch.Generator().manual_seed(3)
    return [torch.randn(100 + index, generator=gen) for index in range(20)]


def _only_plan(plans: kernels._CudaPlans) -> kernels.CudaPlan:
    (plan,) = plans.plans.values()
    return plan


def _sum_of_squares(grads: Sequence[Tensor]) -> float:
    return sum(float((grad.double() ** 2).sum()) for grad in grads)


def test_the_second_call_captures_and_later_ones_replay(plans: kernels._CudaPlans) -> None:
    grads = _grads()
    assert plans.replay(grads, 2) is None  # never seen: the caller launches
    plans.launch(grads, 2)
    first = plans.replay(grads, 2)
    plan = _only_plan(plans)
    assert isinstance(plan.graph, _FakeGraph) and first is not None
    for grad in grads:
        grad.mul_(3.0)
    again = plans.replay(grads, 2)
    assert again is not None and plan.graph.replays == 2
    assert abs(float(again[0]) - _sum_of_squares(grads)) <= 1e-6 * _sum_of_squares(grads)
    assert plan.out is not None
    assert again.data_ptr() != plan.out.data_ptr(), "the caller gets a copy to reduce in place"


def test_a_few_lists_are_kept_the_oldest_dropped_first(plans: kernels._CudaPlans) -> None:
    lists = [_grads() for _ in range(kernels._CudaPlans.KEPT + 1)]
    for grads in lists:
        plans.launch(grads, 2)
    assert plans.replay(lists[0], 2) is None
    for grads in lists[1:]:
        assert plans.replay(grads, 2) is not None


def test_another_list_a_swapped_storage_or_another_p_is_not_replayed(
    plans: kernels._CudaPlans,
) -> None:
    grads = _grads()
    plans.launch(grads, 2)
    assert plans.replay(grads[:-1], 2) is None
    assert plans.replay(list(reversed(grads)), 2) is None
    assert plans.replay(grads, 1) is None
    grads[4].data = torch.zeros_like(grads[4])
    assert plans.replay(grads, 2) is None


@pytest.mark.parametrize(
    "change",
    [
        pytest.param(lambda grad: setattr(grad, "data", grad.data[:50]), id="fewer-elements"),
        pytest.param(lambda grad: grad.resize_(30), id="resized"),
        pytest.param(lambda grad: setattr(grad, "data", grad.data.view(torch.float16)), id="dtype"),
    ],
)
def test_a_gradient_viewed_anew_at_the_same_address_is_not_replayed(
    plans: kernels._CudaPlans, change: Callable[[Tensor], object]
) -> None:
    """The same object at the same address, with other elements: the graph would read the old
    ones (a silently wrong norm), so the call launches instead."""
    grads = [grad.to(torch.bfloat16) for grad in _grads()]
    plans.launch(grads, 2)
    assert plans.replay(grads, 2) is not None
    address = grads[4].data_ptr()
    change(grads[4])
    assert grads[4].data_ptr() == address
    assert plans.replay(grads, 2) is None
    plans.launch(grads, 2)  # what the caller does then: the new layout is the plan's
    again = plans.replay(grads, 2)
    assert again is not None
    assert abs(float(again[0]) - _sum_of_squares(grads)) <= 1e-6 * _sum_of_squares(grads)


def test_a_freed_gradient_drops_the_plan(plans: kernels._CudaPlans) -> None:
    grads = _grads()
    plans.launch(grads, 2)
    plans.replay(grads, 2)
    assert _only_plan(plans).graph is not None
    del grads[7]
    assert not plans.plans


def test_graphs_can_be_switched_off(
    plans: kernels._CudaPlans, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("GRADSTAT_CUDA_GRAPHS", "0")
    grads = _grads()
    plans.launch(grads, 2)
    assert plans.replay(grads, 2) is None and not plans.plans


def test_the_partials_flag_what_the_device_cannot_decide() -> None:
    """[sum, rescale, 0, nan]: tiny, all-zero and infinite sums go the scaled way."""
    ordinary = kernels._device_partials([torch.ones(4)], 2).tolist()
    assert ordinary == [4.0, 0.0, 0.0, 0.0]
    for values, flags in [
        ([0.0, 0.0], [0.0, 1.0, 0.0, 0.0]),
        ([1e-30, 0.0], [0.0, 1.0, 0.0, 0.0]),
        ([float("inf"), 1.0], [0.0, 1.0, 0.0, 0.0]),
    ]:
        assert kernels._device_partials([torch.tensor(values)], 2).tolist() == flags
    nan = kernels._device_partials([torch.tensor([float("nan"), 1.0])], 2).tolist()
    assert nan[1:] == [0.0, 0.0, 1.0]


def test_a_prepared_grad_norm_off_cuda_is_get_grad_norm_fp32() -> None:
    from gradstat import GradNorm, get_grad_norm_fp32

    grads = _grads()
    for p in (2, 1, 3.0, float("inf")):
        prepared = GradNorm(grads, p)
        assert prepared() == get_grad_norm_fp32(grads, p)
        grads[0].mul_(2.0)
        assert prepared() == get_grad_norm_fp32(grads, p), "it reads the current values"


_TRITON_CHECK = """
import torch
from gradstat.core import _triton
gen = torch.Generator().manual_seed(0)
fp32 = [torch.randn(n, generator=gen) * 1e-3 for n in (5, 70_000, 131_072, 1)]
bf16 = [torch.randn(n, generator=gen).bfloat16() for n in (300, 65_537)]
for grads in (fp32, bf16):
    assert all(_triton.usable(grad) for grad in grads)
    table = _triton.ChunkTable(grads)
    for p in (1, 2):
        expected = sum(float((grad.double().abs() ** p).sum()) for grad in grads)
        got = float(table.power_sum(p))
        assert abs(got - expected) <= 1e-7 * expected, (p, got, expected)
assert not _triton.usable(torch.randn(4, 4).t()) and not _triton.usable(torch.empty(0))
print("ok")
"""


def test_the_triton_chunk_kernel_matches_float64_in_the_interpreter() -> None:
    """The kernel the CUDA graphs replay, run by Triton's CPU interpreter where Triton is
    installed (PyTorch's CUDA builds ship it; the CPU build does not)."""
    pytest.importorskip("triton")
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    result = subprocess.run(
        [sys.executable, "-c", _TRITON_CHECK],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
        check=False,
    )
    assert result.returncode == 0 and result.stdout.strip() == "ok", result.stderr

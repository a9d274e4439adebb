"""clip_grad_by_total_norm_fp32: Megatron's coefficient, in-place scaling, dtype rules."""

from __future__ import annotations

import math

import pytest
import torch

from gradstat import clip_grad_by_total_norm_fp32, get_grad_norm_fp32
from gradstat.errors import GradDtypeError
from tests._oracle import float64_norm, rel_err
from tests._params import param_with


def _params(seed: int = 0) -> list[torch.nn.Parameter]:
    gen = torch.Generator().manual_seed(seed)
    shapes = [(64, 17), (5000,), (3, 3), ()]
    return [param_with(torch.randn(shape, generator=gen)) for shape in shapes]


@pytest.mark.parametrize("as_tensor", [False, True])
def test_gradients_are_scaled_by_the_coefficient(as_tensor: bool) -> None:
    params = _params()
    before = [param.grad.double() for param in params]
    total = 123.25
    clip_grad_by_total_norm_fp32(params, 1.5, torch.tensor(total) if as_tensor else total)
    coeff = 1.5 / (total + 1e-6)
    for param, original in zip(params, before, strict=True):
        assert param.grad.dtype == torch.float32
        torch.testing.assert_close(param.grad.double(), original * coeff, rtol=2e-7, atol=0)


def test_clipped_norm_equals_max_norm() -> None:
    """The norm before and after comes from the float64 oracle, not from the function under
    test: a norm k times off would leave the clipped gradients with norm 1/k."""
    params = _params(1)
    expected = float64_norm([param.grad for param in params], 2)
    total = get_grad_norm_fp32([param.grad for param in params])
    assert rel_err(total, expected) <= 1e-6
    clip_grad_by_total_norm_fp32(params, 1.0, total)
    assert float64_norm([param.grad for param in params], 2) == pytest.approx(1.0, rel=1e-6)


@pytest.mark.parametrize("total", [0.5, 1.0 - 1e-6, 0.0, math.nan])
def test_gradients_untouched_bitwise_when_coefficient_is_not_below_one(total: float) -> None:
    params = _params(2)
    params[0].grad[0, 0] = -0.0
    params[1].grad[3] = math.nan
    before = [param.grad.clone() for param in params]
    clip_grad_by_total_norm_fp32(params, 1.0, total)
    for param, original in zip(params, before, strict=True):
        assert param.grad.view(torch.int32).equal(original.view(torch.int32))


def test_every_gradient_is_clipped_and_missing_ones_skipped() -> None:
    shared = param_with(torch.ones(4), shared=True)
    replica = param_with(torch.ones(4), tensor_model_parallel=False)
    no_grad = param_with(None)
    clip_grad_by_total_norm_fp32([shared, replica, no_grad], 1.0, 4.0)
    assert torch.equal(shared.grad, replica.grad)
    assert float(shared.grad[0]) == pytest.approx(0.25, rel=1e-6)
    assert no_grad.grad is None


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float64])
def test_non_fp32_grad_is_a_type_error(dtype: torch.dtype) -> None:
    param = param_with(torch.ones(4, dtype=dtype))
    with pytest.raises(TypeError, match="must be float32"):
        clip_grad_by_total_norm_fp32([param], 1.0, 10.0)
    assert torch.equal(param.grad, torch.ones(4, dtype=dtype))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_decoupled_grad_fp32_or_bf16(dtype: torch.dtype) -> None:
    param = param_with(None)
    param.decoupled_grad = torch.full((8,), 3.0, dtype=dtype)
    clip_grad_by_total_norm_fp32([param], 1.0, 3.0, use_decoupled_grad=True)
    assert param.decoupled_grad.dtype == dtype
    assert torch.allclose(param.decoupled_grad.double(), torch.full((8,), 1.0, dtype=torch.float64))


def test_decoupled_fp16_is_a_type_error() -> None:
    param = param_with(None)
    param.decoupled_grad = torch.ones(2, dtype=torch.float16)
    with pytest.raises(GradDtypeError, match="must be float32 or bfloat16"):
        clip_grad_by_total_norm_fp32([param], 1.0, 3.0, use_decoupled_grad=True)


@pytest.mark.parametrize("max_norm", [0.0, -1.0, math.nan])
def test_max_norm_must_be_positive(max_norm: float) -> None:
    with pytest.raises(ValueError, match="max_norm must be a positive number"):
        clip_grad_by_total_norm_fp32(_params(), max_norm, 1.0)

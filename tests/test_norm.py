"""get_grad_norm_fp32 on one process: accuracy against float64, dtypes, edge cases."""

from __future__ import annotations

import math

import pytest
import torch

from gradstat import get_grad_norm_fp32, total_norm
from gradstat.core import kernels
from gradstat.errors import GradDtypeError, NormTypeError
from tests._oracle import float64_norm, rel_err

NORM_TYPES = [2, 1, 3, 1.5, 0.5, math.inf]
DTYPES_CYCLE = [torch.float32, torch.bfloat16, torch.float64, torch.float16] * 2


def _mixed_grads(seed: int = 0) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    shapes = [(1000, 1000), (4096, 3), (7,), (), (3, 5, 7), (0, 4)]
    grads = [torch.randn(shape, generator=gen) for shape in shapes]
    grads[0][::3] = 0.0
    return grads


@pytest.mark.parametrize("norm_type", NORM_TYPES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64])
def test_norm_matches_float64(norm_type: float, dtype: torch.dtype) -> None:
    grads = [grad.to(dtype) for grad in _mixed_grads()]
    expected = float64_norm(grads, norm_type)
    got = get_grad_norm_fp32(grads, norm_type)
    assert isinstance(got, float)
    if norm_type == math.inf:
        assert got == expected
    else:
        assert rel_err(got, expected) <= 1e-6


def test_single_tensor_argument() -> None:
    grad = torch.randn(300, 7)
    assert get_grad_norm_fp32(grad) == pytest.approx(float64_norm([grad], 2), rel=1e-6)


def test_non_contiguous_gradient() -> None:
    base = torch.randn(512, 300)
    grad = base.t()[:, ::2]
    assert not grad.is_contiguous()
    assert rel_err(get_grad_norm_fp32([grad]), float64_norm([grad], 2)) <= 1e-6


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_l2_of_1e8_elements_within_1e6(dtype: torch.dtype) -> None:
    """The case PyTorch's CPU norm gets wrong by ~1e-2 (pytorch/pytorch#151761)."""
    gen = torch.Generator().manual_seed(7)
    grad = torch.randn(100_000_003, generator=gen).to(dtype)
    expected = float64_norm([grad], 2)
    assert rel_err(get_grad_norm_fp32([grad], 2), expected) <= 1e-6
    assert rel_err(get_grad_norm_fp32([grad], 1), float64_norm([grad], 1)) <= 1e-6


@pytest.mark.parametrize("norm_type", NORM_TYPES)
def test_empty_list_is_zero(norm_type: float) -> None:
    """Megatron crashes here for inf and p norms (NVIDIA/Megatron-LM#5529)."""
    assert get_grad_norm_fp32([], norm_type) == 0.0
    assert get_grad_norm_fp32([torch.empty(0)], norm_type) == 0.0


@pytest.mark.parametrize("norm_type", NORM_TYPES)
def test_negative_zeros_have_a_norm_of_plus_zero(norm_type: float) -> None:
    """Of -0.0 and 0.0 torch.maximum keeps the first: an inf-norm (and a p < 1 norm, scaled by
    it) of gradients all -0.0 was -0.0, a sign a log or copysign shows."""
    grads = [-torch.zeros(4), -torch.zeros(3, dtype=torch.bfloat16)]
    for value in (get_grad_norm_fp32(grads, norm_type), total_norm(grads, norm_type)):
        assert value == 0.0 and math.copysign(1.0, value) == 1.0


@pytest.mark.parametrize("bad", [0, -1, -math.inf, math.nan, "inf", "2", None, True, 2j])
def test_bad_norm_type_raises_value_error(bad: object) -> None:
    with pytest.raises(ValueError, match=r"norm_type .* not supported; use 2, 1, math\.inf"):
        get_grad_norm_fp32([torch.ones(3)], bad)  # type: ignore[arg-type]
    with pytest.raises(NormTypeError):
        get_grad_norm_fp32([], bad)  # type: ignore[arg-type]


# (A complex gradient counts by its elements' magnitudes: test_library_trust.py.)
@pytest.mark.parametrize("dtype", [torch.int32, torch.bool, torch.float8_e4m3fn])
def test_unsupported_dtype_raises(dtype: torch.dtype) -> None:
    with pytest.raises(GradDtypeError, match=r"float16, float64 \(and complex64, complex128, by"):
        get_grad_norm_fp32([torch.zeros(4).to(dtype)])


@pytest.mark.parametrize("norm_type", [2, 1, 3, math.inf])
def test_nan_and_inf_propagate(norm_type: float) -> None:
    nan_grads = [torch.ones(10_000), torch.tensor([1.0, math.nan])]
    inf_grads = [torch.ones(10_000), torch.tensor([1.0, -math.inf])]
    assert math.isnan(get_grad_norm_fp32(nan_grads, norm_type))
    assert get_grad_norm_fp32(inf_grads, norm_type) == math.inf


@pytest.mark.parametrize("norm_type", [2, 1])
@pytest.mark.parametrize("scale", [1e30, 1e-30, 1e-42])
def test_fp32_overflow_and_subnormal_ranges_are_exact(norm_type: float, scale: float) -> None:
    """Squares of 1e30 overflow fp32, squares of 1e-30 underflow it: float64 must take over."""
    gen = torch.Generator().manual_seed(3)
    grad = (torch.rand(20_000, generator=gen) * scale).float()
    expected = float64_norm([grad], norm_type)
    assert math.isfinite(expected) and expected > 0
    assert rel_err(get_grad_norm_fp32([grad], norm_type), expected) <= 1e-6


def test_one_huge_row_among_normal_ones() -> None:
    grads = [torch.randn(10_000), torch.full((4096,), 3e19)]
    assert rel_err(get_grad_norm_fp32(grads), float64_norm(grads, 2)) <= 1e-6


def test_input_is_not_modified() -> None:
    grads = _mixed_grads(5)
    before = [grad.clone() for grad in grads]
    for norm_type in NORM_TYPES:
        get_grad_norm_fp32(grads, norm_type)
    for grad, copy in zip(grads, before, strict=True):
        assert torch.equal(grad, copy)


@pytest.mark.parametrize("low", [torch.bfloat16, torch.float16])
def test_short_mantissa_fp32_has_no_visible_bias(low: torch.dtype) -> None:
    """fp32 main grads often hold bf16/fp16 values; PyTorch's norm kernel is biased on them over
    long rows (-4.8e-7 at 4096-element rows), which gradstat's short rows keep below 1e-7."""
    gen = torch.Generator().manual_seed(11)
    grad = torch.randn(20_000_000, generator=gen).to(low).float()
    assert rel_err(get_grad_norm_fp32([grad]), float64_norm([grad], 2)) <= 1e-7


@pytest.mark.parametrize("norm_type", [1, 2])
def test_fused_multi_tensor_path_matches_float64(norm_type: int) -> None:
    """The path CUDA lists take (one fused norm per tensor), run here on small CPU tensors (on
    CPU each tensor is one long fp32 reduction; its accuracy is tested in test_cuda.py)."""
    gen = torch.Generator().manual_seed(9)
    shapes = [(30, 40), (7,), (), (0, 3), (500,), (3, 3, 3), (64, 8), (1,)]
    grads = [
        torch.randn(shape, generator=gen).to(dtype)
        for shape, dtype in zip(shapes, DTYPES_CYCLE, strict=True)
    ]
    got = float(kernels._foreach_power_sum(grads, norm_type, torch.device("cpu")))
    expected = float64_norm(grads, norm_type) ** norm_type
    assert rel_err(got, expected) <= 1e-6
    assert float(kernels._foreach_power_sum([], norm_type, torch.device("cpu"))) == 0.0

"""count_zeros_fp32 on one process: filters, GTP padding, dtypes, Megatron's own cases."""

from __future__ import annotations

import math

import pytest
import torch

from gradstat import AxisPlace, count_zeros_fp32
from gradstat.errors import GradDtypeError
from tests._oracle import zeros_in
from tests._params import gtp_shard, param_with


def _sparse(shape: tuple[int, ...], zero_every: int, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    grad = torch.randn(shape, generator=gen)
    grad.view(-1)[::zero_every] = 0.0
    return grad


def test_megatron_stamped_padding_is_excluded() -> None:
    """Megatron's TestCountZerosFp32GtpPadding: 8x4 zeros, one nonzero, 12 stamped pad zeros."""
    grad = torch.zeros(8, 4)
    grad[0, 0] = 1.0
    assert count_zeros_fp32([param_with(grad, gtp_pad_zeros=12)], None) == 32 - 1 - 12


def test_megatron_no_gtp_attribute_counts_every_zero() -> None:
    grad = torch.zeros(8, 4)
    grad[0, 0] = 1.0
    assert count_zeros_fp32([param_with(grad)], None) == 31


def test_padding_spilling_over_ranks_is_excluded_on_every_rank() -> None:
    """10 rows padded to 16 over 4 GTP ranks: rank 3 is all padding, rank 2 half padding."""
    total = 0
    for gtp_rank in range(4):
        shard, mask = gtp_shard(10, 3, 4, gtp_rank, 4)
        real_zeros = zeros_in([shard.grad[~mask]])
        got = count_zeros_fp32([shard], None, gtp_group=AxisPlace(gtp_rank, 4))
        assert got == real_zeros
        total += int(got)
    assert total == 0  # random weights: the only zeros were padding


def test_mixed_parameters_count_each_logical_tensor_once() -> None:
    counted = [_sparse((64, 33), 3, 0), _sparse((1000,), 7, 1), torch.zeros(5, 5)]
    params = [param_with(grad, tensor_model_parallel=True) for grad in counted]
    skipped = [
        param_with(_sparse((40,), 2, 2), shared=True),
        param_with(_sparse((40,), 2, 3), tensor_model_parallel=False),  # TP rank 1 replica
        param_with(_sparse((40,), 2, 4), allreduce=False),  # expert TP rank 1 replica
        param_with(None),
    ]
    tp1 = AxisPlace(1, 2)
    got = count_zeros_fp32(params + skipped, None, tp_group=tp1, expert_tp_group=tp1)
    assert got == zeros_in(counted)
    assert isinstance(got, float)


def test_gtp_replicas_count_only_on_gtp_rank_zero() -> None:
    grad = _sparse((30, 3), 4, 5)
    replicated = param_with(grad)
    assert count_zeros_fp32([replicated], None, gtp_group=AxisPlace(0, 2)) == zeros_in([grad])
    assert count_zeros_fp32([replicated], None, gtp_group=AxisPlace(1, 2)) == 0
    expert = param_with(grad, allreduce=False)
    assert count_zeros_fp32([expert], None, expert_gtp_group=AxisPlace(1, 2)) == 0
    assert count_zeros_fp32([expert], None, gtp_group=AxisPlace(1, 2)) == zeros_in([grad])


def test_negative_zero_is_zero_and_nan_is_not() -> None:
    grad = torch.tensor([0.0, -0.0, math.nan, math.inf, 1.0])
    assert count_zeros_fp32([param_with(grad)], None) == 2


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_decoupled_grad(dtype: torch.dtype) -> None:
    grad = _sparse((100, 10), 3, 6)
    param = param_with(torch.ones(100, 10))
    param.decoupled_grad = grad.to(dtype)
    assert count_zeros_fp32([param], None, use_decoupled_grad=True) == zeros_in([grad])
    assert count_zeros_fp32([param], None) == 0


def test_megatron_fsdp_params_count_their_local_shard_whatever_their_attributes() -> None:
    grad = _sparse((20,), 2, 7)
    param = param_with(grad, __fsdp_param__=True, shared=True)
    assert count_zeros_fp32([param], None, tp_group=AxisPlace(1, 2)) == zeros_in([grad])


def test_single_tensor_and_empty_list() -> None:
    grad = _sparse((9, 9), 2, 8)
    assert count_zeros_fp32(param_with(grad), None) == zeros_in([grad])
    assert count_zeros_fp32([], None) == 0.0


def test_unsupported_gradient_dtype() -> None:
    with pytest.raises(GradDtypeError, match="int64"):
        count_zeros_fp32([param_with(torch.zeros(3, dtype=torch.int64))], None)


def test_offline_stats_group_is_rejected() -> None:
    with pytest.raises(TypeError, match=r"must be a torch\.distributed ProcessGroup or None"):
        count_zeros_fp32([param_with(torch.zeros(3))], AxisPlace(0, 1))  # type: ignore[arg-type]

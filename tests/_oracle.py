"""Independent float64 statistics: the expected values of the numeric tests."""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch
from torch import Tensor

_BLOCK = 1 << 22


def _blocks(grad: Tensor) -> Iterable[Tensor]:
    flat = grad.reshape(-1)
    for start in range(0, flat.numel(), _BLOCK):
        yield flat[start : start + _BLOCK].to(torch.float64)


def float64_norm(grads: Iterable[Tensor], p: float) -> float:
    """The p-norm of the concatenated gradients, every operation in float64."""
    if p == math.inf:
        peak = 0.0
        for grad in grads:
            for block in _blocks(grad):
                if block.numel():
                    peak = max(peak, float(block.abs().max()))
        return peak
    total = 0.0
    for grad in grads:
        for block in _blocks(grad):
            total += float((block.abs() ** p).sum())
    return total ** (1.0 / p)


def zeros_in(grads: Iterable[Tensor]) -> int:
    """Exact number of elements equal to zero (-0.0 included)."""
    return sum(int((grad == 0).sum()) for grad in grads)


def rel_err(value: float, expected: float) -> float:
    return abs(value - expected) / abs(expected)

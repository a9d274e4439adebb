"""Small builders of parameters carrying Megatron's attributes."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import torch

from gradstat import AxisPlace


def param_with(grad: torch.Tensor | None, **attrs: Any) -> Any:
    """A Parameter like ``grad`` whose .grad is ``grad``, with attributes set.

    torch refuses an integer Parameter's gradient; such a "parameter" is a plain namespace.
    """
    if grad is not None and not grad.is_floating_point():
        return SimpleNamespace(grad=grad, shape=grad.shape, **attrs)
    like = grad if grad is not None else torch.zeros(1)
    param = torch.nn.Parameter(torch.zeros_like(like))
    param.grad = grad
    for name, value in attrs.items():
        setattr(param, name, value)
    return param


def gtp_shard(
    full_rows: int, cols: int, align: int, gtp_rank: int, gtp_size: int
) -> tuple[Any, torch.Tensor]:
    """Rank ``gtp_rank``'s GTP shard of a random [full_rows, cols] weight, padded as GTP does.

    Returns the shard (with is_gtp_weight_remat, pad_length, group) and a boolean mask of its
    padding elements, built by padding and splitting a real tensor (independent of gradstat).
    """
    multiple = align * gtp_size
    padded_rows = -(-full_rows // multiple) * multiple
    pad_length = padded_rows - full_rows
    gen = torch.Generator().manual_seed(full_rows * 131 + cols)
    weight = torch.randn(full_rows, cols, generator=gen)
    padded = torch.cat([weight, torch.zeros(pad_length, cols)])
    is_pad = torch.zeros(padded_rows, cols, dtype=torch.bool)
    is_pad[full_rows:] = True
    grad = padded.chunk(gtp_size)[gtp_rank].clone()
    mask = is_pad.chunk(gtp_size)[gtp_rank].clone()
    shard = param_with(
        grad,
        is_gtp_weight_remat=True,
        pad_length=pad_length,
        group=AxisPlace(gtp_rank, gtp_size),
    )
    return shard, mask

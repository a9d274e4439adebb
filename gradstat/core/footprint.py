"""Which memory a strided tensor's elements occupy: clipping scales each gradient in place, so
every element it is given must be scaled exactly once.

A tensor overlaps itself when two of its indices name one element (an expanded view, or strides
that fold back). Two tensors hold the same elements (one gradient listed twice, or viewed again
in another shape or order: scaled once), share only some (refused), or none. Most gradients are
dense (a permutation of a contiguous layout, covering every element of their byte range), and
then the byte ranges alone decide; a tensor with gaps (a slice of columns) is held to the exact
offsets of its elements, computed only where the byte ranges meet.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import Tensor

__all__ = ["Footprint", "footprint", "overlaps_itself", "relation"]


class Footprint(NamedTuple):
    """The bytes a non-empty strided tensor's elements occupy: ``[start, end)`` on ``device``
    (a tuple: a step clips thousands of gradients, and a frozen dataclass costs 6 us to make)."""

    tensor: Tensor
    device: torch.device
    start: int
    end: int
    itemsize: int
    dense: bool  # every element of [start, end) is one of the tensor's, once


def _dims(tensor: Tensor) -> list[tuple[int, int]]:
    """(stride, size) of each dimension of more than one element, smallest stride first."""
    return sorted(
        (stride, size)
        for stride, size in zip(tensor.stride(), tensor.shape, strict=True)
        if size > 1
    )


def footprint(tensor: Tensor) -> Footprint | None:
    """The footprint of a strided tensor; None for one without elements."""
    if tensor.numel() == 0:
        return None
    itemsize = tensor.element_size()
    if tensor.is_contiguous():  # the usual gradient, in a few calls: a step clips thousands
        start = tensor.data_ptr()
        return Footprint(tensor, tensor.device, start, start + tensor.nbytes, itemsize, True)
    # torch's strides are >= 0: the first element is the lowest, the last index the highest.
    high = sum(
        (size - 1) * stride for stride, size in zip(tensor.stride(), tensor.shape, strict=True)
    )
    start = tensor.data_ptr()
    end = start + (high + 1) * itemsize
    reach, dense = 1, True
    for stride, size in _dims(tensor):
        dense = dense and stride == reach
        reach *= size
    return Footprint(tensor, tensor.device, start, end, itemsize, dense)


def overlaps_itself(tensor: Tensor) -> bool:
    """Whether two indices of ``tensor`` name one element."""
    if tensor.numel() <= 1 or tensor.is_contiguous():
        return False
    verdict = torch._debug_has_internal_overlap(tensor)
    if verdict != 2:  # 0: no overlap, 1: overlap; 2: too hard to say from the strides alone
        return bool(verdict)
    # Each stride past the farthest element the smaller ones reach: no two indices meet.
    reach = 0
    for stride, size in _dims(tensor):
        if stride <= reach:
            break
        reach += stride * (size - 1)
    else:
        return False
    offsets = _offsets(tensor)
    return bool(offsets.numel() != torch.unique(offsets).numel())


def relation(a: Footprint, b: Footprint) -> str:
    """``"same"`` (the same elements), ``"partial"`` (some elements in common, or bytes shared
    by elements of two sizes) or ``"disjoint"``."""
    if a.device != b.device or a.end <= b.start or b.end <= a.start:
        return "disjoint"
    if a.itemsize != b.itemsize:
        return "partial"
    if a.dense and b.dense:
        return "same" if (a.start, a.end) == (b.start, b.end) else "partial"
    # Neither overlaps itself (see overlaps_itself): each offset is one element.
    first, second = _offsets(a.tensor), _offsets(b.tensor)
    common = int(torch.isin(first, second).sum())
    if common == 0:
        return "disjoint"
    return "same" if common == first.numel() == second.numel() else "partial"


def _offsets(tensor: Tensor) -> Tensor:
    """The byte address of each of ``tensor``'s elements, on the CPU (int64, numel of them:
    asked only of tensors with gaps whose bytes meet another's, or whose strides fold)."""
    offsets = torch.zeros((), dtype=torch.int64)
    for stride, size in zip(tensor.stride(), tensor.shape, strict=True):
        offsets = offsets.unsqueeze(-1) + torch.arange(size, dtype=torch.int64) * stride
    return offsets.reshape(-1) * tensor.element_size() + tensor.data_ptr()

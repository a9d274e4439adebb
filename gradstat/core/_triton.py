"""One launch for the sum of |x|^p (p = 1 or 2) over many CUDA tensors, written in Triton.

PyTorch's multi-tensor norm reads at about 3.4 TB/s on an H200, where a plain reduction of one
large tensor reads at about 4.3: it launches once per ~110 tensors and waits for each launch's
last blocks. Here a table, built once per list, cuts every tensor into chunks of ``CHUNK``
elements (its address and length); one program per chunk sums its |x|^p in fp32 lanes of
``CHUNK / BLOCK`` elements each and writes the chunk's sum in float64; the chunks' sums are
added in float64. That is more accurate than either PyTorch kernel (a lane adds 32 numbers)
and one launch per dtype, so a CUDA graph of it replays as fast as the memory allows.

Only used where Triton imports (PyTorch's CUDA builds ship it); everything else takes
PyTorch's kernels.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

try:
    import triton
    import triton.language as tl
except ImportError:  # a CPU build of PyTorch: the caller takes PyTorch's kernels
    triton = None

CHUNK = 1 << 16
BLOCK = 2048
DTYPES = (torch.float32, torch.bfloat16, torch.float16)

if triton is not None:

    @triton.jit
    def _chunk_power_sums(
        addresses, lengths, sums, like, P: tl.constexpr, CHUNK: tl.constexpr, BLOCK: tl.constexpr
    ):
        # ``like``: a tensor of the chunks' dtype, whose pointer type the addresses take.
        chunk = tl.program_id(0)
        base = tl.load(addresses + chunk).to(like.dtype)
        length = tl.load(lengths + chunk)
        lanes = tl.zeros([BLOCK], dtype=tl.float32)
        for start in range(0, CHUNK, BLOCK):  # a fixed count: unrolled; masked past the length
            offsets = start + tl.arange(0, BLOCK)
            x = tl.load(base + offsets, mask=offsets < length, other=0.0).to(tl.float32)
            if P == 2:
                lanes += x * x
            else:
                lanes += tl.abs(x)
        tl.store(sums + chunk, tl.sum(lanes.to(tl.float64), axis=0))


class ChunkTable:
    """The chunks of a fixed list of contiguous CUDA tensors of one dtype, ready to launch on."""

    def __init__(self, grads: Sequence[Tensor]) -> None:
        device = grads[0].device
        addresses, lengths = [], []
        for grad in grads:
            size, start = grad.element_size(), grad.data_ptr()
            for offset in range(0, grad.numel(), CHUNK):
                addresses.append(start + offset * size)
                lengths.append(min(CHUNK, grad.numel() - offset))
        self.addresses = torch.tensor(addresses, dtype=torch.int64, device=device)
        self.lengths = torch.tensor(lengths, dtype=torch.int32, device=device)
        self.sums = torch.empty(len(addresses), dtype=torch.float64, device=device)
        # Not a gradient: the table must not keep one alive.
        self.like = torch.empty(1, dtype=grads[0].dtype, device=device)

    def power_sum(self, p: int) -> Tensor:
        """sum |x|^p over every element of the tensors, as a 0-dim float64 tensor."""
        grid = (self.addresses.numel(),)
        kernel = _chunk_power_sums[grid]
        kernel(self.addresses, self.lengths, self.sums, self.like, P=p, CHUNK=CHUNK, BLOCK=BLOCK)
        return self.sums.sum()


def usable(grad: Tensor) -> bool:
    """Whether ``grad`` can go through a chunk table (Triton present, contiguous, a dtype
    the kernel reads)."""
    return triton is not None and grad.is_contiguous() and grad.dtype in DTYPES and grad.numel() > 0

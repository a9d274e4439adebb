"""Accurate, fused per-device reductions over lists of gradient tensors, and exact p-norms.

PyTorch's CPU norm kernels accumulate a whole tensor in fp32: for 1e8 fp32 elements the L2 norm
is off by ~1e-2 (pytorch/pytorch#151761), and a tensor of 10 elements by ~1e-7. Here the L1 and
L2 of CPU gradients sum every |x| or x^2 in float64, each term exact, through the native kernel
(:mod:`gradstat.core.native`): within 1e-12 relative of float64 for up to 1e8 elements, and the
same numbers the snapshot reader's pass gives. Without the kernel a tensor of up to
``EXACT_ELEMENTS`` is summed in float64 throughout, a larger one as fp32 norms of ``ROW``-element
rows combined in float64: random values' errors average out (measured at most 4e-8, ~1e-9 for
1e8 elements); values that round alike in every row do not (a constant 0.001 over 1e5 elements:
5.9e-6), bounded by one row's fp32 sum, 511 x 2^-24 = 3.0e-5. CUDA tensors use PyTorch's
fused multi-tensor norm (tree reductions of short fp32 partials), one launch for the whole
list, and the same float64 combination.

A sum of p-th powers need not fit in float64 (1e-160 squared underflows, 2.7e-3 to the 150th
too, 1.37 to the 1e300th overflows): :func:`reduced_norm` then recomputes it scaled by the
largest |x|, which is exact at any magnitude and any p > 0. Nothing here ever writes into a
tensor it is given (read-only memory-mapped snapshots included).

Tensor results are 0-dim tensors on the gradients' device (float64 for norms, int64 for counts),
so a CUDA caller pays one synchronisation at the end, not one per tensor.
"""

from __future__ import annotations

import enum
import functools
import logging
import math
import operator
import os
import weakref
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import NamedTuple

import torch
import torch.distributed as dist
from torch import Tensor

from gradstat.core import _triton, native
from gradstat.errors import GradDtypeError

__all__ = [
    "SUPPORTED_DTYPES",
    "StatCompute",
    "StatReduce",
    "TensorStats",
    "abs_max",
    "add_norms",
    "bits",
    "check_dtype",
    "combine_norms",
    "magnitudes",
    "nonzero_count",
    "norm",
    "norm_partials",
    "one_pass_serves",
    "reduced_norm",
    "scaled_power_sum",
    "tensor_stats",
]

SUPPORTED_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)

# Elements per fp32 partial sum. PyTorch's CPU norm kernel has a small systematic bias on data
# with short mantissas (bf16/fp16 values), growing with the row length: measured on 5e7
# bf16-valued elements, -4.8e-7 with 4096-element rows, -2.2e-8 with 512. Rows of 512 cost
# the same time; their outputs are a 0.2% second pass.
ROW = 512
# Low-precision gradients are upcast to fp32 this many elements at a time, into one reused
# buffer that stays in cache (a multiple of ROW, so a full buffer has no tail).
UPCAST_BLOCK = 1 << 20
# Without the native kernel, tensors of up to this many elements are summed in float64
# throughout (a float64 copy of 512 KiB costs about what their fp32 row norms cost); larger
# ones as fp32 rows, whose errors average out over many rows of random values (rows computed in
# float64 would cost 3.5x: 28 against 7.9 ms for 1e7 elements on this project's CPU).
EXACT_ELEMENTS = 1 << 16
# Below this sum of p-th powers, fp32 squares may have lost precision to subnormals: recompute
# in float64. Bounded error above it: (elements x 2^-150) / 2^-90, under 1e-8 for 2^34 elements.
UNDERFLOW_GUARD = 2.0**-90
# CUDA gradients of at least this many elements are reduced by a launch of their own rather
# than by the multi-tensor kernel (see _foreach_power_sum).
CUDA_OWN_LAUNCH = 1 << 24
# Below this float64 sum of p-th powers, terms may be float64 subnormals (each off by up to
# 2^-1075): the norm is recomputed scaled by max |x|. Bounded error above it:
# (elements x 2^-1075) / 2^-900, under 1e-40 for 2^64 elements.
FLOAT64_GUARD = 2.0**-900

# What runs on each rank's tensors (a statistic on ``device``), and what reduces it over the
# ranks with an op, the same on every rank; see :func:`reduced_norm`.
StatCompute = Callable[[list[Tensor], torch.device], Tensor]
StatReduce = Callable[[StatCompute, dist.ReduceOp.RedOpType], Tensor]

_log = logging.getLogger(__name__)


@functools.cache
def _say_path(path: str) -> None:
    """Log which kernel path ran, once per process and path (it runs once per tensor list)."""
    _log.info("kernels: %s", path)


def check_dtype(grad: Tensor, what: str = "gradient") -> None:
    """Raise GradDtypeError unless ``grad`` is a floating dtype the kernels handle."""
    if grad.dtype not in SUPPORTED_DTYPES:
        names = ", ".join(str(dtype).removeprefix("torch.") for dtype in SUPPORTED_DTYPES)
        raise GradDtypeError(
            f"{what} has dtype {str(grad.dtype).removeprefix('torch.')}; supported: {names} "
            "(and complex64, complex128, by their elements' magnitudes)"
        )


def check_dtypes(grads: Sequence[Tensor]) -> None:
    """check_dtype for each gradient; one set of dtypes to look at in the usual case."""
    if not {grad.dtype for grad in grads} <= set(SUPPORTED_DTYPES):
        for grad in grads:
            check_dtype(grad)


def _split_rows(flat: Tensor) -> tuple[Tensor | None, Tensor]:
    """A (rows, ROW) view of the whole rows of ``flat`` (None if there are none), and the tail."""
    whole = flat.numel() - flat.numel() % ROW
    return (flat[:whole].view(-1, ROW) if whole else None), flat[whole:]


class _RowNorms:
    """Collects fp32-or-better row norms and float64 copies of short pieces (tails, and small
    tensors whole); combines them in float64 at the end."""

    def __init__(self, p: int, device: torch.device) -> None:
        self.p, self.device = p, device
        self.norms: list[Tensor] = []
        self.exact: list[Tensor] = []
        self.exact_elements = 0
        self.folded = torch.zeros((), dtype=torch.float64, device=device)

    def add(self, flat: Tensor) -> None:
        rows, tail = _split_rows(flat)
        if rows is not None:
            self.norms.append(torch.linalg.vector_norm(rows, ord=self.p, dim=1))
        if tail.numel():
            self.add_exact(tail)

    def add_exact(self, flat: Tensor, *, kept: bool = False) -> None:
        """Add ``flat`` in float64 throughout. ``kept``: it stays as it is until the sum (a
        caller's gradient); else it is copied now (a slice of a reused upcast buffer would be
        overwritten later)."""
        self.exact.append(flat if kept else flat.clone())
        self.exact_elements += flat.numel()
        if self.exact_elements >= UPCAST_BLOCK:  # bound the pieces kept: fold them in
            self.folded += self._power_sum(self.exact)
            self.exact, self.exact_elements = [], 0

    def _power_sum(self, pieces: list[Tensor]) -> Tensor:
        """The float64 sum of |x|^p over ``pieces``. Pieces of one dtype and device are joined
        before they are widened: one conversion for all of them, where one a piece made 20,000
        tensors of 512 elements cost 2.8x PyTorch's norm. ``torch.cat`` copies, so nothing is
        written into a piece."""
        same: dict[tuple[torch.dtype, torch.device], list[Tensor]] = {}
        for piece in pieces:
            same.setdefault((piece.dtype, piece.device), []).append(piece)
        total = torch.zeros((), dtype=torch.float64, device=self.device)
        for group in same.values():
            flat = torch.cat(group).to(self.device, torch.float64)
            total += flat.abs_().pow_(self.p).sum()
        return total

    def total(self) -> Tensor:
        total = self.folded.clone()
        for pieces in (self.norms, self.exact):
            if pieces:
                total += self._power_sum(pieces)
        return total


class _Upcaster:
    """Packs bf16/fp16 gradients back to back into one reused fp32 buffer that stays in cache.

    Rows may straddle tensors (the sum does not care), so small tensors share one norm call
    and leave no tails; only the final partial buffer has one. A full buffer goes to ``sink``
    (the native kernel's sum, or row norms).
    """

    def __init__(self, sink: Callable[[Tensor], None], device: torch.device) -> None:
        self.sink = sink
        self.buffer = torch.empty(UPCAST_BLOCK, dtype=torch.float32, device=device)
        self.used = 0

    def add(self, flat: Tensor) -> None:
        start = 0
        while start < flat.numel():
            take = min(flat.numel() - start, UPCAST_BLOCK - self.used)
            self.buffer[self.used : self.used + take].copy_(flat[start : start + take])
            self.used += take
            start += take
            if self.used == UPCAST_BLOCK:
                self.flush()

    def flush(self) -> None:
        if self.used:
            self.sink(self.buffer[: self.used])
            self.used = 0


def _rows_power_sum(grads: Sequence[Tensor], p: int, device: torch.device) -> Tensor:
    """Sum of |x|^p (p = 1 or 2) of gradients not all on CUDA, in float64.

    CPU fp32 and bf16 gradients go through the native kernel where it is built (fp16 through
    an fp32 buffer into it): every square or |x| enters a float64 sum exactly, so the sum is
    float64's to within its additions (see ``_fused.c``). Without the kernel, and for other
    devices, a tensor of at most ``EXACT_ELEMENTS`` elements is summed in float64 throughout,
    a larger one as fp32 norms of ``ROW``-element rows combined in float64.
    """
    rows = _RowNorms(p, device)
    upcasters: dict[torch.device, _Upcaster] = {}
    native_sum = [0.0]

    def to_native(buffer: Tensor) -> None:
        found = native.power_sum(buffer, p)
        if found is None:
            rows.add(buffer)
        else:
            native_sum[0] += found

    for grad, found in zip(grads, native.power_sums(grads, p), strict=True):
        if found is not None:
            native_sum[0] += found
            continue
        flat = grad.reshape(-1)
        if flat.numel() <= EXACT_ELEMENTS and flat.dtype != torch.float64:
            rows.add_exact(flat, kept=True)
            continue
        if flat.dtype in (torch.float32, torch.float64):
            rows.add(flat)
            continue
        upcaster = upcasters.get(flat.device)
        if upcaster is None:
            sink = to_native if flat.is_cpu else rows.add
            upcaster = upcasters[flat.device] = _Upcaster(sink, flat.device)
        upcaster.add(flat)
    for upcaster in upcasters.values():
        upcaster.flush()
    return rows.total() + native_sum[0]


def _foreach_power_sum(grads: Sequence[Tensor], p: int, device: torch.device) -> Tensor:
    """Sum of |x|^p (p = 1 or 2) from one fused fp32 norm per tensor (CUDA's multi-tensor
    kernel reduces each tensor as a tree of short fp32 partials), combined in float64."""
    total = torch.zeros((), dtype=torch.float64, device=device)
    for same in _by_dtype_and_device(grads):
        dtype = torch.float64 if same[0].dtype == torch.float64 else torch.float32
        big: list[Tensor] = []
        if same[0].is_cuda:
            # The multi-tensor kernel reads at ~3.4 TB/s on an H200, a plain reduction of one
            # large tensor at ~4.3: large tensors are worth a launch of their own.
            big = [grad for grad in same if grad.numel() >= CUDA_OWN_LAUNCH]
            if big:
                same = [grad for grad in same if grad.numel() < CUDA_OWN_LAUNCH]
        norms = [torch.linalg.vector_norm(grad, p, dtype=dtype) for grad in big]
        if same:
            norms += torch._foreach_norm(same, p, dtype=dtype)
        # One stack and one conversion per group: a conversion per tensor is a launch per
        # tensor, which cost more than the norms themselves (3.5x PyTorch's time on an H200).
        total += torch.stack(norms).to(device, torch.float64).pow_(p).sum()
    return total


def _fast_power_sum(grads: Sequence[Tensor], p: int, device: torch.device) -> Tensor:
    if grads and all(grad.is_cuda for grad in grads):
        # One launch for all tensors: per-tensor kernels would cost more than reading the data.
        _say_path("CUDA gradients: PyTorch's multi-tensor norm, partials added in float64")
        return _foreach_power_sum(grads, p, device)
    _say_path(
        "CPU gradients: float64 sums of the native kernel (without it: float64 for small "
        f"tensors, PyTorch norms of {ROW}-element rows for large ones), added in float64"
    )
    return _rows_power_sum(grads, p, device)


def _device_partials(grads: Sequence[Tensor], p: int) -> Tensor:
    """:func:`norm_partials` for CUDA gradients and p = 1 or 2, on their device, with no sync.

    Whether the sum is exact is decided on the device: a sum below the underflow guard, or an
    infinite one, is flagged for rescaling (zeroed), and the scaled path then tells an infinite
    or all-zero gradient from an overflow or underflow by max |x|. A NaN sum flags NaN.
    """
    return _partials_of(_foreach_power_sum(grads, p, grads[0].device))


def _partials_of(total: Tensor) -> Tensor:
    """[sum, rescale, 0, nan] from a device's float64 sum of |x|^p (see _device_partials)."""
    rescale = (total < UNDERFLOW_GUARD) | torch.isinf(total)
    kept = torch.where(rescale, torch.zeros_like(total), total)
    return torch.stack([kept, rescale.double(), torch.zeros_like(total), total.isnan().double()])


class CudaPlan:
    """The partials of one list of CUDA gradients as a CUDA graph, captured at the first call
    and replayed at the next ones: one launch, whatever the number of tensors.

    The graph reads the gradients' memory at the addresses they had when it was captured, as
    many elements of the dtype they had then, so it sees each step's new values; the caller
    makes sure the gradients still lie there (:attr:`layout`, from :func:`layout`, to compare
    with).
    """

    def __init__(self, grads: Sequence[Tensor]) -> None:
        self.layout = layout(grads)
        self.refs: list[weakref.ref[Tensor]] = []
        self.graph: torch.cuda.CUDAGraph | None = None
        self.out: Tensor | None = None
        # What the graph reads besides the gradients: it holds addresses, not references.
        self.tables: list[_triton.ChunkTable] = []
        self.failed = False

    def partials(self, grads: Sequence[Tensor], p: int) -> Tensor:
        """:func:`_device_partials` of ``grads`` (the list the plan was made for), replayed.

        The graph reads contiguous fp32/bf16/fp16 gradients through Triton chunk tables (one
        launch per dtype, see :mod:`gradstat.core._triton`) where Triton is present, the rest with
        PyTorch's multi-tensor kernel.
        """
        if self.failed or torch.cuda.is_current_stream_capturing():
            return _device_partials(grads, p)
        if self.graph is None:
            self._capture(grads, p)
            if self.graph is None:
                return _device_partials(grads, p)
        assert self.out is not None
        self.graph.replay()
        return self.out.clone()  # the caller may reduce it in place; the next replay rewrites

    def _capture(self, grads: Sequence[Tensor], p: int) -> None:
        device = grads[0].device
        graph = torch.cuda.CUDAGraph()
        try:
            side = torch.cuda.Stream(device)  # type: ignore[no-untyped-call]
            side.wait_stream(torch.cuda.current_stream(device))
            tables, rest = _chunk_tables(grads)

            def compute() -> Tensor:
                total = torch.zeros((), dtype=torch.float64, device=device)
                for table in tables:
                    total += table.power_sum(p)
                if rest:
                    total += _foreach_power_sum(rest, p, device)
                return _partials_of(total)

            # The capture records the current device's kernels: the gradients' device, made
            # current (their device need not be the current one).
            with torch.cuda.device(device):
                with torch.cuda.stream(side):
                    compute()  # warm-up: lazy initialisation and compilation outside the capture
                torch.cuda.current_stream(device).wait_stream(side)
                with torch.cuda.graph(graph):
                    out = compute()
        except Exception as error:  # a CUDA or Triton error: the eager way still works
            self.failed = True  # this list cannot be captured: launch it eagerly
            _log.info("CUDA graph: capture of %d gradients failed (%s); eager", len(grads), error)
            return
        self.graph, self.out, self.tables = graph, out, tables
        what = f"the L{p} partials of {len(grads)} gradients on {device}"
        _log.info("CUDA graph: captured %s (%d Triton tables)", what, len(tables))


_DTYPE = operator.attrgetter("dtype")


Layout = tuple[tuple[int, ...], tuple[int, ...], tuple[torch.dtype, ...]]


def layout(grads: Sequence[Tensor]) -> Layout:
    """Where each gradient's memory starts, its number of elements and its dtype: what a CUDA
    graph captured over the gradients reads. The same object may change any of them while
    keeping the others (``grad.data = grad.data[:n]`` keeps the address, a bf16 view of fp16
    memory keeps the address and size), so a replay is right only if all three are unchanged."""
    dtypes = tuple(map(_DTYPE, grads))
    return tuple(map(Tensor.data_ptr, grads)), tuple(map(Tensor.numel, grads)), dtypes


def _chunk_tables(grads: Sequence[Tensor]) -> tuple[list[_triton.ChunkTable], list[Tensor]]:
    """Triton chunk tables for the gradients it can read (one per dtype), and the others."""
    by_dtype: dict[torch.dtype, list[Tensor]] = {}
    rest = []
    for grad in grads:
        if _triton.usable(grad):
            by_dtype.setdefault(grad.dtype, []).append(grad)
        elif grad.numel():
            rest.append(grad)
    return [_triton.ChunkTable(same) for same in by_dtype.values()], rest


class _CudaPlans:
    """CUDA graphs of :func:`_device_partials`, replayed while a training loop passes the same
    gradients step after step.

    Launching the multi-tensor norm costs the host a few microseconds per tensor, as much as
    the GPU spends reading a thousand gradients. The second call with the same tensors (the same
    objects at the same addresses) captures the work into a graph, and later calls replay it
    with one launch; the graph reads the gradients' memory, so it sees each step's new values.
    A few lists are kept (a loop may take the norm of two), the oldest dropped first; a list
    with a gradient that is freed (a weak reference tells) is dropped at once. Set
    ``GRADSTAT_CUDA_GRAPHS=0`` to launch eagerly every time.
    """

    KEPT = 4

    def __init__(self) -> None:
        self.plans: dict[tuple[int, ...], CudaPlan] = {}

    @staticmethod
    def enabled() -> bool:
        return os.environ.get("GRADSTAT_CUDA_GRAPHS", "1") != "0"

    def replay(self, grads: Sequence[Tensor], p: int) -> Tensor | None:
        """The partials from the graph of these gradients; None if they were not seen before
        (then :meth:`launch` them)."""
        if not self.plans:
            return None
        plan = self.plans.get((p, *map(id, grads)))
        if plan is None or not self.enabled():
            return None
        if layout(grads) != plan.layout:
            return None  # a gradient was swapped, resized or viewed anew (``.data =``, ``set_``)
        return plan.partials(grads, p)

    def launch(self, grads: Sequence[Tensor], p: int) -> Tensor:
        """The partials, launched eagerly; remembered so that the next call with the same
        gradients captures a graph. ``grads``: non-empty, all on one CUDA device."""
        if self.enabled():
            key = (p, *map(id, grads))
            plan = CudaPlan(grads)
            # The key holds ids: a gradient freed (and its id reused) must drop it first.
            drop = self._dropper(key)
            plan.refs = [weakref.ref(grad, drop) for grad in grads]
            self.plans.pop(key, None)
            self.plans[key] = plan
            while len(self.plans) > self.KEPT:
                self.plans.pop(next(iter(self.plans)))
        return _device_partials(grads, p)

    def _dropper(self, key: tuple[int, ...]) -> Callable[[weakref.ref[Tensor]], None]:
        def drop(_ref: weakref.ref[Tensor]) -> None:
            self.forget(key)

        return drop

    def forget(self, key: tuple[int, ...] | None = None) -> None:
        """Drop the plan of ``key``, or every plan."""
        if key is None:
            self.plans.clear()
        else:
            self.plans.pop(key, None)


_CUDA_PLANS = _CudaPlans()


def _float64_blocks(grads: Sequence[Tensor]) -> Iterator[Tensor]:
    """|x| of every gradient in float64, a block at a time, always in a new tensor.

    ``.to(torch.float64)`` returns a float64 gradient itself, and the callers work in place:
    without the copy they would overwrite the caller's gradient, or fault on a read-only
    memory-mapped snapshot.
    """
    for grad in grads:
        flat = grad.reshape(-1)
        for start in range(0, flat.numel(), UPCAST_BLOCK):
            yield flat[start : start + UPCAST_BLOCK].to(torch.float64, copy=True).abs_()


def _exact_power_sum(grads: Sequence[Tensor], p: float, device: torch.device) -> Tensor:
    """Sum of |x|^p computed entirely in float64, a block at a time (slow, exact)."""
    total = torch.zeros((), dtype=torch.float64, device=device)
    for block in _float64_blocks(grads):
        total += block.pow_(p).sum().to(device)
    return total


def scaled_power_sum(
    grads: Sequence[Tensor], p: float, device: torch.device, scale: float
) -> Tensor:
    """Sum of (|x| / scale)^p in float64, as a 0-dim tensor on ``device``.

    With ``scale`` = max |x| every term lies in [0, 1] and the sum in [1, elements]: it fits in
    float64 whatever the magnitudes and p, where the sum of |x|^p may not.
    """
    check_dtypes(grads)
    total = torch.zeros((), dtype=torch.float64, device=device)
    for block in _float64_blocks(grads):
        total += block.div_(scale).pow_(p).sum().to(device)
    return total


class _Sum(enum.Enum):
    """What a plain float64 sum of |x|^p is worth."""

    EXACT = "exact"  # sum |x|^p to float64 accuracy (ordinary values)
    SCALE = "scale"  # under- or overflowed although every element is finite
    INF = "inf"  # an element is infinite
    NAN = "nan"  # an element is NaN


def _checked_power_sum(
    grads: Sequence[Tensor], p: float, device: torch.device
) -> tuple[Tensor, _Sum]:
    """Sum of |x|^p, and whether it is exact or must be recomputed scaled by max |x|.

    Ordinary values cost one pass (fp32 rows for p = 1 and 2, float64 otherwise). A sum that
    sank towards subnormals or overflowed is recomputed in float64, and max |x| tells a sum
    that is truly 0 or inf from one that under- or overflowed.
    """
    peak: float | None = None

    def largest() -> float:
        nonlocal peak
        if peak is None:
            peak = float(abs_max(grads, device))
        return peak

    if p in (1, 2):
        total = _fast_power_sum(grads, int(p), device)
        value = float(total)
        if UNDERFLOW_GUARD <= value < math.inf:
            return total, _Sum.EXACT
        if math.isnan(value):
            return total, _Sum.NAN
        if value == 0.0 and largest() == 0.0:
            return total, _Sum.EXACT
    total = _exact_power_sum(grads, p, device)
    value = float(total)
    if math.isnan(value):
        return total, _Sum.NAN
    if FLOAT64_GUARD <= value < math.inf or largest() == 0.0:
        return total, _Sum.EXACT
    return total, _Sum.INF if math.isinf(largest()) else _Sum.SCALE


def norm_partials(grads: Sequence[Tensor], p: float, device: torch.device) -> Tensor:
    """What one rank adds to the others' for a finite p-norm: four float64 numbers.

    [sum |x|^p (0 when out of range), 1 if it under- or overflowed (or p < 1), 1 if an element
    is infinite, 1 if one is NaN].
    """
    if p in (1, 2) and device.type == "cuda" and grads:
        planned = _CUDA_PLANS.replay(grads, int(p))
        if planned is not None:
            return planned  # the same gradients as last time: checked then
        index = torch.cuda.current_device() if device.index is None else device.index
        if {grad.get_device() for grad in grads} == {index}:
            check_dtypes(grads)
            return _CUDA_PLANS.launch(grads, int(p))
    check_dtypes(grads)
    if p < 1:
        # The plain root multiplies the sum's rounding error by 1/p (0.5^1e-300 rounds to 1.0,
        # whose 1e300-th power is 1.0, not 0.5): always scale. max |x| finds the non-finite
        # elements.
        peak = float(abs_max(grads, device))
        flags = [0.0, 1.0, float(math.isinf(peak)), float(math.isnan(peak))]
        return torch.tensor(flags, dtype=torch.float64, device=device)
    total, kind = _checked_power_sum(grads, p, device)
    if kind is _Sum.SCALE:
        total = torch.zeros((), dtype=torch.float64, device=device)
    flags = [float(kind is _Sum.SCALE), float(kind is _Sum.INF), float(kind is _Sum.NAN)]
    rest = torch.tensor(flags, dtype=torch.float64, device=device)
    return torch.cat([total.reshape(1).to(device), rest])


def _scaled_root(scale: float, scaled_sum: float, p: float) -> float:
    """scale * scaled_sum^(1/p) for scaled_sum >= 1; inf where that exceeds float64."""
    try:
        return scale * (math.sqrt(scaled_sum) if p == 2 else scaled_sum ** (1.0 / p))
    except OverflowError:
        pass  # the root alone overflowed (a tiny p); times a tiny scale it may not
    try:
        return math.exp(math.log(scale) + math.log(scaled_sum) / p)
    except OverflowError:
        return math.inf


def reduced_norm(p: float, reduce: StatReduce, partials: StatCompute | None = None) -> float:
    """The p-norm of gradients spread over ranks, exact at any magnitude and for any p > 0.

    ``reduce(compute, op)`` runs ``compute(tensors, device)`` on each rank's own gradients and
    reduces the results over the ranks with ``op``; on one device it is just the call. The inf
    norm is one MAX reduction of max |x|. A finite p is one SUM reduction of four numbers: the
    sum of |x|^p and three counts (ranks whose sum under- or overflowed, ranks with an infinite
    element, with a NaN). Ordinary values stop there and take the p-th root of the sum, the
    torchtitan way. Only when a rank's sum left float64's range, the ranks' total overflowed,
    or p < 1, do two more reductions follow: the MAX of |x|, then the SUM of (|x| / max)^p,
    whose root times the max is the norm. The way taken depends on reduced numbers alone, so
    every rank takes the same one.

    Args:
        p: ``math.inf`` or a finite p > 0 (the caller checked it).
        reduce: computes a statistic on every rank and reduces it over the ranks (SUM or MAX),
            the same on every rank.
        partials: computes the four numbers of a rank (default: from its tensors, see
            :func:`norm_partials`); a prepared plan passes its own.

    Returns:
        The norm: NaN if an element is NaN, else inf if one is infinite, or if the norm itself
        exceeds float64 (a tiny p: the 0.001-norm of two equal elements is 2^1000 times them).
    """
    if p == math.inf:
        peak, nan = reduce(_peak_and_nan, dist.ReduceOp.MAX).tolist()
        return math.nan if nan else peak

    def default_partials(tensors: list[Tensor], device: torch.device) -> Tensor:
        return norm_partials(tensors, p, device)

    first = reduce(partials or default_partials, dist.ReduceOp.SUM)
    total, scale, infinite, nan = first.tolist()
    if nan:
        return math.nan
    if infinite:
        return math.inf
    if not scale and math.isfinite(total):
        return math.sqrt(total) if p == 2 else float(total ** (1.0 / p))
    peak = float(reduce(abs_max, dist.ReduceOp.MAX))
    if peak == 0.0 or not math.isfinite(peak):
        return peak  # all zero, or (the device flags a sum, not an element) inf or NaN

    def scaled(tensors: list[Tensor], device: torch.device) -> Tensor:
        return scaled_power_sum(tensors, p, device, peak)

    return _scaled_root(peak, float(reduce(scaled, dist.ReduceOp.SUM)), p)


def norm(grads: Sequence[Tensor], p: float, device: torch.device) -> float:
    """The p-norm (``math.inf`` or any finite p > 0) of ``grads`` on one device.

    :func:`reduced_norm` with nothing to reduce over: exact at any magnitude and for any p.

    Raises:
        GradDtypeError: a gradient of a dtype other than fp32, bf16, fp16 or fp64.
    """
    tensors = list(grads)

    def here(compute: StatCompute, op: dist.ReduceOp.RedOpType) -> Tensor:
        return compute(tensors, device)

    return reduced_norm(p, here)


def add_norms(first: float, second: float, p: float) -> float:
    """The p-norm of two disjoint sets of elements from their p-norms: (a^p + b^p)^(1/p).

    a^p is never formed, so any two norms that fit in float64 combine, whatever p. NaN if
    either is NaN (as a sum of p-th powers would be), else inf if either is infinite.
    """
    if math.isnan(first) or math.isnan(second):
        return math.nan
    big, small = max(first, second), min(first, second)
    if small == 0.0 or big == math.inf or p == math.inf:
        return big
    if p == 1:
        return big + small
    if p == 2:
        return math.hypot(big, small)
    growth = math.log1p((small / big) ** p) / p  # log(norm / big), in (0, log(2) / p]
    try:
        return big * math.exp(growth)
    except OverflowError:
        pass  # the ratio alone overflowed (a tiny p); times a tiny norm it may not
    try:
        return math.exp(math.log(big) + growth)
    except OverflowError:
        return math.inf


def combine_norms(norms: Iterable[float], p: float) -> float:
    """The p-norm of disjoint sets of elements from their p-norms (see :func:`add_norms`)."""
    values = list(norms)
    if any(math.isnan(value) for value in values):
        return math.nan
    if p == 2:
        return math.hypot(*values)
    return functools.reduce(functools.partial(add_norms, p=p), values, 0.0)


def abs_max(grads: Sequence[Tensor], device: torch.device) -> Tensor:
    """max |x| over all gradients as a 0-dim float64 tensor (NaN if any element is NaN).

    One aminmax pass per tensor: PyTorch's CPU inf-norm (abs, then max) is several times slower.
    """
    check_dtypes(grads)
    if grads and all(grad.is_cuda for grad in grads):
        # One multi-tensor launch (its max propagates NaN): a launch or four per tensor made
        # the inf norm of a thousand CUDA tensors 12x slower than PyTorch's.
        peaks = [
            torch.stack(torch._foreach_norm(same, math.inf)).max().to(device, torch.float64)
            for same in _by_dtype_and_device(grads)
        ]
    else:
        peaks = [_abs_max_one(grad, device) for grad in grads if grad.numel()]
    if not peaks:
        return torch.zeros((), dtype=torch.float64, device=device)
    return torch.stack(peaks).max()


def _peak_and_nan(grads: Sequence[Tensor], device: torch.device) -> Tensor:
    """[max |x| (0 where an element is NaN), 1 if an element is NaN]: a MAX reduction over
    ranks keeps both, where it need not keep a NaN itself (gloo's MAX drops it: a NaN on one
    rank gave the others' finite max as the inf-norm)."""
    peak = abs_max(grads, device)
    nan = torch.isnan(peak)
    return torch.stack([torch.where(nan, torch.zeros_like(peak), peak), nan.double()])


def _abs_max_one(grad: Tensor, device: torch.device) -> Tensor:
    low, high = torch.aminmax(grad.reshape(-1))
    # abs: of -0.0 and 0.0, maximum keeps its first argument (all -0.0 gave a norm of -0.0).
    return torch.maximum(high, -low).abs().to(device=device, dtype=torch.float64)


def _by_dtype_and_device(grads: Sequence[Tensor]) -> list[list[Tensor]]:
    """The non-empty gradients grouped by dtype and device (a multi-tensor kernel's needs)."""
    if len({grad.dtype for grad in grads}) == 1 and len({grad.get_device() for grad in grads}) == 1:
        # The usual case, in two set comprehensions: a per-tensor dict costs twice as much.
        same = [grad for grad in grads if grad.numel()]
        return [same] if same else []
    groups: dict[tuple[torch.dtype, torch.device], list[Tensor]] = {}
    for grad in grads:
        if grad.numel():
            groups.setdefault((grad.dtype, grad.device), []).append(grad)
    return list(groups.values())


def nonzero_count(grads: Sequence[Tensor], device: torch.device) -> Tensor:
    """Number of elements that are not zero (-0.0 is zero, NaN is not) as a 0-dim int64 tensor.

    CPU fp32 tensors go through the native one-pass kernel where it is built: PyTorch's
    ``count_nonzero`` costs about twice a summing pass.
    """
    counts = []
    for grad in grads:
        if not grad.numel():
            continue
        fused = native.fused_f32(grad)
        if fused is None:
            counts.append(torch.count_nonzero(grad).to(device))
        else:
            nonzero = grad.numel() - fused.zeros
            counts.append(torch.tensor(nonzero, dtype=torch.int64, device=device))
    if not counts:
        return torch.zeros((), dtype=torch.int64, device=device)
    return torch.stack(counts).sum()


class TensorStats(NamedTuple):
    """One tensor's statistics (see :func:`tensor_stats`); a tuple, made per tensor."""

    norms: tuple[float, ...]  # one per finite p asked, in the order asked
    max_abs: float | None  # NaN when the tensor holds one; None when not asked
    zeros: int | None  # elements equal to zero (-0.0 too); None when not asked


def one_pass_serves(finite: Sequence[float], with_inf: bool, zeros: bool) -> bool:
    """Whether the native kernel's one pass gives some of what is asked (L1, L2, inf or
    zeros)."""
    return zeros or with_inf or 2.0 in finite or 1.0 in finite


def bits(tensor: Tensor) -> Tensor:
    """The tensor's elements as integers of their width: equal where the bits are, NaN payloads
    included (``torch.equal`` finds a NaN unequal to itself); a complex tensor's parts, as its
    real view."""
    if tensor.is_complex():
        tensor = torch.view_as_real(tensor.resolve_conj())
    width = {8: torch.int64, 4: torch.int32, 2: torch.int16, 1: torch.int8}[tensor.element_size()]
    return tensor.view(width)


def magnitudes(grad: Tensor) -> Tensor:
    """|z| of a complex tensor's elements in float64 (to float64's rounding), as PyTorch's norms
    take a complex tensor: an element is zero when both its parts are, NaN when either is and
    neither is infinite."""
    return grad.detach().to(torch.complex128).abs()


def tensor_stats(
    grad: Tensor,
    finite: Sequence[float],
    with_inf: bool,
    zeros: bool,
    device: torch.device,
    fused: native.FusedStats | None = None,
) -> TensorStats:
    """The p-norms of one tensor for each p in ``finite``, its max |x| when ``with_inf``, and
    its zero count when ``zeros``, each as exact as :func:`norm` makes a norm.

    A CPU fp32 tensor gives its sums of squares and of |x|, max |x|, NaN flag and zero count in
    one pass of the native kernel where it is built; its L2 norm is the root of the first sum,
    its L1 norm the second, as :func:`norm` would take them (which recomputes a sum out of the
    ordinary range). ``fused``: that pass, when the caller made it already
    (:func:`native.fused_many_f32`). A complex tensor's statistics are those of its
    magnitudes (:func:`magnitudes`).
    """
    if grad.is_complex():
        grad, fused = magnitudes(grad), None
    if fused is None and one_pass_serves(finite, with_inf, zeros):
        fused = native.fused_f32(grad)
    if fused is not None:
        found = fused_stats(fused, finite, with_inf, zeros)
        if found is not None:
            return found

    def one_norm(p: float) -> float:
        value = None if fused is None else fused_norm(fused, p)
        return norm([grad], p, device) if value is None else value

    max_abs = None
    if with_inf:
        if fused is None:
            max_abs = float(abs_max([grad], device))
        else:
            max_abs = math.nan if fused.has_nan else fused.max_abs
    found_zeros = None
    if zeros:
        found_zeros = (
            fused.zeros if fused is not None else grad.numel() - int(nonzero_count([grad], device))
        )
    return TensorStats(tuple(one_norm(p) for p in finite), max_abs, found_zeros)


def fused_norm(fused: native.FusedStats, p: float) -> float | None:
    """The p-norm that the native pass gives for p = 1 or 2, as :func:`norm` would take it;
    None for another p, or where :func:`norm` recomputes (a sum out of the ordinary range)."""
    if p not in (1, 2):
        return None
    if fused.max_abs == 0.0 and not fused.has_nan:
        return 0.0
    total = fused.sum_squares if p == 2 else fused.sum_abs
    if UNDERFLOW_GUARD <= total < math.inf:
        return math.sqrt(total) if p == 2 else total
    return None


def fused_stats(
    fused: native.FusedStats, finite: Sequence[float], with_inf: bool, zeros: bool
) -> TensorStats | None:
    """:func:`tensor_stats` from the native pass alone, no tensor needed; None where a norm
    needs the tensor (see :func:`fused_norm`)."""
    norms = []
    for p in finite:
        value = fused_norm(fused, p)
        if value is None:
            return None
        norms.append(value)
    max_abs = (math.nan if fused.has_nan else fused.max_abs) if with_inf else None
    return TensorStats(tuple(norms), max_abs, fused.zeros if zeros else None)

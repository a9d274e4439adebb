"""gradstat's native kernel: sums of squares and of |x|, zero count, max |x| and NaN in one pass
over an fp32 or bf16 tensor, summed in float64 (each element's square and |x| exact); and the
guard of mapped files (:func:`guard_map`).

PyTorch has no fused reduction for these, and its ``count_nonzero`` alone costs twice a sum.
The C source ships with gradstat and is compiled on first use with the machine's C compiler
(``$CC``, else ``cc``; -O3 -march=native -fopenmp, about 0.3 s), into a cache keyed by the
source, the flags and the CPU's feature flags (``$GRADSTAT_CACHE``, else ``~/.cache/gradstat``).
Without a compiler, or where the library does not build or load, :func:`fused` is None and
gradstat uses PyTorch operations (about 3x slower for a snapshot's statistics), said once per
process as a :class:`~gradstat.errors.NativeKernelWarning`; ``GRADSTAT_NATIVE=0`` turns the
kernel off without a word.

Why at first use, for this machine, rather than at install time or with runtime CPU dispatch:
gradstat installs as a pure-Python wheel, so one wheel serves every platform and an install
needs no compiler; a kernel built at install time would make the wheel platform-specific, and
one built on a build machine could not use the CPU it runs on. Runtime dispatch
(``target_clones`` for AVX2, AVX-512 and so on) exists to ship one binary to many CPUs, which
gradstat does not do: the compile already runs on the CPU that will run the kernel, so
``-march=native`` gives its best code with no dispatch code to keep. The cache key includes the
CPU's flags because one cache may be shared by different CPUs (an NFS home on a cluster), and
the library is renamed into place whole, so concurrent first uses (torchrun's processes) never
load half a file. Megatron's own fused kernels were built the same way, on the machine at start-up
(``torch.utils.cpp_extension.load``).
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
import time
import warnings
from array import array
from collections.abc import Sequence
from ctypes import c_double, c_int32, c_int64
from functools import cache
from pathlib import Path
from typing import Any, NamedTuple

import torch

from gradstat.errors import NativeKernelWarning

__all__ = [
    "FusedStats",
    "fused",
    "fused_f32",
    "fused_many_at",
    "fused_many_f32",
    "guard_map",
    "guard_release",
    "native_kernel",
    "native_library",
    "power_sum",
    "power_sums",
]

_SOURCE = Path(__file__).with_name("_fused.c")
_FLAGS = ("-O3", "-march=native", "-fopenmp", "-shared", "-fPIC")

_log = logging.getLogger(__name__)


class FusedStats(NamedTuple):
    """What one pass over an fp32 tensor gives (a tuple: a rank file's small tensors each make
    one, at a cost that shows against their pass)."""

    sum_squares: float
    sum_abs: float
    zeros: int
    max_abs: float  # NaN ignored
    has_nan: bool


def _cpu_signature() -> str:
    """What -march=native depends on: a library built for one CPU may not run on another that
    shares the cache (an NFS home on a cluster)."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return platform.processor()
    return next((line for line in lines if line.startswith(("flags", "Features"))), "")


def _cache_dir() -> Path:
    configured = os.environ.get("GRADSTAT_CACHE")
    return Path(configured) if configured else Path.home() / ".cache" / "gradstat"


def _build(compiler: str, target: Path) -> None:
    """Compile the library into ``target``.

    Raises:
        OSError: the cache directory or the library cannot be written.
        subprocess.SubprocessError: the compiler failed or took over two minutes.
    """
    target.parent.mkdir(parents=True, exist_ok=True)
    handle, temporary = tempfile.mkstemp(suffix=".so", dir=target.parent)
    os.close(handle)
    try:
        subprocess.run(
            [compiler, *_FLAGS, "-o", temporary, str(_SOURCE), "-lm"],
            check=True,
            capture_output=True,
            timeout=120,
        )
        os.replace(temporary, target)  # concurrent builders each rename a whole library
    finally:
        if os.path.exists(temporary):
            os.unlink(temporary)


def _load(target: Path) -> Any:
    """Load the library; its OpenMP runtime reads OMP_WAIT_POLICY once, as it loads.

    Passive: between calls its threads sleep instead of spinning on the cores that PyTorch's
    own OpenMP threads need (measured: bf16 norms right after a zero count ran up to 1.3x
    slower with spinning threads). libgomp takes the policy from its environment alone (no call
    sets it), so the variable is set around this one load and removed again. Changing the
    environment races with a getenv in another thread, so this happens at most once per process,
    at the kernel's first use, never at import; an OMP_WAIT_POLICY the user set is left alone,
    and then nothing is changed at all.
    """
    previous = os.environ.get("OMP_WAIT_POLICY")
    if previous is None:
        os.environ["OMP_WAIT_POLICY"] = "PASSIVE"
    try:
        return ctypes.CDLL(str(target))
    finally:
        if previous is None:
            del os.environ["OMP_WAIT_POLICY"]


class _Unavailable(Exception):
    """Why the library cannot be had; the message completes "the native C kernel ..."."""


def _last_line(error: subprocess.SubprocessError) -> str:
    output = getattr(error, "stderr", None) or b""
    lines = [line for line in output.decode(errors="replace").splitlines() if line.strip()]
    return lines[-1].strip() if lines else str(error)


def _compiled() -> Any:
    """Build (unless cached) and load the library.

    Raises:
        _Unavailable: it cannot be built or loaded, saying why.
    """
    if not _SOURCE.exists():
        raise _Unavailable(f"has no source ({_SOURCE} is missing)")
    compiler = os.environ.get("CC") or "cc"
    if shutil.which(compiler) is None:
        raise _Unavailable(f"cannot be built: no C compiler {compiler!r} (set CC)")
    source = _SOURCE.read_bytes()
    identity = " ".join((compiler, *_FLAGS, _cpu_signature())).encode()
    key = hashlib.sha256(source + identity).hexdigest()[:16]
    target = _cache_dir() / f"fused-{platform.machine()}-{key}.so"
    if target.exists():
        _log.info("native C kernel: %s (cached)", target)
    else:
        _log.info(
            "native C kernel: compiling %s with %s %s", _SOURCE.name, compiler, " ".join(_FLAGS)
        )
        started = time.perf_counter()
        try:
            _build(compiler, target)
        except subprocess.SubprocessError as error:
            raise _Unavailable(f"did not build ({compiler}: {_last_line(error)})") from error
        except OSError as error:
            raise _Unavailable(f"did not build ({error})") from error
        _log.info("native C kernel: %s, built in %.1f s", target, time.perf_counter() - started)
    try:
        return _load(target)
    except OSError as error:
        raise _Unavailable(f"did not load ({error})") from error


@cache
def native_library() -> Any:
    """The compiled library, or None where it is turned off or cannot be built or loaded.

    The fallback to PyTorch operations is said once per process, as a NativeKernelWarning,
    unless ``GRADSTAT_NATIVE=0`` asked for it.
    """
    if os.environ.get("GRADSTAT_NATIVE", "1") == "0":
        _log.info("native C kernel: off (GRADSTAT_NATIVE=0); PyTorch operations instead")
        return None
    try:
        library = _compiled()
    except _Unavailable as why:
        warnings.warn(
            f"gradstat's native C kernel {why}; using PyTorch operations, about 3x slower "
            "(GRADSTAT_NATIVE=0 silences this)",
            NativeKernelWarning,
            stacklevel=1,  # no caller of this cached function is more telling than this line
        )
        _log.debug("native C kernel: unavailable", exc_info=why.__cause__)
        return None
    # Where the statistics go: sums of squares and of |x|, zero counts, max |x|, NaN flags.
    kinds = (c_double, c_double, c_int64, ctypes.c_float, c_int32)
    outputs = [ctypes.POINTER(kind) for kind in kinds]
    total = ctypes.POINTER(c_double)
    # The many-tensor calls take addresses of ``array`` buffers (see ``_arrays``): ctypes
    # converts a plain address faster than a typed pointer, and a call per small file shows it.
    address = ctypes.c_void_p
    for dtype_name in _ENTRY_POINTS.values():
        signatures = {
            f"fused_{dtype_name}": [ctypes.c_void_p, c_int64, c_int32, *outputs],
            f"fused_many_{dtype_name}": [address, address, c_int32, c_int32, *[address] * 5],
        }
        for term in ("squares", "abs"):
            signatures[f"sum_{term}_{dtype_name}"] = [ctypes.c_void_p, c_int64, c_int32, total]
            signatures[f"sum_many_{term}_{dtype_name}"] = [
                address,
                address,
                c_int32,
                c_int32,
                address,
            ]
        for name, argtypes in signatures.items():
            function = getattr(library, f"gradstat_{name}")
            function.argtypes, function.restype = argtypes, c_int32
    library.gradstat_guard_map.argtypes = [ctypes.c_void_p, c_int64]
    library.gradstat_guard_release.argtypes = [c_int32]
    library.gradstat_guard_map.restype = library.gradstat_guard_release.restype = c_int32
    return library


def native_kernel() -> Any:
    """The compiled fp32 kernel's C function, or None where it cannot be built or loaded."""
    library = native_library()
    return None if library is None else library.gradstat_fused_f32


_F32 = torch.float32

# The element types the kernel reads, and the suffix of their entry points.
_ENTRY_POINTS = {torch.float32: "f32", torch.bfloat16: "bf16"}


@cache
def _entry_point(name: str) -> Any:
    """The library's ``gradstat_<name>`` ("fused_f32", "sum_squares_bf16", ...), or None."""
    library = native_library()
    return None if library is None else getattr(library, f"gradstat_{name}")


@cache
def _say_used(dtype_name: str) -> None:
    _log.info("native C kernel: one pass over %s CPU gradients", dtype_name)


def fused(grad: torch.Tensor) -> FusedStats | None:
    """One pass over a CPU fp32 or bf16 tensor (bf16 widened to fp32 in registers); None when
    the kernel is unavailable or does not apply."""
    dtype_name = _ENTRY_POINTS.get(grad.dtype)
    if grad.device.type != "cpu" or dtype_name is None:
        return None
    function = _entry_point(f"fused_{dtype_name}")
    if function is None:
        return None
    flat = grad.contiguous()
    sum_squares, sum_abs, zeros = ctypes.c_double(), ctypes.c_double(), ctypes.c_int64()
    max_abs, has_nan = ctypes.c_float(), ctypes.c_int32()
    status = function(
        flat.data_ptr(),
        flat.numel(),
        torch.get_num_threads(),
        ctypes.byref(sum_squares),
        ctypes.byref(sum_abs),
        ctypes.byref(zeros),
        ctypes.byref(max_abs),
        ctypes.byref(has_nan),
    )
    if status != 0:
        return None  # out of memory for the per-chunk sums: let PyTorch do it
    _say_used(dtype_name)
    stats = (sum_squares.value, sum_abs.value, zeros.value, max_abs.value, bool(has_nan.value))
    return FusedStats(*stats)


def power_sum(grad: torch.Tensor, p: int) -> float | None:
    """The sum of |x|^p (p = 1 or 2) over a CPU fp32 or bf16 tensor, alone: the bits of
    :func:`fused`'s ``sum_abs`` or ``sum_squares`` in less time (a norm needs nothing else).
    None when the kernel is unavailable or does not apply."""
    return power_sums([grad], p)[0]


def power_sums(grads: Sequence[torch.Tensor], p: int) -> list[float | None]:
    """:func:`power_sum` of each of ``grads``, those of each element type in a single call (a
    call from Python costs more than the pass over a small tensor)."""
    found: list[float | None] = [None] * len(grads)
    if p not in (1, 2):
        return found
    term = "squares" if p == 2 else "abs"
    for dtype, dtype_name in _ENTRY_POINTS.items():
        chosen = [index for index, grad in enumerate(grads) if grad.is_cpu and grad.dtype == dtype]
        function = _entry_point(f"sum_many_{term}_{dtype_name}") if chosen else None
        if function is None:
            continue
        flats = [grads[index].contiguous() for index in chosen]  # alive through the call
        pointers, sizes = _arrays(flats)
        sums = _zeroed("d", len(chosen))
        threads = torch.get_num_threads()
        if function(*map(address_of, (pointers, sizes)), len(chosen), threads, address_of(sums)):
            continue  # out of memory for the per-chunk sums: let PyTorch do it
        _say_used(dtype_name)
        for index, total in zip(chosen, sums, strict=True):
            found[index] = total
    return found


def address_of(buffer: array[Any]) -> int:
    """The address of an ``array``'s items (valid while it lives and is not resized)."""
    return buffer.buffer_info()[0]


def _arrays(flats: Sequence[torch.Tensor]) -> tuple[array[int], array[int]]:
    """The data pointers and the element counts of contiguous tensors, as C arrays."""
    pointers, sizes = array("q"), array("q")
    for flat in flats:
        pointers.append(flat.data_ptr())
        sizes.append(flat.numel())
    return pointers, sizes


def _zeroed(code: str, count: int) -> array[Any]:
    """An array of ``count`` zero items of type ``code``."""
    return array(code, bytes(count * _ITEM_BYTES[code]))


_ITEM_BYTES = {code: array(code).itemsize for code in "dqfi"}


def fused_f32(grad: torch.Tensor) -> FusedStats | None:
    """:func:`fused` for fp32 tensors only (the snapshot reader's and the zero count's path)."""
    return fused(grad) if grad.dtype == torch.float32 else None


# The array type codes of FusedStats' fields, as the C kernel writes them.
_FUSED_CODES = ("d", "d", "q", "f", "i")


def fused_many_f32(grads: Sequence[torch.Tensor]) -> list[FusedStats | None]:
    """:func:`fused_f32` of each of ``grads``, the CPU fp32 ones in a single call.

    A rank file's tensors are often small, and a call from Python costs more than a pass over a
    few thousand elements: 4 tensors of 16 elements took 21 us as a call each and 14 us as one
    call, 16 of them 83 against 33 us. The statistics are the bits one call per tensor gives.
    """
    found: list[FusedStats | None] = [None] * len(grads)
    chosen = [index for index, grad in enumerate(grads) if grad.is_cpu and grad.dtype == _F32]
    if not chosen:
        return found
    flats = [grads[index].contiguous() for index in chosen]  # alive through the call
    passes = fused_many_at(*_arrays(flats))
    if passes is None:
        return found
    for index, stats in zip(chosen, passes, strict=True):
        found[index] = stats
    return found


def fused_many_at(pointers: array[int], sizes: array[int]) -> list[FusedStats] | None:
    """:func:`fused_f32` of each array of ``sizes[i]`` fp32 values at address ``pointers[i]``
    (``array("q")`` both), in a single call; None when the kernel is unavailable.

    For bytes that no tensor views: a small rank file read whole holds its tensors' values, and
    a tensor costs more to make than their pass (see :func:`gradstat.analysis.stats.file_pieces`).
    The caller keeps the memory alive and unchanged through the call.
    """
    function = _entry_point("fused_many_f32")
    if function is None:
        return None
    count = len(pointers)
    outputs = [_zeroed(code, count) for code in _FUSED_CODES]
    status = function(
        address_of(pointers),
        address_of(sizes),
        count,
        torch.get_num_threads(),
        *map(address_of, outputs),
    )
    if status != 0:
        return None  # out of memory for the per-chunk sums: let PyTorch do it
    _say_used("f32")
    sums, sums_abs, zeros, peaks, nans = outputs
    results = zip(sums, sums_abs, zeros, peaks, map(bool, nans), strict=True)
    return list(map(FusedStats._make, results))


def guard_map(address: int, length: int) -> int | None:
    """Guard the map of ``length`` bytes at ``address`` against a truncation of its file.

    While it is guarded, a touch of a page the truncation cut off (by this kernel, a PyTorch
    operation or a copy) reads zeros instead of killing the process with SIGBUS, and
    :func:`guard_release` tells it happened, so that the caller discards what it computed.

    Returns:
        The guard to release, or None where the library is unavailable or every guard is taken
        (the map is then unguarded).
    """
    library = native_library()
    if library is None:
        return None
    guard = int(library.gradstat_guard_map(address, length))
    return None if guard < 0 else guard


def guard_release(guard: int) -> bool:
    """Release a guard of :func:`guard_map`; whether a page of its map faulted meanwhile."""
    library = native_library()
    assert library is not None, "a guard is only handed out by the library"
    return bool(library.gradstat_guard_release(guard))

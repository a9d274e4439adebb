"""gradstat's native kernel: sum of squares, zero count, max |x| and NaN in one pass over an
fp32 or bf16 tensor.

PyTorch has no fused reduction for these, and its ``count_nonzero`` alone costs twice a sum.
The C source ships with gradstat and is compiled on first use with the machine's C compiler
(``$CC``, else ``cc``; -O3 -march=native -fopenmp), into a cache keyed by the source and flags
(``$GRADSTAT_CACHE``, else ``~/.cache/gradstat``). Without a compiler, or with
``GRADSTAT_NATIVE=0``, :func:`fused_f32` is None and gradstat uses PyTorch operations.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Any

import torch

__all__ = ["FusedStats", "fused", "fused_f32", "native_kernel", "native_library"]

_SOURCE = Path(__file__).with_name("_fused.c")
_FLAGS = ("-O3", "-march=native", "-fopenmp", "-shared", "-fPIC")


@dataclass(frozen=True)
class FusedStats:
    """What one pass over an fp32 tensor gives."""

    sum_squares: float
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
    slower with spinning threads). The user's own setting wins; the variable is restored.
    """
    previous = os.environ.get("OMP_WAIT_POLICY")
    if previous is None:
        os.environ["OMP_WAIT_POLICY"] = "PASSIVE"
    try:
        return ctypes.CDLL(str(target))
    finally:
        if previous is None:
            del os.environ["OMP_WAIT_POLICY"]


@cache
def native_library() -> Any:
    """The compiled library, or None where it cannot be built or loaded."""
    if os.environ.get("GRADSTAT_NATIVE", "1") == "0" or not _SOURCE.exists():
        return None
    compiler = os.environ.get("CC") or "cc"
    if shutil.which(compiler) is None:
        return None
    source = _SOURCE.read_bytes()
    identity = " ".join((compiler, *_FLAGS, _cpu_signature())).encode()
    key = hashlib.sha256(source + identity).hexdigest()[:16]
    target = _cache_dir() / f"fused-{platform.machine()}-{key}.so"
    try:
        if not target.exists():
            _build(compiler, target)
        library = _load(target)
    except (OSError, subprocess.SubprocessError):
        return None
    for dtype_name in _ENTRY_POINTS.values():
        function = getattr(library, f"gradstat_fused_{dtype_name}")
        function.restype = ctypes.c_int32
        function.argtypes = [
            ctypes.c_void_p,
            ctypes.c_int64,
            ctypes.c_int32,
            ctypes.POINTER(ctypes.c_double),
            ctypes.POINTER(ctypes.c_int64),
            ctypes.POINTER(ctypes.c_float),
            ctypes.POINTER(ctypes.c_int32),
        ]
    return library


def native_kernel() -> Any:
    """The compiled fp32 kernel's C function, or None where it cannot be built or loaded."""
    library = native_library()
    return None if library is None else library.gradstat_fused_f32


# The element types the kernel reads, and the suffix of their entry points.
_ENTRY_POINTS = {torch.float32: "f32", torch.bfloat16: "bf16"}


@cache
def _entry_point(dtype_name: str) -> Any:
    library = native_library()
    return None if library is None else getattr(library, f"gradstat_fused_{dtype_name}")


def fused(grad: torch.Tensor) -> FusedStats | None:
    """One pass over a CPU fp32 or bf16 tensor (bf16 widened to fp32 in registers); None when
    the kernel is unavailable or does not apply."""
    dtype_name = _ENTRY_POINTS.get(grad.dtype)
    if grad.device.type != "cpu" or dtype_name is None:
        return None
    function = _entry_point(dtype_name)
    if function is None:
        return None
    flat = grad.contiguous()
    sum_squares, zeros = ctypes.c_double(), ctypes.c_int64()
    max_abs, has_nan = ctypes.c_float(), ctypes.c_int32()
    status = function(
        flat.data_ptr(),
        flat.numel(),
        torch.get_num_threads(),
        ctypes.byref(sum_squares),
        ctypes.byref(zeros),
        ctypes.byref(max_abs),
        ctypes.byref(has_nan),
    )
    if status != 0:
        return None  # out of memory for the per-chunk sums: let PyTorch do it
    return FusedStats(sum_squares.value, zeros.value, max_abs.value, bool(has_nan.value))


def fused_f32(grad: torch.Tensor) -> FusedStats | None:
    """:func:`fused` for fp32 tensors only (the snapshot reader's and the zero count's path)."""
    return fused(grad) if grad.dtype == torch.float32 else None

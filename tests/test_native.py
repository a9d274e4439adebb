"""The native one-pass kernel against float64, and gradstat without it."""

from __future__ import annotations

import itertools
import json
import math
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch import Tensor

from gradstat.core import native
from tests._oracle import float64_norm, rel_err, zeros_in

SAMPLE = Path(__file__).resolve().parent.parent / "sample_data" / "gtp2-pp2-dp2-ep2"


TURNED_OFF = os.environ.get("GRADSTAT_NATIVE", "1") == "0"


def test_the_kernel_builds_where_there_is_a_compiler() -> None:
    if TURNED_OFF or shutil.which(os.environ.get("CC") or "cc") is None:
        assert native.native_kernel() is None
    else:
        assert native.native_kernel() is not None


CHUNK = 32768  # _fused.c: elements per double partial
PARALLEL_CHUNKS = 4  # _fused.c: fewer chunks than this are summed without a thread team

needs_kernel = pytest.mark.skipif(
    native.native_kernel() is None,
    reason="the native kernel is off (GRADSTAT_NATIVE=0)" if TURNED_OFF else "no C compiler here",
)


@needs_kernel
@pytest.mark.parametrize("size", [1, 15, 16, 17, 511, 512, 513, 4099, 1_000_003])
def test_fused_statistics_match_float64(size: int) -> None:
    gen = torch.Generator().manual_seed(size)
    grad = torch.randn(size, generator=gen)
    grad[::3] = 0.0
    grad[1::7] = -0.0
    stats = native.fused_f32(grad)
    assert stats is not None
    assert stats.zeros == zeros_in([grad])
    assert stats.max_abs == float64_norm([grad], math.inf)
    assert not stats.has_nan
    expected = float64_norm([grad], 2) ** 2
    assert (
        stats.sum_squares == 0.0 if expected == 0 else rel_err(stats.sum_squares, expected) < 1e-6
    )


@needs_kernel
def test_nan_inf_and_non_contiguous() -> None:
    grad = torch.randn(64, 100)[:, ::3]
    assert not grad.is_contiguous()
    stats = native.fused_f32(grad)
    assert stats is not None
    assert rel_err(stats.sum_squares, float64_norm([grad], 2) ** 2) < 1e-6
    grad = torch.ones(1000)
    grad[10], grad[500] = math.nan, -math.inf
    stats = native.fused_f32(grad)
    assert stats is not None and stats.has_nan and stats.max_abs == math.inf


def test_other_dtypes_and_devices_are_not_for_the_kernel() -> None:
    assert native.fused_f32(torch.ones(3, dtype=torch.bfloat16)) is None
    assert native.fused_f32(torch.ones(3, dtype=torch.float64)) is None


def test_without_the_kernel_the_numbers_agree(tmp_path: Path) -> None:
    reports = {}
    for setting in ("1", "0"):
        environment = {**os.environ, "GRADSTAT_NATIVE": setting, "GRADSTAT_CACHE": str(tmp_path)}
        result = subprocess.run(
            [sys.executable, "-m", "gradstat", "norm", str(SAMPLE), "--json", "-p", "inf"],
            capture_output=True,
            text=True,
            timeout=120,
            check=False,
            env=environment,
        )
        assert result.returncode == 0, result.stderr
        reports[setting] = json.loads(result.stdout)
    assert reports["1"]["total_norm"] == reports["0"]["total_norm"]
    zeros = {}
    for setting in ("1", "0"):
        environment = {**os.environ, "GRADSTAT_NATIVE": setting, "GRADSTAT_CACHE": str(tmp_path)}
        result = subprocess.run(
            [sys.executable, "-m", "gradstat", "zeros", str(SAMPLE), "--json"],
            capture_output=True,
            text=True,
            timeout=120,
            check=False,
            env=environment,
        )
        zeros[setting] = json.loads(result.stdout)["num_zeros"]
    assert zeros["1"] == zeros["0"] == 1376


@needs_kernel
@pytest.mark.parametrize(
    "size",
    [
        3_000_017,
        PARALLEL_CHUNKS * CHUNK - 1,  # the largest tensor summed by one thread
        PARALLEL_CHUNKS * CHUNK,  # the smallest summed by a team
        PARALLEL_CHUNKS * CHUNK + 1,
    ],
)
def test_result_does_not_depend_on_the_thread_count(size: int) -> None:
    """Under torchrun each process may run another number of threads: bitwise equal sums.

    One thread takes the serial path, more take the parallel one: the same chunks, the same
    order, the same bits; either side of the size where the kernel starts a team too.
    """
    grad = torch.randn(size, generator=torch.Generator().manual_seed(size))
    grad[::5] = 0.0
    before = torch.get_num_threads()
    try:
        results = set()
        for threads in (1, 2, 3, 7):
            torch.set_num_threads(threads)
            results.add(native.fused_f32(grad))
    finally:
        torch.set_num_threads(before)
    assert len(results) == 1
    (stats,) = results
    assert stats is not None and stats.zeros == zeros_in([grad])


@needs_kernel
def test_many_tiny_tensors_keep_exact_statistics() -> None:
    """Thousands of tensors of 1 to 40 elements, each summed without a thread team (issue 14,
    item 15): every zero count and max |x| exact, every sum of squares float64's to 1e-6."""
    gen = torch.Generator().manual_seed(15)
    grads = []
    for index in range(5000):
        grad = torch.randn(1 + index % 40, generator=gen)
        grad[torch.rand(grad.shape, generator=gen) < 0.3] = 0.0
        if index % 7 == 0:
            grad[0] = -0.0
        grads.append(grad)
    results = [native.fused_f32(grad) for grad in grads]
    assert all(stats is not None for stats in results)
    for grad, stats in zip(grads, results, strict=True):
        assert stats is not None
        assert stats.zeros == zeros_in([grad])
        assert stats.max_abs == float64_norm([grad], math.inf)
        assert not stats.has_nan
        expected = float64_norm([grad], 2) ** 2
        assert stats.sum_squares == expected == 0.0 or rel_err(stats.sum_squares, expected) < 1e-6
    total_zeros = sum(stats.zeros for stats in results if stats is not None)
    assert total_zeros == zeros_in(grads) > 0
    # NaN in a tiny tensor is seen too.
    grads[3][0] = math.nan
    stats = native.fused_f32(grads[3])
    assert stats is not None and stats.has_nan


@needs_kernel
@pytest.mark.parametrize("size", [1, 17, 31, 32, 33, 513, CHUNK + 33, 1_000_003])
def test_bf16_statistics_match_float64(size: int) -> None:
    """bf16 is widened to fp32 in registers: the same statistics as its fp32 copy. The sizes
    fall either side of a row of 32 bf16 lanes and past a chunk's end."""
    gen = torch.Generator().manual_seed(size)
    grad = (torch.randn(size, generator=gen) * 3.0).bfloat16()
    grad[5::5] = 0.0
    stats = native.fused(grad)
    assert stats is not None
    assert rel_err(math.sqrt(stats.sum_squares), float64_norm([grad], 2)) <= 1e-6
    assert stats.zeros == zeros_in([grad])
    assert stats.max_abs == float(grad.abs().max()) and not stats.has_nan
    grad[size // 2] = math.nan
    stats = native.fused(grad)
    assert stats is not None and stats.has_nan and math.isnan(stats.sum_squares)


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("size", [1, 17, 513, PARALLEL_CHUNKS * CHUNK - 1, 1_000_003])
def test_a_sum_alone_is_the_fused_pass_sum(size: int, dtype: torch.dtype) -> None:
    """The norm's pass, one sum and nothing else: the fused pass's bits at every thread count,
    float64's to 1e-12, and NaN or inf where the data has one."""
    gen = torch.Generator().manual_seed(size)
    grad = (torch.randn(2 * size, generator=gen) * 7.0).to(dtype)[::2]  # not contiguous
    grad[3::11] = 0.0
    expected = {2: float64_norm([grad], 2) ** 2, 1: float64_norm([grad], 1)}
    before = torch.get_num_threads()
    try:
        for threads in (1, 2, 5):
            torch.set_num_threads(threads)
            stats = native.fused(grad)
            assert stats is not None
            assert native.power_sum(grad, 2) == stats.sum_squares
            assert native.power_sum(grad, 1) == stats.sum_abs
    finally:
        torch.set_num_threads(before)
    for p, total in expected.items():
        found = native.power_sum(grad, p)
        assert found is not None and rel_err(found, total) <= 1e-12
    assert native.power_sum(grad, 3) is None
    assert native.power_sum(grad.half(), 2) is None and native.power_sum(grad.double(), 2) is None
    grad[size // 2] = math.inf
    assert native.power_sum(grad, 2) == native.power_sum(grad, 1) == math.inf
    grad[size // 3] = math.nan
    assert math.isnan(native.power_sum(grad, 2) or 0.0)


@needs_kernel
def test_many_sums_in_one_call_are_each_tensors_own() -> None:
    """fp32 and bf16 tensors of many sizes (empty ones too), mixed with ones the kernel does not
    read, at several thread counts: each sum the bits of the fused pass over that tensor alone,
    None for the others."""
    gen = torch.Generator().manual_seed(30)
    grads = []
    for index in range(300):
        dtype = (torch.float32, torch.bfloat16, torch.float16, torch.float64)[index % 4]
        grads.append(torch.randn(1 + index * 37 % 5000, generator=gen).to(dtype))
    grads.append(torch.randn(64, 100, generator=gen)[:, ::3])  # not contiguous
    grads.append(torch.randn(PARALLEL_CHUNKS * CHUNK + 5, generator=gen).bfloat16())
    # Tensors that take the thread team, among the others: the team is shared by a call.
    grads[150:150] = [
        torch.randn(PARALLEL_CHUNKS * CHUNK, generator=gen),
        torch.randn(5 * CHUNK + 3, generator=gen),
    ]
    grads[40:40] = [torch.randn(PARALLEL_CHUNKS * CHUNK + 77, generator=gen).bfloat16()]
    grads[7:7] = [torch.empty(0), torch.empty(0, dtype=torch.bfloat16)]
    grads.append(torch.empty(0))
    before = torch.get_num_threads()
    try:
        for threads, p in itertools.product((1, 2, 3), (1, 2)):
            torch.set_num_threads(threads)
            sums = native.power_sums(grads, p)
            for grad, found in zip(grads, sums, strict=True):
                if grad.dtype not in (torch.float32, torch.bfloat16):
                    assert found is None
                    continue
                stats = native.fused(grad)  # the other pass, a call of its own
                assert stats is not None and found is not None
                assert found == (stats.sum_squares if p == 2 else stats.sum_abs)
                if grad.numel() == 0:
                    assert found == 0.0
                else:
                    assert rel_err(found, float64_norm([grad], p) ** p) <= 1e-12
    finally:
        torch.set_num_threads(before)
    assert native.power_sums(grads, 3) == [None] * len(grads)
    assert native.power_sums([], 2) == []


@pytest.mark.parametrize("kernel", [True, False])
def test_bf16_l2_with_and_without_the_kernel(kernel: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    import gradstat

    if not kernel:
        monkeypatch.setattr(native, "power_sum", lambda grad, p: None)
    gen = torch.Generator().manual_seed(4)
    grads = [(torch.randn(n, generator=gen) * 1e-3).bfloat16() for n in (3, 5000, 300_001)]
    assert rel_err(gradstat.get_grad_norm_fp32(grads, 2), float64_norm(grads, 2)) <= 1e-6
    grads[1][7] = math.inf
    assert gradstat.get_grad_norm_fp32(grads, 2) == math.inf


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_chunks_of_zeros_count_every_zero(dtype: torch.dtype) -> None:
    """Each lane counts a whole chunk's zeros: three chunks and a bit of zeros, with one value
    among them, count every zero and sum that value alone."""
    grad = torch.zeros(3 * CHUNK + 7, dtype=dtype)
    grad[CHUNK + 5] = -2.5
    stats = native.fused(grad)
    assert stats is not None
    assert stats.zeros == grad.numel() - 1
    assert stats.sum_squares == 6.25 and stats.sum_abs == 2.5 and stats.max_abs == 2.5


@needs_kernel
def test_fused_passes_in_one_call_are_each_tensors_own() -> None:
    """fp32 tensors below and above the size that takes a thread team, in one call (the large
    ones share the team): at every thread count, each tensor's statistics are those of a call
    for it alone, its zeros and peak exact, a NaN in one large tensor its own."""
    gen = torch.Generator().manual_seed(31)
    grads = [torch.randn(1 + index * 53 % 3000, generator=gen) for index in range(60)]
    grads[10:10] = [torch.randn(PARALLEL_CHUNKS * CHUNK + 9, generator=gen)]
    grads[30:30] = [torch.randn(6 * CHUNK, generator=gen), torch.empty(0)]
    grads.append(torch.randn(PARALLEL_CHUNKS * CHUNK, generator=gen))
    for grad in grads:
        grad[::4] = 0.0
    grads[30][CHUNK + 3] = math.nan
    before = torch.get_num_threads()
    try:
        for threads in (1, 2, 3):
            torch.set_num_threads(threads)
            together = native.fused_many_f32(grads)
            alone = [native.fused_f32(grad) for grad in grads]
            assert repr(together) == repr(alone)  # float reprs are exact; NaN reads as nan
    finally:
        torch.set_num_threads(before)
    for index, (grad, stats) in enumerate(zip(grads, together, strict=True)):
        assert stats is not None
        assert stats.zeros == zeros_in([grad])
        assert stats.has_nan == (index == 30)
        if index != 30:
            expected = float64_norm([grad], 2) ** 2
            assert stats.max_abs == float64_norm([grad], math.inf)
            assert (
                stats.sum_squares == expected == 0.0
                or rel_err(stats.sum_squares, expected) <= 1e-12
            )


def _bf16_of_bits(bits: Tensor) -> Tensor:
    return bits.to(torch.int16).view(torch.bfloat16)


@needs_kernel
def test_bf16_squares_of_every_kind_of_value_are_exact() -> None:
    """The bf16 sum of squares, which on some CPUs makes its doubles from the bits: every finite
    bf16 value (subnormals and both zeros among them) in a shuffled order, then chunks of
    subnormals alone, one subnormal in one chunk of many, and infinities and NaNs. Each sum is
    the fused pass's bits (its doubles come from conversions) at one and two threads, and the
    correctly rounded float64 sum of the exact squares to 1e-12."""
    every = torch.arange(1 << 16, dtype=torch.int32)
    exponent = (every >> 7) & 0xFF
    finite = _bf16_of_bits(every[exponent != 0xFF])
    order = torch.randperm(finite.numel(), generator=torch.Generator().manual_seed(6))
    subnormals = _bf16_of_bits(every[(exponent == 0) & (every & 0x7F != 0)])
    gen = torch.Generator().manual_seed(8)
    ordinary = (torch.randn(5 * CHUNK + 77, generator=gen) * 1e-4).bfloat16()
    largest_subnormal = _bf16_of_bits(torch.tensor([0x807F]))  # negative
    one_odd = ordinary.clone()
    one_odd[3 * CHUNK + 40 : 3 * CHUNK + 41] = largest_subnormal
    lone = torch.zeros(2 * CHUNK + 50, dtype=torch.bfloat16)
    lone[CHUNK + 7 : CHUNK + 8] = largest_subnormal
    cases = {
        "every finite value": finite[order],
        "subnormals alone": subnormals.repeat(CHUNK // subnormals.numel() * 3 + 1)[: 3 * CHUNK + 5],
        "one subnormal among normals": one_odd,
        "the largest subnormal among zeros": lone,
    }
    before = torch.get_num_threads()
    try:
        for what, grad in cases.items():
            expected = math.fsum(float(value) ** 2 for value in grad.tolist())
            assert expected > 0.0, what
            for threads in (1, 2):
                torch.set_num_threads(threads)
                stats = native.fused(grad)
                found = native.power_sum(grad, 2)
                assert stats is not None and found == stats.sum_squares, what
                assert rel_err(found, expected) <= 1e-12, what
    finally:
        torch.set_num_threads(before)
    for special, squared in ((math.inf, math.inf), (-math.inf, math.inf), (math.nan, math.nan)):
        grad = ordinary.clone()
        grad[2 * CHUNK + 9] = special
        found = native.power_sum(grad, 2)
        assert found is not None
        assert math.isnan(found) if math.isnan(squared) else found == squared
    for bits in (0x7FC1, 0xFF81, 0x7FBF):  # NaNs of either sign, quiet and signalling
        grad = ordinary.clone()
        grad[CHUNK + 3 : CHUNK + 4] = _bf16_of_bits(torch.tensor([bits], dtype=torch.int32))
        found = native.power_sum(grad, 2)
        assert found is not None and math.isnan(found)

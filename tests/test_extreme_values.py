"""Extreme magnitudes and norm types: the caller's data untouched, no silent wrong number.

Expected values come from 80-digit decimal arithmetic over the exact input values (every float
is a decimal number), or from the definition itself: for p = 1e300 the norm is max |x| to
double precision, for p = 1e-300 it is |x| of a lone non-zero element and beyond float64 for
two. Nothing here asks gradstat or a PyTorch norm kernel for an expected value.
"""

from __future__ import annotations

import decimal
import json
import math
import subprocess
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import Tensor
from typer.testing import CliRunner

from gradstat import get_grad_norm_fp32
from gradstat.cli import app
from gradstat.core import kernels, native
from gradstat.snapshot import save_rank
from gradstat.testing import Case, launch
from tests._cli import run_gradstat
from tests._params import param_with

CPU = torch.device("cpu")
SUM, MAX = torch.distributed.ReduceOp.SUM, torch.distributed.ReduceOp.MAX
# The promise for fp32 L2 and L1 (fp32 sums of 512-element rows); float64 paths are held to 1e-9.
FP32_ROWS = 1e-6


def exact_norm(values: Sequence[float], p: float) -> float:
    """(sum |x|^p)^(1/p) in 80-digit decimal arithmetic, rounded to float64 once at the end."""
    with decimal.localcontext() as context:
        context.prec = 80
        context.Emax, context.Emin = decimal.MAX_EMAX, decimal.MIN_EMIN
        exponent = decimal.Decimal(p)
        total = sum(
            (abs(decimal.Decimal(value)) ** exponent for value in values if value),
            decimal.Decimal(0),
        )
        return 0.0 if total == 0 else float(total ** (1 / exponent))


def expected_norm(values: Sequence[float], p: float) -> float:
    """:func:`exact_norm`, or max |x| where p is so large that the two agree to double precision.

    (sum |x|^p)^(1/p) lies between max |x| and max |x| * elements^(1/p); for p >= 1e18 the factor
    is 1 within 1e-16, while decimal powers like 2.7e-3^1e300 leave its exponent range.
    """
    if p >= 1e18:
        return max(abs(value) for value in values)
    return exact_norm(values, p)


def values_of(*grads: Tensor) -> list[float]:
    """The exact values of the gradients as Python floats (fp32 widens exactly)."""
    return [value for grad in grads for value in grad.double().reshape(-1).tolist()]


def rel_err(value: float, expected: float) -> float:
    return abs(value - expected) / abs(expected)


def scaled_randn(size: int, scale: float, dtype: torch.dtype, seed: int) -> Tensor:
    """Signed values of magnitude ``scale`` (some zeros), made in float64 and cast once."""
    gen = torch.Generator().manual_seed(seed)
    grad = torch.randn(size, generator=gen, dtype=torch.float64) * scale
    grad[::7] = 0.0
    return grad.to(dtype)


# ---------------------------------------------------------------------------------------------
# The caller's data is never written
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("p", [3, 1.5, 2, 1])
@pytest.mark.parametrize("scale", [1.0, 1e-160, 1e-300, 1e200])
def test_the_callers_float64_gradient_is_left_as_it_was(p: float, scale: float) -> None:
    grad = torch.tensor([-1.0, 2.0, -3.0, 0.0], dtype=torch.float64) * scale
    before = grad.clone()
    get_grad_norm_fp32([grad], p)
    kernels.norm([grad], p, CPU)
    assert torch.equal(grad, before)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
def test_the_exact_and_scaled_paths_write_nothing_either(dtype: torch.dtype) -> None:
    """fp32 rows, the float64 exact path and the scaled path, over three dtypes."""
    grads = [scaled_randn(5000, 1e-30, dtype, 1), scaled_randn(3, 3.0, dtype, 2)]
    for grad in grads:
        grad.requires_grad_(False)
    before = [grad.clone() for grad in grads]
    for p in (2, 1, 3, 150, 0.5, 1e300):
        kernels.norm(grads, p, CPU)
        kernels.scaled_power_sum(grads, p, CPU, 3.0)
    assert all(torch.equal(grad, old) for grad, old in zip(grads, before, strict=True))


# ---------------------------------------------------------------------------------------------
# Tiny and huge values
# ---------------------------------------------------------------------------------------------

TINY = [
    (torch.float32, 1e-30),  # fp32 squares underflow to 0
    (torch.float32, 3e-23),  # fp32 squares are subnormals
    (torch.float64, 1e-160),  # float64 squares are subnormals
    (torch.float64, 1e-300),  # float64 squares underflow to 0
]


@pytest.mark.parametrize(("dtype", "scale"), TINY)
@pytest.mark.parametrize("p", [2, 1])
def test_tiny_values_on_one_device(dtype: torch.dtype, scale: float, p: float) -> None:
    grads = [scaled_randn(4099, scale, dtype, 3), scaled_randn(700, scale, dtype, 4)]
    expected = exact_norm(values_of(*grads), p)
    assert rel_err(kernels.norm(grads, p, CPU), expected) <= 1e-6


@pytest.mark.parametrize("p", [2, 1])
def test_tiny_fp32_through_get_grad_norm_fp32(p: float) -> None:
    """sum |x|^p of fp32 values always fits in float64: the plain reduction is exact."""
    grads = [scaled_randn(4099, 1e-30, torch.float32, 5), scaled_randn(33, 1e-30, torch.float32, 6)]
    expected = exact_norm(values_of(*grads), p)
    assert rel_err(get_grad_norm_fp32(grads, p), expected) <= 1e-6


@pytest.mark.parametrize("p", [2, 3])
def test_tiny_float64_through_get_grad_norm_fp32(p: float) -> None:
    grads = [scaled_randn(4099, 1e-160, torch.float64, 7)]
    assert rel_err(get_grad_norm_fp32(grads, p), exact_norm(values_of(*grads), p)) <= 1e-6


@pytest.mark.parametrize("p", [2, 1, 3, 150])
def test_values_near_the_fp32_maximum(p: float) -> None:
    grad = scaled_randn(3000, 1e38, torch.float64, 8).clamp(-3.4e38, 3.4e38).float()
    grad[5] = torch.finfo(torch.float32).max
    expected = exact_norm(values_of(grad), p)
    assert rel_err(kernels.norm([grad], p, CPU), expected) <= 1e-9
    if p != 150:  # 3.4e38 to the 150th overflows float64
        assert rel_err(get_grad_norm_fp32([grad], p), expected) <= 1e-6


@pytest.mark.parametrize("p", [2, 3])
def test_float64_values_whose_powers_overflow(p: float) -> None:
    grad = scaled_randn(1000, 1e200, torch.float64, 9)
    assert rel_err(kernels.norm([grad], p, CPU), exact_norm(values_of(grad), p)) <= 1e-9


def test_nan_and_inf_still_propagate_on_every_path() -> None:
    for p in (2, 1, 3, 150, 0.5, 1e300):
        tiny = scaled_randn(100, 1e-200, torch.float64, 10)
        tiny[3] = math.inf
        assert kernels.norm([tiny], p, CPU) == math.inf, p
        tiny[4] = math.nan
        assert math.isnan(kernels.norm([tiny], p, CPU)), p


# ---------------------------------------------------------------------------------------------
# Large and small p
# ---------------------------------------------------------------------------------------------


def small_grads() -> list[Tensor]:
    """The issue's gradients: |x| <= 2.7e-3, whose 150th powers underflow float64."""
    gen = torch.Generator().manual_seed(11)
    grad = (torch.rand(3000, generator=gen, dtype=torch.float64) * 2 - 1) * 2.7e-3
    return [grad[:2000].float(), grad[2000:].float()]


@pytest.mark.parametrize("p", [150, 40, 7.5])
def test_large_p_of_small_gradients(p: float) -> None:
    grads = small_grads()
    expected = exact_norm(values_of(*grads), p)
    assert rel_err(kernels.norm(grads, p, CPU), expected) <= 1e-9


def test_huge_p_is_the_largest_magnitude() -> None:
    grads = [torch.tensor([1.37, -0.5, 1.2, -1.37], dtype=torch.float64), *small_grads()]
    for p in (1e300, 1e20):
        assert math.isclose(kernels.norm(grads, p, CPU), 1.37, rel_tol=1e-15)
    largest = max(abs(value) for value in values_of(*small_grads()))
    assert math.isclose(kernels.norm(small_grads(), 1e300, CPU), largest, rel_tol=1e-15)


@pytest.mark.parametrize("p", [0.01, 0.2, 0.5])
def test_small_p(p: float) -> None:
    grads = [scaled_randn(150, 1e-3, torch.float32, 12), scaled_randn(50, 2.0, torch.float64, 13)]
    expected = exact_norm(values_of(*grads), p)
    assert math.isfinite(expected)
    assert rel_err(kernels.norm(grads, p, CPU), expected) <= 1e-9


def test_tiny_p_is_exact_or_beyond_float64() -> None:
    lone = torch.tensor([0.0, -0.5, 0.0], dtype=torch.float64)
    assert kernels.norm([lone], 1e-300, CPU) == 0.5
    pair = torch.tensor([0.5, 1e-300], dtype=torch.float64)
    assert kernels.norm([pair], 1e-300, CPU) == math.inf  # at least 0.5 * 2^(1e300)
    # A tiny norm times a huge factor: finite, though the factor alone is not.
    tiny_pair = torch.tensor([1e-300, 1e-300], dtype=torch.float64)
    assert rel_err(kernels.norm([tiny_pair], 5e-4, CPU), exact_norm([1e-300, 1e-300], 5e-4)) < 1e-9


@pytest.mark.parametrize("p", [150, 1e300])
def test_large_p_through_get_grad_norm_fp32(p: float) -> None:
    grads = small_grads()
    assert rel_err(get_grad_norm_fp32(grads, p), expected_norm(values_of(*grads), p)) <= 1e-9


def test_small_p_through_get_grad_norm_fp32() -> None:
    grads = [scaled_randn(3000, 1.0, torch.float32, 14)]
    assert get_grad_norm_fp32(grads, 0.01) == math.inf  # 2571^100 and more


# ---------------------------------------------------------------------------------------------
# Combining norms (what crosses rank files and processes)
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("p", [2, 1, 3, 150, 0.3])
def test_norms_of_parts_combine_to_the_norm_of_the_whole(p: float) -> None:
    parts = [small_grads()[0][i : i + 97] for i in range(0, 2000, 97)]
    norms = [kernels.norm([part], p, CPU) for part in parts]
    expected = exact_norm(values_of(*parts), p)
    assert rel_err(kernels.combine_norms(norms, p), expected) <= 1e-9
    running = 0.0
    for value in norms:
        running = kernels.add_norms(running, value, p)
    assert rel_err(running, expected) <= 1e-9
    assert math.isnan(kernels.combine_norms([1.0, math.nan, math.inf], p))
    assert kernels.combine_norms([1.0, math.inf], p) == math.inf


# ---------------------------------------------------------------------------------------------
# The reduction over ranks: one SUM for ordinary values, the same path on every rank
# ---------------------------------------------------------------------------------------------


def in_process_ranks(shares: list[list[Tensor]]) -> tuple[kernels.StatReduce, list[Any]]:
    """A reducer over simulated ranks (each a list of tensors), and the ops it was called with."""
    calls: list[Any] = []

    def reduce(compute: kernels.StatCompute, op: Any) -> Tensor:
        calls.append(op)
        results = [compute(share, CPU) for share in shares]
        total = results[0].clone()
        for result in results[1:]:
            total = torch.maximum(total, result) if op == MAX else total + result
        return total

    return reduce, calls


def test_ordinary_values_take_one_sum_reduction() -> None:
    shares = [[scaled_randn(1000, 1.0, torch.float32, seed)] for seed in range(3)]
    reduce, calls = in_process_ranks(shares)
    expected = exact_norm(values_of(*(share[0] for share in shares)), 2)
    assert rel_err(kernels.reduced_norm(2, reduce), expected) <= FP32_ROWS
    assert calls == [SUM]


@pytest.mark.parametrize(
    ("case", "scales"),
    [
        ("one rank underflows", [1.0, 1e-300]),
        ("every rank underflows", [1e-170, 1e-160]),
        ("one rank overflows", [1.0, 1e160]),
    ],
)
def test_ranks_out_of_range_take_the_scaled_path(case: str, scales: list[float]) -> None:
    shares = [[scaled_randn(100, scale, torch.float64, 20 + i)] for i, scale in enumerate(scales)]
    reduce, calls = in_process_ranks(shares)
    expected = exact_norm(values_of(*(share[0] for share in shares)), 2)
    assert rel_err(kernels.reduced_norm(2, reduce), expected) <= 1e-9, case
    assert calls == [SUM, MAX, SUM], case


def test_a_total_that_overflows_over_ranks_takes_the_scaled_path() -> None:
    """Each rank's sum of squares (1e308) fits in float64; their sum does not."""
    shares = [[torch.tensor([1e154], dtype=torch.float64)] for _ in range(2)]
    reduce, calls = in_process_ranks(shares)
    assert rel_err(kernels.reduced_norm(2, reduce), exact_norm([1e154, 1e154], 2)) <= 1e-12
    assert calls == [SUM, MAX, SUM]


def reduced_norm_on_rank(rank: int, world_size: int, arg: tuple[list[float], float]) -> float:
    """One gloo rank: its share of the gradients, the norm over all ranks."""
    scales, p = arg
    grads = [scaled_randn(500, scales[rank], torch.float64, 30 + rank)]

    def reduce(compute: kernels.StatCompute, op: Any) -> Tensor:
        stat = compute(grads, CPU)
        torch.distributed.all_reduce(stat, op=op)
        return stat

    return kernels.reduced_norm(p, reduce)


@pytest.mark.multiprocess
@pytest.mark.slow
def test_every_gloo_rank_takes_the_same_path(tmp_path: Path) -> None:
    cases = [
        ("mixed", ([1.0, 1e-300, 1e-170], 2.0)),
        ("ordinary", ([1.0, 2.0, 3.0], 3.0)),
        ("p150", ([2.7e-3, 1e-3, 1e-4], 150.0)),
    ]
    report = launch(3, tmp_path, [Case(name, reduced_norm_on_rank, arg) for name, arg in cases])
    for name, (scales, p) in cases:
        grads = [scaled_randn(500, scale, torch.float64, 30 + i) for i, scale in enumerate(scales)]
        expected = exact_norm(values_of(*grads), p)
        results = report.values(name)
        assert len(set(results)) == 1, name
        assert rel_err(results[0], expected) <= 1e-9, name


# ---------------------------------------------------------------------------------------------
# The command line
# ---------------------------------------------------------------------------------------------


def write_snapshot(directory: Path, grads: Sequence[Tensor]) -> Path:
    """One TP-split parameter over len(grads) rank files."""
    world = len(grads)
    for rank, grad in enumerate(grads):
        param = param_with(grad, tensor_model_parallel=True)
        save_rank(
            directory, [("w", param)], rank=rank, world_size=world, coords={"tp": [rank, world]}
        )
    return directory


def digest(directory: Path) -> dict[str, bytes]:
    return {path.name: path.read_bytes() for path in sorted(directory.iterdir())}


def cli(*args: str) -> tuple[int, str, str]:
    """The real entry point in this process; any exception but an exit fails the test."""
    result = CliRunner().invoke(app, list(args))
    if result.exception is not None and not isinstance(result.exception, SystemExit):
        raise result.exception
    return result.exit_code, result.stdout, result.stderr


def gradstat_process(*args: str) -> subprocess.CompletedProcess[str]:
    """A separate process: a fault (SIGSEGV on a read-only mapping) must not take pytest down."""
    return run_gradstat(*args, timeout=120)


def few_grads() -> list[Tensor]:
    """200 elements: few enough for a finite 0.01-norm (200^100 times their size)."""
    return [scaled_randn(100, 1e-3, torch.float32, 15), scaled_randn(100, 1e-3, torch.float32, 16)]


@pytest.fixture(scope="module")
def small_snapshot(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_snapshot(tmp_path_factory.mktemp("small"), small_grads())


@pytest.fixture(scope="module")
def few_snapshot(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_snapshot(tmp_path_factory.mktemp("few"), few_grads())


@pytest.mark.parametrize("native_kernel", [True, False])
@pytest.mark.parametrize(
    ("which", "p"),
    [("small", "150"), ("small", "1e300"), ("small", "2"), ("small", "3"), ("few", "0.01")],
)
def test_norm_command_large_and_small_p(
    small_snapshot: Path,
    few_snapshot: Path,
    which: str,
    p: str,
    native_kernel: bool,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    if not native_kernel:
        monkeypatch.setattr(native, "fused_f32", lambda grad: None)
    snapshot, grads = (
        (small_snapshot, small_grads()) if which == "small" else (few_snapshot, few_grads())
    )
    before = digest(snapshot)
    code, stdout, stderr = cli("norm", str(snapshot), "--norm-type", p, "--json")
    assert code == 0, stderr
    report = json.loads(stdout)
    expected = expected_norm(values_of(*grads), float(p))
    assert 0 < expected < math.inf
    # L2 and L1 of fp32 take the fast path: fp32 sums of 512-element rows.
    tolerance = FP32_ROWS if float(p) in (1, 2) else 1e-9
    assert rel_err(report["total_norm"], expected) <= tolerance
    assert rel_err(report["params"][0]["norm"], expected) <= tolerance
    assert digest(snapshot) == before


@pytest.mark.parametrize("native_kernel", [True, False])
@pytest.mark.parametrize(("dtype", "scale"), TINY)
@pytest.mark.parametrize("p", ["2", "1"])
def test_norm_command_tiny_values(
    tmp_path: Path,
    dtype: torch.dtype,
    scale: float,
    p: str,
    native_kernel: bool,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    if not native_kernel:
        monkeypatch.setattr(native, "fused_f32", lambda grad: None)
    grads = [scaled_randn(4099, scale, dtype, 40), scaled_randn(4099, scale, dtype, 41)]
    snapshot = write_snapshot(tmp_path / "tiny", grads)
    code, stdout, stderr = cli("norm", str(snapshot), "-p", p, "--json")
    assert code == 0, stderr
    assert (
        rel_err(json.loads(stdout)["total_norm"], exact_norm(values_of(*grads), float(p))) <= 1e-6
    )


@pytest.mark.parametrize("args", [["-p", "3"], ["-p", "2"], ["-p", "1.5"], ["-p", "0.5"]])
def test_float64_snapshot_is_read_not_written(tmp_path: Path, args: list[str]) -> None:
    grads = [
        scaled_randn(3000, 1e-160, torch.float64, 50),
        scaled_randn(3000, 2.0, torch.float64, 51),
    ]
    snapshot = write_snapshot(tmp_path / "f64", grads)
    before = digest(snapshot)
    result = gradstat_process("norm", str(snapshot), *args, "--json")
    assert result.returncode == 0, result.stderr
    expected = exact_norm(values_of(*grads), float(args[1]))
    assert rel_err(json.loads(result.stdout)["total_norm"], expected) <= 1e-9
    assert digest(snapshot) == before
    tiny = write_snapshot(tmp_path / "tiny", [grads[0]])
    before = digest(tiny)
    out = tmp_path / "out"
    result = gradstat_process(
        "clip", str(tiny), *args, "--max-norm", "1e-200", "--out", str(out), "--json"
    )
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout)["clipped"] is True
    assert digest(tiny) == before


def test_clip_by_a_large_p_clips(small_snapshot: Path, tmp_path: Path) -> None:
    out = tmp_path / "clipped"
    code, stdout, stderr = cli(
        "clip",
        str(small_snapshot),
        "-p",
        "150",
        "--max-norm",
        "0.0005",
        "--out",
        str(out),
        "--json",
    )
    assert code == 0, stderr
    report = json.loads(stdout)
    expected = exact_norm(values_of(*small_grads()), 150)
    assert report["clipped"] is True
    assert rel_err(report["total_norm"], expected) <= 1e-9
    assert math.isclose(report["clip_coeff"], 0.0005 / (expected + 1e-6), rel_tol=1e-9)
    code, stdout, stderr = cli("norm", str(out), "-p", "150", "--json")
    assert code == 0, stderr
    assert math.isclose(
        json.loads(stdout)["total_norm"], expected * report["clip_coeff"], rel_tol=1e-6
    )


def _beyond_float64(snapshot: Path, p: str) -> str:
    """The one line the CLI prints for a norm that float64 cannot hold."""
    return (
        f"gradstat: error: {snapshot}: the {p}-norm of these gradients is larger than float64 "
        "holds (1.8e308), although every gradient is finite; a larger --norm-type gives a "
        "smaller norm\n"
    )


def _unsupported(p: str) -> str:
    return f"gradstat: error: --norm-type '{p}' is not supported; use 2, 1, inf or a number p > 0\n"


@pytest.mark.parametrize("p", ["1e-300", "5e-324", "0.001"])
def test_a_norm_beyond_float64_is_refused_in_one_line(
    small_snapshot: Path, tmp_path: Path, p: str
) -> None:
    for command in (["norm"], ["clip", "--max-norm", "1", "--out", str(tmp_path / "out")]):
        code, stdout, stderr = cli(command[0], str(small_snapshot), "-p", p, *command[1:])
        assert code == 2 and stdout == ""
        assert stderr == _beyond_float64(small_snapshot, p)
        assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("p", ["1e-300", "1e308", "0.01", "1e-400", "-1", "nan", "inf"])
def test_no_exception_escapes_for_any_p(small_snapshot: Path, p: str) -> None:
    code, stdout, stderr = cli("norm", str(small_snapshot), f"--norm-type={p}", "--json")
    if p in ("1e308", "inf"):
        assert code == 0, stderr
        largest = max(abs(value) for value in values_of(*small_grads()))
        assert json.loads(stdout)["total_norm"] == pytest.approx(largest, rel=1e-15)
    else:
        assert code == 2 and stdout == ""
        beyond = p in ("1e-300", "0.01")  # valid norm types whose norm leaves float64
        assert stderr == (_beyond_float64(small_snapshot, p) if beyond else _unsupported(p))

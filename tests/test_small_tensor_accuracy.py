"""L1 and L2 norms of small CPU tensors against float64, and the library against the CLI.

docs/library.md states the bounds: with the native kernel, every fp32/bf16/fp16 element's square
and |x| enter a float64 sum exactly, so a norm is float64's within its additions (under 1e-12
relative up to 1e8 elements); without it (``GRADSTAT_NATIVE=0``) a tensor of up to 65536
elements is summed in float64 throughout (the same bound), a larger one in fp32 rows (1e-6 for
random values; at most one 512-element row's fp32 sum, 511 x 2^-24, for values that round alike
in every row).
The bounds hold on any CPU: they do not depend on the vector width or the thread count.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

import gradstat
from gradstat.core import native
from gradstat.snapshot import save_rank
from tests._cli import run_gradstat
from tests._oracle import float64_norm, rel_err

# The bounds docs/library.md states (relative error against float64).
EXACT_BOUND = 1e-12
ROWS_BOUND = 1e-6
ONE_ROW_BOUND = 511 * 2.0**-24  # an fp32 sum of 512 terms, each addition rounded

SMALL_SIZES = [1, 2, 7, 100, 511, 512, 513, 4096, 65536]


@pytest.fixture(params=["kernel", "kernel-off"])
def kernel(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """The native kernel as built here, or turned off as ``GRADSTAT_NATIVE=0`` turns it off."""
    if request.param == "kernel":
        if native.native_library() is None:
            pytest.fail("the native kernel does not build here: these tests need a C compiler")
    else:
        monkeypatch.setattr(native, "_entry_point", lambda name: None)
    return str(request.param)


def _values(size: int, kind: str, dtype: torch.dtype) -> torch.Tensor:
    generator = torch.Generator().manual_seed(size)
    if kind == "randn":
        values = torch.randn(size, generator=generator)
    else:  # uniform positive: no cancellation of signs to hide an error
        values = torch.rand(size, generator=generator) + 1e-3
    return values.to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("kind", ["randn", "uniform"])
@pytest.mark.parametrize("size", SMALL_SIZES)
def test_small_tensors_are_float64s_within_the_bound(
    kernel: str, size: int, kind: str, dtype: torch.dtype
) -> None:
    grad = _values(size, kind, dtype)
    for p in (1.0, 2.0):
        expected = float64_norm([grad], p)
        assert rel_err(gradstat.total_norm([grad], p), expected) <= EXACT_BOUND, (p, kernel)


@pytest.mark.parametrize("kind", ["randn", "uniform"])
def test_many_small_tensors_together(kernel: str, kind: str) -> None:
    grads = [_values(size, kind, torch.float32) for size in SMALL_SIZES * 20]
    for p in (1.0, 2.0):
        assert rel_err(gradstat.total_norm(grads, p), float64_norm(grads, p)) <= EXACT_BOUND


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_large_tensors_within_their_bound(kernel: str, dtype: torch.dtype) -> None:
    # fp16 goes through the fp32 upcast buffer (into the kernel, or into fp32 rows without it).
    grads = [_values(size, "randn", dtype) for size in (65537, 300_001, 2_000_000)]
    bound = EXACT_BOUND if kernel == "kernel" else ROWS_BOUND
    for p in (1.0, 2.0):
        assert rel_err(gradstat.total_norm(grads, p), float64_norm(grads, p)) <= bound


def _grads() -> list[tuple[str, torch.Tensor]]:
    """A model's mix: many small tensors (biases, norms) and a few larger ones."""
    shapes = [(512,), (7,), (4096,), (96, 64), (1,), (513,), (300, 700), (65536,)] * 3
    generator = torch.Generator().manual_seed(15)
    return [
        (f"layer{index}.weight", torch.randn(shape, generator=generator) * 10.0 ** (index % 5))
        for index, shape in enumerate(shapes)
    ]


@pytest.mark.parametrize("p", ["1", "2"])
def test_the_library_and_the_cli_agree_within_the_bound(
    tmp_path: Path, kernel: str, p: str
) -> None:
    named = _grads()
    params = []
    for name, grad in named:
        param = torch.nn.Parameter(torch.zeros_like(grad))
        param.grad = grad
        params.append((name, param))
    save_rank(tmp_path / "snapshot", params, rank=0, world_size=1, coords={})
    environment = {"GRADSTAT_NATIVE": "1" if kernel == "kernel" else "0"}
    result = run_gradstat("norm", tmp_path / "snapshot", "-p", p, "--json", env=environment)
    assert result.returncode == 0, result.stderr
    from_cli = json.loads(result.stdout)["total_norm"]
    from_library = gradstat.total_norm([param for _, param in params], float(p))
    expected = float64_norm([grad for _, grad in named], float(p))
    # Every tensor here has at most 65536 elements but one: without the kernel, that one
    # (210,000 elements) is summed in rows in both.
    bound = EXACT_BOUND if kernel == "kernel" else ROWS_BOUND
    assert rel_err(from_library, expected) <= bound
    assert rel_err(from_cli, expected) <= bound
    assert rel_err(from_library, from_cli) <= 2 * bound
    assert math.isfinite(from_cli)


@pytest.mark.parametrize("value", [0.001, 0.1, 0.7, 3.3])
def test_values_that_round_alike_in_every_row_keep_one_rows_bound(
    kernel: str, value: float
) -> None:
    """Without the kernel a large tensor's fp32 rows all round the same way when its values are
    equal: the error does not average out (a constant 0.001 over 1e5 elements: 5.9e-6, against
    the 4e-8 of random values), and stays within one row's fp32 sum."""
    grad = torch.full((100_000,), value)
    for p in (1, 2):
        error = rel_err(gradstat.get_grad_norm_fp32([grad], p), float64_norm([grad], p))
        assert error <= (EXACT_BOUND if kernel == "kernel" else ONE_ROW_BOUND), (p, error)

"""Complex gradients (a complex64 parameter: a learned spectral filter, an SSM's complex state
matrix) in snapshots: the flight recorder kept no snapshot of a job with one ("complex64 is not
supported", the training going on without it), and a snapshot holding one could not be read.
Their statistics are those of the elements' magnitudes |z|, as PyTorch's norms take a complex
tensor; ``compare`` and ``audit`` compare them as complex numbers, imaginary parts included.

The expected values are Python's own complex arithmetic: ``abs(z)`` in float64."""

from __future__ import annotations

import json
import math
import struct
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

import gradstat
from gradstat.recorder import complete_snapshots
from gradstat.snapshot import Snapshot, save_rank
from tests._cli import run_gradstat
from tests._params import param_with


class _Filter(torch.nn.Module):
    def __init__(self, dtype: torch.dtype) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(4, 3)
        self.spectrum = torch.nn.Parameter(torch.zeros(6, dtype=dtype))


def _magnitudes(grads: list[torch.Tensor]) -> list[float]:
    return [abs(complex(value)) for grad in grads for value in grad.reshape(-1).tolist()]


def _norm(magnitudes: list[float], p: float) -> float:
    if p == math.inf:
        return max(magnitudes)
    return math.fsum(m**p for m in magnitudes) ** (1.0 / p)


def _json(*args: str | Path) -> dict:
    done = run_gradstat(*args, "--json")
    assert done.returncode == 0, done.stdout + done.stderr
    found: dict = json.loads(done.stdout)
    return found


@pytest.mark.parametrize("dtype", [torch.complex64, torch.complex128])
def test_the_recorder_keeps_a_snapshot_of_a_complex_gradient(
    tmp_path: Path, dtype: torch.dtype
) -> None:
    """complex128, which safetensors has no dtype for, is kept as its real view (float64
    pairs, readable by any safetensors reader): its snapshot was lost too."""
    model = _Filter(dtype)
    recorder = gradstat.Recorder(model, tmp_path / "run", spike=None, steps=[2])
    gen = torch.Generator().manual_seed(3)
    kept: list[torch.Tensor] = []
    for step in (1, 2, 3):
        for param in model.parameters():
            param.grad = torch.randn(param.shape, dtype=param.dtype, generator=gen)
        model.spectrum.grad[2] = 0  # type: ignore[index]
        model.spectrum.grad[4] = complex(0.0, -2.5)  # type: ignore[index]
        grads = [param.grad.clone() for param in model.parameters() if param.grad is not None]
        if step == 2:
            kept = grads
        found = recorder.step(step)
        assert math.isclose(found, _norm(_magnitudes(grads), 2.0), rel_tol=1e-12)
    recorder.wait()
    ((step, snapshot),) = complete_snapshots(tmp_path / "run")
    assert step == 2
    magnitudes = _magnitudes(kept)
    for p in ("2", "1", "inf"):
        report = _json("norm", snapshot, "-p", p)
        expected = _norm(magnitudes, float(p))
        assert math.isclose(report["total_norm"], expected, rel_tol=1e-12), (p, report)
        assert report["recorded_norm_differs"] is False
    assert _json("zeros", snapshot)["num_zeros"] == magnitudes.count(0.0) == 1
    assert _json("audit", snapshot)["findings"] == []
    clipped = tmp_path / "clipped"
    before = {path.name: path.read_bytes() for path in snapshot.iterdir()}
    done = run_gradstat("clip", snapshot, "--max-norm", "1", "--out", clipped)
    assert done.returncode == 0, done.stderr
    assert {path.name: path.read_bytes() for path in snapshot.iterdir()} == before
    # Scaled in its dtype: each element within its rounding of its scaled value.
    assert math.isclose(_json("norm", clipped)["total_norm"], 1.0, rel_tol=1e-6)
    with safe_open(next(snapshot.iterdir()), "pt") as file:
        stored = file.get_tensor("spectrum")
    if dtype == torch.complex128:  # the real view: real and imaginary parts, in float64
        assert stored.dtype == torch.float64 and stored.shape == (6, 2)
        stored = torch.view_as_complex(stored)
    assert torch.equal(stored, kept[0])  # the module's own parameter, listed first


def _replicas(folder: Path, second: torch.Tensor) -> None:
    """Two DP ranks of one complex gradient: rank 0's the values below, rank 1's ``second``."""
    for rank, grad in enumerate((_VALUES, second)):
        param = param_with(grad.clone(), tensor_model_parallel=False)
        save_rank(folder, [("spectrum", param)], rank=rank, world_size=2, coords={"dp": [rank, 2]})


_VALUES = torch.tensor([3 + 4j, 0j, -1j, 0.5 - 0.25j], dtype=torch.complex64)


@pytest.mark.parametrize("change", [complex(0.0, 0.5), complex(0.5, 0.0)])
def test_compare_and_audit_see_a_difference_in_either_part(tmp_path: Path, change: complex) -> None:
    """A difference in the imaginary part alone was a difference of zero to ``compare`` (its
    float64 widening kept the real parts) and no finding to ``audit``."""
    changed = _VALUES.clone()
    changed[3] += change
    _replicas(tmp_path / "same", _VALUES)
    _replicas(tmp_path / "changed", changed)
    magnitudes = _magnitudes([_VALUES])
    assert math.isclose(_json("norm", tmp_path / "same")["total_norm"], _norm(magnitudes, 2.0))
    # compare: the counted copy (rank 0's) of one snapshot against the other's.
    _replicas(tmp_path / "first_changed", _VALUES)
    save_rank(
        tmp_path / "first_changed",
        [("spectrum", param_with(changed.clone(), tensor_model_parallel=False))],
        rank=0,
        world_size=2,
        coords={"dp": [0, 2]},
        overwrite=True,
    )
    done = run_gradstat("compare", tmp_path / "same", tmp_path / "first_changed", "--json")
    assert done.returncode == 1, done.stderr
    (param,) = json.loads(done.stdout)["params"]
    assert "values" in param["flags"], param
    assert param["max_abs_diff"] == pytest.approx(abs(change), rel=1e-6)
    # audit: the replicas of one snapshot disagree.
    done = run_gradstat("audit", tmp_path / "changed", "--json")
    assert done.returncode == 1, done.stderr
    (finding,) = json.loads(done.stdout)["findings"]
    assert (finding["kind"], finding["name"]) == ("dp_replicas_differ", "spectrum"), finding
    assert finding["max_abs_diff"] == pytest.approx(abs(change), rel=1e-6)
    miscounted = _norm(_magnitudes([changed]), 2.0)  # had rank 1's copy been counted
    assert finding["norm_if_miscounted"] == pytest.approx(miscounted, rel=1e-12)
    assert _json("audit", tmp_path / "same")["findings"] == []


def _one_rank(folder: Path, values: list[complex], dtype: torch.dtype = torch.complex64) -> None:
    grad = torch.tensor(values, dtype=dtype)
    param = param_with(grad, tensor_model_parallel=False)
    save_rank(folder, [("z", param)], rank=0, world_size=1, coords={})


def _two_replicas(
    folder: Path, first: list[complex], second: list[complex], dtype: torch.dtype
) -> None:
    for rank, values in enumerate((first, second)):
        param = param_with(torch.tensor(values, dtype=dtype), tensor_model_parallel=False)
        save_rank(folder, [("z", param)], rank=rank, world_size=2, coords={"dp": [rank, 2]})


NAN, INF = math.nan, math.inf


@pytest.mark.parametrize(
    ("a", "b", "expected"),
    [
        # A NaN in the same part on both sides hid the other part's difference (it read 0).
        ([1 + 1j, complex(2, NAN)], [1 + 1j, complex(7, NAN)], 5.0),
        # The same infinity on both sides: the other part's difference (inf - inf was NaN).
        ([complex(INF, 2), 1 + 1j], [complex(INF, 2), 1 + 3j], 2.0),
        # A NaN in one part on one side only: a NaN difference, flagged.
        ([complex(NAN, 1), 0j], [complex(1, NAN), 0j], NAN),
    ],
)
@pytest.mark.parametrize("dtype", [torch.complex64, torch.complex128])
def test_differences_are_taken_part_by_part(
    tmp_path: Path, a: list[complex], b: list[complex], expected: float, dtype: torch.dtype
) -> None:
    _one_rank(tmp_path / "a", a, dtype)
    _one_rank(tmp_path / "b", b, dtype)
    done = run_gradstat("compare", tmp_path / "a", tmp_path / "b", "--json")
    assert done.returncode == 1, done.stderr
    (param,) = json.loads(done.stdout)["params"]
    assert "values" in param["flags"], param
    found = float(param["max_abs_diff"])  # JSON's NaN is the string "nan"
    assert math.isnan(found) if math.isnan(expected) else found == expected, param
    _two_replicas(tmp_path / "replicas", a, b, dtype)
    done = run_gradstat("audit", tmp_path / "replicas", "--json")
    assert done.returncode == 1, done.stderr
    kinds = [
        (finding["kind"], finding["max_abs_diff"])
        for finding in json.loads(done.stdout)["findings"]
    ]
    assert len(kinds) == 1 and kinds[0][0] == "dp_replicas_differ", kinds
    found = float(kinds[0][1])
    assert math.isnan(found) if math.isnan(expected) else found == expected


def test_a_real_infinity_on_both_sides_hides_no_difference(tmp_path: Path) -> None:
    """The same for real gradients: an infinity in both copies made the scale of the
    elementwise tolerance infinite, and replicas differing elsewhere had no finding (and
    compare read the difference as NaN)."""
    first, second = [INF, -2.0, 0.0, 4.0], [INF, -2.0, 0.0, 5.0]
    for rank, values in enumerate((first, second)):
        param = param_with(torch.tensor(values), tensor_model_parallel=False)
        save_rank(
            tmp_path / "dp", [("w", param)], rank=rank, world_size=2, coords={"dp": [rank, 2]}
        )
    done = run_gradstat("audit", tmp_path / "dp", "--json")
    assert done.returncode == 1, done.stderr
    (finding,) = json.loads(done.stdout)["findings"]
    assert finding["kind"] == "dp_replicas_differ" and finding["max_abs_diff"] == 1.0, finding
    assert finding["rel_diff"] == pytest.approx(1.0 / 5.0)  # against the largest finite |x|
    for name, values in (("a", first), ("b", second)):
        _one_rank(tmp_path / name, values, torch.float32)
    done = run_gradstat("compare", tmp_path / "a", tmp_path / "b", "--json")
    assert done.returncode == 1, done.stderr
    (param,) = json.loads(done.stdout)["params"]
    assert param["max_abs_diff"] == 1.0 and "values" in param["flags"], param


def test_a_complex_element_is_infinite_where_a_part_is(tmp_path: Path) -> None:
    """inf + NaN j has |z| = inf: one infinite element, no NaN (it was counted as both); 1 + NaN j
    is the NaN, and the norm's."""
    _one_rank(tmp_path / "e", [complex(INF, NAN), complex(1, NAN), 1 + 1j, 0j])
    report = _json_any("norm", tmp_path / "e")
    assert math.isnan(float(report["total_norm"]))
    assert [(row["nan"], row["inf"]) for row in report["nonfinite"]] == [(1, 1)]


def _json_any(*args: str | Path) -> dict:
    done = run_gradstat(*args, "--json")
    assert done.returncode in (0, 1), done.stdout + done.stderr
    found: dict = json.loads(done.stdout)
    return found


def test_complex_gtp_padding_that_is_not_zero_is_measured_in_float64(tmp_path: Path) -> None:
    """The padding rows of a GTP shard holding a value: its |z| was taken in complex64's
    float32 (1.4142135381698608 for 1 + 1j; inf for 3e38 + 3e38j)."""
    from gradstat import AxisPlace

    for value in (1 + 1j, complex(3e38, 3e38)):
        folder = tmp_path / str(value)
        padded = torch.cat([torch.full((5, 2), 0.5 + 0.5j), torch.zeros(3, 2)]).to(torch.complex64)
        padded[7, 1] = value
        for rank in range(2):
            shard = param_with(
                padded.chunk(2)[rank].clone(),
                is_gtp_weight_remat=True,
                pad_length=3,
                group=AxisPlace(rank, 2),
            )
            coords = {"gtp": [rank, 2]}
            save_rank(folder, [("w", shard)], rank=rank, world_size=2, coords=coords, step=1)
        done = run_gradstat("audit", folder, "--json")
        assert done.returncode == 1, done.stderr
        (finding,) = json.loads(done.stdout)["findings"]
        assert finding["kind"] == "gtp_padding_nonzero", finding
        stored = complex(padded[7, 1].item())  # the complex64 value, parts widened exactly
        assert float(finding["max_abs_diff"]) == abs(stored)  # Python's float64 |z|


@pytest.mark.parametrize(
    "stored",
    [
        torch.zeros(8, dtype=torch.float64),  # the right bytes in the wrong shape
        torch.zeros(4, 2, dtype=torch.float32),
        torch.zeros(4, dtype=torch.complex64),
    ],
)
def test_a_complex128_record_whose_tensor_is_not_its_real_view_is_refused(
    tmp_path: Path, stored: torch.Tensor
) -> None:
    _one_rank(tmp_path / "good", [3 + 4j, 0j, -1j, 2j], torch.complex128)
    (path,) = (tmp_path / "good").iterdir()
    with safe_open(path, "pt") as file:
        metadata = file.metadata()
    bad = tmp_path / "bad"
    bad.mkdir()
    save_file({"z": stored}, bad / path.name, metadata=metadata)
    done = run_gradstat("norm", bad)
    assert done.returncode != 0 and done.stdout == "", done.stdout
    (line,) = done.stderr.splitlines()
    assert str(bad / path.name) in line and "'z'" in line, line
    assert "complex128[4] (kept as float64[4, 2])" in line, line


def test_a_complex128_tensor_on_an_8_byte_boundary_is_read_aligned(tmp_path: Path) -> None:
    """safetensors aligns a tensor's bytes to 8 at most; a complex128 view at an address that
    is not a multiple of 16 faulted (SIGSEGV in ``compare`` of a TP x EP snapshot written by
    gradstat, which now aligns them to 16 itself): it is read into memory of its own."""
    values = torch.tensor([3 + 4j, -1j, 0.5 + 0j], dtype=torch.complex128)
    _one_rank(tmp_path / "good", values.tolist(), torch.complex128)
    (good,) = (tmp_path / "good").iterdir()
    with safe_open(good, "pt") as file:
        metadata, real_view = file.metadata(), file.get_tensor("z")
    header = json.loads(metadata["gradstat"])
    for count in (1, 2, 3):  # a float64 tensor before it, of a size that leaves it misaligned
        header["params"] = [  # "a" is first in the file too (safetensors orders by name)
            {
                **header["params"][0],
                "name": "a",
                "dtype": "float64",
                "shape": [count],
                "param_shape": [count],
            },
            header["params"][-1],
        ]
        bad = tmp_path / f"before-{count}"
        bad.mkdir()
        tensors = {"a": torch.ones(count, dtype=torch.float64), "z": real_view}
        save_file(tensors, bad / good.name, metadata={"gradstat": json.dumps(header)})
        (length,) = struct.unpack("<Q", (bad / good.name).read_bytes()[:8])
        if (8 + length + 8 * count) % 16:  # z's bytes begin at 8 modulo 16 in the file
            break
    else:
        pytest.fail("no float64 tensor size left the complex128 one misaligned")
    files = Snapshot.open(bad).files
    with files[0].tensors() as tensors:
        read = tensors["z"]
        assert read.data_ptr() % 16 == 0
        assert torch.equal(read, values)
    done = run_gradstat("compare", tmp_path / "good", bad, "--json")
    assert done.returncode == 1, done.stderr  # only in A: "a"
    (z,) = [param for param in json.loads(done.stdout)["params"] if param["name"] == "z"]
    assert z["max_abs_diff"] == 0.0 and z["flags"] == [], z


@pytest.mark.parametrize("dtype", [torch.complex64, torch.complex128])
@pytest.mark.parametrize("identical", [False, True])
def test_audit_compares_complex_tp_shards_bit_for_bit(
    tmp_path: Path, dtype: torch.dtype, identical: bool
) -> None:
    """A TP-sharded complex128 weight crashed audit (KeyError from its 16-byte elements)."""
    shards = [torch.tensor([1 + 2j, -3j], dtype=dtype), torch.tensor([1 + 2j, -3j], dtype=dtype)]
    if not identical:
        shards[1][1] = complex(0.0, -3.5)  # the imaginary part alone differs
    for rank, shard in enumerate(shards):
        param = param_with(shard, tensor_model_parallel=True, partition_dim=0)
        save_rank(tmp_path, [("w", param)], rank=rank, world_size=2, coords={"tp": [rank, 2]})
    done = run_gradstat("audit", tmp_path, "--json")
    assert done.returncode == (1 if identical else 0), done.stderr
    findings = json.loads(done.stdout)["findings"]
    if not identical:
        assert findings == []
        return
    (finding,) = findings
    assert finding["kind"] == "tp_shards_identical", finding
    once = _norm(_magnitudes([shards[0]]), 2.0)  # the weight counted once, as replicated
    assert finding["norm_if_miscounted"] == pytest.approx(once, rel=1e-12)

"""The core on CUDA tensors, where a GPU exists; skipped cleanly elsewhere."""

from __future__ import annotations

import math
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest
import torch

from gradstat import clip_grad_by_total_norm_fp32, count_zeros_fp32, get_grad_norm_fp32
from gradstat.analysis import stats
from gradstat.analysis.stats import snapshot_stats
from gradstat.core import staging
from gradstat.snapshot import Snapshot
from tests._cli import SAMPLE_DATA, run_gradstat
from tests._oracle import float64_norm, rel_err, zeros_in
from tests._params import param_with

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@pytest.mark.parametrize("norm_type", [2, 1, 3, math.inf])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_norm_on_cuda_matches_float64(norm_type: float, dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(0)
    cpu_grads = [torch.randn(shape, generator=gen).to(dtype) for shape in [(2000, 999), (5,)]]
    cuda_grads = [grad.cuda() for grad in cpu_grads]
    expected = float64_norm(cpu_grads, norm_type)
    got = get_grad_norm_fp32(cuda_grads, norm_type)
    if norm_type == math.inf:
        assert got == expected
    else:
        assert rel_err(got, expected) <= 1e-6


def test_l2_of_1e8_cuda_elements_within_1e6() -> None:
    gen = torch.Generator().manual_seed(1)
    grad = torch.randn(100_000_003, generator=gen)
    expected = float64_norm([grad], 2)
    assert rel_err(get_grad_norm_fp32([grad.cuda()]), expected) <= 1e-6


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_nan_and_inf_reach_every_cuda_norm(dtype: torch.dtype) -> None:
    """Many CUDA tensors (the multi-tensor path): a NaN anywhere makes every norm NaN."""
    grads = [torch.randn(1000 + index, device="cuda").to(dtype) for index in range(40)]
    grads[17][123] = math.nan
    for norm_type in (2, 1, math.inf):
        assert math.isnan(get_grad_norm_fp32(grads, norm_type))
    grads[17][123] = math.inf
    assert get_grad_norm_fp32(grads, math.inf) == math.inf
    assert get_grad_norm_fp32(grads, 2) == math.inf


def test_count_zeros_and_clip_on_cuda() -> None:
    grad = torch.randn(3000, 7)
    grad[::5] = 0.0
    param = param_with(grad.cuda())
    assert count_zeros_fp32([param], None) == zeros_in([grad])
    clip_grad_by_total_norm_fp32([param], 1.0, 10.0)
    assert param.grad.device.type == "cuda"
    torch.testing.assert_close(param.grad.cpu().double(), grad.double() / (10.0 + 1e-6))


def test_nccl_single_rank_reduction(tmp_path: Path) -> None:
    """A one-rank NCCL group: statistics travel as CUDA tensors and come back as floats."""
    script = textwrap.dedent(
        f"""
        import torch, torch.distributed as dist
        from gradstat import get_grad_norm_fp32, count_zeros_fp32
        dist.init_process_group("nccl", init_method="file://{tmp_path}/rdzv", rank=0,
                                world_size=1)
        torch.cuda.set_device(0)
        grad = torch.full((1000,), 2.0, device="cuda")
        grad[:10] = 0
        param = torch.nn.Parameter(torch.zeros_like(grad))
        param.grad = grad
        print(get_grad_norm_fp32([grad], 2, dist.group.WORLD), count_zeros_fp32([param], None))
        print(get_grad_norm_fp32([], 2, None))
        dist.destroy_process_group()
        """
    )
    result = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=300, check=False
    )
    assert result.returncode == 0, result.stderr
    first, second = result.stdout.split("\n")[:2]
    norm, zeros = first.split()
    # CUDA tensors are reduced as fp32 partials combined in float64: within the 1e-6 promised.
    assert float(norm) == pytest.approx(math.sqrt(990 * 4.0), rel=1e-6)
    assert float(zeros) == 10.0
    assert float(second) == 0.0


def _cli_json(args: list[str], device: str, status: int = 0) -> Any:
    """The CLI's JSON document for ``args`` on ``device``, which must exit with ``status`` (1:
    findings)."""
    import json

    result = run_gradstat(*args, "--json", "--device", device)
    assert result.returncode == status, result.stderr
    return json.loads(result.stdout)


def test_cli_on_cuda_prints_what_cpu_prints() -> None:
    """--device cuda reduces each tensor on the GPU; the numbers match the CPU's to 1e-6."""

    sample = SAMPLE_DATA / "gtp2-pp2-dp2-ep2"
    reports = {}
    for device in ("cpu", "cuda"):
        reports[device] = _cli_json(["norm", str(sample)], device)
    assert rel_err(reports["cuda"]["total_norm"], reports["cpu"]["total_norm"]) <= 1e-6
    cpu_rows = {row["name"]: row["norm"] for row in reports["cpu"]["params"]}
    for row in reports["cuda"]["params"]:
        assert math.isclose(row["norm"], cpu_rows[row["name"]], rel_tol=1e-6, abs_tol=1e-12)


def test_compare_and_audit_on_cuda_find_what_cpu_finds() -> None:

    samples = SAMPLE_DATA
    runs = {
        "compare": [str(samples / "tp2-pp2-dp2-ep2-distopt"), str(samples / "gtp2-pp2-dp2-ep2")],
        "audit": [str(samples / "tp2-pp2-dp2-ep2-distopt-nan")],
    }
    for command, inputs in runs.items():
        reports = {}
        for device in ("cpu", "cuda"):
            # audit exits 1 for its finding, on either device.
            reports[device] = _cli_json([command, *inputs], device, int(command == "audit"))
        cpu, cuda = reports["cpu"], reports["cuda"]
        if command == "compare":
            assert cuda["mismatches"] == cpu["mismatches"] == []
            for got, want in zip(cuda["params"], cpu["params"], strict=True):
                assert got["max_abs_diff"] == want["max_abs_diff"] == 0.0
                assert math.isclose(got["norm_a"], want["norm_a"], rel_tol=1e-6, abs_tol=1e-12)
        else:
            # The sample's one finding: the expert no token reaches.
            assert cuda["findings"] == cpu["findings"]
            assert [finding["kind"] for finding in cpu["findings"]] == ["expert_never_routed"]


def test_pinned_staging_moves_every_byte_to_the_gpu() -> None:
    """Tensors of every shape and dtype through two 4 KiB pinned buffers (so that most
    transfers wait for a buffer) and through the default ones: bitwise what was sent, though
    the sources are overwritten as soon as the call returns."""
    gen = torch.Generator().manual_seed(3)
    sources = [
        torch.randn(3, 5, generator=gen),
        torch.randn(7000, generator=gen).to(torch.bfloat16),
        torch.tensor(2.5, dtype=torch.float64),
        torch.empty(0, 4),
        torch.randn(333, generator=gen).half(),
        torch.rand(11, generator=gen) > 0.5,
        torch.randn(2, 60_000, generator=gen),
        torch.randn(400, 3, generator=gen).t(),
        torch.randn(20_000_001, generator=gen),  # 80 MB: several default windows
    ]
    sources[0][1, 2] = math.nan
    device = torch.device("cuda")
    for stage in (
        staging.Staging(device, staging.CudaLink(device), 4096, 2),
        staging.Staging(device, staging.CudaLink(device)),
    ):
        kept = [tensor.clone() for tensor in sources]
        arrived = stage.to_device(sources)
        for tensor in sources:
            if tensor.numel() and tensor.dtype != torch.bool:
                tensor.fill_(7)
        for got, want in zip(arrived, kept, strict=True):
            assert got.device.type == "cuda" and got.dtype == want.dtype
            assert got.shape == want.shape
            assert torch.equal(
                got.cpu().reshape(-1).view(torch.uint8), want.reshape(-1).view(torch.uint8)
            )
        sources = kept


def test_snapshot_stats_through_small_staging_buffers_and_runs_equal_the_cpus(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    def small(device: torch.device) -> staging.Staging:
        return staging.Staging(device, staging.CudaLink(device), 4096, 2)

    monkeypatch.setattr(staging, "_staging", small)
    monkeypatch.setattr(stats, "RUN_BYTES", 8192)  # a few tensors on the device at a time
    for sample in ("gtp2-pp2-dp2-ep2", "tp2-pp2-dp2-ep2-distopt-nan"):
        snapshot = Snapshot.open(SAMPLE_DATA / sample)
        norm_types = (2.0, 1.0, math.inf)
        cpu = snapshot_stats(snapshot, norm_types)
        cuda = snapshot_stats(snapshot, norm_types, device="cuda")
        assert cuda.nonfinite == cpu.nonfinite
        for got, want in zip(cuda.params, cpu.params, strict=True):
            assert (got.name, got.numel, got.zeros, got.pad_zeros) == (
                want.name,
                want.numel,
                want.zeros,
                want.pad_zeros,
            )
            assert got.max_abs == want.max_abs or (
                math.isnan(got.max_abs or 0.0) and math.isnan(want.max_abs or 0.0)
            )
            for p in (2.0, 1.0):
                assert math.isclose(got.norms[p], want.norms[p], rel_tol=1e-6, abs_tol=1e-12) or (
                    math.isnan(got.norms[p]) and math.isnan(want.norms[p])
                )


def _training_grads(count: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(7)
    return [torch.randn(1000 + 37 * index, generator=gen).cuda() for index in range(count)]


def test_repeated_calls_replay_a_graph_that_sees_each_steps_values() -> None:
    """A training loop's pattern: the same gradients every step, new values in place."""
    from gradstat.core import kernels

    grads = _training_grads(300)
    for step in range(6):
        for grad in grads:
            grad.mul_(1.5 if step % 2 else 0.5)
        grads[step * 11].zero_()
        expected = float64_norm([grad.cpu() for grad in grads], 2)
        assert rel_err(get_grad_norm_fp32(grads, 2), expected) <= 1e-6
        l1 = float64_norm([grad.cpu() for grad in grads], 1)
        assert rel_err(get_grad_norm_fp32(grads, 1), l1) <= 1e-6
    assert get_grad_norm_fp32(grads, 1) == get_grad_norm_fp32(grads, 1)
    plans = list(kernels._CUDA_PLANS.plans.values())
    assert any(plan.graph is not None for plan in plans), "the same list twice replays a graph"
    # Faults in place reach the replayed graph: NaN, inf, all zero, tiny values.
    grads[5][3] = math.nan
    assert math.isnan(get_grad_norm_fp32(grads, 2))
    grads[5][3] = math.inf
    assert get_grad_norm_fp32(grads, 2) == math.inf
    for grad in grads:
        grad.zero_()
    assert get_grad_norm_fp32(grads, 2) == 0.0
    grads[9][0], grads[200][1] = 3e-30, 4e-30
    assert rel_err(get_grad_norm_fp32(grads, 2), 5e-30) <= 1e-6


def test_a_changed_or_freed_list_is_not_replayed() -> None:
    from gradstat.core import kernels

    def check(grads: list[torch.Tensor]) -> None:
        expected = float64_norm([grad.cpu() for grad in grads], 2)
        assert rel_err(get_grad_norm_fp32(grads, 2), expected) <= 1e-6

    grads = _training_grads(50)
    for _ in range(3):
        check(grads)
    check(grads[:-1])
    grads[1].data = torch.zeros_like(grads[1])  # the same object, another storage
    check(grads)
    check(grads)
    swapped = list(grads)
    swapped[0] = torch.full_like(grads[0], 2.0)
    check(swapped)
    check(swapped)
    key = (2, *map(id, swapped))
    assert key in kernels._CUDA_PLANS.plans
    del swapped
    assert key not in kernels._CUDA_PLANS.plans, "a freed gradient drops the plan"


def test_a_prepared_grad_norm_follows_the_gradients_step_by_step() -> None:
    from gradstat import GradNorm

    grads = _training_grads(200)
    norm, l1 = GradNorm(grads), GradNorm(grads, 1)
    for step in range(5):
        for grad in grads:
            grad.mul_(0.5 + step)
        cpu = [grad.cpu() for grad in grads]
        assert rel_err(norm(), float64_norm(cpu, 2)) <= 1e-6
        assert rel_err(l1(), float64_norm(cpu, 1)) <= 1e-6
    grads[3].data = torch.full_like(grads[3], 7.0)  # a replaced storage is read, not the old one
    assert rel_err(norm(), float64_norm([grad.cpu() for grad in grads], 2)) <= 1e-6
    grads[0][0] = math.nan
    assert math.isnan(norm())
    grads[0][0] = math.inf
    assert norm() == math.inf
    for grad in grads:
        grad.zero_()
    assert norm() == 0.0
    grads[1][2] = 1e-200 if grads[1].dtype == torch.float64 else 1e-30
    assert rel_err(norm(), float(grads[1][2])) <= 1e-6


def test_a_gradient_viewed_anew_at_its_address_is_read_anew() -> None:
    """Fewer elements, or another dtype, at the same address: a captured graph would read the old
    ones; the library's plans and GradNorm read what the gradient is now."""
    from gradstat import GradNorm

    grads = [grad.to(torch.bfloat16) for grad in _training_grads(40)]
    norm = GradNorm(grads)
    for change in (
        lambda grad: setattr(grad, "data", grad.data[:500]),
        lambda grad: setattr(grad, "data", grad.data.view(torch.float16)),
        lambda grad: grad.resize_(10),
    ):
        for _ in range(3):  # captured, then replayed
            expected = float64_norm([grad.cpu() for grad in grads], 2)
            assert rel_err(get_grad_norm_fp32(grads, 2), expected) <= 1e-6
            assert rel_err(norm(), expected) <= 1e-6
        address = grads[7].data_ptr()
        change(grads[7])
        assert grads[7].data_ptr() == address
        expected = float64_norm([grad.cpu() for grad in grads], 2)
        assert rel_err(get_grad_norm_fp32(grads, 2), expected) <= 1e-6
        assert rel_err(norm(), expected) <= 1e-6


def test_the_recorders_per_parameter_telemetry_on_cuda_equals_float64(tmp_path: Path) -> None:
    """The recorder on a CUDA model: each parameter's L2, max |x|, zeros and NaN count, and the
    norm taken from them, against float64 of the gradients copied to the CPU (to the 1e-6
    promised on CUDA: a tensor's sum of squares there is an fp32 partial)."""
    import gradstat

    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 8)
    ).cuda()
    recorder = gradstat.Recorder(model, tmp_path, spike=None)
    for step in range(1, 5):
        model.zero_grad()
        model(torch.randn(32, 64, device="cuda")).square().mean().backward()
        if step == 3:
            model[0].weight.grad[0, 0] = math.nan
        norm = recorder.step(step)
        grads = {name: param.grad.cpu() for name, param in model.named_parameters()}
        params = recorder.params
        assert params is not None
        for index, name in enumerate(params.layout.names):
            grad = grads[name]
            expected = float64_norm([grad], 2)
            got = params.norms[index]
            assert got is not None
            if math.isnan(expected):
                assert math.isnan(got) and params.nan[index] == 1
            else:
                assert rel_err(got, expected) <= 1e-6
                assert params.max_abs[index] == float(grad.abs().max())
            assert params.zeros[index] == zeros_in([grad])
        total = float64_norm(list(grads.values()), 2)
        assert math.isnan(norm) if math.isnan(total) else rel_err(norm, total) <= 1e-6

"""PyTorch-native jobs, for real: FSDP2, HSDP, TP x FSDP2 (with and without SequenceParallel)
and DDP on 4 gloo processes, one training step each, captured and measured by the README's own
recipes. Every number is held against float64 statistics of the full gradients the job holds
(``full_tensor()``), each logical parameter once, computed without gradstat.
"""

from __future__ import annotations

import itertools
import json
import math
from pathlib import Path
from typing import Any

import pytest
import torch
from typer.testing import CliRunner

from gradstat.cli import app
from gradstat.testing import Case, LaunchReport, launch
from tests import _torch_native as native
from tests._cli import recipe, run_gradstat
from tests._oracle import rel_err

pytestmark = [pytest.mark.multiprocess, pytest.mark.slow]

MAX_NORM = 0.5  # below every job's norm (about 6.3): clipping scales
REL = 1e-6
# Where PyTorch's own clip_grad_norm_ works: every DTensor on one mesh (or none).
PYTORCH_CLIPS = ("fsdp2", "hsdp", "tp_sp_fsdp2", "hsdp_tp_sp", "ddp")
# Where get_grad_norm_fp32 with the default group sees every copy through placements alone.
MEGATRON_API_EXACT = ("fsdp2", "hsdp", "tp_sp_fsdp2", "hsdp_tp_sp")
PLANTED = "hsdp-planted"
# FSDP2's snapshot again, with one element of rank 1's Shard(0) piece of this weight changed.
PLANTED_SHARD, SHARD_PARAM, SHARD_VALUE = (
    "fsdp2-planted-shard",
    "layers.0.attention.wq.weight",
    3.25,
)


def _full(grad: torch.Tensor) -> torch.Tensor:
    full = grad.full_tensor() if hasattr(grad, "full_tensor") else grad
    return full.detach().double()


def _run_job(rank: int, world_size: int, arg: tuple[str, str]) -> dict[str, Any]:
    """One job on this rank: truth, the live API, the README recipes, PyTorch's clip."""
    import torch.distributed as dist

    import gradstat
    from gradstat.snapshot import save_rank

    job, root = arg
    model, mesh = native.train_step(job)
    full = native.full_gradients(model)
    truth = native.float64_stats(full)
    params = list(model.parameters())
    grads = [param.grad for param in params if param.grad is not None]
    result: dict[str, Any] = {"truth": truth}
    # A DTensor's unreduced local norm: this rank's shards alone (explain's rank_R_local).
    local = [grad.to_local() if hasattr(grad, "to_local") else grad for grad in grads]
    result["local_l2"] = math.sqrt(math.fsum(float(g.double().square().sum()) for g in local))
    if job in MEGATRON_API_EXACT:
        result["megatron_api"] = {
            str(p): gradstat.get_grad_norm_fp32(grads, p) for p in (2.0, 1.0, math.inf)
        }
        result["megatron_zeros"] = gradstat.count_zeros_fp32(params, None)
    result["l1"] = gradstat.total_norm(params, 1.0)
    # The README's capture recipe, then the lower-level call with only a dp coordinate.
    exec(recipe("capture"), {"directory": f"{root}/{job}", "model": model, "step": 3})
    named = [(native.logical_name(name), param) for name, param in model.named_parameters()]
    save_rank(f"{root}/{job}-save", named, rank=rank, world_size=world_size,
              coords={"dp": [rank, world_size]}, step=3)  # fmt: skip
    if job == "fsdp2":
        local = dict(model.named_parameters())[SHARD_PARAM].grad.to_local()
        old = float(local[0, 0])
        if rank == 1:
            local[0, 0] = SHARD_VALUE
        exec(recipe("capture"), {"directory": f"{root}/{PLANTED_SHARD}", "model": model, "step": 3})
        if rank == 1:
            local[0, 0] = old
        result["planted_shard_old"] = old
    # The README's live recipe: norm, inf norm, zeros, clip in place.
    namespace: dict[str, Any] = {"model": model, "max_norm": MAX_NORM}
    exec(recipe("live"), namespace)
    result.update(norm=namespace["norm"], norm_inf=namespace["norm_inf"], zeros=namespace["zeros"])
    coefficient = MAX_NORM / (truth["l2"] + 1e-6)
    worst = 0.0
    for name, param in model.named_parameters():
        expected = full[native.logical_name(name)] * coefficient
        difference = float((_full(param.grad) - expected).abs().max())
        worst = max(worst, difference / max(float(expected.abs().max()), 1e-30))
    result["clip_error"] = worst
    if job in PYTORCH_CLIPS:
        theirs, _ = native.train_step(job)
        torch.nn.utils.clip_grad_norm_(theirs.parameters(), MAX_NORM)
        ours = dict(model.named_parameters())
        worst = 0.0
        for name, param in theirs.named_parameters():
            a, b = _full(ours[name].grad), _full(param.grad)
            worst = max(worst, float((a - b).abs().max()) / max(float(b.abs().max()), 1e-30))
        result["vs_pytorch_clip"] = worst
    if job == "hsdp":
        # A Replicate copy that differs: dp_replicate rank 1 holds another value.
        planted = dict(model.named_parameters())["norm.weight"].grad
        if mesh.get_local_rank("dp_replicate") == 1:
            planted.to_local().mul_(1.5)
        exec(recipe("capture"), {"directory": f"{root}/{PLANTED}", "model": model, "step": 3})
    dist.barrier()
    return result


JOB_DIRS = (*native.JOBS, *(f"{job}-save" for job in native.JOBS))


@pytest.fixture(scope="module")
def jobs(tmp_path_factory: pytest.TempPathFactory) -> tuple[LaunchReport, Path]:
    root = tmp_path_factory.mktemp("torch_native")
    cases = [Case(job, _run_job, (job, str(root))) for job in native.JOBS]
    report = launch(4, root, cases, timeout_s=400, pg_timeout_s=60)
    assert not report.problems, report.problems
    return report, root


def _truth(report: LaunchReport, job: str) -> dict[str, Any]:
    truth: dict[str, Any] = report.values(job)[0]["truth"]
    return truth


@pytest.mark.parametrize("job", native.JOBS)
def test_the_live_api_gives_the_full_gradients_numbers(
    job: str, jobs: tuple[LaunchReport, Path]
) -> None:
    report, _ = jobs
    truth = _truth(report, job)
    assert truth["zeros"] == len(native.UNUSED_TOKENS) * native.DIM  # the tied rows
    for value in report.values(job):
        assert rel_err(value["norm"], truth["l2"]) <= REL
        assert rel_err(value["l1"], truth["l1"]) <= REL
        assert value["norm_inf"] == truth["inf"]
        assert value["zeros"] == truth["zeros"]
        assert value["clip_error"] <= REL
        if job in PYTORCH_CLIPS:
            assert value["vs_pytorch_clip"] <= REL
        if job in MEGATRON_API_EXACT:
            api = value["megatron_api"]
            assert rel_err(api["2.0"], truth["l2"]) <= REL
            assert rel_err(api["1.0"], truth["l1"]) <= REL
            assert api["inf"] == truth["inf"]
            assert value["megatron_zeros"] == truth["zeros"]


def _cli(*args: str) -> tuple[int, dict[str, Any]]:
    result = CliRunner().invoke(app, [*args, "--json"])
    return result.exit_code, json.loads(result.stdout)


@pytest.mark.parametrize("directory", JOB_DIRS)
def test_every_command_gives_the_full_gradients_numbers(
    directory: str, jobs: tuple[LaunchReport, Path]
) -> None:
    report, root = jobs
    truth = _truth(report, directory.removesuffix("-save"))
    snapshot = str(root / directory)
    for norm_type, key in (("2", "l2"), ("1", "l1"), ("inf", "inf")):
        code, result = _cli("norm", snapshot, "--norm-type", norm_type, "--top", "1000")
        assert code == 0
        assert rel_err(result["total_norm"], truth[key]) <= REL, (norm_type, result)
    assert sorted(row["name"] for row in result["params"]) == sorted(truth["per_param_l2"])
    code, l2 = _cli("norm", snapshot, "--top", "1000")
    for row in l2["params"]:
        assert rel_err(row["norm"], truth["per_param_l2"][row["name"]]) <= REL, row["name"]
    code, zeros = _cli("zeros", snapshot)
    assert code == 0 and zeros["num_zeros"] == truth["zeros"]
    code, audit = _cli("audit", snapshot)
    assert code == 0 and audit["findings"] == [], audit["findings"]


@pytest.mark.parametrize("job", ["fsdp2", "hsdp", "tp_fsdp2"])
def test_explain_names_a_dtensor_shards_local_norm(
    job: str, jobs: tuple[LaunchReport, Path]
) -> None:
    report, root = jobs
    values = report.values(job)
    for rank in (0, len(values) - 1):
        logged = values[rank]["local_l2"]
        code, found = _cli("explain", str(root / job), "--logged", repr(logged))
        assert code == 0 and found["best"] == f"rank_{rank}_local", found["rows"][:3]
        assert rel_err(found["rows"][0]["value"], logged) <= REL
    if job == "hsdp":  # both dp_replicate copies counted: twice the square sum
        logged = math.sqrt(2) * _truth(report, job)["l2"]
        code, found = _cli("explain", str(root / job), "--logged", repr(logged))
        assert code == 0 and found["best"] == "dtensor_replica_counted"


def test_clip_scales_by_the_full_gradients_coefficient(
    jobs: tuple[LaunchReport, Path], tmp_path: Path
) -> None:
    report, root = jobs
    truth = _truth(report, "tp_fsdp2")
    code, result = _cli(
        "clip", str(root / "tp_fsdp2"), "--max-norm", str(MAX_NORM), "--out", str(tmp_path / "c")
    )
    assert code == 0 and result["clipped"]
    assert rel_err(result["clip_coeff"], MAX_NORM / (truth["l2"] + 1e-6)) <= REL
    code, clipped = _cli("norm", str(tmp_path / "c"))
    assert rel_err(clipped["total_norm"], truth["l2"] * result["clip_coeff"]) <= REL


@pytest.mark.parametrize(("a", "b"), list(itertools.combinations(native.JOBS, 2)))
def test_compare_any_two_layouts_element_by_element(
    a: str, b: str, jobs: tuple[LaunchReport, Path]
) -> None:
    report, root = jobs
    code, result = _cli("compare", str(root / a), str(root / b), "--all", "--rtol", "1e-5")
    assert result["mismatches"] == [], result["mismatches"]
    assert code == 0
    assert len(result["params"]) == len(_truth(report, a)["per_param_l2"])
    for row in result["params"]:
        assert row["max_abs_diff"] is not None, row  # rebuilt and compared element by element


def test_audit_finds_a_replicate_copy_that_differs(jobs: tuple[LaunchReport, Path]) -> None:
    _, root = jobs
    code, result = _cli("audit", str(root / PLANTED))
    assert code == 1
    (finding,) = result["findings"]
    assert finding["kind"] == "replicas_differ" and finding["name"] == "norm.weight"


def test_compare_names_a_changed_shard_of_a_real_dtensor_snapshot(
    jobs: tuple[LaunchReport, Path],
) -> None:
    """One element of one FSDP2 Shard(0) piece: compare finds it against the clean snapshot and
    against DDP's (plain full tensors), names it and measures it; audit has nothing to say (a
    Shard piece has no copy)."""
    report, root = jobs
    old = report.values("fsdp2")[1]["planted_shard_old"]
    for clean in ("fsdp2", "ddp"):
        code, result = _cli("compare", str(root / clean), str(root / PLANTED_SHARD))
        assert code == 1 and result["mismatches"] == [SHARD_PARAM], result["mismatches"]
        (row,) = [row for row in result["params"] if row["name"] == SHARD_PARAM]
        assert "values" in row["flags"]
        if clean == "fsdp2":
            assert row["max_abs_diff"] == abs(SHARD_VALUE - old)
    code, audit = _cli("audit", str(root / PLANTED_SHARD))
    assert code == 0 and audit["findings"] == []


def test_under_torchrun_the_numbers_are_the_same(jobs: tuple[LaunchReport, Path]) -> None:
    _, root = jobs
    command = ["norm", str(root / "tp_fsdp2"), "--top", "1000", "--json"]
    alone = run_gradstat(*command, timeout=240)
    launched = run_gradstat(*command, nproc=2, timeout=240)
    assert alone.returncode == launched.returncode == 0, launched.stderr[-2000:]
    assert launched.stdout == alone.stdout

"""Megatron's own gradient dumps (``--save-wgrads-interval``) of real megatron-core jobs, read by
every gradstat command.

megatron-core 0.16.1 (installed) has no ``megatron.training``, so each rank of a real
``GPTModel`` job under real ``parallel_state`` on gloo CPU processes writes its files itself,
in the layout megatron-core 0.19.2's training loop writes them (read from its
``megatron/training/training.py``, ``train_step``'s ``_save_state_dict``, and
``megatron/training/checkpointing.py``, ``save_grads``; tests/_wgrads_jobs.py's own code): the
ranks of expert-data-parallel rank 0 each ``torch.save`` ``{"model_chunk{i}": {name:
main_grad}}`` of the unwrapped chunks into ``wgrads/iter_NNNNNNN/mp_rank_TT[_PPP][_EEE].pth``.
The gradients are known per-replica values written into ``main_grad`` and reduced by
Megatron's ``finalize_model_grads`` (DP all-reduce, the tied embedding's all-reduce across
stages), chosen so that Megatron's fp32 arithmetic on them is exact: the float64 truth,
computed here without Megatron, is what the files must hold bit for bit.

The layouts: TP2 (DP2); TP2 x PP2 with the output layer tied to the embedding (the last
stage's ``output_layer.weight`` is the tied copy); EP2 MoE (DP4, EDP2); TP2 x EP2 MoE with
SequentialMLP experts (expert TP 2, every TP x EP file present); a virtual pipeline (PP2, two
model chunks per stage, chunk ``i`` of stage ``p`` virtual stage ``i * PP + p``); an uneven
pipeline (``num_layers_in_first_pipeline_stage=1``, ``..._last_...=3``). All on 4 ranks, in
one spawn.

Checked: the files and their contents against the truth; Megatron's own norms and zero count
against float64; then ``norm`` (2, 1, inf), ``zeros``, ``audit`` (clean, and two planted
disagreements), ``inspect`` and ``compare`` (against gradstat's own ``dump_rank`` snapshot of
the same job) on the dump, by global names.
"""

from __future__ import annotations

import importlib.util
import json
import shutil
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import Tensor
from typer.testing import CliRunner

from gradstat.cli.app import app
from gradstat.testing import Case, launch
from tests._cli import run_gradstat
from tests._oracle import float64_norm, rel_err, zeros_in
from tests._wgrads_jobs import (
    EMBEDDING,
    NORM_TYPES,
    OUTPUT_COPY,
    ZERO_EXPERT,
    Logical,
    WgradsJob,
    run_wgrads_job,
    snapshot_dir,
    true_grads,
    wgrads_dir,
)

pytestmark = [
    pytest.mark.multiprocess,
    pytest.mark.slow,
    pytest.mark.skipif(importlib.util.find_spec("megatron") is None, reason="needs megatron-core"),
    pytest.mark.filterwarnings("ignore:Transformer Engine and Apex are not installed:UserWarning"),
]

WORLD_SIZE = 4
# The expert TP size is stated in every job. A job's real default is ETP = TP; with ETP = 1 and
# TP > 1 Megatron's writers (expert-data-parallel rank 0: the ranks r < ETP * EP of a stage)
# would not cover the TP x EP grid of file names.
JOBS = (
    WgradsJob("tp2-dp2", tp=2, etp=2),
    WgradsJob("tp2-pp2-tied", tp=2, pp=2, etp=2),
    WgradsJob("ep2-dp4", ep=2, etp=1),
    WgradsJob("tp2-ep2-etp2", tp=2, ep=2, etp=2),
    WgradsJob("pp2-vpp2-dp2", pp=2, vpp=2, etp=1),
    WgradsJob("pp2-uneven-dp2", pp=2, first_layers=1, last_layers=3, etp=1),
)
BY_NAME = {job.name: job for job in JOBS}
# A gradient Megatron's all-reduce leaves identical in every TP file (no sequence parallelism).
LAYERNORM = "decoder.layers.0.input_layernorm.weight"
# A dense tensor every EP rank's file repeats.
DENSE_IN_EP_FILES = "decoder.layers.0.self_attention.linear_qkv.weight"
MEGATRON_FP32 = 1e-5  # Megatron's norms: fp32 sums of squares and |x|


@dataclass(frozen=True)
class Ran:
    """One job as the ranks left it: its dumps, every rank's result and the float64 truth."""

    job: WgradsJob
    ranks: list[dict[str, Any]]
    wgrads: Path
    snapshot: Path
    tensors: dict[str, Logical]
    truth: dict[str, Tensor]
    scratch: Path


@pytest.fixture(scope="module")
def jobs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Ran]:
    """Every job run once on 4 gloo ranks (one spawn); the tests share its files."""
    base = tmp_path_factory.mktemp("wgrads-megatron")
    run_dir, root = base / "run", base / "dumps"
    run_dir.mkdir()
    cases = [Case(job.name, run_wgrads_job, (job, str(root))) for job in JOBS]
    report = launch(WORLD_SIZE, run_dir, cases, timeout_s=600, pg_timeout_s=120)
    ran = {}
    for job in JOBS:
        ranks = report.values(job.name)
        tensors: dict[str, Logical] = {}
        for result in ranks:
            tensors |= result["tensors"]
        scratch = base / "scratch" / job.name
        scratch.mkdir(parents=True)
        ran[job.name] = Ran(
            job,
            ranks,
            wgrads_dir(root, job),
            snapshot_dir(root, job),
            tensors,
            true_grads(job, tensors),
            scratch,
        )
    return ran


def _cli(*args: str | Path) -> tuple[int, dict[str, Any]]:
    """gradstat's real entry point in this process (Typer's runner), its one JSON document."""
    result = CliRunner().invoke(app, [*map(str, args), "--json"])
    assert result.stdout, f"gradstat {' '.join(map(str, args))} printed nothing: {result.output}"
    return result.exit_code, json.loads(result.stdout)


def _writers(ran: Ran) -> Iterator[dict[str, Any]]:
    return (result for result in ran.ranks if result["file"] is not None)


def _from_files(ran: Ran) -> dict[str, list[tuple[str, Tensor]]]:
    """Every copy of every logical tensor in the files, read with torch.load alone: {global
    name: [(which copy, the tensor whole)]}, TP shards joined along Megatron's own
    partition_dim, a replicated tensor once per TP file and dense tensors once per EP file."""
    shards: dict[tuple[str, int], dict[int, Tensor]] = {}
    for result in _writers(ran):
        saved = torch.load(ran.wgrads / result["file"], weights_only=True)
        coords = result["coords"]
        for chunk, names in result["names"].items():
            for local, name in names.items():
                expert = ran.tensors[name].expert
                replica = coords["ep"] if not expert else 0
                tp = coords["etp"] if expert else coords["tp"]
                shards.setdefault((name, replica), {})[tp] = saved[chunk][local]
    copies: dict[str, list[tuple[str, Tensor]]] = {}
    for (name, replica), by_tp in shards.items():
        split = ran.tensors[name].split_dim
        if split is None:
            pieces = [(f"replica {replica} TP {tp}", grad) for tp, grad in sorted(by_tp.items())]
        else:
            joined = torch.cat([by_tp[tp] for tp in sorted(by_tp)], dim=split)
            pieces = [(f"replica {replica}", joined)]
        copies.setdefault(name, []).extend(pieces)
    return copies


# --- what Megatron wrote, and Megatron's own statistics ----------------------------------------


@pytest.mark.parametrize("name", BY_NAME)
def test_megatron_jobs_write_the_wgrads_layout(name: str, jobs: dict[str, Ran]) -> None:
    ran = jobs[name]
    job = ran.job
    # The file names are those the layout gives, each written by one rank, as a dict of chunks.
    written = sorted(result["file"] for result in _writers(ran))
    assert written == job.file_names() == sorted(p.name for p in ran.wgrads.iterdir()), name
    for result in ran.ranks:
        assert (result["file"] is not None) == (result["coords"]["edp"] == 0), name
        assert result["misnumbered"] == [], (name, result["misnumbered"])
    for result in _writers(ran):
        saved = torch.load(ran.wgrads / result["file"], weights_only=True)
        assert type(saved) is dict and sorted(saved) == [
            f"model_chunk{i}" for i in range(job.chunks)
        ]
        for chunk, names in result["names"].items():
            assert sorted(saved[chunk]) == sorted(names), (name, result["file"], chunk)
            assert not any(local.startswith("module.") for local in names), (name, chunk)

    # The logical tensors are those of the model: no tied copy, every layer and expert once.
    assert (OUTPUT_COPY in ran.tensors) == (job.pp > 1), name
    layers = {n.split(".")[2] for n in ran.truth if n.startswith("decoder.layers.")}
    assert layers == {"0", "1", "2", "3"}, (name, layers)
    if job.moe:
        experts = {
            n.split("local_experts.")[1].split(".")[0] for n in ran.truth if "local_experts" in n
        }
        assert experts == {"0", "1", "2", "3"}, (name, experts)

    # Every copy of every tensor in the files is the float64 truth exactly; the tied output
    # copy is the embedding's gradient, bit for bit (Megatron all-reduced the two).
    copies = _from_files(ran)
    assert set(copies) == set(ran.tensors), name
    for tensor, held in copies.items():
        expected = ran.truth[EMBEDDING if tensor == OUTPUT_COPY else tensor]
        for where, grad in held:
            assert grad.dtype == torch.float32, (name, tensor, where)
            assert torch.equal(grad.double(), expected), (name, tensor, where)

    # Megatron's own numbers on every rank: its optimizer's norm and zero count, and its
    # get_grad_norm_fp32 for each norm type, against float64.
    expected_norms = {p: float64_norm(ran.truth.values(), p) for p in NORM_TYPES}
    expected_zeros = zeros_in(ran.truth.values())
    assert expected_zeros > 0, name
    for result in ran.ranks:
        megatron = result["megatron"]
        assert megatron["optimizer"] == "ChainedOptimizer", name
        assert rel_err(megatron["norm"], expected_norms[2.0]) <= MEGATRON_FP32, name
        for p in NORM_TYPES:
            assert rel_err(megatron["norms"][p], expected_norms[p]) <= MEGATRON_FP32, (name, p)
        assert megatron["zeros"] == expected_zeros, name


# --- the CLI on the dump ------------------------------------------------------------------------


def _close(value: float, expected: float, bound: float) -> bool:
    """Relative error at most ``bound``; a zero expected value must be met exactly."""
    return value == expected if expected == 0 else rel_err(value, expected) <= bound


@pytest.mark.parametrize("name", BY_NAME)
def test_norm_and_zeros_of_the_dump_are_float64s_and_megatrons(
    name: str, jobs: dict[str, Ran]
) -> None:
    ran = jobs[name]
    megatron = ran.ranks[0]["megatron"]
    for p, option in zip(NORM_TYPES, ("2", "1", "inf"), strict=True):
        code, norm = _cli("norm", ran.wgrads, "-p", option)
        assert code == 0 and norm["snapshot"]["source"] == "megatron-wgrads", (name, norm)
        expected = float64_norm(ran.truth.values(), p)
        assert rel_err(norm["total_norm"], expected) <= 1e-12, (name, p)
        assert rel_err(norm["total_norm"], megatron["norms"][p]) <= MEGATRON_FP32, (name, p)
        # Each logical tensor once, under its global name.
        per_param = {entry["name"]: entry["norm"] for entry in norm["params"]}
        assert sorted(per_param) == sorted(ran.truth), name
        for tensor, grad in ran.truth.items():
            expected = float64_norm([grad], p)
            assert _close(per_param[tensor], expected, 1e-12), (name, p, tensor)

    code, zeros = _cli("zeros", ran.wgrads)
    assert code == 0, (name, zeros)
    assert zeros["num_zeros"] == zeros_in(ran.truth.values()) == megatron["zeros"], name
    assert zeros["num_elements"] == sum(grad.numel() for grad in ran.truth.values()), name


# A fresh process costs seconds: two layouts, the tied pipeline and the TP x EP grid.
@pytest.mark.parametrize("name", ["tp2-pp2-tied", "tp2-ep2-etp2"])
def test_the_installed_cli_reads_the_dump_as_the_library_does(
    name: str, jobs: dict[str, Ran]
) -> None:
    ran = jobs[name]
    result = run_gradstat("norm", ran.wgrads, "--json")
    assert result.returncode == 0 and result.stderr == "", (name, result.stderr)
    _, in_process = _cli("norm", ran.wgrads)
    assert json.loads(result.stdout) == in_process, name


def _planted(ran: Ran, label: str, local: str, pick: str) -> tuple[Path, str]:
    """A copy of the dump with one element of ``local`` (chunk 0) changed in the file of the
    first writer whose coordinate ``pick`` is 1; returns the copy and the tensor's global name."""
    copy = ran.scratch / label
    shutil.copytree(ran.wgrads, copy)
    writer = next(result for result in _writers(ran) if result["coords"][pick] == 1)
    path = copy / writer["file"]
    saved = torch.load(path, weights_only=True)
    saved["model_chunk0"][local].view(-1)[5] += 0.5
    torch.save(saved, path)
    return copy, writer["names"]["model_chunk0"][local]


@pytest.mark.parametrize("name", BY_NAME)
def test_audit_passes_the_dump_and_finds_planted_disagreements(
    name: str, jobs: dict[str, Ran]
) -> None:
    ran = jobs[name]
    code, audit = _cli("audit", ran.wgrads)
    # The one finding of a clean MoE dump: ZERO_EXPERT, which no token reaches, in each layer.
    unrouted = sorted(
        f"decoder.layers.{layer}.mlp.experts[{ZERO_EXPERT}]"
        for layer in {int(n.split(".")[2]) for n in ran.truth if ".local_experts." in n}
    )
    found = [(finding["kind"], finding["name"]) for finding in audit["findings"]]
    assert code == (1 if unrouted else 0), (name, audit)
    assert sorted(found) == [("expert_never_routed", label) for label in unrouted], (name, audit)
    plants = []
    if ran.job.tp > 1:  # a replicated layernorm that differs over TP (NVIDIA/Megatron-LM#1446)
        plants.append(_planted(ran, "tp-layernorm", LAYERNORM, "tp"))
    if ran.job.ep > 1:  # a dense tensor whose copies in the EP files differ
        plants.append(_planted(ran, "ep-dense", DENSE_IN_EP_FILES, "ep"))
    for copy, tensor in plants:
        code, audit = _cli("audit", copy)
        assert code == 1 and audit["findings"], (name, copy.name, audit)
        # In TP x EP, a TP file's layernorm also differs from its copy in the other EP file:
        # more than one finding, all naming the tensor changed.
        named = {f["name"] for f in audit["findings"] if f["kind"] != "expert_never_routed"}
        assert named == {tensor}, (name, copy.name, audit["findings"])
        if copy.name == "tp-layernorm":
            kinds = {finding["kind"] for finding in audit["findings"]}
            assert "tp_replicas_differ" in kinds, (name, audit["findings"])


@pytest.mark.parametrize("name", BY_NAME)
def test_inspect_names_every_tensor_globally_with_megatrons_split(
    name: str, jobs: dict[str, Ran]
) -> None:
    ran = jobs[name]
    code, inspect = _cli("inspect", ran.wgrads)
    assert code == 0, (name, inspect)
    listed = {entry["name"]: entry for entry in inspect["params"]}
    # The tied output copy is listed with the embedding's split, as a copy that is not counted
    # again; every other name is a logical tensor of the truth.
    assert set(listed) - {OUTPUT_COPY} == set(ran.truth), name
    sources: dict[str, set[str]] = {}
    for result in _writers(ran):
        for chunk, names in result["names"].items():
            for local, tensor in names.items():
                sources.setdefault(tensor, set()).add(f"{result['file']}:{chunk}/{local}")
    for tensor, entry in listed.items():
        split = ran.tensors[tensor].split_dim  # Megatron's own partition_dim, or None
        assert entry["tensor_parallel"] is (split is not None), (name, tensor)
        assert entry["partition_dim"] == (-1 if split is None else split), (name, tensor)
        assert entry["expert"] is ran.tensors[tensor].expert, (name, tensor)
        # The tied copy is found (its gradient equals the embedding's) and not counted again.
        assert entry["shared"] is (tensor == OUTPUT_COPY), (name, tensor)
        if "rule" in entry:
            assert entry["rule"], (name, tensor)
        if "sources" in entry:
            assert set(entry["sources"]) == sources[tensor], (name, tensor)


@pytest.mark.parametrize("name", BY_NAME)
def test_compare_with_gradstats_own_snapshot_of_the_job(name: str, jobs: dict[str, Ran]) -> None:
    ran = jobs[name]
    code, compare = _cli("compare", ran.wgrads, ran.snapshot)
    assert code == 0, (name, compare)
    assert not any(total["flagged"] for total in compare["totals"]), (name, compare["totals"])
    assert sorted(entry["name"] for entry in compare["params"]) == sorted(ran.truth), name
    # The same fp32 values on both sides, whatever the files' layout.
    for entry in compare["params"]:
        assert entry["max_abs_diff"] == 0 and entry["flags"] == [], (name, entry)


def test_compare_across_jobs_by_logical_names(jobs: dict[str, Ran]) -> None:
    # The virtual and the uneven pipeline place the same logical tensors (same DP, same
    # known gradients) on other stages and chunks: by global names they are the same dump.
    vpp, uneven = jobs["pp2-vpp2-dp2"], jobs["pp2-uneven-dp2"]
    code, same = _cli("compare", vpp.wgrads, uneven.snapshot)
    assert code == 0 and all(entry["max_abs_diff"] == 0 for entry in same["params"]), same
    # TP2 on DP2 and TP2 x PP2 on DP1 average other replicas: the tensors whose truths differ
    # are flagged (the all-zero bias is the same in both).
    tp, tied = jobs["tp2-dp2"], jobs["tp2-pp2-tied"]
    code, other = _cli("compare", tp.wgrads, tied.snapshot)
    assert code == 1, other
    flagged = {entry["name"] for entry in other["params"] if "values" in entry["flags"]}
    differ = {name for name, grad in tp.truth.items() if not torch.equal(grad, tied.truth[name])}
    assert flagged == differ and len(differ) == len(tp.truth) - 1, flagged ^ differ

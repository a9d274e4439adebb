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
from tests._oracle import float64_norm, rel_err, zeros_in
from tests._wgrads_jobs import (
    EMBEDDING,
    NORM_TYPES,
    OUTPUT_COPY,
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
    name: [(file, the tensor whole, TP shards joined along the split Megatron gave)]}."""
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

"""Megatron's own ``--save-wgrads-interval`` dumps, written by its ``save_grads``, read by gradstat.

The jobs of tests/_wgrads_jobs.py (what tests/test_wgrads_megatron.py runs on megatron-core
0.16.1, which has no ``megatron.training``), on the newest megatron-core, with one difference:
the files are written by Megatron itself. On 4 gloo CPU processes per job, under Megatron's real
``parallel_state``: its ``GPTModel`` chunks (local layer spec, output layer tied to the
embedding; MoE layers of ``SequentialMLP`` experts), its ``DistributedDataParallel`` and
``get_megatron_optimizer``, known per-replica gradients written into ``main_grad`` (all from
tests/_wgrads_jobs.py), then what megatron-core 0.19's ``train_step`` does on a
``--save-wgrads-interval`` iteration:

- ``finalize_model_grads(model, force_all_reduce=True)``: the DP all-reduce (never a
  reduce-scatter), the tied embedding and output layer all-reduced across the first and last
  stage;
- ``{"model_chunk{i}": {name: param.main_grad.cpu()}}`` over each unwrapped chunk's
  ``named_parameters()`` (``_save_state_dict``, written here: it is a closure of train_step), and
  ``megatron.training.checkpointing.save_grads`` itself writes it: it picks the writers (expert
  data-parallel rank 0) and the file names ``mp_rank_TT[_PPP][_EEE].pth``. It imports on the
  CPU as it is, no global args or stubs needed (save_grads reads parallel_state only); its two
  ``print_rank_0`` lines and the stdout logging its package sets up go to stderr;
- Megatron's own ``get_grad_norm_fp32`` (p = 2, 1, inf) and ``count_zeros_fp32`` through its
  optimizer, CPU-pointed as in ranks.py.

Then ``gradstat norm`` (p = 2, 1, inf), ``zeros`` and ``audit`` on each dump, as a user runs them,
against float64 statistics of the logical gradient (each tensor once under its global name: the
tied output layer is the embedding, dense tensors repeated in the EP files once) and against
Megatron's numbers.

The Transformer Engine spec is not run: Transformer Engine is not in this environment. Its
PyTorch part on the registry (transformer-engine-torch 2.20.2) is a source package only, a C++
extension compiled against torch and the CUDA core library of transformer-engine-cu12/-cu13,
for machines with an NVIDIA driver (none here); building it on a CPU machine was not attempted.
tests/_wgrads.py covers the TE spec's parameter names with synthetic dumps.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import sys
import warnings
from pathlib import Path
from typing import Any, Protocol

import ranks
import torch
from live_jobs import SPOTS_0_19
from torch import Tensor

from gradstat.testing import Case, launch
from tests._cli import run_gradstat
from tests._megatron import MEGATRON_JOB_SPOTS, point_megatron_at_cpu
from tests._oracle import float64_norm, rel_err, zeros_in
from tests._wgrads_jobs import (
    EMBEDDING,
    ITERATION,
    NORM_TYPES,
    OUTPUT_COPY,
    Logical,
    WgradsJob,
    _build,
    _fill_main_grads,
    _megatron_statistics,
    parallel_state,
    true_grads,
    wgrads_dir,
)

WORLD_SIZE = 4
# The expert TP size is stated in every job; Megatron's default is ETP = TP (tp2-ep2). With
# ETP = 1 and TP 2 (tp2-ep2-etp1) the writers, ranks r < ETP x EP, make 2 of the 4 TP x EP names.
WGRADS_JOBS = (
    WgradsJob("tp2-dp2", tp=2, etp=2),
    WgradsJob("tp2-pp2-tied", tp=2, pp=2, etp=2),
    WgradsJob("ep2-dp4", ep=2, etp=1),
    WgradsJob("tp2-ep2", tp=2, ep=2, etp=2),
    WgradsJob("tp2-ep2-etp1", tp=2, ep=2, etp=1),
    WgradsJob("tp2-dp2-distopt", tp=2, etp=2, distributed_optimizer=True),
    WgradsJob("ep2-dp4-distopt", ep=2, etp=1, distributed_optimizer=True),
    WgradsJob("pp2-vpp2-dp2", pp=2, vpp=2, etp=1),
    WgradsJob("pp2-uneven-dp2", pp=2, first_layers=1, last_layers=3, etp=1),
)
# tests/_wgrads_jobs.py's gradients are dyadic: Megatron's fp32 reductions of them are exact,
# so gradstat's float64 statistics of the dump are held to float64's own rounding.
GRADSTAT_RTOL = 1e-12
MEGATRON_RTOL = 1e-5  # Megatron's norms: fp32 sums of squares and |x|


# --- one rank -----------------------------------------------------------------------------------


def _import_save_grads() -> Any:
    """megatron.training.checkpointing's save_grads. Importing megatron.training configures
    the root logger (``logging.basicConfig``, INFO, a handler on stdout, in training.py): the
    handler is pointed at stderr and the level put back to WARNING, so that this process's
    stdout stays the report's and its stderr readable."""
    from megatron.training.checkpointing import save_grads

    root = logging.getLogger()
    for handler in root.handlers:
        if isinstance(handler, logging.StreamHandler) and handler.stream is sys.stdout:
            handler.setStream(sys.stderr)
    root.setLevel(logging.WARNING)
    return save_grads


def _save_wgrads(model: list[Any], save: Path) -> None:
    """What train_step's ``_save_state_dict("main_grad", "wgrads")`` hands to save_grads, and
    Megatron's save_grads writing it under ``save`` (its ``args.save``)."""
    from megatron.core.utils import unwrap_model

    save_grads = _import_save_grads()
    state_dict: dict[str, dict[str, Tensor]] = {}
    for index, chunk in enumerate(model):
        grads = state_dict.setdefault(f"model_chunk{index}", {})
        for name, param in unwrap_model(chunk).named_parameters():
            if getattr(param, "main_grad", None) is not None:
                grads[name] = param.main_grad.cpu()
    with contextlib.redirect_stdout(sys.stderr):  # its print_rank_0 lines are progress
        save_grads(str(save), state_dict, ITERATION, "wgrads")


def run_save_grads_job(rank: int, world_size: int, arg: tuple[WgradsJob, str]) -> dict[str, Any]:
    """One rank of one job: gradients reduced as on a save-wgrads iteration, the dump written by
    Megatron's save_grads, Megatron's own statistics of them."""
    from megatron.core.distributed import finalize_model_grads

    job, root = arg
    assert world_size == job.world_size, (world_size, job)
    with parallel_state(job):
        _import_save_grads()
        ranks.megatron_clip_grads_on_cpu()
        point_megatron_at_cpu((*MEGATRON_JOB_SPOTS, *SPOTS_0_19))
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            model, optimizer = _build(job)
        tensors, _, misnumbered = _fill_main_grads(job, model)
        finalize_model_grads(model, force_all_reduce=True)
        _save_wgrads(model, Path(root) / job.name)
        for part in optimizer.chained_optimizers:
            # 0.19 names the selection get_grads_for_grad_norm (the same tensors).
            if not hasattr(part, "get_main_grads_for_grad_norm"):
                part.get_main_grads_for_grad_norm = part.get_grads_for_grad_norm
        return {
            "tensors": tensors,
            "misnumbered": misnumbered,
            "megatron": _megatron_statistics(optimizer),
        }


# --- the rows of the report ---------------------------------------------------------------------


class Report(Protocol):
    lines: list[str]

    def check(self, ok: bool, failure: str) -> bool: ...

    def row(self, *cells: str, widths: tuple[int, ...]) -> None: ...


WGRADS_WIDTHS = (16, 5, 8, 7, 7, 5, 8, 9, 6, 7, 6, 6, 0)
WGRADS_HEADER = (
    "layout", "files", "mcore L2", "L2", "L1", "inf", "vs mcore", "per-param", "gstat",
    "float64", "mcore", "audit", "zeros verdict",
)  # fmt: skip


def _fmt(error: float) -> str:
    return "0" if error == 0 else f"{error:.0e}"


def _cli(*args: str) -> tuple[int, dict[str, Any]]:
    """gradstat's exit status and JSON document ({"error": its stderr} when it printed none)."""
    result = run_gradstat(*args, "--json")
    if not result.stdout:
        lines = result.stderr.strip().splitlines()
        return result.returncode, {"error": lines[-1] if lines else ""}
    return result.returncode, json.loads(result.stdout)


def _held(chunks: dict[str, dict[str, Tensor]], name: str) -> Tensor | None:
    return next((grads[name] for grads in chunks.values() if name in grads), None)


def _tied_copies_equal(job: WgradsJob, dump: Path) -> bool:
    """Whether the last stage's output_layer.weight equals the first stage's embedding bit for
    bit in every TP file (finalize_model_grads all-reduces the two; how a reader can tell a
    tied copy from an untied output layer)."""
    for tp_rank in range(job.tp):
        first = torch.load(dump / f"mp_rank_{tp_rank:02d}_000.pth", weights_only=True)
        last = torch.load(dump / f"mp_rank_{tp_rank:02d}_{job.pp - 1:03d}.pth", weights_only=True)
        embedding, output = _held(first, EMBEDDING), _held(last, OUTPUT_COPY)
        if embedding is None or output is None or not torch.equal(embedding, output):
            return False
    return True


def wgrads_rows(report: Report, job: WgradsJob, values: list[dict[str, Any]], root: Path) -> None:
    """The CLI on the job's dump against float64 and Megatron's numbers: one row."""
    where = f"wgrads {job.name}"
    tensors: dict[str, Logical] = {}
    for value in values:
        tensors |= value["tensors"]
    truth = true_grads(job, tensors)
    dump = wgrads_dir(root, job)
    written = {path.name for path in dump.glob("*.pth")}
    report.check(written == set(job.file_names()), f"{where}: save_grads wrote {sorted(written)}")
    misnumbered = [line for value in values for line in value["misnumbered"]]
    report.check(not misnumbered, f"{where}: the layout numbers layers otherwise: {misnumbered}")
    if job.pp > 1 and job.ep == 1:
        report.check(_tied_copies_equal(job, dump), f"{where}: the tied copies differ")
    expected = {p: float64_norm(truth.values(), p) for p in NORM_TYPES}
    expected_zeros = zeros_in(truth.values())
    megatron = [value["megatron"] for value in values]
    for p in NORM_TYPES:
        off = max(rel_err(m["norms"][p], expected[p]) for m in megatron)
        report.check(off <= MEGATRON_RTOL, f"{where}: Megatron's L{p:g} {off:.1e} off float64")
    megatron_off = max(rel_err(m["norm"], expected[2.0]) for m in megatron)
    report.check(megatron_off <= MEGATRON_RTOL, f"{where}: Megatron's optimizer L2 off float64")
    megatron_zeros = {m["zeros"] for m in megatron}
    report.check(megatron_zeros == {expected_zeros}, f"{where}: Megatron zeros {megatron_zeros}")
    cells = [job.name, str(len(written)), _fmt(megatron_off)]

    errors, per_param, worst_param = {}, {}, 0.0
    for p, flag in zip(NORM_TYPES, ("2", "1", "inf"), strict=True):
        code, norm = _cli("norm", str(dump), "-p", flag)
        failure = f"{where}: gradstat norm -p {flag} exited {code}: {norm.get('error', '')}"
        if not report.check(code == 0, failure):
            message = f"gradstat norm exit {code}: {norm.get('error', '')}"
            report.row(*cells, message, widths=WGRADS_WIDTHS[: len(cells) + 1])
            return
        errors[p] = rel_err(norm["total_norm"], expected[p])
        report.check(errors[p] <= GRADSTAT_RTOL, f"{where}: L{flag} {errors[p]:.1e} off float64")
        per_param = {entry["name"]: entry["norm"] for entry in norm["params"]}
        report.check(
            set(per_param) == set(truth),
            f"{where}: names {sorted(set(per_param) ^ set(truth))} differ from the model's",
        )
        for name, grad in truth.items():
            param_norm = float64_norm([grad], p)
            found = per_param.get(name, math.nan)
            off = 0.0 if found == param_norm else abs(found - param_norm) / max(param_norm, 1e-3)
            worst_param = off if math.isnan(off) else max(worst_param, off)
        if p == 2.0:
            vs_megatron = max(rel_err(norm["total_norm"], m["norm"]) for m in megatron)
    report.check(worst_param <= GRADSTAT_RTOL, f"{where}: a parameter's norm is off float64")
    report.check(vs_megatron <= MEGATRON_RTOL, f"{where}: L2 vs Megatron's {vs_megatron:.1e}")

    _, zeros = _cli("zeros", str(dump))
    report.check(
        zeros.get("num_zeros") == expected_zeros,
        f"{where}: zeros {zeros.get('num_zeros')} vs float64 {expected_zeros}",
    )
    elements = sum(grad.numel() for grad in truth.values())
    report.check(
        zeros.get("num_elements") == elements,
        f"{where}: {zeros.get('num_elements')} elements vs the model's {elements}",
    )
    verdict = "agree" if megatron_zeros == {expected_zeros} == {zeros.get("num_zeros")} else "DIFF"
    code, audit = _cli("audit", str(dump))
    findings = [finding.get("kind", str(finding)) for finding in audit.get("findings", [])]
    report.check(code == 0 and not findings, f"{where}: audit exited {code}, {findings}")

    cells += [_fmt(errors[2.0]), _fmt(errors[1.0]), _fmt(errors[math.inf])]
    cells += [_fmt(vs_megatron), _fmt(worst_param), str(zeros.get("num_zeros"))]
    cells += [str(expected_zeros), ",".join(map(str, sorted(megatron_zeros)))]
    report.row(*cells, ", ".join(findings) or "clean", verdict, widths=WGRADS_WIDTHS)


def wgrads_section(report: Report, jobs: list[WgradsJob], scratch: Path) -> None:
    """Run ``jobs`` on 4 gloo processes and add their rows to ``report``."""
    root = scratch / "wgrads"
    cases = [Case(f"wgrads {job.name}", run_save_grads_job, (job, str(root))) for job in jobs]
    print(
        f"running {len(cases)} save_grads jobs on {WORLD_SIZE} gloo processes ...",
        file=sys.stderr,
        flush=True,
    )
    run_dir = scratch / "run-wgrads"
    run_dir.mkdir()
    outcome = launch(WORLD_SIZE, run_dir, cases, timeout_s=3000, pg_timeout_s=300)
    report.lines += [
        "",
        "Megatron's own --save-wgrads-interval dumps: megatron-core's GPTModel (local spec, "
        "tied output layer; MoE of SequentialMLP experts), its DDP, finalize_model_grads with "
        "force_all_reduce, the dump written by megatron.training.checkpointing.save_grads, 4 "
        "gloo CPU processes; gradstat norm/zeros/audit on the wgrads directory against float64 "
        "of the logical gradient (relative error) and Megatron's get_grad_norm_fp32 and "
        "count_zeros_fp32; the Transformer Engine spec not run (Transformer Engine not installed)",
    ]
    report.row(*WGRADS_HEADER, widths=WGRADS_WIDTHS)
    for job in jobs:
        wgrads_rows(report, job, outcome.values(f"wgrads {job.name}"), root)

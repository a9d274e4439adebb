"""Megatron's own ``--save-wgrads-interval`` dumps, written by its ``save_grads``, read by gradstat.

On 4 gloo CPU processes per job, under Megatron's real ``parallel_state``: its ``GPTModel``
(local layer spec, output layer tied to the embedding; MoE layers of ``SequentialMLP`` experts),
its ``DistributedDataParallel`` and ``get_megatron_optimizer`` (plain, or distributed), for TP2,
TP2 x PP2 (the tied output layer on the last stage), EP2 and TP2 x EP2 (expert TP 2, Megatron's
default, and expert TP 1). Each rank writes known per-replica gradients into its DDP
``main_grad`` (what backward would leave there), then does what megatron-core 0.19's
``train_step`` does on a ``--save-wgrads-interval`` iteration:

- ``finalize_model_grads(model, force_all_reduce=True)``: the DP all-reduce (never a
  reduce-scatter, the distributed optimizer too), the tied embedding and output layer
  all-reduced across the first and last stage;
- ``{"model_chunk{i}": {name: param.main_grad.cpu()}}`` over each unwrapped chunk's
  ``named_parameters()`` (``_save_state_dict``, written here: it is a closure of train_step), and
  ``megatron.training.checkpointing.save_grads`` itself writes it: it picks the writers (expert
  data-parallel rank 0) and the file names ``mp_rank_TT[_PPP][_EEE].pth``. It imports on the
  CPU as it is, no global args or stubs needed (save_grads reads parallel_state only); its two
  ``print_rank_0`` lines and the stdout logging its package sets up go to stderr;
- Megatron's own ``get_grad_norm_fp32`` and ``count_zeros_fp32`` through its optimizer
  (``prepare_grads``, ``get_grad_norm``, ``count_zeros``), CPU-pointed as in ranks.py.

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
import re
import sys
import warnings
import zlib
from dataclasses import dataclass
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

LAYERS, HIDDEN, HEADS, FFN, VOCAB, SEQUENCE = 4, 32, 4, 64, 64, 16
EXPERTS, EXPERT_FFN = 4, 16
BUCKET_SIZE = 3000  # several buckets per buffer
ITERATION = 1000  # save_grads's label: the dump is <save>/wgrads/iter_0001000
WORLD_SIZE = 4
EMBEDDING = "embedding.word_embeddings.weight"
OUTPUT_COPY = "output_layer.weight"
UNSEEN_TOKENS = (3, 17, 40)  # embedding rows no token touched: zeros in every replica
ZERO_EXPERT = 1  # an expert no token was routed to
ZERO_BIAS = "decoder.layers.1.self_attention.linear_qkv.bias"
WGRADS_RTOL = 1e-6  # Megatron reduces in fp32; the dump holds its fp32 main_grads


@dataclass(frozen=True)
class WgradsJob:
    """A Megatron layout on 4 ranks; DP follows from the world size."""

    name: str
    tp: int = 1
    pp: int = 1
    ep: int = 1
    etp: int | None = None  # expert TP; None: Megatron's default, the TP size
    distributed_optimizer: bool = False

    @property
    def moe(self) -> bool:
        return self.ep > 1

    @property
    def expert_tp(self) -> int:
        return self.tp if self.etp is None else self.etp

    @property
    def dp(self) -> int:
        return WORLD_SIZE // (self.tp * self.pp)

    @property
    def edp(self) -> int:
        return WORLD_SIZE // (self.expert_tp * self.ep * self.pp)

    @property
    def optimizer(self) -> str:
        return "distopt" if self.distributed_optimizer else "plain"

    @property
    def case(self) -> str:
        return f"wgrads {self.name} {self.optimizer}"

    @property
    def folder(self) -> str:
        return self.case.replace(" ", "_")

    def files(self) -> set[str]:
        """The file names save_grads writes for this layout (from its docstring and code: one
        per writer, the writers being the ranks of expert-data-parallel rank 0)."""
        names = set()
        for stage in range(self.pp):
            for writer in range(self.expert_tp * self.ep):
                name = f"mp_rank_{writer % self.tp:02d}"
                name += f"_{stage:03d}" if self.pp > 1 else ""
                name += f"_{writer // self.expert_tp:03d}" if self.ep > 1 else ""
                names.add(f"{name}.pth")
        return names


WGRADS_JOBS = (
    WgradsJob("tp2-dp2", tp=2),
    WgradsJob("tp2-dp2", tp=2, distributed_optimizer=True),
    WgradsJob("tp2-pp2-tied", tp=2, pp=2),
    WgradsJob("tp2-pp2-tied", tp=2, pp=2, distributed_optimizer=True),
    WgradsJob("ep2-dp2", ep=2),
    WgradsJob("tp2-ep2", tp=2, ep=2),
    WgradsJob("tp2-ep2-etp1", tp=2, ep=2, etp=1),
)


# --- known gradients ----------------------------------------------------------------------------


def replica_grad(name: str, replica: int, shape: tuple[int, ...]) -> Tensor:
    """One data replica's fp32 gradient of the logical tensor ``name`` (global name) before
    Megatron reduces it, with the structural zeros a real batch leaves."""
    generator = torch.Generator().manual_seed(zlib.crc32(f"{name}/{replica}".encode()))
    grad = torch.randn(shape, generator=generator, dtype=torch.float64).to(torch.float32)
    if name in (EMBEDDING, OUTPUT_COPY):
        grad[list(UNSEEN_TOKENS)] = 0.0
    if f"local_experts.{ZERO_EXPERT}." in name or name == ZERO_BIAS:
        grad.zero_()
    return grad


def _global_name(local: str, job: WgradsJob, stage: int, ep_rank: int) -> str:
    """The parameter's name with the stage's layers and the rank's experts numbered globally
    (worked out here from the layout, not by gradstat)."""
    name = re.sub(
        r"^decoder\.layers\.(\d+)\.",
        lambda m: f"decoder.layers.{int(m[1]) + stage * LAYERS // job.pp}.",
        local,
    )
    return re.sub(
        r"\.local_experts\.(\d+)\.",
        lambda m: f".local_experts.{int(m[1]) + ep_rank * EXPERTS // job.ep}.",
        name,
    )


def true_grads(job: WgradsJob, tensors: dict[str, dict[str, Any]]) -> dict[str, Tensor]:
    """The float64 gradient of every logical tensor of the global batch's mean loss: summed over
    the replicas that hold it (an expert's: its expert-data-parallel ones, which together saw
    every token routed to it), divided by the dense data-parallel size; the tied output copy's
    adds to the embedding's (the copy is not a tensor of its own)."""
    truth = {}
    for name, spec in tensors.items():
        if name == OUTPUT_COPY and spec["tied"]:
            continue
        shape = tuple(spec["shape"])
        parts = [name, OUTPUT_COPY] if name == EMBEDDING and OUTPUT_COPY in tensors else [name]
        total = torch.zeros(shape, dtype=torch.float64)
        for replica in range(job.edp if spec["expert"] else job.dp):
            for part in parts:
                total += replica_grad(part, replica, shape).double()
        truth[name] = total / job.dp
    return truth


# --- one rank -----------------------------------------------------------------------------------


def _build(job: WgradsJob) -> tuple[list[Any], Any]:
    """This rank's GPT chunk (local spec, tied output layer) in Megatron's DDP, and its
    optimizer (tests/_megatron.py's megatron_gpt_job, with the expert TP size free)."""
    from megatron.core import parallel_state as ps
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.transformer import TransformerConfig

    torch.manual_seed(0)
    experts = EXPERTS if job.moe else None
    config = TransformerConfig(
        num_layers=LAYERS,
        hidden_size=HIDDEN,
        num_attention_heads=HEADS,
        ffn_hidden_size=FFN,
        num_moe_experts=experts,
        moe_ffn_hidden_size=EXPERT_FFN if job.moe else None,
        moe_router_topk=2,
        tensor_model_parallel_size=job.tp,
        pipeline_model_parallel_size=job.pp,
        expert_model_parallel_size=job.ep,
        expert_tensor_parallel_size=job.expert_tp,
        # Megatron refuses biases in MoE layers with expert TP. Sequence parallelism stays
        # off: its torch LayerNorm fallback (no Apex) refuses it; EP x TP without it is a
        # warning only, and no forward runs.
        add_bias_linear=not (job.moe and job.expert_tp > 1),
        pipeline_dtype=torch.float32,
        use_cpu_initialization=True,
    )
    chunk = GPTModel(
        config=config,
        transformer_layer_spec=get_gpt_layer_local_spec(num_experts=experts),
        vocab_size=VOCAB,
        max_sequence_length=SEQUENCE,
        pre_process=ps.is_pipeline_first_stage(),
        post_process=ps.is_pipeline_last_stage(),
        share_embeddings_and_output_weights=True,
    )
    ddp_config = DistributedDataParallelConfig(
        use_distributed_optimizer=job.distributed_optimizer, bucket_size=BUCKET_SIZE
    )
    model = [DistributedDataParallel(config, ddp_config, chunk)]
    optimizer_config = OptimizerConfig(
        optimizer="adam",
        lr=1e-3,
        use_distributed_optimizer=job.distributed_optimizer,
        log_num_zeros_in_grad=True,
    )
    optimizer = get_megatron_optimizer(optimizer_config, model, use_gloo_process_groups=False)
    return model, optimizer


def _fill_main_grads(model: list[Any], job: WgradsJob) -> dict[str, dict[str, Any]]:
    """Each parameter's ``main_grad`` gets this rank's TP shard of its replica's known
    gradient; returns {global name: full shape, whether an expert, whether the tied output
    copy}."""
    from megatron.core import parallel_state as ps

    stage, ep_rank = ps.get_pipeline_model_parallel_rank(), ps.get_expert_model_parallel_rank()
    tensors = {}
    for local, param in model[0].module.named_parameters():
        name = _global_name(local, job, stage, ep_rank)
        expert = not getattr(param, "allreduce", True)
        if expert:
            replica = ps.get_expert_data_parallel_rank()
            tp_rank = ps.get_expert_tensor_parallel_rank()
            tp_size = ps.get_expert_tensor_parallel_world_size()
        else:
            replica = ps.get_data_parallel_rank()
            tp_rank = ps.get_tensor_model_parallel_rank()
            tp_size = ps.get_tensor_model_parallel_world_size()
        shape = list(param.shape)
        split = getattr(param, "tensor_model_parallel", False)
        if split:
            shape[param.partition_dim] *= tp_size
        full = replica_grad(name, replica, tuple(shape))
        param.main_grad.copy_(
            full.chunk(tp_size, dim=param.partition_dim)[tp_rank] if split else full
        )
        tensors[name] = {
            "shape": shape,
            "expert": expert,
            "tied": bool(getattr(param, "shared_embedding", False)),
        }
    return tensors


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


def _save_wgrads(model: list[Any], root: str) -> None:
    """What train_step's ``_save_state_dict("main_grad", "wgrads")`` hands to save_grads, and
    Megatron's save_grads writing it."""
    from megatron.core.utils import unwrap_model

    save_grads = _import_save_grads()
    state_dict: dict[str, dict[str, Tensor]] = {}
    for index, chunk in enumerate(model):
        grads = state_dict.setdefault(f"model_chunk{index}", {})
        for name, param in unwrap_model(chunk).named_parameters():
            if getattr(param, "main_grad", None) is not None:
                grads[name] = param.main_grad.cpu()
    with contextlib.redirect_stdout(sys.stderr):  # its print_rank_0 lines are progress
        save_grads(root, state_dict, ITERATION, "wgrads")


def run_wgrads_job(rank: int, world_size: int, arg: tuple[WgradsJob, str]) -> dict[str, Any]:
    """One rank of one job: gradients reduced as on a save-wgrads iteration, the dump written by
    Megatron's save_grads, Megatron's own grad norm and zero count."""
    from megatron.core import parallel_state as ps
    from megatron.core.distributed import finalize_model_grads

    job, root = arg
    assert world_size == WORLD_SIZE, (world_size, job)
    ps.initialize_model_parallel(
        tensor_model_parallel_size=job.tp,
        pipeline_model_parallel_size=job.pp,
        expert_model_parallel_size=job.ep,
        expert_tensor_parallel_size=job.expert_tp,
        create_gloo_process_groups=False,
    )
    try:
        _import_save_grads()
        ranks.megatron_clip_grads_on_cpu()
        point_megatron_at_cpu((*MEGATRON_JOB_SPOTS, *SPOTS_0_19))
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            model, optimizer = _build(job)
        tensors = _fill_main_grads(model, job)
        finalize_model_grads(model, force_all_reduce=True)
        _save_wgrads(model, root)
        optimizer.prepare_grads()
        return {
            "tensors": tensors,
            "megatron_norm": float(optimizer.get_grad_norm()),
            "megatron_zeros": int(optimizer.count_zeros()),
        }
    finally:
        ps.destroy_model_parallel()


# --- the rows of the report ---------------------------------------------------------------------


class Report(Protocol):
    lines: list[str]

    def check(self, ok: bool, failure: str) -> bool: ...

    def row(self, *cells: str, widths: tuple[int, ...]) -> None: ...


WGRADS_WIDTHS = (14, 9, 5, 8, 7, 7, 5, 8, 9, 6, 7, 6, 6, 0)
WGRADS_HEADER = (
    "layout", "optimizer", "files", "mcore L2", "L2", "L1", "inf", "vs mcore", "per-param",
    "gstat", "float64", "mcore", "audit", "zeros verdict",
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


def _tied_copies_equal(job: WgradsJob, dump: Path) -> bool:
    """Whether the last stage's output_layer.weight equals the first stage's embedding bit for
    bit in every TP file (finalize_model_grads all-reduces the two; how a reader can tell a
    tied copy from an untied output layer)."""
    for tp_rank in range(job.tp):
        first = torch.load(dump / f"mp_rank_{tp_rank:02d}_000.pth", weights_only=True)
        last = torch.load(dump / f"mp_rank_{tp_rank:02d}_{job.pp - 1:03d}.pth", weights_only=True)
        if not torch.equal(first["model_chunk0"][EMBEDDING], last["model_chunk0"][OUTPUT_COPY]):
            return False
    return True


def wgrads_rows(report: Report, job: WgradsJob, values: list[dict[str, Any]], root: Path) -> None:
    """The CLI on the job's dump against float64 and Megatron's numbers: one row."""
    where = job.case
    tensors = {name: spec for value in values for name, spec in value["tensors"].items()}
    truth = true_grads(job, tensors)
    dump = root / job.folder / "wgrads" / f"iter_{ITERATION:07d}"
    written = {path.name for path in dump.glob("*.pth")}
    report.check(written == job.files(), f"{where}: save_grads wrote {sorted(written)}")
    if job.pp > 1:
        report.check(_tied_copies_equal(job, dump), f"{where}: the tied copies differ")
    expected = {p: float64_norm(truth.values(), p) for p in (2.0, 1.0, math.inf)}
    expected_zeros = zeros_in(truth.values())
    megatron_norms = [value["megatron_norm"] for value in values]
    megatron_off = max(rel_err(m, expected[2.0]) for m in megatron_norms)
    report.check(megatron_off <= WGRADS_RTOL, f"{where}: Megatron's L2 off float64")
    megatron_zeros = {value["megatron_zeros"] for value in values}
    report.check(megatron_zeros == {expected_zeros}, f"{where}: Megatron zeros {megatron_zeros}")
    cells = [job.name, job.optimizer, str(len(written)), _fmt(megatron_off)]
    mcore_zeros = ",".join(map(str, sorted(megatron_zeros)))

    errors = {}
    for p, flag in ((2.0, "2"), (1.0, "1"), (math.inf, "inf")):
        code, norm = _cli("norm", str(dump), "-p", flag)
        failure = f"{where}: gradstat norm -p {flag} exited {code}: {norm.get('error', '')}"
        if not report.check(code == 0, failure):
            message = f"gradstat norm exit {code}: {norm.get('error', '')}"
            report.row(*cells, message, widths=WGRADS_WIDTHS[: len(cells) + 1])
            return
        errors[p] = rel_err(norm["total_norm"], expected[p])
        report.check(errors[p] <= WGRADS_RTOL, f"{where}: L{flag} off float64 by {errors[p]:.1e}")
        if p == 2.0:
            per_param = {entry["name"]: entry["norm"] for entry in norm["params"]}
            total = norm["total_norm"]
    report.check(
        set(per_param) == set(truth),
        f"{where}: names {sorted(set(per_param) ^ set(truth))} differ from the model's",
    )
    worst_param = 0.0
    for name, grad in truth.items():
        param_norm = float64_norm([grad], 2)
        off = abs(per_param.get(name, math.nan) - param_norm) / max(param_norm, 1e-3)
        worst_param = off if math.isnan(off) else max(worst_param, off)
    report.check(worst_param <= WGRADS_RTOL, f"{where}: a parameter's norm is off float64")
    vs_megatron = max(rel_err(total, m) for m in megatron_norms)
    report.check(vs_megatron <= WGRADS_RTOL, f"{where}: L2 vs Megatron's {vs_megatron:.1e}")

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
    cells += [str(expected_zeros), mcore_zeros]
    report.row(*cells, ", ".join(findings) or "clean", verdict, widths=WGRADS_WIDTHS)


def wgrads_section(report: Report, jobs: list[WgradsJob], scratch: Path) -> None:
    """Run ``jobs`` on 4 gloo processes and add their rows to ``report``."""
    root = scratch / "wgrads"
    cases = [Case(job.case, run_wgrads_job, (job, str(root / job.folder))) for job in jobs]
    print(f"running {len(cases)} save_grads jobs on {WORLD_SIZE} gloo processes ...",
          file=sys.stderr, flush=True)  # fmt: skip
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
        wgrads_rows(report, job, outcome.values(job.case), root)

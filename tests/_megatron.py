"""Megatron itself as the oracle: megatron-core's own clip_grads and optimizer code, on gloo CPU
processes, against gradstat given exactly Megatron's arguments.

megatron-core 0.16.1 (the ``parity`` extra) imports without Transformer Engine or Apex and falls
back to its own multi-tensor helpers, but five places in ``optimizer/clip_grads.py`` and one in
its fallback L2 helper allocate on ``device='cuda'``, and clipping asserts a
``torch.cuda.FloatTensor`` gradient. :func:`megatron_clip_grads` loads that very source with
those device strings pointed at the CPU and nothing else changed; it fails loudly when the
upstream text no longer has them where expected, so the workaround can never silently stop
applying. Megatron's optimizer methods (``MegatronOptimizer.get_main_grads_for_grad_norm``,
``get_grad_norm``, ``count_zeros``, ``ChainedOptimizer.get_grad_norm`` ...) then run unchanged
on small stand-in optimizers that hold the rank's parameters and the groups Megatron's
``get_megatron_optimizer`` gives them.

The parameters come from tests/_layouts.py's independent sharder, placed at the coordinates
Megatron's ``parallel_state`` gives each rank.
"""

from __future__ import annotations

import importlib
import inspect
import math
import textwrap
import types
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

import gradstat
from gradstat.snapshot import dump_rank
from tests import _jobs as _layouts
from tests._jobs import Job as Layout
from tests._jobs import RankView

NORM_TYPES = (2.0, 1.0, 3.0, math.inf)

# The CUDA-only spots of megatron-core 0.16.1's clip_grads.py and its fallback L2 helper.
_CLIP_GRADS_CUDA = {"device='cuda'": 5, "'torch.cuda.FloatTensor'": 1}
_L2_HELPER_CUDA = {'device="cuda"': 1}


def _pointed_at_cpu(source: str, where: str, expected: dict[str, int]) -> str:
    for text, count in expected.items():
        found = source.count(text)
        if found != count:
            raise AssertionError(
                f"{where}: expected {count} x {text!r}, found {found}: the upstream code changed "
                "and the CPU workaround of tests/_megatron.py no longer applies"
            )
        source = source.replace(text, text.replace("cuda.", "").replace("cuda", "cpu"))
    return source


def megatron_clip_grads() -> types.ModuleType:
    """megatron.core.optimizer.clip_grads, loaded from its own source with the CUDA devices
    pointed at the CPU."""
    # Expected here: no Transformer Engine, no Apex; Megatron says so at every import.
    warnings.filterwarnings("ignore", message="Transformer Engine and Apex are not installed")
    from megatron.core import utils
    from megatron.core.optimizer import clip_grads

    source = _pointed_at_cpu(inspect.getsource(clip_grads), "clip_grads.py", _CLIP_GRADS_CUDA)
    module = types.ModuleType("megatron.core.optimizer.clip_grads_on_cpu")
    module.__package__ = "megatron.core.optimizer"
    module.__file__ = clip_grads.__file__
    exec(compile(source, clip_grads.__file__ or "clip_grads.py", "exec"), module.__dict__)
    if module.l2_norm_impl is not utils.local_multi_tensor_l2_norm:
        raise AssertionError("Transformer Engine or Apex is installed: the L2 is not Megatron's")
    helper = inspect.getsource(utils.local_multi_tensor_l2_norm)
    namespace = dict(vars(utils))
    exec(_pointed_at_cpu(helper, "utils.local_multi_tensor_l2_norm", _L2_HELPER_CUDA), namespace)
    module.l2_norm_impl = namespace["local_multi_tensor_l2_norm"]
    return module


def _use_cpu_clip_grads(module: types.ModuleType) -> None:
    """Megatron's optimizer module calls the CPU-pointed functions from here on."""
    from megatron.core.optimizer import optimizer

    for name in ("get_grad_norm_fp32", "count_zeros_fp32", "clip_grad_by_total_norm_fp32"):
        setattr(optimizer, name, getattr(module, name))


@dataclass(frozen=True)
class CudaSpot:
    """A megatron-core function whose source names CUDA where a job on gloo CPU processes needs
    the CPU; it is compiled again from that source with ``edits`` made, nothing else changed.

    Attributes:
        module: the module the function is defined in (its globals).
        owner: the class in ``module`` that holds it, "" for a module-level function.
        name: the function's name.
        edits: ``(text, replacement, expected count)``; a count that differs fails loudly.
        rebind: the module whose binding is replaced instead of ``module``'s, for a function
            callers import from a re-export at call time; "" for ``module`` (or ``owner``).
    """

    module: str
    owner: str
    name: str
    edits: tuple[tuple[str, str, int], ...]
    rebind: str = ""


# Megatron's CUDA-only spots on the path from GPTModel to the optimizer, the same text in
# megatron-core 0.16.1 and 0.19.2:
# - LanguageModule.setup_embeddings_and_output_layer moves the tied copy to ``.cuda()``;
# - _ParamAndGradBuffer.__init__ allocates the param/grad buffers on the current CUDA device;
# - MixedPrecisionOptimizer.__init__ and FP32Optimizer.__init__ make small flag tensors on
#   ``'cuda'`` (the former's zero-argument ``super()`` names its class once recompiled);
# - DistributedOptimizer._build_model_and_main_param_groups accepts fp32 parameters by the type
#   name ``torch.cuda.FloatTensor``.
# Megatron's norm and zero count run through its CPU-pointed clip_grads (megatron_clip_grads).
MEGATRON_JOB_SPOTS = (
    CudaSpot(
        "megatron.core.models.common.language_module.language_module",
        "LanguageModule",
        "setup_embeddings_and_output_layer",
        (("weight.data = weight.data.cuda()", "weight.data = weight.data", 1),),
    ),
    CudaSpot(
        "megatron.core.distributed.param_and_grad_buffer",
        "_ParamAndGradBuffer",
        "__init__",
        (("device=torch.cuda.current_device()", 'device="cpu"', 3),),
    ),
    CudaSpot(
        "megatron.core.optimizer.optimizer",
        "MixedPrecisionOptimizer",
        "__init__",
        (
            ("device='cuda'", "device='cpu'", 3),
            ("super().__init__(", "super(MixedPrecisionOptimizer, self).__init__(", 1),
        ),
    ),
    CudaSpot(
        "megatron.core.optimizer.optimizer",
        "FP32Optimizer",
        "__init__",
        (("device='cuda'", "device='cpu'", 1),),
    ),
    CudaSpot(
        "megatron.core.optimizer.distrib_optimizer",
        "DistributedOptimizer",
        "_build_model_and_main_param_groups",
        (
            (
                "model_param.type() == 'torch.cuda.FloatTensor'",
                "model_param.type() == 'torch.FloatTensor'",
                1,
            ),
        ),
    ),
)

_POINTED: set[tuple[str, str, str]] = set()


def point_megatron_at_cpu(spots: Sequence[CudaSpot] = MEGATRON_JOB_SPOTS) -> int:
    """Recompile each of ``spots`` from its installed source, pointed at the CPU (once per
    process); returns how many functions were replaced by this call.

    Raises:
        AssertionError: a spot's text is not in its source as often as expected: megatron-core
            changed and the workaround no longer applies (never silently skipped).
    """
    from importlib.metadata import version

    replaced = 0
    for spot in spots:
        key = (spot.module, spot.owner, spot.name)
        if key in _POINTED:
            continue
        module = importlib.import_module(spot.module)
        holder = importlib.import_module(spot.rebind) if spot.rebind else module
        owner = getattr(holder, spot.owner) if spot.owner else holder
        raw = inspect.getattr_static(owner, spot.name)
        function = raw.__func__ if isinstance(raw, classmethod) else raw
        source = textwrap.dedent(inspect.getsource(function))
        where = f"megatron-core {version('megatron-core')} {spot.module}.{spot.owner or ''}"
        where = f"{where.rstrip('.')}.{spot.name}"
        for text, replacement, count in spot.edits:
            found = source.count(text)
            if found != count:
                raise AssertionError(
                    f"{where}: expected {count} x {text!r}, found {found}: megatron-core changed "
                    "and the CPU workaround of tests/_megatron.py no longer applies"
                )
            source = source.replace(text, replacement)
        namespace = dict(vars(module))
        exec(compile(source, inspect.getsourcefile(function) or where, "exec"), namespace)
        setattr(owner, spot.name, namespace[spot.name])
        _POINTED.add(key)
        replaced += 1
    return replaced


@dataclass(frozen=True)
class GptSize:
    """The small GPT of the Megatron jobs: its sizes and the DDP's bucket size."""

    layers: int
    hidden: int
    heads: int
    ffn: int
    vocab: int
    sequence: int
    experts: int
    expert_ffn: int
    bucket_size: int


def megatron_gpt_job(
    size: GptSize,
    *,
    moe: bool,
    distributed_optimizer: bool,
    before_ddp: Callable[[Any], None] | None = None,
    **parallel: int,
) -> tuple[list[Any], Any]:
    """What a Megatron training script builds on this rank: its ``GPTModel`` (local layer
    spec, output layer tied to the embedding), wrapped in its ``DistributedDataParallel``, and
    ``get_megatron_optimizer``'s Adam, plain or distributed.

    Args:
        size: the model's sizes.
        moe: MoE layers with ``size.experts`` experts.
        distributed_optimizer: the DDP and optimizer use Megatron's distributed optimizer.
        before_ddp: called with the bare model before DDP wraps it.
        parallel: ``TransformerConfig``'s parallel sizes (``tensor_model_parallel_size``, ...).
    """
    from megatron.core import parallel_state as ps
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.transformer import TransformerConfig

    torch.manual_seed(0)
    experts = size.experts if moe else None
    config = TransformerConfig(
        num_layers=size.layers,
        hidden_size=size.hidden,
        num_attention_heads=size.heads,
        ffn_hidden_size=size.ffn,
        num_moe_experts=experts,
        moe_ffn_hidden_size=size.expert_ffn if moe else None,
        moe_router_topk=2,
        expert_tensor_parallel_size=1,
        pipeline_dtype=torch.float32,
        use_cpu_initialization=True,
        **parallel,
    )
    chunk = GPTModel(
        config=config,
        transformer_layer_spec=get_gpt_layer_local_spec(num_experts=experts),
        vocab_size=size.vocab,
        max_sequence_length=size.sequence,
        pre_process=ps.is_pipeline_first_stage(),
        post_process=ps.is_pipeline_last_stage(),
        share_embeddings_and_output_weights=True,
    )
    if before_ddp is not None:
        before_ddp(chunk)
    ddp_config = DistributedDataParallelConfig(
        use_distributed_optimizer=distributed_optimizer, bucket_size=size.bucket_size
    )
    model = [DistributedDataParallel(config, ddp_config, chunk)]
    optimizer_config = OptimizerConfig(
        optimizer="adam",
        lr=1e-3,
        use_distributed_optimizer=distributed_optimizer,
        log_num_zeros_in_grad=True,
    )
    optimizer = get_megatron_optimizer(optimizer_config, model, use_gloo_process_groups=False)
    return model, optimizer


def _stand_in_optimizer(params: list[Any], stats_group: Any, tp_group: Any) -> Any:
    """An object on which MegatronOptimizer's own methods run: parameters, config, groups."""
    from megatron.core.optimizer.optimizer import MegatronOptimizer

    class StandIn:
        get_main_grads_for_grad_norm = MegatronOptimizer.get_main_grads_for_grad_norm
        get_grad_stats_parallel_group = MegatronOptimizer.get_grad_stats_parallel_group
        get_grad_norm = MegatronOptimizer.get_grad_norm
        count_zeros = MegatronOptimizer.count_zeros

        def get_parameters(self) -> list[Any]:
            return params

    stand_in = StandIn()
    stand_in.config = types.SimpleNamespace(  # type: ignore[attr-defined]
        use_precision_aware_optimizer_no_fp8_or_ds_fp8=False, log_num_zeros_in_grad=True
    )
    stand_in.grad_stats_parallel_group = stats_group  # type: ignore[attr-defined]
    stand_in.tp_group = tp_group  # type: ignore[attr-defined]
    return stand_in


def _chained(optimizers: list[Any]) -> Any:
    from megatron.core.optimizer.optimizer import ChainedOptimizer

    class StandInChain:
        grads_states_parallel_group_is_shared = (
            ChainedOptimizer.grads_states_parallel_group_is_shared
        )
        get_grad_stats_parallel_group = ChainedOptimizer.get_grad_stats_parallel_group
        get_grad_norm = ChainedOptimizer.get_grad_norm
        count_zeros = ChainedOptimizer.count_zeros

    chain = StandInChain()
    chain.chained_optimizers = optimizers  # type: ignore[attr-defined]
    chain.config = optimizers[0].config  # type: ignore[attr-defined]
    return chain


def megatron_view(layout: Layout) -> RankView:
    """This rank's coordinates and groups, as Megatron's parallel_state made them."""
    from megatron.core import parallel_state as ps

    pp = ps.get_pipeline_model_parallel_rank()
    dense = {"tp": ps.get_tensor_model_parallel_rank(), "gtp": 0}
    if layout.cp > 1:
        dense["cp"] = ps.get_context_parallel_rank()
    dense |= {"dp": ps.get_data_parallel_rank(), "pp": pp}
    expert = {"etp": ps.get_expert_tensor_parallel_rank(), "egtp": 0}
    expert |= {"ep": ps.get_expert_model_parallel_rank()}
    expert |= {"edp": ps.get_expert_data_parallel_rank(), "pp": pp}
    groups = {
        "tp": ps.get_tensor_model_parallel_group(),
        "etp": ps.get_expert_tensor_parallel_group(),
    }
    return RankView(dense, expert, groups)


def _same_tensors(first: list[Tensor], second: list[Tensor]) -> bool:
    return [id(t) for t in first] == [id(t) for t in second]


def _stats(
    selected: list[Tensor], norm: Callable[[list[Tensor], float], float], zeros: Callable[[], Any]
) -> dict[str, Any]:
    return {"norms": {p: norm(selected, p) for p in NORM_TYPES}, "zeros": zeros()}


def run_parity(rank: int, world_size: int, arg: tuple[Layout, str]) -> dict[str, Any]:
    """One rank: Megatron's and gradstat's statistics of ``layout``, plain and distributed
    optimizer, dense, expert and the chained whole; then the rank dumped with ``dump_rank``
    (coordinates from Megatron's parallel_state) under ``root/plain`` and ``root/distopt``."""
    from megatron.core import parallel_state as ps

    layout, root = arg

    ps.initialize_model_parallel(
        tensor_model_parallel_size=layout.tp,
        pipeline_model_parallel_size=layout.pp,
        context_parallel_size=layout.cp,
        expert_model_parallel_size=layout.ep,
        expert_tensor_parallel_size=layout.etp,
        create_gloo_process_groups=False,
    )
    try:
        mcore = megatron_clip_grads()
        _use_cpu_clip_grads(mcore)
        view = megatron_view(layout)
        params = _layouts.local_params(layout, view)
        tp_group = ps.get_tensor_model_parallel_group()
        result: dict[str, Any] = {"coords": (view.dense, view.expert)}
        for kind in ("plain", "distopt"):
            result[kind] = _one_optimizer_setup(layout, view, params, kind, mcore, tp_group)
            dense, experts = result[kind].pop("members")
            named = [(param._gradstat_name, param) for param in dense + experts]
            dump_rank(Path(root) / kind, named, step=1, distributed_optimizer=kind == "distopt")
        return result
    finally:
        ps.destroy_model_parallel()


def _one_optimizer_setup(
    layout: Layout,
    view: RankView,
    params: list[Any],
    kind: str,
    mcore: types.ModuleType,
    tp_group: Any,
) -> dict[str, Any]:
    from megatron.core import parallel_state as ps

    dense = [param for param in params if getattr(param, "allreduce", True)]
    experts = [param for param in params if not getattr(param, "allreduce", True)]
    if kind == "distopt":
        # Megatron's distributed optimizer shards dense params over DP x CP.
        dense = _layouts.fragments(dense, *layout.dp_cp_place(view.dense), stamp=True)
        experts = _layouts.fragments(experts, view.expert["edp"], layout.edp, stamp=True)
        stats_groups = [ps.get_intra_distributed_optimizer_instance_group()] * 2
    else:
        stats_groups = [ps.get_model_parallel_group()]
        stats_groups.append(ps.get_expert_tensor_model_pipeline_parallel_group())
    out: dict[str, Any] = {}
    optimizers = []
    # A model without experts has no expert optimizer (Megatron makes none).
    parts = [("dense", dense, stats_groups[0])]
    if layout.moe:
        parts.append(("expert", experts, stats_groups[1]))
    for name, members, group in parts:
        optimizer = _stand_in_optimizer(members, group, tp_group)
        optimizers.append(optimizer)
        megatron_selected = optimizer.get_main_grads_for_grad_norm()
        # gradstat with exactly Megatron's arguments (its optimizer passes tp_group alone) ...
        ours_selected = gradstat.grads_for_norm(members, tp_group=tp_group)
        # ... and with no group at all: read from parallel_state in a live job, as Megatron does.
        bare_selected = gradstat.grads_for_norm(members)
        out[name] = {
            "same_selection": _same_tensors(megatron_selected, ours_selected),
            "same_bare_selection": _same_tensors(megatron_selected, bare_selected),
            "megatron": _stats(
                megatron_selected,
                lambda grads, p, group=group: mcore.get_grad_norm_fp32(grads, p, group),
                optimizer.count_zeros,
            ),
            "gradstat": _stats(
                ours_selected,
                lambda grads, p, group=group: gradstat.get_grad_norm_fp32(grads, p, group),
                lambda members=members, group=group: gradstat.count_zeros_fp32(
                    members, group, tp_group=tp_group
                ),
            ),
            "gradstat_bare_zeros": gradstat.count_zeros_fp32(members, group),
            "megatron_optimizer_norm": optimizer.get_grad_norm(),
        }
    chain = _chained(optimizers)
    out["chained"] = {"megatron_norm": chain.get_grad_norm(), "megatron_zeros": chain.count_zeros()}
    out["members"] = (dense, experts)
    out["zeros_type"] = (type(out["dense"]["megatron"]["zeros"]).__name__,)
    out["zeros_type"] += (type(out["dense"]["gradstat"]["zeros"]).__name__,)
    return out


def run_clip_and_empty(rank: int, world_size: int, _arg: Any) -> dict[str, Any]:
    """Clipping on .grad (fp32) and .decoupled_grad (fp32, bf16), and empty gradient lists,
    through Megatron's functions and gradstat's; one process is enough (no reduction)."""
    mcore = megatron_clip_grads()
    generator = torch.Generator().manual_seed(rank + 11)
    result: dict[str, Any] = {"clip": {}, "empty": {}}
    for attr, dtype in (
        ("grad", torch.float32),
        ("decoupled_grad", torch.float32),
        ("decoupled_grad", torch.bfloat16),
    ):
        grads = [torch.randn(n, generator=generator).to(dtype) for n in (7, 300, 4096)]
        for max_norm, total in ((0.5, 3.0), (5.0, 3.0)):
            copies = []
            for clipper in (
                mcore.clip_grad_by_total_norm_fp32,
                gradstat.clip_grad_by_total_norm_fp32,
            ):
                params = [torch.nn.Parameter(torch.zeros(grad.shape)) for grad in grads]
                for param, grad in zip(params, grads, strict=True):
                    setattr(param, attr, grad.clone())
                clipper(params, max_norm, total, use_decoupled_grad=attr == "decoupled_grad")
                copies.append([getattr(param, attr) for param in params])
            megatron_out, ours_out = copies
            result["clip"][(attr, str(dtype), max_norm)] = {
                "bitwise": all(
                    torch.equal(a, b) for a, b in zip(megatron_out, ours_out, strict=True)
                ),
                "scaled_by": [
                    float((b.double() / g.double())[g != 0].mean())
                    for b, g in zip(ours_out, grads, strict=True)
                ],
            }
    for p in NORM_TYPES:
        try:
            megatron = float(mcore.get_grad_norm_fp32([], p, None))
        except Exception as error:  # the crash of NVIDIA/Megatron-LM#5529 in this version
            megatron = f"{type(error).__name__}: {error}"
        result["empty"][p] = {
            "megatron": megatron,
            "gradstat": gradstat.get_grad_norm_fp32([], p, None),
        }
    result["empty_zeros"] = {
        "megatron": mcore.count_zeros_fp32([], None),
        "gradstat": gradstat.count_zeros_fp32([], None),
    }
    return result

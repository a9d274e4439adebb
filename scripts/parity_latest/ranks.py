"""What every rank runs: Megatron's own parallel_state, clip_grads and optimizer code (newest
megatron-core, with GTP) next to gradstat given exactly Megatron's arguments.

Like tests/_megatron.py (the CI parity test against megatron-core 0.16.1), Megatron's
``optimizer/clip_grads.py`` and its no-TE L2 helper are loaded from their own source with their
``device='cuda'`` allocations pointed at the CPU and nothing else changed; the number of such
spots is expected per megatron-core version (:data:`CUDA_SPOTS`), and a source that no longer
has them where expected fails loudly. Megatron's optimizer methods (selection, grad norm, zero
count, the chained optimizer) run unchanged on stand-in objects holding the rank's parameters
and the groups ``get_megatron_optimizer`` gives them in that version.

Parameters come from gradstat.testing's sharder (tests/_jobs.py), placed at the coordinates
Megatron's ``parallel_state`` gives each rank, GTP shards padded and split by the sharder.
Three optimizer setups are measured:

- ``plain``: whole shards (Float16Optimizer / FP32Optimizer), grad stats over the model-parallel
  group (dense) and the expert tensor-model-pipeline group merged over EGTP (experts).
- ``distopt``: the distributed optimizer's 1-D fragments, their attributes copied onto them by
  Megatron's own copy functions (as its DistributedOptimizer does: no ``pad_length``, no
  ``group``, no padding stamp in 0.19.x); grad stats over the whole world.
- ``distopt+stamp``: the same fragments as the sharder stamps them with ``gtp_pad_zeros``
  (the padding inside each fragment, what NVIDIA/Megatron-LM PR #6778 stamps).
"""

from __future__ import annotations

import inspect
import math
import types
import warnings
from importlib.metadata import version
from pathlib import Path
from typing import Any

from packaging.version import Version
from torch import Tensor

import gradstat
from gradstat import testing
from gradstat.snapshot import dump_rank
from gradstat.snapshot.capture import coords_from_megatron
from tests import _jobs
from tests._jobs import Job, RankView
from tests._megatron import _pointed_at_cpu
from tests._params import param_with

NORM_TYPES = (2.0, 1.0, math.inf)
KINDS = ("plain", "distopt", "distopt+stamp")

# The CUDA-only spots of optimizer/clip_grads.py and of utils.local_multi_tensor_l2_norm, per
# megatron-core minor version, counted in each release's source. A newer version not listed
# is tried with the newest counts and fails loudly if its source has others.
CUDA_SPOTS: dict[str, tuple[dict[str, int], dict[str, int]]] = {
    "0.19": ({"device='cuda'": 5, "'torch.cuda.FloatTensor'": 1}, {'device="cuda"': 1}),
}
# GTP (gtp_remat_size, param_is_not_gtp_duplicate) first ships in megatron-core 0.19.0.
FIRST_GTP_RELEASE = Version("0.19.0")


def megatron_version() -> Version:
    return Version(version("megatron-core"))


def _cuda_spots() -> tuple[dict[str, int], dict[str, int]]:
    installed = megatron_version()
    if installed < FIRST_GTP_RELEASE:
        raise RuntimeError(
            f"megatron-core {installed} has no GTP (first in {FIRST_GTP_RELEASE}); this script "
            "measures GTP layouts: install a newer megatron-core"
        )
    minor = f"{installed.major}.{installed.minor}"
    return CUDA_SPOTS.get(minor, CUDA_SPOTS[max(CUDA_SPOTS, key=Version)])


def megatron_clip_grads_on_cpu() -> types.ModuleType:
    """megatron.core.optimizer.clip_grads from its own source, CUDA devices pointed at the CPU,
    wired into Megatron's optimizer module so its methods call these functions."""
    warnings.filterwarnings("ignore", message="Transformer Engine and Apex are not installed")
    warnings.filterwarnings("ignore", message="absl.logging is not installed")
    from megatron.core import utils
    from megatron.core.optimizer import clip_grads, optimizer

    clip_spots, helper_spots = _cuda_spots()
    where = f"megatron-core {megatron_version()} clip_grads.py"
    source = _pointed_at_cpu(inspect.getsource(clip_grads), where, clip_spots)
    module = types.ModuleType("megatron.core.optimizer.clip_grads_on_cpu")
    module.__package__ = "megatron.core.optimizer"
    module.__file__ = clip_grads.__file__
    exec(compile(source, clip_grads.__file__ or "clip_grads.py", "exec"), module.__dict__)
    if module.l2_norm_impl is not utils.local_multi_tensor_l2_norm:
        raise RuntimeError("Transformer Engine or Apex is installed: the L2 is not Megatron's")
    helper = inspect.getsource(utils.local_multi_tensor_l2_norm)
    namespace = dict(vars(utils))
    exec(_pointed_at_cpu(helper, "utils.local_multi_tensor_l2_norm", helper_spots), namespace)
    module.l2_norm_impl = namespace["local_multi_tensor_l2_norm"]
    for name in ("get_grad_norm_fp32", "count_zeros_fp32", "clip_grad_by_total_norm_fp32"):
        setattr(optimizer, name, getattr(module, name))
    return module


# MegatronOptimizer's own methods the stand-ins run (selection is get_grads_for_grad_norm from
# 0.19, get_main_grads_for_grad_norm before).
_OPTIMIZER_METHODS = (
    "_filter_grads_for_norm",
    "get_grads_for_grad_norm",
    "get_main_grads_for_grad_norm",
    "get_grad_stats_parallel_group",
    "get_grad_norm",
    "count_zeros",
)
_CHAINED_METHODS = (
    "grads_states_parallel_group_is_shared",
    "get_grad_stats_parallel_group",
    "get_grad_norm",
    "count_zeros",
)


def _stand_in(params: list[Any], stats_group: Any, tp_group: Any, expert_tp_group: Any) -> Any:
    """An object on which MegatronOptimizer's methods run, with what get_megatron_optimizer
    sets on a real one: grad_stats_parallel_group, tp_group, expert_tp_group."""
    from megatron.core.optimizer.optimizer import MegatronOptimizer

    methods = {
        n: getattr(MegatronOptimizer, n)
        for n in _OPTIMIZER_METHODS
        if hasattr(MegatronOptimizer, n)
    }
    stand_in: Any = type("StandInOptimizer", (), methods)()
    stand_in.get_parameters = lambda: params
    stand_in.config = types.SimpleNamespace(
        use_precision_aware_optimizer_no_fp8_or_ds_fp8=False,
        use_precision_aware_optimizer=False,
        log_num_zeros_in_grad=True,
    )
    stand_in.grad_stats_parallel_group = stats_group
    stand_in.tp_group, stand_in.expert_tp_group = tp_group, expert_tp_group
    return stand_in


def _selected(optimizer: Any) -> list[Tensor]:
    if hasattr(optimizer, "get_grads_for_grad_norm"):
        return list(optimizer.get_grads_for_grad_norm())
    return list(optimizer.get_main_grads_for_grad_norm())


def _chained(optimizers: list[Any]) -> Any:
    from megatron.core.optimizer.optimizer import ChainedOptimizer

    methods = {name: getattr(ChainedOptimizer, name) for name in _CHAINED_METHODS}
    chain: Any = type("StandInChain", (), methods)()
    chain.chained_optimizers = optimizers
    chain.config = optimizers[0].config
    return chain


def _unravel(rank: int, axes: list[tuple[str, int]]) -> dict[str, int]:
    """``rank``'s place on each axis, the first axis the fastest."""
    coords = {}
    for axis, size in axes:
        coords[axis], rank = rank % size, rank // size
    return coords


def expected_coords(layout: Job, rank: int) -> dict[str, list[int]]:
    """Where Megatron's documented rank order puts ``rank``: dense 'tp-gtp_remat-cp-ep-dp-pp',
    experts 'tp-cp-ep-gtp_remat-dp-pp' (parallel_state._inject_gtp_remat_axis: EGTP after EP).
    """
    dense_axes = [("tp", layout.tp), ("gtp", layout.gtp), ("dp", layout.dp), ("pp", layout.pp)]
    expert_axes = [("etp", layout.etp), ("ep", layout.ep), ("egtp", layout.egtp)]
    expert_axes += [("edp", layout.edp), ("pp", layout.pp)]
    sizes = dict(dense_axes) | dict(expert_axes) | {"cp": 1}
    coords = _unravel(rank, dense_axes) | _unravel(rank, expert_axes)
    return {axis: [coords.get(axis, 0), size] for axis, size in sorted(sizes.items())}


def _parallel_state_coords() -> dict[str, list[int]]:
    """This rank's coordinates read straight from parallel_state (replica DP without GTP)."""
    from megatron.core import parallel_state as ps

    def place(group: Any) -> list[int]:
        return [int(group.rank()), int(group.size())]

    return {
        "cp": place(ps.get_context_parallel_group()),
        "dp": place(ps.get_data_parallel_group(with_gtp_remat=False)),
        "edp": place(ps.get_expert_data_parallel_group(with_gtp_remat=False)),
        "egtp": place(ps.get_expert_gtp_weight_remat_group()),
        "ep": place(ps.get_expert_model_parallel_group()),
        "etp": place(ps.get_expert_tensor_parallel_group()),
        "gtp": place(ps.get_gtp_weight_remat_group()),
        "pp": place(ps.get_pipeline_model_parallel_group()),
        "tp": place(ps.get_tensor_model_parallel_group()),
    }


def _view(coords: dict[str, list[int]]) -> RankView:
    """The sharder's view of this rank at Megatron's coordinates, with Megatron's groups."""
    from megatron.core import parallel_state as ps

    rank = {axis: place[0] for axis, place in coords.items()}
    dense = {axis: rank[axis] for axis in ("tp", "gtp", "dp", "pp")}
    expert = {axis: rank[axis] for axis in ("etp", "egtp", "ep", "edp", "pp")}
    groups = {
        "tp": ps.get_tensor_model_parallel_group(),
        "etp": ps.get_expert_tensor_parallel_group(),
        "gtp": ps.get_gtp_weight_remat_group(),
        "egtp": ps.get_expert_gtp_weight_remat_group(),
    }
    return RankView(dense, expert, groups)


def _megatron_fragments(stamped: list[Any], model_params: list[Any]) -> list[Any]:
    """The sharder's fragments, their attributes replaced by what Megatron's
    DistributedOptimizer copies onto its shard main params (its own copy functions)."""
    from megatron.core import tensor_parallel
    from megatron.core.optimizer.optimizer import copy_optimizer_param_metadata

    by_name = {param._gradstat_name: param for param in model_params}
    fragments = []
    for fragment in stamped:
        source = by_name[fragment._gradstat_name]
        main = param_with(
            fragment.grad,
            _gradstat_name=fragment._gradstat_name,
            fragment_offset=fragment.fragment_offset,
            fragment_shape=fragment.fragment_shape,
        )
        tensor_parallel.copy_tensor_model_parallel_attributes(main, source)
        tensor_parallel.copy_gtp_attributes(main, source)
        copy_optimizer_param_metadata(main, source)
        fragments.append(main)
    return fragments


def _same_tensors(first: list[Tensor], second: list[Tensor]) -> bool:
    return [id(t) for t in first] == [id(t) for t in second]


def _optimizer_setup(
    layout: Job, view: RankView, params: list[Any], kind: str, mcore: types.ModuleType
) -> dict[str, Any]:
    """Megatron's and gradstat's statistics of one optimizer setup: dense, expert, chained."""
    from megatron.core import parallel_state as ps

    tp_group = ps.get_tensor_model_parallel_group()
    expert_tp_group = ps.get_expert_tensor_parallel_group()
    dense = [param for param in params if getattr(param, "allreduce", True)]
    experts = [param for param in params if not getattr(param, "allreduce", True)]
    if kind == "plain":
        stats_groups = [
            ps.get_model_parallel_group(),
            ps.get_expert_tensor_model_pipeline_parallel_group(with_egtp_remat=True),
        ]
    else:
        # What the distributed optimizer shards over: the replica DP (x CP) group without GTP.
        dp = ps.get_data_parallel_group(
            with_context_parallel=True, with_gtp_remat=False, partial_data_parallel=True
        )
        edp = ps.get_expert_data_parallel_group(
            with_gtp_remat=False, partial_expert_data_parallel=True
        )
        stamped_dense = _jobs.fragments(dense, dp.rank(), dp.size(), stamp=True)
        stamped_experts = _jobs.fragments(experts, edp.rank(), edp.size(), stamp=True)
        if kind == "distopt":
            stamped_dense = _megatron_fragments(stamped_dense, dense)
            stamped_experts = _megatron_fragments(stamped_experts, experts)
        dense, experts = stamped_dense, stamped_experts
        stats_groups = [ps.get_intra_distributed_optimizer_instance_group()] * 2
    out: dict[str, Any] = {}
    optimizers = []
    for part, members, group in (
        ("dense", dense, stats_groups[0]),
        ("expert", experts, stats_groups[1]),
    ):
        if part == "expert" and not layout.moe:
            continue
        optimizer = _stand_in(members, group, tp_group, expert_tp_group)
        optimizers.append(optimizer)
        megatron_selected = _selected(optimizer)
        # gradstat with exactly the arguments Megatron's optimizer passes (no GTP group) ...
        ours = gradstat.grads_for_norm(members, tp_group=tp_group, expert_tp_group=expert_tp_group)
        # ... and with no group at all: every axis read from parallel_state, as Megatron does.
        bare = gradstat.grads_for_norm(members)
        megatron_zeros = optimizer.count_zeros()
        out[part] = {
            "same_selection": _same_tensors(megatron_selected, ours),
            "same_bare_selection": _same_tensors(megatron_selected, bare),
            "megatron_norms": {
                p: float(mcore.get_grad_norm_fp32(megatron_selected, p, group)) for p in NORM_TYPES
            },
            "gradstat_norms": {p: gradstat.get_grad_norm_fp32(ours, p, group) for p in NORM_TYPES},
            "megatron_optimizer_norm": float(optimizer.get_grad_norm()),
            "megatron_zeros": megatron_zeros,
            "gradstat_zeros": gradstat.count_zeros_fp32(
                members, group, tp_group=tp_group, expert_tp_group=expert_tp_group
            ),
            "gradstat_bare_zeros": gradstat.count_zeros_fp32(members, group),
            "zeros_types": (type(megatron_zeros).__name__,),
        }
        out[part]["zeros_types"] += (type(out[part]["gradstat_zeros"]).__name__,)
    chain = _chained(optimizers)
    out["chained"] = {
        "megatron_norm": float(chain.get_grad_norm()),
        "megatron_zeros": chain.count_zeros(),
    }
    out["members"] = dense + experts
    return out


def run_layout(rank: int, world_size: int, arg: tuple[Job, str]) -> dict[str, Any]:
    """One rank of one layout: coordinates, the three optimizer setups, the dumped snapshots
    (``root/<kind>``, coordinates left to dump_rank) and Megatron's answer on empty lists."""
    from megatron.core import parallel_state as ps

    layout, root = arg
    assert world_size == layout.world_size, (world_size, layout)
    mcore = megatron_clip_grads_on_cpu()
    ps.initialize_model_parallel(
        tensor_model_parallel_size=layout.tp,
        pipeline_model_parallel_size=layout.pp,
        expert_model_parallel_size=layout.ep,
        expert_tensor_parallel_size=layout.etp,
        gtp_remat_size=layout.gtp,
        expert_gtp_remat_size=layout.egtp,
        create_gloo_process_groups=False,
    )
    try:
        coords = _parallel_state_coords()
        offline = testing.Layout(
            tp=layout.tp,
            pp=layout.pp,
            dp=layout.dp,
            gtp=layout.gtp,
            ep=layout.ep,
            etp=layout.etp,
            egtp=layout.egtp,
        ).coords(rank)
        result: dict[str, Any] = {
            "expected_coords": expected_coords(layout, rank),
            "parallel_state_coords": coords,
            "dump_rank_coords": coords_from_megatron(),
            "gradstat_layout_coords": {axis: list(place) for axis, place in offline.items()},
        }
        view = _view(coords)
        params = _jobs.local_params(layout, view)
        for kind in KINDS:
            result[kind] = _optimizer_setup(layout, view, params, kind, mcore)
            named = [(param._gradstat_name, param) for param in result[kind].pop("members")]
            dump_rank(Path(root) / kind, named, step=1, distributed_optimizer=kind != "plain")
        empty_zeros = mcore.count_zeros_fp32([], None)
        result["empty"] = {
            "megatron": {p: float(mcore.get_grad_norm_fp32([], p, None)) for p in NORM_TYPES},
            "gradstat": {p: gradstat.get_grad_norm_fp32([], p, None) for p in NORM_TYPES},
            "megatron_zeros": (empty_zeros, type(empty_zeros).__name__),
            "gradstat_zeros": gradstat.count_zeros_fp32([], None),
        }
        return result
    finally:
        ps.destroy_model_parallel()

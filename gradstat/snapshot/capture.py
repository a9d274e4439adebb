"""dump_rank: one call from a live training job, which works out the rank's place itself.

With Megatron's distributed optimizer the call also takes the optimizer: after the gradient
reduce-scatter a rank's ``main_grad`` holds reduced values only in the range that rank's
optimizer owns, so that range is what the rank dumps (:func:`optimizer_fragments`).
"""

from __future__ import annotations

import inspect
import os
import re
import types
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from gradstat.core.axes import AXES, EXPERT_AXES, Axis, too_many_places
from gradstat.core.groups import megatron_gtp_group, megatron_state
from gradstat.core.predicates import gtp_local_pad_zero_count
from gradstat.errors import SnapshotError
from gradstat.snapshot.format import FRAGMENT_INHERITED_ATTRS
from gradstat.snapshot.writer import check_coords, save_rank

__all__ = [
    "coords_from_megatron",
    "coords_from_mesh",
    "dump_rank",
    "gradients_to_dump",
    "logical_name",
    "named_gradients",
    "optimizer_fragments",
    "rank_coords",
]

# DeviceMesh dimension names that together make up the data-parallel axis (FSDP2 / HSDP).
_DP_MESH_NAMES = ("dp_replicate", "dp", "dp_shard", "dp_shard_cp")

# (axis, parallel_state rank getter, size getter); the data-parallel ones without CP.
_MEGATRON_GETTERS = (
    (Axis.tp, "get_tensor_model_parallel_rank", "get_tensor_model_parallel_world_size"),
    (Axis.pp, "get_pipeline_model_parallel_rank", "get_pipeline_model_parallel_world_size"),
    (Axis.dp, "get_data_parallel_rank", "get_data_parallel_world_size"),
    (Axis.cp, "get_context_parallel_rank", "get_context_parallel_world_size"),
    (Axis.ep, "get_expert_model_parallel_rank", "get_expert_model_parallel_world_size"),
    (Axis.etp, "get_expert_tensor_parallel_rank", "get_expert_tensor_parallel_world_size"),
    (Axis.edp, "get_expert_data_parallel_rank", "get_expert_data_parallel_world_size"),
)


def _call_without(fn: Any, **options: bool) -> int:
    """``fn(**options)`` with only the options its signature takes (versions differ)."""
    try:
        accepted: Mapping[str, Any] = inspect.signature(fn).parameters
    except (TypeError, ValueError):
        accepted = {}
    if any(param.kind is inspect.Parameter.VAR_KEYWORD for param in accepted.values()):
        return int(fn(**options))
    return int(fn(**{name: value for name, value in options.items() if name in accepted}))


def coords_from_megatron() -> dict[str, list[int]] | None:
    """This rank's coordinates from ``megatron.core.parallel_state``, or None outside a
    Megatron job (one that has not imported and initialised it).

    Data-parallel axes are the replica axes Megatron's optimizer reduces over: without context
    parallelism and without GTP (``with_gtp_remat=False``, where the version's default folds
    the GTP ranks into dp). GTP and EGTP come from Megatron's GTP groups where the version has
    them.
    """
    state = megatron_state()
    if state is None:
        return None
    coords: dict[str, list[int]] = {}
    for axis, rank_getter, size_getter in _MEGATRON_GETTERS:
        rank_fn, size_fn = getattr(state, rank_getter, None), getattr(state, size_getter, None)
        if rank_fn is None or size_fn is None:
            continue
        options = {"with_gtp_remat": False}
        if axis is Axis.dp:
            options["with_context_parallel"] = False
        coords[axis] = [_call_without(rank_fn, **options), _call_without(size_fn, **options)]
    for gtp_axis in (Axis.gtp, Axis.egtp):
        group = megatron_gtp_group(state, gtp_axis)
        if group is not None:
            coords[gtp_axis] = [int(group.rank()), int(group.size())]
    return coords


def coords_from_mesh(mesh: Any) -> dict[str, list[int]]:
    """This rank's coordinates on a DeviceMesh whose dimension names are gradstat's axes.

    FSDP2/HSDP dimensions (dp_replicate, dp_shard, dp_shard_cp, dp) combine into one dp axis.

    Raises:
        ValueError: an unnamed mesh, a dimension name gradstat does not know, or a rank that is
            not on the mesh.
    """
    names = mesh.mesh_dim_names
    coordinate = mesh.get_coordinate()
    if names is None or coordinate is None:
        raise ValueError("the DeviceMesh needs mesh_dim_names and must contain this rank")
    coords: dict[str, list[int]] = {}
    dp_rank, dp_size = 0, 1
    for name, index, size in zip(names, coordinate, mesh.shape, strict=True):
        if name in _DP_MESH_NAMES:
            dp_rank, dp_size = dp_rank * size + index, dp_size * size
        elif name in AXES:
            coords[name] = [int(index), int(size)]
        else:
            raise ValueError(
                f"mesh dimension {name!r} is not a gradstat axis ({', '.join(AXES)}, or "
                f"{', '.join(_DP_MESH_NAMES)}); pass coords explicitly"
            )
    coords["dp"] = [dp_rank, dp_size]
    return coords


def _step_number(step: int | torch.Tensor | None) -> int | None:
    if isinstance(step, torch.Tensor):
        if step.numel() != 1 or step.dtype.is_floating_point or step.dtype.is_complex:
            raise ValueError(f"step must be an integer or a 0-d integer tensor, got {step!r}")
        return int(step.item())
    if step is not None and (isinstance(step, bool) or not isinstance(step, int)):
        raise ValueError(f"step must be an integer or a 0-d integer tensor, got {step!r}")
    return step


_LAYER = re.compile(r"(^|\.)layers\.(\d+)$")
_LOCAL_EXPERT = re.compile(r"(^|\.)local_experts\.(\d+)$")
# Grouped-GEMM experts (TEGroupedMLP): one module per fc, expert K's weight is ``weightK``.
_GROUPED_EXPERT = re.compile(r"(\.experts\.linear_fc[12]\.(?:weight|bias))(\d+)$")


def _global_prefixes(module: torch.nn.Module) -> tuple[dict[str, str], dict[str, str]]:
    """Module paths, and parameter names, renamed to global indices, so that names agree
    across pipeline stages and expert-parallel ranks.

    Megatron numbers a stage's layers from 0; each layer knows its global ``layer_number``
    (1-based). Expert modules list their global ``local_expert_indices``: SequentialMLP's
    ``local_experts.K`` modules are renamed, and a grouped GEMM's ``weightK`` parameters (one
    module per fc, TEGroupedMLP) get ``weight{indices[K]}``.
    """
    renames, grouped = {}, {}
    for path, sub in module.named_modules():
        layer_number = getattr(sub, "layer_number", None)
        if isinstance(layer_number, int) and _LAYER.search(path):
            renames[path] = _LAYER.sub(rf"\g<1>layers.{layer_number - 1}", path)
        indices = getattr(sub, "local_expert_indices", None)
        if isinstance(indices, Sequence):
            for child_path, _ in sub.named_modules(prefix=path):
                match = _LOCAL_EXPERT.search(child_path)
                if match and int(match.group(2)) < len(indices):
                    global_index = indices[int(match.group(2))]
                    renames[child_path] = _LOCAL_EXPERT.sub(
                        rf"\g<1>local_experts.{global_index}", child_path
                    )
            for name, _ in sub.named_parameters(prefix=path):
                match = _GROUPED_EXPERT.search(name)
                if match and int(match.group(2)) < len(indices):
                    grouped[name] = f"{name[: match.start(2)]}{indices[int(match.group(2))]}"
    return renames, grouped


def _rename(name: str, renames: Mapping[str, str]) -> str:
    # Only paths that prefix the original name, innermost first: an expert's rename keeps its
    # layer's (local) prefix, which the layer's rename then replaces.
    matches = [path for path in renames if name.startswith(path + ".")]
    for path in sorted(matches, key=len, reverse=True):
        name = renames[path] + name[len(path) :]
    return name


# Module names wrappers insert into parameter names: torch.compile, activation checkpointing,
# FSDP1. DDP (PyTorch's and Megatron's, and Megatron's Float16Module) adds leading "module.".
_WRAPPER_COMPONENTS = frozenset({"_orig_mod", "_checkpoint_wrapped_module", "_fsdp_wrapped_module"})


def logical_name(name: str) -> str:
    """``name`` without the components wrappers add, so that every wrapper's snapshot compares.

    ``module.0.weight`` (DDP) and ``_orig_mod.layers.0._checkpoint_wrapped_module.w`` become
    ``0.weight`` and ``layers.0.w``.
    """
    parts = [part for part in name.split(".") if part not in _WRAPPER_COMPONENTS]
    while len(parts) > 1 and parts[0] == "module":
        parts.pop(0)
    return ".".join(parts)


def named_gradients(
    model: torch.nn.Module | Sequence[torch.nn.Module] | Iterable[tuple[str, Any]],
) -> list[tuple[str, Any]]:
    """``(name, param)`` pairs with names that mean the same logical tensor on every rank.

    A module (or a list of Megatron model chunks) is walked with ``named_parameters``; layer and
    expert indices are made global (see ``_global_prefixes``).
    Anything else is taken as ``(name, param)`` pairs. Names lose the components wrappers add
    (:func:`logical_name`).
    """
    items: list[Any] = [model] if isinstance(model, torch.nn.Module) else list(model)
    if not items or not all(isinstance(item, torch.nn.Module) for item in items):
        return [(logical_name(name), param) for name, param in items]
    modules: list[torch.nn.Module] = items
    pairs = []
    for module in modules:
        renames, grouped = _global_prefixes(module)
        pairs += [
            (logical_name(_rename(grouped.get(name, name), renames)), param)
            for name, param in module.named_parameters()
        ]
    return pairs


# A fragment carries its model parameter's attributes; where it lies is its own.
def _optimizer_parts(optimizer: Any) -> list[Any]:
    """The innermost Megatron optimizers of ``optimizer``, stubs left out.

    A ``ChainedOptimizer`` (dense + expert) lists them in ``chained_optimizers``; a wrapper
    holds a Megatron optimizer (not a torch one) as ``optimizer``. A stub (a rank whose
    parameters are all frozen) owns nothing.
    """
    parts, pending = [], [optimizer]
    while pending:
        current = pending.pop()
        chained = getattr(current, "chained_optimizers", None)
        if chained is not None:
            # Read before .optimizer, which a ChainedOptimizer of several refuses.
            pending.extend(reversed(list(chained)))
            continue
        inner = None if hasattr(current, "gbuf_ranges") else getattr(current, "optimizer", None)
        if inner is not None and not isinstance(inner, torch.optim.Optimizer):
            pending.append(inner)
        elif not getattr(current, "is_stub_optimizer", False):
            parts.append(current)
    return parts


def _owned_ranges(part: Any) -> Iterable[tuple[Any, int, int]]:
    """``(model_param, start, end)`` for each parameter a DistributedOptimizer owns a range of.

    ``gbuf_ranges`` holds, per grad buffer, per (param dtype, grad dtype), per bucket, a
    ``param_map`` whose ``"param"`` range is where this rank's shard lies in the flattened
    parameter: the slice of ``main_grad`` the optimizer copies into its main-param grad.
    (megatron-core 0.16 to 0.19 agree on this.)
    """
    for buffer_ranges in part.gbuf_ranges:
        for bucket_ranges in buffer_ranges.values():
            for bucket in bucket_ranges:
                for param, ranges in bucket["param_map"].items():
                    param_range = ranges["param"]
                    yield param, int(param_range.start), int(param_range.end)


def _distributed_ranges(optimizer: Any) -> dict[int, tuple[Any, int, int]] | None:
    """The ranges the optimizer owns on this rank by ``id(model_param)``; None when it is not
    a distributed optimizer.

    Raises:
        SnapshotError: distributed and plain parts mixed, a parameter owned twice, or a range
            map this version of gradstat cannot read.
    """
    parts = _optimizer_parts(optimizer)
    distributed = [part for part in parts if hasattr(part, "gbuf_ranges")]
    if not distributed:
        return None
    if len(distributed) != len(parts):
        plain = next(part for part in parts if not hasattr(part, "gbuf_ranges"))
        raise SnapshotError(
            f"the optimizer mixes distributed parts with a plain {type(plain).__name__}; "
            "a snapshot is all fragments or all whole gradients"
        )
    ranges: dict[int, tuple[Any, int, int]] = {}
    for part in distributed:
        try:
            owned = list(_owned_ranges(part))
        except (AttributeError, KeyError, TypeError, ValueError) as error:
            raise SnapshotError(
                f"cannot read the range map (gbuf_ranges) of {type(part).__name__}: {error!r}; "
                "this megatron-core version lays it out differently from 0.16-0.19"
            ) from error
        for param, start, end in owned:
            if id(param) in ranges:
                raise SnapshotError(
                    f"a parameter of shape {list(param.shape)} is owned by two optimizers"
                )
            ranges[id(param)] = (param, start, end)
    return ranges


def _fragment(param: Any, start: int, end: int) -> types.SimpleNamespace:
    """What :func:`save_rank` reads of one fragment: attributes, ``main_grad``, shape."""
    grad = param.main_grad.view(-1)[start:end]
    attrs = {key: getattr(param, key) for key in FRAGMENT_INHERITED_ATTRS if hasattr(param, key)}
    if getattr(param, "is_gtp_weight_remat", False):
        attrs["group"] = getattr(param, "group", None)
        attrs["gtp_pad_zeros"] = gtp_local_pad_zero_count(param, start, end)
    return types.SimpleNamespace(
        **attrs,
        fragment_offset=start,
        fragment_shape=list(param.shape),
        main_grad=grad,
        shape=grad.shape,
    )


def optimizer_fragments(
    model: torch.nn.Module | Sequence[torch.nn.Module] | Iterable[tuple[str, Any]],
    optimizer: Any,
) -> list[tuple[str, Any]] | None:
    """This rank's distributed-optimizer fragments, named as :func:`named_gradients` names
    the model's parameters; None when ``optimizer`` is not a distributed optimizer.

    For each model parameter Megatron's ``DistributedOptimizer`` owns a range of on this rank
    (a ``ChainedOptimizer`` of them, or a wrapper, too): the range of
    ``param.main_grad.view(-1)``, carrying the parameter's Megatron attributes,
    ``fragment_offset`` (the range's start) and ``fragment_shape`` (the parameter's shape);
    GTP shards also get ``gtp_pad_zeros``, the padding inside the range. Megatron is never
    imported: the optimizer is read through its ``chained_optimizers`` and ``gbuf_ranges``.

    Raises:
        SnapshotError: the optimizer owns a parameter ``model`` does not have, a parameter
            has no ``main_grad``, or the optimizer cannot be read (see _distributed_ranges).
    """
    ranges = _distributed_ranges(optimizer)
    if ranges is None:
        return None
    fragments = []
    for name, param in named_gradients(model):
        owned = ranges.pop(id(param), None)
        if owned is None:
            continue
        if getattr(param, "main_grad", None) is None:
            raise SnapshotError(
                f"parameter {name!r} has no .main_grad: dump after backward and the gradient "
                "reduce-scatter, before zero_grad"
            )
        fragments.append((name, _fragment(*owned)))
    if ranges:
        param, _, _ = next(iter(ranges.values()))
        raise SnapshotError(
            f"the optimizer owns {len(ranges)} parameters the model does not have (the first of "
            f"shape {list(param.shape)}): pass the model chunks the optimizer was built for"
        )
    return fragments


def _uses_distributed_optimizer(model: Any) -> bool:
    """Whether Megatron's DDP says its chunks use the distributed optimizer (ddp_config)."""
    if isinstance(model, torch.nn.Module):
        chunks: Sequence[Any] = [model]
    elif isinstance(model, Sequence):
        chunks = model
    else:
        return False
    return any(
        getattr(getattr(chunk, "ddp_config", None), "use_distributed_optimizer", False) is True
        for chunk in chunks
        if isinstance(chunk, torch.nn.Module)
    )


def gradients_to_dump(
    model: torch.nn.Module | Sequence[torch.nn.Module] | Iterable[tuple[str, Any]],
    optimizer: Any = None,
    grad_attr: str | None = None,
    distributed_optimizer: bool = False,
) -> tuple[list[tuple[str, Any]], str, bool]:
    """What :func:`dump_rank` (and the flight recorder) dump of ``model``: named parameters,
    the gradient attribute and whether they are distributed-optimizer fragments.

    With a distributed ``optimizer``: its fragments (:func:`optimizer_fragments`),
    ``"main_grad"``, True. Else the model's parameters (:func:`named_gradients`), ``grad_attr``
    (None: ``"main_grad"`` when any parameter has one, else ``"grad"``) and
    ``distributed_optimizer`` as given.

    Raises:
        SnapshotError: the model's DDP uses the distributed optimizer and no distributed
            ``optimizer`` was given: its whole ``main_grad`` would give a wrong number.
        ValueError: a ``grad_attr`` other than "main_grad" with fragments.
    """
    fragments = None if optimizer is None else optimizer_fragments(model, optimizer)
    if fragments is not None:
        if grad_attr not in (None, "main_grad"):
            raise ValueError(
                f"grad_attr={grad_attr!r}: distributed-optimizer fragments are main_grad ranges"
            )
        return fragments, "main_grad", True
    if _uses_distributed_optimizer(model):
        given = "no optimizer" if optimizer is None else f"a plain {type(optimizer).__name__}"
        rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
        raise SnapshotError(
            f"rank {rank}: the model's DDP uses the distributed optimizer, whose main_grad "
            f"holds reduced values only in this rank's range, and {given} was given: pass "
            "optimizer=optimizer"
        )
    pairs = named_gradients(model)
    if grad_attr is None:
        has_main = any(getattr(param, "main_grad", None) is not None for _, param in pairs)
        grad_attr = "main_grad" if has_main else "grad"
    return pairs, grad_attr, distributed_optimizer


def rank_coords(
    coords: Mapping[str, Sequence[int]] | None = None, mesh: Any = None
) -> tuple[int, int, dict[str, list[int]]]:
    """This rank, the world size and the rank's coordinates, as :func:`dump_rank` finds them:
    ``mesh``, else Megatron's ``parallel_state``, else plain data parallelism over the world;
    ``coords`` entries override."""
    ready = dist.is_available() and dist.is_initialized()
    rank = dist.get_rank() if ready else 0
    world_size = dist.get_world_size() if ready else 1
    if mesh is not None:
        found: dict[str, list[int]] | None = coords_from_mesh(mesh)
    else:
        found = coords_from_megatron()
    if found is None:
        found = {"dp": [rank, world_size]}
    merged = {**found, **{axis: list(place) for axis, place in (coords or {}).items()}}
    if not merged.keys() & _EXPERT_AXIS_NAMES:
        merged.update(_experts_as_dense(merged))
    return rank, world_size, merged


_EXPERT_AXIS_NAMES = frozenset(EXPERT_AXES)


def _experts_as_dense(coords: Mapping[str, list[int]]) -> dict[str, list[int]]:
    """The expert axes of a job that names none (no expert parallelism: a DDP job's
    ``allreduce=False`` parameters, DeepSpeed-style, or a mesh without expert dimensions): its
    expert parameters are laid out as the others, sharded over tp (and gtp) and replicated over
    dp and cp, as Megatron lays them out with one expert-parallel rank. Without this, two
    tensor-parallel or data-parallel ranks would hold experts at one expert coordinate, and no
    reader could take the snapshot."""
    tp, gtp, dp, cp = (_place(coords.get(axis, (0, 1))) for axis in ("tp", "gtp", "dp", "cp"))
    if tp is None or gtp is None or dp is None or cp is None:
        return {}  # a malformed place: check_coords words it
    return {"etp": list(tp), "egtp": list(gtp), "edp": [dp[0] * cp[1] + cp[0], dp[1] * cp[1]]}


def _place(value: Any) -> tuple[int, int] | None:
    if isinstance(value, (list, tuple)) and len(value) == 2 and all(type(v) is int for v in value):
        return value[0], value[1]
    return None


def job_coords(
    coords: Mapping[str, Sequence[int]] | None = None, mesh: Any = None
) -> tuple[int, int, dict[str, list[int]]]:
    """:func:`rank_coords`, checked: in a live process group, coordinates that describe more
    places than the job has ranks (``coords={"tp": ...}`` beside the data-parallel size found
    over the world) are refused before anything is written that no reader could take.

    Raises:
        ValueError: unknown axes, bad places, or more places than ranks.
    """
    rank, world_size, merged = rank_coords(coords, mesh)
    problem = too_many_places(check_coords(merged), world_size)
    if problem is not None and dist.is_available() and dist.is_initialized():
        # Outside a process group the world size is a stand-in, not the job's.
        raise ValueError(f"coords {merged}: {problem}; give every axis of the job")
    return rank, world_size, merged


def dump_rank(
    directory: str | os.PathLike[str],
    model: torch.nn.Module | Sequence[torch.nn.Module] | Iterable[tuple[str, Any]],
    *,
    optimizer: Any = None,
    step: int | torch.Tensor | None = None,
    grad_attr: str | None = None,
    distributed_optimizer: bool = False,
    coords: Mapping[str, Sequence[int]] | None = None,
    mesh: Any = None,
    overwrite: bool = False,
    triggers: Sequence[str] = (),
    empty_ok: bool = False,
) -> Path:
    """Dump this rank of a live job: coordinates and names worked out, then :func:`save_rank`.

    Call it on every rank after backward and the gradient reduction (Megatron's
    ``finalize_model_grads``) and before ``optimizer.step()`` and ``zero_grad``.

    Coordinates come from, in order: ``coords``; ``mesh`` (a DeviceMesh); Megatron's
    ``parallel_state`` when it is importable and initialized; else plain data parallelism over
    the torch.distributed world. Explicit ``coords`` entries override discovered ones. DTensor
    gradients (FSDP2, HSDP, TP x FSDP2) need none of it: their placements, recorded with their
    mesh, decide what counts.

    With Megatron's distributed optimizer pass it as ``optimizer``: each rank then dumps the
    fragments it owns (:func:`optimizer_fragments`), the only part of its ``main_grad`` that
    holds reduced values after the reduce-scatter, with ``distributed_optimizer`` set. A plain
    optimizer changes nothing.

    Args:
        directory: the snapshot directory, the same on every rank.
        model: a module, a list of model chunks, or ``(name, param)`` pairs.
        optimizer: Megatron's optimizer (what ``get_megatron_optimizer`` returns); needed when
            the model's DDP uses the distributed optimizer.
        step: the training step, an int or a 0-d integer tensor.
        grad_attr: "grad", "main_grad" or "decoupled_grad"; None: "main_grad" when any
            parameter has one (Megatron's DDP), else "grad". Fragments are always "main_grad".
        distributed_optimizer: the gradients are disjoint shards across data-parallel ranks
            (fragments named by hand, FSDP); set for you with a distributed ``optimizer``.
        coords: ``{axis: [rank_on_axis, axis_size]}``, overriding what is discovered.
        mesh: a DeviceMesh whose dimension names are gradstat axes.
        overwrite: replace an existing rank file.
        triggers: why the snapshot was taken, recorded in it (the flight recorder's triggers).
        empty_ok: write the file even when no parameter has a gradient (the flight recorder:
            a rank whose gradients are all None, frozen or unused, still completes the
            snapshot, with its parameters recorded as without gradient).

    Returns:
        The rank file's path.

    Raises:
        SnapshotError: no parameter has a gradient (dumped before backward, or after
            ``zero_grad``); the model's DDP uses the distributed optimizer and no distributed
            ``optimizer`` was given (its whole ``main_grad`` would give a wrong number); the
            optimizer does not match the model; or the rank file cannot be written.
        ValueError: bad arguments (a step that is not an integer, unknown axes, a
            ``grad_attr`` other than "main_grad" with fragments, ...).
    """
    step = _step_number(step)
    rank, world_size, merged = job_coords(coords, mesh)
    pairs, grad_attr, distributed_optimizer = gradients_to_dump(
        model, optimizer, grad_attr, distributed_optimizer
    )
    if not empty_ok and not any(getattr(param, grad_attr, None) is not None for _, param in pairs):
        raise SnapshotError(
            f"rank {rank}: none of the {len(pairs)} parameters has a .{grad_attr}: dump "
            "after backward and before zero_grad (a snapshot of no gradients would read "
            "as norm 0)"
        )
    return save_rank(
        directory,
        pairs,
        rank=rank,
        world_size=world_size,
        coords=merged,
        grad_attr=grad_attr,
        distributed_optimizer=distributed_optimizer,
        step=step,
        overwrite=overwrite,
        triggers=triggers,
    )

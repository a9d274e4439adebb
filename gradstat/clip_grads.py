"""Megatron-LM's ``megatron.core.optimizer.clip_grads`` API, exact and on any device.

Same names, signatures and semantics as Megatron's module, with what an offline tool needs:
CPU (gloo) or CUDA (NCCL) tensors, groups given as ProcessGroups or rank()/size() objects,
float64 accuracy, an empty gradient list allowed, and plain Python floats as results.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from gradstat.core import kernels
from gradstat.core.groups import (
    MeshShards,
    RankLike,
    all_reduce,
    group_ranks,
    is_dtensor,
    reduce_over_mesh,
    split_by_mesh,
    stats_device,
    to_local,
)
from gradstat.core.predicates import (
    gtp_local_pad_zero_count,
    param_is_not_gtp_duplicate,
    param_is_not_shared,
    param_is_not_tensor_parallel_duplicate,
    param_is_unique,
)
from gradstat.core.predicates import gtp_pad_zero_count as _gtp_pad_zero_count
from gradstat.errors import GradDtypeError, NormTypeError

__all__ = [
    "GradNorm",
    "clip_grad_by_total_norm_fp32",
    "count_zeros_fp32",
    "get_grad_norm_fp32",
    "grads_for_norm",
    "gtp_local_pad_zero_count",
    "param_is_not_gtp_duplicate",
    "param_is_not_shared",
    "param_is_not_tensor_parallel_duplicate",
    "total_norm",
    "total_zeros",
]

_TensorOrList = Tensor | Iterable[Tensor]
# Parameters: tensors carrying Megatron's attributes, or any object that duck-types them.
_Params = Tensor | Iterable[Any]


def _as_list(tensors: _Params) -> list[Any]:
    return [tensors] if isinstance(tensors, Tensor) else list(tensors)


def check_norm_type(norm_type: Any) -> float:
    """The norm type as a float: 2, inf, 1 or any finite p > 0.

    Raises:
        NormTypeError: anything else (0, negative, nan, -inf, a string, a bool).
    """
    if isinstance(norm_type, numbers.Real) and not isinstance(norm_type, bool):
        value = float(norm_type)
        if value > 0 and not math.isnan(value):
            return value
    raise NormTypeError(
        f"norm_type {norm_type!r} is not supported; use 2, 1, math.inf or a finite p > 0"
    )


def _stat(
    grads: list[Tensor],
    compute: Callable[[list[Tensor], torch.device], Tensor],
    op: dist.ReduceOp.RedOpType,
    group: dist.ProcessGroup | None,
    *,
    megatron: bool,
    tensor_parallel: Sequence[bool] | None = None,
    plain_offset: int = 0,
) -> Tensor:
    """One statistic of ``grads``, each element counted once, reduced over their ranks.

    Plain gradients count as they are and their statistic is reduced over ``group``. DTensor
    gradients count by placement (see :mod:`gradstat.core.placements`), reduced over their mesh,
    then over ``group`` without counting a rank the mesh reduction already covered.

    Args:
        megatron: Megatron's semantics: ``group`` None is the default group, and only a
            DTensor's own placements decide (attribute filters removed its other copies). Else
            ``group`` None is no group (plain gradients are data-parallel replicas), and copies
            along the root mesh are counted once.
        plain_offset: added to this rank's own statistic before any reduction (the GTP
            padding a zero count leaves out).
    """
    with torch.no_grad():
        plain, meshes = grads, list[MeshShards]()
        if any(type(grad) is not Tensor and is_dtensor(grad) for grad in grads):
            plain, meshes = split_by_mesh(grads, tensor_parallel, root=not megatron)
        reduces_later = megatron or group is not None
        every = plain + [shard for bucket in meshes for shard in bucket.shards]
        mesh_groups = [bucket.mesh.get_group(mesh_dim=0) for bucket in meshes]
        device = stats_device(every, *mesh_groups, group if reduces_later else None)
        stat = compute(plain, device)
        if plain_offset:
            stat = stat + plain_offset
        # Every rank joins the reductions, also one with no gradients: skipping would hang.
        later = group_ranks(group, default_world=megatron) if meshes else frozenset()
        for bucket in meshes:
            part = reduce_over_mesh(compute(bucket.shards, device), op, bucket.mesh, later)
            stat = torch.maximum(stat, part) if op == dist.ReduceOp.MAX else stat + part
    if reduces_later:
        all_reduce(stat, op, group)
    return stat


def _norm(
    grads: list[Tensor],
    p: float,
    group: dist.ProcessGroup | None,
    *,
    megatron: bool,
    tensor_parallel: Sequence[bool] | None = None,
) -> float:
    def reduce(compute: kernels.StatCompute, op: dist.ReduceOp.RedOpType) -> Tensor:
        return _stat(grads, compute, op, group, megatron=megatron, tensor_parallel=tensor_parallel)

    return kernels.reduced_norm(p, reduce)


def get_grad_norm_fp32(
    grads_for_norm: _TensorOrList,
    norm_type: float = 2,
    grad_stats_parallel_group: dist.ProcessGroup | None = None,
) -> float:
    """The p-norm of all gradients, treated as one vector, reduced over the stats group.

    Each rank computes sum |x|^p of its own gradients (max |x| for inf) in float64, reduces it
    over ``grad_stats_parallel_group`` and takes the p-th root; when a sum leaves float64's
    range (tiny or huge values, large p) or p < 1, every rank takes the scaled path instead
    (max |x|, then sum (|x|/max)^p), so any p > 0 is exact. Callers pass only the
    gradients that count (see :func:`grads_for_norm`). DTensor gradients count by their own
    placements on any mesh (Shard pieces all, Replicate copies once) and are reduced over their
    mesh first, unless the stats group covers the mesh: a mesh rank is never counted twice.
    A module left out of a TP plan lives on a slice of the mesh and is a copy on every TP
    rank: select it on TP rank 0 only, or use :func:`total_norm`, which sees the whole mesh.

    Args:
        grads_for_norm: a tensor or an iterable of tensors (fp32, bf16, fp16 or fp64; DTensors
            on any meshes).
        norm_type: 2, 1, ``math.inf`` or any finite p > 0.
        grad_stats_parallel_group: the group the statistics are reduced over. None: the default
            group when torch.distributed is initialized, no reduction otherwise.

    Returns:
        The norm as a Python float (0.0 for an empty list; NaN/inf when a gradient is).

    Raises:
        NormTypeError: an unsupported ``norm_type``.
        GradDtypeError: a gradient of an unsupported dtype.
        PartialGradientError: a DTensor gradient still Partial on a mesh dimension.
    """
    p = check_norm_type(norm_type)
    return _norm(_as_list(grads_for_norm), p, grad_stats_parallel_group, megatron=True)


class GradNorm:
    """:func:`get_grad_norm_fp32` of the same gradients step after step, prepared once.

    A training loop whose gradients stay in place (Megatron's ``main_grad`` buffers, gradients
    zeroed rather than set to None) builds it once and calls it every step. On one CUDA device
    with p = 1 or 2, the first call captures the whole computation as a CUDA graph and later
    calls replay it: one launch and one synchronisation per step, whatever the number of
    tensors, and no per-tensor work on the host but reading the addresses (a gradient whose
    storage was replaced is seen, and the graph captured again). Anything else (CPU, DTensor
    gradients, another p) is :func:`get_grad_norm_fp32` itself. The numbers are the same:
    exact at any magnitude, NaN and inf propagated.

    Args:
        grads_for_norm: the gradients, as for :func:`get_grad_norm_fp32`; the list is kept.
        norm_type: 2, 1, ``math.inf`` or any finite p > 0.
        grad_stats_parallel_group: as for :func:`get_grad_norm_fp32`.

    Raises:
        NormTypeError: an unsupported ``norm_type``.
        GradDtypeError: a gradient of an unsupported dtype.
    """

    def __init__(
        self,
        grads_for_norm: _TensorOrList,
        norm_type: float = 2,
        grad_stats_parallel_group: dist.ProcessGroup | None = None,
    ) -> None:
        self.grads = _as_list(grads_for_norm)
        self.p = check_norm_type(norm_type)
        self.group = grad_stats_parallel_group
        self._plan: kernels.CudaPlan | None = None
        grads = self.grads
        if self.p in (1, 2) and grads and all(type(grad) is Tensor for grad in grads):
            kernels.check_dtypes(grads)
            device = grads[0].device
            same_device = {grad.get_device() for grad in grads} == {device.index}
            if device.type == "cuda" and same_device and stats_device(grads, self.group) == device:
                self._plan = kernels.CudaPlan(grads)

    def __call__(self) -> float:
        """The norm of the gradients' current values, as a Python float."""
        plan = self._plan
        if plan is None:
            return get_grad_norm_fp32(self.grads, self.p, self.group)
        if tuple(map(Tensor.data_ptr, self.grads)) != plan.addresses:
            plan = self._plan = kernels.CudaPlan(self.grads)  # a storage was replaced
        device, p = self.grads[0].device, int(self.p)

        def reduce(compute: kernels.StatCompute, op: dist.ReduceOp.RedOpType) -> Tensor:
            return all_reduce(compute(self.grads, device), op, self.group)

        def partials(tensors: list[Tensor], _device: torch.device) -> Tensor:
            return plan.partials(tensors, p)

        return kernels.reduced_norm(self.p, reduce, partials)


def total_norm(
    parameters: _Params,
    norm_type: float = 2,
    *,
    group: dist.ProcessGroup | None = None,
) -> float:
    """The p-norm of a torch-native job's full gradients, with no group to work out.

    For FSDP2, HSDP, TP (with or without sequence parallelism) x FSDP2, DDP and single-device
    jobs: DTensor gradients count by placement over their whole mesh (Shard pieces all,
    Replicate copies once, a module left out of a TP plan once), plain gradients as data-parallel
    replicas (each rank's copy is the full gradient), exactly (float64 partials).

    Args:
        parameters: parameters (their ``.grad``; those without one are skipped) or gradient
            tensors, in any mix of meshes.
        norm_type: 2, 1, ``math.inf`` or any finite p > 0.
        group: ranks that hold different parameters and no mesh joins, such as pipeline
            stages: their statistics are summed too. None: none.

    Returns:
        The norm as a Python float, the same on every rank.

    Raises:
        NormTypeError: an unsupported ``norm_type``.
        GradDtypeError: a gradient of an unsupported dtype.
        PartialGradientError: a DTensor gradient still Partial on a mesh dimension.
    """
    p = check_norm_type(norm_type)
    grads, tensor_parallel = _torch_native_grads(parameters)
    return _norm(grads, p, group, megatron=False, tensor_parallel=tensor_parallel)


def total_zeros(parameters: _Params, *, group: dist.ProcessGroup | None = None) -> int:
    """The number of zero elements of a torch-native job's full gradients (see
    :func:`total_norm`: DTensors by placement, plain tensors as data-parallel replicas).

    Args:
        parameters: parameters (their ``.grad``; those without one are skipped) or gradients.
        group: ranks that hold different parameters and share no mesh (pipeline stages).

    Raises:
        GradDtypeError: a gradient of an unsupported dtype.
        PartialGradientError: a DTensor gradient still Partial on a mesh dimension.
    """
    grads, tensor_parallel = _torch_native_grads(parameters)
    for grad in grads:
        kernels.check_dtype(to_local(grad))
    stat = _stat(
        grads,
        _zero_count,
        dist.ReduceOp.SUM,
        group,
        megatron=False,
        tensor_parallel=tensor_parallel,
    )
    return int(stat)


def _zero_count(tensors: list[Tensor], device: torch.device) -> Tensor:
    numel = sum(tensor.numel() for tensor in tensors)
    return numel - kernels.nonzero_count(tensors, device)


def _torch_native_grads(parameters: _Params) -> tuple[list[Tensor], list[bool]]:
    """The gradients of parameters (or the tensors given), and which are Megatron TP shards."""
    grads, tensor_parallel = [], []
    for item in _as_list(parameters):
        grad = item.grad if isinstance(item, torch.nn.Parameter) else item
        if grad is not None:
            grads.append(grad)
            tensor_parallel.append(bool(getattr(item, "tensor_model_parallel", False)))
    return grads, tensor_parallel


def _grads_of(parameters: _Params, use_decoupled_grad: bool) -> list[Tensor]:
    attr = "decoupled_grad" if use_decoupled_grad else "grad"
    allowed = (torch.float32, torch.bfloat16) if use_decoupled_grad else (torch.float32,)
    grads = []
    for param in _as_list(parameters):
        grad = getattr(param, attr, None)
        if grad is None:
            continue
        if grad.dtype not in allowed:
            names = " or ".join(str(dtype).removeprefix("torch.") for dtype in allowed)
            raise GradDtypeError(
                f"clip_grad_by_total_norm_fp32: .{attr} of a parameter of shape "
                f"{tuple(param.shape)} is {str(grad.dtype).removeprefix('torch.')}; "
                f"it must be {names}"
            )
        grads.append(to_local(grad).detach())
    return grads


def clip_coefficient(max_norm: float, total_norm: float | Tensor) -> float:
    """Megatron's clip coefficient ``max_norm / (total_norm + 1e-6)``; scale only when < 1.

    NaN when the norm is NaN: ``nan < 1`` is false, so non-finite gradients are left as they are.
    """
    return float(max_norm) / (float(total_norm) + 1.0e-6)


def clip_grad_by_total_norm_fp32(
    parameters: _Params,
    max_norm: float,
    total_norm: float | Tensor,
    use_decoupled_grad: bool = False,
) -> None:
    """Scale every gradient in place by ``max_norm / (total_norm + 1e-6)`` when that is < 1.

    Gradients are left bitwise untouched when the coefficient is >= 1 (or NaN, as in Megatron).

    Args:
        parameters: a tensor or an iterable of tensors whose ``.grad`` (fp32) or
            ``.decoupled_grad`` (fp32 or bf16) is scaled; params without one are skipped.
        max_norm: the largest total norm allowed, > 0.
        total_norm: the current total norm, a float or a 0-dim tensor.
        use_decoupled_grad: scale ``.decoupled_grad`` instead of ``.grad``.

    Raises:
        ValueError: ``max_norm`` is not a positive number.
        GradDtypeError: a ``.grad`` that is not fp32, or a ``.decoupled_grad`` that is not
            fp32/bf16 (Megatron asserts the same).
    """
    if not max_norm > 0:
        raise ValueError(f"max_norm must be a positive number, got {max_norm!r}")
    grads = _grads_of(parameters, use_decoupled_grad)
    clip_coeff = clip_coefficient(max_norm, total_norm)
    if grads and clip_coeff < 1.0:
        if all(grad.is_cuda for grad in grads):
            torch._foreach_mul_(grads, clip_coeff)
        else:
            # On the CPU, the in-place multi-tensor multiply rounds bf16/fp16 products worse than
            # the plain one (2.6e-3 against 1.3e-3 off float64 on unit bf16 values, which is the
            # correctly rounded result, and Megatron's): one multiply per tensor costs nothing.
            for grad in grads:
                grad.mul_(clip_coeff)


def grads_for_norm(
    parameters: _Params,
    *,
    use_decoupled_grad: bool = False,
    tp_group: RankLike | None = None,
    expert_tp_group: RankLike | None = None,
    gtp_group: RankLike | None = None,
    expert_gtp_group: RankLike | None = None,
) -> list[Tensor]:
    """The gradients that count towards the norm, as Megatron's optimizer selects them.

    Skips params without a gradient, ``shared`` copies, TP/ETP duplicates and GTP/EGTP
    duplicates. Megatron-FSDP params (``__fsdp_param__``) always count. The result is what
    :func:`get_grad_norm_fp32` expects. A group left None is read from Megatron's
    ``parallel_state`` inside a live Megatron job; outside one, it means the axis is not split.
    """
    attr = "decoupled_grad" if use_decoupled_grad else "grad"
    groups = (tp_group, expert_tp_group, gtp_group, expert_gtp_group)
    selected = []
    for param in _as_list(parameters):
        grad = getattr(param, attr, None)
        if grad is None:
            continue
        if getattr(param, "__fsdp_param__", False) or param_is_unique(param, *groups):
            selected.append(grad)
    return selected


def count_zeros_fp32(
    parameters: _Params,
    grad_stats_parallel_group: dist.ProcessGroup | None,
    use_decoupled_grad: bool = False,
    tp_group: RankLike | None = None,
    expert_tp_group: RankLike | None = None,
    *,
    gtp_group: RankLike | None = None,
    expert_gtp_group: RankLike | None = None,
) -> float:
    """The number of zero gradient elements, each logical parameter counted once.

    Skips params without a gradient, ``shared`` copies, TP/ETP and GTP/EGTP duplicates, and
    excludes GTP alignment padding. Megatron-FSDP params (``__fsdp_param__``) count their local
    DTensor shard with no further data-parallel reduction. Counts are summed over a DTensor's
    mesh group, then over ``grad_stats_parallel_group``.

    Args:
        parameters: a tensor or an iterable of tensors carrying Megatron's attributes.
        grad_stats_parallel_group: the group counts are summed over (None: the default group
            when torch.distributed is initialized, no reduction otherwise).
        use_decoupled_grad: read ``.decoupled_grad`` instead of ``.grad``.
        tp_group: the TP group (ProcessGroup or rank()/size() object).
        expert_tp_group: the expert TP group, for ``allreduce=False`` params.
        gtp_group: the GTP group, for params replicated over GTP.
        expert_gtp_group: the expert GTP group.
            A group left None is read from Megatron's ``parallel_state`` inside a live Megatron
            job, as Megatron does; outside one, None means the axis is not split.

    Returns:
        The count as a float holding an exact integer.

    Raises:
        ValueError: Megatron-FSDP params mixed with DTensor gradients that need a DP reduction.
        GradDtypeError: a gradient of an unsupported dtype.
    """
    attr = "decoupled_grad" if use_decoupled_grad else "grad"
    groups = (tp_group, expert_tp_group, gtp_group, expert_gtp_group)
    counted: list[Tensor] = []
    fsdp_shards: list[Tensor] = []
    pad_zeros = 0
    for param in _as_list(parameters):
        grad = getattr(param, attr, None)
        if grad is None:
            continue
        local = to_local(grad).detach()
        if getattr(param, "__fsdp_param__", False):
            fsdp_shards.append(local)
        elif param_is_unique(param, *groups):
            pad_zeros += _gtp_pad_zero_count(param, local)
            counted.append(grad.detach())
        else:
            continue
        kernels.check_dtype(local)
    if fsdp_shards and any(is_dtensor(grad) for grad in counted):
        raise ValueError(
            "Megatron-FSDP params (__fsdp_param__) are mixed with DTensor gradients that need a "
            "data-parallel reduction; FSDP has already reduced its gradients over DP"
        )

    # Megatron-FSDP shards are counted as they are, like plain tensors; the padding too.
    stats = _stat(
        fsdp_shards + counted,
        _zero_count,
        dist.ReduceOp.SUM,
        grad_stats_parallel_group,
        megatron=True,
        plain_offset=-pad_zeros,
    )
    return float(int(stats))

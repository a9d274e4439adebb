"""Megatron-LM's ``megatron.core.optimizer.clip_grads`` API, exact and on any device.

Same names, signatures and semantics as Megatron's module, with what an offline tool needs:
CPU (gloo) or CUDA (NCCL) tensors, groups given as ProcessGroups or rank()/size() objects,
float64 accuracy, an empty gradient list allowed, and plain Python floats as results.
"""

from __future__ import annotations

import math
import numbers
import warnings
from collections import defaultdict, deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from gradstat.core import copies, kernels, replicas
from gradstat.core.copies import CopyGroup
from gradstat.core.footprint import Footprint, footprint, overlaps_itself, relation
from gradstat.core.groups import (
    HeldGroup,
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
from gradstat.errors import (
    ClipArgumentError,
    GradDtypeError,
    GradientInputError,
    GradstatError,
    NormTypeError,
    StatsGroupError,
)

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


def is_parameter(item: Any) -> bool:
    """Whether ``item`` is a parameter (its ``.grad`` is the gradient) rather than a gradient.

    An ``nn.Parameter``, a tensor that holds a ``.grad`` or is a leaf that requires grad, a view
    of an ``nn.Parameter`` (Megatron's distributed optimizer keeps each fp32 parameter's shard as
    ``param.view(-1)[start:end]``, whose ``.grad`` it sets before the step and clears after), or
    an object that is no tensor but has a ``grad`` attribute (a stand-in carrying Megatron's
    attributes). A gradient never requires grad, except one made by
    ``backward(create_graph=True)``, which is no leaf and no parameter's view: it stays a
    gradient.
    """
    if isinstance(item, torch.nn.Parameter):
        return True
    if not isinstance(item, Tensor):
        return hasattr(item, "grad")
    # Every tensor that does not require grad is a leaf: two reads, not three, per gradient.
    return _requiring_grad_is_parameter(item) if item.requires_grad else item.grad is not None


def _requiring_grad_is_parameter(item: Tensor) -> bool:
    """:func:`is_parameter` of a tensor that requires grad."""
    if item.is_leaf:
        return True
    base = item._base
    # A parameter's view, not any leaf's: a create_graph gradient can be a view of its
    # grad_outputs when those require grad (torch.autograd.functional.jvp's double vjp).
    return isinstance(base, torch.nn.Parameter) or _read_grad(item) is not None


def _read_grad(item: Any, attr: str = "grad") -> Any:
    """``item.grad`` (or another attribute), without torch's warning that a non-leaf tensor's
    ``.grad`` is not populated by backward: the parameter views :func:`is_parameter` takes have
    theirs set by hand."""
    if isinstance(item, Tensor) and attr == "grad" and not item.is_leaf:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)
            return item.grad
    return getattr(item, attr, None)


def _label(what: str, index: int, tensor: Any, *, of_parameter: bool) -> str:
    shape = tuple(getattr(tensor, "shape", ()))
    held = "the gradient of parameter" if of_parameter else "gradient"
    return f"{what}: {held} {index} (shape {shape})"


def readable_values(grad: Tensor, label: str) -> tuple[Tensor, int]:
    """The tensor the statistics read for ``grad``, and how many zeros it leaves implicit.

    A strided tensor (or DTensor) is itself. A sparse one (COO, CSR, CSC, BSR, BSC) is the
    values of its coalesced COO form: duplicate entries summed, every element it does not store
    a zero. A complex one is its elements' magnitudes |z| in float64 (as PyTorch's norms take
    a complex tensor: an element is zero when both its parts are). Nothing is written into
    ``grad``.

    Raises:
        GradientInputError: a gradient on the meta device (it holds no values).
        GradDtypeError: a dtype the kernels do not handle.
    """
    local = to_local(grad)
    if local.is_meta:
        raise GradientInputError(
            f"{label} is on the meta device and holds no values; take the statistics where "
            "the gradients were computed"
        )
    if local.is_complex() and local.layout == torch.strided:
        return _magnitudes(grad, local), 0
    kernels.check_dtype(local, label)
    if local.layout == torch.strided:
        return grad, 0
    if local is not grad:
        raise GradientInputError(
            f"{label} is a sparse DTensor; redistribute it or pass its dense local tensor"
        )
    coo = local if local.layout == torch.sparse_coo else local.to_sparse()
    values = coo.coalesce().values()
    if values.is_complex():
        values = _magnitudes(values, values)
    return values, local.numel() - values.numel()


def _magnitudes(grad: Tensor, local: Tensor) -> Tensor:
    """|z| of a complex gradient's elements in float64 (a DTensor stays one, placed alike)."""
    found = kernels.magnitudes(local)
    if local is grad:
        return found
    from torch.distributed.tensor import DTensor

    return DTensor.from_local(found, grad.device_mesh, grad.placements, run_check=False)  # type: ignore[attr-defined]


def _plain_gradient(grad: Any) -> bool:
    """Whether ``grad`` is a dense plain tensor of a dtype the kernels read, holding values and
    no parameter: the usual gradient, which the checks below would take as it is. Asked first,
    it spares a list of 20,000 gradients about half its checks' time; anything else goes
    through them and their errors."""
    return (
        type(grad) is Tensor
        and grad.layout == torch.strided
        and grad.dtype in kernels.SUPPORTED_DTYPES
        and not grad.is_meta
        and not grad.requires_grad  # a create_graph gradient goes through the checks
        and grad.grad is None  # is_parameter
    )


def _megatron_grads(grads_for_norm: _TensorOrList, what: str) -> tuple[list[Tensor], int]:
    """Gradients given by Megatron's API, checked and made readable; the implicit zeros."""
    readable, implicit = [], 0
    for index, grad in enumerate(_as_list(grads_for_norm)):
        if grad is None:  # a parameter without a gradient, as count_zeros_fp32 skips it
            continue
        if _plain_gradient(grad):
            readable.append(grad)
            continue
        if is_parameter(grad):
            raise GradientInputError(
                f"{_label(what, index, grad, of_parameter=False)} is a parameter (it requires "
                "grad or holds a .grad); pass the gradients (grads_for_norm(params)), not the "
                "parameters"
            )
        tensor, zeros = readable_values(grad, _label(what, index, grad, of_parameter=False))
        readable.append(tensor)
        implicit += zeros
    return readable, implicit


def check_stats_group(group: Any, what: str) -> None:
    """Raise unless this rank is a member of ``group`` (None, the default group, always is).

    Raises:
        StatsGroupError: ``group`` is ``GroupMember.NON_GROUP_MEMBER`` (what ``new_group``
            returns outside the group) or a ProcessGroup without this rank.
    """
    if group is None or not (dist.is_available() and dist.is_initialized()):
        return
    outside = isinstance(group, int) and group == dist.GroupMember.NON_GROUP_MEMBER
    if isinstance(group, dist.ProcessGroup):
        outside = dist.get_rank(group) < 0
    if outside:
        raise StatsGroupError(
            f"{what}: rank {dist.get_rank()} is not a member of the stats group it was given; "
            "pass each rank a group that contains it (or None)"
        )


def _stat(
    grads: list[Tensor],
    compute: Callable[[list[Tensor], torch.device], Tensor],
    op: dist.ReduceOp.RedOpType,
    group: dist.ProcessGroup | None,
    *,
    plain_offset: int = 0,
) -> Tensor:
    """One statistic of ``grads`` with Megatron's semantics, reduced over their ranks.

    Plain gradients count as they are and their statistic is reduced over ``group`` (None: the
    default group). DTensor gradients count by their own placements (Megatron's attribute
    filters removed their other copies, see :mod:`gradstat.core.placements`), reduced over
    their mesh unless ``group`` covers it, then over ``group`` without counting a rank twice.

    Args:
        plain_offset: added to this rank's own statistic before any reduction (the GTP
            padding a zero count leaves out, a sparse gradient's implicit zeros).
    """
    with torch.no_grad():
        plain, meshes = grads, list[MeshShards]()
        if any(type(grad) is not Tensor and is_dtensor(grad) for grad in grads):
            plain, meshes = split_by_mesh(grads)
        every = plain + [shard for bucket in meshes for shard in bucket.shards]
        mesh_groups = [bucket.mesh.get_group(mesh_dim=0) for bucket in meshes]
        device = stats_device(every, *mesh_groups, group)
        stat = compute(plain, device)
        if plain_offset:  # to the statistic, not to a refusal's flag after it
            stat = stat.clone()
            stat.view(-1)[0] += plain_offset
        # With the default group (which covers every mesh) this is one all-reduce on every
        # rank, whatever its list holds; a smaller group needs the same meshes on every rank.
        later = group_ranks(group, default_world=True) if meshes else frozenset()
        for bucket in meshes:
            part = reduce_over_mesh(compute(bucket.shards, device), op, bucket.mesh, later)
            stat = torch.maximum(stat, part) if op == dist.ReduceOp.MAX else stat + part
    all_reduce(stat, op, group)
    return stat


def _megatron_norm(
    grads: list[Tensor],
    p: float,
    group: dist.ProcessGroup | None,
    problem: GradstatError | None = None,
) -> float:
    """The norm of ``grads`` over ``group``. With ``problem`` (this rank refused its input)
    the rank still joins the first reduction, whose one more number tells every rank of the
    group that one refused: all raise together, and the next call is in step (a rank that
    raised alone left the others' all-reduce to pair with its next call)."""
    first = [_distributed()]  # one process has no other rank to tell

    def reduce(compute: kernels.StatCompute, op: dist.ReduceOp.RedOpType) -> Tensor:
        if not first:
            return _stat(grads, compute, op, group)
        first.clear()
        flagged = _stat(grads, _with_refusal(compute, problem is not None), op, group)
        return _unflagged(flagged, problem, "norm")

    return kernels.reduced_norm(p, reduce)


def _with_refusal(compute: kernels.StatCompute, refused: bool) -> kernels.StatCompute:
    """``compute``'s statistic (a vector) with one more number: 1 where this rank refused."""

    def flagged(tensors: list[Tensor], device: torch.device) -> Tensor:
        stat = compute(tensors, device).reshape(-1)
        return torch.cat([stat, stat.new_full((1,), float(refused))])  # a fill: no copy

    return flagged


def _unflagged(flagged: Tensor, problem: GradstatError | None, what: str) -> Tensor:
    """The statistic of a reduction made with :func:`_with_refusal`: ``problem`` raised where
    this rank refused its input, an error where another did (every rank raises together)."""
    if problem is not None:
        raise problem
    if float(flagged[-1]):
        raise GradstatError(
            f"another rank refused its gradients (its error says why), so no {what} was "
            "computed; fix that rank's input"
        )
    return flagged[:-1]


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
    gradients that count (see :func:`grads_for_norm`): gradients, as Megatron's API takes them;
    a tensor that requires grad (or holds a ``.grad``) is a parameter given by mistake and is
    refused. A sparse gradient counts by its values. DTensor gradients count by their own
    placements on any mesh (Shard pieces all, Replicate copies once: the copy at coordinate 0,
    so a NaN or spike on another copy is :func:`total_norm`'s to find, which counts each shard
    by its largest copy) and are reduced over their mesh first, unless the stats group covers
    the mesh: a mesh rank is never counted twice.
    With the default group every rank joins one all-reduce whatever its list holds; with a
    smaller group that does not cover a DTensor's mesh, every rank of the mesh must pass
    gradients of that mesh. A module left out of a TP plan lives on a slice of the mesh and is a
    copy on every TP rank: select it on TP rank 0 only, or use :func:`total_norm`, which sees
    the whole mesh.

    Args:
        grads_for_norm: a tensor or an iterable of tensors (fp32, bf16, fp16 or fp64, strided
            or sparse; DTensors on any meshes); None, a parameter without a gradient, is skipped.
        norm_type: 2, 1, ``math.inf`` or any finite p > 0.
        grad_stats_parallel_group: the group the statistics are reduced over. None: the default
            group when torch.distributed is initialized, no reduction otherwise.

    Returns:
        The norm as a Python float (0.0 for an empty list; NaN/inf when a gradient is).

    Raises:
        NormTypeError: an unsupported ``norm_type``.
        GradDtypeError: a gradient of an unsupported dtype.
        GradientInputError: a parameter instead of a gradient, a meta-device gradient.
        PartialGradientError: a DTensor gradient still Partial on a mesh dimension.
        StatsGroupError: a stats group that does not contain this rank.
        GradstatError: another rank of the group refused its gradients (plain gradients:
            every rank raises together; a rank refusing DTensors of a mesh the others reduce
            over first leaves them waiting for it).
    """
    p = check_norm_type(norm_type)
    check_stats_group(grad_stats_parallel_group, "get_grad_norm_fp32")
    try:
        grads, _ = _megatron_grads(grads_for_norm, "get_grad_norm_fp32")
    except GradstatError as error:
        if not _distributed():
            raise
        return _megatron_norm([], p, grad_stats_parallel_group, error)
    return _megatron_norm(grads, p, grad_stats_parallel_group)


class GradNorm:
    """:func:`get_grad_norm_fp32` step after step, prepared once.

    Given parameters (``model.parameters()``, or any tensors that require grad), every call
    reads their ``.grad`` again, so it is the norm of the gradients they hold now, after
    ``zero_grad()`` set them to None and the next backward made new ones; the parameters that
    count are selected once, as :func:`grads_for_norm` selects them, and no gradient is held
    between calls (the memory of one ``zero_grad()`` dropped is freed). Given gradients (Megatron's
    ``main_grad`` buffers, gradients zeroed in place rather than set to None), the gradient
    tensors themselves are kept: a gradient that is replaced by a new tensor is not seen, so
    pass the parameters whenever ``zero_grad()`` sets gradients to None (PyTorch's default).

    On one CUDA device with p = 1 or 2, the first call captures the whole computation as a CUDA
    graph and later calls replay it: one launch and one synchronisation per step, whatever the
    number of tensors, and no per-tensor work on the host but reading the gradients' addresses
    (and, given parameters, their ``.grad``; a gradient at another address or of another size
    is seen, and the graph captured again). Anything else (CPU, DTensor gradients, another p)
    is :func:`get_grad_norm_fp32` itself. The numbers are the same: exact at any magnitude, NaN
    and inf propagated.

    Args:
        grads_for_norm: parameters, or gradients as for :func:`get_grad_norm_fp32` (not a mix).
        norm_type: 2, 1, ``math.inf`` or any finite p > 0.
        grad_stats_parallel_group: as for :func:`get_grad_norm_fp32`.

    Raises:
        NormTypeError: an unsupported ``norm_type``.
        GradDtypeError: a gradient of an unsupported dtype.
        GradientInputError: parameters and gradients mixed in one list.
        StatsGroupError: a stats group that does not contain this rank.
    """

    def __init__(
        self,
        grads_for_norm: _TensorOrList,
        norm_type: float = 2,
        grad_stats_parallel_group: dist.ProcessGroup | None = None,
    ) -> None:
        items = _as_list(grads_for_norm)
        self.p = check_norm_type(norm_type)
        check_stats_group(grad_stats_parallel_group, "GradNorm")
        self._group = HeldGroup(grad_stats_parallel_group, "GradNorm")
        kinds = {is_parameter(item) for item in items}
        if len(kinds) > 1:
            raise GradientInputError(
                "GradNorm: the list mixes parameters and gradients; pass the parameters "
                "(their .grad is read at every call) or the gradients, not both"
            )
        self.parameters: list[Any] | None = None
        if kinds == {True}:
            self.parameters = [
                param
                for param in items
                if getattr(param, "__fsdp_param__", False) or param_is_unique(param)
            ]
        # Given parameters, no gradient is held between calls: one replaced by zero_grad() is
        # freed, and the next backward may reuse its memory (and the captured graph).
        self.grads: list[Tensor] = items if self.parameters is None else []
        self._plan: kernels.CudaPlan | None = None
        grads = self._current()
        if self.parameters is None:
            _megatron_grads(grads, "GradNorm")
        if self.p in (1, 2) and self._plannable(grads):
            self._capture(grads)

    @property
    def group(self) -> dist.ProcessGroup | None:
        """The stats group (None: the default group), held weakly (see ``HeldGroup``)."""
        return self._group()

    def _capture(self, grads: list[Tensor]) -> kernels.CudaPlan:
        """Capture the graph of ``grads`` (a plannable list); it remembers what it reads."""
        self._plan = kernels.CudaPlan(grads)
        return self._plan

    def _plannable(self, grads: list[Tensor]) -> bool:
        """Whether a CUDA graph can serve: plain strided gradients on one CUDA device."""
        if not grads or not all(
            type(grad) is Tensor and grad.layout == torch.strided for grad in grads
        ):
            return False
        kernels.check_dtypes(grads)
        device = grads[0].device
        same_device = {grad.get_device() for grad in grads} == {device.index}
        return device.type == "cuda" and same_device and stats_device(grads, self.group) == device

    def _current(self) -> list[Tensor]:
        """The gradients given, or the ``.grad`` the parameters hold now."""
        if self.parameters is None:
            return self.grads
        return [grad for param in self.parameters if (grad := _read_grad(param)) is not None]

    def __call__(self) -> float:
        """The norm of the gradients' current values, as a Python float."""
        plan, grads = self._plan, self._current()
        # Parameters without gradients when it was built: the first CUDA gradients plan it.
        first_cuda = plan is None and self.parameters is not None and grads and grads[0].is_cuda
        if first_cuda and self.p in (1, 2) and self._plannable(grads):
            plan = self._capture(grads)
        if plan is None:
            return get_grad_norm_fp32(grads, self.p, self.group)
        try:
            moved = kernels.layout(grads) != plan.layout
        except RuntimeError:  # a sparse gradient has no address
            moved = True
        if moved:
            if not self._plannable(grads):
                return get_grad_norm_fp32(grads, self.p, self.group)
            plan = self._capture(grads)  # a gradient moved or was resized
        device, p = grads[0].device, int(self.p)

        def reduce(compute: kernels.StatCompute, op: dist.ReduceOp.RedOpType) -> Tensor:
            return all_reduce(compute(grads, device), op, self.group)

        def partials(tensors: list[Tensor], _device: torch.device) -> Tensor:
            return plan.partials(tensors, p)

        return kernels.reduced_norm(self.p, reduce, partials)


@dataclass
class _NativeGrads:
    """One rank's gradients for a torch-native statistic, sorted before any collective.

    Attributes:
        plain: plain gradients (data-parallel replicas, or distinct over ``group``).
        shards: the local DTensor shards this rank holds uniquely in the whole job (Shard
            pieces, a Replicate copy at coordinate 0 only, see :mod:`gradstat.core.placements`).
        implicit_zeros: the zeros each of ``plain`` does not store (a sparse gradient's).
        problem: this rank's error, raised on every rank once they have all been told.
        device: where the statistics live.
        places: each of ``plain``'s place in the caller's list.
        length: how many items the caller's list holds.
        lacking: the places of plain parameters that want a gradient and hold none (see
            :mod:`gradstat.core.replicas`).
        per_place: whether the replicas lack different gradients (decided at the first
            reduction, over every rank).
    """

    plain: list[Tensor]
    shards: list[Tensor]
    implicit_zeros: list[int]
    problem: GradstatError | None
    device: torch.device
    places: list[int]
    length: int
    lacking: list[int]
    per_place: bool | None = None
    # The DTensor shards that other ranks hold copies of, each counted by its largest copy
    # (:mod:`gradstat.core.copies`): a copy that differs is a fault the norm must not hide.
    groups: list[CopyGroup] = field(default_factory=list)
    # The places whose item holds no gradient that counts (None, a parameter without one, a
    # shared copy): a DTensor's copies line up across lists that hold it or nothing there.
    without: list[int] = field(default_factory=list)


def _lacks(item: Any) -> bool:
    """Whether ``item``, holding no gradient, is a plain parameter that wants one: None (a
    place without a gradient) or a parameter requiring grad (a frozen one never has one)."""
    if item is None:
        return True
    return bool(getattr(item, "requires_grad", False)) and not is_dtensor(item)


def _native_grads(parameters: _Params, group: Any, what: str) -> _NativeGrads:
    """Sort a torch-native job's gradients; an error is kept, to be told to every rank."""
    plain: list[Tensor] = []
    shards: list[Tensor] = []
    groups: list[CopyGroup] = []
    implicit: list[int] = []
    places: list[int] = []
    lacking: list[int] = []
    without: list[int] = []
    problem = None
    items = _as_list(parameters)
    try:
        check_stats_group(group, what)
        grads, tensor_parallel, zeros_of, positions = [], [], [], []
        place_of: dict[int, deque[int]] = defaultdict(deque)
        for index, item in enumerate(items):
            if item is not None and not param_is_not_shared(item):
                without.append(index)  # a tied weight's second copy (Megatron's shared=True)
                continue
            if item is None or is_parameter(item):
                grad = None if item is None else _read_grad(item)
            elif isinstance(item, Tensor):
                grad = item
            else:
                raise GradientInputError(
                    f"{what}: item {index} is a {type(item).__name__}, not a tensor, a parameter "
                    "or None"
                )
            if grad is None:
                without.append(index)
                if _lacks(item):
                    lacking.append(index)
                continue
            label = _label(what, index, grad, of_parameter=grad is not item)
            values, zeros = readable_values(grad, label)
            place_of[id(values)].append(index)  # a tensor listed twice has two places
            grads.append(values)
            positions.append(index)
            zeros_of.append(zeros)
            tensor_parallel.append(bool(getattr(item, "tensor_model_parallel", False)))
        plain, implicit = grads, zeros_of
        if any(type(grad) is not Tensor and is_dtensor(grad) for grad in grads):
            try:
                plain, meshes = split_by_mesh(grads, tensor_parallel, root=True, places=positions)
            except GradstatError:
                raise
            except ValueError as error:  # a mesh without this rank, copies it cannot tell
                raise GradientInputError(f"{what}: {error}") from error
            shards = [shard for bucket in meshes for shard in bucket.shards]
            groups = [group for bucket in meshes for group in bucket.groups.values()]
            zeros_by_id = {id(grad): zeros for grad, zeros in zip(grads, zeros_of, strict=True)}
            implicit = [zeros_by_id[id(grad)] for grad in plain]
        places = [place_of[id(grad)].popleft() for grad in plain]  # plain keeps the list's order
    except GradstatError as error:
        plain, shards, implicit, places, lacking, problem = [], [], [], [], [], error
        groups = []
    if problem is not None and not _distributed():
        raise problem
    held = plain + shards + [tensor for copies in groups for tensor in copies.tensors]
    device = stats_device(held, None, group if problem is None else None)
    return _NativeGrads(
        plain, shards, implicit, problem, device, places, len(items), lacking, None, groups, without
    )


def _distributed() -> bool:
    return dist.is_available() and dist.is_initialized()


def _native_reduce(
    native: _NativeGrads,
    compute: kernels.StatCompute,
    op: dist.ReduceOp.RedOpType,
    group: dist.ProcessGroup | None,
    *,
    implicit: bool = False,
) -> Tensor:
    """``compute`` of a torch-native job's gradients, reduced over every rank alike.

    Every rank runs the same collectives whatever its list holds, and ends with the same
    numbers, so the norm's later reductions (the scaled path) are taken by all or none:

    - one all-reduce over the default group with ``op`` of the DTensor shards' statistic
      (each element of the job is counted on exactly one rank, so one sum serves every mesh),
      of whether a rank refused its gradients and of whether one lacks a gradient; for a sum,
      also of whether the copies of shards held on several ranks agree, and where they do not,
      each such shard's largest copy is gathered (:mod:`gradstat.core.copies`);
    - the plain gradients' statistic, summed over ``group`` when given (pipeline stages),
      then its MAX over the default group: plain gradients are data-parallel replicas, so a
      rank whose list lacks one takes another rank's value. For the MAX of an inf norm this
      rides on the first all-reduce. Without ``group``, replicas that lack different
      gradients are matched by place instead (:mod:`gradstat.core.replicas`).

    ``implicit``: add each gradient's implicit zeros (a sparse gradient's) to its statistic.
    """
    is_max = op == dist.ReduceOp.MAX
    with torch.no_grad():
        # An empty list's statistic is zeros of the same shape: no kernel (nor, on CUDA, a
        # synchronisation) for the part a job does not have.
        copied = [tensor for copies_of in native.groups for tensor in copies_of.tensors]
        shards = native.shards + copied if is_max else native.shards
        if native.plain or not shards:
            plain = compute(native.plain, native.device)
            mesh = compute(shards, native.device) if shards else plain.new_zeros(plain.shape)
        else:
            mesh = compute(shards, native.device)
            plain = mesh.new_zeros(mesh.shape)
        if implicit:
            plain = plain + sum(native.implicit_zeros)
        if not _distributed():
            return torch.maximum(plain, mesh) if is_max else plain + mesh
        parts = [mesh.reshape(-1)]
        if not is_max:
            # Each shard's own statistic (a sum's parts add up): no difference in one shard
            # cancels another's.
            stats = [
                torch.stack([compute([tensor], native.device) for tensor in group.tensors])
                for group in native.groups
            ]
            counted, found = copies.moments(native.groups, stats, mesh.shape, mesh.device)
            parts += [counted.reshape(-1), found.reshape(-1)]
        told = sum(part.numel() for part in parts)  # the shards', the counted copies', moments
        flags = [native.problem is not None, bool(native.lacking)]
        parts.append(torch.tensor(flags, dtype=mesh.dtype).to(mesh.device))
        if is_max and group is None:
            parts.append(plain.reshape(-1))
        world = all_reduce(torch.cat(parts), op, None)
        if native.problem is not None:
            raise native.problem
        width = mesh.numel()
        refused, lacked = world[told : told + len(flags)].tolist()
        if refused:
            raise GradstatError(
                f"rank {dist.get_rank()}: another rank refused its gradients (its error says "
                "why), so no statistic was computed; fix that rank's input"
            )
        mesh = world[:width].reshape(mesh.shape)
        if not is_max:
            if copies.differ(world[2 * width : told].tolist()):
                mesh = mesh + copies.largest_copies(
                    native.groups, stats, mesh.shape, native.device, native.length, native.without
                )
            else:
                mesh = mesh + world[width : 2 * width].reshape(mesh.shape)
        if group is None and lacked and native.per_place is None:
            native.per_place = replicas.lacked_differently(
                native.length, native.lacking, native.device
            )
        if native.per_place:
            extra = native.implicit_zeros if implicit else [0] * len(native.plain)
            plain = replicas.per_place(
                native.plain, native.places, extra, native.length, compute, op, native.device
            )
        elif is_max and group is None:
            plain = world[told + len(flags) :].reshape(plain.shape)
        else:
            if group is not None:
                all_reduce(plain, op, group)
            plain = all_reduce(plain, dist.ReduceOp.MAX, None)
        return torch.maximum(plain, mesh) if is_max else plain + mesh


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
    replicas (each rank's copy is the full gradient), exactly (float64 partials). A parameter
    (an ``nn.Parameter``, a tensor that requires grad or holds a ``.grad``) stands for its
    ``.grad``; any other tensor is a gradient. A sparse gradient counts by its values. A tied
    weight's second copy marked ``shared=True`` (as Megatron marks it) does not count, as in a
    snapshot.

    Once torch.distributed is initialized this is a collective over the default group: every
    rank calls it, and every rank joins the same reductions whatever its list holds (an empty
    list, a gradient None on one rank only) and returns the same number: one all-reduce serves
    the DTensors of every mesh in the job; the plain gradients' statistic (summed over
    ``group`` when given) is the largest rank's, replicas being equal (a rank lacking one takes
    its replica's value). Without ``group``, ranks whose lists (of one length) lack different
    gradients count their union: each place's largest over the ranks
    (:mod:`gradstat.core.replicas`); with ``group``, or lists of other lengths, the largest
    rank's stands (a :class:`~gradstat.errors.ReplicaWarning` says so for the latter).

    Args:
        parameters: parameters (their ``.grad``; those without one are skipped) or gradient
            tensors, in any mix of meshes; None stands for a parameter without a gradient.
        norm_type: 2, 1, ``math.inf`` or any finite p > 0.
        group: ranks that hold different plain gradients, such as pipeline stages: their
            statistics are summed too. None: plain gradients are replicas.

    Returns:
        The norm as a Python float, the same on every rank.

    Raises:
        NormTypeError: an unsupported ``norm_type``.
        GradDtypeError: a gradient of an unsupported dtype.
        GradientInputError: a meta-device gradient, or an item that is no tensor.
        PartialGradientError: a DTensor gradient still Partial on a mesh dimension.
        StatsGroupError: a ``group`` that does not contain this rank.
        GradstatError: another rank raised one of these (every rank raises together).
    """
    p = check_norm_type(norm_type)
    native = _native_grads(parameters, group, "total_norm")

    def reduce(compute: kernels.StatCompute, op: dist.ReduceOp.RedOpType) -> Tensor:
        return _native_reduce(native, compute, op, group)

    return kernels.reduced_norm(p, reduce)


def total_zeros(parameters: _Params, *, group: dist.ProcessGroup | None = None) -> int:
    """The number of zero elements of a torch-native job's full gradients (see
    :func:`total_norm`: parameters and gradients alike, DTensors by placement, plain tensors as
    data-parallel replicas, a collective over the default group once distributed). A sparse
    gradient's elements it does not store are zeros.

    Args:
        parameters: parameters (their ``.grad``; those without one are skipped) or gradients.
        group: ranks that hold different plain gradients (pipeline stages).

    Raises:
        GradDtypeError: a gradient of an unsupported dtype.
        GradientInputError: a meta-device gradient, or an item that is no tensor.
        PartialGradientError: a DTensor gradient still Partial on a mesh dimension.
        StatsGroupError: a ``group`` that does not contain this rank.
    """
    native = _native_grads(parameters, group, "total_zeros")
    stat = _native_reduce(native, _zero_count, dist.ReduceOp.SUM, group, implicit=True)
    return int(stat)


def _zero_count(tensors: list[Tensor], device: torch.device) -> Tensor:
    numel = sum(tensor.numel() for tensor in tensors)
    return numel - kernels.nonzero_count(tensors, device)


def _held_grad(item: Any, attr: str, index: int, what: str) -> Tensor | None:
    """``item``'s ``.grad`` (or ``.decoupled_grad``); a gradient given for a parameter refused."""
    grad: Tensor | None = _read_grad(item, attr)
    if (
        grad is None
        and isinstance(item, Tensor)
        and not is_parameter(item)
        and item.layout == torch.strided
        and attr == "grad"
    ):
        raise GradientInputError(
            f"{what}: item {index} (shape {tuple(item.shape)}) is a gradient, not a parameter "
            "(it neither requires grad nor holds a .grad); pass the parameters"
        )
    return grad


def _clip_target(grad: Tensor, label: str) -> Tensor:
    """The tensor to scale in place for ``grad``; every reason it cannot be scaled, raised
    before any gradient is.

    A sparse COO gradient is scaled through its values (also uncoalesced: scaling distributes
    over the duplicates that add up), a compressed one (CSR, CSC, BSR, BSC) through its values.
    """
    local = to_local(grad).detach()
    if local.is_meta:
        raise GradientInputError(
            f"{label} is on the meta device and holds no values; nothing could be clipped"
        )
    if local.layout == torch.sparse_coo:
        local = local._values()
    elif local.layout != torch.strided:
        local = local.values()
    if local.is_inference() and not torch.is_inference_mode_enabled():
        raise GradientInputError(
            f"{label} is an inference tensor, which cannot be scaled in place outside "
            "torch.inference_mode(); clip inside it, or clone the gradient"
        )
    if overlaps_itself(local):
        raise GradientInputError(
            f"{label} has elements sharing memory (an expanded, stride-0 or self-overlapping "
            f"view, strides {local.stride()}): scaling it in place would scale them twice; "
            "make it .contiguous() first"
        )
    return local


def _grads_of(parameters: _Params, use_decoupled_grad: bool) -> list[Tensor]:
    attr = "decoupled_grad" if use_decoupled_grad else "grad"
    allowed = (torch.float32, torch.bfloat16) if use_decoupled_grad else (torch.float32,)
    what = "clip_grad_by_total_norm_fp32"
    grads: list[tuple[Tensor, Footprint | None, int]] = []
    for index, param in enumerate(_as_list(parameters)):
        grad = _held_grad(param, attr, index, what)
        if grad is None:
            continue
        if grad.dtype not in allowed:
            names = " or ".join(str(dtype).removeprefix("torch.") for dtype in allowed)
            raise GradDtypeError(
                f"clip_grad_by_total_norm_fp32: .{attr} of a parameter of shape "
                f"{tuple(param.shape)} is {str(grad.dtype).removeprefix('torch.')}; "
                f"it must be {names}"
            )
        target = _clip_target(grad, f"{what}: .{attr} of parameter {index} (shape "
                              f"{tuple(grad.shape)})")  # fmt: skip
        grads.append((target, footprint(target), index))
    repeated = _repeated(what, attr, [(found, index) for _, found, index in grads if found])
    return [target for target, _, index in grads if index not in repeated]


def _repeated(what: str, attr: str, found: list[tuple[Footprint, int]]) -> set[int]:
    """The parameters whose gradient holds the same elements as an earlier one's (the same
    gradient listed twice, or viewed again in another shape or order: scaled once).

    Raises:
        GradientInputError: two gradients sharing only some of their elements (scaling each in
            place would scale those twice), before any gradient is scaled.
    """
    by_device: dict[torch.device, list[tuple[int, int, Footprint]]] = {}
    for print_, index in found:
        by_device.setdefault(print_.device, []).append((print_.start, index, print_))
    repeated: set[int] = set()
    for entries in by_device.values():
        entries.sort()  # by start (the indices differ: footprints are never compared)
        reaching: list[tuple[int, Footprint]] = []  # those whose bytes reach past the next start
        for start, index, current in entries:
            reaching = [(at, other) for at, other in reaching if other.end > start]
            for at, other in reaching:
                kind = relation(other, current)
                if kind == "same":
                    repeated.add(max(index, at))
                elif kind == "partial":
                    low, high = sorted((at, index))
                    raise GradientInputError(
                        f"{what}: .{attr} of parameters {low} and {high} share part of their "
                        "memory: scaling both in place would scale the shared elements twice"
                    )
            reaching.append((index, current))
    return repeated


def clip_coefficient(max_norm: float, total_norm: float | Tensor) -> float:
    """Megatron's clip coefficient ``max_norm / (total_norm + 1e-6)``; scale only when < 1.

    NaN when the norm is NaN: ``nan < 1`` is false, so non-finite gradients are left as they are.
    0.0 when the norm is inf: every gradient is multiplied by 0, as Megatron does.
    """
    return float(max_norm) / (float(total_norm) + 1.0e-6)


def _clip_number(value: Any, name: str) -> float:
    """``value`` as a float: a real number or a one-element tensor, not a bool."""
    if isinstance(value, Tensor) and value.numel() == 1 and not value.is_meta:
        if value.dtype == torch.bool:
            raise ClipArgumentError(f"{name} must be a number, got a bool tensor")
        return float(value)
    if isinstance(value, numbers.Real) and not isinstance(value, bool):
        return float(value)
    shown = f"a tensor of shape {tuple(value.shape)}" if isinstance(value, Tensor) else repr(value)
    raise ClipArgumentError(f"{name} must be a number (a float or a 0-dim tensor), got {shown}")


def clip_grad_by_total_norm_fp32(
    parameters: _Params,
    max_norm: float,
    total_norm: float | Tensor,
    use_decoupled_grad: bool = False,
) -> None:
    """Scale every gradient in place by ``max_norm / (total_norm + 1e-6)`` when that is < 1.

    Gradients are left bitwise untouched when the coefficient is >= 1. As in Megatron, a NaN
    ``total_norm`` gives a NaN coefficient, which is not < 1: nothing is scaled; an infinite
    one gives 0: every gradient is multiplied by 0 (finite elements become 0, inf and NaN ones
    NaN). All or none: every gradient is checked (dtype, meta device, memory an in-place
    multiply cannot write) before the first one is scaled. A sparse gradient is scaled
    through its stored values; the same gradient listed twice is scaled once.

    Args:
        parameters: a tensor or an iterable of tensors whose ``.grad`` (fp32) or
            ``.decoupled_grad`` (fp32 or bf16) is scaled; params without one are skipped.
        max_norm: the largest total norm allowed, > 0.
        total_norm: the current total norm, >= 0, NaN or inf: a float or a 0-dim tensor.
        use_decoupled_grad: scale ``.decoupled_grad`` instead of ``.grad``.

    Raises:
        ClipArgumentError: ``max_norm`` not a positive number, ``total_norm`` negative or not
            a number (a ValueError and a TypeError).
        GradDtypeError: a ``.grad`` that is not fp32, or a ``.decoupled_grad`` that is not
            fp32/bf16 (Megatron asserts the same).
        GradientInputError: a gradient on the meta device, an inference tensor, an expanded
            (stride-0) or otherwise self-overlapping gradient, or a gradient tensor given where
            its parameter belongs.
    """
    max_value = _clip_number(max_norm, "max_norm")
    if not max_value > 0:
        raise ClipArgumentError(f"max_norm must be a positive number, got {max_norm!r}")
    norm_value = _clip_number(total_norm, "total_norm")
    if norm_value < 0:
        raise ClipArgumentError(
            f"total_norm must be >= 0 (a norm), got {norm_value!r}: a negative one would flip "
            "or zero the gradients"
        )
    grads = _grads_of(parameters, use_decoupled_grad)
    clip_coeff = clip_coefficient(max_value, norm_value)
    if grads and clip_coeff < 1.0:
        with torch.no_grad():
            if all(grad.is_cuda for grad in grads):
                torch._foreach_mul_(grads, clip_coeff)
            else:
                # On the CPU, the in-place multi-tensor multiply rounds bf16/fp16 products worse
                # than the plain one (2.6e-3 against 1.3e-3 off float64 on unit bf16 values,
                # which is the correctly rounded result, and Megatron's): one multiply per
                # tensor costs nothing.
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

    Raises:
        GradientInputError: a gradient tensor given where its parameter belongs (it has no
            ``.grad``: it would be left out without a word).
    """
    attr = "decoupled_grad" if use_decoupled_grad else "grad"
    groups = (tp_group, expert_tp_group, gtp_group, expert_gtp_group)
    selected = []
    for index, param in enumerate(_as_list(parameters)):
        grad = _held_grad(param, attr, index, "grads_for_norm")
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
    mesh group, then over ``grad_stats_parallel_group``. A sparse gradient's elements it does
    not store are zeros.

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
        GradientInputError: a meta-device gradient, a gradient tensor given for a parameter,
            or Megatron-FSDP params mixed with DTensor gradients that need a DP reduction (a
            ValueError too).
        GradDtypeError: a gradient of an unsupported dtype.
        StatsGroupError: a stats group that does not contain this rank.
        GradstatError: another rank of the group refused its input (plain gradients: every
            rank raises together, and the next call is in step, as for
            :func:`get_grad_norm_fp32`).
    """
    check_stats_group(grad_stats_parallel_group, "count_zeros_fp32")
    groups = (tp_group, expert_tp_group, gtp_group, expert_gtp_group)
    problem = None
    try:
        shards, offset = _zero_inputs(parameters, use_decoupled_grad, groups)
    except GradstatError as error:
        if not _distributed():
            raise
        # Still joins the reduction, which tells every rank of the group that one refused.
        (shards, offset), problem = ([], 0), error
    flagged = _stat(
        shards,
        _with_refusal(_zero_count, problem is not None),
        dist.ReduceOp.SUM,
        grad_stats_parallel_group,
        plain_offset=offset,
    )
    return float(int(_unflagged(flagged, problem, "zero count")))


def _zero_inputs(
    parameters: _Params, use_decoupled_grad: bool, groups: tuple[RankLike | None, ...]
) -> tuple[list[Tensor], int]:
    """The gradients :func:`count_zeros_fp32` counts, and the zeros to add to their count (a
    sparse gradient's implicit zeros) less those to take from it (GTP padding).

    Raises:
        GradstatError: what :func:`count_zeros_fp32` raises for its input.
    """
    what = "count_zeros_fp32"
    attr = "decoupled_grad" if use_decoupled_grad else "grad"
    counted: list[Tensor] = []
    fsdp_shards: list[Tensor] = []
    pad_zeros = implicit_zeros = 0
    for index, param in enumerate(_as_list(parameters)):
        grad = _held_grad(param, attr, index, what)
        if grad is None:
            continue
        fsdp = getattr(param, "__fsdp_param__", False)
        if not fsdp and not param_is_unique(param, *groups):
            continue
        label = _label(what, index, grad, of_parameter=True)
        values, implicit = readable_values(grad.detach(), label)
        implicit_zeros += implicit
        local = to_local(values)
        if fsdp:
            fsdp_shards.append(local)
        else:
            pad_zeros += _gtp_pad_zero_count(param, local)
            counted.append(values)
    if fsdp_shards and any(is_dtensor(grad) for grad in counted):
        raise GradientInputError(
            "Megatron-FSDP params (__fsdp_param__) are mixed with DTensor gradients that need a "
            "data-parallel reduction; FSDP has already reduced its gradients over DP"
        )
    # Megatron-FSDP shards are counted as they are, like plain tensors; the padding too.
    return fsdp_shards + counted, implicit_zeros - pad_zeros

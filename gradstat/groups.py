"""Distributed glue: rank descriptions, DTensor unwrapping and float64/int64 reductions.

The same code runs on one rank or many. Outside an initialized process group a reduction over
``group=None`` is the identity, and a missing axis group means "this axis is not split".
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

import torch
import torch.distributed as dist
from torch import Tensor

try:
    from torch.distributed.tensor import DTensor

    _HAVE_DTENSOR = True
except ImportError:  # a torch built without distributed support has no DTensor
    _HAVE_DTENSOR = False

__all__ = [
    "AxisPlace",
    "RankLike",
    "all_reduce",
    "dtensor_stats_group",
    "group_rank",
    "group_size",
    "stats_device",
    "to_local",
]


@runtime_checkable
class RankLike(Protocol):
    """Anything that tells a rank's place on one axis: a ProcessGroup or an offline stand-in."""

    def rank(self) -> int: ...

    def size(self) -> int: ...


@dataclass(frozen=True)
class AxisPlace:
    """One rank's place on one parallel axis, usable wherever a tp/gtp group is accepted.

    Lets offline code (a snapshot reader, a test) describe a rank without a live process group.
    """

    axis_rank: int
    axis_size: int

    def __post_init__(self) -> None:
        if self.axis_size < 1 or not 0 <= self.axis_rank < self.axis_size:
            raise ValueError(
                f"axis rank {self.axis_rank} is outside an axis of size {self.axis_size}"
            )

    def rank(self) -> int:
        return self.axis_rank

    def size(self) -> int:
        return self.axis_size


def group_rank(group: RankLike | None) -> int:
    """This rank's index in ``group``; 0 when the axis is not split (``None``)."""
    return 0 if group is None else int(group.rank())


def group_size(group: RankLike | None) -> int:
    """The number of ranks in ``group``; 1 when the axis is not split (``None``)."""
    return 1 if group is None else int(group.size())


def _distributed_ready() -> bool:
    return dist.is_available() and dist.is_initialized()


def _backend_device(group: dist.ProcessGroup | None) -> str | None:
    """'cuda' for a NCCL-only group, 'cpu' for a gloo-only group, None when either works."""
    if not _distributed_ready():
        return None
    backend = str(dist.get_backend(group))
    if "nccl" in backend and "gloo" not in backend:
        return "cuda"
    if "gloo" in backend and "nccl" not in backend:
        return "cpu"
    return None


def stats_device(grads: list[Tensor], *groups: dist.ProcessGroup | None) -> torch.device:
    """Where a statistic lives so that every reduction it goes through accepts it.

    The gradients' device wins when the groups allow it (CPU over gloo, CUDA over NCCL); a rank
    with no gradients still has to join the collectives, so it follows the groups' backend.
    """
    wanted = {_backend_device(group) for group in groups} - {None}
    if grads and (not wanted or grads[0].device.type in wanted):
        return grads[0].device
    if "cuda" in wanted:
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def all_reduce(stat: Tensor, op: dist.ReduceOp.RedOpType, group: Any) -> Tensor:
    """All-reduce ``stat`` in place over ``group``; the identity outside a process group.

    Args:
        stat: a float64 or int64 tensor on a device the group's backend accepts.
        op: ``dist.ReduceOp.SUM`` or ``dist.ReduceOp.MAX``.
        group: a ProcessGroup, or None for the default group.

    Raises:
        TypeError: ``group`` is an offline stand-in (rank()/size() only): statistics can only be
            reduced over a real process group.
    """
    if group is None and not _distributed_ready():
        return stat
    if group is not None and not isinstance(group, dist.ProcessGroup):
        raise TypeError(
            f"grad_stats_parallel_group must be a torch.distributed ProcessGroup or None, "
            f"got {type(group).__name__}"
        )
    if not _distributed_ready():
        raise RuntimeError("a ProcessGroup was given but torch.distributed is not initialized")
    dist.all_reduce(stat, op=op, group=group)
    return stat


def _as_dtensor(grad: Tensor) -> DTensor | None:
    return grad if _HAVE_DTENSOR and isinstance(grad, DTensor) else None


def to_local(grad: Tensor) -> Tensor:
    """The local shard of a DTensor gradient; any other tensor as it is."""
    dtensor = _as_dtensor(grad)
    return grad if dtensor is None else dtensor.to_local()


def dtensor_stats_group(grad: Tensor) -> dist.ProcessGroup | None:
    """The group a DTensor gradient's local statistics are summed over first, as Megatron does.

    A 1-D mesh reduces over its only dimension, a 2-D (HSDP) mesh over its shard dimension (1).

    Raises:
        ValueError: a mesh of three or more dimensions, which Megatron does not support either.
    """
    dtensor = _as_dtensor(grad)
    if dtensor is None:
        return None
    mesh = dtensor.device_mesh
    if mesh.ndim in (1, 2):
        group: dist.ProcessGroup = mesh.get_group(mesh_dim=mesh.ndim - 1)
        return group
    raise ValueError(f"DTensor gradients on a {mesh.ndim}-D device mesh are not supported")

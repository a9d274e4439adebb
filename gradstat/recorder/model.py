"""What the recorder reads of the model each step: its parameters as they are now, their
gradients, and the global norm the job's optimizer would compute of them."""

from __future__ import annotations

import types
from collections.abc import Iterable, Sequence
from typing import Any

import torch
import torch.distributed as dist

from gradstat.clip_grads import get_grad_norm_fp32, is_parameter, total_norm
from gradstat.core.groups import megatron_state, megatron_stats_groups
from gradstat.core.kernels import combine_norms
from gradstat.core.predicates import (
    param_is_not_gtp_duplicate,
    param_is_not_shared,
    param_is_not_tensor_parallel_duplicate,
)
from gradstat.errors import ArgumentError
from gradstat.snapshot.capture import gradients_to_dump, named_gradients

__all__ = ["Gradients", "is_gradient"]


def is_gradient(item: Any) -> bool:
    """A tensor given as the gradient itself: one that is no parameter by the rule
    :func:`gradstat.total_norm` follows (:func:`gradstat.clip_grads.is_parameter`)."""
    return isinstance(item, torch.Tensor) and not is_parameter(item)


def _counts_in_megatron(param: Any) -> bool:
    """Megatron's optimizer's filters, with its groups read from its parallel_state."""
    return (
        param_is_not_shared(param)
        and param_is_not_tensor_parallel_duplicate(param)
        and param_is_not_gtp_duplicate(param)
    )


class Gradients:
    """The model as the recorder sees it: a module (or chunks) walked again each step, or
    fixed ``(name, item)`` pairs (given, or Megatron's distributed-optimizer fragments, views
    of buffers it allocates once)."""

    def __init__(
        self,
        model: torch.nn.Module | Sequence[torch.nn.Module] | Iterable[tuple[str, Any]],
        optimizer: Any,
        grad_attr: str | None,
        distributed_optimizer: bool,
    ) -> None:
        if isinstance(model, torch.nn.Module):
            self._modules: list[torch.nn.Module] | None = [model]
        elif (
            isinstance(model, Sequence)
            and model
            and all(isinstance(item, torch.nn.Module) for item in model)
        ):
            self._modules = list(model)
        else:
            self._modules = None
        # Pairs may come as a generator: read them once.
        given: Any = model
        if self._modules is None and not isinstance(model, torch.nn.Module):
            given = list(model)
        pairs, self.grad_attr, self.distributed_optimizer = gradients_to_dump(
            given, optimizer, grad_attr, distributed_optimizer
        )
        if self.distributed_optimizer and optimizer is not None:
            self._modules = None  # fragments of buffers allocated once: fixed
        if self._modules is None:
            # A name given twice would merge two gradients' statistics into one row, and no
            # snapshot could be written.
            seen: set[str] = set()
            for name, _ in pairs:
                if name in seen:
                    raise ArgumentError(f"model: the name {name!r} is given twice")
                seen.add(name)
        self._pairs = pairs

    @property
    def pairs(self) -> list[tuple[str, Any]]:
        """The ``(name, item)`` pairs as they are now (a module is walked again)."""
        if self._modules is None:
            return self._pairs
        return named_gradients(self._modules)

    def items(self) -> list[Any]:
        """The parameters (or given gradients) as they are now, without names (names cost a
        walk of the modules' paths)."""
        if self._modules is None:
            return [item for _, item in self._pairs]
        if len(self._modules) == 1:
            return list(self._modules[0].parameters())
        return [param for module in self._modules for param in module.parameters()]

    def gradient(self, item: Any) -> Any:
        return item if is_gradient(item) else getattr(item, self.grad_attr, None)

    def dumped_pairs(self) -> list[tuple[str, Any]]:
        """The named parameters to dump; a tensor given as the gradient is held as one."""
        held = []
        for name, item in self.pairs:
            if is_gradient(item):
                item = types.SimpleNamespace(**{self.grad_attr: item}, shape=item.shape)
            held.append((name, item))
        return held

    def norm(
        self, norm_type: float, group: dist.ProcessGroup | None, items: Sequence[Any] | None = None
    ) -> float:
        """The global norm of the gradients as they are now (a collective: every rank calls);
        of ``items`` when the caller walked the model already this step."""
        if items is None:
            items = self.items()
        megatron = megatron_state()
        if megatron is None:
            # A place whose gradient is missing stays in the list as None: replicas that lack
            # different gradients are matched by place (see gradstat.core.replicas).
            given = []
            for item in items:
                if self.grad_attr == "grad" and isinstance(item, torch.nn.Parameter):
                    given.append(item)  # total_norm reads its attributes and .grad
                    continue
                grad = self.gradient(item)
                if grad is not None or getattr(item, "requires_grad", False):
                    given.append(grad)
            return total_norm(given, norm_type, group=group)
        # Megatron: the gradients its optimizer counts. Distributed-optimizer fragments hold
        # each element once across the job; whole gradients are reduced as its plain optimizers
        # reduce them, the dense ones over the model-parallel group and the expert ones over
        # the expert group (a replica of the data-parallel axes holds the same numbers), and
        # the two norms combined as its ChainedOptimizer combines them.
        counted = [
            item for item in items if self.gradient(item) is not None and _counts_in_megatron(item)
        ]
        if group is not None or self.distributed_optimizer:
            grads = [self.gradient(item) for item in counted]
            return get_grad_norm_fp32(grads, norm_type, group or dist.group.WORLD)
        norms = []
        for expert, stats_group in zip((False, True), megatron_stats_groups(megatron), strict=True):
            grads = [
                self.gradient(item)
                for item in counted
                if (not getattr(item, "allreduce", True)) == expert
            ]
            norms.append(get_grad_norm_fp32(grads, norm_type, stats_group))
        return combine_norms(norms, norm_type)

"""gradstat: Megatron-exact gradient norms, clipping and zero counts, outside the training loop.

The public API is Megatron-LM's ``megatron.core.optimizer.clip_grads``. It is loaded on first
use, so that ``gradstat --help`` answers without importing torch.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from ._version import __version__

if TYPE_CHECKING:
    from .clip_grads import (
        GradNorm,
        clip_grad_by_total_norm_fp32,
        count_zeros_fp32,
        get_grad_norm_fp32,
        grads_for_norm,
        gtp_local_pad_zero_count,
        param_is_not_gtp_duplicate,
        param_is_not_shared,
        param_is_not_tensor_parallel_duplicate,
        total_norm,
        total_zeros,
    )
    from .errors import GradstatError
    from .groups import AxisPlace
    from .recorder import Recorder

_LAZY = {
    "GradNorm": "clip_grads",
    "clip_grad_by_total_norm_fp32": "clip_grads",
    "count_zeros_fp32": "clip_grads",
    "get_grad_norm_fp32": "clip_grads",
    "grads_for_norm": "clip_grads",
    "gtp_local_pad_zero_count": "clip_grads",
    "param_is_not_gtp_duplicate": "clip_grads",
    "param_is_not_shared": "clip_grads",
    "param_is_not_tensor_parallel_duplicate": "clip_grads",
    "total_norm": "clip_grads",
    "total_zeros": "clip_grads",
    "GradstatError": "errors",
    "AxisPlace": "groups",
    "Recorder": "recorder",
}

__all__ = [
    "AxisPlace",
    "GradNorm",
    "GradstatError",
    "Recorder",
    "__version__",
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


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'gradstat' has no attribute {name!r}")
    return getattr(importlib.import_module(f".{module}", __name__), name)


def __dir__() -> list[str]:
    return sorted(__all__)

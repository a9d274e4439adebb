"""gradstat: Megatron-exact gradient norms, clipping and zero counts, outside the training loop.

The public API is Megatron-LM's ``megatron.core.optimizer.clip_grads`` (the names in
``gradstat.clip_grads.__all__``) and a few of gradstat's own. They are loaded on first use, so
that ``gradstat --help`` answers without importing torch.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from gradstat._version import __version__ as __version__

if TYPE_CHECKING:
    from gradstat.clip_grads import *  # noqa: F403
    from gradstat.core.groups import AxisPlace as AxisPlace
    from gradstat.errors import GradstatError as GradstatError
    from gradstat.recorder import Recorder as Recorder

# gradstat's own public names and their modules; Megatron's are listed once, in clip_grads.
_OWN = {"GradstatError": "errors", "AxisPlace": "core.groups", "Recorder": "recorder"}


def _megatron_api() -> list[str]:
    return list(importlib.import_module(".clip_grads", __name__).__all__)


def __getattr__(name: str) -> Any:
    if name == "__all__":  # for ``import *`` and dir(): needs clip_grads, hence torch
        return sorted(["__version__", *_OWN, *_megatron_api()])
    # A private or dunder name is never public: asking for one (as tools probing a module do)
    # must not import torch.
    module = _OWN.get(name)
    if module is None and not name.startswith("_") and name in _megatron_api():
        module = "clip_grads"
    if module is None:
        raise AttributeError(f"module 'gradstat' has no attribute {name!r}")
    return getattr(importlib.import_module(f".{module}", __name__), name)


def __dir__() -> list[str]:
    return list(__getattr__("__all__"))

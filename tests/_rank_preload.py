"""What the suite's gloo ranks have imported before they start (``gradstat.testing.spawn.PRELOAD``,
set in conftest.py): Megatron, where it is installed, which costs each rank that imports it
2.3 s of CPU on this project's machine. Megatron only acts once a job initialises its
``parallel_state``, and gradstat reads that state only when it is initialised, so a rank of a
torch-native job computes what it would without the import.
"""

from __future__ import annotations

import importlib
import importlib.util
import warnings

_MEGATRON = (
    "megatron.core.parallel_state",
    "megatron.core.distributed",
    "megatron.core.models.gpt",
    "megatron.core.models.gpt.gpt_layer_specs",
    "megatron.core.optimizer",
    "megatron.core.transformer",
)

if importlib.util.find_spec("megatron") is not None:
    # Expected here: no Transformer Engine, no Apex; Megatron says so at every import.
    warnings.filterwarnings("ignore", message="Transformer Engine and Apex are not installed")
    for _name in _MEGATRON:
        importlib.import_module(_name)

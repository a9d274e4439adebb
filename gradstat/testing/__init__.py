"""Test helpers for code built on gradstat: Megatron's sharding, offline, and a gloo launcher.

``shard_gradients`` lays a model's full gradients out as every rank of a Megatron job holds
them (TP, CP, PP, DP, EP/ETP, GTP/EGTP, distributed-optimizer fragments), in Megatron's rank
order; ``write_snapshot`` saves them as a snapshot. ``spawn`` and ``launch`` run a function on
N gloo ranks on the CPU and bring back each rank's value, naming a rank that failed. gradstat's
own tests use exactly these; their expected values come from the unsharded gradients.
"""

from __future__ import annotations

from gradstat.testing import layout as _layout
from gradstat.testing import spawn as _spawn
from gradstat.testing.layout import *  # noqa: F403
from gradstat.testing.spawn import *  # noqa: F403

__all__ = [*_layout.__all__, *_spawn.__all__]

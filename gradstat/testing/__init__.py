"""Test helpers for code built on gradstat: Megatron's sharding, offline, and a gloo launcher.

``shard_gradients`` lays a model's full gradients out as every rank of a Megatron job holds
them (TP, CP, PP, DP, EP/ETP, GTP/EGTP, distributed-optimizer fragments), in Megatron's rank
order; ``write_snapshot`` saves them as a snapshot. ``spawn`` and ``launch`` run a function on
N gloo ranks on the CPU and bring back each rank's value, naming a rank that failed. gradstat's
own tests use exactly these; their expected values come from the unsharded gradients.
"""

from __future__ import annotations

from .layout import (
    Layout,
    LayoutError,
    ParamLayout,
    RankParams,
    Split,
    data_parallel_with_cp,
    fragments,
    gtp_pad_rows,
    padding_mask,
    shard_gradients,
    shard_rank,
    write_snapshot,
)
from .spawn import Case, LaunchReport, Outcome, launch, spawn

__all__ = [
    "Case",
    "LaunchReport",
    "Layout",
    "LayoutError",
    "Outcome",
    "ParamLayout",
    "RankParams",
    "Split",
    "data_parallel_with_cp",
    "fragments",
    "gtp_pad_rows",
    "launch",
    "padding_mask",
    "shard_gradients",
    "shard_rank",
    "spawn",
    "write_snapshot",
]

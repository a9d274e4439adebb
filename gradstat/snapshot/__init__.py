"""Snapshots: every rank dumps its gradients with their attributes; a reader rebuilds them."""

from .capture import dump_rank
from .reader import RankFile, RebuiltParam, Snapshot, SnapshotShare
from .writer import save_rank

__all__ = [
    "RankFile",
    "RebuiltParam",
    "Snapshot",
    "SnapshotShare",
    "dump_rank",
    "save_rank",
]

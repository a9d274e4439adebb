"""Snapshots: every rank dumps its gradients with their attributes; a reader rebuilds them."""

from gradstat.snapshot.capture import dump_rank
from gradstat.snapshot.reader import RankFile, RebuiltParam, Snapshot, SnapshotShare
from gradstat.snapshot.writer import save_rank

__all__ = [
    "RankFile",
    "RebuiltParam",
    "Snapshot",
    "SnapshotShare",
    "dump_rank",
    "save_rank",
]

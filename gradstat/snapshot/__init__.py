"""Snapshots: every rank dumps its gradients with their attributes; a reader rebuilds them."""

from .capture import dump_rank
from .reader import RankFile, RebuiltParam, Snapshot
from .writer import save_rank

__all__ = ["RankFile", "RebuiltParam", "Snapshot", "dump_rank", "save_rank"]

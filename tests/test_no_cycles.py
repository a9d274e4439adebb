"""Reading and reducing a snapshot makes no reference cycles.

The command line turns Python's collector off for a command (``gradstat.cli.app.main``): what a
command drops is freed by its reference count at once, so long as nothing it builds refers back
to itself. These tests hold every reader to that, by the collector itself: with collection off,
a snapshot opened, reduced and dropped leaves nothing for a collection to find. A reader that
made a cycle per rank file would otherwise keep each file's records (and a small file's bytes)
until the process ends.
"""

from __future__ import annotations

import gc
import math
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch

from gradstat.analysis.stats import snapshot_stats
from gradstat.snapshot import Snapshot, save_rank
from gradstat.snapshot.reader import SMALL_FILE_BYTES
from tests._wgrads import Layout, Model

SAMPLES = Path(__file__).resolve().parents[1] / "sample_data"


@pytest.fixture
def collection_off() -> Iterator[Callable[[Callable[[], object]], int]]:
    """Runs an action with the collector off; returns how many objects a collection then
    finds unreachable (what the action left in cycles)."""
    was_on = gc.isenabled()

    def left_in_cycles(action: Callable[[], object]) -> int:
        gc.collect()
        gc.disable()
        action()
        return gc.collect()

    try:
        yield left_in_cycles
    finally:
        if was_on:
            gc.enable()


def _read_and_reduce(directory: Path) -> Callable[[], object]:
    def action() -> None:
        snapshot = Snapshot.open(directory)
        stats = snapshot_stats(snapshot, (2.0, 1.0, math.inf), zeros=True)
        assert stats.params

    return action


def test_the_check_finds_a_cycle(collection_off: Callable[[Callable[[], object]], int]) -> None:
    """The negative control: a cycle made and dropped is found."""

    def make_cycle() -> None:
        node: dict[str, object] = {}
        node["self"] = node

    assert collection_off(make_cycle) >= 1


@pytest.mark.parametrize("name", sorted(path.name for path in SAMPLES.iterdir() if path.is_dir()))
def test_rank_files_leave_no_cycles(
    name: str, collection_off: Callable[[Callable[[], object]], int]
) -> None:
    """The sample snapshots: distributed optimizer, NaN (located tensor by tensor), GTP padding."""
    assert collection_off(_read_and_reduce(SAMPLES / name)) == 0


def test_mapped_rank_files_leave_no_cycles(
    tmp_path: Path, collection_off: Callable[[Callable[[], object]], int]
) -> None:
    """Files too large to read whole are mapped, their tensors viewed in the map."""
    holder = type("Param", (), {})()
    holder.grad = torch.randn(SMALL_FILE_BYTES // 4 + 1, generator=torch.Generator().manual_seed(0))
    holder.shape = holder.grad.shape
    for rank in range(2):
        coords = {"pp": [rank, 2]}
        save_rank(tmp_path, [(f"w{rank}", holder)], rank=rank, world_size=2, coords=coords)
    assert collection_off(_read_and_reduce(tmp_path)) == 0


def test_wgrads_dumps_leave_no_cycles(
    tmp_path: Path, collection_off: Callable[[Callable[[], object]], int]
) -> None:
    Model.make(Layout(tp=2, pp=2)).write(tmp_path)
    assert collection_off(_read_and_reduce(tmp_path)) == 0


def test_checkpoints_leave_no_cycles(
    tmp_path: Path, collection_off: Callable[[Callable[[], object]], int]
) -> None:
    import torch.distributed.checkpoint as dcp

    weights = {"layer.weight": torch.randn(5, 4), "layer.bias": torch.randn(5)}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # saved without a process group, as one process
        dcp.save({"model": weights}, checkpoint_id=str(tmp_path))
    assert collection_off(_read_and_reduce(tmp_path)) == 0

"""compare rebuilds a DTensor parameter whose uneven sharding leaves some ranks empty shards.

A [3, 2] tensor sharded on dim 1 over 4 ranks: ranks 2 and 3 hold [3, 0] shards at the same
offset. compare took them for two shards of one box and left the parameter unrebuilt; norm,
zeros and audit were right. Written by real DTensors under torchrun (4 and 2 ranks)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests._cli import run_gradstat, run_torchrun

pytestmark = pytest.mark.multiprocess

_WRITER = """\
import sys, torch, torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Shard
from gradstat.snapshot import save_rank

dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()
mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("dp_shard",))
full = torch.arange(1.0, 7.0).reshape(3, 2)
chunks = torch.chunk(full, world, 1)
local = chunks[rank] if rank < len(chunks) else full.narrow(1, 0, 0)
grad = DTensor.from_local(local.contiguous(), mesh, [Shard(1)], run_check=False,
                          shape=full.shape, stride=full.stride())


class Param:
    shape = full.shape

    def __init__(self, grad):
        self.grad = grad


save_rank(sys.argv[1], [("c", Param(grad))], rank=rank, world_size=world,
          coords={"dp": [rank, world]})
dist.destroy_process_group()
"""


def test_empty_shards_do_not_stop_a_parameter_being_rebuilt(tmp_path: Path) -> None:
    writer = tmp_path / "writer.py"
    writer.write_text(_WRITER)
    for ranks in (4, 2):
        result = run_torchrun(ranks, str(writer), str(tmp_path / f"ranks-{ranks}"))
        assert result.returncode == 0, result.stderr
    result = run_gradstat("compare", tmp_path / "ranks-4", tmp_path / "ranks-2", "--json")
    (row,) = json.loads(result.stdout)["params"]
    assert row["not_rebuilt"] is None and row["max_abs_diff"] == 0.0, row
    assert row["diff_norm"] == 0.0 and row["flags"] == [], row

"""What audit says a replica would have done had it been counted (``norm_if_miscounted``), and
a wgrads dump's tied copy holding a NaN, against float64 sums of the values written."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from gradstat.snapshot import save_rank
from tests import _wgrads
from tests._cli import run_gradstat
from tests._params import param_with

NAN = math.nan
FULL = torch.arange(1.0, 9.0).reshape(4, 2)  # rows split over TP


def _norm(values: list[float]) -> float:
    return math.sqrt(math.fsum(value * value for value in values))


def _finding(folder: Path) -> dict:
    done = run_gradstat("audit", folder, "--json")
    assert done.returncode == 1, done.stdout + done.stderr
    (finding,) = json.loads(done.stdout)["findings"]
    return finding


@pytest.mark.parametrize("changed", [{0: 11.0, 1: 15.0}, {0: NAN, 1: 15.0}])
def test_a_sharded_weights_replica_counts_by_all_its_shards(
    tmp_path: Path, changed: dict[int, float]
) -> None:
    """TP=2 x DP=2, plain optimizer: DP rank 1's copies of both TP shards differ. Counting that
    replica counts both; the largest one shard's change was reported (20.10 for 22.89), and a
    NaN in one shard was dropped for the other's finite change."""
    replica: list[float] = []
    rank = 0
    for dp in range(2):
        for tp in range(2):
            shard = FULL.chunk(2)[tp].clone()
            if dp == 1:
                shard.view(-1)[0] = changed[tp]
                replica += shard.reshape(-1).tolist()
            param = param_with(shard, tensor_model_parallel=True, partition_dim=0)
            coords = {"tp": [tp, 2], "dp": [dp, 2]}
            save_rank(tmp_path, [("w", param)], rank=rank, world_size=4, coords=coords)
            rank += 1
    finding = _finding(tmp_path)
    assert finding["kind"] == "dp_replicas_differ", finding
    expected = _norm(replica)
    found = float(finding["norm_if_miscounted"])  # JSON's NaN is the string "nan"
    assert (
        math.isnan(found) if math.isnan(expected) else found == pytest.approx(expected, rel=1e-12)
    )


@pytest.mark.parametrize("order", ["nan first", "nan last"])
def test_a_nan_replica_is_reported_whatever_the_rank_order(tmp_path: Path, order: str) -> None:
    """DP=4: one replica NaN, another with a finite difference. The NaN one's NaN was replaced
    by the finite one's change when that one came later."""
    base = [1.0, 2.0, 3.0, 4.0]
    odd = [[NAN, 2.0, 3.0, 4.0], [1.0, 2.0, 3.0, 5.0]]
    replicas = [base, *(odd if order == "nan first" else odd[::-1]), base]
    for rank, values in enumerate(replicas):
        param = param_with(torch.tensor(values), tensor_model_parallel=False)
        save_rank(tmp_path, [("w", param)], rank=rank, world_size=4, coords={"dp": [rank, 4]})
    finding = _finding(tmp_path)
    assert finding["kind"] == "dp_replicas_differ", finding
    assert finding["norm_if_miscounted"] == finding["norm_change"] == "nan", finding


def test_a_tied_output_layer_holding_the_embeddings_nan_is_still_its_copy(tmp_path: Path) -> None:
    """A wgrads dump (TP=1, PP=2) whose tied output layer holds the NaN the all-reduce gave it
    and the embedding: it was taken for an untied layer (NaN is unequal to itself) and its
    elements counted a second time by ``zeros``."""
    model = _wgrads.Model.make(_wgrads.Layout(pp=2))
    model.tensors["embedding.word_embeddings.weight"].grad.view(-1)[3] = NAN
    folder = tmp_path / "wgrads" / "iter_0000007"
    model.write(folder)
    done = run_gradstat("zeros", folder, "--json")
    assert done.returncode == 0, done.stdout + done.stderr
    report = json.loads(done.stdout)
    assert report["num_zeros"] == model.zeros
    assert report["num_elements"] == sum(tensor.grad.numel() for tensor in model.tensors.values())


def test_an_hsdp_replica_counts_by_all_its_shards(tmp_path: Path) -> None:
    """HSDP (mesh 2 x 2, Replicate x Shard(0)): the replica at coordinate 1 differs in both of
    its shards; counting it counts both."""
    from gradstat.core.placements import MeshPlacement
    from tests.test_coverage import _write_shard

    full = torch.arange(1.0, 25.0).reshape(4, 6) / 3
    replica = full.clone()
    replica[0, 0], replica[3, 5] = 100.0, -7.0
    for rank in range(4):
        copy, shard = divmod(rank, 2)
        grad = (replica if copy else full)[2 * shard : 2 * shard + 2].clone()
        mesh = MeshPlacement(
            (2, 2),
            (copy, shard),
            ("R", "S(0)"),
            (4, 6),
            ("dp_replicate", "dp_shard"),
            (2 * shard, 0),
        )
        _write_shard(tmp_path, rank, 4, grad, mesh)
    finding = _finding(tmp_path)
    assert finding["kind"] == "replicas_differ", finding
    expected = _norm(replica.reshape(-1).tolist())
    assert finding["norm_if_miscounted"] == pytest.approx(expected, rel=1e-12)

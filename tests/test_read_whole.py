"""Small rank files read whole: their statistics come from one native pass over the bytes read
(no tensor made), and must be the tensor path's, bit for bit, and float64's."""

from __future__ import annotations

import math
from array import array
from pathlib import Path
from typing import Any

import pytest
import torch

from gradstat.analysis.stats import SnapshotStats, snapshot_stats
from gradstat.core import native
from gradstat.snapshot import Snapshot, reader, save_rank
from gradstat.snapshot.container import kept_fp32
from tests._oracle import float64_norm, rel_err, zeros_in
from tests._params import gtp_shard, param_with

needs_kernel = pytest.mark.skipif(native.native_library() is None, reason="no C compiler here")


def _grads(seed: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    weight = torch.randn(64, 32, generator=gen)
    weight[3] = 0.0
    weight[5, :7] = -0.0
    tiny = torch.full((40,), 1e-42)  # subnormal: its square underflows in fp32, not float64
    tiny[::3] = 3e-39
    bad = torch.randn(9, generator=gen)
    bad[2], bad[6] = math.nan, math.inf
    return {"w": weight, "tiny": tiny, "bad": bad, "empty": torch.zeros(0)}


def _write(directory: Path, mixed_rank: int | None = None) -> dict[str, list[torch.Tensor]]:
    """Two GTP ranks' files, each of plain fp32 tensors (one with NaN and inf, one empty), a
    GTP shard with its padding and a frozen parameter; ``mixed_rank``'s also holds a bf16
    tensor. Returns each counted parameter's gradients over the ranks."""
    counted: dict[str, list[torch.Tensor]] = {}
    for rank in range(2):
        grads = _grads(rank)
        params: list[tuple[str, Any]] = [(name, param_with(grad)) for name, grad in grads.items()]
        shard, _ = gtp_shard(13, 4, align=8, gtp_rank=rank, gtp_size=2)
        params.append(("gtp", shard))
        params.append(("frozen", param_with(None)))
        # Replicated over GTP: counted on GTP rank 0 only.
        names = list(grads) if rank == 0 else []
        if rank == mixed_rank:
            half = torch.randn(17, generator=torch.Generator().manual_seed(7)).bfloat16()
            params.append(("half", param_with(half, is_gtp_weight_remat=True)))
            counted["half"] = [half]
        for name in names:
            counted.setdefault(name, []).append(grads[name])
        counted.setdefault("gtp", []).append(shard.grad)
        save_rank(directory, params, rank=rank, world_size=2, coords={"gtp": [rank, 2]})
    return counted


def _stats(directory: Path, norm_types: tuple[float, ...]) -> SnapshotStats:
    return snapshot_stats(Snapshot.open(directory), norm_types)


def _both(
    directory: Path, norm_types: tuple[float, ...], monkeypatch: pytest.MonkeyPatch
) -> tuple[SnapshotStats, SnapshotStats]:
    kept = _stats(directory, norm_types)
    with monkeypatch.context() as patch:
        patch.setattr(reader, "SMALL_FILE_BYTES", 0)  # every file mapped, every tensor made
        snapshot = Snapshot.open(directory)
        assert all(file.container.data is None for file in snapshot.files)
        mapped = snapshot_stats(snapshot, norm_types)
    return kept, mapped


def _same(first: SnapshotStats, second: SnapshotStats) -> None:
    # repr: NaN equal to NaN, -0.0 told from 0.0.
    assert repr(first.params) == repr(second.params)
    assert first.nonfinite == second.nonfinite


@needs_kernel
@pytest.mark.parametrize("norm_types", [(2.0,), (2.0, 1.0, math.inf), (3.0,)])
def test_files_read_whole_give_the_tensor_paths_statistics(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, norm_types: tuple[float, ...]
) -> None:
    counted = _write(tmp_path)
    snapshot = Snapshot.open(tmp_path)
    for file in snapshot.files:
        assert file.container.data is not None
        # The native pass applies: every tensor of these files is fp32.
        names = [record.name for record in file.header.params if record.has_grad]
        assert kept_fp32(file.container, names) is not None
    kept, mapped = _both(tmp_path, norm_types, monkeypatch)
    _same(kept, mapped)
    by_name = {param.name: param for param in kept.params}
    assert sorted(by_name) == sorted(counted)
    for name, grads in counted.items():
        stats = by_name[name]
        if name == "bad":
            assert math.isnan(stats.norm(norm_types[0]))
            continue
        for p in norm_types:
            expected = float64_norm(grads, p)
            assert stats.norm(p) == expected == 0.0 or rel_err(stats.norm(p), expected) < 1e-12
        if name != "gtp":  # the GTP shards' padding is counted apart from their zeros
            assert stats.zeros == zeros_in(grads)
    assert by_name["gtp"].pad_zeros > 0
    assert by_name["gtp"].zeros + by_name["gtp"].pad_zeros == zeros_in(counted["gtp"])
    assert [(bad.name, bad.nan, bad.inf) for bad in kept.nonfinite] == [("bad", 1, 1)]


@needs_kernel
def test_a_file_with_another_dtype_takes_the_tensor_path(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _write(tmp_path, mixed_rank=1)
    mixed = Snapshot.open(tmp_path).files[1]
    names = [record.name for record in mixed.header.params if record.has_grad]
    assert kept_fp32(mixed.container, names) is None
    kept, mapped = _both(tmp_path, (2.0, math.inf), monkeypatch)
    _same(kept, mapped)
    assert any(param.name == "half" for param in kept.params)


def test_kept_addresses_are_the_tensors_bytes(tmp_path: Path) -> None:
    """What the native pass reads at each address is the tensor's own values."""
    _write(tmp_path)
    file = Snapshot.open(tmp_path).files[0]
    names = ["w", "tiny", "empty"]
    found = kept_fp32(file.container, names)
    assert found is not None
    pointers, sizes = found
    with file.tensors() as tensors:
        for name, pointer, size in zip(names, pointers, sizes, strict=True):
            tensor = tensors[name]
            assert size == tensor.numel()
            if size:
                assert pointer == tensor.data_ptr()


@needs_kernel
def test_a_pass_over_addresses_is_each_tensors_own() -> None:
    gen = torch.Generator().manual_seed(30)
    grads = [torch.randn(size, generator=gen) for size in (1, 7, 2048, 100_003, 0, 33)]
    grads[1][3] = math.nan
    grads[2][:100] = 0.0
    grads[5][0] = -math.inf
    pointers = array("q", (grad.data_ptr() for grad in grads))
    sizes = array("q", (grad.numel() for grad in grads))
    passes = native.fused_many_at(pointers, sizes)
    assert passes is not None
    # repr: a NaN sum equal to a NaN sum.
    assert repr(passes) == repr([native.fused_f32(grad) for grad in grads])
    assert repr(passes) == repr(native.fused_many_f32(grads))
    for grad, stats in zip(grads, passes, strict=True):
        assert stats.zeros == zeros_in([grad])
        assert bool(stats.has_nan) == bool(grad.isnan().any())

"""Host-to-device staging (gradstat.core.staging) on a link that runs every transfer as late as
a device may: a buffer refilled before its transfer ran, or bytes packed in the wrong place,
show in the copies. The same checks on a real GPU are in tests/test_cuda.py."""

from __future__ import annotations

import math
import weakref
from collections.abc import Sequence

import pytest
import torch

from gradstat.analysis import stats
from gradstat.analysis.stats import Request, counts, file_pieces, snapshot_pieces
from gradstat.core import staging
from gradstat.core.staging import Staging
from gradstat.errors import SnapshotError
from gradstat.snapshot import RankFile, RebuiltParam, Snapshot
from tests._cli import SAMPLE_DATA


class _Point:
    def __init__(self, link: _LateLink, upto: int) -> None:
        self.link, self.upto = link, upto

    def synchronize(self) -> None:
        self.link.run(self.upto)


class _LateLink:
    """Transfers queue and run only when a mark after them is waited for, or at ``run()``."""

    def __init__(self) -> None:
        self.queue: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.done = 0

    def buffer(self, size: int) -> torch.Tensor:
        return torch.full((size,), 0xAB, dtype=torch.uint8)

    def send(self, destination: torch.Tensor, source: torch.Tensor) -> None:
        assert destination.numel() == source.numel()
        self.queue.append((destination, source))

    def mark(self) -> _Point:
        return _Point(self, len(self.queue))

    def run(self, upto: int | None = None) -> None:
        upto = len(self.queue) if upto is None else upto
        for destination, source in self.queue[self.done : upto]:
            destination.copy_(source)
        self.done = max(self.done, upto)


def _mixed_tensors(seed: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    tensors = [
        torch.randn(3, 5, generator=gen),
        torch.randn(700, generator=gen).to(torch.bfloat16),  # 1400 bytes: spans windows
        torch.tensor(2.5, dtype=torch.float64),  # no dimensions
        torch.empty(0, 4),
        torch.randn(33, generator=gen).half(),
        torch.randint(-5, 5, (9,), generator=gen),
        torch.rand(11, generator=gen) > 0.5,
        torch.randn(2, 600, generator=gen),  # 4800 bytes: several windows of 1000
        torch.randn(40, 3, generator=gen).t(),  # not contiguous
    ]
    tensors[0][1, 2] = math.nan
    tensors[7][1, 7] = -math.inf
    return tensors


def _same(got: torch.Tensor, want: torch.Tensor) -> bool:
    """Bitwise equal, dtype and shape too (NaN equals NaN)."""
    if got.dtype != want.dtype or got.shape != want.shape:
        return False

    def raw(tensor: torch.Tensor) -> torch.Tensor:
        return tensor.contiguous().reshape(-1).view(torch.uint8)

    return torch.equal(raw(got), raw(want))


def test_every_tensor_arrives_bitwise_though_transfers_run_late() -> None:
    link = _LateLink()
    stage = Staging(torch.device("cpu"), link, buffer_bytes=1000, buffers=2)
    calls = [_mixed_tensors(seed) for seed in range(3)]  # rank files one after another
    kept = [[tensor.clone() for tensor in tensors] for tensors in calls]
    arrived = [stage.to_device(tensors) for tensors in calls]
    link.run()
    for got, sources, originals in zip(arrived, calls, kept, strict=True):
        assert all(map(_same, got, originals))
        assert all(map(_same, sources, originals))  # the sources are only read


def test_the_sources_may_change_once_the_call_returns() -> None:
    """A rank file's map is closed after its tensors are staged: the transfers still queued read
    the staging buffers, never the sources."""
    link = _LateLink()
    stage = Staging(torch.device("cpu"), link, buffer_bytes=512, buffers=3)
    sources = _mixed_tensors(4)
    want = [tensor.clone() for tensor in sources]
    arrived = stage.to_device(sources)
    for tensor in sources:
        if tensor.numel() and tensor.dtype != torch.bool:
            tensor.fill_(7)
    link.run()
    assert all(map(_same, arrived, want))


def test_small_tensors_share_one_transfer_per_window() -> None:
    link = _LateLink()
    stage = Staging(torch.device("cpu"), link, buffer_bytes=64 << 10, buffers=2)
    tensors = [torch.full((10,), float(index)) for index in range(100)]  # 100 x 256 aligned bytes
    arrived = stage.to_device(tensors)
    assert len(link.queue) == 1
    link.run()
    assert all(map(_same, arrived, tensors))
    stage.to_device([torch.zeros(64 << 10, dtype=torch.uint8)])  # one window exactly
    stage.to_device([torch.zeros((64 << 10) + 1, dtype=torch.uint8)])  # two
    assert len(link.queue) == 4


def test_another_device_than_cuda_gets_a_plain_copy() -> None:
    tensors = _mixed_tensors(5)
    moved = staging.to_device(tensors, torch.device("cpu"))
    assert all(map(_same, moved, tensors))


def test_the_host_waits_only_for_the_buffer_it_refills() -> None:
    """With three buffers, staging five windows forces the first two transfers, no more: the
    link carries the others while the host goes on."""
    link = _LateLink()
    stage = Staging(torch.device("cpu"), link, buffer_bytes=256, buffers=3)
    stage.to_device([torch.arange(5 * 64, dtype=torch.float32)])  # 1280 bytes, 5 windows
    assert (len(link.queue), link.done) == (5, 2)


def test_a_rank_file_read_in_runs_gives_the_pieces_of_the_whole(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A GPU holds one run of a file's gradients at a time: read a tensor at a time, or a few
    together, every piece (expert rows included) comes out as from the whole file at once."""
    request = Request.make((2.0, 3.0, math.inf), zeros=True, split_experts=True)
    for sample in ("tp2-pp2-dp2-ep2-distopt-nan", "gtp2-pp2-dp2-ep2"):
        snapshot = Snapshot.open(SAMPLE_DATA / sample)
        whole = repr(snapshot_pieces(snapshot, request))
        sizes = [record.numel * 4 for file in snapshot.files for record in file.header.params]
        for limit in (1, 3 * max(sizes) // 2):
            monkeypatch.setattr(stats, "RUN_BYTES", limit)
            counted = [p for p in _params(snapshot.files[0]) if counts(snapshot.files[0], p)]
            assert 1 < len(stats._runs(counted)) <= len(counted)
            assert repr(snapshot_pieces(snapshot, request)) == whole


def _params(rank_file: RankFile) -> list[RebuiltParam]:
    with rank_file.params() as params:
        return params


def test_gradients_a_device_has_no_room_for_are_one_line(monkeypatch: pytest.MonkeyPatch) -> None:
    def no_room(tensors: Sequence[torch.Tensor], device: torch.device) -> list[torch.Tensor]:
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")

    monkeypatch.setattr(staging, "to_device", no_room)
    snapshot = Snapshot.open(SAMPLE_DATA / "gtp2-pp2-dp2-ep2")
    rank_file = snapshot.files[0]
    request = Request.make((2.0,), zeros=True, device="meta", split_experts=True)
    with pytest.raises(SnapshotError) as raised:
        file_pieces(rank_file, request)
    message = str(raised.value)
    assert "\n" not in message
    assert message.startswith(f"{rank_file.path}: ") and "free memory of meta" in message
    assert "use --device cpu" in message


def test_the_device_holds_one_run_of_a_file_at_a_time(monkeypatch: pytest.MonkeyPatch) -> None:
    """Each run's copies are gone before the next run is copied (here the "device" copies are
    CPU clones, watched by weak references): a file larger than the GPU is read run by run."""
    watched: list[weakref.ref[torch.Tensor]] = []
    runs = []

    def to_device(tensors: Sequence[torch.Tensor], device: torch.device) -> list[torch.Tensor]:
        assert all(copy() is None for copy in watched), "an earlier run is still held"
        copies = [tensor.clone() for tensor in tensors]
        watched.extend(map(weakref.ref, copies))
        runs.append(len(copies))
        return copies

    snapshot = Snapshot.open(SAMPLE_DATA / "gtp2-pp2-dp2-ep2")
    on_cpu = Request.make((2.0,), zeros=True, split_experts=True)
    want = repr(snapshot_pieces(snapshot, on_cpu))
    monkeypatch.setattr(staging, "to_device", to_device)
    monkeypatch.setattr(stats, "RUN_BYTES", 1)
    elsewhere = Request.make((2.0,), zeros=True, device="meta", split_experts=True)
    assert repr(snapshot_pieces(snapshot, elsewhere)) == want
    assert len(runs) > len(snapshot.files) and set(runs) == {1}

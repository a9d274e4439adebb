"""Host-to-device copies of a rank file's gradients through pinned staging buffers.

``tensor.to("cuda")`` from a file's map copies from pageable memory: the driver stages it
through a pinned buffer of its own and the host waits for each copy, so reading the page cache
and the transfer over the link take turns. Here the host packs the tensors' bytes, window by
window, into a few pinned buffers of its own and queues each window's transfer without waiting
for it: while the link carries one window, the host fills the next. The device side is one
allocation per call, each tensor a view of it at an aligned offset, so that a file of
thousands of small gradients costs one transfer per window, not one per tensor.

Everything runs on the device's current stream: a transfer is ordered before every reduction
launched after it, and the reductions (HBM at terabytes a second) take about 1% of the link's
time, so a second stream would hide nothing worth its lifetime rules. The one hazard is the
host refilling a buffer whose transfer has not run yet; each buffer's transfer is marked with
an event, and the host waits for it before refilling that buffer.
"""

from __future__ import annotations

import functools
import logging
import os
import threading
from collections.abc import Sequence
from typing import Protocol

import torch

__all__ = ["CudaLink", "Link", "Mark", "Staging", "to_device"]

_log = logging.getLogger(__name__)

# Device offsets of the tensors: aligned for any dtype and for vectorised loads.
_ALIGN = 256
BUFFER_BYTES = 16 << 20
BUFFERS = 4


class Mark(Protocol):
    """A point in the device's queue: ``synchronize`` returns once everything queued before it
    has run (``torch.cuda.Event``)."""

    def synchronize(self) -> None: ...


class Link(Protocol):
    """How bytes reach a device: host buffers to stage them in, a transfer that may still be
    running when it returns, and a mark after the transfers queued so far."""

    def buffer(self, size: int) -> torch.Tensor: ...

    def send(self, destination: torch.Tensor, source: torch.Tensor) -> None: ...

    def mark(self) -> Mark: ...


class CudaLink:
    """A CUDA device's link: pinned host buffers, transfers and events on its current stream."""

    def __init__(self, device: torch.device) -> None:
        self.device = device

    def buffer(self, size: int) -> torch.Tensor:
        return torch.empty(size, dtype=torch.uint8, pin_memory=True)

    def send(self, destination: torch.Tensor, source: torch.Tensor) -> None:
        destination.copy_(source, non_blocking=True)

    def mark(self) -> Mark:
        event = torch.cuda.Event()  # type: ignore[no-untyped-call]
        event.record(torch.cuda.current_stream(self.device))
        return event


class Staging:
    """Copies of host tensors to ``device`` through ``buffers`` host buffers of
    ``buffer_bytes`` each, used in turn."""

    def __init__(
        self,
        device: torch.device,
        link: Link,
        buffer_bytes: int = BUFFER_BYTES,
        buffers: int = BUFFERS,
    ) -> None:
        if buffer_bytes <= 0 or buffers <= 0:
            raise ValueError(f"staging needs buffers of some bytes, not {buffers} x {buffer_bytes}")
        self.device = device
        self._link = link
        self._buffers = [link.buffer(buffer_bytes) for _ in range(buffers)]
        # The mark after each buffer's last transfer: it may be refilled once that has run.
        self._marks: list[Mark | None] = [None] * buffers
        self._next = 0
        self._lock = threading.Lock()  # the buffers are the process's, threads take turns

    def to_device(self, tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """Each tensor's copy on the device, as it will be once the transfers queued now have
        run: whatever is launched on the device's current stream after this call sees the
        values. The sources may change or go away as soon as it returns (they were copied)."""
        with self._lock:
            return self._to_device(tensors)

    def _to_device(self, tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        sources = [tensor.contiguous().reshape(-1).view(torch.uint8) for tensor in tensors]
        offsets, end = [], 0
        for source in sources:
            offsets.append(end)
            end += -(-source.numel() // _ALIGN) * _ALIGN
        arrived = torch.empty(end, dtype=torch.uint8, device=self.device)
        size = self._buffers[0].numel()
        first = 0  # the first tensor not wholly staged yet
        for start in range(0, end, size):
            stop = min(start + size, end)
            index, buffer = self._free_buffer()
            while first < len(sources) and offsets[first] < stop:
                source, offset = sources[first], offsets[first]
                low, high = max(offset, start), min(offset + source.numel(), stop)
                buffer[low - start : high - start].copy_(source[low - offset : high - offset])
                if offset + source.numel() > stop:
                    break  # it goes on in the next window
                first += 1
            self._link.send(arrived[start:stop], buffer[: stop - start])
            self._marks[index] = self._link.mark()
        return [
            arrived[offset : offset + source.numel()].view(tensor.dtype).view(tensor.shape)
            for tensor, source, offset in zip(tensors, sources, offsets, strict=True)
        ]

    def _free_buffer(self) -> tuple[int, torch.Tensor]:
        """The next buffer in turn (and its index), once its last transfer has run."""
        index = self._next
        self._next = (index + 1) % len(self._buffers)
        mark, self._marks[index] = self._marks[index], None
        if mark is not None:
            mark.synchronize()
        return index, self._buffers[index]


def to_device(tensors: Sequence[torch.Tensor], device: torch.device) -> list[torch.Tensor]:
    """``tensors`` on ``device``: through pinned staging buffers to a CUDA device (see the
    module's docstring), with a plain ``.to`` elsewhere, or where pinned memory cannot be had
    or ``GRADSTAT_PINNED=0``."""
    staging = _staging(device) if device.type == "cuda" else None
    if staging is None:
        return [tensor.to(device) for tensor in tensors]
    return staging.to_device(tensors)


@functools.cache
def _staging(device: torch.device) -> Staging | None:
    """The process's staging buffers for ``device`` (64 MiB pinned), made at its first use."""
    if os.environ.get("GRADSTAT_PINNED", "1") == "0":
        return None
    try:
        return Staging(device, CudaLink(device))
    except RuntimeError as error:  # no pinned memory to be had (a locked-memory limit)
        _log.warning("pinned staging buffers unavailable (%s); copying tensor by tensor", error)
        return None

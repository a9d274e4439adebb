"""Python's cyclic garbage collector, paused for work that makes many objects and no cycles."""

from __future__ import annotations

import gc
from collections.abc import Iterator
from contextlib import contextmanager


@contextmanager
def collector_paused() -> Iterator[None]:
    """Pause the cyclic collector for the block, where it was running.

    A step over 100,000 gradients makes a few objects for each (its statistics, its place in
    a list), freed by reference counting when the step ends. Counted as they are made, they
    start a young collection every 700 and, promoted, full ones that walk the training
    process's whole heap: measured in ``benchmarks/bench_telemetry.py``, 130 collections and
    60 ms a step of the 100,000-tensor scenario, more than the step's own work. Paused, the
    objects are freed before the collector looks; a cycle made meanwhile (by another thread)
    is collected after the block, as it would be at the next collection.
    """
    if not gc.isenabled():
        yield
        return
    gc.disable()
    try:
        yield
    finally:
        gc.enable()

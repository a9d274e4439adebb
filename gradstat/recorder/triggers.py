"""When the recorder takes a snapshot: the triggers, decided the same way on every rank."""

from __future__ import annotations

import math
import statistics
from collections import deque

__all__ = ["ROUTINE_TRIGGERS", "TRIGGERS", "Triggers"]

TRIGGERS = ("nonfinite", "spike", "step", "every", "mismatch")
ROUTINE_TRIGGERS = frozenset({"step", "every"})  # the others mark a step that went wrong


class Triggers:
    """The triggers' state: the recent finite norms (for ``spike``), the listed steps, the
    period, and whether the logged norm disagreed at the step before (for ``mismatch``)."""

    def __init__(
        self,
        spike: float | None,
        window: int,
        warmup: int,
        steps: frozenset[int],
        every: int | None,
        logged_rtol: float,
    ) -> None:
        self.spike, self.warmup = spike, warmup
        self.steps, self.every = steps, every
        self.logged_rtol = logged_rtol
        self.history: deque[float] = deque(maxlen=window)
        self._mismatched = False

    def fired(self, step: int, norm: float, mismatch: bool) -> list[bool]:
        """One flag per name of :data:`TRIGGERS`. ``mismatch`` fires where a run of steps whose
        logged norm disagrees begins (not at every step of a constant miscount)."""
        spiked = False
        if self.spike is not None and len(self.history) >= self.warmup and math.isfinite(norm):
            spiked = norm > self.spike * statistics.median(self.history)
        every = self.every is not None and step % self.every == 0
        began = mismatch and not self._mismatched
        return [not math.isfinite(norm), spiked, step in self.steps, every, began]

    def after(self, norm: float, mismatch: bool) -> None:
        """Record the step's norm and whether its logged norm disagreed."""
        if math.isfinite(norm):
            self.history.append(norm)
        self._mismatched = mismatch

    def disagrees(self, exact: float, logged: float) -> bool:
        """Whether ``logged`` is not ``exact`` within ``logged_rtol`` (both non-finite of the
        same kind agree: a NaN logged for a NaN norm is right)."""
        if not (math.isfinite(exact) and math.isfinite(logged)):
            return not (math.isnan(exact) and math.isnan(logged)) and exact != logged
        return abs(logged - exact) > self.logged_rtol * max(abs(exact), abs(logged))

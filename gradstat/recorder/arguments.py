"""The recorder's arguments, checked: one line naming the argument, never a late surprise."""

from __future__ import annotations

import math
import numbers
import re
from collections.abc import Iterable
from typing import Any

import torch

from gradstat.errors import ArgumentError, ArgumentTypeError

__all__ = [
    "count",
    "logged_value",
    "patterns",
    "seconds",
    "spike_factor",
    "step_number",
    "step_set",
    "tolerance",
]


def _whole(name: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise ArgumentTypeError(f"{name} must be an integer, got {value!r}")
    return int(value)


def patterns(name: str, value: Any) -> tuple[str, ...]:
    """``value`` as a tuple of regular expressions, each compiled once to check it."""
    if isinstance(value, str | bytes):
        raise ArgumentTypeError(f"{name} must be a list of regular expressions, got {value!r}")
    found = tuple(value)
    for pattern in found:
        if not isinstance(pattern, str):
            raise ArgumentTypeError(f"{name}: {pattern!r} is no regular expression (a str)")
        try:
            re.compile(pattern)
        except re.error as error:
            raise ArgumentError(f"{name}: {pattern!r} is no regular expression: {error}") from None
    return found


def count(name: str, value: Any) -> int:
    """``value`` as an integer >= 1."""
    number = _whole(name, value)
    if number < 1:
        raise ArgumentError(f"{name} must be >= 1, got {number}")
    return number


def seconds(name: str, value: Any) -> float:
    """``value`` as a finite number of seconds > 0."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise ArgumentTypeError(f"{name} must be a number of seconds, got {value!r}")
    number = float(value)
    if not (math.isfinite(number) and number > 0):
        raise ArgumentError(f"{name} must be a finite number of seconds > 0, got {value!r}")
    return number


def spike_factor(name: str, value: Any) -> float | None:
    """``value`` as a factor > 1, or None."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise ArgumentTypeError(f"{name} must be a number (a factor > 1) or None, got {value!r}")
    factor = float(value)
    if not factor > 1.0:
        raise ArgumentError(f"{name} must be a factor > 1, got {value!r}")
    return factor


def step_number(step: Any) -> int:
    """``step`` as a non-negative int: an int or a 0-d integer tensor, nothing else.

    Raises:
        ArgumentTypeError: a float, a string, a bool, a float tensor or a tensor of more than
            one element (a float step would be recorded rounded down).
        ArgumentError: a negative step, or one past a signed 64-bit integer (the log's).
    """
    if isinstance(step, torch.Tensor):
        if step.numel() != 1 or step.dtype.is_floating_point or step.dtype.is_complex:
            raise ArgumentTypeError(
                f"step must be an integer or a one-element integer tensor, got {step!r}"
            )
        if step.dtype == torch.bool:
            raise ArgumentTypeError(f"step must be an integer, got {step!r}")
        number = int(step.item())
    else:
        number = _whole("step", step)
    if number < 0:
        raise ArgumentError(f"step must be >= 0, got {number}")
    if number >= 2**63:
        raise ArgumentError(f"step must be < 2**63 (the log keeps int64 steps), got {number}")
    return number


def logged_value(value: Any) -> float | None:
    """A norm the framework logged, as a float: a number or a one-element tensor (on any
    device; a DTensor's full value); None stays None. NaN and inf are kept (a framework may
    log them).

    Raises:
        ArgumentTypeError: a string, a bool, a tensor of more than one element.
        ArgumentError: a negative norm.
    """
    if value is None:
        return None
    if isinstance(value, torch.Tensor):
        if value.numel() != 1 or value.dtype == torch.bool or value.dtype.is_complex:
            raise ArgumentTypeError(
                f"logged_norm must be a number or a one-element tensor, got {value!r}"
            )
        # A DTensor's value is its full tensor's (a pending Partial sum is reduced: every
        # rank passes its own), never the local shard's.
        full = getattr(value, "full_tensor", None)
        number = float((full() if callable(full) else value).item())
    elif isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise ArgumentTypeError(f"logged_norm must be a number, got {value!r}")
    else:
        number = float(value)
    if number < 0:
        raise ArgumentError(f"logged_norm must be a norm (>= 0, NaN or inf), got {number!r}")
    return math.nan if math.isnan(number) else number + 0.0


def step_set(name: str, steps: Any) -> frozenset[int]:
    """``steps`` (a list of steps, each as :func:`step_number` takes it) as a frozenset."""
    if isinstance(steps, str | bytes) or not isinstance(steps, Iterable):
        raise ArgumentTypeError(f"{name} must be a list of integers, got {steps!r}")
    return frozenset(step_number(step) for step in steps)


def tolerance(name: str, value: Any) -> float:
    """``value`` as a finite number >= 0."""
    number = math.nan
    if isinstance(value, numbers.Real) and not isinstance(value, bool):
        number = float(value)
    if not 0 <= number < math.inf:
        raise ArgumentError(f"{name} must be a number >= 0, got {value!r}")
    return number

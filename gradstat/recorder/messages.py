"""The recorder's one-line warnings, through ``logging``."""

from __future__ import annotations

import logging

__all__ = ["warn"]

_log = logging.getLogger("gradstat.recorder")


def warn(message: str) -> None:
    """One warning line of the recorder, through ``logging`` (logger ``gradstat.recorder``):
    on stderr when the job configured no logging, else where the job's handlers send it."""
    _log.warning("gradstat recorder: %s", message)

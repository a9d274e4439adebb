"""Suite-wide setup and fixtures: the sample data, the CLI in a subprocess, a fresh kernel cache.

Nothing a test sees comes from an earlier run on this machine. The native kernel is compiled
into a cache that outlives a run (``~/.cache/gradstat``); the suite builds its own into a fresh
directory instead, so a library left by another checkout, another compiler or an interrupted
build never stands in for the one this source makes. Subprocesses (the CLI, torchrun, spawned
ranks) inherit the setting. Spawned ranks start from a fork server that has imported torch and,
where it is installed, Megatron (tests/_rank_preload.py); the CLI's runs, and torchrun's
launcher and workers, from one that has imported torch (tests/_forkserver.py).

Markers (registered in pyproject.toml): ``multiprocess`` for tests that spawn gloo ranks or run
torchrun, ``slow`` for tests that take more than a few seconds; ``-m "not slow"`` is the quick
run, and a plain ``pytest`` runs everything.
"""

from __future__ import annotations

import atexit
import logging
import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from gradstat.testing.spawn import PRELOAD
from tests._cli import SAMPLE_DATA, pin_fork_server_environment, run_gradstat

if "GRADSTAT_CACHE" not in os.environ:
    _CACHE = tempfile.mkdtemp(prefix="gradstat-test-cache-")
    os.environ["GRADSTAT_CACHE"] = _CACHE
    atexit.register(shutil.rmtree, _CACHE, ignore_errors=True)

# The CLI's fork server imports with the suite's environment, not one a test has changed.
pin_fork_server_environment()

# The gloo ranks of gradstat.testing.launch start with Megatron imported where it is installed
# (tests/_rank_preload.py), imported once, not 2.3 s of CPU in each rank of a Megatron launch.
PRELOAD.append("tests._rank_preload")


@pytest.fixture(scope="session")
def sample_data() -> Path:
    """The four 8-rank snapshots of sample_data/ (read-only: copy one before changing it)."""
    return SAMPLE_DATA


@pytest.fixture(name="run_gradstat", scope="session")
def _run_gradstat() -> Callable[..., Any]:
    """``run_gradstat(*args, nproc=None, ...)`` of tests/_cli.py: the CLI in a subprocess."""
    return run_gradstat


@pytest.fixture
def recorder_warnings(caplog: pytest.LogCaptureFixture) -> Callable[[], list[str]]:
    """The flight recorder's warning lines so far (it warns through ``logging``)."""
    caplog.set_level(logging.WARNING, logger="gradstat.recorder")

    def lines() -> list[str]:
        return [
            record.getMessage() for record in caplog.records if record.name == "gradstat.recorder"
        ]

    return lines

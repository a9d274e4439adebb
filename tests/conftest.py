"""Suite-wide setup: nothing a test sees comes from an earlier run on this machine.

The native kernel is compiled into a cache that outlives a run (``~/.cache/gradstat``); the
suite builds its own into a fresh directory instead, so a library left by another checkout,
another compiler or an interrupted build never stands in for the one this source makes.
Subprocesses (the CLI, torchrun, spawned ranks) inherit the setting.
"""

from __future__ import annotations

import atexit
import os
import shutil
import tempfile

if "GRADSTAT_CACHE" not in os.environ:
    _CACHE = tempfile.mkdtemp(prefix="gradstat-test-cache-")
    os.environ["GRADSTAT_CACHE"] = _CACHE
    atexit.register(shutil.rmtree, _CACHE, ignore_errors=True)

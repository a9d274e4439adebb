"""The CLI as a user runs it, in a subprocess; where the sample data is; the docs' recipes.

``run_gradstat("norm", SAMPLE, "--json")`` is ``python -m gradstat norm SAMPLE --json``;
``nproc=N`` runs it under ``torchrun --standalone --nproc-per-node N -m gradstat`` (as the README
says), ``script=True`` through the installed ``gradstat`` console script. Nothing is checked
here: the caller asserts on the exit status, stdout and stderr.
"""

from __future__ import annotations

import atexit
import json
import os
import re
import select
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, ClassVar

ROOT = Path(__file__).resolve().parents[1]
SAMPLE_DATA = ROOT / "sample_data"
README = ROOT / "README.md"
# Where users read: the README and the documents it points to.
DOCUMENTS = (README, *sorted((ROOT / "docs").glob("*.md")))
BIN = Path(sys.executable).parent


def run_gradstat(
    *args: str | Path,
    nproc: int | None = None,
    script: bool = False,
    launcher: Sequence[str] = (),
    cwd: Path | None = None,
    env: Mapping[str, str] | None = None,
    timeout: float = 300,
) -> subprocess.CompletedProcess[str]:
    """Run gradstat with ``args`` in a fresh process and return what it did.

    A plain ``python -m gradstat`` (no torchrun, script, directory or environment of its own)
    is forked from :class:`_ForkServer`, which has imported torch once; anything else, and every
    run when ``GRADSTAT_TEST_FORK=0``, starts a new interpreter.

    Args:
        args: the command line after ``gradstat``.
        nproc: run under torchrun with this many processes.
        script: the console script instead of ``python -m gradstat`` (not with ``nproc``).
        launcher: extra torchrun options, before ``-m gradstat``.
        cwd: the working directory (default: this one).
        env: variables added to this process's environment.
        timeout: seconds before the run is killed (``subprocess.TimeoutExpired``).
    """
    words = list(map(str, args))
    if nproc is None and not script and cwd is None and not env and _ForkServer.serves():
        return _ForkServer.run(words, timeout)
    if nproc is not None:
        start = [str(BIN / "torchrun"), "--standalone", f"--nproc-per-node={nproc}", *launcher]
        command = [*start, "-m", "gradstat"]
    elif script:
        command = [str(BIN / "gradstat")]
    else:
        command = [sys.executable, "-m", "gradstat"]
    return subprocess.run(
        [*command, *words],
        cwd=cwd,
        env={**os.environ, **(env or {})},
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )


class _ForkServer:
    """``python -m gradstat`` forked from one process that imported torch (tests/_forkserver.py).

    A fresh interpreter spends 1.1 of its 1.2 s here on ``import torch``, and the suite runs the
    CLI hundreds of times. The server is started at the first run and serves the session, with
    the environment :func:`pin_fork_server_environment` took (conftest.py pins it before any
    test can change it; else the one at the first run). The child of each run has the
    environment of this process at the time of the call. Where that differs from the server's
    in anything that is read at import (every variable but ``_VOLATILE``), the run is a new
    interpreter instead.
    """

    _process: subprocess.Popen[bytes] | None = None
    _requests: Any = None
    _replies: Any = None
    _pinned: ClassVar[dict[str, str] | None] = None  # the server's whole environment
    _environ: ClassVar[dict[str, str]] = {}  # what of it a run's must equal
    # pytest's own, and what libraries set in this process to the defaults a fresh process
    # would find anyway (torch's inductor names its cache once it is imported).
    _VOLATILE = ("PYTEST_CURRENT_TEST", "TORCHINDUCTOR_CACHE_DIR")

    @classmethod
    def _comparable(cls, environ: Mapping[str, str]) -> dict[str, str]:
        return {key: value for key, value in environ.items() if key not in cls._VOLATILE}

    @classmethod
    def serves(cls) -> bool:
        if os.environ.get("GRADSTAT_TEST_FORK", "1") == "0":
            return False
        if cls._process is None or cls._process.poll() is not None:
            cls._start()
        return cls._comparable(os.environ) == cls._environ

    @classmethod
    def _start(cls) -> None:
        if cls._pinned is None:
            cls._pinned = dict(os.environ)
        cls._environ = cls._comparable(cls._pinned)
        request_read, request_write = os.pipe()
        reply_read, reply_write = os.pipe()
        cls._process = subprocess.Popen(
            [
                sys.executable,
                str(ROOT / "tests" / "_forkserver.py"),
                str(request_read),
                str(reply_write),
            ],
            pass_fds=(request_read, reply_write),
            stdin=subprocess.DEVNULL,
            cwd=ROOT,
            env=cls._pinned,
        )
        os.close(request_read)
        os.close(reply_write)
        cls._requests = os.fdopen(request_write, "w")
        cls._replies = os.fdopen(reply_read, "r")
        atexit.register(cls._requests.close)
        atexit.register(cls._replies.close)

    @classmethod
    def _reply(cls, deadline: float) -> dict[str, Any]:
        ready, _, _ = select.select([cls._replies], [], [], max(0.0, deadline - time.monotonic()))
        line = cls._replies.readline() if ready else ""
        if not line:
            raise _NoReply
        reply: dict[str, Any] = json.loads(line)
        return reply

    @classmethod
    def run(cls, args: list[str], timeout: float) -> subprocess.CompletedProcess[str]:
        with tempfile.TemporaryDirectory() as scratch:
            out, err = Path(scratch, "stdout"), Path(scratch, "stderr")
            out.touch()
            err.touch()
            request = {
                "args": args,
                "environ": dict(os.environ),
                "stdout": str(out),
                "stderr": str(err),
            }
            cls._requests.write(json.dumps(request) + "\n")
            cls._requests.flush()
            deadline = time.monotonic() + timeout
            pid = cls._reply(deadline)["pid"]
            try:
                status = cls._reply(deadline)["status"]
            except _NoReply:
                os.kill(pid, signal.SIGKILL)
                cls._reply(time.monotonic() + 60)
                command = [sys.executable, "-m", "gradstat", *args]
                raise subprocess.TimeoutExpired(command, timeout) from None
            stdout, stderr = out.read_text(), err.read_text()  # as subprocess decodes
        return subprocess.CompletedProcess(
            [sys.executable, "-m", "gradstat", *args], status, stdout, stderr
        )


def pin_fork_server_environment() -> None:
    """Start the fork server, whenever it starts, with this process's environment as it is now."""
    _ForkServer._pinned = dict(os.environ)


class _NoReply(Exception):
    """The fork server did not answer in time (or is gone)."""


def recipe(name: str) -> str:
    """The code block of the README or docs/ that starts with ``# recipe: NAME``."""
    found = [
        code
        for document in DOCUMENTS
        for code, label in re.findall(
            r"```python\n(# recipe: (\w+)\n.*?)```", document.read_text(), re.S
        )
        if label == name
    ]
    assert len(found) == 1, f"README and docs/ have {len(found)} '# recipe: {name}' blocks"
    return found[0]


def norm_json(snapshot: Path) -> tuple[int, dict[str, Any] | None, str]:
    """``python -m gradstat norm SNAPSHOT --json``: its exit status, its JSON (None when it
    printed nothing) and its stderr."""
    result = run_gradstat("norm", snapshot, "--json")
    document = json.loads(result.stdout) if result.stdout else None
    return result.returncode, document, result.stderr

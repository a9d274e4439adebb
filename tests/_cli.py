"""The CLI as a user runs it, in a subprocess; where the sample data is; the docs' recipes.

``run_gradstat("norm", SAMPLE, "--json")`` is ``python -m gradstat norm SAMPLE --json``;
``nproc=N`` runs it under ``torchrun --standalone --nproc-per-node N -m gradstat`` (as the README
says), ``script=True`` through the installed ``gradstat`` console script. Nothing is checked
here: the caller asserts on the exit status, stdout and stderr.
"""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import re
import select
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, ClassVar

from tests._forkenv import SOCKET_VARIABLE, differing

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

    ``python -m gradstat``, the console script, or torchrun's launcher and each of its workers
    are forked from :class:`_ForkServer`, which has imported torch once, where the environment
    lets it (see :meth:`_ForkServer.serves`); else, and every run when
    ``GRADSTAT_TEST_FORK=0``, they are new interpreters.

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
    if nproc is not None and not script:
        worker = ("-m", "gradstat", *words)
        return run_torchrun(nproc, *worker, launcher=launcher, cwd=cwd, env=env, timeout=timeout)
    environ = {**os.environ, **(env or {})}
    if nproc is None and _ForkServer.serves(environ):
        target = {"script": str(BIN / "gradstat")} if script else {"module": "gradstat"}
        return _ForkServer.run(target, words, timeout, cwd, environ)
    if nproc is not None:
        start = ["--standalone", f"--nproc-per-node={nproc}", *launcher]
        command = [str(BIN / "torchrun"), *start, "-m", "gradstat"]
    elif script:
        command = [str(BIN / "gradstat")]
    else:
        command = [sys.executable, "-m", "gradstat"]
    return subprocess.run(
        [*command, *words],
        cwd=cwd,
        env=environ,
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )


def run_python(
    code: str, *args: str, env: Mapping[str, str] | None = None, timeout: float = 300
) -> subprocess.CompletedProcess[str]:
    """``python -c CODE ARGS`` with ``env`` added to this environment, forked from
    :class:`_ForkServer` where it serves; else a new interpreter. Not for code that tests what
    a fresh interpreter imports (the server has imported torch and gradstat's CLI)."""
    environ = {**os.environ, **(env or {})}
    if _ForkServer.serves(environ):
        return _ForkServer.run({"code": code}, list(args), timeout, None, environ)
    return subprocess.run(
        [sys.executable, "-c", code, *args],
        env=environ,
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )


def run_torchrun(
    nproc: int,
    *worker: str,
    launcher: Sequence[str] = (),
    cwd: Path | None = None,
    env: Mapping[str, str] | None = None,
    timeout: float = 300,
) -> subprocess.CompletedProcess[str]:
    """``torchrun --standalone --nproc-per-node NPROC [LAUNCHER] WORKER`` in ``cwd`` (default:
    this directory) with ``env`` added to this environment, ``WORKER`` being ``-m MODULE ARGS``
    or ``SCRIPT ARGS``.

    The launcher and each worker are forked from :class:`_ForkServer` where it serves (each
    worker through tests/_fork_client.py, which stands in for it); else all are new
    interpreters.
    """
    start = ["--standalone", f"--nproc-per-node={nproc}", *launcher]
    environ = {**os.environ, **(env or {})}
    if _ForkServer.serves(environ):
        client = str(ROOT / "tests" / "_fork_client.py")
        target = {"module": "torch.distributed.run"}
        return _ForkServer.run(target, [*start, client, *worker], timeout, cwd, environ)
    return subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", *start, *worker],
        cwd=cwd,
        env=environ,  # not the C library's: readline sets COLUMNS there
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )


# How the command line names each kind of request's target.
_FLAGS = {"module": ["-m"], "script": [], "code": ["-c"]}


class _ForkServer:
    """Processes forked from one process that imported torch (tests/_forkserver.py).

    A fresh interpreter spends 1.1 of its 1.2 s here on ``import torch`` (3 of 3.3 s on a slow
    day), and the suite starts hundreds: ``python -m gradstat`` and console-script runs, and
    torchrun's launcher and workers. The server is started at the first run and serves the
    session, with the environment :func:`pin_fork_server_environment` took (conftest.py pins it
    before any test can change it; else the one at the first run). The process of each run has
    the environment and working directory it is given. Where that environment differs from the
    server's in anything that is read at import (every variable but ``_forkenv.VOLATILE`` and a
    thread count, which the process applies: ``_forkenv.differing``), the run is a new
    interpreter instead.
    """

    _process: subprocess.Popen[bytes] | None = None
    _socket: ClassVar[str] = ""
    _pinned: ClassVar[dict[str, str] | None] = None  # the server's whole environment

    @classmethod
    def serves(cls, environ: Mapping[str, str] | None = None) -> bool:
        """Whether a run with ``environ`` (default: this process's) can be forked."""
        environ = os.environ if environ is None else environ
        if environ.get("GRADSTAT_TEST_FORK", "1") == "0":
            return False
        if cls._process is None or cls._process.poll() is not None:
            cls._start()
        assert cls._pinned is not None
        return not differing(cls._pinned, environ, launched=False)

    @classmethod
    def _start(cls) -> None:
        if cls._pinned is None:
            cls._pinned = dict(os.environ)
        folder = tempfile.mkdtemp(prefix="gradstat-fork-")
        atexit.register(shutil.rmtree, folder, ignore_errors=True)
        cls._socket = str(Path(folder) / "socket")
        cls._process = subprocess.Popen(
            [sys.executable, str(ROOT / "tests" / "_forkserver.py"), cls._socket],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            cwd=ROOT,
            env=cls._pinned,
        )
        atexit.register(cls._stop, cls._process)
        deadline = time.monotonic() + 300
        while not os.path.exists(cls._socket):  # it listens once its imports are done
            if cls._process.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError("the CLI fork server (tests/_forkserver.py) did not start")
            time.sleep(0.02)

    @staticmethod
    def _stop(process: subprocess.Popen[bytes]) -> None:
        process.kill()
        process.wait()

    @classmethod
    def run(
        cls,
        target: dict[str, str],
        args: list[str],
        timeout: float,
        cwd: Path | None,
        environ: Mapping[str, str],
    ) -> subprocess.CompletedProcess[str]:
        """``python -m MODULE ARGS`` (``target`` {"module": MODULE}), ``python SCRIPT ARGS``
        ({"script": SCRIPT}) or ``python -c CODE ARGS`` ({"code": CODE}) forked from the server
        in ``cwd`` with ``environ``, torchrun's workers too."""
        ((kind, value),) = target.items()
        shown = [sys.executable, *_FLAGS[kind], value, *args]
        request = {
            **target,
            "args": args,
            "environ": {**environ, SOCKET_VARIABLE: cls._socket},
            "cwd": str(cwd or os.getcwd()),
            "unbuffered": False,
            "group": True,
        }
        with tempfile.TemporaryDirectory() as scratch, socket.socket(socket.AF_UNIX) as server:
            out, err = Path(scratch, "stdout"), Path(scratch, "stderr")
            server.connect(cls._socket)
            files = [open(os.devnull, "rb"), out.open("wb"), err.open("wb")]  # noqa: SIM115
            try:
                line = (json.dumps(request) + "\n").encode()
                socket.send_fds(server, [line], [file.fileno() for file in files])
            finally:
                for file in files:
                    file.close()
            replies, deadline = _Replies(server), time.monotonic() + timeout
            started = replies.next(deadline)
            if "refused" in started:  # serves() found the environment the server's
                raise RuntimeError(f"the CLI fork server refused {shown}: {started['refused']}")
            pid = started["pid"]
            try:
                status = replies.next(deadline)["status"]
            except _NoReply:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(pid, signal.SIGKILL)  # the launcher's workers with it
                raise subprocess.TimeoutExpired(shown, timeout) from None
            stdout_text, stderr_text = out.read_text(), err.read_text()  # as subprocess decodes
        return subprocess.CompletedProcess(shown, status, stdout_text, stderr_text)


class _Replies:
    """The server's reply lines on one connection, each awaited until a deadline."""

    def __init__(self, server: socket.socket) -> None:
        self._server, self._pending = server, b""

    def next(self, deadline: float) -> dict[str, Any]:
        while b"\n" not in self._pending:
            timeout = max(0.0, deadline - time.monotonic())
            ready, _, _ = select.select([self._server], [], [], timeout)
            more = self._server.recv(1 << 16) if ready else b""
            if not more:
                raise _NoReply
            self._pending += more
        line, self._pending = self._pending.split(b"\n", 1)
        reply: dict[str, Any] = json.loads(line)
        return reply


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

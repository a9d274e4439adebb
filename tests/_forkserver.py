"""Python processes without paying ``import torch`` each time: tests/_cli.py's fork server.

Run as ``python tests/_forkserver.py SOCKET``. It imports what every gradstat command and the
torchrun launcher import (torch is nearly all of a process's start on a small machine: 1.1 of
1.2 s, and 3 of 3.3 s on a slow day), then listens on the Unix socket ``SOCKET``. Each
connection asks for one process: ``python -m MODULE ARGS`` (``gradstat``, or
``torch.distributed.run``: torchrun's launcher), ``python SCRIPT ARGS`` or ``python -c CODE
ARGS``, with the caller's stdin, stdout and stderr (passed over the socket), environment and
working directory. The server forks a handler for it, which forks the process and reports on
it, so that a launcher and its workers run at once. From the fork on, the process is what the
fresh interpreter would be: its own descriptors, ``sys.argv``, ``sys.path[0]``, environment and
working directory, the module, script or code run as ``__main__`` at the top level, so that an
uncaught exception, ``SystemExit``, atexit handlers and the interpreter's shutdown are the ones
a fresh process has. (A DataLoader's workers are forked from a process that has imported torch
in the same way.)

A request is one JSON line, ``{"module" | "script" | "code", "args", "environ", "cwd",
"unbuffered"}``, sent with the three descriptors. The handler answers ``{"pid"}`` once the
process runs (or ``{"refused"}``, see below) and ``{"status"}`` (the exit code as
``subprocess`` gives it: minus the signal that killed it) when it is gone; a caller that hangs
up before then has the process killed. torchrun's workers start through
tests/_fork_client.py, which forwards the launcher's signals to the process it stands for.

The environment is read at import in places (torch reads ``OMP_NUM_THREADS`` as it loads), so
a request whose environment differs from the server's is refused, except for what torchrun sets
for its workers and a thread count: that is set as torch would have set it from the variable.
"""

from __future__ import annotations

import builtins
import gc
import importlib
import io
import json
import os
import runpy
import select
import signal
import socket
import sys
import types
from typing import Any

# What every command and torchrun's launcher import; about all of their start.
for _module in (
    "torch",
    "torch.distributed",
    "torch.distributed.launcher.api",
    "torch.distributed.elastic.multiprocessing.errors",
    "safetensors.torch",
    "gradstat.cli.app",
    # What the tests' torchrun workers import besides: DTensor and its meshes, FSDP2,
    # distributed checkpoints, gradstat's snapshots and recorder (1 s a process on a small
    # machine, a worker of DTensors' nearly all of its start).
    "torch.distributed.tensor",
    "torch.distributed.device_mesh",
    "torch.distributed.fsdp",
    "torch.distributed.checkpoint",
    "gradstat.snapshot",
    "gradstat.recorder",
):
    importlib.import_module(_module)

import torch  # noqa: E402 (imported above, named here)
from _forkenv import differing, threads  # noqa: E402 (tests/, this script's)

# What was imported is left out of every collection, the forked processes' too: a collection
# (one at their exit) touched each object, and so copied the page it lies on from the server.
gc.freeze()


def _message(connection: socket.socket, document: dict[str, Any]) -> None:
    connection.sendall((json.dumps(document) + "\n").encode())


def _request(connection: socket.socket) -> tuple[dict[str, Any], list[int]]:
    """The request line and the three descriptors sent with it."""
    data, descriptors, _, _ = socket.recv_fds(connection, 1 << 20, 3)
    while not data.endswith(b"\n"):
        more = connection.recv(1 << 20)
        if not more:
            raise EOFError("the caller hung up mid-request")
        data += more
    return json.loads(data), descriptors


def _handle(connection: socket.socket, server_environ: dict[str, str]) -> dict[str, Any] | None:
    """Run one request: return it (in the forked process), or None once the process is gone."""
    request, descriptors = _request(connection)
    launched = "RANK" in request["environ"] and "TORCHELASTIC_RUN_ID" in request["environ"]
    others = differing(server_environ, request["environ"], launched)
    if others:
        _message(connection, {"refused": f"the environment differs in {', '.join(others)}"})
        return None
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    pid = os.fork()
    if pid == 0:
        connection.close()
        if request.get("group"):  # a launcher: its workers are killed with it on a timeout
            os.setpgid(0, 0)
        for target, descriptor in enumerate(descriptors):
            os.dup2(descriptor, target)
            os.close(descriptor)
        return request
    for descriptor in descriptors:
        os.close(descriptor)
    _message(connection, {"pid": pid})
    watch = os.pidfd_open(pid)
    while True:
        ready, _, _ = select.select([watch, connection], [], [])
        if watch in ready:
            break
        if not connection.recv(1 << 16):  # the caller is gone: so must the process be
            os.kill(pid, signal.SIGKILL)
            break
    os.close(watch)
    _, wait_status = os.waitpid(pid, 0)
    _message(connection, {"status": os.waitstatus_to_exitcode(wait_status)})
    return None


def _serve(path: str) -> dict[str, Any]:
    """Answer connections until the parent goes; return (in a forked process) its request."""
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path)
    listener.listen(64)
    server_environ = dict(os.environ)
    signal.signal(signal.SIGCHLD, signal.SIG_IGN)  # handlers are reaped as they end
    parent = os.getppid()
    while True:
        ready, _, _ = select.select([listener], [], [], 1.0)
        if os.getppid() != parent:  # pytest is gone
            os._exit(0)
        if not ready:
            continue
        connection, _ = listener.accept()
        if os.fork() != 0:
            connection.close()
            continue
        listener.close()
        try:
            request = _handle(connection, server_environ)
        except Exception:  # a caller that hung up: nothing to answer
            os._exit(1)
        if request is None:
            os._exit(0)
        return request


def _become(request: dict[str, Any]) -> None:
    """Turn this forked process into ``python [-u] (-m MODULE | SCRIPT) ARGS``."""
    os.environ.clear()
    os.environ.update(request["environ"])
    os.chdir(request["cwd"])
    asked = threads(request["environ"])
    if asked is not None and asked != torch.get_num_threads():
        torch.set_num_threads(asked)  # as torch does from the variable as it loads
    if request["unbuffered"]:  # python -u, as torchrun starts its workers
        sys.stdout = io.TextIOWrapper(io.FileIO(1, "w", closefd=False), write_through=True)
        sys.stderr = io.TextIOWrapper(
            io.FileIO(2, "w", closefd=False), write_through=True, errors="backslashreplace"
        )
    if "module" in request:
        sys.argv = ["-m", *request["args"]]
        sys.path[0] = os.getcwd()
        runpy.run_module(request["module"], run_name="__main__", alter_sys=True)
    elif "code" in request:  # python -c CODE: run in a __main__ of its own, as there
        sys.argv = ["-c", *request["args"]]
        sys.path[0] = ""
        main = types.ModuleType("__main__")
        main.__builtins__ = builtins  # type: ignore[attr-defined]
        sys.modules["__main__"] = main
        exec(compile(request["code"], "<string>", "exec", dont_inherit=True), vars(main))
    else:
        script = request["script"]
        sys.argv = [script, *request["args"]]
        sys.path[0] = os.path.dirname(os.path.abspath(script))
        runpy.run_path(script, run_name="__main__")


_become(_serve(sys.argv[1]))

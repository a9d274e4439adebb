"""``python -m gradstat`` without paying ``import torch`` each time: tests/_cli.py's fork server.

Run as ``python tests/_forkserver.py REQUEST_FD REPLY_FD``. It imports what every gradstat
command imports (torch is nearly all of a command's start on a small machine: 1.1 of 1.2 s),
then for each request forks, and the child becomes ``python -m gradstat ARGS`` from there on:
its own stdout, stderr and stdin (/dev/null), ``sys.argv``, ``sys.path[0]`` and environment as
the fresh interpreter would have them, the module run as ``__main__`` at the top level, so an
uncaught exception, ``SystemExit``, atexit handlers and the interpreter's shutdown are the ones a
fresh process has. A DataLoader's workers are forked from a process that has imported torch in
the same way.

A request is one JSON line ``{"args", "environ", "stdout", "stderr"}`` (the two are file paths);
the server answers ``{"pid"}`` once the child runs and ``{"status"}`` (the exit code as
``subprocess`` gives it: minus the signal that killed it) when it is gone.
"""

from __future__ import annotations

import importlib
import json
import os
import runpy
import sys
from typing import Any

# What every command imports; about all of its start.
for _module in ("torch", "torch.distributed", "safetensors.torch", "gradstat.cli.app"):
    importlib.import_module(_module)


def _serve(requests: int, replies: int) -> dict[str, Any]:
    """Answer requests until the pipe closes; return (in a child only) the request to run."""
    incoming = os.fdopen(requests, "r")
    for line in incoming:
        request = json.loads(line)
        pid = os.fork()
        if pid == 0:
            incoming.close()
            os.close(replies)
            return request
        os.write(replies, (json.dumps({"pid": pid}) + "\n").encode())
        _, wait_status = os.waitpid(pid, 0)
        status = os.waitstatus_to_exitcode(wait_status)
        os.write(replies, (json.dumps({"status": status}) + "\n").encode())
    os._exit(0)


_request = _serve(int(sys.argv[1]), int(sys.argv[2]))
# The child, from here on python -m gradstat.
for _fd, _target in ((0, os.devnull), (1, _request["stdout"]), (2, _request["stderr"])):
    _opened = os.open(str(_target), os.O_RDONLY if _fd == 0 else os.O_WRONLY | os.O_TRUNC)
    os.dup2(_opened, _fd)
    os.close(_opened)
os.environ.clear()
os.environ.update(_request["environ"])
sys.argv = ["-m", *_request["args"]]
sys.path[0] = os.getcwd()
del _fd, _target, _opened, _request, _module
runpy.run_module("gradstat", run_name="__main__", alter_sys=True)

"""A torchrun worker forked from tests/_forkserver.py instead of started afresh.

torchrun starts ``python -u tests/_fork_client.py (-m MODULE | SCRIPT) ARGS`` for each worker
(see ``run_gradstat(nproc=...)`` in tests/_cli.py). This process imports nothing heavy: it asks
the fork server (its socket in ``GRADSTAT_TEST_FORK_SOCKET``) for ``python -u -m MODULE ARGS``
with its own descriptors, environment and working directory, forwards the signals the launcher
sends it, and ends as that process ends, with its exit code or by its signal. Where the server
refuses (an environment it cannot stand for), it becomes a fresh interpreter of the same
command instead.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import sys

from _forkenv import SOCKET_VARIABLE  # tests/, this script's

# What torchrun's agent sends a worker to stop it (SIGKILL and SIGSTOP cannot be caught: the
# server kills the process when this one is gone).
FORWARDED = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1)


def main() -> None:
    words = sys.argv[1:]
    if words[0] == "-m":
        target, args = {"module": words[1]}, words[2:]
    else:
        target, args = {"script": words[0]}, words[1:]
    request = {
        **target,
        "args": args,
        "environ": dict(os.environ),
        "cwd": os.getcwd(),
        "unbuffered": True,
    }
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    server.connect(os.environ[SOCKET_VARIABLE])
    socket.send_fds(server, [(json.dumps(request) + "\n").encode()], [0, 1, 2])
    replies = server.makefile("r")
    reply = json.loads(replies.readline())
    if "refused" in reply:
        server.close()
        os.execv(sys.executable, [sys.executable, "-u", *words])
    pid = reply["pid"]
    for number in FORWARDED:
        signal.signal(number, lambda received, _: os.kill(pid, received))
    line = replies.readline()  # a forwarded signal's handler runs, and the read goes on
    if not line:
        sys.exit(1)  # the server is gone
    status = json.loads(line)["status"]
    if status < 0:
        signal.signal(-status, signal.SIG_DFL)
        os.kill(os.getpid(), -status)
    sys.exit(status)


main()

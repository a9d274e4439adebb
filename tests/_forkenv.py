"""What the fork server (tests/_forkserver.py), its pytest side (tests/_cli.py) and torchrun's
stand-in workers (tests/_fork_client.py) agree on of a run's environment.

A run is forked only where its environment equals the server's in everything read at import:
every variable but those below. Imported by the server and the client as ``_forkenv`` (run as
scripts from tests/), by pytest as ``tests._forkenv``; nothing heavy, the client stays light.
"""

from __future__ import annotations

from collections.abc import Mapping

# Where the server listens; torchrun's workers inherit it from the launcher's environment.
SOCKET_VARIABLE = "GRADSTAT_TEST_FORK_SOCKET"

# pytest's own, what libraries set in a process to the defaults a fresh one would find anyway,
# and the server's socket.
VOLATILE = frozenset(("PYTEST_CURRENT_TEST", "TORCHINDUCTOR_CACHE_DIR", SOCKET_VARIABLE))

# What torchrun sets in its workers' environment, none of it read at import but the thread
# count (the server applies it in the process, see differing). "_" is the shell's, which a
# launcher's children may differ in.
LAUNCHER_VARIABLES = frozenset(
    (
        "GROUP_RANK",
        "GROUP_WORLD_SIZE",
        "LOCAL_RANK",
        "LOCAL_WORLD_SIZE",
        "MASTER_ADDR",
        "MASTER_PORT",
        "OMP_NUM_THREADS",
        "RANK",
        "ROLE_NAME",
        "ROLE_RANK",
        "ROLE_WORLD_SIZE",
        "TORCHELASTIC_ERROR_FILE",
        "TORCHELASTIC_MAX_RESTARTS",
        "TORCHELASTIC_RESTART_COUNT",
        "TORCHELASTIC_RUN_ID",
        "TORCHELASTIC_SIGNALS_TO_HANDLE",
        "TORCHELASTIC_USE_AGENT_STORE",
        "TORCH_NCCL_ASYNC_ERROR_HANDLING",
        "WORLD_SIZE",
        "_",
    )
)


def comparable(environ: Mapping[str, str], also: frozenset[str] = frozenset()) -> dict[str, str]:
    """``environ`` without what a run may differ in from the server's (``also``: a launcher's
    variables, for its workers)."""
    ignored = VOLATILE | also
    return {key: value for key, value in environ.items() if key not in ignored}


def threads(environ: Mapping[str, str]) -> int | None:
    """The thread count ``OMP_NUM_THREADS`` asks torch for, None where it asks for none."""
    value = environ.get("OMP_NUM_THREADS", "")
    return int(value) if value.isdigit() and int(value) > 0 else None


def differing(server: Mapping[str, str], run: Mapping[str, str], launched: bool) -> list[str]:
    """The variables read at import that a run's environment has other than the server's.

    A thread count the run asks for is not among them: the server's process applies it as
    torch would have as it loaded (the only such variable torchrun sets in its workers, too)."""
    also = LAUNCHER_VARIABLES if launched else frozenset()
    if threads(run) is not None:
        also |= {"OMP_NUM_THREADS"}
    mine, theirs = comparable(server, also), comparable(run, also)
    return sorted(key for key in mine.keys() | theirs.keys() if mine.get(key) != theirs.get(key))

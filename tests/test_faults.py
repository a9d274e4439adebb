"""Faults: a clip killed while writing, an output that refuses writes, lost processes."""

from __future__ import annotations

import os
import select
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path

import pytest
import torch

from gradstat.snapshot import Snapshot, save_rank
from tests._cli import SAMPLE_DATA, run_gradstat
from tests._params import param_with

SAMPLE = SAMPLE_DATA / "gtp2-pp2-dp2-ep2"


@pytest.fixture(scope="module")
def large_snapshot(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """4 rank files of 4 MiB: each tensor's bytes are one write of at least 1 MiB."""
    directory = tmp_path_factory.mktemp("large")
    gen = torch.Generator().manual_seed(0)
    for rank in range(4):
        grad = torch.randn(1 << 20, generator=gen)
        param = param_with(grad, tensor_model_parallel=True)
        save_rank(directory, [("w", param)], rank=rank, world_size=4, coords={"tp": [rank, 4]})
    return directory


# The clip runs under this wrapper, which stalls it halfway through the tensor bytes of its
# second rank file and says so on a pipe: the test kills it there, at a known point, instead of
# racing a poll against the writer.
STALLED_CLIP = """
import os, sys, time
import gradstat.snapshot.reader as reader
from gradstat.cli import main

signal_fd, files = int(sys.argv.pop(1)), []
real_write_container = reader.write_container

class Stalling:
    def __init__(self, file):
        self.file = file
    def write(self, data):
        view = memoryview(data).cast("B")
        if len(files) == 2 and len(view) >= 1 << 20:
            self.file.write(view[: len(view) // 2])
            self.file.flush()
            os.write(signal_fd, b"stalled")
            time.sleep(3600)
        return self.file.write(data)
    def __getattr__(self, name):
        return getattr(self.file, name)

def write_container(file, metadata, tensors):
    files.append(file)
    real_write_container(Stalling(file), metadata, tensors)

reader.write_container = write_container
sys.argv[0] = "gradstat"
main()
"""


def test_clip_killed_while_writing_leaves_nothing_that_looks_complete(
    large_snapshot: Path, tmp_path: Path
) -> None:
    out = tmp_path / "clipped"
    read_end, write_end = os.pipe()
    args = ["clip", str(large_snapshot), "--max-norm", "1", "--out", str(out)]
    process = subprocess.Popen(
        [sys.executable, "-c", STALLED_CLIP, str(write_end), *args], pass_fds=(write_end,)
    )
    os.close(write_end)
    try:
        # Waits for the clip to stall mid-file (or to exit: then the pipe says b"").
        ready, _, _ = select.select([read_end], [], [], 600)  # a guard against a hang only
        said = os.read(read_end, 16) if ready else b"(nothing within 600 s)"
        assert said == b"stalled", f"the clip never reached its second file ({said!r})"
        process.send_signal(signal.SIGKILL)
        assert process.wait(timeout=120) == -signal.SIGKILL
    finally:
        os.close(read_end)
        process.kill()
        process.wait(timeout=120)
    assert not out.exists()
    (staging,) = tmp_path.iterdir()
    assert staging.name.startswith(".clipped.partial-")
    staged = {path.name: path.stat().st_size for path in staging.iterdir()}
    whole = (large_snapshot / "rank-00000.safetensors").stat().st_size
    assert staged.get("rank-00000.safetensors") == whole, staged
    assert 0 < staged.get("rank-00001.safetensors", 0) < whole, staged  # killed mid-file
    with pytest.raises(Exception, match="no such directory"):
        Snapshot.open(out)


@pytest.mark.skipif(not os.path.isdir("/sys/kernel"), reason="needs Linux's read-only /sys")
def test_clip_into_a_directory_that_refuses_writes() -> None:
    out = "/sys/kernel/gradstat-out"
    result = run_gradstat("clip", SAMPLE, "--max-norm", "1", "--out", out, timeout=120)
    assert result.returncode == 2
    assert result.stderr.strip().startswith("gradstat: error: /sys/kernel/gradstat-out: cannot")
    assert len(result.stderr.strip().splitlines()) == 1


def _free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


# What process 0 says when process 1 of 2 stops moving under --timeout 3.
LOST_PROCESS_1 = (
    "gradstat: error: process 0 of 2: process 1 made no progress for 3 s (killed or hung?); "
    "stopping"
)


@contextmanager
def _as_launched(commands: list[list[str]]) -> Iterator[list[subprocess.Popen[str]]]:
    """One process per command, numbered as a launcher numbers them (RANK, LOCAL_RANK,
    WORLD_SIZE and a free MASTER_PORT on this host), stdout and stderr captured; all killed
    when the block is left."""
    port = _free_port()
    env = {
        **os.environ,
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(port),
        "WORLD_SIZE": str(len(commands)),
    }
    processes = [
        subprocess.Popen(
            command,
            env={**env, "RANK": str(rank), "LOCAL_RANK": str(rank)},
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for rank, command in enumerate(commands)
    ]
    try:
        yield processes
    finally:
        for process in processes:
            process.kill()
            process.communicate()


# Process 1 runs under this wrapper, which stops it (SIGSTOP, by its own hand) as it maps its
# first rank file: it has joined the group and started, and cannot have finished.
FROZEN_ON_FIRST_FILE = """
import os, signal, sys
from gradstat.snapshot.reader import RankFile
from gradstat.cli import main

real_params = RankFile.params

def params(self):
    os.kill(os.getpid(), signal.SIGSTOP)
    return real_params(self)

RankFile.params = params
sys.argv[0] = "gradstat"
main()
"""


@pytest.mark.skipif(not hasattr(signal, "SIGSTOP"), reason="needs POSIX signals")
@pytest.mark.multiprocess
@pytest.mark.slow
def test_a_frozen_process_is_named_by_the_others(large_snapshot: Path) -> None:
    """Two processes as a launcher starts them; process 1 freezes while reading its files."""
    args = ["norm", str(large_snapshot), "--timeout", "3"]
    commands = [
        [sys.executable, "-m", "gradstat", *args],
        [sys.executable, "-c", FROZEN_ON_FIRST_FILE, *args],
    ]
    with _as_launched(commands) as processes:
        _, stderr = processes[0].communicate(timeout=300)
        assert processes[0].returncode == 2, stderr
        assert stderr.strip().splitlines()[-1] == LOST_PROCESS_1, stderr


# Each process runs this; process 1 stops (SIGSTOP) or dies (SIGKILL) by its own hand at a
# chosen point, so that the test never races the process it freezes. The processes import torch
# first and start together on a signal (a file), so that the short timeout only measures faults.
FAULTY = """
import os, signal, sys, time, warnings
from pathlib import Path
warnings.filterwarnings("ignore", message="Failed to initialize NumPy")
from gradstat.distributed import runner
from gradstat.errors import GradstatError

where, how, folder = sys.argv[1], sys.argv[2], Path(sys.argv[3])
rank = int(os.environ["RANK"])
(folder / f"ready-{rank}").touch()
while not (folder / "go").exists():
    time.sleep(0.01)

def fault():
    os.kill(os.getpid(), getattr(signal, how))

gather, gathers = runner._all_gather_bytes, []

def faulty_gather(*args):
    gathers.append(args)
    # The agreement, round 0, round 1: the fault strikes in round 1's, once this process's work
    # is done and said to be done.
    if rank == 1 and where == "before the gather" and len(gathers) == 3:
        fault()
    return gather(*args)

runner._all_gather_bytes = faulty_gather
try:
    with runner.process_group(3.0) as processes:
        for round_ in range(2):
            def work(job):
                if rank == 1 and where == "while working" and round_ == 1:
                    fault()
                return job
            runner.gather_jobs(processes, list(range(4)), work)
except GradstatError as error:
    print(f"gradstat: error: {error}", file=sys.stderr)
    sys.exit(2)
print("finished")
"""


# Each fault as ``(where, how)``: the three run at once, as their time is mostly the timeout.
_FAULTS = (
    ("while working", "SIGSTOP"),
    ("before the gather", "SIGSTOP"),
    ("before the gather", "SIGKILL"),
)


@pytest.mark.skipif(not hasattr(signal, "SIGSTOP"), reason="needs POSIX signals")
@pytest.mark.multiprocess
@pytest.mark.slow
def test_a_process_lost_at_any_point_is_named(tmp_path: Path) -> None:
    """Issue 14 item 11: a process frozen after its work was done used to fail the others'
    gather, which said "another process failed or was lost"; and the second exchange of a run
    (compare and audit make several) found the first one's marks and waited for no one."""
    with ExitStack() as stack:
        launched = []
        for index, (where, how) in enumerate(_FAULTS):
            folder = tmp_path / str(index)
            folder.mkdir()
            script = folder / "faulty.py"
            script.write_text(FAULTY)
            command = [sys.executable, str(script), where, how, str(folder)]
            launched.append((folder, stack.enter_context(_as_launched([command, command]))))
        deadline = time.monotonic() + 120
        for folder, processes in launched:
            while not all((folder / f"ready-{rank}").exists() for rank in range(2)):
                assert time.monotonic() < deadline and processes[0].poll() is None, "never ready"
                time.sleep(0.05)
        for folder, _ in launched:
            (folder / "go").touch()
        for fault, (_, processes) in zip(_FAULTS, launched, strict=True):
            stdout, stderr = processes[0].communicate(timeout=120)
            assert processes[0].returncode == 2, (fault, stderr)
            assert "finished" not in stdout, fault
            assert "another process failed or was lost" not in stderr, fault
            assert stderr.strip().splitlines()[-1] == LOST_PROCESS_1, (fault, stderr)

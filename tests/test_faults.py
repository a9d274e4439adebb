"""Faults: a clip killed while writing, an output that refuses writes, lost processes."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from gradstat.snapshot import Snapshot, save_rank
from tests._params import param_with

SAMPLE = Path(__file__).resolve().parent.parent / "sample_data" / "gtp2-pp2-dp2-ep2"


@pytest.fixture(scope="module")
def large_snapshot(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """4 rank files of 32 MiB, so that writing a clipped copy takes a while."""
    directory = tmp_path_factory.mktemp("large")
    gen = torch.Generator().manual_seed(0)
    for rank in range(4):
        grad = torch.randn(8 << 20, generator=gen)
        param = param_with(grad, tensor_model_parallel=True)
        save_rank(directory, [("w", param)], rank=rank, world_size=4, coords={"tp": [rank, 4]})
    return directory


def test_clip_killed_while_writing_leaves_nothing_that_looks_complete(
    large_snapshot: Path, tmp_path: Path
) -> None:
    out = tmp_path / "clipped"
    command = [sys.executable, "-m", "gradstat", "clip", str(large_snapshot)]
    process = subprocess.Popen([*command, "--max-norm", "1", "--out", str(out)])
    deadline = time.monotonic() + 120
    staged = []
    while time.monotonic() < deadline and process.poll() is None:
        staged = [path for path in tmp_path.glob(".clipped.partial-*/*") if path.is_file()]
        if staged:
            break
        time.sleep(0.005)
    process.send_signal(signal.SIGKILL)
    process.wait(timeout=60)
    assert staged, "the clip finished before any file was staged; make the snapshot larger"
    if out.exists():  # it finished between the check and the kill: then it is whole
        assert Snapshot.open(out).world_size == 4
    else:
        leftovers = [path.name for path in tmp_path.iterdir()]
        assert all(name.startswith(".clipped.partial-") for name in leftovers), leftovers
        with pytest.raises(Exception, match="no such directory"):
            Snapshot.open(out)


@pytest.mark.skipif(not os.path.isdir("/sys/kernel"), reason="needs Linux's read-only /sys")
def test_clip_into_a_directory_that_refuses_writes() -> None:
    out = "/sys/kernel/gradstat-out"
    result = subprocess.run(
        [sys.executable, "-m", "gradstat", "clip", str(SAMPLE), "--max-norm", "1", "--out", out],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert result.returncode == 2
    assert result.stderr.strip().startswith("gradstat: error: /sys/kernel/gradstat-out: cannot")
    assert len(result.stderr.strip().splitlines()) == 1


def _free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _maps(pid: int, needle: str) -> bool:
    try:
        return needle in Path(f"/proc/{pid}/maps").read_text()
    except OSError:
        return False


@pytest.mark.skipif(not os.path.isdir("/proc/self"), reason="needs Linux's /proc")
def test_a_frozen_process_is_named_by_the_others(large_snapshot: Path) -> None:
    """Two processes as a launcher starts them; process 1 freezes while reading its files."""
    port = _free_port()
    env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "WORLD_SIZE": "2"}
    command = [sys.executable, "-m", "gradstat", "norm", str(large_snapshot), "--timeout", "3"]
    processes = [
        subprocess.Popen(
            command,
            env={**env, "RANK": str(rank), "LOCAL_RANK": str(rank)},
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for rank in range(2)
    ]
    try:
        # Process 1 reads rank files 1 and 3; freeze it once the first is mapped (it has joined
        # the group and started, and cannot have finished).
        deadline = time.monotonic() + 120
        while not _maps(processes[1].pid, str(large_snapshot)) and time.monotonic() < deadline:
            assert processes[1].poll() is None, processes[1].communicate()
            time.sleep(0.001)
        processes[1].send_signal(signal.SIGSTOP)
        _, stderr = processes[0].communicate(timeout=120)
        assert processes[0].returncode == 2, stderr
        assert stderr.strip().splitlines()[-1] == (
            "gradstat: error: process 0 of 2: process 1 made no progress for 3 s "
            "(killed or hung?); stopping"
        ), stderr
    finally:
        for process in processes:
            process.kill()
            process.communicate()

"""A rank file truncated while `norm` or `clip` reads it: one line naming the file, exit 2.

The truncation lands where a real one is hardest to see: after the reader validated the file
and after the lookup checked the tensor's file size, before the tensor's bytes are read (a job
rewriting its dump while someone reads it). Mapped pages past the new end then fault with
SIGBUS, which used to kill the process with no message. Each run is a fresh process (the CLI
as a user runs it, with the truncation patched in; forked from tests/_cli.py's server), so
that a crash cannot take pytest down.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest
import torch

from gradstat.snapshot import save_rank
from tests._cli import run_python

# Runs the CLI on argv[8:] with the rank file argv[1] truncated to half its size (argv[5]
# "half") or by its last 100 bytes ("tail") in the argv[2]-th pass over it (the argv[2]-th
# ``with`` block of its tensors, counted from 0): argv[3] "after", right after that pass's
# argv[4]-th tensor lookup returned (its size check passed; a mapped view's pages are touched
# later, by the reduction or the copy); "before-read", as that pass first reads a tensor's bytes
# (where tensors are read, not mapped); "count", not at all. GRADSTAT_NATIVE is argv[6]. Writes
# each pass's lookups to argv[7].
_TRUNCATING_CLI = """
import atexit, json, os, sys
from gradstat.snapshot import container

path, chosen, how, at, tail, native, report = sys.argv[1:8]
chosen, at = int(chosen), int(at)
from gradstat.core.native import native_library
assert native_library.cache_info().currsize == 0, "the kernel was wanted before GRADSTAT_NATIVE"
os.environ["GRADSTAT_NATIVE"] = native  # read when the kernel is first wanted
lookups = []
atexit.register(lambda: open(report, "w").write(json.dumps(lookups)))
tensors = container.MappedTensors

def cut():
    size = os.path.getsize(path)
    os.truncate(path, size - 100 if tail == "tail" else size // 2)

def enter(original):
    def entered(self):
        lookups.append(0)
        return original(self)
    return entered

def look_up(original):
    def looked_up(self, name):
        found = original(self, name)
        lookups[-1] += 1
        if how == "after" and len(lookups) - 1 == chosen and lookups[-1] == at:
            cut()
        return found
    return looked_up

def read(original):
    def reading(self, *args):
        if how == "before-read" and len(lookups) - 1 == chosen and lookups[-1] == 0:
            cut()
        return original(self, *args)
    return reading

tensors.__enter__ = enter(tensors.__enter__)
tensors.__getitem__ = look_up(tensors.__getitem__)
if hasattr(tensors, "_read"):
    tensors._read = read(tensors._read)
sys.argv = ["gradstat", *sys.argv[8:]]
from gradstat.cli.app import main
main()
"""


def _run(
    folder: Path,
    arguments: list[str],
    native: str,
    chosen: int,
    how: str,
    at: int = 0,
    tail: bool = False,
) -> tuple[subprocess.CompletedProcess[str], list[int]]:
    """The CLI on ``arguments`` with the truncation ``how`` in pass ``chosen``; the lookups
    of each pass."""
    report = folder / "lookups.json"
    rank_file = folder / "snapshot" / "rank-00000.safetensors"
    cut = "tail" if tail else "half"
    given = [str(rank_file), str(chosen), how, str(at), cut, native, str(report), *arguments]
    result = run_python(_TRUNCATING_CLI, *given, timeout=120)
    return result, json.loads(report.read_text())


def _snapshot(folder: Path) -> Path:
    """One rank file of one gradient, 16 MB: large enough to be mapped, not read whole."""
    param = torch.nn.Parameter(torch.zeros(1 << 22))
    param.grad = torch.randn(1 << 22, generator=torch.Generator().manual_seed(14))
    return save_rank(folder, [("weight", param)], rank=0, world_size=1, coords={})


@pytest.mark.parametrize(
    ("command", "chosen", "native"),
    [
        (["norm"], 0, "1"),  # the native kernel's pass over the map
        (["norm", "-p", "3"], 0, "1"),  # PyTorch's operations over the map
        (["clip", "--max-norm", "1"], 0, "1"),  # clip's norm pass
        (["clip", "--max-norm", "1"], 1, "1"),  # clip's copy, after its norm pass
        (["norm"], 0, "0"),  # without the native library: read, not mapped
        (["clip", "--max-norm", "1"], 1, "0"),
    ],
    ids=["norm", "norm-p3", "clip-norm-pass", "clip-copy", "norm-kernel-off", "clip-kernel-off"],
)
def test_a_rank_file_truncated_while_read_is_one_line(
    tmp_path: Path, command: list[str], chosen: int, native: str
) -> None:
    rank_file = _snapshot(tmp_path / "snapshot")
    full_size = os.path.getsize(rank_file)
    arguments = [*command, str(rank_file.parent)]
    out = tmp_path / "clipped"
    if command[0] == "clip":
        arguments += ["--out", str(out)]
    # Untouched first: the command succeeds, and each pass's lookups are counted.
    result, lookups = _run(tmp_path, arguments, native, chosen, "count")
    assert result.returncode == 0, result.stderr
    assert len(lookups) == (2 if command[0] == "clip" else 1)
    shutil.rmtree(out, ignore_errors=True)
    # Mapped: cut after the pass's last lookup, before its pages are read. Read: cut before
    # the pass reads the tensor.
    how = "after" if native == "1" else "before-read"
    result, _ = _run(tmp_path, arguments, native, chosen, how, lookups[chosen])
    assert os.path.getsize(rank_file) < full_size  # the truncation happened
    assert result.returncode == 2, (result.returncode, result.stderr[-2000:])
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert str(rank_file) in lines[0]
    assert "changed while gradstat was reading it" in lines[0]
    assert result.stdout == ""
    assert not out.exists()
    assert not [entry for entry in tmp_path.iterdir() if entry.name.startswith(".clipped")]


def test_a_cut_inside_the_last_page_is_found_too(tmp_path: Path) -> None:
    """100 bytes off the end fault nowhere (the rest of the page reads zeros): the file's
    stamp, checked again as the pass ends, finds them."""
    rank_file = _snapshot(tmp_path / "snapshot")
    arguments = ["norm", str(rank_file.parent)]
    _, lookups = _run(tmp_path, arguments, "1", 0, "count")
    result, _ = _run(tmp_path, arguments, "1", 0, "after", lookups[0], tail=True)
    assert result.returncode == 2, (result.returncode, result.stderr[-2000:])
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and str(rank_file) in lines[0], result.stderr
    assert "changed while gradstat was reading it" in lines[0]

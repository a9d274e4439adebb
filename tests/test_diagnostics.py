"""Saying what happened: ``-v`` logs on stderr, the native kernel's fallback said once, and no
process-wide change from importing gradstat."""

from __future__ import annotations

import json
import subprocess
import sys
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch

from gradstat.core import native
from gradstat.errors import NativeKernelWarning

RunGradstat = Callable[..., subprocess.CompletedProcess[str]]


def _without_kernel(cache: Path) -> dict[str, str]:
    """An environment where the kernel is wanted but cannot be built: no compiler, no cache."""
    return {"GRADSTAT_NATIVE": "1", "CC": str(cache / "no-such-cc"), "GRADSTAT_CACHE": str(cache)}


def test_verbose_logs_on_stderr_and_leaves_stdout_alone(
    run_gradstat: RunGradstat, sample_data: Path
) -> None:
    snapshot = sample_data / "gtp2-pp2-dp2-ep2"
    plain = run_gradstat("norm", snapshot, "--json")
    verbose = run_gradstat("-v", "norm", snapshot, "--json")
    more = run_gradstat("-vv", "norm", snapshot, "--json")
    assert plain.returncode == verbose.returncode == more.returncode == 0, verbose.stderr
    assert plain.stdout == verbose.stdout == more.stdout
    assert json.loads(verbose.stdout)["total_norm"] > 0
    assert plain.stderr == ""
    lines = verbose.stderr.splitlines()
    assert f"gradstat: INFO gradstat.analysis.stats: {snapshot}: reading 8 of 8 rank files" in (
        verbose.stderr
    )
    kernel = [line for line in lines if "gradstat.core.native: native C kernel: " in line]
    assert kernel and any(line.endswith((".so (cached)", " s")) for line in kernel), lines
    assert all(line.startswith("gradstat: INFO ") for line in lines), lines
    assert not any("DEBUG" in line for line in lines)
    debug = [line for line in more.stderr.splitlines() if line.startswith("gradstat: DEBUG ")]
    assert len(debug) == 8 and all("tensors counted" in line for line in debug), debug


def test_verbose_names_the_turned_off_kernel(run_gradstat: RunGradstat, sample_data: Path) -> None:
    snapshot = sample_data / "gtp2-pp2-dp2-ep2"
    off = run_gradstat("-v", "zeros", snapshot, env={"GRADSTAT_NATIVE": "0"})
    assert off.returncode == 0, off.stderr
    assert "native C kernel: off (GRADSTAT_NATIVE=0)" in off.stderr
    assert "warning" not in off.stderr


def test_fallback_is_said_once_per_command(
    run_gradstat: RunGradstat, sample_data: Path, tmp_path: Path
) -> None:
    snapshot = sample_data / "gtp2-pp2-dp2-ep2"
    # compare reads two snapshots: the kernel is asked for many times.
    result = run_gradstat("compare", snapshot, snapshot, "--json", env=_without_kernel(tmp_path))
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout)["mismatches"] == []
    assert result.stderr == (
        f"gradstat: warning: gradstat's native C kernel cannot be built: no C compiler "
        f"'{tmp_path / 'no-such-cc'}' (set CC); using PyTorch operations, about 3x slower "
        "(GRADSTAT_NATIVE=0 silences this)\n"
    )
    quiet = run_gradstat(
        "compare",
        snapshot,
        snapshot,
        "--json",
        env={**_without_kernel(tmp_path), "GRADSTAT_NATIVE": "0"},
    )
    assert quiet.returncode == 0 and quiet.stderr == ""
    assert quiet.stdout == result.stdout


@pytest.fixture
def fresh_kernel(monkeypatch: pytest.MonkeyPatch) -> Iterator[pytest.MonkeyPatch]:
    """The kernel looked up anew under the test's environment, and anew again after it."""

    def forget() -> None:
        native.native_library.cache_clear()
        native._entry_point.cache_clear()

    forget()
    yield monkeypatch
    forget()


def test_library_fallback_warns_once_not_when_turned_off(
    fresh_kernel: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    for key, value in _without_kernel(tmp_path).items():
        fresh_kernel.setenv(key, value)
    with pytest.warns(NativeKernelWarning, match="no C compiler") as said:
        for _ in range(3):
            assert native.fused(torch.ones(10)) is None
            assert native.fused(torch.ones(10, dtype=torch.bfloat16)) is None
    assert len(said) == 1
    native.native_library.cache_clear()
    native._entry_point.cache_clear()
    fresh_kernel.setenv("GRADSTAT_NATIVE", "0")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert native.fused(torch.ones(10)) is None


IMPORT_LEAVES_NO_TRACE = """
import os, sys, warnings
def umask():
    mask = os.umask(0o022)
    os.umask(mask)
    return mask
before = (list(warnings.filters), umask(), dict(os.environ), warnings.showwarning)
import gradstat, gradstat.cli
after = (list(warnings.filters), umask(), dict(os.environ), warnings.showwarning)
assert before == after, [pair for pair in zip(before, after) if pair[0] != pair[1]]
assert "torch" not in sys.modules
import torch
from gradstat.core import native
environment = dict(os.environ)
assert native.fused(torch.ones(4)) is not None or os.environ.get("GRADSTAT_NATIVE") == "0"
assert dict(os.environ) == environment, "the kernel's first use changed the environment"
print("ok")
"""


def test_importing_gradstat_changes_nothing_process_wide() -> None:
    result = subprocess.run(
        [sys.executable, "-c", IMPORT_LEAVES_NO_TRACE],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout == "ok\n"


@pytest.mark.multiprocess
@pytest.mark.slow
def test_under_torchrun_each_process_logs_and_one_warns(
    run_gradstat: RunGradstat, sample_data: Path, tmp_path: Path
) -> None:
    snapshot = sample_data / "gtp2-pp2-dp2-ep2"
    result = run_gradstat("-v", "zeros", snapshot, "--json", nproc=2, env=_without_kernel(tmp_path))
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout)["num_zeros"] == 1376
    lines = result.stderr.splitlines()
    for process in (0, 1):
        assert any(
            line.startswith(
                f"gradstat[{process}]: INFO gradstat.cli.app: process {process} of 2: "
                "joined the gloo group at "
            )
            for line in lines
        ), lines
        assert f"gradstat[{process}]: INFO gradstat.analysis.stats: {snapshot}: reading 4 of 8" in (
            result.stderr
        )
    warned = [line for line in lines if line.startswith("gradstat: warning: ")]
    assert len(warned) == 1 and "native C kernel cannot be built" in warned[0], lines

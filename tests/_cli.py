"""The CLI as a user runs it, in a subprocess; where the sample data is; the docs' recipes.

``run_gradstat("norm", SAMPLE, "--json")`` is ``python -m gradstat norm SAMPLE --json``;
``nproc=N`` runs it under ``torchrun --standalone --nproc-per-node N -m gradstat`` (as the README
says), ``script=True`` through the installed ``gradstat`` console script. Nothing is checked
here: the caller asserts on the exit status, stdout and stderr.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

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

    Args:
        args: the command line after ``gradstat``.
        nproc: run under torchrun with this many processes.
        script: the console script instead of ``python -m gradstat`` (not with ``nproc``).
        launcher: extra torchrun options, before ``-m gradstat``.
        cwd: the working directory (default: this one).
        env: variables added to this process's environment.
        timeout: seconds before the run is killed (``subprocess.TimeoutExpired``).
    """
    if nproc is not None:
        start = [str(BIN / "torchrun"), "--standalone", f"--nproc-per-node={nproc}", *launcher]
        command = [*start, "-m", "gradstat"]
    elif script:
        command = [str(BIN / "gradstat")]
    else:
        command = [sys.executable, "-m", "gradstat"]
    return subprocess.run(
        [*command, *map(str, args)],
        cwd=cwd,
        env={**os.environ, **(env or {})},
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )


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
    result = subprocess.run(
        [sys.executable, "-m", "gradstat", "norm", str(snapshot), "--json"],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    document = json.loads(result.stdout) if result.stdout else None
    return result.returncode, document, result.stderr

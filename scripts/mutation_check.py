"""Plant known bugs in a copy of the repository, one at a time, and show which tests catch each.

A test suite that passes is only worth what it fails on. Each mutation below is a small bug of
the kind issue 19 found unguarded (or that the suite already catches, kept as a control): the
script copies the working tree (tracked and untracked files git does not ignore) into a
temporary directory, runs the chosen test files there once unchanged (the baseline: every
test must pass), then once per mutation with that one edit applied, and prints a table of the
tests that failed under each. A mutation that no test catches is a hole in the suite.

    .venv/bin/python scripts/mutation_check.py                  # every mutation, default files
    .venv/bin/python scripts/mutation_check.py --only cp_filter --files tests/test_snapshot.py

The copy is imported instead of the installed checkout: each run's working directory and
PYTHONPATH are the copy (checked before any test runs). Runs are sequential, one pytest at a
time, so the multi-process tests never share the machine with each other.
"""

from __future__ import annotations

import argparse
import datetime
import os
import shutil
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

DEFAULT_FILES = (
    "tests/test_predicates.py",
    "tests/test_count_zeros.py",
    "tests/test_norm.py",
    "tests/test_api.py",
    "tests/test_snapshot.py",
    "tests/test_capture.py",
    "tests/test_compare.py",
    "tests/test_audit.py",
    "tests/test_independent_layouts.py",
    "tests/test_context_parallel.py",
    "tests/test_layouts.py",
    "tests/test_torch_native.py",
    "tests/test_megatron_parity.py",
)


@dataclass(frozen=True)
class Mutation:
    """One planted bug: ``old`` (which must occur exactly once in ``path``) becomes ``new``."""

    key: str
    description: str
    path: str
    old: str
    new: str


MUTATIONS = (
    Mutation(
        "cp_filter",
        "the context-parallel filter in analysis.counts removed",
        "gradstat/analysis/stats.py",
        'return coords["dp"][0] == 0 and coords["cp"][0] == 0',
        'return coords["dp"][0] == 0',
    ),
    Mutation(
        "mesh_dim0",
        "a DTensor's stats reduced over mesh dimension 0 only (groups.reduce_over_mesh)",
        "gradstat/core/groups.py",
        "    for dim in range(mesh.ndim):\n        all_reduce(",
        "    for dim in (0,):\n        all_reduce(",
    ),
    Mutation(
        "is_replica_false",
        "MeshPlacement.is_replica always False (placements.py)",
        "gradstat/core/placements.py",
        '        if any(\n            code == "R" and index != 0',
        '        return False\n        if any(\n            code == "R" and index != 0',
    ),
    Mutation(
        "tp_filter",
        "TP replicas counted on every TP rank (param_is_not_tensor_parallel_duplicate)",
        "gradstat/core/predicates.py",
        '    return _axis_rank(tp_group, "tp") == 0',
        "    return True",
    ),
    Mutation(
        "gtp_filter",
        "GTP replicas counted on every GTP rank (param_is_not_gtp_duplicate)",
        "gradstat/core/predicates.py",
        '    return _axis_rank(gtp_group, "gtp") == 0',
        "    return True",
    ),
    Mutation(
        "gtp_padding",
        "GTP padding of a whole shard not excluded from the zero count (gtp_pad_zero_count)",
        "gradstat/core/predicates.py",
        "    return gtp_local_pad_zero_count(param, 0, int(param.numel()))",
        "    return 0",
    ),
    Mutation(
        "gtp_padding_spill",
        "GTP padding placed in the last shard only, never spilling into lower ranks",
        "gradstat/core/predicates.py",
        "    first_pad_row = min(max(rows * gtp_size - pad_length - gtp_rank * rows, 0), rows)",
        "    first_pad_row = max(rows - pad_length, 0) if gtp_rank == gtp_size - 1 else rows",
    ),
)


def working_tree_files() -> list[str]:
    listing = subprocess.run(
        ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        cwd=ROOT,
        capture_output=True,
        check=True,
    ).stdout
    return sorted({name for name in listing.decode().split("\0") if name})


def copy_tree(target: Path) -> None:
    for name in working_tree_files():
        source = ROOT / name
        if not source.is_file():  # deleted in the working tree, or a submodule
            continue
        destination = target / name
        destination.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(source, destination)


def plant(copy: Path, mutation: Mutation) -> None:
    path = copy / mutation.path
    text = path.read_text()
    found = text.count(mutation.old)
    if found != 1:
        raise SystemExit(
            f"mutation {mutation.key}: {mutation.path} holds its text {found} times, not once; "
            "the code changed: update the mutation"
        )
    path.write_text(text.replace(mutation.old, mutation.new))


def environment(copy: Path) -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(copy), "PYTHONDONTWRITEBYTECODE": "1"}


def check_imports_the_copy(copy: Path) -> None:
    found = subprocess.run(
        [sys.executable, "-c", "import gradstat; print(gradstat.__file__)"],
        cwd=copy,
        env=environment(copy),
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    if not Path(found).resolve().is_relative_to(copy.resolve()):
        raise SystemExit(f"the copy imports gradstat from {found}, not from {copy}")


def failed_tests(copy: Path, files: list[str], label: str, timeout_s: float) -> list[str]:
    """The node ids of the tests that failed or errored in one pytest run of ``files``."""
    report = copy / f"junit-{label}.xml"
    command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider"]
    command += [f"--junitxml={report}", *files]
    started = time.monotonic()
    result = subprocess.run(
        command,
        cwd=copy,
        env=environment(copy),
        capture_output=True,
        text=True,
        timeout=timeout_s,
        check=False,
    )
    print(f"  {label}: exit {result.returncode} in {time.monotonic() - started:.0f} s", flush=True)
    if not report.exists():
        tail = (result.stdout + result.stderr)[-3000:]
        raise SystemExit(f"{label}: pytest wrote no report (exit {result.returncode}):\n{tail}")
    failed = []
    for case in ET.parse(report).getroot().iter("testcase"):
        if case.find("failure") is not None or case.find("error") is not None:
            module = case.get("classname", "").replace(".", "/")
            failed.append(f"{module}.py::{case.get('name')}")
    if result.returncode not in (0, 1):  # 1: tests failed; anything else: pytest itself did
        tail = (result.stdout + result.stderr)[-3000:]
        raise SystemExit(f"{label}: pytest exited {result.returncode}:\n{tail}")
    return failed


def short(node: str) -> str:
    return node.removeprefix("tests/")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--files", nargs="+", default=list(DEFAULT_FILES))
    parser.add_argument("--only", nargs="+", choices=[m.key for m in MUTATIONS])
    parser.add_argument("--timeout", type=float, default=1800.0, help="seconds per pytest run")
    parser.add_argument("--keep", action="store_true", help="keep the temporary copies")
    args = parser.parse_args(argv)
    mutations = [m for m in MUTATIONS if args.only is None or m.key in args.only]
    command = " ".join(["scripts/mutation_check.py", *(argv if argv is not None else sys.argv[1:])])
    started = datetime.datetime.now(datetime.timezone.utc)
    print(f"mutation check, {started:%Y-%m-%d %H:%M} UTC: {command}", flush=True)
    print(f"test files: {' '.join(args.files)}", flush=True)
    results: dict[str, list[str]] = {}
    with tempfile.TemporaryDirectory(prefix="gradstat-mutation-") as scratch:
        base = Path(scratch)
        copy = base / "baseline"
        copy_tree(copy)
        check_imports_the_copy(copy)
        baseline = failed_tests(copy, args.files, "baseline", args.timeout)
        if baseline:
            print("the unchanged copy fails; fix these first:", *baseline, sep="\n  ")
            return 2
        for mutation in mutations:
            copy = base / mutation.key
            copy_tree(copy)
            plant(copy, mutation)
            check_imports_the_copy(copy)
            results[mutation.key] = failed_tests(copy, args.files, mutation.key, args.timeout)
            if not args.keep:
                shutil.rmtree(copy, ignore_errors=True)
        if args.keep:
            kept = Path(tempfile.mkdtemp(prefix="gradstat-mutation-kept-"))
            shutil.copytree(base, kept, dirs_exist_ok=True)
            print(f"copies kept in {kept}")
    print()
    print("| planted bug | tests failed | caught by (file: tests) |")
    print("|---|---:|---|")
    for mutation in mutations:
        failed = results[mutation.key]
        by_file = Counter(short(node).split("::")[0] for node in failed)
        where = ", ".join(f"`{name}`: {count}" for name, count in sorted(by_file.items()))
        print(f"| {mutation.description} | {len(failed)} | {where or '**none: not caught**'} |")
    print()
    for mutation in mutations:
        print(f"{mutation.key}: {mutation.description}")
        for node in results[mutation.key]:
            print(f"  {short(node)}")
    elapsed = datetime.datetime.now(datetime.timezone.utc) - started
    print(f"\n{len(mutations)} mutations in {elapsed.total_seconds() / 60:.0f} min")
    return 1 if any(not results[m.key] for m in mutations) else 0


if __name__ == "__main__":
    raise SystemExit(main())

"""Write a clipped copy of a snapshot: same format (gradstat rank files, or a Megatron wgrads
dump), dtypes and attributes, atomically."""

from __future__ import annotations

import errno
import os
import shutil
from collections.abc import Callable
from pathlib import Path

import torch

from gradstat.errors import SnapshotError
from gradstat.snapshot.reader import RankFile, Snapshot
from gradstat.snapshot.writer import new_hidden_directory

__all__ = ["check_output_dir", "write_clipped"]


def check_output_dir(source_dir: Path, out: Path) -> None:
    """Refuse an output that exists with content, or that is (inside) the input snapshot.

    Raises:
        SnapshotError: naming the directory and the problem.
    """
    source = source_dir.resolve()
    target = out.resolve()
    if target == source or source in target.parents:
        raise SnapshotError(f"{out}: the output must not be the input snapshot or inside it")
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise SnapshotError(f"{out}: exists and is not an empty directory; choose a new one")


def _make_parents(directory: Path) -> list[Path]:
    """Create ``directory`` and its missing parents, as ``mkdir -p`` does.

    Returns:
        The directories created, outermost first (to be removed again if the write fails).
    """
    missing = []
    while not directory.is_dir():
        if directory.exists() or directory.is_symlink():
            raise NotADirectoryError(errno.ENOTDIR, f"{directory} is not a directory")
        missing.append(directory)
        if directory.parent == directory:
            break
        directory = directory.parent
    created = []
    for path in reversed(missing):
        try:
            path.mkdir()
        except FileExistsError:
            if not path.is_dir():
                raise
            continue  # made meanwhile by someone else: not ours to remove
        created.append(path)
    return created


def _scaled(rank_file: RankFile, coefficient: float) -> list[tuple[str, torch.Tensor]]:
    tensors = []
    with rank_file.params() as params:
        for param in params:
            if param.grad is None:
                continue
            grad = param.grad.clone()  # the map is read-only, and the input is never changed
            if coefficient < 1.0:
                grad.mul_(coefficient)
            tensors.append((param.name, grad))
    return tensors


def write_clipped(
    snapshot: Snapshot,
    out: Path,
    coefficient: float,
    on_file: Callable[[RankFile], None] | None = None,
) -> None:
    """Write every rank file scaled by ``coefficient`` (when < 1) into the new directory ``out``.

    Missing parents of ``out`` are created (and removed again when the write fails). The files
    are written into a hidden sibling directory, fsynced, and the directory is renamed to
    ``out`` last: a run killed midway leaves no ``out``, only a ``.NAME.partial-*`` directory.

    Raises:
        SnapshotError: an unusable ``out`` or a write failure, naming the path.
    """
    check_output_dir(snapshot.directory, out)
    parent = out.parent if str(out.parent) else Path(".")
    created: list[Path] = []
    try:
        created = _make_parents(parent)
        staging = new_hidden_directory(parent, f".{out.name}.partial-")
    except OSError as error:
        _remove(created)
        raise SnapshotError(f"{out}: cannot create it ({error.strerror or error})") from error
    written = False
    try:
        for rank_file in snapshot.files:
            target = staging / rank_file.path.name
            with open(target, "wb") as file:
                rank_file.write(file, _scaled(rank_file, coefficient))
                file.flush()
                os.fsync(file.fileno())
            if on_file is not None:
                on_file(rank_file)
        if out.exists():
            out.rmdir()  # checked empty above; rename needs it gone or empty
        os.rename(staging, out)
        written = True
    except OSError as error:
        raise SnapshotError(f"{out}: cannot write the clipped snapshot ({error})") from error
    finally:
        if staging.exists():
            shutil.rmtree(staging, ignore_errors=True)
        if not written:
            _remove(created)


def _remove(directories: list[Path]) -> None:
    """Remove the directories ``_make_parents`` created, innermost first, where still empty."""
    for directory in reversed(directories):
        try:
            directory.rmdir()
        except OSError:
            return

"""save_rank: one rank of a training job dumps its gradients, with no collective."""

from __future__ import annotations

import contextlib
import errno
import os
import secrets
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any, TypeVar

import torch

from gradstat.core.axes import AXES
from gradstat.core.groups import group_rank, group_size, is_dtensor, to_local
from gradstat.core.placements import describe
from gradstat.errors import SnapshotError
from gradstat.snapshot.container import write_container
from gradstat.snapshot.format import (
    ATTRIBUTE_KINDS,
    DTYPE_NAMES,
    FILE_PATTERN,
    GRAD_ATTRS,
    METADATA_KEY,
    PLAIN_ATTRS,
    DTensorRecord,
    ParamRecord,
    RankHeader,
    supported_dtypes,
)

__all__ = ["check_coords", "param_record", "save_rank"]

T = TypeVar("T")


def check_coords(coords: Mapping[str, Sequence[int]]) -> dict[str, tuple[int, int]]:
    """``coords`` with every axis present (a missing one is ``[0, 1]``), checked."""
    unknown = sorted(set(coords) - set(AXES))
    if unknown:
        raise ValueError(f"coords: unknown axis {unknown[0]!r}; axes are {', '.join(AXES)}")
    checked = {}
    for axis in AXES:
        given = coords.get(axis, (0, 1))
        try:
            place = tuple(int(value) for value in given)
        except (TypeError, ValueError):
            place = ()
        if len(place) != 2 or not 0 <= place[0] < place[1]:
            raise ValueError(f"coords[{axis!r}] is {given!r}; expected [rank_on_axis, axis_size]")
        checked[axis] = (place[0], place[1])
    return checked


def _local_and_dtensor(grad: torch.Tensor) -> tuple[torch.Tensor, DTensorRecord | None]:
    if not is_dtensor(grad):
        return grad, None
    return to_local(grad), describe(grad, with_offset=True)


def _dense(grad: torch.Tensor) -> torch.Tensor:
    """``grad`` as the strided tensor the rank file stores: itself when strided; a sparse one
    (COO, CSR, CSC, BSR, BSC; hybrid too) coalesced, duplicate entries summed, and densified,
    every element it does not store a zero, as the norm functions read it. A new tensor:
    nothing is written into ``grad``.

    The file stays plain safetensors and every reader reads it as any other gradient; a sparse
    gradient (an embedding's) is at most its parameter's size.
    """
    if grad.layout == torch.strided:
        return grad
    if grad.layout == torch.sparse_coo:
        return grad.coalesce().to_dense()
    return grad.to_dense()


def param_record(name: str, param: Any, grad_attr: str) -> tuple[ParamRecord, torch.Tensor | None]:
    """The record a rank file holds of ``param`` and its gradient's local tensor (None: no
    gradient): what the reader rebuilds the parameter from."""
    attrs: dict[str, Any] = {}
    for key in PLAIN_ATTRS:
        value = getattr(param, key, None)
        if value is None:
            continue
        if isinstance(value, bool):
            attrs[key] = value
        elif ATTRIBUTE_KINDS[key] is list:
            attrs[key] = [int(item) for item in value]
        else:
            attrs[key] = int(value)
    group = getattr(param, "group", None)
    if getattr(param, "is_gtp_weight_remat", False) and group is not None:
        attrs["gtp_group"] = [group_rank(group), group_size(group)]
    if getattr(param, "__fsdp_param__", False):
        attrs["fsdp_param"] = True
    grad = getattr(param, grad_attr, None)
    param_shape = tuple(getattr(param, "shape", ()))
    if grad is None:
        record = ParamRecord(name, False, param_shape, None, param_shape, attrs)
        return record, None
    local, dtensor = _local_and_dtensor(grad)
    if local.dtype not in DTYPE_NAMES:
        raise ValueError(
            f"parameter {name!r}: gradient dtype {str(local.dtype).removeprefix('torch.')} is "
            f"not supported; supported: {supported_dtypes()}"
        )
    record = ParamRecord(
        name=name,
        has_grad=True,
        shape=tuple(local.shape),
        dtype=DTYPE_NAMES[local.dtype],
        param_shape=param_shape,
        attrs=attrs,
        dtensor=dtensor,
    )
    return record, local


def save_rank(
    directory: str | os.PathLike[str],
    named_params: Iterable[tuple[str, Any]],
    *,
    rank: int,
    world_size: int,
    coords: Mapping[str, Sequence[int]],
    grad_attr: str = "grad",
    distributed_optimizer: bool = False,
    step: int | None = None,
    overwrite: bool = False,
    triggers: Sequence[str] = (),
) -> Path:
    """Write this rank's gradients and their attributes as one safetensors file.

    Needs no collective, so a failing job can still dump. The file appears atomically (written
    to a temporary file, fsynced, then linked into place); an existing rank file is kept unless
    ``overwrite`` is set. A sparse gradient is written dense (see :func:`_dense`).

    Args:
        directory: the snapshot directory (created if missing).
        named_params: ``(name, param)`` pairs as the job holds them; names must be unique.
        rank: this rank's global rank.
        world_size: the number of ranks in the job.
        coords: ``{axis: [rank_on_axis, axis_size]}`` for tp, pp, dp, cp, ep, etp, edp, gtp,
            egtp; a missing axis is ``[0, 1]``.
        grad_attr: where the gradient is: "grad", "main_grad" or "decoupled_grad".
        distributed_optimizer: the params are the distributed optimizer's fragments.
        step: the training step, recorded for the reader to check.
        overwrite: replace an existing file of this rank.
        triggers: why the snapshot was taken (the flight recorder's triggers), recorded.

    Returns:
        The rank file's path.

    Raises:
        ValueError: bad arguments, duplicate names, an unsupported gradient dtype.
        SnapshotError: the rank file exists (and ``overwrite`` is not set) or cannot be written.
    """
    if grad_attr not in GRAD_ATTRS:
        raise ValueError(f"grad_attr must be one of {', '.join(GRAD_ATTRS)}, got {grad_attr!r}")
    if world_size < 1 or not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} is outside world size {world_size}")
    checked_coords = check_coords(coords)
    records, tensors = [], []
    seen: set[str] = set()
    for name, param in named_params:
        if name in seen:
            raise ValueError(f"parameter {name!r} appears twice in named_params")
        seen.add(name)
        record, local = param_record(name, param, grad_attr)
        records.append(record)
        if local is not None:
            tensors.append((name, _dense(local)))
    header = RankHeader(
        rank=rank,
        world_size=world_size,
        step=step,
        coords=checked_coords,
        distributed_optimizer=distributed_optimizer,
        grad_attr=grad_attr,
        params=tuple(records),
        triggers=tuple(triggers),
    )
    folder = Path(directory)
    created = _make_directories(folder)
    target = folder / FILE_PATTERN.format(rank=rank)
    try:
        if target.exists() and not overwrite:
            raise SnapshotError(f"{target}: rank file exists; pass overwrite=True to replace it")
        _write_atomically(target, {METADATA_KEY: header.to_json()}, tensors, overwrite)
    except BaseException:
        # A failed dump leaves no empty directory behind (another rank's files keep theirs).
        for made in created:
            try:
                made.rmdir()
            except OSError:
                break
        raise
    return target


def _make_directories(folder: Path) -> list[Path]:
    """Create ``folder`` and its missing parents; the ones created, deepest first."""
    missing = []
    for path in (folder, *folder.parents):
        if path.exists():
            break
        missing.append(path)
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as error:
        raise SnapshotError(f"{folder}: cannot create ({error.strerror or error})") from error
    return missing


def _new_hidden(parent: Path, prefix: str, create: Callable[[Path], T]) -> T:
    """``create(path)`` for a free path of ``parent`` named ``prefix`` and random letters."""
    for _ in range(100):
        try:
            return create(parent / f"{prefix}{secrets.token_hex(6)}")
        except FileExistsError:
            continue
    raise FileExistsError(errno.EEXIST, f"no free name {prefix}* in {parent}")


def new_hidden_file(parent: Path, prefix: str) -> tuple[int, Path]:
    """Create a file as ``tempfile.mkstemp`` does, but with the mode any new file gets in
    ``parent`` (mkstemp's is owner-only).

    The kernel applies the umask (or the directory's default ACL) as the file is created:
    reading the umask would mean setting it, for every thread of the process at once.

    Returns:
        The open descriptor (write-only) and the path.
    """
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0)
    return _new_hidden(parent, prefix, lambda path: (os.open(path, flags, 0o666), path))


def new_hidden_directory(parent: Path, prefix: str) -> Path:
    """Create a directory as ``tempfile.mkdtemp`` does, but with the mode any new directory
    gets in ``parent`` (mkdtemp's is owner-only); see :func:`new_hidden_file`."""

    def make(path: Path) -> Path:
        path.mkdir(0o777)
        return path

    return _new_hidden(parent, prefix, make)


def _write_atomically(
    target: Path,
    metadata: dict[str, str],
    tensors: Sequence[tuple[str, torch.Tensor]],
    overwrite: bool,
) -> None:
    """Write ``target`` through a hidden temporary file, linked (or, with ``overwrite``,
    renamed) into place, then the folder synced.

    Every step after the write goes through a descriptor of the folder, not its path: the flight
    recorder's rank 0 renames the folder to ``step-N`` as soon as every rank file is there,
    which may fall between another rank's link and its removal of the temporary name (that
    rank then said it could not dump, and left a second name of its file behind).
    """
    try:
        folder = os.open(target.parent, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    except OSError as error:
        raise SnapshotError(f"{target}: cannot write ({error.strerror or error})") from error
    temporary = None
    try:
        handle, path = new_hidden_file(target.parent, f".{target.name}.")
        temporary = path.name
        with os.fdopen(handle, "wb") as file:
            write_container(file, metadata, tensors)
            file.flush()
            os.fsync(file.fileno())
        if overwrite:
            os.replace(temporary, target.name, src_dir_fd=folder, dst_dir_fd=folder)
        else:
            # link() fails if the target appeared meanwhile: never clobber another writer.
            os.link(temporary, target.name, src_dir_fd=folder, dst_dir_fd=folder)
            os.unlink(temporary, dir_fd=folder)
        temporary = None
        os.fsync(folder)
    except FileExistsError as error:
        raise SnapshotError(f"{target}: rank file exists; pass overwrite=True") from error
    except OSError as error:
        raise SnapshotError(f"{target}: cannot write ({error.strerror or error})") from error
    finally:
        if temporary is not None:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(temporary, dir_fd=folder)
        os.close(folder)

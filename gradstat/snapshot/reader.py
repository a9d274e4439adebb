"""Open a snapshot directory, validate it as a whole, then stream it one rank file at a time."""

from __future__ import annotations

import math
import os
import stat
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch

from ..errors import SnapshotError
from ..groups import AxisPlace
from .container import Container, mapped, read_container
from .format import AXES, METADATA_KEY, PLAIN_ATTRS, ParamRecord, RankHeader, parse_header

__all__ = ["RankFile", "RebuiltParam", "Snapshot"]

# Axes whose coordinates, together, tell dense ranks apart.
_DENSE_AXES = ("tp", "cp", "dp", "pp", "gtp")


class RebuiltParam:
    """A parameter rebuilt from a snapshot: Megatron's attributes, its gradient and shape.

    Duck-types what the core functions read from a parameter: attributes via getattr, the
    gradient as ``.grad``, and ``shape``/``numel()``/``dim()`` of the parameter itself.
    """

    def __init__(self, record: ParamRecord, grad: torch.Tensor | None) -> None:
        self.record = record
        self._gradstat_name = record.name
        self.grad = grad
        self.shape = torch.Size(record.param_shape)
        for key in PLAIN_ATTRS:
            value = record.attr(key)
            if value is not None:
                setattr(self, key, value)
        gtp_group = record.attr("gtp_group")
        self.group = AxisPlace(*gtp_group) if gtp_group is not None else None
        if record.attr("fsdp_param"):
            self.__fsdp_param__ = True

    @property
    def name(self) -> str:
        return self.record.name

    def numel(self) -> int:
        return math.prod(self.shape)

    def dim(self) -> int:
        return len(self.shape)


@dataclass(frozen=True)
class RankFile:
    """One validated rank file: its header and where its tensors lie."""

    header: RankHeader
    container: Container

    @property
    def path(self) -> Path:
        return self.container.path

    @property
    def rank(self) -> int:
        return self.header.rank

    @property
    def size_bytes(self) -> int:
        return self.path.stat().st_size

    def place(self, axis: str) -> AxisPlace:
        """This rank's place on ``axis``, as the duplicate filters take it."""
        return AxisPlace(*self.header.coords[axis])

    @contextmanager
    def params(self) -> Iterator[list[RebuiltParam]]:
        """Map the file and rebuild its parameters; valid inside the ``with`` block only."""
        with mapped(self.container) as tensors:
            yield [
                RebuiltParam(record, tensors[record.name] if record.has_grad else None)
                for record in self.header.params
            ]


@dataclass(frozen=True)
class Snapshot:
    """A validated snapshot: every rank file present once and consistent with the others."""

    directory: Path
    files: tuple[RankFile, ...]

    @property
    def world_size(self) -> int:
        return self.files[0].header.world_size

    @property
    def step(self) -> int | None:
        return self.files[0].header.step

    @property
    def distributed_optimizer(self) -> bool:
        return self.files[0].header.distributed_optimizer

    @property
    def axis_sizes(self) -> dict[str, int]:
        return {axis: size for axis, (_, size) in self.files[0].header.coords.items()}

    @classmethod
    def open(cls, directory: str | os.PathLike[str]) -> Snapshot:
        """Read and validate every rank file's header; no gradient is read.

        Raises:
            SnapshotError: naming the directory or file and what is wrong.
        """
        folder = Path(directory)
        if not folder.exists():
            raise SnapshotError(f"{folder}: no such directory")
        if not folder.is_dir():
            raise SnapshotError(f"{folder}: not a directory")
        paths = sorted(path for path in folder.iterdir() if path.name.endswith(".safetensors"))
        if not paths:
            raise SnapshotError(f"{folder}: no rank files (*.safetensors) in the directory")
        files = [_open_rank_file(folder, path) for path in paths]
        _check_whole(folder, files)
        return cls(folder, tuple(sorted(files, key=lambda file: file.rank)))


def _open_rank_file(folder: Path, path: Path) -> RankFile:
    try:
        resolved = path.resolve(strict=True)
        mode = os.stat(resolved).st_mode
    except OSError as error:
        raise SnapshotError(f"{path}: cannot open ({error.strerror or error})") from error
    if path.is_symlink() and folder.resolve() not in resolved.parents:
        raise SnapshotError(f"{path}: symlink leads out of the snapshot directory to {resolved}")
    if not stat.S_ISREG(mode):
        kind = "a directory" if stat.S_ISDIR(mode) else "not a regular file"
        raise SnapshotError(f"{path}: {kind}, expected a rank file")
    container = read_container(path)
    if METADATA_KEY not in container.metadata:
        raise SnapshotError(f"{path}: a safetensors file without gradstat metadata")
    header = parse_header(path, container.metadata[METADATA_KEY])
    _check_tensors(path, header, container)
    return RankFile(header, container)


def _check_tensors(path: Path, header: RankHeader, container: Container) -> None:
    recorded = {record.name for record in header.params if record.has_grad}
    extra = sorted(set(container.slots) - recorded)
    if extra:
        raise SnapshotError(f"{path}: tensor {extra[0]!r} has no parameter record")
    for record in header.params:
        where = f"{path}: parameter {record.name!r}"
        if not record.has_grad:
            continue
        slot = container.slots.get(record.name)
        if slot is None:
            raise SnapshotError(f"{where}: its gradient tensor is missing from the file")
        if slot.dtype != record.dtype or slot.shape != record.shape:
            raise SnapshotError(
                f"{where}: tensor is {slot.dtype}{list(slot.shape)} but its record says "
                f"{record.dtype}{list(record.shape)}"
            )
        _check_gtp(where, header, record)
        _check_fragment(where, record)


def _check_gtp(where: str, header: RankHeader, record: ParamRecord) -> None:
    if not record.attr("is_gtp_weight_remat"):
        return
    axis = "egtp" if record.is_expert else "gtp"
    place = header.coords[axis]
    group = record.attr("gtp_group")
    if group is not None and tuple(group) != place:
        raise SnapshotError(
            f"{where}: GTP group {list(group)} does not match the rank's {axis} coordinate "
            f"{list(place)}"
        )
    pad_length = record.attr("pad_length")
    rows = record.param_shape[0] if record.param_shape else 1
    # A flat distributed-optimizer fragment has no rows of its own: only whole shards tell.
    whole_shard = len(record.param_shape) >= 2
    if whole_shard and not 0 <= pad_length <= rows * place[1]:
        raise SnapshotError(
            f"{where}: pad_length {pad_length} is larger than the padded tensor "
            f"({rows} rows x {axis} size {place[1]})"
        )
    pad_zeros = record.attr("gtp_pad_zeros")
    if pad_zeros is not None and not 0 <= pad_zeros <= record.numel:
        raise SnapshotError(
            f"{where}: gtp_pad_zeros {pad_zeros} is outside its {record.numel} elements"
        )


def _check_fragment(where: str, record: ParamRecord) -> None:
    offset, shape = record.attr("fragment_offset"), record.attr("fragment_shape")
    if offset is None and shape is None:
        return
    if offset is None or shape is None:
        raise SnapshotError(f"{where}: fragment_offset and fragment_shape come together")
    if not all(type(size) is int and size >= 0 for size in shape):
        raise SnapshotError(f"{where}: fragment_shape {shape!r} is not a list of sizes")
    if len(record.shape) != 1 or not 0 <= offset <= math.prod(shape) - record.numel:
        raise SnapshotError(
            f"{where}: a fragment of {record.numel} elements at offset {offset} does not fit "
            f"in a parameter of shape {shape}"
        )


def _check_whole(folder: Path, files: list[RankFile]) -> None:
    first = files[0]
    for file in files[1:]:
        for field, label in (
            ("version", "format version"),
            ("world_size", "world size"),
            ("step", "step"),
            ("distributed_optimizer", "distributed_optimizer"),
        ):
            mine, theirs = getattr(file.header, field), getattr(first.header, field)
            if mine != theirs:
                raise SnapshotError(
                    f"{file.path}: {label} {mine} differs from {theirs} in {first.path.name} "
                    f"(a rank file from another snapshot?)"
                )
        for axis in AXES:
            mine_size, first_size = file.header.coords[axis][1], first.header.coords[axis][1]
            if mine_size != first_size:
                raise SnapshotError(
                    f"{file.path}: axis {axis} has size {mine_size}, but {first_size} in "
                    f"{first.path.name}"
                )
    world_size = first.header.world_size
    by_rank: dict[int, RankFile] = {}
    places: dict[tuple[int, ...], RankFile] = {}
    for file in files:
        if file.rank in by_rank:
            raise SnapshotError(
                f"{file.path}: rank {file.rank} is also in {by_rank[file.rank].path.name}"
            )
        by_rank[file.rank] = file
        place = tuple(file.header.coords[axis][0] for axis in _DENSE_AXES)
        if place in places:
            raise SnapshotError(
                f"{file.path}: rank {file.rank} has the same coordinates as rank "
                f"{places[place].rank} ({places[place].path.name})"
            )
        places[place] = file
    missing = sorted(set(range(world_size)) - set(by_rank))
    if missing:
        shown = ", ".join(str(rank) for rank in missing[:8])
        raise SnapshotError(
            f"{folder}: {len(missing)} of {world_size} rank files missing (rank {shown})"
        )

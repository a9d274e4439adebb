"""Open a snapshot directory, validate it as a whole, then stream it one rank file at a time."""

from __future__ import annotations

import errno
import itertools
import math
import operator
import os
import stat
from collections.abc import Iterable, Iterator, Mapping, Sequence
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any, ClassVar

import torch

from gradstat._cached import cached
from gradstat.core.axes import AXES, DENSE_AXES, EXPERT_AXES, Axis, too_many_places
from gradstat.core.groups import AxisPlace
from gradstat.errors import SnapshotError
from gradstat.snapshot.container import (
    Container,
    KnownLayouts,
    TensorSlot,
    mapped,
    read_container,
    write_container,
)
from gradstat.snapshot.dcp import is_dcp_directory
from gradstat.snapshot.format import (
    METADATA_KEY,
    REAL_VIEWS,
    TORCH_SIZE_LIMIT,
    ParamRecord,
    RankHeader,
    fits_torch,
    is_wgrads_name,
    parse_header,
)
from gradstat.snapshot.repeats import KnownParams
from gradstat.snapshot.stand_ins import (
    Lacking,
    Listing,
    lacking,
    listing,
    names_digest,
    with_stand_ins,
)

if TYPE_CHECKING:
    from gradstat.snapshot.wgrads import Source, WgradsOptions

__all__ = [
    "FileSummary",
    "RankFile",
    "RebuiltParam",
    "Snapshot",
    "SnapshotShare",
    "filter_places_of",
    "open_rank_file",
    "open_rank_files",
    "rank_file_names",
    "refuse_kind",
]

# Axes whose coordinates, together, tell dense (expert) ranks apart.
_DENSE_PLACES = (*DENSE_AXES, Axis.pp)
_EXPERT_PLACES = (*EXPERT_AXES, Axis.pp)


class RebuiltParam:
    """A parameter rebuilt from a snapshot: Megatron's attributes, its gradient and shape.

    Duck-types what the core functions read from a parameter: attributes via getattr, the
    gradient as ``.grad``, and ``shape``/``numel()``/``dim()`` of the parameter itself.

    Args:
        record: the parameter's record in its rank file.
        grad: its gradient, when the caller holds it.
        mapped: its rank file's mapped tensors, where ``.grad`` is looked up on each access
            (the lookup checks the file first; see ``MappedTensors``) until one is assigned.
        whole: its gradient is its whole shard, never a fragment (a plain optimizer's file):
            a 1-D GTP shard's padding can then be placed (see ``gtp_pad_zero_count``).
    """

    def __init__(
        self,
        record: ParamRecord,
        grad: torch.Tensor | None = None,
        *,
        mapped: Mapping[str, torch.Tensor] | None = None,
        whole: bool = False,
    ) -> None:
        self.record = record
        self._gradstat_name = record.name
        self._gradstat_whole_shard = whole
        self._grad = grad
        self._mapped = mapped if grad is None and record.has_grad else None
        self.shape = torch.Size(record.param_shape)
        self.__dict__.update(record.plain_attrs)
        gtp_group = record.attr("gtp_group")
        self.group = AxisPlace(*gtp_group) if gtp_group is not None else None
        if record.attr("fsdp_param"):
            self.__fsdp_param__ = True

    @property
    def grad(self) -> torch.Tensor | None:
        if self._mapped is not None:
            return self._mapped[self.record.name]
        return self._grad

    @grad.setter
    def grad(self, value: torch.Tensor | None) -> None:
        self._grad, self._mapped = value, None

    @property
    def name(self) -> str:
        return self.record.name

    def numel(self) -> int:
        return math.prod(self.shape)

    def dim(self) -> int:
        return len(self.shape)


def filter_places_of(
    coords: Mapping[str, tuple[int, int]],
) -> tuple[AxisPlace, AxisPlace, AxisPlace, AxisPlace]:
    """A rank's TP, ETP, GTP and EGTP places from its coordinates, as the duplicate filters
    take them."""
    tp, etp, gtp, egtp = (AxisPlace(*coords[axis]) for axis in ("tp", "etp", "gtp", "egtp"))
    return tp, etp, gtp, egtp


@dataclass(frozen=True)
class RankFile:
    """One validated rank file: its header and where its tensors lie."""

    header: RankHeader
    container: Container
    # Its tensors are read into memory when asked for (a checkpoint's chunks), not mapped:
    # readers then take them one at a time.
    one_tensor_at_a_time: ClassVar[bool] = False

    @property
    def path(self) -> Path:
        return self.container.path

    @property
    def rank(self) -> int:
        return self.header.rank

    @property
    def size_bytes(self) -> int:
        """The file's size when it was validated."""
        return self.container.stamp.size

    def axis_place(self, axis: str) -> AxisPlace:
        """This rank's place on ``axis``, as the duplicate filters take it."""
        return self._places[axis]

    @cached
    def _places(self) -> dict[str, AxisPlace]:
        return {axis: AxisPlace(*place) for axis, place in self.header.coords.items()}

    @cached
    def filter_places(self) -> tuple[AxisPlace, AxisPlace, AxisPlace, AxisPlace]:
        """This rank's TP, ETP, GTP and EGTP places, as the duplicate filters take them."""
        return filter_places_of(self.header.coords)

    def tensors(self) -> AbstractContextManager[Mapping[str, torch.Tensor]]:
        """The file's gradients by parameter name, read-only views of its map (see
        :func:`mapped`), valid inside the ``with`` block only."""
        return mapped(self.container)

    @contextmanager
    def params(self) -> Iterator[list[RebuiltParam]]:
        """Map the file and rebuild its parameters; valid inside the ``with`` block only.

        A gradient is looked up in the map each time ``.grad`` is read, so that a file
        truncated meanwhile is found before the gradient's pages are touched.
        """
        with self.tensors() as tensors:
            whole = not self.header.distributed_optimizer
            yield [
                RebuiltParam(record, mapped=tensors, whole=whole) for record in self.header.params
            ]

    def write(self, file: IO[bytes], tensors: Sequence[tuple[str, torch.Tensor]]) -> None:
        """Write a file of this one's kind and header holding ``tensors`` (by record name)."""
        write_container(file, self.container.metadata, tensors)

    def source(self, name: str) -> Source | None:
        """Where parameter ``name`` came from and what decided its attributes, for a file
        whose attributes were rebuilt (a Megatron wgrads file); None here: recorded."""
        return None


@dataclass(frozen=True)
class FileSummary:
    """What the checks of a whole snapshot read of one rank file: where it lies, its size, and
    its header without the parameter records. Processes that each read a share of a snapshot
    exchange these (as JSON) to check the whole."""

    directory: Path
    name: str  # the path is made when asked for: an error, a report (2.4 us a file)
    size_bytes: int
    header: RankHeader
    # What the stand-ins read of its records (gradstat.snapshot.stand_ins): those without a
    # gradient, and a digest of their names.
    lacking: Lacking = ()
    names: tuple[int, int] = (0, 0)

    @property
    def path(self) -> Path:
        return self.directory / self.name

    @property
    def rank(self) -> int:
        return self.header.rank

    @classmethod
    def of(cls, rank_file: RankFile) -> FileSummary:
        path = rank_file.path
        header = replace(rank_file.header, params=())
        found = rank_file.header
        return cls(
            path.parent,
            path.name,
            rank_file.size_bytes,
            header,
            lacking(found),
            names_digest(found),
        )

    @staticmethod
    def to_columns(files: Sequence[RankFile | FileSummary]) -> list[list[Any]]:
        """The summaries of ``files`` (rank files, or their summaries) as JSON data, one list
        per field: what processes that each read a share of a snapshot exchange. Every process
        decodes every file's, so that part does not shrink with more processes: a list per
        field decodes faster than an object per file (8192 files: 9.2 us a file as objects, 6.1
        as lists). Taken from the rank files, no summary is made first (6.4 us a file)."""
        headers = [file.header for file in files]
        return [
            [file.path.name for file in files],
            [file.size_bytes for file in files],
            *([getattr(header, key) for header in headers] for key in _SUMMARY_FIELDS),
            [[header.coords[axis] for axis in AXES] for header in headers],
            *map(list, zip(*(_listed(file) for file in files), strict=True)),
        ]

    @classmethod
    def from_columns(cls, folder: Path, columns: Sequence[Sequence[Any]]) -> list[FileSummary]:
        """The summaries :meth:`to_columns` made of headers another process parsed and checked
        (they are not parsed again: a rank file's header costs more to parse than its data to
        reduce)."""
        # Every process decodes every file's summary: each header and summary is made as a
        # copy of a template's fields, not through the frozen dataclasses' __init__ (10.3 ->
        # 6.3 us a file), and what the files share (their triggers) is made once.
        summaries: list[FileSummary] = []
        template = RankHeader(0, 0, None, {}, False, "", ())
        header_fields, summary_fields = template.__dict__, cls(folder, "", 0, template).__dict__
        new = object.__new__
        triggers_seen: dict[tuple[str, ...], tuple[str, ...]] = {}
        for name, size, *fields, places, missing, names in zip(*columns, strict=True):
            header = new(RankHeader)
            state = header.__dict__
            state.update(header_fields)
            state.update(zip(_SUMMARY_FIELDS, fields, strict=True))
            triggers = tuple(state["triggers"])
            state["triggers"] = triggers_seen.setdefault(triggers, triggers)
            state["coords"] = dict(zip(AXES, map(tuple, places), strict=True))
            summary = new(cls)
            state = summary.__dict__
            state.update(summary_fields)
            state["name"], state["size_bytes"], state["header"] = name, size, header
            if missing:
                state["lacking"] = tuple((str(record), bool(expert)) for record, expert in missing)
            state["names"] = (int(names[0]), int(names[1]))
            summaries.append(summary)
        return summaries


def _listed(file: RankFile | FileSummary) -> tuple[Lacking, tuple[int, int]]:
    if isinstance(file, FileSummary):
        return file.lacking, file.names
    return lacking(file.header), names_digest(file.header)


# The header fields of a summary's columns, in order (see FileSummary.to_columns).
_SUMMARY_FIELDS = (
    "rank",
    "world_size",
    "step",
    "distributed_optimizer",
    "grad_attr",
    "version",
    "triggers",
)


class _Described:
    """What a snapshot says of itself, the same in every rank file (checked): read from the
    first one."""

    @property
    def _first(self) -> RankHeader:
        raise NotImplementedError

    @property
    def world_size(self) -> int:
        return self._first.world_size

    @property
    def step(self) -> int | None:
        return self._first.step

    @property
    def distributed_optimizer(self) -> bool:
        return self._first.distributed_optimizer

    @property
    def axis_sizes(self) -> dict[str, int]:
        return {axis: size for axis, (_, size) in self._first.coords.items()}


@dataclass(frozen=True)
class Snapshot(_Described):
    """A validated snapshot: every rank file present once and consistent with the others."""

    directory: Path
    files: tuple[RankFile, ...]

    @property
    def _first(self) -> RankHeader:
        return self.files[0].header

    @classmethod
    def open(
        cls, directory: str | os.PathLike[str], options: WgradsOptions | None = None
    ) -> Snapshot:
        """Read and validate every rank file's header; no gradient is read.

        ``directory`` holds gradstat's rank files, a Megatron wgrads dump (``mp_rank_*.pth``,
        read by :mod:`gradstat.snapshot.wgrads` with ``options``), or a PyTorch distributed
        checkpoint (read by :mod:`gradstat.snapshot.checkpoint`, ``options.kind`` of it).

        Raises:
            SnapshotError: naming the directory or file and what is wrong.
        """
        folder = Path(directory)
        files: list[RankFile]
        if is_dcp_directory(folder):
            from gradstat.snapshot.checkpoint import open_checkpoint

            files = list(open_checkpoint(folder, options.kind if options else None))
            _check_whole(folder, files)
            return cls(folder, tuple(files))
        refuse_kind(folder, options)
        names = rank_file_names(folder)
        if is_wgrads_name(names[0]):
            from gradstat.snapshot.wgrads import open_wgrads

            files = list(open_wgrads(folder, names, options))
        else:
            files = list(open_rank_files(folder, names))
        _check_whole(folder, files)
        files = with_stand_ins(files, [listing(file.path.name, file.header) for file in files])
        return cls(folder, tuple(sorted(files, key=lambda file: file.rank)))


@dataclass(frozen=True)
class SnapshotShare(_Described):
    """A process's share of a validated snapshot: the rank files it read, and the summaries of
    every rank file, with which the whole was checked as :meth:`Snapshot.open` checks it."""

    directory: Path
    files: tuple[RankFile, ...]
    summaries: tuple[FileSummary, ...]

    @property
    def _first(self) -> RankHeader:
        return self.summaries[0].header

    @classmethod
    def assemble(
        cls,
        directory: Path,
        files: Sequence[RankFile],
        summaries: Sequence[FileSummary],
        copies: Mapping[int, set[str]] | None = None,
    ) -> SnapshotShare:
        """Check the whole snapshot from every rank file's summary; keep the files read here.
        ``copies``: the DTensor stand-ins, from every process's records (see
        :func:`gradstat.snapshot.stand_ins.copy_rows`); the summaries hold none.

        Raises:
            SnapshotError: as :meth:`Snapshot.open` raises it for the whole.
        """
        _check_whole(directory, sorted(summaries, key=operator.attrgetter("name")))
        everyone = [
            Listing(summary.name, summary.header, summary.lacking, summary.names)
            for summary in summaries
        ]
        files = with_stand_ins(files, everyone, copies or {})
        return cls(
            directory,
            tuple(sorted(files, key=lambda file: file.rank)),
            tuple(sorted(summaries, key=lambda summary: summary.rank)),
        )


def rank_file_names(folder: Path) -> list[str]:
    """The names of the rank files in ``folder``, sorted: gradstat's ``*.safetensors``, or the
    ``mp_rank_*.pth`` files of a Megatron wgrads dump.

    Raises:
        SnapshotError: ``folder`` is not a readable directory, holds no rank file, or both
            kinds.
    """
    try:
        mode = folder.stat().st_mode
    except OSError as error:
        raise SnapshotError(f"{folder}: {_stat_problem(error, 'directory')}") from error
    if not stat.S_ISDIR(mode):
        kind = folder.suffix == ".safetensors" or is_wgrads_name(folder.name)
        hint = f"; pass the snapshot, the directory that holds it ({folder.parent})" if kind else ""
        raise SnapshotError(f"{folder}: not a directory{hint}")
    listed = os.listdir(folder)
    names = sorted(name for name in listed if name.endswith(".safetensors"))
    dumped = sorted(name for name in listed if is_wgrads_name(name))
    if names and dumped:
        raise SnapshotError(
            f"{folder}: holds both gradstat rank files ({names[0]}) and a Megatron wgrads dump "
            f"({dumped[0]}); keep each in a directory of its own"
        )
    if not names and not dumped:
        data = sorted(name for name in listed if name.endswith(".distcp"))
        if data:
            raise SnapshotError(
                f"{folder}: holds DCP data files ({data[0]}) but no .metadata or __R.metadata "
                "file: the checkpoint's save did not finish, or its metadata was not copied"
            )
        raise SnapshotError(
            f"{folder}: no rank files (*.safetensors) in the directory, nor a Megatron wgrads "
            "dump (mp_rank_*.pth)"
        )
    return names or dumped


def refuse_kind(folder: Path, options: WgradsOptions | None) -> None:
    """Refuse ``--kind`` for a directory that is no DCP checkpoint: it would mean nothing.

    Raises:
        SnapshotError: a kind was given.
    """
    if options is not None and options.kind is not None:
        raise SnapshotError(
            f"{folder}: --kind {options.kind} chooses a PyTorch distributed checkpoint's "
            "tensors; this is a gradient snapshot, not a checkpoint"
        )


def holds_rank_files(folder: Path) -> bool:
    """Whether ``folder`` holds rank files of any kind, or is a DCP checkpoint (no error when
    it cannot be read)."""
    try:
        return is_dcp_directory(folder) or any(
            name.endswith(".safetensors") or is_wgrads_name(name) for name in os.listdir(folder)
        )
    except OSError:
        return False


def _stat_problem(error: OSError, kind: str) -> str:
    """What a failed stat of a snapshot path means, in words."""
    if error.errno == errno.ELOOP:
        return "a symlink loop (the link leads back to itself)"
    if error.errno == errno.ENOENT:
        return f"no such {kind}"
    return f"cannot open ({error.strerror or error})"


# Rank files up to this size are read whole with their header and their tensors viewed in the
# bytes read (no second open, no map), until a snapshot's files kept so reach KEEP_TOTAL_BYTES.
SMALL_FILE_BYTES = 1 << 20
KEEP_TOTAL_BYTES = 256 << 20


def open_rank_files(folder: Path, names: Iterable[str]) -> Iterator[RankFile]:
    """:func:`open_rank_file` of each of ``names``, small files read whole within the budget.

    Raises:
        SnapshotError: naming the first file that is wrong and what is wrong with it.
    """
    room, known = KEEP_TOTAL_BYTES, Repeats()
    for name in names:
        rank_file = open_rank_file(folder, name, min(SMALL_FILE_BYTES, room), known)
        if rank_file.container.data is not None:
            room -= rank_file.size_bytes
        yield rank_file


@dataclass
class Repeats:
    """What the rank files of a snapshot repeat of each other, checked once, by its text: the
    tensors' layouts and the parameter lists (every data-parallel replica has its own file, and
    tensor-parallel shards and pipeline stages often hold the same list). Such a file is still
    read, its own parts parsed and every check that involves them made."""

    layouts: KnownLayouts = field(default_factory=dict)
    params: KnownParams = field(default_factory=KnownParams)


def open_rank_file(
    folder: Path, name: str, keep_up_to: int = 0, known: Repeats | None = None
) -> RankFile:
    """Read and validate the header of the rank file ``name`` in ``folder``; a file of at most
    ``keep_up_to`` bytes is read whole and kept (see :func:`read_container`). ``known``: what
    the snapshot's files read before held (the parts this one repeats are not checked again).

    Raises:
        SnapshotError: naming the file and what is wrong with it.
    """
    path = folder / name
    try:
        mode = os.lstat(path).st_mode
        if stat.S_ISLNK(mode):
            resolved = path.resolve(strict=True)
            if folder.resolve() not in resolved.parents:
                raise SnapshotError(
                    f"{path}: symlink leads out of the snapshot directory to {resolved}"
                )
            mode = os.stat(path).st_mode
    except OSError as error:
        raise SnapshotError(f"{path}: {_stat_problem(error, 'file')}") from error
    except RuntimeError as error:  # Python before 3.13 reports a loop met while resolving so
        raise SnapshotError(f"{path}: a symlink loop (the link leads back to itself)") from error
    if not stat.S_ISREG(mode):
        kind = "a directory" if stat.S_ISDIR(mode) else "not a regular file"
        raise SnapshotError(f"{path}: {kind}, expected a rank file")
    container = read_container(path, keep_up_to, None if known is None else known.layouts)
    if METADATA_KEY not in container.metadata:
        raise SnapshotError(f"{path}: a safetensors file without gradstat metadata")
    metadata = container.metadata[METADATA_KEY]
    header = parse_header(path, metadata, None if known is None else known.params)
    return RankFile(header, _check_tensors(path, header, container))


def _check_tensors(path: Path, header: RankHeader, container: Container) -> Container:
    """The container checked against the header's records, its tensors kept as their real
    view (``REAL_VIEWS``) read as what their records say."""
    slots = container.slots
    recorded = {record.name for record in header.params if record.has_grad}
    coords = header.coords
    # The most shards a tensor's full shape spans (TP times GTP): none beyond one, no check.
    spanned = max(coords[Axis.tp][1], coords[Axis.etp][1]) * max(
        coords[Axis.gtp][1], coords[Axis.egtp][1]
    )
    viewed: dict[str, TensorSlot] = {}  # the real views, as their records say they are
    if not slots.keys() <= recorded:
        extra = sorted(slots.keys() - recorded)
        raise SnapshotError(f"{path}: tensor {extra[0]!r} has no parameter record")
    for record in header.params:
        if not record.has_grad:
            continue
        slot = slots.get(record.name)
        if slot is None:
            raise SnapshotError(
                f"{_where(path, record)}: its gradient tensor is missing from the file"
            )
        if slot.dtype != record.dtype or slot.shape != record.shape:
            viewed[record.name] = _real_view(_where(path, record), record, slot)
        if record.attr("is_gtp_weight_remat"):
            _check_gtp(_where(path, record), header, record)
        if spanned > 1:
            _check_full_shape(path, header, record)
    return replace(container, slots={**slots, **viewed}) if viewed else container


def _real_view(where: str, record: ParamRecord, slot: TensorSlot) -> TensorSlot:
    """The slot of a tensor whose dtype safetensors has no code for (``REAL_VIEWS``), as the
    record's dtype and shape: its file holds the real view, the same bytes."""
    stored = REAL_VIEWS.get(str(record.dtype))
    if stored is None or slot.dtype != stored or slot.shape != (*record.shape, 2):
        said = f"{record.dtype}{list(record.shape)}"
        if stored is not None:
            said += f" (kept as {stored}{[*record.shape, 2]})"
        raise SnapshotError(
            f"{where}: tensor is {slot.dtype}{list(slot.shape)} but its record says {said}"
        )
    return slot._replace(dtype=str(record.dtype), shape=record.shape)


def _where(path: Path, record: ParamRecord) -> str:
    return f"{path}: parameter {record.name!r}"


def _check_gtp(where: str, header: RankHeader, record: ParamRecord) -> None:
    axis = "egtp" if record.is_expert else "gtp"
    place = header.coords[axis]
    group = record.attr("gtp_group")
    if group is not None and tuple(group) != place:
        raise SnapshotError(
            f"{where}: GTP group {list(group)} does not match the rank's {axis} coordinate "
            f"{list(place)}"
        )
    pad_length = record.attr("pad_length")
    if pad_length < 0:
        raise SnapshotError(f"{where}: pad_length {pad_length} is negative (rows of padding)")
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


def _check_full_shape(path: Path, header: RankHeader, record: ParamRecord) -> None:
    """The tensor a shard is part of must be one torch can make, though the shard is empty.

    An empty shard passes every byte count, yet rebuilding its tensor (TP shards side by side,
    GTP shards stacked) multiplies a size by the axis size, past torch's 64-bit sizes.
    """
    tp_axis, gtp_axis = (Axis.etp, Axis.egtp) if record.is_expert else (Axis.tp, Axis.gtp)
    scale = header.coords[tp_axis][1] if record.attr("tensor_model_parallel") else 1
    if record.attr("is_gtp_weight_remat"):
        scale *= header.coords[gtp_axis][1]
    if scale == 1 or record.extent * scale <= TORCH_SIZE_LIMIT:
        return  # each shape alone was checked with its record
    for label, shape in (
        ("shape", record.shape),
        ("param_shape", record.param_shape),
        ("fragment_shape", record.attr("fragment_shape")),
    ):
        if shape is not None and not fits_torch(shape, scale):
            raise SnapshotError(
                f"{_where(path, record)}: {label} {list(shape)} across {scale} shards is too "
                "large for torch (its sizes are 64-bit)"
            )


def _check_places(first: RankFile | FileSummary, world_size: int) -> None:
    """The axes of each family must not describe more places than the job has ranks: such
    coordinates would merge ranks as replicas that are not (a dp size with GTP folded in)."""
    problem = too_many_places(first.header.coords, world_size, "the snapshot")
    if problem is not None:
        raise SnapshotError(
            f"{first.path}: {problem} (a data-parallel size that includes GTP or CP ranks?)"
        )


# What every rank file of a snapshot agrees on, with the words that name a difference.
_AGREED_FIELDS = (
    ("version", "format version"),
    ("world_size", "world size"),
    ("step", "step"),
    ("distributed_optimizer", "distributed_optimizer"),
)


_agreed_values = operator.attrgetter(*(key for key, _ in _AGREED_FIELDS))


_every_axis = operator.itemgetter(*AXES)
_dense_places = operator.itemgetter(*_DENSE_PLACES)
_size = operator.itemgetter(1)


def _agreed(header: RankHeader) -> tuple[Any, ...]:
    """The values of ``_AGREED_FIELDS``, then the axis sizes in ``AXES`` order."""
    return *_agreed_values(header), tuple(map(_size, _every_axis(header.coords)))


def _check_whole(folder: Path, files: Sequence[RankFile | FileSummary]) -> None:
    first = files[0]
    agreed = _agreed(first.header)
    for file in files[1:]:
        mine = _agreed(file.header)
        if mine == agreed:
            continue  # the common case, in one comparison; else the first difference is named
        for (_, label), value, theirs in zip(_AGREED_FIELDS, mine[:-1], agreed[:-1], strict=True):
            if value != theirs:
                raise SnapshotError(
                    f"{file.path}: {label} {value} differs from {theirs} in {first.path.name} "
                    f"(a rank file from another snapshot?)"
                )
        for axis, mine_size, first_size in zip(AXES, mine[-1], agreed[-1], strict=True):
            if mine_size != first_size:
                raise SnapshotError(
                    f"{file.path}: axis {axis} has size {mine_size}, but {first_size} in "
                    f"{first.path.name}"
                )
    world_size = first.header.world_size
    for axis, (_, size) in first.header.coords.items():
        # An axis's group is a subset of the job: nothing later may build an axis's worth of
        # anything larger than the rank files present.
        if size > world_size:
            raise SnapshotError(
                f"{first.path}: axis {axis} has size {size}, larger than the world size "
                f"{world_size}"
            )
    _check_places(first, world_size)
    by_rank: dict[int, RankFile | FileSummary] = {}
    # (rank, size) on each axis: the sizes are every file's (checked above).
    places: dict[tuple[tuple[int, int], ...], RankFile | FileSummary] = {}
    for file in files:
        header = file.header
        rank = header.rank
        if rank in by_rank:
            raise SnapshotError(f"{file.path}: rank {rank} is also in {by_rank[rank].path.name}")
        by_rank[rank] = file
        place = _dense_places(header.coords)
        if place in places:
            raise SnapshotError(
                f"{file.path}: rank {file.rank} has the same coordinates as rank "
                f"{places[place].rank} ({places[place].path.name})"
            )
        places[place] = file
    # Each rank is in range(world_size) and none is there twice, so the count of missing ranks
    # is a difference, and the first few gaps turn up within len(files) + 8 steps: nothing here
    # is as large as the world size a header claims.
    missing = world_size - len(by_rank)
    if missing:
        gaps = (rank for rank in itertools.count() if rank not in by_rank)
        shown = ", ".join(str(rank) for rank in itertools.islice(gaps, min(missing, 8)))
        raise SnapshotError(
            f"{folder}: {missing} of {world_size} rank files missing (rank {shown})"
        )

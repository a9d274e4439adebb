"""PyTorch distributed checkpoints (DCP), indexed safely and read one chunk at a time.

A directory written by ``torch.distributed.checkpoint``'s ``FileSystemWriter`` holds a pickled
``.metadata`` (or, saved with ``use_collectives=False``, one ``__{rank}.metadata`` per rank) and
data files whose byte ranges the metadata's storage entries name. This module is the layer
below gradstat's snapshot reader:

- :func:`load_metadata` unpickles one metadata file by allowlist
  (:mod:`gradstat.snapshot.dcp_pickle`: DCP's records as inert stand-ins, anything else
  refused before it exists) and converts it to plain records.
- :func:`open_index` merges the metadata files of a directory into a :class:`DcpIndex` and
  validates it: chunks tile their tensor exactly, every chunk has a storage entry inside the
  directory, data files are long enough, nothing is transformed (compressed, encrypted).
- :func:`read_chunk` and :func:`iter_chunks` read a chunk's exact byte range, a ``torch.save``
  record (loaded with ``weights_only=True``) or a tensor of a safetensors data file, and check
  it against the metadata. Bytes entries (pickled objects) are listed, never read.

What each key holds (a gradient, an Adam moment, a weight) is for
:mod:`gradstat.snapshot.checkpoint` to say, which reads a checkpoint as a snapshot.
"""

from __future__ import annotations

import gc
import io
import math
import os
import re
import stat
import struct
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, replace
from pathlib import Path, PurePosixPath, PureWindowsPath
from typing import IO, Any

import torch

from gradstat.errors import SnapshotError
from gradstat.snapshot.container import open_regular
from gradstat.snapshot.dcp_pickle import Inert, MetadataUnpickler
from gradstat.snapshot.format import load_json

__all__ = [
    "BytesEntry",
    "ChunkRef",
    "DcpIndex",
    "MetadataFile",
    "StorageRef",
    "TensorEntry",
    "is_dcp_directory",
    "iter_chunks",
    "load_metadata",
    "metadata_paths",
    "open_index",
    "read_chunk",
]

GLOBAL_METADATA = ".metadata"
_RANK_METADATA = re.compile(r"__(\d+)\.metadata")

_ZIP_MAGIC = b"PK\x03\x04"
_SAFETENSORS_DTYPES: dict[str, torch.dtype] = {
    name: dtype
    for name, dtype in {
        "F64": torch.float64,
        "F32": torch.float32,
        "F16": torch.float16,
        "BF16": torch.bfloat16,
        "I64": torch.int64,
        "I32": torch.int32,
        "I16": torch.int16,
        "I8": torch.int8,
        "U8": torch.uint8,
        "BOOL": torch.bool,
        "C64": torch.complex64,
        "F8_E4M3": getattr(torch, "float8_e4m3fn", None),
        "F8_E5M2": getattr(torch, "float8_e5m2", None),
        "F8_E4M3FNUZ": getattr(torch, "float8_e4m3fnuz", None),
        "F8_E5M2FNUZ": getattr(torch, "float8_e5m2fnuz", None),
        "F8_E8M0": getattr(torch, "float8_e8m0fnu", None),  # MX block scales
        "U16": getattr(torch, "uint16", None),
        "U32": getattr(torch, "uint32", None),
        "U64": getattr(torch, "uint64", None),
    }.items()
    if dtype is not None
}
_MAX_SAFETENSORS_HEADER = 100 * 2**20
# DCP's key in a safetensors data file's __metadata__: per fqn, the offsets of its chunk.
_SAFETENSORS_SHARDING_KEY = "DCP_SHARDING_INFO"
# gradstat's key in its rank files' __metadata__ (gradstat.snapshot.format.METADATA_KEY).
_GRADSTAT_KEY = "gradstat"
# A Hugging Face checkpoint's index, and its files' names (DCP's HuggingFaceStorageWriter adds
# "shard-R-" per rank before consolidation).
_HF_INDEX = "model.safetensors.index.json"
_HF_SHARD_NAME = re.compile(r"(?:shard-(\d+)-)?model-(\d+)-of-(\d+)\.safetensors")
_HF_SHARDED = re.compile(r"shard-\d+-")


# --- Index records --------------------------------------------------------------------------


@dataclass(frozen=True)
class StorageRef:
    """Where one chunk or bytes entry lies: ``[offset, offset + length)`` of a data file.

    ``relative_path`` is as the metadata names it (relative to the checkpoint directory);
    ``transform_descriptors`` lists DCP's stream transforms (compression, encryption), empty for
    a plain entry.
    """

    relative_path: str
    offset: int
    length: int
    transform_descriptors: tuple[str, ...] = ()


@dataclass(frozen=True)
class ChunkRef:
    """One stored chunk of a tensor: its place in the global tensor and its bytes.

    ``copies`` counts how many times the same chunk (identical offsets and sizes) was stored
    (rank-local metadata keeps every rank's copy of a replicated tensor); the chunk is read
    once, from ``storage``, the first copy in metadata-file order, and ``others`` are where the
    further copies lie (``audit`` compares them with it).
    """

    fqn: str
    offsets: tuple[int, ...]
    sizes: tuple[int, ...]
    dtype: torch.dtype
    storage: StorageRef
    copies: int = 1
    others: tuple[StorageRef, ...] = ()

    @property
    def numel(self) -> int:
        """Number of elements in the chunk."""
        return math.prod(self.sizes)

    @property
    def slices(self) -> tuple[slice, ...]:
        """The chunk's place in the global tensor, as an index (``full[chunk.slices]``)."""
        return tuple(
            slice(offset, offset + size)
            for offset, size in zip(self.offsets, self.sizes, strict=True)
        )


@dataclass(frozen=True)
class TensorEntry:
    """A tensor of the checkpoint: global shape and dtype, and its chunks in offset order."""

    fqn: str
    size: tuple[int, ...]
    dtype: torch.dtype
    chunks: tuple[ChunkRef, ...]

    @property
    def numel(self) -> int:
        """Number of elements in the global tensor."""
        return math.prod(self.size)


@dataclass(frozen=True)
class BytesEntry:
    """A non-tensor entry (a pickled object); listed, never unpickled."""

    fqn: str
    storage: StorageRef | None
    copies: int = 1


@dataclass(frozen=True)
class _ChunkMeta:
    offsets: tuple[int, ...]
    sizes: tuple[int, ...]


@dataclass(frozen=True)
class _TensorMeta:
    size: tuple[int, ...]
    dtype: torch.dtype
    chunks: tuple[_ChunkMeta, ...]


@dataclass(frozen=True)
class MetadataFile:
    """One metadata file as pickled, converted to plain records; not yet checked against files.

    Attributes:
        path: the file read.
        tensors: fqn to its global size, dtype and chunk list (as stored, duplicates kept).
        bytes_fqns: the fqns of bytes entries, in metadata order.
        storage: ``(fqn, chunk offsets)`` (``(fqn, None)`` for a bytes entry) to its storage.
        version: the DCP version string the writer recorded, if any.
        planner_data: the planner's data, inert (a flatten mapping for DCP's default planner).
    """

    path: Path
    tensors: Mapping[str, _TensorMeta]
    bytes_fqns: tuple[str, ...]
    storage: Mapping[tuple[str, tuple[int, ...] | None], StorageRef]
    version: str | None
    planner_data: Any


@dataclass(frozen=True)
class DcpIndex:
    """A checkpoint directory's validated index.

    Attributes:
        directory: the checkpoint directory.
        metadata_files: the metadata files merged (``.metadata``, or every ``__R.metadata``).
        tensors: fqn to its entry, in the order the metadata lists them.
        bytes_entries: fqn to its entry.
        version: the DCP version of the first metadata file.
    """

    directory: Path
    metadata_files: tuple[Path, ...]
    tensors: Mapping[str, TensorEntry]
    bytes_entries: Mapping[str, BytesEntry]
    version: str | None

    def chunks_by_file(self, fqns: Iterable[str] | None = None) -> dict[str, list[ChunkRef]]:
        """Chunks grouped by data file (files sorted by path), each in storage-offset order.

        Args:
            fqns: only these tensors' chunks (unknown names are ignored); every tensor if None.
        """
        wanted = self.tensors.keys() if fqns is None else set(fqns)
        by_file: dict[str, list[ChunkRef]] = {}
        for fqn, entry in self.tensors.items():
            if fqn in wanted:
                for chunk in entry.chunks:
                    by_file.setdefault(chunk.storage.relative_path, []).append(chunk)
        return {
            path: sorted(by_file[path], key=lambda chunk: chunk.storage.offset)
            for path in sorted(by_file)
        }


# --- Loading metadata -----------------------------------------------------------------------


def load_metadata(path: Path) -> MetadataFile:
    """Unpickle one DCP metadata file by allowlist and convert it to plain records.

    Args:
        path: a ``.metadata`` or ``__{rank}.metadata`` file.

    Returns:
        Its tensors, bytes entries and storage entries, unchecked against the data files (see
        :func:`open_index` for that).

    Raises:
        SnapshotError: one line naming the file: unreadable, not a pickle, truncated, a global
            outside the allowlist (named as ``module.name``; nothing it names was called), or
            a pickle that is not DCP metadata.
    """
    try:
        with os.fdopen(open_regular(path), "rb") as file:
            raw = MetadataUnpickler(file, path).load()
    except SnapshotError:  # not a regular file; a global outside the allowlist (Refused)
        raise
    except FileNotFoundError as error:
        raise SnapshotError(f"{path}: no such file") from error
    except OSError as error:
        raise SnapshotError(f"{path}: cannot read ({error.strerror or error})") from error
    except Exception as error:  # an untrusted pickle of allowed objects fails in any way
        raise SnapshotError(
            f"{path}: not a readable DCP metadata pickle ({_one_line(error)}): truncated or "
            "damaged; save the checkpoint again"
        ) from error
    try:
        return _convert(path, raw)
    except SnapshotError:
        raise
    except Exception as error:  # a well-formed pickle whose records hold the wrong types
        raise SnapshotError(
            f"{path}: DCP metadata with malformed records ({_one_line(error)})"
        ) from error


def _one_line(error: BaseException) -> str:
    text = " ".join(str(error).split())
    text = f"{type(error).__name__}: {text}" if text else type(error).__name__
    return text if len(text) <= 200 else text[:197] + "..."


def _ints(value: Any, what: str) -> tuple[int, ...]:
    if not isinstance(value, (tuple, list)) or not all(
        type(item) is int and item >= 0 for item in value
    ):
        raise ValueError(f"{what} is {value!r}, not a sequence of non-negative ints")
    return tuple(value)


def _dtype_of(properties: Any) -> torch.dtype:
    dtype = getattr(properties, "dtype", None)
    state = getattr(properties, "_state", None)
    if dtype is None and type(state) is tuple and state:
        dtype = state[0]  # TensorProperties pickles (dtype, layout, ...)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"tensor properties without a torch dtype ({dtype!r})")
    return dtype


def _convert(path: Path, raw: Any) -> MetadataFile:
    entries = getattr(raw, "state_dict_metadata", None)
    storage_data = getattr(raw, "storage_data", None)
    if not isinstance(entries, dict):
        raise SnapshotError(
            f"{path}: a pickle of {type(raw).__name__}, not DCP metadata (no "
            "state_dict_metadata dict); is this a torch.distributed.checkpoint directory?"
        )
    if not isinstance(storage_data, dict):
        raise SnapshotError(
            f"{path}: DCP metadata without storage entries (storage_data is "
            f"{type(storage_data).__name__}); it was not written by FileSystemWriter"
        )
    tensors: dict[str, _TensorMeta] = {}
    bytes_fqns: list[str] = []
    for fqn, entry in entries.items():
        if type(fqn) is not str:
            raise SnapshotError(f"{path}: a state_dict_metadata key {fqn!r} is not a string")
        if hasattr(entry, "chunks"):
            size = _ints(getattr(entry, "size", None), f"{fqn!r} size")
            chunks = []
            for chunk in entry.chunks:
                offsets = _ints(getattr(chunk, "offsets", None), f"{fqn!r} chunk offsets")
                sizes = _ints(getattr(chunk, "sizes", None), f"{fqn!r} chunk sizes")
                chunks.append(_ChunkMeta(offsets, sizes))
            properties = getattr(entry, "properties", None)
            tensors[fqn] = _TensorMeta(size, _dtype_of(properties), tuple(chunks))
        elif isinstance(entry, Inert) and entry._origin.endswith(".BytesStorageMetadata"):
            bytes_fqns.append(fqn)
        else:
            raise SnapshotError(
                f"{path}: entry {fqn!r} is a {entry!r}, neither tensor nor bytes metadata"
            )
    storage: dict[tuple[str, tuple[int, ...] | None], StorageRef] = {}
    for index, info in storage_data.items():
        fqn = getattr(index, "fqn", None)
        if type(fqn) is not str:
            raise SnapshotError(f"{path}: a storage entry's key {index!r} names no fqn")
        raw_offset = getattr(index, "offset", None)
        offset = None if raw_offset is None else _ints(raw_offset, f"{fqn!r} storage offset")
        relative_path = getattr(info, "relative_path", None)
        start = getattr(info, "offset", None)
        length = getattr(info, "length", None)
        descriptors = getattr(info, "transform_descriptors", None) or ()
        if (
            type(relative_path) is not str
            or type(start) is not int
            or type(length) is not int
            or start < 0
            or length < 0
            or not all(type(item) is str for item in descriptors)
        ):
            raise SnapshotError(
                f"{path}: storage entry of {fqn!r} is malformed (relative_path "
                f"{relative_path!r}, offset {start!r}, length {length!r})"
            )
        storage[fqn, offset] = StorageRef(relative_path, start, length, tuple(descriptors))
    version = getattr(raw, "version", None)
    return MetadataFile(
        path=path,
        tensors=tensors,
        bytes_fqns=tuple(bytes_fqns),
        storage=storage,
        version=version if type(version) is str else None,
        planner_data=getattr(raw, "planner_data", None),
    )


# --- The index ------------------------------------------------------------------------------


def metadata_paths(directory: Path) -> list[Path]:
    """The metadata files of a checkpoint directory, in the order they are merged.

    ``.metadata`` alone when it exists (a collective save); otherwise every ``__{rank}.metadata``
    (saved with ``use_collectives=False``), by rank. Empty when there is none.
    """
    global_path = directory / GLOBAL_METADATA
    if os.path.lexists(global_path):  # whatever it is: loading it says what is wrong
        return [global_path]
    try:
        names = os.listdir(directory)
    except OSError:
        return []
    ranked = [(int(match[1]), name) for name in names if (match := _RANK_METADATA.fullmatch(name))]
    return [directory / name for _, name in sorted(ranked)]


def is_dcp_directory(directory: Path) -> bool:
    """Whether ``directory`` has DCP metadata (``.metadata`` or ``__R.metadata`` files), or is
    a checkpoint in Hugging Face's safetensors layout (see :func:`hf_files`)."""
    return directory.is_dir() and bool(
        metadata_paths(directory) or os.path.lexists(directory / _HF_INDEX) or hf_files(directory)
    )


def hf_files(directory: Path) -> list[str]:
    """The ``*.safetensors`` files of a checkpoint in Hugging Face's layout, sorted: what DCP's
    ``HuggingFaceStorageWriter`` writes (consolidated, or one file per rank whose
    ``DCP_SHARDING_INFO`` says where each tensor's chunk lies) and any Hugging Face model
    folder. Empty where ``directory`` holds none, or where its first such file is a gradstat
    rank file (its metadata names gradstat) or cannot be read as safetensors. (DCP metadata,
    looked for first, makes it a DCP checkpoint of the other kind.)
    """
    try:
        names = sorted(name for name in os.listdir(directory) if name.endswith(".safetensors"))
    except OSError:
        return []
    if not names:
        return []
    try:
        metadata = _hf_header(directory / names[0]).get("__metadata__")
    except SnapshotError:
        return []
    return [] if type(metadata) is dict and _GRADSTAT_KEY in metadata else names


def _hf_header(path: Path) -> dict[str, Any]:
    """The JSON header of a whole safetensors file, checked to be an object."""
    try:
        with os.fdopen(open_regular(path), "rb") as file:
            return _blob_header(file, path, str(path), 0)[1]
    except OSError as error:
        raise SnapshotError(f"{path}: cannot read ({error.strerror or error})") from error


def _blob_header(file: IO[bytes], path: Path, where: str, start: int) -> tuple[int, dict[str, Any]]:
    """Where the data of the safetensors blob at byte ``start`` begins, and its JSON header,
    checked to be an object; ``where`` begins each message."""
    file.seek(start)
    prefix = file.read(8)
    length = struct.unpack("<Q", prefix)[0] if len(prefix) == 8 else 0
    if not 0 < length <= _MAX_SAFETENSORS_HEADER:
        raise SnapshotError(f"{where}: no safetensors header at byte {start} (no header length)")
    raw = file.read(length)
    if len(raw) != length:
        raise SnapshotError(f"{where}: the file ends inside the safetensors header at {start}")
    try:
        header = load_json(path, raw.decode("utf-8"), "its safetensors header")
    except ValueError as error:
        why = _one_line(error)
        raise SnapshotError(f"{where}: no safetensors header at byte {start} ({why})") from error
    if type(header) is not dict:
        raise SnapshotError(f"{where}: the safetensors header at {start} is not a JSON object")
    return start + 8 + length, header


def _hf_metadata(directory: Path, names: list[str]) -> list[MetadataFile]:
    """Each safetensors file of a Hugging Face checkpoint as a metadata file of its own: its
    tensors, each one chunk (whole, or at the offsets its ``DCP_SHARDING_INFO`` gives), stored
    in a blob at byte 0; a tensor's global shape is its chunks' extent, as DCP's
    ``HuggingFaceStorageReader`` takes it."""
    _check_hf_complete(directory, names)
    found: list[tuple[str, str, torch.dtype, tuple[int, ...], tuple[int, ...], int]] = []
    for name in names:
        path = directory / name
        header = _hf_header(path)
        metadata = header.pop("__metadata__", {})
        if type(metadata) is not dict:
            raise SnapshotError(f"{path}: its safetensors __metadata__ is not a JSON object")
        if _GRADSTAT_KEY in metadata:
            raise SnapshotError(
                f"{directory / names[0]}: a safetensors file without gradstat metadata beside "
                f"gradstat rank files ({name}): a damaged rank file, or a file of another kind "
                "(keep each kind in a directory of its own)"
            )
        sharding = _sharding(path, metadata)
        for fqn, record in header.items():
            dtype, shape, begin, end = _blob_record(f"{path}: tensor {fqn!r}", record)
            offsets = (0,) * len(shape) if sharding is None else sharding.get(fqn)
            if offsets is None or len(offsets) != len(shape):
                raise SnapshotError(
                    f"{path}: tensor {fqn!r}: its DCP_SHARDING_INFO gives no offsets of "
                    f"{len(shape)} dimensions"
                )
            found.append((name, fqn, dtype, shape, offsets, end - begin))
    sizes: dict[str, tuple[int, ...]] = {}
    for _, fqn, _, shape, offsets, _ in found:
        extent = tuple(offset + size for offset, size in zip(offsets, shape, strict=True))
        known = sizes.get(fqn, extent)
        if len(known) != len(extent):
            raise SnapshotError(
                f"{directory}: tensor {fqn!r} has chunks of {len(known)} and {len(extent)} "
                "dimensions"
            )
        sizes[fqn] = tuple(max(a, b) for a, b in zip(known, extent, strict=True))
    tensors: dict[str, dict[str, _TensorMeta]] = {}
    storage: dict[str, dict[tuple[str, tuple[int, ...] | None], StorageRef]] = {}
    for name, fqn, dtype, shape, offsets, nbytes in found:
        chunk = _ChunkMeta(offsets, shape)
        tensors.setdefault(name, {})[fqn] = _TensorMeta(sizes[fqn], dtype, (chunk,))
        storage.setdefault(name, {})[(fqn, offsets)] = StorageRef(name, 0, nbytes)
    return [
        MetadataFile(directory / name, tensors[name], (), storage[name], None, None)
        for name in tensors
    ]


def _check_hf_complete(directory: Path, names: list[str]) -> None:
    """The files a Hugging Face checkpoint names are all there: those of its
    ``model.safetensors.index.json``, and every ``model-K-of-N`` of each rank's
    ``shard-R-model-K-of-N`` run, ranks 1 to the highest (a missing last rank's file cannot be
    told: nothing records a tensor's full shape in that layout)."""
    index = directory / _HF_INDEX
    if os.path.lexists(index):
        try:
            with os.fdopen(open_regular(index), "rb") as file:
                text = file.read().decode("utf-8")
            weight_map = load_json(index, text, "the index")["weight_map"]
            named = {str(name) for name in weight_map.values()}
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as error:
            raise SnapshotError(f"{index}: not a safetensors index ({_one_line(error)})") from error
        missing = sorted(named - set(names))
        if missing:
            raise SnapshotError(f"{directory / missing[0]}: named by {_HF_INDEX}, but missing")
    parts: dict[int, set[tuple[int, int]]] = {}
    for name in names:
        match = _HF_SHARD_NAME.fullmatch(name)
        if match is not None:
            rank = int(match[1] or 1)
            parts.setdefault(rank, set()).add((int(match[2]), int(match[3])))
    for rank in range(1, max(parts, default=0) + 1):
        held = parts.get(rank, set())
        total = max((count for _, count in held), default=0)
        gone = [part for part in range(1, total + 1) if (part, total) not in held]
        if not held or gone:
            shard = f"shard-{rank:05d}-" if any(_HF_SHARDED.match(name) for name in names) else ""
            what = f"{shard}model-{(gone or [1])[0]:05d}-of-{max(total, 1):05d}.safetensors"
            raise SnapshotError(f"{directory}: no file {what}: the checkpoint is incomplete")


def _sharding(path: Path, metadata: dict[str, Any]) -> dict[str, tuple[int, ...]] | None:
    """The chunk offsets a per-rank file's ``DCP_SHARDING_INFO`` gives, by fqn; None without."""
    info = metadata.get(_SAFETENSORS_SHARDING_KEY)
    if info is None:
        return None
    try:
        parsed = load_json(path, info, "its DCP_SHARDING_INFO") if type(info) is str else None
        offsets = {
            fqn: _ints(entry["saved_offsets"], "saved_offsets")
            for fqn, entry in parsed.items()  # type: ignore[union-attr]
        }
    except (ValueError, TypeError, KeyError, AttributeError) as error:
        raise SnapshotError(
            f"{path}: its DCP_SHARDING_INFO is not a JSON object of saved_offsets "
            f"({_one_line(error)})"
        ) from error
    return offsets


def _blob_record(where: str, record: Any) -> tuple[torch.dtype, tuple[int, ...], int, int]:
    """A safetensors header entry's dtype, shape and data offsets, checked: a dtype gradstat
    reads, and offsets that span the shape's bytes."""
    if type(record) is not dict or record.get("dtype") not in _SAFETENSORS_DTYPES:
        code = record.get("dtype") if type(record) is dict else None
        raise SnapshotError(f"{where}: dtype {code!r} is not one gradstat reads")
    try:
        shape = _ints(record.get("shape"), "its shape")
        begin, end = _ints(record.get("data_offsets"), "its data_offsets")
    except ValueError as error:
        raise SnapshotError(f"{where}: {error}") from error
    dtype = _SAFETENSORS_DTYPES[record["dtype"]]
    nbytes = math.prod(shape) * dtype.itemsize
    if end - begin != nbytes:
        raise SnapshotError(
            f"{where}: data_offsets span {end - begin} bytes, its shape {list(shape)} of "
            f"{dtype} needs {nbytes}"
        )
    return dtype, shape, begin, end


def open_index(directory: Path) -> DcpIndex:
    """Index a DCP checkpoint directory and validate it against its data files.

    Every metadata file is loaded by :func:`load_metadata`; rank-local files are merged. A chunk
    stored more than once with identical offsets and sizes (each rank's copy of a replicated
    tensor, in rank-local metadata) counts once: the copy of the lowest metadata file is kept
    and ``copies`` counts them all; every copy's storage is validated. Chunks that differ but
    intersect are an overlap.

    Returns:
        The index; its tensors' chunks tile each tensor exactly, and each chunk's bytes lie in a
        plain (untransformed) entry of a data file inside the directory that is long enough.

    Raises:
        SnapshotError: one line naming the directory (or file) and the fqn: no metadata, a
            metadata file :func:`load_metadata` refuses, disagreeing rank-local files, a chunk
            outside its tensor, overlapping chunks, a gap, a chunk without a storage entry, a
            storage path that is absolute or leaves the directory, a transformed entry, a
            missing or short data file.
    """
    if not directory.is_dir():
        raise SnapshotError(f"{directory}: not a directory; a DCP checkpoint is a directory")
    paths = metadata_paths(directory)
    names = [] if paths else hf_files(directory)
    if not paths and not names and not os.path.lexists(directory / _HF_INDEX):
        raise SnapshotError(
            f"{directory}: no .metadata or __R.metadata file; not a torch.distributed.checkpoint "
            "directory, or its save did not finish"
        )
    files = [load_metadata(path) for path in paths] if paths else _hf_metadata(directory, names)
    paths = paths or [meta.path for meta in files]
    tensors: dict[str, TensorEntry] = {}
    declared_in: dict[str, Path] = {}
    bytes_entries: dict[str, BytesEntry] = {}
    stored: list[tuple[str, StorageRef]] = []
    for meta in files:
        for fqn, tensor in meta.tensors.items():
            if fqn in bytes_entries:
                raise SnapshotError(
                    f"{meta.path}: {fqn!r} is a tensor here and a bytes entry in an earlier "
                    "metadata file; the rank-local metadata files disagree"
                )
            _merge_tensor(directory, meta, fqn, tensor, tensors, declared_in, stored)
        for fqn in meta.bytes_fqns:
            if fqn in tensors:
                raise SnapshotError(
                    f"{meta.path}: {fqn!r} is a bytes entry here and a tensor in "
                    f"{declared_in[fqn]}; the rank-local metadata files disagree"
                )
            storage = meta.storage.get((fqn, None))
            if storage is not None:
                _check_path(directory, fqn, storage)
            known = bytes_entries.get(fqn)
            if known is None:
                bytes_entries[fqn] = BytesEntry(fqn, storage)
            else:
                bytes_entries[fqn] = BytesEntry(fqn, known.storage or storage, known.copies + 1)
    merged = {fqn: _validated(directory, entry) for fqn, entry in tensors.items()}
    _check_lengths(directory, stored)
    return DcpIndex(
        directory=directory,
        metadata_files=tuple(paths),
        tensors=merged,
        bytes_entries=bytes_entries,
        version=files[0].version,
    )


def _merge_tensor(
    directory: Path,
    meta: MetadataFile,
    fqn: str,
    tensor: _TensorMeta,
    tensors: dict[str, TensorEntry],
    declared_in: dict[str, Path],
    stored: list[tuple[str, StorageRef]],
) -> None:
    known = tensors.get(fqn)
    if known is not None and (known.size != tensor.size or known.dtype != tensor.dtype):
        raise SnapshotError(
            f"{meta.path}: tensor {fqn!r} is {list(tensor.size)} {tensor.dtype} here and "
            f"{list(known.size)} {known.dtype} in {declared_in[fqn]}; the rank-local metadata "
            "files disagree"
        )
    chunks = {(chunk.offsets, chunk.sizes): chunk for chunk in known.chunks} if known else {}
    for chunk in tensor.chunks:
        storage = meta.storage.get((fqn, chunk.offsets))
        if storage is None:
            raise SnapshotError(
                f"{meta.path}: tensor {fqn!r}: chunk at offsets {list(chunk.offsets)} has no "
                "storage entry; the metadata is damaged or was edited"
            )
        _check_path(directory, fqn, storage)
        if storage.transform_descriptors:
            raise SnapshotError(
                f"{directory}: tensor {fqn!r}: its chunk at offsets {list(chunk.offsets)} is "
                f"stored transformed ({', '.join(storage.transform_descriptors)}); gradstat "
                "reads plain entries only: save without the stream transforms"
            )
        stored.append((fqn, storage))
        key = (chunk.offsets, chunk.sizes)
        seen = chunks.get(key)
        if seen is None:
            chunks[key] = ChunkRef(fqn, chunk.offsets, chunk.sizes, tensor.dtype, storage)
        else:
            others = (*seen.others, storage)
            chunks[key] = replace(seen, copies=seen.copies + 1, others=others)
    tensors[fqn] = TensorEntry(fqn, tensor.size, tensor.dtype, tuple(chunks.values()))
    declared_in.setdefault(fqn, meta.path)


def _validated(directory: Path, entry: TensorEntry) -> TensorEntry:
    """``entry`` with its chunks in offset order, once they tile its shape exactly."""
    where = f"{directory}: tensor {entry.fqn!r}"
    for chunk in entry.chunks:
        if len(chunk.offsets) != len(entry.size) or len(chunk.sizes) != len(entry.size):
            raise SnapshotError(
                f"{where}: chunk at offsets {list(chunk.offsets)} sizes {list(chunk.sizes)} has "
                f"another number of dimensions than the tensor's shape {list(entry.size)}"
            )
        if any(
            offset + size > dim
            for offset, size, dim in zip(chunk.offsets, chunk.sizes, entry.size, strict=True)
        ):
            raise SnapshotError(
                f"{where}: chunk at offsets {list(chunk.offsets)} sizes {list(chunk.sizes)} "
                f"lies outside the global shape {list(entry.size)}"
            )
    chunks = sorted(entry.chunks, key=lambda chunk: (chunk.offsets, chunk.sizes))
    _check_no_overlap(where, chunks)
    covered = sum(chunk.numel for chunk in chunks)
    if covered != entry.numel:
        raise SnapshotError(
            f"{where}: its chunks cover {covered} of its {entry.numel} elements "
            f"(shape {list(entry.size)}): a gap; the checkpoint is incomplete (a rank's "
            "metadata missing?) or its metadata was edited"
        )
    return TensorEntry(entry.fqn, entry.size, entry.dtype, tuple(chunks))


def _check_no_overlap(where: str, chunks: list[ChunkRef]) -> None:
    """Refuse two chunks that share an element (a sweep along the first dimension)."""
    solid = [chunk for chunk in chunks if chunk.numel > 0]
    if not solid or not solid[0].offsets:
        if len(solid) > 1:  # two scalar chunks: identical ones were merged already
            raise SnapshotError(f"{where}: the scalar is stored in {len(solid)} chunks")
        return
    solid.sort(key=lambda chunk: chunk.offsets[0])
    active: list[ChunkRef] = []
    for chunk in solid:
        start = chunk.offsets[0]
        active = [other for other in active if other.offsets[0] + other.sizes[0] > start]
        for other in active:
            if all(
                max(a, b) < min(a + m, b + n)
                for a, m, b, n in zip(
                    other.offsets, other.sizes, chunk.offsets, chunk.sizes, strict=True
                )
            ):
                raise SnapshotError(
                    f"{where}: chunks at offsets {list(other.offsets)} sizes "
                    f"{list(other.sizes)} and at offsets {list(chunk.offsets)} sizes "
                    f"{list(chunk.sizes)} overlap; the checkpoint's metadata is inconsistent"
                )
        active.append(chunk)


def _check_path(directory: Path, fqn: str, storage: StorageRef) -> Path:
    """The data file of a storage entry, once its path is known to stay inside ``directory``."""
    relative = storage.relative_path
    problem = None
    if not relative or "\x00" in relative:
        problem = "is empty or holds a NUL byte"
    elif (
        PurePosixPath(relative).is_absolute()
        or PureWindowsPath(relative).is_absolute()
        or PureWindowsPath(relative).drive
    ):
        problem = "is absolute"
    elif ".." in PurePosixPath(relative).parts or ".." in PureWindowsPath(relative).parts:
        problem = "climbs out with '..'"
    else:
        root = os.path.realpath(directory)
        target = os.path.realpath(directory / relative)
        if os.path.commonpath([root, target]) != root:
            problem = f"resolves (through a symlink) to {target}, outside the directory"
    if problem is not None:
        raise SnapshotError(
            f"{directory}: entry {fqn!r}: storage path {relative!r} {problem}; gradstat reads "
            "only files inside the checkpoint directory"
        )
    return directory / relative


def _check_lengths(directory: Path, stored: list[tuple[str, StorageRef]]) -> None:
    """Each data file exists, is a regular file, and holds every chunk's byte range.

    ``stored`` holds every copy of every chunk: copies not read are part of the checkpoint too.
    A short file is named with the first entry it cuts (the lowest offset past its end).
    """
    by_file: dict[str, list[tuple[int, int, str]]] = {}
    for fqn, storage in stored:
        by_file.setdefault(storage.relative_path, []).append(
            (storage.offset, storage.offset + storage.length, fqn)
        )
    for relative, ranges in sorted(by_file.items()):
        path = directory / relative
        try:
            info = os.stat(path)
        except FileNotFoundError as error:
            raise SnapshotError(
                f"{path}: data file of tensor {ranges[0][2]!r} is missing; copy the whole "
                "checkpoint directory"
            ) from error
        except OSError as error:
            raise SnapshotError(f"{path}: cannot read ({error.strerror or error})") from error
        if not stat.S_ISREG(info.st_mode):
            raise SnapshotError(
                f"{path}: data file of tensor {ranges[0][2]!r} is not a regular file"
            )
        cut = sorted(item for item in ranges if item[1] > info.st_size)
        if cut:
            start, end, fqn = cut[0]
            raise SnapshotError(
                f"{path}: {info.st_size} bytes, but tensor {fqn!r} is stored at bytes "
                f"[{start}, {end}) ({len(cut)} entries past the end): the file is truncated; "
                "copy it again"
            )


# --- Reading chunks -------------------------------------------------------------------------


def read_chunk(directory: Path, chunk: ChunkRef) -> torch.Tensor:
    """One chunk's tensor, read from exactly its storage range and checked against the index.

    Args:
        directory: the checkpoint directory (the index's ``directory``).
        chunk: a chunk of the index.

    Returns:
        A CPU tensor of shape ``chunk.sizes`` and dtype ``chunk.dtype``.

    Raises:
        SnapshotError: one line naming the fqn and the data file: the path leaves the
            directory, the file is missing or short, its bytes are not a tensor record, or
            the tensor's shape or dtype differ from the metadata's.
    """
    path = _check_path(directory, chunk.fqn, chunk.storage)
    try:
        with os.fdopen(open_regular(path), "rb") as file:
            return _read_from(file, path, chunk, {})
    except FileNotFoundError as error:
        raise SnapshotError(f"{path}: data file of tensor {chunk.fqn!r} is missing") from error
    except OSError as error:
        raise SnapshotError(f"{path}: cannot read ({error.strerror or error})") from error


def iter_chunks(
    index: DcpIndex,
    *,
    fqns: Iterable[str] | None = None,
    files: Iterable[str] | None = None,
) -> Iterator[tuple[str, ChunkRef, torch.Tensor]]:
    """Every chunk's tensor, file by file: each data file opened once, read in offset order.

    A caller that drops each tensor before asking for the next holds about one chunk at a time.

    Args:
        index: the checkpoint's index.
        fqns: only these tensors (all if None).
        files: only chunks stored in these data files, by relative path (all if None); a
            process of a launched job can take its share of the files.

    Yields:
        ``(fqn, chunk, tensor)`` as :func:`read_chunk` returns the tensor.

    Raises:
        SnapshotError: as :func:`read_chunk`.
    """
    by_file = index.chunks_by_file(fqns)
    selected = by_file.keys() if files is None else [name for name in files if name in by_file]
    for relative in selected:
        chunks = by_file[relative]
        path = _check_path(index.directory, chunks[0].fqn, chunks[0].storage)
        headers: dict[int, tuple[int, dict[str, Any]]] = {}
        try:
            with os.fdopen(open_regular(path), "rb") as file:  # not a FIFO swapped in since
                for chunk in chunks:
                    yield chunk.fqn, chunk, _read_from(file, path, chunk, headers)
        except FileNotFoundError as error:
            raise SnapshotError(
                f"{path}: data file of tensor {chunks[0].fqn!r} is missing"
            ) from error
        except OSError as error:
            raise SnapshotError(f"{path}: cannot read ({error.strerror or error})") from error


def _read_exactly(file: IO[bytes], path: Path, fqn: str, start: int, length: int) -> bytes:
    file.seek(start)
    data = file.read(length)
    if len(data) != length:
        raise SnapshotError(
            f"{path}: tensor {fqn!r} is stored at bytes [{start}, {start + length}) but the file "
            f"ends at {start + len(data)}: truncated; copy it again"
        )
    return data


def _read_from(
    file: IO[bytes],
    path: Path,
    chunk: ChunkRef,
    headers: dict[int, tuple[int, dict[str, Any]]],
) -> torch.Tensor:
    storage = chunk.storage
    if storage.transform_descriptors:
        raise SnapshotError(
            f"{path}: tensor {chunk.fqn!r} is stored transformed "
            f"({', '.join(storage.transform_descriptors)}); gradstat reads plain entries only"
        )
    magic = _read_exactly(file, path, chunk.fqn, storage.offset, min(4, storage.length))
    if magic == _ZIP_MAGIC:
        data = _read_exactly(file, path, chunk.fqn, storage.offset, storage.length)
        try:
            tensor = _load_record(data)
        except Exception as error:  # a damaged record fails in any way
            raise SnapshotError(
                f"{path}: tensor {chunk.fqn!r}: the torch.save record at bytes "
                f"[{storage.offset}, {storage.offset + storage.length}) does not load "
                f"({_one_line(error)})"
            ) from error
        if not isinstance(tensor, torch.Tensor):
            raise SnapshotError(
                f"{path}: tensor {chunk.fqn!r}: its record holds a {type(tensor).__name__}, "
                "not a tensor"
            )
    else:
        tensor = _read_safetensors(file, path, chunk, headers)
    if tuple(tensor.shape) != chunk.sizes or tensor.dtype != chunk.dtype:
        raise SnapshotError(
            f"{path}: tensor {chunk.fqn!r}: the chunk at offsets {list(chunk.offsets)} holds "
            f"{list(tensor.shape)} {tensor.dtype}, the metadata says {list(chunk.sizes)} "
            f"{chunk.dtype}; the metadata does not describe this file"
        )
    return tensor


def _load_record(data: bytes) -> Any:
    """``torch.load`` of a chunk's ``torch.save`` record.

    ``torch.load`` defines a class each call, and a class refers to itself: every call leaves a
    few objects that only the collector frees. Where collection is off (the command line turns
    it off for a command: ``gradstat.cli.app.main``), a checkpoint of a million chunks would
    keep them all; they are collected here instead, a call's worth at a time.
    """
    loaded = torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
    if not gc.isenabled():
        gc.collect(0)
    return loaded


def _read_safetensors(
    file: IO[bytes],
    path: Path,
    chunk: ChunkRef,
    headers: dict[int, tuple[int, dict[str, Any]]],
) -> torch.Tensor:
    """A chunk of a data file DCP wrote with ``SerializationFormat.SAFETENSORS``.

    Such a file holds its bytes entries first, then one safetensors blob with every tensor of
    the file; each tensor's storage offset is the blob's start (its length the tensor's bytes),
    and the tensor is found in the blob's header by its fqn.
    """
    start = chunk.storage.offset
    where = f"{path}: tensor {chunk.fqn!r}"
    if start not in headers:
        headers[start] = _blob_header(file, path, where, start)
    data_start, header = headers[start]
    record = header.get(chunk.fqn)
    if record is None:
        raise SnapshotError(f"{where}: the safetensors blob at byte {start} has no record of it")
    dtype, shape, begin, end = _blob_record(where, record)
    sharding = header.get("__metadata__", {})
    info = sharding.get(_SAFETENSORS_SHARDING_KEY) if type(sharding) is dict else None
    if type(info) is str:
        try:
            saved = load_json(path, info, "its DCP_SHARDING_INFO").get(chunk.fqn, {})
            saved = saved.get("saved_offsets")
        except (ValueError, AttributeError):
            saved = None
        if saved is not None and tuple(saved) != chunk.offsets:
            raise SnapshotError(
                f"{where}: the file holds the chunk at offsets {saved}, the metadata says "
                f"{list(chunk.offsets)}"
            )
    if shape != chunk.sizes or dtype != chunk.dtype:
        raise SnapshotError(
            f"{where}: the chunk at offsets {list(chunk.offsets)} holds {list(shape)} {dtype}, "
            f"the metadata says {list(chunk.sizes)} {chunk.dtype}; the metadata does not "
            "describe this file"
        )
    nbytes = end - begin
    if nbytes != chunk.storage.length:
        raise SnapshotError(
            f"{where}: its safetensors record spans {nbytes} bytes, the metadata says "
            f"{chunk.storage.length}"
        )
    if nbytes == 0:
        return torch.empty(shape, dtype=dtype)
    data = bytearray(_read_exactly(file, path, chunk.fqn, data_start + begin, nbytes))
    return torch.frombuffer(data, dtype=dtype).reshape(shape)

"""Files written by ``torch.save`` (its zip format), read as a :class:`Container` of tensors.

Megatron's ``--save-wgrads-interval`` dumps are ``torch.save`` files of nested dicts of
tensors. They are read here without ``torch.load``, for three reasons:

- Their tensors are served by :func:`~gradstat.snapshot.container.mapped`, as a rank file's
  are: views of one map, guarded against a truncation while they are read (a page cut off
  reads zeros and the block ends in a one-line error). A ``torch.load(mmap=True)`` map has no
  such guard, and a file cut while its tensors are summed crashes the process with SIGBUS.
- Errors are one line naming the file and the tensor's key path (an int64 tensor, a
  non-contiguous view, a list where a dict goes), found before a byte of tensor data is used.
- Nothing is built but dicts and tensor descriptors: the unpickler knows
  ``torch._utils._rebuild_tensor_v2`` (replaced by a function of gradstat's that only records
  its arguments), ``collections.OrderedDict`` and torch's typed storage classes, and refuses
  any other global before it exists, so a pickle that would run code runs nothing.
  ``torch.load(weights_only=True)`` also refuses code; it admits more (ints, lists,
  parameters, every dtype), which gradstat would have to refuse afterwards anyway.

The pickle is read by Python's pure-Python unpickler, as torch's ``weights_only`` unpickler is:
its memo is a dict, where the C unpickler's is an array that a single ``LONG_BINPUT 2**32-1``
grows to 32 GiB. A storage's bytes lie in its zip member, which must be stored uncompressed;
their offset is taken from the member's local header, whose extra field (torch pads it to align
each record to 64 bytes, and adds zip64 sizes past 4 GiB) differs from the central directory's.
"""

from __future__ import annotations

import io
import math
import os
import pickle
import reprlib
import struct
import zipfile
from collections import OrderedDict
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any, NamedTuple

from gradstat.errors import SnapshotError
from gradstat.snapshot.container import (
    MAX_HEADER_BYTES,
    Container,
    FileStamp,
    TensorSlot,
    open_regular,
)
from gradstat.snapshot.format import DTYPES, are_sizes, fits_torch, supported_dtypes

# torch's typed storage classes, by the dtype of their elements (torch.storage's table).
_STORAGE_DTYPES = {
    "DoubleStorage": "float64",
    "FloatStorage": "float32",
    "HalfStorage": "float16",
    "BFloat16Storage": "bfloat16",
    "LongStorage": "int64",
    "IntStorage": "int32",
    "ShortStorage": "int16",
    "CharStorage": "int8",
    "ByteStorage": "uint8",
    "BoolStorage": "bool",
    "ComplexDoubleStorage": "complex128",
    "ComplexFloatStorage": "complex64",
    "QInt8Storage": "qint8",
    "QInt32Storage": "qint32",
    "QUInt8Storage": "quint8",
    "QUInt4x2Storage": "quint4x2",
    "QUInt2x4Storage": "quint2x4",
}
_LOCAL_HEADER = struct.Struct("<4s22xHH")
_LOCAL_SIGNATURE = b"PK\x03\x04"


@dataclass(frozen=True)
class PthFile:
    """A ``torch.save`` file's tensors as slots of its bytes, and where each sat in its dicts."""

    container: Container  # metadata {}, data_start 0: slot offsets are the file's
    paths: dict[str, tuple[str, ...]]  # slot name -> key path, in the pickle's order


# Tuples, so that a pickle's BUILD cannot set state on them (they have no __dict__).
class _StorageType(NamedTuple):
    dtype: str


class _Storage(NamedTuple):
    dtype: str
    key: str
    numel: int


class _Tensor(NamedTuple):
    storage: Any
    offset: Any
    size: Any
    stride: Any


def _rebuild_tensor(
    storage: Any,
    storage_offset: Any,
    size: Any,
    stride: Any,
    requires_grad: Any = False,
    backward_hooks: Any = None,
    metadata: Any = None,
) -> _Tensor:
    """Stands in for ``torch._utils._rebuild_tensor_v2``: records the view, builds nothing."""
    return _Tensor(storage, storage_offset, size, stride)


class _Unpickler(pickle._Unpickler):
    def __init__(self, file: IO[bytes], path: Path) -> None:
        super().__init__(file)
        self._path = path

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) == ("torch._utils", "_rebuild_tensor_v2"):
            return _rebuild_tensor
        if (module, name) == ("collections", "OrderedDict"):
            return OrderedDict
        if module == "torch" and name in _STORAGE_DTYPES:
            return _StorageType(_STORAGE_DTYPES[name])
        raise SnapshotError(
            f"{self._path}: holds a pickled {module}.{name}, not nested dicts of tensors; "
            "gradstat unpickles nothing else"
        )

    def persistent_load(self, pid: Any) -> _Storage:
        if not (
            type(pid) is tuple
            and len(pid) == 5
            and pid[0] == "storage"
            and type(pid[1]) is _StorageType
            and type(pid[2]) is str
            and are_sizes([pid[4]])
        ):
            raise pickle.UnpicklingError(f"persistent id {reprlib.repr(pid)} is not a storage's")
        return _Storage(pid[1].dtype, pid[2], pid[4])


def read_pth(path: Path) -> PthFile:
    """Parse and validate the ``torch.save`` file at ``path``; no tensor data is read.

    Raises:
        SnapshotError: one line naming the file (and the tensor's key path where there is one).
    """
    try:
        with os.fdopen(open_regular(path), "rb") as file:
            return _read(path, file, FileStamp.of(file.fileno()))
    except FileNotFoundError as error:
        raise SnapshotError(f"{path}: no such file") from error
    except OSError as error:
        raise SnapshotError(f"{path}: cannot read ({error.strerror or error})") from error
    except zipfile.BadZipFile as error:  # a member's local header or checksum
        raise SnapshotError(f"{path}: damaged zip archive ({_one_line(error)})") from error


def _read(path: Path, file: IO[bytes], stamp: FileStamp) -> PthFile:
    try:
        archive = zipfile.ZipFile(file)
    except (zipfile.BadZipFile, EOFError, struct.error, ValueError) as error:
        raise SnapshotError(
            f"{path}: not a PyTorch zip archive ({_one_line(error)}): truncated, not written by "
            "torch.save, or saved with _use_new_zipfile_serialization=False; save it again "
            "with torch.save's default format"
        ) from error
    with archive:
        pickles = [n for n in archive.namelist() if n.endswith("/data.pkl") and n.count("/") == 1]
        if len(pickles) != 1:
            raise SnapshotError(
                f"{path}: a zip archive with {len(pickles)} <archive>/data.pkl members, "
                "not a torch.save file (which has one)"
            )
        prefix = pickles[0].removesuffix("data.pkl")
        for info in archive.infolist():
            if info.compress_type != zipfile.ZIP_STORED or info.flag_bits & 0x1:
                raise SnapshotError(
                    f"{path}: zip member {info.filename!r} is compressed or encrypted; gradstat "
                    "maps tensors where they lie, which needs the stored members torch.save "
                    "writes: save it again with torch.save"
                )
        if f"{prefix}byteorder" in archive.namelist():
            info = archive.getinfo(f"{prefix}byteorder")
            order = archive.read(info) if info.file_size <= 16 else b"unknown"
            if order != b"little":
                raise SnapshotError(
                    f"{path}: saved on a {reprlib.repr(order.decode('latin-1'))}-endian "
                    "machine; gradstat reads little-endian files only"
                )
        info = archive.getinfo(pickles[0])
        if info.file_size > MAX_HEADER_BYTES:
            raise SnapshotError(
                f"{path}: data.pkl is {info.file_size} bytes, more than a dict of tensors needs "
                f"(at most {MAX_HEADER_BYTES}); not a gradient dump"
            )
        try:
            root = _Unpickler(io.BytesIO(archive.read(info)), path).load()
        except SnapshotError:
            raise
        except Exception as error:  # an untrusted pickle of allowed objects fails in any way
            raise SnapshotError(
                f"{path}: data.pkl is not a pickle of nested dicts of tensors "
                f"({type(error).__name__}: {_one_line(error)})"
            ) from error
        if not isinstance(root, dict):
            raise SnapshotError(f"{path}: holds {_what(root)}, not a dict of tensors")
        storages = _Storages(path, archive, prefix, file.fileno(), stamp.size)
        slots: dict[str, TensorSlot] = {}
        paths: dict[str, tuple[str, ...]] = {}
        for key_path, tensor in _leaves(path, root):
            name = "/".join(key_path)
            slots[name] = _slot(path, name, tensor, storages)
            paths[name] = key_path
    return PthFile(Container(path, {}, slots, 0, stamp), paths)


def _leaves(path: Path, root: dict[Any, Any]) -> Iterator[tuple[tuple[str, ...], _Tensor]]:
    """The tensors under ``root`` with their key paths, in the pickle's order; anything else
    is an error naming its key path."""
    walked = {id(root)}
    stack: list[tuple[tuple[str, ...], Iterator[tuple[Any, Any]]]] = [((), iter(root.items()))]
    while stack:
        above, items = stack[-1]
        item = next(items, None)
        if item is None:
            stack.pop()
            continue
        key, value = item
        where = "/".join(above) or "the top level"
        if type(key) is not str or "/" in key:
            raise SnapshotError(
                f"{path}: key {reprlib.repr(key)} under {where!r}: gradstat reads keys that "
                "are strings without '/'"
            )
        key_path = (*above, key)
        if type(value) is _Tensor:
            yield key_path, value
        elif isinstance(value, dict):
            if id(value) in walked:
                raise SnapshotError(
                    f"{path}: {'/'.join(key_path)!r} is a dict met before (a shared or cyclic "
                    "reference), not a tree of tensors"
                )
            walked.add(id(value))
            stack.append((key_path, iter(value.items())))
        else:
            raise SnapshotError(
                f"{path}: {'/'.join(key_path)!r} holds {_what(value)}, not a tensor or a dict "
                "of tensors"
            )


def _slot(path: Path, name: str, tensor: _Tensor, storages: _Storages) -> TensorSlot:
    """Where tensor ``name``'s bytes lie in the file, its view and storage checked."""
    storage, offset, size, stride = tensor
    if type(storage) is not _Storage:
        raise SnapshotError(f"{path}: tensor {name!r} has {_what(storage)} for its storage")
    if storage.dtype not in DTYPES:
        raise SnapshotError(
            f"{path}: tensor {name!r} is {storage.dtype}; gradstat reads {supported_dtypes()}"
        )
    if not (
        type(size) is tuple
        and type(stride) is tuple
        and len(size) == len(stride)
        and are_sizes(size)
        and set(map(type, stride)) <= {int}
        and are_sizes([offset])
        and fits_torch(size)
    ):
        raise SnapshotError(
            f"{path}: tensor {name!r} has offset {reprlib.repr(offset)}, size "
            f"{reprlib.repr(size)}, stride {reprlib.repr(stride)}: not a tensor's view"
        )
    if not _contiguous(size, stride):
        raise SnapshotError(
            f"{path}: tensor {name!r} (shape {list(size)}, stride {list(stride)}) is not "
            "contiguous; save it with .contiguous()"
        )
    start = storages.start(name, storage)
    itemsize = DTYPES[storage.dtype][0].itemsize
    count = math.prod(size)
    if offset + count > storage.numel:
        raise SnapshotError(
            f"{path}: tensor {name!r} ends at element {offset + count} of a storage of "
            f"{storage.numel}"
        )
    begin = start + offset * itemsize
    return TensorSlot(storage.dtype, size, begin, begin + count * itemsize)


def _contiguous(size: tuple[int, ...], stride: tuple[int, ...]) -> bool:
    """Whether a view of ``size`` and ``stride`` is C-contiguous, as torch decides it: the
    stride of a dimension of one element does not matter, nor any when there is no element."""
    if 0 in size:
        return True
    expected = 1
    for length, step in zip(reversed(size), reversed(stride), strict=True):
        if length != 1:
            if step != expected:
                return False
            expected *= length
    return True


class _Storages:
    """The storages of one archive: where each one's bytes begin, its zip member checked once."""

    def __init__(
        self, path: Path, archive: zipfile.ZipFile, prefix: str, descriptor: int, size: int
    ) -> None:
        self._path, self._archive, self._prefix = path, archive, prefix
        self._descriptor, self._size = descriptor, size
        self._known: dict[str, tuple[_Storage, int]] = {}

    def start(self, name: str, storage: _Storage) -> int:
        """The file offset of ``storage``'s bytes; ``name``: the tensor viewing them."""
        path = self._path
        known = self._known.get(storage.key)
        if known is not None:
            if known[0] != storage:
                raise SnapshotError(
                    f"{path}: tensor {name!r}: storage {storage.key!r} is given as "
                    f"{storage.numel} {storage.dtype} elements, and elsewhere as "
                    f"{known[0].numel} {known[0].dtype}"
                )
            return known[1]
        member = f"{self._prefix}data/{storage.key}"
        try:
            info = self._archive.getinfo(member)
        except KeyError as error:
            raise SnapshotError(
                f"{path}: tensor {name!r}: its storage, zip member {member!r}, is missing"
            ) from error
        itemsize = DTYPES[storage.dtype][0].itemsize
        if info.file_size != storage.numel * itemsize:
            raise SnapshotError(
                f"{path}: tensor {name!r}: zip member {member!r} holds {info.file_size} bytes, "
                f"its storage of {storage.numel} {storage.dtype} {storage.numel * itemsize}"
            )
        # The local header's name and extra field lengths, not the central directory's.
        header = os.pread(self._descriptor, _LOCAL_HEADER.size, info.header_offset)
        if len(header) < _LOCAL_HEADER.size or header[:4] != _LOCAL_SIGNATURE:
            raise SnapshotError(
                f"{path}: zip member {member!r} has no local header at byte {info.header_offset}"
            )
        name_length: int
        extra_length: int
        _, name_length, extra_length = _LOCAL_HEADER.unpack(header)
        start: int = info.header_offset + _LOCAL_HEADER.size + name_length + extra_length
        if start % itemsize or start + info.file_size > self._size:
            raise SnapshotError(
                f"{path}: tensor {name!r}: zip member {member!r} lies at bytes {start} to "
                f"{start + info.file_size} of {self._size} (truncated, or not torch.save's "
                "layout)"
            )
        self._known[storage.key] = (storage, start)
        return start


def _what(value: Any) -> str:
    if value is None:
        return "None"
    kind = {_Tensor: "tensor", _Storage: "storage", _StorageType: "storage class"}.get(type(value))
    kind = kind or type(value).__name__
    return f"{'an' if kind[0] in 'aeiouAEIOU' else 'a'} {kind}"


def _one_line(error: BaseException) -> str:
    return " ".join(str(error).split())

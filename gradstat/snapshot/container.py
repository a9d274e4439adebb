"""The safetensors byte layout, read strictly and written as a stream.

Reading checks everything before a byte of tensor data is used: the header length against the
file size, UTF-8 JSON without duplicate keys, each entry's dtype, shape and byte range, and that
the ranges tile the data section exactly (no overlap, no hole, no trailing bytes). The file's
identity, size and modification time are kept with the header: mapping refuses a file that has
changed since, each tensor lookup re-checks the size before the tensor's pages are touched, and
a truncation while they are read is an error, not a SIGBUS (see :class:`MappedTensors`).

Why not the safetensors library, which the field trusts and fuzzes: its ``safe_open`` gives no
tensor's byte range, so the file could not be mapped once and every tensor viewed in it; each
``get_tensor`` costs a call of its own. Measured with ``benchmarks/bench_reader.py`` (CPU time,
per rank file, 2026-12-01): the header and its checks 0.033 ms here against 0.033 ms through
``safe_open`` (8192 files of 4 tensors) and 0.086 against 0.056 ms (``sample_data``'s 8 files
of about 50 tensors); the header and then every tensor 0.89x and 0.82x the time ``safe_open``
+ ``get_tensor`` take (tensor views are made as they are looked up). Everything
safetensors checks of a header is checked here too, and more: a key given twice, files that
change while they are read. The writer streams one tensor at a time (``write_container``),
where ``safetensors.torch.save_file`` wants every tensor in host memory at once: a rank's
gigabytes of GPU gradients would need as much host memory. The tests read what gradstat writes
back through ``safe_open`` (``test_snapshot.py::test_a_rank_file_is_plain_safetensors``, every
dtype bitwise), so the files stay plain safetensors.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import math
import mmap
import os
import re
import stat
import struct
import warnings
from array import array
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any, NamedTuple

import torch

from gradstat.core import native
from gradstat.errors import SnapshotError
from gradstat.snapshot.format import (
    CODE_NAMES,
    DTYPE_NAMES,
    DTYPES,
    REAL_VIEWS,
    are_sizes,
    fits_torch,
    load_json,
    scan_json,
    supported_dtypes,
)

# A header larger than this is not a gradient snapshot's: refuse before reading it.
MAX_HEADER_BYTES = 256 << 20
_ALIGN = 8


class TensorSlot(NamedTuple):
    """Where one tensor's bytes lie in the file (a tuple: a header has thousands)."""

    dtype: str
    shape: tuple[int, ...]
    start: int
    end: int


@dataclass(frozen=True)
class FileStamp:
    """What tells the file that was validated from a later one at the same path."""

    device: int
    inode: int
    size: int
    mtime_ns: int

    @classmethod
    def of(cls, fd: int) -> FileStamp:
        return cls._from(os.fstat(fd))

    @classmethod
    def of_path(cls, path: Path) -> FileStamp:
        return cls._from(os.stat(path))

    @classmethod
    def _from(cls, status: os.stat_result) -> FileStamp:
        return cls(status.st_dev, status.st_ino, status.st_size, status.st_mtime_ns)

    def change(self, now: FileStamp) -> str | None:
        """How ``now`` differs from this stamp, in words; None when it is the same file."""
        if (now.device, now.inode) != (self.device, self.inode):
            return "replaced by another file"
        if now.size != self.size:
            return f"now {now.size} bytes, {self.size} when checked"
        if now.mtime_ns != self.mtime_ns:
            return "modified"
        return None


@dataclass(frozen=True)
class Container:
    """A parsed safetensors header: metadata, tensor slots, where the data section begins, and
    the stamp of the file it was read from."""

    path: Path
    metadata: dict[str, str]
    slots: dict[str, TensorSlot]
    data_start: int
    stamp: FileStamp
    # The whole file, when it was read whole with its header (see ``read_container``).
    data: bytearray | None = None


@dataclass(frozen=True)
class TensorLayout:
    """The tensors of a safetensors header: their slots, and where the last one ends."""

    slots: dict[str, TensorSlot]
    end: int


# The tensor layouts of files read before, by the text of the header after its metadata, and
# by its template: that text split at the tensors' names (see _ENTRY_NAMES).
KnownLayouts = dict[str | tuple[str, ...], TensorLayout]


_NOT_REGULAR = (
    (stat.S_ISDIR, "a directory"),
    (stat.S_ISFIFO, "a FIFO"),
    (stat.S_ISCHR, "a character device"),
    (stat.S_ISBLK, "a block device"),
    (stat.S_ISSOCK, "a socket"),
)


def open_regular(path: Path) -> int:
    """A read-only descriptor of the regular file at ``path`` (a symlink followed).

    Opened without waiting (a FIFO's open waits for a writer, for ever) and refused unless a
    regular file: a FIFO, a device (``/dev/zero`` reads without end) or a directory named like
    a snapshot's file is none.

    Raises:
        SnapshotError: not a regular file, naming it and what it is.
        OSError: as ``os.open`` (the caller words it).
    """
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NONBLOCK)
    try:
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):
            what = next((said for test, said in _NOT_REGULAR if test(mode)), "not a file")
            raise SnapshotError(f"{path}: is {what}, not a regular file")
        os.set_blocking(fd, True)
    except BaseException:
        os.close(fd)
        raise
    return fd


def _changed(path: Path, how: str) -> SnapshotError:
    return SnapshotError(
        f"{path}: the file changed while gradstat was reading it ({how}); run again once "
        "nothing writes to the snapshot"
    )


def read_container(path: Path, keep_up_to: int = 0, known: KnownLayouts | None = None) -> Container:
    """Parse and validate the safetensors header of ``path``.

    The data is not read, unless the file is no larger than ``keep_up_to`` bytes: then it is
    read whole, in one read, and kept (``Container.data``), so that its tensors need neither a
    second open nor a map (a small file's open and map cost more than its bytes). ``known``:
    the tensor layouts of the files read before (see :func:`_known_slots`), this one's added.

    Raises:
        SnapshotError: naming the file and what is wrong with it.
    """
    try:
        # The descriptor alone, no file object: a small file's read costs about as much.
        fd = open_regular(path)
        try:
            stamp = FileStamp.of(fd)
            size = stamp.size
            data = None
            if size <= keep_up_to:  # gradstat's own copy, which its tensors may view writably
                data = bytearray(size)
                del data[os.readv(fd, [data]) :]
            prefix = os.pread(fd, 8, 0) if data is None else data
            if len(prefix) < 8:
                raise SnapshotError(
                    f"{path}: {size} bytes is too short for a safetensors file (needs 8 or more)"
                )
            (header_len,) = struct.unpack_from("<Q", prefix)
            if header_len > min(size - 8, MAX_HEADER_BYTES):
                raise SnapshotError(
                    f"{path}: header length {header_len} exceeds the file's {size} bytes "
                    f"(truncated, or not a safetensors file)"
                )
            raw = os.pread(fd, header_len, 8) if data is None else data[8 : 8 + header_len]
        finally:
            os.close(fd)
    except OSError as error:
        raise SnapshotError(f"{path}: cannot read ({error.strerror or error})") from error
    if data is not None and len(data) != size:
        raise _changed(path, f"it ends after {len(data)} of {size} bytes")
    if len(raw) != header_len:
        raise _changed(path, f"its header ends after {len(raw)} of {header_len} bytes")
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as error:
        raise SnapshotError(f"{path}: header is not UTF-8 (not a safetensors file)") from error
    data_start = 8 + header_len
    split = None if known is None else _known_slots(path, text, known)
    if split is not None and split[1].end == size - data_start:
        metadata, layout = split
        return Container(path, metadata, layout.slots, data_start, stamp, data)
    try:
        header = load_json(path, text, "header")
    except ValueError as error:
        raise SnapshotError(f"{path}: header is not JSON (not a safetensors file)") from error
    if not isinstance(header, dict):
        raise SnapshotError(f"{path}: header is not a JSON object")
    metadata = header.pop("__metadata__", {})
    if not _string_map(metadata):
        raise SnapshotError(f"{path}: __metadata__ must map strings to strings")
    slots = {name: _slot(path, name, entry) for name, entry in header.items()}
    _check_tiling(path, slots, size - data_start)
    return Container(path, metadata, slots, data_start, stamp, data)


def _string_map(value: Any) -> bool:
    return type(value) is dict and all(type(item) is str for item in value.values())


_METADATA_FIRST = '{"__metadata__":'


def _known_slots(
    path: Path, text: str, known: KnownLayouts
) -> tuple[dict[str, str], TensorLayout] | None:
    """The header's metadata, and its tensors' layout checked once per distinct text: the rank
    files of a snapshot mostly hold the same tensors and differ in the metadata alone, or in
    their names too (pipeline stages named by global layer index), read once per template.

    Safetensors headers written by gradstat (and the safetensors library) begin with the
    metadata. Its value is parsed where it stands; the rest, ``{`` and what follows its
    comma, parses as the object of the tensors' entries when the whole does (``__metadata__``
    not among them, at least one entry). None when the header is not so split: the caller
    parses it whole and words any error.
    """
    if not text.startswith(_METADATA_FIRST):
        return None
    found = scan_json(text, len(_METADATA_FIRST))
    if found is None or not _string_map(found[0]) or text[found[1] : found[1] + 1] != ",":
        return None
    # JSON's whitespace: the padding after the header differs with the metadata's length.
    rest = text[found[1] + 1 :].rstrip(" \t\n\r")
    layout = known.get(rest)
    if layout is None:
        layout = _layout_of(path, "{" + rest, known)
        if layout is None:
            return None
        known[rest] = layout
    return found[0], layout


# A tensor's entry begins: "{" or ",", its name as a plain JSON string (no escape, no control
# character: its text is its value), and the opening of its object. Split at these, a header's
# entries are a template and the names that fill it.
_ENTRY_NAMES = re.compile(r'([{,])"([^"\\\x00-\x1f]*)":\{')


def _layout_of(path: Path, entries_text: str, known: KnownLayouts) -> TensorLayout | None:
    """The checked layout of the tensors' entries (``{`` and what follows the metadata): its
    template's with these names, or parsed and checked, and its template kept; None where the
    entries do not parse as one object of tensors (the caller parses the whole header).

    A template was made from entries whose split names are their keys, one to one, in order:
    other plain names in their places make entries that parse the same under those keys, so
    what is left to check is that no name is given twice, and that none is the metadata's.
    """
    parts = _ENTRY_NAMES.split(entries_text)  # text, "{" or ",", name, text, ...
    names = parts[2::3]
    template_key = tuple(parts[0::3] + parts[1::3])
    template = known.get(template_key)
    if template is not None:
        slots = dict(zip(names, template.slots.values(), strict=True))
        if len(slots) == len(names) and "__metadata__" not in slots:
            return TensorLayout(slots, template.end)
        return None
    entries = scan_json(entries_text, 0)
    if (
        entries is None
        or entries[1] != len(entries_text)
        or type(entries[0]) is not dict
        or not entries[0]
        or "__metadata__" in entries[0]
    ):
        return None
    try:
        slots = {name: _slot(path, name, entry) for name, entry in entries[0].items()}
        end = _check_tiling(path, slots, None)
    except SnapshotError:
        return None
    layout = TensorLayout(slots, end)
    if list(slots) == names:  # each split name is a key, in order: a template
        known[template_key] = layout
    return layout


def _slot(path: Path, name: str, entry: Any) -> TensorSlot:
    if type(entry) is not dict:
        raise SnapshotError(f"{path}: tensor {name!r}: entry is not a JSON object")
    code, shape, offsets = entry.get("dtype"), entry.get("shape"), entry.get("data_offsets")
    if type(code) is not str or code not in CODE_NAMES:
        raise SnapshotError(
            f"{path}: tensor {name!r}: dtype {code!r} is not supported; "
            f"supported: {supported_dtypes()}"
        )
    if type(shape) is not list or not are_sizes(shape):
        raise SnapshotError(f"{path}: tensor {name!r}: shape {shape!r} is not a list of sizes")
    if not fits_torch(shape):
        raise SnapshotError(
            f"{path}: tensor {name!r}: shape {shape} is too large for torch (its sizes are 64-bit)"
        )
    if not (
        type(offsets) is list
        and len(offsets) == 2
        and type(offsets[0]) is int
        and type(offsets[1]) is int
        and 0 <= offsets[0] <= offsets[1]
    ):
        raise SnapshotError(f"{path}: tensor {name!r}: data_offsets {offsets!r} are not a range")
    dtype = CODE_NAMES[code]
    expected = math.prod(shape) * _ITEM_SIZES[dtype]
    if offsets[1] - offsets[0] != expected:
        raise SnapshotError(
            f"{path}: tensor {name!r}: {offsets[1] - offsets[0]} bytes for shape {shape} of "
            f"{dtype}, which needs {expected}"
        )
    return TensorSlot(dtype, tuple(shape), offsets[0], offsets[1])


_ITEM_SIZES = {name: torch_dtype.itemsize for name, (torch_dtype, _) in DTYPES.items()}


def _check_tiling(path: Path, slots: dict[str, TensorSlot], data_len: int | None) -> int:
    """Check that the tensors' byte ranges tile the data section, of ``data_len`` bytes (None:
    whatever length they end at); returns that length."""
    position = 0
    for name, slot in sorted(slots.items(), key=lambda item: (item[1].start, item[1].end)):
        if slot.start != position:
            problem = "overlaps the previous tensor" if slot.start < position else "leaves a gap"
            raise SnapshotError(f"{path}: tensor {name!r}: byte range {problem}")
        position = slot.end
    if data_len is None:
        return position
    if position != data_len:
        problem = "is truncated" if position > data_len else "has trailing bytes"
        raise SnapshotError(
            f"{path}: file {problem}: tensors need {position} data bytes, it has {data_len}"
        )
    return position


class MappedTensors(Mapping[str, torch.Tensor]):
    """A rank file's tensors by name, as read-only views of its map (or of the bytes kept when
    the file was read whole), each made when it is first looked up: a tensor that does not
    count (a replica) costs nothing.

    A file truncated while it is read (a job rewriting its dump meanwhile) must give one line,
    never a crash. A page of a map that a truncation cut off faults with SIGBUS when it is
    touched, in whatever code touches it (the native kernel, a PyTorch operation, a copy), and
    Python cannot catch that signal. So the map is guarded by the native library while the
    ``with`` block runs (:func:`gradstat.core.native.guard_map`): such a page then reads zeros,
    and the block's end raises a :class:`SnapshotError` naming the file, so that nothing
    computed from it is used. Each lookup also checks, through the descriptor, that the file
    still has the size it was validated at, which finds most truncations before a page is
    touched, and the file's stamp is checked again as the block ends (a cut inside the last page
    faults nowhere). Where the library is unavailable (no C compiler, ``GRADSTAT_NATIVE=0``),
    each tensor is read into memory of its own instead (``preadv``), where a truncation is a
    short read; the map stays for the guarded case, as a read pass took 2.5 to 5.7 times as long
    as a mapped one (16 x 64 MiB fp32, page cache warm, fused norm pass). Measured with
    ``benchmarks/bench_snapshot.py --gib 1 --repeats 3`` (whole ``gradstat norm`` processes
    against a ``safe_open`` pass, 2026-12-01): guarded 0.70x (fastest 0.96x) where unguarded
    maps gave 0.84x (0.78x); read, with the kernel off, 1.15x (1.16x) where maps gave 1.05x
    (1.11x). The guard costs about 50 us per mapped file (126 against 73 us for a pass of one
    lookup). Kept bytes need none of it.

    A context manager (see :func:`mapped`): the file is mapped (or opened), or found
    unchanged, as the ``with`` block begins; the views are dropped and the map closed as it
    ends.
    """

    def __init__(self, container: Container) -> None:
        self._container = container
        self._view: mmap.mmap | bytearray | None = None
        self._guard: int | None = None
        self._descriptor: int | None = None  # the file's, open while the block runs
        self._made: dict[str, torch.Tensor] = {}

    def __enter__(self) -> MappedTensors:
        container = self._container
        if container.data is not None:
            try:
                change = container.stamp.change(FileStamp.of_path(container.path))
            except OSError as error:
                raise SnapshotError(
                    f"{container.path}: cannot open ({error.strerror or error})"
                ) from error
            if change is not None:
                raise _changed(container.path, change)
            self._view = container.data
            return self
        try:
            descriptor = open_regular(container.path)
        except OSError as error:
            raise SnapshotError(
                f"{container.path}: cannot open ({error.strerror or error})"
            ) from error
        try:
            change = container.stamp.change(FileStamp.of(descriptor))
            if change is not None:
                raise _changed(container.path, change)
            if native.native_library() is not None:
                self._map(descriptor)
        except OSError as error:
            os.close(descriptor)
            raise SnapshotError(
                f"{container.path}: cannot map ({error.strerror or error})"
            ) from error
        except BaseException:
            os.close(descriptor)
            raise
        self._descriptor = descriptor
        return self

    def _map(self, descriptor: int) -> None:
        """Map the file and guard the map; an unguarded map is closed again (then read)."""
        view = mmap.mmap(descriptor, 0, access=mmap.ACCESS_READ)
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="The given buffer is not writable")
            address = torch.frombuffer(view, dtype=torch.uint8).data_ptr()
        self._guard = native.guard_map(address, len(view))
        if self._guard is None:
            view.close()
        else:
            self._view = view

    def __exit__(self, *exception: object) -> None:
        view, self._view = self._view, None
        guard, self._guard = self._guard, None
        descriptor, self._descriptor = self._descriptor, None
        self._made.clear()
        faulted = guard is not None and native.guard_release(guard)
        change = None
        if descriptor is not None:
            # A truncation inside the last page faults nowhere (the rest of the page reads
            # zeros), and a rewrite may restore the size: the file must be as it was checked.
            try:
                change = self._container.stamp.change(FileStamp.of(descriptor))
            finally:
                os.close(descriptor)
        if isinstance(view, mmap.mmap):
            # A caller that kept a tensor alive keeps the map: it closes with the last view.
            with contextlib.suppress(BufferError):
                view.close()
        if faulted:
            # What was computed from the zeros past the new end must not be used.
            raise _changed(self._container.path, "truncated while its tensors were read")
        if change is not None:
            raise _changed(self._container.path, change)

    def __getitem__(self, name: str) -> torch.Tensor:
        if self._view is None and self._descriptor is None:
            raise KeyError(name)
        if self._descriptor is not None:
            now, was = os.fstat(self._descriptor).st_size, self._container.stamp.size
            if now != was:  # the file as it is now
                raise _changed(self._container.path, f"now {now} bytes, {was} when checked")
        tensor = self._made.get(name)
        if tensor is None:
            slot = self._container.slots[name]
            if self._view is None:
                assert self._descriptor is not None
                tensor = self._read(name, slot, self._descriptor)
            else:
                tensor = self._make(slot, self._view)
            self._made[name] = tensor
        return tensor

    def _read(self, name: str, slot: TensorSlot, descriptor: int) -> torch.Tensor:
        """Tensor ``name`` read from the file into memory of its own."""
        dtype = DTYPES[slot.dtype][0]
        tensor = torch.empty(slot.shape, dtype=dtype)
        size = slot.end - slot.start
        if size == 0:
            return tensor
        into = memoryview((ctypes.c_ubyte * size).from_address(tensor.data_ptr())).cast("B")
        start, done = self._container.data_start + slot.start, 0
        while done < size:
            got = os.preadv(descriptor, [into[done:]], start + done)
            if got == 0:
                how = f"it ends inside tensor {name!r}, {done} of its {size} bytes read"
                raise _changed(self._container.path, how)
            done += got
        return tensor

    def _make(self, slot: TensorSlot, view: mmap.mmap | bytearray) -> torch.Tensor:
        count = math.prod(slot.shape)
        dtype = DTYPES[slot.dtype][0]
        if count == 0:
            return torch.empty(slot.shape, dtype=dtype)
        offset = self._container.data_start + slot.start
        with warnings.catch_warnings():
            # The map is read-only and gradstat never writes through it.
            warnings.filterwarnings("ignore", message="The given buffer is not writable")
            tensor = torch.frombuffer(view, dtype=dtype, count=count, offset=offset)
            if tensor.data_ptr() % dtype.itemsize:
                # Not aligned to its dtype (safetensors aligns to 8 bytes at most, a complex128
                # needs 16, and kernels that assume it fault): a copy, which is.
                size = count * dtype.itemsize
                raw = torch.frombuffer(view, dtype=torch.uint8, count=size, offset=offset)
                tensor = raw.clone().view(dtype)
        return tensor.view(slot.shape)

    def __iter__(self) -> Iterator[str]:
        return iter(self._container.slots)

    def __len__(self) -> int:
        return len(self._container.slots)


def mapped(container: Container) -> MappedTensors:
    """The file's tensors, as read-only views of its map, or of the bytes read of a small file
    once the file is found unchanged: ``with mapped(container) as tensors``. No copies, but of a
    tensor whose bytes are not aligned to its dtype.

    The views are valid inside the ``with`` block only; nothing may write to them.

    Raises:
        SnapshotError: the file cannot be mapped, or it changed since ``read_container`` read
            it (then, or later when a tensor is looked up).
    """
    return MappedTensors(container)


def kept_fp32(container: Container, names: Sequence[str]) -> tuple[array[int], array[int]] | None:
    """The addresses and element counts (``array("q")`` both) of the tensors ``names`` in the
    bytes of a file read whole with its header (``Container.data``), for a native pass over
    them; None unless the file was so read and every one of them is fp32.

    The addresses hold while the container does: its bytes are never resized. Look the file up
    first (``with mapped(container)``), which finds it unchanged since it was read.
    """
    data = container.data
    if data is None:
        return None
    slots = [container.slots[name] for name in names]
    if any(slot.dtype != "float32" for slot in slots):
        return None
    base = ctypes.addressof(ctypes.c_char.from_buffer(data)) + container.data_start
    pointers = array("q", [base + slot.start for slot in slots])
    return pointers, array("q", [math.prod(slot.shape) for slot in slots])


def _stored(tensor: torch.Tensor) -> torch.Tensor:
    """The tensor as the file keeps it: its real view for a dtype safetensors has no code for."""
    if DTYPE_NAMES[tensor.dtype] in REAL_VIEWS:
        return torch.view_as_real(tensor.detach().resolve_conj())
    return tensor


def write_container(
    file: IO[bytes], metadata: dict[str, str], tensors: Sequence[tuple[str, torch.Tensor]]
) -> None:
    """Write a safetensors file from CPU-or-device tensors, one tensor in memory at a time.

    Tensors are laid out widest dtype first, from a data section aligned to the widest (8
    bytes, 16 with a complex128), so every tensor's bytes are aligned to its dtype. One of a
    dtype safetensors has no code for is written as its real view (``REAL_VIEWS``).
    """
    widest = sorted(tensors, key=lambda item: -item[1].element_size())
    align = max(_ALIGN, widest[0][1].element_size()) if widest else _ALIGN
    order = [(name, _stored(tensor)) for name, tensor in widest]
    entries: dict[str, Any] = {"__metadata__": metadata}
    position = 0
    for name, tensor in order:
        nbytes = tensor.numel() * tensor.element_size()
        entries[name] = {
            "dtype": DTYPES[DTYPE_NAMES[tensor.dtype]][1],
            "shape": list(tensor.shape),
            "data_offsets": [position, position + nbytes],
        }
        position += nbytes
    header = json.dumps(entries, separators=(",", ":")).encode("utf-8")
    header += b" " * (-(8 + len(header)) % align)
    file.write(struct.pack("<Q", len(header)))
    file.write(header)
    for _, tensor in order:
        local = tensor.detach().to("cpu").contiguous()
        nbytes = local.numel() * local.element_size()
        if nbytes:
            file.write((ctypes.c_ubyte * nbytes).from_address(local.data_ptr()))

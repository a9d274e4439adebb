"""The telemetry log: rank 0 appends one framed record per recorded step to the run directory.

Every record is framed as TensorBoard frames its events (the TFRecord idea): a length and a
CRC of the frame's head, the payload, a CRC of the payload. A record torn by a kill mid-write
fails its CRC or ends early: the reader skips it with one line and finds the next frame by its
magic, so a run resumed after a kill (appending after the torn tail) reads on. Each record is
one ``write`` call; nothing is rewritten, and a write that fails (a full disk) is cut back off
the file where the system lets it, one warning line, and training goes on.

Layout (little-endian)::

    frame    = b"GSTL" kind:u8 length:u32 head_crc:u32 | payload[length] | crc32(payload):u32
    start    = kind 1, JSON: format, version, attempt, time_ns, norm_type, world_size,
               every, groups
    layout   = kind 2, JSON: names, expert (one per name); numel (one per name, or null)
    step     = kind 4: attempt:u64 then the fields of version 2's step record (kind 3):
               step:i64 norm:f64 logged:f64 triggers:u32 repeat:i32 count:u32
               then, when count > 0 (count = the layout's names):
               norms:f64[count]  (-1: no gradient at this step)
               max_abs:f32[count] zeros:u32[count]
               extras:u32 then extras x (index:u32 zeros:u64 nan:u64 inf:u64 max_abs:f64)

A step record costs 17 + 44 = 61 bytes, and when it holds the per-parameter statistics 4
bytes more and 16 per name; an entry whose zero count, maximum (outside float32's exact
values) or NaN/Inf counts do not fit there is repeated exactly in ``extras`` (36 bytes).
``attempt`` is the start record's attempt id (10 hex digits) as a number: version 3 added it,
versions 1 and 2 wrote step records of kind 3, without it. ``logged`` is the NaN of bits
``_NO_LOGGED`` when the job logged no norm (any other NaN is a NaN it logged; version 1 wrote
a plain NaN for none); ``repeat`` is the snapshot's repeat index
(``step-N.repeat``), -1 for none; ``triggers`` has bit i set for trigger i of
:data:`~gradstat.recorder.triggers.TRIGGERS`. A start record of a version above
``FORMAT_VERSION`` (a newer gradstat's, perhaps one that resumed the run) stops the reader with
one line naming the file and both versions: its records are not this layout's to guess at.

A step record names no layout: its per-parameter statistics belong to the layout record read
last. So when damaged bytes may have held a layout record (a damaged record whose intact head
says it was one, or bytes whose head is unreadable), the per-parameter statistics of the step
records that follow, up to the next intact layout or start record, are left out (their norm,
logged norm and triggers kept), one line for them all: read with the layout before the damage,
they would be put under another parameter's name. The writer writes the layout again after a
failed write and each attempt starts with its own, so a torn record or a resume loses none.
Likewise the step records after a damaged start record, up to the next intact one, are left
out, one line: which attempt recorded them, with which norm type, is unknown. Bytes whose head
is unreadable may have held a start record too: a step record that names an attempt other than
that of the start record read last is left out likewise (before version 3, whose step records
name none, such steps were taken as the earlier attempt's, its norm type included).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import mmap
import os
import struct
import zlib
from array import array
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gradstat.errors import SnapshotError
from gradstat.recorder.messages import warn

__all__ = [
    "LOG_NAME",
    "LogWriter",
    "StartRecord",
    "StepRecordData",
    "UnreadableLog",
    "read_log",
]

LOG_NAME = "telemetry.gslog"
FORMAT_NAME = "gradstat-telemetry"
FORMAT_VERSION = 3
_MAGIC = b"GSTL"
_HEAD = struct.Struct("<4sBI")  # magic, kind, length
_CRC = struct.Struct("<I")
_STEP = struct.Struct("<qd8sIiI")  # the logged norm as its 8 bytes (see _NO_LOGGED)
_F64 = struct.Struct("<d")
_EXTRA = struct.Struct("<IQQQd")
_ATTEMPT = struct.Struct("<Q")
_START, _LAYOUT, _STEP_KIND, _ATTEMPT_STEP = 1, 2, 3, 4
_NO_GRADIENT = -1.0
# The logged norm's bytes when the job logged none: a quiet NaN whose payload spells "none",
# which no arithmetic produces; a logged NaN is written as math.nan.
_NO_LOGGED = bytes.fromhex("656e6f6e0000f87f")
_U32_MAX = 0xFFFFFFFF


def _frame(kind: int, payload: bytes) -> bytes:
    head = _HEAD.pack(_MAGIC, kind, len(payload))
    return b"".join(
        (
            head,
            _CRC.pack(zlib.crc32(head)),
            payload,
            _CRC.pack(zlib.crc32(payload)),
        )
    )


def _json(document: dict[str, Any]) -> bytes:
    return json.dumps(document, separators=(",", ":"), allow_nan=False).encode()


def step_payload(
    step: int,
    norm: float,
    logged: float | None,
    triggers: int,
    repeat: int,
    params: Any = None,
) -> bytes:
    """The payload of one step record; ``params`` a
    :class:`~gradstat.recorder.telemetry.ParamsAtStep` or None (the norm only)."""
    if logged is None:
        logged_value = _NO_LOGGED
    else:  # one NaN for every NaN logged: never the bytes of none
        logged_value = _F64.pack(math.nan if math.isnan(logged) else logged)
    if params is None:
        return _STEP.pack(step, norm, logged_value, triggers, repeat, 0)
    count = len(params.norms)
    norms = array("d", [_NO_GRADIENT if value is None else value for value in params.norms])
    peaks = array("f", params.max_abs)  # beyond float32: inf, and repeated exactly below
    zeros = array("I", [value if value < _U32_MAX else _U32_MAX for value in params.zeros])
    # Exact in the columns unless NaN/Inf counted, a count that does not fit, a max that
    # float32 rounds (a NaN max is never equal to itself: its NaN count is there too).
    extras = [
        _EXTRA.pack(index, zero, nan, inf, peak)
        for index, (nan, inf, zero, peak, stored) in enumerate(
            zip(params.nan, params.inf, params.zeros, params.max_abs, peaks, strict=True)
        )
        if nan or inf or zero >= _U32_MAX or stored != peak
    ]
    parts = [
        _STEP.pack(step, norm, logged_value, triggers, repeat, count),
        norms.tobytes(),
        peaks.tobytes(),
        zeros.tobytes(),
        struct.pack("<I", len(extras)),
        *extras,
    ]
    return b"".join(parts)


class LogWriter:
    """Rank 0's appender of the telemetry log. Never raises: a failed write is one warning
    (and one more when writes work again), the records meanwhile lost.

    Args:
        directory: the run directory (created if missing).
        start: the start record's JSON fields.
    """

    def __init__(self, directory: Path, start: dict[str, Any]) -> None:
        self.path = directory / LOG_NAME
        self._fd: int | None = None
        self._failing = False
        self._lost = 0
        self._layout: bytes | None = None
        self._layout_written = False
        document = {"format": FORMAT_NAME, "version": FORMAT_VERSION, **start}
        # The step records' kind and the bytes before their fields, as the version defines.
        self._step_kind, self._step_head = _STEP_KIND, b""
        if FORMAT_VERSION >= 3:
            self._step_kind = _ATTEMPT_STEP
            self._step_head = _ATTEMPT.pack(int(start["attempt"], 16))
        try:
            directory.mkdir(parents=True, exist_ok=True)
            flags = os.O_WRONLY | os.O_APPEND | os.O_CREAT | getattr(os, "O_CLOEXEC", 0)
            self._fd = os.open(self.path, flags, 0o666)
        except OSError as error:
            warn(f"{self.path}: cannot open the telemetry log ({error}); training goes on")
            return
        self._append(_frame(_START, _json(document)))

    def layout(
        self, names: Sequence[str], expert: Sequence[bool], numel: Sequence[int] | None
    ) -> None:
        """The names the next step records hold, written before the next of them."""
        document = {
            "names": list(names),
            "expert": list(expert),
            "numel": None if numel is None else list(numel),
        }
        self._layout = _frame(_LAYOUT, _json(document))
        self._layout_written = False

    def step(self, payload: bytes, holds_params: bool) -> None:
        if holds_params and not self._layout_written and self._layout is not None:
            self._layout_written = self._append(self._layout)
            if not self._layout_written:
                self._lost += 1
                return
        if not self._append(_frame(self._step_kind, self._step_head + payload)):
            self._lost += 1

    def _append(self, frame: bytes) -> bool:
        if self._fd is None:
            return False
        try:
            before = os.fstat(self._fd).st_size
        except OSError:
            before = None
        try:
            written = os.write(self._fd, frame)
            if written != len(frame):
                raise OSError(f"wrote {written} of {len(frame)} bytes")
        except OSError as error:
            if before is not None:
                with contextlib.suppress(OSError):
                    os.ftruncate(self._fd, before)  # no torn record left behind where possible
            if not self._failing:
                self._failing = True
                warn(
                    f"{self.path}: cannot append to the telemetry log ({error}); training "
                    "goes on, and the records meanwhile are lost"
                )
            self._layout_written = False  # a later step record needs its layout again
            return False
        if self._failing:
            self._failing = False
            warn(f"{self.path}: appending again; {self._lost} record(s) were lost")
            self._lost = 0
        return True

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


@dataclass(frozen=True)
class StartRecord:
    """A recorder's start: one per attempt (a resumed run appends its own)."""

    attempt: str
    time_ns: int
    version: int
    norm_type: float
    world_size: int
    every: int | None
    groups: tuple[str, ...]


@dataclass(frozen=True)
class StepRecordData:
    """One recorded step as the log holds it."""

    attempt: str
    step: int
    norm: float
    logged: float | None
    triggers: int
    repeat: int  # the snapshot's repeat index, -1: none
    names: tuple[str, ...]  # the layout's names (empty: the norm only)
    expert: tuple[bool, ...]
    numel: tuple[int, ...] | None  # each name's elements, as the layout gives them
    norms: array[float] | None  # -1: no gradient
    max_abs: array[float] | None
    zeros: list[int] | None
    nan: dict[int, int]  # index: count, where non-zero
    inf: dict[int, int]
    end_offset: int = 0  # where the record ends in the file


class UnreadableLog(SnapshotError):
    """A telemetry log none of whose records can be read: empty, unreadable, or without an
    intact start record."""


class _Damage:
    """Reports each run of unreadable bytes once, as one line."""

    def __init__(self, path: Path, report: Callable[[str], None]) -> None:
        self.path, self.report = path, report

    def __call__(self, offset: int, length: int, reason: str) -> None:
        self.report(f"{self.path}: skipped {length} bytes at offset {offset} ({reason})")


def _parse_step(
    payload: bytes, start: StartRecord | None, layout: dict[str, Any] | None
) -> StepRecordData:
    """A step record's data; ``layout`` None: its per-parameter statistics (checked, then)
    are left out, the names they belong to being unknown."""
    step, norm, logged, triggers, repeat, count = _STEP.unpack_from(payload, 0)
    names: tuple[str, ...] = ()
    expert: tuple[bool, ...] = ()
    numel = None
    norms = peaks = None
    zeros = None
    nan: dict[int, int] = {}
    inf: dict[int, int] = {}
    if count:
        offset = _STEP.size
        norms = array("d")
        norms.frombytes(payload[offset : offset + 8 * count])
        offset += 8 * count
        peak32 = array("f")
        peak32.frombytes(payload[offset : offset + 4 * count])
        peaks = array("d", peak32)
        offset += 4 * count
        zeros32 = array("I")
        zeros32.frombytes(payload[offset : offset + 4 * count])
        zeros = list(zeros32)
        offset += 4 * count
        (extras,) = struct.unpack_from("<I", payload, offset)
        offset += 4
        for _ in range(extras):
            index, zero, nan_count, inf_count, peak = _EXTRA.unpack_from(payload, offset)
            offset += _EXTRA.size
            zeros[index], peaks[index] = zero, peak
            if nan_count:
                nan[index] = nan_count
            if inf_count:
                inf[index] = inf_count
        if offset != len(payload):
            raise ValueError(f"step {step}: {len(payload) - offset} bytes left over")
        if layout is None:
            norms = peaks = zeros = None
            nan, inf = {}, {}
        else:
            names, expert = tuple(layout["names"]), tuple(layout["expert"])
            if layout.get("numel") is not None:
                numel = tuple(int(value) for value in layout["numel"])
    return StepRecordData(
        attempt=start.attempt if start is not None else "",
        step=step,
        norm=norm,
        logged=_logged(logged, start.version if start is not None else FORMAT_VERSION),
        triggers=triggers,
        repeat=repeat,
        names=names,
        expert=expert,
        numel=numel,
        norms=norms,
        max_abs=peaks,
        zeros=zeros,
        nan=nan,
        inf=inf,
    )


def _logged(stored: bytes, version: int) -> float | None:
    """The logged norm a step record holds, None for none."""
    if stored == _NO_LOGGED:
        return None
    (value,) = _F64.unpack(stored)
    return None if version < 2 and math.isnan(value) else value  # version 1's NaN was none


def read_log(
    path: Path,
    report: Callable[[str], None],
    on_start: Callable[[StartRecord], None] | None = None,
) -> Iterator[tuple[StartRecord, StepRecordData]]:
    """The step records of a telemetry log in the order written, each with its attempt's start
    record. Damaged or torn bytes are skipped, each run as one ``report`` line; so are the
    step records, or their per-parameter statistics, that damage leaves unattributable (the
    module's docstring), one line for each stretch of them.

    Args:
        path: the log.
        report: called with each line about what was skipped.
        on_start: called with each intact start record as it is read (an attempt that
            recorded no step has one too).

    Raises:
        UnreadableLog: the file is empty, cannot be read, or holds no intact start record of
            this format (damaged bytes where it would be: the step records after them are one
            line, left out).
        SnapshotError: a start record of a newer format version than :data:`FORMAT_VERSION`.
    """
    damage = _Damage(path, report)
    try:
        with open(path, "rb") as file:
            size = os.fstat(file.fileno()).st_size
            if size == 0:
                raise UnreadableLog(f"{path}: an empty telemetry log")
            with mmap.mmap(file.fileno(), 0, access=mmap.ACCESS_READ) as data:
                yield from _records(data, size, damage, path, on_start)
    except OSError as error:
        raise UnreadableLog(f"{path}: cannot read ({error.strerror or error})") from error


class _Unattributed:
    """The step records since damage that may have held their layout record (or their start
    record): which they were, reported as one line when the stretch ends."""

    def __init__(self, path: Path, report: Callable[[str], None], what: str) -> None:
        self.path, self.report, self.what = path, report, what
        self.reason: str | None = None  # why the stretch is open; None: no stretch
        self.steps: list[int] = []

    def begin(self, reason: str) -> None:
        if self.reason is None:
            self.reason = reason

    def end(self) -> None:
        if self.steps:
            first, last = self.steps[0], self.steps[-1]
            span = f"step {first}" if len(self.steps) == 1 else f"steps {first} .. {last}"
            count = f"{len(self.steps)} step record{'s' if len(self.steps) != 1 else ''}"
            self.report(f"{self.path}: {self.what.format(count=count, span=span)} {self.reason}")
        self.reason, self.steps = None, []


def _records(
    data: mmap.mmap,
    size: int,
    damage: _Damage,
    path: Path,
    on_start: Callable[[StartRecord], None] | None,
) -> Iterator[tuple[StartRecord, StepRecordData]]:
    start: StartRecord | None = None
    start_id: int | None = None  # its attempt id, as version 3's step records name it
    started = False  # an intact start record was read
    layout: dict[str, Any] | None = None
    rows_lost = _Unattributed(
        path,
        damage.report,
        "left out the per-parameter statistics of {count} ({span}), their totals kept:",
    )
    orphans = _Unattributed(path, damage.report, "left out {count} ({span}):")
    offset = 0
    head_size = _HEAD.size + _CRC.size
    while offset < size:
        found = _frame_at(data, offset, size)
        if isinstance(found, _Unreadable):
            following = data.find(_MAGIC, offset + 1)
            end = size if following < 0 else following
            damage(offset, end - offset, found.reason)
            if found.kind is None:
                rows_lost.begin(
                    f"the layout record naming them may be among the damaged bytes at "
                    f"offset {offset}"
                )
                if start is None:  # and so may the start record, none read before
                    orphans.begin(_LOST_START.format(offset=offset))
            elif found.kind == _LAYOUT:
                rows_lost.begin(f"the layout record naming them, at offset {offset}, is damaged")
            elif found.kind == _START:
                orphans.begin(_LOST_START.format(offset=offset))
            offset = end
            continue
        kind, payload = found
        record_offset, offset = offset, offset + head_size + len(payload) + _CRC.size
        try:
            if kind == _START:
                start, layout = None, None
                start = _parse_start(payload, path)
                start_id = _attempt_id(start)
                started = True
                orphans.end()
                rows_lost.end()
                if on_start is not None:
                    on_start(start)
            elif kind == _LAYOUT:
                layout = None
                layout = _parse_layout(payload)
                rows_lost.end()
            elif kind in (_STEP_KIND, _ATTEMPT_STEP):
                if kind == _ATTEMPT_STEP:
                    (attempt,) = _ATTEMPT.unpack_from(payload, 0)
                    payload = payload[_ATTEMPT.size :]
                    if start is not None and attempt != start_id:
                        orphans.begin(_OTHER_ATTEMPT.format(attempt=attempt, own=start.attempt))
                elif start is not None and start.version >= 3:  # which writes none of kind 3
                    orphans.begin(_OLDER_STEP.format(version=start.version))
                if start is None and orphans.reason is None:
                    raise ValueError("a step record before any start record")
                count = _STEP.unpack_from(payload, 0)[5]
                usable = layout
                if count and (usable is None or len(usable["names"]) != count):
                    rows_lost.begin(f"no layout record of {count} names precedes them")
                if rows_lost.reason is not None:
                    usable = None
                record = _parse_step(payload, start, usable)
                if orphans.reason is not None:
                    orphans.steps.append(record.step)
                    continue
                assert start is not None
                if count and usable is None:
                    rows_lost.steps.append(record.step)
                yield start, dataclasses.replace(record, end_offset=offset)
            else:
                raise ValueError(f"unknown record kind {kind}")
        except (ValueError, KeyError, TypeError, struct.error) as error:
            damage(record_offset, offset - record_offset, f"a record that does not parse: {error}")
            if kind == _LAYOUT:
                rows_lost.begin(
                    f"the layout record naming them, at offset {record_offset}, is damaged"
                )
            elif kind == _START:
                orphans.begin(_LOST_START.format(offset=record_offset))
    orphans.end()
    rows_lost.end()
    if not started:
        raise UnreadableLog(f"{path}: no start record of a {FORMAT_NAME} log")


# Step records of an attempt whose start record was not read: why they are not that of the
# start record before them, then what that means.
_UNREAD_START = (
    ": the start record of theirs, with its norm type, was not read (damaged bytes may have "
    "held it)"
)
_OTHER_ATTEMPT = (
    "they name attempt {attempt:010x}, not that of the start record before them ({own})"
    + _UNREAD_START
)
_OLDER_STEP = (
    "they are of a version before 3, not that of the start record before them ({version})"
    + _UNREAD_START
)
_LOST_START = (
    "the start record before them, at offset {offset}, is damaged: which attempt recorded "
    "them, with which norm type, is unknown"
)


def _parse_start(payload: bytes, path: Path) -> StartRecord:
    document = json.loads(payload)
    if document.get("format") != FORMAT_NAME:
        raise ValueError(f"format {document.get('format')!r}")
    return StartRecord(
        attempt=str(document["attempt"]),
        time_ns=int(document["time_ns"]),
        version=_version(document["version"], path),
        norm_type=float(document["norm_type"]),
        world_size=int(document["world_size"]),
        every=document["every"],
        groups=tuple(document["groups"]),
    )


def _attempt_id(start: StartRecord) -> int | None:
    """A start record's attempt id as its step records name it (None: not 10 hex digits, as
    gradstat writes it: no step record names it)."""
    text = start.attempt
    if len(text) != 10 or text.strip("0123456789abcdef"):
        return None
    return int(text, 16)


def _parse_layout(payload: bytes) -> dict[str, Any]:
    layout: dict[str, Any] = json.loads(payload)
    numel = layout.get("numel")
    if len(layout["expert"]) != len(layout["names"]) or (
        numel is not None and len(numel) != len(layout["names"])
    ):
        raise ValueError("a layout whose lists differ in length")
    return layout


def _version(stored: Any, path: Path) -> int:
    """A start record's format version, refused when a newer gradstat wrote it: its records
    may hold what this reader would misread, and a resumed run's later attempts with them.

    Raises:
        SnapshotError: a version above :data:`FORMAT_VERSION`.
    """
    version = int(stored)
    if version < 1:
        raise ValueError(f"format version {version}, which no gradstat writes")
    if version > FORMAT_VERSION:
        raise SnapshotError(
            f"{path}: a telemetry log of format version {version}, written by a newer "
            f"gradstat; this one reads versions up to {FORMAT_VERSION}: upgrade gradstat "
            "to read it"
        )
    return version


@dataclass(frozen=True)
class _Unreadable:
    """Why there is no frame at an offset, and the kind of record that was there when its head
    is intact (None: unknown)."""

    reason: str
    kind: int | None = None


def _frame_at(data: mmap.mmap, offset: int, size: int) -> tuple[int, bytes] | _Unreadable:
    """The frame at ``offset`` as (kind, payload), or why there is none."""
    head_end = offset + _HEAD.size + _CRC.size
    if head_end > size:
        return _Unreadable("a torn last record: the job stopped mid-write")
    head = data[offset : offset + _HEAD.size]
    magic, kind, length = _HEAD.unpack(head)
    if magic != _MAGIC:
        return _Unreadable("not a record's start")
    (head_crc,) = _CRC.unpack(data[offset + _HEAD.size : head_end])
    if head_crc != zlib.crc32(head):
        return _Unreadable("a record head whose checksum fails")
    end = head_end + length + _CRC.size
    # A record cut short, then followed by another run's records, holds the next one's start.
    torn = "a torn record: a job stopped mid-write and a later one appended after it"
    if end > size:
        inside = data.find(_MAGIC, head_end, size)
        return _Unreadable(
            "a torn last record: the job stopped mid-write" if inside < 0 else torn, kind
        )
    payload = data[head_end : head_end + length]
    (crc,) = _CRC.unpack(data[end - _CRC.size : end])
    if crc != zlib.crc32(payload):
        inside = data.find(_MAGIC, head_end, end) >= 0
        return _Unreadable(torn if inside else "a record whose checksum fails", kind)
    return kind, payload

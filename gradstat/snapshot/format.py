"""The snapshot format: one safetensors file per rank, self-described in its header.

A rank file is a plain safetensors file: an 8-byte little-endian header length, a JSON header,
then the tensors' bytes back to back. Each tensor is one parameter's local gradient under the
parameter's name. ``__metadata__["gradstat"]`` holds a JSON document (format version 1):

    {"format": "gradstat-snapshot", "version": 1,
     "rank": 3, "world_size": 8, "step": 1200,            # step may be null
     "coords": {"tp": [1, 2], "pp": [0, 2], ...},         # all of AXES, [rank_on_axis, size]
     "distributed_optimizer": false, "grad_attr": "main_grad",
     "params": [{"name": ..., "grad": true, "shape": [...], "dtype": "float32",
                 "param_shape": [...], "attrs": {...}, "dtensor": null | {...}}, ...]}

``attrs`` holds every attribute the statistics depend on (see ``ATTRIBUTE_DEFAULTS``);
``gtp_group`` is the GTP group's ``[rank, size]``. A distributed-optimizer fragment may say
where it lies: ``fragment_offset`` (its first element in the flattened local parameter) and
``fragment_shape`` (that parameter's shape); ``gradstat compare`` and ``audit`` need them to
place fragments. ``dtensor`` records a DTensor gradient's mesh: ``{"mesh_shape": [...],
"coordinate": [...], "placements": ["S(0)", "R"], "global_shape": [...]}``. A parameter whose
gradient is None has ``"grad": false`` and no tensor in the file.
"""

from __future__ import annotations

import json
import math
import operator
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from gradstat._cached import cached
from gradstat.core.axes import AXES
from gradstat.core.placements import MeshPlacement, valid_code
from gradstat.errors import SnapshotError

if TYPE_CHECKING:
    from gradstat.snapshot.repeats import KnownParams

FORMAT_NAME = "gradstat-snapshot"
FORMAT_VERSION = 1
METADATA_KEY = "gradstat"
GRAD_ATTRS = ("grad", "main_grad", "decoupled_grad")
FILE_PATTERN = "rank-{rank:05d}.safetensors"
# A file of a Megatron wgrads dump (--save-wgrads-interval): TP rank, then PP and EP ranks
# (either alone when the other's size is 1). See gradstat.snapshot.wgrads.
WGRADS_FILE = re.compile(r"^mp_rank_(\d{2,})(?:_(\d{3,}))?(?:_(\d{3,}))?\.pth$")


def is_wgrads_name(name: str) -> bool:
    return WGRADS_FILE.match(name) is not None


# safetensors dtype codes of the gradient dtypes a snapshot keeps as they are.
DTYPES = {
    "float32": (torch.float32, "F32"),
    "bfloat16": (torch.bfloat16, "BF16"),
    "float16": (torch.float16, "F16"),
    "float64": (torch.float64, "F64"),
    "complex64": (torch.complex64, "C64"),
    "complex128": (torch.complex128, "F64"),
}
# The dtypes safetensors has no code for, kept as their real view (the same bytes: the shape and
# a last dimension of 2, real and imaginary parts) in the dtype named here; the record says
# which they are.
REAL_VIEWS = {"complex128": "float64"}
DTYPE_NAMES = {torch_dtype: name for name, (torch_dtype, _) in DTYPES.items()}
CODE_NAMES = {code: name for name, (_, code) in DTYPES.items() if name not in REAL_VIEWS}

# Megatron attributes recorded per parameter, with the value an absent attribute means.
ATTRIBUTE_DEFAULTS: dict[str, Any] = {
    "tensor_model_parallel": False,
    "partition_dim": -1,
    "partition_stride": 1,
    "shared": False,
    "shared_embedding": False,
    "allreduce": True,
    "is_gtp_weight_remat": False,
    "pad_length": 0,
    "gtp_group": None,
    "gtp_pad_zeros": None,
    "fragment_offset": None,
    "fragment_shape": None,
    "fsdp_param": False,
}


# Attributes recorded as the parameter carries them (the rest are derived: gtp_group from the
# GTP group's rank()/size(), fsdp_param from ``__fsdp_param__``).
PLAIN_ATTRS = tuple(key for key in ATTRIBUTE_DEFAULTS if key not in ("gtp_group", "fsdp_param"))

# The plain attributes an absent one stands for, those whose default is a value.
_PLAIN_PRESENT = {
    key: ATTRIBUTE_DEFAULTS[key] for key in PLAIN_ATTRS if ATTRIBUTE_DEFAULTS[key] is not None
}
_PLAIN_KEYS = frozenset(PLAIN_ATTRS)

# What a distributed-optimizer fragment takes over from its parameter; the rest (its place in
# the parameter, the GTP padding inside it) is the fragment's own.
FRAGMENT_INHERITED_ATTRS = tuple(
    key for key in PLAIN_ATTRS if key not in ("gtp_pad_zeros", "fragment_offset", "fragment_shape")
)

ATTRIBUTE_KINDS: dict[str, type] = {
    "tensor_model_parallel": bool,
    "partition_dim": int,
    "partition_stride": int,
    "shared": bool,
    "shared_embedding": bool,
    "allreduce": bool,
    "is_gtp_weight_remat": bool,
    "pad_length": int,
    "gtp_group": list,
    "gtp_pad_zeros": int,
    "fragment_offset": int,
    "fragment_shape": list,
    "fsdp_param": bool,
}


def supported_dtypes() -> str:
    return ", ".join(DTYPES)


# torch keeps sizes and strides in int64, and computes strides even for a tensor with no
# element: a [0, 2**62, 4] shape fails in torch.empty as surely as a [2**63] one.
TORCH_SIZE_LIMIT = 2**63 - 1


def are_sizes(values: Sequence[Any], minimum: int = 0) -> bool:
    """Whether ``values`` are all integers >= ``minimum`` (true and false are not integers
    here, though Python's bool is an int).

    A loop: a header checks a few sizes per tensor, thousands of times, and this takes 0.34 us
    for two where ``set(map(type, ...))`` and ``min`` took 2.0.
    """
    for value in values:  # noqa: SIM110 (all() over a generator: 0.79 us for two)
        if type(value) is not int or value < minimum:
            return False
    return True


def fits_torch(shape: Sequence[int], scale: int = 1) -> bool:
    """Whether torch can make a tensor of ``shape`` whose elements are ``scale`` times as many.

    Each size, a 0 taken as 1, multiplies in; the check stops as soon as the limit is passed, so
    a header's huge numbers cost no huge arithmetic.
    """
    if len(shape) <= 8 and 0 not in shape:  # a tensor's shape: its product costs nothing
        return math.prod(shape, start=scale) <= TORCH_SIZE_LIMIT
    total = scale
    for size in shape:
        total *= max(size, 1)
        if total > TORCH_SIZE_LIMIT:
            return False
    return True


class _DuplicateKey(Exception):
    """A JSON object that lists a key twice (``json`` would keep the last one silently)."""


def _unique_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    found = dict(pairs)
    if len(found) != len(pairs):
        seen: set[str] = set()
        for key, _ in pairs:
            if key in seen:
                raise _DuplicateKey(key)
            seen.add(key)
    return found


# One decoder for every header: ``json.loads`` with a hook builds a new one per call.
_DECODER = json.JSONDecoder(object_pairs_hook=_unique_keys)


def load_json(path: Path, text: str, what: str) -> Any:
    """``json.loads`` without the standard library's leniencies toward a hostile file.

    A key given twice in one object is refused (``json`` keeps the last one silently), and
    nesting deeper than Python's recursion limit becomes an error naming the file.

    Raises:
        SnapshotError: a duplicate key, or nesting too deep to parse.
        ValueError: ``text`` is not JSON (the caller words that for its format).
    """
    try:
        return _DECODER.decode(text)
    except _DuplicateKey as error:
        raise SnapshotError(f"{path}: {what} lists {error.args[0]!r} twice") from None
    except RecursionError as error:
        raise SnapshotError(
            f"{path}: {what} is nested too deeply to parse (not a gradstat snapshot)"
        ) from error


def scan_json(text: str, index: int) -> tuple[Any, int] | None:
    """The JSON value at ``text[index]`` and the index after it, read as :func:`load_json` reads
    (no key twice); None where no such value begins there."""
    try:
        value, end = _DECODER.raw_decode(text, index)
    except (ValueError, _DuplicateKey, RecursionError):
        return None
    return value, end


# Megatron's expert parameters, by name (``...mlp.experts.local_experts.3.linear_fc1.weight``,
# ``...experts.linear_fc1.weight3``, torchtitan's ``...moe.experts.w1``): what a reader that
# finds no attributes (a wgrads dump, a checkpoint) marks ``allreduce=False``.
EXPERT_NAME = re.compile(r"(^|\.)experts\.")


# A DTensor gradient's placement on its mesh (placements decide what counts).
DTensorRecord = MeshPlacement


@dataclass(frozen=True)
class ParamRecord:
    """One parameter of a rank file: its name, gradient shape/dtype and attributes."""

    name: str
    has_grad: bool
    shape: tuple[int, ...]
    dtype: str | None
    param_shape: tuple[int, ...]
    attrs: dict[str, Any] = field(default_factory=dict)
    dtensor: DTensorRecord | None = None

    def attr(self, key: str) -> Any:
        return self.attrs.get(key, ATTRIBUTE_DEFAULTS[key])

    def with_own(
        self, name: str, attrs: dict[str, Any], dtensor: MeshPlacement | None
    ) -> ParamRecord:
        """This record with another name, attributes and placement: a template's record in a
        list of values of its own (``gradstat.snapshot.repeats``), made as a copy of this one's
        fields and of the values it cached from its attributes and shapes alone
        (``_CACHED_FROM_ATTRS``), those where the attributes are these: 1.1 us with its
        ``plain_attrs`` and ``is_expert`` read, against 3.3 us through the frozen dataclass's
        ``__init__`` (each field set by ``object.__setattr__``) and the two computed again."""
        twin = object.__new__(ParamRecord)
        state = twin.__dict__
        state.update(self.__dict__)
        for key in _CACHED_ELSE if attrs is self.attrs else _CACHED:
            state.pop(key, None)
        state["name"], state["attrs"], state["dtensor"] = name, attrs, dtensor
        return twin

    @cached
    def plain_attrs(self) -> dict[str, Any]:
        """The attributes a parameter rebuilt from this record carries: each of PLAIN_ATTRS,
        its default where the record has none; one that is None is left out (absent)."""
        values = dict(_PLAIN_PRESENT)
        for key, value in self.attrs.items():
            if key in _PLAIN_KEYS:
                if value is None:
                    values.pop(key, None)
                else:
                    values[key] = value
        return values

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @cached
    def is_expert(self) -> bool:
        """Megatron's mark of an expert-parallel parameter (``allreduce=False``): counted over
        the expert axes (``etp``, ``ep``, ``egtp``, ``edp``)."""
        return not self.attr("allreduce")

    @cached
    def expert(self) -> bool:
        """Whether the statistics split it as an expert's (dense and expert norms, ``explain``):
        Megatron's mark, or, for a parameter of torch-native parallelism (a DTensor, or a
        plain tensor without any Megatron attribute: DDP), its name under an ``experts``
        module, as a checkpoint's or a wgrads dump's is told. What counts is placed by
        ``is_expert`` (and a DTensor's placements): this changes no count."""
        if self.is_expert:
            return True
        if self.dtensor is None and self.attrs:
            return False  # Megatron's attributes say it
        return EXPERT_NAME.search(self.name) is not None

    @cached
    def extent(self) -> int:
        """The most elements any of its shapes spans (shape, param_shape, fragment_shape), a
        size of 0 taken as 1: how far from torch's 64-bit limit its shards side by side are."""
        shapes = (self.shape, self.param_shape, self.attr("fragment_shape") or ())
        return max(math.prod(size or 1 for size in shape) for shape in shapes)


# ParamRecord's cached values, and those that are functions of its attributes and shapes alone.
_CACHED = tuple(name for name, value in vars(ParamRecord).items() if isinstance(value, cached))
_CACHED_FROM_ATTRS = ("plain_attrs", "is_expert", "extent")
_CACHED_ELSE = tuple(name for name in _CACHED if name not in _CACHED_FROM_ATTRS)


@dataclass(frozen=True)
class RankHeader:
    """The gradstat metadata of one rank file."""

    rank: int
    world_size: int
    step: int | None
    coords: dict[str, tuple[int, int]]
    distributed_optimizer: bool
    grad_attr: str
    params: tuple[ParamRecord, ...]
    version: int = FORMAT_VERSION
    # Why the snapshot was taken, when a flight recorder took it ("nonfinite", "spike", ...).
    triggers: tuple[str, ...] = ()
    # Worked out when the snapshot is opened, never written: the parameters this file counts
    # for a lower replica that holds no gradient (see gradstat.snapshot.stand_ins).
    stand_ins: frozenset[str] = frozenset()

    def to_json(self) -> str:
        document: dict[str, Any] = {
            "format": FORMAT_NAME,
            "version": self.version,
            "rank": self.rank,
            "world_size": self.world_size,
            "step": self.step,
            "coords": {axis: list(place) for axis, place in self.coords.items()},
            "distributed_optimizer": self.distributed_optimizer,
            "grad_attr": self.grad_attr,
        }
        if self.triggers:
            document["triggers"] = list(self.triggers)
        # Last: a reader finds the list's text without parsing (see ``KnownParams``).
        document["params"] = [_param_to_json(record) for record in self.params]
        return json.dumps(document, separators=(",", ":"))


def _param_to_json(record: ParamRecord) -> dict[str, Any]:
    dtensor = None
    if record.dtensor is not None:
        dtensor = {
            "mesh_shape": list(record.dtensor.mesh_shape),
            "coordinate": list(record.dtensor.coordinate),
            "placements": list(record.dtensor.placements),
            "global_shape": list(record.dtensor.global_shape),
            "mesh_dim_names": _optional_list(record.dtensor.mesh_dim_names),
            "global_offset": _optional_list(record.dtensor.global_offset),
            "copies": [list(copy) for copy in record.dtensor.copies],
        }
    return {
        "name": record.name,
        "grad": record.has_grad,
        "shape": list(record.shape),
        "dtype": record.dtype,
        "param_shape": list(record.param_shape),
        "attrs": record.attrs,
        "dtensor": dtensor,
    }


def _optional_list(values: tuple[Any, ...] | None) -> list[Any] | None:
    return None if values is None else list(values)


class _Fields:
    """Typed access to one JSON object, with errors that name the file and the field.

    ``where`` names the object; with ``subject``, it is a template that takes it (``"params[{}]"``
    and 3), worded only when an error needs it: a header has thousands of objects, all sound.
    """

    def __init__(self, path: Path, where: str, data: Any, subject: object = None) -> None:
        self.path, self.data = path, data
        self.name(where, subject)
        if type(data) is not dict:
            raise SnapshotError(f"{path}: {self.where} is not a JSON object")

    def name(self, where: str, subject: object = None) -> None:
        """Name the object anew (a parameter once its name is read)."""
        self._where, self._subject = where, subject

    @property
    def where(self) -> str:
        return self._where if self._subject is None else self._where.format(self._subject)

    def fail(self, message: str) -> SnapshotError:
        return SnapshotError(f"{self.path}: {self.where}: {message}")

    def get(self, key: str, kind: type | tuple[type, ...], optional: bool = False) -> Any:
        value = self.data.get(key)
        if type(value) is kind:  # JSON gives exact types; the checks below word a mismatch
            return value
        if key not in self.data:
            if optional:
                return None
            raise self.fail(f"missing field {key!r}")
        value = self.data[key]
        if value is None and optional:
            return None
        # bool is an int in Python; a field typed int must not accept true/false.
        if isinstance(value, bool) and bool not in _as_tuple(kind):
            raise self.fail(f"field {key!r} must be {_kind_name(kind)}, got {value!r}")
        if not isinstance(value, kind):
            raise self.fail(f"field {key!r} must be {_kind_name(kind)}, got {value!r}")
        return value

    def ints(self, key: str, minimum: int = 0) -> tuple[int, ...]:
        values = self.get(key, list)
        if not are_sizes(values, minimum):
            raise self.fail(f"field {key!r} must be a list of integers >= {minimum}")
        return tuple(values)

    def sizes(self, key: str) -> tuple[int, ...]:
        """A tensor shape: sizes >= 0 that torch can hold."""
        shape = self.ints(key)
        if not fits_torch(shape):
            raise self.fail(
                f"field {key!r} is {list(shape)}, too large for torch (its sizes are 64-bit)"
            )
        return shape


def _as_tuple(kind: type | tuple[type, ...]) -> tuple[type, ...]:
    return kind if isinstance(kind, tuple) else (kind,)


def _kind_name(kind: type | tuple[type, ...]) -> str:
    names = {
        bool: "true/false",
        int: "an integer",
        str: "a string",
        list: "a list",
        dict: "an object",
    }
    return " or ".join(names.get(k, k.__name__) for k in _as_tuple(kind))


_PARAMS_KEY = '"params":'


def _known_params(
    path: Path, text: str, known: KnownParams
) -> tuple[dict[str, Any], tuple[ParamRecord, ...]] | None:
    """The metadata without its parameter list, and the list's records, parsed and checked
    once per distinct list (see :mod:`gradstat.snapshot.repeats`): a snapshot's rank files
    repeat each other's lists, and a list costs more to check than the rest of the file.

    gradstat writes the list last: the text is ``head + list + "}"``, ``head`` ending in
    ``"params":``. When ``head + "null}"`` parses, as an object, that key is the object's own and
    the list's text (a JSON value) is the whole of what follows, so the two parts parse as the
    whole does. None when the text is not so split (another writer's order, a malformed
    file): the caller parses it whole and words any error.
    """
    at = text.rfind(_PARAMS_KEY)
    if at < 0 or not text.endswith("}"):
        return None
    head, listed = text[: at + len(_PARAMS_KEY)], text[at + len(_PARAMS_KEY) : -1]
    try:
        document = load_json(path, head + "null}", "gradstat metadata")
        records = known.records(path, listed)
    except (ValueError, SnapshotError):
        return None
    return None if records is None else (document, records)


def parse_header(path: Path, text: str, known: KnownParams | None = None) -> RankHeader:
    """Parse and check the gradstat metadata of ``path``.

    ``known``: the parameter lists of rank files already read; this file's is added (see
    :func:`_known_params`).

    Raises:
        SnapshotError: not a gradstat snapshot, another format version, or a malformed field.
    """
    split = None if known is None else _known_params(path, text, known)
    try:
        document = load_json(path, text, "gradstat metadata") if split is None else split[0]
    except ValueError as error:
        raise SnapshotError(f"{path}: gradstat metadata is not valid JSON ({error})") from error
    top = _Fields(path, "gradstat metadata", document)
    if top.get("format", str) != FORMAT_NAME:
        raise top.fail(f"format is {document['format']!r}, expected {FORMAT_NAME!r}")
    version = top.get("version", int)
    if version != FORMAT_VERSION:
        raise top.fail(
            f"format version {version} is not supported (this gradstat reads {FORMAT_VERSION})"
        )
    world_size = top.get("world_size", int)
    rank = top.get("rank", int)
    if world_size < 1 or not 0 <= rank < world_size:
        raise top.fail(f"rank {rank} is outside world size {world_size}")
    step = top.get("step", int, optional=True)
    coords = _parse_coords(_Fields(path, "coords", top.get("coords", dict)))
    grad_attr = top.get("grad_attr", str)
    if grad_attr not in GRAD_ATTRS:
        raise top.fail(f"grad_attr {grad_attr!r} is not one of {', '.join(GRAD_ATTRS)}")
    params = parse_params(path, top.get("params", list)) if split is None else split[1]
    triggers = top.get("triggers", list, optional=True) or []
    if not all(isinstance(trigger, str) for trigger in triggers):
        raise top.fail("triggers must be a list of strings")
    return RankHeader(
        rank=rank,
        world_size=world_size,
        step=step,
        coords=coords,
        distributed_optimizer=top.get("distributed_optimizer", bool),
        grad_attr=grad_attr,
        params=params,
        version=version,
        triggers=tuple(triggers),
    )


_UNSPLIT = [0, 1]


def parse_params(path: Path, entries: list[Any]) -> tuple[ParamRecord, ...]:
    params = tuple(_parse_param(path, index, entry) for index, entry in enumerate(entries))
    names: set[str] = set()
    for record in params:
        if record.name in names:
            raise SnapshotError(
                f"{path}: gradstat metadata: parameter {record.name!r} is listed twice"
            )
        names.add(record.name)
    return params


def _parse_coords(fields: _Fields) -> dict[str, tuple[int, int]]:
    if not fields.data.keys() <= _AXIS_NAMES:
        unknown = sorted(fields.data.keys() - _AXIS_NAMES)
        raise fields.fail(f"unknown axis {unknown[0]!r} (axes: {', '.join(AXES)})")
    coords = {}
    found = fields.data
    for axis in AXES:
        place = found.get(axis, _UNSPLIT)
        if type(place) is list and len(place) == 2:
            rank, size = place
            if type(rank) is int and type(size) is int and 0 <= rank < size:
                coords[axis] = (rank, size)
                continue
        raise fields.fail(f"axis {axis!r} is {place!r}; expected [rank_on_axis, size]")
    return coords


_AXIS_NAMES = frozenset(AXES)


def _parse_param(path: Path, index: int, entry: Any) -> ParamRecord:
    record = _plain_record(entry)
    return record if record is not None else _checked_param(path, index, entry)


# The attributes a plain record may carry, by kind: all but the GTP group (a GTP shard's
# record is checked field by field); a fragment's place is checked besides.
_QUICK_KINDS = {key: kind for key, kind in ATTRIBUTE_KINDS.items() if key != "gtp_group"}


def _plain_record(entry: Any) -> ParamRecord | None:
    """The record of a plain entry (no GTP group, each attribute of its own type, a
    distributed-optimizer fragment inside its parameter, a DTensor's shard inside its tensor),
    checked in a few steps: a rank file lists thousands, and a snapshot whose files do not
    repeat each other's lists (pipeline stages, fragments, FSDP2 shards) has every one checked.
    None for any other entry, sound or not, which :func:`_checked_param` reads (and words what
    is wrong): what this accepts, it accepts as that does, and makes the same record of."""
    if type(entry) is not dict:
        return None
    name, has_grad, dtype = entry.get("name"), entry.get("grad"), entry.get("dtype")
    shape, param_shape, attrs = entry.get("shape"), entry.get("param_shape"), entry.get("attrs")
    if not (
        type(name) is str
        and type(has_grad) is bool
        and ((type(dtype) is str and dtype in DTYPES) or (dtype is None and not has_grad))
        and type(shape) is list
        and type(param_shape) is list
        and type(attrs) is dict
        and all(type(value) is _QUICK_KINDS.get(key) for key, value in attrs.items())
        and are_sizes(shape)
        and are_sizes(param_shape)
        and fits_torch(shape)
        and fits_torch(param_shape)
    ):
        return None
    if ("fragment_offset" in attrs or "fragment_shape" in attrs) and not fits_fragment(
        attrs, shape
    ):
        return None
    found = entry.get("dtensor")
    placement = None if found is None else _quick_placement(found)
    if found is not None and (placement is None or not shard_inside(placement, shape)):
        return None
    return ParamRecord(name, has_grad, tuple(shape), dtype, tuple(param_shape), attrs, placement)


def _quick_placement(found: Any) -> MeshPlacement | None:
    """A DTensor record's placement as :func:`_parse_dtensor` makes it, checked in a few steps;
    None for anything unusual (that function words what is wrong)."""
    if type(found) is not dict:
        return None
    mesh_shape, coordinate = found.get("mesh_shape"), found.get("coordinate")
    placements, names = found.get("placements"), found.get("mesh_dim_names")
    global_shape, offset = found.get("global_shape"), found.get("global_offset")
    copies = found.get("copies")
    if not (
        type(mesh_shape) is list
        and type(coordinate) is list
        and type(placements) is list
        and type(global_shape) is list
        and (names is None or (type(names) is list and all(type(n) is str for n in names)))
        and (offset is None or (type(offset) is list and are_sizes(offset)))
        and (copies is None or (type(copies) is list and all(map(_plain_copy, copies))))
        and are_sizes(mesh_shape, 1)
        and are_sizes(coordinate)
        and are_sizes(global_shape)
        and fits_torch(global_shape)
        and all(map(valid_code, placements))
        and len(mesh_shape) == len(placements)
        and (not names or len(names) == len(placements))
    ):
        return None
    placement = MeshPlacement(
        mesh_shape=tuple(mesh_shape),
        coordinate=tuple(coordinate),
        placements=tuple(placements),
        global_shape=tuple(global_shape),
        mesh_dim_names=None if names is None else tuple(names),
        global_offset=tuple(offset) if offset else None,  # [] as no offset, as there
        copies=tuple((copy[0], copy[1], copy[2]) for copy in copies or ()),
    )
    return placement if on_its_mesh(placement) else None


def on_its_mesh(placement: MeshPlacement) -> bool:
    """Whether a DTensor shard's coordinate lies on its mesh and its offset, where it has one,
    gives one place per dimension of its global shape: the checks of a rank's own numbers."""
    coordinate, mesh_shape = placement.coordinate, placement.mesh_shape
    offset = placement.global_offset
    return (
        len(coordinate) == len(mesh_shape)
        and all(map(int.__lt__, coordinate, mesh_shape))
        and (offset is None or len(offset) == len(placement.global_shape))
    )


def _plain_copy(copy: Any) -> bool:
    """Whether a DTensor record's ``copies`` entry is ``[dim_name, rank, size]``."""
    return (
        type(copy) is list
        and len(copy) == 3
        and type(copy[0]) is str
        and type(copy[1]) is int
        and type(copy[2]) is int
        and 0 <= copy[1] < copy[2]
    )


def shard_inside(placement: MeshPlacement, shape: Sequence[int]) -> bool:
    """Whether a shard of ``shape`` at the placement's offset lies inside its global shape."""
    offset, full = placement.global_offset, placement.global_shape
    if offset is None:
        return True
    # map(): 0.9 us for two dimensions, a generator over zip() 1.9 (once per shard read).
    return len(shape) == len(full) == len(offset) and all(
        map(operator.le, map(operator.add, offset, shape), full)
    )


def fits_fragment(attrs: dict[str, Any], shape: Sequence[int]) -> bool:
    """Whether a plain entry's fragment attributes (each of its kind, ``shape`` sizes) pass
    :func:`_check_fragment`: both given, a flat fragment within its parameter's shape."""
    offset, full = attrs.get("fragment_offset"), attrs.get("fragment_shape")
    return (
        offset is not None
        and full is not None
        and are_sizes(full)
        and fits_torch(full)
        and len(shape) == 1
        and 0 <= offset <= math.prod(full) - shape[0]
    )


def _checked_param(path: Path, index: int, entry: Any) -> ParamRecord:
    """A parameter record checked field by field, naming the first field that is wrong."""
    fields = _Fields(path, "params[{}]", entry, index)
    name = fields.get("name", str)
    fields.name("parameter {!r}", name)
    has_grad = fields.get("grad", bool)
    dtype = fields.get("dtype", str, optional=not has_grad)
    if dtype is not None and dtype not in DTYPES:
        raise fields.fail(f"dtype {dtype!r} is not supported; supported: {supported_dtypes()}")
    attrs = _Fields(path, "parameter {!r} attrs", fields.get("attrs", dict), name)
    if not attrs.data.keys() <= ATTRIBUTE_KINDS.keys():
        unknown = sorted(attrs.data.keys() - ATTRIBUTE_KINDS.keys())
        raise attrs.fail(f"unknown attribute {unknown[0]!r}")
    for key, value in attrs.data.items():
        if type(value) is not ATTRIBUTE_KINDS[key]:
            attrs.get(key, ATTRIBUTE_KINDS[key], optional=True)
    gtp_group = attrs.data.get("gtp_group")
    if gtp_group is not None and (
        len(gtp_group) != 2
        or not all(type(value) is int for value in gtp_group)
        or not 0 <= gtp_group[0] < gtp_group[1]
    ):
        raise attrs.fail(f"gtp_group is {gtp_group!r}; expected [rank_in_group, size]")
    dtensor_data = fields.get("dtensor", dict, optional=True)
    dtensor = None
    if dtensor_data is not None:
        dtensor = _parse_dtensor(_Fields(path, "parameter {!r} dtensor", dtensor_data, name))
    shape = fields.sizes("shape")
    if dtensor is not None and not shard_inside(dtensor, shape):
        assert dtensor.global_offset is not None  # no offset: nothing to lie outside of
        raise fields.fail(
            f"dtensor global_offset {list(dtensor.global_offset)} with shape {list(shape)} "
            f"is outside global_shape {list(dtensor.global_shape)}"
        )
    record = ParamRecord(
        name=name,
        has_grad=has_grad,
        shape=shape,
        dtype=dtype,
        param_shape=fields.sizes("param_shape"),
        attrs=attrs.data,
        dtensor=dtensor,
    )
    if "fragment_offset" in attrs.data or "fragment_shape" in attrs.data:
        _check_fragment(attrs, record)
    return record


def _check_fragment(attrs: _Fields, record: ParamRecord) -> None:
    """A distributed-optimizer fragment's place: a flat range within its parameter's shape."""
    offset, shape = record.attr("fragment_offset"), record.attr("fragment_shape")
    if offset is None and shape is None:
        return
    if offset is None or shape is None:
        raise attrs.fail("fragment_offset and fragment_shape come together")
    if not are_sizes(shape):  # a list: its kind was checked with the other attributes
        raise attrs.fail(f"fragment_shape {shape!r} is not a list of sizes")
    if not fits_torch(shape):  # before any product of a header's numbers is taken
        raise attrs.fail(f"fragment_shape {shape} is too large for torch (its sizes are 64-bit)")
    if len(record.shape) != 1 or not 0 <= offset <= math.prod(shape) - record.numel:
        raise attrs.fail(
            f"a fragment of {record.numel} elements at offset {offset} does not fit in a "
            f"parameter of shape {shape}"
        )


def _parse_dtensor(mesh: _Fields) -> MeshPlacement:
    """A DTensor record; the fields after ``global_shape`` are optional (older files lack them)."""
    placements = tuple(mesh.get("placements", list))
    if not all(valid_code(code) for code in placements):
        raise mesh.fail(f"placements {list(placements)!r}: each must be 'S(dim)', 'R' or 'P'")
    names = mesh.get("mesh_dim_names", list, optional=True)
    if names is not None and not all(isinstance(name, str) for name in names):
        raise mesh.fail("mesh_dim_names must be a list of strings")
    offset = mesh.ints("global_offset") if mesh.get("global_offset", list, True) else None
    copies = []
    for copy in mesh.get("copies", list, optional=True) or []:
        if not _plain_copy(copy):
            raise mesh.fail(f"copies entry {copy!r}: expected [dim_name, rank, size]")
        copies.append((copy[0], copy[1], copy[2]))
    record = MeshPlacement(
        mesh_shape=mesh.ints("mesh_shape", minimum=1),
        coordinate=mesh.ints("coordinate"),
        placements=placements,
        global_shape=mesh.sizes("global_shape"),
        mesh_dim_names=None if names is None else tuple(names),
        global_offset=offset,
        copies=tuple(copies),
    )
    dims = (record.mesh_shape, record.coordinate, placements, *([names] if names else []))
    if len({len(values) for values in dims}) != 1:
        raise mesh.fail("mesh_shape, coordinate, placements and mesh_dim_names differ in length")
    if not all(0 <= i < n for i, n in zip(record.coordinate, record.mesh_shape, strict=True)):
        raise mesh.fail(f"coordinate {list(record.coordinate)} is outside the mesh")
    if offset is not None and len(offset) != len(record.global_shape):
        raise mesh.fail("global_offset and global_shape differ in length")
    return record


# The flight recorder's note in a snapshot it took: why, when, and its norm of the step.
RECORDER_MARKER = ".recorder.json"


def recorded_norm(directory: Path, norm_type: float) -> float | None:
    """The flight recorder's norm of the snapshot's step, of ``norm_type``, from the note it
    leaves in a snapshot it took; None where there is none (a snapshot taken by hand, another
    norm type, a note it could not read)."""
    try:
        note = json.loads((directory / RECORDER_MARKER).read_text())
        found = note["norm"]
        if float(found["type"]) != float(norm_type):
            return None
        return float(found["value"])
    except (OSError, ValueError, KeyError, TypeError):
        return None

"""PyTorch distributed checkpoints (DCP) as snapshots: one kind of tensor, chunk by chunk.

A checkpoint holds more than gradients: model weights, the optimizer's Adam moments
(``exp_avg``, ``exp_avg_sq``) and step counters, or a ``grads`` tree when gradients were saved
with ``dcp.save({"grads": {...}})``. Its statistics mean something one kind at a time, so a
checkpoint is read as the tensors of one kind (:data:`KINDS`; by default its gradients when it
holds any, else its weights), each named by the parameter it belongs to, so that a checkpoint
and a gradient snapshot of the same model compare name by name.

Each data file is a rank file of the snapshot (a :class:`CheckpointFile`): its records are the
chunks it stores, each a box of its tensor placed by its global offset (recorded as a DTensor
shard is, so that analysis, compare and audit place it as they place one), its tensors read
from the chunk's stored byte range when asked for (:mod:`gradstat.snapshot.dcp` indexes and
reads them safely). A file that stores two chunks of one tensor is two rank files, so that a
record name is a file's once. Under a launcher the processes split the rank files, so each
reads its share of the data files.
"""

from __future__ import annotations

import math
import re
import warnings
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, TYPE_CHECKING, ClassVar

import torch

from gradstat.core.axes import AXES
from gradstat.core.placements import MeshPlacement
from gradstat.errors import DumpWarning, SnapshotError
from gradstat.snapshot.container import Container, FileStamp
from gradstat.snapshot.dcp import ChunkRef, DcpIndex, open_index, read_chunk
from gradstat.snapshot.format import DTYPE_NAMES, EXPERT_NAME, ParamRecord, RankHeader
from gradstat.snapshot.reader import RankFile
from gradstat.snapshot.torch_dist import (
    expert_rows,
    is_torch_dist,
    layer_rows,
    refuse_dp_reshardable,
)

if TYPE_CHECKING:
    from collections.abc import Sequence

    from gradstat.snapshot.wgrads import Source

__all__ = [
    "KINDS",
    "CheckpointFile",
    "KeyKind",
    "classify_key",
    "open_checkpoint",
]

# What ``--kind`` selects: one kind of tensor by its parameter's name, or every floating-point
# tensor but the optimizer's step counters by its key.
KINDS = ("grad", "weight", "exp_avg", "exp_avg_sq", "all")
_SAID = {
    "grad": "gradients",
    "weight": "model weights",
    "exp_avg": "Adam first moments (exp_avg)",
    "exp_avg_sq": "Adam second moments (exp_avg_sq)",
    "all": "every floating-point tensor but step counters",
}
# The checkpoint's own folder names: torchtitan's ``step-N``, Megatron's ``iter_NNNNNNN``.
_STEP = re.compile(r"^(?:step-|iter_)(\d+)$")
_MESH_DIM = "checkpoint chunks"


def kind_said(kind: str) -> str:
    """How reports name a kind: ``model weights``, ``gradients``..."""
    return _SAID.get(kind, kind)


# --- What a key holds -------------------------------------------------------------------------


@dataclass(frozen=True)
class KeyKind:
    """What a checkpoint key holds, and the parameter it belongs to (None when none)."""

    kind: str  # grad, exp_avg, exp_avg_sq, step, weight or other
    param: str | None


_MOMENTS = {"exp_avg": "exp_avg", "exp_avg_sq": "exp_avg_sq", "step": "step"}
# Optimizer states that are not moments or counters; Megatron's fp32_param is a master weight.
# Megatron's ``param`` is its fp32 master copy of the weight.
_OTHER_STATES = frozenset(
    {"max_exp_avg_sq", "momentum_buffer", "fp32_param", "param", "square_avg"}
)
# Top-level keys of trainers' checkpoints that hold no model parameters (torchtitan's and
# DCP's tutorials' names).
_NON_MODEL_ROOTS = frozenset(
    {"lr_scheduler", "lr_schedulers", "dataloader", "train_state", "extra", "rng", "scheduler"}
)


_STATS = frozenset(_MOMENTS) | _OTHER_STATES
_OPTIMIZER_ROOTS = frozenset({"optimizer", "optim"})
# What torch's optimizers keep per parameter group (``lr`` may be a tensor).
_GROUP_KEYS = frozenset(
    {"lr", "initial_lr", "betas", "eps", "weight_decay", "momentum", "dampening", "params"}
)


def classify_key(fqn: str) -> KeyKind:
    """Classify a checkpoint key as the checkpoint holds it.

    - ``grads.<param>``: a gradient dump (``dcp.save({"grads": {name: p.grad}})``).
    - ``<root>.state.<param>.<stat>`` (``get_state_dict``'s and torchtitan's flattening, under
      any root: ``optimizer``, ``optim``, an ``app.optim`` of DCP's tutorial, none), or
      ``<root>.state.<stat>.<param>`` (Megatron's), told apart by where the stat is (the last
      word first: a parameter may be named ``param`` or ``step``): ``exp_avg``, ``exp_avg_sq``,
      ``step`` by stat; another stat (``max_exp_avg_sq``, ``fp32_param``...) is ``other``.
    - ``<root>.param_groups...``, anything else under ``optimizer``, and the roots of trainer
      state (``lr_scheduler``, ``dataloader``, ``train_state``, ``extra``...): ``other``.
    - ``model.<param>``, or any other key (torchtitan saves model keys at the top level):
      ``weight``.
    """
    parts = fqn.split(".")
    if parts[0] == "grads" and len(parts) > 1:
        return KeyKind("grad", fqn[len("grads.") :])
    if parts[0] != "model":
        optimizer = parts[0] == "optimizer"
        grouped = parts[-1] in _GROUP_KEYS
        for index, part in enumerate(parts[:-2]):  # a state or param_groups word, two after it
            rest = parts[index + 1 :]
            if part == "state":
                # Under another root, a stat names it an optimizer's (a module may be called
                # state); the last word is the stat unless only the first is one (Megatron's).
                first, last = rest[0] in _STATS, rest[-1] in _STATS
                if first or last or index == 0 or optimizer:
                    stat_name, owner = (
                        (rest[0], rest[1:]) if first and not last else (rest[-1], rest[:-1])
                    )
                    return KeyKind(_MOMENTS.get(stat_name, "other"), ".".join(owner))
            if part == "param_groups" and (index == 0 or optimizer or grouped):
                # flattened: param_groups.<param>.<key>; a list's: param_groups.<n>.<key>
                return KeyKind("other", None if rest[0].isdigit() else ".".join(rest[:-1]))
        if optimizer or parts[0] in _NON_MODEL_ROOTS or parts[0] in ("state", "param_groups"):
            return KeyKind("other", None)
    param = fqn[len("model.") :] if parts[0] == "model" and len(parts) > 1 else fqn
    return KeyKind("weight", param)


def classify_stored(stored: Mapping[str, list[_Stored]]) -> dict[str, KeyKind]:
    """:func:`classify_key` of each key, corrected by what the whole checkpoint holds.

    A key's words alone mislead where a model's own modules are named as trainer state is
    (torchtitan saves model keys at the top level: a module ``state``, ``extra`` or
    ``scheduler``, a submodule ``state.step``). Where no key has the ``model`` root, a key read
    as trainer state (by its root alone) or as a step counter, outside ``optimizer`` (Megatron's
    dp_reshardable buckets lie there), ``optim`` and the roots of the optimizer's moments, is a
    weight when the optimizer holds moments of it, or when it is a floating-point tensor of
    more than one element: a step counter has one, and trainers keep their own state as bytes
    (a scheduler's numbers, a data loader's position) or as integer tensors (an RNG's state).
    A weight ``<root>.model.<p>`` beside moments under ``<root>`` (DCP's tutorial's ``app``)
    is ``<p>``'s, as they are.
    """
    kinds = {key: classify_key(key) for key in stored}
    if any(key.partition(".")[0] == "model" for key in stored):
        return kinds
    moments = [(key, held) for key, held in kinds.items() if held.kind in ("exp_avg", "exp_avg_sq")]
    owned = {held.param for _, held in moments}
    state_roots = {key.partition(".")[0] for key, _ in moments}
    for key, held in kinds.items():
        by_words = held.kind == "step" or (held.kind == "other" and held.param is None)
        root = key.partition(".")[0]
        if not by_words or root in state_roots or root in _OPTIMIZER_ROOTS:
            continue
        first = stored[key][0]
        if key in owned or (first.dtype.is_floating_point and math.prod(first.size) > 1):
            kinds[key] = KeyKind("weight", key)
    for key, held in kinds.items():
        # DCP's tutorial saves {"app": {"model": ..., "optim": ...}}: its weights are named by
        # their parameter, as its moments are.
        root, _, rest = key.partition(".")
        if held.kind == "weight" and root in state_roots and rest.startswith("model."):
            kinds[key] = KeyKind("weight", rest[len("model.") :])
    return kinds


# --- The checkpoint as rank files -------------------------------------------------------------


class _ChunkTensors(Mapping[str, torch.Tensor]):
    """A rank file's chunks by record name, each read when first asked for; only the latest is
    kept, so a reader going tensor by tensor holds about one chunk."""

    def __init__(
        self,
        directory: Path,
        chunks: Mapping[str, ChunkRef],
        shapes: Mapping[str, tuple[int, ...]],
    ) -> None:
        self._directory, self._chunks, self._shapes = directory, chunks, shapes
        self._latest: tuple[str, torch.Tensor] | None = None

    def __getitem__(self, name: str) -> torch.Tensor:
        if self._latest is not None and self._latest[0] == name:
            return self._latest[1]
        # A stacked tensor's chunk is its row's without the leading layer (expert) axis.
        tensor = read_chunk(self._directory, self._chunks[name]).reshape(self._shapes[name])
        self._latest = (name, tensor)
        return tensor

    def __iter__(self) -> Iterator[str]:
        return iter(self._chunks)

    def __len__(self) -> int:
        return len(self._chunks)


@dataclass(frozen=True)
class CheckpointFile(RankFile):
    """The chunks one data file of a checkpoint stores (of the kind read), as a rank file."""

    directory: Path = Path()
    kind: str = "weight"
    chunks: dict[str, ChunkRef] = field(default_factory=dict)  # by record name
    shapes: dict[str, tuple[int, ...]] = field(default_factory=dict)  # the records' shapes
    keys: dict[str, str] = field(default_factory=dict)  # record name: the checkpoint's key
    # What the whole checkpoint holds, read or not: (kind, tensors) by kind, and its bytes
    # entries (pickled objects, never read).
    holds: tuple[tuple[str, int], ...] = ()
    bytes_entries: int = 0
    left_out: tuple[str, ...] = ()  # keys of the kind not read (see ``left_out``)
    # Chunks are read into memory (not mapped): a reader takes them one at a time.
    one_tensor_at_a_time: ClassVar[bool] = True

    @property
    def size_bytes(self) -> int:
        return sum(chunk.storage.length for chunk in self.chunks.values())

    @contextmanager
    def tensors(self) -> Iterator[Mapping[str, torch.Tensor]]:
        yield _ChunkTensors(self.directory, self.chunks, self.shapes)

    def write(self, file: IO[bytes], tensors: Sequence[tuple[str, torch.Tensor]]) -> None:
        raise SnapshotError(
            f"{self.directory}: a DCP checkpoint is read, not rewritten; clip writes gradient "
            "snapshots (dump the gradients with gradstat's dump_rank to clip them)"
        )

    def source(self, name: str) -> Source | None:
        from gradstat.snapshot.wgrads import Source

        chunk = self.chunks[name]
        return Source(
            chunk=f"offset {list(chunk.offsets)}",
            local_name=self.keys[name],
            rule=self.kind,
            slot=self.keys[name],
        )


def _step(directory: Path) -> int | None:
    match = _STEP.match(directory.resolve().name)
    return int(match[1]) if match else None


@dataclass(frozen=True)
class _Stored:
    """One stored chunk as a record takes it: of a tensor, or of a row of a Megatron stacked
    tensor (``decoder.layers.<rest>`` of shape [L, ...] read as ``decoder.layers.<i>.<rest>``).

    ``chunk`` is read as stored; ``offsets`` and ``sizes`` are its place in ``size``, the
    tensor's (the row's) global shape.
    """

    key: str  # the checkpoint's key, or the row's name (classified as a key)
    size: tuple[int, ...]
    dtype: torch.dtype
    chunk: ChunkRef
    offsets: tuple[int, ...]
    sizes: tuple[int, ...]


def _stored(index: DcpIndex, torch_dist: bool) -> dict[str, list[_Stored]]:
    """Every tensor's chunks by key; a ``torch_dist`` checkpoint's stacked tensors by row, each
    chunk (one layer, and for MoE experts one expert) a chunk of its row."""
    found: dict[str, list[_Stored]] = {}
    for fqn, entry in index.tensors.items():
        try:
            experts = expert_rows(entry) if torch_dist else None
            layers = None if experts is not None or not torch_dist else layer_rows(entry)
        except SnapshotError as error:  # a chunk of several layers (experts): name the folder
            raise SnapshotError(f"{index.directory}: {error}") from None
        rows: dict[tuple[int, ...], str]
        if experts is not None:
            rows = {(layer, expert): name for name, layer, expert in experts}
            depth = 2
        elif layers is not None:
            rows = {(layer,): name for name, layer in layers}
            depth = 1
        else:
            found[fqn] = [
                _Stored(fqn, entry.size, entry.dtype, chunk, chunk.offsets, chunk.sizes)
                for chunk in entry.chunks
            ]
            continue
        for chunk in entry.chunks:
            row = rows[chunk.offsets[:depth]]
            found.setdefault(row, []).append(
                _Stored(
                    row,
                    entry.size[depth:],
                    entry.dtype,
                    chunk,
                    chunk.offsets[depth:],
                    chunk.sizes[depth:],
                )
            )
    return found


# The dtypes read from a checkpoint: a complex tensor there is a buffer (a RoPE table), not a
# weight or a gradient.
_READ = frozenset(dtype for dtype in DTYPE_NAMES if not dtype.is_complex)


def _selected(
    index: DcpIndex, stored: dict[str, list[_Stored]], kinds: Mapping[str, KeyKind], kind: str
) -> dict[str, list[_Stored]]:
    """The tensors of ``kind``, by the name their records take.

    Model state holds buffers too: those of a type gradstat does not read (BatchNorm's int64
    ``num_batches_tracked``, a complex ``freqs_cis``) are left out of the weights
    (:func:`left_out` names them; ``inspect`` says so), as they are of ``all``, with the
    optimizer's step counters.

    Raises:
        SnapshotError: the checkpoint holds no tensor of the kind (naming what it holds), a
            gradient or moment that is not floating point, or two keys of it for one parameter.
    """
    found: dict[str, list[_Stored]] = {}
    skipped = set(left_out(stored, kinds, kind))
    for key, chunks in stored.items():
        held = kinds[key]
        if key in skipped:
            continue
        if kind == "all":
            name = key
        elif held.kind != kind:
            continue
        else:
            assert held.param is not None
            name = held.param
            if chunks[0].dtype not in _READ:
                raise SnapshotError(
                    f"{index.directory}: tensor {key!r} ({kind}) is {chunks[0].dtype}; gradstat "
                    f"reads float32, bfloat16, float16 and float64"
                )
        if name in found:
            raise SnapshotError(
                f"{index.directory}: keys {found[name][0].key!r} and {key!r} both hold the "
                f"{kind} of parameter {name!r}"
            )
        found[name] = chunks
    if not found:
        holds = ", ".join(f"{kind_said(name)} ({count})" for name, count in held_kinds(kinds))
        raise SnapshotError(
            f"{index.directory}: the checkpoint holds no {kind_said(kind)}; it holds "
            f"{holds or 'no tensor'}: choose one with --kind {'|'.join(KINDS)}"
        )
    return found


def left_out(
    stored: Mapping[str, list[_Stored]], kinds: Mapping[str, KeyKind], kind: str
) -> tuple[str, ...]:
    """The keys of ``kind`` that are not read (``kinds``: :func:`classify_stored`'s): buffers
    of a type gradstat does not read among the weights, and with ``all`` the step counters
    too."""
    found = []
    for key, chunks in stored.items():
        held = kinds[key].kind
        if kind not in ("all", held) or kind not in ("all", "weight"):
            continue
        if chunks[0].dtype not in _READ or (kind == "all" and held == "step"):
            found.append(key)
    return tuple(found)


def _warn_unread_floats(
    directory: Path, stored: Mapping[str, list[_Stored]], skipped: tuple[str, ...]
) -> None:
    """Warn of floating-point tensors of the kind read that are left out (float8 weights of a
    quantized model): unlike an integer buffer, they are what the statistics are of. A step
    counter left out of ``all`` is a float32 tensor read as such: no warning."""
    unread = [
        key
        for key in skipped
        if stored[key][0].dtype.is_floating_point and stored[key][0].dtype not in _READ
    ]
    if unread:
        dtypes = sorted({str(stored[key][0].dtype).removeprefix("torch.") for key in unread})
        shown = ", ".join(unread[:3]) + (", ..." if len(unread) > 3 else "")
        warnings.warn(
            f"{directory}: {len(unread)} of the kind read left out of every statistic, of a "
            f"dtype gradstat does not read ({', '.join(dtypes)}): {shown}",
            DumpWarning,
            stacklevel=3,
        )


def held_kinds(kinds: Mapping[str, KeyKind]) -> tuple[tuple[str, int], ...]:
    """(kind, number of tensors) of every kind of key the checkpoint holds (``kinds``:
    :func:`classify_stored`'s), by kind."""
    held: dict[str, int] = {}
    for key_kind in kinds.values():
        held[key_kind.kind] = held.get(key_kind.kind, 0) + 1
    return tuple(sorted(held.items()))


def default_kind(kinds: Mapping[str, KeyKind]) -> str:
    """Gradients when the checkpoint holds any (``kinds``: :func:`classify_stored`'s), else
    model weights."""
    return "grad" if any(held.kind == "grad" for held in kinds.values()) else "weight"


def open_checkpoint(directory: Path, kind: str | None = None) -> list[CheckpointFile]:
    """The checkpoint in ``directory`` as rank files: its tensors of ``kind``, chunk by chunk.

    Args:
        directory: a DCP checkpoint directory (``.metadata`` or ``__R.metadata`` files).
        kind: one of :data:`KINDS`; None: :func:`default_kind`.

    Raises:
        SnapshotError: what :func:`gradstat.snapshot.dcp.open_index` refuses, an unknown kind,
            or what :func:`_selected` refuses.
    """
    if kind is not None and kind not in KINDS:
        raise SnapshotError(f"--kind {kind!r} is not a kind; use one of {', '.join(KINDS)}")
    index = open_index(directory)
    torch_dist = is_torch_dist(directory)
    stored = _stored(index, torch_dist)
    kinds = classify_stored(stored)  # once: each key's kind, with the whole checkpoint seen
    kind = kind or default_kind(kinds)
    if torch_dist and kind in ("exp_avg", "exp_avg_sq", "all"):
        refuse_dp_reshardable(index)
    selected = _selected(index, stored, kinds, kind)
    # Each data file's chunks, a second chunk of one tensor in a file of its own.
    groups: dict[tuple[str, int], list[tuple[str, _Stored]]] = {}
    for name, chunks in selected.items():
        seen: dict[str, int] = {}
        for piece in chunks:
            path = piece.chunk.storage.relative_path
            occurrence = seen[path] = seen.get(path, -1) + 1
            groups.setdefault((path, occurrence), []).append((name, piece))
    world_size = len(groups)
    step = _step(directory)
    holds = held_kinds(kinds)
    skipped = left_out(stored, kinds, kind)
    _warn_unread_floats(directory, stored, skipped)
    opened = []
    for rank, (path, occurrence) in enumerate(sorted(groups)):
        held = sorted(groups[path, occurrence], key=lambda item: item[1].chunk.storage.offset)
        records = tuple(_record(name, piece, rank, world_size) for name, piece in held)
        # Each file its own data-parallel place, of the experts' too (chunks decide what counts).
        place = (rank, world_size)
        coords = {axis: (0, 1) for axis in AXES} | {"dp": place, "edp": place}
        header = RankHeader(rank, world_size, step, coords, False, kind, records)
        location = directory / path
        container = Container(location, {}, {}, 0, FileStamp.of_path(location))
        opened.append(
            CheckpointFile(
                header,
                container,
                directory=directory,
                kind=kind,
                chunks={name: piece.chunk for name, piece in held},
                shapes={name: piece.sizes for name, piece in held},
                keys={name: piece.chunk.fqn for name, piece in held},
                holds=holds,
                bytes_entries=len(index.bytes_entries),
                left_out=skipped,
            )
        )
    return opened


def _record(name: str, piece: _Stored, rank: int, world_size: int) -> ParamRecord:
    """A chunk as a record: a box of its tensor (its row) at the chunk's global offset."""
    placement = MeshPlacement(
        mesh_shape=(world_size,),
        coordinate=(rank,),
        placements=("S(0)",),  # a box of the tensor: every chunk counts, none is a copy
        global_shape=piece.size,
        mesh_dim_names=(_MESH_DIM,),
        global_offset=piece.offsets,
    )
    return ParamRecord(
        name=name,
        has_grad=True,
        shape=piece.sizes,
        dtype=DTYPE_NAMES[piece.dtype],
        param_shape=piece.size,
        attrs={"allreduce": False} if EXPERT_NAME.search(name) else {},
        dtensor=placement,
    )

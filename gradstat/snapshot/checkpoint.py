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

import re
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, TYPE_CHECKING, ClassVar

import torch

from gradstat.core.axes import AXES
from gradstat.core.placements import MeshPlacement
from gradstat.errors import SnapshotError
from gradstat.snapshot.container import Container, FileStamp
from gradstat.snapshot.dcp import ChunkRef, DcpIndex, TensorEntry, open_index, read_chunk
from gradstat.snapshot.format import DTYPE_NAMES, ParamRecord, RankHeader
from gradstat.snapshot.reader import RankFile

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
_OTHER_STATES = frozenset({"max_exp_avg_sq", "momentum_buffer", "fp32_param", "square_avg"})
# Top-level keys of trainers' checkpoints that hold no model parameters (torchtitan's and
# DCP's tutorials' names).
_NON_MODEL_ROOTS = frozenset(
    {"lr_scheduler", "lr_schedulers", "dataloader", "train_state", "extra", "rng", "scheduler"}
)


def classify_key(fqn: str) -> KeyKind:
    """Classify a checkpoint key as the checkpoint holds it.

    - ``grads.<param>``: a gradient dump (``dcp.save({"grads": {name: p.grad}})``).
    - ``[optimizer.]state.<param>.<stat>`` (``get_state_dict``'s and torchtitan's flattening)
      or ``optimizer.state.<stat>.<param>`` (Megatron's): ``exp_avg``, ``exp_avg_sq``, ``step``
      by stat; another stat (``max_exp_avg_sq``, ``fp32_param``...) is ``other``.
    - ``[optimizer.]param_groups...``, and the roots of trainer state (``lr_scheduler``,
      ``dataloader``, ``train_state``, ``extra``...): ``other``, no parameter.
    - ``model.<param>``, or any other key (torchtitan saves model keys at the top level):
      ``weight``.
    """
    parts = fqn.split(".")
    if parts[0] == "grads" and len(parts) > 1:
        return KeyKind("grad", fqn[len("grads.") :])
    if parts[0] == "optimizer":
        parts = parts[1:]
        if not parts:
            return KeyKind("other", None)
    elif parts[0] not in ("state", "param_groups"):
        if parts[0] in _NON_MODEL_ROOTS:
            return KeyKind("other", None)
        param = fqn[len("model.") :] if parts[0] == "model" and len(parts) > 1 else fqn
        return KeyKind("weight", param)
    if parts[0] == "state" and len(parts) >= 3:
        if parts[1] in _MOMENTS or parts[1] in _OTHER_STATES:
            stat_name, param = parts[1], ".".join(parts[2:])
        else:
            stat_name, param = parts[-1], ".".join(parts[1:-1])
        return KeyKind(_MOMENTS.get(stat_name, "other"), param)
    if parts[0] == "param_groups" and len(parts) >= 3 and not parts[1].isdigit():
        return KeyKind("other", ".".join(parts[1:-1]))  # flattened: param_groups.<param>.<key>
    return KeyKind("other", None)


# --- The checkpoint as rank files -------------------------------------------------------------


class _ChunkTensors(Mapping[str, torch.Tensor]):
    """A rank file's chunks by record name, each read when first asked for; only the latest is
    kept, so a reader going tensor by tensor holds about one chunk."""

    def __init__(self, directory: Path, chunks: Mapping[str, ChunkRef]) -> None:
        self._directory, self._chunks = directory, chunks
        self._latest: tuple[str, torch.Tensor] | None = None

    def __getitem__(self, name: str) -> torch.Tensor:
        if self._latest is not None and self._latest[0] == name:
            return self._latest[1]
        tensor = read_chunk(self._directory, self._chunks[name])
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
        yield _ChunkTensors(self.directory, self.chunks)

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


def _selected(index: DcpIndex, kind: str) -> dict[str, TensorEntry]:
    """The tensors of ``kind``, by the name their records take.

    Model state holds buffers too: those of a type gradstat does not read (BatchNorm's int64
    ``num_batches_tracked``, a complex ``freqs_cis``) are left out of the weights
    (:func:`left_out` names them; ``inspect`` says so), as they are of ``all``, with the
    optimizer's step counters.

    Raises:
        SnapshotError: the checkpoint holds no tensor of the kind (naming what it holds), a
            gradient or moment that is not floating point, or two keys of it for one parameter.
    """
    found: dict[str, TensorEntry] = {}
    skipped = set(left_out(index, kind))
    for fqn, entry in index.tensors.items():
        key = classify_key(fqn)
        if fqn in skipped:
            continue
        if kind == "all":
            name = fqn
        elif key.kind != kind:
            continue
        else:
            assert key.param is not None
            name = key.param
            if entry.dtype not in DTYPE_NAMES:
                raise SnapshotError(
                    f"{index.directory}: tensor {fqn!r} ({kind}) is {entry.dtype}; gradstat "
                    f"reads float32, bfloat16, float16 and float64"
                )
        if name in found:
            raise SnapshotError(
                f"{index.directory}: keys {found[name].fqn!r} and {fqn!r} both hold the {kind} "
                f"of parameter {name!r}"
            )
        found[name] = entry
    if not found:
        holds = ", ".join(f"{kind_said(name)} ({count})" for name, count in held_kinds(index))
        raise SnapshotError(
            f"{index.directory}: the checkpoint holds no {kind_said(kind)}; it holds "
            f"{holds or 'no tensor'}: choose one with --kind {'|'.join(KINDS)}"
        )
    return found


def left_out(index: DcpIndex, kind: str) -> tuple[str, ...]:
    """The keys of ``kind`` that are not read: buffers of a type gradstat does not read among
    the weights, and with ``all`` the step counters too."""
    found = []
    for fqn, entry in index.tensors.items():
        held = classify_key(fqn).kind
        if kind not in ("all", held) or kind not in ("all", "weight"):
            continue
        if entry.dtype not in DTYPE_NAMES or (kind == "all" and held == "step"):
            found.append(fqn)
    return tuple(found)


def held_kinds(index: DcpIndex) -> tuple[tuple[str, int], ...]:
    """(kind, number of tensors) of every kind of key the checkpoint holds, by kind."""
    held: dict[str, int] = {}
    for fqn in index.tensors:
        kind = classify_key(fqn).kind
        held[kind] = held.get(kind, 0) + 1
    return tuple(sorted(held.items()))


def default_kind(index: DcpIndex) -> str:
    """Gradients when the checkpoint holds any, else model weights."""
    kinds = {classify_key(fqn).kind for fqn in index.tensors}
    return "grad" if "grad" in kinds else "weight"


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
    kind = kind or default_kind(index)
    entries = _selected(index, kind)
    # Each data file's chunks, a second chunk of one tensor in a file of its own.
    groups: dict[tuple[str, int], list[tuple[str, TensorEntry, ChunkRef]]] = {}
    for name, entry in entries.items():
        seen: dict[str, int] = {}
        for chunk in entry.chunks:
            path = chunk.storage.relative_path
            occurrence = seen[path] = seen.get(path, -1) + 1
            groups.setdefault((path, occurrence), []).append((name, entry, chunk))
    world_size = len(groups)
    step = _step(directory)
    holds = held_kinds(index)
    skipped = left_out(index, kind)
    opened = []
    for rank, (path, occurrence) in enumerate(sorted(groups)):
        held = sorted(groups[path, occurrence], key=lambda item: item[2].storage.offset)
        records = tuple(
            _record(name, entry, chunk, rank, world_size) for name, entry, chunk in held
        )
        coords = {axis: (0, 1) for axis in AXES} | {"dp": (rank, world_size)}
        header = RankHeader(rank, world_size, step, coords, False, kind, records)
        location = directory / path
        container = Container(location, {}, {}, 0, FileStamp.of_path(location))
        opened.append(
            CheckpointFile(
                header,
                container,
                directory=directory,
                kind=kind,
                chunks={name: chunk for name, _, chunk in held},
                keys={name: entry.fqn for name, entry, _ in held},
                holds=holds,
                bytes_entries=len(index.bytes_entries),
                left_out=skipped,
            )
        )
    return opened


def _record(
    name: str, entry: TensorEntry, chunk: ChunkRef, rank: int, world_size: int
) -> ParamRecord:
    """A chunk as a record: a box of its tensor at the chunk's global offset."""
    placement = MeshPlacement(
        mesh_shape=(world_size,),
        coordinate=(rank,),
        placements=("S(0)",),  # a box of the tensor: every chunk counts, none is a copy
        global_shape=entry.size,
        mesh_dim_names=(_MESH_DIM,),
        global_offset=chunk.offsets,
    )
    return ParamRecord(
        name=name,
        has_grad=True,
        shape=chunk.sizes,
        dtype=DTYPE_NAMES[entry.dtype],
        param_shape=entry.size,
        dtensor=placement,
    )

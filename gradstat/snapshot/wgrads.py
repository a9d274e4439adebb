"""Megatron's own gradient dumps (``--save-wgrads-interval N``), read as they are.

Every N-th iteration, after the gradients are reduced and before the optimizer steps,
megatron-core 0.19's training loop saves each model chunk's ``main_grad`` by parameter name:

    <save>/wgrads/iter_NNNNNNN/mp_rank_TT[_PPP][_EEE].pth
    = torch.save({"model_chunk0": {name: grad}, "model_chunk1": ...})

written by the ranks whose expert-data-parallel rank is 0 (``TT`` the tensor-parallel rank,
``_PPP`` the pipeline rank when PP > 1, ``_EEE`` the expert-parallel rank when EP > 1). The names
are the unwrapped chunk's: layer indices local to the stage and chunk, expert indices local to
the EP rank, and no parallel attribute is saved. This module rebuilds what :class:`RankFile`
holds for gradstat's own snapshots, so that every command reads such a directory unchanged:

- **how each tensor lies over TP**, from the names Megatron's layer specs give
  (:data:`NAME_RULES`; a user's ``--tp-sharded``/``--tp-replicated`` rows come first), checked
  against the shapes of the same tensor in every TP file;
- **global names**: a stage's layers renumbered after those of the virtual stages before it
  (chunk ``I`` of stage ``p`` is virtual stage ``I * PP + p``, as Megatron assigns layers, so
  uneven first and last stages need nothing said), experts after the EP ranks before;
- **coordinates**: the writers of one stage are its ranks ``r < ETP * EP`` (Megatron numbers
  ranks TP (ETP) first), so ``r % TP`` is a file's TP rank, ``r // ETP`` its EP rank, and the
  files of one TP rank are replicas of its dense tensors (dense parameters repeated in every EP
  rank's file count once, and ``audit`` checks them equal);
- **the tied output layer**: a copy of the first stage's embedding (``shared``, not counted)
  when its gradient equals the embedding's bit for bit in every TP file (Megatron all-reduces
  the two before the dump), its own parameter otherwise; ``--tied-output`` states it.

What the files cannot tell is refused in one line, or stated by an option: the expert TP size
when the writers do not tell it (``--etp``), GTP (whose ranks write the same file: ``--gtp``).
An expert TP size over the TP size is such a case: the expert TP ranks that share a TP rank
write the same file, so the dump keeps one of their expert shards; its files are an ETP = TP
job's grid with nothing in the shapes to tell them apart. Unstated, ETP = TP (Megatron's
default) is taken; stated, it is refused.
"""

from __future__ import annotations

import fnmatch
import functools
import re
import warnings
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

import torch

from gradstat.core.axes import AXES
from gradstat.core.kernels import bits
from gradstat.errors import ArgumentError, DumpWarning, SnapshotError
from gradstat.snapshot.container import mapped
from gradstat.snapshot.format import EXPERT_NAME, WGRADS_FILE, ParamRecord, RankHeader
from gradstat.snapshot.pth import PthFile, read_pth
from gradstat.snapshot.reader import RankFile

__all__ = [
    "NAME_RULES",
    "WgradsFile",
    "WgradsOptions",
    "open_wgrads",
]

_CHUNK = re.compile(r"^model_chunk(\d+)$")
_ITERATION = re.compile(r"^iter_(\d+)$")
# A layer of a block that pipeline stages split, numbered from 0 on each stage: the first
# ``layers.N`` of a name (GPT's ``decoder.layers.3.``, BERT's and T5's ``encoder.layers.3.``, a
# multimodal model's ``vision_model.decoder.layers.3.``). Each block is numbered on its own.
_LAYER = re.compile(r"^((?:.+?\.)?layers\.)(\d+)(\..+)$")
_LOCAL_EXPERT = re.compile(r"^(.+\.experts\.local_experts\.)(\d+)(\..+)$")
_GROUPED_EXPERT = re.compile(r"^(.+\.experts\.linear_fc[12]\.(?:weight|bias))(\d+)$")
_EMBEDDING = "embedding.word_embeddings.weight"
_OUTPUT = "output_layer.weight"

COLUMN, ROW = 0, 1  # the dimension a column- or row-parallel weight is split along

# How Megatron's modules lie over tensor parallelism, by the parameter names its layer specs
# give (local and Transformer Engine specs, MoE with SequentialMLP or grouped-GEMM experts,
# shared experts, multi-token prediction): (pattern on the local name, the dimension split
# over TP or None for a full copy on every TP rank, the module it comes from). The first row
# that matches decides; a user's --tp-sharded/--tp-replicated rows come before these.
NAME_RULES: tuple[tuple[str, int | None, str], ...] = (
    (_EMBEDDING, COLUMN, "VocabParallelEmbedding (rows split)"),
    ("embedding.position_embeddings.weight", None, "learned position embedding (full copy)"),
    ("embedding.tokentype_embeddings.weight", None, "token-type embedding (full copy)"),
    (_OUTPUT, COLUMN, "output ColumnParallelLinear (vocabulary split)"),
    ("output_layer.bias", COLUMN, "output ColumnParallelLinear bias"),
    ("*.layer_norm_weight", None, "layernorm fused into a TE linear (full copy)"),
    ("*.layer_norm_bias", None, "layernorm fused into a TE linear (full copy)"),
    ("*layernorm.weight", None, "layernorm (full copy)"),
    ("*layernorm.bias", None, "layernorm (full copy)"),
    ("*.enorm.weight", None, "MTP embedding norm (full copy)"),
    ("*.hnorm.weight", None, "MTP hidden norm (full copy)"),
    ("*.eh_proj.weight", COLUMN, "MTP ColumnParallelLinear"),
    ("*.linear_qkv.weight", COLUMN, "attention QKV ColumnParallelLinear"),
    ("*.linear_qkv.bias", COLUMN, "attention QKV ColumnParallelLinear bias"),
    ("*.linear_q.weight", COLUMN, "cross-attention query ColumnParallelLinear"),
    ("*.linear_q.bias", COLUMN, "cross-attention query ColumnParallelLinear bias"),
    ("*.linear_kv.weight", COLUMN, "cross-attention key-value ColumnParallelLinear"),
    ("*.linear_kv.bias", COLUMN, "cross-attention key-value ColumnParallelLinear bias"),
    ("*.linear_q_proj.weight", COLUMN, "MLA query ColumnParallelLinear"),
    ("*.linear_q_up_proj.weight", COLUMN, "MLA query up-projection ColumnParallelLinear"),
    ("*.linear_kv_up_proj.weight", COLUMN, "MLA key-value up-projection ColumnParallelLinear"),
    ("*.linear_proj.weight", ROW, "attention output RowParallelLinear"),
    ("*.linear_proj.bias", None, "RowParallelLinear bias (full copy)"),
    ("*.linear_fc1.weight", COLUMN, "MLP fc1 ColumnParallelLinear"),
    ("*.linear_fc1.bias", COLUMN, "MLP fc1 ColumnParallelLinear bias"),
    ("*.experts.linear_fc1.weight[0-9]*", COLUMN, "grouped-GEMM expert fc1 (column)"),
    ("*.experts.linear_fc1.bias[0-9]*", COLUMN, "grouped-GEMM expert fc1 bias (column)"),
    ("*.linear_fc2.weight", ROW, "MLP fc2 RowParallelLinear"),
    ("*.experts.linear_fc2.weight[0-9]*", ROW, "grouped-GEMM expert fc2 (row)"),
    ("*.linear_fc2.bias", None, "RowParallelLinear bias (full copy)"),
    ("*.experts.linear_fc2.bias[0-9]*", None, "grouped-GEMM expert fc2 bias (full copy)"),
    ("*.router.weight", None, "MoE router (full copy)"),
    ("*.router.bias", None, "MoE router bias (full copy)"),
    ("*.shared_experts.gate_weight", None, "shared-expert gate (full copy)"),
)


@dataclass(frozen=True)
class WgradsOptions:
    """What a user states of a dump that its files do not say.

    Attributes:
        tp_sharded: ``(pattern, dim)`` rows: tensors split over TP along ``dim``.
        tp_replicated: patterns of tensors that are full copies on every TP rank.
        etp: the expert tensor-parallel size (None: told by the files present).
        gtp: the generalized tensor-parallel size (> 1 is refused: see the module doc).
        tied_output: whether the last stage's ``output_layer.weight`` is the embedding's tied
            copy (None: decided by its values).
        kind: of a DCP checkpoint, which tensors (``gradstat.snapshot.checkpoint.KINDS``;
            None: its gradients when it holds any, else its weights).
    """

    tp_sharded: tuple[tuple[str, int], ...] = ()
    tp_replicated: tuple[str, ...] = ()
    etp: int | None = None
    gtp: int | None = None
    tied_output: bool | None = None
    kind: str | None = None

    @classmethod
    def parse(
        cls,
        tp_sharded: Sequence[str] = (),
        tp_replicated: Sequence[str] = (),
        etp: int | None = None,
        gtp: int | None = None,
        tied_output: str = "auto",
        kind: str | None = None,
    ) -> WgradsOptions:
        """The options as the CLI gives them (``--tp-sharded 'PATTERN=DIM'``, ...).

        Raises:
            ArgumentError: a ``--tp-sharded`` without ``=DIM``, a size below 1, ...
        """
        rows = []
        for text in tp_sharded:
            pattern, equals, dim = text.rpartition("=")
            if not equals or not pattern or not dim.isdigit():
                raise ArgumentError(
                    f"--tp-sharded {text!r}: expected PATTERN=DIM, e.g. "
                    "'*.my_proj.weight=0' (0: column-parallel rows, 1: row-parallel columns)"
                )
            rows.append((pattern, int(dim)))
        for name, size in (("--etp", etp), ("--gtp", gtp)):
            if size is not None and size < 1:
                raise ArgumentError(f"{name} must be a size >= 1, got {size}")
        tied = {"auto": None, "yes": True, "no": False}
        if tied_output not in tied:
            raise ArgumentError(f"--tied-output must be auto, yes or no, got {tied_output!r}")
        return cls(tuple(rows), tuple(tp_replicated), etp, gtp, tied[tied_output], kind)

    def sharding(self, name: str) -> tuple[int | None, str] | None:
        """``(dim or None, why)`` for the local ``name``; None when no row knows it."""
        for pattern, dim in self.tp_sharded:
            if fnmatch.fnmatchcase(name, pattern):
                return dim, f"--tp-sharded '{pattern}={dim}'"
        for pattern in self.tp_replicated:
            if fnmatch.fnmatchcase(name, pattern):
                return None, f"--tp-replicated '{pattern}'"
        for pattern, rule_dim, module in NAME_RULES:
            if fnmatch.fnmatchcase(name, pattern):
                return rule_dim, f"name rule '{pattern}': {module}"
        return None


@dataclass(frozen=True)
class Source:
    """Where one parameter of a wgrads file came from, and what decided its attributes."""

    chunk: str
    local_name: str
    rule: str
    slot: str  # its tensor's slot in the file's container


class _Renamed(Mapping[str, torch.Tensor]):
    """A file's mapped tensors by the global names of its records."""

    def __init__(self, tensors: Mapping[str, torch.Tensor], sources: Mapping[str, Source]) -> None:
        self._tensors, self._sources = tensors, sources

    def __getitem__(self, name: str) -> torch.Tensor:
        return self._tensors[self._sources[name].slot]

    def __iter__(self) -> Iterator[str]:
        return iter(self._sources)

    def __len__(self) -> int:
        return len(self._sources)


@dataclass(frozen=True)
class WgradsFile(RankFile):
    """One ``mp_rank_*.pth`` file as a rank file: records under global names with the
    attributes rebuilt, each mapped to its tensor in the file."""

    sources: dict[str, Source] = field(default_factory=dict)  # by global name

    @contextmanager
    def tensors(self) -> Iterator[Mapping[str, torch.Tensor]]:
        with mapped(self.container) as found:
            yield _Renamed(found, self.sources)

    def write(self, file: IO[bytes], tensors: Sequence[tuple[str, torch.Tensor]]) -> None:
        """Write ``tensors`` (by global name) in the dump's own layout, as Megatron does."""
        chunks: dict[str, dict[str, torch.Tensor]] = {}
        for name, tensor in tensors:
            source = self.sources[name]
            chunks.setdefault(source.chunk, {})[source.local_name] = tensor
        torch.save(chunks, file)

    def source(self, name: str) -> Source | None:
        return self.sources.get(name)


@dataclass
class _Dump:
    """One parsed file: its place in the name grid and its tensors by chunk and local name."""

    name: str
    tp: int
    suffixes: tuple[int, ...]
    pth: PthFile
    chunks: dict[int, dict[str, str]] = field(default_factory=dict)  # local name: slot
    pp: int = 0
    ep: int = 0
    writer: int = 0  # its rank among the stage's writers

    @property
    def path(self) -> Path:
        return self.pth.container.path

    def shape(self, slot: str) -> tuple[int, ...]:
        return self.pth.container.slots[slot].shape


def _parse(folder: Path, name: str) -> _Dump:
    match = WGRADS_FILE.match(name)
    assert match is not None
    pth = read_pth(folder / name)
    dump = _Dump(name, int(match[1]), tuple(int(s) for s in match.groups()[1:] if s), pth)
    for slot, path in pth.paths.items():
        chunk = _CHUNK.match(path[0]) if len(path) == 2 else None
        if chunk is None:
            raise SnapshotError(
                f"{dump.path}: holds {'/'.join(path)!r}; a Megatron wgrads file holds "
                "model_chunkN/<parameter name> tensors only"
            )
        dump.chunks.setdefault(int(chunk[1]), {})[path[1]] = slot
    return dump


def _place_suffixes(dumps: list[_Dump]) -> set[str]:
    """Give each file its PP and EP rank: two suffixes are PP then EP; one alone is either,
    told apart by what the files hold (stages hold other layers, EP ranks the same names).
    Returns the ranks the names carry (``pp``, ``ep``)."""
    widths = {len(dump.suffixes) for dump in dumps}
    if len(widths) > 1:
        odd = min(dumps, key=lambda dump: len(dump.suffixes) == len(dumps[0].suffixes))
        raise SnapshotError(
            f"{odd.path}: its name has {len(odd.suffixes)} rank suffixes, {dumps[0].name} "
            f"{len(dumps[0].suffixes)}: files of two layouts in one directory"
        )
    width = widths.pop()
    for dump in dumps:
        if width == 2:
            dump.pp, dump.ep = dump.suffixes
    if width != 1:
        return {"pp", "ep"} if width == 2 else set()
    by_suffix: dict[int, set[tuple[int, str]]] = {}
    for dump in dumps:
        names = {(chunk, name) for chunk, held in dump.chunks.items() for name in held}
        by_suffix.setdefault(dump.suffixes[0], set()).update(names)
    alike = len({frozenset(names) for names in by_suffix.values()}) == 1
    experts = any(EXPERT_NAME.search(name) for names in by_suffix.values() for _, name in names)
    key = "ep" if alike and experts else "pp"
    for dump in dumps:
        setattr(dump, key, dump.suffixes[0])
    return {key}


def _sizes(dumps: list[_Dump], key: str, label: str, named: bool = False) -> int:
    """The size of an axis: its highest rank found, plus one; ``named``: the file names carry
    the rank, which Megatron adds only when the size is over 1."""
    found: set[int] = {getattr(dump, key) for dump in dumps}
    size = max(found) + 1
    if named and size == 1:
        raise SnapshotError(
            f"{dumps[0].path}: its name ends in {label} rank 0, which Megatron writes only when "
            f"the {label} size is over 1, and no file of {label} rank 1 is here: the other "
            f"{label} ranks' files are missing from the dump"
        )
    missing = sorted(set(range(size)) - found)
    if missing:
        raise SnapshotError(
            f"{dumps[0].path.parent}: no file of {label} rank {missing[0]} (the ranks found go "
            f"up to {size - 1}): a file is missing from the dump"
        )
    return size


def _writers(tp: int, ep: int, etp: int) -> dict[tuple[int, int], int]:
    """(TP rank, EP rank) of each writer of a stage, by its rank among them: ranks r < ETP * EP
    write (expert-data-parallel rank 0), r % TP their TP rank and r // ETP their EP rank."""
    return {(r % tp, r // etp): r for r in range(etp * ep)}


def _expert_tp(folder: Path, dumps: list[_Dump], tp: int, ep: int, etp: int | None) -> int:
    """The expert TP size the writers present tell (or the one stated), checked.

    A job whose expert TP size is over its TP size has writers that share a TP and an EP rank
    (``r % TP`` and ``r // ETP``) and write the same file, each over the last: its dump keeps
    one expert TP rank's shards of each expert per TP rank, so it is refused when stated. Its
    file names are the full TP x EP grid, as a job's with ETP = TP (Megatron's default), and
    the shapes do not tell the two apart (no tensor holds the experts' unsplit width): unstated,
    ETP = TP is taken.
    """
    # Without an expert gradient nothing is lost: the writers' grid below answers the size.
    names = (name for dump in dumps for held in dump.chunks.values() for name in held)
    if etp is not None and etp > tp and any(EXPERT_NAME.search(name) for name in names):
        raise SnapshotError(
            f"{folder}: a wgrads dump of a job whose expert TP size ({etp}, --etp) is over its "
            f"TP size ({tp}) cannot be read: the expert TP ranks that share a TP rank write the "
            "same mp_rank file, so Megatron's dump holds one of their expert shards, not every one"
        )
    present = {(dump.tp, dump.ep) for dump in dumps if dump.pp == 0}
    candidates = [etp] if etp is not None else [tp, *range(1, tp)]
    for size in candidates:
        writers = _writers(tp, ep, size)
        if len(writers) == size * ep and set(writers) == present:
            return size
    grid = sorted(_writers(tp, ep, candidates[0]))
    missing = [place for place in grid if place not in present]
    stated = f" with --etp {etp}" if etp is not None else ""
    if missing:
        t, e = missing[0]
        raise SnapshotError(
            f"{folder}: no file for TP rank {t}, EP rank {e}{stated} (of a {tp} x {ep} TP x EP "
            "grid): a file is missing, or the expert TP size is neither the TP size nor told "
            "by the files (state it with --etp)"
        )
    fix = "another --etp, or none to have it found" if etp is not None else "state it with --etp"
    raise SnapshotError(
        f"{folder}: the files' TP and EP ranks fit no expert TP size{stated}; {fix}"
    )


def _stage_names(dumps: list[_Dump]) -> dict[int, dict[str, tuple[int, ...]]]:
    """Each chunk's local names and shapes, the same in every file of a stage (checked)."""
    first = dumps[0]
    held = {chunk: {name: first.shape(slot) for name, slot in names.items()}
            for chunk, names in first.chunks.items()}  # fmt: skip
    for dump in dumps[1:]:
        for chunk in held.keys() | dump.chunks.keys():
            mine, theirs = dump.chunks.get(chunk, {}), held.get(chunk, {})
            for name in theirs.keys() - mine.keys():
                raise SnapshotError(
                    f"{dump.path}: model_chunk{chunk} has no {name!r}, which {first.name} holds "
                    "(files of one stage hold the same parameters)"
                )
            for name in mine.keys() - theirs.keys():
                raise SnapshotError(
                    f"{dump.path}: model_chunk{chunk} holds {name!r}, which {first.name} does "
                    "not (files of one stage hold the same parameters)"
                )
            for name, slot in mine.items():
                if dump.shape(slot) != theirs[name]:
                    raise SnapshotError(
                        f"{dump.path}: {name!r} is {list(dump.shape(slot))}, but "
                        f"{list(theirs[name])} in {first.name}: not shards of one Megatron "
                        "layout (files of two runs?)"
                    )
    return held


_PROJ = re.compile(r"^(decoder\.layers\.\d+\.)self_attention\.linear_proj\.weight$")
_HIDDEN_NORMS = ("input_layernorm.weight", "self_attention.linear_qkv.layer_norm_weight")


def _check_tp_size(folder: Path, names_of: list[dict[int, dict[str, Any]]], tp: int) -> None:
    """Warn when the attention's output projection says another TP size than the files.

    A missing last TP file looks like a smaller TP size; but with attention as wide as the
    hidden size (Megatron's default kv_channels), ``linear_proj.weight`` is [hidden,
    hidden / TP]. Models whose attention is narrower or wider are fine, hence a warning.
    """
    for chunks in names_of:
        for held in chunks.values():
            for name, shape in held.items():
                match = _PROJ.match(name)
                norms = [held.get(match[1] + norm) for norm in _HIDDEN_NORMS] if match else []
                hidden = next((norm[0] for norm in norms if norm), None)
                if match is None or hidden is None or len(shape) != 2 or not shape[1]:
                    continue
                if shape[0] == hidden and hidden % shape[1] == 0 and hidden // shape[1] != tp:
                    warnings.warn(
                        f"{folder}: {name} is {list(shape)} with hidden size {hidden}: TP "
                        f"{hidden // shape[1]} if the attention is as wide as the hidden size, "
                        f"but the files are TP {tp} (a missing mp_rank file?)",
                        DumpWarning,
                        stacklevel=2,
                    )
                return


def _check_experts(folder: Path, names_of: list[dict[int, dict[str, Any]]], ep: int) -> None:
    """Refuse a dump whose EP ranks hold fewer experts than the router routes to.

    A MoE layer's router weight is [experts, hidden], a full copy in every file; its experts
    are spread over the EP ranks, each file holding its own local ones. A missing last EP rank
    looks like a smaller EP size, and would leave its experts out of every statistic.
    """
    for stage, chunks in enumerate(names_of):
        for held in chunks.values():
            for module, local in _experts_per_rank(held).items():
                router = module.rpartition(".experts.")[0] + ".router.weight"
                shape = held.get(router)
                if shape and shape[0] != ep * local:
                    raise SnapshotError(
                        f"{folder}: {router} routes to {shape[0]} experts, but the files hold "
                        f"{ep} EP rank{'s' if ep > 1 else ''} of {local} experts each (pipeline "
                        f"stage {stage}): an EP rank's files are missing from the dump"
                    )


_LAST_STAGE = (_OUTPUT, "decoder.final_layernorm.weight", "decoder.final_norm.weight")


def _check_last_stage(folder: Path, names_of: list[dict[int, dict[str, Any]]]) -> None:
    """Warn when the last stage found holds nothing a GPT model's last stage holds.

    Names carry no pipeline size: a missing last stage looks like a smaller one. A model whose
    first stage holds the word embeddings holds its output layer and final norm on the last
    stage (save the frozen ones, which have no gradient), hence a warning.
    """
    pp = len(names_of)
    last = {name for held in names_of[-1].values() for name in held}
    if pp > 1 and _EMBEDDING in names_of[0].get(0, {}) and not last & set(_LAST_STAGE):
        warnings.warn(
            f"{folder}: the last pipeline stage found ({pp - 1}) holds neither {_OUTPUT} nor a "
            "final norm, which a GPT model's last stage holds: a missing mp_rank file of the "
            "last stage?",
            DumpWarning,
            stacklevel=2,
        )


def _layer_counts(names: Mapping[str, Any]) -> dict[str, int]:
    """The layers each block (by its ``...layers.`` prefix) holds among ``names``."""
    found: dict[str, int] = {}
    for name in names:
        match = _LAYER.match(name)
        if match:
            found[match[1]] = max(found.get(match[1], 0), int(match[2]) + 1)
    return found


def _experts_per_rank(names: Mapping[str, Any]) -> dict[str, int]:
    """Local experts per expert module (by its name prefix), SequentialMLP or grouped GEMM."""
    found: dict[str, set[int]] = {}
    for name in names:
        match = _LOCAL_EXPERT.match(name) or _GROUPED_EXPERT.match(name)
        if match:
            module = match[1] if match.re is _LOCAL_EXPERT else match[1].rpartition(".")[0]
            found.setdefault(module, set()).add(int(match[2]))
    return {module: max(indices) + 1 for module, indices in found.items()}


def _global_name(
    name: str, layer_offsets: Mapping[str, int], ep_rank: int, per_rank: Mapping[str, int]
) -> str:
    """``name`` with the layer numbered after its block's layers on the virtual stages before
    and the expert after the EP ranks before."""
    expert = _LOCAL_EXPERT.match(name)
    if expert:
        index = ep_rank * per_rank[expert[1]] + int(expert[2])
        name = f"{expert[1]}{index}{expert[3]}"
    grouped = _GROUPED_EXPERT.match(name)
    if grouped:
        index = ep_rank * per_rank[grouped[1].rpartition(".")[0]] + int(grouped[2])
        name = f"{grouped[1]}{index}"
    layer = _LAYER.match(name)
    if layer:
        name = f"{layer[1]}{int(layer[2]) + layer_offsets.get(layer[1], 0)}{layer[3]}"
    return name


def _tied(
    first: list[_Dump], last: list[_Dump], chunk: int, stated: bool | None
) -> tuple[bool, str]:
    """Whether the later stage's output layer is the embedding's tied copy, and why."""
    if stated is not None:
        return stated, f"--tied-output {'yes' if stated else 'no'}"
    by_place = {(dump.tp, dump.ep): dump for dump in first}
    for dump in last:
        other = by_place[(dump.tp, dump.ep)]
        output, embedding = dump.chunks[chunk][_OUTPUT], other.chunks[0][_EMBEDDING]
        if dump.shape(output) != other.shape(embedding):
            return False, "untied: its shape is not the embedding's"
        with mapped(dump.pth.container) as mine, mapped(other.pth.container) as theirs:
            # Bitwise: a NaN the all-reduce gave both copies is equal to itself here.
            ours, embedded = mine[output], theirs[embedding]
            if ours.dtype != embedded.dtype or not torch.equal(bits(ours), bits(embedded)):
                return False, (
                    f"untied: its gradient differs from the embedding's in {other.name} "
                    "(Megatron all-reduces tied copies before the dump)"
                )
    return True, "tied copy of the embedding: its gradient equals the embedding's in every file"


def open_wgrads(
    folder: Path, names: Sequence[str], options: WgradsOptions | None = None
) -> list[WgradsFile]:
    """Every file of the dump in ``folder`` as a rank file (a :class:`WgradsFile`), by rank.

    Raises:
        SnapshotError: a file that is not a wgrads file, a file missing from the TP x PP x EP
            grid, files of two layouts, a name no rule places, ... naming the file and tensor.
    """
    options = options or WgradsOptions()
    if options.gtp is not None and options.gtp > 1:
        raise SnapshotError(
            f"{folder}: a wgrads dump of a GTP job (--gtp {options.gtp}) cannot be read: the "
            "ranks of a GTP group write the same mp_rank file, so it holds one of their shards"
        )
    dumps = [_parse(folder, name) for name in names]
    named = _place_suffixes(dumps)
    places: dict[tuple[int, int, int], str] = {}
    for dump in dumps:
        place = (dump.tp, dump.pp, dump.ep)
        if place in places:
            raise SnapshotError(
                f"{dump.path}: names the same TP, PP and EP ranks as {places[place]}"
            )
        places[place] = dump.name
    tp = _sizes(dumps, "tp", "TP")
    pp = _sizes(dumps, "pp", "pipeline", "pp" in named)
    ep = _sizes(dumps, "ep", "expert-parallel", "ep" in named)
    etp = _expert_tp(folder, dumps, tp, ep, options.etp)
    writers = _writers(tp, ep, etp)
    stages: list[list[_Dump]] = [[] for _ in range(pp)]
    for dump in dumps:
        if (dump.tp, dump.ep) not in writers:
            raise SnapshotError(
                f"{dump.path}: TP rank {dump.tp} and EP rank {dump.ep} are not a writer of a "
                f"TP {tp} x EP {ep} x expert TP {etp} job"
            )
        dump.writer = writers[(dump.tp, dump.ep)]
        stages[dump.pp].append(dump)
    for stage, held in enumerate(stages):
        absent = sorted(set(writers) - {(dump.tp, dump.ep) for dump in held})
        if absent:
            t, e = absent[0]
            name = f"mp_rank_{t:02d}" + (f"_{stage:03d}" if pp > 1 else "")
            name += (f"_{e:03d}" if ep > 1 else "") + ".pth"
            raise SnapshotError(
                f"{folder / name}: missing: pipeline stage {stage} has {len(held)} files, "
                f"stage 0 {len(stages[0])}"
            )
        held.sort(key=lambda dump: dump.writer)
    names_of = [_stage_names(held) for held in stages]
    _check_tp_size(folder, names_of, tp)
    _check_experts(folder, names_of, ep)
    _check_last_stage(folder, names_of)
    chunks = max((max(held, default=0) for held in names_of), default=0) + 1
    # Virtual stage v = chunk * PP + stage holds the layers after those of v - 1.
    offsets: dict[tuple[int, int], dict[str, int]] = {}
    totals: dict[str, int] = {}
    for chunk in range(chunks):
        for stage in range(pp):
            offsets[(stage, chunk)] = dict(totals)
            for block, count in _layer_counts(names_of[stage].get(chunk, {})).items():
                totals[block] = totals.get(block, 0) + count
    first_place = (0, 0)
    last_place = (pp - 1, max(names_of[pp - 1], default=0))
    embedding_first = _EMBEDDING in names_of[0].get(0, {})
    later_output = pp > 1 and _OUTPUT in names_of[pp - 1].get(last_place[1], {})
    tied, tied_why = False, ""
    if embedding_first and later_output:
        tied, tied_why = _tied(stages[0], stages[pp - 1], last_place[1], options.tied_output)
    step = None
    iteration = _ITERATION.match(folder.resolve().name)
    if iteration:
        step = int(iteration[1])
    world_size = len(dumps)
    opened: list[WgradsFile] = []
    stage_of: dict[str, tuple[int, Path]] = {}  # a global name's stage, and a file holding it
    for stage, held in enumerate(stages):
        for dump in held:
            coords = {axis: (0, 1) for axis in AXES}
            coords |= {
                "tp": (dump.tp, tp),
                "pp": (stage, pp),
                "dp": (dump.writer // tp, etp * ep // tp),
                "ep": (dump.ep, ep),
                "etp": (dump.writer % etp, etp),
            }
            records: list[ParamRecord] = []
            sources: dict[str, Source] = {}
            for chunk in sorted(dump.chunks):
                local = dump.chunks[chunk]
                per_rank = _experts_per_rank(local)
                virtual = (stage, chunk)
                for name, slot in local.items():
                    global_name = _global_name(name, offsets[virtual], dump.ep, per_rank)
                    if global_name in sources:
                        raise SnapshotError(
                            f"{dump.path}: {name!r} of model_chunk{chunk} is {global_name!r}, "
                            f"as is {sources[global_name].local_name!r} of "
                            f"{sources[global_name].chunk}"
                        )
                    attrs, rule = _attributes(
                        dump, name, local, tp, etp, options, virtual != first_place, tied, tied_why
                    )
                    # One parameter on two stages: a copy (MTP's embedding), or a clash.
                    found = stage_of.setdefault(global_name, (stage, dump.path))
                    if found[0] != stage and not attrs.get("shared"):
                        raise SnapshotError(
                            f"{dump.path}: {name!r} of model_chunk{chunk} is {global_name!r}, as "
                            f"is a parameter of {found[1]} (pipeline stage {found[0]}): its "
                            "block's layers are not numbered from 0 on each stage"
                        )
                    container_slot = dump.pth.container.slots[slot]
                    records.append(
                        ParamRecord(
                            name=global_name,
                            has_grad=True,
                            shape=container_slot.shape,
                            dtype=container_slot.dtype,
                            param_shape=container_slot.shape,
                            attrs=attrs,
                        )
                    )
                    sources[global_name] = Source(f"model_chunk{chunk}", name, rule, slot)
            header = RankHeader(
                rank=len(opened),
                world_size=world_size,
                step=step,
                coords=coords,
                distributed_optimizer=False,
                grad_attr="main_grad",
                params=tuple(records),
            )
            opened.append(WgradsFile(header, dump.pth.container, sources))
    return opened


@functools.cache
def _rule(options: WgradsOptions, name: str) -> tuple[int | None, str] | None:
    """:meth:`WgradsOptions.sharding`, once per name: every file of a stage holds the same."""
    return options.sharding(name)


# Multi-latent attention's down-projections are duplicated in the Transformer Engine spec and
# column-parallel in the local one: the up-projection that reads the latent tells which. Its
# weight is [..., latent] whole; the down-projection's rows are the latent (the query's), or
# the latent and the rotary dimensions (the key-value's), whole or split over TP.
_DOWN_PROJECTIONS = (
    ("linear_q_down_proj.weight", "linear_q_up_proj.weight", False),
    ("linear_kv_down_proj.weight", "linear_kv_up_proj.weight", True),
)


def _by_shapes(
    dump: _Dump, name: str, held: Mapping[str, str], tp: int
) -> tuple[int | None, str] | None:
    """How a tensor whose name leaves it open lies over TP, from the shapes; None: unknown."""
    for down, up, with_rotary in _DOWN_PROJECTIONS:
        companion = name[: -len(down)] + up
        if not name.endswith("." + down) or companion not in held:
            continue
        rows, latent = dump.shape(held[name])[0], dump.shape(held[companion])[-1]
        evidence = f"shape evidence: {rows} rows against the {latent}-wide latent {up} reads"
        whole = rows > latent if with_rotary else rows == latent
        split = (rows < latent <= rows * tp) if with_rotary else rows * tp == latent
        if whole:
            return None, f"{evidence}: duplicated (Transformer Engine spec)"
        if split:
            return COLUMN, f"{evidence}: column-parallel (local spec)"
    return None


def _attributes(
    dump: _Dump,
    name: str,
    held: Mapping[str, str],
    tp: int,
    etp: int,
    options: WgradsOptions,
    later_stage: bool,
    tied: bool,
    tied_why: str,
) -> tuple[dict[str, Any], str]:
    """A parameter's Megatron attributes and the rule that decided them."""
    expert = EXPERT_NAME.search(name) is not None
    attrs: dict[str, Any] = {} if not expert else {"allreduce": False}
    size = etp if expert else tp
    decided = _rule(options, name)
    if decided is None and size > 1:
        decided = _by_shapes(dump, name, held, size)
    if decided is None:
        if size > 1:
            raise SnapshotError(
                f"{dump.path}: parameter {name!r} matches no Megatron naming rule, so how it "
                f"lies over tensor parallelism (size {size}) is unknown; state it with "
                "--tp-sharded 'PATTERN=DIM' or --tp-replicated PATTERN"
            )
        decided = (None, f"{'expert ' if expert else ''}TP size 1: whole on every file")
    dim, rule = decided
    shape = dump.shape(held[name])
    if dim is not None:
        if dim >= len(shape):
            raise SnapshotError(
                f"{dump.path}: parameter {name!r} is {list(shape)}, with no dimension {dim} to "
                f"split over TP ({rule})"
            )
        attrs |= {"tensor_model_parallel": True, "partition_dim": dim}
    if name == _EMBEDDING and later_stage:
        attrs |= {"shared": True, "shared_embedding": True}
        rule = "a copy of the first stage's embedding (the MTP stage's), not counted"
    elif name == _OUTPUT and later_stage and tied:
        attrs |= {"shared": True, "shared_embedding": True}
        rule = f"{rule}; {tied_why}, not counted"
    elif name == _OUTPUT and later_stage and tied_why:
        rule = f"{rule}; {tied_why}"
    elif name == _OUTPUT and not later_stage:
        rule += (
            "; untied: the embedding's stage holds an output weight of its own (Megatron "
            "allocates none when they are tied)"
        )
    elif name == _EMBEDDING and tied:
        attrs["shared_embedding"] = True
    return attrs, rule

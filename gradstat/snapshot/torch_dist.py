"""Megatron ``torch_dist`` checkpoints: stacked layers per layer, the optimizer's two forms.

Megatron's ``dist_checkpointing.save`` writes a DCP directory (``.metadata``, ``__R_I.distcp``)
plus ``metadata.json`` (``{"sharded_backend": "torch_dist", ...}``) and ``common.pt`` (a pickle,
never read here). What it stores, as observed from megatron-core 0.16.1 (GPTModel, TP2 x PP2):

- Homogeneous transformer layers are one tensor per layer parameter, stacked on a leading layer
  axis: ``decoder.layers.self_attention.linear_qkv.weight`` of global shape ``[L, 3h, h]``, each
  chunk one layer (``sizes[0] == 1``) at ``offsets[0]`` = the layer's global index (numbered
  across pipeline stages), further split by TP on the partitioned dim. Layernorms are stored
  under Transformer Engine's names (``linear_qkv.layer_norm_weight``,
  ``mlp.linear_fc1.layer_norm_bias``) even for the local layer spec, whose modules are
  ``input_layernorm`` and ``pre_mlp_layernorm``.
- The distributed optimizer's ``fully_reshardable`` form stores, per model key,
  ``optimizer.state.{param,exp_avg,exp_avg_sq}.<key>`` with the model key's shape and chunks
  (``param`` is the fp32 master copy); its ``dp_reshardable`` form (Megatron's default) stores
  1-D buckets ``optimizer.distributed.dp_group_idx_D.gbuf_idx_G.dtype_(...).bucket_idx_B.<stat>``
  whose gaps are uninitialised memory and whose parameter layout is not in the checkpoint.
- MoE experts (local spec, ``SequentialMLP``; EP2 x PP2) are stacked twice:
  ``decoder.layers.mlp.experts.experts.linear_fc1.weight`` of shape ``[L, E, out, in]``, each
  chunk one layer and one expert at offsets ``(layer, global expert, 0, 0)``; the live modules are
  ``decoder.layers.<i>.mlp.experts.local_experts.<k>`` with ``k`` local to the EP rank. Routers
  are stacked like dense layers (``decoder.layers.mlp.router.weight``, ``[L, E, h]``).

These functions only look at the index and ``metadata.json`` (as JSON); they never unpickle.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

from gradstat.errors import SnapshotError
from gradstat.snapshot.dcp import DcpIndex, TensorEntry

__all__ = [
    "DP_RESHARDABLE_PREFIX",
    "STACKED_PREFIX",
    "expert_rows",
    "is_torch_dist",
    "layer_rows",
    "optimizer_key",
    "refuse_dp_reshardable",
]

METADATA_JSON = "metadata.json"
TORCH_DIST = "torch_dist"
# The stacked transformer layers' keys (one tensor per layer parameter, layer axis first).
STACKED_PREFIX = "decoder.layers."
# The distributed optimizer's dp_reshardable state (buckets and their per-group records).
DP_RESHARDABLE_PREFIX = "optimizer.distributed."
# Megatron's fully_reshardable optimizer keys: optimizer.state.<stat>.<model key>; the stat is
# one segment (param, exp_avg, exp_avg_sq...), the model key may itself hold dots.
_OPTIMIZER_STATE = re.compile(r"^optimizer\.state\.(?P<stat>[A-Za-z_][A-Za-z0-9_]*)\.(?P<key>.+)$")
_MOMENTS = frozenset({"exp_avg", "exp_avg_sq"})
# A stacked key: an optional optimizer-state head, then decoder.layers.<not a layer number>.
_STACKED = re.compile(
    r"^(?P<head>(?:optimizer\.state\.[A-Za-z_][A-Za-z0-9_]*\.)?)decoder\.layers\.(?P<rest>(?!\d+(?:\.|$)).+)$"
)


def is_torch_dist(directory: Path) -> bool:
    """Whether ``directory`` is a Megatron ``torch_dist`` checkpoint.

    Megatron writes ``metadata.json`` with ``"sharded_backend": "torch_dist"`` beside the DCP
    files; it is read as JSON only (``common.pt``, a pickle, is never opened).

    Args:
        directory: a checkpoint directory.

    Returns:
        True when ``metadata.json`` names the ``torch_dist`` backend; False when there is none.

    Raises:
        SnapshotError: ``metadata.json`` exists but is not a JSON object.
    """
    path = Path(directory) / METADATA_JSON
    if not path.is_file():
        return False
    try:
        document = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as error:
        raise SnapshotError(
            f"{path}: cannot read Megatron's checkpoint metadata ({error}); the file should be "
            f'JSON like {{"sharded_backend": "torch_dist"}}'
        ) from error
    if not isinstance(document, dict):
        raise SnapshotError(
            f"{path}: Megatron's checkpoint metadata is a {type(document).__name__}, not a JSON "
            f'object like {{"sharded_backend": "torch_dist"}}'
        )
    return document.get("sharded_backend") == TORCH_DIST


def layer_rows(entry: TensorEntry) -> list[tuple[str, int]] | None:
    """The per-layer record names of a stacked-layer tensor, one per index of its layer axis.

    A tensor is stacked when its key is ``decoder.layers.<rest>`` (optionally behind a
    fully_reshardable optimizer head ``optimizer.state.<stat>.``) with ``<rest>`` not starting
    with a layer number, and it has at least one dimension. Row ``i`` is named as the key
    would be unstacked, ``decoder.layers.<i>.<rest>`` (``optimizer.state.<stat>.decoder.layers.
    <i>.<rest>``), so that :func:`gradstat.snapshot.checkpoint.classify_key` and
    :func:`optimizer_key` apply to the row's name unchanged. ``i`` is the global layer index
    (Megatron numbers layers across pipeline stages in the checkpoint): the chunk with
    ``offsets[0] == i`` holds row ``i``.

    MoE expert weights (``decoder.layers.<...>experts.experts.<rest>``) are stacked the same way
    on the layer axis and their rows keep the expert axis; :func:`expert_rows` splits them into
    one row per layer and expert, named as the experts' parameters are.

    Args:
        entry: a tensor of the checkpoint's index.

    Returns:
        ``[(row name, layer index), ...]`` in layer order, or None for a tensor that is not a
        stacked-layer tensor (embeddings, the final layernorm, optimizer buckets, per-layer keys
        ``decoder.layers.3.<rest>``).

    Raises:
        SnapshotError: a stacked key whose chunk spans more than one layer, so its rows are not
            Megatron's one chunk per layer.
    """
    match = _STACKED.match(entry.fqn)
    if match is None or not entry.size:
        return None
    for chunk in entry.chunks:
        if chunk.sizes[0] != 1:
            raise SnapshotError(
                f"tensor {entry.fqn!r}: a chunk at {chunk.offsets} spans {chunk.sizes[0]} "
                f"layers of its leading layer axis (of {entry.size[0]}); Megatron's torch_dist "
                "stores one layer per chunk: the checkpoint was not written by Megatron's "
                "stacked layout and cannot be split into layers"
            )
    head, rest = match["head"], match["rest"]
    return [(f"{head}{STACKED_PREFIX}{layer}.{rest}", layer) for layer in range(entry.size[0])]


def expert_rows(entry: TensorEntry) -> list[tuple[str, int, int]] | None:
    """The per-layer, per-expert record names of a stacked MoE expert tensor.

    A stacked tensor (see :func:`layer_rows`) whose key continues ``<...>experts.experts.<rest>``
    after ``decoder.layers.`` has a second, expert axis: Megatron stores each layer's experts
    numbered globally (over expert-parallel ranks), one chunk per layer and expert. Row
    ``(i, e)`` is ``full[i, e]``, named ``decoder.layers.<i>.<...>experts.local_experts.<e>.<rest>``
    (behind the same optimizer head, if any): ``SequentialMLP``'s parameter name with the expert
    numbered globally, as layers are.

    Args:
        entry: a tensor of the checkpoint's index.

    Returns:
        ``[(row name, layer index, expert index), ...]`` in layer then expert order, or None for a
        tensor that is not a stacked expert tensor.

    Raises:
        SnapshotError: a chunk spans more than one layer or more than one expert.
    """
    if layer_rows(entry) is None:
        return None
    match = _STACKED.match(entry.fqn)
    assert match is not None
    head, rest = match["head"], match["rest"]
    before, found, after = rest.partition("experts.experts.")
    if not found or len(entry.size) < 2 or (before and not before.endswith(".")):
        return None
    for chunk in entry.chunks:
        if chunk.sizes[1] != 1:
            raise SnapshotError(
                f"tensor {entry.fqn!r}: a chunk at {chunk.offsets} spans {chunk.sizes[1]} "
                f"experts of its expert axis (of {entry.size[1]}); Megatron's torch_dist stores "
                "one expert per chunk: the tensor cannot be split into experts"
            )
    return [
        (
            f"{head}{STACKED_PREFIX}{layer}.{before}experts.local_experts.{expert}.{after}",
            layer,
            expert,
        )
        for layer in range(entry.size[0])
        for expert in range(entry.size[1])
    ]


def optimizer_key(fqn: str) -> tuple[str, str] | None:
    """What a fully_reshardable optimizer key holds, and the model key it belongs to.

    Megatron names them ``optimizer.state.<stat>.<model key>``: ``exp_avg`` and ``exp_avg_sq``
    are Adam's moments; ``param`` is the fp32 master copy of the weight and other stats are
    reported as ``other`` (the kinds of :class:`gradstat.snapshot.checkpoint.KeyKind`).
    :func:`~gradstat.snapshot.checkpoint.classify_key` gets the moments right but reads
    ``optimizer.state.param.<key>`` as stat ``<last segment>`` of parameter ``param.<key minus
    its last segment>``; this function names the model key.

    Args:
        fqn: a checkpoint key (or a row name from :func:`layer_rows`).

    Returns:
        ``(kind, model key)`` with kind ``exp_avg``, ``exp_avg_sq`` or ``other``; None for a key
        that is not ``optimizer.state.<stat>.<key>``.
    """
    match = _OPTIMIZER_STATE.match(fqn)
    if match is None:
        return None
    stat = match["stat"]
    return (stat if stat in _MOMENTS else "other", match["key"])


def refuse_dp_reshardable(index: DcpIndex) -> None:
    """Refuse a checkpoint whose distributed-optimizer state is in the dp_reshardable form.

    The form is recognised by its keys: tensors (the 1-D buckets) or bytes entries
    (``per_bucket_numel``, the inner optimizer's state) under ``optimizer.distributed.``.
    ``metadata.json`` does not say which form was saved (only ``common.pt``, a pickle, does).

    Args:
        index: the checkpoint's index.

    Raises:
        SnapshotError: the checkpoint holds dp_reshardable state; the message names the
            directory and the first such key, why it cannot be read per parameter, and what to
            save instead.
    """
    keys = [*index.tensors, *index.bytes_entries]
    found = next((key for key in keys if key.startswith(DP_RESHARDABLE_PREFIX)), None)
    if found is None:
        return
    raise SnapshotError(
        f"{index.directory}: key {found!r} is Megatron's distributed-optimizer state in the "
        "dp_reshardable form, whose 1-D buckets' gaps hold uninitialised memory and whose layout "
        "(which parameter lies where) is not in the checkpoint; save the optimizer with "
        "sharding type 'fully_reshardable' to read its state per parameter"
    )

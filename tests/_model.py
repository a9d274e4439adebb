"""A small model sharded with ``gradstat.testing``, for the compare and audit tests.

Dense and expert parameters, TP column and row splits, GTP-sharded weights whose padding
spills over a whole shard in some layouts, and a tied output layer on the last stage. The
gradients are float32 with exact zeros; tests plant defects into the sharded ranks.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import torch

from gradstat.testing import Layout, ParamLayout, RankParams, shard_gradients, write_snapshot

EMBEDDING = "embedding.word_embeddings.weight"
OUTPUT = "output_layer.weight"
LAYERNORM = "decoder.layers.0.input_layernorm.weight"
QKV = "decoder.layers.0.self_attention.linear_qkv.weight"
PROJ = "decoder.layers.0.self_attention.linear_proj.weight"
ROUTER = "decoder.layers.1.mlp.router.weight"
NUM_EXPERTS = 4


def expert(index: int, which: str = "fc1", kind: str = "weight") -> str:
    return f"decoder.layers.1.mlp.experts.local_experts.{index}.linear_{which}.{kind}"


# name: (shape, split, stage (0 first, -1 last), expert index, GTP-sharded)
_PARAMS: dict[str, tuple[tuple[int, ...], str, int, int | None, bool]] = {
    EMBEDDING: ((64, 16), "column", 0, None, False),
    "embedding.position_embeddings.weight": ((8, 16), "none", 0, None, False),
    LAYERNORM: ((16,), "none", 0, None, False),
    QKV: ((40, 16), "column", 0, None, True),
    PROJ: ((16, 32), "row", -1, None, True),
    ROUTER: ((NUM_EXPERTS, 16), "none", -1, None, False),
    **{expert(i): ((24, 16), "column", -1, i, True) for i in range(NUM_EXPERTS)},
    **{expert(i, "fc2"): ((16, 24), "row", -1, i, False) for i in range(NUM_EXPERTS)},
    **{expert(i, "fc1", "bias"): ((24,), "none", -1, i, False) for i in range(NUM_EXPERTS)},
    "decoder.final_layernorm.weight": ((16,), "none", -1, None, False),
}


def full_grads(seed: int = 0) -> dict[str, torch.Tensor]:
    """Every logical parameter's float32 gradient, about a seventh of it exact zeros."""
    gen = torch.Generator().manual_seed(seed)
    grads = {}
    for name, (shape, *_) in _PARAMS.items():
        grad = torch.randn(shape, generator=gen)
        grad.view(-1)[::7] = 0.0
        grads[name] = grad
    return grads


def specs(pp: int = 1) -> list[ParamLayout]:
    """Module order; the output layer is the embedding's tied copy on the last stage."""
    found = []
    for name, (_, split, stage, index, gtp) in _PARAMS.items():
        found.append(
            ParamLayout(
                name,
                split,  # type: ignore[arg-type]
                stage=stage % pp,
                expert=index,
                num_experts=NUM_EXPERTS if index is not None else 0,
                gtp=gtp,
            )
        )
    found.append(ParamLayout(OUTPUT, "column", stage=pp - 1, tied_copy_of=EMBEDDING))
    return found


def write(
    directory: Path,
    layout: Layout,
    grads: dict[str, torch.Tensor] | None = None,
    plant: Callable[[list[RankParams]], None] | None = None,
) -> Path:
    """Shard ``grads`` (default: ``full_grads()``) in ``layout``, let ``plant`` edit the ranks'
    parameters, and write the snapshot."""
    grads = full_grads() if grads is None else grads
    wanted = [spec for spec in specs(layout.pp) if spec.name in grads or spec.tied_copy_of]
    ranks = shard_gradients(layout, wanted, grads)
    if plant is not None:
        plant(ranks)
    write_snapshot(directory, layout, ranks, step=7)
    return directory


def params_named(ranks: list[RankParams], name: str) -> list[tuple[RankParams, torch.nn.Parameter]]:
    """Every rank's param called ``name``, with the rank it is on."""
    return [(share, param) for share in ranks for found, param in share.params if found == name]

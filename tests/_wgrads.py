"""Megatron wgrads dumps of known logical gradients, sharded here, independently of gradstat.

A :class:`Model` is a GPT's logical gradients by global name (layers and experts numbered over
the whole model), each with how Megatron's module lays it over tensor parallelism. A
:class:`Layout` places them as megatron-core 0.19's ``save_grads`` writes them
(``megatron/training/checkpointing.py``, read for the facts): the writers of a stage are its
ranks with expert-data-parallel rank 0, ranks ``r < ETP * EP`` (Megatron numbers TP, for
experts ETP, first), TP rank ``r % TP``, EP rank ``r // ETP``; each writes
``{"model_chunk{i}": {local name: main_grad}}`` to ``mp_rank_TT[_PPP][_EEE].pth``, local names
numbering layers from 0 in each virtual stage (chunk ``i`` of stage ``p`` is virtual stage
``i * PP + p``) and experts from 0 on each EP rank.

The float64 statistics of the logical gradients are the oracle: each tensor once, the tied
output layer not a tensor of its own.
"""

from __future__ import annotations

import json
import math
import zlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import Tensor
from typer.testing import CliRunner

from gradstat.cli import app

HIDDEN, FFN, VOCAB, EXPERT_FFN = 8, 16, 24, 6


@dataclass(frozen=True)
class Logical:
    """One logical tensor: its float32 gradient, the dimension split over TP (None: a full
    copy on every TP rank), and whether it is an expert's."""

    grad: Tensor
    dim: int | None
    expert: bool = False


@dataclass(frozen=True)
class Layout:
    """A Megatron job's parallel sizes and model options."""

    tp: int = 1
    pp: int = 1
    ep: int = 1
    etp: int | None = None  # None: the TP size
    vpp: int = 1
    layers: tuple[int, ...] | None = None  # layers per virtual stage (None: 2 each)
    experts: int = 0  # MoE layers with this many experts (0: dense)
    grouped: bool = False  # grouped-GEMM experts (weight0..K) instead of SequentialMLP
    te: bool = False  # Transformer Engine spec: layernorms fused into the linears
    tied: bool = True  # the output layer shares the embedding's weight
    block: str = "decoder"  # the layers' block: GPT's decoder, BERT's encoder

    @property
    def expert_tp(self) -> int:
        return self.tp if self.etp is None else self.etp

    @property
    def stage_layers(self) -> tuple[int, ...]:
        return self.layers or (2,) * (self.pp * self.vpp)


def _grad(name: str, shape: tuple[int, ...], seed: int = 0) -> Tensor:
    generator = torch.Generator().manual_seed(zlib.crc32(f"{name}/{seed}".encode()))
    grad = torch.randn(shape, generator=generator, dtype=torch.float64).to(torch.float32)
    grad[grad.abs() < 0.15] = 0.0  # exact zeros to count
    return grad


@dataclass
class Model:
    """The logical gradients of a GPT in ``layout``, by global name, in module order."""

    layout: Layout
    tensors: dict[str, Logical] = field(default_factory=dict)

    @classmethod
    def make(cls, layout: Layout, seed: int = 0) -> Model:
        model = cls(layout)
        add = model._add
        add("embedding.word_embeddings.weight", (VOCAB, HIDDEN), 0, seed)
        for layer in range(sum(layout.stage_layers)):
            prefix = f"{layout.block}.layers.{layer}."
            if layout.te:
                add(prefix + "self_attention.linear_qkv.layer_norm_weight", (HIDDEN,), None, seed)
            else:
                add(prefix + "input_layernorm.weight", (HIDDEN,), None, seed)
                add(prefix + "input_layernorm.bias", (HIDDEN,), None, seed)
            add(prefix + "self_attention.linear_qkv.weight", (3 * HIDDEN, HIDDEN), 0, seed)
            add(prefix + "self_attention.linear_qkv.bias", (3 * HIDDEN,), 0, seed)
            add(prefix + "self_attention.linear_proj.weight", (HIDDEN, HIDDEN), 1, seed)
            add(prefix + "self_attention.linear_proj.bias", (HIDDEN,), None, seed)
            if layout.experts:
                add(prefix + "pre_mlp_layernorm.weight", (HIDDEN,), None, seed)
                add(prefix + "mlp.router.weight", (layout.experts, HIDDEN), None, seed)
                for expert in range(layout.experts):
                    if layout.grouped:
                        fc1 = f"{prefix}mlp.experts.linear_fc1.weight{expert}"
                        fc2 = f"{prefix}mlp.experts.linear_fc2.weight{expert}"
                    else:
                        fc1 = f"{prefix}mlp.experts.local_experts.{expert}.linear_fc1.weight"
                        fc2 = f"{prefix}mlp.experts.local_experts.{expert}.linear_fc2.weight"
                    add(fc1, (EXPERT_FFN, HIDDEN), 0, seed, expert=True)
                    add(fc2, (HIDDEN, EXPERT_FFN), 1, seed, expert=True)
            else:
                if layout.te:
                    add(prefix + "mlp.linear_fc1.layer_norm_weight", (HIDDEN,), None, seed)
                else:
                    add(prefix + "pre_mlp_layernorm.weight", (HIDDEN,), None, seed)
                add(prefix + "mlp.linear_fc1.weight", (FFN, HIDDEN), 0, seed)
                add(prefix + "mlp.linear_fc2.weight", (HIDDEN, FFN), 1, seed)
                add(prefix + "mlp.linear_fc2.bias", (HIDDEN,), None, seed)
        add(f"{layout.block}.final_layernorm.weight", (HIDDEN,), None, seed)
        if not layout.tied:
            add("output_layer.weight", (VOCAB, HIDDEN), 0, seed)
        return model

    def _add(
        self, name: str, shape: tuple[int, ...], dim: int | None, seed: int, expert: bool = False
    ) -> None:
        self.tensors[name] = Logical(_grad(name, shape, seed), dim, expert)

    # --- the oracle ---------------------------------------------------------------------

    def norm(self, p: float) -> float:
        grads = [logical.grad.double() for logical in self.tensors.values()]
        if p == math.inf:
            return max(float(grad.abs().max()) for grad in grads)
        return sum(float((grad.abs() ** p).sum()) for grad in grads) ** (1 / p)

    def param_norms(self) -> dict[str, float]:
        return {
            name: math.sqrt(float((logical.grad.double() ** 2).sum()))
            for name, logical in self.tensors.items()
        }

    @property
    def zeros(self) -> int:
        return sum(int((logical.grad == 0).sum()) for logical in self.tensors.values())

    # --- the dump -----------------------------------------------------------------------

    def write(self, folder: Path) -> list[Path]:
        """Write the dump as ``save_grads`` writes it; returns the files."""
        layout = self.layout
        folder.mkdir(parents=True, exist_ok=True)
        written = []
        for stage in range(layout.pp):
            for writer in range(layout.expert_tp * layout.ep):
                tp_rank, ep_rank = writer % layout.tp, writer // layout.expert_tp
                chunks = {}
                for chunk in range(layout.vpp):
                    held = self._chunk(stage, chunk, tp_rank, ep_rank, writer % layout.expert_tp)
                    if held:
                        chunks[f"model_chunk{chunk}"] = held
                name = f"mp_rank_{tp_rank:02d}"
                if layout.pp > 1:
                    name += f"_{stage:03d}"
                if layout.ep > 1:
                    name += f"_{ep_rank:03d}"
                path = folder / f"{name}.pth"
                torch.save(chunks, path)
                written.append(path)
        return written

    def _chunk(
        self, stage: int, chunk: int, tp_rank: int, ep_rank: int, etp_rank: int
    ) -> dict[str, Tensor]:
        layout = self.layout
        virtual = chunk * layout.pp + stage
        last = layout.pp * layout.vpp - 1
        first_layer = sum(layout.stage_layers[:virtual])
        layers = range(first_layer, first_layer + layout.stage_layers[virtual])
        per_rank = layout.experts // layout.ep if layout.experts else 0
        held: dict[str, Tensor] = {}
        for name, logical in self.tensors.items():
            local = self._local_name(name, virtual, last, layers, ep_rank, per_rank)
            if local is None:
                continue
            size, rank = (layout.expert_tp, etp_rank) if logical.expert else (layout.tp, tp_rank)
            grad = logical.grad
            if logical.dim is not None:
                grad = grad.chunk(size, dim=logical.dim)[rank]
            held[local] = grad.clone()
        if virtual == last and layout.tied and layout.pp > 1:
            # The last stage's tied copy, all-reduced with the embedding before the dump.
            embedding = self.tensors["embedding.word_embeddings.weight"].grad
            held["output_layer.weight"] = embedding.chunk(layout.tp, dim=0)[tp_rank].clone()
        return held

    def _local_name(
        self, name: str, virtual: int, last: int, layers: range, ep_rank: int, per_rank: int
    ) -> str | None:
        if name.startswith("embedding."):
            return name if virtual == 0 else None
        if name.startswith((f"{self.layout.block}.final_layernorm", "output_layer")):
            return name if virtual == last else None
        parts = name.split(".")
        layer = int(parts[2])
        if layer not in layers:
            return None
        parts[2] = str(layer - layers.start)
        if "local_experts" in parts:
            index = parts.index("local_experts") + 1
            expert = int(parts[index])
            if expert // per_rank != ep_rank:
                return None
            parts[index] = str(expert % per_rank)
        elif ".experts.linear_fc" in name:
            head = parts[-1].rstrip("0123456789")
            expert = int(parts[-1][len(head) :])
            if expert // per_rank != ep_rank:
                return None
            parts[-1] = f"{head}{expert % per_rank}"
        return ".".join(parts)


def run_cli(*args: str | Path) -> tuple[int, Any, str]:
    """A command in this process: its exit code, its JSON (else its text) and its stderr."""
    result = CliRunner().invoke(app, [str(arg) for arg in args])
    output = result.stdout
    document = json.loads(output) if output.strip().startswith("{") else output
    return result.exit_code, document, result.stderr


def close(got: float, expected: float) -> bool:
    """Within 1e-12 of ``expected``, relatively."""
    return abs(got - expected) <= 1e-12 * max(abs(expected), 1e-300)

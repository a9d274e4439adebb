"""Real torch-native jobs for the tests: a small Llama-style model, parallelized as users do.

Each job runs one real training step (loss and backward) on gloo CPU ranks with PyTorch's own
parallelism: ``fully_shard`` (FSDP2) on a 1-D mesh, HSDP on a 2x2 mesh, ``parallelize_module``
TP with and without SequenceParallel x FSDP2 on a 2x2 mesh, HSDP x TP on a 2x1x2 mesh, and
DDP. The truth every number is held against is float64 statistics of the full gradients the
job holds (``full_tensor()``), each logical parameter once, computed here without gradstat.

The model has a tied embedding (the output layer shares it), shapes that FSDP2 shards unevenly
over 2 or 4 ranks, and vocabulary rows no token uses, whose gradient rows are exactly zero.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn

VOCAB, DIM, HEADS, FFN, LAYERS = 37, 12, 2, 22, 2
BATCH, SEQ = 2, 6
UNUSED_TOKENS = (3, 5, 30, 31, 32, 33, 34, 35, 36)
SEED = 20261130
JOBS = ("fsdp2", "hsdp", "tp_fsdp2", "tp_sp_fsdp2", "hsdp_tp_sp", "ddp")
# Wrapper prefixes a job's parameter names carry, which gradstat strips.
PREFIXES = ("module.", "_orig_mod.", "_checkpoint_wrapped_module.", "_fsdp_wrapped_module.")


class Attention(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.wq = nn.Linear(DIM, DIM, bias=False)
        self.wk = nn.Linear(DIM, DIM, bias=False)
        self.wv = nn.Linear(DIM, DIM, bias=False)
        self.wo = nn.Linear(DIM, DIM, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        batch, seq, _ = x.shape

        def heads(t: Tensor) -> Tensor:
            return t.view(batch, seq, -1, DIM // HEADS).transpose(1, 2)

        q, k, v = heads(self.wq(x)), heads(self.wk(x)), heads(self.wv(x))
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        result: Tensor = self.wo(out.transpose(1, 2).reshape(batch, seq, -1))
        return result


class FeedForward(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w1 = nn.Linear(DIM, FFN, bias=False)
        self.w2 = nn.Linear(FFN, DIM, bias=False)
        self.w3 = nn.Linear(DIM, FFN, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        result: Tensor = self.w2(F.silu(self.w1(x)) * self.w3(x))
        return result


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.attention_norm = nn.RMSNorm(DIM)
        self.attention = Attention()
        self.ffn_norm = nn.RMSNorm(DIM)
        self.feed_forward = FeedForward()

    def forward(self, x: Tensor) -> Tensor:
        x = x + self.attention(self.attention_norm(x))
        result: Tensor = x + self.feed_forward(self.ffn_norm(x))
        return result


class Transformer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.tok_embeddings = nn.Embedding(VOCAB, DIM)
        self.layers = nn.ModuleDict({str(index): Block() for index in range(LAYERS)})
        self.norm = nn.RMSNorm(DIM)
        self.output = nn.Linear(DIM, VOCAB, bias=False)
        self.output.weight = self.tok_embeddings.weight  # tied

    def forward(self, tokens: Tensor) -> Tensor:
        x = self.tok_embeddings(tokens)
        for layer in self.layers.values():
            x = layer(x)
        result: Tensor = self.output(self.norm(x))
        return result


def batch() -> tuple[Tensor, Tensor]:
    """The same tokens on every rank (so every layout computes the same gradient)."""
    generator = torch.Generator().manual_seed(SEED + 1)
    used = torch.tensor([token for token in range(VOCAB) if token not in UNUSED_TOKENS])
    picks = torch.randint(0, len(used), (BATCH, SEQ + 1), generator=generator)
    tokens = used[picks]
    return tokens[:, :-1], tokens[:, 1:]


def new_model() -> Transformer:
    torch.manual_seed(SEED)
    return Transformer()


def loss_of(model: nn.Module) -> Tensor:
    inputs, targets = batch()
    logits = model(inputs)
    if hasattr(logits, "full_tensor"):  # a DTensor output (loss parallel is not used)
        logits = logits.full_tensor()
    # Unused tokens are masked out of the logits: their (tied) rows get exact-zero gradients.
    unused = torch.zeros(VOCAB, dtype=torch.bool)
    unused[list(UNUSED_TOKENS)] = True
    logits = logits.masked_fill(unused, -math.inf)
    return F.cross_entropy(logits.reshape(-1, VOCAB).float(), targets.reshape(-1))


def _tp_plan(sequence_parallel: bool) -> dict[str, Any]:
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        PrepareModuleInput,
        RowwiseParallel,
        SequenceParallel,
    )

    plan: dict[str, Any] = {
        "tok_embeddings": RowwiseParallel(
            input_layouts=Replicate(),
            output_layouts=Shard(1) if sequence_parallel else Replicate(),
        ),
        "output": ColwiseParallel(
            input_layouts=Shard(1) if sequence_parallel else Replicate(),
            output_layouts=Replicate(),
        ),
    }
    if sequence_parallel:
        plan["norm"] = SequenceParallel()
    for index in range(LAYERS):
        prefix = f"layers.{index}."
        for name in ("wq", "wk", "wv"):
            plan[prefix + "attention." + name] = ColwiseParallel()
        plan[prefix + "attention.wo"] = RowwiseParallel(
            output_layouts=Shard(1) if sequence_parallel else Replicate()
        )
        plan[prefix + "feed_forward.w1"] = ColwiseParallel()
        plan[prefix + "feed_forward.w3"] = ColwiseParallel()
        plan[prefix + "feed_forward.w2"] = RowwiseParallel(
            output_layouts=Shard(1) if sequence_parallel else Replicate()
        )
        if sequence_parallel:
            plan[prefix + "attention_norm"] = SequenceParallel()
            plan[prefix + "ffn_norm"] = SequenceParallel()
            plan[prefix + "attention"] = PrepareModuleInput(
                input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)
            )
            plan[prefix + "feed_forward"] = PrepareModuleInput(
                input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)
            )
    return plan


def build(job: str) -> tuple[nn.Module, Any]:
    """The model of ``job`` parallelized over the 4 ranks, and its mesh (None for DDP)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import parallelize_module

    model = new_model()
    world = dist.get_world_size()
    if job == "ddp":
        return nn.parallel.DistributedDataParallel(model), None
    if job == "fsdp2":
        mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("dp_shard",))
        for layer in model.layers.values():
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        return model, mesh
    if job == "hsdp":
        mesh = init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("dp_replicate", "dp_shard"))
        for layer in model.layers.values():
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        return model, mesh
    if job == "hsdp_tp_sp":  # a 3-D mesh: HSDP (2 x 1) x TP 2 with SequenceParallel
        mesh = init_device_mesh(
            "cpu", (2, 1, world // 2), mesh_dim_names=("dp_replicate", "dp_shard", "tp")
        )
        data_parallel = mesh["dp_replicate", "dp_shard"]
        sequence_parallel = True
    else:
        mesh = init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("dp_shard", "tp"))
        data_parallel = mesh["dp_shard"]
        sequence_parallel = job == "tp_sp_fsdp2"
    parallelize_module(model, mesh["tp"], _tp_plan(sequence_parallel))
    model.output.weight = model.tok_embeddings.weight  # the plan replaced the tied parameter
    for layer in model.layers.values():
        fully_shard(layer, mesh=data_parallel)
    fully_shard(model, mesh=data_parallel)
    return model, mesh


def logical_name(name: str) -> str:
    for prefix in PREFIXES:
        name = name.replace(prefix, "")
    return name


def full_gradients(model: nn.Module) -> dict[str, Tensor]:
    """Every logical parameter's full gradient as the job holds it (collective on DTensors)."""
    grads = {}
    for name, param in model.named_parameters():
        grad = param.grad
        if grad is None:
            continue
        full = grad.full_tensor() if hasattr(grad, "full_tensor") else grad
        grads[logical_name(name)] = full.detach().clone()
    return grads


def float64_stats(grads: dict[str, Tensor]) -> dict[str, Any]:
    """Norms 2, 1, inf and the zero count, in float64, from the full gradients."""
    flat = [grad.double().reshape(-1) for grad in grads.values()]
    everything = torch.cat(flat) if flat else torch.zeros(0, dtype=torch.float64)
    return {
        "l2": math.sqrt(math.fsum(everything.square().tolist())),
        "l1": math.fsum(everything.abs().tolist()),
        "inf": float(everything.abs().max()) if everything.numel() else 0.0,
        "zeros": int((everything == 0).sum()),
        "per_param_l2": {
            name: math.sqrt(math.fsum(grad.double().square().reshape(-1).tolist()))
            for name, grad in grads.items()
        },
    }


def train_step(job: str) -> tuple[nn.Module, Any]:
    """Build the job's model, run one loss and backward, return it with its mesh."""
    model, mesh = build(job)
    loss_of(model).backward()
    return model, mesh


def single_process_gradients() -> dict[str, Tensor]:
    model = new_model()
    loss_of(model).backward()
    return {name: param.grad.detach().clone() for name, param in model.named_parameters()}


Job = Callable[[str], tuple[nn.Module, Any]]

"""gradstat's core on a toy model sharded over 4 gloo ranks (TP=2 x PP=2, tied embedding).

Every rank holds only its own shards, as in a Megatron job. The distributed norm and zero count
must equal the float64 statistics of the unsharded gradient; counting naively (every rank's
every tensor) inflates them with TP replicas and the tied output-layer copy.

Run: python examples/core_demo.py
"""

from __future__ import annotations

import math
import sys
import tempfile
import warnings
from pathlib import Path

# torch without numpy warns at import, here and in each spawned rank; the demo needs no numpy.
warnings.filterwarnings("ignore", message="Failed to initialize NumPy")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402
from rich.console import Console  # noqa: E402
from rich.table import Table  # noqa: E402

from gradstat import count_zeros_fp32, get_grad_norm_fp32, grads_for_norm  # noqa: E402

TP, PP = 2, 2
HIDDEN, VOCAB = 16, 64


def full_gradients() -> dict[str, torch.Tensor]:
    """The unsharded gradients of a 2-layer toy model: the ground truth."""
    gen = torch.Generator().manual_seed(0)
    grads = {"embedding.word": torch.randn(VOCAB, HIDDEN, generator=gen)}
    grads["embedding.word"][40:] = 0.0  # tokens never seen in the batch: exact zero rows
    for layer in range(PP):
        grads[f"layers.{layer}.qkv"] = torch.randn(3 * HIDDEN, HIDDEN, generator=gen)
        grads[f"layers.{layer}.proj"] = torch.randn(HIDDEN, HIDDEN, generator=gen)
        grads[f"layers.{layer}.norm"] = torch.randn(HIDDEN, generator=gen)
    return grads


def local_params(rank: int) -> list[torch.nn.Parameter]:
    """This rank's shards, with Megatron's attributes (tp rank = rank % TP, stage = rank // TP)."""
    tp_rank, stage = rank % TP, rank // TP
    full = full_gradients()

    def shard(name: str, dim: int | None, **attrs: object) -> torch.nn.Parameter:
        grad = full[name] if dim is None else full[name].chunk(TP, dim=dim)[tp_rank].clone()
        param = torch.nn.Parameter(torch.zeros_like(grad))
        param.grad = grad
        param.tensor_model_parallel = dim is not None
        for key, value in attrs.items():
            setattr(param, key, value)
        return param

    params = [
        shard(f"layers.{stage}.qkv", 0),  # column-parallel
        shard(f"layers.{stage}.proj", 1),  # row-parallel
        shard(f"layers.{stage}.norm", None),  # replicated over TP
    ]
    if stage == 0:
        params.append(shard("embedding.word", 0, shared_embedding=True))
    else:  # the output layer is a tied copy of the embedding, all-reduced to the same grad
        params.append(shard("embedding.word", 0, shared_embedding=True, shared=True))
    return params


def run_rank(rank: int, rendezvous: str, results: mp.SimpleQueue) -> None:  # type: ignore[type-arg]
    dist.init_process_group("gloo", init_method=rendezvous, rank=rank, world_size=TP * PP)
    tp_groups = [dist.new_group([s * TP + t for t in range(TP)]) for s in range(PP)]
    tp_group = tp_groups[rank // TP]
    params = local_params(rank)
    counted = grads_for_norm(params, tp_group=tp_group)
    every = [param.grad for param in params]
    # The same gradients stripped of their attributes: nothing is recognised as a duplicate.
    bare = [torch.nn.Parameter(torch.zeros_like(grad)) for grad in every]
    for param, grad in zip(bare, every, strict=True):
        param.grad = grad
    row = {
        "L2": (get_grad_norm_fp32(counted, 2), get_grad_norm_fp32(every, 2)),
        "L1": (get_grad_norm_fp32(counted, 1), get_grad_norm_fp32(every, 1)),
        "inf": (get_grad_norm_fp32(counted, math.inf), get_grad_norm_fp32(every, math.inf)),
        "zeros": (count_zeros_fp32(params, None, tp_group=tp_group), count_zeros_fp32(bare, None)),
    }
    if rank == 0:
        results.put(row)
    dist.destroy_process_group()


def float64_truth() -> dict[str, float]:
    flat = torch.cat([grad.reshape(-1).double() for grad in full_gradients().values()])
    return {
        "L2": math.sqrt(float((flat**2).sum())),
        "L1": float(flat.abs().sum()),
        "inf": float(flat.abs().max()),
        "zeros": float((flat == 0).sum()),
    }


def accuracy_row() -> tuple[float, float]:
    """Relative error of PyTorch's CPU L2 norm and of gradstat's on 5e7 fp32 elements."""
    grad = torch.randn(50_000_000, generator=torch.Generator().manual_seed(1))
    exact = math.sqrt(sum(float((b.double() ** 2).sum()) for b in grad.split(1 << 22)))
    torch_err = abs(float(torch.linalg.vector_norm(grad)) - exact) / exact
    ours_err = abs(get_grad_norm_fp32([grad]) - exact) / exact
    return torch_err, ours_err


def main() -> int:
    console = Console()
    with tempfile.TemporaryDirectory() as tmp:
        context = mp.get_context("spawn")
        results = context.SimpleQueue()
        rendezvous = f"file://{Path(tmp) / 'rendezvous'}"
        workers = [
            context.Process(target=run_rank, args=(rank, rendezvous, results))
            for rank in range(TP * PP)
        ]
        for worker in workers:
            worker.start()
        for worker in workers:
            worker.join(timeout=120)
        if any(worker.exitcode != 0 for worker in workers):
            console.print("[red]a rank failed[/red]", file=sys.stderr)
            return 1
        row = results.get()
    truth = float64_truth()
    table = Table(title=f"toy model on {TP * PP} gloo ranks (TP={TP}, PP={PP}, tied embedding)")
    for column in ("statistic", "unsharded, float64", "gradstat, 4 ranks", "naive, 4 ranks"):
        table.add_column(column, justify="right")
    for name, (ours, naive) in row.items():
        table.add_row(name, f"{truth[name]:.10g}", f"{ours:.10g}", f"{naive:.10g}")
    console.print(table)
    matches = all(
        math.isclose(row[name][0], truth[name], rel_tol=1e-6, abs_tol=0) for name in truth
    )
    console.print(f"gradstat equals the unsharded float64 statistics (rel. 1e-6): {matches}")
    torch_err, ours_err = accuracy_row()
    console.print(
        f"L2 norm of 5e7 fp32 elements, relative error vs float64: "
        f"torch.linalg.vector_norm {torch_err:.1e}, gradstat {ours_err:.1e}"
    )
    return 0 if matches else 1


if __name__ == "__main__":
    sys.exit(main())

"""Sample gradient snapshots: one real backward pass of a tiny GPT, in two Megatron layouts.

The model is a 2-layer GPT in plain torch, named like Megatron's: a vocabulary of 96 (ids 88-95
are vocabulary padding and 7, 45 are reserved: none appears in the batch and all are masked out
of the logits, so their embedding rows get exact-zero gradients), hidden size 32, attention
(column-parallel QKV, row-parallel projection, replicated layernorms), a dense MLP in layer 0 and
an MoE block in layer 1 (4 experts, top-1 router; expert 2 is masked out of the router, so no
token reaches it and its gradients are all zeros), and an output layer tied to the embedding.
One forward/backward on a fixed-seed batch, on CPU in fp32, gives the gradients; gradstat.testing
shards them and save_rank writes:

- ``tp2-pp2-dp2-ep2-distopt/``: TP=2, PP=2, DP=2, EP=2 (EDP=2), distributed-optimizer
  fragments; the embedding on stage 0 and its output-layer copy (``shared``) on stage 1.
- ``gtp2-pp2-dp2-ep2/``: the same gradients, GTP=2 and EGTP=2 with MXFP8 alignment (32), plain
  optimizer. The padding of the experts' linear_fc1 spills into EGTP rank 0's shard.
- ``tp2-pp2-dp2-ep2-distopt-nan/``: the first snapshot with a NaN in one fragment of
  ``decoder.layers.1.self_attention.linear_qkv.weight`` (rank 5) and an Inf in one of
  ``decoder.layers.1.mlp.experts.local_experts.1.linear_fc2.weight`` (rank 6).
- ``tp2-gtp2-pp2-ep2-bugs/``: the same gradients, TP=2, GTP=2, PP=2, EP=2, with three layout
  bugs planted for ``gradstat audit`` to find: the first layernorm's gradient on TP rank 1 is
  1.5x rank 0's (a replicated weight whose TP copies differ, as in Megatron-LM#1446), the tied
  output layer is not marked ``shared`` (counted twice), and one GTP padding element of the
  first QKV weight is 0.5.

Then it checks, with Snapshot.open and snapshot_stats, that both clean snapshots give the
float64 statistics of the unsharded gradients (each logical parameter once) and prints them.
Two runs write byte-identical files. Existing snapshot directories are refused unless --force.

Run: python sample_data/make_sample_data.py [--out sample_data] [--force]
"""

from __future__ import annotations

import argparse
import math
import sys
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from gradstat.analysis.audit import audit_snapshot
from gradstat.analysis.stats import snapshot_stats
from gradstat.distributed.runner import Processes
from gradstat.snapshot import Snapshot
from gradstat.testing import (
    Layout,
    ParamLayout,
    RankParams,
    Split,
    shard_gradients,
    write_snapshot,
)

VOCAB, HIDDEN, HEADS, FFN = 96, 32, 4, 80
LAYERS, MOE_LAYER, EXPERTS, EXPERT_FFN = 2, 1, 4, 16
BATCH, SEQ = 4, 16
PADDING_TOKENS = tuple(range(88, VOCAB))
RESERVED_TOKENS = (7, 45)
UNUSED_TOKENS = tuple(sorted(RESERVED_TOKENS + PADDING_TOKENS))
UNREACHED_EXPERT = 2
SEED = 20260829
STEP = 100
NORM_TYPES = (2.0, 1.0, math.inf)
REL_TOL = 1e-6  # the kernels accumulate 512-element rows in fp32 (as tests/test_snapshot.py)

EMBEDDING = "embedding.word_embeddings.weight"
OUTPUT_LAYER = "output_layer.weight"
DISTOPT = "tp2-pp2-dp2-ep2-distopt"
GTP = "gtp2-pp2-dp2-ep2"
NAN = "tp2-pp2-dp2-ep2-distopt-nan"
BUGS = "tp2-gtp2-pp2-ep2-bugs"
BUGS_LAYOUT = Layout(tp=2, gtp=2, pp=2, ep=2, gtp_align=16)
BUG_LAYERNORM = "decoder.layers.0.input_layernorm.weight"
BUG_PADDING = "decoder.layers.0.self_attention.linear_qkv.weight"
BUG_KINDS = ["tp_replicas_differ", "gtp_padding_nonzero", "tied_copy_counted_twice"]
LAYOUTS = {
    DISTOPT: Layout(tp=2, pp=2, dp=2, ep=2, distributed_optimizer=True),
    GTP: Layout(gtp=2, pp=2, dp=2, ep=2, egtp=2, gtp_align=32),
}
# (rank, parameter, value) written into the NaN snapshot's copy of the distopt layout.
CORRUPTIONS = (
    (5, "decoder.layers.1.self_attention.linear_qkv.weight", math.nan),
    (6, f"decoder.layers.{MOE_LAYER}.mlp.experts.local_experts.1.linear_fc2.weight", math.inf),
)

# TP split of each kind of weight, and which ones GTP shards (dim 0 padded to the alignment).
_SPLITS: dict[str, Split] = {
    "word_embeddings.weight": "column",
    "linear_qkv.weight": "column",
    "linear_qkv.bias": "column",
    "linear_proj.weight": "row",
    "linear_fc1.weight": "column",
    "linear_fc1.bias": "column",
    "linear_fc2.weight": "row",
}
_GTP_SHARDED = ("linear_qkv.weight", "linear_proj.weight", "linear_fc1.weight")


# ---------------------------------------------------------------------------------------------
# The model
# ---------------------------------------------------------------------------------------------


class SelfAttention(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear_qkv = nn.Linear(HIDDEN, 3 * HIDDEN)
        self.linear_proj = nn.Linear(HIDDEN, HIDDEN)

    def forward(self, x: Tensor) -> Tensor:
        batch, seq, _ = x.shape
        heads = self.linear_qkv(x).view(batch, seq, 3, HEADS, HIDDEN // HEADS)
        query, key, value = heads.permute(2, 0, 3, 1, 4).unbind(0)
        scores = query @ key.transpose(-1, -2) / math.sqrt(HIDDEN // HEADS)
        future = torch.ones(seq, seq, dtype=torch.bool).triu(1)
        context = scores.masked_fill(future, -math.inf).softmax(-1) @ value
        out: Tensor = self.linear_proj(context.transpose(1, 2).reshape(batch, seq, HIDDEN))
        return out


class MLP(nn.Module):
    def __init__(self, ffn: int, bias: bool) -> None:
        super().__init__()
        self.linear_fc1 = nn.Linear(HIDDEN, ffn, bias=bias)
        self.linear_fc2 = nn.Linear(ffn, HIDDEN, bias=bias)

    def forward(self, x: Tensor) -> Tensor:
        out: Tensor = self.linear_fc2(F.gelu(self.linear_fc1(x)))
        return out


class Experts(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.local_experts = nn.ModuleList(MLP(EXPERT_FFN, bias=False) for _ in range(EXPERTS))


class MoE(nn.Module):
    """Top-1 routing; the unreached expert is masked out of the router's choice."""

    def __init__(self) -> None:
        super().__init__()
        self.router = nn.Linear(HIDDEN, EXPERTS, bias=False)
        self.experts = Experts()
        self.tokens_per_expert = torch.zeros(EXPERTS, dtype=torch.int64)

    def forward(self, x: Tensor) -> Tensor:
        tokens = x.reshape(-1, HIDDEN)
        masked = torch.zeros(EXPERTS, dtype=torch.bool)
        masked[UNREACHED_EXPERT] = True
        probs = self.router(tokens).masked_fill(masked, -math.inf).softmax(-1)
        gate, choice = probs.max(-1)
        self.tokens_per_expert = torch.bincount(choice, minlength=EXPERTS)
        out = torch.zeros_like(tokens)
        for index, expert in enumerate(self.experts.local_experts):
            # An expert with no tokens still runs (on none): its gradients are zeros, as in
            # Megatron's zero-initialised gradient buffer.
            picked = (choice == index).nonzero().squeeze(1)
            out = out.index_add(0, picked, gate[picked, None] * expert(tokens[picked]))
        return out.view_as(x)


class TransformerLayer(nn.Module):
    def __init__(self, moe: bool) -> None:
        super().__init__()
        self.input_layernorm = nn.LayerNorm(HIDDEN)
        self.self_attention = SelfAttention()
        self.pre_mlp_layernorm = nn.LayerNorm(HIDDEN)
        self.mlp: nn.Module = MoE() if moe else MLP(FFN, bias=True)

    def forward(self, x: Tensor) -> Tensor:
        x = x + self.self_attention(self.input_layernorm(x))
        out: Tensor = x + self.mlp(self.pre_mlp_layernorm(x))
        return out


class Embedding(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.word_embeddings = nn.Embedding(VOCAB, HIDDEN)
        self.position_embeddings = nn.Embedding(SEQ, HIDDEN)


class Decoder(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(TransformerLayer(i == MOE_LAYER) for i in range(LAYERS))
        self.final_layernorm = nn.LayerNorm(HIDDEN)


class TinyGPT(nn.Module):
    """The output layer is the word embedding itself (tied): it has no parameter of its own."""

    def __init__(self) -> None:
        super().__init__()
        self.embedding = Embedding()
        self.decoder = Decoder()

    def forward(self, tokens: Tensor, targets: Tensor) -> Tensor:
        positions = torch.arange(tokens.shape[1])
        x = self.embedding.word_embeddings(tokens) + self.embedding.position_embeddings(positions)
        for layer in self.decoder.layers:
            x = layer(x)
        logits = self.decoder.final_layernorm(x) @ self.embedding.word_embeddings.weight.T
        unused = torch.zeros(VOCAB, dtype=torch.bool)
        unused[list(UNUSED_TOKENS)] = True
        logits = logits.masked_fill(unused, -math.inf)
        return F.cross_entropy(logits.reshape(-1, VOCAB), targets.reshape(-1))


@contextmanager
def _deterministic() -> Iterator[None]:
    """Seeded, deterministic, single-threaded torch; the caller's settings come back after."""
    was_deterministic = torch.are_deterministic_algorithms_enabled()
    threads = torch.get_num_threads()
    torch.use_deterministic_algorithms(True)
    # One thread: a reduction's order, and so its rounding, cannot depend on the machine's cores.
    torch.set_num_threads(1)
    try:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(SEED)
            yield
    finally:
        torch.use_deterministic_algorithms(was_deterministic)
        torch.set_num_threads(threads)


def batch(generator: torch.Generator) -> tuple[Tensor, Tensor]:
    """A fixed batch of tokens and next-token targets drawn from the used vocabulary."""
    used = torch.tensor([token for token in range(VOCAB) if token not in UNUSED_TOKENS])
    sequence = used[torch.randint(len(used), (BATCH, SEQ + 1), generator=generator)]
    return sequence[:, :-1], sequence[:, 1:]


@dataclass(frozen=True)
class Gradients:
    """The model's full fp32 gradients by parameter name, and how many tokens each expert got."""

    grads: dict[str, Tensor]
    tokens_per_expert: tuple[int, ...]


def full_gradients() -> Gradients:
    """One forward/backward of the seeded model on the seeded batch (CPU, fp32)."""
    with _deterministic():
        model = TinyGPT()
        tokens, targets = batch(torch.Generator().manual_seed(SEED))
        model(tokens, targets).backward()
    grads = {}
    for name, param in model.named_parameters():
        assert param.grad is not None, name
        grads[name] = param.grad.detach().clone()
    moe = model.decoder.layers[MOE_LAYER].mlp
    assert isinstance(moe, MoE)
    return Gradients(grads, tuple(int(count) for count in moe.tokens_per_expert))


def param_layouts(names: Sequence[str], pp: int) -> list[ParamLayout]:
    """Where Megatron puts each parameter over ``pp`` stages, and the tied output-layer copy."""
    specs = []
    for name in names:
        parts = name.split(".")
        if name.startswith("embedding."):
            stage = 0
        elif name.startswith("decoder.layers."):
            stage = int(parts[2]) * pp // LAYERS
        else:
            stage = pp - 1
        expert = int(parts[parts.index("local_experts") + 1]) if "local_experts" in parts else None
        kind = ".".join(parts[-2:])
        specs.append(
            ParamLayout(
                name,
                split=_SPLITS.get(kind, "none"),
                stage=stage,
                expert=expert,
                num_experts=EXPERTS if expert is not None else 0,
                gtp=kind in _GTP_SHARDED,
            )
        )
    specs.append(ParamLayout(OUTPUT_LAYER, "column", stage=pp - 1, tied_copy_of=EMBEDDING))
    return specs


def corrupt(ranks: Sequence[RankParams]) -> None:
    """Write CORRUPTIONS into the middle element of each named fragment (in place)."""
    for rank, name, value in CORRUPTIONS:
        held = dict(ranks[rank].params)
        if name not in held or held[name].grad is None:
            raise RuntimeError(f"rank {rank} holds no gradient of {name!r} to corrupt")
        grad = held[name].grad
        assert grad is not None
        grad.view(-1)[grad.numel() // 2] = value


def plant_bugs(ranks: Sequence[RankParams]) -> None:
    """The three bugs of the BUGS snapshot (in place)."""
    planted = 0
    for share in ranks:
        for name, param in share.params:
            assert param.grad is not None
            if name == BUG_LAYERNORM and share.coords["tp"][0] == 1:
                param.grad.mul_(1.5)
            if name == OUTPUT_LAYER:
                param.shared = False  # type: ignore[attr-defined]
            last_gtp = share.coords["gtp"][0] == share.coords["gtp"][1] - 1
            if name == BUG_PADDING and last_gtp and share.coords["tp"][0] == 0:
                if not getattr(param, "pad_length", 0):
                    raise RuntimeError(f"{name!r} has no GTP padding to plant a value in")
                param.grad[-1, 0] = 0.5  # the last row of the last GTP shard is padding
                planted += 1
    if planted != 1:
        raise RuntimeError(f"planted the padding value {planted} times, expected once")


# ---------------------------------------------------------------------------------------------
# Statistics and checks
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Figures:
    norms: dict[float, float]
    zeros: int
    numel: int
    pad_zeros: int = 0


def float64_figures(grads: Sequence[Tensor]) -> Figures:
    """Norms and zero count of the concatenated gradients, in float64: the expected values."""
    flat = torch.cat([grad.reshape(-1).to(torch.float64) for grad in grads])
    norms = {
        p: float(flat.abs().max()) if p == math.inf else float(flat.abs().pow(p).sum()) ** (1 / p)
        for p in NORM_TYPES
    }
    return Figures(norms, int((flat == 0).sum()), flat.numel())


def snapshot_figures(directory: Path) -> tuple[Figures, dict[str, float]]:
    """The snapshot's statistics, and each parameter's L2 norm."""
    snapshot = Snapshot.open(directory)
    if snapshot.step != STEP:
        raise RuntimeError(f"{directory}: step {snapshot.step}, expected {STEP}")
    stats = snapshot_stats(snapshot, NORM_TYPES)
    figures = Figures(
        {p: stats.norm(p) for p in NORM_TYPES}, stats.zeros, stats.numel, stats.pad_zeros
    )
    return figures, {param.name: param.norm(2) for param in stats.params}


def check_gradients(gradients: Gradients) -> list[str]:
    """What the sample promises about its gradients; returns the broken promises."""
    grads, problems = gradients.grads, []
    counts = gradients.tokens_per_expert
    if (
        counts[UNREACHED_EXPERT] != 0
        or min(c for i, c in enumerate(counts) if i != UNREACHED_EXPERT) == 0
    ):
        problems.append(f"tokens per expert {counts}: only expert {UNREACHED_EXPERT} must get none")
    for name, grad in grads.items():
        unreached = f"local_experts.{UNREACHED_EXPERT}." in name
        if unreached and grad.count_nonzero():
            problems.append(f"{name}: the unreached expert has non-zero gradients")
        if not unreached and not grad.count_nonzero():
            problems.append(f"{name}: all-zero gradient")
    rows = grads[EMBEDDING].count_nonzero(dim=1)
    zero_rows = tuple(int(row) for row in (rows == 0).nonzero().squeeze(1))
    if zero_rows != UNUSED_TOKENS:
        problems.append(f"embedding rows with zero gradient {zero_rows}, expected {UNUSED_TOKENS}")
    return problems


def compare(label: str, got: Figures, expected: Figures) -> list[str]:
    problems = []
    for p in NORM_TYPES:
        value, want = got.norms[p], expected.norms[p]
        close = value == want if p == math.inf else math.isclose(value, want, rel_tol=REL_TOL)
        if not close:
            problems.append(f"{label}: norm {p} is {value!r}, float64 says {want!r}")
    for field, value, want in (
        ("zeros", got.zeros, expected.zeros),
        ("numel", got.numel, expected.numel),
    ):
        if value != want:
            problems.append(f"{label}: {field} is {value}, float64 says {want}")
    return problems


def _row(label: str, figures: Figures, expected: Figures | None) -> str:
    cells = [f"{label:<30}"]
    for p in NORM_TYPES:
        cells.append(f"{figures.norms[p]:>22.17g}")
    cells.append(f"{figures.zeros:>6} {figures.numel:>6} {figures.pad_zeros:>9}")
    if expected is not None:
        errors = [
            abs(figures.norms[p] - expected.norms[p]) / expected.norms[p]
            for p in NORM_TYPES
            if p != math.inf
        ]
        cells.append(f"{max(errors):>9.2e}")
    return " ".join(cells)


# ---------------------------------------------------------------------------------------------
# Command line
# ---------------------------------------------------------------------------------------------


def _prepare(directories: Sequence[Path], force: bool) -> list[str]:
    """Refuse non-empty output directories unless ``force``; with it, remove old rank files."""
    files = [d for d in directories if d.exists() and not d.is_dir()]
    if files:
        return [f"{path} exists and is not a directory" for path in files]
    occupied = [d for d in directories if d.exists() and any(d.iterdir())]
    if occupied and not force:
        return [f"{d} is not empty; pass --force to replace its rank files" for d in occupied]
    for directory in occupied:
        for path in directory.glob("rank-*.safetensors"):
            path.unlink()
    return []


def generate(out: Path, force: bool = False) -> int:
    """Write the four snapshots under ``out``, check them, print the figures; the exit code."""
    directories = {name: out / name for name in (DISTOPT, GTP, NAN, BUGS)}
    refusals = _prepare(list(directories.values()), force)
    if refusals:
        print("\n".join(f"error: {message}" for message in refusals), file=sys.stderr)
        return 2
    gradients = full_gradients()
    print(f"tokens per expert: {list(gradients.tokens_per_expert)}", file=sys.stderr)
    problems = check_gradients(gradients)
    if problems:
        print("\n".join(f"error: {problem}" for problem in problems), file=sys.stderr)
        return 1
    names = list(gradients.grads)
    for name, layout in LAYOUTS.items():
        ranks = shard_gradients(layout, param_layouts(names, layout.pp), gradients.grads)
        write_snapshot(directories[name], layout, ranks, step=STEP)
        if name == DISTOPT:
            corrupt(ranks)
            write_snapshot(directories[NAN], layout, ranks, step=STEP)
    ranks = shard_gradients(BUGS_LAYOUT, param_layouts(names, BUGS_LAYOUT.pp), gradients.grads)
    plant_bugs(ranks)
    write_snapshot(directories[BUGS], BUGS_LAYOUT, ranks, step=STEP)
    expected = float64_figures(list(gradients.grads.values()))
    header = ["snapshot".ljust(30), *(f"{'L' + format(p, 'g'):>22}" for p in NORM_TYPES)]
    print(" ".join([*header, " zeros  numel pad_zeros   max rel err"]))
    print(_row("unsharded (float64)", expected, None))
    for name in (DISTOPT, GTP):
        figures, _ = snapshot_figures(directories[name])
        print(_row(name, figures, expected))
        problems += compare(name, figures, expected)
        if name == GTP and figures.pad_zeros == 0:
            problems.append(f"{name}: no GTP padding in the snapshot")
    figures, per_param = snapshot_figures(directories[NAN])
    print(_row(NAN, figures, None))
    broken = {name for name, norm in per_param.items() if not math.isfinite(norm)}
    if not math.isnan(figures.norms[2.0]) or broken != {name for _, name, _ in CORRUPTIONS}:
        problems.append(f"{NAN}: L2 {figures.norms[2.0]}, non-finite parameters {sorted(broken)}")
    figures, _ = snapshot_figures(directories[BUGS])
    print(_row(BUGS, figures, None))
    report = audit_snapshot(Snapshot.open(directories[BUGS]), Processes(0, 1))
    kinds = [finding.kind for finding in report.findings]
    # The planted bugs, and the expert no token reaches (in every sample snapshot).
    expected = [*BUG_KINDS, "expert_never_routed"]
    if sorted(kinds) != sorted(expected):
        problems.append(f"{BUGS}: gradstat audit found {kinds}, expected {expected}")
    for problem in problems:
        print(f"error: {problem}", file=sys.stderr)
    return 1 if problems else 0


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, default=Path(__file__).resolve().parent)
    parser.add_argument("--force", action="store_true", help="replace existing rank files")
    args = parser.parse_args(argv)
    return generate(args.out, args.force)


if __name__ == "__main__":
    sys.exit(main())

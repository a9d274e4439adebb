"""Speed and accuracy of gradstat's core reductions against PyTorch, measured in one run.

Builds a seeded, model-like set of gradients (about ``--gib`` GiB of fp32: many ~1M-element
matrices, a few very large embedding/expert blocks, biases and norms, some tensors mostly zero
rows) plus the same set in bf16, then times gradstat and its peer alternately, repeat by repeat:

- L2 and inf norm: ``get_grad_norm_fp32`` vs ``torch.nn.utils.get_total_norm``;
- zero count: ``count_zeros_fp32`` vs ``numel - torch.count_nonzero`` per tensor;
- bf16 L2 norm: the same pair on the bf16 copy;
- L1 norm, and L2 of many small tensors (20,000 of 512 elements) and of a few big ones
  (4 of 16M), each also with the native kernel off (the library's CPU path before it summed
  fp32 in the kernel's float64 lanes: fp32 norms of 512-element rows);
- on CUDA also: L2 through ``gradstat.GradNorm`` (prepared once, as a training loop calls it),
  L2 with CUDA graphs off, and L2 of the same bytes as one tensor (the kernels' ceiling).

Each row reports the median over repeats of the per-repeat time ratio ours/peer, the ratio of
the fastest times, and both results' relative error against a float64 oracle computed block by
block (never by a PyTorch norm kernel). Absolute times are only in the JSON, next to the peer's.

``--accuracy`` prints instead the relative error against float64 of L1 and L2 for single
tensors of 1 to 1e7 elements (randn and uniform positive, the worst of several seeds): gradstat
with the native kernel, without it, and ``get_total_norm``.

Usage::

    python benchmarks/bench_core.py [--gib 1.0] [--repeats 7] [--device cpu|cuda] [--json]
                                    [--threads N] [--bandwidth-gbs 4800] [--accuracy]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict, dataclass

import torch
from torch import Tensor

import gradstat
from gradstat.core import native

_ORACLE_BLOCK = 1 << 22
_SEED = 1234
_MEDIUM_SHAPES = (
    (1024, 1024),
    (4096, 256),
    (768, 1536),
    (1536, 768),
    (2048, 512),
    (512, 2048),
    (1024, 1152),
    (3072, 384),
)
_SMALL_SIZES = (1024, 1536, 2048, 3072, 4096, 8192)


_START = time.perf_counter()


def _log(message: str) -> None:
    print(f"[{time.perf_counter() - _START:6.1f}s] {message}", file=sys.stderr, flush=True)


@dataclass(frozen=True)
class GradSpec:
    """One gradient of the synthetic model: its shape, scale and fraction of zero rows."""

    shape: tuple[int, ...]
    scale: float
    zero_row_fraction: float = 0.0


def model_specs(gib: float, rng: torch.Generator) -> list[GradSpec]:
    """A model-like mix of gradient shapes summing to about ``gib`` GiB of fp32.

    About 40% of the elements sit in three very large tensors (a vocabulary embedding with most
    rows unseen, an output layer, an expert block mostly unreached), the rest in ~1M-element
    matrices of varied shapes, each followed by a bias or norm vector; every seventh matrix has
    50-90% zero rows.
    """
    budget = int(gib * (1 << 30)) // 4

    def uniform(low: float, high: float) -> float:
        return low + (high - low) * float(torch.rand((), generator=rng))

    def scale() -> float:
        return math.pow(10.0, uniform(-5.0, -2.0))

    big_rows = max(1, int(0.135 * budget) // 1024)
    specs = [
        GradSpec((big_rows, 1024), scale(), zero_row_fraction=0.8),
        GradSpec((int(1.2 * big_rows), 1024 - 256), scale()),
        GradSpec((max(1, big_rows // 2), 2048), scale(), zero_row_fraction=0.9),
    ]
    used = sum(math.prod(spec.shape) for spec in specs)
    index = 0
    while used < budget:
        rows, cols = _MEDIUM_SHAPES[index % len(_MEDIUM_SHAPES)]
        zero_rows = uniform(0.5, 0.9) if index % 7 == 3 else 0.0
        specs.append(GradSpec((rows, cols), scale(), zero_row_fraction=zero_rows))
        small = _SMALL_SIZES[index % len(_SMALL_SIZES)]
        specs.append(GradSpec((small,), scale()))
        used += rows * cols + small
        index += 1
    return specs


def build_grads(specs: Sequence[GradSpec], rng: torch.Generator) -> list[Tensor]:
    """fp32 CPU gradients for ``specs``: Gaussian values, whole rows zeroed where asked."""
    grads = []
    for spec in specs:
        grad = torch.randn(spec.shape, generator=rng).mul_(spec.scale)
        if spec.zero_row_fraction:
            rows = grad.shape[0]
            zero_rows = torch.randperm(rows, generator=rng)[: int(spec.zero_row_fraction * rows)]
            grad[zero_rows] = 0.0
        grads.append(grad)
    return grads


def _oracle_blocks(grads: Iterable[Tensor]) -> Iterable[Tensor]:
    for grad in grads:
        flat = grad.reshape(-1)
        for start in range(0, flat.numel(), _ORACLE_BLOCK):
            yield flat[start : start + _ORACLE_BLOCK].to(torch.float64)


def oracle_l2(grads: Sequence[Tensor]) -> float:
    """The L2 norm with every square and sum in float64, a few M elements at a time."""
    return math.sqrt(sum(float(block.square().sum()) for block in _oracle_blocks(grads)))


def oracle_inf(grads: Sequence[Tensor]) -> float:
    """max |x|: exact in any precision, taken on float64 blocks for uniformity."""
    return max(float(block.abs().max()) for block in _oracle_blocks(grads) if block.numel())


def oracle_zeros(grads: Sequence[Tensor]) -> int:
    """Elements equal to zero, by comparison rather than by count_nonzero."""
    return sum(int((grad == 0).sum()) for grad in grads)


@dataclass(frozen=True)
class Row:
    """One measure: ours against the peer, timed in the same run."""

    measure: str
    peer: str
    median_ratio: float
    min_ratio: float
    target: float
    ours_rel_error: float
    peer_rel_error: float
    ours_min_s: float
    peer_min_s: float
    ours_gbs: float
    peer_gbs: float
    bytes_read: int

    @property
    def meets_target(self) -> bool:
        return self.median_ratio <= self.target


@dataclass(frozen=True)
class Case:
    """A measure to time: our callable and the peer's, both returning a Python float."""

    measure: str
    peer_name: str
    ours: Callable[[], float]
    peer: Callable[[], float]
    oracle: float
    target: float
    bytes_read: int


def _timer(device: torch.device) -> Callable[[Callable[[], float]], tuple[float, float]]:
    cuda = device.type == "cuda"

    def timed(fn: Callable[[], float]) -> tuple[float, float]:
        if cuda:
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        value = fn()
        if cuda:
            torch.cuda.synchronize(device)
        return time.perf_counter() - start, value

    return timed


def _rel_error(value: float, expected: float) -> float:
    if expected == 0:
        return abs(value)
    return abs(value - expected) / abs(expected)


def measure(cases: Sequence[Case], repeats: int, device: torch.device) -> list[Row]:
    """Time every case ``repeats`` times, ours and peer interleaved within each repeat.

    Repeats are interleaved across cases too, so a burst of noise on a shared machine hits all
    measures of one repeat rather than every repeat of one measure.
    """
    timed = _timer(device)
    values: dict[str, tuple[float, float]] = {}
    for case in cases:
        ours_value, peer_value = case.ours(), case.peer()  # warm-up, and the values to check
        values[case.measure] = (ours_value, peer_value)
    ratios: dict[str, list[float]] = {case.measure: [] for case in cases}
    fastest: dict[str, list[float]] = {case.measure: [math.inf, math.inf] for case in cases}
    for repeat in range(repeats):
        _log(f"repeat {repeat + 1}/{repeats}")
        for case in cases:
            # ABBA (then BAAB): a slow drift in machine load cancels out of each repeat's ratio.
            order = (0, 1, 1, 0) if repeat % 2 == 0 else (1, 0, 0, 1)
            spent = [0.0, 0.0]
            best = fastest[case.measure]
            for who in order:
                seconds = timed(case.peer if who else case.ours)[0]
                spent[who] += seconds
                best[who] = min(best[who], seconds)
            ratios[case.measure].append(spent[0] / spent[1])
    rows = []
    for case in cases:
        ours_value, peer_value = values[case.measure]
        ours_min, peer_min = fastest[case.measure]
        rows.append(
            Row(
                measure=case.measure,
                peer=case.peer_name,
                median_ratio=statistics.median(ratios[case.measure]),
                min_ratio=ours_min / peer_min,
                target=case.target,
                ours_rel_error=_rel_error(ours_value, case.oracle),
                peer_rel_error=_rel_error(peer_value, case.oracle),
                ours_min_s=ours_min,
                peer_min_s=peer_min,
                ours_gbs=case.bytes_read / ours_min / 1e9,
                peer_gbs=case.bytes_read / peer_min / 1e9,
                bytes_read=case.bytes_read,
            )
        )
    return rows


def make_cases(
    grads: list[Tensor],
    bf16_grads: list[Tensor],
    params: Sequence[Tensor],
    cpu_grads: list[Tensor],
) -> list[Case]:
    """The four measures, with oracles computed from the CPU fp32 values (bf16: its own)."""
    get_total_norm = torch.nn.utils.get_total_norm
    fp32_bytes = sum(grad.numel() * grad.element_size() for grad in grads)
    bf16_bytes = sum(grad.numel() * grad.element_size() for grad in bf16_grads)
    _log("float64 oracles")
    bf16_cpu = [grad.to("cpu") for grad in bf16_grads]
    expected_zeros = oracle_zeros(cpu_grads)

    def ours_zeros() -> float:
        return gradstat.count_zeros_fp32(params, None)

    def peer_zeros() -> float:
        return float(sum(grad.numel() - int(torch.count_nonzero(grad)) for grad in grads))

    ours_count, peer_count = ours_zeros(), peer_zeros()
    if not ours_count == peer_count == expected_zeros:
        raise SystemExit(
            f"bench_core: zero counts differ: gradstat {ours_count}, torch {peer_count}, "
            f"oracle {expected_zeros}"
        )
    cases = [
        Case(
            "L2 fp32",
            "get_total_norm(2.0)",
            lambda: gradstat.get_grad_norm_fp32(grads, 2),
            lambda: float(get_total_norm(grads, 2.0)),
            oracle_l2(cpu_grads),
            1.0,
            fp32_bytes,
        ),
        Case(
            "inf fp32",
            "get_total_norm(inf)",
            lambda: gradstat.get_grad_norm_fp32(grads, math.inf),
            lambda: float(get_total_norm(grads, math.inf)),
            oracle_inf(cpu_grads),
            0.3,
            fp32_bytes,
        ),
        Case(
            "zero count fp32",
            "numel - count_nonzero",
            ours_zeros,
            peer_zeros,
            float(expected_zeros),
            1.0,
            fp32_bytes,
        ),
        Case(
            "L2 bf16",
            "get_total_norm(2.0)",
            lambda: gradstat.get_grad_norm_fp32(bf16_grads, 2),
            lambda: float(get_total_norm(bf16_grads, 2.0)),
            oracle_l2(bf16_cpu),
            0.6,  # bf16 has half fp32's bytes to read (issue 30, item 5)
            bf16_bytes,
        ),
    ]
    if grads[0].is_cuda:
        cases += _cuda_cases(grads, oracle_l2(cpu_grads), fp32_bytes)
    else:
        cases += _cpu_cases(grads)
    return cases


def kernel_off(function: Callable[[], float]) -> Callable[[], float]:
    """``function`` with the native kernel off, as ``GRADSTAT_NATIVE=0`` turns it off."""

    def call() -> float:
        saved = native._entry_point
        native._entry_point = lambda name: None  # type: ignore[assignment]
        try:
            return function()
        finally:
            native._entry_point = saved

    return call


def _cpu_cases(grads: list[Tensor]) -> list[Case]:
    """L1; L2 of many small tensors and of a few big ones; each with the kernel off too."""
    get_total_norm = torch.nn.utils.get_total_norm
    rng = torch.Generator().manual_seed(_SEED + 1)
    small = [torch.randn(512, generator=rng) for _ in range(20_000)]
    big = [torch.randn(1 << 24, generator=rng) for _ in range(4)]
    cases = []
    for label, tensors, p, oracle in (
        ("L1 fp32", grads, 1.0, oracle_l1(grads)),
        ("L2 fp32, 20000 x 512", small, 2.0, oracle_l2(small)),
        ("L2 fp32, 4 x 16M", big, 2.0, oracle_l2(big)),
    ):
        size = sum(tensor.numel() * tensor.element_size() for tensor in tensors)

        def ours(tensors: list[Tensor] = tensors, p: float = p) -> float:
            return gradstat.get_grad_norm_fp32(tensors, p)

        def peer(tensors: list[Tensor] = tensors, p: float = p) -> float:
            return float(get_total_norm(tensors, p))

        cases += [
            Case(label, f"get_total_norm({p})", ours, peer, oracle, 1.0, size),
            Case(
                f"{label}, kernel off",
                f"get_total_norm({p})",
                kernel_off(ours),
                peer,
                oracle,
                1.0,
                size,
            ),
        ]
    return cases


def oracle_l1(grads: Sequence[Tensor]) -> float:
    """The L1 norm with every |x| and sum in float64."""
    return sum(float(block.abs().sum()) for block in _oracle_blocks(grads))


_ACCURACY_SIZES = (1, 10, 100, 512, 1000, 4096, 10_000, 65_536, 65_537, 100_000, 10**6, 10**7)


def accuracy_table() -> str:
    """Relative errors against float64 of single tensors' L1 and L2, the worst of 5 seeds (2
    for 1e6 elements and more): gradstat with the kernel, without, and get_total_norm."""
    get_total_norm = torch.nn.utils.get_total_norm
    paths: dict[str, Callable[[Tensor, float], float]] = {
        "gradstat": lambda tensor, p: gradstat.get_grad_norm_fp32([tensor], p),
        "gradstat, kernel off": lambda tensor, p: kernel_off(
            lambda: gradstat.get_grad_norm_fp32([tensor], p)
        )(),
        "get_total_norm": lambda tensor, p: float(get_total_norm([tensor], p)),
    }
    lines = [
        "| elements | values | " + " | ".join(f"{name} L1 | {name} L2" for name in paths) + " |",
        "|---:|---|" + "---:|" * (2 * len(paths)),
    ]
    worst_of: dict[str, float] = dict.fromkeys(paths, 0.0)
    for size in _ACCURACY_SIZES:
        for kind in ("randn", "uniform"):
            errors = {(name, p): 0.0 for name in paths for p in (1.0, 2.0)}
            for seed in range(2 if size >= 10**6 else 5):
                rng = torch.Generator().manual_seed(seed)
                if kind == "randn":
                    tensor = torch.randn(size, generator=rng)
                else:
                    tensor = torch.rand(size, generator=rng)
                wide = tensor.double()
                for p in (1.0, 2.0):
                    expected = float(wide.abs().pow(p).sum()) ** (1 / p)
                    for name, path in paths.items():
                        error = _rel_error(path(tensor, p), expected)
                        errors[name, p] = max(errors[name, p], error)
                        worst_of[name] = max(worst_of[name], error)
            cells = " | ".join(f"{errors[name, p]:.1e}" for name in paths for p in (1.0, 2.0))
            lines.append(f"| {size} | {kind} | {cells} |")
        _log(f"accuracy: {size} elements")
    worst = ", ".join(f"{name} {error:.1e}" for name, error in worst_of.items())
    return "\n".join([*lines, "", f"worst: {worst}"])


def _cuda_cases(grads: list[Tensor], l2: float, fp32_bytes: int) -> list[Case]:
    """The training loop's way (GradNorm, prepared once), what the graph replay is worth (the
    same call with graphs off), and the ceiling: the same bytes as one tensor, where the host's
    per-tensor cost is gone."""
    get_total_norm = torch.nn.utils.get_total_norm

    def eager() -> float:
        os.environ["GRADSTAT_CUDA_GRAPHS"] = "0"
        try:
            return gradstat.get_grad_norm_fp32(grads, 2)
        finally:
            del os.environ["GRADSTAT_CUDA_GRAPHS"]

    flat = torch.cat([grad.reshape(-1) for grad in grads])
    prepared = gradstat.GradNorm(grads, 2)
    return [
        Case(
            "L2 fp32, GradNorm prepared once",
            "get_total_norm(2.0)",
            prepared,
            lambda: float(get_total_norm(grads, 2.0)),
            l2,
            1.0,
            fp32_bytes,
        ),
        Case(
            "L2 fp32, CUDA graphs off",
            "get_total_norm(2.0)",
            eager,
            lambda: float(get_total_norm(grads, 2.0)),
            l2,
            1.0,
            fp32_bytes,
        ),
        Case(
            "L2 fp32, one flat tensor",
            "vector_norm",
            lambda: gradstat.get_grad_norm_fp32([flat], 2),
            lambda: float(torch.linalg.vector_norm(flat, 2)),
            l2,
            1.0,
            fp32_bytes,
        ),
    ]


def render_table(meta: dict[str, object], rows: Sequence[Row], bandwidth_gbs: float | None) -> str:
    lines = [
        f"torch {meta['torch']}, {meta['threads']} threads, device {meta['device']}, "
        f"{meta['gib']:.3f} GiB fp32 in {meta['tensors']} tensors "
        f"({meta['zero_fraction']:.1%} zeros), {meta['repeats']} repeats",
        "",
        "| measure | peer | ours/peer time (median ratio) | ours/peer (min times) | target "
        "| ours rel. error | peer rel. error |",
        "|---|---|---:|---:|---:|---:|---:|",
    ]
    for row in rows:
        verdict = "" if row.meets_target else " (missed)"
        lines.append(
            f"| {row.measure} | {row.peer} | {row.median_ratio:.2f}x{verdict} | "
            f"{row.min_ratio:.2f}x | <= {row.target:.1f}x | {row.ours_rel_error:.1e} | "
            f"{row.peer_rel_error:.1e} |"
        )
    if meta["device_type"] == "cuda":
        peak = f"{bandwidth_gbs:.0f} GB/s" if bandwidth_gbs else "not given (--bandwidth-gbs)"
        lines += ["", f"Achieved bandwidth (min times), device peak {peak}:", ""]
        lines += ["| measure | ours GB/s | peer GB/s | ours / device bandwidth |"]
        lines.append("|---|---:|---:|---:|")
        for row in rows:
            share = f"{row.ours_gbs / bandwidth_gbs:.1%}" if bandwidth_gbs else "n/a"
            lines.append(f"| {row.measure} | {row.ours_gbs:.0f} | {row.peer_gbs:.0f} | {share} |")
    return "\n".join(lines)


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--gib", type=float, default=1.0, help="GiB of fp32 gradients")
    parser.add_argument("--repeats", type=int, default=7, help="timed repeats per measure")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument(
        "--threads", type=int, default=None, help="torch intra-op threads (default: torch's)"
    )
    parser.add_argument(
        "--bandwidth-gbs",
        type=float,
        default=None,
        help="device memory bandwidth in GB/s (H200: ~4800), to report ours as a share of it",
    )
    parser.add_argument("--json", action="store_true", help="one JSON document instead of tables")
    parser.add_argument(
        "--accuracy", action="store_true", help="the error table over tensor sizes, no timing"
    )
    args = parser.parse_args(argv)
    if args.gib <= 0 or args.repeats < 1 or (args.threads is not None and args.threads < 1):
        parser.error("--gib must be > 0, --repeats and --threads >= 1")
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: no CUDA device is available to this torch build")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    if args.accuracy:
        print(accuracy_table())
        return 0
    on_gpu = args.device == "cuda"
    device = torch.device("cuda", torch.cuda.current_device()) if on_gpu else torch.device("cpu")
    rng = torch.Generator().manual_seed(_SEED)
    _log(f"building {args.gib} GiB of gradients")
    specs = model_specs(args.gib, rng)
    cpu_grads = build_grads(specs, rng)
    # Built on the CPU whatever the device, so that every device sees the same values.
    grads = [grad.to(device) for grad in cpu_grads] if on_gpu else cpu_grads
    bf16_grads = [grad.to(torch.bfloat16) for grad in grads]
    params = []
    for grad in grads:
        # A zero-stride stand-in for the weight: .grad only has to match shape, dtype, device.
        param = torch.nn.Parameter(torch.zeros((), device=device).expand(grad.shape))
        param.grad = grad
        params.append(param)
    cases = make_cases(grads, bf16_grads, params, cpu_grads)
    numel = sum(grad.numel() for grad in cpu_grads)
    _log("timing")
    rows = measure(cases, args.repeats, device)
    zeros = next(case.oracle for case in cases if case.measure.startswith("zero"))
    meta: dict[str, object] = {
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "device": torch.cuda.get_device_name(device) if on_gpu else "cpu",
        "device_type": device.type,
        "gib": numel * 4 / (1 << 30),
        "tensors": len(grads),
        "elements": numel,
        "zero_fraction": zeros / numel,
        "repeats": args.repeats,
        "bandwidth_gbs": args.bandwidth_gbs,
    }
    if args.json:
        doc = {
            "meta": meta,
            "rows": [{**asdict(row), "meets_target": row.meets_target} for row in rows],
        }
        print(json.dumps(doc, indent=2))
    else:
        print(render_table(meta, rows, args.bandwidth_gbs))
    return 0


if __name__ == "__main__":
    sys.exit(main())

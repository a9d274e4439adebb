"""Reading a snapshot: gradstat's norm + zero count against the cheapest pass over the files.

Writes (once) a seeded fp32 snapshot of ``--ranks`` rank files totalling ``--gib`` GiB, every
tensor TP-sharded so that every byte counts, then times, alternately and each as a whole fresh
process, from launch to exit, as a user waits for it (peak RSS from ``wait4``):

- peer: a Python process that opens each file with ``safetensors.safe_open`` and sums each
  tensor once;
- ours: ``python -m gradstat norm DIR`` (L2 norm and zero count, the table printed); with
  ``--command zeros`` or ``audit``, that command; with ``--command compare``, ``gradstat
  compare DIR DIR`` (two reductions and every tensor rebuilt twice).

Prints the median of per-repeat time ratios ours/peer, the ratio of the fastest times, and each
side's peak RSS against the snapshot's size.

``--device cuda`` (issue 30 item 4: the command line on a GPU) times four sides instead, each
also on a one-tensor snapshot, so that the time beyond each process's start (Python, torch,
the CUDA context) gives its throughput in GB/s of the snapshot's bytes:

- ours: ``python -m gradstat norm --device cuda DIR`` (copies through pinned staging buffers,
  see ``gradstat.core.staging``);
- pageable: the same with ``GRADSTAT_PINNED=0`` (each tensor copied with a plain ``.to``);
- cpu: the same command on the CPU (``python -m gradstat norm DIR``);
- peer: a Python process that opens each file with ``safe_open``, copies each tensor to the GPU
  with ``.cuda()`` and sums it there, and reads the total once;

and, once, the host-to-device link: a 1 GiB copy from pinned memory, the fastest of five, which
each side's GB/s is also given as a fraction of. The files stay in the page cache between runs
(a warm-up pass of each side runs first), so this measures reading, not the disk. Both sides
may cache bytecode (``PYTHONDONTWRITEBYTECODE`` is dropped from their environment), as an
installed package has its ``.pyc`` files.

Usage::

    python benchmarks/bench_snapshot.py [--gib 4] [--ranks 8] [--repeats 5] [--dir PATH]
        [--command norm|audit|compare] [--device cpu|cuda]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

SIDES = ("peer", "peer-cuda", "link")
ENV = {name: value for name, value in os.environ.items() if name != "PYTHONDONTWRITEBYTECODE"}
_SHAPES = ((4096, 1024), (1024, 1024), (2048, 768), (512, 4096), (8192, 512))


def write_snapshot(directory: Path, gib: float, ranks: int) -> None:
    """``ranks`` rank files of ~gib/ranks GiB each: 2-D fp32 shards, a third of them sparse."""
    from gradstat.snapshot import save_rank

    per_rank = int(gib * (1 << 30) / 4 / ranks)
    gen = torch.Generator().manual_seed(0)
    for rank in range(ranks):
        params, total, index = [], 0, 0
        while total < per_rank:
            shape = _SHAPES[index % len(_SHAPES)]
            grad = torch.randn(shape, generator=gen)
            if index % 3 == 0:
                grad[: shape[0] // 2] = 0.0
            param = torch.nn.Parameter(torch.empty(0))
            param.grad = None
            holder = type("Shard", (), {})()
            holder.grad, holder.shape = grad, grad.shape
            holder.tensor_model_parallel, holder.partition_dim = True, 0
            params.append((f"layers.{index}.weight", holder))
            total += grad.numel()
            index += 1
        save_rank(directory, params, rank=rank, world_size=ranks, coords={"tp": [rank, ranks]})
        del params


def measure(directory: Path) -> dict[str, float]:
    """The peer's pass in this process: open each file with safe_open, sum each tensor once."""
    from safetensors import safe_open

    start = time.perf_counter()
    total = 0.0
    for path in sorted(directory.glob("*.safetensors")):
        with safe_open(str(path), framework="pt") as file:
            for key in file.keys():  # noqa: SIM118 (safe_open is not iterable)
                total += float(file.get_tensor(key).sum())
    seconds = time.perf_counter() - start
    return {"seconds": seconds, "peak_rss": _peak_rss(), "result": total}


def measure_cuda(directory: Path) -> dict[str, float]:
    """The bare GPU pass: each tensor read with safe_open, copied with ``.cuda()``, summed on the
    GPU into one float64 total, read once at the end."""
    from safetensors import safe_open

    total = torch.zeros((), dtype=torch.float64, device="cuda")
    for path in sorted(directory.glob("*.safetensors")):
        with safe_open(str(path), framework="pt") as file:
            for key in file.keys():  # noqa: SIM118 (safe_open is not iterable)
                total += file.get_tensor(key).cuda().sum(dtype=torch.float64)
    return {"result": float(total)}


def measure_link() -> dict[str, float]:
    """The host-to-device link: GB/s of a 1 GiB copy from pinned memory, the fastest of five."""
    host = torch.ones(1 << 28, dtype=torch.float32).pin_memory()
    device = torch.empty_like(host, device="cuda")
    best = math.inf
    for _ in range(6):  # the first warms the copy engine up
        torch.cuda.synchronize()
        start = time.perf_counter()
        device.copy_(host, non_blocking=True)
        torch.cuda.synchronize()
        best = min(best, time.perf_counter() - start)
    return {"gbs": host.numel() * host.element_size() / best / 1e9}


def _peak_rss() -> float:
    """This process's peak resident set in bytes: VmHWM, which (unlike ru_maxrss) starts anew
    at exec instead of inheriting the parent's peak."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return float(line.split()[1]) * 1024
    return float(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024)


def _run(side: str, directory: Path) -> dict[str, float]:
    """One fresh process, timed from launch to exit as a user waits for it: the peer's pass,
    or the gradstat command itself (``python -m gradstat norm DIR``, ...); ``cuda``: that
    command with ``--device cuda``, ``pageable``: the same without pinned staging buffers,
    ``cpu``: without ``--device``."""
    env = ENV
    if side in SIDES:
        command = [sys.executable, __file__, "--measure", side, "--dir", str(directory)]
    elif side in ("cuda", "pageable", "cpu"):
        device = "cpu" if side == "cpu" else "cuda"
        command = [sys.executable, "-m", "gradstat", "norm", str(directory), "--device", device]
        if side == "pageable":
            env = {**ENV, "GRADSTAT_PINNED": "0"}
    else:
        command = [sys.executable, "-m", "gradstat", "norm" if side == "ours" else side]
        command.append(str(directory))
        if side == "compare":
            command.append(str(directory))
    # stderr to a file: a pipe nobody reads while the process runs would stop it once full.
    with tempfile.TemporaryFile() as errors:
        start = time.perf_counter()
        process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=errors, env=env)
        _, status, usage = os.wait4(process.pid, 0)
        seconds = time.perf_counter() - start
        process.returncode = os.waitstatus_to_exitcode(status)
        if process.returncode not in (0, 1):
            errors.seek(0)
            raise SystemExit(f"{' '.join(command)} failed: {errors.read().decode()}")
    return {"seconds": seconds, "peak_rss": usage.ru_maxrss * 1024.0}


def _baseline_rss() -> float:
    """Peak RSS of a process that imports torch, gradstat and safetensors and does nothing."""
    code = (
        "import sys, torch, safetensors, gradstat.analysis.stats;"
        f"sys.path.insert(0, {str(Path(__file__).parent)!r});"
        "from bench_snapshot import _peak_rss; print(_peak_rss())"
    )
    return float(
        subprocess.run(
            [sys.executable, "-c", code], capture_output=True, text=True, check=True
        ).stdout
    )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--gib", type=float, default=4.0)
    parser.add_argument("--ranks", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--dir", type=Path, default=None, help="keep the snapshot here")
    parser.add_argument(
        "--command",
        choices=("norm", "zeros", "audit", "compare"),
        default="norm",
        help="what ours runs",
    )
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--measure", choices=SIDES, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.measure:
        passes = {"peer": measure, "peer-cuda": measure_cuda}
        result = measure_link() if args.measure == "link" else passes[args.measure](args.dir)
        print(json.dumps(result))
        return 0
    if args.device == "cuda" and args.command != "norm":
        parser.error("--device cuda times gradstat norm only")
    temporary = args.dir is None
    directory = Path(tempfile.mkdtemp(prefix="gradstat-bench-")) if temporary else args.dir
    try:
        if not any(directory.glob("*.safetensors")):
            print(
                f"writing {args.gib} GiB in {args.ranks} rank files to {directory}", file=sys.stderr
            )
            write_snapshot(directory, args.gib, args.ranks)
        size = sum(path.stat().st_size for path in directory.glob("*.safetensors"))
        if args.device == "cuda":
            _compare_on_cuda(directory, size, args.repeats)
            return 0
        mine = "ours" if args.command == "norm" else args.command
        _run("peer", directory), _run(mine, directory)  # warm the page cache
        peers: list[dict[str, float]] = []
        ours: list[dict[str, float]] = []
        for repeat in range(args.repeats):
            order = ("peer", mine) if repeat % 2 == 0 else (mine, "peer")
            for side in order:
                (peers if side == "peer" else ours).append(_run(side, directory))
        ratios = [o["seconds"] / p["seconds"] for o, p in zip(ours, peers, strict=True)]
        base = _baseline_rss()
        peer_rss = max(run["peak_rss"] for run in peers)
        ours_rss = max(run["peak_rss"] for run in ours)
        gib = 1 << 30
        print(
            f"torch {torch.__version__}, {torch.get_num_threads()} threads, snapshot "
            f"{size / gib:.2f} GiB in {args.ranks} rank files, {args.repeats} repeats, "
            f"ours: gradstat {args.command}\n"
        )
        print("| measure | ours | peer (safe_open + sum) | ours/peer |")
        print("|---|---:|---:|---:|")
        print(
            f"| time, median of per-repeat ratios | | | {statistics.median(ratios):.2f}x |\n"
            f"| time, fastest runs | {min(o['seconds'] for o in ours):.2f} s | "
            f"{min(p['seconds'] for p in peers):.2f} s | "
            f"{min(o['seconds'] for o in ours) / min(p['seconds'] for p in peers):.2f}x |\n"
            f"| peak RSS | {ours_rss / gib:.2f} GiB | {peer_rss / gib:.2f} GiB | "
            f"{ours_rss / peer_rss:.2f}x |\n"
            f"| peak RSS above an idle process ({base / gib:.2f} GiB) | "
            f"{(ours_rss - base) / gib:.2f} GiB | {(peer_rss - base) / gib:.2f} GiB | |"
        )
        print(
            f"\nsnapshot size {size / gib:.2f} GiB; targets (issue 12): norm/zeros <= 1.15x, "
            "audit <= 1.2x, compare <= 1.5x x2 (it reads two snapshots); RSS near the peer's"
        )
    finally:
        if temporary:
            shutil.rmtree(directory, ignore_errors=True)
    return 0


def _compare_on_cuda(directory: Path, size: int, repeats: int) -> None:
    """Issue 30 item 4: ``gradstat norm --device cuda`` against the same command on the CPU and
    against the bare ``.cuda()`` + sum pass, each as GB/s beyond its process's start (the bytes
    beyond a one-file snapshot's, in the time beyond its run's)."""
    with tempfile.TemporaryDirectory(prefix="gradstat-bench-one-") as one:
        # One file of one tensor (16 MiB): each side's start, and its bytes, taken away.
        tiny = Path(one)
        write_snapshot(tiny, 1e-6, 1)
        extra = size - sum(path.stat().st_size for path in tiny.glob("*.safetensors"))
        sides = ("cuda", "pageable", "cpu", "peer-cuda")
        whole: dict[str, list[float]] = {side: [] for side in sides}
        beyond: dict[str, list[float]] = {side: [] for side in sides}
        for side in sides:  # warm the page cache, the kernel cache and the driver
            _run(side, directory)
        for repeat in range(repeats):
            turn = repeat % len(sides)
            for side in sides[turn:] + sides[:turn]:
                start_only = _run(side, tiny)["seconds"]
                seconds = _run(side, directory)["seconds"]
                whole[side].append(seconds)
                beyond[side].append(seconds - start_only)
    link = json.loads(
        subprocess.run(
            [sys.executable, __file__, "--measure", "link"],
            capture_output=True,
            text=True,
            check=True,
            env=ENV,
        ).stdout
    )["gbs"]
    gib = 1 << 30
    print(
        f"torch {torch.__version__}, {torch.cuda.get_device_name(0)}, snapshot "
        f"{size / gib:.2f} GiB, {repeats} repeats; host-to-device link {link:.1f} GB/s "
        "(1 GiB from pinned memory)\n"
    )
    print("| side | whole command | beyond its start | GB/s | of the link |")
    print("|---|---:|---:|---:|---:|")
    names = {
        "cuda": "gradstat norm --device cuda",
        "pageable": "the same, GRADSTAT_PINNED=0",
        "cpu": "gradstat norm (CPU)",
        "peer-cuda": "safe_open + .cuda() + sum",
    }
    rates = {}
    for side in sides:
        seconds = statistics.median(beyond[side])
        # Beyond the start, a run shorter than the noise of starting has no rate to give.
        rates[side] = extra / seconds / 1e9 if seconds > 0 else math.nan
        print(
            f"| {names[side]} | {statistics.median(whole[side]):.2f} s | {seconds:.3f} s | "
            f"{rates[side]:.1f} | {rates[side] / link:.0%} |"
        )
    print(
        f"\n--device cuda against the CPU: {rates['cuda'] / rates['cpu']:.2f}x the throughput; "
        f"against the bare .cuda() + sum pass: {rates['cuda'] / rates['peer-cuda']:.2f}x; "
        f"pinned staging against pageable copies: {rates['cuda'] / rates['pageable']:.2f}x "
        "(nan: a snapshot too small to time beyond the start; give a larger --gib)"
    )


if __name__ == "__main__":
    sys.exit(main())

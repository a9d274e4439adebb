"""gradstat against the newest megatron-core (GTP, EGTP), held against float64.

Run through scripts/megatron_parity_latest.sh, which makes the Python 3.12 environment this
needs; not part of CI (tests/ is CI's only test path, and this directory is outside it).

On 8 gloo CPU processes with Megatron's real parallel_state, over GTP and EGTP layouts, with
the plain optimizer and the distributed optimizer, it compares:

- the tensors Megatron's optimizer selects for the norm with gradstat's, given Megatron's
  arguments (tp_group, expert_tp_group, no GTP group) and given no group at all;
- get_grad_norm_fp32 for 2, 1 and inf (Megatron's and gradstat's), against float64;
- count_zeros_fp32 (Megatron's optimizer count and gradstat's), against float64 of the
  unpadded gradients: where they differ, which one is right;
- the coordinates dump_rank reads from parallel_state, and the CLI's numbers on the snapshots
  each rank dumped;
- then real Megatron jobs on 4 gloo processes (live_jobs.py): its GPTModel with GTP, MoE layers
  with EGTP, its DDP and optimizer (plain and distributed), dumped by the README's recipes, the
  CLI's numbers against float64 and Megatron's own;
- Megatron's own ``--save-wgrads-interval`` dumps, written by its ``save_grads`` on 4 gloo
  processes (wgrads_jobs.py), the CLI on them against float64 and Megatron's own.

stdout is the report (what README.md quotes); progress goes to stderr. Exit status 0 when
every check holds or differs for a reason the report states, 1 otherwise.
"""

from __future__ import annotations

import datetime
import json
import math
import platform
import sys
import tempfile
import time
from importlib.metadata import version
from pathlib import Path
from typing import Any

_ROOT = Path(__file__).resolve().parents[2]
_HERE = Path(__file__).resolve().parent
for _path in (str(_ROOT), str(_HERE)):
    if _path not in sys.path:
        sys.path.insert(0, _path)

import live_jobs  # noqa: E402
import ranks  # noqa: E402
import wgrads_jobs  # noqa: E402

from gradstat.testing import Case, launch  # noqa: E402
from tests import _jobs  # noqa: E402
from tests._cli import run_gradstat  # noqa: E402
from tests._jobs import Job  # noqa: E402
from tests._oracle import float64_norm, rel_err, zeros_in  # noqa: E402

# Every layout has 8 ranks, so one launch runs them all, one after the other.
LAYOUTS = (
    Job("tp1-gtp2-dp4", gtp=2, dp=4),
    Job("tp2-gtp2-dp2", tp=2, gtp=2, dp=2),
    Job("tp2-gtp2-pp2-tied", tp=2, gtp=2, pp=2),
    # EP before EGTP in Megatron's expert order; align 8 makes an expert fc1 shard all padding.
    Job("gtp2-dp4+ep2-egtp2-edp2", gtp=2, dp=4, ep=2, egtp=2, moe=True, align=8),
    Job("tp2-gtp2-dp2+etp2-ep2-egtp2", tp=2, gtp=2, dp=2, ep=2, etp=2, egtp=2, moe=True),
)
# Megatron's no-TE fallback reduces each tensor in fp32; gradstat combines in float64; the
# snapshot reader's one-pass kernel sums fp32 chunks in fp32 lanes.
MEGATRON_RTOL, GRADSTAT_RTOL, SNAPSHOT_RTOL = 1e-6, 1e-9, 1e-7


def _say(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def _oracle(layout: Job) -> dict[str, dict[str, Any]]:
    """float64 norms and exact zero counts of the unpadded gradients, and the GTP padding
    elements a count that keeps them adds (from the sharder's geometry)."""
    grads = _jobs.oracle_grads(layout.moe)
    padding = {"dense": 0, "expert": 0}
    for geometry in _jobs.gtp_geometry(layout):
        part = "expert" if ".local_experts." in geometry.name else "dense"
        padding[part] += geometry.pad_elements
    padding["chained"] = padding["dense"] + padding["expert"]
    parts = {"dense": "dense", "expert": "expert", "chained": "total"}
    return {
        part: {
            "norms": {p: float64_norm(grads[key], p) for p in ranks.NORM_TYPES},
            "zeros": zeros_in(grads[key]),
            "padding": padding[part],
        }
        for part, key in parts.items()
    }


class Report:
    """The printed rows and the failures found while making them."""

    def __init__(self) -> None:
        self.lines: list[str] = []
        self.failures: list[str] = []
        self.checks = 0

    def check(self, ok: bool, failure: str) -> bool:
        self.checks += 1
        if not ok:
            self.failures.append(failure)
        return ok

    def row(self, *cells: str, widths: tuple[int, ...]) -> None:
        self.lines.append(
            "  ".join(c.ljust(w) for c, w in zip(cells, widths, strict=True)).rstrip()
        )


def _err(value: float, expected: float) -> float:
    return 0.0 if value == expected else rel_err(value, expected)


def _fmt(error: float) -> str:
    return "0" if error == 0 else f"{error:.0e}"


NORM_WIDTHS = (28, 13, 7, 9, 8, 8, 8, 8, 5)
ZERO_WIDTHS = (28, 13, 7, 6, 6, 8, 7, 7, 0)


def _norm_rows(report: Report, layout: Job, values: list[dict[str, Any]], oracle: Any) -> None:
    for kind in ranks.KINDS:
        for part in ("dense", "expert") if layout.moe else ("dense",):
            where = f"{layout.name} {kind} {part}"
            per_rank = [value[kind][part] for value in values]
            selection = all(r["same_selection"] and r["same_bare_selection"] for r in per_rank)
            report.check(selection, f"{where}: gradstat selects other tensors than Megatron")
            cells = [layout.name, kind, part, "same" if selection else "DIFFERENT"]
            for p in (2.0, 1.0):
                expected = oracle[part]["norms"][p]
                megatron = max(_err(r["megatron_norms"][p], expected) for r in per_rank)
                ours = max(_err(r["gradstat_norms"][p], expected) for r in per_rank)
                report.check(megatron <= MEGATRON_RTOL, f"{where}: Megatron L{p:g} off float64")
                report.check(ours <= GRADSTAT_RTOL, f"{where}: gradstat L{p:g} off float64")
                cells += [_fmt(megatron), _fmt(ours)]
            expected = oracle[part]["norms"][math.inf]
            exact = all(
                r["megatron_norms"][math.inf] == r["gradstat_norms"][math.inf] == expected
                for r in per_rank
            )
            report.check(exact, f"{where}: inf-norms differ")
            optimizer = all(
                r["megatron_optimizer_norm"] == r["megatron_norms"][2.0] for r in per_rank
            )
            report.check(optimizer, f"{where}: Megatron's optimizer norm is not its function's")
            report.row(*cells, "exact" if exact else "DIFF", widths=NORM_WIDTHS)


def _zero_verdict(
    megatron: int, ours: int, bare: int, truth: int, padding: int
) -> tuple[str, bool]:
    """What the counts mean against float64, and whether that is an explained outcome."""
    if bare != ours:
        return "gradstat given no group counts otherwise than given Megatron's groups", False
    if megatron == ours == truth:
        return "agree", True
    if ours == truth and megatron == truth + padding:
        return "gradstat right: Megatron counts the padding", True
    if megatron == ours == truth + padding:
        return "both count the padding: the fragments carry no padding attribute", True
    return "UNEXPLAINED", False


def _zero_rows(report: Report, layout: Job, values: list[dict[str, Any]], oracle: Any) -> None:
    parts = ("dense", "expert", "chained") if layout.moe else ("dense",)
    for kind in ranks.KINDS:
        for part in parts:
            where = f"{layout.name} {kind} {part}"
            counts: dict[str, set[int]] = {"megatron": set(), "ours": set(), "bare": set()}
            for value in values:
                if part == "chained":
                    counts["megatron"].add(int(value[kind]["chained"]["megatron_zeros"]))
                    counts["ours"].add(
                        sum(int(value[kind][q]["gradstat_zeros"]) for q in ("dense", "expert"))
                    )
                    counts["bare"].add(
                        sum(int(value[kind][q]["gradstat_bare_zeros"]) for q in ("dense", "expert"))
                    )
                else:
                    stats = value[kind][part]
                    counts["megatron"].add(int(stats["megatron_zeros"]))
                    counts["ours"].add(int(stats["gradstat_zeros"]))
                    counts["bare"].add(int(stats["gradstat_bare_zeros"]))
            if not report.check(
                all(len(found) == 1 for found in counts.values()), f"{where}: ranks disagree"
            ):
                report.row(layout.name, kind, part, "ranks disagree", widths=ZERO_WIDTHS[:4])
                continue
            megatron, ours, bare = (next(iter(counts[key])) for key in ("megatron", "ours", "bare"))
            truth, padding = oracle[part]["zeros"], oracle[part]["padding"]
            verdict, explained = _zero_verdict(megatron, ours, bare, truth, padding)
            report.check(explained, f"{where}: zeros {megatron=} {ours=} {bare=} {truth=}")
            cells = [layout.name, kind, part, str(megatron), str(ours), str(bare), str(truth)]
            report.row(*cells, str(padding), verdict, widths=ZERO_WIDTHS)
        if layout.moe:
            chained = [value[kind]["chained"]["megatron_norm"] for value in values]
            worst = max(_err(norm, oracle["chained"]["norms"][2.0]) for norm in chained)
            report.check(worst <= MEGATRON_RTOL, f"{layout.name} {kind}: chained L2 off float64")


def _cli(*args: str) -> dict[str, Any]:
    result = run_gradstat(*args, "--json")
    if result.returncode not in (0, 1):
        raise RuntimeError(f"gradstat {' '.join(args)} exited {result.returncode}: {result.stderr}")
    document: dict[str, Any] = json.loads(result.stdout)
    return document


CAPTURE_WIDTHS = (28, 13, 9, 9, 9, 6, 12, 0)


def _capture_rows(
    report: Report, layout: Job, values: list[dict[str, Any]], oracle: Any, root: Path
) -> None:
    """dump_rank's coordinates on every rank, then the CLI on each dumped snapshot."""
    coords_ok = all(
        value["dump_rank_coords"] == value["parallel_state_coords"] == value["expected_coords"]
        for value in values
    )
    report.check(coords_ok, f"{layout.name}: dump_rank's coordinates are not Megatron's")
    total = oracle["chained"]
    for kind in ranks.KINDS:
        snapshot = str(root / kind)
        errors = []
        for p, flag in ((2.0, "2"), (1.0, "1"), (math.inf, "inf")):
            errors.append(_err(_cli("norm", snapshot, "-p", flag)["total_norm"], total["norms"][p]))
        report.check(max(errors) <= SNAPSHOT_RTOL, f"{layout.name} {kind}: CLI norms off float64")
        zeros = int(_cli("zeros", snapshot)["num_zeros"])
        live = {int(value[kind]["dense"]["gradstat_zeros"]) for value in values}
        if layout.moe:
            live = {
                sum(int(value[kind][q]["gradstat_zeros"]) for q in ("dense", "expert"))
                for value in values
            }
        report.check(live == {zeros}, f"{layout.name} {kind}: CLI zeros {zeros} != live {live}")
        findings = [
            finding.get("kind", str(finding)) for finding in _cli("audit", snapshot)["findings"]
        ]
        report.check(not findings, f"{layout.name} {kind}: audit findings {findings}")
        cells = [layout.name, kind, "same" if coords_ok else "DIFFERENT"]
        cells += [_fmt(error) for error in errors]
        zero_cell = f"{zeros}" + (
            "" if zeros == total["zeros"] else f" (+{zeros - total['zeros']})"
        )
        report.row(*cells, zero_cell, ", ".join(findings) or "clean", widths=CAPTURE_WIDTHS)


def _order_rows(report: Report, values_by_layout: dict[str, list[dict[str, Any]]]) -> None:
    """gradstat.testing's rank order against Megatron's, rank by rank."""
    for name, values in values_by_layout.items():
        moved = [
            rank
            for rank, value in enumerate(values)
            if value["gradstat_layout_coords"] != value["expected_coords"]
        ]
        placed_ok = all(
            value["parallel_state_coords"] == value["expected_coords"] for value in values
        )
        report.check(placed_ok, f"{name}: parallel_state is not in the documented rank order")
        report.check(
            not moved, f"{name}: gradstat.testing places ranks {moved} otherwise than Megatron"
        )
        if moved:
            first = values[moved[0]]
            axes = [
                axis
                for axis in first["expected_coords"]
                if first["gradstat_layout_coords"].get(axis) != first["expected_coords"][axis]
            ]
            mine, theirs = first["gradstat_layout_coords"], first["expected_coords"]
            detail = ", ".join(f"{axis} {mine[axis][0]} vs {theirs[axis][0]}" for axis in axes)
            report.lines.append(
                f"{name}: gradstat.testing differs on ranks {moved} (rank {moved[0]}: {detail})"
            )
        else:
            report.lines.append(f"{name}: gradstat.testing places every rank as Megatron does")


def _layout_sections(report: Report, layouts: list[Job], scratch: Path, mcore: Any) -> None:
    """Megatron's optimizer code on stand-in optimizers beside gradstat, the snapshots dump_rank
    wrote, the rank order and the empty lists, for ``layouts`` (8 ranks each)."""
    cases = []
    for index, layout in enumerate(layouts):
        root = scratch / f"snapshots{index}"
        cases.append(Case(layout.name, ranks.run_layout, (layout, str(root))))
    _say(f"running {len(cases)} layouts on 8 gloo processes (megatron-core {mcore}) ...")
    run_dir = scratch / "run"
    run_dir.mkdir()
    outcome = launch(8, run_dir, cases, timeout_s=3000, pg_timeout_s=300)
    values = {layout.name: outcome.values(layout.name) for layout in layouts}
    report.lines += [
        "Stand-in optimizers, 8 gloo CPU processes per layout",
        "optimizer: plain = whole shards; distopt = 1-D fragments carrying what Megatron's "
        "DistributedOptimizer copies onto them (its own copy functions); distopt+stamp = the "
        "same fragments stamped with gtp_pad_zeros, as Megatron-LM PR #6778 stamps them",
        "",
        "Norms: relative error against float64, worst rank (tensors: Megatron's optimizer "
        "selection = gradstat's, given Megatron's groups and given none)",
    ]
    report.row(
        "layout", "optimizer", "part", "tensors", "L2 mcore", "L2 gstat", "L1 mcore",
        "L1 gstat", "inf", widths=NORM_WIDTHS,
    )  # fmt: skip
    oracles = {layout.name: _oracle(layout) for layout in layouts}
    for layout in layouts:
        _norm_rows(report, layout, values[layout.name], oracles[layout.name])
    report.lines += [
        "",
        "Zero counts: Megatron's optimizer, gradstat given Megatron's groups, gradstat given "
        "none, float64 of the unpadded gradients, GTP padding elements",
    ]
    report.row(
        "layout", "optimizer", "part", "mcore", "gstat", "no-group", "float64", "padding",
        "verdict", widths=ZERO_WIDTHS,
    )  # fmt: skip
    for layout in layouts:
        _zero_rows(report, layout, values[layout.name], oracles[layout.name])
    _say("reading the dumped snapshots back through the CLI ...")
    report.lines += [
        "",
        "Capture: dump_rank in every rank, coordinates from parallel_state; the CLI on the "
        "snapshot, whole model (relative error against float64; zeros: +padding counted)",
    ]
    report.row(
        "layout", "optimizer", "coords", "norm 2", "norm 1", "inf", "zeros", "audit",
        widths=CAPTURE_WIDTHS,
    )  # fmt: skip
    for index, layout in enumerate(layouts):
        root = scratch / f"snapshots{index}"
        _capture_rows(report, layout, values[layout.name], oracles[layout.name], root)
    report.lines += ["", "Rank order (Megatron: experts etp-ep-egtp-edp-pp):"]
    _order_rows(report, values)
    empty = values[layouts[0].name][0]["empty"]
    report.check(
        all(empty[side][p] == 0.0 for side in ("megatron", "gradstat") for p in ranks.NORM_TYPES),
        "empty gradient lists: a norm is not 0.0",
    )
    megatron_zeros, megatron_type = empty["megatron_zeros"]
    zeros_types = {
        value[kind]["dense"]["zeros_types"] for vals in values.values() for value in vals
        for kind in ranks.KINDS
    }  # fmt: skip
    report.lines += [
        "",
        f"Empty lists: get_grad_norm_fp32 2/1/inf: Megatron {list(empty['megatron'].values())},"
        f" gradstat {list(empty['gradstat'].values())}; count_zeros_fp32: Megatron "
        f"{megatron_zeros!r} ({megatron_type}), gradstat {empty['gradstat_zeros']!r}",
        "count_zeros_fp32 return types (Megatron, gradstat): "
        + ", ".join(f"({a}, {b})" for a, b in sorted(zeros_types))
        + ("" if all(a == b for a, b in zeros_types) else ": the types differ, values equal"),
    ]


def _live_section(report: Report, jobs: list[live_jobs.LiveJob], scratch: Path) -> None:
    """Real Megatron jobs with GTP and EGTP, dumped by the README's recipes (live_jobs.py)."""
    by_size: dict[int, list[live_jobs.LiveJob]] = {}
    for job in jobs:
        by_size.setdefault(job.world_size, []).append(job)
    values: dict[live_jobs.LiveJob, list[dict[str, Any]]] = {}
    root = scratch / "live"
    for world_size, group in sorted(by_size.items()):
        cases = [
            Case(job.case, live_jobs.run_live_job, (job, str(root / job.folder))) for job in group
        ]
        _say(f"running {len(cases)} real Megatron jobs on {world_size} gloo processes ...")
        run_dir = scratch / f"run-live-{world_size}"
        run_dir.mkdir()
        outcome = launch(world_size, run_dir, cases, timeout_s=3000, pg_timeout_s=300)
        values |= {job: outcome.values(job.case) for job in group}
    report.lines += [
        "",
        "Real Megatron jobs (megatron-core's GPTModel with GTP weight remat, MoE layers with "
        "EGTP, its DDP, finalize_model_grads, get_megatron_optimizer), 4 gloo CPU processes; "
        "the README's megatron and recorder recipes; the CLI on the snapshot against float64 "
        "(relative error; zeros and elements without the GTP padding) and Megatron's optimizer",
    ]
    report.row(*live_jobs.LIVE_HEADER, widths=live_jobs.LIVE_WIDTHS)
    for job in jobs:
        live_jobs.live_rows(report, job, values[job], root / job.folder)


def main(argv: list[str]) -> int:
    """Run the layouts and live jobs named in ``argv`` (all of them when none is named)."""
    started = time.monotonic()
    mcore = ranks.megatron_version()
    known = [layout.name for layout in LAYOUTS]
    known += list(dict.fromkeys(job.name for job in live_jobs.LIVE_JOBS))
    known += ["wgrads", *dict.fromkeys(job.name for job in wgrads_jobs.WGRADS_JOBS)]
    unknown = set(argv) - set(known)
    if unknown:
        _say(f"unknown layouts {sorted(unknown)}; known: {known}")
        return 2
    layouts = [layout for layout in LAYOUTS if not argv or layout.name in argv]
    jobs = [job for job in live_jobs.LIVE_JOBS if not argv or job.name in argv]
    wgrads = [
        job for job in wgrads_jobs.WGRADS_JOBS if not argv or "wgrads" in argv or job.name in argv
    ]
    report = Report()
    today = datetime.date.today().isoformat()
    report.lines.append(
        f"gradstat vs megatron-core {mcore} (torch {version('torch')}, Python "
        f"{platform.python_version()}), gloo CPU processes, {today}"
    )
    with tempfile.TemporaryDirectory(prefix="gradstat-parity-latest-") as scratch:
        if layouts:
            _layout_sections(report, layouts, Path(scratch), mcore)
        if jobs:
            _live_section(report, jobs, Path(scratch))
        if wgrads:
            wgrads_jobs.wgrads_section(report, wgrads, Path(scratch))
    report.lines.append("")
    if report.failures:
        report.lines.append(f"{len(report.failures)} of {report.checks} checks FAILED:")
        report.lines += [f"  {failure}" for failure in report.failures]
    else:
        report.lines.append(f"all {report.checks} checks hold")
    report.lines.append(f"({time.monotonic() - started:.0f} s)")
    print("\n".join(report.lines))
    return 1 if report.failures else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

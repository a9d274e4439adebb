"""Rich tables for the report rows (the other rendering is ``to_json``), and progress bars.

Parameter names, paths and whatever else a snapshot or the command line supplies are data: they
go through ``_shown``, so no text in them is taken for rich markup or reaches the terminal as a
control sequence. Print with ``Console(emoji=False)``: rich would turn ``:name:`` codes into
emoji otherwise. A table never breaks a word to fit the terminal (a parameter name must stay
one piece that can be copied): its headings wrap between words, and a table that still does
not fit is printed wider than the terminal (``_print_table``). Importing this module is cheap
(no torch): the CLI's error line uses ``visible``.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rich.console import Console
from rich.markup import escape
from rich.measure import Measurement
from rich.table import Table

if TYPE_CHECKING:
    from gradstat.analysis.explain import ExplainReport
    from gradstat.analysis.history import History
    from gradstat.analysis.report import (
        AuditReport,
        ClipReport,
        CompareReport,
        InspectReport,
        NormReport,
        SnapshotInfo,
        ZerosReport,
    )
    from gradstat.distributed.runner import Progress

__all__ = [
    "ProgressBars",
    "print_audit",
    "print_clip",
    "print_compare",
    "print_explain",
    "print_history",
    "print_inspect",
    "print_norm",
    "print_zeros",
    "sparkline",
    "visible",
]


def visible(text: str) -> str:
    """``text`` with each character that is not printable written as ``repr`` writes it.

    An ESC or OSC sequence in a parameter name must not reach the terminal, a newline must not
    break a one-line message, and a lone surrogate (an undecodable byte of a path, decoded
    with surrogateescape) must not fail the encoding of stdout: they read ``\\x1b``,
    ``\\n``, ``\\udcff``. Backslashes are left as they are, so a name is shown as written.
    """
    if text.isprintable():
        return text
    return "".join(char if char.isprintable() else repr(char)[1:-1] for char in text)


def _shown(text: str) -> str:
    """Data as rich markup that shows it literally: ``[/]`` and ``[i]`` stay text."""
    return escape(visible(text))


def _count(number: int, noun: str) -> str:
    """``1 rank``, ``2 ranks``: a number and its noun, singular or plural."""
    return f"{number} {noun}{'' if number == 1 else 's'}"


_UNBOUNDED = 1 << 20  # columns: a width no table reaches, to measure it unconstrained


def _print_table(console: Console, table: Table) -> None:
    """Print ``table`` with every cell's words whole.

    rich shrinks a table that is wider than the console by folding its cells mid-word (or
    cutting them with an ellipsis). Here a table that fits is printed as it is; one that does
    not gets column widths that keep each column's longest word (no-wrap columns, the
    parameter names, whole), headings and lists wrapping between words, and when even that is
    wider than the console it is printed at that width: the terminal wraps the line, and a
    name copied from it is the name.
    """
    wide = console.options.update_width(_UNBOUNDED)
    if Measurement.get(console, wide, table).maximum <= console.width:
        console.print(table)
        return
    ranges = []
    for column in table.columns:
        cells = [Measurement.get(console, wide, cell) for cell in (column.header, *column.cells)]
        longest = max(cell.maximum for cell in cells)
        word = longest if column.no_wrap else max(cell.minimum for cell in cells)
        ranges.append((word, longest))
    widths = [word for word, _ in ranges]
    # Borders and padding: what the table adds to its columns' contents.
    overhead = Measurement.get(console, wide, table).maximum - sum(high for _, high in ranges)
    spare = console.width - overhead - sum(widths)
    # The spare columns go first to the columns that need the least to be whole on one line.
    for index in sorted(range(len(ranges)), key=lambda i: ranges[i][1] - ranges[i][0]):
        grow = min(max(spare, 0), ranges[index][1] - widths[index])
        widths[index] += grow
        spare -= grow
    for column, width in zip(table.columns, widths, strict=True):
        column.width = width
    needed = sum(widths) + overhead
    if needed <= console.width:
        console.print(table)
        return
    previous = console.width
    console.width = needed
    try:
        console.print(table)
    finally:
        console.width = previous


def _number(value: float, digits: int = 6) -> str:
    if math.isnan(value):
        return "[bold red]nan[/]"
    if math.isinf(value):
        return "[bold red]inf[/]" if value > 0 else "[bold red]-inf[/]"
    return f"{value:.{digits}g}"


def _norm_name(norm_type: float) -> str:
    if norm_type == math.inf:
        return "inf"
    return f"L{norm_type:g}"


ALL_ZERO = (
    "[bold red]every counted gradient is zero[/]: dumped before the backward pass, or after "
    "zero_grad?"
)


RECORDED_NORM_DIFFERS = (
    "[bold red]the flight recorder's norm of this step was {recorded}[/]: it counts every copy "
    "(each data-parallel replica, each DTensor copy) where the snapshot counts one, so a copy "
    "it does not count differs (gradstat audit names it), or the recorder was told another "
    "layout"
)
NONFINITE_NOT_COUNTED = (
    "[bold red]taken for a non-finite norm, yet every counted copy is finite[/]: a copy the "
    "norm does not count (another data-parallel replica) holds the NaN or Inf; gradstat audit "
    "names it"
)


def _header(console: Console, info: SnapshotInfo) -> None:
    """The snapshot's line: its ranks, what kind of gradients, its step, what took it.

    A snapshot of DTensor gradients says nothing of an optimizer unless its header says
    "distributed": their placements decide what counts, whatever the job's optimizer.
    """
    if info.source == "megatron-wgrads":
        # No optimizer is saved: the dump is the all-reduced main_grad of each writer.
        parts = [f"Megatron wgrads dump, {_count(info.world_size, 'file')}"]
    elif info.source == "dcp":
        from gradstat.snapshot.checkpoint import kind_said
        from gradstat.snapshot.dcp import metadata_paths

        # DCP's own metadata, or Hugging Face's safetensors layout (read as a DCP checkpoint).
        label = "DCP checkpoint" if metadata_paths(Path(info.path)) else "Hugging Face checkpoint"
        parts = [f"{label}, {kind_said(info.kind or '')}"]
    elif info.distributed_optimizer:
        parts = [_count(info.world_size, "rank"), "distributed optimizer"]
    elif info.dtensor:
        parts = [_count(info.world_size, "rank"), "DTensor gradients"]
    else:
        parts = [_count(info.world_size, "rank"), "plain optimizer"]
    if info.step is not None:
        parts.append(f"{'iteration' if info.source == 'megatron-wgrads' else 'step'} {info.step}")
    if info.triggers:
        noun = "trigger" if len(info.triggers) == 1 else "triggers"
        parts.append(f"{noun}: {', '.join(info.triggers)}")
    # soft_wrap: a long path stays one piece for the terminal to wrap, never cut by rich
    console.print(f"[bold]{_shown(info.path)}[/]: {_shown(', '.join(parts))}", soft_wrap=True)


def print_norm(console: Console, report: NormReport) -> None:
    _header(console, report.snapshot)
    name = _norm_name(report.norm_type)
    split = ""
    if report.has_experts:
        split = f" (dense {_number(report.dense_norm, 8)}, expert {_number(report.expert_norm, 8)})"
    console.print(f"total {name} norm [bold]{_number(report.total_norm, 10)}[/]{split}")
    if report.clip_coeff is not None and report.max_norm is not None:
        verdict = "clips" if report.clip_coeff < 1.0 else "does not clip"
        console.print(
            f"max_norm {report.max_norm:g}: clip coefficient {_number(report.clip_coeff, 8)} "
            f"({verdict})"
        )
    # The inf norm is a max: a parameter's max |g| over the total is no share of a sum.
    maximum = report.norm_type == math.inf
    share = "max |g| / total" if maximum else f"share of norm^{report.norm_type:g}"
    order = "largest |g|" if maximum else "contribution"
    if report.by_expert is not None:
        _print_expert_norms(console, report, name, share, order)
    else:
        counted = len(report.params) + report.params_left_out
        table = Table(title=f"parameters by {order} ({len(report.params)} of {counted} shown)")
        table.add_column("parameter", no_wrap=True)
        for column in (f"{name} norm", share, "elements", "ranks"):
            table.add_column(column, justify="right")
        for row in report.params:
            label = f"{_shown(row.name)} [dim](expert)[/]" if row.expert else _shown(row.name)
            part = row.ratio if row.share is None else row.share
            table.add_row(
                label, _number(row.norm), _part(part), str(row.num_elements), str(row.ranks)
            )
        _print_table(console, table)
    if report.nonfinite:
        found = Table(title="[bold red]non-finite gradients[/]")
        found.add_column("rank", justify="right")
        found.add_column("parameter", no_wrap=True)
        for column in ("NaN", "Inf"):
            found.add_column(column, justify="right")
        for item in report.nonfinite:
            found.add_row(str(item.rank), _shown(item.name), str(item.nan), str(item.inf))
        _print_table(console, found)
    if report.nonfinite_not_counted:
        console.print(NONFINITE_NOT_COUNTED)
    if report.recorded_norm_differs and report.recorded_norm is not None:
        console.print(RECORDED_NORM_DIFFERS.format(recorded=_number(report.recorded_norm)))
    if report.all_zero:
        console.print(ALL_ZERO)


def _part(part: float) -> str:
    return "-" if math.isnan(part) else f"{part:.2%}"


_NO_EXPERTS = (
    "[dim]no expert recognised by name (local_experts.E, or a grouped GEMM's weightE); "
    "stacked [E, ...] expert weights are not split[/]"
)


def _print_expert_norms(
    console: Console, report: NormReport, name: str, share: str, order: str
) -> None:
    rows = report.by_expert or ()
    counted = len(rows) + report.experts_left_out
    table = Table(title=f"experts by {order} ({len(rows)} of {counted} shown)")
    table.add_column("expert", no_wrap=True)
    for column in (f"{name} norm", share, "elements", "params", "ranks"):
        table.add_column(column, justify="right")
    for row in rows:
        part = row.ratio if row.share is None else row.share
        table.add_row(
            _shown(row.name),
            _number(row.norm),
            _part(part),
            str(row.num_elements),
            str(row.params),
            str(row.ranks),
        )
    _print_table(console, table)
    if not any(row.expert is not None for row in rows):
        console.print(_NO_EXPERTS)


def print_zeros(console: Console, report: ZerosReport) -> None:
    _header(console, report.snapshot)
    console.print(
        f"num_zeros [bold]{report.num_zeros}[/] of {report.num_elements} elements "
        f"({report.sparsity:.2%}); GTP padding excluded: {report.padding_excluded}"
    )
    order = {"zeros": "most zeros first", "sparsity": "sparsest first", "module": "module order"}
    if report.by_expert is not None:
        experts = report.by_expert
        counted = len(experts) + report.experts_left_out
        table = Table(
            title=f"zeros per expert, {order[report.sort]} ({len(experts)} of {counted} shown)"
        )
        table.add_column("expert", no_wrap=True)
        for column in ("zeros", "elements", "sparsity", "padding excluded", "params"):
            table.add_column(column, justify="right")
        for expert in experts:
            table.add_row(
                _shown(expert.name),
                str(expert.num_zeros),
                str(expert.num_elements),
                f"{expert.sparsity:.2%}",
                str(expert.padding_excluded),
                str(expert.params),
            )
        _print_table(console, table)
        if not any(expert.expert is not None for expert in experts):
            console.print(_NO_EXPERTS)
    else:
        counted = len(report.params) + report.params_left_out
        table = Table(
            title=f"zeros per parameter, {order[report.sort]} ({len(report.params)} of "
            f"{counted} shown)"
        )
        table.add_column("parameter", no_wrap=True)
        for column in ("zeros", "elements", "sparsity", "padding excluded"):
            table.add_column(column, justify="right")
        for row in report.params:
            table.add_row(
                _shown(row.name),
                str(row.num_zeros),
                str(row.num_elements),
                f"{row.sparsity:.2%}",
                str(row.padding_excluded),
            )
        _print_table(console, table)
    if report.all_zero:
        console.print(ALL_ZERO)


def print_inspect(console: Console, report: InspectReport) -> None:
    _header(console, report.snapshot)
    axes = _shown(", ".join(f"{axis}={size}" for axis, size in report.axes.items() if size > 1))
    total = sum(file.bytes for file in report.files)
    rebuilt = report.snapshot.source in ("megatron-wgrads", "dcp")
    if report.snapshot.source == "dcp":
        made = "chunks placed by the checkpoint's metadata (each data file a rank file)"
    elif rebuilt:
        made = "attributes rebuilt from Megatron's names and the files' shapes"
    else:
        made = f"format version {report.format_version}"
    console.print(
        f"{made}; axes: {axes or 'none split'}; "
        f"{_count(len(report.files), 'file')}, {_count(total, 'byte')}"
    )
    table = Table(title="parameters")
    table.add_column("parameter", no_wrap=True)
    columns = ("dtype", "local shape", "ranks", "kind", "attributes", *(("why", "from") * rebuilt))
    for column in columns:
        table.add_column(column, justify="right" if column == "ranks" else "left")
    for row in report.params:
        notes = []
        if row.placements:
            notes.append(row.placements)
        if row.tensor_parallel:
            notes.append(f"TP partition dim {row.partition_dim}")
        elif row.kind not in ("fsdp shard", "dtensor", "checkpoint chunk"):
            notes.append("replicated over TP")
        if row.shared:
            notes.append("shared copy (not counted)")
        if row.expert:
            notes.append("expert")
        if row.gtp_pad_length:
            notes.append(f"GTP pad {row.gtp_pad_length} rows")
        if row.no_grad:
            notes.append("no gradient")
        shape = "x".join(str(dim) for dim in row.local_shape) or "scalar"
        table.add_row(
            _shown(row.name),
            _shown(row.dtype),
            shape,
            str(row.ranks),
            row.kind,
            _shown(", ".join(notes)),
            *(
                (_shown(row.rule or "-"), _shown(_sources(row.name, row.sources)))
                if rebuilt
                else ()
            ),
        )
    _print_table(console, table)
    for note in report.notes:
        console.print(f"note: {_shown(note)}")


def _sources(name: str, sources: tuple[str, ...]) -> str:
    """The files a parameter was read from (the first, and how many more), and its local name
    there where it is not ``name``."""
    if not sources:
        return "-"
    file, _, local = sources[0].partition(":")
    shown = file if len(sources) == 1 else f"{file} +{len(sources) - 1}"
    local = local.partition("/")[2]
    return shown if local == name else f"{shown} as {local}"


def print_clip(console: Console, report: ClipReport) -> None:
    name = _norm_name(report.norm_type)
    action = (
        f"scaled by {_number(report.clip_coeff, 8)}"
        if report.clipped
        else "copied unchanged (coefficient >= 1)"
        if report.clip_coeff >= 1.0
        else "copied unchanged (non-finite norm)"
    )
    console.print(
        f"{_shown(report.snapshot)}: total {name} norm {_number(report.total_norm, 10)}, "
        f"max_norm {report.max_norm:g}: gradients {action}"
    )
    console.print(f"wrote {_shown(report.out)}")
    if report.all_zero:
        console.print(ALL_ZERO)


def _maybe(value: float | int | None, digits: int = 6) -> str:
    if value is None:
        return "-"
    return str(value) if isinstance(value, int) else _number(value, digits)


def _ratio(value: float) -> str:
    """B/A as a multiple (``100x``), telling the jumps that a relative difference near 1 hides."""
    if math.isnan(value) or math.isinf(value):
        return _number(value)
    return f"{value:.4g}x"


# Between two checkpoints' weights, the table's largest updates (--all: every parameter).
UPDATES_SHOWN = 20


def print_compare(console: Console, report: CompareReport, show_all: bool = False) -> None:
    for side, info in (("A", report.a), ("B", report.b)):
        console.print(f"{side}: ", end="")
        _header(console, info)
    totals = Table(title=f"whole model (rtol {report.rtol:g})")
    totals.add_column("measure", no_wrap=True)
    for column in ("A", "B", "rel. diff", "B/A"):
        totals.add_column(column, justify="right")
    for total in report.totals:
        if not report.has_experts and total.measure in ("dense_norm", "expert_norm"):
            continue  # no expert parameter: dense is the total, expert nothing
        a, b = (str(x) if isinstance(x, int) else _number(x, 10) for x in (total.a, total.b))
        diff = _number(total.rel_diff, 3)
        shown = f"[bold red]{diff}[/]" if total.flagged else diff
        multiple = "" if isinstance(total.a, int) else _ratio(total.ratio)  # counts: no ratio
        totals.add_row(total.measure, a, b, shown, multiple)
    _print_table(console, totals)
    updates = report.updates
    rows = [param for param in report.params if show_all or param.flags]
    scope = "all parameters" if show_all else "flagged parameters"
    if updates and not show_all:
        # Two checkpoints' weights: the largest updates (the report's order), and any unchanged.
        largest = report.params[:UPDATES_SHOWN]
        rows = [*largest, *(param for param in report.params[UPDATES_SHOWN:] if param.flags)]
        scope = "largest updates, and parameters unchanged"
    flagged = f"{len(report.mismatches)} of {len(report.params)} flagged"
    table = Table(title=f"{scope} ({flagged})")
    table.add_column("parameter", no_wrap=True)
    columns = ["L2 A", "L2 B", "rel. diff", "B/A", "zeros A", "zeros B", "max |A-B|"]
    if updates:
        columns += ["||B-A||", "/ ||A||"]
    for column in columns:
        table.add_column(column, justify="right")
    table.add_column("flags")
    for param in rows:
        elementwise = _maybe(param.max_abs_diff)
        if param.max_abs_diff is None and param.not_rebuilt:
            elementwise = "[dim]n/a[/]"
        flags = ", ".join(param.flags)
        table.add_row(
            _shown(param.name),
            _maybe(param.norm_a),
            _maybe(param.norm_b),
            _maybe(param.rel_diff, 3),
            "-" if param.ratio is None else _ratio(param.ratio),
            _maybe(param.zeros_a),
            _maybe(param.zeros_b),
            elementwise,
            *((_maybe(param.diff_norm), _maybe(param.rel_diff_norm, 3)) if updates else ()),
            f"[bold red]{flags}[/]" if flags else "",
        )
    if rows:
        _print_table(console, table)
    unplaced = [param for param in report.params if param.not_rebuilt]
    if unplaced:
        console.print(
            f"[dim]{_count(len(unplaced), 'parameter')} not compared element by element "
            f"(first: {_shown(unplaced[0].name)}: {_shown(unplaced[0].not_rebuilt or '')})[/]"
        )
    if updates:
        unchanged = sum("unchanged" in param.flags for param in report.params)
        if unchanged:
            console.print(
                f"[bold red]{_count(unchanged, 'parameter')} did not change[/] from A to B "
                "(frozen, or never given a gradient?)"
            )
        elif report.flagged:
            console.print("the checkpoints [bold red]differ[/] in what they hold")
        else:
            console.print("every parameter [bold green]changed[/] from A to B")
    elif report.flagged:
        console.print(f"the snapshots [bold red]differ[/] beyond rtol {report.rtol:g}")
    else:
        console.print(f"the snapshots [bold green]agree[/] within rtol {report.rtol:g}")


def print_audit(console: Console, report: AuditReport) -> None:
    _header(console, report.snapshot)
    console.print(
        f"{_count(report.params_checked, 'parameter')} checked; total L2 norm "
        f"{_number(report.total_norm, 10)}"
    )
    if not report.findings:
        console.print("[bold green]no findings[/]: every copy, padding row and attribute agrees")
        return
    table = Table(title=f"[bold red]{_count(len(report.findings), 'finding')}[/]")
    table.add_column("#", justify="right")
    table.add_column("finding", no_wrap=True)
    table.add_column("parameter", no_wrap=True)
    table.add_column("ranks")
    for column in ("max |diff|", "norm if miscounted", "change"):
        table.add_column(column, justify="right")
    for number, finding in enumerate(report.findings, 1):
        ranks = ", ".join(str(rank) for rank in finding.ranks[:8])
        if len(finding.ranks) > 8:
            ranks += f" (+{len(finding.ranks) - 8})"
        change = "-" if finding.norm_change is None else f"{finding.norm_change:+.3%}"
        table.add_row(
            str(number),
            finding.kind,
            _shown(finding.name),
            ranks,
            _maybe(finding.max_abs_diff, 4),
            _maybe(finding.norm_if_miscounted, 8),
            change,
        )
    _print_table(console, table)
    for number, finding in enumerate(report.findings, 1):
        console.print(f"{number:>2}. {_shown(finding.detail)}")


def print_explain(console: Console, report: ExplainReport, top: int | None = None) -> None:
    """The exact value, the logged one, and each hypothesis by its distance to it."""
    _header(console, report.snapshot)
    if report.norm_type is None:
        what, digits = "zero count", 12
    else:
        p = report.norm_type
        shown = "inf" if p == math.inf else f"{p:g}"
        what, digits = f"{'L2' if p == 2 else shown + '-'} norm", 10
    console.print(
        f"exact {what} {_number(report.exact, digits)}; logged {_number(report.logged, digits)}"
    )
    matches = report.matches
    if report.exact_matches:
        console.print("[bold green]the logged number is right[/]: it is the exact value")
    elif matches:
        best = matches[0]
        console.print(f"[bold]explained by {_shown(best.name)}[/]: {_shown(best.description)}")
    else:
        console.print(f"[bold red]no hypothesis explains {_number(report.logged, digits)}[/]")
    rows = report.rows if top is None else report.rows[:top]
    title = f"hypotheses by distance ({len(rows)} of {len(report.rows)} shown)"
    table = Table(title=title)
    table.add_column("#", justify="right")
    table.add_column("hypothesis", no_wrap=True)
    table.add_column("predicts", justify="right")
    table.add_column("distance", justify="right")
    table.add_column("match")
    table.add_column("parameters", justify="right")
    table.add_column("what it assumes")
    for number, row in enumerate(rows, 1):
        distance = "inf" if math.isinf(row.distance) else f"{row.distance:.3%}"
        table.add_row(
            str(number),
            _shown(row.name),
            _number(row.value, digits),
            distance,
            "[bold green]yes[/]" if row.match else "",
            str(len(row.params)),
            _shown(row.description),
        )
    _print_table(console, table)


class ProgressBars:
    """How far a command is, as rich progress bars on ``console`` (stderr), one per stage.

    Called with each :class:`~gradstat.distributed.runner.Progress`; the bars appear with the
    first one, count units and bytes, and vanish at :meth:`stop`, before any result is printed.
    """

    def __init__(self, console: Console) -> None:
        self._console = console
        self._bars: Any = None  # rich.progress.Progress, imported when first drawn
        self._tasks: dict[str, Any] = {}

    def __call__(self, progress: Progress) -> None:
        if self._bars is None:
            from rich.progress import BarColumn, TextColumn, TimeElapsedColumn
            from rich.progress import Progress as Bars

            self._bars = Bars(
                TextColumn("{task.description}"),
                BarColumn(),
                TextColumn("{task.fields[count]}"),
                TextColumn("{task.fields[size]}"),
                TimeElapsedColumn(),
                console=self._console,
                transient=True,
                # stdout carries results only: nothing written there goes to the bars' stderr
                redirect_stdout=False,
                redirect_stderr=False,
            )
            self._bars.start()
        from rich.filesize import decimal

        fields = {"count": f"{progress.done}/{progress.total} {progress.unit}", "size": ""}
        completed, total = progress.done, progress.total
        if progress.bytes_total:
            fields["size"] = f"{decimal(progress.bytes_done)} of {decimal(progress.bytes_total)}"
            completed, total = progress.bytes_done, progress.bytes_total
        task = self._tasks.get(progress.stage)
        if task is None:
            self._tasks[progress.stage] = self._bars.add_task(
                progress.stage, total=total, completed=completed, **fields
            )
        else:
            self._bars.update(task, total=total, completed=completed, **fields)

    def stop(self) -> None:
        """Take the bars off the terminal (a later stage draws new ones)."""
        if self._bars is not None:
            self._bars.stop()
            self._bars, self._tasks = None, {}


_BARS = "▁▂▃▄▅▆▇█"


def sparkline(values: Iterable[float]) -> str:
    """One character per value, scaled between the finite minimum and maximum; '!' for NaN or
    inf. On a log scale when the values span more than two decades."""
    values = list(values)
    finite = [value for value in values if math.isfinite(value)]
    if not finite:
        return "!" * len(values)
    logarithmic = min(finite) > 0 and max(finite) > 100 * min(finite)

    def scaled(value: float) -> float:
        return math.log10(value) if logarithmic else value

    low, high = scaled(min(finite)), scaled(max(finite))
    span = high - low
    chars = []
    for value in values:
        if not math.isfinite(value):
            chars.append("!")
        else:
            level = 0 if span == 0 else round((scaled(value) - low) / span * (len(_BARS) - 1))
            chars.append(_BARS[level])
    return "".join(chars)


def _triggered(steps: Sequence[int], taken_by: Sequence[tuple[str, ...]]) -> str:
    """Which snapshots each trigger took (the kept snapshots in order: each one's step and
    the triggers that took it): ``every at 5, 10; spike at 9``. Three or more
    snapshots one after the other whose steps have one stride read ``1 .. 12`` (stride 1) or
    ``5, 10 .. 60``; a step with several (a resumed run replayed it) ``4 (2 snapshots)``."""
    # trigger: its runs, each a list of (step, snapshots at it, index of the last of them)
    runs: dict[str, list[list[tuple[int, int, int]]]] = {}
    for index, triggers in enumerate(taken_by):
        for trigger in triggers:
            found = runs.setdefault(trigger, [])
            run = found[-1] if found else []
            follows = bool(run) and run[-1][2] == index - 1
            if follows and run[-1][0] == steps[index]:  # the same step again
                step, count, _ = run.pop()
                if run:  # a step of several snapshots stands alone
                    found.append([])
                    run = found[-1]
                run.append((step, count + 1, index))
                continue
            if follows:
                follows = run[-1][1] == 1 and (
                    len(run) < 2 or steps[index] - run[-1][0] == run[1][0] - run[0][0]
                )
            if follows:
                run.append((steps[index], 1, index))
            else:
                found.append([(steps[index], 1, index)])

    def shown(run: list[tuple[int, int, int]]) -> str:
        if run[0][1] > 1:
            return f"{run[0][0]} ({run[0][1]} snapshots)"
        at = [str(step) for step, _, _ in run]
        if len(at) < 3:
            return ", ".join(at)
        stride = run[1][0] - run[0][0]
        return f"{at[0]} .. {at[-1]}" if stride == 1 else f"{at[0]}, {at[1]} .. {at[-1]}"

    return "; ".join(
        f"{trigger} at {', '.join(map(shown, found))}" for trigger, found in runs.items()
    )


def print_history(console: Console, history: History, top: int | None = 20) -> None:
    """The total norm as a sparkline, what took the snapshots, then the parameters that jumped
    (the one that moved first at the top) and the largest of the rest, each with its own
    sparkline."""
    totals = history.totals
    finite = [value for value in totals if math.isfinite(value)]
    span = f"{min(finite):.6g} .. {max(finite):.6g}" if finite else "no finite norm"
    kept = _count(len(history.snapshots), "snapshot")
    if not history.steps:  # a log without a step in the range: its snapshots alone
        console.print(f"no step in the log, {kept} kept")
        for snapshot in history.snapshots:
            console.print(
                f"{_shown(snapshot.path.name)}: step {snapshot.step}, total norm "
                f"{_number(snapshot.total_norm)}"
            )
    else:
        steps = f"steps {history.steps[0]} .. {history.steps[-1]}"
        if history.source == "log":
            counted = f"{_count(len(history.steps), 'step')} in the log, {steps}, {kept} kept"
        else:
            counted = f"{_count(len(history.steps), 'snapshot')}, {steps}"
        console.print(f"{counted}; total norm ({span}): {sparkline(_sampled(totals))}")
    kept_snapshots = history.snapshots
    triggered = _triggered(
        [kept.step for kept in kept_snapshots], [kept.triggers for kept in kept_snapshots]
    )
    if triggered:
        console.print(f"taken by the flight recorder's triggers: {_shown(triggered)}")
    mismatched = [
        index
        for index, logged in enumerate(history.logged)
        if logged is not None and "mismatch" in history.triggers[index]
    ]
    if mismatched:
        at = ", ".join(str(history.steps[index]) for index in mismatched[:5])
        console.print(f"the logged norm disagreed with the exact one from step(s) {at}")
    jumped = history.jumped()
    rest = sorted(
        (series for series in history.params.values() if series.jump_step is None),
        key=lambda series: -series.peak(),
    )
    rows = jumped + rest
    if not rows:
        return
    table = Table(title="per parameter, the first to jump first")
    table.add_column("parameter", no_wrap=True)
    for column in ("first jump", "first norm", "last norm", "norm over steps"):
        table.add_column(
            column, justify="right", no_wrap=column in ("first jump", "norm over steps")
        )
    shown = rows if top is None else rows[:top]
    for series in shown:
        jump = "" if series.jump_step is None else f"{series.jump_kind} at {series.jump_step}"
        if series.jump_ratio is not None and math.isfinite(series.jump_ratio):
            jump += f" ({series.jump_ratio:.3g}x)"
        table.add_row(
            _shown(series.name),
            jump,
            _number(series.norms[0]),
            _number(series.norms[-1]),
            sparkline(_sampled(series.norms)),
        )
    _print_table(console, table)
    if len(rows) > len(shown):
        more = _count(len(rows) - len(shown), "more parameter")
        console.print(f"{more} (--top, or --json for all)")


_SPARK_WIDTH = 40


def _sampled(values: Sequence[float]) -> list[float]:
    """At most ``_SPARK_WIDTH`` values for a sparkline: the largest of each stretch (a NaN
    kept), so that a one-step spike in a long history still shows."""
    if len(values) <= _SPARK_WIDTH:
        return list(values)
    size = len(values)
    bounds = [size * index // _SPARK_WIDTH for index in range(_SPARK_WIDTH + 1)]
    stretches = [values[low:high] for low, high in itertools.pairwise(bounds)]
    return [
        math.nan if any(math.isnan(value) for value in stretch) else max(stretch)
        for stretch in stretches
    ]

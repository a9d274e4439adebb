"""The pictures of ``gradstat history``: a PNG or SVG figure (``--plot``) and TensorBoard
event files (``--tensorboard``) of a run's history.

Both need the ``plot`` extra (matplotlib, tensorboard), imported only when asked for. Nothing
the user owns is overwritten: the figure is written to a hidden file beside its target and
linked into place only if the name is still free; the event files go into a new or empty
directory.
"""

from __future__ import annotations

import math
import os
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from gradstat.analysis.history import History, ParamSeries
from gradstat.errors import GradstatError

if TYPE_CHECKING:
    from matplotlib.axes import Axes
    from matplotlib.figure import Figure

__all__ = ["FIGURE_PIXELS", "PLOT_SUFFIXES", "pick_series", "write_pictures"]

PLOT_SUFFIXES = (".png", ".svg")
FIGURE_PIXELS = (1200, 750)  # width, height of the PNG
_DPI = 100
_LABEL_CHARS = 80  # longer names lose their middle in the legend
_NONFINITE_COLOR = "#d62728"
_MISMATCH_COLOR = "#ff7f0e"
_SNAPSHOT_COLOR = "#7f7f7f"
# matplotlib's tab10 less the colours of the marks above: a parameter's line is never taken
# for one; after these seven, the same colours dash-dotted.
_PARAM_COLORS = ("#1f77b4", "#2ca02c", "#9467bd", "#8c564b", "#e377c2", "#bcbd22", "#17becf")
_PROGRESS_STEPS = 100  # how many times writing the event files reports its progress

Progress = Callable[[int, int, str], None]


def write_pictures(
    history: History,
    plot: Path | None,
    tensorboard: Path | None,
    top: int,
    progress: Progress,
) -> None:
    """Write the figure to ``plot`` and the event files into ``tensorboard`` (either may be
    None).

    Both targets and both extras are checked before either is written, so a refusal leaves
    nothing behind.

    Args:
        history: the run's history, jumps found.
        plot: a ``.png`` or ``.svg`` file that does not exist yet.
        tensorboard: a directory that does not exist yet, or is empty.
        top: the parameters in the figure (the ones that jumped first, then the largest).
        progress: called with (done, total, unit) now and then.

    Raises:
        GradstatError: a target that exists (or a non-empty directory), a bad suffix, a
            missing extra; one line each.
    """
    if plot is not None:
        _check_plot_target(plot)
        _import_matplotlib()
    if tensorboard is not None:
        _check_tensorboard_target(tensorboard)
        _import_file_writer()
    if plot is not None:
        with warnings.catch_warnings():
            # Norms near float64's ends overflow matplotlib's log-scale arithmetic (numpy says
            # so on stderr); the figure is drawn all the same.
            warnings.simplefilter("ignore", RuntimeWarning)
            _write_plot(history, plot, top, progress)
    if tensorboard is not None:
        _write_tensorboard(history, tensorboard, progress)


def pick_series(history: History, top: int) -> list[ParamSeries]:
    """The ``top`` parameters to draw: those that jumped, the first to move first, then the
    largest by peak norm."""
    chosen = history.jumped()[:top]
    taken = {series.name for series in chosen}
    rest = sorted(
        (series for series in history.params.values() if series.name not in taken),
        key=lambda series: -series.peak(),
    )
    return chosen + rest[: top - len(chosen)]


def _check_plot_target(plot: Path) -> None:
    if plot.suffix.lower() not in PLOT_SUFFIXES:
        raise GradstatError(
            f"--plot {plot}: unknown suffix {plot.suffix or '(none)'!r}; "
            f"name a {' or '.join(PLOT_SUFFIXES)} file"
        )
    if os.path.lexists(plot):
        raise GradstatError(f"--plot {plot}: exists; remove it or choose another name")
    parent = plot.parent
    if not parent.is_dir():
        raise GradstatError(f"--plot {plot}: no such directory {parent}")


def _check_tensorboard_target(directory: Path) -> None:
    if os.path.lexists(directory):
        if not directory.is_dir():
            raise GradstatError(f"--tensorboard {directory}: exists and is not a directory")
        if any(directory.iterdir()):
            raise GradstatError(
                f"--tensorboard {directory}: exists and is not empty; remove it or choose "
                "another directory"
            )


def _import_matplotlib() -> None:
    try:
        import matplotlib  # noqa: F401
    except ImportError as error:
        raise GradstatError("--plot needs matplotlib: pip install 'gradstat[plot]'") from error


def _import_file_writer() -> Any:
    """torch's TensorBoard event-file writer (torch.utils.tensorboard needs tensorboard)."""
    try:
        from torch.utils.tensorboard.writer import FileWriter
    except ImportError as error:
        raise GradstatError(
            "--tensorboard needs tensorboard: pip install 'gradstat[plot]'"
        ) from error
    return FileWriter


# --- the figure ---------------------------------------------------------------------------


def _write_plot(history: History, plot: Path, top: int, progress: Progress) -> None:
    import matplotlib

    chosen = pick_series(history, top)
    # Only for the drawing, and no pyplot: the user's backend and global state stay as they
    # are. Long jagged lines draw in chunks (Agg refuses one path of too many cells); the SVG
    # keeps its text as text, searchable and smaller.
    with matplotlib.rc_context({"agg.path.chunksize": 10_000, "svg.fonttype": "none"}):
        figure = _figure(history, chosen, progress)
        _save(figure, plot)
    progress(len(chosen) + 1, len(chosen) + 1, "series")


def _figure(history: History, chosen: list[ParamSeries], progress: Progress) -> Figure:
    from matplotlib.figure import Figure

    width, height = FIGURE_PIXELS
    figure = Figure(figsize=(width / _DPI, height / _DPI), dpi=_DPI, layout="constrained")
    axes = figure.add_subplot()
    axes.set_yscale("log")
    axes.set_xlabel("step")
    axes.set_ylabel(
        f"gradient norm, log scale (total: {_norm_name(history.norm_type)}, "
        f"parameters: {_norm_name(history.param_norm_type)})"
    )
    axes.set_title(_title(history, len(chosen)), fontsize=10)
    axes.grid(True, which="major", alpha=0.3)
    axes.set_prop_cycle(
        color=[*_PARAM_COLORS, *_PARAM_COLORS],
        linestyle=["solid"] * len(_PARAM_COLORS) + ["dashdot"] * len(_PARAM_COLORS),
    )
    handles: list[Any] = []
    labels: list[str] = []

    def keep(handle: Any, label: str) -> None:
        handles.append(handle)
        labels.append(label)

    marks = _mark_steps(history, axes)
    total = _line(
        axes,
        history.steps,
        history.totals,
        color="black",
        linestyle="solid",
        linewidth=1.4,
        zorder=3,
    )
    keep(total, f"total ({_norm_name(history.norm_type)})")
    if any(value is not None for value in history.logged):
        logged = [math.nan if value is None else value for value in history.logged]
        line = _line(axes, history.steps, logged, color="black", linestyle=":", linewidth=1.0)
        keep(line, "logged by the job")
    for done, series in enumerate(chosen, 1):
        line = _line(axes, series.steps, series.norms, linewidth=1.0, zorder=2)
        label = _legend_text(series.name)
        if series.jump_step is not None:
            label = f"{label}: {series.jump_kind} at {series.jump_step}"
            _mark_jump(axes, series, line.get_color())
        keep(line, label)
        progress(done, len(chosen) + 1, "series")
    for handle, label in marks:
        keep(handle, label)
    if not any(value > 0 and math.isfinite(value) for value in _all_values(history, chosen)):
        axes.set_ylim(0.1, 10.0)  # nothing a log axis can show: keep it from failing
    figure.legend(handles, labels, loc="outside lower center", ncols=2, fontsize=8, frameon=False)
    return figure


def _title(history: History, shown: int) -> str:
    source = "telemetry log" if history.source == "log" else "snapshots"
    where = history.root
    first = f"gradstat history of {_legend_text(str(where))}" if where else "gradstat history"
    count = len(history.steps)
    span = f" ({history.steps[0]} .. {history.steps[-1]})" if count > 1 else ""
    return (
        f"{first}\nfrom its {source}: {count} step{'s' if count != 1 else ''}{span}; "
        f"the total and {shown} of {len(history.params)} parameters"
    )


def _mark_steps(history: History, axes: Axes) -> list[tuple[Any, str]]:
    """Vertical lines across the axes: snapshots (light), the mismatch trigger, and the steps
    whose total is NaN or Inf (a log axis has no place for them); their legend entries."""
    transform = axes.get_xaxis_transform()  # x in steps, y from the bottom (0) to the top (1)
    snapshots = sorted({kept.step for kept in history.snapshots})
    mismatches = [
        step
        for step, triggers in zip(history.steps, history.triggers, strict=True)
        if "mismatch" in triggers
    ]
    nonfinite = [
        step
        for step, total in zip(history.steps, history.totals, strict=True)
        if not math.isfinite(total)
    ]
    marks: tuple[tuple[list[int], str, Literal["solid", "dashed"], float, float, str], ...] = (
        (snapshots, _SNAPSHOT_COLOR, "solid", 0.8, 0.35, "snapshot"),
        (mismatches, _MISMATCH_COLOR, "dashed", 1.2, 0.9, "mismatch trigger"),
        (nonfinite, _NONFINITE_COLOR, "solid", 1.5, 0.8, "total NaN or Inf"),
    )
    found: list[tuple[Any, str]] = []
    for steps, color, style, width, alpha, what in marks:
        if steps:
            lines = axes.vlines(
                steps,
                0,
                1,
                transform=transform,
                colors=color,
                linestyles=style,
                linewidth=width,
                alpha=alpha,
                zorder=1,
            )
            plural = "s" if len(steps) != 1 else ""
            found.append((lines, f"{what} ({len(steps)} step{plural})"))
    return found


def _mark_jump(axes: Axes, series: ParamSeries, color: Any) -> None:
    """A marker at the first jump: on the line, or at the top edge where the norm there is
    non-finite (or zero) and the log axis has no place for it."""
    assert series.jump_step is not None
    norm = series.norms[series.steps.index(series.jump_step)]
    if math.isfinite(norm) and norm > 0:
        axes.plot(
            [series.jump_step],
            [norm],
            marker="o",
            markersize=7,
            color=color,
            markeredgecolor="black",
            linestyle="none",
            zorder=4,
        )
    else:
        axes.plot(
            [series.jump_step],
            [1.0],
            marker="v",
            markersize=8,
            color=color,
            markeredgecolor="black",
            linestyle="none",
            zorder=4,
            transform=axes.get_xaxis_transform(),
            clip_on=False,
        )


def _line(axes: Axes, steps: list[int], values: list[float], **style: Any) -> Any:
    """A line of the values a log axis can show, broken where it cannot; a dot for each
    value alone between two gaps, which a line would not show."""
    shown = _drawable(values)
    (line,) = axes.plot(steps, shown, **style)
    alone = [
        index
        for index, value in enumerate(shown)
        if not math.isnan(value)
        and (index == 0 or math.isnan(shown[index - 1]))
        and (index == len(shown) - 1 or math.isnan(shown[index + 1]))
    ]
    if alone and len(shown) > 1:
        axes.plot(
            [steps[index] for index in alone],
            [shown[index] for index in alone],
            marker=".",
            linestyle="none",
            color=line.get_color(),
            zorder=style.get("zorder", 2),
        )
    return line


def _drawable(values: list[float]) -> list[float]:
    """The values a log axis can show; NaN (a gap in the line) for the others."""
    return [value if value > 0 and math.isfinite(value) else math.nan for value in values]


def _all_values(history: History, chosen: list[ParamSeries]) -> Iterator[float]:
    yield from history.totals
    for series in chosen:
        yield from series.norms


def _legend_text(name: str) -> str:
    """A name as matplotlib shows it literally: printable, no mathtext, its middle cut when
    long."""
    from gradstat.cli.render import visible

    shown = visible(name)
    if len(shown) > _LABEL_CHARS:
        keep = _LABEL_CHARS - 3
        shown = f"{shown[: keep // 3]}...{shown[-(keep - keep // 3) :]}"
    return shown.replace("$", r"\$")


def _norm_name(norm_type: float) -> str:
    if norm_type == math.inf:
        return "max |g|"
    return "L2" if norm_type == 2 else f"L{norm_type:g}"


def _save(figure: Figure, plot: Path) -> None:
    """Save to a hidden file beside ``plot``, then link it to ``plot``: the link fails, and
    nothing is overwritten, if the name was taken meanwhile."""
    from gradstat.snapshot.writer import new_hidden_file

    handle, temporary = new_hidden_file(plot.parent, f".{plot.name}.")
    try:
        with os.fdopen(handle, "wb") as file:
            figure.savefig(file, format=plot.suffix.lower()[1:], dpi=_DPI)
            file.flush()
            os.fsync(file.fileno())
        os.link(temporary, plot)
    except FileExistsError as error:
        raise GradstatError(f"--plot {plot}: exists; remove it or choose another name") from error
    except OSError as error:
        raise GradstatError(f"--plot {plot}: cannot write ({error.strerror or error})") from error
    finally:
        if os.path.lexists(temporary):
            os.unlink(temporary)


# --- the event files ----------------------------------------------------------------------


def _write_tensorboard(history: History, directory: Path, progress: Progress) -> None:
    """One event per step holding every scalar of that step: one event per scalar, as
    ``SummaryWriter.add_scalar`` writes them, is about 6 times slower. Either way the time
    goes to tensorboard's pure-Python CRC32C of every byte (some 15 us a scalar)."""
    from tensorboard.compat.proto.summary_pb2 import Summary

    file_writer = _import_file_writer()
    try:
        directory.mkdir(parents=True, exist_ok=True)
    except OSError as error:
        raise GradstatError(
            f"--tensorboard {directory}: cannot create ({error.strerror or error})"
        ) from error
    steps = sorted(set(history.steps).union(*(series.steps for series in history.params.values())))
    rows = {step: index for index, step in enumerate(history.steps)}
    cursors = dict.fromkeys(history.params, 0)
    every = max(1, len(steps) // _PROGRESS_STEPS)
    writer = file_writer(str(directory), max_queue=1000, flush_secs=3600)
    try:
        for done, step in enumerate(steps, 1):
            values: list[tuple[str, float]] = []
            row = rows.get(step)
            if row is not None:
                values.extend(_total_values(history, row))
            for name, series in history.params.items():
                index = cursors[name]
                if index < len(series.steps) and series.steps[index] == step:
                    values.extend(_param_values(series, index))
                    cursors[name] = index + 1
            summary = Summary(
                value=[Summary.Value(tag=tag, simple_value=value) for tag, value in values]
            )
            writer.add_summary(summary, step)
            if done % every == 0 or done == len(steps):
                progress(done, len(steps), "steps")
        writer.flush()
    finally:
        writer.close()


def _total_values(history: History, row: int) -> Iterator[tuple[str, float]]:
    yield "total/grad_norm", history.totals[row]
    logged = history.logged[row]
    if logged is not None:
        yield "total/logged_norm", logged
    zeros = history.total_zeros[row]
    if zeros is not None:
        yield "total/num_zeros", float(zeros)


def _param_values(series: ParamSeries, index: int) -> Iterator[tuple[str, float]]:
    yield f"grad_norm/{series.name}", series.norms[index]
    if series.max_abs is not None:
        yield f"max_abs/{series.name}", series.max_abs[index]
    yield f"num_zeros/{series.name}", float(series.zeros[index])

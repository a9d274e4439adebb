"""The ``gradstat`` command line: parses arguments and renders results, computes nothing.

Importing this module must stay cheap: torch is imported only by the commands that need it, so
``gradstat --help`` and ``gradstat --version`` answer at once. stdout carries results only (a
table, or exactly one JSON document with ``--json``); errors, usage errors included, are one
line on stderr: ``gradstat: error: ...``.

Names and paths are shown as data: rich markup in them (``[/]``, ``[i]``) is printed literally,
and characters that are not printable (ESC, newlines, a lone surrogate from an undecodable byte
of a path) are written as ``repr`` writes them (``\\x1b``), in tables and error lines alike.
The JSON keeps the true strings; it is ASCII, so a lone surrogate is written as the escape
``\\udcff``, which Python's ``json`` reads back to the same string (``os.fsencode`` then gives
the original bytes).

Exit status: 0 fine, 1 findings (non-finite gradients, compare mismatches, audit findings), 2
bad input or usage, 141 when the reader of stdout leaves early (``gradstat norm DIR | head -1``):
the output stops quietly with the status a shell reports for ``cat`` or ``seq`` there, killed
by SIGPIPE (128 + 13). gradstat exits with that status rather than restoring SIGPIPE's default
action, which would let a closed socket under torchrun kill it without a word.
"""

from __future__ import annotations

import errno
import json
import math
import os
import sys
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer
from rich.console import Console
from typer.core import TyperGroup

from ._version import __version__

if TYPE_CHECKING:
    from typer._click.exceptions import UsageError

    from .analysis import SnapshotStats
    from .snapshot import RankFile, Snapshot
else:
    # typer exports one click exception on every release, whether it vendors click (0.2x on)
    # or depends on it: BadParameter, whose base class is click's UsageError.
    UsageError = typer.BadParameter.__base__

EXIT_FINDINGS, EXIT_BAD_INPUT = 1, 2
EXIT_BROKEN_PIPE = 128 + 13  # a shell's status for a tool killed by SIGPIPE

# torch without numpy warns at import; gradstat needs no numpy, and stderr is for errors.
warnings.filterwarnings("ignore", message="Failed to initialize NumPy")


def _fail(message: str) -> typer.Exit:
    """Print ``message`` as the one error line on stderr; the caller raises the returned Exit."""
    from .render import visible

    typer.echo(f"gradstat: error: {visible(message)}", err=True)
    return typer.Exit(EXIT_BAD_INPUT)


def _usage_error(error: UsageError) -> int:
    """One line for a usage error (unknown option, missing argument, bad value); its status."""
    if type(error).__name__ == "NoArgsIsHelpError":
        return error.exit_code  # a bare ``gradstat``: typer printed the help already
    message = error.format_message().rstrip(".")
    command = error.ctx.command_path if error.ctx is not None else "gradstat"
    _fail(f"{message[:1].lower()}{message[1:]}; see '{command} --help'")
    return error.exit_code


class _ResultConsole(Console):
    """rich's Console, leaving a closed pipe on stdout to ``_quiet_broken_pipe``.

    rich would exit with status 1 there, the status of findings.
    """

    def on_broken_pipe(self) -> None:
        self.quiet = True  # nothing more is drawn
        raise BrokenPipeError(errno.EPIPE, "the reader of stdout is gone")


@contextmanager
def _quiet_broken_pipe() -> Iterator[None]:
    """Write to stdout and flush; a reader gone early (``| head -1``) ends the run quietly.

    Raises:
        typer.Exit: status 141, when the pipe on stdout is closed.
    """
    try:
        yield
        sys.stdout.flush()
    except BrokenPipeError:
        # What is still buffered goes nowhere, so the flush at exit does not fail again.
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
        raise typer.Exit(EXIT_BROKEN_PIPE) from None


class _Commands(TyperGroup):
    """Typer's command group, with a usage error as one line on stderr instead of a panel."""

    def main(self, *args: Any, **kwargs: Any) -> Any:
        if not kwargs.get("standalone_mode", True):
            return super().main(*args, **kwargs)
        # Not standalone, typer raises a usage error instead of drawing it, and returns the
        # exit status instead of exiting with it; ``sys.exit`` then passes it on.
        kwargs["standalone_mode"] = False
        try:
            status = super().main(*args, **kwargs)
        except UsageError as error:
            status = _usage_error(error)
        sys.exit(status if isinstance(status, int) else 0)


app = typer.Typer(
    cls=_Commands,
    name="gradstat",
    help="Megatron-exact gradient norms, clipping and zero counts for sharded gradients.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    rich_markup_mode="markdown",  # docstring lines join into paragraphs, as in the source
)

SnapshotArg = Annotated[
    Path, typer.Argument(help="Snapshot directory (one rank-NNNNN.safetensors per rank).")
]
JsonOption = Annotated[
    bool, typer.Option("--json", help="Print exactly one JSON document on stdout.")
]
DeviceOption = Annotated[
    str,
    typer.Option(
        "--device", help="cpu, cuda (cuda:LOCAL_RANK under torchrun) or auto (cuda if any)."
    ),
]


def _finite(value: float) -> float:
    """Refuse inf and nan where a number of seconds or a tolerance is wanted (a usage error)."""
    if not math.isfinite(value):
        raise typer.BadParameter(f"{value} is not a finite number")
    return value


TimeoutOption = Annotated[
    float,
    typer.Option(
        "--timeout",
        min=1.0,
        callback=_finite,
        help="Seconds to wait for other processes under torchrun.",
    ),
]


@contextmanager
def _user_errors() -> Iterator[None]:
    """Turn gradstat's own errors (and the OS's) into one line on stderr and exit status 2."""
    from .errors import GradstatError

    try:
        yield
    except GradstatError as error:
        raise _fail(str(error)) from None
    except OSError as error:
        where = f"{error.filename}: " if error.filename else ""
        raise _fail(f"{where}{error.strerror or error}") from None


def _parse_norm_type(text: str) -> float:
    from .clip_grads import check_norm_type

    try:
        value = math.inf if text.strip().lower() in ("inf", "infinity") else float(text)
        return check_norm_type(value)
    except ValueError:
        message = f"--norm-type {text!r} is not supported; use 2, 1, inf or a number p > 0"
        raise _fail(message) from None


@contextmanager
def _progress(files: int, show: bool = True) -> Iterator[Callable[[RankFile], None] | None]:
    """A progress bar on stderr while ``files`` rank files are read, when stderr is a terminal."""
    if not show or not sys.stderr.isatty():
        yield None
        return
    from rich.progress import Progress

    with Progress(console=Console(stderr=True), transient=True) as progress:
        task = progress.add_task("reading rank files", total=files)
        yield lambda _: progress.advance(task)


def _statistics(
    snapshot_dir: Path,
    norm_types: tuple[float, ...],
    zeros: bool,
    device: str,
    timeout: float,
) -> tuple[Snapshot, SnapshotStats, bool]:
    """Open, validate and reduce the snapshot, in this process or over torchrun's.

    Returns the snapshot, its statistics, and whether this process prints (rank 0).
    """
    from .analysis import Request, merge
    from .runner import gather_pieces, pick_device, process_group
    from .snapshot import Snapshot

    with _user_errors(), process_group(timeout, sys.argv[1:], [snapshot_dir]) as place:
        snapshot = Snapshot.open(snapshot_dir)
        request = Request.make(norm_types, zeros, pick_device(device))
        with _progress(len(place.share(snapshot.files)), place.is_first) as on_file:
            pieces = gather_pieces(snapshot, request, place, on_file)
        return snapshot, merge(pieces, request), place.is_first


def _refuse_overflow(snapshot_dir: Path, stats: SnapshotStats, p: float, shown: str) -> None:
    """Refuse a norm larger than float64 holds although every gradient is finite.

    Only a tiny p gets there (the 0.01-norm of 2,000 ones is 2000^100): inf would look like a
    non-finite gradient, and clipping by it would zero every gradient.
    """
    if not stats.nonfinite and math.isinf(stats.norm(p)):
        raise _fail(
            f"{snapshot_dir}: the {shown}-norm of these gradients is larger than float64 holds "
            f"(1.8e308), although every gradient is finite; a larger --norm-type gives a smaller "
            f"norm"
        )


def _emit(as_json: bool, document: dict[str, Any], draw: Callable[[Console], None]) -> None:
    """Print the results: one JSON document (ASCII, names as they are), or rich tables."""
    with _quiet_broken_pipe():
        if as_json:
            sys.stdout.write(json.dumps(document, indent=2, allow_nan=False) + "\n")
        else:
            # A terminal gets its own width; a pipe or a log file gets tables that do not fold.
            # Names are data: no ``:name:`` code in them becomes an emoji.
            draw(_ResultConsole(width=None if sys.stdout.isatty() else 160, emoji=False))


def _print_version(value: bool) -> None:
    if value:
        typer.echo(f"gradstat {__version__}")
        raise typer.Exit()


@app.callback()
def _root(
    version: Annotated[
        bool,
        typer.Option(
            "--version", callback=_print_version, is_eager=True, help="Print the version and exit."
        ),
    ] = False,
) -> None:
    """Megatron-exact gradient norms, clipping and zero counts for sharded gradients."""


@app.command()
def norm(
    snapshot_dir: SnapshotArg,
    norm_type: Annotated[
        str, typer.Option("--norm-type", "-p", help="2, 1, inf, or any number p > 0.")
    ] = "2",
    max_norm: Annotated[
        float | None,
        typer.Option("--max-norm", help="Also show the clip coefficient for this max norm."),
    ] = None,
    top: Annotated[
        int, typer.Option("--top", min=1, help="Parameters to list (largest first).")
    ] = 20,
    as_json: JsonOption = False,
    device: DeviceOption = "cpu",
    timeout: TimeoutOption = 30.0,
) -> None:
    """The global gradient norm as Megatron computes it, and each parameter's share.

    Exit status 1 when a gradient holds NaN or Inf (they are located by rank and parameter).
    """
    p = _parse_norm_type(norm_type)
    if max_norm is not None and not (math.isfinite(max_norm) and max_norm > 0):
        raise _fail(f"--max-norm must be a positive number, got {max_norm}")
    from .render import print_norm
    from .report import norm_report

    snapshot, stats, prints = _statistics(snapshot_dir, (p,), False, device, timeout)
    if not prints:
        return
    _refuse_overflow(snapshot_dir, stats, p, norm_type)
    report = norm_report(snapshot, stats, p, max_norm, top)
    _emit(as_json, report.to_json(), lambda console: print_norm(console, report))
    if report.nonfinite:
        raise typer.Exit(EXIT_FINDINGS)


@app.command()
def zeros(
    snapshot_dir: SnapshotArg,
    as_json: JsonOption = False,
    device: DeviceOption = "cpu",
    timeout: TimeoutOption = 30.0,
) -> None:
    """num_zeros as Megatron counts it (GTP padding excluded), and per parameter."""
    from .render import print_zeros
    from .report import zeros_report

    snapshot, stats, prints = _statistics(snapshot_dir, (), True, device, timeout)
    if not prints:
        return
    report = zeros_report(snapshot, stats)
    _emit(as_json, report.to_json(), lambda console: print_zeros(console, report))


@app.command()
def clip(
    snapshot_dir: SnapshotArg,
    max_norm: Annotated[float, typer.Option("--max-norm", help="The largest total norm allowed.")],
    out: Annotated[Path, typer.Option("--out", help="New directory for the clipped snapshot.")],
    norm_type: Annotated[
        str, typer.Option("--norm-type", "-p", help="Norm to clip by: 2, 1, inf or p > 0.")
    ] = "2",
    allow_nonfinite: Annotated[
        bool,
        typer.Option(
            "--allow-nonfinite",
            help="Write the output even when the norm is NaN/Inf (gradients are then copied "
            "unchanged, as Megatron leaves them).",
        ),
    ] = False,
    as_json: JsonOption = False,
    device: DeviceOption = "cpu",
    timeout: TimeoutOption = 30.0,
) -> None:
    """Write a clipped copy of a snapshot (clip_grad_by_total_norm_fp32 semantics).

    The input is never modified; DIR must be new or empty and not inside the input. The copy
    appears atomically: a killed run leaves nothing that looks complete.
    """
    p = _parse_norm_type(norm_type)
    if not (math.isfinite(max_norm) and max_norm > 0):
        raise _fail(f"--max-norm must be a positive number, got {max_norm}")
    from .clip_grads import clip_coefficient
    from .render import print_clip
    from .report import ClipReport
    from .snapshot.clip import check_output_dir, write_clipped

    with _user_errors():
        check_output_dir(snapshot_dir, out)
    snapshot, stats, prints = _statistics(snapshot_dir, (p,), False, device, timeout)
    if not prints:
        return  # rank 0 alone writes the copy
    _refuse_overflow(snapshot_dir, stats, p, norm_type)
    with _user_errors():
        total = stats.norm(p)
        if not math.isfinite(total) and not allow_nonfinite:
            raise _fail(
                f"{snapshot_dir}: the {norm_type} norm is {total}; refusing to write a clipped "
                f"copy of non-finite gradients (gradstat norm locates them; "
                f"--allow-nonfinite writes it anyway)"
            )
        coefficient = clip_coefficient(max_norm, total)
        with _progress(len(snapshot.files)) as on_file:
            write_clipped(snapshot, out, coefficient, on_file)
    report = ClipReport(str(snapshot_dir), str(out), p, max_norm, total, coefficient)
    _emit(as_json, report.to_json(), lambda console: print_clip(console, report))


RtolOption = Annotated[
    float, typer.Option("--rtol", min=0.0, callback=_finite, help="Relative tolerance.")
]


@app.command()
def compare(
    snapshot_a: Annotated[Path, typer.Argument(help="First snapshot directory (A).")],
    snapshot_b: Annotated[Path, typer.Argument(help="Second snapshot directory (B).")],
    rtol: RtolOption = 1e-5,
    show_all: Annotated[
        bool, typer.Option("--all", help="List every parameter, not only the flagged ones.")
    ] = False,
    as_json: JsonOption = False,
    device: DeviceOption = "cpu",
    timeout: TimeoutOption = 30.0,
) -> None:
    """Two snapshots of one model, parameter by parameter, whatever their layouts.

    Norms, zeros and, where both sides can be rebuilt into full tensors, the largest
    elementwise difference. Exit status 1 when anything is flagged.
    """
    from .compare import compare_snapshots
    from .render import print_compare
    from .runner import pick_device, process_group
    from .snapshot import Snapshot

    with _user_errors(), process_group(timeout, sys.argv[1:], [snapshot_a, snapshot_b]) as place:
        snapshots = Snapshot.open(snapshot_a), Snapshot.open(snapshot_b)
        report = compare_snapshots(*snapshots, place, rtol, pick_device(device))
        if not place.is_first:
            return
    _emit(as_json, report.to_json(), lambda console: print_compare(console, report, show_all))
    if report.flagged:
        raise typer.Exit(EXIT_FINDINGS)


@app.command()
def audit(
    snapshot_dir: SnapshotArg,
    rtol: RtolOption = 0.0,
    as_json: JsonOption = False,
    device: DeviceOption = "cpu",
    timeout: TimeoutOption = 30.0,
) -> None:
    """Check the gradients against what their attributes promise.

    Copies that must be equal (TP/ETP and GTP replicas, tied embeddings, data-parallel
    replicas of a plain optimizer), GTP padding that must be zero, attributes that must agree
    with each other and with the shapes. Each finding gives the global norm had it been counted
    the other way. Copies are equal when max |a - b| <= rtol * max |x| (default: bitwise).
    Exit status 1 when there is any finding.
    """
    from .audit import audit_snapshot
    from .render import print_audit
    from .runner import pick_device, process_group
    from .snapshot import Snapshot

    with _user_errors(), process_group(timeout, sys.argv[1:], [snapshot_dir]) as place:
        report = audit_snapshot(Snapshot.open(snapshot_dir), place, rtol, pick_device(device))
        if not place.is_first:
            return
    _emit(as_json, report.to_json(), lambda console: print_audit(console, report))
    if report.findings:
        raise typer.Exit(EXIT_FINDINGS)


@app.command()
def inspect(snapshot_dir: SnapshotArg, as_json: JsonOption = False) -> None:
    """What gradstat rebuilt: world size, axes, files, and each parameter's attributes."""
    from .render import print_inspect
    from .report import inspect_report
    from .snapshot import Snapshot

    with _user_errors():
        report = inspect_report(Snapshot.open(snapshot_dir))
    _emit(as_json, report.to_json(), lambda console: print_inspect(console, report))


@app.command()
def version() -> None:
    """Print gradstat's version and the torch it runs on."""
    import torch

    typer.echo(f"gradstat {__version__} (torch {torch.__version__})")


def main() -> None:
    """Console-script entry point."""
    app()

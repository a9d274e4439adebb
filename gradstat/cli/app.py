"""The ``gradstat`` command line: parses arguments and renders results, computes nothing.

Importing this module must stay cheap: torch is imported only by the commands that need it, so
``gradstat --help`` and ``gradstat --version`` answer at once. stdout carries results only (a
table, or exactly one JSON document with ``--json``); errors, usage errors included, are one
line on stderr: ``gradstat: error: ...``. Progress bars go to stderr, on a terminal only.

Names and paths are shown as data: rich markup in them (``[/]``, ``[i]``) is printed literally,
and characters that are not printable (ESC, newlines, a lone surrogate from an undecodable byte
of a path) are written as ``repr`` writes them (``\\x1b``), in tables and error lines alike.
The JSON keeps the true strings; it is ASCII, so a lone surrogate is written as the escape
``\\udcff``, which Python's ``json`` reads back to the same string (``os.fsencode`` then gives
the original bytes).

``gradstat -v COMMAND`` says on stderr what happened (the snapshot read, the kernels that ran, the
process group under torchrun), ``-vv`` more: the ``gradstat`` loggers' INFO and DEBUG records.
Without it stderr carries errors and warnings only. A warning of gradstat's own (the native
kernel's fallback to PyTorch) is one line, ``gradstat: warning: ...``, once per machine under
torchrun.

Exit status: 0 fine, 1 findings (non-finite or all-zero gradients, compare mismatches, audit
findings), 2 bad input or usage, 141 when the reader of stdout leaves early (``gradstat norm
DIR | head -1``): the output stops quietly with the status a shell reports for ``cat`` or
``seq`` there, killed by SIGPIPE (128 + 13). gradstat exits with that status rather than
restoring SIGPIPE's default action, which would let a closed socket under torchrun kill it
without a word. torchrun turns any failing status into 1: ``--status-file`` keeps it.

Under torchrun, process 0 alone prints, results and errors alike: an error every process meets
(bad input, a usage error) is said once, by process 0, and the others leave quietly once it has
left the process group; a lost process is named by each process that notices it, since
torchrun may stop process 0 first.
"""

from __future__ import annotations

import errno
import gc
import json
import logging
import math
import os
import sys
import tempfile
import warnings
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer
from rich.console import Console
from typer.core import TyperGroup

from gradstat._version import __version__
from gradstat.errors import (
    DumpWarning,
    GradstatError,
    NativeKernelWarning,
    SnapshotError,
    StoppedTogether,
)

if TYPE_CHECKING:
    from typer._click.exceptions import UsageError

    from gradstat.analysis.stats import SnapshotStats
    from gradstat.cli.render import ProgressBars
    from gradstat.distributed.runner import Processes, Progress
    from gradstat.snapshot import Snapshot, SnapshotShare
    from gradstat.snapshot.wgrads import WgradsOptions
else:
    # typer exports one click exception on every release, whether it vendors click (0.2x on)
    # or depends on it: BadParameter, whose base class is click's UsageError.
    UsageError = typer.BadParameter.__base__

_log = logging.getLogger(__name__)

EXIT_FINDINGS, EXIT_BAD_INPUT = 1, 2
EXIT_BROKEN_PIPE = 128 + 13  # a shell's status for a tool killed by SIGPIPE

TORCHRUN = "torchrun --standalone --nproc-per-node N -m gradstat norm SNAPSHOT"


def _say_error(message: str) -> None:
    """Print ``message`` as the one error line on stderr."""
    from gradstat.cli.render import visible

    typer.echo(f"gradstat: error: {visible(message)}", err=True)


def _one_line_warnings(show: Callable[..., None]) -> Callable[..., None]:
    """``warnings.showwarning`` while a command runs: gradstat's own warnings as one line,
    others as ``show`` shows them.

    The native kernel's fallback is the same on every process of a machine: under torchrun the
    first process of each machine says it.
    """

    def show_warning(
        message: Warning | str, category: type[Warning], *where: Any, **more: Any
    ) -> None:
        if not issubclass(category, (NativeKernelWarning, DumpWarning)):
            show(message, category, *where, **more)
        else:  # the kernel's fallback is of the machine, not of the numbers: stderr alone
            _warning_line(str(message), about_data=category is not NativeKernelWarning)

    return show_warning


def _warning_line(line: str, about_data: bool = True) -> None:
    """One warning: on stderr (once per machine under a launcher), and, ``about_data``, in
    the JSON document's ``warnings``."""
    if _SESSIONS and about_data:
        _SESSIONS[-1].warnings.append(line)
    if os.environ.get("LOCAL_RANK", "0") == "0":
        from gradstat.cli.render import visible

        typer.echo(f"gradstat: warning: {visible(line)}", err=True)


def _message(error: GradstatError | OSError) -> str:
    if isinstance(error, OSError):
        where = f"{error.filename}: " if error.filename else ""
        return f"{where}{error.strerror or error}"
    return str(error)


def _usage_message(error: UsageError) -> str:
    """The one line for a usage error (unknown option, missing argument, bad value)."""
    message = error.format_message().rstrip(".")
    command = error.ctx.command_path if error.ctx is not None else "gradstat"
    return f"{message[:1].lower()}{message[1:]}; see '{command} --help'"


def _option_value(arguments: Sequence[str], name: str) -> str | None:
    """The value given to option ``name`` in ``arguments``, read before (or without) parsing,
    so that a usage error elsewhere on the line still finds it."""
    value = None
    for index, argument in enumerate(arguments):
        if argument == "--":
            break
        if argument == name and index + 1 < len(arguments):
            value = arguments[index + 1]
        elif argument.startswith(f"{name}="):
            value = argument[len(name) + 1 :]
    return value


class _Session:
    """One run of the command line: the processes it joined, its progress bars, its status.

    Under a launcher, the process group is left last, once the error line and the status file
    are written: the processes that keep quiet about an error wait for process 0 to leave.
    """

    def __init__(self, arguments: Sequence[str]) -> None:
        self.arguments = list(arguments)
        self.processes: Processes | None = None
        self.joining = False  # set once this process tried to join the others
        self.timeout_s = 30.0
        self.bars: ProgressBars | None = None
        self.status_file = _option_value(self.arguments, "--status-file")
        self.log_handler: logging.Handler | None = None
        self.log_level = logging.NOTSET
        self.warnings: list[str] = []  # gradstat's warnings, one line each, as said on stderr

    def log_to_stderr(self, level: int) -> None:
        """Show the ``gradstat`` loggers' records from ``level`` up on stderr while this run
        lasts (:meth:`stop_logging`), each line naming the process under a launcher."""
        from gradstat.distributed.launcher import launch_rank, launched

        handler = logging.StreamHandler(sys.stderr)
        process = f"[{launch_rank()}]" if launched() else ""
        form = f"gradstat{process}: %(levelname)s %(name)s: %(message)s"
        handler.setFormatter(logging.Formatter(form))
        logger = logging.getLogger("gradstat")
        self.stop_logging()
        self.log_handler, self.log_level = handler, logger.level
        logger.addHandler(handler)
        logger.setLevel(level)

    def stop_logging(self) -> None:
        if self.log_handler is not None:
            logger = logging.getLogger("gradstat")
            logger.removeHandler(self.log_handler)
            logger.setLevel(self.log_level)
            self.log_handler = None

    def speaks(self) -> bool:
        """Whether this process prints: alone, or process 0 under a launcher."""
        if self.processes is not None:
            return self.processes.is_first
        from gradstat.distributed.launcher import launch_rank

        return launch_rank() == 0

    def begin(self) -> None:
        """Remove an old status file, so that one left by another run is never read as ours.

        Raises:
            OSError: it cannot be removed.
        """
        if self.status_file is not None and self.speaks():
            Path(self.status_file).unlink(missing_ok=True)

    def join(
        self, timeout_s: float, snapshot_dirs: Sequence[Path], as_json: bool = False
    ) -> Processes:
        """Join the launcher's processes (or stay alone) and agree with them on the command.

        Progress bars are drawn on process 0 when stderr is an interactive terminal and the
        output is not JSON.
        """
        from gradstat.cli.render import ProgressBars
        from gradstat.distributed.runner import agree, join

        self.timeout_s, self.joining = timeout_s, True
        console = Console(stderr=True)
        if not as_json and console.is_interactive:
            self.bars = ProgressBars(console)
        self.processes = join(timeout_s, self.bars)
        if self.processes.size > 1:
            where = f"{os.environ.get('MASTER_ADDR')}:{os.environ.get('MASTER_PORT')}"
            rank, size = self.processes.rank, self.processes.size
            _log.info("process %d of %d: joined the gloo group at %s", rank, size, where)
        agree(self.processes, self.arguments, snapshot_dirs)
        return self.processes

    def report(self, progress: Progress) -> None:
        if self.bars is not None:
            self.bars(progress)

    def stop_progress(self) -> None:
        if self.bars is not None:
            self.bars.stop()

    def failed(self, message: str, stopped_together: bool = False) -> int:
        """Say ``message`` once for all the processes; the exit status (2).

        Under a launcher, a process that fails before joining the others joins them to stop
        together (they are waiting in the agreement): process 0 then says the first error.
        """
        if not stopped_together and not self.joining:
            from gradstat.distributed.launcher import launched

            if launched():
                from gradstat.distributed.runner import join, together

                self.joining = True
                try:
                    self.processes = join(self.timeout_s)
                    together(self.processes, lambda: _raise(GradstatError(message)))
                except StoppedTogether as stopped:
                    if stopped.quiet:
                        return EXIT_BAD_INPUT
                    message = str(stopped)
                except GradstatError:
                    pass  # the others are gone: this process says it
        self.stop_progress()
        _say_error(message)
        return EXIT_BAD_INPUT

    def close(self, status: int) -> int:
        """Write the status file (the process that prints), then leave the process group.

        Returns:
            The exit status: ``status``, or 2 when the status file cannot be written.
        """
        self.stop_progress()
        try:
            if self.status_file is not None and self.speaks():
                try:
                    _write_status(Path(self.status_file), status)
                except OSError as error:
                    _say_error(f"{self.status_file}: cannot write the exit status ({error})")
                    status = EXIT_BAD_INPUT
        finally:
            if self.processes is not None:
                from gradstat.distributed.runner import leave

                leave(self.processes)
        return status


def _raise(error: Exception) -> Any:
    raise error


def _write_status(path: Path, status: int) -> None:
    """Write ``status`` into ``path`` (replaced whole: a reader never sees half a file)."""
    parent = path.parent if str(path.parent) else Path(".")
    descriptor, temporary = tempfile.mkstemp(prefix=f".{path.name}.", dir=parent)
    try:
        with os.fdopen(descriptor, "w") as file:
            file.write(f"{status}\n")
        os.replace(temporary, path)
    except BaseException:
        Path(temporary).unlink(missing_ok=True)
        raise


_SESSIONS: list[_Session] = []  # the runs in progress, the current one last


def _session() -> _Session:
    assert _SESSIONS, "gradstat's commands run through the app, which opens a session"
    return _SESSIONS[-1]


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
    """Typer's command group, with errors (usage errors too) as one line on stderr, said once
    under torchrun, and the exit status written where ``--status-file`` asks."""

    def main(self, *args: Any, **kwargs: Any) -> Any:
        if not kwargs.get("standalone_mode", True):
            return super().main(*args, **kwargs)
        # Not standalone, typer raises a usage error instead of drawing it, and returns the
        # exit status instead of exiting with it; ``sys.exit`` then passes it on.
        kwargs["standalone_mode"] = False
        given = kwargs.get("args", args[0] if args else None)
        session = _Session(sys.argv[1:] if given is None else given)
        with warnings.catch_warnings():
            # torch without numpy warns at import; gradstat needs no numpy, stderr is for errors.
            warnings.filterwarnings("ignore", message="Failed to initialize NumPy")
            warnings.showwarning = _one_line_warnings(warnings.showwarning)
            status = self._run(session, *args, **kwargs)
        sys.exit(status)

    def _run(self, session: _Session, *args: Any, **kwargs: Any) -> int:
        """Run the command in ``session``; its exit status."""
        _SESSIONS.append(session)
        try:
            try:
                session.begin()
                status = super().main(*args, **kwargs)
                status = status if isinstance(status, int) else 0
            except UsageError as error:
                if type(error).__name__ == "NoArgsIsHelpError":
                    status = error.exit_code  # a bare ``gradstat``: typer printed the help
                else:
                    session.failed(_usage_message(error))
                    status = error.exit_code
            except StoppedTogether as error:
                status = EXIT_BAD_INPUT if error.quiet else session.failed(str(error), True)
            except (GradstatError, OSError) as error:
                status = session.failed(_message(error))
            status = session.close(status)
        finally:
            session.stop_logging()
            _SESSIONS.remove(session)
        return status


app = typer.Typer(
    cls=_Commands,
    name="gradstat",
    help=(
        "Megatron-exact gradient norms, clipping and zero counts for sharded gradients.\n\n"
        f"Under torchrun, from any directory: `{TORCHRUN}` (torchrun runs `-m gradstat` with "
        "its own Python; a bare `gradstat` would be taken for a script in the current "
        "directory). Process 0 prints; torchrun reports any failure as exit status 1, so "
        "`--status-file PATH` writes gradstat's own (0, 1, 2) into PATH."
    ),
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
# The session reads the option itself (``_option_value``), so that a usage error elsewhere on
# the line is written too; the commands only declare it.
StatusFileOption = Annotated[
    Path | None,
    typer.Option(
        "--status-file",
        help="Write the exit status (0, 1, 2 or 141) into this file at the end, from process 0 "
        "under torchrun (which reports any failure as 1); removed first, so a missing file "
        "means the run did not finish.",
        # Not read, only written: under torchrun process 0 removes it while the others parse
        # their arguments, and a readability check there failed them now and then.
        readable=False,
    ),
]

# A Megatron wgrads dump (`--save-wgrads-interval`) says no attribute: what its files do not
# tell, the user states (gradstat.snapshot.wgrads).
TpShardedOption = Annotated[
    list[str] | None,
    typer.Option(
        "--tp-sharded",
        metavar="PATTERN=DIM",
        help="Megatron wgrads dumps: parameters whose local name matches PATTERN (fnmatch) are "
        "split over tensor parallelism along DIM (0 column-parallel, 1 row-parallel). "
        "Repeatable; before the built-in naming rules.",
    ),
]
TpReplicatedOption = Annotated[
    list[str] | None,
    typer.Option(
        "--tp-replicated",
        metavar="PATTERN",
        help="Megatron wgrads dumps: parameters matching PATTERN are full copies on every TP "
        "rank. Repeatable.",
    ),
]
EtpOption = Annotated[
    int | None,
    typer.Option(
        "--etp",
        help=(
            "Megatron wgrads dumps: the expert TP size, where the files do not tell it; one "
            "over the TP size cannot be told from the files (assumed TP) and is refused."
        ),
    ),
]
GtpOption = Annotated[
    int | None,
    typer.Option("--gtp", help="Megatron wgrads dumps: the job's GTP size (> 1 is refused)."),
]
TiedOutputOption = Annotated[
    str,
    typer.Option(
        "--tied-output",
        help="Megatron wgrads dumps: whether the last stage's output_layer.weight is the "
        "embedding's tied copy: yes, no, or auto (equal gradients: tied).",
    ),
]
KindOption = Annotated[
    str | None,
    typer.Option(
        "--kind",
        help="PyTorch distributed checkpoints: which tensors to read: grad, weight, exp_avg, "
        "exp_avg_sq or all (default: grad when it holds gradients, else weight).",
    ),
]


def _layout(
    tp_sharded: list[str] | None,
    tp_replicated: list[str] | None,
    etp: int | None,
    gtp: int | None,
    tied_output: str,
    kind: str | None = None,
) -> WgradsOptions:
    from gradstat.snapshot.wgrads import WgradsOptions

    return WgradsOptions.parse(tp_sharded or (), tp_replicated or (), etp, gtp, tied_output, kind)


def _finite(value: float) -> float:
    """Refuse inf and nan where a number of seconds or a tolerance is wanted (a usage error)."""
    if not math.isfinite(value):
        raise typer.BadParameter(f"{value} is not a finite number")
    return value


def _timeout(value: float) -> float:
    """A finite number of seconds, kept for the session: an error before the processes join
    waits that long for them."""
    _session().timeout_s = _finite(value)
    return value


TimeoutOption = Annotated[
    float,
    typer.Option(
        "--timeout",
        min=1.0,
        callback=_timeout,
        help="Seconds to wait for other processes under torchrun.",
    ),
]


def _parse_norm_type(text: str) -> float:
    from gradstat.clip_grads import check_norm_type

    try:
        value = math.inf if text.strip().lower() in ("inf", "infinity") else float(text)
        return check_norm_type(value)
    except ValueError:
        message = f"--norm-type {text!r} is not supported; use 2, 1, inf or a number p > 0"
        raise GradstatError(message) from None


def _refuse_run_dir(*snapshot_dirs: Path) -> None:
    """Refuse a directory of snapshots (the flight recorder's run directory, holding step-N
    folders) where one snapshot is wanted, naming the snapshots it holds.

    Raises:
        GradstatError: ``snapshot_dir`` holds no rank file but folders that do.
    """
    from gradstat.analysis.history import find_snapshots
    from gradstat.snapshot.reader import holds_rank_files

    for snapshot_dir in snapshot_dirs:
        try:
            if holds_rank_files(snapshot_dir):
                continue
            found = [path.name for path in find_snapshots(snapshot_dir)]
        except (OSError, SnapshotError):
            continue  # no snapshots inside: the reader says what is wrong with it
        named = found if len(found) <= 4 else [*found[:2], "...", found[-1]]
        noun = "snapshot" if len(found) == 1 else "snapshots"
        raise GradstatError(
            f"{snapshot_dir} holds {len(found)} {noun} ({', '.join(named)}), not rank files; "
            f"pass one of them, or use gradstat history {snapshot_dir}"
        )


def _statistics(
    snapshot_dir: Path,
    norm_types: tuple[float, ...],
    zeros: bool,
    device: str,
    timeout: float,
    as_json: bool,
    layout: WgradsOptions,
    split_experts: bool = False,
) -> tuple[Snapshot | SnapshotShare, SnapshotStats, bool]:
    """Open, validate and reduce the snapshot, in this process or over torchrun's (each
    process validating its share of the rank files); with ``split_experts``, each expert's
    row of stacked expert tensors too.

    Returns the snapshot (under torchrun, this process's share), its statistics, and whether
    this process prints (rank 0).
    """
    from gradstat.analysis import coverage
    from gradstat.analysis.stats import Request, gather_pieces, merge
    from gradstat.distributed.runner import open_shared, pick_device, together

    _refuse_run_dir(snapshot_dir)
    processes = _session().join(timeout, [snapshot_dir], as_json)
    snapshot = open_shared(processes, snapshot_dir, layout)
    where = together(processes, lambda: pick_device(device))
    request = Request.make(norm_types, zeros, where, split_experts)
    stats = merge(gather_pieces(snapshot, request, processes), request)
    together(processes, lambda: coverage.check(snapshot_dir, stats.miscounts))
    return snapshot, stats, processes.is_first


def _refuse_overflow(snapshot_dir: Path, stats: SnapshotStats, p: float, shown: str) -> None:
    """Refuse a norm larger than float64 holds although every gradient is finite.

    Only a tiny p gets there (the 0.01-norm of 2,000 ones is 2000^100): inf would look like a
    non-finite gradient, and clipping by it would zero every gradient.
    """
    if not stats.nonfinite and math.isinf(stats.norm(p)):
        raise GradstatError(
            f"{snapshot_dir}: the {shown}-norm of these gradients is larger than float64 holds "
            f"(1.8e308), although every gradient is finite; a larger --norm-type gives a smaller "
            f"norm"
        )


def json_text(value: Any, depth: int = 0) -> str:
    """``value`` as JSON indented by two spaces, each item of a list of objects (a report's
    rows) on a line of its own, which the C encoder writes, where the indenting one is pure
    Python (16,384 rows of ``norm --json``: 120 ms indented, 58 ms a row per line)."""
    inner = "  " * (depth + 1)
    if isinstance(value, dict) and value:
        items = [
            f"{inner}{json.dumps(key)}: {json_text(item, depth + 1)}" for key, item in value.items()
        ]
        return "{\n" + ",\n".join(items) + "\n" + "  " * depth + "}"
    if isinstance(value, list) and value and all(isinstance(item, dict) for item in value):
        return "[\n" + inner + _rows(value, ",\n" + inner) + "\n" + "  " * depth + "]"
    if isinstance(value, list) and any(isinstance(item, (dict, list)) for item in value):
        items = [inner + json_text(item, depth + 1) for item in value]
        return "[\n" + ",\n".join(items) + "\n" + "  " * depth + "]"
    return _ENCODER.encode(value)


_ENCODER = json.JSONEncoder(allow_nan=False)  # one for all: json.dumps makes one per call


def _rows(items: list[dict[str, Any]], between: str) -> str:
    """A list of objects, each encoded on its own, joined by ``between``.

    Report rows (flat objects that all begin with one key) are encoded in one call, and parted
    where one object ends and the next begins with that key: ``}, {"name": `` never lies
    inside a string, whose quotes the encoder escapes (a string may end in ``}, {``, but its
    closing quote is followed by a comma or a brace, not by the key)."""
    first = next(iter(items[0]), None)
    if first is not None and all(
        next(iter(row), None) == first
        and not any(isinstance(v, (dict, list)) for v in row.values())
        for row in items
    ):
        key = _ENCODER.encode(first)
        return _ENCODER.encode(items)[1:-1].replace(
            "}, {" + key + ": ", "}" + between + "{" + key + ": "
        )
    return between.join(map(_ENCODER.encode, items))


def _emit(as_json: bool, document: dict[str, Any], draw: Callable[[Console], None]) -> None:
    """Print the results: one JSON document (ASCII, names as they are), or rich tables; under
    a launcher, process 0 alone (every process of ``inspect`` or a log's ``history`` has them)."""
    if not _session().speaks():
        return
    _session().stop_progress()
    with _quiet_broken_pipe():
        if as_json:
            # What stderr warned of travels with the numbers (a dump that may lack a file).
            document = {**document, "warnings": _session().warnings}
            sys.stdout.write(json_text(document) + "\n")
        else:
            # A terminal gets its own width, as does a pipe given COLUMNS; a pipe or a log file
            # without it, 160 columns. Tables never break a word whatever the width (render.py).
            # Names are data: no ``:name:`` code in them becomes an emoji.
            given = os.environ.get("COLUMNS", "").isdigit() or sys.stdout.isatty()
            draw(_ResultConsole(width=None if given else 160, emoji=False))


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
    verbose: Annotated[
        int,
        typer.Option(
            "--verbose",
            "-v",
            count=True,
            help="Say on stderr what happened (snapshot read, kernels, process group); -vv more. "
            "Before the command: `gradstat -v norm DIR`.",
        ),
    ] = 0,
) -> None:
    """Megatron-exact gradient norms, clipping and zero counts for sharded gradients."""
    if verbose:
        _session().log_to_stderr(logging.INFO if verbose == 1 else logging.DEBUG)


# Rows of norm and zeros: one per parameter, or one per MoE expert (gradstat.analysis.experts).
ByOption = Annotated[
    str,
    typer.Option(
        "--by",
        help="param (a row per parameter) or expert (a row per MoE expert, by its global "
        "index; dense parameters in one row).",
    ),
]


def _by_expert(by: str) -> bool:
    """Whether ``--by`` asks for expert rows."""
    if by not in ("param", "expert"):
        raise GradstatError(f"--by {by!r} is not a row kind; use param or expert")
    return by == "expert"


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
        int | None,
        typer.Option(
            "--top",
            min=1,
            help="Parameters to list, largest first (the table: 20 unless given; the JSON: "
            "every one unless given, then also how many were left out).",
        ),
    ] = None,
    by: ByOption = "param",
    as_json: JsonOption = False,
    device: DeviceOption = "cpu",
    timeout: TimeoutOption = 30.0,
    tp_sharded: TpShardedOption = None,
    tp_replicated: TpReplicatedOption = None,
    etp: EtpOption = None,
    gtp: GtpOption = None,
    tied_output: TiedOutputOption = "auto",
    kind: KindOption = None,
    status_file: StatusFileOption = None,
) -> None:
    """The global gradient norm as Megatron computes it, and each parameter's share (with
    --by expert, each MoE expert's).

    Exit status 1 when a gradient holds NaN or Inf (they are located by rank and parameter),
    or when every gradient is zero (a snapshot dumped before the backward pass?).
    """
    p = _parse_norm_type(norm_type)
    per_expert = _by_expert(by)
    if max_norm is not None and not (math.isfinite(max_norm) and max_norm > 0):
        raise GradstatError(f"--max-norm must be a positive number, got {max_norm}")
    from gradstat.analysis.report import norm_report
    from gradstat.cli.render import print_norm

    snapshot, stats, prints = _statistics(
        snapshot_dir,
        (p,),
        False,
        device,
        timeout,
        as_json,
        _layout(tp_sharded, tp_replicated, etp, gtp, tied_output, kind),
        per_expert,
    )
    if not prints:
        return
    _refuse_overflow(snapshot_dir, stats, p, norm_type)
    shown = top if as_json else (top or 20)
    report = norm_report(snapshot, stats, p, max_norm, shown, per_expert)
    _emit(as_json, report.to_json(), lambda console: print_norm(console, report))
    findings = (report.nonfinite, report.all_zero, report.nonfinite_not_counted)
    if any(findings) or report.recorded_norm_differs:
        raise typer.Exit(EXIT_FINDINGS)


@app.command()
def zeros(
    snapshot_dir: SnapshotArg,
    top: Annotated[
        int | None,
        typer.Option(
            "--top",
            min=1,
            help="Parameters to list, in --sort order (the table: 20 unless given; the JSON: "
            "every one unless given, then also how many were left out).",
        ),
    ] = None,
    sort: Annotated[
        str,
        typer.Option(
            "--sort",
            help="zeros (most zeros first), sparsity (sparsest first) or module (the "
            "snapshot's order).",
        ),
    ] = "zeros",
    by: ByOption = "param",
    as_json: JsonOption = False,
    device: DeviceOption = "cpu",
    timeout: TimeoutOption = 30.0,
    tp_sharded: TpShardedOption = None,
    tp_replicated: TpReplicatedOption = None,
    etp: EtpOption = None,
    gtp: GtpOption = None,
    tied_output: TiedOutputOption = "auto",
    kind: KindOption = None,
    status_file: StatusFileOption = None,
) -> None:
    """num_zeros as Megatron counts it (GTP padding excluded), and per parameter (most zeros
    first unless --sort says otherwise; with --by expert, per MoE expert).

    Exit status 1 when every gradient is zero (a snapshot dumped before the backward pass?).
    """
    from gradstat.analysis.report import ZEROS_ORDERS, zeros_report
    from gradstat.cli.render import print_zeros

    per_expert = _by_expert(by)
    if sort not in ZEROS_ORDERS:
        raise GradstatError(f"--sort {sort!r} is not an order; use {', '.join(ZEROS_ORDERS)}")
    # The L2 norms too, though the report shows none: the coverage check tells a replica's copy
    # from another shard by its statistics, and zero counts alone do not tell them apart.
    snapshot, stats, prints = _statistics(
        snapshot_dir,
        (2.0,),
        True,
        device,
        timeout,
        as_json,
        _layout(tp_sharded, tp_replicated, etp, gtp, tied_output, kind),
        per_expert,
    )
    if not prints:
        return
    report = zeros_report(snapshot, stats, sort, top if as_json else (top or 20), per_expert)
    _emit(as_json, report.to_json(), lambda console: print_zeros(console, report))
    if report.all_zero:
        raise typer.Exit(EXIT_FINDINGS)


@app.command()
def clip(
    snapshot_dir: SnapshotArg,
    max_norm: Annotated[float, typer.Option("--max-norm", help="The largest total norm allowed.")],
    out: Annotated[
        Path,
        typer.Option("--out", help="New directory for the clipped snapshot (parents created)."),
    ],
    norm_type: Annotated[
        str, typer.Option("--norm-type", "-p", help="Norm to clip by: 2, 1, inf or p > 0.")
    ] = "2",
    allow_nonfinite: Annotated[
        bool,
        typer.Option(
            "--allow-nonfinite",
            help="Write the output even when the norm is NaN/Inf, as Megatron scales them: a "
            "NaN norm copies the gradients unchanged, an Inf norm scales them by 0 (an Inf "
            "element becomes NaN).",
        ),
    ] = False,
    as_json: JsonOption = False,
    device: DeviceOption = "cpu",
    timeout: TimeoutOption = 30.0,
    tp_sharded: TpShardedOption = None,
    tp_replicated: TpReplicatedOption = None,
    etp: EtpOption = None,
    gtp: GtpOption = None,
    tied_output: TiedOutputOption = "auto",
    kind: KindOption = None,
    status_file: StatusFileOption = None,
) -> None:
    """Write a clipped copy of a snapshot (clip_grad_by_total_norm_fp32 semantics).

    The input is never modified; DIR must be new or empty and not inside the input; its
    missing parents are created. The copy appears atomically: a killed run leaves nothing that
    looks complete. Exit status 1 when every gradient is zero (the copy is then the input).
    """
    p = _parse_norm_type(norm_type)
    if not (math.isfinite(max_norm) and max_norm > 0):
        raise GradstatError(f"--max-norm must be a positive number, got {max_norm}")
    from gradstat.analysis.report import ClipReport
    from gradstat.cli.render import print_clip
    from gradstat.clip_grads import clip_coefficient
    from gradstat.distributed.launcher import launch_rank
    from gradstat.distributed.runner import Progress
    from gradstat.snapshot import Snapshot
    from gradstat.snapshot.clip import check_output_dir, write_clipped

    layout = _layout(tp_sharded, tp_replicated, etp, gtp, tied_output, kind)
    if launch_rank() == 0:  # process 0 alone writes the copy, maybe on its own machine
        check_output_dir(snapshot_dir, out)
    opened, stats, prints = _statistics(snapshot_dir, (p,), False, device, timeout, as_json, layout)
    if not prints:
        return
    _refuse_overflow(snapshot_dir, stats, p, norm_type)
    total = stats.norm(p)
    if not math.isfinite(total) and not allow_nonfinite:
        raise GradstatError(
            f"{snapshot_dir}: the {norm_type} norm is {total}; refusing to write a clipped "
            f"copy of non-finite gradients (gradstat norm locates them; "
            f"--allow-nonfinite writes it anyway)"
        )
    coefficient = clip_coefficient(max_norm, total)
    # Under torchrun each process read its share; process 0 writes every rank file.
    snapshot = opened if isinstance(opened, Snapshot) else Snapshot.open(snapshot_dir, layout)
    files, total_bytes = len(snapshot.files), sum(file.size_bytes for file in snapshot.files)
    written = [0, 0]

    def on_file(rank_file: Any) -> None:
        written[0] += 1
        written[1] += rank_file.size_bytes
        progress = Progress("writing", written[0], files, "rank files", written[1], total_bytes)
        _session().report(progress)

    write_clipped(snapshot, out, coefficient, on_file)
    report = ClipReport(str(snapshot_dir), str(out), p, max_norm, total, coefficient)
    _emit(as_json, report.to_json(), lambda console: print_clip(console, report))
    if report.all_zero:
        raise typer.Exit(EXIT_FINDINGS)


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
    tp_sharded: TpShardedOption = None,
    tp_replicated: TpReplicatedOption = None,
    etp: EtpOption = None,
    gtp: GtpOption = None,
    tied_output: TiedOutputOption = "auto",
    kind: KindOption = None,
    status_file: StatusFileOption = None,
) -> None:
    """Two snapshots of one model, parameter by parameter, whatever their layouts.

    Norms, zeros and, where both sides can be rebuilt into full tensors, the largest
    elementwise difference. Exit status 1 when anything is flagged.
    """
    from gradstat.analysis.compare import compare_snapshots
    from gradstat.cli.render import print_compare
    from gradstat.distributed.runner import pick_device, together
    from gradstat.snapshot import Snapshot

    layout = _layout(tp_sharded, tp_replicated, etp, gtp, tied_output, kind)
    _refuse_run_dir(snapshot_a, snapshot_b)
    processes = _session().join(timeout, [snapshot_a, snapshot_b], as_json)
    *snapshots, where = together(
        processes,
        lambda: (
            Snapshot.open(snapshot_a, layout),
            Snapshot.open(snapshot_b, layout),
            pick_device(device),
        ),
    )
    report = compare_snapshots(snapshots[0], snapshots[1], processes, rtol, where)
    if not processes.is_first:
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
    tp_sharded: TpShardedOption = None,
    tp_replicated: TpReplicatedOption = None,
    etp: EtpOption = None,
    gtp: GtpOption = None,
    tied_output: TiedOutputOption = "auto",
    kind: KindOption = None,
    status_file: StatusFileOption = None,
) -> None:
    """Check the gradients against what their attributes promise.

    Copies that must be equal (TP/ETP and GTP replicas, tied embeddings, data-parallel
    replicas of a plain optimizer), GTP padding that must be zero, attributes that must agree
    with each other and with the shapes. Each finding gives the global norm had it been counted
    the other way. Copies are equal when max |a - b| <= rtol * max |x| (default: bitwise).
    MoE layers too: an expert whose gradient is all zero (never routed), an expert or router
    without any gradient, a router whose gradient is zero while its experts have one.
    Exit status 1 when there is any finding.
    """
    from gradstat.analysis.audit import audit_snapshot
    from gradstat.cli.render import print_audit
    from gradstat.distributed.runner import pick_device, together
    from gradstat.snapshot import Snapshot

    layout = _layout(tp_sharded, tp_replicated, etp, gtp, tied_output, kind)
    _refuse_run_dir(snapshot_dir)
    processes = _session().join(timeout, [snapshot_dir], as_json)
    snapshot, where = together(
        processes, lambda: (Snapshot.open(snapshot_dir, layout), pick_device(device))
    )
    report = audit_snapshot(snapshot, processes, rtol, where)
    if not processes.is_first:
        return
    _emit(as_json, report.to_json(), lambda console: print_audit(console, report))
    if report.findings:
        raise typer.Exit(EXIT_FINDINGS)


@app.command()
def inspect(
    snapshot_dir: SnapshotArg,
    as_json: JsonOption = False,
    tp_sharded: TpShardedOption = None,
    tp_replicated: TpReplicatedOption = None,
    etp: EtpOption = None,
    gtp: GtpOption = None,
    tied_output: TiedOutputOption = "auto",
    kind: KindOption = None,
    status_file: StatusFileOption = None,
) -> None:
    """What gradstat rebuilt: world size, axes, files, and each parameter's attributes."""
    from gradstat.analysis.report import inspect_report
    from gradstat.cli.render import print_inspect
    from gradstat.snapshot import Snapshot

    _refuse_run_dir(snapshot_dir)
    report = inspect_report(
        Snapshot.open(snapshot_dir, _layout(tp_sharded, tp_replicated, etp, gtp, tied_output, kind))
    )
    _emit(as_json, report.to_json(), lambda console: print_inspect(console, report))


@app.command()
def history(
    root: Annotated[
        Path,
        typer.Argument(
            help="A run directory (the flight recorder's: its telemetry log and step-N "
            "snapshots), or any directory of snapshots.",
            show_default=False,
        ),
    ],
    norm_type: Annotated[
        str | None,
        typer.Option(
            "--norm-type",
            "-p",
            help="Snapshots: 2, 1, inf or any p > 0. A log: read the attempts that recorded "
            "this norm type (default: the latest attempt's).",
        ),
    ] = None,
    factor: Annotated[
        float,
        typer.Option("--factor", help="A jump: the norm above this many times its median."),
    ] = 10.0,
    window: Annotated[
        int,
        typer.Option("--window", min=1, help="Steps the median looks back over."),
    ] = 50,
    since: Annotated[
        int | None, typer.Option("--since", min=0, help="Only steps from this one on.")
    ] = None,
    until: Annotated[
        int | None, typer.Option("--until", min=0, help="Only steps up to this one.")
    ] = None,
    source: Annotated[
        str,
        typer.Option("--source", help="auto (the log when there is one), log or snapshots."),
    ] = "auto",
    top: Annotated[
        int | None,
        typer.Option("--top", min=1, help="Parameters in the table (20 unless given)."),
    ] = None,
    plot: Annotated[
        Path | None,
        typer.Option("--plot", help="Write a PNG (or .svg) of the total and the top parameters."),
    ] = None,
    tensorboard: Annotated[
        Path | None,
        typer.Option("--tensorboard", help="Write TensorBoard event files into this directory."),
    ] = None,
    as_json: JsonOption = False,
    tp_sharded: TpShardedOption = None,
    tp_replicated: TpReplicatedOption = None,
    etp: EtpOption = None,
    gtp: GtpOption = None,
    tied_output: TiedOutputOption = "auto",
    kind: KindOption = None,
    status_file: StatusFileOption = None,
) -> None:
    """The total norm and every parameter over a run's steps, and where each first jumped.

    Reads the flight recorder's telemetry log when the directory has one (every recorded
    step), else its snapshots, each once, in step order (hidden .step-*.partial ones are
    skipped). Parameters that jumped come first, the one that moved first at the top. Exit
    status 1 when a parameter's norm went NaN or Inf.
    """
    from gradstat.analysis.history import SOURCES, read_history
    from gradstat.cli.render import print_history
    from gradstat.distributed.runner import Progress

    p = None if norm_type is None else _parse_norm_type(norm_type)
    if not (math.isfinite(factor) and factor > 1):
        raise GradstatError(f"--factor must be a number > 1, got {factor}")
    if source not in SOURCES:
        raise GradstatError(f"--source must be one of {', '.join(SOURCES)}, got {source!r}")
    if since is not None and until is not None and since > until:
        raise GradstatError(f"--since {since} is after --until {until}")
    session = _session()
    console = Console(stderr=True)
    bars = None
    if not as_json and console.is_interactive:
        from gradstat.cli.render import ProgressBars

        bars = session.bars = ProgressBars(console)

    def progress(done: int, total: int, unit: str) -> None:
        if bars is None:
            return
        if unit == "bytes":
            bars(Progress(f"reading {root.name}", 0, 1, "log", done, total))
        else:
            bars(Progress(f"reading {root.name}", done, total, unit))

    found = read_history(
        root,
        p,
        factor=factor,
        window=window,
        since=since,
        until=until,
        source=source,
        on_progress=progress,
        report=_warning_line,
        options=_layout(tp_sharded, tp_replicated, etp, gtp, tied_output, kind),
    )
    session.stop_progress()
    if plot is not None or tensorboard is not None:
        from gradstat.cli.pictures import write_pictures

        write_pictures(found, plot, tensorboard, top or 8, progress)
        session.stop_progress()
    _emit(as_json, found.to_json(), lambda console: print_history(console, found, top or 20))
    if any(series.went_nonfinite for series in found.params.values()) or any(
        kept.recorder_differs for kept in found.snapshots
    ):
        raise typer.Exit(EXIT_FINDINGS)


@app.command()
def explain(
    snapshot_dir: SnapshotArg,
    logged: Annotated[
        float | None,
        typer.Option("--logged", help="The gradient norm the framework logged, to explain."),
    ] = None,
    logged_zeros: Annotated[
        int | None,
        typer.Option("--logged-zeros", min=0, help="The zero count it logged, to explain."),
    ] = None,
    norm_type: Annotated[
        str, typer.Option("--norm-type", "-p", help="The norm it logged: 2, 1, inf or p > 0.")
    ] = "2",
    rtol: Annotated[
        float,
        typer.Option(
            "--rtol", min=0.0, callback=_finite, help="A prediction this close (relative) matches."
        ),
    ] = 1e-3,
    top: Annotated[
        int | None,
        typer.Option(
            "--top", min=1, help="Rows in the table (every one unless given; the JSON: all)."
        ),
    ] = None,
    as_json: JsonOption = False,
    timeout: TimeoutOption = 30.0,
    tp_sharded: TpShardedOption = None,
    tp_replicated: TpReplicatedOption = None,
    etp: EtpOption = None,
    gtp: GtpOption = None,
    tied_output: TiedOutputOption = "auto",
    kind: KindOption = None,
    status_file: StatusFileOption = None,
) -> None:
    """Which miscount of the snapshot's gradients gives the number a framework logged.

    The exact value, then each hypothesis (a kind of copy counted as well, experts or a
    pipeline stage left out, expert copies told apart by the dense TP rank, one rank's local
    norm never reduced, per-rank norms averaged or summed, gradients not divided by the
    data-parallel size, partial sums rounded to bf16, GTP padding counted as zeros), each
    computed from the snapshot's own gradients, matches first. Under torchrun the processes
    read the rank files in turn and process 0 prints. Exit status 1 when neither the exact
    value nor any hypothesis is within --rtol of the logged number.
    """
    if (logged is None) == (logged_zeros is None):
        raise GradstatError("give exactly one of --logged X (a norm) and --logged-zeros N")
    if logged is not None and not (math.isnan(logged) or logged >= 0):
        raise GradstatError(f"--logged must be a norm (>= 0, nan or inf), got {logged}")
    p = _parse_norm_type(norm_type)
    from gradstat.analysis.explain import explain_snapshot
    from gradstat.cli.render import print_explain
    from gradstat.distributed.runner import open_shared

    layout = _layout(tp_sharded, tp_replicated, etp, gtp, tied_output, kind)
    _refuse_run_dir(snapshot_dir)
    processes = _session().join(timeout, [snapshot_dir], as_json)
    snapshot = open_shared(processes, snapshot_dir, layout)
    if logged is not None:
        report = explain_snapshot(snapshot, logged, p, rtol, processes=processes)
    else:
        assert logged_zeros is not None
        report = explain_snapshot(snapshot, float(logged_zeros), None, rtol, processes=processes)
    if not processes.is_first:
        return
    _emit(as_json, report.to_json(), lambda console: print_explain(console, report, top))
    if not report.matches:
        raise typer.Exit(EXIT_FINDINGS)


@app.command()
def version() -> None:
    """Print gradstat's version and the torch it runs on."""
    import torch

    typer.echo(f"gradstat {__version__} (torch {torch.__version__})")


def main() -> None:
    """Console-script entry point.

    A command runs once, and what it builds lives until it ends: a snapshot's headers, records
    and per-tensor pieces, about 60 objects per rank file. Python's collector would walk them
    again and again as they are made (a young-generation pass every so many allocations, each
    touching objects scattered over hundreds of MB), for nothing: gradstat's readers and
    reductions make no reference cycles (``tests/test_no_cycles.py`` holds them to it), so
    everything a command drops is freed at once by its reference count. Collection is
    therefore off for the command (as Mercurial turns it off while it builds large indexes).
    Against the thresholds raised to 100,000, as before, run back to back: 0.13 s less on a
    one-file snapshot (the collections torch's import set off), 0.24 s less on 8192 rank files
    of 4 tensors (3.07 s against 3.31). At exit, Python's last collection would walk every object
    once more (0.3 to 0.4 s of a 1.9 s `gradstat norm sample_data/`, most of them torch's):
    frozen first, they are left to the end of the process.
    """
    gc.disable()
    try:
        app()
    finally:
        gc.freeze()

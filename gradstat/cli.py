"""The ``gradstat`` command line: parses arguments and renders results, computes nothing.

Importing this module must stay cheap: torch is imported only by the commands that need it, so
``gradstat --help`` and ``gradstat --version`` answer at once.
"""

from __future__ import annotations

import typer

from ._version import __version__

app = typer.Typer(
    name="gradstat",
    help="Megatron-exact gradient norms, clipping and zero counts for sharded gradients.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)


def _print_version(value: bool) -> None:
    if value:
        typer.echo(f"gradstat {__version__}")
        raise typer.Exit()


@app.callback()
def _root(
    version: bool = typer.Option(
        False,
        "--version",
        callback=_print_version,
        is_eager=True,
        help="Print the version and exit.",
    ),
) -> None:
    """Megatron-exact gradient norms, clipping and zero counts for sharded gradients."""


@app.command()
def version() -> None:
    """Print gradstat's version and the torch it runs on."""
    import torch

    typer.echo(f"gradstat {__version__} (torch {torch.__version__})")


def main() -> None:
    """Console-script entry point."""
    app()

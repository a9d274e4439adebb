"""The ``gradstat`` command line: the commands (app), what they print (render, report), and
how they run in one process or many (runner, launcher)."""

from gradstat.cli.app import app, main

__all__ = ["app", "main"]

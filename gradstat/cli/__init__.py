"""The ``gradstat`` command line: the commands (app) and what they print (report, render)."""

from gradstat.cli.app import app, main

__all__ = ["app", "main"]

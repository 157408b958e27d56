"""The console the `war` commands print to.

Knows: rich's console, and that writing to a file or a pipe (a CI log, ``| tee``) rich
assumes 80 columns, which cuts the headers of WAR's wider tables to an ellipsis;
and that an error is reported on one line (``one_line``). Does not know what is printed.
"""

from __future__ import annotations

import os

from rich.console import Console

PIPE_WIDTH = 120
"""Columns of the console when the output is not a terminal and ``COLUMNS`` is unset."""


def make_console() -> Console:
    """A rich console: a terminal's own width, ``COLUMNS`` when set, else (a file or a
    pipe) ``PIPE_WIDTH`` columns."""
    console = Console()
    if not console.is_terminal and not os.environ.get("COLUMNS"):
        console = Console(width=PIPE_WIDTH)
    return console


def one_line(message: str) -> str:
    """``message`` on one line: its lines stripped and joined by spaces, blank ones and
    YAML's caret markers (``^`` under a column) dropped."""
    return " ".join(line.strip() for line in message.splitlines() if line.strip(" \t^"))


__all__ = ["PIPE_WIDTH", "make_console", "one_line"]

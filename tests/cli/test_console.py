"""The console of the `war` commands: wide enough for its tables when piped."""

from __future__ import annotations

import pytest
from rich.table import Table

from war.cli.console import PIPE_WIDTH, make_console


def test_piped_output_is_wide_unless_columns_say_otherwise(monkeypatch: pytest.MonkeyPatch
                                                           ) -> None:
    monkeypatch.delenv("COLUMNS", raising=False)
    console = make_console()  # (pytest captures the output: not a terminal)
    assert not console.is_terminal and console.width == PIPE_WIDTH
    table = Table(*[f"column {i}" for i in range(10)])
    table.add_row(*[str(i) for i in range(10)])
    with console.capture() as out:
        console.print(table)
    assert "column 9" in out.get() and "…" not in out.get()  # no header cut short
    monkeypatch.setenv("COLUMNS", "100")
    assert make_console().width == 100

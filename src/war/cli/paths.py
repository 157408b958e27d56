"""Where a `war` command's report may go, beside the files it reads.

Knows: that an output file given as one of the command's inputs (``--json`` naming the
trace or experiment file it reads) would be replaced by the report, losing the input,
and how to refuse that before any work starts. Does not know what the files hold.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from pathlib import Path


def same_file(a: str | os.PathLike[str], b: str | os.PathLike[str]) -> bool:
    """Whether ``a`` and ``b`` name one file (through links and relative paths); a
    missing path is the same as another only when both resolve to one name."""
    try:
        return os.path.samefile(a, b)
    except OSError:
        return Path(os.path.realpath(a)) == Path(os.path.realpath(b))


def check_not_input(out: str | os.PathLike[str], what: str,
                    inputs: Iterable[tuple[str, str | os.PathLike[str]]]) -> None:
    """Raises ValueError when the output file ``out`` (the option ``what``) is one of
    ``inputs`` (pairs of the option that gave it and the path): the report would be
    written over a file the command reads."""
    for option, path in inputs:
        if same_file(out, path):
            raise ValueError(f"{what} {out} is the {option} file {path}: the report would "
                             "replace it; give another file name")


__all__ = ["check_not_input", "same_file"]

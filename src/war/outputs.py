"""Output files of WAR's commands and benchmarks.

Knows: how to check, before a run that may take many minutes, that its report can be
written where the user asked (so a mistyped path fails at once instead of after the
work, losing it), and how to write a report so that a reader never sees half of it (a
temporary file in the same folder, renamed over the target). Does not know what the
reports hold.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import tempfile
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import IO, Any

__all__ = [
    "check_output_dir", "check_output_file", "output_file_arg", "removing_created_folders",
    "write_bytes_atomic", "write_json", "write_text_atomic",
]


def check_output_file(path: str | os.PathLike[str], what: str = "output file") -> Path:
    """Checks that ``path`` can be written as a file: its folder exists (created if
    missing) and takes new files, and ``path`` is not a folder. Writes nothing at
    ``path`` itself. Raises ValueError naming ``what`` and the path otherwise."""
    p = Path(path)
    try:
        if p.is_dir():
            raise ValueError(f"{what} {p} is a folder; give a file name")
        if p.exists() and not os.access(p, os.W_OK):
            raise ValueError(f"{what} {p} is not writable")
    except OSError as e:  # e.g. a name too long for the file system
        raise ValueError(f"{what} {p}: {e.strerror or e}") from None
    _probe(p.parent, what, p)
    return p


def check_output_dir(path: str | os.PathLike[str], what: str = "output folder") -> Path:
    """Checks that ``path`` is (or can be created as) a folder that takes new files;
    creates it. Raises ValueError naming ``what`` and the path otherwise."""
    p = Path(path)
    try:
        if p.exists() and not p.is_dir():
            raise ValueError(f"{what} {p} exists and is not a folder")
    except OSError as e:  # e.g. a name too long for the file system
        raise ValueError(f"{what} {p}: {e.strerror or e}") from None
    _probe(p, what, p)
    return p


def write_text_atomic(path: str | os.PathLike[str], text: str) -> None:
    """Writes ``text`` (UTF-8) to ``path`` through a temporary file in the same folder,
    renamed over ``path``: ``path`` holds either its old content or all of ``text``."""
    _write_atomic(path, text)


def write_bytes_atomic(path: str | os.PathLike[str], data: bytes) -> None:
    """``write_text_atomic`` for bytes (an image)."""
    _write_atomic(path, data)


def _write_atomic(path: str | os.PathLike[str], data: str | bytes) -> None:
    p = Path(path)
    if p.is_symlink():  # the file it points to is written (the link stays a link)
        p = Path(os.path.realpath(p))
    p.parent.mkdir(parents=True, exist_ok=True)
    # the name is cut so that the temporary's fits where the target's does (255 bytes)
    fd, tmp = tempfile.mkstemp(prefix=f".{p.name[:32]}.", suffix=".tmp", dir=p.parent)
    try:
        f: IO[Any] = (os.fdopen(fd, "wb") if isinstance(data, bytes)
                      else os.fdopen(fd, "w", encoding="utf-8"))
        with f:
            f.write(data)
            # on disk before the rename, which a crash could otherwise keep over no data
            f.flush()
            os.fsync(f.fileno())
        # mkstemp makes the file private: give it the mode a plain open() would
        # (or the replaced file's).
        os.chmod(tmp, p.stat().st_mode & 0o7777 if p.exists() else 0o666 & ~_umask())
        os.replace(tmp, p)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def write_json(path: str | os.PathLike[str], obj: Any, indent: int | None = 1) -> None:
    """``obj`` as standard JSON (and a final newline), written with ``write_text_atomic``.

    A float that is not finite (a percentile of no samples, a ratio over zero) is
    written as ``null``: Python's ``NaN``/``Infinity`` are not JSON, and strict readers
    (``jq``, browsers, most other languages) refuse the whole file over one of them."""
    try:
        text = json.dumps(obj, indent=indent, allow_nan=False)
    except ValueError as e:  # a non-finite float somewhere: only then is the tree copied
        if "float" not in str(e):  # a circular reference, say: not for a copy to fix
            raise
        text = json.dumps(_finite_or_none(obj), indent=indent, allow_nan=False)
    write_text_atomic(path, text + "\n")


def _finite_or_none(obj: Any, path: frozenset[int] = frozenset()) -> Any:
    """``obj`` with every non-finite float replaced by ``None`` (dicts, lists and tuples
    rebuilt; anything else returned as is, for ``json.dumps`` to judge). A container
    inside itself raises ``ValueError``, as ``json.dumps`` does."""
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict | list | tuple):
        if id(obj) in path:
            raise ValueError("Circular reference detected")
        inner = path | {id(obj)}
        if isinstance(obj, dict):
            return {k: _finite_or_none(v, inner) for k, v in obj.items()}
        return [_finite_or_none(v, inner) for v in obj]
    return obj


def _umask() -> int:
    """The process's umask: read where the system tells it (Linux), since setting it
    to read it back changes it, for a moment, for every thread's new files."""
    try:
        with open("/proc/self/status", encoding="ascii") as f:
            for line in f:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def _probe(folder: Path, what: str, shown: Path) -> None:
    try:
        folder.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=folder):
            pass
    except OSError as e:
        reason = e.strerror or str(e)
        raise ValueError(f"{what} {shown}: cannot write in {folder}: {reason}") from None


def output_file_arg(value: str) -> Path:
    """An argparse ``type=`` for an output file option: the path, checked as
    ``check_output_file`` does (argparse reports a failure as a usage error)."""
    import argparse

    try:
        return check_output_file(value, "output file")
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


@contextlib.contextmanager
def removing_created_folders(paths: Iterable[str | os.PathLike[str]]) -> Iterator[None]:
    """Runs the body; when it raises, removes again the folders among ``paths`` and
    above them that did not exist before it and are still empty, deepest first: a
    refused or failed command leaves no empty folders behind. A folder that existed
    before is never removed, nor one that holds anything."""
    missing: set[Path] = set()
    for path in map(Path, paths):
        for folder in (path, *path.parents):
            try:
                if os.path.lexists(folder):
                    break
            except (OSError, ValueError):
                break
            if folder.name not in ("", ".", ".."):  # (those name an existing folder)
                missing.add(folder)
    try:
        yield
    except BaseException:
        for folder in sorted(missing, key=lambda f: len(f.parts), reverse=True):
            with contextlib.suppress(OSError):  # (rmdir removes only an empty folder)
                folder.rmdir()
        raise

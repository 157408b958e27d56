"""Loading a benchmark script (``benchmarks/<part>/<name>.py``) as a module, for its tests."""

from __future__ import annotations

import importlib.util
import sys
from collections.abc import Sequence
from pathlib import Path
from types import ModuleType

import pytest

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"


def load_benchmark(part: str, name: str) -> ModuleType:
    """``benchmarks/<part>/<name>.py`` as the module ``name`` (registered in
    ``sys.modules``: dataclasses look their module up)."""
    path = BENCHMARKS / part / f"{name}.py"
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def usage_error(script: ModuleType, argv: Sequence[str], heavy: Sequence[str],
                monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> str:
    """Runs ``script.main(argv)`` with its functions ``heavy`` (those that do the work)
    failing if called: it must stop with a usage error (status 2) before any of them.
    Returns what it wrote to stderr."""

    def no_work(*_: object, **__: object) -> None:
        raise AssertionError(f"{script.__name__} worked before its arguments were checked")

    for name in heavy:
        monkeypatch.setattr(script, name, no_work)
    with pytest.raises(SystemExit) as e:
        script.main(list(argv))
    assert e.value.code == 2
    return capsys.readouterr().err

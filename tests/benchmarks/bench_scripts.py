"""Loading a benchmark script (``benchmarks/<part>/<name>.py``) as a module, for its tests."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

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

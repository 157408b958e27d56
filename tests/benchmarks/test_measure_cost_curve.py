"""The cost-curve script's refusals: every bad value is one usage error before the model
is built, and nothing is written."""

from __future__ import annotations

from pathlib import Path

import pytest
from bench_scripts import load_benchmark, usage_error


@pytest.mark.parametrize(("argv", "message"), [
    (["--threads", "0"], "--threads must be >= 1, got 0"),
    (["--passes", "0"], "--passes must be >= 1, got 0"),
    (["--passes", "-1"], "--passes must be >= 1, got -1"),
    (["--repeats", "0"], "--repeats must be >= 1, got 0"),
    (["--batches", "1", "0"], "--batches must be >= 1, got [1, 0]"),
    (["--drafts", "-1"], "--drafts must be >= 0, got [-1]"),
    (["--contexts", "128", "-5"], "--contexts must be >= 0, got [128, -5]"),
    (["--seed", "-1"], "--seed must be in [0, 2**63), got -1"),
])
def test_bad_values_are_refused_before_any_work(
        tmp_path: Path, argv: list[str], message: str, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "curve.json"
    err = usage_error(load_benchmark("sim", "measure_cost_curve"), ["--json", str(out), *argv],
                      ["init_random"], monkeypatch, capsys)
    assert err.splitlines()[-1].endswith(f" error: {message}")  # one usage line
    assert not out.exists()

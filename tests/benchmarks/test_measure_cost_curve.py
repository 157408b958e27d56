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
    (["--batches", "1", "2", "1"], "--batches must be distinct, got [1, 2, 1]"),
    (["--drafts", "0", "0"], "--drafts must be distinct, got [0, 0]"),
    (["--contexts", "128", "128"], "--contexts must be distinct, got [128, 128]"),
])
def test_bad_values_are_refused_before_any_work(
        tmp_path: Path, argv: list[str], message: str, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "curve.json"
    err = usage_error(load_benchmark("sim", "measure_cost_curve"), ["--json", str(out), *argv],
                      ["init_random"], monkeypatch, capsys)
    assert err.splitlines()[-1].endswith(f" error: {message}")  # one usage line
    assert not out.exists()


def test_the_callers_torch_threads_are_kept_when_a_run_fails(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import torch

    script = load_benchmark("sim", "measure_cost_curve")

    def fail(*_: object, **__: object) -> None:
        raise RuntimeError("out of memory")

    monkeypatch.setattr(script, "init_random", fail)
    before = torch.get_num_threads()
    with pytest.raises(RuntimeError, match="out of memory"):
        script.main(["--json", str(tmp_path / "curve.json"), "--threads", str(before + 1)])
    assert torch.get_num_threads() == before

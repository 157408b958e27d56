"""The trace model script's refusals: one usage error before any training."""

from __future__ import annotations

from pathlib import Path

import pytest
from bench_scripts import load_benchmark, usage_error


@pytest.mark.parametrize(("argv", "message"), [
    (["--steps", "0"], "--steps must be a number > 0, got 0"),
    (["--minutes", "nan"], "--minutes must be a number > 0, got nan"),
    (["--minutes", "-1"], "--minutes must be a number > 0, got -1.0"),
    (["--threads", "0"], "--threads must be a number > 0, got 0"),
    (["--seed", "-1"], "--seed must be >= 0, got -1"),
    (["--traces", "{tmp}/missing.jsonl"], "--traces: no such file {tmp}/missing.jsonl"),
    (["--out", "{tmp}/file"], "--out {tmp}/file exists and is not a folder"),
])
def test_bad_values_are_refused_before_training(
        tmp_path: Path, argv: list[str], message: str, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "file").write_text("x")
    (tmp_path / "t.jsonl").write_text("{}\n")
    argv = ["--out", str(tmp_path / "model"), "--traces", str(tmp_path / "t.jsonl"), *argv]
    err = usage_error(load_benchmark("engine", "train_trace_model"),
                      [a.format(tmp=tmp_path) for a in argv], ["ensure_trace_model"],
                      monkeypatch, capsys)
    assert err.splitlines()[-1].endswith(f" error: {message.format(tmp=tmp_path)}")

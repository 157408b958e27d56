"""The rollout step benchmark's interface on a tiny random policy (not its figures)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest
from bench_scripts import BENCHMARKS, load_benchmark, usage_error

from war.rollout.agent import AgentConfig
from war.rollout.bench import CONFIGS, BenchConfig, run_bench
from war.rollout.run import RunConfig


def test_bench_step_report_shape(random_policy: Path) -> None:
    run = RunConfig(model=str(random_policy), replicas=2, tasks_per_step=2, group_size=2,
                    steps=1, agent=AgentConfig(max_turns=1, max_tokens_per_turn=4))
    out = run_bench(BenchConfig(run=run, low_tasks=1, low_in_flight=1, repeats=1),
                    random_policy, log=lambda s: None)
    assert {(r["load"], r["config"]) for r in out["runs"]} == {
        (load, c) for load in ("low", "high") for c in CONFIGS}
    for r in out["runs"]:
        assert set(r) >= {"load", "config", "makespan_s", "tokens_per_s", "tokens_per_step",
                          "lower_bound_ratio", "mean_reward"}
        assert r["makespan_s"] > 0 and r["tokens_per_s"] > 0 and r["lower_bound_ratio"] > 0
    assert set(out["ratios"]["high"]) == {"war_vs_off", "war_vs_always"}
    assert 0.0 <= out["policy_success_rate"] <= 1.0


def _script() -> ModuleType:
    return load_benchmark("rollout", "bench_step")


@pytest.mark.parametrize(("argv", "message"), [
    (["--repeats", "0"], "--repeats must be >= 1, got 0"),
    (["--repeats", "-1"], "--repeats must be >= 1, got -1"),
    (["--model", "{tmp}/missing"], "--model folder not found: {tmp}/missing"),
    (["--model", "{tmp}"], "--model {tmp} has no config.json"),
    (["--model", "{tmp}/file"], "--model {tmp}/file is not a folder"),
])
def test_bad_arguments_are_usage_errors_before_any_run(
        tmp_path: Path, argv: list[str], message: str, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "file").write_text("x")
    out = tmp_path / "out.json"
    err = usage_error(_script(), ["--json", str(out), "--quick",
                                  *(a.format(tmp=tmp_path) for a in argv)],
                      ["run_bench"], monkeypatch, capsys)
    line = err.splitlines()[-1]
    assert f" error: {message.format(tmp=tmp_path)}" in line
    assert not out.exists()


def test_a_model_that_fails_to_load_is_one_error_line(tmp_path: Path) -> None:
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text("{}\n")  # no model_type: refused on loading
    proc = subprocess.run(
        [sys.executable, str(BENCHMARKS / "rollout" / "bench_step.py"), "--json",
         str(tmp_path / "out.json"), "--quick", "--model", str(model)],
        capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1
    assert proc.stderr.strip().splitlines() == [
        "bench_step: error: unsupported model_type None (supported: llama, qwen2, qwen3)"]
    assert not (tmp_path / "out.json").exists()

"""The rollout step benchmark's interface on a tiny random policy (not its figures)."""

from __future__ import annotations

from pathlib import Path

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

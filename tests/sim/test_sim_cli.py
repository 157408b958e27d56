"""`war sim`: an experiment file in, a JSON report (and plots) out."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from war import data
from war.cli.main import main

EXPERIMENT = """
name: tiny
workload: {kind: traces, rl_steps: 1, latency: {tool_median_s: 0.1, user_median_s: 0.5}}
cost: {kind: linear, intercept_s: 0.01, per_token_s: 1.0e-5, kv_tokens: 200000}
replica: {max_num_batched_tokens: 4096}
sim: {num_replicas: 2, timeline_s: 0.5}
loads: [2]
configs:
  rr_nospec: {policy: round_robin, spec_mode: "off"}
  rr_spec: {policy: round_robin, spec_mode: always}
  cache_nospec: {policy: cache_aware, spec_mode: "off"}
  war: {policy: war, spec_mode: auto}
"""


def test_sim_writes_results_targets_and_plots(tmp_path: Path,
                                              capsys: pytest.CaptureFixture[str]) -> None:
    cfg = tmp_path / "tiny.yaml"
    cfg.write_text(EXPERIMENT)
    out = tmp_path / "out.json"
    traces = str(data.resource(data.SAMPLE_TRACES))
    status = main(["sim", "--config", str(cfg), "--traces", traces, "--json", str(out),
                   "--plots", str(tmp_path / "plots")])
    assert status == 0
    report = json.loads(out.read_text())
    assert report["wall_s"] > 0
    rows = report["results"]
    assert {(r["config"], r["load"]) for r in rows} == {
        (c, ld) for c in ("rr_nospec", "rr_spec", "cache_nospec", "war") for ld in (2.0,)}
    keys = {"config", "load", "throughput", "makespan_s", "lower_bound_ratio",
            "prefix_hit_rate", "tokens_per_step", "migrations"}
    assert all(keys <= set(r) for r in rows)
    assert all(r["lower_bound_ratio"] >= 0.99 for r in rows)
    assert "war_vs_best_fixed" in report["targets"]
    assert {p.name for p in (tmp_path / "plots").iterdir()} >= {
        "throughput_vs_load.png", "makespan_cdf.png", "timeline_war.png"}
    assert "wall" in capsys.readouterr().out


def test_sim_reports_bad_files(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    cfg = tmp_path / "bad.yaml"
    cfg.write_text("name: x\nloads: [1]\nconfigs: {a: {policy: war}}\nbogus: 1\n")
    assert main(["sim", "--config", str(cfg), "--json", str(tmp_path / "o.json")]) == 1
    assert "unknown section" in capsys.readouterr().err

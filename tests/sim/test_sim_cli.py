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


@pytest.mark.parametrize("extra, message", [
    (["--loads", "-1"], "--loads must be positive finite numbers, got [-1.0]"),
    (["--loads", "0"], "--loads must be positive finite numbers, got [0.0]"),
    (["--loads", "nan"], "--loads must be positive finite numbers, got [nan]"),
    (["--loads", "2", "inf"], "--loads must be positive finite numbers, got [inf]"),
    (["--json", "{tmp}"], "is a folder; give a file name"),
    (["--json", "{tmp}/file.txt/out.json"], "cannot write in"),
    (["--plots", "{tmp}/file.txt"], "exists and is not a folder"),
    (["--traces", "{tmp}"], "is not a file"),
])
def test_sim_refuses_bad_options_before_running(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], extra: list[str], message: str,
) -> None:
    """Bad loads and unwritable outputs fail at once (one line), before any run whose
    report would then be lost."""
    cfg = tmp_path / "tiny.yaml"
    cfg.write_text(EXPERIMENT)
    (tmp_path / "file.txt").write_text("x")
    out = tmp_path / "out.json"
    args = [a.replace("{tmp}", str(tmp_path)) for a in extra]
    argv = ["sim", "--config", str(cfg), "--json", str(out), *args]
    assert main(argv) == 1
    err = capsys.readouterr().err
    assert err.startswith("war: error: ") and message in err and err.count("\n") == 1
    assert "traces:" not in err  # nothing was loaded or run
    assert not out.exists()


def test_sim_reports_unreadable_experiment_files(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = str(tmp_path / "o.json")
    bad_yaml = tmp_path / "bad.yaml"
    bad_yaml.write_text("name: [x\n")
    cases = [(tmp_path, "is not a file"), (tmp_path / "none.yaml", "experiment file not found"),
             (bad_yaml, "not a valid YAML file")]
    for path, message in cases:
        assert main(["sim", "--config", str(path), "--json", out]) == 1
        err = capsys.readouterr().err
        assert err.startswith("war: error: ") and message in err
    loads = tmp_path / "loads.yaml"
    loads.write_text(EXPERIMENT.replace("loads: [2]", "loads: [two]"))
    assert main(["sim", "--config", str(loads), "--json", out]) == 1
    assert "loads must be a list of numbers" in capsys.readouterr().err


def test_sim_on_small_traces_merges_loads_and_cuts_long_trajectories(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Six tasks of four trials: loads of 12 and 24 per replica (two replicas) both ask
    for more than every task in one step, so they run once, as load 12; with 6,000 KV
    tokens a replica, trajectories longer than that end early and are counted; the
    plot of the largest load is made from the load it merged into."""
    cfg = tmp_path / "small.yaml"
    cfg.write_text(EXPERIMENT.replace("loads: [2]", "loads: [2, 12, 24]")
                   .replace("kv_tokens: 200000", "kv_tokens: 6000"))
    out = tmp_path / "out.json"
    traces = str(data.resource(data.SAMPLE_TRACES))
    assert main(["sim", "--config", str(cfg), "--traces", traces, "--json", str(out),
                 "--configs", "rr_nospec", "war", "--plots", str(tmp_path / "plots")]) == 0
    report = json.loads(out.read_text())
    rows = report["results"]
    assert sorted(r["requested_load"] for r in rows) == [2.0, 2.0, 12.0, 12.0]
    assert report["same_loads"] == [{"load": 24.0, "same_as": 12.0}]
    assert {r["load"] for r in rows if r["requested_load"] == 12.0} == {6 * 4 / 2}
    assert all(r["truncated_trajectories"] > 0 for r in rows if r["requested_load"] == 12.0)
    assert all(r["dropped_trajectories"] == 0 for r in rows)
    assert {p.name for p in (tmp_path / "plots").iterdir()} >= {
        "throughput_vs_load.png", "makespan_cdf.png", "timeline_war.png"}
    err = capsys.readouterr().err
    assert "load 24: the traces give the same workload as load 12" in err
    assert "beyond the KV:" in err

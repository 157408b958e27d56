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


@pytest.mark.parametrize("old, new, message", [
    ("configs:\n", "configs:\n  bad: {policy: nope}\n",
     "configuration 'bad': unknown routing policy 'nope'"),
    ("  war: {policy: war, spec_mode: auto}",
     "  war: {policy: war, spec_mode: auto, policy_settings: {bogus: 1}}",
     "configuration 'war': policy_settings: "),
    ("replica: {max_num_batched_tokens: 4096}", "replica: {max_num_batched_tokens: 4096, x: 1}",
     "replica: unknown setting(s) ['x']"),
    ("replica: {max_num_batched_tokens: 4096}", "replica: {max_num_batched_tokens: lots}",
     "replica.max_num_batched_tokens must be an int, got 'lots'"),
    ("sim: {num_replicas: 2, timeline_s: 0.5}", "sim: {num_replicas: two}",
     "sim.num_replicas must be an int, got 'two'"),
    ("sim: {num_replicas: 2, timeline_s: 0.5}", "sim: {num_replicas: 2, max_tokens: '99'}",
     "sim.max_tokens must be an int, got '99'"),
    ("cost: {kind: linear,", "cost: {kind: linear, bogus: 1,",
     "cost: unknown setting(s) ['bogus']"),
    ("cost: {kind: linear,", "cost: {kind: profile,", "cost: a profile needs a curve"),
    ("rl_steps: 1", "rl_steps: 0", "workload.rl_steps must be >= 1, got 0"),
    ("rl_steps: 1", "rl_steps: 1.5", "workload.rl_steps must be an int, got 1.5"),
    ("rl_steps: 1", "rl_steps: 1, group_size: 0", "workload.group_size must be >= 1"),
    ("rl_steps: 1", "rl_steps: 1, seed: zero", "workload.seed must be an int, got 'zero'"),
    ("rl_steps: 1", "rl_steps: 1, tasks: 3", "workload: unknown setting(s) ['tasks']"),
    ("user_median_s: 0.5}", "user_median_s: 0.5, p99: 3}",
     "workload.latency: unknown setting(s) ['p99']"),
    ("user_median_s: 0.5}", "user_median_s: fast}",
     "workload.latency.user_median_s must be a float, got 'fast'"),
    ("replica: {max_num_batched_tokens: 4096}", "replica: {max_num_batched_tokens: 4096}\n"
     "spec: {min_prob: 2}", "spec: min_prob must be <= 1.0, got 2"),
    ("  rr_nospec: {policy: round_robin, spec_mode: \"off\"}",
     "  rr_nospec: {policy: round_robin, spec_mode: \"off\", replica: 3}",
     "configuration 'rr_nospec': replica must be a mapping of settings, got 3"),
    ("name: tiny", "name: tiny\ntraces: one.jsonl", "traces must be a list of file names"),
    ("cost: {kind: linear, intercept_s: 0.01, per_token_s: 1.0e-5, kv_tokens: 200000}", "",
     "missing section(s) ['cost']"),
    ("loads: [2]", "loads: [2]\nplot_load: big", "plot_load must be positive finite numbers"),
])
def test_sim_refuses_bad_experiment_settings_before_running(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], old: str, new: str,
        message: str) -> None:
    """Every setting of an experiment file is checked when it is read: an unknown
    setting, a value of the wrong type or out of range is one error line naming the
    section and setting (never a traceback), before traces are loaded or anything runs,
    so no run's report is lost to a configuration that fails later in the sweep."""
    assert old in EXPERIMENT
    cfg = tmp_path / "bad.yaml"
    cfg.write_text(EXPERIMENT.replace(old, new, 1))
    out = tmp_path / "out.json"
    traces = str(data.resource(data.SAMPLE_TRACES))
    assert main(["sim", "--config", str(cfg), "--traces", traces, "--json", str(out)]) == 1
    err = capsys.readouterr().err
    assert err.startswith(f"war: error: {cfg}: ") and message in err and err.count("\n") == 1
    assert "traces:" not in err
    assert not out.exists()


def test_sim_checks_every_loads_workload_before_running(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A group size the traces cannot fill at one load fails before the first run."""
    cfg = tmp_path / "groups.yaml"
    cfg.write_text(EXPERIMENT.replace("rl_steps: 1", "rl_steps: 1, group_size: 9")
                   .replace("loads: [2]", "loads: [1, 2]"))
    out = tmp_path / "out.json"
    traces = str(data.resource(data.SAMPLE_TRACES))
    assert main(["sim", "--config", str(cfg), "--traces", traces, "--json", str(out),
                 "--workers", "1"]) == 1
    err = capsys.readouterr().err
    assert "war: error: load 1: " in err and "need more trials of task" in err
    assert "tok/s" not in err  # no run was made
    assert not out.exists()

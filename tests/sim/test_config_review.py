"""Experiment files: YAML quirks and settings that were accepted but misread."""

from __future__ import annotations

from pathlib import Path

import pytest

from war import data
from war.cli.main import main
from war.sim.experiment import Experiment

EXPERIMENT = """
name: tiny
workload: {kind: traces, rl_steps: 1}
cost: {kind: linear, intercept_s: 0.01, per_token_s: 1.0e-5, kv_tokens: 200000}
sim: {num_replicas: 2}
loads: [2]
configs:
  rr: {policy: round_robin, spec_mode: "off"}
  war: {policy: war, spec_mode: auto}
"""


@pytest.mark.parametrize("old, new, message", [
    # a quoted "off" (as spec_mode needs) is a string: the policy took it as true
    ("war: {policy: war, spec_mode: auto}",
     "war: {policy: war, spec_mode: auto, policy_settings: {age_priority: \"off\"}}",
     "configuration 'war': policy_settings.age_priority must be a bool, got 'off'"),
    ("war: {policy: war, spec_mode: auto}",
     "war: {policy: war, spec_mode: auto, policy_settings: {migrate_abs_tokens: 1.5}}",
     "policy_settings.migrate_abs_tokens must be an int, got 1.5"),
    # PyYAML keeps the last of duplicate keys: a configuration vanished unseen
    ("  war: {policy: war, spec_mode: auto}",
     "  war: {policy: war, spec_mode: auto}\n  war: {policy: war, spec_mode: always}",
     "duplicate key 'war' (line 10)"),
    ("loads: [2]", "loads: [2]\nloads: [4]", "duplicate key 'loads'"),
])
def test_misread_settings_are_one_error_line(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], old: str, new: str,
        message: str) -> None:
    assert old in EXPERIMENT
    cfg = tmp_path / "bad.yaml"
    cfg.write_text(EXPERIMENT.replace(old, new, 1))
    out = tmp_path / "out.json"
    assert main(["sim", "--config", str(cfg), "--json", str(out)]) == 1
    err = capsys.readouterr().err
    assert err.startswith(f"war: error: {cfg}: ") and message in err and err.count("\n") == 1
    assert not out.exists()


def test_well_typed_policy_settings_still_load(tmp_path: Path) -> None:
    cfg = tmp_path / "ok.yaml"
    cfg.write_text(EXPERIMENT.replace(
        "war: {policy: war, spec_mode: auto}",
        "war: {policy: war, spec_mode: auto, policy_settings: {age_priority: off, "
        "migrate_rel: 2}}"))
    exp = Experiment.load(cfg)
    assert exp.configs["war"]["policy_settings"] == {"age_priority": False, "migrate_rel": 2}


def test_a_plot_load_outside_the_loads_is_refused(tmp_path: Path,
                                                  capsys: pytest.CaptureFixture[str]) -> None:
    """plot_load 4 beside loads [2] drew no CDF and no timelines, silently."""
    cfg = tmp_path / "bad.yaml"
    cfg.write_text(EXPERIMENT.replace("loads: [2]", "loads: [2]\nplot_load: 4"))
    out = tmp_path / "out.json"
    assert main(["sim", "--config", str(cfg), "--json", str(out)]) == 1
    err = capsys.readouterr().err
    assert "plot_load 4 is not one of the loads [2.0]" in err and err.count("\n") == 1
    assert not out.exists()


def test_loads_that_leave_out_plot_load_plot_the_largest_run(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    cfg = tmp_path / "ok.yaml"
    cfg.write_text(EXPERIMENT.replace("loads: [2]", "loads: [1, 2]\nplot_load: 2"))
    plots = tmp_path / "plots"
    traces = str(data.resource(data.SAMPLE_TRACES))
    assert main(["sim", "--config", str(cfg), "--traces", traces, "--loads", "1", "--json",
                 str(tmp_path / "o.json"), "--plots", str(plots), "--workers", "1"]) == 0
    assert "plot_load 2 is not among the loads run: plotting load 1" in capsys.readouterr().err
    assert "makespan_cdf.png" in {p.name for p in plots.iterdir()}


def test_configurations_with_one_file_part_get_a_timeline_each(tmp_path: Path) -> None:
    from war.sim.plots import write_plots

    tl = {"t": [0.0, 1.0], "in_flight": [1, 0], "budget_per_seq": [0.0, 0.0]}
    rows = [{"config": name, "load": 1.0, "throughput": 1.0, "finish_times": [1.0],
             "timeline": tl} for name in ("war a", "war/a")]
    out = write_plots(rows, tmp_path)
    names = [p.name for p in out]
    assert names == ["throughput_vs_load.png", "makespan_cdf.png", "timeline_war_a.png",
                     "timeline_war_a-2.png"]
    assert all(p.is_file() and p.read_bytes().startswith(b"\x89PNG") for p in out)
    assert not [p for p in tmp_path.iterdir() if p.name not in names]  # (no temporaries)

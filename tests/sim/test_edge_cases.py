"""Bad settings and degenerate runs: a clear ValueError naming the setting (never a
traceback, never a silent nonsense value), and metrics and plots that stay sensible
on runs with nothing in them."""

from __future__ import annotations

import json
import math
import warnings
from pathlib import Path
from typing import Any

import pytest
from sim_helpers import trajectory, workload

from war.sim.costs import LinearCost, RooflineCost
from war.sim.experiment import Experiment, build_cost, check_experiment
from war.sim.plots import write_plots
from war.sim.profile import CurvePoint, ProfileCost, load_cost_curve, parse_cost_curve
from war.sim.replica import ReplicaConfig
from war.sim.simulator import SimConfig, Simulator
from war.sim.synthetic import SyntheticConfig
from war.sim.workload import LatencyModel, Workload

INF, NAN = math.inf, math.nan


def _experiment(**changes: Any) -> Experiment:
    args: dict[str, Any] = dict(
        name="x", base_dir=Path("."), workload={"kind": "synthetic"},
        cost={"kind": "linear", "kv_tokens": 100_000}, configs={"a": {"policy": "war"}},
        loads=(1.0,))
    args.update(changes)
    return Experiment(**args)


@pytest.mark.parametrize("cls, field", [
    (LinearCost, "intercept_s"), (LinearCost, "per_token_s"),
    (LinearCost, "per_context_token_s"), (LinearCost, "per_seq_s"),
    (RooflineCost, "overhead_s"), (RooflineCost, "per_seq_overhead_s"),
    (RooflineCost, "all_reduce_latency_s")])
def test_cost_models_refuse_infinite_coefficients(cls: Any, field: str) -> None:
    with pytest.raises(ValueError, match=field):
        cls(**{field: INF})


@pytest.mark.parametrize("report, message", [
    ([1, 2], "a cost-curve report is a JSON object"),
    ({"cost_curve": [1], "config": {"cost_context": 8}}, "record 0 must be an object"),
    ({"cost_curve": [{"batch": 1}], "config": {"cost_context": 8}},
     "record 0 has no draft_tokens, step_ms"),
    ({"cost_curve": [{"batch": 1.5, "draft_tokens": 0, "step_ms": 1.0}],
      "config": {"cost_context": 8}}, "batch must be a whole number, got 1.5"),
    ({"cost_curve": [{"batch": INF, "draft_tokens": 0, "step_ms": 1.0}],
      "config": {"cost_context": 8}}, "batch must be a whole number, got inf"),
    ({"cost_curve": [{"batch": 1, "draft_tokens": 0, "step_ms": "fast"}],
      "config": {"cost_context": 8}}, "step_ms must be a number"),
    ({"cost_curve": [{"batch": 1, "draft_tokens": 0, "step_ms": INF}],
      "config": {"cost_context": 8}}, "step_ms must be > 0 and finite"),
    ({"cost_curve": [{"batch": 1, "draft_tokens": 0, "step_ms": 1.0}], "config": [8]},
     "config must be an object"),
])
def test_malformed_cost_curves_are_value_errors(report: Any, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        parse_cost_curve(report)


def test_cost_curve_files_and_profile_settings(tmp_path: Path) -> None:
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(ValueError, match=f"cost curve {bad}: not a valid JSON file"):
        load_cost_curve(bad)
    with pytest.raises(FileNotFoundError, match="cost curve file not found"):
        load_cost_curve(tmp_path / "absent.json")
    good = tmp_path / "good.json"
    good.write_text(json.dumps({"cost_curve": [
        {"batch": b, "draft_tokens": 0, "context": 64, "step_ms": 1.0 + b} for b in (1, 2)]}))
    for settings, message in [({"curve": None}, "cost.curve must be a str"),
                              ({"curve": "good.json", "kv_tokens": 0}, "cost.kv_tokens"),
                              ({"curve": "good.json", "context": -1}, "cost.context")]:
        with pytest.raises(ValueError, match=message):
            build_cost({"kind": "profile", **settings}, tmp_path)
    with pytest.raises(ValueError, match="kv_tokens"):
        ProfileCost((1.0, 0, 0, 0, 0), kv_tokens=0)
    with pytest.raises(ValueError, match="step_ms"):
        CurvePoint(1, 0, 0, INF)


@pytest.mark.parametrize("field, value", [
    ("turns_sigma", NAN), ("response_sigma", INF), ("sample_sigma", -1.0),
    ("tool_tokens_sigma", NAN), ("tool_sigma", NAN), ("response_median", INF),
    ("task_tokens_median", INF), ("tool_median_s", INF), ("system_tokens", -5)])
def test_synthetic_settings_refuse_draws_that_cannot_be_made(field: str, value: Any) -> None:
    """Checked with the experiment, before any workload is drawn (they crashed the draw
    with an OverflowError, or with a ValueError that named no setting, or passed)."""
    with pytest.raises(ValueError, match=f"workload: {field}"):
        check_experiment(_experiment(workload={"kind": "synthetic", field: value}))
    with pytest.raises(ValueError, match=field):
        SyntheticConfig(**{field: value})


def test_latency_settings_refuse_infinite_draws_and_clip_huge_ones() -> None:
    for field, value in [("tool_median_s", INF), ("user_median_s", INF),
                         ("tool_sigma", INF), ("user_sigma", INF)]:
        with pytest.raises(ValueError, match=field):
            LatencyModel(**{field: value})
    wild = LatencyModel(tool_sigma=1e6, max_s=30.0)
    draws = [wild.draw(["tool"], f"k{i}") for i in range(20)]
    assert all(0.0 <= d <= 30.0 for d in draws) and 30.0 in draws


def test_run_settings_are_checked_before_a_run() -> None:
    with pytest.raises(ValueError, match="prefill_token_value"):
        ReplicaConfig(prefill_token_value=-1.0)
    with pytest.raises(ValueError, match="prefill_token_value"):
        check_experiment(_experiment(replica={"prefill_token_value": NAN}))
    for field in ("train_s", "timeline_s"):
        with pytest.raises(ValueError, match=field):
            SimConfig(**{field: INF})


def test_a_kv_that_does_not_hold_one_block_is_refused_with_the_experiment() -> None:
    with pytest.raises(ValueError, match="less than one block"):
        check_experiment(_experiment(cost={"kind": "linear", "kv_tokens": 8}))
    with pytest.raises(ValueError, match="does not know KV capacity"):
        check_experiment(_experiment(cost={"kind": "linear"}))
    check_experiment(_experiment(cost={"kind": "linear"}, replica={"num_kv_blocks": 64}))


def test_experiment_names_and_plot_load_are_checked() -> None:
    with pytest.raises(ValueError, match="plot_load"):
        _experiment(plot_load=True)
    with pytest.raises(ValueError, match="name must be a string"):
        _experiment(name=5)
    with pytest.raises(ValueError, match="configuration names must be strings"):
        _experiment(configs={1: {"policy": "war"}})


def _run(wl: Workload, kv_tokens: int = 10_000) -> dict[str, Any]:
    cost = LinearCost(0.01, 1e-5, kv_tokens=kv_tokens)
    return Simulator(SimConfig(num_replicas=2), cost, wl).run().summary()


def test_a_step_that_generates_nothing_has_a_bound() -> None:
    """A turn with an empty response (an empty assistant message in a trace): the
    step's work term divided zero tokens by a zero rate."""
    s = _run(workload(trajectory("a", 10, [0])))
    assert s["generated_tokens"] == 0 and s["throughput"] == 0.0
    assert s["lower_bound_ratio"] == pytest.approx(1.0)


def test_a_step_with_every_trajectory_left_out_does_not_skew_the_means() -> None:
    """The first step's only trajectory does not fit the KV: that step ran nothing, so
    it neither zeroes the bound ratio nor halves the mean makespan."""
    too_long = trajectory("big", 20_000, [5])
    fits = trajectory("a", 10, [5], rl_step=1)
    both = _run(Workload("w", ((too_long,), (fits,))))
    alone = _run(Workload("w", ((fits,),)))
    assert both["dropped_trajectories"] == 1
    assert both["lower_bound_ratio"] == alone["lower_bound_ratio"] > 0.99
    assert both["makespan_s"] == alone["makespan_s"] > 0


def test_plots_of_degenerate_rows(tmp_path: Path) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # (no legend warning on empty data)
        assert [p.name for p in write_plots([], tmp_path / "empty")] == [
            "throughput_vs_load.png"]
        rows = [{"config": "war/8 replicas", "load": 1.0, "throughput": 0.0,
                 "finish_times": [], "timeline": {"t": [0.0], "in_flight": [1],
                                                  "budget_per_seq": [0.0]}}]
        out = write_plots(rows, tmp_path / "odd")
    assert {p.name for p in out} == {"throughput_vs_load.png", "makespan_cdf.png",
                                     "timeline_war_8_replicas.png"}
    assert all(p.is_file() for p in out)

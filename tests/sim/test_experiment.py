"""Running experiments: what one (configuration, load) row depends on."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from war.sim.experiment import Experiment, run_experiment


def _cached_experiment() -> Experiment:
    # Synthetic groups that repeat across loads (copies of the same 4 tasks), so that
    # load 2's streams are also load 8's.
    return Experiment(
        name="cached", base_dir=Path("."),
        workload={"kind": "synthetic", "rl_steps": 1, "group_size": 4, "num_tasks": 4,
                  "copies": True, "turns_median": 2.0, "max_turns": 4,
                  "response_median": 40.0, "max_response": 200, "tool_tokens_median": 30.0,
                  "task_tokens_median": 50.0, "system_tokens": 40, "tool_median_s": 0.1},
        cost={"kind": "linear", "intercept_s": 0.01, "per_token_s": 1.0e-5,
              "kv_tokens": 65536},
        sim={"num_replicas": 2, "max_tokens": 512}, drafts="cached", loads=(2.0, 8.0),
        configs={"war": {"policy": "war", "spec_mode": "always"}})


def _figures(row: dict[str, Any]) -> dict[str, Any]:
    out = {k: v for k, v in row.items() if k not in ("wall_s", "finish_times", "timeline")}
    out["acceptance_table"] = {k: v for k, v in row["acceptance_table"].items()
                               if k != "record_s"}
    return out


def test_cached_drafts_do_not_depend_on_the_loads_run_before() -> None:
    """With ``drafts: cached`` each workload has its own recording: load 8 after load 2
    in one process gives what load 8 gives alone (a table shared across loads replayed
    load 2's streams as load 2's replay had recorded them), and each row's table
    summary is its own workload's."""
    exp = _cached_experiment()
    alone = run_experiment(exp, loads=[8])["results"]
    both = run_experiment(exp, loads=[2, 8])["results"]
    assert [r["requested_load"] for r in both] == [2.0, 8.0]
    assert _figures(both[1]) == _figures(alone[0])
    small = run_experiment(exp, loads=[2])["results"]
    assert _figures(both[0]) == _figures(small[0])
    assert both[0]["acceptance_table"]["positions"] < both[1]["acceptance_table"]["positions"]


def test_unknown_configurations_are_refused_before_any_run() -> None:
    with pytest.raises(ValueError, match=r"unknown configurations \['nope'\]"):
        run_experiment(_cached_experiment(), configs=["war", "nope"])

"""Workloads: RL steps cut from traces, tool latencies, synthetic long tails, and the
acceptance table recorded by a replay."""

from __future__ import annotations

import statistics
from functools import cache

import pytest

from war import data
from war.sim.acceptance import record_acceptance
from war.sim.synthetic import SyntheticConfig, synthetic_workload
from war.sim.workload import LatencyModel, TraceSet, build_trace_steps
from war.spec.config import SpecConfig


@cache
def sample() -> TraceSet:
    return TraceSet.load([data.resource(data.SAMPLE_TRACES)])  # 6 tasks x 4 trials


def test_groups_are_trials_and_steps_take_new_tasks() -> None:
    wl = build_trace_steps(sample(), tasks_per_step=2, rl_steps=3, seed=1)
    assert [len(s) for s in wl.steps] == [8, 8, 8] and wl.reused == 0
    sources = [t.source for s in wl.steps for t in s]
    assert len(set(sources)) == 24  # every trace trajectory exactly once
    for step in wl.steps:
        groups: dict[str, list[str]] = {}
        for t in step:
            groups.setdefault(t.group_id, []).append(t.source)
        assert all(len(v) == 4 for v in groups.values())
    assert {t.rl_step for t in wl.steps[2]} == {2}


def test_no_replay_without_copies() -> None:
    with pytest.raises(ValueError, match="trials"):
        build_trace_steps(sample(), tasks_per_step=6, rl_steps=2)
    wl = build_trace_steps(sample(), tasks_per_step=6, rl_steps=2, copies=True)
    assert wl.reused == 24
    copies = [t for t in wl.steps[1]]
    first = {t.turns[0].prompt[0] for t in copies}
    assert all(tok >= 1_000_000_000 for tok in first)  # salted: copies share no prefix
    assert len({t.group_id for t in copies}) == 6


def test_group_size_takes_the_next_trials() -> None:
    wl = build_trace_steps(sample(), tasks_per_step=6, rl_steps=2, group_size=2)
    a = {t.source for t in wl.steps[0]}
    b = {t.source for t in wl.steps[1]}
    assert len(a) == len(b) == 12 and not a & b


def test_tool_latency_follows_the_messages_and_is_order_free() -> None:
    lat = LatencyModel(tool_median_s=1.0, tool_sigma=0.0, user_median_s=3.0, user_sigma=0.0)
    assert lat.draw(("tool", "tool", "user"), "k") == pytest.approx(5.0)
    assert lat.draw((), "k") == 0.0
    noisy = LatencyModel(seed=3)
    assert noisy.draw(("tool",), "a") == noisy.draw(("tool",), "a") != noisy.draw(("tool",), "b")
    wl = build_trace_steps(sample(), tasks_per_step=1, rl_steps=1, latency=lat)
    for t in wl.steps[0]:
        assert t.turns[-1].tool_s == 0.0
        assert all(u.tool_s >= 1.0 for u in t.turns[:-1])


def test_synthetic_long_tail() -> None:
    cfg = SyntheticConfig(group_size=8, sample_sigma=0.8, seed=0)
    wl = synthetic_workload(cfg, groups_per_step=16, rl_steps=2)
    assert wl.num_trajectories == 256
    gen = sorted(t.num_generated for t in wl.steps[0])
    assert gen[-1] > 5 * statistics.median(gen)  # a long tail
    step0, step1 = wl.steps
    assert {t.group_id for t in step0} == {t.group_id for t in step1}  # tasks recur
    a, b = step0[0], step0[1]  # siblings share their first prompt
    assert a.group_id == b.group_id and a.turns[0].prompt == b.turns[0].prompt
    again = synthetic_workload(cfg, 16, 2).steps[0][5]
    assert [(u.prompt, u.response, u.tool_s) for u in again.turns] == \
        [(u.prompt, u.response, u.tool_s) for u in wl.steps[0][5].turns]


def test_acceptance_table_records_every_distinct_stream() -> None:
    wl = build_trace_steps(sample(), tasks_per_step=2, rl_steps=2, copies=True)
    trajs = [t for s in wl.steps for t in s]
    table = record_acceptance(trajs, SpecConfig())
    distinct = {t.source: t for t in trajs}
    assert table.positions == sum(t.num_generated for t in distinct.values())
    s = table.summary()
    assert 0.0 < s["acceptance_rate"] < 1.0
    t = trajs[-1]
    probs, acc = table.at(t.source, 0, 0)
    assert acc <= len(probs) <= SpecConfig().max_spec_tokens
    assert table.at(t.source, 0, 10**6)[1] == 0
    again = record_acceptance(trajs, SpecConfig(), table)  # nothing new to record
    assert again.positions == table.positions
    with pytest.raises(ValueError):
        record_acceptance(trajs, SpecConfig.tree_preset())

"""The makespan's lower bound is a lower bound: no simulated step ends before it.

Scenarios that each broke one term of an earlier version (a capacity searched only at
batch sizes 1, 2, 4, ...; a batch's KV counted as if no prompt were shared; the mean
drafts per pass rounded to a whole token), and seeded random small fleets. The bound
is an estimate (per-turn averages), documented to within about 1 % of a trajectory
running alone, so a step may end up to 1 % before it.
"""

from __future__ import annotations

import random

import pytest
from sim_helpers import trajectory

from war.sim.costs import LinearCost
from war.sim.metrics import (
    StepMetrics,
    decode_step_time,
    hold_time,
    replica_capacity,
    shared_prefix_lens,
    work_time,
)
from war.sim.replica import ReplicaConfig
from war.sim.simulator import SimConfig, Simulator
from war.sim.synthetic import SyntheticConfig, synthetic_workload
from war.sim.workload import SimTrajectory, SimTurn, Workload

SLACK = 1.01


def _check(steps: list[StepMetrics]) -> None:
    for m in steps:
        if not m.trajectories:
            continue
        for name, term in (("work", m.work_s), ("longest", m.longest_s), ("kv", m.kv_s),
                           ("hold", m.hold_s)):
            assert term <= m.makespan * SLACK, (name, term, m.makespan, m.rl_step)


def test_samples_sharing_a_long_prompt() -> None:
    """32 samples of one task share a 2,000-token prompt in a 4,000-token KV: all run
    at once (the prompt is cached once), so the bound must not assume one at a time
    (it read 28x the makespan when every sample was charged the whole prompt)."""
    shared = tuple(range(2000))
    trajs = tuple(
        SimTrajectory(f"g/{j}", "g", 0,
                      (SimTurn(shared, tuple(range(10**5 + 100 * j, 10**5 + 100 * j + 50)), 0.0),),
                      f"g/{j}")
        for j in range(32))
    cfg = SimConfig(num_replicas=1, policy="round_robin",
                    replica=ReplicaConfig(spec_mode="off", num_kv_blocks=250))
    res = Simulator(cfg, LinearCost(0.01, 1e-5), Workload("shared", (trajs,))).run()
    _check(res.steps)
    assert shared_prefix_lens(trajs) == [2000] * 32


def test_a_batch_size_that_is_not_a_power_of_two() -> None:
    """120 trajectories whose KV fits 120 at once: the capacity is the best over every
    batch size (batch sizes 1, 2, 4, ... only gave 64: half the rate, a bound 1.5x the
    makespan)."""
    trajs = [trajectory(f"t{i}", 1000, [20], base=10**6 * i) for i in range(120)]
    cfg = SimConfig(num_replicas=1, policy="round_robin",
                    replica=ReplicaConfig(spec_mode="off", num_kv_blocks=120 * 1021 // 16 + 8))
    res = Simulator(cfg, LinearCost(0.01, 1e-5), Workload("wide", (tuple(trajs),))).run()
    _check(res.steps)
    cost = LinearCost(0.01, 1e-5)
    assert replica_capacity(cost, 1.0, 0.0, 1010.0, 120 * 1011, 256) == pytest.approx(
        120 / cost.step_time(120, 120, 120 * 1011, 0))


def test_fractional_drafts_per_pass() -> None:
    """A lone speculating trajectory on a cost where drafts cost as much as tokens:
    its time alone uses the mean drafts per pass, not the mean rounded (up to 6.5 %
    over the makespan before)."""
    rng = random.Random(1)
    cost = LinearCost(0.001, 1e-3)
    for _ in range(12):
        period = rng.randint(3, 40)
        pat = [rng.randrange(1000) for _ in range(period)]
        n = rng.randint(50, 400)
        resp = tuple(pat[i % period] if rng.random() > 0.1 else rng.randrange(1000)
                     for i in range(n))
        t = SimTrajectory("t", "t", 0, (SimTurn(tuple(pat) * 3, resp, 0.0),), "t")
        for mode in ("always", "auto"):
            cfg = SimConfig(num_replicas=1, policy="round_robin",
                            replica=ReplicaConfig(spec_mode=mode, num_kv_blocks=4096))
            _check(Simulator(cfg, cost, Workload("x", ((t,),))).run().steps)
    # the interpolation: a mean of 2.5 drafts costs the mean of 2 and 3 drafts
    assert decode_step_time(cost, 1, 2.5, 100.0) == pytest.approx(
        (cost.step_time(1, 3, 100, 2) + cost.step_time(1, 4, 101, 3)) / 2)


@pytest.mark.parametrize("seed", range(40))
def test_random_small_fleets(seed: int) -> None:
    rng = random.Random(seed)
    if rng.random() < 0.5:
        wl = synthetic_workload(SyntheticConfig(
            group_size=rng.choice([1, 2, 4]), system_tokens=rng.choice([1, 32, 100]),
            task_tokens_median=rng.choice([20.0, 80.0]), turns_median=rng.choice([1.0, 3.0]),
            response_median=rng.choice([10.0, 40.0]), max_response=120,
            tool_tokens_median=20.0, max_tool_tokens=60, max_turns=5, tool_median_s=0.05,
            divergence=rng.choice([0.0, 0.2]), vocab=50, seed=rng.randrange(1000)),
            rng.choice([1, 2, 3]), rng.choice([1, 2]))
    else:
        wl = Workload("t", (tuple(
            trajectory(f"t{i}", rng.choice([5, 16, 40, 100]),
                       [rng.randint(1, 60) for _ in range(rng.randint(1, 4))],
                       tool_s=rng.choice([0.0, 0.02, 0.3]), group=f"g{i % 2}",
                       base=rng.choice([0, 1000 * i]))
            for i in range(rng.randint(1, 8))),))
    longest = max(sum(len(u.prompt) + len(u.response) for u in t.turns)
                  for s in wl.steps for t in s)
    rc = ReplicaConfig(spec_mode=rng.choice(["off", "always", "auto"]),
                       num_kv_blocks=max(4, int(longest / 16 * rng.choice([1.1, 1.5, 3, 10]))),
                       max_num_batched_tokens=rng.choice([256, 8192]),
                       max_num_seqs=rng.choice([2, 256]))
    cfg = SimConfig(num_replicas=rng.choice([1, 2, 3]),
                    policy=rng.choice(["round_robin", "cache_aware", "war", "least_load"]),
                    replica=rc)
    _check(Simulator(cfg, LinearCost(0.01, 1e-4, rng.choice([0.0, 1e-6])), wl).run().steps)


def _step(generated: int, context: int) -> StepMetrics:
    """A step of ``generated`` single-token passes at a mean context of ``context``."""
    return StepMetrics(rl_step=0, start=0.0, end=1.0, trajectories=1, generated=generated,
                       passes=generated, context_sum=generated * context)


def test_hold_time_is_the_work_term_without_gaps_and_grows_with_them() -> None:
    cost = LinearCost(0.01, 1e-3)
    m = _step(20_000, 1000)
    work = work_time(m, 0, cost, 10_000, 256, 8192, 1)
    assert hold_time(m, 0, cost, 10_000, 256, 8192, 1, []) == pytest.approx(work)
    # gaps of no tokens or no latency hold nothing
    assert hold_time(m, 0, cost, 10_000, 256, 8192, 1, [(0, 5.0), (1000, 0.0)]) == (
        pytest.approx(work))
    last = work
    for seconds in (0.5, 1.0, 2.0, 4.0):
        t = hold_time(m, 0, cost, 10_000, 256, 8192, 1, [(1000, seconds)] * 40)
        assert t > last
        last = t
    # two replicas share the gaps (and the work)
    two = hold_time(m, 0, cost, 10_000, 256, 8192, 2, [(1000, 2.0)] * 40)
    assert two < hold_time(m, 0, cost, 10_000, 256, 8192, 1, [(1000, 2.0)] * 40)


def _all_held(m: StepMetrics, cost: LinearCost, kv: int, held: float) -> float:
    """The makespan of keeping every context: the least ``T`` at which the KV left
    beside ``held`` token-seconds (``kv - held / T`` on average) decodes the step."""
    lo, hi = 0.0, 1e7
    for _ in range(200):
        mid = (lo + hi) / 2
        if work_time(m, 0, cost, kv - held / mid, 256, 8192, 1, partial=True) <= mid:
            hi = mid
        else:
            lo = mid
    return hi


@pytest.mark.parametrize("cost", [LinearCost(0.01, 1e-3), LinearCost(0.01, 1e-4),
                                  LinearCost(0.02, 1e-3, 1e-6), LinearCost(0.01)])
def test_hold_time_is_at_most_the_best_whole_choice(cost: LinearCost) -> None:
    """Against the two choices computed apart: keep every context (a fixed point) or
    compute every one again (their tokens as prompt work). The bound is at most the
    better of them, at least the work term, and close to the better one (a mix can
    only gain a little over it on these steps)."""
    m = _step(20_000, 1000)
    gaps = [(1000, 5.0)] * 40
    work = work_time(m, 0, cost, 10_000, 256, 8192, 1)
    held = _all_held(m, cost, 10_000, sum(n * s for n, s in gaps))
    recompute = work_time(m, 40_000, cost, 10_000, 256, 8192, 1)
    t = hold_time(m, 0, cost, 10_000, 256, 8192, 1, gaps)
    assert work <= t <= min(held, recompute) * (1 + 1e-6)
    assert t >= 0.95 * min(held, recompute)


@pytest.mark.parametrize("policy", ["war", "round_robin"])
@pytest.mark.parametrize("hold", [0.0, 10.0])
def test_contexts_kept_between_turns(policy: str, hold: float) -> None:
    """16 six-turn trajectories on a replica whose KV holds about three of them, tool
    calls of 2 s and prompt tokens that cost 1 ms: a context is either kept through
    its tool call or computed again, and the bound counts that (over twice the other
    terms here), still below the makespan."""
    trajs = tuple(trajectory(f"t{i}", 400, [40] * 6, tool_s=2.0, base=10**5 * i)
                  for i in range(16))
    cfg = SimConfig(num_replicas=1, policy=policy,
                    replica=ReplicaConfig(spec_mode="off", num_kv_blocks=80, kv_hold_s=hold))
    steps = Simulator(cfg, LinearCost(0.01, 1e-3), Workload("held", (trajs,))).run().steps
    _check(steps)
    for m in steps:
        assert m.hold_s > 2 * max(m.work_s, m.kv_s, m.longest_s)
        assert m.lower_bound == m.hold_s

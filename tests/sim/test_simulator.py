"""The simulator on scenarios with known answers, determinism and virtual time."""

from __future__ import annotations

import pytest
from sim_helpers import ClockGuard, FixedPolicy, trajectory, workload

from war.router.policies import make_policy
from war.router.policies.base import Decision, ReplicaView
from war.sim.costs import CostModel, LinearCost
from war.sim.drafter import LiveDrafter
from war.sim.replica import ReplicaConfig
from war.sim.sequence import SimSeq
from war.sim.simulator import SimConfig, Simulator, fitting_turns
from war.sim.workload import SimTrajectory, SimTurn, Workload
from war.spec.config import SpecConfig
from war.spec.speculator import SuffixSpeculator
from war.types import GenRequest, GenResult, SamplingParams

A, B, C = 0.01, 0.001, 0.0  # intercept, per batch token, per context token


def run(wl: Workload, replicas: int = 1, policy: str = "round_robin", mode: str = "off",
        cost: CostModel | None = None, guard: bool = False, **replica: int) -> Simulator:
    cfg = SimConfig(num_replicas=replicas, policy=policy,
                    replica=ReplicaConfig(spec_mode=mode, num_kv_blocks=replica.pop(
                        "num_kv_blocks", 4096), **replica))
    pol = make_policy(policy)
    sim = Simulator(cfg, cost or LinearCost(A, B, C), wl, ClockGuard(pol) if guard else pol)
    sim.run()
    return sim


def test_single_replica_single_turn_linear_cost() -> None:
    # One prefill step of 100 tokens (it samples the first token), then 19 decode steps.
    sim = run(workload(trajectory("t", 100, [20])))
    m = sim.result.steps[0]
    assert m.makespan == pytest.approx((A + B * 100) + 19 * (A + B * 1))
    assert (m.generated, m.passes) == (20, 20)


def test_context_cost_and_tool_latency_add_up() -> None:
    cost = LinearCost(A, B, 1e-6)
    sim = run(workload(trajectory("t", 64, [10, 4], tool_s=2.5)), cost=cost)
    # turn 1: prefill 64 (context 64), decodes read 65..73; after 2.5 s of tool, turn 2's
    # prompt (64 + 10 + 5 = 79 tokens) hits the cached 64 (whole blocks of 16; at most
    # 78 tokens), prefills 15 (context 79), then decodes read 80..82.
    t1 = (A + B * 64 + 1e-6 * 64) + sum(A + B + 1e-6 * c for c in range(65, 74))
    t2 = (A + B * 15 + 1e-6 * 79) + sum(A + B + 1e-6 * c for c in range(80, 83))
    m = sim.result.steps[0]
    assert m.makespan == pytest.approx(t1 + 2.5 + t2)
    assert (m.prompt_tokens, m.cached_tokens) == (64 + 79, 64)


def test_a_turns_last_sampled_token_has_no_kv() -> None:
    """A turn ending on a block boundary (10 + 6 = 16 tokens) has computed 15 of them:
    its last sampled token is never fed back, so no whole block is cached (nor held)
    and the next turn's 21-token prompt is prefilled whole, as the engine, which
    publishes computed whole blocks, would."""
    for hold in (0, 10):
        sim = run(workload(trajectory("t", 10, [6, 4], tool_s=1.0)), kv_hold_s=hold)
        m = sim.result.steps[0]
        assert (m.prompt_tokens, m.cached_tokens) == (10 + 21, 0)
        assert sim.replicas[0].stats.prefill_tokens == 10 + 21


def test_two_replicas_balanced_versus_all_on_one() -> None:
    trajs = [trajectory(f"t{i}", 32, [10], base=1000 * i) for i in range(4)]
    balanced = run(workload(*trajs), replicas=2).result.steps[0]
    assert balanced.makespan == pytest.approx((A + B * 64) + 9 * (A + B * 2))
    cfg = SimConfig(num_replicas=2, replica=ReplicaConfig(spec_mode="off", num_kv_blocks=4096))
    skewed = Simulator(cfg, LinearCost(A, B, C), workload(*trajs), FixedPolicy("r0"))
    m = skewed.run().steps[0]
    assert m.makespan == pytest.approx((A + B * 128) + 9 * (A + B * 4))
    assert balanced.lower_bound < m.makespan  # the bound does not depend on placement
    assert balanced.makespan / balanced.lower_bound <= m.makespan / m.lower_bound


def test_round_robin_moves_turns_and_cache_aware_keeps_them() -> None:
    trajs = [trajectory(f"t{i}", 64, [8, 8, 8], tool_s=0.1, base=1000 * i) for i in range(3)]
    rr = run(workload(*trajs), replicas=2, policy="round_robin").result
    ca = run(workload(*trajs), replicas=2, policy="cache_aware").result
    assert rr.migrations > 0 and ca.migrations == 0
    assert ca.summary()["prefix_hit_rate"] > rr.summary()["prefix_hit_rate"]


def test_same_seed_same_result_on_traces() -> None:
    from war import data
    from war.sim.workload import LatencyModel, TraceSet, build_trace_steps

    traces = TraceSet.load([data.resource(data.SAMPLE_TRACES)])

    def summary(seed: int) -> dict[str, object]:
        wl = build_trace_steps(traces, 2, 1, latency=LatencyModel(seed=seed), seed=seed)
        return run(wl, replicas=2, policy="war", mode="auto").result.summary()

    first = summary(3)
    assert summary(3) == first
    assert summary(4) != first


def test_same_inputs_same_result() -> None:
    trajs = [trajectory(f"t{i}", 48, [30, 12, 40], tool_s=0.3 * i, group="g", base=0)
             for i in range(4)]
    a = run(workload(*trajs), replicas=2, policy="war", mode="auto").result.summary()
    b = run(workload(*trajs), replicas=2, policy="war", mode="auto").result.summary()
    assert a == b


@pytest.mark.parametrize("policy", ["round_robin", "least_load", "cache_aware", "war"])
def test_policies_see_only_monotone_virtual_time(policy: str) -> None:
    trajs = [trajectory(f"t{i}", 40, [12, 7, 9], tool_s=0.05 * (i + 1), base=100 * i)
             for i in range(6)]
    sim = run(workload(*trajs), replicas=3, policy=policy, mode="auto", guard=True)
    guard = sim.policy
    assert isinstance(guard, ClockGuard)
    assert len(guard.times) >= 2 * 18  # a select and an on_complete per turn
    assert guard.times[-1] == pytest.approx(sim.result.steps[0].end)


def _echo(tid: str, base: int, n: int = 150) -> SimTrajectory:
    """A one-turn trajectory whose response repeats its prompt: drafts from the
    trajectory itself are accepted."""
    prompt = tuple(range(base, base + 200))
    return SimTrajectory(tid, tid, 0, (SimTurn(prompt, prompt[:n], 0.0),), tid)


def test_speculation_accepts_repeated_text() -> None:
    off = run(workload(_echo("t", 0)), mode="off").result.summary()
    always = run(workload(_echo("t", 0)), mode="always").result.summary()
    assert off["tokens_per_step"] == 1.0
    assert always["tokens_per_step"] > 1.3 and always["acceptance_rate"] > 0.8
    assert always["makespan_s"] < off["makespan_s"]


def test_auto_budget_shrinks_under_load() -> None:
    # 1 ms per token after a 1 ms step: alone, a draft token (accepted ~90%) is cheaper
    # per generated token than a step; with 96 sequences the step's own tokens are.
    cost = LinearCost(0.001, 0.001)
    alone = run(workload(_echo("t", 0)), mode="auto", cost=cost).result.summary()
    many = [run(workload(*[_echo(f"t{i}", 1000 * i) for i in range(96)]), mode=mode,
                cost=cost, max_num_seqs=96).result.summary() for mode in ("auto", "always")]
    assert alone["spec_tokens_per_pass"] > 5
    assert many[0]["spec_tokens_per_pass"] < 0.2 * alone["spec_tokens_per_pass"]
    assert many[0]["throughput"] > many[1]["throughput"]


def test_kv_pressure_preempts_and_still_completes() -> None:
    trajs = [trajectory(f"t{i}", 100, [150], base=1000 * i) for i in range(6)]
    sim = run(workload(*trajs), num_kv_blocks=40, block_size=16)
    assert sim.result.preemptions > 0
    assert sim.result.steps[0].generated == 6 * 150
    r = sim.replicas[0]
    assert r.kv.private_blocks == 0 and r.kv.locked_blocks == 0


def test_turns_beyond_the_kv_end_the_trajectory_and_are_counted() -> None:
    """160 KV tokens: a trajectory ends before the turn that would not fit (its whole
    context plus the response), one whose first turn does not fit is left out, and the
    others run whole; the summary counts both."""
    whole = trajectory("whole", 40, [30, 30], base=0)  # 40+30, +5+30 = 105 tokens
    cut = trajectory("cut", 50, [40, 40, 40], base=1000)  # 90, 135, then 180 > 160
    out = trajectory("out", 150, [20], base=2000)  # 170 > 160 at once
    assert [fitting_turns(t, 160) for t in (whole, cut, out)] == [2, 2, 0]
    assert fitting_turns(cut, 180) == 3 and fitting_turns(cut, 179) == 2
    sim = run(workload(whole, cut, out), num_kv_blocks=10, block_size=16)
    summary = sim.result.summary()
    assert summary["truncated_trajectories"] == 1 and summary["dropped_trajectories"] == 1
    assert summary["trajectories"] == 2
    assert sim.result.steps[0].generated == 30 + 30 + 40 + 40
    # the replica itself still refuses a request larger than its KV
    with pytest.raises(ValueError, match="exceed"):
        sim.replicas[0].submit(SimSeq(GenRequest("big", out.turns[0].prompt, SamplingParams()),
                                      out, 0, out.turns[0].prompt, 0.0, 1))


def test_rl_steps_run_one_after_another() -> None:
    t0 = trajectory("a", 32, [10])
    t1 = trajectory("b", 32, [10], base=500, rl_step=1)
    wl = Workload("two", ((t0,), (t1,)))
    cfg = SimConfig(num_replicas=1, train_s=5.0,
                    replica=ReplicaConfig(spec_mode="off", num_kv_blocks=4096))
    res = Simulator(cfg, LinearCost(A, B, C), wl).run()
    assert res.steps[1].start == pytest.approx(res.steps[0].end + 5.0)
    assert res.steps[1].makespan == pytest.approx(res.steps[0].makespan)


class KVWatch:
    """Round robin that records, at each request, every replica's cached and locked
    KV blocks (``sim`` set after the simulator is built)."""

    name = "kv_watch"

    def __init__(self) -> None:
        self.inner = make_policy("round_robin")
        self.sim: Simulator | None = None
        self.seen: dict[str, list[tuple[int, int]]] = {}

    def select(self, request: GenRequest, replicas: list[ReplicaView], now: float) -> Decision:
        assert self.sim is not None
        self.seen[request.request_id] = [(r.kv.cached_blocks, r.kv.locked_blocks)
                                         for r in self.sim.replicas]
        return self.inner.select(request, replicas, now)

    def on_complete(self, request: GenRequest, result: GenResult | None, replica: str,
                    now: float) -> None:
        self.inner.on_complete(request, result, replica, now)

    def on_replica_down(self, replica: str, now: float) -> None:
        self.inner.on_replica_down(replica, now)


@pytest.mark.parametrize("mode", ["off", "always"])
def test_new_weights_between_rl_steps_drop_every_replicas_kv(mode: str) -> None:
    """The weights change between RL steps, so KV computed in one step is stale in the
    next: every hold is released and every prefix cache emptied (the engine's
    ``load_weights`` clears its cache). Step 1 replays step 0's tokens: it starts on
    empty caches (a hold "a" left on r0 when its last turn moved to r1 is gone too) and
    finds no prefix that step 0 computed. The draft history is tokens and survives:
    speculation accepts more in step 1, which has seen step 0's responses."""
    a = trajectory("a", 40, [30, 30], tool_s=0.5)  # turn 0 on r0, turn 1 on r1
    b = trajectory("b", 40, [30, 30], tool_s=0.5, rl_step=1)  # the same tokens
    cfg = SimConfig(num_replicas=2, replica=ReplicaConfig(
        spec_mode=mode, num_kv_blocks=4096, kv_hold_s=10.0))
    policy = KVWatch()
    sim = Simulator(cfg, LinearCost(A, B, C), Workload("two", ((a,), (b,))), policy)
    policy.sim = sim
    first, second = sim.run().steps
    assert policy.seen["a/1"][0] == (4, 4)  # "a"'s context (69 computed tokens) held
    assert policy.seen["b/0"] == [(0, 0), (0, 0)]
    assert first.cached_tokens == second.cached_tokens == 0
    if mode == "off":
        assert second.makespan == pytest.approx(first.makespan)
    else:
        assert second.accepted > first.accepted


def test_new_weights_need_an_idle_replica() -> None:
    """Synchronous RL updates the weights when nothing runs: a replica with a request
    in flight refuses them."""
    sim = Simulator(SimConfig(num_replicas=1, replica=ReplicaConfig(
        spec_mode="off", num_kv_blocks=64)), LinearCost(A, B, C),
        workload(trajectory("t", 10, [4])))
    r = sim.replicas[0]
    t = sim.workload.steps[0][0]
    r.submit(SimSeq(GenRequest("t/0", t.turns[0].prompt, SamplingParams()), t, 0,
                    t.turns[0].prompt, 0.0, 1))
    with pytest.raises(AssertionError, match="in flight"):
        r.load_weights(0.0)


def test_coalesced_steps_change_nothing_for_a_lone_sequence() -> None:
    t = trajectory("t", 300, [40, 25, 60], tool_s=0.7)
    wl = workload(_echo("e", 5000), t)

    def summary(coalesce: int) -> dict[str, object]:
        cfg = SimConfig(num_replicas=2, policy="round_robin", replica=ReplicaConfig(
            spec_mode="auto", num_kv_blocks=4096, max_coalesced_steps=coalesce))
        out = Simulator(cfg, LinearCost(A, B, 1e-7), wl).run().summary()
        out.pop("steps")
        return out

    exact, coalesced = summary(1), summary(64)
    assert coalesced == pytest.approx(exact, rel=1e-12)


def test_cached_drafts_from_a_replay() -> None:
    from war import data
    from war.sim.acceptance import record_acceptance
    from war.sim.drafter import CachedDrafter
    from war.sim.workload import TraceSet, build_trace_steps

    wl = build_trace_steps(TraceSet.load([data.resource(data.SAMPLE_TRACES)]), 2, 1)
    table = record_acceptance([t for s in wl.steps for t in s], SimConfig().spec)
    cfg = SimConfig(num_replicas=2, policy="war",
                    replica=ReplicaConfig(spec_mode="always", num_kv_blocks=8192))
    res = Simulator(cfg, LinearCost(A, B, C), wl,
                    make_drafter=lambda _i: CachedDrafter(table)).run().summary()
    rate = table.summary()["acceptance_rate"]
    assert res["tokens_per_step"] > 1.5
    assert abs(res["acceptance_rate"] - rate) < 0.1  # whole drafts: the table's own rate


@pytest.mark.parametrize("mode", ["auto", "always", "off"])
def test_lone_sequence_fast_path_matches_the_planner(mode: str) -> None:
    from war import data
    from war.sim.acceptance import record_acceptance
    from war.sim.drafter import CachedDrafter
    from war.sim.workload import TraceSet, build_trace_steps

    wl = build_trace_steps(TraceSet.load([data.resource(data.SAMPLE_TRACES)]), 2, 1)
    table = record_acceptance([t for s in wl.steps for t in s], SimConfig().spec)

    def summary(coalesce: int) -> dict[str, object]:
        # one trajectory per replica, sticky: nothing arrives while a replica is busy
        cfg = SimConfig(num_replicas=8, policy="least_load", replica=ReplicaConfig(
            spec_mode=mode, num_kv_blocks=8192, spec_interval=4,
            max_coalesced_steps=coalesce))
        sim = Simulator(cfg, LinearCost(A, B, 1e-7), wl,
                        make_drafter=lambda _i: CachedDrafter(table))
        out = sim.run().summary()
        out.pop("steps")
        return out

    exact, fast = summary(1), summary(1000)
    assert fast == pytest.approx(exact, rel=1e-9)


@pytest.mark.parametrize("share", ["one history", "forwarded", "off"])
def test_a_response_helps_drafts_on_another_replica_only_when_history_is_shared(
        share: str) -> None:
    """Step 0: trajectory a (group g) on replica r0; step 1: b, same group and same
    response text, on r1. With shared history b's drafts come from a's response:
    one history for every replica (the default) or responses forwarded to each
    replica's own speculator (custom drafters); without, r1 never saw it."""
    response = tuple(range(500, 700))
    a = SimTrajectory("a", "g", 0, (SimTurn(tuple(range(0, 50)), response, 0.0),), "a")
    b = SimTrajectory("b", "g", 1, (SimTurn(tuple(range(50, 100)), response, 0.0),), "b")
    spec = SpecConfig(use_global=False)
    cfg = SimConfig(num_replicas=2, policy="round_robin", spec=spec,
                    share_history=share != "off",
                    replica=ReplicaConfig(spec_mode="always", num_kv_blocks=4096))
    make = (lambda _i: LiveDrafter(spec)) if share == "forwarded" else None
    sim = Simulator(cfg, LinearCost(A, B, C), Workload("t", ((a,), (b,))), make_drafter=make)
    d0, d1 = (r.drafter for r in sim.replicas)
    assert isinstance(d0, LiveDrafter) and isinstance(d1, LiveDrafter)
    assert (d0.spec is d1.spec) == (share == "one history")
    sim.run()
    second = sim.result.steps[1]
    if share == "off":
        assert second.accepted == 0
    else:
        assert second.accepted > 150  # most of the 200 tokens come from a's response
        assert d1.spec.num_history_entries >= 1


@pytest.mark.parametrize("mode", ["always", "auto"])
def test_replicas_keep_one_tree_per_trajectory_with_the_same_drafts(mode: str) -> None:
    """With one history, the replicas keep one tree per trajectory between them: round
    robin moves every turn, and the results are those of one map per replica (as
    engines keep them, each catching a returning trajectory up) over the same
    speculator."""
    from war import data
    from war.sim.workload import LatencyModel, TraceSet, build_trace_steps

    traces = TraceSet.load([data.resource(data.SAMPLE_TRACES)])
    wl = build_trace_steps(traces, 2, 2, latency=LatencyModel(seed=1), seed=1)
    spec = SpecConfig()
    cfg = SimConfig(num_replicas=3, policy="round_robin", spec=spec,
                    replica=ReplicaConfig(spec_mode=mode, num_kv_blocks=4096))
    one = Simulator(cfg, LinearCost(A, B, C), wl)
    shared = SuffixSpeculator(spec)
    apart = Simulator(cfg, LinearCost(A, B, C), wl, make_drafter=lambda i: LiveDrafter(
        spec, shared=shared, first_id=i << 40))
    a, b = one.run(), apart.run()
    assert a.migrations > 0
    assert a.summary() == b.summary()
    assert [m.accepted for m in a.steps] == [m.accepted for m in b.steps]
    drafters = [r.drafter for r in one.replicas]
    assert all(isinstance(d, LiveDrafter) and d.drafts is drafters[0].drafts  # type: ignore[union-attr]
               for d in drafters)
    idle_apart = sum(r.drafter.drafts.num_idle for r in apart.replicas)  # type: ignore[union-attr]
    assert drafters[0].drafts.num_idle < idle_apart  # type: ignore[union-attr]


def test_a_trajectory_map_must_belong_to_the_shared_speculator() -> None:
    from war.engine.drafting import TrajectoryDrafts

    spec = SpecConfig()
    other = TrajectoryDrafts(SuffixSpeculator(spec), 16)
    with pytest.raises(ValueError, match="shared speculator"):
        LiveDrafter(spec, shared=SuffixSpeculator(spec), trajectories=other)
    with pytest.raises(ValueError, match="shared speculator"):
        LiveDrafter(spec, trajectories=other)

"""KV holds and whole-prompt admission on simulated replicas: a trajectory's context
stays pinned through its tool call, a cold request waits instead of evicting it, holds
expire, give way before a running sequence is preempted, and are released when the
trajectory ends."""

from __future__ import annotations

import dataclasses

import pytest
from sim_helpers import FixedPolicy, trajectory, workload

from war.engine.spec_policy import SpecPolicy, SpecPolicyConfig
from war.sim.costs import LinearCost
from war.sim.replica import ReplicaConfig, SimReplica
from war.sim.sequence import SimSeq
from war.sim.simulator import SimConfig, Simulator
from war.sim.workload import SimTrajectory, Workload
from war.types import GenRequest, GenResult, SamplingParams


class Recorder(FixedPolicy):
    """Everything to r0; records when each trajectory's turns complete."""

    def __init__(self) -> None:
        super().__init__("r0")
        self.done: list[tuple[str, float]] = []

    def on_complete(self, request: GenRequest, result: GenResult | None, replica: str,
                    now: float) -> None:
        assert request.trajectory_id is not None
        self.done.append((request.trajectory_id, now))

    def end(self, tid: str) -> float:
        return max(t for name, t in self.done if name == tid)


def run(wl: Workload, hold_s: float, whole: bool = True, blocks: int = 20
        ) -> tuple[Simulator, Recorder]:
    cfg = SimConfig(num_replicas=1, replica=ReplicaConfig(
        spec_mode="off", num_kv_blocks=blocks, block_size=16, kv_hold_s=hold_s,
        admit_whole_prompt=whole))
    policy = Recorder()
    sim = Simulator(cfg, LinearCost(0.01, 0.001, 0.0), wl, policy)
    sim.run()
    return sim, policy


def two_trajectories(tool_s: float) -> Workload:
    # 320 KV tokens (20 blocks). "a" holds 10 blocks after its first turn (175 of its
    # 176 tokens computed: the last sampled token has no KV), 13 at the end; "b" needs
    # 13 blocks for its 200-token prompt: both never fit at once.
    a = trajectory("a", 160, [16, 16, 16], tool_s=tool_s, base=0)
    b = trajectory("b", 200, [16], base=1000)
    return workload(a, b)


def test_a_held_context_survives_its_tool_calls_and_a_cold_request_waits() -> None:
    sim, policy = run(two_trajectories(tool_s=1.0), hold_s=10.0)
    st = sim.replicas[0].stats
    # "a" prefills its first prompt, then only what has no KV: 21 tokens (160 of 181
    # cached: the whole blocks of the 175 tokens computed), then 10 (192 of 202
    # cached); "b" its whole prompt, once.
    assert st.prefill_tokens == 160 + 21 + 10 + 200
    assert (st.holds, st.holds_used, st.holds_broken, st.preemptions) == (4, 2, 0, 0)
    # "b" waited through both tool calls: it starts after "a" has ended.
    assert policy.end("b") > policy.end("a") + 0.2
    assert sim.result.steps[0].generated == 3 * 16 + 16
    kv = sim.replicas[0].kv
    assert kv.locked_blocks == 0 and kv.private_blocks == 0  # released at the end


def test_without_holds_the_cold_request_evicts_the_context() -> None:
    sim, policy = run(two_trajectories(tool_s=1.0), hold_s=0.0)
    st = sim.replicas[0].stats
    assert st.prefill_tokens > 160 + 5 + 10 + 200  # "a" recomputes what "b" evicted
    assert st.holds == 0
    assert policy.end("b") < policy.end("a")
    assert sim.result.steps[0].generated == 3 * 16 + 16


def test_the_next_rl_step_starts_when_the_last_one_ends() -> None:
    """"b" waits for "a"'s hold, so its replica is to look again when the hold would
    expire (10 s on); the step ends before that, and the next starts at its end, with
    no hold left (new weights)."""
    a, b = two_trajectories(tool_s=1.0).steps[0]
    again = [dataclasses.replace(t, traj_id=t.traj_id + "'", rl_step=1) for t in (a, b)]
    sim, _ = run(Workload("two", ((a, b), tuple(again))), hold_s=10.0)
    first, second = sim.result.steps
    assert second.start == first.end
    assert second.makespan == pytest.approx(first.makespan)


def test_a_hold_expires_when_the_tool_call_outlasts_it() -> None:
    held, p_held = run(two_trajectories(tool_s=5.0), hold_s=10.0)
    expired, p_expired = run(two_trajectories(tool_s=5.0), hold_s=1.0)
    assert p_held.end("b") > p_held.end("a")
    # After "a"'s first turn its hold lasts 1 s: "b" runs then, during the tool call.
    first = min(t for name, t in p_expired.done if name == "a")
    assert first + 1.0 <= p_expired.end("b") < first + 5.0
    assert expired.replicas[0].stats.holds_used < held.replicas[0].stats.holds_used


def test_a_hold_gives_way_before_a_running_sequence_is_preempted() -> None:
    # "a" (100-token prompt, 6 blocks held: 111 tokens computed) is held through a 5 s
    # tool call while "c" grows to 250 tokens (16 blocks): 22 blocks of 20, so the hold
    # is broken, nobody preempted.
    a = trajectory("a", 100, [12, 12], tool_s=5.0, base=0)
    c = trajectory("c", 50, [200], base=1000)
    sim, _ = run(workload(a, c), hold_s=10.0)
    st = sim.replicas[0].stats
    assert (st.holds_broken, st.preemptions) == (1, 0)
    assert sim.result.steps[0].generated == 12 + 12 + 200


def replica_with_held(a_priority: float) -> tuple[SimReplica, float]:
    """A replica of 320 KV tokens that served "a"'s first turn (10 blocks now held: the
    whole blocks of the 175 of its 176 tokens computed); returns it and the time."""
    replica = SimReplica("r0", ReplicaConfig(spec_mode="off", num_kv_blocks=20,
                                             block_size=16, kv_hold_s=10.0,
                                             admit_whole_prompt=True),
                         LinearCost(0.01, 0.001, 0.0), None,
                         SpecPolicy(SpecPolicyConfig(mode="off")))
    a = trajectory("a", 160, [16, 16], tool_s=1.0, base=0)
    replica.submit(seq_of(a, a_priority, 1))
    now = 0.0
    while replica.has_work():
        dt = replica.start_step(now)
        assert dt is not None
        now += dt
        replica.finish_step(now)
    assert replica.kv.locked_blocks == 10
    return replica, now


def seq_of(t: SimTrajectory, priority: float, order: int) -> SimSeq:
    req = GenRequest(f"{t.traj_id}/0", t.turns[0].prompt, SamplingParams(max_tokens=64),
                     trajectory_id=t.traj_id)
    return SimSeq(req, t, 0, t.turns[0].prompt, priority, order)


def test_a_cold_request_waits_for_a_held_context_whatever_its_priority() -> None:
    cold = trajectory("c", 200, [16], base=1000)  # 13 blocks: 10 are left beside "a"
    for priority in (1.0, 5.0):
        replica, now = replica_with_held(a_priority=1.0)
        replica.submit(seq_of(cold, priority, 2))
        assert replica.start_step(now) is None  # it waits for "a"'s hold
        assert replica.hold_expiry == pytest.approx(now + 10.0)
        # ... which expires: then it runs
        dt = replica.start_step(now + 10.0)
        assert dt is not None and replica.stats.holds_broken == 0
        assert replica.kv.locked_blocks == 0  # "a"'s hold expired


def test_a_held_turn_that_cannot_fit_waits_for_a_hold_to_end() -> None:
    # 320 KV tokens: "a" and "u" both held (the whole blocks of 175 + 111 computed
    # tokens, 16 blocks); "a"'s next turn (100 new tokens, 276 in all) needs 8 more
    # blocks with nothing else running: the replica
    # idles until a hold ends ("u"'s turn comes back after its 5 s tool call).
    a = trajectory("a", 160, [16, 16], tool_s=1.0, base=0)
    a = dataclasses.replace(a, turns=(a.turns[0], dataclasses.replace(
        a.turns[1], prompt=tuple(range(5000, 5100)))))
    u = trajectory("u", 100, [12, 12], tool_s=5.0, base=1000)
    sim, policy = run(workload(a, u), hold_s=10.0)
    st = sim.replicas[0].stats
    assert st.holds_broken == 0 and st.preemptions == 0
    u_first = min(t for name, t in policy.done if name == "u")
    assert policy.end("a") > u_first + 5.0  # it waited for "u"'s next turn
    assert sim.result.steps[0].generated == 16 + 16 + 12 + 12


def test_whole_prompt_admission_avoids_preempting_running_sequences() -> None:
    trajs = [trajectory(f"t{i}", 100, [150], base=1000 * i) for i in range(6)]
    chunked, _ = run(workload(*trajs), hold_s=0.0, whole=False, blocks=40)
    whole, _ = run(workload(*trajs), hold_s=0.0, whole=True, blocks=40)
    assert chunked.result.preemptions > 0
    assert whole.result.preemptions < chunked.result.preemptions
    assert whole.result.steps[0].generated == chunked.result.steps[0].generated == 6 * 150


def test_hold_settings_are_validated() -> None:
    with pytest.raises(ValueError, match="kv_hold_s"):
        ReplicaConfig(kv_hold_s=-1.0)
    with pytest.raises(ValueError, match="kv_hold_s"):
        ReplicaConfig(kv_hold_s=float("nan"))

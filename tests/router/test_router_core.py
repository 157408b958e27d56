"""The router over fake backends: failover and retries, continuing turns moved
between replicas, shared history, health checks."""

from __future__ import annotations

import asyncio
import math
from collections.abc import Sequence

import pytest

from war.backends.base import ReplicaUnavailable
from war.router.policies.base import Decision, ReplicaView
from war.router.router import NoReplicaAvailable, Router, RouterConfig
from war.types import GenRequest, GenResult, ReplicaLoad, SamplingParams, UnknownTrajectory

SP = SamplingParams(temperature=0.0, max_tokens=3)


class Echo:
    """A replica whose output is a function of the whole context, which it keeps
    per trajectory like a WAR replica does."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.down = False
        self.fail_next = 0
        self.held: dict[str, list[int]] = {}
        self.requests: list[GenRequest] = []
        self.history: list[tuple[list[int], str | None]] = []
        self.history_calls = 0

    async def generate(self, request: GenRequest) -> GenResult:
        self.requests.append(request)
        await asyncio.sleep(0)
        if self.down or self.fail_next:
            self.fail_next = max(0, self.fail_next - 1)
            raise ReplicaUnavailable(f"{self.name} is down")
        if request.continues:
            held = self.held.get(request.trajectory_id or "")
            if held is None:
                raise UnknownTrajectory("not here")
            ctx = held + list(request.prompt_ids)
        else:
            ctx = list(request.prompt_ids)
        out = tuple((sum(ctx) + i) % 50 for i in range(request.sampling.max_tokens))
        if request.trajectory_id:
            self.held[request.trajectory_id] = ctx + list(out)
        return GenResult(request.request_id, out, (-0.5,) * len(out), "length", len(ctx))

    async def load(self) -> ReplicaLoad:
        if self.down:
            raise ReplicaUnavailable("down")
        return ReplicaLoad(0, 0, 0, 1, 100, 16)

    async def health(self) -> bool:
        return not self.down

    async def add_history(self, items: Sequence[tuple[Sequence[int], str | None]]) -> None:
        self.history_calls += 1
        self.history.extend((list(t), g) for t, g in items)

    async def close(self) -> None:
        pass


class Sticky:
    """A minimal policy: a trajectory stays where it started; new ones go to the
    replica with the fewest requests (ties by name)."""

    name = "sticky"

    def __init__(self) -> None:
        self.home: dict[str, str] = {}
        self.completed: list[tuple[str, bool]] = []
        self.down: list[str] = []

    def select(self, request: GenRequest, replicas: list[ReplicaView], now: float) -> Decision:
        names = [r.name for r in replicas]
        tid = request.trajectory_id or request.request_id
        home = self.home.get(tid)
        if home in names:
            return Decision(home, priority=7.0)
        best = min(replicas, key=lambda r: (r.num_requests, r.name)).name
        self.home[tid] = best
        return Decision(best, priority=7.0, migrated=home is not None)

    def on_complete(self, request: GenRequest, result: GenResult | None, replica: str,
                    now: float) -> None:
        self.completed.append((replica, result is not None))

    def on_replica_down(self, replica: str, now: float) -> None:
        self.down.append(replica)


def router(*names: str, **cfg: object) -> tuple[Router, dict[str, Echo], Sticky]:
    reps = {n: Echo(n) for n in names}
    policy = Sticky()
    return Router(reps, policy, RouterConfig(**cfg), clock=lambda: 0.0), reps, policy  # type: ignore[arg-type]


def test_routes_sets_priority_and_shares_history() -> None:
    r, reps, _policy = router("a", "b")

    async def main() -> list[GenResult]:
        out = await asyncio.gather(*[
            r.generate(GenRequest(f"q{i}", (i, 1), SP, trajectory_id=f"t{i}", group_id="g"))
            for i in range(4)])
        await asyncio.sleep(0.01)
        # history forwarding is in the background, gathered for history_flush_s
        assert reps["a"].history == [] and reps["b"].history == []
        await asyncio.sleep(r.config.history_flush_s + 0.05)
        return list(out)

    out = asyncio.run(main())
    assert [o.output_ids[0] for o in out] == [(i + 1) % 50 for i in range(4)]
    assert all(q.priority == 7.0 for rep in reps.values() for q in rep.requests)
    assert r.stats.completed == 4 and sorted(r.stats.per_replica.values()) == [2, 2]
    # each replica got the other's responses as draft history, in one call
    assert len(reps["a"].history) == 2 and len(reps["b"].history) == 2
    assert reps["a"].history_calls == 1 and reps["b"].history_calls == 1
    assert r.stats.history_forwarded == 4
    # each entry: the prompt's last tokens (its lead-in, up to 8), then the response
    assert sorted(reps["a"].history + reps["b"].history) == sorted(
        ([i, 1, *out[i].output_ids], "g") for i in range(4))


@pytest.mark.parametrize("flush_s, batch, calls", [(0.0, 64, 3), (10.0, 2, 1)])
def test_history_is_sent_at_once_or_in_full_batches(flush_s: float, batch: int,
                                                     calls: int) -> None:
    r, reps, _policy = router("a", "b", history_flush_s=flush_s, history_batch=batch)

    async def main() -> None:
        for i in range(3):  # b serves nothing: the sticky test policy sends all to a
            await r.generate(GenRequest(f"q{i}", (0, 1), SP, trajectory_id="t", group_id="g"))
        await asyncio.sleep(0.01)
        await r.close()

    asyncio.run(main())
    # at once: three calls; batches of two: one full batch sent, the third waits
    # for a flush that close() cancels (history is an optimization)
    assert reps["b"].history_calls == calls
    assert len(reps["b"].history) == (3 if flush_s == 0 else 2)
    with pytest.raises(ValueError, match="history_batch"):
        RouterConfig(history_batch=0)
    with pytest.raises(ValueError, match="history_flush_s"):
        RouterConfig(history_flush_s=-1.0)
    with pytest.raises(ValueError, match="history_lead_in"):
        RouterConfig(history_lead_in=-1)


def test_failover_retries_elsewhere_with_the_whole_context() -> None:
    r, reps, policy = router("a", "b")

    async def main() -> tuple[GenResult, GenResult, GenResult]:
        first = await r.generate(GenRequest("t/0", (1, 2, 3), SP, trajectory_id="t"))
        home = reps["a"] if reps["a"].requests else reps["b"]
        other = reps["b"] if home is reps["a"] else reps["a"]
        home.down = True
        # the next turn sends only its new tokens; the router resends the whole context
        second = await r.generate(GenRequest("t/1", (9,), SP, trajectory_id="t", continues=True))
        assert other.requests[-1].continues is False
        assert list(other.requests[-1].prompt_ids) == [1, 2, 3, *first.output_ids, 9]
        ref = Echo("ref")
        want = await ref.generate(GenRequest("x", (1, 2, 3, *first.output_ids, 9), SP))
        return first, second, want

    _first, second, want = asyncio.run(main())
    assert second.output_ids == want.output_ids
    assert r.stats.retries == 1 and r.stats.replicas_marked_down == 1
    # the continuing turn went whole to the other replica: counted as a resent context
    assert r.stats.resent_contexts == 1
    assert len(policy.down) == 1 and (policy.down[0], False) in policy.completed


class Placed:
    """A policy that places requests as scripted (names in turn) and never says that a
    trajectory moved, as ``round_robin`` does not."""

    name = "placed"

    def __init__(self, *names: str) -> None:
        self.names = list(names)
        self.completed: list[tuple[str, str, bool]] = []

    def select(self, request: GenRequest, replicas: list[ReplicaView], now: float) -> Decision:
        return Decision(self.names.pop(0))

    def on_complete(self, request: GenRequest, result: GenResult | None, replica: str,
                    now: float) -> None:
        self.completed.append((request.request_id, replica, result is not None))

    def on_replica_down(self, replica: str, now: float) -> None:
        pass


def test_a_continuing_turn_goes_whole_to_any_replica_but_its_home() -> None:
    # turn 0 on a, turn 1 on b, turn 2 back on a (which holds turn 0's context only),
    # turn 3 on a again (its home now), turn 4 on c which fails, retried on b (which
    # holds turn 1's context)
    reps = {n: Echo(n) for n in "abc"}
    policy = Placed("a", "b", "a", "a", "c", "b")
    r = Router(reps, policy, RouterConfig(), clock=lambda: 0.0)  # type: ignore[arg-type]
    ref = Echo("ref")

    async def main() -> None:
        context: list[int] = []
        for i, new in enumerate([(1, 2, 3), (4, 5), (6,), (7,), (8,)]):
            if i == 4:
                reps["c"].fail_next = 1
            res, where = await r.route(GenRequest(f"t/{i}", new, SP, trajectory_id="t",
                                                  continues=i > 0))
            context += new
            want = await ref.generate(GenRequest("x", tuple(context), SP))
            assert res.output_ids == want.output_ids, f"turn {i} on {where}"
            assert res.num_prompt_tokens == len(context)
            context += res.output_ids
            sent = reps[where].requests[-1]
            # only the home of the last turn is sent the new tokens alone
            assert sent.continues == (i == 3), f"turn {i}"

    asyncio.run(main())
    assert r.stats.retries == 1 and r.stats.completed == 5
    # every whole send of a continuing turn counts: turns 1 and 2, turn 4 twice
    assert r.stats.resent_contexts == 4


def test_a_continuing_turn_moved_without_its_context_goes_back_to_the_client() -> None:
    # the context is not held (too large): a turn placed away from its home cannot be
    # sent whole, and sending its new tokens there would extend a stale context
    reps = {n: Echo(n) for n in "ab"}
    policy = Placed("a", "b", "a", "b")
    r = Router(reps, policy, RouterConfig(max_context_tokens=4),  # type: ignore[arg-type]
               clock=lambda: 0.0)

    async def main() -> None:
        await r.route(GenRequest("t/0", (1, 2, 3), SP, trajectory_id="t"))
        await r.route(GenRequest("t/1", (4, 5, 6), SP, trajectory_id="t"))  # whole, on b
        with pytest.raises(UnknownTrajectory, match="send the whole context"):
            await r.route(GenRequest("t/2", (7,), SP, trajectory_id="t", continues=True))
        assert len(reps["a"].requests) == 1  # nothing sent
        assert policy.completed[-1] == ("t/2", "a", False)  # the policy forgets it
        # at its home, it continues
        res, where = await r.route(GenRequest("t/3", (7,), SP, trajectory_id="t",
                                              continues=True))
        assert where == "b" and res.num_prompt_tokens == 3 + 3 + 1

    asyncio.run(main())
    assert r.stats.failed == 1


def test_unknown_trajectory_is_resent_whole_and_down_replicas_rejoin() -> None:
    r, reps, _ = router("a")

    async def main() -> None:
        await r.generate(GenRequest("t/0", (4, 5), SP, trajectory_id="t"))
        reps["a"].held.clear()  # e.g. the replica evicted it
        res = await r.generate(GenRequest("t/1", (6,), SP, trajectory_id="t", continues=True))
        assert res.num_prompt_tokens == 2 + 3 + 1
        assert r.stats.resent_contexts == 1
        reps["a"].down = True
        with pytest.raises(NoReplicaAvailable):
            await r.generate(GenRequest("u", (1,), SP))
        with pytest.raises(NoReplicaAvailable, match="no replica is up"):
            await r.generate(GenRequest("v", (1,), SP))
        reps["a"].down = False
        await r.check_health()
        assert (await r.generate(GenRequest("w", (1,), SP))).output_ids

    asyncio.run(main())


def test_refusals_are_not_retried_and_unknown_contexts_go_back_to_the_client() -> None:
    r, _reps, _ = router("a", "b")

    class Refuse(Echo):
        async def generate(self, request: GenRequest) -> GenResult:
            raise ValueError("token id 999 outside the vocabulary")

    r.replicas["a"].backend = Refuse("a")
    r.replicas["b"].backend = Refuse("b")

    async def main() -> None:
        with pytest.raises(ValueError, match="vocabulary"):
            await r.generate(GenRequest("q", (1,), SP))

    asyncio.run(main())
    assert r.stats.retries == 0
    r2, reps2, _ = router("a", "b")
    reps2["a"].down = reps2["b"].down = False

    async def cont() -> None:
        with pytest.raises(UnknownTrajectory):  # the router never saw this trajectory
            await r2.generate(GenRequest("q", (1,), SP, trajectory_id="zz", continues=True))

    asyncio.run(cont())


def test_held_contexts_are_bounded_in_tokens_least_recently_used_first() -> None:
    # SP generates 3 tokens: a 10-token prompt leaves a 13-token context
    r, reps, _ = router("a", "b", max_context_tokens=29)

    async def main() -> None:
        await r.generate(GenRequest("t1/0", tuple(range(10)), SP, trajectory_id="t1"))
        await r.generate(GenRequest("t2/0", tuple(range(10)), SP, trajectory_id="t2"))
        assert r.held_context_tokens == 26 and r.stats.contexts_dropped == 0
        await r.generate(GenRequest("t1/1", (7,), SP, trajectory_id="t1", continues=True))
        # t1 grew to 17 tokens and is the most recent: t2 (the least recent) goes
        assert list(r._contexts) == ["t1"] and r.held_context_tokens == 17
        assert r.stats.contexts_dropped == 1
        # t2's next turn still goes to its replica, which holds its context...
        home = reps[r._homes["t2"]]
        ok = await r.generate(GenRequest("t2/1", (8,), SP, trajectory_id="t2", continues=True))
        assert ok.num_prompt_tokens == 14 and home.requests[-1].continues
        assert "t2" not in r._contexts  # (its whole context is not known here)
        # ... and when that replica fails, its client is asked for the whole context
        home.down = True
        with pytest.raises(UnknownTrajectory):
            await r.generate(GenRequest("t2/2", (9,), SP, trajectory_id="t2", continues=True))
        home.down = False
        # a context larger than the bound is not held at all; finishing frees at once
        await r.generate(GenRequest("big", tuple(range(40)), SP, trajectory_id="big"))
        assert "big" not in r._contexts and r.stats.contexts_dropped == 2
        assert r.held_context_tokens == 17
        assert r.finish_trajectory("t1") and r.held_context_tokens == 0
        assert not r.finish_trajectory("t1")

    asyncio.run(main())
    with pytest.raises(ValueError, match="max_context_tokens"):
        RouterConfig(max_context_tokens=-1)


def test_retry_budget_and_config_validation() -> None:
    r, reps, _ = router("a", "b", "c", max_attempts=2)
    for rep in reps.values():
        rep.fail_next = 1

    async def main() -> None:
        with pytest.raises(NoReplicaAvailable, match="failed on"):
            await r.generate(GenRequest("q", (1,), SP))

    asyncio.run(main())
    assert r.stats.failed == 1
    with pytest.raises(ValueError):
        RouterConfig(max_attempts=0)
    for bad in (0.0, -1.0, math.inf, math.nan):
        with pytest.raises(ValueError, match="health_interval_s must be a finite number"):
            RouterConfig(health_interval_s=bad)
    with pytest.raises(ValueError, match="at least one"):
        Router({}, Sticky())


def test_health_loop_runs_and_stops() -> None:
    r, reps, _ = router("a", health_interval_s=0.01)

    async def main() -> None:
        async with r:
            reps["a"].down = True
            r.replicas["a"].healthy = False
            reps["a"].down = False
            for _ in range(200):
                await asyncio.sleep(0.01)
                if r.replicas["a"].healthy:
                    break
            assert r.replicas["a"].healthy
            assert r.replicas["a"].load is not None

    asyncio.run(main())


class Hung(Echo):
    """A replica that accepts calls but never answers them (its health check too,
    once ``health_hangs``)."""

    health_hangs = False

    async def load(self) -> ReplicaLoad:
        await asyncio.Event().wait()
        raise AssertionError("unreachable")

    async def health(self) -> bool:
        if self.health_hangs:
            await asyncio.Event().wait()
        return True


def test_a_hung_replica_holds_up_no_other_health_check_and_is_marked_down() -> None:
    reps: dict[str, Echo] = {"a": Hung("a"), "b": Echo("b")}
    policy = Sticky()
    r = Router(reps, policy, RouterConfig(health_timeout_s=0.3),  # type: ignore[arg-type]
               clock=lambda: 0.0)
    r._mark_down("b", RuntimeError("it failed earlier"))  # ... and answers again now

    async def main() -> None:
        t0 = asyncio.get_running_loop().time()
        round_ = asyncio.create_task(r.check_health())
        for _ in range(100):
            await asyncio.sleep(0.01)
            if r.replicas["b"].healthy:
                break
        # b is back (with its load) while a's check still hangs
        assert r.replicas["b"].healthy and r.replicas["b"].load is not None
        assert not round_.done() and r.replicas["a"].healthy
        await asyncio.wait_for(round_, 5)
        assert asyncio.get_running_loop().time() - t0 < 2
        # a's check ran out of its bound: a is down, and its requests go elsewhere
        assert not r.replicas["a"].healthy and policy.down == ["b", "a"]
        assert r.replicas["a"].failures == 1
        # a down replica whose health check hangs stays down, without a new failure
        reps["a"].health_hangs = True  # type: ignore[attr-defined]
        await asyncio.wait_for(r.check_health(), 5)
        assert not r.replicas["a"].healthy and r.replicas["a"].failures == 1

    asyncio.run(main())
    with pytest.raises(ValueError, match="health_timeout_s"):
        RouterConfig(health_timeout_s=0)
    with pytest.raises(ValueError, match="health_timeout_s"):
        RouterConfig(health_timeout_s=float("inf"))


def test_finish_trajectory_drops_the_context_and_tells_the_policy() -> None:
    r, _reps, policy = router("a", "b")
    told: list[tuple[str, float]] = []
    policy.finish_trajectory = lambda tid, now: told.append((tid, now))  # type: ignore[attr-defined]

    async def main() -> None:
        await r.generate(GenRequest("q0", (1, 2), SP, trajectory_id="t0", group_id="g"))

    asyncio.run(main())
    assert r.finish_trajectory("t0") is True  # the router held its context
    assert r.finish_trajectory("t0") is False  # nothing left; the policy still hears of it
    assert told == [("t0", 0.0), ("t0", 0.0)]
    # a continuing turn of a finished trajectory has no context to fall back on
    assert r._full_prompt(GenRequest("q1", (3,), SP, trajectory_id="t0",
                                     continues=True)) is None
    with pytest.raises(ValueError, match="trajectory_id"):
        r.finish_trajectory("")
    # a policy without the hook is fine
    plain, _, _ = router("a")
    assert plain.finish_trajectory("nobody") is False


def test_deliver_comes_before_the_bookkeeping_which_runs_even_if_it_fails() -> None:
    r, _reps, policy = router("a", "b")
    seen: list[tuple[str, int, int]] = []  # (replica, policy feedback so far, contexts held)

    def deliver(result: GenResult, replica: str) -> None:
        seen.append((replica, len(policy.completed), len(r._contexts)))

    def failing(result: GenResult, replica: str) -> None:
        raise RuntimeError("the client's answer failed")

    async def main() -> None:
        result, where = await r.route(GenRequest("q1", (1, 2), SP, trajectory_id="t1"), deliver)
        assert seen == [(where, 0, 0)]  # delivered before the policy and the context knew
        assert policy.completed == [(where, True)] and "t1" in r._contexts
        assert result.output_ids == (3, 4, 5)
        with pytest.raises(RuntimeError, match="answer failed"):
            await r.route(GenRequest("q2", (1,), SP, trajectory_id="t2"), failing)
        # the failed delivery did not stop the bookkeeping
        assert len(policy.completed) == 2 and "t2" in r._contexts

    asyncio.run(main())
    assert r.stats.completed == 2


def test_views_follow_load_reports_and_health() -> None:
    r, _reps, _ = router("a", "b")
    assert r.views() == [ReplicaView("a"), ReplicaView("b")]  # nothing reported yet
    r.replicas["a"].load = ReplicaLoad(num_running=1, num_waiting=3, tokens_in_flight=40,
                                       kv_blocks_used=6, kv_blocks_total=10, block_size=16)
    r.replicas["b"].load = ReplicaLoad(num_running=0, num_waiting=2, tokens_in_flight=0,
                                       kv_blocks_used=0, kv_blocks_total=0, block_size=16)
    r.replicas["b"].healthy = False
    r.replicas["b"].num_requests, r.replicas["b"].tokens_in_flight = 2, 70
    # a: 4 free blocks of 16 tokens out of 160; b reports no capacity (0 blocks): unknown
    assert r.views() == [ReplicaView("a", True, 0, 0, 64, 160, 3),
                         ReplicaView("b", False, 2, 70, None, None, 2)]
    r.replicas["a"].load = None
    assert r.views()[0] == ReplicaView("a")


def test_turns_routed_without_hold_keep_no_context() -> None:
    r, reps, _ = router("a", "b")

    async def main() -> None:
        await r.route(GenRequest("t1/0", tuple(range(10)), SP, trajectory_id="t1"))
        assert r.held_context_tokens == 13  # 10 prompt tokens + 3 generated
        # a whole turn routed without hold: nothing held, the earlier (now stale) copy gone
        _, where = await r.route(GenRequest("t1/1", tuple(range(15)), SP, trajectory_id="t1"),
                                 None, False)
        assert r.held_context_tokens == 0 and "t1" not in r._contexts
        assert r._homes["t1"] == where  # the trajectory's home is still known
        assert r.stats.contexts_dropped == 0  # (dropped as stale, not for the bounds)
        # its next turn may not send only new tokens if its replica fails: the client is
        # asked for the whole context
        reps[where].down = True
        with pytest.raises(UnknownTrajectory):
            await r.route(GenRequest("t1/2", (7,), SP, trajectory_id="t1", continues=True))
        reps[where].down = False
        # other trajectories are not touched; a trajectory without an id holds nothing
        await r.route(GenRequest("t2/0", (1, 2), SP, trajectory_id="t2"))
        await r.route(GenRequest("x", (1, 2), SP), None, False)
        assert list(r._contexts) == ["t2"] and r.held_context_tokens == 5

    asyncio.run(main())


def test_the_policys_priority_goes_only_to_replicas_that_take_it() -> None:
    reps = {"a": Echo("a"), "b": Echo("b")}
    reps["b"].takes_priority = False  # type: ignore[attr-defined]  # (e.g. FCFS servers)
    r = Router(reps, Sticky(), RouterConfig(), clock=lambda: 0.0)  # type: ignore[arg-type]

    async def main() -> None:
        # Sticky sends new trajectories to the least busy replica with priority 7: a, then
        # b while a's request is in flight
        await asyncio.gather(
            r.route(GenRequest("q0", (1, 2), SP, trajectory_id="t0", priority=1.0)),
            r.route(GenRequest("q1", (1, 2), SP, trajectory_id="t1", priority=1.0)))

    asyncio.run(main())
    (to_a,), (to_b,) = reps["a"].requests, reps["b"].requests
    assert to_a.priority == 7.0  # no attribute: the policy's priority is sent
    assert to_b.priority == 1.0 and to_b == GenRequest("q1", (1, 2), SP, trajectory_id="t1",
                                                       priority=1.0)


def test_a_policy_choosing_a_down_replica_is_told_the_request_failed() -> None:
    r, reps, _policy = router("a", "b")

    class Stray(Sticky):
        def select(self, request: GenRequest, replicas: list[ReplicaView],
                   now: float) -> Decision:
            return Decision("elsewhere")

    stray = Stray()
    r.policy = stray

    async def main() -> None:
        with pytest.raises(RuntimeError, match="not a healthy replica"):
            await r.generate(GenRequest("q", (1,), SP))

    asyncio.run(main())
    # the policy may have counted the request as placed: it hears that it failed
    assert stray.completed == [("elsewhere", False)]
    assert r.stats.failed == 1 and r.stats.completed == 0
    assert all(not rep.requests for rep in reps.values())


def test_a_continuing_turn_whose_context_is_lost_counts_as_failed() -> None:
    r, _reps, _ = router("a", "b")

    async def main() -> None:
        with pytest.raises(UnknownTrajectory):  # neither the router nor a replica holds it
            await r.generate(GenRequest("q", (1,), SP, trajectory_id="zz", continues=True))

    asyncio.run(main())
    assert r.stats.requests == 1 and r.stats.failed == 1


def test_close_waits_for_the_background_work_it_cancels() -> None:
    reps: dict[str, Echo] = {"a": Echo("a"), "b": Echo("b")}
    closed: list[str] = []

    class Slow(Echo):
        async def add_history(self, items: Sequence[tuple[Sequence[int], str | None]]
                              ) -> None:
            try:
                await asyncio.Event().wait()
            finally:
                closed.append("history")

        async def close(self) -> None:
            closed.append("backend")

    reps["b"] = Slow("b")
    r = Router(reps, Sticky(), RouterConfig(history_flush_s=0), clock=lambda: 0.0)  # type: ignore[arg-type]

    async def main() -> None:
        await r.generate(GenRequest("q", (1, 2), SP, trajectory_id="t", group_id="g"))
        await asyncio.sleep(0.01)  # the history call to b is under way
        tasks = set(r._background)
        assert tasks
        await r.close()
        # nothing the router started runs past its close, nor after its backends close
        assert all(t.done() for t in tasks)
        assert closed == ["history", "backend"]

    asyncio.run(main())


@pytest.mark.parametrize("field", ["max_attempts", "history_batch", "history_lead_in",
                                   "max_trajectories", "max_context_tokens"])
@pytest.mark.parametrize("bad", [math.nan, 2.5, True, "8"])
def test_integer_settings_must_be_ints(field: str, bad: object) -> None:
    with pytest.raises(ValueError, match=f"{field} must be an int"):
        RouterConfig(**{field: bad})  # type: ignore[arg-type]


def test_history_flush_s_must_be_finite() -> None:
    for bad in (math.inf, math.nan, -0.5):
        with pytest.raises(ValueError, match="history_flush_s must be a finite number"):
            RouterConfig(history_flush_s=bad)
    assert RouterConfig(history_flush_s=0).history_flush_s == 0


def test_a_continuing_turn_sent_back_to_its_client_is_not_counted_as_retried() -> None:
    r, reps, _ = router("a", "b")

    async def main() -> None:
        _, where = await r.route(GenRequest("t/0", (1, 2), SP, trajectory_id="t"), None, False)
        reps[where].down = True  # its home fails; the router holds no context to resend
        with pytest.raises(UnknownTrajectory):
            await r.route(GenRequest("t/1", (7,), SP, trajectory_id="t", continues=True))

    asyncio.run(main())
    assert r.stats.failed == 1 and r.stats.retries == 0  # nothing was sent again


def test_a_replica_rejoins_only_with_a_fresh_load_report() -> None:
    r, _reps, _ = router("a", "b")
    seen: list[bool] = []

    class BadLoad(Echo):
        """Answers its health check; its load report fails (or, once ``ok``, is
        checked while the router's view of it is recorded)."""

        ok = False

        async def load(self) -> ReplicaLoad:
            seen.append(r.replicas["b"].healthy)
            if not self.ok:
                raise ReplicaUnavailable("load: 500")
            return ReplicaLoad(0, 0, 0, 3, 100, 16)

    bad = BadLoad("b")
    r.replicas["b"].backend = bad

    async def main() -> None:
        await r.check_health()  # b was up: marked down by its failed load report
        assert not r.replicas["b"].healthy and r.stats.replicas_marked_down == 1
        for _ in range(3):  # its health check passes, its load still fails: stays down
            await r.check_health()
        assert not r.replicas["b"].healthy and r.stats.replicas_marked_down == 1
        bad.ok = True
        await r.check_health()

    asyncio.run(main())
    # never offered to requests while its load was being asked for after going down
    assert seen == [True, False, False, False, False]
    assert r.replicas["b"].healthy and r.views()[1].kv_free_tokens == 97 * 16

"""A replica that stalls (its health check answers, its generations never complete: an
engine loop wedged behind a live HTTP front): with ``RouterConfig.stall_timeout_s`` it is
marked down once it has had requests in flight that long with none completing, its
requests are failed over and answered once, and it rejoins only when its health check
passes a health interval later with nothing of the router's left in flight there.
Without the setting nothing changes; a slow replica that completes requests, or an idle
one, is never taken for stalled. Over fake backends; the router's clock is a fake one
stepped by the tests wherever time matters, and every wait is bounded."""

from __future__ import annotations

import argparse
import asyncio
import logging
import math

import pytest
from test_hung_replica import BOUND_S, Hangs, idle, until
from test_router_core import Echo
from test_router_server import FirstHealthy

from war.router.metrics import RouterMetrics
from war.router.router import Router, RouterConfig
from war.types import GenRequest, GenResult, SamplingParams

SP = SamplingParams(temperature=0.0, max_tokens=3)
STALL_S = 0.2


class Clock:
    """The router's clock, stepped by the test."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


class Gated(Echo):
    """A slow replica that does complete: each generation waits until the test lets it
    go (oldest first, ``release``), then answers, or raises the error it was let go with
    (an error answer, such as a 400)."""

    def __init__(self, name: str) -> None:
        super().__init__(name)
        self.gates: list[asyncio.Future[Exception | None]] = []

    async def generate(self, request: GenRequest) -> GenResult:
        gate: asyncio.Future[Exception | None] = asyncio.get_running_loop().create_future()
        self.gates.append(gate)
        error = await gate
        if error is not None:
            raise error
        return await super().generate(request)

    def release(self, error: Exception | None = None) -> None:
        self.gates.pop(0).set_result(error)


def stall_warnings(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records
            if r.levelno == logging.WARNING and "marked down" in r.getMessage()
            and "stalled" in r.getMessage()]


def test_requests_on_a_stalled_replica_are_failed_over_and_answered_once(
        caplog: pytest.LogCaptureFixture) -> None:
    # The health loop running on the real clock: a answers its probes, never a generation.
    a, b = Hangs("a"), Echo("b")
    policy = FirstHealthy()  # (always a while it is up)
    r = Router({"a": a, "b": b}, policy,  # type: ignore[arg-type]
               RouterConfig(health_interval_s=0.02, health_timeout_s=0.3,
                            stall_timeout_s=STALL_S))
    delivered: list[tuple[str, str]] = []

    async def main() -> None:
        async with r:
            tasks = [asyncio.create_task(r.route(
                GenRequest(f"x{i}", (1, i), SP),
                lambda res, w: delivered.append((res.request_id, w)))) for i in range(3)]
            done = await asyncio.wait_for(asyncio.gather(*tasks), BOUND_S)
            assert [where for _, where in done] == ["b", "b", "b"]
            # a's late answers reach no one
            a.late.set_result(GenResult("x0", (1,), (-0.5,), "length", 1))
            await asyncio.sleep(0.05)

    with caplog.at_level(logging.WARNING, logger="war.router.router"):
        asyncio.run(main())
    assert sorted(delivered) == [("x0", "b"), ("x1", "b"), ("x2", "b")]
    assert a.cancelled == 3 and len(a.requests) == 3 and len(b.requests) == 3
    st = r.stats
    assert (st.requests, st.completed, st.failed, st.retries) == (3, 3, 0, 3)
    assert (st.in_flight_aborted, st.replicas_stalled, st.replicas_marked_down) == (3, 1, 1)
    text = RouterMetrics(r).render().decode()  # (exported at war route's /metrics)
    assert "war_router_replicas_stalled_total 1.0" in text
    assert "war_router_replicas_marked_down_total 1.0" in text
    assert st.per_replica == {"a": 0, "b": 3}
    assert r.replicas["a"].failures == 1 and idle(r, "a") and idle(r, "b")
    # the policy saw each placement end once: on a (aborted), then on b
    assert sorted(policy.completed) == sorted(["x0", "x1", "x2"] * 2)
    warned = stall_warnings(caplog)
    assert len(warned) == 1, warned  # once per stall
    assert "stalled: 3 requests in flight, none completed for" in warned[0]


def test_without_a_stall_timeout_a_stalled_replica_keeps_its_requests() -> None:
    clock = Clock()
    a, b = Hangs("a"), Echo("b")
    r = Router({"a": a, "b": b}, FirstHealthy(), RouterConfig(),  # type: ignore[arg-type]
               clock=clock)

    async def main() -> None:
        task = asyncio.create_task(r.route(GenRequest("x", (1,), SP)))
        await until(lambda: bool(a.requests))
        for _ in range(3):
            clock.now += 1e6
            await asyncio.wait_for(r.check_health(), BOUND_S)
        with pytest.raises(TimeoutError):  # still waiting on a (its own timeout's business)
            await asyncio.wait_for(asyncio.shield(task), 0.1)
        assert r.replicas["a"].healthy and not b.requests
        a.late.set_result(GenResult("x", (5,), (-0.5,), "length", 1))
        _, where = await asyncio.wait_for(task, BOUND_S)
        assert where == "a"

    asyncio.run(main())
    st = r.stats
    assert (st.replicas_stalled, st.replicas_marked_down, st.in_flight_aborted) == (0, 0, 0)


def test_a_stalled_replica_rejoins_after_a_health_interval_with_its_calls_gone() -> None:
    clock = Clock()
    a, b = Hangs("a"), Echo("b")
    r = Router({"a": a, "b": b}, FirstHealthy(),  # type: ignore[arg-type]
               RouterConfig(health_interval_s=1.0, stall_timeout_s=STALL_S), clock=clock)
    rep = r.replicas["a"]

    async def rounds_at(now: float) -> None:
        clock.now = now
        await asyncio.wait_for(r.check_health(), BOUND_S)

    async def main() -> None:
        task = asyncio.create_task(r.route(GenRequest("x", (1,), SP)))
        await until(lambda: bool(a.requests))
        await rounds_at(0.1)  # in flight for less than the timeout
        assert rep.healthy and not task.done()
        await rounds_at(0.25)  # stalled: down, its call failed over
        assert not rep.healthy
        _, where = await asyncio.wait_for(task, BOUND_S)
        assert where == "b" and idle(r, "a")
        # its health check passes, but not a health interval after the stall
        for now in (0.25, 0.5, 1.2):
            await rounds_at(now)
            assert not rep.healthy, now
        await rounds_at(1.25)
        assert rep.healthy
        # back: a new request's time in flight counts from its start, not from before
        task = asyncio.create_task(r.route(GenRequest("y", (2,), SP)))
        await until(lambda: len(a.requests) == 2)
        await rounds_at(1.4)
        assert rep.healthy
        await rounds_at(1.5)  # stalled again: counted again
        assert not rep.healthy
        _, where = await asyncio.wait_for(task, BOUND_S)
        assert where == "b"

    asyncio.run(main())
    st = r.stats
    assert (st.replicas_stalled, st.replicas_marked_down, st.in_flight_aborted) == (2, 2, 2)
    assert (st.completed, st.retries, st.failed) == (2, 2, 0)


def test_with_failover_off_a_stalled_replica_stays_down_while_its_calls_are_in_flight(
        ) -> None:
    clock = Clock()
    a, b = Hangs("a"), Echo("b")
    r = Router({"a": a, "b": b}, FirstHealthy(),  # type: ignore[arg-type]
               RouterConfig(health_interval_s=1.0, stall_timeout_s=STALL_S,
                            failover_in_flight=False), clock=clock)
    rep = r.replicas["a"]

    async def main() -> None:
        task = asyncio.create_task(r.route(GenRequest("x", (1,), SP)))
        await until(lambda: bool(a.requests))
        clock.now = 0.3
        await asyncio.wait_for(r.check_health(), BOUND_S)
        assert not rep.healthy and not task.done()  # down, its call left to end by itself
        for now in (5.0, 50.0):  # a health interval on, the stalled call still there
            clock.now = now
            await asyncio.wait_for(r.check_health(), BOUND_S)
            assert not rep.healthy, now
        a.late.set_result(GenResult("x", (5,), (-0.5,), "length", 1))
        _, where = await asyncio.wait_for(task, BOUND_S)
        assert where == "a"  # its answer reaches its caller: nothing was failed over
        await asyncio.wait_for(r.check_health(), BOUND_S)
        assert rep.healthy

    asyncio.run(main())
    st = r.stats
    assert (st.replicas_stalled, st.in_flight_aborted, st.retries) == (1, 0, 0)
    assert not b.requests and idle(r, "a")


def test_a_slow_replica_that_completes_requests_is_never_marked_stalled() -> None:
    # Two requests in flight at all times, none for less than the stall timeout at
    # times, but one completes (an answer, every third an error answer) every 0.15 s
    # of the router's clock: progress, not a stall.
    clock = Clock()
    a = Gated("a")
    r = Router({"a": a, "b": Echo("b")}, FirstHealthy(),  # type: ignore[arg-type]
               RouterConfig(stall_timeout_s=STALL_S), clock=clock)

    async def main() -> None:
        tasks = [asyncio.create_task(r.route(GenRequest(f"x{i}", (i,), SP)))
                 for i in range(2)]
        await until(lambda: len(a.gates) == 2)
        for step in range(20):
            clock.now += 0.15
            await asyncio.wait_for(r.check_health(), BOUND_S)
            assert r.replicas["a"].healthy, step
            error = ValueError("bad request") if step % 3 == 2 else None
            a.release(error)
            first = tasks.pop(0)
            await until(first.done)
            if error is None:
                assert first.result()[1] == "a"
            else:
                assert isinstance(first.exception(), ValueError)
            tasks.append(asyncio.create_task(r.route(GenRequest(f"y{step}", (step,), SP))))
            await until(lambda: len(a.gates) == 2)
            await asyncio.wait_for(r.check_health(), BOUND_S)
            assert r.replicas["a"].healthy, step
        for _ in tasks:
            a.release()
        await asyncio.wait_for(asyncio.gather(*tasks), BOUND_S)

    asyncio.run(main())
    st = r.stats
    assert (st.replicas_stalled, st.replicas_marked_down, st.in_flight_aborted) == (0, 0, 0)
    assert st.per_replica["a"] == st.completed == 22 - 6  # (six error answers)


def test_an_idle_replica_is_never_marked_stalled() -> None:
    clock = Clock()
    a = Hangs("a", hang_after=1)  # answers its first request, hangs on the next
    r = Router({"a": a, "b": Echo("b")}, FirstHealthy(),  # type: ignore[arg-type]
               RouterConfig(stall_timeout_s=STALL_S), clock=clock)
    rep = r.replicas["a"]

    async def main() -> None:
        for now in (0.0, 10.0, 1e4):  # nothing in flight there yet, however long
            clock.now = now
            await asyncio.wait_for(r.check_health(), BOUND_S)
            assert rep.healthy
        _, where = await r.route(GenRequest("x", (1,), SP))
        assert where == "a"
        clock.now = 2e4  # idle for long after its last completion: not a stall
        await asyncio.wait_for(r.check_health(), BOUND_S)
        assert rep.healthy
        task = asyncio.create_task(r.route(GenRequest("y", (2,), SP)))
        await until(lambda: len(a.requests) == 1)  # (Hangs counts the hanging ones)
        clock.now = 2e4 + 0.1  # in flight since 2e4, not since the last completion
        await asyncio.wait_for(r.check_health(), BOUND_S)
        assert rep.healthy
        clock.now = 2e4 + 0.3
        await asyncio.wait_for(r.check_health(), BOUND_S)
        assert not rep.healthy
        _, where = await asyncio.wait_for(task, BOUND_S)
        assert where == "b"

    asyncio.run(main())
    assert r.stats.replicas_stalled == 1


@pytest.mark.parametrize("bad", [0, 0.0, -1, -0.5, math.inf, math.nan, "1", True])
def test_stall_timeout_s_must_be_a_finite_number_above_zero(bad: object) -> None:
    with pytest.raises(ValueError, match="stall_timeout_s"):
        RouterConfig(stall_timeout_s=bad)  # type: ignore[arg-type]


def test_good_stall_timeouts_are_taken() -> None:
    assert RouterConfig().stall_timeout_s is None
    assert RouterConfig(stall_timeout_s=None).stall_timeout_s is None
    assert RouterConfig(stall_timeout_s=0.2).stall_timeout_s == 0.2
    assert RouterConfig(stall_timeout_s=30).stall_timeout_s == 30


# ------------------------------------------------------------ war route --stall-timeout

def test_war_route_stall_timeout_reaches_the_router(capsys: pytest.CaptureFixture[str]
                                                    ) -> None:
    cli_main = pytest.importorskip("war.cli.main", reason="war.cli needs the native core")
    from war.cli.route import add_route_command, build_app, build_router

    parser = argparse.ArgumentParser()
    add_route_command(parser.add_subparsers())
    replica = ["route", "--replica", "war+http://127.0.0.1:9"]
    app = build_app(parser.parse_args([*replica, "--stall-timeout", "2.5"]))
    assert app.state.router.config.stall_timeout_s == 2.5
    assert build_app(parser.parse_args(replica)).state.router.config.stall_timeout_s is None
    router = build_router(["war+http://127.0.0.1:9"], "war", stall_timeout_s=0.5)
    assert router.config.stall_timeout_s == 0.5
    for bad in ("0", "-1", "inf", "nan"):
        assert cli_main.main([*replica, "--stall-timeout", bad]) == 2
        assert "--stall-timeout must be a finite number > 0" in capsys.readouterr().err
    with pytest.raises(SystemExit):  # (argparse: not a number)
        cli_main.main([*replica, "--stall-timeout", "soon"])
    with pytest.raises(SystemExit):
        cli_main.main(["route", "--help"])
    assert "--stall-timeout" in capsys.readouterr().out

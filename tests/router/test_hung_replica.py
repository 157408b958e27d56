"""A replica that hangs (it holds its calls open and never answers; no connection
error) while another is healthy: once the health loop finds it failing, its requests in
flight are cancelled there and sent elsewhere at once, answered once, with the
trajectory's bookkeeping, the policy's accounting and the counters right; a late answer
of the hung replica reaches no one. Over fake backends, through ``war route``'s edge,
and over loopback HTTP (``WarHttpBackend`` on ``war.backends.h1``) on asyncio's loop
and on uvloop. Every wait is bounded; no timeout of a whole generation is waited on."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable, Coroutine, Sequence
from typing import Any

import httpx
import orjson
import pytest
from test_edge import running
from test_router_core import Echo, Sticky
from test_router_server import FirstHealthy

import war.aio
from war.backends.base import ReplicaUnavailable
from war.backends.http import WarHttpBackend
from war.router.policies import make_policy
from war.router.policies.base import Decision, ReplicaView
from war.router.router import NoReplicaAvailable, Router, RouterConfig
from war.router.server import create_router_app
from war.types import GenRequest, GenResult, ReplicaLoad, SamplingParams

SP = SamplingParams(temperature=0.0, max_tokens=3)
NO_LP = SamplingParams(temperature=0.0, max_tokens=2, logprobs=False)
FAST = {"health_interval_s": 0.02, "health_timeout_s": 0.3}  # RouterConfig
BOUND_S = 2.0  # a failover's bound in these tests (the generation timeouts are far above)


class Hangs(Echo):
    """A replica whose generations hang (``hang_after`` served first): each waits on
    ``late`` (shielded: a cancelled call leaves it, as a replica that goes on computing
    an answer nobody waits for), counting its cancellations. ``load_hangs``: its load
    probe hangs; ``health_says``: its health check's answer (None: it hangs)."""

    def __init__(self, name: str, hang_after: int = 0) -> None:
        super().__init__(name)
        self.hang_after = hang_after
        self.load_hangs = False
        self.health_says: bool | None = True
        self.cancelled = 0
        self.swallow = False  # answers at once when cancelled (a backend that should not)
        self.probes_follow = False  # its load probe hangs once a generation hangs
        self._late: asyncio.Future[GenResult] | None = None

    @property
    def late(self) -> asyncio.Future[GenResult]:
        if self._late is None:
            self._late = asyncio.get_running_loop().create_future()
        return self._late

    async def generate(self, request: GenRequest) -> GenResult:
        if self.hang_after > 0:
            self.hang_after -= 1
            return await super().generate(request)
        self.requests.append(request)
        if self.probes_follow:
            self.load_hangs = True
        try:
            return await asyncio.shield(self.late)
        except asyncio.CancelledError:
            self.cancelled += 1
            if self.swallow:
                return GenResult(request.request_id, (42,), (-0.1,), "length", 1)
            raise

    async def load(self) -> ReplicaLoad:
        if self.load_hangs:
            await asyncio.Event().wait()
        return await super().load()

    async def health(self) -> bool:
        if self.health_says is None:
            await asyncio.Event().wait()
        return bool(self.health_says)


async def until(cond: Callable[[], bool], timeout_s: float = BOUND_S) -> None:
    async with asyncio.timeout(timeout_s):
        while not cond():
            await asyncio.sleep(0.002)


def idle(r: Router, name: str) -> bool:
    """Nothing of the router's is in flight on replica ``name`` any more."""
    rep = r.replicas[name]
    return (rep.num_requests, rep.tokens_in_flight, rep.calls, rep.aborted) == (0, 0, {}, {})


# ---------------------------------------------------------------- fake backends


def test_a_turn_in_flight_on_a_replica_failing_its_health_check_goes_elsewhere_at_once(
        ) -> None:
    a, b = Hangs("a", hang_after=1), Echo("b")
    policy = Sticky()
    r = Router({"a": a, "b": b}, policy, RouterConfig(**FAST),  # type: ignore[arg-type]
               clock=lambda: 0.0)
    delivered: list[tuple[str, str]] = []

    async def main() -> None:
        loop = asyncio.get_running_loop()
        async with r:
            first, where = await r.route(GenRequest("t-0", (1, 2, 3), SP, trajectory_id="t"))
            assert where == "a"
            turn = GenRequest("t-1", (9,), SP, trajectory_id="t", continues=True)
            task = asyncio.create_task(r.route(
                turn, lambda res, w: delivered.append((res.request_id, w))))
            await until(lambda: len(a.requests) == 2)  # a has it, and now hangs
            a.load_hangs = True
            t0 = loop.time()
            _, where = await asyncio.wait_for(task, BOUND_S)
            assert loop.time() - t0 < BOUND_S  # its probe's bound (0.3 s) and a little
            assert where == "b" and delivered == [("t-1", "b")]
            assert a.cancelled == 1 and not r.replicas["a"].healthy
            # b got the turn whole: the context the router held, then the new tokens
            whole = (1, 2, 3, *first.output_ids, 9)
            assert (b.requests[-1].prompt_ids, b.requests[-1].continues) == (whole, False)
            assert b.requests[-1].request_id == "t-1"
            # a's late answer reaches no one
            a.late.set_result(GenResult("t-1", (1, 1, 1), (-0.5,) * 3, "length", 1))
            await asyncio.sleep(0.05)
            assert delivered == [("t-1", "b")]
            # b is the trajectory's home now: its next turn goes there with its new
            # tokens alone
            _, where = await r.route(
                GenRequest("t-2", (4,), SP, trajectory_id="t", continues=True))
            assert where == "b" and b.requests[-1].prompt_ids == (4,)
            assert b.requests[-1].continues
            assert asyncio.current_task().cancelling() == 0  # type: ignore[union-attr]

    asyncio.run(main())
    st = r.stats
    assert (st.requests, st.completed, st.failed) == (3, 3, 0)
    assert (st.retries, st.in_flight_aborted, st.replicas_marked_down) == (1, 1, 1)
    assert (st.resent_contexts, st.migrations) == (1, 1)
    assert st.per_replica == {"a": 1, "b": 2}
    assert r.replicas["a"].failures == 1  # the probe's, not one per aborted call
    assert idle(r, "a") and idle(r, "b")
    assert r._homes["t"] == "b"
    # the policy saw each placement end once: a's served turn, a's aborted one, b's two
    assert policy.completed == [("a", True), ("a", False), ("b", True), ("b", True)]
    assert policy.down == ["a"]


@pytest.mark.parametrize("health_says", [False, None], ids=["no", "hangs"])
def test_a_replica_down_for_a_requests_failure_loses_its_others_when_its_check_fails(
        health_says: bool | None) -> None:
    # One request's failure (a 5xx, say) marks a down but leaves its other requests
    # there; the health loop's next check of a, failing, sends them elsewhere.
    a, b = Hangs("a"), Echo("b")
    policy = Sticky()
    r = Router({"a": a, "b": b}, policy, RouterConfig(health_timeout_s=0.2),
               clock=lambda: 0.0)

    async def main() -> None:
        task = asyncio.create_task(r.route(GenRequest("x", (1,), SP)))
        await until(lambda: bool(a.requests))
        r._mark_down("a", ReplicaUnavailable("a: POST /v1/completions failed (500)"))
        await asyncio.sleep(0.02)
        assert not task.done() and r.stats.in_flight_aborted == 0
        a.health_says = health_says
        await asyncio.wait_for(r.check_health(), BOUND_S)
        _, where = await asyncio.wait_for(task, BOUND_S)
        assert where == "b"

    asyncio.run(main())
    assert (r.stats.retries, r.stats.in_flight_aborted, r.stats.completed) == (1, 1, 1)
    assert r.stats.replicas_marked_down == 1 and idle(r, "a")
    assert policy.completed == [("a", False), ("b", True)]


@pytest.mark.parametrize("first", ["router", "caller"])
def test_a_caller_cancelling_as_the_replica_fails_still_ends_the_request(first: str) -> None:
    # The client hangs up in the same step as the health loop cancels the call: the
    # request ends (its caller's cancellation wins), and is sent nowhere else.
    a, b = Hangs("a"), Echo("b")
    policy = Sticky()
    r = Router({"a": a, "b": b}, policy, clock=lambda: 0.0)

    async def main() -> None:
        task = asyncio.create_task(r.route(GenRequest("x", (1,), SP)))
        await until(lambda: bool(a.requests))
        if first == "caller":
            task.cancel()
        r._mark_down("a", ReplicaUnavailable("a: no load answer"))
        aborted = r._abort_in_flight("a", r.replicas["a"], "test")
        assert aborted == (1 if first == "router" else 0)
        if first == "router":
            task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await asyncio.wait_for(task, BOUND_S)

    asyncio.run(main())
    assert not b.requests and r.stats.retries == 0 and r.stats.completed == 0
    assert idle(r, "a") and policy.completed == [("a", False)]


def test_a_backend_that_swallows_the_cancellation_is_answered_once() -> None:
    a, b = Hangs("a"), Echo("b")
    a.swallow = True
    r = Router({"a": a, "b": b}, Sticky(), clock=lambda: 0.0)
    delivered: list[str] = []

    async def call() -> tuple[str, int]:
        _, where = await r.route(GenRequest("x", (1,), SP),
                                 lambda res, w: delivered.append(w))
        return where, asyncio.current_task().cancelling()  # type: ignore[union-attr]

    async def main() -> None:
        task = asyncio.create_task(call())
        await until(lambda: bool(a.requests))
        r._mark_down("a", ReplicaUnavailable("a: no load answer"))
        assert r._abort_in_flight("a", r.replicas["a"], "test") == 1
        # its answer is taken (it came before any re-send), and the cancel undone
        assert await asyncio.wait_for(task, BOUND_S) == ("a", 0)

    asyncio.run(main())
    assert delivered == ["a"] and not b.requests
    assert (r.stats.completed, r.stats.retries, r.stats.in_flight_aborted) == (1, 0, 1)
    assert idle(r, "a")


def test_with_failover_in_flight_off_requests_stay_on_the_failed_replica() -> None:
    a, b = Hangs("a"), Echo("b")
    r = Router({"a": a, "b": b}, Sticky(),
               RouterConfig(health_timeout_s=0.1, failover_in_flight=False),
               clock=lambda: 0.0)

    async def main() -> None:
        task = asyncio.create_task(r.route(GenRequest("x", (1,), SP)))
        await until(lambda: bool(a.requests))
        a.load_hangs = True
        await asyncio.wait_for(r.check_health(), BOUND_S)
        assert not r.replicas["a"].healthy and not task.done()
        a.late.set_result(GenResult("x", (5,), (-0.5,), "length", 1))
        _, where = await asyncio.wait_for(task, BOUND_S)
        assert where == "a"

    asyncio.run(main())
    assert (r.stats.in_flight_aborted, r.stats.retries) == (0, 0) and not b.requests
    for bad in (1, None, "yes"):
        with pytest.raises(ValueError, match="failover_in_flight"):
            RouterConfig(failover_in_flight=bad)  # type: ignore[arg-type]


def test_an_aborted_request_on_its_last_attempt_fails() -> None:
    a = Hangs("a")
    r = Router({"a": a}, Sticky(), RouterConfig(max_attempts=1),
               clock=lambda: 0.0)

    async def main() -> None:
        task = asyncio.create_task(r.route(GenRequest("x", (1,), SP)))
        await until(lambda: bool(a.requests))
        r._mark_down("a", ReplicaUnavailable("a: no load answer"))
        r._abort_in_flight("a", r.replicas["a"], "test")
        with pytest.raises(NoReplicaAvailable):
            await asyncio.wait_for(task, BOUND_S)

    asyncio.run(main())
    assert (r.stats.failed, r.stats.retries, r.stats.in_flight_aborted) == (1, 0, 1)
    assert idle(r, "a")


# ---------------------------------------------------------------- through the edge


def test_a_client_of_war_route_is_answered_by_another_replica_when_its_own_hangs() -> None:
    a, b = Hangs("a"), Echo("b")
    a.probes_follow = True
    router = Router({"a": a, "b": b}, FirstHealthy(),
                    RouterConfig(health_interval_s=0.05, health_timeout_s=0.3))
    app = create_router_app(router, manage_router=True)
    with running(app, app.state.fast_routes) as (h, p, _), \
            httpx.Client(base_url=f"http://{h}:{p}", timeout=10.0) as c:
        r = c.post("/v1/completions", json={"prompt": [1, 2], "max_tokens": 2})
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["replica"] == "b"
        assert r.elapsed.total_seconds() < BOUND_S + 1
        text = c.get("/metrics").text
        assert "war_router_in_flight_aborted_total 1.0" in text
        assert "war_router_retries_total 1.0" in text
        assert 'war_router_http_requests_total{status="200"} 1.0' in text
    assert a.cancelled == 1 and len(b.requests) == 1
    assert idle(router, "a")


# ---------------------------------------------------------------- over loopback HTTP


class HttpReplica:
    """A ``war serve`` stand-in on 127.0.0.1 (``/health``, ``/v1/load``,
    ``/v1/completions``, each answered at once) that hangs once it has served
    ``serve`` completions: it then keeps every call's connection open without an
    answer until the client drops it, except ``/health`` if ``answers_health``."""

    def __init__(self, serve: int = 1 << 30, answers_health: bool = True) -> None:
        self.serve = serve
        self.answers_health = answers_health
        self.hung = False
        self.completions: list[dict[str, Any]] = []
        self.dropped_completions = 0  # completions whose connection the client dropped
        self.open = 0
        self.server: asyncio.Server | None = None

    async def start(self) -> str:
        self.server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        port = self.server.sockets[0].getsockname()[1]
        return f"http://127.0.0.1:{port}"

    async def stop(self) -> None:
        assert self.server is not None
        self.server.close()
        await self.server.wait_closed()

    @staticmethod
    async def _until_dropped(reader: asyncio.StreamReader) -> None:
        with contextlib.suppress(ConnectionError):
            while await reader.read(65536):
                pass

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.open += 1
        try:
            while True:
                try:
                    head = await reader.readuntil(b"\r\n\r\n")
                except (asyncio.IncompleteReadError, ConnectionError):
                    return
                lines = head.decode("latin-1").split("\r\n")
                _, path, _ = lines[0].split(" ")
                length = 0
                for line in lines[1:]:
                    key, _, value = line.partition(":")
                    if key.strip().lower() == "content-length":
                        length = int(value)
                body = await reader.readexactly(length) if length else b""
                if path == "/v1/completions":
                    self.completions.append(orjson.loads(body))
                    if len(self.completions) > self.serve:
                        self.hung = True
                    if self.hung:
                        await self._until_dropped(reader)
                        self.dropped_completions += 1
                        return
                    payload = orjson.dumps({
                        "choices": [{"token_ids": [7, 8], "finish_reason": "length"}],
                        "usage": {"prompt_tokens": len(self.completions[-1]["prompt"])}})
                elif self.hung and not (path == "/health" and self.answers_health):
                    await self._until_dropped(reader)
                    return
                elif path == "/v1/load":
                    payload = orjson.dumps({
                        "num_running": 0, "num_waiting": 0, "tokens_in_flight": 0,
                        "kv_blocks_used": 0, "kv_blocks_total": 64, "block_size": 16})
                else:
                    payload = b'{"status": "ok"}'
                writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n"
                             b"Content-Length: %d\r\n\r\n%b" % (len(payload), payload))
        finally:
            self.open -= 1
            writer.close()


class Recording:
    """A real policy, with the times replicas went down and each placement's end."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.name = inner.name
        self.selected: list[str] = []
        self.completed: list[tuple[str, str, bool]] = []
        self.down_at: list[float] = []

    def select(self, request: GenRequest, replicas: list[ReplicaView], now: float) -> Decision:
        decision: Decision = self.inner.select(request, replicas, now)
        self.selected.append(decision.replica)
        return decision

    def on_complete(self, request: GenRequest, result: GenResult | None, replica: str,
                    now: float) -> None:
        self.completed.append((request.request_id, replica, result is not None))
        self.inner.on_complete(request, result, replica, now)

    def on_replica_down(self, replica: str, now: float) -> None:
        self.down_at.append(asyncio.get_running_loop().time())
        self.inner.on_replica_down(replica, now)


def loop_runner(kind: str) -> Callable[[Coroutine[Any, Any, None]], None]:
    if kind == "uvloop":
        pytest.importorskip("uvloop")
        return war.aio.run
    return asyncio.run


@pytest.mark.parametrize("answers_health", [True, False], ids=["health-ok", "health-hangs"])
@pytest.mark.parametrize("kind", ["asyncio", "uvloop"])
def test_a_turn_on_a_hung_http_replica_fails_over_once_it_is_marked_down(
        kind: str, answers_health: bool) -> None:
    a = HttpReplica(serve=1, answers_health=answers_health)  # serves one turn, then hangs
    b = HttpReplica()
    policy = Recording(make_policy("least_load"))  # (ties by name: a first)
    seen: dict[str, Any] = {}

    async def main() -> None:
        loop = asyncio.get_running_loop()
        urls = [await a.start(), await b.start()]
        # a generation's timeout of 60 s, far beyond the bounds waited on here
        backends: Sequence[WarHttpBackend] = [
            WarHttpBackend(n, u, timeout_s=60.0, health_timeout_s=0.2)
            for n, u in zip("ab", urls, strict=True)]
        r = Router(backends, policy, RouterConfig(health_interval_s=0.05,
                                                  health_timeout_s=1.0))
        seen["router"] = r
        try:
            async with r:
                first, where = await r.route(GenRequest("t-0", (1, 2, 3), NO_LP,
                                                        trajectory_id="t"))
                assert where == "a" and first.output_ids == (7, 8)
                t0 = loop.time()
                second, where = await asyncio.wait_for(r.route(GenRequest(
                    "t-1", (9,), NO_LP, trajectory_id="t", continues=True)), 10)
                done = loop.time()
                assert where == "b" and second.output_ids == (7, 8)
                assert len(policy.down_at) == 1
                # failed over promptly once marked down, and well within the probes'
                # bounds from the start (not the 60 s generation timeout)
                assert done - policy.down_at[0] < 0.5
                assert done - t0 < BOUND_S
                _, where = await r.route(GenRequest("t-2", (5,), NO_LP,
                                                        trajectory_id="t", continues=True))
                assert where == "b"
                await until(lambda: a.dropped_completions == 1)
                await asyncio.sleep(0.1)  # (a few health rounds with a down)
                assert not r.replicas["a"].healthy
        finally:
            await r.close()
        await until(lambda: a.open == 0 and b.open == 0)  # every connection closed
        await a.stop()
        await b.stop()
        others = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
        await until(lambda: all(t.done() for t in others))

    loop_runner(kind)(main())
    r: Router = seen["router"]
    # a got the turn it hung on once (not re-sent to it by the HTTP client), b got it
    # whole once, then the next turn alone
    assert [c["request_id"] for c in a.completions] == ["t-0", "t-1"]
    assert [c["request_id"] for c in b.completions] == ["t-1", "t-2"]
    assert b.completions[0]["prompt"] == [1, 2, 3, 7, 8, 9]
    assert b.completions[0]["continues"] is False
    assert (b.completions[1]["prompt"], b.completions[1]["continues"]) == ([5], True)
    st = r.stats
    assert (st.requests, st.completed, st.failed) == (3, 3, 0)
    assert (st.retries, st.in_flight_aborted, st.replicas_marked_down) == (1, 1, 1)
    assert st.resent_contexts == 1 and st.per_replica == {"a": 1, "b": 2}
    assert r.replicas["a"].failures == 1 and r.replicas["a"].served == 1
    assert idle(r, "a") and idle(r, "b")
    assert policy.completed == [("t-0", "a", True), ("t-1", "a", False),
                                ("t-1", "b", True), ("t-2", "b", True)]
    assert policy.selected == ["a", "a", "b", "b"]

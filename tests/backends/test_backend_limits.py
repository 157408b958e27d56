"""Backends against what a review found mishandled: idle pooled connections past
``keepalive_s`` that stayed open while the pool was in use, timeouts whose message did
not say what ran out (connecting, or waiting for a free connection), token ids that
are not whole numbers (``5.5``, ``true``, ``"7"``) read as ids, and calls of a hung
replica bounded by a generation's timeout instead of a probe's (a WAR replica's
``finish_trajectory``, a Ray actor's ``load``)."""

from __future__ import annotations

import asyncio
import threading
import time
from typing import Any

import orjson
import pytest
from test_h1 import (
    LOCAL,
    T_SHORT,
    RawServer,
    Run,
    arun,
    eventually,
    gated,
    get,
    hang,
    keepalive,
    per_connection,
    unanswered_port,
)

from war.backends.base import ReplicaUnavailable

__all__ = ["arun"]  # (test_h1's fixture: each test runs on asyncio's loop and on uvloop)
from war.backends.h1 import Pool
from war.backends.http import HttpChannel, WarHttpBackend, parse_completion
from war.backends.openai import parse_sglang_generate, parse_vllm_completion
from war.types import GenRequest, SamplingParams

# ---------------------------------------------------------------- idle connections


def test_idle_connections_past_keepalive_s_are_closed_while_the_pool_is_in_use(
        arun: Run) -> None:
    # A burst opens three connections; steady calls after it reuse the most recent one
    # only: the other two, idle past keepalive_s, used to stay open for good.
    gate = threading.Event()
    with RawServer(gated(gate)) as server:
        async def go() -> None:
            pool = Pool(LOCAL, server.port, keepalive_s=0.1)
            burst = [asyncio.create_task(get(pool, f"/{i}")) for i in range(3)]
            await eventually(lambda: len(server.requests) == 3)
            gate.set()
            await asyncio.gather(*burst)
            assert server.accepted == 3
            for _ in range(8):  # one call every 40 ms, for 0.32 s
                await get(pool)
                await asyncio.sleep(0.04)
            # (the connection in use, and none of the others, is left)
            await eventually(lambda: sum(p.dropped.is_set() for p in server.peers) == 2)
            assert len(pool._idle) == 1
            assert server.accepted == 3
            pool.close()

        arun(go())


# ---------------------------------------------------------------- timeout messages


def test_a_call_that_cannot_connect_in_time_says_so(arun: Run) -> None:
    with unanswered_port() as port:
        async def go() -> None:
            channel = HttpChannel(f"http://{LOCAL}:{port}", None, 5.0, T_SHORT, T_SHORT, 4,
                                  None)
            try:
                await channel.send("GET", "/v1/load", "r0")
            except ReplicaUnavailable as e:
                # (it used to read "r0: /v1/load timed out: TimeoutError")
                assert str(e) == f"r0: /v1/load timed out: no connection within {T_SHORT:g} s"
                assert isinstance(e.__cause__, TimeoutError)
                return
            finally:
                await channel.close()
            pytest.skip("this system accepted a connection past a full backlog")

        arun(go())


def test_a_call_that_waits_for_a_free_connection_past_its_time_says_so(arun: Run) -> None:
    with RawServer(per_connection(hang, then=keepalive())) as server:
        async def go() -> None:
            channel = HttpChannel(server.url, None, 5.0, T_SHORT, T_SHORT, 1, None)
            busy = asyncio.create_task(channel.send("POST", "/v1/completions", "r0",
                                                    json={"a": 1}))
            await eventually(lambda: len(server.requests) == 1)
            with pytest.raises(ReplicaUnavailable) as e:
                await channel.send("GET", "/v1/load", "r0", timeout_s=T_SHORT)
            # (it used to read "r0: /v1/load timed out: TimeoutError": the replica
            # blamed for the client's own connection limit)
            assert str(e.value) == ("r0: /v1/load timed out: no free connection in time "
                                    "(all 1 in use)")
            assert isinstance(e.value.__cause__, TimeoutError)
            busy.cancel()
            with pytest.raises(asyncio.CancelledError):
                await busy
            answer = await channel.send("GET", "/next", "r0")  # the slot came back
            assert answer.status_code == 200 and orjson.loads(answer.content)["conn"] == 1
            await channel.close()

        arun(go())


# ---------------------------------------------------------------- token ids


NO_LP = SamplingParams(max_tokens=4, logprobs=False)


@pytest.mark.parametrize("ids", [[3, 5.5], [3, True], [3, "7"]],
                         ids=["fraction", "bool", "string"])
def test_token_ids_that_are_not_whole_numbers_are_refused(ids: list[Any]) -> None:
    # 5.5 used to read as token 5, true as token 1, "7" as token 7
    request = GenRequest(request_id="r", prompt_ids=(1, 2), sampling=NO_LP)
    war = {"choices": [{"token_ids": ids, "logprobs": None}]}
    with pytest.raises(ValueError, match=r"choices\[0\]\.token_ids"):
        parse_completion(request, war)
    with pytest.raises(ValueError, match=r"choices\[0\]\.token_ids"):
        parse_vllm_completion(request, war)
    with pytest.raises(ValueError, match="output_ids"):
        parse_sglang_generate(request, {"output_ids": ids, "meta_info": {}})


def test_whole_numbers_written_as_floats_are_still_token_ids() -> None:
    request = GenRequest(request_id="r", prompt_ids=(1, 2), sampling=NO_LP)
    result = parse_completion(request, {"choices": [{"token_ids": [4, 5.0, 0.0]}]})
    assert result.output_ids == (4, 5, 0) and all(type(t) is int for t in result.output_ids)


# ---------------------------------------------------------------- finish_trajectory


def test_finish_trajectory_of_a_hung_replica_is_bounded_by_the_health_timeout(
        arun: Run) -> None:
    # The rollout driver awaits it when each episode ends, failed ones included: a hung
    # replica used to hold every episode's end for a whole generation's timeout.
    with RawServer(hang) as server:
        async def go() -> None:
            backend = WarHttpBackend("w", server.url, timeout_s=3.0, connect_timeout_s=1.0,
                                     health_timeout_s=T_SHORT)
            t0 = time.monotonic()
            with pytest.raises(ReplicaUnavailable,
                               match="w: /v1/trajectories/finish timed out"):
                await backend.finish_trajectory("t")
            assert time.monotonic() - t0 < T_SHORT + 0.5
            await backend.close()

        arun(go(), timeout_s=8.0)


# ---------------------------------------------------------------- Ray: load is a probe


class _HungMethod:
    """An actor method whose calls never answer (a wedged actor)."""

    def remote(self, *args: object) -> asyncio.Future[Any]:
        return asyncio.get_running_loop().create_future()


class _HungActor:
    def __getattr__(self, method: str) -> _HungMethod:
        return _HungMethod()


def test_ray_load_of_a_hung_actor_is_bounded_by_the_health_timeout() -> None:
    # Backend.load is the router's probe: bounded by a probe's time, not by a
    # generation's (it used to wait timeout_s, the generations' bound, when one was set)
    pytest.importorskip("ray")
    from war.backends.ray_actor import RayEngineBackend

    backend = RayEngineBackend("a", _HungActor(), timeout_s=3.0, health_timeout_s=T_SHORT)
    cancelled: list[object] = []
    # (``ray.cancel`` would start a local Ray instance to cancel a call of no cluster)
    backend._cancel = cancelled.append  # type: ignore[method-assign]

    async def go() -> None:
        t0 = time.monotonic()
        with pytest.raises(ReplicaUnavailable, match="a: load timed out"):
            await backend.load()
        assert time.monotonic() - t0 < T_SHORT + 0.5
        assert len(cancelled) == 1  # the actor's call is cancelled

    asyncio.run(asyncio.wait_for(go(), 8.0))

"""Telling the fleet that an RL step began through the router (``Router.observe_rl_step``,
``war route``'s ``POST /v1/rl_step``): every WAR replica's draft history window slides,
each replica's outcome is reported (ok, unsupported, down, refused, failed), one that
hangs delays no other beyond the probe's bound, and one that rejoins is told the last
step. Real in-process engines and scripted backends; every wait is bounded."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
from fastapi.testclient import TestClient
from test_router_server import FirstHealthy, Scripted

from war.backends.base import ReplicaUnavailable
from war.backends.inprocess import InProcessBackend
from war.engine.async_engine import AsyncEngine
from war.engine.config import EngineConfig
from war.engine.engine import Engine
from war.router.router import Router, RouterConfig
from war.router.server import create_router_app

BOUND_S = 5.0


class Steps(Scripted):
    """A scripted replica that takes RL steps (refusing one that goes back), or hangs on
    them (``hang``)."""

    def __init__(self, name: str) -> None:
        super().__init__(name)
        self.steps: list[int] = []
        self.hang = False

    async def observe_rl_step(self, rl_step: int) -> None:
        if self.down:
            raise ReplicaUnavailable(f"{self.name} is down")
        if self.hang:
            await asyncio.Event().wait()
        if self.steps and rl_step < self.steps[-1]:
            raise ValueError(f"rl_step went backwards: {rl_step} < {self.steps[-1]}")
        self.steps.append(rl_step)


def test_real_engines_slide_their_window_and_a_later_step_is_refused_back(
        random_policy: Path) -> None:
    engines = [AsyncEngine(Engine.from_pretrained(random_policy,
                                                  EngineConfig(kv_cache_bytes=4_000_000)))
               for _ in range(2)]
    vllm_like = Scripted("c")  # (no observe_rl_step: a vLLM or SGLang replica)
    router = Router([InProcessBackend("a", engines[0], owns_engine=True),
                     InProcessBackend("b", engines[1], owns_engine=True), vllm_like],
                    FirstHealthy())

    async def main() -> None:
        async with router:
            told = await asyncio.wait_for(router.observe_rl_step(3), BOUND_S)
            assert told == {"a": "ok", "b": "ok", "c": "unsupported"}
            assert [e.engine.speculator.rl_step for e in engines] == [3, 3]
            back = await asyncio.wait_for(router.observe_rl_step(1), BOUND_S)
            assert back["a"].startswith("refused: ") and "went backwards" in back["a"]
            assert back["b"].startswith("refused: ") and back["c"] == "unsupported"
            assert [e.engine.speculator.rl_step for e in engines] == [3, 3]

    asyncio.run(main())


def test_outcomes_down_hung_and_told_on_rejoining() -> None:
    a, b, c = Steps("a"), Steps("b"), Steps("c")
    router = Router([a, b, c], FirstHealthy(),
                    RouterConfig(health_interval_s=3600, health_timeout_s=0.2))

    async def main() -> None:
        b.down = True
        await router.check_health()  # (b is marked down)
        c.hang = True
        told = await asyncio.wait_for(router.observe_rl_step(2), BOUND_S)
        assert told["a"] == "ok" and told["b"] == "down"
        assert told["c"] == "failed: no answer within 0.2 s"
        assert list(told) == ["a", "b", "c"]
        assert a.steps == [2] and b.steps == [] and c.steps == []
        b.down = c.hang = False
        await router.check_health()  # b rejoins, and is told step 2 in the background
        for _ in range(200):
            if b.steps:
                break
            await asyncio.sleep(0.01)
        assert b.steps == [2]
        await router.close()

    asyncio.run(main())


@pytest.mark.parametrize("bad", [-1, True, 1.5, "2", None])
def test_a_bad_step_is_refused(bad: object) -> None:
    router = Router([Steps("a")], FirstHealthy())
    with pytest.raises(ValueError, match="rl_step must be an int >= 0"):
        asyncio.run(router.observe_rl_step(bad))  # type: ignore[arg-type]


def test_the_http_endpoint() -> None:
    a, c = Steps("a"), Scripted("c")
    client = TestClient(create_router_app(Router([a, c], FirstHealthy()), eos_token_ids=(7,)))
    r = client.post("/v1/rl_step", json={"rl_step": 4})
    assert r.status_code == 200, r.text
    assert r.json() == {"status": "ok", "rl_step": 4,
                        "replicas": {"a": "ok", "c": "unsupported"}}
    r = client.post("/v1/rl_step", json={"rl_step": 3})  # (a refuses going back)
    assert r.status_code == 200 and r.json()["status"] == "partial"
    assert r.json()["replicas"]["a"].startswith("refused: ")
    for bad in ({}, {"rl_step": -1}, {"rl_step": "1"}, {"rl_step": True},
                {"rl_step": 1, "x": 1}):
        r = client.post("/v1/rl_step", json=bad)
        assert r.status_code == 400, (bad, r.text)
        assert r.json()["error"]["type"] == "invalid_request_error"
    assert a.steps == [4]
    # only unsupported replicas: nothing was told
    only = TestClient(create_router_app(Router([Scripted("v")], FirstHealthy()),
                                        eos_token_ids=(7,)))
    assert only.post("/v1/rl_step", json={"rl_step": 0}).json()["status"] == "partial"


def test_a_closed_in_process_engine_is_unavailable(random_policy: Path) -> None:
    engine = AsyncEngine(Engine.from_pretrained(random_policy,
                                                EngineConfig(kv_cache_bytes=4_000_000)))
    backend = InProcessBackend("a", engine, owns_engine=True)

    async def main() -> None:
        await backend.observe_rl_step(1)
        assert engine.engine.speculator.rl_step == 1
        await backend.close()
        with pytest.raises(ReplicaUnavailable, match="a: "):
            await backend.observe_rl_step(2)

    asyncio.run(main())

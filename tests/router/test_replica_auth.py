"""The key ``war route`` sends its replicas (``--replica-api-key`` / ``WAR_REPLICA_API_KEY``)
against real ``war serve`` apps (``war.engine.server.create_app`` with ``api_key``, over
uvicorn on 127.0.0.1): with the right key every call works (completions, load polls,
forwarded history, finished trajectories); a replica that refuses it (a missing or
wrong key, or one started with another key) is left out of placement, its requests sent
to the others, until it accepts the key again; only when every replica refuses does a
request fail, with a 502 naming them; the key never shows in logs, ``/metrics``,
``/v1/load``, error bodies or reprs. Also the parsing of a refusal, the option's checks,
and ``war serve`` + ``war route`` as processes."""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import httpx
import orjson
import pytest
from fastapi.testclient import TestClient

from loopback import serve
from war.backends.base import CredentialsRefused, ReplicaUnavailable
from war.backends.http import Answer, raise_for_answer
from war.router.policies import make_policy
from war.router.policies.base import Decision, ReplicaView
from war.router.router import ReplicaAuthRefused, Router, RouterConfig, auth_refusal
from war.router.server import create_router_app
from war.types import GenRequest, GenResult, ReplicaLoad, SamplingParams, UnknownTrajectory

cli_main = pytest.importorskip("war.cli.main", reason="war.cli needs the native core")
torch = pytest.importorskip("torch")
uvicorn = pytest.importorskip("uvicorn")

from war.cli.route import build_app, replica_api_key  # noqa: E402
from war.engine.async_engine import AsyncEngine  # noqa: E402
from war.engine.config import EngineConfig  # noqa: E402
from war.engine.engine import Engine  # noqa: E402
from war.engine.loader import init_random  # noqa: E402
from war.engine.model_config import ModelConfig  # noqa: E402
from war.engine.server import create_app  # noqa: E402

KEY = "replica-secret-5b1e"
WRONG = "not-the-key-77c3"
OTHER = "another-replica-key-41d0"  # a replica started with a key of its own
ROUTER_KEY = "router-secret-90af"
TINY = {
    "model_type": "llama", "vocab_size": 64, "hidden_size": 32, "intermediate_size": 64,
    "num_hidden_layers": 1, "num_attention_heads": 2, "num_key_value_heads": 1,
    "max_position_embeddings": 128, "rms_norm_eps": 1e-6, "rope_theta": 10000.0,
    "tie_word_embeddings": True,
}
BODY = {"prompt": [3, 4, 5], "max_tokens": 4, "temperature": 0.0, "ignore_eos": True}


# ------------------------------------------------------------ replicas on loopback


def _engine() -> Any:
    model = init_random(ModelConfig.from_dict(TINY), seed=0, dtype=torch.float32)
    ae = AsyncEngine(Engine(model, EngineConfig(num_kv_blocks=64, block_size=8,
                                                max_num_batched_tokens=256)))
    ae.start()
    return ae


@pytest.fixture(scope="module")
def replicas() -> Iterator[list[str]]:
    """Two ``war serve`` apps needing ``KEY``, each over its own tiny engine: their
    ``war+http://`` specs (named r0 and r1)."""
    engines = [_engine() for _ in range(2)]
    try:
        with serve(create_app(engines[0], model_name="tiny", api_key=KEY)) as (u0, _), \
                serve(create_app(engines[1], model_name="tiny", api_key=KEY)) as (u1, _):
            yield [f"war+{u0}?name=r0", f"war+{u1}?name=r1"]
    finally:
        for ae in engines:
            asyncio.run(ae.close())


class _Switch:
    """An ASGI app that is one of ``apps`` (by key), switched at will: a ``war serve``
    replica restarted with another key, on the same port."""

    def __init__(self, apps: dict[str, Any], now: str) -> None:
        self.apps = apps
        self.now = now

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        await self.apps[self.now](scope, receive, send)


@pytest.fixture(scope="module")
def mixed() -> Iterator[tuple[list[str], _Switch]]:
    """A fleet of two ``war serve`` apps: r0 needing ``KEY``, and rx, whose key is
    switched (``_Switch.now``: ``OTHER`` or ``KEY``, each a ``war serve`` app of its own
    over rx's engine): their specs, and rx's switch."""
    engines = [_engine() for _ in range(2)]
    switch = _Switch({k: create_app(engines[1], model_name="tiny", api_key=k)
                      for k in (OTHER, KEY)}, OTHER)
    try:
        with serve(create_app(engines[0], model_name="tiny", api_key=KEY)) as (u0, _), \
                serve(switch) as (ux, _):
            yield [f"war+{u0}?name=r0", f"war+{ux}?name=rx"], switch
    finally:
        for ae in engines:
            asyncio.run(ae.close())


def _router_app(specs: Sequence[str], *extra: str) -> Any:
    args = cli_main.build_parser().parse_args(
        ["route", *[a for s in specs for a in ("--replica", s)], "--policy", "round_robin",
         "--health-interval", "0.05", "--api-key", ROUTER_KEY, *extra])
    return build_app(args)


def _wait(what: Callable[[], bool], timeout_s: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while not what():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.02)
    return True


AUTH = {"Authorization": f"Bearer {ROUTER_KEY}"}


def _shown(client: TestClient) -> str:
    """Everything the router shows of itself: /metrics, /v1/load, /health, reprs."""
    router: Router = client.app.state.router  # type: ignore[attr-defined]
    return "\n".join([
        client.get("/metrics", headers=AUTH).text, client.get("/v1/load", headers=AUTH).text,
        client.get("/health").text, repr(router), repr(router.stats),
        *(repr(r.backend) for r in router.replicas.values()),
        *(repr(vars(r.backend)) for r in router.replicas.values()
          if hasattr(r.backend, "__dict__"))])


# ------------------------------------------------------------ with the right key


def test_the_right_key_reaches_every_replica_call(
        replicas: list[str], caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG)
    app = _router_app(replicas, "--replica-api-key", KEY)
    with TestClient(app) as client:
        router: Router = app.state.router
        # load polls (GET /v1/load needs the key on war serve)
        assert _wait(lambda: all(r.load is not None for r in router.replicas.values()))
        served = set()
        for i in range(4):
            r = client.post("/v1/completions", headers=AUTH,
                            json={**BODY, "group_id": "g", "trajectory_id": f"t{i}"})
            assert r.status_code == 200, r.text
            assert len(r.json()["choices"][0]["token_ids"]) == 4
            served.add(r.json()["war"]["replica"])
        assert served == {"r0", "r1"}
        # forwarded history (POST /v1/history) and ended trajectories (POST
        # /v1/trajectories/finish), both in the background
        assert _wait(lambda: router.stats.history_forwarded >= 4), router.stats
        assert client.post("/v1/trajectories/finish", headers=AUTH,
                           json={"trajectory_id": "t0"}).status_code == 200
        assert _wait(lambda: router.stats.trajectories_released == 1), router.stats
        assert router.stats.auth_refusals == 0 and router.stats.retries == 0
        shown = _shown(client)
        assert 'war_router_replica_auth_refused{replica="r0"} 0.0' in shown
        assert "war_router_replica_auth_refusals_total 0.0" in shown
        assert KEY not in shown
    assert KEY not in caplog.text


def test_the_key_can_come_from_the_environment(
        replicas: list[str], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("WAR_REPLICA_API_KEY", KEY)
    with TestClient(_router_app(replicas)) as client:
        r = client.post("/v1/completions", headers=AUTH, json=BODY)
        assert r.status_code == 200, r.text
    # the option wins over the environment
    monkeypatch.setenv("WAR_REPLICA_API_KEY", WRONG)
    with TestClient(_router_app(replicas, "--replica-api-key", KEY)) as client:
        assert client.post("/v1/completions", headers=AUTH, json=BODY).status_code == 200


# ------------------------------------------------------------ without it


@pytest.mark.parametrize("extra", [(), ("--replica-api-key", WRONG)], ids=["missing", "wrong"])
def test_a_key_every_replica_refuses_is_a_502_naming_them(
        replicas: list[str], extra: tuple[str, ...], caplog: pytest.LogCaptureFixture,
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("WAR_REPLICA_API_KEY", raising=False)
    caplog.set_level(logging.DEBUG)
    app = _router_app(replicas, *extra)
    with TestClient(app) as client:
        router: Router = app.state.router
        # the health loop's load polls are refused too: logged, counted, flagged
        assert _wait(lambda: all(r.auth_refused for r in router.replicas.values()))
        for _ in range(3):
            r = client.post("/v1/completions", headers=AUTH, json=BODY)
            assert r.status_code == 502, r.text
            err = r.json()["error"]
            assert err["code"] == "replica_auth_failed" and err["type"] == "server_error"
            # (both left out of placement since their load polls were refused: not
            # called, the message says what each refused)
            assert err["message"].startswith(
                "replicas r0, r1 refused the router's API key (r0: 401 on GET /v1/load"), err
            assert "; r1: 401 on GET /v1/load" in err["message"]
            assert "--replica-api-key" in err["message"]
            # and SGLang's /generate the same way
            g = client.post("/generate", headers=AUTH,
                            json={"input_ids": [3, 4], "sampling_params": {"max_new_tokens": 2}})
            assert g.status_code == 502 and g.json()["error"]["code"] == "replica_auth_failed"
        assert router.stats.retries == 0  # no replica left to try
        assert router.stats.completed == 0 and router.stats.failed == 6
        assert all(r.auth_refused for r in router.replicas.values())
        assert all(r.healthy for r in router.replicas.values())  # not marked down
        assert router.stats.replicas_marked_down == 0
        assert router.stats.auth_refusals >= 2  # (the polls')
        shown = _shown(client)
        assert 'war_router_replica_auth_refused{replica="r1"} 1.0' in shown
        assert 'war_router_http_requests_total{status="502"}' in shown
        assert KEY not in shown and WRONG not in shown
    refusals = [rec for rec in caplog.records if "refused the router's API key" in rec.message]
    # logged once per replica, not once per call nor per poll
    assert sorted(rec.message.split()[1] for rec in refusals) == ["r0", "r1"], refusals
    assert all(rec.levelno == logging.ERROR for rec in refusals)
    assert KEY not in caplog.text and WRONG not in caplog.text


# ------------------------------------------------------------ one replica with another key


def test_a_replica_with_another_key_is_left_out_and_the_others_serve(
        mixed: tuple[list[str], _Switch], caplog: pytest.LogCaptureFixture) -> None:
    specs, switch = mixed
    switch.now = OTHER
    caplog.set_level(logging.DEBUG)
    app = _router_app(specs, "--replica-api-key", KEY)
    with TestClient(app) as client:
        router: Router = app.state.router
        rx = router.replicas["rx"]
        # requests from the start: round robin places some on rx before or after its
        # poll is refused; every one is answered by r0
        for i in range(8):
            r = client.post("/v1/completions", headers=AUTH,
                            json={**BODY, "trajectory_id": f"t{i}"})
            assert r.status_code == 200, r.text
            assert r.json()["war"]["replica"] == "r0"
        g = client.post("/generate", headers=AUTH,
                        json={"input_ids": [3, 4], "sampling_params": {"max_new_tokens": 2}})
        assert g.status_code == 200 and g.json()["meta_info"]["replica"] == "r0", g.text
        assert _wait(lambda: rx.auth_refused)
        assert rx.healthy and rx.served == 0  # not down: left out of placement
        assert router.stats.completed == 9 and router.stats.failed == 0
        assert router.stats.per_replica == {"r0": 9, "rx": 0}
        assert router.stats.replicas_marked_down == 0
        assert router.stats.auth_refusals >= 1
        load = client.get("/v1/load", headers=AUTH).json()["replicas"]
        assert load["rx"]["auth_refused"] is True and load["rx"]["healthy"] is True
        assert load["r0"]["auth_refused"] is False
        assert client.get("/health").status_code == 200
        shown = _shown(client)
        assert 'war_router_replica_auth_refused{replica="rx"} 1.0' in shown
        assert 'war_router_replica_auth_refused{replica="r0"} 0.0' in shown
        assert 'war_router_replica_healthy{replica="rx"} 1.0' in shown
        assert KEY not in shown and OTHER not in shown
    refusals = [rec for rec in caplog.records if "refused the router's API key" in rec.message]
    assert [rec.message.split()[1] for rec in refusals] == ["rx"], refusals  # once
    assert refusals[0].levelno == logging.ERROR
    assert "left out of placement" in refusals[0].message
    assert KEY not in caplog.text and OTHER not in caplog.text


def test_a_replica_that_accepts_the_key_again_rejoins_after_the_next_poll(
        mixed: tuple[list[str], _Switch], caplog: pytest.LogCaptureFixture) -> None:
    specs, switch = mixed
    switch.now = OTHER
    caplog.set_level(logging.DEBUG)
    app = _router_app(specs, "--replica-api-key", KEY)
    try:
        with TestClient(app) as client:
            router: Router = app.state.router
            rx = router.replicas["rx"]
            assert _wait(lambda: rx.auth_refused)
            for _ in range(4):
                r = client.post("/v1/completions", headers=AUTH, json=BODY)
                assert r.status_code == 200 and r.json()["war"]["replica"] == "r0"
            # and it stays out, round after round (a refused poll never lets it in)
            polls = router.stats.auth_refusals
            assert _wait(lambda: router.stats.auth_refusals >= polls + 3)
            assert rx.auth_refused
            switch.now = KEY  # rx restarted with the fleet's key
            assert _wait(lambda: not rx.auth_refused)  # its next poll is accepted
            served = {client.post("/v1/completions", headers=AUTH, json=BODY)
                      .json()["war"]["replica"] for _ in range(6)}
            assert served == {"r0", "rx"} and rx.served >= 1
            # and it stays in: accepted polls do not end a new episode, nor start one
            time.sleep(0.3)
            assert not rx.auth_refused
            assert 'war_router_replica_auth_refused{replica="rx"} 0.0' in _shown(client)
    finally:
        switch.now = OTHER
    back = [rec for rec in caplog.records if "accepts the router's API key again" in rec.message]
    assert [rec.message.split()[1] for rec in back] == ["rx"], back
    refusals = [rec for rec in caplog.records if "refused the router's API key" in rec.message]
    assert len(refusals) == 1, refusals


# ------------------------------------------------------------ units


class _Refusing:
    """A replica whose every call raises ``error``."""

    def __init__(self, name: str, error: Exception) -> None:
        self.name = name
        self.error = error
        self.calls = 0

    async def generate(self, request: GenRequest) -> GenResult:
        self.calls += 1
        raise self.error

    async def load(self) -> ReplicaLoad:
        raise self.error

    async def health(self) -> bool:
        return True

    async def add_history(self, items: Sequence[tuple[Sequence[int], str | None]]) -> None:
        raise self.error

    async def close(self) -> None:
        pass


def test_auth_refusal_reads_only_401_and_403_of_that_backend() -> None:
    msg = "missing or invalid API key (Authorization: Bearer <key>)"
    got = auth_refusal(CredentialsRefused("w", 401, "POST /v1/completions", msg), "w")
    assert isinstance(got, ReplicaAuthRefused)
    assert (got.replica, got.status, got.call, got.detail) == (
        "w", 401, "POST /v1/completions", msg)
    assert "replica w refused the router's API key (401 on POST /v1/completions" in str(got)
    got = auth_refusal(CredentialsRefused("w", 403, "GET /v1/load", "forbidden"), "w", "named")
    assert got is not None and (got.replica, got.status) == ("named", 403)
    assert auth_refusal(got, "other") is got  # a backend may raise it itself
    # another backend's refusal, or any other 4xx (even one quoting such words), is not
    assert auth_refusal(CredentialsRefused("x", 401, "POST /v1/completions", "no"), "w") is None
    assert auth_refusal(ValueError("w: POST /v1/completions refused (401): no"), "w") is None
    assert auth_refusal(UnknownTrajectory("w: POST /x refused (401): no"), "w") is None
    assert auth_refusal(RuntimeError("w: POST /x refused (401): no"), "w") is None
    long = auth_refusal(CredentialsRefused("w", 401, "GET /v1/load", "x" * 1000), "w")
    assert long is not None and len(long.detail) < 220


def test_the_http_backend_raises_credentials_refused_for_401_and_403_only() -> None:
    for status, typed in ((401, True), (403, True), (400, False), (404, False)):
        answer = Answer(status, "", orjson.dumps({"error": {"message": "nope"}}), "POST",
                        "/v1/completions")
        with pytest.raises(ValueError, match=r"r0: POST /v1/completions refused") as e:
            raise_for_answer(answer, "r0")
        assert isinstance(e.value, CredentialsRefused) is typed
        if typed:
            assert (e.value.status, e.value.call, e.value.detail) == (
                status, "POST /v1/completions", "nope")


def test_a_refusal_is_failed_over_and_other_errors_still_are_400() -> None:
    a = _Refusing("a", CredentialsRefused("a", 403, "POST /v1/completions", "forbidden"))
    b = _Refusing("b", ValueError("b: POST /v1/completions refused (400): token id 99"))
    router = Router([a, b], make_policy("round_robin"))
    client = TestClient(create_router_app(router))
    # refused by a: sent to b, whose own 400 (the request's fault) is the answer
    r = client.post("/v1/completions", json={"prompt": [1], "max_tokens": 1})
    assert r.status_code == 400 and "token id 99" in r.json()["error"]["message"]
    assert (a.calls, b.calls) == (1, 1) and router.stats.retries == 1
    r = client.post("/v1/completions", json={"prompt": [1], "max_tokens": 1})
    assert r.status_code == 400 and (a.calls, b.calls) == (1, 2)  # a is left out
    assert router.stats.auth_refusals == 1 and router.replicas["a"].auth_refused
    assert not router.replicas["b"].auth_refused


def _refused(name: str, call: str = "POST /v1/completions") -> CredentialsRefused:
    return CredentialsRefused(name, 401, call, "missing or invalid API key")


class _Keyed:
    """A replica that serves (output: the sum of the whole context, per trajectory as a
    WAR replica keeps it) unless ``refuse`` (every generation refused, 401) or
    ``refuse_load`` (its load polls refused, as WAR's ``/v1/load`` is; off: an open
    poll, as vLLM's ``/metrics``)."""

    def __init__(self, name: str, refuse: bool = False, refuse_load: bool = False) -> None:
        self.name = name
        self.refuse = refuse
        self.refuse_load = refuse_load
        self.requests: list[GenRequest] = []
        self.held: dict[str, list[int]] = {}
        self.polls = 0

    async def generate(self, request: GenRequest) -> GenResult:
        self.requests.append(request)
        await asyncio.sleep(0)
        if self.refuse:
            raise _refused(self.name)
        if request.continues:
            held = self.held.get(request.trajectory_id or "")
            if held is None:
                raise UnknownTrajectory("not here")
            ctx = held + list(request.prompt_ids)
        else:
            ctx = list(request.prompt_ids)
        out = (sum(ctx) % 50,)
        if request.trajectory_id:
            self.held[request.trajectory_id] = ctx + list(out)
        return GenResult(request.request_id, out, (-0.5,), "length", len(ctx))

    async def load(self) -> ReplicaLoad:
        self.polls += 1
        if self.refuse_load:
            raise _refused(self.name, "GET /v1/load")
        return ReplicaLoad(0, 0, 0, 1, 100, 16)

    async def health(self) -> bool:
        return True

    async def add_history(self, items: Sequence[tuple[Sequence[int], str | None]]) -> None:
        if self.refuse:
            raise _refused(self.name, "POST /v1/history")

    async def close(self) -> None:
        pass


class _First:
    """A policy: a trajectory's home if offered, else the first replica offered (by
    name); records what it is told."""

    name = "first"

    def __init__(self) -> None:
        self.home: dict[str, str] = {}
        self.offered: list[list[str]] = []
        self.completed: list[tuple[str, bool]] = []

    def select(self, request: GenRequest, replicas: list[ReplicaView], now: float) -> Decision:
        names = sorted(r.name for r in replicas)
        self.offered.append(names)
        home = self.home.get(request.trajectory_id or "")
        return Decision(home if home in names else names[0])

    def on_complete(self, request: GenRequest, result: GenResult | None, replica: str,
                    now: float) -> None:
        self.completed.append((replica, result is not None))
        if result is not None and request.trajectory_id:
            self.home[request.trajectory_id] = replica

    def on_replica_down(self, replica: str, now: float) -> None:
        pass


SP1 = SamplingParams(temperature=0.0, max_tokens=1)


def _req(i: int, prompt: tuple[int, ...] = (1, 2), tid: str | None = None,
         continues: bool = False) -> GenRequest:
    return GenRequest(f"q{i}", prompt, SP1, trajectory_id=tid, continues=continues)


def test_requests_refused_by_one_replica_are_answered_by_the_other() -> None:
    async def main() -> None:
        a, b = _Keyed("a", refuse=True), _Keyed("b")
        policy = _First()
        router = Router([a, b], policy, RouterConfig(share_history=False))
        for i in range(5):
            _, name = await router.route(_req(i))
            assert name == "b"
        assert len(a.requests) == 1 and len(b.requests) == 5  # refused once, then left out
        # (the retry of the first request included: 6 placements)
        assert policy.offered == [["a", "b"], *[["b"]] * 5]
        # the refused attempt is booked as a failure there, then served by b
        assert policy.completed[:2] == [("a", False), ("b", True)]
        st = router.stats
        assert (st.retries, st.completed, st.failed, st.auth_refusals) == (1, 5, 0, 1)
        assert st.replicas_marked_down == 0 and st.per_replica == {"a": 0, "b": 5}
        ra = router.replicas["a"]
        assert ra.auth_refused and ra.healthy and ra.failures == 0
        assert router.fleet_load()["a"]["auth_refused"] is True
        assert router.fleet_load()["b"]["auth_refused"] is False
    asyncio.run(main())


def test_a_continuing_turn_its_home_refuses_goes_whole_to_another_replica() -> None:
    async def main() -> None:
        a, b = _Keyed("a"), _Keyed("b")
        router = Router([a, b], _First(), RouterConfig(share_history=False))
        first, name = await router.route(_req(0, (1, 2, 3), "t"))
        assert name == "a"
        a.refuse = True  # a now refuses the key (restarted with another one)
        _, name = await router.route(_req(1, (7,), "t", continues=True))
        assert name == "b"
        assert a.requests[-1].continues and a.requests[-1].prompt_ids == (7,)
        sent = b.requests[-1]
        assert not sent.continues and sent.prompt_ids == (1, 2, 3, *first.output_ids, 7)
        assert router.stats.resent_contexts == 1 and router.stats.retries == 1
        # its home is b now: the next turn goes there with its new tokens only
        _, name = await router.route(_req(2, (9,), "t", continues=True))
        assert name == "b" and b.requests[-1].continues and b.requests[-1].prompt_ids == (9,)
    asyncio.run(main())


def test_every_replica_refusing_is_one_502_naming_them(
        caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG)
    a, b = _Keyed("a", refuse=True), _Keyed("b", refuse=True)
    router = Router([a, b], _First())
    client = TestClient(create_router_app(router))
    for _ in range(3):
        r = client.post("/v1/completions", json={"prompt": [1], "max_tokens": 1})
        assert r.status_code == 502, r.text
        err = r.json()["error"]
        assert err["code"] == "replica_auth_failed"
        assert err["message"].startswith(
            "replicas a, b refused the router's API key (a: 401 on POST /v1/completions: "
            "missing or invalid API key; b: 401 on POST /v1/completions"), err
        assert "--replica-api-key" in err["message"]
    # the first request tried both; the others, none being left, neither (retries are
    # counted as after any failure: each refused attempt with attempts left is one)
    assert (len(a.requests), len(b.requests)) == (1, 1)
    st = router.stats
    assert (st.retries, st.failed, st.completed, st.auth_refusals) == (2, 3, 0, 2)
    assert all(r.healthy and r.auth_refused for r in router.replicas.values())
    refusals = [rec for rec in caplog.records if "refused the router's API key" in rec.message
                and rec.name == "war.router.router"]
    assert sorted(rec.message.split()[1] for rec in refusals) == ["a", "b"]
    # with max_attempts 1, a refusal is the answer (no retry left)
    one = Router([_Keyed("c", refuse=True), _Keyed("d")], _First(),
                 RouterConfig(max_attempts=1))
    with pytest.raises(ReplicaAuthRefused, match=r"^replica c refused the router's API key"):
        asyncio.run(one.route(_req(0)))
    # a refusing replica next to one that fails (marked down): the 502 names the one
    # refusing, every replica left having refused
    down = _Keyed("z")

    async def lost(request: GenRequest) -> GenResult:
        raise ReplicaUnavailable("z: connection refused")

    down.generate = lost  # type: ignore[method-assign]
    mixed_fleet = Router([_Keyed("e", refuse=True), down], _First())
    with pytest.raises(ReplicaAuthRefused) as e:
        asyncio.run(mixed_fleet.route(_req(0)))
    assert e.value.replicas == ("e",) and str(e.value).startswith("replica e refused")
    assert not mixed_fleet.replicas["z"].healthy and mixed_fleet.replicas["e"].healthy


def test_a_refusing_replica_with_a_refused_poll_rejoins_at_its_first_accepted_poll() -> None:
    async def main() -> None:
        a, b = _Keyed("a", refuse=True, refuse_load=True), _Keyed("b")
        router = Router([a, b], _First(), RouterConfig(share_history=False))
        await router.check_health()
        ra = router.replicas["a"]
        assert ra.auth_refused and ra.poll_refused and ra.healthy
        for i in range(3):
            assert (await router.route(_req(i)))[1] == "b"
        assert a.requests == []  # left out before any request: its poll showed it
        for _ in range(3):
            await router.check_health()
            assert ra.auth_refused
        a.refuse = a.refuse_load = False  # fixed
        await router.check_health()
        assert not ra.auth_refused and not ra.poll_refused
        assert (await router.route(_req(9)))[1] == "a"
        for _ in range(3):  # accepted polls leave it in
            await router.check_health()
            assert not ra.auth_refused
        # a poll accepted while requests are refused (a poll that needs no key): the
        # refused request flags it again, and the accepted polls do not let it back in
        a.refuse_load = True
        await router.check_health()
        a.refuse_load = False
        await router.check_health()  # (accepted after refused: back)
        assert not ra.auth_refused
        a.refuse = True
        assert (await router.route(_req(10)))[1] == "b"
        for _ in range(3):
            await router.check_health()
            assert ra.auth_refused and not ra.poll_refused
        assert (await router.route(_req(11)))[1] == "b"
    asyncio.run(main())


def test_a_refusing_replica_with_an_open_poll_gets_a_trial_request_now_and_then(
        caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG)

    async def main() -> None:
        now = [100.0]
        a, b = _Keyed("a", refuse=True), _Keyed("b")  # a's poll needs no key (vLLM's)
        router = Router([a, b], _First(), RouterConfig(share_history=False, auth_retry_s=30),
                        clock=lambda: now[0])
        ra = router.replicas["a"]
        assert (await router.route(_req(0)))[1] == "b"
        assert ra.auth_refused and len(a.requests) == 1
        # its accepted polls prove nothing: it stays out, round after round
        for _ in range(5):
            await router.check_health()
            assert ra.auth_refused
        now[0] += 29
        assert (await router.route(_req(1)))[1] == "b" and len(a.requests) == 1
        now[0] += 1  # its trial is due: one request goes there, refused, then to b
        assert (await router.route(_req(2)))[1] == "b" and len(a.requests) == 2
        assert (await router.route(_req(3)))[1] == "b" and len(a.requests) == 2
        assert router.stats.retries == 2 and router.stats.failed == 0
        a.refuse = False  # fixed: its next trial serves, and it rejoins
        now[0] += 30
        assert (await router.route(_req(4)))[1] == "a"
        assert not ra.auth_refused
        assert (await router.route(_req(5)))[1] == "a"
    asyncio.run(main())
    refusals = [rec for rec in caplog.records if "refused the router's API key" in rec.message]
    assert len(refusals) == 1  # one episode: logged once, though refused twice
    back = [rec for rec in caplog.records if "accepts the router's API key again" in rec.message]
    assert len(back) == 1 and "served a request" in back[0].message


def test_a_bad_replica_key_is_one_line_without_the_key(
        capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("WAR_REPLICA_API_KEY", raising=False)
    for bad in ("secret\n", "sec\r\nX-Injected: 1", "sécret", "   "):
        assert cli_main.main(["route", "--replica", "war+http://127.0.0.1:9",
                              "--replica-api-key", bad]) == 2
        err = capsys.readouterr().err
        assert err.startswith("war route: error: --replica-api-key (or WAR_REPLICA_API_KEY)")
        assert err.count("\n") == 1 and "sec" not in err
    monkeypatch.setenv("WAR_REPLICA_API_KEY", "env-secret\n")
    assert cli_main.main(["route", "--replica", "war+http://127.0.0.1:9"]) == 2
    assert "env-secret" not in capsys.readouterr().err


def test_replica_api_key_precedence(monkeypatch: pytest.MonkeyPatch) -> None:
    parse = cli_main.build_parser().parse_args
    monkeypatch.delenv("WAR_REPLICA_API_KEY", raising=False)
    assert replica_api_key(parse(["route", "--replica", "sim://a"])) is None
    monkeypatch.setenv("WAR_REPLICA_API_KEY", "")
    assert replica_api_key(parse(["route", "--replica", "sim://a"])) is None
    monkeypatch.setenv("WAR_REPLICA_API_KEY", "from-env")
    assert replica_api_key(parse(["route", "--replica", "sim://a"])) == "from-env"
    assert replica_api_key(parse(["route", "--replica", "sim://a", "--replica-api-key",
                                  "from-flag"])) == "from-flag"
    # the key is the backends' (their Authorization header), shown by none of their reprs
    app = build_app(parse(["route", "--replica", "war+http://127.0.0.1:9?name=w"]))
    backend = app.state.router.replicas["w"].backend
    assert backend._http.headers == {"Authorization": "Bearer from-env"}
    assert "from-env" not in repr(backend) and "from-env" not in repr(backend._http)


# ------------------------------------------------------------ war serve + war route


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _stop(proc: subprocess.Popen[bytes]) -> str:
    proc.terminate()
    try:
        out, _ = proc.communicate(timeout=20)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, _ = proc.communicate(timeout=5)
    return (out or b"").decode(errors="replace")


def _wait_http(proc: subprocess.Popen[bytes], url: str, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        assert proc.poll() is None, _stop(proc)
        try:
            if httpx.get(url, timeout=1.0).status_code in (200, 503):
                return
        except httpx.TransportError:
            pass
        assert time.monotonic() < deadline, f"{url} did not answer"
        time.sleep(0.2)


@pytest.mark.slow
def test_war_route_in_front_of_war_serve_with_a_key(random_policy: Path) -> None:
    """``war serve --api-key`` and two ``war route`` processes in front of it: the one
    given the key through ``WAR_REPLICA_API_KEY`` serves; the one given a wrong key
    answers 502 naming the replica; neither prints a key."""
    env = {k: v for k, v in os.environ.items() if k not in ("WAR_API_KEY",
                                                             "WAR_REPLICA_API_KEY")}
    serve_port = _free_port()
    serve = subprocess.Popen(
        [sys.executable, "-m", "war.cli.main", "serve", "--model", str(random_policy),
         "--port", str(serve_port), "--kv-cache-mb", "16", "--api-key", KEY,
         "--log-level", "warning"],
        env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    routers: list[subprocess.Popen[bytes]] = []
    try:
        _wait_http(serve, f"http://127.0.0.1:{serve_port}/health")
        urls = []
        for key in (KEY, WRONG):
            port = _free_port()
            routers.append(subprocess.Popen(
                [sys.executable, "-m", "war.cli.main", "route", "--replica",
                 f"war+http://127.0.0.1:{serve_port}?name=replica0", "--port", str(port),
                 "--health-interval", "0.2", "--log-level", "debug"],
                env={**env, "WAR_REPLICA_API_KEY": key},
                stdout=subprocess.PIPE, stderr=subprocess.STDOUT))
            urls.append(f"http://127.0.0.1:{port}")
        for proc, url in zip(routers, urls, strict=True):
            _wait_http(proc, f"{url}/health")
        good, bad = urls
        r = httpx.post(f"{good}/v1/completions", json=BODY, timeout=30)
        assert r.status_code == 200, r.text
        assert r.json()["war"]["replica"] == "replica0"
        r = httpx.post(f"{bad}/v1/completions", json=BODY, timeout=30)
        assert r.status_code == 502, r.text
        assert r.json()["error"]["code"] == "replica_auth_failed"
        assert "replica replica0 refused the router's API key (401" in \
            r.json()["error"]["message"]
        for url in urls:
            assert KEY not in httpx.get(f"{url}/metrics", timeout=5).text
    finally:
        logs = [_stop(p) for p in routers]
        _stop(serve)
    assert len(logs) == 2
    assert "replica replica0 refused the router's API key" in logs[1], logs[1]
    for text in logs:
        assert KEY not in text and WRONG not in text

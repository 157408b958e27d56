"""The router's HTTP app over scripted in-process backends: completions, routing keys from
the body and headers, EOS handling, error mapping (400/409/503, and the app keeps
serving), auth, ``/metrics``, ``/health`` with a replica down, ``/v1/load``, the app's
lifespan, and ``war route`` (bad specs; a subprocess on loopback)."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from collections.abc import Sequence
from typing import Any

import httpx
import pytest
from fastapi.testclient import TestClient

from war.backends.base import ReplicaUnavailable
from war.router.policies.base import Decision, ReplicaView
from war.router.router import Router
from war.router.server import _sampling, create_router_app
from war.types import GenRequest, GenResult, ReplicaLoad, UnknownTrajectory

KEY = "router-key"


class Scripted:
    """A replica that echoes the prompt's first tokens, records what it got, and can be
    told to refuse (``ValueError``), not know a trajectory, or be down."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.down = False
        self.refuse: str | None = None
        self.unknown_trajectory = False
        self.seen: list[GenRequest] = []
        self.history: list[tuple[Sequence[int], str | None]] = []

    async def generate(self, request: GenRequest) -> GenResult:
        if self.down:
            raise ReplicaUnavailable(f"{self.name} is down")
        self.seen.append(request)
        if self.refuse is not None:
            raise ValueError(self.refuse)
        if self.unknown_trajectory and request.continues:
            raise UnknownTrajectory(f"{self.name} does not hold {request.trajectory_id}")
        out = request.prompt_ids[: min(3, request.sampling.max_tokens)]
        lps = (-0.5,) * len(out) if request.sampling.logprobs else ()
        return GenResult(request.request_id, tuple(out), lps, "length",
                         num_prompt_tokens=len(request.prompt_ids), num_cached_tokens=1,
                         num_forward_passes=len(out))

    async def load(self) -> ReplicaLoad:
        if self.down:
            raise ReplicaUnavailable(f"{self.name} is down")
        return ReplicaLoad(0, 0, 0, 0, 64, 16)

    async def health(self) -> bool:
        return not self.down

    async def add_history(self, items: Sequence[tuple[Sequence[int], str | None]]) -> None:
        self.history.extend(items)

    async def close(self) -> None:
        pass


class FirstHealthy:
    """The first healthy replica, always."""

    name = "first"

    def __init__(self) -> None:
        self.completed: list[str] = []

    def select(self, request: GenRequest, replicas: list[ReplicaView], now: float) -> Decision:
        return Decision(replicas[0].name)

    def on_complete(self, request: GenRequest, result: GenResult | None, replica: str,
                    now: float) -> None:
        self.completed.append(request.request_id)

    def on_replica_down(self, replica: str, now: float) -> None:
        pass


def make(api_key: str | None = None, eos: Sequence[int] = (7,)
         ) -> tuple[TestClient, Router, Scripted, Scripted]:
    a, b = Scripted("a"), Scripted("b")
    router = Router([a, b], FirstHealthy())
    app = create_router_app(router, api_key=api_key, eos_token_ids=eos)
    return TestClient(app), router, a, b


def post(client: TestClient, body: dict[str, Any], **headers: str) -> httpx.Response:
    return client.post("/v1/completions", json=body, headers=headers)


def test_completion_has_the_replica_shape_and_the_replica_name() -> None:
    client, router, a, _ = make()
    r = post(client, {"prompt": [5, 6, 8, 9], "max_tokens": 2, "logprobs": 1})
    assert r.status_code == 200, r.text
    data = r.json()
    assert data["object"] == "text_completion" and data["model"] == "war"
    (choice,) = data["choices"]
    assert choice["text"] == "" and choice["token_ids"] == [5, 6]
    assert choice["logprobs"]["token_logprobs"] == [-0.5, -0.5]
    assert choice["logprobs"]["tokens"] == ["token_id:5", "token_id:6"]
    assert choice["finish_reason"] == "length" and choice["replica"] == "a"
    assert data["usage"] == {"prompt_tokens": 4, "completion_tokens": 2, "total_tokens": 6,
                             "prompt_tokens_details": {"cached_tokens": 1}}
    assert data["war"]["replica"] == "a" and data["war"]["forward_passes"] == 2
    assert router.stats.completed == 1
    assert router.policy.completed == [a.seen[0].request_id]  # type: ignore[attr-defined]


def test_routing_keys_from_headers_and_body() -> None:
    client, _, a, _ = make()
    r = post(client, {"prompt": [1, 2], "max_tokens": 1},
             **{"X-Request-Id": "rq", "X-Trajectory-Id": "t1", "X-Group-Id": "g1",
                "X-Priority": "2.5"})
    assert r.status_code == 200 and r.json()["id"] == "rq"
    got = a.seen[-1]
    assert (got.request_id, got.trajectory_id, got.group_id, got.priority) == \
        ("rq", "t1", "g1", 2.5)
    r = post(client, {"prompt": [1, 2], "max_tokens": 1, "request_id": "body",
                      "trajectory_id": "t2", "group_id": "g2", "priority": 1.0},
             **{"X-Request-Id": "hdr", "X-Trajectory-Id": "t9", "X-Priority": "9"})
    assert r.status_code == 200
    got = a.seen[-1]
    assert (got.request_id, got.trajectory_id, got.group_id, got.priority) == \
        ("body", "t2", "g2", 1.0)


def test_eos_is_added_unless_ignore_eos() -> None:
    client, _, a, _ = make(eos=(7, 3))
    assert post(client, {"prompt": [1], "max_tokens": 1, "stop_token_ids": [3]}).status_code \
        == 200
    assert a.seen[-1].sampling.stop_token_ids == (3, 7)
    assert post(client, {"prompt": [1], "max_tokens": 1, "ignore_eos": True}).status_code == 200
    assert a.seen[-1].sampling.stop_token_ids == ()


def test_requests_asking_alike_share_their_sampling_params() -> None:
    client, _, a, _ = make()
    body = {"prompt": [1, 2], "max_tokens": 3, "temperature": 0.5, "stop_token_ids": [4]}
    for _ in range(2):
        assert post(client, body).status_code == 200
    first, second = a.seen[-2].sampling, a.seen[-1].sampling
    assert first == second and first.temperature == 0.5 and first.stop_token_ids[0] == 4
    assert _sampling(0.5, 1.0, 0, 3, (4,), (), None, False) \
        is _sampling(0.5, 1.0, 0, 3, (4,), (), None, False)
    # equal but differently typed values are not conflated; different values differ
    assert type(_sampling(0, 1.0, 0, 3, (), (), None, False).temperature) is int
    assert type(_sampling(0.0, 1.0, 0, 3, (), (), None, False).temperature) is float
    assert post(client, {**body, "max_tokens": 4}).status_code == 200
    assert a.seen[-1].sampling.max_tokens == 4 and a.seen[-2].sampling.max_tokens == 3
    # a refused value is refused every time, not remembered
    for _ in range(2):
        r = post(client, {**body, "top_p": 0.0})
        assert r.status_code == 400 and "top_p" in r.json()["error"]["message"]


def test_token_ids_past_the_fast_check_are_still_checked_alike() -> None:
    client, _, a, _ = make()
    big = [2**30, 2**40, 5]  # beyond the native fast check: the Python checks take them
    assert post(client, {"prompt": big, "max_tokens": 1}).status_code == 200
    assert a.seen[-1].prompt_ids == tuple(big)
    for prompt, message in (([1, True], "got the element True"), ([1, 2.0], "got the element 2.0"),
                            ([2**31, -1], "negative")):
        r = post(client, {"prompt": prompt, "max_tokens": 1})
        assert r.status_code == 400 and message in r.json()["error"]["message"], r.json()


def test_several_prompts_are_several_choices() -> None:
    client, _, a, _ = make()
    r = post(client, {"prompt": [[1, 2], [3, 4, 5]], "max_tokens": 2, "request_id": "m"})
    assert r.status_code == 200
    data = r.json()
    assert [c["token_ids"] for c in data["choices"]] == [[1, 2], [3, 4]]
    assert sorted(q.request_id for q in a.seen) == ["m-0", "m-1"]
    assert data["war"]["replicas"] == ["a", "a"]


@pytest.mark.parametrize(("body", "needle"), [
    ({"prompt": "hello", "max_tokens": 1}, "the router needs token ids"),
    ({"prompt": ["hello", "you"], "max_tokens": 1}, "the router needs token ids"),
    ({"prompt": [], "max_tokens": 1}, "prompt is empty"),
    ({"prompt": [1, "x"], "max_tokens": 1}, "got the element 'x'"),
    ({"prompt": [[1], [2, True]], "max_tokens": 1}, "prompt[1]: token ids must be ints"),
    ({"prompt": [1, -2], "max_tokens": 1}, "negative"),
    ({"prompt": [1], "max_tokens": None}, "max_tokens is required"),
    ({"prompt": [1]}, "max_tokens is required"),  # (not the replica's default of 16)
    ({"prompt": [1], "max_tokens": 0}, "max_tokens must be >= 1"),
    ({"prompt": [1], "max_tokens": 1, "n": 2}, "n must be 1"),
    ({"prompt": [1], "max_tokens": 1, "stream": True}, "stream=true"),
    ({"prompt": [1], "max_tokens": 1, "temperature": -1.0}, "temperature"),
    ({"prompt": [1], "max_tokens": 1, "bogus": 1}, "unknown field 'bogus'"),
    ({"prompt": [1], "max_tokens": "many"}, "max_tokens"),
    ({"prompt": [1], "max_tokens": 1, "continues": True}, "continues needs a trajectory_id"),
    ({"prompt": [[1], [2]], "max_tokens": 1, "trajectory_id": "t"}, "takes one prompt"),
])
def test_bad_bodies_are_400_and_the_router_keeps_serving(body: dict[str, Any],
                                                         needle: str) -> None:
    client, _, a, _ = make()
    r = post(client, body)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert needle in err["message"] and err["type"] == "invalid_request_error"
    assert a.seen == []
    assert post(client, {"prompt": [1, 2], "max_tokens": 1}).status_code == 200


def test_malformed_json_and_bad_priority_header() -> None:
    client, _, _, _ = make()
    r = client.post("/v1/completions", content=b"{not json",
                    headers={"content-type": "application/json"})
    assert r.status_code == 400 and r.json()["error"]["message"].startswith("invalid request")
    r = post(client, {"prompt": [1], "max_tokens": 1}, **{"X-Priority": "high"})
    assert r.status_code == 400 and "X-Priority must be a number" in r.json()["error"]["message"]
    assert client.get("/v1/nothing").status_code == 404
    assert post(client, {"prompt": [1], "max_tokens": 1}).status_code == 200


def test_replica_refusal_is_400_with_its_message() -> None:
    client, router, a, _ = make()
    a.refuse = "token id 999 outside the vocabulary [0, 64)"
    r = post(client, {"prompt": [999], "max_tokens": 1})
    assert r.status_code == 400
    assert r.json()["error"]["message"] == "token id 999 outside the vocabulary [0, 64)"
    a.refuse = None
    assert post(client, {"prompt": [1], "max_tokens": 1}).status_code == 200
    assert router.replicas["a"].healthy


def test_unknown_trajectory_is_409() -> None:
    client, _, a, _ = make()
    a.unknown_trajectory = True
    r = post(client, {"prompt": [4], "max_tokens": 1, "trajectory_id": "t", "continues": True})
    assert r.status_code == 409
    assert r.json()["error"]["code"] == "unknown_trajectory"
    assert post(client, {"prompt": [4], "max_tokens": 1, "trajectory_id": "t"}).status_code \
        == 200


def test_failover_then_503_when_every_replica_is_down() -> None:
    client, router, a, b = make()
    a.down = True
    r = post(client, {"prompt": [1, 2], "max_tokens": 1})
    assert r.status_code == 200 and r.json()["war"]["replica"] == "b"
    assert router.stats.retries == 1
    health = client.get("/health")
    assert health.status_code == 200
    assert health.json()["replicas"]["a"]["healthy"] is False
    assert health.json()["replicas"]["b"]["healthy"] is True
    b.down = True
    r = post(client, {"prompt": [1, 2], "max_tokens": 1})
    assert r.status_code == 503
    assert r.json()["error"]["code"] == "no_replica_available"
    r = post(client, {"prompt": [1, 2], "max_tokens": 1})
    assert r.status_code == 503
    health = client.get("/health")
    assert health.status_code == 503 and health.json()["status"] == "unavailable"


def test_auth() -> None:
    client, _, _, _ = make(api_key=KEY)
    body = {"prompt": [1], "max_tokens": 1}
    r = post(client, body)
    assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
    assert post(client, body, Authorization="Bearer nope").status_code == 401
    assert post(client, body, Authorization=f"Bearer {KEY}").status_code == 200
    assert client.get("/health").status_code == 200
    assert client.get("/metrics").status_code == 401
    assert client.get("/v1/load", headers={"Authorization": f"Bearer {KEY}"}).status_code == 200


def test_metrics_and_load() -> None:
    client, _, _, _ = make()
    assert post(client, {"prompt": [1, 2], "max_tokens": 1, "group_id": "g"}).status_code == 200
    assert post(client, {"prompt": "x", "max_tokens": 1}).status_code == 400
    text = client.get("/metrics").text
    for name in ("war_router_requests_total 1.0", "war_router_completed_total 1.0",
                 "war_router_failed_total 0.0", "war_router_retries_total",
                 "war_router_migrations_total", "war_router_resent_contexts_total",
                 "war_router_history_forwarded_total", "war_router_contexts_dropped_total 0.0",
                 "war_router_trajectories_released_total 0.0",
                 "war_router_held_context_tokens 0.0",
                 'war_router_replica_requests_in_flight{replica="a"} 0.0',
                 'war_router_replica_tokens_in_flight{replica="b"} 0.0',
                 'war_router_replica_healthy{replica="a"} 1.0',
                 'war_router_replica_served_total{replica="a"} 1.0',
                 'war_router_http_requests_total{status="200"} 1.0',
                 'war_router_http_requests_total{status="400"} 1.0',
                 "war_router_request_seconds_bucket", "war_router_replicas_healthy 2.0"):
        assert name in text, name
    load = client.get("/v1/load").json()
    assert load["policy"] == "first" and load["healthy_replicas"] == 2
    assert load["num_requests"] == 0 and load["tokens_in_flight"] == 0
    assert set(load["replicas"]) == {"a", "b"}
    assert load["replicas"]["a"]["served"] == 1
    # two apps over two routers in one process: separate registries
    client2, _, _, _ = make()
    assert "war_router_requests_total 0.0" in client2.get("/metrics").text


def test_lifespan_starts_and_closes_the_router() -> None:
    a, b = Scripted("a"), Scripted("b")
    router = Router([a, b], FirstHealthy())
    app = create_router_app(router, manage_router=True)
    with TestClient(app) as client:
        assert router._health_task is not None
        b.down = True
        deadline = time.monotonic() + 10
        while router.replicas["b"].healthy and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not router.replicas["b"].healthy  # marked down by the health loop
        assert client.get("/health").json()["healthy_replicas"] == 1
    assert router._health_task is None


# ------------------------------------------------------------ war route

cli_main = pytest.importorskip("war.cli.main", reason="war.cli needs the native core")


def test_route_refuses_bad_specs(capsys: pytest.CaptureFixture[str]) -> None:
    pytest.importorskip("war.backends", reason="backends not available")
    from war.backends import make_backend  # noqa: F401  (skip until it exists)

    assert cli_main.main(["route", "--replica", "nonsense://x"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("war route: error: --replica 'nonsense://x'")
    # (inf: a down replica would never be re-checked)
    for option in ("--health-interval", "--health-timeout", "--auth-retry"):
        for bad in ("0", "-1", "inf", "nan"):
            assert cli_main.main(["route", "--replica", "war+http://127.0.0.1:9",
                                  option, bad]) == 2
            assert f"{option} must be a finite number > 0" in capsys.readouterr().err
    from war.cli.route import add_route_command, build_app, build_router

    router = build_router(["war+http://127.0.0.1:9"], "war", health_timeout_s=0.5)
    assert router.config.health_timeout_s == 0.5
    assert router.config.failover_in_flight and router.config.auth_retry_s == 30.0
    # the options reach the router's settings
    import argparse

    parser = argparse.ArgumentParser()
    add_route_command(parser.add_subparsers())
    args = parser.parse_args(["route", "--replica", "war+http://127.0.0.1:9",
                              "--no-failover-in-flight", "--auth-retry", "2.5"])
    app = build_app(args)
    assert app.state.router.config.failover_in_flight is False
    assert app.state.router.config.auth_retry_s == 2.5
    args = parser.parse_args(["route", "--replica", "war+http://127.0.0.1:9"])
    assert build_app(args).state.router.config.failover_in_flight is True
    with pytest.raises(SystemExit):
        cli_main.main(["route"])
    with pytest.raises(SystemExit):
        cli_main.main(["route", "--replica", "war+http://127.0.0.1:9", "--policy", "best"])


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.mark.slow
def test_war_route_serves_and_sees_a_dead_replica() -> None:
    """``war route`` as a process in front of a replica that does not answer: /health
    turns 503 once the health loop has looked, a completion is a 503, /metrics works."""
    port, dead = _free_port(), _free_port()
    env = {**os.environ, "WAR_API_KEY": ""}
    proc = subprocess.Popen(
        [sys.executable, "-m", "war.cli.main", "route", "--replica", f"war+http://127.0.0.1:{dead}",
         "--port", str(port), "--health-interval", "0.2", "--log-level", "warning"],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        url = f"http://127.0.0.1:{port}"
        status = None
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and proc.poll() is None:
            try:
                status = httpx.get(f"{url}/health", timeout=2).status_code
            except httpx.TransportError:
                status = None
            if status == 503:
                break
            time.sleep(0.2)
        assert status == 503, proc.stdout.read().decode() if proc.poll() is not None else status
        r = httpx.post(f"{url}/v1/completions", json={"prompt": [1, 2], "max_tokens": 1},
                       timeout=10)
        assert r.status_code == 503
        assert "war_router_replica_healthy" in httpx.get(f"{url}/metrics", timeout=5).text
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=5)


def test_finish_trajectory_endpoint() -> None:
    client, router, _a, _b = make()
    told: list[str] = []
    router.policy.finish_trajectory = lambda tid, now: told.append(tid)  # type: ignore[attr-defined]
    assert post(client, {"prompt": [1, 2], "max_tokens": 1, "trajectory_id": "t"}
                ).status_code == 200
    r = client.post("/v1/trajectories/finish", json={"trajectory_id": "t"})
    assert r.status_code == 200 and r.json() == {"trajectory_id": "t", "held": True}
    assert told == ["t"]
    for bad in ({}, {"trajectory_id": ""}, {"trajectory_id": 3}, {"trajectory_id": "t", "x": 1}):
        r = client.post("/v1/trajectories/finish", json=bad)
        assert r.status_code == 400, bad
        assert r.json()["error"]["type"] == "invalid_request_error"
    assert post(client, {"prompt": [1], "max_tokens": 1}).status_code == 200


def test_oversized_bodies_are_413_and_the_router_keeps_serving(
        monkeypatch: pytest.MonkeyPatch) -> None:
    import war.router.server as server

    monkeypatch.setattr(server, "MAX_BODY_BYTES", 64)
    client, _, a, _ = make()
    r = post(client, {"prompt": list(range(100)), "max_tokens": 1})
    assert r.status_code == 413 and "larger than 64 bytes" in r.json()["error"]["message"]
    assert a.seen == []
    assert post(client, {"prompt": [1], "max_tokens": 1}).status_code == 200
    # the fast path's answers still count in the metrics, by status
    text = client.get("/metrics").text
    assert 'war_router_http_requests_total{status="413"} 1.0' in text
    assert 'war_router_http_requests_total{status="200"} 1.0' in text


def test_openai_fields_at_their_neutral_values_pass_the_router() -> None:
    """As at the replica (``war.api.refuse_unsupported``): LangChain-style clients send
    ``frequency_penalty: 0`` and the like on every call."""
    client, _, a, _ = make()
    neutral = {"frequency_penalty": 0, "presence_penalty": 0.0, "best_of": 1,
               "logit_bias": {}, "suffix": "", "stream_options": None}
    r = post(client, {"prompt": [1, 2], "max_tokens": 1, **neutral})
    assert r.status_code == 200, r.text
    assert len(a.seen) == 1
    for field, value in (("frequency_penalty", 0.5), ("best_of", 2),
                         ("logit_bias", {"5": 100}), ("suffix", "x"),
                         ("stream_options", {"include_usage": True})):
        r = post(client, {"prompt": [1, 2], "max_tokens": 1, field: value})
        assert r.status_code == 400, (field, r.text)
        assert r.json()["error"]["param"] == field
    assert post(client, {"prompt": [1], "max_tokens": 1, "min_tokens": 1}).status_code == 400
    assert len(a.seen) == 1  # (nothing refused reached a replica)

"""The key ``war route`` sends its replicas (``--replica-api-key`` / ``WAR_REPLICA_API_KEY``)
against real ``war serve`` apps (``war.engine.server.create_app`` with ``api_key``, over
uvicorn on 127.0.0.1): with the right key every call works (completions, load polls,
forwarded history, finished trajectories); with a missing or wrong one a request fails at
once with a 502 naming the replica, without retries; the key never shows in logs,
``/metrics``, ``/v1/load``, error bodies or reprs. Also the parsing of a refusal, the
option's checks, and ``war serve`` + ``war route`` as processes."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import httpx
import orjson
import pytest
from fastapi.testclient import TestClient

from war.backends.base import CredentialsRefused
from war.backends.http import Answer, raise_for_answer
from war.router.policies import make_policy
from war.router.router import ReplicaAuthRefused, Router, auth_refusal
from war.router.server import create_router_app
from war.types import GenRequest, GenResult, ReplicaLoad, UnknownTrajectory

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
ROUTER_KEY = "router-secret-90af"
TINY = {
    "model_type": "llama", "vocab_size": 64, "hidden_size": 32, "intermediate_size": 64,
    "num_hidden_layers": 1, "num_attention_heads": 2, "num_key_value_heads": 1,
    "max_position_embeddings": 128, "rms_norm_eps": 1e-6, "rope_theta": 10000.0,
    "tie_word_embeddings": True,
}
BODY = {"prompt": [3, 4, 5], "max_tokens": 4, "temperature": 0.0, "ignore_eos": True}


# ------------------------------------------------------------ replicas on loopback


@contextlib.contextmanager
def _uvicorn(app: Any) -> Iterator[int]:
    """``app`` on a free 127.0.0.1 port in a thread (bounded start and stop); its port."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = int(sock.getsockname()[1])
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="off",
                                           access_log=False))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    try:
        deadline = time.monotonic() + 10
        while not server.started:
            assert time.monotonic() < deadline, "uvicorn did not start"
            assert thread.is_alive(), "uvicorn stopped"
            time.sleep(0.01)
        yield port
    finally:
        server.should_exit = True
        thread.join(10)
        sock.close()


@pytest.fixture(scope="module")
def replicas() -> Iterator[list[str]]:
    """Two ``war serve`` apps needing ``KEY``, each over its own tiny engine: their
    ``war+http://`` specs (named r0 and r1)."""
    engines = []
    for _ in range(2):
        model = init_random(ModelConfig.from_dict(TINY), seed=0, dtype=torch.float32)
        ae = AsyncEngine(Engine(model, EngineConfig(num_kv_blocks=64, block_size=8,
                                                    max_num_batched_tokens=256)))
        ae.start()
        engines.append(ae)
    try:
        with _uvicorn(create_app(engines[0], model_name="tiny", api_key=KEY)) as p0, \
                _uvicorn(create_app(engines[1], model_name="tiny", api_key=KEY)) as p1:
            yield [f"war+http://127.0.0.1:{p0}?name=r0", f"war+http://127.0.0.1:{p1}?name=r1"]
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
def test_a_refused_key_is_a_502_naming_the_replica_without_retries(
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
            assert err["message"].startswith(("replica r0 refused the router's API key (401",
                                              "replica r1 refused the router's API key (401"))
            assert "POST /v1/completions" in err["message"]
            assert "--replica-api-key" in err["message"]
            # and SGLang's /generate the same way
            g = client.post("/generate", headers=AUTH,
                            json={"input_ids": [3, 4], "sampling_params": {"max_new_tokens": 2}})
            assert g.status_code == 502 and g.json()["error"]["code"] == "replica_auth_failed"
        assert router.stats.retries == 0  # not failed over: a configuration error
        assert router.stats.completed == 0 and router.stats.failed == 6
        assert all(r.healthy for r in router.replicas.values())  # not marked down
        assert router.stats.replicas_marked_down == 0
        assert router.stats.auth_refusals >= 6
        shown = _shown(client)
        assert 'war_router_replica_auth_refused{replica="r1"} 1.0' in shown
        assert 'war_router_http_requests_total{status="502"}' in shown
        assert KEY not in shown and WRONG not in shown
    refusals = [rec for rec in caplog.records if "refused the router's API key" in rec.message]
    # logged once per replica, not once per call
    assert sorted(rec.message.split()[1] for rec in refusals) == ["r0", "r1"], refusals
    assert all(rec.levelno == logging.ERROR for rec in refusals)
    assert KEY not in caplog.text and WRONG not in caplog.text


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


def test_a_refusal_is_not_failed_over_and_other_errors_still_are_400() -> None:
    a = _Refusing("a", CredentialsRefused("a", 403, "POST /v1/completions", "forbidden"))
    b = _Refusing("b", ValueError("b: POST /v1/completions refused (400): token id 99"))
    router = Router([a, b], make_policy("round_robin"))
    client = TestClient(create_router_app(router))
    r = client.post("/v1/completions", json={"prompt": [1], "max_tokens": 1})
    assert r.status_code == 502 and "replica a refused the router's API key (403" in \
        r.json()["error"]["message"]
    assert (a.calls, b.calls) == (1, 0)
    r = client.post("/v1/completions", json={"prompt": [1], "max_tokens": 1})
    assert r.status_code == 400 and "token id 99" in r.json()["error"]["message"]
    assert router.stats.auth_refusals == 1 and router.replicas["a"].auth_refused
    assert not router.replicas["b"].auth_refused


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

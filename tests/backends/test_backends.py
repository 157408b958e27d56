"""The replica backends: in-process, WAR over HTTP (in memory and on real sockets,
with the error mapping and dead servers), vLLM/SGLang against fake servers written
here, simulated and instant replicas, ``make_backend``, and Ray actors (slow)."""

from __future__ import annotations

import asyncio
import contextlib
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Awaitable, Iterator
from pathlib import Path
from typing import Any, TypeVar

import httpx
import pytest
import torch
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response

from loopback import serve
from war.backends import (
    InProcessBackend,
    InstantBackend,
    OpenAICompatBackend,
    ReplicaUnavailable,
    SimulatedBackend,
    WarHttpBackend,
    make_backend,
)
from war.backends.openai import metrics_from_text, parse_prometheus, parse_sglang_generate
from war.backends.ray_actor import RAY_MISSING, RayEngineBackend, import_ray
from war.engine.async_engine import AsyncEngine
from war.engine.config import EngineConfig
from war.engine.engine import Engine
from war.engine.loader import init_random, save_model
from war.engine.model_config import ModelConfig
from war.engine.server import create_app
from war.types import GenRequest, GenResult, ReplicaLoad, SamplingParams, UnknownTrajectory

T = TypeVar("T")

VOCAB = 64
TINY = {
    "model_type": "llama", "vocab_size": VOCAB, "hidden_size": 32, "intermediate_size": 64,
    "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
    "max_position_embeddings": 128, "rms_norm_eps": 1e-6, "rope_theta": 10000.0,
    "tie_word_embeddings": False, "eos_token_id": 1,
}
ENGINE_CONFIG = EngineConfig(num_kv_blocks=64, block_size=8, max_num_batched_tokens=256)
GREEDY = SamplingParams(temperature=0.0, max_tokens=6, logprobs=True)
KEY = "test-key"


def run(coro: Awaitable[T], timeout_s: float = 30.0) -> T:
    async def bounded() -> T:
        return await asyncio.wait_for(coro, timeout_s)

    return asyncio.run(bounded())


def req(rid: str, prompt: tuple[int, ...] = (5, 6, 7, 8), sampling: SamplingParams = GREEDY,
        **kw: Any) -> GenRequest:
    return GenRequest(request_id=rid, prompt_ids=prompt, sampling=sampling, **kw)


def tiny_engine(config: EngineConfig = ENGINE_CONFIG) -> Engine:
    model = init_random(ModelConfig.from_dict(TINY), seed=0, dtype=torch.float32)
    return Engine(model, config)


@pytest.fixture(scope="module")
def async_engine() -> Iterator[AsyncEngine]:
    ae = AsyncEngine(tiny_engine())
    ae.start()
    yield ae
    asyncio.run(ae.close())


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def asgi_backend(app: FastAPI, **kw: Any) -> WarHttpBackend:
    client = httpx.AsyncClient(transport=httpx.ASGITransport(app=app))
    return WarHttpBackend("asgi", "http://replica", client=client, **kw)


# ---------------------------------------------------------------- in-process


def test_inprocess_round_trip_and_closed_engine() -> None:
    engine = tiny_engine()
    expected = engine.generate([req("ref")])[0]
    ae = AsyncEngine(tiny_engine())
    backend = InProcessBackend("local", ae, owns_engine=True)

    async def go() -> None:
        assert await backend.health()  # started by the backend
        result = await backend.generate(req("r1"))
        assert result.output_ids == expected.output_ids
        assert result.logprobs == pytest.approx(expected.logprobs, abs=1e-5)
        load = await backend.load()
        assert load.kv_blocks_total == 64 and load.block_size == 8
        await backend.add_history([((1, 2, 3), "g"), ((), None)])
        with pytest.raises(UnknownTrajectory):
            await backend.generate(req("r2", continues=True, trajectory_id="nobody"))
        with pytest.raises(ValueError, match="outside the vocabulary"):
            await backend.generate(req("r3", prompt=(VOCAB + 5,)))
        await backend.close()
        assert not await backend.health()
        with pytest.raises(ReplicaUnavailable):
            await backend.generate(req("r4"))
        with pytest.raises(ReplicaUnavailable):
            await backend.add_history([((1, 2), None)])

    run(go())


# ---------------------------------------------------------------- WAR over HTTP


def test_war_http_request_body_is_exact() -> None:
    seen: list[dict[str, Any]] = []
    app = FastAPI()

    @app.post("/v1/completions")
    async def completions(request: Request) -> dict[str, Any]:
        seen.append(await request.json())
        return {"id": "x", "choices": [{"index": 0, "token_ids": [3, 4], "finish_reason": "stop",
                                        "logprobs": {"token_logprobs": [-0.5, None]}}],
                "usage": {"prompt_tokens": 9, "prompt_tokens_details": {"cached_tokens": 4}},
                "war": {"forward_passes": 2, "draft_tokens": 3, "accepted_tokens": 1,
                        "preemptions": 0, "weight_version": 7, "queue_s": 0.1,
                        "total_s": 0.2}}

    backend = asgi_backend(app, model="tiny")
    sp = SamplingParams(temperature=0.7, top_p=0.9, top_k=0, max_tokens=12,
                        stop_token_ids=(2, 9), seed=3, logprobs=True, stop=("END",))
    request = req("rid-1", (1, 2, 3), sp, trajectory_id="t", group_id="g", priority=2.5,
                  continues=True)
    result = run(backend.generate(request))
    assert seen == [{
        "model": "tiny", "prompt": [1, 2, 3], "max_tokens": 12, "temperature": 0.7,
        "top_p": 0.9, "top_k": -1, "ignore_eos": True, "stop_token_ids": [2, 9],
        "request_id": "rid-1", "priority": 2.5, "continues": True, "stop": ["END"],
        "seed": 3, "logprobs": 1, "trajectory_id": "t", "group_id": "g",
    }]
    assert result.request_id == "rid-1" and result.output_ids == (3, 4)
    assert result.logprobs[0] == -0.5 and result.logprobs[1] != result.logprobs[1]  # NaN
    assert (result.num_prompt_tokens, result.num_cached_tokens) == (9, 4)
    assert (result.num_forward_passes, result.num_draft_tokens, result.num_accepted_tokens,
            result.weight_version) == (2, 3, 1, 7)
    assert result.finish_reason == "stop" and result.total_s == 0.2

    # top_k > 0 is sent as is; no logprobs, seed, ids or model when not set
    plain = WarHttpBackend("p", "http://replica/", client=backend._http.client)
    body = plain.request_body(req("r", (1,), SamplingParams(top_k=5, logprobs=False)))
    assert body["top_k"] == 5 and "logprobs" not in body and "seed" not in body
    assert "trajectory_id" not in body and "model" not in body and "stop" not in body
    assert plain.base_url == "http://replica"


def test_war_http_generate_matches_in_process(async_engine: AsyncEngine) -> None:
    app = create_app(async_engine, model_name="tiny")
    backend = asgi_backend(app)
    local = InProcessBackend("local", async_engine)

    async def go() -> None:
        for i, prompt in enumerate([(5, 6, 7, 8), (9, 10), (11, 12, 13, 14, 15, 16)]):
            via_http = await backend.generate(req(f"h{i}", prompt))
            direct = await local.generate(req(f"d{i}", prompt))
            assert via_http.output_ids == direct.output_ids
            assert len(via_http.output_ids) == 6 and via_http.finish_reason == "length"
            assert via_http.logprobs == pytest.approx(direct.logprobs, abs=1e-5)
            assert via_http.num_prompt_tokens == len(prompt)
        # without logprobs
        no_lp = await backend.generate(req("nolp", sampling=SamplingParams(
            temperature=0.0, max_tokens=3, logprobs=False)))
        assert no_lp.logprobs == () and len(no_lp.output_ids) == 3
        # the request's stop token ends the output (included); no EOS is added by the server
        first = await backend.generate(req("s0"))
        stop_at = first.output_ids[2]
        cut = await backend.generate(req("s1", sampling=SamplingParams(
            temperature=0.0, max_tokens=6, stop_token_ids=(stop_at,))))
        assert cut.output_ids == first.output_ids[: first.output_ids.index(stop_at) + 1]
        assert cut.finish_reason == "stop"
        await backend.close()

    run(go())


def test_war_http_continues_and_error_mapping(async_engine: AsyncEngine) -> None:
    backend = asgi_backend(create_app(async_engine, model_name="tiny"))
    local = InProcessBackend("local", async_engine)

    async def go() -> None:
        turn1 = await backend.generate(req("c1", (20, 21, 22), trajectory_id="traj-a"))
        turn2 = await backend.generate(req("c2", (23, 24), trajectory_id="traj-a",
                                           continues=True))
        whole = (20, 21, 22, *turn1.output_ids, 23, 24)
        assert turn2.num_prompt_tokens == len(whole)
        direct = await local.generate(req("c-direct", whole))
        assert turn2.output_ids == direct.output_ids

        with pytest.raises(UnknownTrajectory, match="send the whole context"):
            await backend.generate(req("c3", (1, 2), trajectory_id="unknown", continues=True))
        with pytest.raises(ValueError, match=r"refused \(400\).*outside the vocabulary") as e:
            await backend.generate(req("bad", (VOCAB + 1,)))
        assert not isinstance(e.value, UnknownTrajectory)
        with pytest.raises(ValueError, match="exceeds the context length"):
            await backend.generate(req("long", sampling=SamplingParams(max_tokens=1000)))
        # the replica keeps serving after refusals
        assert len((await backend.generate(req("after"))).output_ids) == 6

    run(go())


def test_war_http_load_history_health_and_auth(async_engine: AsyncEngine) -> None:
    app = create_app(async_engine, model_name="tiny", api_key=KEY)

    async def go() -> None:
        backend = asgi_backend(app, api_key=KEY)
        load = await backend.load()
        assert isinstance(load, ReplicaLoad)
        assert (load.kv_blocks_total, load.block_size) == (64, 8)
        assert load.num_running == 0 and load.weight_version == async_engine.weight_version
        await backend.add_history([((3, 4, 5), "g1"), ((6, 7), None), ((), "empty")])
        await backend.add_history([])
        with pytest.raises(ValueError, match="outside the vocabulary"):
            await backend.add_history([((VOCAB + 3,), None)])
        assert await backend.health()
        assert len((await backend.generate(req("auth-ok"))).output_ids) == 6
        await backend.observe_rl_step(2)
        assert async_engine.engine.speculator.rl_step == 2  # type: ignore[attr-defined]
        with pytest.raises(ValueError, match="went backwards"):
            await backend.observe_rl_step(1)
        with pytest.raises(ValueError, match="rl_step must be"):
            await backend.observe_rl_step(-1)

        anonymous = asgi_backend(app)
        assert await anonymous.health()  # /health needs no key
        with pytest.raises(ValueError, match=r"\(401\).*API key"):
            await anonymous.generate(req("auth-missing"))

    run(go())


def test_war_http_5xx_and_malformed_answers_mean_unavailable() -> None:
    app = FastAPI()
    mode = {"kind": "503"}

    @app.post("/v1/completions")
    async def completions() -> Response:
        if mode["kind"] == "503":
            return JSONResponse({"error": {"message": "engine closed", "code": "x"}},
                                status_code=503)
        if mode["kind"] == "500-text":
            return PlainTextResponse("Internal Server Error", status_code=500)
        if mode["kind"] == "not-json":
            return PlainTextResponse("hello")
        if mode["kind"] == "409-other":
            return JSONResponse({"error": {"message": "busy", "code": "conflict"}},
                                status_code=409)
        return JSONResponse({"choices": []})

    @app.get("/v1/load")
    async def load() -> dict[str, Any]:
        return {"num_running": 1}

    @app.get("/health")
    async def health() -> Response:
        return JSONResponse({"status": "stopped"}, status_code=503)

    backend = asgi_backend(app)

    async def go() -> None:
        with pytest.raises(ReplicaUnavailable, match=r"\(503\): engine closed"):
            await backend.generate(req("a"))
        mode["kind"] = "500-text"
        with pytest.raises(ReplicaUnavailable, match="Internal Server Error"):
            await backend.generate(req("b"))
        mode["kind"] = "not-json"
        with pytest.raises(ReplicaUnavailable, match="invalid JSON"):
            await backend.generate(req("c"))
        mode["kind"] = "empty"
        with pytest.raises(ReplicaUnavailable, match="malformed"):
            await backend.generate(req("d"))
        mode["kind"] = "409-other"
        with pytest.raises(ValueError, match="busy") as e:
            await backend.generate(req("e"))
        assert not isinstance(e.value, UnknownTrajectory)
        with pytest.raises(ReplicaUnavailable, match="malformed /v1/load"):
            await backend.load()
        assert not await backend.health()

    run(go())


def test_war_http_real_socket(async_engine: AsyncEngine) -> None:
    app = create_app(async_engine, model_name="tiny")
    local = InProcessBackend("local", async_engine)
    with serve(app) as (url, server):
        async def go() -> None:
            backend = WarHttpBackend("sock", url, timeout_s=30)
            assert await backend.health()
            results = await asyncio.gather(*(backend.generate(req(f"sock-{i}", (30 + i, 31)))
                                             for i in range(4)))
            for i, r in enumerate(results):
                direct = await local.generate(req(f"sock-d{i}", (30 + i, 31)))
                assert r.output_ids == direct.output_ids
            load = await backend.load()
            assert load.kv_blocks_total == 64
            await backend.add_history([((1, 2, 3), "g")])

            server.should_exit = True  # the server goes away under the pooled connections
            deadline = time.monotonic() + 10
            while _accepts(url):
                assert time.monotonic() < deadline, "uvicorn did not stop"
                await asyncio.sleep(0.05)
            t0 = time.monotonic()  # now unavailable, quickly
            assert not await backend.health()
            with pytest.raises(ReplicaUnavailable, match="unreachable"):
                await backend.generate(req("gone"))
            with pytest.raises(ReplicaUnavailable):
                await backend.load()
            assert time.monotonic() - t0 < 5
            await backend.close()

        run(go())


def _accepts(url: str) -> bool:
    """Whether something accepts connections at ``url``'s host and port."""
    host, port = url.removeprefix("http://").split(":")
    with socket.socket() as s:
        s.settimeout(1.0)
        return s.connect_ex((host, int(port))) == 0


def test_connection_refused_is_unavailable_quickly() -> None:
    backend = WarHttpBackend("nobody", f"http://127.0.0.1:{free_port()}",
                             timeout_s=2.0, connect_timeout_s=0.5, health_timeout_s=0.5)

    async def go() -> None:
        t0 = time.monotonic()
        with pytest.raises(ReplicaUnavailable, match="unreachable"):
            await backend.generate(req("r"))
        with pytest.raises(ReplicaUnavailable):
            await backend.load()
        with pytest.raises(ReplicaUnavailable):
            await backend.add_history([((1,), None)])
        assert not await backend.health()
        assert time.monotonic() - t0 < 3
        await backend.close()

    run(go())


@contextlib.contextmanager
def dying_server(behaviour: str) -> Iterator[str]:
    """A raw TCP server on 127.0.0.1 that reads a request and then, as a crashed
    replica would, closes the connection (``close``), resets it (``reset``) or never
    answers (``hang``)."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(8)
    listener.settimeout(0.1)
    stop = threading.Event()
    conns: list[socket.socket] = []

    def loop() -> None:
        while not stop.is_set():
            try:
                conn, _ = listener.accept()
            except (TimeoutError, OSError):
                continue
            conns.append(conn)
            conn.settimeout(2)
            with contextlib.suppress(OSError):
                data = b""
                while b"\r\n\r\n" not in data:
                    chunk = conn.recv(65536)
                    if not chunk:
                        break
                    data += chunk
            if behaviour == "reset":
                conn.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER,
                                b"\x01\x00\x00\x00\x00\x00\x00\x00")
                conn.close()
            elif behaviour == "close":
                conn.close()

    thread = threading.Thread(target=loop, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{listener.getsockname()[1]}"
    finally:
        stop.set()
        thread.join(5)
        for c in conns:
            c.close()
        listener.close()


def test_load_and_health_of_a_hung_replica_are_bounded_by_the_health_timeout() -> None:
    # a replica that accepts connections but never answers: its probes fail within
    # health_timeout_s, not a whole generation's timeout_s
    with dying_server("hang") as url:
        backend = WarHttpBackend("hung", url, timeout_s=30.0, health_timeout_s=0.3)

        async def go() -> None:
            t0 = time.monotonic()
            with pytest.raises(ReplicaUnavailable, match="timed out"):
                await backend.load()
            assert not await backend.health()
            assert time.monotonic() - t0 < 3
            await backend.close()

        run(go(), timeout_s=10)


def test_an_explicit_port_is_kept() -> None:
    # port 0 is not the default port (``or`` made it 80); make_backend refuses it
    assert WarHttpBackend("z", "http://127.0.0.1:0")._http._port == 0
    assert WarHttpBackend("d", "http://127.0.0.1")._http._port == 80
    assert WarHttpBackend("t", "https://host.example")._http._port == 443


@pytest.mark.parametrize("url", [
    "http://user:pw@127.0.0.1:8000",  # (the h1 pool would drop them unseen)
    "http://127.0.0.1:8000/v1?x=1",  # (a client's URL would put the path in the query)
    "http://127.0.0.1:8000/?",
    "http://127.0.0.1:8000/#frag",
])
def test_a_base_url_with_credentials_query_or_fragment_is_refused(url: str) -> None:
    with pytest.raises(ValueError, match=r"credentials|query or fragment"):
        WarHttpBackend("w", url)
    with pytest.raises(ValueError, match=r"credentials|query or fragment"):
        OpenAICompatBackend("v", url, "m")


@pytest.mark.parametrize("api_key", ["key\n", "key\r\nX-Injected: 1", "ke\x00y", "kéy"])
def test_an_api_key_that_would_break_its_header_is_refused(api_key: str) -> None:
    with pytest.raises(ValueError, match="api_key"):
        WarHttpBackend("w", "http://127.0.0.1:8000", api_key)
    with pytest.raises(ValueError, match="api_key"):
        OpenAICompatBackend("v", "http://127.0.0.1:8000", "m", api_key)
    WarHttpBackend("w", "http://127.0.0.1:8000", "sk-Abc_123.x=")  # an ordinary key


@pytest.mark.parametrize("behaviour", ["close", "reset", "hang"])
def test_server_dying_mid_request_is_unavailable(behaviour: str) -> None:
    # (a closed or reset connection is found at once: its generous timeout keeps a busy
    # machine from reading it as a timeout; a hang waits out the short one)
    timeout_s = 0.5 if behaviour == "hang" else 20.0
    with dying_server(behaviour) as url:
        backend = WarHttpBackend("dying", url, timeout_s=timeout_s, connect_timeout_s=timeout_s)

        async def go() -> None:
            t0 = time.monotonic()
            with pytest.raises(ReplicaUnavailable,
                               match="timed out" if behaviour == "hang" else "unreachable"):
                await backend.generate(req("r"))
            assert time.monotonic() - t0 < 15  # (bounded: not a whole generation's wait)
            await backend.close()

        run(go())


SLOW_REPLICA = """
import asyncio, os, sys
import uvicorn
from fastapi import FastAPI

app = FastAPI()

@app.post("/v1/completions")
async def completions() -> dict:
    await asyncio.sleep(120)
    return {}

@app.get("/health")
async def health() -> dict:
    return {"status": "ok", "pid": os.getpid()}

uvicorn.run(app, host="127.0.0.1", port=int(sys.argv[1]), log_level="warning")
"""


def test_replica_process_killed_mid_request_is_unavailable(tmp_path: Path) -> None:
    script = tmp_path / "slow_replica.py"
    script.write_text(SLOW_REPLICA, encoding="utf-8")
    port = free_port()
    proc = subprocess.Popen([sys.executable, str(script), str(port)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    backend = WarHttpBackend("doomed", f"http://127.0.0.1:{port}", timeout_s=60,
                             health_timeout_s=0.5)

    async def go() -> None:
        deadline = time.monotonic() + 30
        while not await backend.health():
            assert proc.poll() is None, "the replica process exited"
            assert time.monotonic() < deadline, "the replica process did not come up"
            await asyncio.sleep(0.05)
        # the port is ours: not another server that took it first (then our process
        # failed to bind, and killing it would leave the call hanging on the other)
        answer = httpx.get(f"http://127.0.0.1:{port}/health", timeout=5)
        assert answer.json()["pid"] == proc.pid
        task = asyncio.ensure_future(backend.generate(req("in-flight")))
        await asyncio.sleep(0.3)  # the request is being served
        assert not task.done()
        t0 = time.monotonic()
        proc.kill()
        with pytest.raises(ReplicaUnavailable, match="unreachable"):
            await task
        assert time.monotonic() - t0 < 5
        assert not await backend.health()
        await backend.close()

    try:
        run(go(), timeout_s=60)
    finally:
        proc.kill()
        proc.wait(10)


# ---------------------------------------------------------------- vLLM and SGLang (fakes)


def _fake_tokens(prompt: list[int], n: int) -> list[int]:
    return [(prompt[-1] + 1 + i) % 1000 for i in range(n)]


def fake_vllm(shape: str, seen: list[dict[str, Any]], gate: asyncio.Event | None = None,
              metrics: str | None = None) -> FastAPI:
    """A vLLM-like server: ``shape`` ``token_ids`` (vLLM >= 0.10 with return_token_ids)
    or ``strings`` (only ``logprobs.tokens`` as ``token_id:<id>``)."""
    app = FastAPI()

    @app.post("/v1/completions")
    async def completions(request: Request) -> dict[str, Any]:
        body = await request.json()
        seen.append(body)
        if gate is not None:
            await gate.wait()
        out = _fake_tokens(body["prompt"], body["max_tokens"])
        choice: dict[str, Any] = {
            "index": 0, "text": "xx", "finish_reason": "length", "stop_reason": None,
            "logprobs": None,
        }
        if body.get("logprobs") is not None:  # as vLLM: logprobs only when asked
            choice["logprobs"] = {
                "text_offset": [0] * len(out),
                "token_logprobs": [-0.25 * (i + 1) for i in range(len(out))],
                "tokens": [f"token_id:{t}" for t in out],
                "top_logprobs": [{f"token_id:{t}": -0.25} for t in out]}
        if shape == "token_ids":
            choice["token_ids"] = out
            choice["prompt_token_ids"] = body["prompt"]
        return {"id": "cmpl-1", "object": "text_completion", "created": 0,
                "model": body.get("model"), "choices": [choice],
                "usage": {"prompt_tokens": len(body["prompt"]),
                          "completion_tokens": len(out), "total_tokens": 0,
                          "prompt_tokens_details": None}}

    @app.get("/health")
    async def health() -> Response:
        return Response(status_code=200)

    if metrics is not None:
        @app.get("/metrics")
        async def prom() -> PlainTextResponse:
            return PlainTextResponse(metrics)

    return app


def fake_sglang(seen: list[dict[str, Any]], with_output_ids: bool) -> FastAPI:
    app = FastAPI()

    @app.post("/generate")
    async def generate(request: Request) -> dict[str, Any]:
        body = await request.json()
        seen.append(body)
        out = _fake_tokens(body["input_ids"], body["sampling_params"]["max_new_tokens"])
        answer: dict[str, Any] = {
            "text": "yy",
            "meta_info": {
                "id": body["rid"], "prompt_tokens": len(body["input_ids"]),
                "completion_tokens": len(out), "cached_tokens": 2,
                "finish_reason": {"type": "length", "length": len(out)},
            },
        }
        if body["return_logprob"]:  # as SGLang: logprobs only when asked
            answer["meta_info"]["output_token_logprobs"] = [[-0.5, t, None] for t in out]
        if with_output_ids:
            answer["output_ids"] = out
        return answer

    @app.get("/health")
    async def health() -> Response:
        return Response(status_code=200)

    return app


def openai_backend(app: FastAPI, server: str = "vllm", **kw: Any) -> OpenAICompatBackend:
    client = httpx.AsyncClient(transport=httpx.ASGITransport(app=app))
    return OpenAICompatBackend("oa", "http://fake", "the-model", server=server, client=client,
                               **kw)


@pytest.mark.parametrize("shape", ["token_ids", "strings"])
def test_vllm_token_ids_and_logprobs(shape: str) -> None:
    seen: list[dict[str, Any]] = []
    backend = openai_backend(fake_vllm(shape, seen))
    sp = SamplingParams(temperature=0.5, top_k=0, max_tokens=4, stop_token_ids=(2,), seed=11)

    async def go() -> None:
        result = await backend.generate(req("v1", (7, 8, 9), sp, priority=3.0))
        assert result.output_ids == (10, 11, 12, 13)
        assert result.logprobs == (-0.25, -0.5, -0.75, -1.0)
        assert result.finish_reason == "length" and result.num_prompt_tokens == 3
        assert result.request_id == "v1"
        no_lp = await backend.generate(req("v2", (7,), SamplingParams(max_tokens=2,
                                                                      logprobs=False)))
        assert no_lp.output_ids == (8, 9) and no_lp.logprobs == ()
        assert no_lp.total_s > 0  # the round trip
        assert await backend.health()

    run(go())
    body = seen[0]
    assert body == {
        "model": "the-model", "prompt": [7, 8, 9], "max_tokens": 4, "temperature": 0.5,
        "top_p": 1.0, "top_k": -1, "stop_token_ids": [2], "ignore_eos": True,
        "skip_special_tokens": False, "logprobs": 1, "return_token_ids": True,
        "return_tokens_as_token_ids": True, "seed": 11,
    }
    if shape == "token_ids":  # the ids came back themselves: logprobs only when wanted
        assert "logprobs" not in seen[1] and backend.ids_direct
    else:  # the ids come only in the logprobs: always asked
        assert seen[1]["logprobs"] == 1 and not backend.ids_direct
    assert backend.logprob_fallbacks == 0


@pytest.mark.parametrize("server", ["vllm", "sglang"])
def test_logprobs_asked_again_when_a_server_stops_returning_ids(server: str) -> None:
    """A server whose answers stop carrying the token ids themselves: the call that
    did not ask for logprobs is made once more asking for them (its result is whole),
    and calls ask for them again from then on; nothing is lost."""
    seen: list[dict[str, Any]] = []
    direct = [True]
    app = FastAPI()

    def tokens(body: dict[str, Any]) -> list[int]:
        return _fake_tokens(body.get("prompt") or body.get("input_ids") or [0], 2)

    @app.post("/v1/completions")
    async def completions(request: Request) -> dict[str, Any]:
        body = await request.json()
        seen.append(body)
        out = tokens(body)
        choice: dict[str, Any] = {"text": "", "finish_reason": "length", "logprobs": None}
        if body.get("logprobs") is not None:
            choice["logprobs"] = {"tokens": [f"token_id:{t}" for t in out],
                                  "token_logprobs": [-1.0] * len(out)}
        if direct[0]:
            choice["token_ids"] = out
        return {"choices": [choice], "usage": {"prompt_tokens": 1}}

    @app.post("/generate")
    async def generate(request: Request) -> dict[str, Any]:
        body = await request.json()
        seen.append(body)
        out = tokens(body)
        answer: dict[str, Any] = {"text": "", "meta_info": {"finish_reason": {"type": "length"}}}
        if body["return_logprob"]:
            answer["meta_info"]["output_token_logprobs"] = [[-1.0, t, None] for t in out]
        if direct[0]:
            answer["output_ids"] = out
        return answer

    backend = openai_backend(app, server=server)
    asked = (lambda b: b.get("logprobs") == 1) if server == "vllm" else (
        lambda b: b["return_logprob"] is True)
    quiet = SamplingParams(max_tokens=2, logprobs=False)

    async def go() -> None:
        first = await backend.generate(req("a", (5,), quiet))  # unknown yet: asks
        second = await backend.generate(req("b", (5,), quiet))  # learned: does not ask
        assert first.output_ids == second.output_ids == (6, 7)
        assert [asked(b) for b in seen] == [True, False] and backend.ids_direct
        direct[0] = False  # (say, the server was replaced by an older version)
        third = await backend.generate(req("c", (5,), quiet))
        assert third.output_ids == (6, 7) and third.logprobs == ()
        assert [asked(b) for b in seen[2:]] == [False, True]  # the same call, once more
        assert backend.logprob_fallbacks == 1 and not backend.ids_direct
        fourth = await backend.generate(req("d", (5,), quiet))
        assert fourth.output_ids == (6, 7) and asked(seen[-1]) and len(seen) == 5
        wanted = await backend.generate(req("e", (5,), SamplingParams(max_tokens=2)))
        assert wanted.logprobs == (-1.0, -1.0) and asked(seen[-1])

    run(go())


def test_vllm_priority_scheduling_and_malformed_answers() -> None:
    seen: list[dict[str, Any]] = []
    backend = openai_backend(fake_vllm("token_ids", seen), priority_scheduling=True)
    run(backend.generate(req("p", (3,), priority=4.4)))
    assert seen[0]["priority"] == -4  # vLLM: lower first
    # the router sends the policy's priority only to servers that schedule by it
    assert backend.takes_priority
    assert not openai_backend(fake_vllm("token_ids", seen)).takes_priority

    app = FastAPI()

    @app.post("/v1/completions")
    async def completions() -> dict[str, Any]:
        return {"choices": [{"text": "no ids here", "finish_reason": "stop",
                             "logprobs": None}]}

    with pytest.raises(ReplicaUnavailable, match="neither"):
        run(openai_backend(app).generate(req("m")))


def test_vllm_text_prompts_for_fronts_that_refuse_token_ids() -> None:
    seen: list[dict[str, Any]] = []
    app = FastAPI()

    @app.post("/v1/completions")
    async def completions(request: Request) -> dict[str, Any]:
        body = await request.json()
        seen.append(body)
        assert isinstance(body["prompt"], str)
        ids = [int(w) for w in body["prompt"].split()]
        if ids and ids[0] == 99:  # this server "tokenizes" 99 as two tokens
            ids = [9, 9, *ids[1:]]
        return {"choices": [{"text": "", "finish_reason": "length", "logprobs": None,
                             "token_ids": [5, 6], "prompt_token_ids": ids}]}

    backend = openai_backend(app, text_prompt=lambda ids: " ".join(map(str, ids)))
    sp = SamplingParams(max_tokens=2, logprobs=False)
    assert run(backend.generate(req("t1", (3, 4), sp))).output_ids == (5, 6)
    assert seen[0]["prompt"] == "3 4" and backend.prompt_mismatches == 0
    run(backend.generate(req("t2", (99, 4), sp)))
    assert backend.prompt_mismatches == 1  # counted, not hidden
    with pytest.raises(ValueError, match="server='vllm' only"):
        openai_backend(fake_sglang(seen, True), server="sglang", text_prompt=str)


def test_openai_backend_refuses_continues_without_calling() -> None:
    seen: list[dict[str, Any]] = []
    for backend in (openai_backend(fake_vllm("token_ids", seen)),
                    openai_backend(fake_sglang(seen, True), server="sglang")):
        with pytest.raises(UnknownTrajectory, match="whole context"):
            run(backend.generate(req("c", trajectory_id="t", continues=True)))
        run(backend.add_history([((1, 2), "g")]))  # a no-op
    assert seen == []


@pytest.mark.parametrize("with_output_ids", [True, False])
def test_sglang_generate(with_output_ids: bool) -> None:
    seen: list[dict[str, Any]] = []
    backend = openai_backend(fake_sglang(seen, with_output_ids), server="sglang")
    sp = SamplingParams(temperature=0.0, top_k=4, max_tokens=3, stop_token_ids=(1,), seed=5)
    result = run(backend.generate(req("s1", (40, 41), sp)))
    assert result.output_ids == (42, 43, 44)
    assert result.logprobs == (-0.5, -0.5, -0.5)
    assert result.finish_reason == "length"
    assert (result.num_prompt_tokens, result.num_cached_tokens) == (2, 2)
    assert result.total_s > 0  # the round trip, measured here
    assert seen[0] == {
        "input_ids": [40, 41], "return_logprob": True, "rid": "s1",
        "sampling_params": {"max_new_tokens": 3, "temperature": 0.0, "top_p": 1.0, "top_k": 4,
                            "stop_token_ids": [1], "ignore_eos": True,
                            "skip_special_tokens": False, "sampling_seed": 5},
    }
    quiet = run(backend.generate(req("s2", (40,), SamplingParams(max_tokens=2,
                                                                   logprobs=False))))
    assert quiet.output_ids == (41, 42) and quiet.logprobs == ()
    # logprobs are asked for without being wanted only while the ids may come in them alone
    assert seen[1]["return_logprob"] is (not with_output_ids)
    assert backend.ids_direct is with_output_ids and backend.logprob_fallbacks == 0


VLLM_METRICS = """\
# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="the-model"} 2.0
vllm:num_requests_running{engine="1",model_name="the-model"} 1.0
# HELP vllm:num_requests_waiting Number of requests waiting to be processed.
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{engine="0",model_name="the-model"} 4.0
# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{engine="0",model_name="the-model"} 0.25
# TYPE vllm:cache_config_info gauge
vllm:cache_config_info{block_size="16",cache_dtype="auto",num_gpu_blocks="1000"} 1.0
vllm:prompt_tokens_total{model_name="the-model"} 1234 1700000000000
this line is not prometheus
vllm:num_requests_waiting{engine="1",model_name="the-model"} NaN
"""

SGLANG_METRICS = """\
# TYPE sglang:num_running_reqs gauge
sglang:num_running_reqs{model_name="m",tp_rank="0"} 5
sglang:num_queue_reqs{model_name="m"} 1
sglang:token_usage{model_name="m"} 0.5
sglang:max_total_num_tokens{model_name="m"} 20000
"""


def test_metrics_parsing() -> None:
    samples = parse_prometheus(VLLM_METRICS)
    assert samples["vllm:prompt_tokens_total"] == [({"model_name": "the-model"}, 1234.0)]
    assert samples["vllm:cache_config_info"][0][0]["num_gpu_blocks"] == "1000"
    m = metrics_from_text(VLLM_METRICS)
    assert (m.num_running, m.num_waiting, m.kv_usage) == (3, 4, 0.25)
    assert (m.kv_blocks_total, m.block_size) == (1000, 16)
    old = metrics_from_text("vllm:gpu_cache_usage_perc 0.5\nvllm:num_requests_running 1\n")
    assert (old.kv_usage, old.num_running, old.num_waiting, old.kv_blocks_total) == (
        0.5, 1, None, None)
    sg = metrics_from_text(SGLANG_METRICS)
    assert (sg.num_running, sg.num_waiting, sg.kv_usage) == (5, 1, 0.5)
    assert (sg.kv_blocks_total, sg.block_size) == (20000, 1)
    assert metrics_from_text("") == metrics_from_text("garbage {{{")


def test_openai_load_from_metrics_and_from_in_flight() -> None:
    seen: list[dict[str, Any]] = []

    async def go() -> None:
        with_metrics = openai_backend(fake_vllm("token_ids", seen, metrics=VLLM_METRICS))
        load = await with_metrics.load()
        assert (load.num_running, load.num_waiting) == (3, 4)
        assert (load.kv_blocks_used, load.kv_blocks_total, load.block_size) == (250, 1000, 16)
        assert load.kv_free_tokens == 750 * 16

        gate = asyncio.Event()
        bare = openai_backend(fake_vllm("token_ids", seen, gate=gate))  # no /metrics: 404
        tasks = [asyncio.ensure_future(bare.generate(req(f"f{i}", (1, 2, 3))))
                 for i in range(2)]
        for _ in range(200):
            if len(seen) == 2:
                break
            await asyncio.sleep(0.01)
        load = await bare.load()
        assert (load.num_running, load.tokens_in_flight, load.num_waiting) == (2, 6, 0)
        assert (load.kv_blocks_used, load.kv_blocks_total) == (0, 0)  # unknown
        assert bare._metrics_missing
        gate.set()
        await asyncio.gather(*tasks)
        load = await bare.load()
        assert (load.num_running, load.tokens_in_flight) == (0, 0)
        no_metrics = openai_backend(fake_vllm("token_ids", seen), use_metrics=False)
        assert (await no_metrics.load()).num_running == 0

    run(go())


def test_openai_backend_unreachable() -> None:
    backend = OpenAICompatBackend("gone", f"http://127.0.0.1:{free_port()}", "m",
                                  connect_timeout_s=0.5, health_timeout_s=0.5)

    async def go() -> None:
        with pytest.raises(ReplicaUnavailable):
            await backend.generate(req("r"))
        with pytest.raises(ReplicaUnavailable):
            await backend.load()
        assert not await backend.health()
        assert backend.num_in_flight == 0
        await backend.close()

    run(go())


def test_openai_backend_over_a_real_socket() -> None:
    seen: list[dict[str, Any]] = []
    with serve(fake_vllm("strings", seen, metrics=VLLM_METRICS)) as (url, _):
        async def go() -> None:
            backend = OpenAICompatBackend("real", url, "the-model")
            result = await backend.generate(req("x", (1, 2)))
            assert result.output_ids == (3, 4, 5, 6, 7, 8)
            assert (await backend.load()).num_waiting == 4
            assert await backend.health()
            await backend.close()

        run(go())


# ---------------------------------------------------------------- simulated and instant


class ManualClock:
    """A clock that moves only when told to."""

    def __init__(self) -> None:
        self.t = 0.0
        self.sleeps: list[float] = []
        self._waiters: list[tuple[float, asyncio.Future[None]]] = []

    def now(self) -> float:
        return self.t

    async def sleep(self, seconds: float) -> None:
        self.sleeps.append(seconds)
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._waiters.append((self.t + seconds, fut))
        await fut

    def advance(self, seconds: float) -> None:
        self.t += seconds
        for due, fut in list(self._waiters):
            if due <= self.t and not fut.done():
                fut.set_result(None)


async def settle(rounds: int = 5) -> None:
    """Lets the other tasks run up to their next real wait."""
    for _ in range(rounds):
        await asyncio.sleep(0)


def test_simulated_backend_delay_tokens_and_load() -> None:
    clock = ManualClock()
    calls: list[tuple[int, int]] = []

    def step_time(batch: int, context: int) -> float:
        calls.append((batch, context))
        return 0.01

    backend = SimulatedBackend("sim", step_time, clock=clock, vocab_size=50, block_size=4,
                               kv_blocks_total=100)

    async def go() -> None:
        sp = SamplingParams(max_tokens=5)
        task = asyncio.ensure_future(backend.generate(req("a", (1, 2, 3), sp)))
        await settle()
        assert clock.sleeps == [pytest.approx(0.06)]  # one prefill + five decode steps
        load = await backend.load()
        assert (load.num_running, load.tokens_in_flight, load.kv_blocks_used) == (1, 8, 2)
        assert load.kv_blocks_total == 100 and load.block_size == 4
        clock.advance(0.05)
        await settle()
        assert not task.done()
        clock.advance(0.02)
        result = await task
        assert len(result.output_ids) == 5 and result.finish_reason == "length"
        assert all(0 <= t < 50 for t in result.output_ids)
        assert result.total_s == pytest.approx(0.07) and len(result.logprobs) == 5
        assert (await backend.load()).num_running == 0
        # deterministic; a stop token ends it
        again = asyncio.ensure_future(backend.generate(req("b", (1, 2, 3), sp)))
        await settle()
        clock.advance(1)
        assert (await again).output_ids == result.output_ids
        stop = result.output_ids[1]
        cut = asyncio.ensure_future(backend.generate(req("c", (1, 2, 3), SamplingParams(
            max_tokens=5, stop_token_ids=(stop,)))))
        await settle()
        clock.advance(1)
        done = await cut
        assert done.output_ids == result.output_ids[:2] and done.finish_reason == "stop"

    run(go())
    assert calls[0] == (3, 3)  # prefill of the 3 prompt tokens


def test_simulated_backend_trajectories_failures_and_history() -> None:
    backend = SimulatedBackend("sim", lambda b, c: 0.0, fail_after_n=3,
                               output_len=lambda r: 2)

    async def go() -> None:
        first = await backend.generate(req("t1", (1, 2), trajectory_id="tr"))
        assert first.finish_reason == "stop" and len(first.output_ids) == 2
        second = await backend.generate(req("t2", (9,), trajectory_id="tr", continues=True))
        assert second.num_prompt_tokens == 5 and second.num_cached_tokens == 4
        with pytest.raises(UnknownTrajectory):
            await backend.generate(req("t3", (9,), trajectory_id="other", continues=True))
        await backend.add_history([((1, 2), "g")])
        assert list(backend.history) == [((1, 2), "g")]
        # the 4th call crashes the replica
        with pytest.raises(ReplicaUnavailable):
            await backend.generate(req("t4"))
        assert not await backend.health()
        with pytest.raises(ReplicaUnavailable):
            await backend.load()
        backend.set_down(False)
        assert await backend.health()
        with pytest.raises(UnknownTrajectory):  # the crash lost the trajectories
            await backend.generate(req("t5", (9,), trajectory_id="tr", continues=True))
        assert len((await backend.generate(req("t6"))).output_ids) == 2  # fires once

    run(go())


def test_simulated_set_down_fails_in_flight_requests() -> None:
    backend = SimulatedBackend("sim", lambda b, c: 10.0)  # real clock: ten seconds a step

    async def go() -> None:
        tasks = [asyncio.ensure_future(backend.generate(req(f"r{i}"))) for i in range(3)]
        await asyncio.sleep(0.01)
        assert backend.num_in_flight == 3
        t0 = time.monotonic()
        backend.set_down(True)
        results = await asyncio.gather(*tasks, return_exceptions=True)
        assert all(isinstance(r, ReplicaUnavailable) for r in results)
        assert time.monotonic() - t0 < 1 and backend.num_in_flight == 0
        assert backend.num_failed == 3

    run(go())


def test_instant_backend() -> None:
    backend = InstantBackend("fast", max_output_tokens=4)

    async def go() -> None:
        r = await backend.generate(req("i", (1, 2, 3)))
        assert r.output_ids == (1, 2, 3, 1) and r.finish_reason == "stop"
        r = await backend.generate(req("j", (1, 2), SamplingParams(max_tokens=3,
                                                                   stop_token_ids=(2,))))
        assert r.output_ids == (1, 2) and r.finish_reason == "stop"
        r = await backend.generate(req("k", (5,), SamplingParams(max_tokens=2)))
        assert r.output_ids == (5, 5) and r.finish_reason == "length"
        assert (await backend.load()).num_running == 0 and await backend.health()
        backend.set_down(True)
        with pytest.raises(ReplicaUnavailable):
            await backend.generate(req("l"))

    run(go())


def test_instant_backend_is_fast() -> None:
    backend = InstantBackend("fast")
    requests = [req(f"q{i}") for i in range(2000)]

    async def go() -> list[GenResult]:
        return [await backend.generate(r) for r in requests]

    t0 = time.perf_counter()
    assert len(run(go())) == 2000
    assert time.perf_counter() - t0 < 2


# ---------------------------------------------------------------- make_backend


def test_make_backend_parses_specs() -> None:
    war = make_backend("war+http://127.0.0.1:8001")
    assert isinstance(war, WarHttpBackend)
    assert war.name == "127.0.0.1:8001" and war.base_url == "http://127.0.0.1:8001"
    named = make_backend("war+https://host.example:443/prefix/?name=r1&timeout_s=5")
    assert isinstance(named, WarHttpBackend)
    assert named.name == "r1" and named.base_url == "https://host.example:443/prefix"
    assert named._http.timeout_s == 5.0
    vllm = make_backend("vllm+http://10.0.0.2:8000/?model=Qwen/Qwen3-8B", name="v")
    assert isinstance(vllm, OpenAICompatBackend)
    assert (vllm.name, vllm.server, vllm.model, vllm.base_url) == (
        "v", "vllm", "Qwen/Qwen3-8B", "http://10.0.0.2:8000")
    sgl = make_backend("sglang+http://[::1]:30000")
    assert isinstance(sgl, OpenAICompatBackend)
    assert (sgl.server, sgl.model, sgl.base_url) == ("sglang", None, "http://[::1]:30000")
    assert isinstance(make_backend("sim://s1"), SimulatedBackend)
    instant = make_backend("instant://i1")
    assert isinstance(instant, InstantBackend) and instant.name == "i1"


@pytest.mark.parametrize("spec, why", [
    ("", "empty"),
    ("http://127.0.0.1:8000", "unknown scheme"),
    ("tgi+http://127.0.0.1:8000", "unknown scheme"),
    ("war+ftp://127.0.0.1:8000", "unknown scheme"),
    ("war+http://", "no host"),
    ("war+http://127.0.0.1:99999", "bad port"),
    ("war+http://127.0.0.1:abc", "bad port"),
    ("war+http://127.0.0.1:0", "port 0"),
    ("sglang+http://127.0.0.1:0/?name=s", "port 0"),
    ("war+http://user:pw@127.0.0.1:8000", "credentials"),
    ("war+http://127.0.0.1:8000/?model=x", "unknown parameter 'model'"),
    ("war+http://127.0.0.1:8000/?name=a&name=b", "given twice"),
    ("war+http://127.0.0.1:8000/?name=", "empty"),
    ("war+http://127.0.0.1:8000/?timeout_s=-1", "timeout_s"),
    ("war+http://127.0.0.1:8000/?timeout_s=soon", "timeout_s"),
    ("vllm+http://127.0.0.1:8000", "needs \\?model"),
    ("war+http://127.0.0.1:8000#x", "fragment"),
    ("sim://", "takes a name"),
])
def test_make_backend_rejects_bad_specs(spec: str, why: str) -> None:
    with pytest.raises(ValueError, match=why) as e:
        make_backend(spec)
    assert "expected one of" in str(e.value)


def test_constructors_validate() -> None:
    with pytest.raises(ValueError, match="base_url"):
        WarHttpBackend("x", "127.0.0.1:8000")
    with pytest.raises(ValueError, match="base_url"):
        WarHttpBackend("x", "http://[::1")
    with pytest.raises(ValueError, match="name"):
        WarHttpBackend("", "http://127.0.0.1:8000")
    with pytest.raises(ValueError, match="timeout_s"):
        WarHttpBackend("x", "http://127.0.0.1:8000", timeout_s=0)
    with pytest.raises(ValueError, match="server"):
        OpenAICompatBackend("x", "http://127.0.0.1:8000", "m", server="tgi")
    with pytest.raises(ValueError, match="fail_after_n"):
        SimulatedBackend("x", fail_after_n=-1)


# ---------------------------------------------------------------- Ray


def test_ray_missing_gives_install_advice(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "ray", None)  # as if Ray were not installed
    with pytest.raises(ImportError, match=r"war-rollout\[ray\]") as e:
        import_ray()
    assert str(e.value) == RAY_MISSING
    with pytest.raises(ImportError, match="Ray is not installed"):
        RayEngineBackend("r", object())


@pytest.mark.slow
def test_ray_actors_generate_concurrently_and_death_is_unavailable(tmp_path: Path) -> None:
    ray = pytest.importorskip("ray")
    from war.backends import start_ray_replica

    model_dir = tmp_path / "tiny"
    save_model(init_random(ModelConfig.from_dict(TINY), seed=0, dtype=torch.float32), model_dir)
    expected = Engine.from_pretrained(model_dir, ENGINE_CONFIG).generate(
        [req("ref-0", (5, 6, 7)), req("ref-1", (8, 9))])

    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    backends: list[RayEngineBackend] = []
    try:
        backends = [start_ray_replica(model_dir, ENGINE_CONFIG, name=f"ray-{i}", num_cpus=1,
                                      timeout_s=60) for i in range(2)]

        async def go() -> None:
            await asyncio.gather(*(b.wait_ready(60) for b in backends))
            assert all([await b.health() for b in backends])
            prompts = [(5, 6, 7), (8, 9)]
            results = await asyncio.gather(*(
                b.generate(req(f"{b.name}-{j}", prompts[j]))
                for b in backends for j in range(2)))
            for k, result in enumerate(results):
                assert result.output_ids == expected[k % 2].output_ids
                assert result.logprobs == pytest.approx(expected[k % 2].logprobs, abs=1e-5)
            load = await backends[0].load()
            assert (load.kv_blocks_total, load.block_size) == (64, 8)
            await backends[0].add_history([((1, 2, 3), "g")])
            with pytest.raises(UnknownTrajectory):
                await backends[0].generate(req("u", trajectory_id="none", continues=True))
            with pytest.raises(ValueError, match="outside the vocabulary"):
                await backends[0].generate(req("v", (VOCAB + 2,)))

            ray.kill(backends[0].actor)
            with pytest.raises(ReplicaUnavailable):
                await backends[0].generate(req("after-kill"))
            assert not await backends[0].health()
            with pytest.raises(ReplicaUnavailable):
                await backends[0].load()
            survivor = await backends[1].generate(req("survivor", (5, 6, 7)))
            assert survivor.output_ids == expected[0].output_ids

        run(go(), timeout_s=90)
    finally:
        async def close_all() -> None:
            for b in backends:
                await b.close()

        with contextlib.suppress(Exception):
            run(close_all(), timeout_s=20)
        ray.shutdown()


# ---------------------------------------------------------------- ended trajectories


def test_router_tells_the_replica_that_a_trajectory_ended() -> None:
    """The router sends ``finish_trajectory`` to the replica that served the last turn
    (in process and over HTTP), which frees the KV it held for a next turn."""
    from war.router.policies import make_policy
    from war.router.router import Router

    cfg = EngineConfig(num_kv_blocks=64, block_size=8, max_num_batched_tokens=256,
                       kv_hold_s=60.0)
    engines = [AsyncEngine(tiny_engine(cfg)), AsyncEngine(tiny_engine(cfg))]
    for ae in engines:
        ae.start()
    local = InProcessBackend("local", engines[0])
    remote = asgi_backend(create_app(engines[1], model_name="tiny"))
    remote.name = "remote"

    async def held(i: int) -> int:
        return await engines[i].call(lambda e: e.scheduler.num_held)  # type: ignore[attr-defined]

    async def go() -> None:
        for backend, i in ((local, 0), (remote, 1)):
            router = Router([backend], make_policy("round_robin"))
            await router.generate(req(f"t{i}", (5, 6, 7, 8, 9, 10, 11, 12, 13),
                                      trajectory_id=f"traj{i}"))
            assert await held(i) == 1
            assert router.finish_trajectory(f"traj{i}")
            for _ in range(200):  # the release is sent in the background
                if await held(i) == 0:
                    break
                await asyncio.sleep(0.01)
            assert await held(i) == 0 and router.stats.trajectories_released == 1
            # unknown or repeated: nothing held, nothing sent
            assert not router.finish_trajectory(f"traj{i}")
            assert await backend.finish_trajectory("nobody") is False
        with pytest.raises(ValueError, match="trajectory_id"):
            await remote.finish_trajectory("")
        for ae in engines:
            await ae.close()

    run(go())


def test_finish_endpoint_refuses_bad_bodies(async_engine: AsyncEngine) -> None:
    app = create_app(async_engine, model_name="tiny")

    async def go() -> None:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app),
                                     base_url="http://replica") as client:
            for body in ({}, {"trajectory_id": ""}, {"trajectory_id": 3},
                         {"trajectory_id": "t", "extra": 1}):
                r = await client.post("/v1/trajectories/finish", json=body)
                assert r.status_code in (400, 422), (body, r.status_code)
            r = await client.post("/v1/trajectories/finish", json={"trajectory_id": "t"})
            assert r.status_code == 200 and r.json() == {"trajectory_id": "t", "held": False}

    run(go())


@pytest.mark.parametrize(("ids", "expected"), [
    ([5, 6, 7], (5, 6, 7)),  # plain ints: taken as they are
    ([5.0, 6, 7], (5, 6, 7)),  # numbers of another type: converted one by one
    ([], ()),
])
def test_sglang_answer_parsed(ids: list[Any], expected: tuple[int, ...]) -> None:
    request = GenRequest("r", (1, 2), SamplingParams(max_tokens=4, logprobs=False))
    data = {"text": "", "output_ids": ids, "meta_info": {
        "prompt_tokens": 2, "cached_tokens": 1, "finish_reason": {"type": "length"}}}
    result = parse_sglang_generate(request, data, 0.25)
    assert result.output_ids == expected
    assert all(type(t) is int for t in result.output_ids)
    assert (result.request_id, result.finish_reason, result.num_prompt_tokens,
            result.num_cached_tokens, result.total_s, result.logprobs) == (
        "r", "length", 2, 1, 0.25, ())
    assert (result.num_forward_passes, result.num_draft_tokens, result.num_accepted_tokens,
            result.num_preemptions, result.weight_version, result.queue_s) == (0, 0, 0, 0, 0, 0.0)
    # a finish reason given as a bare string, and a batch answer of one
    plain = parse_sglang_generate(request, [{**data, "meta_info": {"finish_reason": "stop"}}])
    assert (plain.finish_reason, plain.num_prompt_tokens, plain.num_cached_tokens) == ("stop", 2, 0)

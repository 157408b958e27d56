"""The replica's HTTP API on a tiny random model: completions with token ids and
text, logprobs, several prompts, bad requests (4xx, and the server keeps
serving), auth, side endpoints, and ``war serve`` as a subprocess."""

from __future__ import annotations

import asyncio
import contextlib
import os
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import httpx
import pytest
import torch
from fastapi.testclient import TestClient
from starlette.datastructures import Headers
from test_async_engine import FakeEngine, req
from tokenizers import Tokenizer, models, pre_tokenizers

from war.api import ClientDisconnected, CompletionRequest, unless_disconnected
from war.cli.main import main as war_main
from war.engine.async_engine import AsyncEngine
from war.engine.config import EngineConfig
from war.engine.engine import Engine
from war.engine.loader import init_random, save_model
from war.engine.model_config import ModelConfig
from war.engine.server import _Completions, create_app
from war.engine.stats import EngineStats
from war.types import GenRequest, GenResult, ReplicaLoad, SamplingParams

VOCAB = 64
MAX_LEN = 96
TINY = {
    "model_type": "llama", "vocab_size": VOCAB, "hidden_size": 32, "intermediate_size": 64,
    "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
    "max_position_embeddings": MAX_LEN, "rms_norm_eps": 1e-6, "rope_theta": 10000.0,
    "tie_word_embeddings": False, "eos_token_id": 1,
}
KEY = "sekrit-key"


def tiny_engine(tokenizer: Tokenizer | None = None) -> Engine:
    model = init_random(ModelConfig.from_dict(TINY), seed=0, dtype=torch.float32)
    cfg = EngineConfig(num_kv_blocks=64, block_size=8, max_num_batched_tokens=256)
    return Engine(model, cfg, tokenizer=tokenizer)


def word_tokenizer() -> Tokenizer:
    tok = Tokenizer(models.WordLevel({f"w{i}": i for i in range(VOCAB)}, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    return tok


@pytest.fixture(scope="module")
def async_engine() -> Iterator[AsyncEngine]:
    ae = AsyncEngine(tiny_engine())
    ae.start()
    yield ae
    asyncio.run(ae.close())


@pytest.fixture(scope="module")
def client(async_engine: AsyncEngine) -> Iterator[TestClient]:
    with TestClient(create_app(async_engine, model_name="tiny")) as c:
        yield c


def complete(client: TestClient, **body: Any) -> httpx.Response:
    body.setdefault("model", "tiny")
    return client.post("/v1/completions", json=body)


def test_completion_with_token_ids_and_logprobs(client: TestClient) -> None:
    r = complete(client, prompt=[5, 6, 7, 8], max_tokens=6, temperature=0.0, logprobs=1,
                 ignore_eos=True, request_id="req-1", trajectory_id="t", group_id="g")
    assert r.status_code == 200, r.text
    out = r.json()
    assert out["id"] == "req-1" and out["object"] == "text_completion" and out["model"] == "tiny"
    (choice,) = out["choices"]
    assert choice["index"] == 0 and choice["finish_reason"] == "length"
    assert choice["text"] == "" and len(choice["token_ids"]) == 6
    assert all(0 <= t < VOCAB for t in choice["token_ids"])
    lp = choice["logprobs"]
    assert len(lp["tokens"]) == len(lp["token_logprobs"]) == 6
    assert all(x <= 0.0 for x in lp["token_logprobs"])
    assert lp["tokens"][0] == f"token_id:{choice['token_ids'][0]}"
    usage = out["usage"]
    assert usage == {"prompt_tokens": 4, "completion_tokens": 6, "total_tokens": 10,
                     "prompt_tokens_details": {"cached_tokens": usage["prompt_tokens_details"][
                         "cached_tokens"]}}
    war = out["war"]
    assert set(war) == {"forward_passes", "draft_tokens", "accepted_tokens", "preemptions",
                        "weight_version", "queue_s", "total_s"}
    assert war["forward_passes"] >= 1 and war["total_s"] >= war["queue_s"] >= 0

    # Greedy is deterministic; a stop token cuts the output right after it.
    again = complete(client, prompt=[5, 6, 7, 8], max_tokens=6, temperature=0.0,
                     ignore_eos=True).json()["choices"][0]
    assert again["token_ids"] == choice["token_ids"] and again["logprobs"] is None
    stop_at = choice["token_ids"][2]
    cut = complete(client, prompt=[5, 6, 7, 8], max_tokens=6, temperature=0.0,
                   ignore_eos=True, stop_token_ids=[stop_at]).json()["choices"][0]
    first = choice["token_ids"].index(stop_at)
    assert cut["token_ids"] == choice["token_ids"][: first + 1]
    assert cut["finish_reason"] == "stop"


def test_several_prompts_give_several_choices(client: TestClient) -> None:
    r = complete(client, prompt=[[3, 4], [9, 10, 11], [12]], max_tokens=3, logprobs=0, seed=7,
                 ignore_eos=True, top_k=5, top_p=0.9, temperature=0.8)
    assert r.status_code == 200, r.text
    out = r.json()
    assert [c["index"] for c in out["choices"]] == [0, 1, 2]
    assert all(len(c["token_ids"]) == 3 == len(c["logprobs"]["token_logprobs"])
               for c in out["choices"])
    assert out["usage"]["prompt_tokens"] == 6 and out["usage"]["completion_tokens"] == 9
    assert out["id"].startswith("cmpl-")


@pytest.mark.parametrize(("body", "status", "needle"), [
    ({"prompt": [5, VOCAB]}, 400, "outside the vocabulary"),
    ({"prompt": [5, -1]}, 400, "outside the vocabulary"),
    ({"prompt": [5, 6], "max_tokens": MAX_LEN}, 400, "context length"),
    ({"prompt": [5], "max_tokens": -3}, 400, "max_tokens"),
    ({"prompt": [5], "max_tokens": 0}, 400, "max_tokens"),
    ({"prompt": [5], "max_tokens": "4"}, 400, "max_tokens"),
    ({"prompt": [5], "temperature": -0.5}, 400, "temperature"),
    ({"prompt": [5], "top_p": 0.0}, 400, "top_p"),
    ({"prompt": [5], "top_k": -2}, 400, "top_k"),
    ({"prompt": [5], "logprobs": -1}, 400, "logprobs"),
    ({"prompt": []}, 400, "empty"),
    ({"prompt": [[1, 2], []]}, 400, "empty"),
    ({"prompt": [5], "frequency_penalty": 0.5}, 400, "frequency_penalty=0.5 is not supported"),
    ({"prompt": [5], "min_tokens": 2}, 400, "unknown field 'min_tokens'"),
    ({"prompt": "hello"}, 400, "tokenizer"),
    ({"prompt": [5], "stop": ["x"]}, 400, "tokenizer"),
    ({"prompt": [1.5, 2]}, 400, "prompt must be token ids"),
    ({"prompt": [True, 2]}, 400, "prompt must be token ids"),
    ({"prompt": 5}, 400, "got int"),
    ({"prompt": [[1, 2], [3, "a"]]}, 400, "prompt[1]: token ids must be ints"),
    ({"prompt": [[1, None]]}, 400, "prompt[0]: token ids must be ints, got None"),
    ({"prompt": [[1, 2], [None, 3]]}, 400, "prompt[1]: token ids must be ints, got None"),
    ({"prompt": [[1], [2]], "trajectory_id": "tr"}, 400, "takes one prompt, got 2"),
    ({"prompt": [5], "n": 2}, 400, "n must be 1"),
    ({"prompt": [5], "stream": True}, 400, "stream"),
    ({"prompt": [5], "echo": True}, 400, "echo"),
    ({"prompt": [5], "stop_token_ids": [VOCAB + 1]}, 400, "stop token"),
    ({"prompt": [5], "model": "other"}, 404, "does not exist"),
    ({}, 400, "prompt"),
])
def test_bad_requests_get_4xx_and_the_server_keeps_serving(
    client: TestClient, body: dict[str, Any], status: int, needle: str
) -> None:
    body.setdefault("model", "tiny")
    r = client.post("/v1/completions", json=body)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert needle in err["message"] and err["type"]
    ok = complete(client, prompt=[5, 6], max_tokens=2, ignore_eos=True)
    assert ok.status_code == 200 and len(ok.json()["choices"][0]["token_ids"]) == 2


def test_malformed_json_and_unknown_routes(client: TestClient) -> None:
    r = client.post("/v1/completions", content=b"{not json",
                    headers={"content-type": "application/json"})
    assert r.status_code == 400 and "invalid request" in r.json()["error"]["message"]
    r = client.get("/v1/nothing")
    assert r.status_code == 404 and r.json()["error"]["type"] == "not_found_error"


def test_headers_carry_war_fields(client: TestClient) -> None:
    r = client.post("/v1/completions", json={"prompt": [5, 6], "max_tokens": 2},
                    headers={"X-Request-Id": "hdr-1", "X-Trajectory-Id": "traj",
                             "X-Group-Id": "grp", "X-Priority": "2.5"})
    assert r.status_code == 200 and r.json()["id"] == "hdr-1"
    r = client.post("/v1/completions", json={"prompt": [5]}, headers={"X-Priority": "high"})
    assert r.status_code == 400 and "X-Priority" in r.json()["error"]["message"]


def test_build_adds_eos_unless_ignored(async_engine: AsyncEngine) -> None:
    comp = _Completions(async_engine, "tiny")
    _, (req,) = comp.build(CompletionRequest(prompt=[3], stop_token_ids=[9]), Headers())
    assert req.sampling.stop_token_ids == (9, 1)
    assert req.sampling.max_tokens == 16 and req.sampling.temperature == 1.0
    assert req.sampling.top_k == 0 and not req.sampling.logprobs
    _, (req,) = comp.build(CompletionRequest(prompt=[3], ignore_eos=True, max_tokens=None,
                                             logprobs=True), Headers())
    assert req.sampling.stop_token_ids == () and req.sampling.max_tokens == MAX_LEN - 1
    assert req.sampling.logprobs


def test_side_endpoints(client: TestClient) -> None:
    h = client.get("/health")
    assert h.status_code == 200 and h.json() == {"status": "ok", "weight_version": 0}
    m = client.get("/v1/models").json()
    assert m["data"][0]["id"] == "tiny" and m["data"][0]["max_model_len"] == MAX_LEN
    load = client.get("/v1/load").json()
    assert load["kv_blocks_total"] == 64 and load["block_size"] == 8
    assert {"num_running", "num_waiting", "tokens_in_flight", "kv_blocks_used",
            "spec_tokens_per_seq", "weight_version", "kv_free_tokens"} <= set(load)

    r = client.post("/v1/history", json={"token_ids": [5, 6, 7, 5, 6, 7], "group_id": "g"})
    assert r.status_code == 200 and r.json()["num_tokens"] == 6
    r = client.post("/v1/history", json={"items": [{"token_ids": [1, 2]},
                                                   {"token_ids": [3], "group_id": "g"}]})
    assert r.status_code == 200 and r.json()["num_items"] == 2
    for bad in ({}, {"token_ids": [1], "items": []}, {"token_ids": [VOCAB]},
                {"token_ids": []}, {"items": [{"token_ids": [1], "extra": 1}]},
                {"items": [{"token_ids": [1]}], "group_id": "g"}):
        r = client.post("/v1/history", json=bad)
        assert r.status_code == 400, (bad, r.text)
        assert r.json()["error"]["message"]

    text = client.get("/metrics").text
    for name in ("war_generated_tokens_total", "war_tokens_per_step",
                 "war_spec_acceptance_rate", "war_spec_draft_budget_tokens",
                 "war_prefix_cache_hit_rate", "war_step_seconds_total", "war_preemptions_total",
                 "war_running_sequences", "war_waiting_sequences", "war_kv_blocks_used",
                 "war_kv_blocks_total", "war_weight_version", "war_http_requests_total"):
        assert f"\n{name} " in text or f"\n{name}{{" in text, name


def test_text_prompts_with_a_tokenizer() -> None:
    ae = AsyncEngine(tiny_engine(word_tokenizer()))
    try:
        with TestClient(create_app(ae)) as c:
            r = c.post("/v1/completions", json={
                "model": "war", "prompt": "w5 w6 w7", "max_tokens": 4, "ignore_eos": True,
                "temperature": 0.0, "logprobs": 1, "stop": "never-seen"})
            assert r.status_code == 200, r.text
            choice = r.json()["choices"][0]
            assert r.json()["usage"]["prompt_tokens"] == 3
            assert choice["text"] == " ".join(f"w{t}" for t in choice["token_ids"])
            assert choice["logprobs"]["tokens"] == [f"w{t}" for t in choice["token_ids"]]
            same = c.post("/v1/completions", json={"prompt": [5, 6, 7], "max_tokens": 4,
                                                   "ignore_eos": True, "temperature": 0.0})
            assert same.json()["choices"][0]["token_ids"] == choice["token_ids"]
            two = c.post("/v1/completions", json={"prompt": ["w1 w2", "w3"], "max_tokens": 1})
            assert len(two.json()["choices"]) == 2
    finally:
        asyncio.run(ae.close())


def test_api_key_is_required_except_for_health(async_engine: AsyncEngine) -> None:
    with TestClient(create_app(async_engine, model_name="tiny", api_key=KEY)) as c:
        body = {"prompt": [5, 6], "max_tokens": 1}
        assert c.get("/health").status_code == 200
        for path in ("/v1/models", "/v1/load", "/metrics"):
            r = c.get(path)
            assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
        assert c.post("/v1/completions", json=body).status_code == 401
        bad = {"Authorization": "Bearer nope"}
        assert c.post("/v1/completions", json=body, headers=bad).status_code == 401
        basic = {"Authorization": f"Basic {KEY}"}
        assert c.post("/v1/completions", json=body, headers=basic).status_code == 401
        good = {"Authorization": f"Bearer {KEY}"}
        assert c.post("/v1/completions", json=body, headers=good).status_code == 200
        assert c.get("/metrics", headers=good).status_code == 200


class _FailingEngine:
    """Refuses nothing, but every step raises."""

    def __init__(self) -> None:
        self.model_config = SimpleNamespace(vocab_size=10, eos_token_id=())
        self.tokenizer = None
        self.max_model_len = 50
        self.weight_version = 0
        self.stats = EngineStats()
        self._ids: list[str] = []

    def add_request(self, request: Any) -> None:
        self._ids.append(request.request_id)

    def abort(self, request_id: str) -> GenResult | None:
        self._ids.remove(request_id)
        return None

    def step(self) -> list[GenResult]:
        raise RuntimeError("kernel exploded")

    def has_unfinished(self) -> bool:
        return bool(self._ids)

    def finish_trajectory(self, trajectory_id: str) -> bool:
        return False

    def wait_s(self) -> float | None:
        return None

    def load(self) -> ReplicaLoad:
        return ReplicaLoad(len(self._ids), 0, 0, 0, 1, 16)


def test_engine_failure_is_a_500_and_closed_engine_a_503() -> None:
    ae = AsyncEngine(_FailingEngine())  # type: ignore[arg-type]
    with TestClient(create_app(ae)) as c:
        r = c.post("/v1/completions", json={"prompt": [1, 2]})
        assert r.status_code == 500 and "kernel exploded" in r.json()["error"]["message"]
        asyncio.run(ae.close())
        r = c.post("/v1/completions", json={"prompt": [1, 2]})
        assert r.status_code == 503
        assert c.get("/health").status_code == 503


def test_client_hang_up_aborts_the_request() -> None:
    fake = FakeEngine(step_s=0.001)

    class HangingUp:
        async def receive(self) -> dict[str, str]:
            await asyncio.sleep(0.05)
            return {"type": "http.disconnect"}

    async def main() -> None:
        async with AsyncEngine(fake) as ae:  # type: ignore[arg-type]
            with pytest.raises(ClientDisconnected):
                await asyncio.wait_for(
                    unless_disconnected(HangingUp(), ae.generate(req("gone", 10**9))),  # type: ignore[arg-type]
                    10.0)
            for _ in range(1000):
                if ("abort", "gone") in fake.calls:
                    break
                await asyncio.sleep(0.01)
            assert ("abort", "gone") in fake.calls and not fake.has_unfinished()

    asyncio.run(main())


def test_serve_reports_a_missing_model_folder(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert war_main(["serve", "--model", str(tmp_path / "nope")]) == 2
    assert "model folder not found" in capsys.readouterr().err
    (tmp_path / "file").write_text("x")
    assert war_main(["serve", "--model", str(tmp_path / "file")]) == 2
    assert "file is not a folder (--model takes" in capsys.readouterr().err


def test_serve_reports_an_unusable_device(capsys: pytest.CaptureFixture[str]) -> None:
    """One error line (a traceback from inside torch before); the port is free again."""
    from war import data

    assert war_main(["serve", "--model", str(data.policy_path()), "--port", "0",
                     "--device", "foo"]) != 0
    err = capsys.readouterr().err
    assert err.startswith("war: error: device 'foo' is not a torch device")
    assert "Traceback" not in err


def test_serve_reports_a_taken_port_before_loading_the_model(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """One error line and status 1, before the model is read (uvicorn logged the bind
    error and exited with its own status 3, after the model had loaded)."""
    folder = tmp_path / "tiny"
    save_model(init_random(ModelConfig.from_dict(TINY), seed=0), folder)
    (folder / "model.safetensors").write_bytes(b"not weights")  # loading it would fail
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        assert war_main(["serve", "--model", str(folder), "--port", str(port)]) == 1
    err = capsys.readouterr().err
    assert err.startswith(f"war: error: cannot serve on 127.0.0.1:{port}: "), err
    assert err.count("\n") == 1 and "Traceback" not in err


def test_bind_socket_binds_names_and_addresses() -> None:
    from war.cli.serve import bind_socket

    for host in ("127.0.0.1", "localhost"):
        with bind_socket(host, 0) as sock:
            assert sock.getsockname()[1] > 0
    with pytest.raises(OSError):
        bind_socket("256.1.1.1", 0)


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.mark.slow
def test_war_serve_subprocess(tmp_path: Path) -> None:
    folder = tmp_path / "tiny"
    save_model(init_random(ModelConfig.from_dict(TINY), seed=0), folder)
    port = _free_port()
    env = {**os.environ, "WAR_API_KEY": KEY}
    proc = subprocess.Popen(
        [sys.executable, "-m", "war.cli.main", "serve", "--model", str(folder),
         "--port", str(port), "--kv-cache-mb", "4", "--log-level", "warning",
         "--kv-hold-s", "5", "--admit-whole-prompt"],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 30.0
        while True:
            assert proc.poll() is None, proc.communicate()[0].decode(errors="replace")
            try:
                if httpx.get(f"{base}/health", timeout=1.0).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert time.monotonic() < deadline, "war serve did not become healthy in 30 s"
            time.sleep(0.2)
        headers = {"Authorization": f"Bearer {KEY}"}
        assert httpx.post(f"{base}/v1/completions", json={"prompt": [1, 2]},
                          timeout=5.0).status_code == 401
        r = httpx.post(f"{base}/v1/completions", headers=headers, timeout=30.0,
                       json={"model": "war", "prompt": [5, 6, 7], "max_tokens": 4,
                             "ignore_eos": True, "logprobs": 1})
        assert r.status_code == 200, r.text
        assert len(r.json()["choices"][0]["logprobs"]["token_logprobs"]) == 4
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=10)
        if proc.stdout is not None:
            proc.stdout.close()
    assert proc.returncode is not None


def test_weight_update_and_rl_step_endpoints(tmp_path: Path) -> None:
    ae = AsyncEngine(tiny_engine())
    ae.start()
    try:
        with TestClient(create_app(ae, model_name="tiny")) as c:
            before = complete(c, prompt=[3, 4, 5], max_tokens=6, temperature=0.0).json()
            other = init_random(ModelConfig.from_dict(TINY), seed=7, dtype=torch.float32)
            save_model(other, tmp_path / "new")
            r = c.post("/v1/weights", json={"path": str(tmp_path / "new")})
            assert r.status_code == 200 and r.json()["weight_version"] == 1
            after = complete(c, prompt=[3, 4, 5], max_tokens=6, temperature=0.0).json()
            assert after["war"]["weight_version"] == 1
            assert after["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
            ref = Engine(other, EngineConfig(num_kv_blocks=64, block_size=8))
            want = ref.generate([GenRequest("x", (3, 4, 5),
                                            SamplingParams(temperature=0.0, max_tokens=6,
                                                           stop_token_ids=(1,)))])[0]
            assert after["choices"][0]["token_ids"] == list(want.output_ids)
            assert before["war"]["weight_version"] == 0
            bad = c.post("/v1/weights", json={"path": str(tmp_path / "missing")})
            assert bad.status_code == 400 and "missing" in bad.json()["error"]["message"]
            assert c.get("/health").json()["weight_version"] == 1
            assert c.post("/v1/rl_step", json={"rl_step": 3}).status_code == 200
            back = c.post("/v1/rl_step", json={"rl_step": 2})
            assert back.status_code == 400 and "backwards" in back.json()["error"]["message"]
            assert c.post("/v1/rl_step", json={"rl_step": -1}).status_code == 400
            assert c.post("/v1/weights", json={"path": 5}).status_code == 400
    finally:
        asyncio.run(ae.close())


def test_weights_that_do_not_load_are_a_400_and_change_nothing(tmp_path: Path) -> None:
    engine = tiny_engine()
    before = {k: v.clone() for k, v in engine.model.state_dict().items()}
    good = tmp_path / "good"
    save_model(init_random(ModelConfig.from_dict(TINY), seed=7, dtype=torch.float32), good)
    corrupt, index = tmp_path / "corrupt", tmp_path / "index"
    for folder in (corrupt, index):
        folder.mkdir()
        (folder / "config.json").write_text((good / "config.json").read_text())
    (corrupt / "model.safetensors").write_bytes(b"\x10" + b"\x00" * 7 + b"garbage!")
    (index / "model.safetensors.index.json").write_text('{"weight_map": {"a": 5}}')
    ae = AsyncEngine(engine)
    try:
        with TestClient(create_app(ae, model_name="tiny")) as c:
            for folder, needle in ((corrupt, "not a valid safetensors file"),
                                   (index, "must be a file name")):
                r = c.post("/v1/weights", json={"path": str(folder)})
                assert r.status_code == 400 and needle in r.json()["error"]["message"]
            assert c.get("/health").json()["weight_version"] == 0
            assert complete(c, prompt=[3, 4], max_tokens=2).status_code == 200
    finally:
        asyncio.run(ae.close())
    after = engine.model.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)


def test_continuing_a_trajectory_over_http(client: TestClient) -> None:
    first = complete(client, prompt=[3, 4, 5, 6], max_tokens=4, temperature=0.0,
                     trajectory_id="conv", ignore_eos=True).json()
    ids = first["choices"][0]["token_ids"]
    cont = complete(client, prompt=[7, 8], max_tokens=4, temperature=0.0,
                    trajectory_id="conv", continues=True, ignore_eos=True).json()
    assert cont["usage"]["prompt_tokens"] == 4 + len(ids) + 2
    full = complete(client, prompt=[3, 4, 5, 6, *ids, 7, 8], max_tokens=4, temperature=0.0,
                    ignore_eos=True).json()
    assert cont["choices"][0]["token_ids"] == full["choices"][0]["token_ids"]
    missing = complete(client, prompt=[7, 8], max_tokens=4, trajectory_id="nope",
                       continues=True)
    assert missing.status_code == 409
    assert missing.json()["error"]["code"] == "unknown_trajectory"


def test_continuing_with_the_rest_of_the_context_as_max_tokens(client: TestClient) -> None:
    first = complete(client, prompt=[3, 4, 5, 6], max_tokens=4, temperature=0.0,
                     trajectory_id="rest", ignore_eos=True)
    assert first.status_code == 200, first.text
    # max_tokens null: what the context length leaves after the held 8 tokens + 2 new.
    cont = complete(client, prompt=[7, 8], max_tokens=None, temperature=0.0,
                    trajectory_id="rest", continues=True, ignore_eos=True)
    assert cont.status_code == 200, cont.text
    usage = cont.json()["usage"]
    assert usage["prompt_tokens"] == 10 and usage["completion_tokens"] == MAX_LEN - 10
    full = complete(client, prompt=[9], max_tokens=None, trajectory_id="rest",
                    continues=True)
    assert full.status_code == 400 and "leaves no room" in full.json()["error"]["message"]
    unknown = complete(client, prompt=[9], max_tokens=None, trajectory_id="rest-nope",
                       continues=True)
    assert unknown.status_code == 409


def test_a_refused_turn_of_several_prompts_leaves_the_trajectory(client: TestClient) -> None:
    first = complete(client, prompt=[3, 4, 5], max_tokens=4, temperature=0.0,
                     trajectory_id="two", ignore_eos=True)
    assert first.status_code == 200
    bad = complete(client, prompt=[[8, 9], [10]], max_tokens=4, temperature=0.0,
                   trajectory_id="two", continues=True)
    assert bad.status_code == 400 and "one prompt" in bad.json()["error"]["message"]
    good = complete(client, prompt=[8, 9], max_tokens=4, temperature=0.0,
                    trajectory_id="two", continues=True, ignore_eos=True)
    assert good.status_code == 200, good.text
    assert good.json()["usage"]["prompt_tokens"] == 3 + 4 + 2


def test_a_dead_engine_thread_is_a_503() -> None:
    ae = AsyncEngine(FakeEngine())  # type: ignore[arg-type]

    def broken() -> None:  # a bug in the thread's own loop, not in a step
        raise RuntimeError("loop bug")

    async def kill() -> None:  # bounded: the command is answered even as the thread dies
        await asyncio.wait_for(ae.add_history([1], None), 10.0)

    with TestClient(create_app(ae)) as c:
        assert c.post("/v1/completions", json={"prompt": [1, 2]}).status_code == 200
        ae._snapshot = broken  # type: ignore[method-assign]
        asyncio.run(kill())
        assert not ae.is_running
        r = c.post("/v1/completions", json={"prompt": [1, 2]})
        assert r.status_code == 503 and "engine thread failed" in r.json()["error"]["message"]
        assert c.post("/v1/history", json={"token_ids": [1]}).status_code == 503
        assert c.get("/health").status_code == 503
    asyncio.run(ae.close())


def test_unless_hung_up_leaves_the_callers_own_cancellation_alone() -> None:
    from war.api import unless_hung_up

    async def never_hangs_up() -> dict[str, str]:
        await asyncio.sleep(3600)
        return {"type": "http.disconnect"}

    async def main() -> None:
        # the work finishes: its value comes back, the watcher is gone
        assert await unless_hung_up(never_hangs_up, asyncio.sleep(0.01, "done")) == "done"
        # the caller cancels: CancelledError, not ClientDisconnected
        task = asyncio.ensure_future(unless_hung_up(never_hangs_up, asyncio.sleep(3600)))
        await asyncio.sleep(0.01)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(main())


def test_war_aio_runs_on_uvloop_and_falls_back(monkeypatch: pytest.MonkeyPatch) -> None:
    import builtins

    from war import aio

    async def loop_name() -> str:
        return type(asyncio.get_running_loop()).__module__

    assert aio.run(loop_name()).startswith("uvloop")
    real_import = builtins.__import__

    def no_uvloop(name: str, *args: object, **kw: object) -> object:
        if name == "uvloop":
            raise ImportError("no uvloop here")
        return real_import(name, *args, **kw)  # type: ignore[arg-type]

    monkeypatch.setattr(builtins, "__import__", no_uvloop)
    assert aio.loop_factory() is None
    assert aio.run(loop_name()).startswith("asyncio")


@pytest.mark.parametrize(("raw", "field"), [
    (r'{"prompt": [5], "request_id": "a\ud800"}', "request_id"),
    (r'{"prompt": [5], "trajectory_id": "\udfff"}', "trajectory_id"),
    (r'{"prompt": [5], "trajectory_id": "\udfff", "continues": true, "max_tokens": null}',
     "trajectory_id"),
    (r'{"prompt": [5], "group_id": "\ud800"}', "group_id"),
])
def test_lone_surrogates_are_a_400_naming_the_field(
        client: TestClient, raw: str, field: str) -> None:
    # Python's JSON parser lets "\ud800" through; it has no UTF-8 form (a 500 before,
    # for request_id after the work was done)
    r = client.post("/v1/completions", content=raw.encode(),
                    headers={"content-type": "application/json"})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == field and "not valid Unicode" in err["message"]
    assert complete(client, prompt=[5, 6], max_tokens=1).status_code == 200


def test_lone_surrogates_in_text_and_side_requests_are_a_400(client: TestClient) -> None:
    raw = {"/v1/history": r'{"items": [{"token_ids": [1, 2], "group_id": "\ud800"}]}',
           "/v1/trajectories/finish": r'{"trajectory_id": "\ud800"}',
           "/v1/weights": r'{"path": "/tmp/\ud800"}'}
    for path, body in raw.items():
        r = client.post(path, content=body.encode(), headers={"content-type": "application/json"})
        assert r.status_code == 400 and "not valid Unicode" in r.json()["error"]["message"], (
            path, r.text)
    ae = AsyncEngine(tiny_engine(word_tokenizer()))
    try:
        with TestClient(create_app(ae)) as c:
            for body in (r'{"prompt": "w5 \udc80"}', r'{"prompt": ["w5", "\ud800"]}',
                         r'{"prompt": [5], "stop": ["\ud800"]}',
                         r'{"prompt": [5], "stop": "\ud800"}'):
                r = c.post("/v1/completions", content=body.encode(),
                           headers={"content-type": "application/json"})
                assert r.status_code == 400, (body, r.text)
                assert "not valid Unicode" in r.json()["error"]["message"]
            ok = c.post("/v1/completions", json={"prompt": "w5 \U0001f600", "max_tokens": 1})
            assert ok.status_code == 200, ok.text
    finally:
        asyncio.run(ae.close())


def test_empty_history_items_and_weights_path_are_refused(client: TestClient) -> None:
    r = client.post("/v1/history", json={"items": []})
    assert r.status_code == 400 and r.json()["error"]["message"] == "items is empty"
    r = client.post("/v1/weights", json={"path": ""})  # would be the working folder
    assert r.status_code == 400 and r.json()["error"]["message"] == "path must not be empty"


@contextlib.contextmanager
def _client_whose_responses_fail() -> Iterator[TestClient]:
    """A server whose completion responses fail to render (the detokenizer raises)."""
    class BadTokenizer:
        def decode(self, ids: list[int]) -> str:
            raise RuntimeError("cannot decode")

    fake = FakeEngine()
    fake.tokenizer = BadTokenizer()  # type: ignore[assignment]
    ae = AsyncEngine(fake)  # type: ignore[arg-type]
    try:
        with TestClient(create_app(ae), raise_server_exceptions=False) as c:
            yield c
    finally:
        asyncio.run(ae.close())


def test_a_response_that_fails_is_counted_as_a_500() -> None:
    with _client_whose_responses_fail() as c:
        assert c.post("/v1/completions", json={"prompt": [1, 2]}).status_code == 500
        text = c.get("/metrics").text
        assert 'war_http_requests_total{status="500"} 1.0' in text, text
        assert 'status="200"' not in text


def test_finite_logprob_maps_what_json_cannot_hold() -> None:
    from war.api import finite_logprob

    assert finite_logprob(float("nan")) is None and finite_logprob(float("inf")) is None
    assert finite_logprob(float("-inf")) == -9999.0 and finite_logprob(-0.5) == -0.5


def test_an_unexpected_error_is_a_500_in_the_error_format() -> None:
    with _client_whose_responses_fail() as c:
        r = c.post("/v1/completions", json={"prompt": [1, 2]})
        assert r.status_code == 500
        assert r.headers["content-type"] == "application/json"  # was text/plain
        err = r.json()["error"]
        assert err["type"] == "server_error" and err["code"] == "internal_error"
        assert c.post("/v1/history", json={"token_ids": [1]}).status_code == 200


def test_a_405_keeps_its_allow_header(client: TestClient) -> None:
    r = client.get("/v1/completions")
    assert r.status_code == 405 and r.headers["allow"] == "POST"
    assert r.json()["error"]["type"] == "invalid_request_error"


def test_a_request_id_already_in_flight_is_a_409() -> None:
    fake = FakeEngine(step_s=0.001)
    ae = AsyncEngine(fake)  # type: ignore[arg-type]
    try:
        with TestClient(create_app(ae)) as c:
            first: dict[str, httpx.Response] = {}

            def send_first() -> None:
                first["r"] = c.post("/v1/completions", json={
                    "prompt": [1], "max_tokens": 300, "request_id": "dup"})

            th = threading.Thread(target=send_first)
            th.start()
            try:
                deadline = time.monotonic() + 10.0
                while "dup" not in fake._left and time.monotonic() < deadline:
                    time.sleep(0.005)
                assert "dup" in fake._left
                for body in ({"prompt": [2], "request_id": "dup"},
                             {"prompt": [3], "max_tokens": 1},):
                    r = c.post("/v1/completions", json=body,
                               headers={"X-Request-Id": "dup"})
                    assert r.status_code == 409, r.text
                    err = r.json()["error"]
                    assert err["code"] == "duplicate_request_id"
                    assert err["param"] == "request_id" and "dup" in err["message"]
            finally:
                th.join(10.0)
            assert first["r"].status_code == 200  # the first one was left alone
            assert len(first["r"].json()["choices"][0]["token_ids"]) == 300
    finally:
        asyncio.run(ae.close())


def test_completion_bodies_refused_before_the_handler_are_counted(
        async_engine: AsyncEngine) -> None:
    with TestClient(create_app(async_engine, model_name="tiny")) as c:
        assert c.post("/v1/completions", json={"prompt": [1], "nope": 1}).status_code == 400
        assert c.post("/v1/completions", content=b"{",
                      headers={"content-type": "application/json"}).status_code == 400
        assert c.get("/v1/completions").status_code == 405  # not a completion request
        text = c.get("/metrics").text
        assert 'war_http_requests_total{status="400"} 2.0' in text, text
        assert 'status="405"' not in text
        assert "war_http_request_seconds_count 0.0" in text


def test_a_body_over_the_limit_is_a_413(async_engine: AsyncEngine) -> None:
    app = create_app(async_engine, model_name="tiny", max_body_bytes=1000)
    big = b'{"prompt": [' + b"1, " * 400 + b'1]}'
    json_type = {"content-type": "application/json"}
    with TestClient(app) as c:
        for content in (big, iter([big[:600], big[600:]])):  # declared, and chunked
            r = c.post("/v1/completions", content=content, headers=json_type)
            assert r.status_code == 413, r.text
            assert "larger than 1000 bytes" in r.json()["error"]["message"]
        r = c.post("/v1/history", content=big.replace(b"prompt", b"token_ids"),
                   headers=json_type)
        assert r.status_code == 413
        small = b'{"prompt": [5, 6], "max_tokens": 1}'
        for content in (small, iter([small[:5], small[5:]])):
            assert c.post("/v1/completions", content=content,
                          headers=json_type).status_code == 200
        assert 'war_http_requests_total{status="413"} 2.0' in c.get("/metrics").text

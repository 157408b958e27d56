"""What an OpenAI client sends to the replica: the OpenAI completion fields WAR does not
implement (accepted at the value that changes nothing, refused otherwise), top-k
logprobs (refused), ``GET /v1/models/{id}``, the chat API (refused, naming what to use
instead), and ``seed`` reproducing a sample, speculating or not."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from fastapi.testclient import TestClient
from test_server import TINY, complete

from war.engine.async_engine import AsyncEngine
from war.engine.config import EngineConfig
from war.engine.engine import Engine
from war.engine.loader import init_random
from war.engine.model_config import ModelConfig
from war.engine.server import create_app
from war.rollout.fingerprint import model_fingerprint


def _engine(spec_mode: str = "auto") -> Engine:
    model = init_random(ModelConfig.from_dict(TINY), seed=0, dtype=torch.float32)
    cfg = EngineConfig(num_kv_blocks=64, block_size=8, max_num_batched_tokens=256,
                       spec_mode=spec_mode)
    return Engine(model, cfg)


@pytest.fixture(scope="module")
def client() -> Iterator[TestClient]:
    ae = AsyncEngine(_engine())
    try:
        with TestClient(create_app(ae, model_name="tiny")) as c:
            yield c
    finally:
        asyncio.run(ae.close())


def _still_serves(client: TestClient) -> None:
    ok = complete(client, prompt=[5, 6], max_tokens=2, ignore_eos=True)
    assert ok.status_code == 200 and len(ok.json()["choices"][0]["token_ids"]) == 2


def test_openai_fields_at_their_neutral_values_are_accepted(client: TestClient) -> None:
    # LangChain's OpenAI LLM sends the penalties (0) on every call, others best_of 1.
    r = complete(client, prompt=[5, 6], max_tokens=3, ignore_eos=True,
                 frequency_penalty=0, presence_penalty=0.0, best_of=1, logit_bias={},
                 suffix=None, stream_options=None, user="u")
    assert r.status_code == 200, r.text
    assert len(r.json()["choices"][0]["token_ids"]) == 3


@pytest.mark.parametrize(("field", "value"), [
    ("frequency_penalty", 0.5), ("presence_penalty", -1.0), ("best_of", 2),
    ("logit_bias", {"5": 100}), ("suffix", "tail"), ("stream_options", {"include_usage": True}),
])
def test_openai_fields_that_would_change_the_output_are_refused(
    client: TestClient, field: str, value: Any
) -> None:
    r = complete(client, prompt=[5, 6], max_tokens=2, **{field: value})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == field and field in err["message"]
    assert err["type"] == "invalid_request_error"
    _still_serves(client)


def test_a_field_openai_does_not_define_is_still_refused(client: TestClient) -> None:
    r = complete(client, prompt=[5], max_tokens=1, repetition_penalty=1.0)
    assert r.status_code == 400
    assert "unknown field 'repetition_penalty'" in r.json()["error"]["message"]


def test_logprobs_asking_for_alternatives_is_refused(client: TestClient) -> None:
    r = complete(client, prompt=[5, 6], max_tokens=2, logprobs=5)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == "logprobs" and "sampled" in err["message"]
    for ok in (0, 1, True):  # the sampled tokens' logprobs
        r = complete(client, prompt=[5, 6], max_tokens=2, ignore_eos=True, logprobs=ok)
        assert r.status_code == 200
        assert len(r.json()["choices"][0]["logprobs"]["token_logprobs"]) == 2


def test_retrieving_a_model(client: TestClient) -> None:
    r = client.get("/v1/models/tiny")
    assert r.status_code == 200, r.text
    card = r.json()
    assert card["id"] == "tiny" and card["object"] == "model" and card["owned_by"] == "war"
    assert card == client.get("/v1/models").json()["data"][0]
    r = client.get("/v1/models/org/other")
    assert r.status_code == 404
    err = r.json()["error"]
    assert err["code"] == "model_not_found" and "'org/other'" in err["message"]


def test_the_chat_api_is_refused_naming_the_completions_api(client: TestClient) -> None:
    r = client.post("/v1/chat/completions", json={
        "model": "tiny", "messages": [{"role": "user", "content": "hi"}]})
    assert r.status_code == 404
    err = r.json()["error"]
    assert err["code"] == "unsupported_endpoint" and "/v1/completions" in err["message"]
    _still_serves(client)


@pytest.mark.parametrize("spec_mode", ["off", "always", "auto"])
def test_a_seed_reproduces_the_sample(spec_mode: str) -> None:
    # (with speculation the drafts differ each time, as the history grows: the tokens
    # do not, war.engine.verify)
    outs = []
    for mode in ("off", spec_mode):
        ae = AsyncEngine(_engine(spec_mode=mode))
        try:
            with TestClient(create_app(ae, model_name="tiny")) as c:
                outs += [complete(c, prompt=[1, 2], max_tokens=8, ignore_eos=True, seed=3,
                                  temperature=1.0).json()["choices"][0]["token_ids"]
                         for _ in range(3)]
        finally:
            asyncio.run(ae.close())
    assert all(o == outs[0] for o in outs) and len(outs[0]) == 8, outs


def test_models_state_the_served_weights_fingerprint(
        tmp_path: Path, random_policy: Path,
        make_random_policy: Callable[[Path, int], Path]) -> None:
    """``/v1/models`` says which weights it samples from (the model folder's content
    fingerprint, then the one of each ``/v1/weights`` folder), so that a rollout run can
    check the servers serve its model; weights loaded past the server have none."""
    ae = AsyncEngine(Engine.from_pretrained(random_policy,
                                            EngineConfig(kv_cache_bytes=4_000_000)))
    other = make_random_policy(tmp_path / "step1", 1)
    try:
        app = create_app(ae, model_name="p", model_folder=random_policy,
                         fingerprint=model_fingerprint)
        with TestClient(app) as c:
            def card() -> dict[str, Any]:
                data: dict[str, Any] = c.get("/v1/models").json()["data"][0]
                return data
            first = card()
            assert first["weights_fingerprint"] == model_fingerprint(random_policy)
            assert first["weights_fingerprint"] is not None
            r = c.post("/v1/weights", json={"path": str(other)})
            assert r.status_code == 200, r.text
            assert r.json()["weights_fingerprint"] == model_fingerprint(other)
            assert card()["weights_fingerprint"] == model_fingerprint(other)
            assert card()["weights_fingerprint"] != first["weights_fingerprint"]
            assert c.get("/v1/models/p").json()["weights_fingerprint"] == model_fingerprint(other)
            bad = c.post("/v1/weights", json={"path": str(tmp_path / "missing")})
            assert bad.status_code == 400  # (nothing changed: the same weights, stated)
            assert card()["weights_fingerprint"] == model_fingerprint(other)
            asyncio.run(ae.load_weights(random_policy))  # (past the server: not known)
            assert card()["weights_fingerprint"] is None
        with TestClient(create_app(ae, model_name="p")) as c:  # (no fingerprint given)
            assert c.get("/v1/models").json()["data"][0]["weights_fingerprint"] is None
    finally:
        asyncio.run(ae.close())

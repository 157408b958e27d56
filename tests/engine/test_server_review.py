"""The completions answer's text around stop strings, as OpenAI clients read it."""

from __future__ import annotations

import asyncio

from fastapi.testclient import TestClient
from test_server import tiny_engine, word_tokenizer

from war.engine.async_engine import AsyncEngine
from war.engine.server import create_app


def test_a_stop_string_is_left_out_of_the_text_but_not_of_the_tokens() -> None:
    ae = AsyncEngine(tiny_engine(word_tokenizer()))
    try:
        with TestClient(create_app(ae)) as c:
            body = {"prompt": [5, 6], "max_tokens": 6, "ignore_eos": True, "temperature": 0.0}
            free = c.post("/v1/completions", json=body).json()["choices"][0]
            ids = free["token_ids"]
            assert len(set(ids[:3])) == 3, ids  # (a greedy path of distinct words)
            stop = f"w{ids[2]}"
            assert stop not in f"w{ids[0]} w{ids[1]}"  # (it first completes at token 3)
            for stops in (stop, [stop], ["never-seen", stop]):
                got = c.post("/v1/completions", json={**body, "stop": stops}).json()
                choice = got["choices"][0]
                assert choice["finish_reason"] == "stop"
                assert choice["token_ids"] == ids[:3]  # (the tokens trained on, all kept)
                assert choice["text"] == f"w{ids[0]} w{ids[1]} "  # (OpenAI: before the stop)
                assert got["usage"]["completion_tokens"] == 3
            # a stop token, or the length limit, leaves the text whole
            by_token = c.post("/v1/completions", json={
                **body, "stop": "never-seen", "stop_token_ids": [ids[2]]}).json()["choices"][0]
            assert by_token["finish_reason"] == "stop"
            assert by_token["text"] == " ".join(f"w{t}" for t in ids[:3])
            capped = c.post("/v1/completions", json={**body, "max_tokens": 2,
                                                     "stop": "never-seen"}).json()["choices"][0]
            assert capped["finish_reason"] == "length"
            assert capped["text"] == f"w{ids[0]} w{ids[1]}"
    finally:
        asyncio.run(ae.close())

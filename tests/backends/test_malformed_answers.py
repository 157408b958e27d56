"""Backends against answers that are malformed in ways that used to pass unseen
(token ids as a string, negative ids, missing logprobs, a finish report of the
wrong type), the simulated replica's cached tokens for a context that is not an
extension of the held one, and replica specs with parts that would be dropped."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable
from typing import Any, TypeVar

import httpx
import pytest
from fastapi import FastAPI
from fastapi.responses import JSONResponse

from war.backends import (
    OpenAICompatBackend,
    ReplicaUnavailable,
    SimulatedBackend,
    WarHttpBackend,
    make_backend,
)
from war.backends.http import parse_completion
from war.backends.openai import parse_sglang_generate, parse_vllm_completion
from war.types import GenRequest, SamplingParams

T = TypeVar("T")

WANTS = SamplingParams(max_tokens=4, logprobs=True)
NO_LP = SamplingParams(max_tokens=4, logprobs=False)


def run(coro: Awaitable[T], timeout_s: float = 10.0) -> T:
    async def bounded() -> T:
        return await asyncio.wait_for(coro, timeout_s)

    return asyncio.run(bounded())


def req(rid: str = "r", prompt: tuple[int, ...] = (1, 2, 3),
        sampling: SamplingParams = WANTS, **kw: Any) -> GenRequest:
    return GenRequest(request_id=rid, prompt_ids=prompt, sampling=sampling, **kw)


def app_answering(path: str, answer: dict[str, Any]) -> FastAPI:
    app = FastAPI()

    @app.post(path)
    async def endpoint() -> JSONResponse:
        return JSONResponse(answer["body"])

    return app


def client_for(app: FastAPI) -> httpx.AsyncClient:
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=app))


# ---------------------------------------------------------------- token ids


@pytest.mark.parametrize("ids", ["12", {"1": 2}, 7, [3, -1]],
                         ids=["string", "object", "number", "negative"])
def test_token_ids_that_are_not_a_list_of_ids_are_refused(ids: Any) -> None:
    # a string's characters ("12" -> 1, 2) or an object's keys used to pass as ids
    war = {"choices": [{"token_ids": ids, "logprobs": None}]}
    with pytest.raises(ValueError, match="token_ids"):
        parse_completion(req(sampling=NO_LP), war)
    with pytest.raises(ValueError, match="token_ids"):
        parse_vllm_completion(req(sampling=NO_LP), war)
    with pytest.raises(ValueError, match="output_ids"):
        parse_sglang_generate(req(sampling=NO_LP), {"output_ids": ids, "meta_info": {}})


def test_well_formed_token_ids_still_parse() -> None:
    war = {"choices": [{"token_ids": [4, 5.0], "finish_reason": "length",
                        "logprobs": {"token_logprobs": [-0.5, None]}}]}
    result = parse_completion(req(), war)
    assert result.output_ids == (4, 5) and all(type(t) is int for t in result.output_ids)
    assert result.logprobs[0] == -0.5 and result.finish_reason == "length"
    vllm = parse_vllm_completion(req(sampling=NO_LP), {"choices": [{"token_ids": []}]})
    assert vllm.output_ids == ()


def test_logprobs_given_as_a_string_are_refused() -> None:
    # "12" has as many characters as the two tokens: it used to pass as (1.0, 2.0)
    answer = {"choices": [{"token_ids": [4, 5], "logprobs": {"token_logprobs": "12",
                                                              "tokens": "ab"}}]}
    with pytest.raises(ValueError, match="token_logprobs"):
        parse_completion(req(), answer)
    with pytest.raises(ValueError, match="token_logprobs"):
        parse_vllm_completion(req(), answer)
    with pytest.raises(ValueError, match="output_token_logprobs"):
        parse_sglang_generate(req(), {"meta_info": {"output_token_logprobs": "ab"}})


def test_war_answer_without_the_logprobs_asked_for_is_unavailable() -> None:
    # the request wants logprobs; an answer without them gave a result with none
    answer: dict[str, Any] = {"body": {"choices": [{"token_ids": [4, 5],
                                                    "finish_reason": "length"}]}}
    backend = WarHttpBackend("w", "http://replica",
                             client=client_for(app_answering("/v1/completions", answer)))

    async def go() -> None:
        with pytest.raises(ReplicaUnavailable, match="logprobs were asked for"):
            await backend.generate(req())
        answer["body"]["choices"][0]["logprobs"] = {"token_logprobs": None}
        with pytest.raises(ReplicaUnavailable, match="logprobs were asked for"):
            await backend.generate(req())
        # not asked for: none needed
        assert (await backend.generate(req(sampling=NO_LP))).output_ids == (4, 5)
        answer["body"]["choices"][0]["token_ids"] = "45"
        with pytest.raises(ReplicaUnavailable, match="malformed completion"):
            await backend.generate(req(sampling=NO_LP))
        await backend.close()

    run(go())


def test_openai_backend_maps_string_token_ids_to_unavailable() -> None:
    answer: dict[str, Any] = {"body": {"choices": [{"token_ids": "45",
                                                    "finish_reason": "length"}]}}
    backend = OpenAICompatBackend("v", "http://replica", "m", use_metrics=False,
                                  client=client_for(app_answering("/v1/completions", answer)))

    async def go() -> None:
        with pytest.raises(ReplicaUnavailable, match="malformed vllm"):
            await backend.generate(req(sampling=NO_LP))
        assert backend.num_in_flight == 0
        await backend.close()

    run(go())


# ---------------------------------------------------------------- finish_trajectory


@pytest.mark.parametrize("body", [{"held": "no"}, {"held": 1}, None, [True]],
                         ids=["string", "number", "null", "array"])
def test_malformed_finish_answer_is_unavailable(body: Any) -> None:
    # {"held": "no"} used to read as held; null or an array as "not held"
    answer = {"body": body}
    backend = WarHttpBackend(
        "w", "http://replica",
        client=client_for(app_answering("/v1/trajectories/finish", answer)))

    async def go() -> None:
        with pytest.raises(ReplicaUnavailable, match="malformed /v1/trajectories/finish"):
            await backend.finish_trajectory("t")
        answer["body"] = {"trajectory_id": "t", "held": True}
        assert await backend.finish_trajectory("t") is True
        answer["body"] = {"trajectory_id": "t"}
        assert await backend.finish_trajectory("t") is False
        await backend.close()

    run(go())


# ---------------------------------------------------------------- simulated replicas


def test_simulated_cached_tokens_are_the_shared_prefix_of_a_whole_context() -> None:
    backend = SimulatedBackend("sim", lambda b, c: 0.0, output_len=lambda r: 2)

    async def go() -> None:
        first = await backend.generate(req("a", (1, 2, 3, 4), NO_LP, trajectory_id="t"))
        held = (1, 2, 3, 4, *first.output_ids)
        # the whole context again, extended: everything held is cached
        again = await backend.generate(req("b", (*held, 9), NO_LP, trajectory_id="t"))
        assert (again.num_prompt_tokens, again.num_cached_tokens) == (7, 6)
        # a whole context that differs after two tokens (the agent rewrote its history)
        other = await backend.generate(req("c", (1, 2, 8), NO_LP, trajectory_id="t"))
        assert (other.num_prompt_tokens, other.num_cached_tokens) == (3, 2)
        # a shorter one: no more cached tokens than the prompt has
        short = await backend.generate(req("d", (1,), NO_LP, trajectory_id="t"))
        assert (short.num_prompt_tokens, short.num_cached_tokens) == (1, 1)
        # a continuing turn still counts all it holds
        cont = await backend.generate(req("e", (5,), NO_LP, trajectory_id="t",
                                          continues=True))
        assert (cont.num_prompt_tokens, cont.num_cached_tokens) == (4, 3)

    run(go())


# ---------------------------------------------------------------- make_backend


@pytest.mark.parametrize("spec", ["sim://a/b", "instant://a/b/"])
def test_make_backend_refuses_a_path_after_a_simulated_name(spec: str) -> None:
    # the path used to be dropped: "sim://a/b" made a replica named "a"
    with pytest.raises(ValueError, match="takes a name and nothing else"):
        make_backend(spec)
    assert make_backend("sim://a/").name == "a"
    assert make_backend("sim:///a").name == "a"

"""SGLang's native ``POST /generate`` on the router: token ids in, SGLang's answer
shape out, routing keys from headers, refusals of what the router cannot honour."""

from __future__ import annotations

from typing import Any

import httpx
import orjson
import pytest
from test_edge import running
from test_router_server import KEY, FirstHealthy, Scripted, make

from war.api import APIError
from war.router.router import Router
from war.router.server import GENERATE_MAX_NEW_TOKENS, create_router_app


def test_one_prompt_has_sglangs_shape() -> None:
    client, router, a, _ = make()
    r = client.post("/generate", json={
        "input_ids": [5, 6, 7, 8], "rid": "q1", "return_logprob": True,
        "sampling_params": {"max_new_tokens": 2, "temperature": 0, "top_k": -1,
                            "skip_special_tokens": False, "stop_token_ids": [9]}},
        headers={"X-Trajectory-Id": "t1", "X-Group-Id": "g1"})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["text"] == "" and body["output_ids"] == [5, 6]
    meta = body["meta_info"]
    assert meta["id"] == "q1" and meta["finish_reason"] == {"type": "length", "length": 2}
    assert (meta["prompt_tokens"], meta["completion_tokens"], meta["cached_tokens"]) == (4, 2, 1)
    assert meta["output_token_logprobs"] == [[-0.5, 5, None], [-0.5, 6, None]]
    assert meta["replica"] == "a" and meta["war"]["forward_passes"] == 2
    sent = a.seen[0]
    assert sent.request_id == "q1" and sent.prompt_ids == (5, 6, 7, 8)
    assert (sent.trajectory_id, sent.group_id) == ("t1", "g1")
    assert sent.sampling.max_tokens == 2 and sent.sampling.temperature == 0
    assert sent.sampling.top_k == 0 and sent.sampling.logprobs
    assert sent.sampling.stop_token_ids == (9, 7)  # the router's eos id is added
    assert router.stats.completed == 1


def test_defaults_batches_and_per_prompt_settings() -> None:
    client, _, a, _ = make()
    r = client.post("/generate", json={"input_ids": [1, 2]})
    assert r.status_code == 200 and "output_token_logprobs" not in r.json()["meta_info"]
    assert a.seen[-1].sampling.max_tokens == GENERATE_MAX_NEW_TOKENS
    assert a.seen[-1].sampling.temperature == 1.0
    r = client.post("/generate", json={
        "input_ids": [[1, 2, 3], [4, 5]], "rid": ["x", "y"],
        "sampling_params": [{"max_new_tokens": 1}, {"max_new_tokens": 2, "ignore_eos": True}]})
    assert r.status_code == 200, r.text
    out = r.json()
    assert isinstance(out, list) and [o["output_ids"] for o in out] == [[1], [4, 5]]
    assert [o["meta_info"]["id"] for o in out] == ["x", "y"]
    assert a.seen[-1].sampling.stop_token_ids == ()  # ignore_eos: no eos added
    r = client.post("/generate", json={"input_ids": [[1], [2]], "rid": "b"})
    assert [o["meta_info"]["id"] for o in r.json()] == ["b-0", "b-1"]
    r = client.post("/generate", json={"input_ids": [[1], [2]]}, headers={"X-Request-Id": "h"})
    assert [o["meta_info"]["id"] for o in r.json()] == ["h-0", "h-1"]
    ids = [o["meta_info"]["id"] for o in client.post("/generate",
                                                      json={"input_ids": [[1], [2]]}).json()]
    assert ids[0].endswith("-0") and ids[1] == ids[0][:-1] + "1"  # one new name, numbered


@pytest.mark.parametrize("body, param", [
    ({"text": "hello"}, "text"),
    ({"input_ids": "hello"}, "input_ids"),
    ({"input_ids": []}, "input_ids"),
    ({"input_ids": [1, -2]}, "input_ids"),
    ({"input_ids": [[1], [2, "x"]]}, "input_ids"),
    ({}, "input_ids"),
    ({"input_ids": [1], "stream": True}, "stream"),
    ({"input_ids": [1], "image_data": "x.png"}, "image_data"),
    ({"input_ids": [1], "top_logprobs_num": 5}, "top_logprobs_num"),
    ({"input_ids": [1], "return_logprob": "yes"}, "return_logprob"),
    ({"input_ids": [1], "rid": 3}, "rid"),
    ({"input_ids": [[1], [2]], "rid": ["only-one"]}, "rid"),
    ({"input_ids": [[1], [2]], "rid": ["same", "same"]}, "rid"),
    ({"input_ids": [1], "priority": "high"}, "priority"),
    ({"input_ids": [1], "sampling_params": [1]}, "sampling_params"),
    ({"input_ids": [[1], [2]], "sampling_params": [{}]}, "sampling_params"),
    ({"input_ids": [1], "sampling_params": {"max_new_tokens": 0}}, "max_new_tokens"),
    ({"input_ids": [1], "sampling_params": {"max_new_tokens": 2.5}}, "max_new_tokens"),
    ({"input_ids": [1], "sampling_params": {"top_k": 0}}, "top_k"),
    ({"input_ids": [1], "sampling_params": {"temperature": "hot"}}, "temperature"),
    ({"input_ids": [1], "sampling_params": {"frequency_penalty": 0.5}}, "frequency_penalty"),
    ({"input_ids": [1], "sampling_params": {"n": 2}}, "n"),
    ({"input_ids": [1], "sampling_params": {"regex": "a+"}}, "regex"),
    ({"input_ids": [1], "sampling_params": {"lora": "x"}}, "lora"),
    ({"input_ids": [1], "sampling_params": {"stop": [""]}}, "stop"),
    ({"input_ids": [1], "sampling_params": {"stop_token_ids": [-1]}}, "stop_token_ids"),
    ({"input_ids": [1], "sampling_params": {"ignore_eos": 1}}, "ignore_eos"),
    # falsy values of the wrong type are not read as none
    ({"input_ids": [1], "sampling_params": {"stop_token_ids": 0}}, "stop_token_ids"),
    ({"input_ids": [1], "sampling_params": {"stop_token_ids": ""}}, "stop_token_ids"),
    ({"input_ids": [1], "sampling_params": {"stop": 0}}, "stop"),
    ({"input_ids": [1], "sampling_params": {"stop": False}}, "stop"),
    ({"input_ids": [1], "sampling_params": {"stop": {}}}, "stop"),
])
def test_what_the_router_cannot_honour_is_400(body: dict[str, Any], param: str) -> None:
    client, router, a, _ = make()
    r = client.post("/generate", json=body)
    assert r.status_code == 400, (body, r.text)
    assert r.json()["error"]["param"] == param, r.json()
    assert a.seen == [] and router.stats.requests == 0
    # neutral values of the refused settings are accepted
    ok = client.post("/generate", json={"input_ids": [1], "sampling_params": {
        "frequency_penalty": 0.0, "repetition_penalty": 1.0, "n": 1, "min_p": 0,
        "regex": None, "no_stop_trim": True}, "logprob_start_len": -1, "stream": False})
    assert ok.status_code == 200, ok.text


def test_sampling_params_are_checked_once_but_never_confused() -> None:
    """A checked ``sampling_params`` object is reused for the same object again, never
    for one that is equal but of other types (``1`` / ``True`` / ``1.0`` hash alike)."""
    client, _, a, _ = make()

    def post(params: dict[str, Any]) -> httpx.Response:
        return client.post("/generate", json={"input_ids": [1], "sampling_params": params})

    assert post({"max_new_tokens": 1, "stop_token_ids": [1]}).status_code == 200
    assert post({"max_new_tokens": 1, "stop_token_ids": [1]}).status_code == 200
    for params, param in [({"max_new_tokens": True, "stop_token_ids": [1]}, "max_new_tokens"),
                          ({"max_new_tokens": 1.0, "stop_token_ids": [1]}, "max_new_tokens"),
                          ({"max_new_tokens": 1, "stop_token_ids": [True]}, "stop_token_ids"),
                          ({"max_new_tokens": 1, "ignore_eos": 1}, "ignore_eos")]:
        r = post(params)
        assert r.status_code == 400 and r.json()["error"]["param"] == param, (params, r.text)
    assert post({"max_new_tokens": 1, "ignore_eos": True}).status_code == 200
    assert post({"max_new_tokens": 1, "temperature": 0}).status_code == 200
    assert post({"max_new_tokens": 1, "temperature": 0.0}).status_code == 200
    assert post({"max_new_tokens": 1, "stop": ["x", "y"]}).status_code == 200
    sent = [req.sampling for req in a.seen]
    assert [s.max_tokens for s in sent] == [1] * 6
    assert sent[0] is sent[1]  # checked once: the same settings object
    assert sent[0].stop_token_ids[0] == 1 and sent[0].stop == ()
    assert sent[3].temperature == sent[4].temperature == 0.0
    assert sent[5].stop == ("x", "y")


def test_not_json_refusals_and_auth() -> None:
    client, _, a, _ = make(api_key=KEY)
    auth = {"Authorization": f"Bearer {KEY}"}
    assert client.post("/generate", json={"input_ids": [1]}).status_code == 401
    assert client.post("/generate", content=b"{nope", headers=auth).status_code == 400
    a.refuse = "context too long"
    r = client.post("/generate", json={"input_ids": [1]}, headers=auth)
    assert r.status_code == 400 and "context too long" in r.json()["error"]["message"]
    a.refuse = None
    assert client.post("/generate", json={"input_ids": [1]}, headers=auth).status_code == 200


def test_generate_on_the_edge_answers_and_counts() -> None:
    a, b = Scripted("a"), Scripted("b")
    app = create_router_app(Router([a, b], FirstHealthy()), eos_token_ids=(7,),
                            manage_router=True)
    with running(app, app.state.fast_routes) as (h, p, _), \
            httpx.Client(base_url=f"http://{h}:{p}") as c:
        r = c.post("/generate", content=orjson.dumps(
            {"input_ids": [3, 4, 5], "sampling_params": {"max_new_tokens": 3}}),
            headers={"X-Trajectory-Id": "t2"})
        assert r.status_code == 200 and r.json()["output_ids"] == [3, 4, 5]
        assert c.post("/generate", content=b'{"text": "hi"}').status_code == 400
        text = c.get("/metrics").text
        assert 'war_router_http_requests_total{status="200"} 1.0' in text
        assert 'war_router_http_requests_total{status="400"} 1.0' in text
    assert a.seen[-1].trajectory_id == "t2"


def test_generate_holds_no_context_and_completions_do() -> None:
    # /generate sends every turn whole: the router keeps no copy of its contexts; WAR's
    # /v1/completions may continue a trajectory, so its contexts are held
    client, router, _, _ = make()
    assert client.post("/v1/completions", json={"prompt": [1, 2, 3], "max_tokens": 2},
                       headers={"X-Trajectory-Id": "t"}).status_code == 200
    assert router.held_context_tokens == 5 and "t" in router._contexts
    r = client.post("/generate", json={"input_ids": [1, 2, 3, 4, 5, 6],
                                       "sampling_params": {"max_new_tokens": 2}},
                    headers={"X-Trajectory-Id": "t"})
    assert r.status_code == 200
    assert router.held_context_tokens == 0 and not router._contexts  # the stale copy went
    batch = client.post("/generate", json={"input_ids": [[1, 2], [3, 4]]},
                        headers={"X-Trajectory-Id": "u"})
    assert batch.status_code == 200 and router.held_context_tokens == 0
    # over the edge (the fast route) alike
    a, b = Scripted("a"), Scripted("b")
    edge_router = Router([a, b], FirstHealthy())
    app = create_router_app(edge_router, manage_router=True)
    with running(app, app.state.fast_routes) as (h, p, _), \
            httpx.Client(base_url=f"http://{h}:{p}") as c:
        for path, body in (("/generate", {"input_ids": [3, 4, 5]}),
                           ("/v1/completions", {"prompt": [3, 4, 5], "max_tokens": 1})):
            r = c.post(path, content=orjson.dumps(body), headers={"X-Trajectory-Id": path})
            assert r.status_code == 200, r.text
    assert list(edge_router._contexts) == ["/v1/completions"]


@pytest.mark.parametrize("params", [None, {}, {"max_new_tokens": 5, "temperature": 0.5,
                                               "top_k": 3, "stop_token_ids": [2]}])
def test_plain_bodies_read_as_the_general_checks_read_them(params: Any) -> None:
    from war.router.server import build_generate_requests

    headers = {"x-request-id": "q", "x-trajectory-id": "t", "x-group-id": "g",
               "x-priority": "2.5"}
    plain: dict[str, Any] = {"input_ids": [4, 5, 6]}
    if params is not None:
        plain["sampling_params"] = params
    # return_logprob at its default takes the body past the plain reading
    general = {**plain, "return_logprob": False}
    assert build_generate_requests(plain, headers, (7,)) == \
        build_generate_requests(general, headers, (7,))
    (req,), batch, logprobs = build_generate_requests(plain, headers, (7,))
    assert (req.request_id, req.prompt_ids, req.trajectory_id, req.group_id, req.priority,
            batch, logprobs) == ("q", (4, 5, 6), "t", "g", 2.5, False, False)
    # what the plain reading does not take goes through the general checks and messages
    for bad, needle in (({"input_ids": [4, -1]}, "negative"),
                        ({"input_ids": []}, "empty"),
                        ({"input_ids": [4, 5], "sampling_params": {"top_k": 0}}, "top_k"),
                        ({"input_ids": [4, 5], "sampling_params": [{}, {}]}, "2 entries")):
        with pytest.raises(APIError, match=needle):
            build_generate_requests(bad, headers, (7,))


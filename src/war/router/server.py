"""The HTTP edge of the router: the replica's completions API in front of a fleet.

Knows: the body of ``POST /v1/completions`` (the replica's ``CompletionRequest``,
reused), how a body and the routing headers (``X-Request-Id``, ``X-Trajectory-Id``,
``X-Group-Id``, ``X-Priority``; body fields win) become ``GenRequest``s for
``Router.generate``, the response (the replica's shape, plus the name of the replica
that served each choice), how failures map to statuses (a replica's refusal: 400; an
unknown trajectory: 409 ``unknown_trajectory``; no replica up: 503; the app keeps
serving), the side endpoints (``/health``, ``/v1/load``, ``/v1/models``, ``/metrics``,
``/v1/trajectories/finish``: a rollout driver reports an ended episode)
and bearer-token auth (the replica's middleware).

The router has no tokenizer and no model: prompts must be token ids, ``text`` is always
``""`` and logprob tokens are ``token_id:<id>``; the end-of-sequence ids it adds to the
stop ids (unless ``ignore_eos``) are the ones it was given (``eos_token_ids``), since it
cannot read them from a model; ``max_tokens`` must be set (it does not know the context
length). Any ``model`` name is accepted and echoed. Vocabulary bounds and the context
length are checked by the replica (a 400 passed on).

Does not know how requests are placed (``war.router.router`` and its policy; its
``route`` tells which replica served a request) nor how replicas are reached
(``war.backends``).
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import math
import time
import uuid
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from contextlib import asynccontextmanager
from typing import Any

import orjson
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from pydantic import StrictStr, ValidationError
from starlette.datastructures import Headers
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Receive, Scope, Send

from war.api import (
    UNAUTHORIZED,
    APIError,
    BearerAuth,
    ClientDisconnected,
    CompletionRequest,
    ForbidExtra,
    bearer_ok,
    error_body,
    error_response,
    finite_logprob,
    is_token,
    unless_hung_up,
    validation_message,
)
from war.router.edge import FastRoute, Respond
from war.router.metrics import CONTENT_TYPE, RouterMetrics
from war.router.policies.prefix_tree import plain_token_ids
from war.router.router import NoReplicaAvailable, Router
from war.types import GenRequest, GenResult, SamplingParams, UnknownTrajectory

log = logging.getLogger("war.router.server")

TEXT_PROMPT = ("the router needs token ids (it has no tokenizer): send the prompt as a list "
               "of ints or a list of such lists")


def _all_ints(values: list[Any]) -> bool:
    """Whether every element is an int (not a bool), checked at C speed."""
    return set(map(type, values)) == {int} or all(map(is_token, values))


def _prompts(prompt: Any) -> list[list[int]]:
    """Token-id prompts: a list of ints, or a list of such lists."""
    if type(prompt) is list and prompt:
        if plain_token_ids(prompt):  # the common case: one native pass
            return [prompt]
        if _all_ints(prompt):  # ids the native check does not take (negative, >= 2**30)
            if min(prompt) < 0:
                raise APIError(400, f"prompt: token id {min(prompt)} is negative",
                               param="prompt")
            return [prompt]
    if isinstance(prompt, str) or (isinstance(prompt, list) and prompt
                                   and all(isinstance(p, str) for p in prompt)):
        raise APIError(400, TEXT_PROMPT, param="prompt")
    if not isinstance(prompt, list):
        raise APIError(400, f"{TEXT_PROMPT}; got {type(prompt).__name__}", param="prompt")
    if not prompt:
        raise APIError(400, "prompt is empty", param="prompt")
    if all(is_token(t) for t in prompt):
        prompts = [list(prompt)]
    elif all(isinstance(p, list) for p in prompt):
        for i, p in enumerate(prompt):
            bad = next((t for t in p if not is_token(t)), None)
            if bad is not None:
                raise APIError(400, f"prompt[{i}]: token ids must be ints, got {bad!r}",
                               param="prompt")
        prompts = [list(p) for p in prompt]
    else:
        bad = next(t for t in prompt if not is_token(t))
        raise APIError(400, f"{TEXT_PROMPT}; got the element {bad!r}", param="prompt")
    for i, ids in enumerate(prompts):
        where = "prompt" if len(prompts) == 1 else f"prompt[{i}]"
        if not ids:
            raise APIError(400, f"{where} is empty", param="prompt")
        bad_id = next((t for t in ids if t < 0), None)
        if bad_id is not None:
            raise APIError(400, f"{where}: token id {bad_id} is negative", param="prompt")
    return prompts


def parse_completion_body(raw: bytes) -> CompletionRequest:
    """The ``/v1/completions`` body; ``APIError`` 400 for invalid JSON or fields."""
    try:
        data = orjson.loads(raw)
    except orjson.JSONDecodeError as e:
        raise APIError(400, f"invalid request: the body is not JSON ({e})") from None
    if not isinstance(data, dict):
        raise APIError(400, "invalid request: the body must be a JSON object")
    try:
        return CompletionRequest.model_validate(data)
    except ValidationError as e:
        raise APIError(400, validation_message(e)) from None


_ID_PREFIX = f"cmpl-{uuid.uuid4().hex[:16]}-"  # this process's; unique across routers
_id_counter = itertools.count()


def _new_request_id() -> str:
    return f"{_ID_PREFIX}{next(_id_counter):x}"


_SAMPLING_CACHE: dict[tuple[Any, ...], SamplingParams] = {}
_SAMPLING_CACHE_SIZE = 256


def _sampling(temperature: float, top_p: float, top_k: int, max_tokens: int,
              stop_token_ids: tuple[int, ...], stop: tuple[str, ...], seed: int | None,
              logprobs: bool) -> SamplingParams:
    """``SamplingParams`` of these values (validated by its constructor), shared between
    requests that ask for the same: most of a run's requests do. The key has each
    value's type, so ``0`` and ``0.0`` (equal, and hashing alike) stay apart."""
    key = (temperature, type(temperature), top_p, type(top_p), top_k, max_tokens,
           stop_token_ids, stop, seed, logprobs)
    sampling = _SAMPLING_CACHE.get(key)
    if sampling is None:
        sampling = SamplingParams(temperature=temperature, top_p=top_p, top_k=top_k,
                                  max_tokens=max_tokens, stop_token_ids=stop_token_ids,
                                  stop=stop, seed=seed, logprobs=logprobs)
        if len(_SAMPLING_CACHE) >= _SAMPLING_CACHE_SIZE:
            _SAMPLING_CACHE.clear()
        _SAMPLING_CACHE[key] = sampling
    return sampling


def build_requests(body: CompletionRequest, headers: Mapping[str, str],
                   eos_token_ids: Sequence[int] = ()) -> tuple[str, list[GenRequest]]:
    """The response id and one ``GenRequest`` per prompt (``<id>-<i>`` when several).
    Raises ``APIError`` for a body the router refuses."""
    if body.n != 1:
        raise APIError(400, f"n must be 1 (send the prompt again for more samples), "
                       f"got {body.n}", param="n")
    if body.stream:
        raise APIError(400, "stream=true is not supported", param="stream")
    if body.echo:
        raise APIError(400, "echo=true is not supported", param="echo")
    if body.max_tokens is None:
        raise APIError(400, "max_tokens is required (the router does not know the replicas' "
                       "context length)", param="max_tokens")
    if body.max_tokens < 1:
        raise APIError(400, f"max_tokens must be >= 1, got {body.max_tokens}",
                       param="max_tokens")
    top_k = -1 if body.top_k is None else body.top_k
    if top_k < -1:
        raise APIError(400, f"top_k must be -1 or 0 (off) or >= 1, got {top_k}", param="top_k")
    if body.logprobs is not None and not isinstance(body.logprobs, bool) and body.logprobs < 0:
        raise APIError(400, f"logprobs must be >= 0, got {body.logprobs}", param="logprobs")
    want_logprobs = body.logprobs is not None and body.logprobs is not False
    stop_ids = list(body.stop_token_ids or [])
    bad = next((t for t in stop_ids if t < 0), None)
    if bad is not None:
        raise APIError(400, f"stop token id {bad} is negative", param="stop_token_ids")
    if not body.ignore_eos:
        stop_ids += [t for t in eos_token_ids if t not in stop_ids]
    stop = [body.stop] if isinstance(body.stop, str) else list(body.stop or [])
    if any(not s for s in stop):
        raise APIError(400, "stop strings must be non-empty", param="stop")

    rid = body.request_id or headers.get("x-request-id") or _new_request_id()
    trajectory_id = body.trajectory_id or headers.get("x-trajectory-id")
    group_id = body.group_id or headers.get("x-group-id")
    priority = body.priority
    if priority is None and "x-priority" in headers:
        try:
            priority = float(headers["x-priority"])
        except ValueError:
            raise APIError(400, f"X-Priority must be a number, got {headers['x-priority']!r}",
                           param="priority") from None
    priority = 0.0 if priority is None else priority
    if not math.isfinite(priority):
        raise APIError(400, f"priority must be finite, got {priority}", param="priority")

    prompts = _prompts(body.prompt)
    try:
        sampling = _sampling(1.0 if body.temperature is None else body.temperature,
                             1.0 if body.top_p is None else body.top_p, max(top_k, 0),
                             body.max_tokens, tuple(stop_ids), tuple(stop), body.seed,
                             want_logprobs)
    except ValueError as e:
        raise APIError(400, str(e)) from None
    requests = []
    for i, ids in enumerate(prompts):
        try:
            requests.append(GenRequest(
                request_id=rid if len(prompts) == 1 else f"{rid}-{i}",
                prompt_ids=tuple(ids), sampling=sampling, trajectory_id=trajectory_id,
                group_id=group_id, priority=priority, continues=body.continues,
            ))
        except ValueError as e:
            raise APIError(400, str(e)) from None
    return rid, requests


def build_response(rid: str, model: str, results: Sequence[GenResult],
                   replicas: Sequence[str | None], want_logprobs: bool) -> dict[str, Any]:
    """The replica's response shape (no text: the router has no tokenizer), with the
    replica that served each choice."""
    choices = []
    for i, (r, where) in enumerate(zip(results, replicas, strict=True)):
        logprobs = None
        if want_logprobs:
            logprobs = {"tokens": [f"token_id:{t}" for t in r.output_ids],
                        "token_logprobs": [finite_logprob(x) for x in r.logprobs]}
        choices.append({"index": i, "text": "", "token_ids": list(r.output_ids),
                        "logprobs": logprobs, "finish_reason": r.finish_reason,
                        "replica": where})
    prompt_tokens = sum(r.num_prompt_tokens for r in results)
    completion_tokens = sum(len(r.output_ids) for r in results)
    return {
        "id": rid,
        "object": "text_completion",
        "created": int(time.time()),
        "model": model,
        "choices": choices,
        "usage": {
            "prompt_tokens": prompt_tokens,
            "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": sum(r.num_cached_tokens for r in results)},
        },
        "war": {
            "forward_passes": sum(r.num_forward_passes for r in results),
            "draft_tokens": sum(r.num_draft_tokens for r in results),
            "accepted_tokens": sum(r.num_accepted_tokens for r in results),
            "preemptions": sum(r.num_preemptions for r in results),
            "weight_version": min(r.weight_version for r in results),
            "queue_s": max(r.queue_s for r in results),
            "total_s": max(r.total_s for r in results),
            "replica": replicas[0],
            "replicas": list(replicas),
        },
    }


async def _generate_all(router: Router, requests: Sequence[GenRequest]
                        ) -> tuple[list[GenResult], list[str | None]]:
    """Routes every request; if one fails, the others are cancelled."""
    if len(requests) == 1:  # the common case: no task of its own
        result, where = await router.route(requests[0])
        return [result], [where]
    tasks = [asyncio.ensure_future(router.route(r)) for r in requests]
    try:
        done = await asyncio.gather(*tasks)
    except BaseException:
        for t in tasks:
            t.cancel()
        await asyncio.wait(tasks)
        raise
    return [r for r, _ in done], [w for _, w in done]


class FinishRequest(ForbidExtra):
    trajectory_id: StrictStr


MAX_BODY_BYTES = 64 << 20  # a completions body (token ids as JSON) larger than this: 413


class RouterApp(FastAPI):
    """The router's FastAPI app; ``POST /v1/completions`` goes straight to
    ``fast_completions`` (a plain ASGI handler), everything else through FastAPI."""

    fast_completions: ASGIApp | None = None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        fast = self.fast_completions
        if fast is not None and scope["type"] == "http" and scope["method"] == "POST" \
                and scope["path"] == "/v1/completions":
            await fast(scope, receive, send)
            return
        await super().__call__(scope, receive, send)


def _error_body(err: APIError) -> bytes:
    return orjson.dumps(error_body(err))


def _bearer_check(api_key: str) -> Callable[[Mapping[str, str]],
                                            tuple[int, bytes, dict[str, str]] | None]:
    """``FastRoute.authorize`` for ``Authorization: Bearer <api_key>``."""

    def authorize(headers: Mapping[str, str]) -> tuple[int, bytes, dict[str, str]] | None:
        if bearer_ok(headers.get("authorization", ""), api_key):
            return None
        return 401, _error_body(UNAUTHORIZED), {"WWW-Authenticate": "Bearer"}

    return authorize


def create_router_app(router: Router, api_key: str | None = None,
                      eos_token_ids: Sequence[int] = (), *, model_name: str = "war",
                      manage_router: bool = False) -> FastAPI:
    """A FastAPI app serving ``router``. With ``api_key``, every endpoint but ``/health``
    needs ``Authorization: Bearer <api_key>``. ``eos_token_ids`` are added to each
    request's stop ids unless it sets ``ignore_eos``. With ``manage_router``, the app's
    lifespan starts the router's health checks and closes the router (and its backends)
    at shutdown; otherwise both stay with the caller. ``model_name`` is reported when a
    request names no model."""
    eos = tuple(int(t) for t in eos_token_ids)
    bad_eos = next((t for t in eos if t < 0), None)
    if bad_eos is not None:
        raise ValueError(f"eos token ids must be >= 0, got {bad_eos}")

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        if manage_router:
            await router.start()
        try:
            yield
        finally:
            if manage_router:
                await router.close()

    app = RouterApp(title="WAR router", docs_url=None, redoc_url=None, openapi_url=None,
                    lifespan=lifespan)
    metrics = RouterMetrics(router)
    app.state.router = router
    app.state.metrics = metrics
    if api_key:
        app.add_middleware(BearerAuth, api_key=api_key)

    @app.exception_handler(APIError)
    async def api_error(request: Request, exc: APIError) -> JSONResponse:
        return error_response(exc)

    @app.exception_handler(RequestValidationError)
    async def validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
        return error_response(APIError(400, validation_message(exc)))

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        kind = {404: "not_found_error", 405: "invalid_request_error"}.get(
            exc.status_code, "invalid_request_error" if exc.status_code < 500 else "server_error")
        return error_response(APIError(exc.status_code, str(exc.detail), kind))

    async def complete(raw: bytes, headers: Mapping[str, str],
                       receive: Receive | None = None,
                       respond: Respond | None = None) -> tuple[int, bytes] | None:
        """Status and JSON body of the answer to a completions call (``headers``: lower-
        case names). ``receive``: the ASGI channel, to notice the client hanging up;
        without it the caller cancels this on a hang-up (counted as 499). ``respond``
        (the edge's): a single prompt's success is answered through it as soon as the
        replica has answered, before the router's bookkeeping (``Router.route``'s
        ``deliver``), and None is returned; anything else is returned."""
        t0 = time.perf_counter()
        status = 500
        answered = False
        try:
            try:
                body = parse_completion_body(raw)
                rid, reqs = build_requests(body, headers, eos)
                want = body.logprobs is not None and body.logprobs is not False
                model = body.model or model_name
                if respond is not None and len(reqs) == 1:

                    def deliver(result: GenResult, where: str) -> None:
                        nonlocal status, answered
                        payload = orjson.dumps(build_response(rid, model, [result], [where],
                                                              want))
                        status, answered = 200, True
                        respond(200, payload)

                    await router.route(reqs[0], deliver)
                    return None
                work = _generate_all(router, reqs)
                results, where = await (work if receive is None
                                        else unless_hung_up(receive, work))
            except UnknownTrajectory as e:  # the client resends the whole context
                raise APIError(409, str(e), code="unknown_trajectory") from None
            except ValueError as e:  # refused by a replica
                raise APIError(400, str(e)) from None
            except NoReplicaAvailable as e:
                raise APIError(503, str(e), "server_error", "no_replica_available") from None
            except ClientDisconnected:
                raise APIError(499, "client closed the request") from None
            except APIError:
                raise
            except Exception as e:  # the router's own failure: report it, keep serving
                raise APIError(500, f"router error: {e!r}", "server_error",
                               "router_error") from None
            payload = orjson.dumps(build_response(rid, model, results, where, want))
            status = 200
            return status, payload
        except APIError as e:
            if answered:  # the router failed after the answer went out: the client has it
                log.error("completions: %s, after answering", e.message)
                return None
            status = e.status
            return status, _error_body(e)
        except asyncio.CancelledError:
            status = 499  # the client hung up (or the server is stopping)
            raise
        finally:
            metrics.observe_request(status, time.perf_counter() - t0)

    async def answer(raw: bytes, headers: Mapping[str, str],
                     receive: Receive | None) -> tuple[int, bytes]:
        """``complete`` for the ASGI paths: the answer, returned."""
        out = await complete(raw, headers, receive)
        assert out is not None, "complete returns its answer when given no respond"
        return out

    def too_large() -> tuple[int, bytes]:
        metrics.observe_request(413, 0.0)
        return 413, _error_body(APIError(413, f"request body larger than {MAX_BODY_BYTES} bytes"))

    # The hot path: a plain ASGI handler ahead of FastAPI's middleware, routing and body
    # handling, which cost more than the routing decision and the call to the replica.
    async def completions_asgi(scope: Scope, receive: Receive, send: Send) -> None:
        chunks: list[bytes] = []
        size = 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return  # gone before its body arrived: nothing to answer
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > MAX_BODY_BYTES:
                status, payload = too_large()
                break
            chunks.append(chunk)
            if not message.get("more_body", False):
                status, payload = await answer(b"".join(chunks), Headers(scope=scope),
                                               receive)
                break
        await send({"type": "http.response.start", "status": status,
                    "headers": [(b"content-type", b"application/json"),
                                (b"content-length", str(len(payload)).encode())]})
        await send({"type": "http.response.body", "body": payload})

    app.fast_completions = (BearerAuth(completions_asgi, api_key) if api_key
                            else completions_asgi)
    # the same endpoint for ``war.router.edge`` (``war route``), without ASGI
    app.state.fast_routes = {("POST", "/v1/completions"): FastRoute(
        handle=lambda raw, headers, respond: complete(raw, headers, None, respond),
        too_large=too_large,
        authorize=_bearer_check(api_key) if api_key else FastRoute.authorize)}

    @app.post("/v1/completions")  # reached only by calls the fast path passes on
    async def create_completion(request: Request) -> Response:
        status, payload = await answer(await request.body(), request.headers,
                                       request.receive)
        return Response(payload, status_code=status, media_type="application/json")

    @app.post("/v1/trajectories/finish")
    async def finish_trajectory(body: FinishRequest) -> dict[str, Any]:
        """The rollout driver reports an ended episode (see ``Router.finish_trajectory``)."""
        if not body.trajectory_id:
            raise APIError(400, "trajectory_id must not be empty", param="trajectory_id")
        held = router.finish_trajectory(body.trajectory_id)
        return {"trajectory_id": body.trajectory_id, "held": held}

    @app.get("/health")
    async def health() -> JSONResponse:
        replicas = {v.name: {"healthy": v.healthy, "num_requests": v.num_requests}
                    for v in router.views()}
        up = sum(1 for v in router.views() if v.healthy)
        return JSONResponse({"status": "ok" if up else "unavailable", "healthy_replicas": up,
                             "replicas": replicas}, status_code=200 if up else 503)

    @app.get("/v1/load")
    async def load() -> dict[str, Any]:
        views = router.views()
        return {
            "policy": router.policy.name,
            "healthy_replicas": sum(1 for v in views if v.healthy),
            "num_requests": sum(v.num_requests for v in views),
            "tokens_in_flight": sum(v.tokens_in_flight for v in views),
            "replicas": router.fleet_load(),
        }

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [{"id": model_name, "object": "model", "created": 0,
                                            "owned_by": "war-router"}]}

    @app.get("/metrics")
    async def prometheus() -> Response:
        return Response(metrics.render(), media_type=CONTENT_TYPE)

    return app

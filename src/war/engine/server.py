"""The HTTP edge of one replica: an OpenAI-compatible completions API.

Knows: the request and response shapes of ``POST /v1/completions`` (token-id
prompts first; strings when the engine has a tokenizer) and WAR's extensions
(trajectory/group ids, priority, per-request speculation figures), how each
field maps to a ``GenRequest``, how mistakes are reported (a 4xx, or a 500, with
an OpenAI-style ``{"error": {...}}`` body; the server keeps serving; a body over
``MAX_BODY_BYTES`` is a 413), which OpenAI fields it refuses (those it does not
implement unless at their neutral value, ``n`` > 1, streaming, top-k logprobs, the chat
API), the side endpoints (``/health``, ``/v1/models[/{id}]``, ``/v1/load``, ``/v1/history``,
``/v1/rl_step``, ``/v1/trajectories/finish``, ``/metrics``), bearer-token auth,
and that a request whose client hung up is aborted in the engine.

Does not know how generation works (``AsyncEngine`` drives the ``Engine``), how
metrics are named (``war.engine.metrics``), or how the process is started
(``war.cli.serve``).
"""

from __future__ import annotations

import dataclasses
import math
import time
import uuid
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.datastructures import Headers
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from war.api import (
    APIError,
    BearerAuth,
    ClientDisconnected,
    CompletionRequest,
    HistoryItem,
    HistoryRequest,
    RLStepRequest,
    TrajectoryFinishRequest,
    WeightsRequest,
    error_response,
    finite_logprob,
    is_token,
    refuse_unsupported,
    unless_disconnected,
    validation_message,
)
from war.engine.async_engine import (
    AsyncEngine,
    DuplicateRequestError,
    EngineClosedError,
    EngineLike,
    EngineStepError,
)
from war.engine.metrics import CONTENT_TYPE, ReplicaMetrics
from war.types import GenRequest, GenResult, SamplingParams, UnknownTrajectory

MAX_BODY_BYTES = 64 << 20  # as the router's: a larger request body is a 413


class _BodyLimit:
    """ASGI middleware: reading a request body of more than ``max_bytes`` (declared or
    sent) raises a 413, which the app answers in its error format, instead of the
    whole body being buffered. Paths that never read their body are unaffected."""

    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        limit = self.max_bytes
        declared = Headers(scope=scope).get("content-length", "")
        size = int(declared) if declared.isdigit() else 0

        async def limited() -> Message:
            nonlocal size
            if size <= limit:  # (a declared length over it is refused before reading)
                message = await receive()
                if message["type"] == "http.request" and not declared:  # chunked: count
                    size += len(message.get("body", b""))
                if size <= limit:
                    return message
            raise StarletteHTTPException(413, f"request body larger than {limit} bytes")

        await self.app(scope, limited, send)


def _check_unicode(value: str | None, param: str) -> None:
    """Refuses a string holding a lone surrogate (JSON's ``"\\ud800"``, which the JSON
    parser lets through): it has no UTF-8 form, so the tokenizer, the engine's draft
    trees and the response encoder would fail on it with a 500."""
    if value is not None:
        try:
            value.encode()
        except UnicodeEncodeError as e:
            raise APIError(400, f"{param} is not valid Unicode (a lone surrogate at "
                           f"index {e.start})", param=param) from None


class _Completions:
    """Turns completion bodies into engine requests and results into responses."""

    def __init__(self, engine: AsyncEngine, model_name: str) -> None:
        self.engine = engine
        self.model_name = model_name
        inner: EngineLike = engine.engine
        self.vocab_size = inner.model_config.vocab_size
        self.eos_ids = tuple(inner.model_config.eos_token_id)
        self.max_model_len = inner.max_model_len
        self.tokenizer = inner.tokenizer

    # ---- requests

    def _encode(self, text: str) -> list[int]:
        encode = getattr(self.tokenizer, "encode", None)
        if encode is None:
            raise APIError(400, "text prompts need a server with a tokenizer; send token ids",
                           param="prompt")
        _check_unicode(text, "prompt")
        enc = encode(text)
        ids = getattr(enc, "ids", enc)
        return [int(t) for t in ids]

    def _prompts(self, prompt: Any) -> list[list[int]]:
        shape = ("prompt must be token ids (a list of ints), a list of such lists, "
                 "a string or a list of strings")
        prompts: list[list[int]]
        if isinstance(prompt, str):
            prompts = [self._encode(prompt)]
        elif not isinstance(prompt, list):
            raise APIError(400, f"{shape}; got {type(prompt).__name__}", param="prompt")
        elif not prompt:
            raise APIError(400, "prompt is empty", param="prompt")
        elif all(is_token(t) for t in prompt):
            prompts = [list(prompt)]
        elif all(isinstance(p, str) for p in prompt):
            prompts = [self._encode(p) for p in prompt]
        elif all(isinstance(p, list) for p in prompt):
            for i, p in enumerate(prompt):
                # An index, not the element: a bad element may be None itself.
                j = next((j for j, t in enumerate(p) if not is_token(t)), None)
                if j is not None:
                    raise APIError(400, f"prompt[{i}]: token ids must be ints, got {p[j]!r}",
                                   param="prompt")
            prompts = [list(p) for p in prompt]
        else:
            bad = next(t for t in prompt if not is_token(t))
            raise APIError(400, f"{shape}; got the element {bad!r}", param="prompt")
        for i, ids in enumerate(prompts):
            where = "prompt" if len(prompts) == 1 else f"prompt[{i}]"
            if not ids:
                raise APIError(400, f"{where} is empty", param="prompt")
            bad = next((t for t in ids if not 0 <= t < self.vocab_size), None)
            if bad is not None:
                raise APIError(400, f"{where}: token id {bad} outside the vocabulary "
                               f"[0, {self.vocab_size})", param="prompt")
        return prompts

    @staticmethod
    def trajectory_id(body: CompletionRequest, headers: Headers) -> str | None:
        return body.trajectory_id or headers.get("x-trajectory-id")

    def build(self, body: CompletionRequest, headers: Headers, held: int = 0
              ) -> tuple[str, list[GenRequest]]:
        """The response id and one engine request per prompt (``<id>-<i>`` when several).
        ``held``: the tokens the engine holds for a continuing request's trajectory (its
        prompt is appended to them), for the default ``max_tokens``."""
        if body.model is not None and body.model != self.model_name:
            raise APIError(404, f"the model {body.model!r} does not exist "
                           f"(this server serves {self.model_name!r})",
                           "not_found_error", "model_not_found", "model")
        if body.n != 1:
            raise APIError(400, f"n must be 1 (send the prompt again for more samples), "
                           f"got {body.n}", param="n")
        if body.stream:
            raise APIError(400, "stream=true is not supported", param="stream")
        if body.echo:
            raise APIError(400, "echo=true is not supported", param="echo")
        top_k = -1 if body.top_k is None else body.top_k
        if top_k < -1:
            raise APIError(400, f"top_k must be -1 or 0 (off) or >= 1, got {top_k}",
                           param="top_k")
        if body.logprobs is not None and not isinstance(body.logprobs, bool) \
                and body.logprobs < 0:
            raise APIError(400, f"logprobs must be >= 0, got {body.logprobs}", param="logprobs")
        if not isinstance(body.logprobs, bool) and isinstance(body.logprobs, int) \
                and body.logprobs > 1:
            # OpenAI's logprobs=k also lists the k likeliest tokens at each position; the
            # engine returns the sampled token's only, so a larger k is refused rather
            # than answered without the alternatives it asked for.
            raise APIError(400, f"logprobs={body.logprobs} is not supported: only the sampled "
                           "tokens' logprobs are returned (logprobs 0 or 1, or true)",
                           param="logprobs")
        want_logprobs = body.logprobs is not None and body.logprobs is not False
        stop_ids = list(body.stop_token_ids or [])
        bad = next((t for t in stop_ids if not 0 <= t < self.vocab_size), None)
        if bad is not None:
            raise APIError(400, f"stop token id {bad} outside the vocabulary "
                           f"[0, {self.vocab_size})", param="stop_token_ids")
        if not body.ignore_eos:
            stop_ids += [t for t in self.eos_ids if t not in stop_ids]
        stop = [body.stop] if isinstance(body.stop, str) else list(body.stop or [])
        if any(not s for s in stop):
            raise APIError(400, "stop strings must be non-empty", param="stop")
        if stop and self.tokenizer is None:
            raise APIError(400, "stop strings need a server with a tokenizer; "
                           "use stop_token_ids", param="stop")
        for s in stop:
            _check_unicode(s, "stop")

        rid = body.request_id or headers.get("x-request-id") or f"cmpl-{uuid.uuid4().hex}"
        trajectory_id = self.trajectory_id(body, headers)
        group_id = body.group_id or headers.get("x-group-id")
        _check_unicode(rid, "request_id")
        _check_unicode(trajectory_id, "trajectory_id")
        _check_unicode(group_id, "group_id")
        priority = body.priority
        if priority is None and "x-priority" in headers:
            try:
                priority = float(headers["x-priority"])
            except ValueError:
                raise APIError(400, f"X-Priority must be a number, got "
                               f"{headers['x-priority']!r}", param="priority") from None
        priority = 0.0 if priority is None else priority
        if not math.isfinite(priority):
            raise APIError(400, f"priority must be finite, got {priority}", param="priority")

        prompts = self._prompts(body.prompt)
        if trajectory_id is not None and len(prompts) > 1:
            # A trajectory is one line of turns: its prompts would all claim its draft
            # tree, held context and KV (a continuing one fails on the first's claim).
            raise APIError(400, f"a request of a trajectory (trajectory_id "
                           f"{trajectory_id!r}) takes one prompt, got {len(prompts)}",
                           param="prompt")
        if not body.continues:
            held = 0
        requests = []
        for i, ids in enumerate(prompts):
            max_tokens = body.max_tokens
            if max_tokens is None:  # the rest of the context, after the whole prompt
                max_tokens = self.max_model_len - held - len(ids)
                if max_tokens < 1:
                    size = f"{held} held + {len(ids)} new" if held else f"{len(ids)}"
                    raise APIError(400, f"the prompt ({size} tokens) leaves no room in "
                                   f"the context length {self.max_model_len}",
                                   param="max_tokens")
            if max_tokens < 1:
                raise APIError(400, f"max_tokens must be >= 1, got {max_tokens}",
                               param="max_tokens")
            if len(ids) + max_tokens > self.max_model_len and not body.continues:
                raise APIError(400, f"prompt ({len(ids)} tokens) + max_tokens ({max_tokens}) "
                               f"exceeds the context length {self.max_model_len}",
                               param="max_tokens")
            try:
                sampling = SamplingParams(
                    temperature=1.0 if body.temperature is None else body.temperature,
                    top_p=1.0 if body.top_p is None else body.top_p,
                    top_k=max(top_k, 0),
                    max_tokens=max_tokens,
                    stop_token_ids=tuple(stop_ids),
                    stop=tuple(stop),
                    seed=body.seed,
                    logprobs=want_logprobs,
                )
                requests.append(GenRequest(
                    request_id=rid if len(prompts) == 1 else f"{rid}-{i}",
                    prompt_ids=tuple(ids), sampling=sampling, trajectory_id=trajectory_id,
                    group_id=group_id, priority=priority, continues=body.continues,
                ))
            except ValueError as e:
                raise APIError(400, str(e)) from None
        return rid, requests

    # ---- responses

    def _piece(self, token_id: int) -> str:
        if self.tokenizer is None:
            return f"token_id:{token_id}"
        piece = str(self.tokenizer.decode([token_id]))
        if not piece and hasattr(self.tokenizer, "id_to_token"):
            piece = str(self.tokenizer.id_to_token(token_id) or "")
        return piece

    def respond(self, rid: str, results: Sequence[GenResult], want_logprobs: bool,
                stops: Sequence[str] = ()) -> dict[str, Any]:
        """The completion's answer; a choice that a stop string ended has its ``text``
        cut before that string, as OpenAI's is (its ``token_ids`` and ``logprobs`` keep
        the tokens the model generated: those are what a trajectory trains on)."""
        choices = []
        for i, r in enumerate(results):
            text = "" if self.tokenizer is None else str(self.tokenizer.decode(list(r.output_ids)))
            if stops and r.finish_reason == "stop":
                found = [at for at in map(text.find, stops) if at >= 0]
                if found:  # (a stop token ended it otherwise)
                    text = text[:min(found)]
            logprobs = None
            if want_logprobs:
                logprobs = {
                    "tokens": [self._piece(t) for t in r.output_ids],
                    "token_logprobs": [finite_logprob(x) for x in r.logprobs],
                }
            choices.append({"index": i, "text": text, "token_ids": list(r.output_ids),
                            "logprobs": logprobs, "finish_reason": r.finish_reason})
        prompt_tokens = sum(r.num_prompt_tokens for r in results)
        completion_tokens = sum(len(r.output_ids) for r in results)
        return {
            "id": rid,
            "object": "text_completion",
            "created": int(time.time()),
            "model": self.model_name,
            "choices": choices,
            "usage": {
                "prompt_tokens": prompt_tokens,
                "completion_tokens": completion_tokens,
                "total_tokens": prompt_tokens + completion_tokens,
                "prompt_tokens_details": {
                    "cached_tokens": sum(r.num_cached_tokens for r in results)},
            },
            "war": {
                "forward_passes": sum(r.num_forward_passes for r in results),
                "draft_tokens": sum(r.num_draft_tokens for r in results),
                "accepted_tokens": sum(r.num_accepted_tokens for r in results),
                "preemptions": sum(r.num_preemptions for r in results),
                "weight_version": min(r.weight_version for r in results),
                "queue_s": max(r.queue_s for r in results),
                "total_s": max(r.total_s for r in results),
            },
        }


def create_app(async_engine: AsyncEngine, model_name: str = "war",
               api_key: str | None = None, max_body_bytes: int = MAX_BODY_BYTES, *,
               model_folder: str | Path | None = None,
               fingerprint: Callable[[str | Path], str | None] | None = None) -> FastAPI:
    """A FastAPI app serving ``async_engine`` (started here if it is not running yet;
    closing it stays with the caller). With ``api_key``, every endpoint but
    ``/health`` needs ``Authorization: Bearer <api_key>``. A request body over
    ``max_body_bytes`` is a 413. With ``fingerprint`` (a content fingerprint of a model
    folder: ``war.rollout.fingerprint.model_fingerprint``), ``/v1/models`` states the
    served weights' ``weights_fingerprint``: ``model_folder``'s at the start, the
    folder's of each ``/v1/weights`` since (``null`` without them), so that a client
    can tell which weights it is sampling from."""
    async_engine.start()
    # (the fingerprint of the weights of one version: stated only while they are served;
    # weights loaded otherwise, say through the engine itself, have none)
    served: dict[int, str | None] = {async_engine.weight_version: fingerprint(model_folder)
                                     if fingerprint is not None and model_folder is not None
                                     else None}
    app = FastAPI(title="WAR replica", docs_url=None, redoc_url=None, openapi_url=None)
    metrics = ReplicaMetrics(async_engine)
    completions = _Completions(async_engine, model_name)
    app.state.async_engine = async_engine
    app.state.metrics = metrics
    app.add_middleware(_BodyLimit, max_bytes=max_body_bytes)
    if api_key:
        app.add_middleware(BearerAuth, api_key=api_key)

    @app.exception_handler(APIError)
    async def api_error(request: Request, exc: APIError) -> JSONResponse:
        return error_response(exc)

    def count_unparsed(request: Request, status: int) -> None:
        # A completion body refused before the handler ran is answered too; its
        # latency is not known (and not a completion's), so only the count.
        if request.method == "POST" and request.url.path == "/v1/completions":
            metrics.observe_request(status, None)

    @app.exception_handler(RequestValidationError)
    async def validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
        count_unparsed(request, 400)
        return error_response(APIError(400, validation_message(exc)))

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        count_unparsed(request, exc.status_code)
        kind = {404: "not_found_error", 405: "invalid_request_error"}.get(
            exc.status_code, "invalid_request_error" if exc.status_code < 500 else "server_error")
        # (its headers: a 405's Allow)
        return error_response(APIError(exc.status_code, str(exc.detail), kind),
                              dict(exc.headers or {}))

    @app.exception_handler(Exception)
    async def internal_error(request: Request, exc: Exception) -> JSONResponse:
        # A bug, not the client's fault; the body keeps the OpenAI shape (Starlette's
        # own is plain text) and the error is still raised to the server's log.
        return error_response(APIError(500, f"internal error: {type(exc).__name__}",
                                       "server_error", "internal_error"))

    @app.post("/v1/completions")
    async def create_completion(body: CompletionRequest, request: Request) -> JSONResponse:
        t0 = time.perf_counter()
        status = 500
        try:
            try:
                refuse_unsupported(body)
                held = 0
                tid = completions.trajectory_id(body, request.headers)
                if body.continues and body.max_tokens is None and tid is not None:
                    # The default max_tokens is the rest of the context after the held
                    # tokens too. (Only another turn of the same trajectory, sent
                    # concurrently, could change them before the request is admitted;
                    # the engine then refuses it.)
                    held = await async_engine.held_length(tid) or 0
                rid, reqs = completions.build(body, request.headers, held)
                results = await unless_disconnected(request, async_engine.generate_all(reqs))
            except UnknownTrajectory as e:  # the client resends the whole context
                raise APIError(409, str(e), code="unknown_trajectory") from None
            except DuplicateRequestError as e:
                raise APIError(409, str(e), code="duplicate_request_id",
                               param="request_id") from None
            except ValueError as e:  # refused by the engine
                raise APIError(400, str(e)) from None
            except ClientDisconnected:
                status = 499
                return error_response(APIError(499, "client closed the request"))
            except EngineClosedError as e:
                raise APIError(503, str(e), "server_error", "engine_closed") from None
            except EngineStepError as e:
                raise APIError(500, str(e), "server_error", "engine_error") from None
            want = body.logprobs is not None and body.logprobs is not False
            # (rendered first: a response that fails to render is counted as the 500 it is)
            stops = reqs[0].sampling.stop if reqs else ()  # (build's, one for the body)
            response = JSONResponse(completions.respond(rid, results, want, stops))
            status = 200
            return response
        except APIError as e:
            status = e.status
            raise
        finally:
            metrics.observe_request(status, time.perf_counter() - t0)

    @app.get("/health")
    async def health() -> JSONResponse:
        ok = async_engine.is_running
        return JSONResponse({"status": "ok" if ok else "stopped",
                             "weight_version": async_engine.weight_version},
                            status_code=200 if ok else 503)

    def model_card() -> dict[str, Any]:
        return {"id": model_name, "object": "model", "created": 0, "owned_by": "war",
                "max_model_len": completions.max_model_len,
                "vocab_size": completions.vocab_size,
                "weight_version": async_engine.weight_version,
                "weights_fingerprint": served.get(async_engine.weight_version)}

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [model_card()]}

    @app.get("/v1/models/{model_id:path}")  # (``:path``: a model name may hold a slash)
    async def retrieve_model(model_id: str) -> dict[str, Any]:
        if model_id != model_name:
            raise APIError(404, f"the model {model_id!r} does not exist (this server serves "
                           f"{model_name!r})", "not_found_error", "model_not_found", "model")
        return model_card()

    @app.post("/v1/chat/completions")
    async def chat_completions() -> JSONResponse:
        # The replica holds no chat template: the client renders the conversation
        # (war.rollout.chat) and sends its tokens, which keeps a trajectory's token ids
        # exactly those it trains on. Answered before the body is read.
        raise APIError(404, "this server has no chat API: render the conversation with "
                       "the model's chat template and send it to POST /v1/completions as "
                       "token ids (or text)", "not_found_error", "unsupported_endpoint")

    @app.get("/v1/load")
    async def load() -> dict[str, Any]:
        snap = async_engine.load()
        out = dataclasses.asdict(snap)
        out["kv_free_tokens"] = snap.kv_free_tokens
        return out

    @app.post("/v1/history")
    async def history(body: HistoryRequest) -> dict[str, Any]:
        if (body.token_ids is None) == (body.items is None):
            raise APIError(400, "send either token_ids (with an optional group_id) or items")
        if body.items is not None and not body.items:
            raise APIError(400, "items is empty", param="items")
        if body.items is not None and body.group_id is not None:
            raise APIError(400, "group_id goes inside each item when items are sent",
                           param="group_id")
        items = ([HistoryItem(token_ids=body.token_ids, group_id=body.group_id)]
                 if body.token_ids is not None else list(body.items or []))
        vocab = completions.vocab_size
        for i, item in enumerate(items):
            if not item.token_ids:
                raise APIError(400, f"item {i}: token_ids is empty", param="token_ids")
            _check_unicode(item.group_id, "group_id")
            bad = next((t for t in item.token_ids if not 0 <= t < vocab), None)
            if bad is not None:
                raise APIError(400, f"item {i}: token id {bad} outside the vocabulary "
                               f"[0, {vocab})", param="token_ids")

        def add_all(engine: EngineLike) -> None:
            for item in items:
                engine.add_history(item.token_ids, item.group_id)

        try:
            await async_engine.call(add_all)
        except EngineClosedError as e:
            raise APIError(503, str(e), "server_error", "engine_closed") from None
        return {"status": "ok", "num_items": len(items),
                "num_tokens": sum(len(item.token_ids) for item in items)}

    @app.post("/v1/weights")
    async def weights(body: WeightsRequest) -> dict[str, Any]:
        """Loads new weights from a folder (RL weight sync through disk): in-flight
        requests are recomputed with them and the prefix cache is cleared."""
        if not body.path:  # would be the server's working folder
            raise APIError(400, "path must not be empty", param="path")
        _check_unicode(body.path, "path")
        try:
            version = await async_engine.load_weights(body.path)
        except (ValueError, OSError, KeyError) as e:
            raise APIError(400, f"cannot load weights from {body.path!r}: {e}",
                           param="path") from None
        except EngineClosedError as e:
            raise APIError(503, str(e), "server_error", "engine_closed") from None
        served.clear()
        served[version] = fingerprint(body.path) if fingerprint is not None else None
        return {"status": "ok", "weight_version": version,
                "weights_fingerprint": served[version]}

    @app.post("/v1/rl_step")
    async def rl_step(body: RLStepRequest) -> dict[str, Any]:
        """Advances the draft history's window of RL steps."""
        if body.rl_step < 0:
            raise APIError(400, f"rl_step must be >= 0, got {body.rl_step}", param="rl_step")
        try:
            await async_engine.observe_rl_step(body.rl_step)
        except ValueError as e:
            raise APIError(400, str(e), param="rl_step") from None
        except EngineClosedError as e:
            raise APIError(503, str(e), "server_error", "engine_closed") from None
        return {"status": "ok", "rl_step": body.rl_step}

    @app.post("/v1/trajectories/finish")
    async def finish_trajectory(body: TrajectoryFinishRequest) -> dict[str, Any]:
        """The trajectory ended: KV held for its next turn is freed
        (``EngineConfig.kv_hold_s``)."""
        if not body.trajectory_id:
            raise APIError(400, "trajectory_id must not be empty", param="trajectory_id")
        _check_unicode(body.trajectory_id, "trajectory_id")
        try:
            held = await async_engine.finish_trajectory(body.trajectory_id)
        except EngineClosedError as e:
            raise APIError(503, str(e), "server_error", "engine_closed") from None
        return {"trajectory_id": body.trajectory_id, "held": held}

    @app.get("/metrics")
    async def prometheus() -> Response:
        return Response(metrics.render(), media_type=CONTENT_TYPE)

    return app

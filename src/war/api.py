"""The OpenAI-compatible HTTP API that WAR's replica and router both serve.

Knows: the accepted bodies (``CompletionRequest`` and the side requests), the error
shape (``APIError`` answered as ``{"error": {...}}``), how validation errors read,
bearer-token auth (an ASGI middleware), and how to abandon a call's work when its
client hangs up. Does not know engines, routers or models, and imports no torch, so
that the router process stays light.
"""

from __future__ import annotations

import asyncio
import math
import secrets
from collections.abc import Awaitable
from typing import Any, TypeVar

from fastapi import Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import (
    BaseModel,
    ConfigDict,
    StrictBool,
    StrictFloat,
    StrictInt,
    StrictStr,
    ValidationError,
)
from starlette.datastructures import Headers
from starlette.types import ASGIApp, Receive, Scope, Send

T = TypeVar("T")

OPEN_PATHS = frozenset({"/health"})  # reachable without the API key
_LOGPROB_FLOOR = -9999.0  # -inf is not JSON; vLLM clamps the same way
_MAX_ERRORS_SHOWN = 5


class APIError(Exception):
    """A request the server answers with an error body."""

    def __init__(self, status: int, message: str, type_: str = "invalid_request_error",
                 code: str | None = None, param: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type_
        self.code = code
        self.param = param


def error_body(err: APIError) -> dict[str, Any]:
    """The OpenAI-style error body: ``{"error": {message, type, param, code}}``."""
    return {"error": {"message": err.message, "type": err.type, "param": err.param,
                      "code": err.code}}


def error_response(err: APIError, headers: dict[str, str] | None = None) -> JSONResponse:
    return JSONResponse(error_body(err), status_code=err.status, headers=headers)


class ForbidExtra(BaseModel):
    model_config = ConfigDict(extra="forbid")


class CompletionRequest(ForbidExtra):
    """The accepted body of ``POST /v1/completions`` (unknown fields are refused)."""

    model: StrictStr | None = None
    # token ids | list of token-id lists | text | list of texts; checked by the server,
    # whose messages are clearer than those of a four-way union
    prompt: Any
    max_tokens: StrictInt | None = 16
    temperature: StrictFloat | None = 1.0
    top_p: StrictFloat | None = 1.0
    top_k: StrictInt | None = -1
    stop: StrictStr | list[StrictStr] | None = None
    stop_token_ids: list[StrictInt] | None = None
    seed: StrictInt | None = None
    logprobs: StrictBool | StrictInt | None = None
    n: StrictInt = 1
    ignore_eos: StrictBool = False
    stream: StrictBool = False
    echo: StrictBool = False
    user: StrictStr | None = None
    request_id: StrictStr | None = None
    trajectory_id: StrictStr | None = None
    group_id: StrictStr | None = None
    priority: StrictFloat | None = None
    continues: StrictBool = False
    # OpenAI completion fields WAR does not implement: accepted at the value that changes
    # nothing (clients such as LangChain send ``frequency_penalty: 0`` on every call),
    # refused otherwise (``refuse_unsupported``)
    frequency_penalty: StrictFloat | None = None
    presence_penalty: StrictFloat | None = None
    best_of: StrictInt | None = None
    logit_bias: dict[StrictStr, Any] | None = None
    suffix: StrictStr | None = None
    stream_options: dict[StrictStr, Any] | None = None


# field -> the values that change nothing (None: the field left out)
_NEUTRAL: dict[str, tuple[Any, ...]] = {
    "frequency_penalty": (None, 0.0), "presence_penalty": (None, 0.0), "best_of": (None, 1),
    "logit_bias": (None, {}), "suffix": (None, ""), "stream_options": (None,)}


def refuse_unsupported(body: CompletionRequest) -> None:
    """``APIError`` 400 naming the first OpenAI field of ``body`` set to a value WAR does
    not implement (``CompletionRequest``'s last fields); a neutral value passes."""
    for name, neutral in _NEUTRAL.items():
        value = getattr(body, name)
        if value in neutral:
            continue
        if name == "stream_options":  # (OpenAI refuses it without stream=true too)
            raise APIError(400, "stream_options needs stream=true, which is not supported",
                           param=name)
        allowed = " or ".join(repr(v) for v in neutral if v is not None)
        raise APIError(400, f"{name}={value!r} is not supported (only {allowed}, or "
                       f"leaving it out)", param=name)


class HistoryItem(ForbidExtra):
    token_ids: list[StrictInt]
    group_id: StrictStr | None = None


class WeightsRequest(ForbidExtra):
    """A Hugging Face folder on the server's disk holding the new weights."""

    path: StrictStr


class RLStepRequest(ForbidExtra):
    rl_step: StrictInt


class TrajectoryFinishRequest(ForbidExtra):
    """An ended trajectory (``POST /v1/trajectories/finish``)."""

    trajectory_id: StrictStr


class HistoryRequest(ForbidExtra):
    """``{token_ids, group_id}`` (one response) or ``{items: [...]}`` (several)."""

    token_ids: list[StrictInt] | None = None
    group_id: StrictStr | None = None
    items: list[HistoryItem] | None = None


class BearerAuth:
    """ASGI middleware: every HTTP path but ``OPEN_PATHS`` needs ``Bearer <api_key>``."""

    def __init__(self, app: ASGIApp, api_key: str) -> None:
        self.app = app
        self._key = api_key.encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["path"] not in OPEN_PATHS:
            auth = Headers(scope=scope).get("authorization", "")
            if not bearer_ok(auth, self._key):
                await error_response(UNAUTHORIZED, {"WWW-Authenticate": "Bearer"})(
                    scope, receive, send)
                return
        await self.app(scope, receive, send)


UNAUTHORIZED = APIError(401, "missing or invalid API key (Authorization: Bearer <key>)",
                        "authentication_error", "invalid_api_key")


def bearer_ok(authorization: str, api_key: str | bytes) -> bool:
    """Whether an ``Authorization`` header value is ``Bearer <api_key>`` (compared in
    constant time)."""
    key = api_key.encode() if isinstance(api_key, str) else api_key
    scheme, _, token = authorization.partition(" ")
    return scheme.lower() == "bearer" and secrets.compare_digest(token.strip().encode(), key)


def validation_message(exc: RequestValidationError | ValidationError) -> str:
    parts = []
    errors = list(exc.errors())
    for e in errors[:_MAX_ERRORS_SHOWN]:
        loc = [str(x) for x in e.get("loc", ()) if x != "body"]
        where = ".".join(loc) or "body"
        if e.get("type") == "extra_forbidden":
            parts.append(f"unknown field {where!r}")
        else:
            parts.append(f"{where}: {e.get('msg', 'invalid')}")
    if len(errors) > _MAX_ERRORS_SHOWN:
        parts.append(f"... ({len(errors) - _MAX_ERRORS_SHOWN} more)")
    return "invalid request: " + "; ".join(parts)


async def wait_disconnect(receive: Receive) -> None:
    """Returns when the client hangs up (the body has been read already)."""
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return


class ClientDisconnected(Exception):
    """The client hung up before its response was ready."""


async def unless_disconnected(request: Request, work: Awaitable[T]) -> T:
    """Awaits ``work``; cancels it (aborting its requests) if the client hangs up."""
    return await unless_hung_up(request.receive, work)


async def unless_hung_up(receive: Receive, work: Awaitable[T]) -> T:
    """Awaits ``work`` in the calling task; cancels it if the client hangs up
    (``receive``: the ASGI channel of the call, its body already read) and raises
    ``ClientDisconnected`` then."""
    task = asyncio.current_task()
    assert task is not None, "called outside a task"
    hung_up = finished = False

    def on_watch_done(watch: asyncio.Future[None]) -> None:
        nonlocal hung_up
        # (a callback scheduled just before ``work`` ended must not cancel the caller)
        if not finished and not watch.cancelled() and watch.exception() is None:
            hung_up = True
            task.cancel()

    watch = asyncio.ensure_future(wait_disconnect(receive))
    watch.add_done_callback(on_watch_done)
    try:
        return await work
    except asyncio.CancelledError:
        if hung_up and task.uncancel() == 0:  # our cancellation, not the caller's
            raise ClientDisconnected from None
        raise
    finally:
        finished = True
        watch.cancel()


def is_token(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def finite_logprob(x: float) -> float | None:
    # NaN and +inf (no log-probability) have no JSON form either
    if math.isnan(x) or x == math.inf:
        return None
    return max(x, _LOGPROB_FLOOR)

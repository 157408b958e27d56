"""The HTTP edge of the router: the replica's completions API in front of a fleet.

Knows: the body of ``POST /v1/completions`` (the replica's ``CompletionRequest``,
reused) and of SGLang's native ``POST /generate`` with token ids (for clients written
against SGLang: its fields, which of them WAR honours, and its answer's shape), how a
body and the routing headers (``X-Request-Id``, ``X-Trajectory-Id``,
``X-Group-Id``, ``X-Priority``; body fields win) become ``GenRequest``s for
``Router.generate``, the response (the replica's shape, plus the name of the replica
that served each choice), how failures map to statuses (a replica's refusal: 400; an
unknown trajectory: 409 ``unknown_trajectory``; no replica up: 503; a replica that
refuses the router's own credentials: 502 ``replica_auth_failed``; the app keeps
serving), the side endpoints (``/health``, ``/v1/load``, ``/v1/models``, ``/metrics``,
``/v1/trajectories/finish``: a rollout driver reports an ended episode; ``/v1/rl_step``:
an RL step began, told to every WAR replica)
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
from pydantic import StrictInt, StrictStr, ValidationError
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
    refuse_unsupported,
    unless_hung_up,
    validation_message,
)
from war.router.edge import FastRoute, Respond
from war.router.metrics import CONTENT_TYPE, RouterMetrics
from war.router.policies.prefix_tree import plain_token_ids
from war.router.router import NoReplicaAvailable, ReplicaAuthRefused, Router
from war.types import GenRequest, GenResult, SamplingParams, UnknownTrajectory

log = logging.getLogger("war.router.server")

TEXT_PROMPT = ("the router needs token ids (it has no tokenizer): send the prompt as a list "
               "of ints or a list of such lists")


def _all_ints(values: list[Any]) -> bool:
    """Whether every element is an int (not a bool), checked at C speed."""
    return set(map(type, values)) == {int} or all(map(is_token, values))


def _prompts(prompt: Any, name: str = "prompt", text: str = TEXT_PROMPT) -> list[list[int]]:
    """Token-id prompts: a list of ints, or a list of such lists (``name``: the field,
    for messages; ``text``: the message for text)."""
    if type(prompt) is list and prompt:
        if plain_token_ids(prompt):  # the common case: one native pass
            return [prompt]
        if _all_ints(prompt):  # ids the native check does not take (negative, >= 2**30)
            if min(prompt) < 0:
                raise APIError(400, f"{name}: token id {min(prompt)} is negative",
                               param=name)
            return [prompt]
    if isinstance(prompt, str) or (isinstance(prompt, list) and prompt
                                   and all(isinstance(p, str) for p in prompt)):
        raise APIError(400, text, param=name)
    if not isinstance(prompt, list):
        raise APIError(400, f"{text}; got {type(prompt).__name__}", param=name)
    if not prompt:
        raise APIError(400, f"{name} is empty", param=name)
    if all(is_token(t) for t in prompt):
        prompts = [list(prompt)]
    elif all(isinstance(p, list) for p in prompt):
        for i, p in enumerate(prompt):
            bad = next((t for t in p if not is_token(t)), None)
            if bad is not None:
                raise APIError(400, f"{name}[{i}]: token ids must be ints, got {bad!r}",
                               param=name)
        prompts = [list(p) for p in prompt]
    else:
        bad = next(t for t in prompt if not is_token(t))
        raise APIError(400, f"{text}; got the element {bad!r}", param=name)
    for i, ids in enumerate(prompts):
        where = name if len(prompts) == 1 else f"{name}[{i}]"
        if not ids:
            raise APIError(400, f"{where} is empty", param=name)
        bad_id = next((t for t in ids if t < 0), None)
        if bad_id is not None:
            raise APIError(400, f"{where}: token id {bad_id} is negative", param=name)
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
        body = CompletionRequest.model_validate(data)
    except ValidationError as e:
        raise APIError(400, validation_message(e)) from None
    refuse_unsupported(body)  # (OpenAI's fields WAR does not implement, but neutral)
    return body


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


def _routing(headers: Mapping[str, str], rid: str | None, trajectory_id: str | None,
             group_id: str | None, priority: float | None
             ) -> tuple[str, str | None, str | None, float]:
    """A request's id, trajectory, group and priority: the body's values, else the
    routing headers' (``X-Request-Id``, ``X-Trajectory-Id``, ``X-Group-Id``,
    ``X-Priority``), else a new id and priority 0."""
    rid = rid or headers.get("x-request-id") or _new_request_id()
    trajectory_id = trajectory_id or headers.get("x-trajectory-id")
    group_id = group_id or headers.get("x-group-id")
    if priority is None and "x-priority" in headers:
        try:
            priority = float(headers["x-priority"])
        except ValueError:
            raise APIError(400, f"X-Priority must be a number, got {headers['x-priority']!r}",
                           param="priority") from None
    priority = 0.0 if priority is None else priority
    if not math.isfinite(priority):
        raise APIError(400, f"priority must be finite, got {priority}", param="priority")
    return rid, trajectory_id, group_id, priority


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
    # (missing, ``max_tokens`` reads as the replica's default, 16, as OpenAI's: the
    # router refuses it as it refuses null, for a default it cannot check either)
    if body.max_tokens is None or "max_tokens" not in body.model_fields_set:
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

    rid, trajectory_id, group_id, priority = _routing(
        headers, body.request_id, body.trajectory_id, body.group_id, body.priority)
    prompts = _prompts(body.prompt)
    if trajectory_id is not None and len(prompts) > 1:
        # as the replica refuses it: a trajectory is one line of turns, whose context
        # (held here, and on its replica) each prompt would claim
        raise APIError(400, f"a request of a trajectory (trajectory_id {trajectory_id!r}) "
                       f"takes one prompt, got {len(prompts)}", param="prompt")
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
        choices.append({"index": i, "text": "", "token_ids": r.output_ids,
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


# --------------------------------------------------------------------------- SGLang's /generate

GENERATE_TEXT = ("the router needs token ids (it has no tokenizer): send input_ids, a list "
                 "of ints or a list of such lists")
# SGLang's /generate fields WAR takes; the others are refused unless they hold the value
# that does nothing (``_GENERATE_NEUTRAL``).
_GENERATE_FIELDS = frozenset({"input_ids", "sampling_params", "rid", "return_logprob",
                              "priority", "text", "stream", "return_text_in_logprobs"})
_GENERATE_NEUTRAL: dict[str, tuple[Any, ...]] = {
    "logprob_start_len": (None, -1), "top_logprobs_num": (None, 0)}
_PLAIN_GENERATE = frozenset({"input_ids", "sampling_params"})
_SAMPLING_FIELDS = frozenset({"max_new_tokens", "temperature", "top_p", "top_k", "stop",
                              "stop_token_ids", "ignore_eos", "sampling_seed", "seed"})
# settings that change nothing here (detokenization: the router returns no text) or are
# accepted only at their neutral value
_SAMPLING_NEUTRAL: dict[str, tuple[Any, ...]] = {
    "skip_special_tokens": (None, True, False), "spaces_between_special_tokens": (None, True,
                                                                                   False),
    "no_stop_trim": (None, True, False), "min_p": (None, 0, 0.0),
    "frequency_penalty": (None, 0, 0.0), "presence_penalty": (None, 0, 0.0),
    "repetition_penalty": (None, 1, 1.0), "min_new_tokens": (None, 0), "n": (None, 1),
    "regex": (None,), "json_schema": (None,), "ebnf": (None,), "structural_tag": (None,),
    "logit_bias": (None,), "custom_params": (None,)}
GENERATE_MAX_NEW_TOKENS = 128  # SGLang's default for ``max_new_tokens``


def _check_fields(data: Mapping[str, Any], known: frozenset[str],
                  neutral: Mapping[str, tuple[Any, ...]], where: str) -> None:
    for key, value in data.items():
        if key in known and key not in neutral:
            continue
        allowed = neutral.get(key)
        if allowed is None:
            raise APIError(400, f"{where}{key} is not supported by the WAR router",
                           param=key)
        if not any(value is a or (type(value) is type(a) and value == a) for a in allowed):
            raise APIError(400, f"{where}{key}={value!r} is not supported by the WAR router "
                           f"(only {', '.join(repr(a) for a in allowed)})", param=key)


_GENERATE_SAMPLINGS: dict[tuple[Any, ...], SamplingParams] = {}
_SCALARS = (int, float, bool, str, type(None))


def _sampling_params_key(params: Any) -> tuple[Any, ...] | None:
    """A key for an SGLang ``sampling_params`` object whose values are scalars or lists
    of ints or strings (each with its type: ``1``, ``1.0`` and ``True`` are equal and
    hash alike, but are not accepted alike); ``None`` for anything else."""
    if params is None:
        return ()
    if type(params) is not dict:
        return None
    key: list[Any] = []
    for name, value in params.items():
        kind = type(value)
        if kind is list:
            if not all(type(x) is int or type(x) is str for x in value):
                return None
            key.append((name, tuple((type(x), x) for x in value)))
        elif kind in _SCALARS:
            key.append((name, kind, value))
        else:
            return None
    return tuple(key)


def _generate_sampling(params: Any, eos_token_ids: Sequence[int],
                       logprobs: bool) -> SamplingParams:
    """WAR's ``SamplingParams`` of one SGLang ``sampling_params`` object: checked once
    per distinct object (a run's requests mostly repeat one), then shared."""
    key = _sampling_params_key(params)
    if key is None:
        return _check_generate_sampling(params, eos_token_ids, logprobs)
    full = (key, tuple(eos_token_ids), logprobs)
    sampling = _GENERATE_SAMPLINGS.get(full)
    if sampling is None:
        sampling = _check_generate_sampling(params, eos_token_ids, logprobs)
        if len(_GENERATE_SAMPLINGS) >= _SAMPLING_CACHE_SIZE:
            _GENERATE_SAMPLINGS.clear()
        _GENERATE_SAMPLINGS[full] = sampling
    return sampling


def _check_generate_sampling(params: Any, eos_token_ids: Sequence[int],
                             logprobs: bool) -> SamplingParams:
    """``_generate_sampling`` without the cache: checks every field (``APIError``)."""
    if params is None:
        params = {}
    if not isinstance(params, dict):
        raise APIError(400, "sampling_params must be an object (or a list of them, one per "
                       "prompt)", param="sampling_params")
    _check_fields(params, _SAMPLING_FIELDS, _SAMPLING_NEUTRAL, "sampling_params.")

    def number(key: str, default: float) -> float:
        value = params.get(key)
        if value is None:
            return default
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise APIError(400, f"sampling_params.{key} must be a number, got {value!r}",
                           param=key)
        return value

    def integer(key: str, default: int | None) -> int | None:
        value = params.get(key)
        if value is None:
            return default
        if not is_token(value):
            raise APIError(400, f"sampling_params.{key} must be an int, got {value!r}",
                           param=key)
        return int(value)

    max_new = integer("max_new_tokens", GENERATE_MAX_NEW_TOKENS)
    assert max_new is not None
    if max_new < 1:
        raise APIError(400, f"sampling_params.max_new_tokens must be >= 1, got {max_new}",
                       param="max_new_tokens")
    top_k = integer("top_k", -1)
    assert top_k is not None
    if top_k < -1 or top_k == 0:
        raise APIError(400, f"sampling_params.top_k must be -1 (off) or >= 1, got {top_k}",
                       param="top_k")
    seed = integer("sampling_seed", None)
    if seed is None:
        seed = integer("seed", None)
    ignore_eos = params.get("ignore_eos")
    if ignore_eos is not None and not isinstance(ignore_eos, bool):
        raise APIError(400, f"sampling_params.ignore_eos must be a bool, got {ignore_eos!r}",
                       param="ignore_eos")
    raw_ids = params.get("stop_token_ids")
    if raw_ids is None:  # (not ``or []``: a 0 or a "" is refused, not read as none)
        raw_ids = []
    if not isinstance(raw_ids, list) or not all(is_token(t) and t >= 0 for t in raw_ids):
        raise APIError(400, "sampling_params.stop_token_ids must be a list of token ids >= 0",
                       param="stop_token_ids")
    stop_ids = list(raw_ids)
    if not ignore_eos:
        stop_ids += [t for t in eos_token_ids if t not in stop_ids]
    raw_stop = params.get("stop")
    stop = [raw_stop] if isinstance(raw_stop, str) else [] if raw_stop is None else raw_stop
    if not isinstance(stop, list) or not all(isinstance(x, str) and x for x in stop):
        raise APIError(400, "sampling_params.stop must be a non-empty string or a list of "
                       "them", param="stop")
    try:
        return _sampling(number("temperature", 1.0), number("top_p", 1.0), max(top_k, 0),
                         max_new, tuple(stop_ids), tuple(stop), seed, logprobs)
    except ValueError as e:
        raise APIError(400, str(e)) from None


def build_generate_requests(data: Any, headers: Mapping[str, str],
                            eos_token_ids: Sequence[int] = ()
                            ) -> tuple[list[GenRequest], bool, bool]:
    """SGLang's ``/generate`` body as ``GenRequest``s (one per prompt of ``input_ids``);
    returns them, whether the body was a batch and whether logprobs were asked for.
    Routing keys come from the headers (SGLang's body has none), ``rid`` names the
    request(s), ``priority`` is WAR's (higher first). Raises ``APIError`` (400) for
    what the router refuses."""
    if type(data) is dict and data.keys() <= _PLAIN_GENERATE:
        # the common body, one prompt of plain ids and its sampling object: what the
        # checks below come to for it
        ids = data.get("input_ids")
        params = data.get("sampling_params")
        if type(ids) is list and ids and type(params) is not list and plain_token_ids(ids):
            sampling = _generate_sampling(params, eos_token_ids, False)
            rid, trajectory_id, group_id, prio = _routing(headers, None, None, None, None)
            return [GenRequest(rid, tuple(ids), sampling, trajectory_id, group_id, prio)], \
                False, False
    if not isinstance(data, dict):
        raise APIError(400, "invalid request: the body must be a JSON object")
    if data.get("text") is not None:
        raise APIError(400, GENERATE_TEXT, param="text")
    if data.get("stream"):
        raise APIError(400, "stream=true is not supported", param="stream")
    _check_fields(data, _GENERATE_FIELDS, _GENERATE_NEUTRAL, "")
    if "input_ids" not in data:
        raise APIError(400, GENERATE_TEXT, param="input_ids")
    ids = data["input_ids"]
    batch = isinstance(ids, list) and bool(ids) and isinstance(ids[0], list)
    prompts = _prompts(ids, "input_ids", GENERATE_TEXT)
    logprobs = data.get("return_logprob")
    if logprobs is None:
        logprobs = False
    if not isinstance(logprobs, bool):
        raise APIError(400, f"return_logprob must be a bool, got {logprobs!r}",
                       param="return_logprob")
    params = data.get("sampling_params")
    if isinstance(params, list):
        if len(params) != len(prompts):
            raise APIError(400, f"sampling_params has {len(params)} entries for "
                           f"{len(prompts)} prompts", param="sampling_params")
        samplings = [_generate_sampling(p, eos_token_ids, logprobs) for p in params]
    else:
        samplings = [_generate_sampling(params, eos_token_ids, logprobs)] * len(prompts)
    rids = data.get("rid")
    if isinstance(rids, list):
        if len(rids) != len(prompts) or not all(isinstance(r, str) and r for r in rids):
            raise APIError(400, "rid must be one non-empty string per prompt", param="rid")
        if len(set(rids)) != len(rids):  # (requests in flight are told apart by id)
            dup = next(r for i, r in enumerate(rids) if r in rids[:i])
            raise APIError(400, f"rid must name each prompt once, {dup!r} is repeated",
                           param="rid")
    elif rids is not None and not (isinstance(rids, str) and rids):
        raise APIError(400, f"rid must be a non-empty string, got {rids!r}", param="rid")
    priority = data.get("priority")
    if priority is not None and (isinstance(priority, bool)
                                 or not isinstance(priority, (int, float))):
        raise APIError(400, f"priority must be a number, got {priority!r}", param="priority")
    rid, trajectory_id, group_id, prio = _routing(
        headers, rids if isinstance(rids, str) else None, None, None,
        None if priority is None else float(priority))
    if isinstance(rids, list):
        names: list[str] = rids
    elif len(prompts) == 1:
        names = [rid]
    else:  # a batch under one name (the body's, the header's or a new one): <name>-<i>
        names = [f"{rid}-{i}" for i in range(len(prompts))]
    requests = []
    for prompt, sampling, name in zip(prompts, samplings, names, strict=True):
        try:
            requests.append(GenRequest(name, tuple(prompt), sampling, trajectory_id, group_id,
                                       prio))
        except ValueError as e:
            raise APIError(400, str(e)) from None
    return requests, batch, logprobs


def build_generate_response(results: Sequence[GenResult], replicas: Sequence[str | None],
                            requests: Sequence[GenRequest], batch: bool,
                            want_logprobs: bool) -> Any:
    """SGLang's ``/generate`` answer (a list for a batch): ``text`` is empty (no
    tokenizer), ``output_ids``, and ``meta_info`` with SGLang's ``id``,
    ``finish_reason`` (``{"type": "length", "length": n}``, ``{"type": "stop"}`` with
    the matched stop token id when one ended it, or ``{"type": "abort"}``), token
    counts, ``output_token_logprobs`` (``[logprob, token id, null]``) when asked for,
    and WAR's ``replica`` and ``war`` figures."""
    out = []
    for r, where, req in zip(results, replicas, requests, strict=True):
        if r.finish_reason == "length":
            reason: dict[str, Any] = {"type": "length", "length": len(r.output_ids)}
        elif r.finish_reason == "stop":
            reason = {"type": "stop"}
            if r.output_ids and r.output_ids[-1] in req.sampling.stop_token_ids:
                reason["matched"] = r.output_ids[-1]
        else:
            reason = {"type": "abort"}
        meta: dict[str, Any] = {
            "id": req.request_id, "finish_reason": reason,
            "prompt_tokens": r.num_prompt_tokens, "completion_tokens": len(r.output_ids),
            "cached_tokens": r.num_cached_tokens, "replica": where,
            "war": {"forward_passes": r.num_forward_passes, "draft_tokens": r.num_draft_tokens,
                    "accepted_tokens": r.num_accepted_tokens, "preemptions": r.num_preemptions,
                    "weight_version": r.weight_version, "queue_s": r.queue_s,
                    "total_s": r.total_s}}
        if want_logprobs:
            meta["output_token_logprobs"] = [[finite_logprob(x), t, None]
                                             for x, t in zip(r.logprobs, r.output_ids,
                                                             strict=False)]
        out.append({"text": "", "output_ids": r.output_ids, "meta_info": meta})
    return out if batch else out[0]


async def _generate_all(router: Router, requests: Sequence[GenRequest], hold: bool = True
                        ) -> tuple[list[GenResult], list[str | None]]:
    """Routes every request (``hold``: as ``Router.route``); if one fails, the others are
    cancelled."""
    if len(requests) == 1:  # the common case: no task of its own
        result, where = await router.route(requests[0], None, hold)
        return [result], [where]
    tasks = [asyncio.ensure_future(router.route(r, None, hold)) for r in requests]
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


class RLStepRequest(ForbidExtra):
    rl_step: StrictInt


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

    Render = Callable[[Sequence[GenResult], Sequence[str | None]], bytes]
    Parse = Callable[[bytes, Mapping[str, str]], tuple[list[GenRequest], Render]]

    def parse_completions(raw: bytes, headers: Mapping[str, str]
                          ) -> tuple[list[GenRequest], Render]:
        body = parse_completion_body(raw)
        rid, reqs = build_requests(body, headers, eos)
        want = body.logprobs is not None and body.logprobs is not False
        model = body.model or model_name

        def render(results: Sequence[GenResult], where: Sequence[str | None]) -> bytes:
            return orjson.dumps(build_response(rid, model, results, where, want))
        return reqs, render

    def parse_generate(raw: bytes, headers: Mapping[str, str]
                       ) -> tuple[list[GenRequest], Render]:
        try:
            data = orjson.loads(raw)
        except orjson.JSONDecodeError as e:
            raise APIError(400, f"invalid request: the body is not JSON ({e})") from None
        reqs, batch, want = build_generate_requests(data, headers, eos)

        def render(results: Sequence[GenResult], where: Sequence[str | None]) -> bytes:
            return orjson.dumps(build_generate_response(results, where, reqs, batch, want))
        return reqs, render

    async def serve(parse: Parse, raw: bytes, headers: Mapping[str, str],
                    receive: Receive | None = None,
                    respond: Respond | None = None) -> tuple[int, bytes] | None:
        """Status and JSON body of the answer to a generation call (``parse``: its API's
        body -> requests and the renderer of their results; ``headers``: lower-case
        names). ``receive``: the ASGI channel, to notice the client hanging up; without
        it the caller cancels this on a hang-up (counted as 499). ``respond`` (the
        edge's): a single prompt's success is answered through it as soon as the
        replica has answered, before the router's bookkeeping (``Router.route``'s
        ``deliver``), and None is returned; anything else is returned."""
        t0 = time.perf_counter()
        status = 500
        answered = False
        # SGLang's /generate cannot send a turn's new tokens alone: the router holds no
        # contexts for its trajectories (``Router.route``'s ``hold``)
        hold = parse is not parse_generate
        try:
            try:
                reqs, render = parse(raw, headers)
                if respond is not None and len(reqs) == 1:

                    def deliver(result: GenResult, where: str) -> None:
                        nonlocal status, answered
                        payload = render([result], [where])
                        status, answered = 200, True
                        respond(200, payload)

                    await router.route(reqs[0], deliver, hold)
                    return None
                work = _generate_all(router, reqs, hold)
                results, where = await (work if receive is None
                                        else unless_hung_up(receive, work))
            except UnknownTrajectory as e:  # the client resends the whole context
                raise APIError(409, str(e), code="unknown_trajectory") from None
            except ValueError as e:  # refused by a replica
                raise APIError(400, str(e)) from None
            except NoReplicaAvailable as e:
                raise APIError(503, str(e), "server_error", "no_replica_available") from None
            except ReplicaAuthRefused as e:  # the router's key for it: not the client's fault
                raise APIError(502, str(e), "server_error", "replica_auth_failed") from None
            except ClientDisconnected:
                raise APIError(499, "client closed the request") from None
            except APIError:
                raise
            except Exception as e:  # the router's own failure: report it, keep serving
                raise APIError(500, f"router error: {e!r}", "server_error",
                               "router_error") from None
            payload = render(results, where)
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

    async def answer(raw: bytes, headers: Mapping[str, str], receive: Receive | None,
                     parse: Parse = parse_completions) -> tuple[int, bytes]:
        """``serve`` for the ASGI paths: the answer, returned."""
        out = await serve(parse, raw, headers, receive)
        assert out is not None, "serve returns its answer when given no respond"
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
    authorize = _bearer_check(api_key) if api_key else FastRoute.authorize
    app.state.fast_routes = {
        ("POST", "/v1/completions"): FastRoute(
            handle=lambda raw, headers, respond: serve(parse_completions, raw, headers, None,
                                                       respond),
            too_large=too_large, authorize=authorize),
        ("POST", "/generate"): FastRoute(
            handle=lambda raw, headers, respond: serve(parse_generate, raw, headers, None,
                                                       respond),
            too_large=too_large, authorize=authorize)}

    @app.post("/v1/completions")  # reached only by calls the fast path passes on
    async def create_completion(request: Request) -> Response:
        status, payload = await answer(await request.body(), request.headers,
                                       request.receive)
        return Response(payload, status_code=status, media_type="application/json")

    @app.post("/generate")  # SGLang's native API (``war route`` serves it on the edge)
    async def generate(request: Request) -> Response:
        status, payload = await answer(await request.body(), request.headers,
                                       request.receive, parse_generate)
        return Response(payload, status_code=status, media_type="application/json")

    @app.post("/v1/trajectories/finish")
    async def finish_trajectory(body: FinishRequest) -> dict[str, Any]:
        """The rollout driver reports an ended episode (see ``Router.finish_trajectory``)."""
        if not body.trajectory_id:
            raise APIError(400, "trajectory_id must not be empty", param="trajectory_id")
        held = router.finish_trajectory(body.trajectory_id)
        return {"trajectory_id": body.trajectory_id, "held": held}

    @app.post("/v1/rl_step")
    async def rl_step(body: RLStepRequest) -> dict[str, Any]:
        """RL step ``rl_step`` began: every WAR replica is told (``Router.observe_rl_step``);
        the answer gives each replica's outcome."""
        if body.rl_step < 0:
            raise APIError(400, f"rl_step must be >= 0, got {body.rl_step}", param="rl_step")
        replicas = await router.observe_rl_step(body.rl_step)
        told = [o for o in replicas.values() if o != "unsupported"]
        status = "ok" if told and all(o == "ok" for o in told) else "partial"
        return {"status": status, "rl_step": body.rl_step, "replicas": replicas}

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

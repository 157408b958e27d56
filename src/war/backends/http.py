"""A WAR replica reached over HTTP (``war serve``).

Knows: how a ``GenRequest`` maps onto WAR's ``POST /v1/completions`` body
(token-id prompt, ``ignore_eos`` with the request's own stop token ids, sampling
fields and WAR's trajectory/group/priority/continues fields) and how the answer
maps back to a ``GenResult``; how the replica's answers map to the errors the
router acts on (409 ``unknown_trajectory`` -> ``UnknownTrajectory``, other 4xx ->
``ValueError`` with the server's message, connection errors, timeouts, 5xx and
malformed answers -> ``ReplicaUnavailable``); ``/v1/load``, ``/v1/history`` and
``/health``. One pool of keep-alive connections per backend (``war.backends.h1``),
or the caller's ``httpx.AsyncClient``. A base URL with credentials, a query or a
fragment, and an api_key that would break its header, are refused
(``ValueError``) when the backend is made.

Does not know how the replica generates, nor routing; it never retries (the
router does, elsewhere). The helpers at the bottom are shared with
``war.backends.openai``.
"""

from __future__ import annotations

import asyncio
import functools
import math
import ssl
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, NoReturn
from urllib.parse import urlsplit

import httpx
import orjson

from war.backends import h1
from war.backends.base import CredentialsRefused, ReplicaUnavailable
from war.types import FINISH_REASONS, GenRequest, GenResult, ReplicaLoad, UnknownTrajectory

DEFAULT_TIMEOUT_S = 600.0  # a whole generation; long responses take minutes
DEFAULT_CONNECT_TIMEOUT_S = 5.0
DEFAULT_HEALTH_TIMEOUT_S = 2.0
DEFAULT_MAX_CONNECTIONS = 512


class WarHttpBackend:
    """One ``war serve`` replica at ``base_url`` (e.g. ``http://10.0.0.7:8000``).

    ``timeout_s`` bounds a whole call (read, write, pool wait) and
    ``connect_timeout_s`` the connection; ``health()`` and ``load()`` (probes), and
    ``finish_trajectory()``, use ``health_timeout_s``.
    A ``client`` passed in lends its transport, pool and settings (these timeouts
    still apply to each call) and is not closed by ``close()``.
    """

    def __init__(
        self,
        name: str,
        base_url: str,
        api_key: str | None = None,
        timeout_s: float = DEFAULT_TIMEOUT_S,
        client: httpx.AsyncClient | None = None,
        *,
        model: str | None = None,
        connect_timeout_s: float = DEFAULT_CONNECT_TIMEOUT_S,
        health_timeout_s: float = DEFAULT_HEALTH_TIMEOUT_S,
        max_connections: int = DEFAULT_MAX_CONNECTIONS,
    ) -> None:
        self.name = check_name(name)
        self.base_url = check_base_url(base_url)
        self.model = model
        self._http = HttpChannel(self.base_url, api_key, timeout_s, connect_timeout_s,
                                 health_timeout_s, max_connections, client)

    def __repr__(self) -> str:
        return f"WarHttpBackend({self.name!r}, {self.base_url!r})"

    def request_body(self, request: GenRequest) -> dict[str, Any]:
        """The ``/v1/completions`` body of ``request``."""
        sp = request.sampling
        body: dict[str, Any] = {
            "prompt": request.prompt_ids,  # (orjson writes a tuple as an array)
            "max_tokens": sp.max_tokens,
            "temperature": float(sp.temperature),
            "top_p": float(sp.top_p),
            "top_k": sp.top_k if sp.top_k > 0 else -1,
            # The request's stop ids are the whole set: the replica adds no EOS of its own.
            "ignore_eos": True,
            "stop_token_ids": sp.stop_token_ids,
            "request_id": request.request_id,
            "priority": float(request.priority),
            "continues": request.continues,
        }
        if self.model is not None:
            body["model"] = self.model
        if sp.stop:
            body["stop"] = list(sp.stop)
        if sp.seed is not None:
            body["seed"] = sp.seed
        if sp.logprobs:
            body["logprobs"] = 1
        if request.trajectory_id is not None:
            body["trajectory_id"] = request.trajectory_id
        if request.group_id is not None:
            body["group_id"] = request.group_id
        return body

    async def generate(self, request: GenRequest) -> GenResult:
        data = await self._http.post_json("/v1/completions", self.request_body(request),
                                          self.name)
        try:
            return parse_completion(request, data)
        except (KeyError, IndexError, TypeError, ValueError, AttributeError) as e:
            raise ReplicaUnavailable(
                f"{self.name}: malformed completion response: {type(e).__name__}: {e}"
            ) from e

    async def load(self) -> ReplicaLoad:
        # a probe, like ``health()``: bounded by the health timeout, not by a whole
        # generation's (a replica that accepts connections but never answers is down)
        data = await self._http.get_json("/v1/load", self.name,
                                         timeout_s=self._http.health_timeout_s)
        try:
            return ReplicaLoad(
                num_running=int(data["num_running"]),
                num_waiting=int(data["num_waiting"]),
                tokens_in_flight=int(data["tokens_in_flight"]),
                kv_blocks_used=int(data["kv_blocks_used"]),
                kv_blocks_total=int(data["kv_blocks_total"]),
                block_size=int(data["block_size"]),
                spec_tokens_per_seq=float(data.get("spec_tokens_per_seq", 0.0)),
                weight_version=int(data.get("weight_version", 0)),
            )
        except (KeyError, TypeError, ValueError, AttributeError) as e:
            raise ReplicaUnavailable(f"{self.name}: malformed /v1/load response: {e!r}") from e

    async def health(self) -> bool:
        return await self._http.health("/health")

    async def models(self) -> Any:
        """The replica's ``GET /v1/models`` answer (JSON), a probe bounded by the health
        timeout; the backend errors as for any call (``ReplicaUnavailable`` when it does
        not answer, ``CredentialsRefused`` for a refused key)."""
        return await self._http.get_json("/v1/models", self.name,
                                         timeout_s=self._http.health_timeout_s)

    async def add_history(self, items: Sequence[tuple[Sequence[int], str | None]]) -> None:
        payload = [{"token_ids": [int(t) for t in ids], "group_id": group}
                   for ids, group in items if len(ids) > 0]
        if payload:
            await self._http.post_json("/v1/history", {"items": payload}, self.name)

    async def finish_trajectory(self, trajectory_id: str) -> bool:
        """The trajectory ended: the replica frees KV it holds for it
        (``POST /v1/trajectories/finish``); returns whether it held any."""
        if not isinstance(trajectory_id, str) or not trajectory_id:
            raise ValueError(f"trajectory_id must be a non-empty string, got {trajectory_id!r}")
        # (bounded like a probe: the rollout driver awaits it as each episode ends, a
        # failed one too, and it only frees a hold that expires anyway)
        body = await self._http.post_json("/v1/trajectories/finish",
                                          {"trajectory_id": trajectory_id}, self.name,
                                          timeout_s=self._http.health_timeout_s)
        held = body.get("held", False) if isinstance(body, dict) else None
        if not isinstance(held, bool):
            raise ReplicaUnavailable(
                f"{self.name}: malformed /v1/trajectories/finish response: expected an "
                f"object with a boolean 'held', got {str(body)[:200]}")
        return held

    async def observe_rl_step(self, rl_step: int) -> None:
        """Tells the replica that RL step ``rl_step`` began (its draft history window
        slides); ``ValueError`` if the replica refuses the step (e.g. it went back)."""
        if isinstance(rl_step, bool) or not isinstance(rl_step, int) or rl_step < 0:
            raise ValueError(f"rl_step must be an int >= 0, got {rl_step!r}")
        await self._http.post_json("/v1/rl_step", {"rl_step": rl_step}, self.name)

    async def close(self) -> None:
        await self._http.close()


# ---------------------------------------------------------------- shared helpers


def check_name(name: str) -> str:
    if not isinstance(name, str) or not name:
        raise ValueError(f"a backend name must be a non-empty string, got {name!r}")
    return name


def check_base_url(base_url: str) -> str:
    """``base_url`` without its trailing slash; ValueError unless it is http(s)://host..."""
    try:
        url = httpx.URL(base_url)
    except (httpx.InvalidURL, TypeError) as e:
        raise ValueError(f"base_url {base_url!r} is not a URL: {e}") from None
    if url.scheme not in ("http", "https") or not url.host:
        raise ValueError(f"base_url must be http://host[:port][/prefix], got {base_url!r}")
    # (each would be dropped unseen, or put the call's path inside the query)
    if url.userinfo:
        raise ValueError("base_url must not hold credentials (pass api_key)")
    if "?" in base_url or "#" in base_url:
        raise ValueError(f"base_url takes no query or fragment, got {base_url!r}")
    return base_url.rstrip("/")


def _check_api_key(api_key: str | None) -> None:
    """A key that would break the Authorization header (a line break read from a
    file, say) is refused here rather than sent: it would inject header lines."""
    if api_key is None:
        return
    if not isinstance(api_key, str):
        raise ValueError(f"api_key must be a string or None, got {type(api_key).__name__}")
    if any((c < " " and c != "\t") or c >= "\x7f" for c in api_key):
        raise ValueError("api_key holds a control or non-ASCII character "
                         "(a trailing newline?)")


def _check_positive(what: str, value: float) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0 \
            or math.isinf(value):
        raise ValueError(f"{what} must be a finite number > 0, got {value!r}")


@dataclass(frozen=True)
class Answer:
    """A replica's answer, read whole: status, reason phrase, body, and the call it
    answers (for error messages)."""

    status_code: int
    reason: str
    content: bytes
    method: str
    path: str

    @property
    def text(self) -> str:
        return self.content.decode("utf-8", errors="replace")

    def json(self) -> Any:
        """The body as JSON (``ValueError`` if it is not)."""
        return orjson.loads(self.content)


def error_message(answer: Answer) -> tuple[str, str | None]:
    """The message and code of an error answer (OpenAI ``{"error": {...}}``, FastAPI
    ``{"detail": ...}`` or plain text)."""
    try:
        data = answer.json()
    except ValueError:
        return answer.text.strip()[:500] or answer.reason, None
    if isinstance(data, Mapping):
        err = data.get("error")
        if isinstance(err, Mapping):
            code = err.get("code")
            return str(err.get("message", err)), None if code is None else str(code)
        if isinstance(err, str):
            return err, None
        if "detail" in data:
            return str(data["detail"]), None
        if "message" in data:
            return str(data["message"]), None
    return str(data)[:500], None


def raise_for_answer(answer: Answer, name: str) -> None:
    """Maps an unsuccessful answer to the backend errors (returns on 2xx)."""
    status = answer.status_code
    if 200 <= status < 300:
        return
    message, code = error_message(answer)
    where = f"{name}: {answer.method} {answer.path}"
    if status == 409 and code == "unknown_trajectory":
        raise UnknownTrajectory(message)
    if status in (401, 403):
        raise CredentialsRefused(name, status, f"{answer.method} {answer.path}", message)
    if 400 <= status < 500:
        raise ValueError(f"{where} refused ({status}): {message}")
    raise ReplicaUnavailable(f"{where} failed ({status}): {message}")


# What a failed call can raise below the HTTP layer: connection refused, reset or
# closed, a timeout, an answer that is not HTTP.
TRANSPORT_ERRORS = (httpx.RequestError, h1.TransportError, OSError, TimeoutError)


def transport_failure(name: str, path: str, exc: BaseException) -> NoReturn:
    """Raises ``ReplicaUnavailable`` for a connection error or timeout."""
    timed_out = isinstance(exc, (httpx.TimeoutException, TimeoutError))
    kind = "timed out" if timed_out else "unreachable"
    detail = str(exc) or type(exc).__name__
    raise ReplicaUnavailable(f"{name}: {path} {kind}: {detail}") from exc


@functools.cache
def _tls_context() -> ssl.SSLContext:
    """One verifying TLS context for every client (loading CA certificates is slow)."""
    return ssl.create_default_context()


class HttpChannel:
    """Keep-alive HTTP calls to one base URL, with the error mapping above.

    By default calls go through ``war.backends.h1``'s pool (up to ``max_connections``
    connections, made in the event loop of the first call, and made again if a later
    call runs in another loop). A ``client`` (``httpx.AsyncClient``) passed in is used
    instead, with its own transport and pool (e.g. an ASGI app in process), and is not
    closed by ``close()``."""

    def __init__(self, base_url: str, api_key: str | None, timeout_s: float,
                 connect_timeout_s: float, health_timeout_s: float, max_connections: int,
                 client: httpx.AsyncClient | None) -> None:
        _check_positive("timeout_s", timeout_s)
        _check_positive("connect_timeout_s", connect_timeout_s)
        _check_positive("health_timeout_s", health_timeout_s)
        if isinstance(max_connections, bool) or not isinstance(max_connections, int) \
                or max_connections < 1:
            raise ValueError(f"max_connections must be an int >= 1, got {max_connections!r}")
        _check_api_key(api_key)
        self.base_url = base_url
        self.timeout_s = float(timeout_s)
        self.connect_timeout_s = float(min(connect_timeout_s, timeout_s))
        self.health_timeout_s = float(health_timeout_s)
        self.max_connections = max_connections
        self.headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._json_headers = {**self.headers, "Content-Type": "application/json"}
        self._h1_headers = tuple(self.headers.items())
        self._h1_json_headers = tuple(self._json_headers.items())
        url = urlsplit(base_url)
        self._host = url.hostname or ""
        self._tls = url.scheme == "https"
        # (``or`` would turn an explicit port 0 into the default one)
        self._port = url.port if url.port is not None else (443 if self._tls else 80)
        # (percent-encoded as httpx sends it: a raw space would split the request line)
        self._prefix = httpx.URL(base_url).raw_path.decode("ascii").rstrip("/")
        self.client = client
        self._pool: h1.Pool | None = None
        self._pool_loop: asyncio.AbstractEventLoop | None = None
        self._closed = False

    def url(self, path: str) -> str:
        return self.base_url + path

    def _h1(self) -> h1.Pool:
        loop = asyncio.get_running_loop()
        if self._pool is None or self._pool_loop is not loop:
            # (a pool of an earlier, ended loop is dropped: its loop can no longer close
            # its sockets; they close when collected)
            self._pool = h1.Pool(self._host, self._port,
                                 tls=_tls_context() if self._tls else None,
                                 max_connections=self.max_connections)
            self._pool_loop = loop
        return self._pool

    async def send(self, method: str, path: str, name: str, *,
                   json: object = None, timeout_s: float | None = None) -> Answer:
        """One call; transport failures raise ``ReplicaUnavailable``; the answer is
        returned whatever its status."""
        if self._closed:
            raise ReplicaUnavailable(f"{name}: {path} unreachable: the backend is closed")
        total = self.timeout_s if timeout_s is None else timeout_s
        connect = min(self.connect_timeout_s, total)
        try:
            content = None if json is None else orjson.dumps(json)
            if self.client is not None:
                # (httpx's timeouts bound each read and write, not the whole call)
                async with asyncio.timeout(total):
                    response = await self.client.request(
                        method, self.url(path), content=content,
                        headers=self.headers if json is None else self._json_headers,
                        timeout=httpx.Timeout(total, connect=connect))
                return Answer(response.status_code, response.reason_phrase, response.content,
                              method, path)
            answer = await self._h1().request(
                method, self._prefix + path, body=content,
                headers=self._h1_headers if json is None else self._h1_json_headers,
                timeout_s=total, connect_timeout_s=connect)
            return Answer(answer.status, answer.reason, answer.body, method, path)
        except TRANSPORT_ERRORS as e:
            transport_failure(name, path, e)

    async def post_json(self, path: str, body: Mapping[str, Any], name: str,
                        timeout_s: float | None = None) -> Any:
        """A POST whose 2xx JSON answer is returned (``timeout_s``: the call's bound,
        None: ``timeout_s`` of the channel)."""
        if self.client is not None or self._closed:
            answer = await self.send("POST", path, name, json=body, timeout_s=timeout_s)
        else:  # ``send`` inlined: this is a router's call for every request it routes
            total = self.timeout_s if timeout_s is None else timeout_s
            try:
                content = orjson.dumps(body)
                got = await self._h1().request(
                    "POST", self._prefix + path, body=content, headers=self._h1_json_headers,
                    timeout_s=total, connect_timeout_s=min(self.connect_timeout_s, total))
            except TRANSPORT_ERRORS as e:
                transport_failure(name, path, e)
            if got.status == 200:  # the common answer: no ``Answer`` built
                try:
                    return orjson.loads(got.body)
                except ValueError as e:
                    raise ReplicaUnavailable(
                        f"{name}: {path} answered with invalid JSON") from e
            answer = Answer(got.status, got.reason, got.body, "POST", path)
        raise_for_answer(answer, name)
        return self._json(answer, path, name)

    async def get_json(self, path: str, name: str, timeout_s: float | None = None) -> Any:
        """A GET whose 2xx JSON answer is returned (``timeout_s``: the call's bound,
        None: ``timeout_s`` of the channel)."""
        answer = await self.send("GET", path, name, timeout_s=timeout_s)
        raise_for_answer(answer, name)
        return self._json(answer, path, name)

    async def get_unchecked(self, path: str, name: str) -> Answer:
        """A short GET whose answer is returned whatever its status (transport
        failures still raise ``ReplicaUnavailable``)."""
        return await self.send("GET", path, name, timeout_s=self.health_timeout_s)

    async def health(self, path: str) -> bool:
        try:
            answer = await self.send("GET", path, "health", timeout_s=self.health_timeout_s)
        except Exception:  # health() never raises
            return False
        return answer.status_code == 200

    @staticmethod
    def _json(answer: Answer, path: str, name: str) -> Any:
        try:
            return answer.json()
        except ValueError as e:
            raise ReplicaUnavailable(f"{name}: {path} answered with invalid JSON") from e

    async def close(self) -> None:
        """Closes the connections this channel made (not a ``client`` passed in);
        later calls raise ``ReplicaUnavailable``."""
        self._closed = True
        pool, self._pool = self._pool, None
        if pool is not None:
            pool.close()


def finish_reason(value: object) -> str:
    """A server's finish reason as one of ``FINISH_REASONS`` (``eos``, stop strings,
    tool calls... are all ``stop``)."""
    if isinstance(value, str) and value in FINISH_REASONS:
        return value
    return "abort" if value is None else "stop"


def logprob(value: Any) -> float:
    """A JSON log-probability (``null``: not a number)."""
    return float("nan") if value is None else float(value)


_INT = {int}  # the types of a list of plain ints (empty: none)


def json_list(value: Any, where: str) -> list[Any]:
    """``value`` if it is a JSON array; ``ValueError`` naming ``where`` if not (a
    string's characters or an object's keys would pass for its items)."""
    if type(value) is not list:
        raise ValueError(f"{where} must be a list, got {type(value).__name__}")
    return value


def _token_id(value: Any, where: str) -> int:
    """A JSON number that is a whole number as an int (``5.0``: 5); ``ValueError``
    for anything else (``5.5``, ``true``, ``"7"``: a broken answer, not token 5, 1, 7)."""
    if type(value) is int:
        return value
    if type(value) is float and value.is_integer():
        return int(value)
    raise ValueError(f"{where} holds {value!r}, not a token id")


def token_ids(value: Any, where: str) -> tuple[int, ...]:
    """A JSON array of token ids as a tuple of ints (whole numbers written as floats
    are converted one by one); ``ValueError`` if it is not an array or holds anything
    else, or a negative id."""
    items = json_list(value, where)
    ids = tuple(items) if set(map(type, items)) <= _INT else tuple(
        _token_id(t, where) for t in items)
    if ids and min(ids) < 0:
        raise ValueError(f"{where} holds a negative token id ({min(ids)})")
    return ids


def parse_completion(request: GenRequest, data: Mapping[str, Any]) -> GenResult:
    """A WAR ``/v1/completions`` answer (one choice) as a ``GenResult``."""
    choice = data["choices"][0]
    output = token_ids(choice["token_ids"], "choices[0].token_ids")
    logprobs: tuple[float, ...] = ()
    if request.sampling.logprobs:
        lp = choice.get("logprobs")
        if lp is None or lp.get("token_logprobs") is None:
            raise ValueError("logprobs were asked for but not returned")
        logprobs = tuple(logprob(x) for x in json_list(lp["token_logprobs"],
                                                       "logprobs.token_logprobs"))
        if len(logprobs) != len(output):
            raise ValueError(f"{len(logprobs)} logprobs for {len(output)} tokens")
    usage = data.get("usage") or {}
    details = usage.get("prompt_tokens_details") or {}
    war = data.get("war") or {}
    return GenResult(
        request_id=request.request_id,
        output_ids=output,
        logprobs=logprobs,
        finish_reason=finish_reason(choice.get("finish_reason")),
        num_prompt_tokens=int(usage.get("prompt_tokens", len(request.prompt_ids))),
        num_cached_tokens=int(details.get("cached_tokens") or 0),
        num_forward_passes=int(war.get("forward_passes", 0)),
        num_draft_tokens=int(war.get("draft_tokens", 0)),
        num_accepted_tokens=int(war.get("accepted_tokens", 0)),
        num_preemptions=int(war.get("preemptions", 0)),
        weight_version=int(war.get("weight_version", 0)),
        queue_s=float(war.get("queue_s", 0.0)),
        total_s=float(war.get("total_s", 0.0)),
    )

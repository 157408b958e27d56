"""A WAR replica reached over HTTP (``war serve``).

Knows: how a ``GenRequest`` maps onto WAR's ``POST /v1/completions`` body
(token-id prompt, ``ignore_eos`` with the request's own stop token ids, sampling
fields and WAR's trajectory/group/priority/continues fields) and how the answer
maps back to a ``GenResult``; how the replica's answers map to the errors the
router acts on (409 ``unknown_trajectory`` -> ``UnknownTrajectory``, other 4xx ->
``ValueError`` with the server's message, connection errors, timeouts, 5xx and
malformed answers -> ``ReplicaUnavailable``); ``/v1/load``, ``/v1/history`` and
``/health``. One pooled keep-alive ``httpx.AsyncClient`` per backend (or the
caller's).

Does not know how the replica generates, nor routing; it never retries (the
router does, elsewhere). The helpers at the bottom are shared with
``war.backends.openai``.
"""

from __future__ import annotations

import functools
import math
import ssl
from collections.abc import Mapping, Sequence
from typing import Any, NoReturn

import httpx

from war.backends.base import ReplicaUnavailable
from war.types import FINISH_REASONS, GenRequest, GenResult, ReplicaLoad, UnknownTrajectory

DEFAULT_TIMEOUT_S = 600.0  # a whole generation; long responses take minutes
DEFAULT_CONNECT_TIMEOUT_S = 5.0
DEFAULT_HEALTH_TIMEOUT_S = 2.0
DEFAULT_MAX_CONNECTIONS = 512


class WarHttpBackend:
    """One ``war serve`` replica at ``base_url`` (e.g. ``http://10.0.0.7:8000``).

    ``timeout_s`` bounds a whole call (read, write, pool wait) and
    ``connect_timeout_s`` the connection; ``health()`` uses ``health_timeout_s``.
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
            "prompt": list(request.prompt_ids),
            "max_tokens": sp.max_tokens,
            "temperature": float(sp.temperature),
            "top_p": float(sp.top_p),
            "top_k": sp.top_k if sp.top_k > 0 else -1,
            # The request's stop ids are the whole set: the replica adds no EOS of its own.
            "ignore_eos": True,
            "stop_token_ids": list(sp.stop_token_ids),
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
        data = await self._http.get_json("/v1/load", self.name)
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

    async def add_history(self, items: Sequence[tuple[Sequence[int], str | None]]) -> None:
        payload = [{"token_ids": [int(t) for t in ids], "group_id": group}
                   for ids, group in items if len(ids) > 0]
        if payload:
            await self._http.post_json("/v1/history", {"items": payload}, self.name)

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
    return base_url.rstrip("/")


def _check_positive(what: str, value: float) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0 \
            or math.isinf(value):
        raise ValueError(f"{what} must be a finite number > 0, got {value!r}")


def error_message(response: httpx.Response) -> tuple[str, str | None]:
    """The message and code of an error answer (OpenAI ``{"error": {...}}``, FastAPI
    ``{"detail": ...}`` or plain text)."""
    try:
        data = response.json()
    except ValueError:
        return response.text.strip()[:500] or response.reason_phrase, None
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


def raise_for_answer(response: httpx.Response, name: str) -> None:
    """Maps an unsuccessful answer to the backend errors (returns on 2xx)."""
    status = response.status_code
    if 200 <= status < 300:
        return
    message, code = error_message(response)
    where = f"{name}: {response.request.method} {response.request.url.path}"
    if status == 409 and code == "unknown_trajectory":
        raise UnknownTrajectory(message)
    if 400 <= status < 500:
        raise ValueError(f"{where} refused ({status}): {message}")
    raise ReplicaUnavailable(f"{where} failed ({status}): {message}")


def transport_failure(name: str, path: str, exc: httpx.RequestError) -> NoReturn:
    """Raises ``ReplicaUnavailable`` for a connection error or timeout."""
    kind = "timed out" if isinstance(exc, httpx.TimeoutException) else "unreachable"
    detail = str(exc) or type(exc).__name__
    raise ReplicaUnavailable(f"{name}: {path} {kind}: {detail}") from exc


@functools.cache
def _tls_context() -> ssl.SSLContext:
    """One verifying TLS context for every client (loading CA certificates is slow)."""
    return ssl.create_default_context()


class HttpChannel:
    """Pooled keep-alive clients bound to one base URL, with the error mapping above.

    A channel that makes its own clients splits its connections over up to
    ``POOL_SHARDS`` of them and sends each call through the one with the fewest calls
    in flight: httpcore's pool checks every connection it holds (a socket poll for
    each idle one) whenever a request starts or ends, which grows with the square of
    the concurrency, and a hundred agent turns in flight to one replica made that the
    client's main cost. A ``client`` passed in is used alone."""

    POOL_SHARDS = 8

    def __init__(self, base_url: str, api_key: str | None, timeout_s: float,
                 connect_timeout_s: float, health_timeout_s: float, max_connections: int,
                 client: httpx.AsyncClient | None) -> None:
        _check_positive("timeout_s", timeout_s)
        _check_positive("connect_timeout_s", connect_timeout_s)
        _check_positive("health_timeout_s", health_timeout_s)
        if isinstance(max_connections, bool) or not isinstance(max_connections, int) \
                or max_connections < 1:
            raise ValueError(f"max_connections must be an int >= 1, got {max_connections!r}")
        self.base_url = base_url
        self.timeout = httpx.Timeout(timeout_s, connect=min(connect_timeout_s, timeout_s))
        self.health_timeout = httpx.Timeout(health_timeout_s)
        self.headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._owns_client = client is None
        if client is not None:
            self.clients = [client]
        else:
            shards = min(self.POOL_SHARDS, max_connections)
            per = max_connections // shards
            self.clients = [
                httpx.AsyncClient(timeout=self.timeout, verify=_tls_context(), limits=httpx.Limits(
                    max_connections=per, max_keepalive_connections=per))
                for _ in range(shards)]
        self._in_flight = [0] * len(self.clients)

    @property
    def client(self) -> httpx.AsyncClient:
        """The first (with a client passed in: the only) client."""
        return self.clients[0]

    def url(self, path: str) -> str:
        return self.base_url + path

    async def send(self, method: str, path: str, name: str, *,
                   json: object = None, timeout: httpx.Timeout | None = None) -> httpx.Response:
        """One call; transport failures raise ``ReplicaUnavailable``; the answer is
        returned whatever its status."""
        shard = min(range(len(self.clients)), key=self._in_flight.__getitem__)
        self._in_flight[shard] += 1
        try:
            return await self.clients[shard].request(
                method, self.url(path), json=json, headers=self.headers,
                timeout=timeout if timeout is not None else self.timeout)
        except httpx.RequestError as e:  # connect/read/write, timeouts, protocol, decoding
            transport_failure(name, path, e)
        finally:
            self._in_flight[shard] -= 1

    async def post_json(self, path: str, body: Mapping[str, Any], name: str) -> Any:
        response = await self.send("POST", path, name, json=body)
        raise_for_answer(response, name)
        return self._json(response, path, name)

    async def get_json(self, path: str, name: str) -> Any:
        response = await self.send("GET", path, name)
        raise_for_answer(response, name)
        return self._json(response, path, name)

    async def get_unchecked(self, path: str, name: str) -> httpx.Response:
        """A short GET whose answer is returned whatever its status (transport
        failures still raise ``ReplicaUnavailable``)."""
        return await self.send("GET", path, name, timeout=self.health_timeout)

    async def health(self, path: str) -> bool:
        try:
            response = await self.client.get(self.url(path), headers=self.headers,
                                             timeout=self.health_timeout)
        except Exception:  # health() never raises
            return False
        return response.status_code == 200

    @staticmethod
    def _json(response: httpx.Response, path: str, name: str) -> Any:
        try:
            return response.json()
        except ValueError as e:
            raise ReplicaUnavailable(f"{name}: {path} answered with invalid JSON") from e

    async def close(self) -> None:
        if self._owns_client:
            for client in self.clients:
                await client.aclose()


def finish_reason(value: object) -> str:
    """A server's finish reason as one of ``FINISH_REASONS`` (``eos``, stop strings,
    tool calls... are all ``stop``)."""
    if isinstance(value, str) and value in FINISH_REASONS:
        return value
    return "abort" if value is None else "stop"


def logprob(value: Any) -> float:
    """A JSON log-probability (``null``: not a number)."""
    return float("nan") if value is None else float(value)


def parse_completion(request: GenRequest, data: Mapping[str, Any]) -> GenResult:
    """A WAR ``/v1/completions`` answer (one choice) as a ``GenResult``."""
    choice = data["choices"][0]
    output = tuple(int(t) for t in choice["token_ids"])
    logprobs: tuple[float, ...] = ()
    lp = choice.get("logprobs")
    if request.sampling.logprobs and lp is not None:
        logprobs = tuple(logprob(x) for x in lp["token_logprobs"])
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

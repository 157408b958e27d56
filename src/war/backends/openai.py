"""A vLLM or SGLang server as a replica, over the API it already has.

Knows: for ``server="vllm"``, the OpenAI-compatible ``POST /v1/completions`` with a
token-id prompt, asking for token ids back (``return_token_ids``, vLLM >= 0.10;
else ``logprobs.tokens`` as ``"token_id:123"`` through
``return_tokens_as_token_ids``; both are sent and whichever comes back is parsed)
and logprobs (``logprobs: 1``) when the request wants them or the server has not yet
shown that it returns the token ids themselves (the fallback needs them);
``skip_special_tokens: false``, ``ignore_eos`` with the request's own stop token
ids, ``top_k`` (``0`` -> ``-1``), ``seed``. For ``server="sglang"``, SGLang's native
``POST /generate`` (``input_ids`` in, ``output_ids`` and
``meta_info.output_token_logprobs`` out; ``return_logprob`` on the same terms as
vLLM's ``logprobs``). Logprobs cost the server work and the answer bytes, so once an
answer has carried its token ids directly, requests that do not want logprobs stop
asking for them; if a later answer comes without its ids, the call is made once more
asking for logprobs (nothing is lost) and the backend asks for them again from then
on (``logprob_fallbacks`` counts such calls). The error mapping is the one of
``war.backends.http``. Load comes from what this backend has in flight (requests,
prompt tokens) and, best effort, from the server's Prometheus ``/metrics``
(vLLM's ``vllm:num_requests_running``/``waiting``, ``kv_cache_usage_perc`` or
``gpu_cache_usage_perc`` and ``cache_config_info``; SGLang's
``sglang:num_running_reqs``/``num_queue_reqs``/``token_usage``/
``max_total_num_tokens``). A result's ``total_s`` is the round trip seen here;
the speculation and queue figures of WAR's own replicas are left at zero.

Does not know trajectories: these servers hold none, so a ``continues`` request is
refused at once with ``UnknownTrajectory`` (the router then sends the whole
context; their prefix caches make that cheap). Shared draft history is not
forwarded (``add_history`` does nothing: vLLM's suffix decoding keeps its own
cache). WAR's priority is dropped unless ``priority_scheduling`` is set (then
vLLM gets ``priority = -round(priority)``, lower first, and SGLang
``priority = round(priority)``, higher first by default; the server must be started
with priority scheduling). When the KV cache is unknown, ``load()`` reports
``kv_blocks_used = kv_blocks_total = 0`` (and ``block_size = 0``): read a zero
total as "unknown", not "full".
"""

from __future__ import annotations

import contextlib
import math
import re
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import httpx

from war.backends.base import ReplicaUnavailable
from war.backends.http import (
    DEFAULT_CONNECT_TIMEOUT_S,
    DEFAULT_HEALTH_TIMEOUT_S,
    DEFAULT_MAX_CONNECTIONS,
    DEFAULT_TIMEOUT_S,
    HttpChannel,
    check_base_url,
    check_name,
    finish_reason,
    json_list,
    logprob,
    token_ids,
)
from war.types import GenRequest, GenResult, ReplicaLoad, UnknownTrajectory

SERVERS = ("vllm", "sglang")
_TOKEN_ID = re.compile(r"^token_id:(\d+)$")
_SAMPLE = re.compile(r"^([A-Za-z_:][A-Za-z0-9_:]*)(?:\{(.*)\})?\s+(\S+)(?:\s+\S+)?\s*$")
_LABEL = re.compile(r'([A-Za-z_][A-Za-z0-9_]*)\s*=\s*"((?:[^"\\]|\\.)*)"')


# ---------------------------------------------------------------- /metrics


@dataclass(frozen=True)
class ServerMetrics:
    """What a server's ``/metrics`` says about its load (``None``: not reported)."""

    num_running: int | None = None
    num_waiting: int | None = None
    kv_usage: float | None = None  # fraction of the KV cache in use, in [0, 1]
    kv_blocks_total: int | None = None
    block_size: int | None = None

    def __post_init__(self) -> None:
        if self.kv_usage is not None and not 0.0 <= self.kv_usage <= 1.0:
            raise ValueError(f"kv_usage must be in [0, 1], got {self.kv_usage}")


def parse_prometheus(text: str) -> dict[str, list[tuple[dict[str, str], float]]]:
    """Samples of a Prometheus text exposition by metric name; lines that do not
    parse are skipped (best effort)."""
    out: dict[str, list[tuple[dict[str, str], float]]] = {}
    for raw in text.splitlines():
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        m = _SAMPLE.match(line)
        if m is None:
            continue
        try:
            value = float(m.group(3))
        except ValueError:
            continue
        labels = {k: v for k, v in _LABEL.findall(m.group(2) or "")}
        out.setdefault(m.group(1), []).append((labels, value))
    return out


def _total(samples: Mapping[str, list[tuple[dict[str, str], float]]], *names: str
           ) -> float | None:
    """The sum over label sets of the first of ``names`` that is present and finite."""
    for name in names:
        values = [v for _, v in samples.get(name, ()) if math.isfinite(v)]
        if values:
            return sum(values)
    return None


def _mean(samples: Mapping[str, list[tuple[dict[str, str], float]]], *names: str
          ) -> float | None:
    for name in names:
        values = [v for _, v in samples.get(name, ()) if math.isfinite(v)]
        if values:
            return sum(values) / len(values)
    return None


def _int_label(samples: Mapping[str, list[tuple[dict[str, str], float]]], name: str,
               label: str) -> int | None:
    for labels, _ in samples.get(name, ()):
        try:
            return int(labels[label])
        except (KeyError, ValueError):
            continue
    return None


def metrics_from_text(text: str) -> ServerMetrics:
    """The load figures of a vLLM or SGLang ``/metrics`` page."""
    s = parse_prometheus(text)
    running = _total(s, "vllm:num_requests_running", "sglang:num_running_reqs")
    waiting = _total(s, "vllm:num_requests_waiting", "sglang:num_queue_reqs")
    usage = _mean(s, "vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc",
                  "sglang:token_usage")
    blocks = _int_label(s, "vllm:cache_config_info", "num_gpu_blocks")
    block_size = _int_label(s, "vllm:cache_config_info", "block_size")
    if blocks is None:
        tokens = _total(s, "sglang:max_total_num_tokens")
        if tokens is not None and tokens >= 1:  # SGLang's pool counts tokens: blocks of 1
            blocks, block_size = int(tokens), 1
    return ServerMetrics(
        num_running=None if running is None else round(running),
        num_waiting=None if waiting is None else round(waiting),
        kv_usage=None if usage is None else min(max(usage, 0.0), 1.0),
        kv_blocks_total=blocks if blocks is not None and blocks >= 1 else None,
        block_size=block_size if block_size is not None and block_size >= 1 else None,
    )


# ---------------------------------------------------------------- responses


def _token_ids_from_strings(tokens: Sequence[Any]) -> tuple[int, ...]:
    ids = []
    for tok in tokens:
        m = _TOKEN_ID.match(tok) if isinstance(tok, str) else None
        if m is None:
            raise ValueError(f"logprobs.tokens holds {tok!r}, not 'token_id:<id>' "
                             "(the server ignored return_tokens_as_token_ids)")
        ids.append(int(m.group(1)))
    return tuple(ids)


def parse_vllm_completion(request: GenRequest, data: Mapping[str, Any],
                          total_s: float = 0.0) -> GenResult:
    """A vLLM ``/v1/completions`` answer as a ``GenResult``: token ids from
    ``choices[0].token_ids``, else from ``logprobs.tokens`` (``"token_id:<id>"``);
    ``total_s``: the round trip, as measured by the caller."""
    choice = data["choices"][0]
    lp = choice.get("logprobs")
    raw_ids = choice.get("token_ids")
    if raw_ids is not None:
        output = token_ids(raw_ids, "choices[0].token_ids")
    elif lp is not None and lp.get("tokens") is not None:
        output = _token_ids_from_strings(json_list(lp["tokens"], "logprobs.tokens"))
    else:
        raise ValueError("the answer has neither choices[0].token_ids nor logprobs.tokens "
                         "(vLLM >= 0.10 with return_token_ids, or logprobs with "
                         "return_tokens_as_token_ids, are needed)")
    logprobs: tuple[float, ...] = ()
    if request.sampling.logprobs:
        if lp is None or lp.get("token_logprobs") is None:
            raise ValueError("logprobs were asked for but not returned")
        logprobs = tuple(logprob(x) for x in json_list(lp["token_logprobs"],
                                                       "logprobs.token_logprobs"))
        if len(logprobs) != len(output):
            raise ValueError(f"{len(logprobs)} logprobs for {len(output)} tokens")
    usage = data.get("usage") or {}
    details = usage.get("prompt_tokens_details") or {}
    return GenResult(
        request_id=request.request_id,
        output_ids=output,
        logprobs=logprobs,
        finish_reason=finish_reason(choice.get("finish_reason")),
        num_prompt_tokens=int(usage.get("prompt_tokens") or len(request.prompt_ids)),
        num_cached_tokens=int(details.get("cached_tokens") or 0),
        total_s=total_s,
    )


def parse_sglang_generate(request: GenRequest, data: Any, total_s: float = 0.0) -> GenResult:
    """An SGLang ``/generate`` answer as a ``GenResult``: token ids from
    ``output_ids``, else from ``meta_info.output_token_logprobs`` (``[logprob,
    token_id, text]`` triples); ``total_s``: the round trip, as measured by the caller."""
    if isinstance(data, list):  # a batch answer; one prompt was sent
        data = data[0]
    meta = data.get("meta_info") or {}
    triples = meta.get("output_token_logprobs")
    raw_ids = data.get("output_ids")
    if triples is not None:
        triples = json_list(triples, "meta_info.output_token_logprobs")
    if raw_ids is not None:
        output = token_ids(raw_ids, "output_ids")
    elif triples is not None:
        output = tuple(int(t[1]) for t in triples)
    else:
        raise ValueError("the answer has neither output_ids nor "
                         "meta_info.output_token_logprobs")
    logprobs: tuple[float, ...] = ()
    if request.sampling.logprobs:
        if triples is None:
            raise ValueError("logprobs were asked for but not returned")
        logprobs = tuple(logprob(t[0]) for t in triples)
        if len(logprobs) != len(output):
            raise ValueError(f"{len(logprobs)} logprobs for {len(output)} tokens")
    reason = meta.get("finish_reason")
    kind = reason.get("type") if type(reason) is dict or isinstance(reason, Mapping) else reason
    # (positional: request_id, output_ids, logprobs, finish_reason, prompt and cached
    # tokens, forward passes, draft and accepted tokens, preemptions, weight version,
    # queue_s, total_s)
    return GenResult(request.request_id, output, logprobs, finish_reason(kind),
                     int(meta.get("prompt_tokens") or len(request.prompt_ids)),
                     int(meta.get("cached_tokens") or 0), 0, 0, 0, 0, 0, 0.0, total_s)


def _carries_ids(data: Any, vllm: bool) -> bool:
    """Whether an answer holds its token ids themselves (vLLM's ``choices[0].token_ids``,
    SGLang's ``output_ids``), not only in its logprobs."""
    try:
        if vllm:
            return data["choices"][0].get("token_ids") is not None
        if isinstance(data, list):
            data = data[0]
        return data.get("output_ids") is not None
    except (KeyError, IndexError, TypeError, AttributeError):
        return False


# ---------------------------------------------------------------- the backend


class OpenAICompatBackend:
    """One vLLM (``server="vllm"``) or SGLang (``server="sglang"``) server.

    ``model`` is the served model name sent to vLLM (``None``: the server's
    default; SGLang's ``/generate`` takes none). ``use_metrics``: read ``/metrics``
    in ``load()`` (a server without it is remembered and not asked again); without
    ``/metrics`` ``load()`` asks ``/health`` instead, so that it always reaches the
    server within ``health_timeout_s`` (the router's health loop probes a healthy
    replica with ``load()``: a server that hangs must fail it).
    ``text_prompt`` (vLLM only) turns a request's token ids into the text sent as
    the prompt, for fronts that refuse token-id prompts (sglang-router's
    ``/v1/completions``); the server tokenizes that text again, and each answer
    whose ``prompt_token_ids`` differ from the request's counts in
    ``prompt_mismatches``.
    """

    def __init__(
        self,
        name: str,
        base_url: str,
        model: str | None,
        api_key: str | None = None,
        server: str = "vllm",
        *,
        timeout_s: float = DEFAULT_TIMEOUT_S,
        connect_timeout_s: float = DEFAULT_CONNECT_TIMEOUT_S,
        health_timeout_s: float = DEFAULT_HEALTH_TIMEOUT_S,
        max_connections: int = DEFAULT_MAX_CONNECTIONS,
        client: httpx.AsyncClient | None = None,
        use_metrics: bool = True,
        priority_scheduling: bool = False,
        text_prompt: Callable[[Sequence[int]], str] | None = None,
    ) -> None:
        if server not in SERVERS:
            raise ValueError(f"server must be one of {SERVERS}, got {server!r}")
        if text_prompt is not None and server != "vllm":
            raise ValueError("text_prompt works with server='vllm' only")
        if model is not None and (not isinstance(model, str) or not model):
            raise ValueError(f"model must be a non-empty string or None, got {model!r}")
        self.name = check_name(name)
        self.base_url = check_base_url(base_url)
        self.model = model
        self.server = server
        self.use_metrics = use_metrics
        self.priority_scheduling = priority_scheduling
        self.text_prompt = text_prompt
        self.prompt_mismatches = 0  # text prompts the server tokenized otherwise
        self._http = HttpChannel(self.base_url, api_key, timeout_s, connect_timeout_s,
                                 health_timeout_s, max_connections, client)
        self._inflight: dict[int, int] = {}  # call key -> prompt tokens
        self._next_key = 0
        # whether the server's answers carry the token ids themselves (learned): until
        # then every call asks for logprobs, whose tokens are the fallback
        self.ids_direct = False
        self.logprob_fallbacks = 0  # calls made again because the ids did not come
        self._metrics_missing = False

    def __repr__(self) -> str:
        return f"OpenAICompatBackend({self.name!r}, {self.base_url!r}, server={self.server!r})"

    # ---- requests

    @property
    def takes_priority(self) -> bool:
        """Whether calls carry requests' priority (``priority_scheduling``; ``Backend``)."""
        return self.priority_scheduling

    def asks_logprobs(self, request: GenRequest) -> bool:
        """Whether the call for ``request`` asks the server for logprobs: when the
        request wants them, or while the server has not shown that its answers carry
        the token ids themselves."""
        return request.sampling.logprobs or not self.ids_direct

    def vllm_body(self, request: GenRequest, logprobs: bool | None = None) -> dict[str, Any]:
        """The vLLM ``/v1/completions`` body of ``request``; ``logprobs``: ask for them
        (``None``: ``asks_logprobs``)."""
        sp = request.sampling
        prompt: Sequence[int] | str = request.prompt_ids  # (orjson writes a tuple as an array)
        if self.text_prompt is not None:
            prompt = self.text_prompt(request.prompt_ids)
        body: dict[str, Any] = {
            "prompt": prompt,
            "max_tokens": sp.max_tokens,
            "temperature": float(sp.temperature),
            "top_p": float(sp.top_p),
            "top_k": sp.top_k if sp.top_k > 0 else -1,
            "stop_token_ids": sp.stop_token_ids,
            "ignore_eos": True,
            "skip_special_tokens": False,
            "return_token_ids": True,
            "return_tokens_as_token_ids": True,
        }
        if self.asks_logprobs(request) if logprobs is None else logprobs:
            body["logprobs"] = 1
        if self.model is not None:
            body["model"] = self.model
        if sp.stop:
            body["stop"] = list(sp.stop)
        if sp.seed is not None:
            body["seed"] = sp.seed
        if self.priority_scheduling:
            body["priority"] = -round(request.priority)
        return body

    def sglang_body(self, request: GenRequest, logprobs: bool | None = None) -> dict[str, Any]:
        """The SGLang ``/generate`` body of ``request``; ``logprobs``: ask for them
        (``None``: ``asks_logprobs``)."""
        sp = request.sampling
        params: dict[str, Any] = {
            "max_new_tokens": sp.max_tokens,
            "temperature": float(sp.temperature),
            "top_p": float(sp.top_p),
            "top_k": sp.top_k if sp.top_k > 0 else -1,
            "stop_token_ids": sp.stop_token_ids,
            "ignore_eos": True,
            "skip_special_tokens": False,
        }
        if sp.stop:
            params["stop"] = list(sp.stop)
        if sp.seed is not None:
            params["sampling_seed"] = sp.seed
        body: dict[str, Any] = {
            "input_ids": request.prompt_ids,
            "sampling_params": params,
            "return_logprob": self.asks_logprobs(request) if logprobs is None else logprobs,
            "rid": request.request_id,
        }
        if self.priority_scheduling:
            body["priority"] = round(request.priority)
        return body

    async def generate(self, request: GenRequest) -> GenResult:
        if request.continues:
            raise UnknownTrajectory(
                f"request {request.request_id}: {self.name} ({self.server}) holds no "
                "trajectories; send the whole context")
        key = self._next_key
        self._next_key += 1
        self._inflight[key] = len(request.prompt_ids)
        t0 = time.perf_counter()
        vllm = self.server == "vllm"
        path, make = ("/v1/completions", self.vllm_body) if vllm else ("/generate",
                                                                         self.sglang_body)
        parse = parse_vllm_completion if vllm else parse_sglang_generate
        try:
            asked = self.asks_logprobs(request)
            data = await self._http.post_json(path, make(request, asked), self.name)
            direct = _carries_ids(data, vllm)
            if not asked and not direct:
                # the server stopped returning the ids themselves: once more, asking for
                # logprobs (whose tokens hold them)
                self.logprob_fallbacks += 1
                data = await self._http.post_json(path, make(request, True), self.name)
                direct = _carries_ids(data, vllm)
            self.ids_direct = direct  # what the latest answer showed
        finally:
            del self._inflight[key]
        if self.text_prompt is not None and isinstance(data, dict):
            with contextlib.suppress(KeyError, IndexError, TypeError):
                seen = data["choices"][0]["prompt_token_ids"]
                if seen is not None and list(seen) != list(request.prompt_ids):
                    self.prompt_mismatches += 1
        try:
            # (the round trip goes in as the result is built: ``replace`` would build it twice)
            return parse(request, data, time.perf_counter() - t0)
        except (KeyError, IndexError, TypeError, ValueError, AttributeError) as e:
            raise ReplicaUnavailable(
                f"{self.name}: malformed {self.server} response: {type(e).__name__}: {e}"
            ) from e

    # ---- load, health, history

    @property
    def num_in_flight(self) -> int:
        return len(self._inflight)

    async def server_metrics(self) -> ServerMetrics | None:
        """The server's ``/metrics`` figures; None when it has no such page (a 404 is
        remembered). Raises ``ReplicaUnavailable`` when the server is unreachable."""
        if self._metrics_missing:
            return None
        answer = await self._http.get_unchecked("/metrics", self.name)
        if answer.status_code in (404, 405):
            self._metrics_missing = True
            return None
        if answer.status_code != 200:
            if answer.status_code >= 500:
                raise ReplicaUnavailable(
                    f"{self.name}: /metrics failed ({answer.status_code})")
            return None
        return metrics_from_text(answer.text)

    async def load(self) -> ReplicaLoad:
        running = len(self._inflight)
        tokens = sum(self._inflight.values())
        waiting = 0
        used = total = block_size = 0
        if not self.use_metrics or self._metrics_missing:
            # (the router's health loop takes this call as the probe of a healthy
            # replica: it must reach the server, bounded, so that a hung one is found)
            await self._probe()
        else:
            m = await self.server_metrics()
            if m is not None:
                running = m.num_running if m.num_running is not None else running
                waiting = m.num_waiting if m.num_waiting is not None else 0
                if m.kv_usage is not None and m.kv_blocks_total is not None \
                        and m.block_size is not None:
                    total, block_size = m.kv_blocks_total, m.block_size
                    used = min(total, round(m.kv_usage * total))
        return ReplicaLoad(num_running=running, num_waiting=waiting, tokens_in_flight=tokens,
                           kv_blocks_used=used, kv_blocks_total=total, block_size=block_size)

    async def _probe(self) -> None:
        """``GET /health`` within the health timeout: ``ReplicaUnavailable`` if the
        server does not answer or answers with a 5xx."""
        answer = await self._http.get_unchecked("/health", self.name)
        if answer.status_code >= 500:
            raise ReplicaUnavailable(f"{self.name}: /health failed ({answer.status_code})")

    async def health(self) -> bool:
        return await self._http.health("/health")

    async def add_history(self, items: Sequence[tuple[Sequence[int], str | None]]) -> None:
        """Nothing: these servers keep no shared draft history of WAR's."""

    async def close(self) -> None:
        await self._http.close()

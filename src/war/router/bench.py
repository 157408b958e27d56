"""Helpers of the router benchmark (``benchmarks/router/bench_router.py``).

Knows two measurements and what they need:

* Routing throughput: replicas that answer at once (``InstantBackend`` behind a tiny
  HTTP app that speaks WAR's ``/v1/completions`` and, for SGLang's router, SGLang's
  ``/generate``, ``/health``, ``/server_info`` and ``/model_info``), served together
  by one process (``python -m war.router.bench replicas --port P ...``); ``war route``
  in front of them, one process per policy; SGLang's router (``sglang_router``) in
  front of the same replicas when it is installed; and a load client
  (one ``aiohttp`` session, a fixed number of requests kept in flight) whose prompts
  share a prefix with an earlier one with probability ``affinity`` (the next turn
  of an earlier session). Requests per second and latency percentiles per target;
  the targets take turns within each repeat (the order rotates), so that other work
  on the machine slows them alike; the figures are medians over repeats, and the
  latency a router adds is measured against direct calls in the same repeat.
* Policies on real replicas: ``AsyncEngine``s over a tiny random model in this
  process, behind ``InProcessBackend``s and one ``Router`` per policy, serving
  multi-turn sessions in groups (a group's samples share their task prompt; each
  turn sends the whole context: previous prompt, response and an observation) whose
  lengths differ by group, more sessions than the replicas' batch slots (a saturated
  fleet, where placement matters). Each engine step is paced to a GPU-like cost,
  ``step_ms + prefill_us * prompt tokens computed + decode_us * decoding sequences``
  of wall time (``PacedEngine`` sleeps the rest, releasing the GIL), so that the
  replicas behave as parallel devices on a machine with fewer cores than replicas.
  Prefix-cache hit rate (cached / prompt tokens of the results), makespan and
  migrations per policy, medians over repeats with the policies taking turns. The
  fleet is small, so the policies' absolute load thresholds are scaled by
  ``threshold_scale`` alike (SGLang's 64 requests and WAR's 32768 tokens correspond at
  ~512 tokens a request).

Does not know the router's internals (it uses ``war route``, ``Router``, policies and
backends through their public API) nor how the engine works.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import importlib.metadata
import importlib.util
import itertools
import math
import os
import random
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

import aiohttp
import httpx
import orjson
import torch
from fastapi import FastAPI, Request
from fastapi.responses import Response

from war import aio
from war.backends.inprocess import InProcessBackend
from war.backends.simulated import InstantBackend
from war.engine.async_engine import AsyncEngine
from war.engine.config import EngineConfig
from war.engine.engine import Engine
from war.engine.loader import init_random
from war.engine.model_config import ModelConfig
from war.engine.stats import EngineStats
from war.router.policies import make_policy
from war.router.router import Router, RouterConfig
from war.router.server import build_response
from war.types import GenRequest, GenResult, ReplicaLoad, SamplingParams

POLICIES = ("war", "cache_aware", "least_load", "round_robin")
Log = Callable[[str], None]


def _quiet(_: str) -> None:
    pass


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def percentile(values: Sequence[float], q: float) -> float:
    """The ``q``-th percentile (0..100) by linear interpolation; NaN when empty."""
    if not values:
        return math.nan
    xs = sorted(values)
    pos = (len(xs) - 1) * q / 100.0
    lo = math.floor(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def paired_ratio(values: Sequence[float], bases: Sequence[float]) -> float | None:
    """The median of ``values[i] / bases[i]`` over the repeats both have (each pair
    measured side by side, in one repeat): steadier than a ratio of medians on a shared
    machine, whose speed drifts between repeats. ``None`` when no pair has a base > 0."""
    ratios = [v / b for v, b in zip(values, bases, strict=False) if b > 0]
    return _median(ratios) if ratios else None


def _median(values: Sequence[float]) -> float:
    finite = [v for v in values if not math.isnan(v)]
    return statistics.median(finite) if finite else math.nan


# --------------------------------------------------------------------------- instant replicas


def _json(payload: Any) -> Response:
    return Response(orjson.dumps(payload), media_type="application/json")


def sglang_answer(result: GenResult) -> dict[str, Any]:
    """What an SGLang server's ``/generate`` answers for ``result`` (the instant
    replica's answer)."""
    return {"text": "", "output_ids": list(result.output_ids), "meta_info": {
        "id": result.request_id, "prompt_tokens": result.num_prompt_tokens,
        "completion_tokens": len(result.output_ids), "cached_tokens": 0,
        "finish_reason": {"type": result.finish_reason}}}


def instant_replica_app(name: str, max_output_tokens: int = 8) -> FastAPI:
    """A replica that answers at once (``InstantBackend``: the prompt echoed) over HTTP:
    WAR's ``/v1/completions``, ``/v1/load``, ``/v1/history`` and ``/health``, and the
    endpoints SGLang's router calls (``/generate``, ``/server_info``, ``/model_info``,
    also under ``/get_...``). Bodies are read without validation: it is a load target."""
    backend = InstantBackend(name, max_output_tokens)
    app = FastAPI(docs_url=None, redoc_url=None, openapi_url=None)
    counter = iter(range(1 << 62))

    def request_of(prompt: Sequence[int], max_tokens: int, stop: Sequence[int],
                   logprobs: bool) -> GenRequest:
        return GenRequest(f"{name}-{next(counter)}", tuple(int(t) for t in prompt),
                          SamplingParams(max_tokens=max(1, int(max_tokens)),
                                         stop_token_ids=tuple(int(t) for t in stop),
                                         logprobs=logprobs))

    # Both APIs read and write JSON with orjson, so that neither pays more than its
    # format's own size: the load target should cost either router's calls alike.
    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        body = orjson.loads(await request.body())
        req = request_of(body["prompt"], body.get("max_tokens") or 16,
                         body.get("stop_token_ids") or (), bool(body.get("logprobs")))
        result = await backend.generate(req)
        rid = str(body.get("request_id") or req.request_id)
        return _json(build_response(rid, str(body.get("model") or "war"), [result], [name],
                                    bool(body.get("logprobs"))))

    @app.post("/generate")
    async def generate(request: Request) -> Response:
        body = orjson.loads(await request.body())
        params = body.get("sampling_params") or {}
        req = request_of(body["input_ids"], params.get("max_new_tokens") or 16, (), False)
        return _json(sglang_answer(await backend.generate(req)))

    @app.get("/health")
    async def health() -> dict[str, str]:
        return {"status": "ok"}

    @app.get("/v1/load")
    async def load() -> dict[str, Any]:
        snap: ReplicaLoad = await backend.load()
        return {**dataclasses.asdict(snap), "kv_free_tokens": snap.kv_free_tokens}

    @app.post("/v1/history")
    async def history(request: Request) -> dict[str, Any]:
        body = await request.json()
        return {"status": "ok", "num_items": len(body.get("items") or [])}

    info = {"model_path": "war-instant", "tokenizer_path": None, "is_generation": True,
            "served_model_name": "war-instant", "max_total_num_tokens": 1 << 20}
    for path in ("/server_info", "/get_server_info", "/model_info", "/get_model_info"):
        app.add_api_route(path, lambda: info, methods=["GET"])

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [{"id": "war-instant", "object": "model"}]}

    return app


async def serve_instant_replicas(ports: Sequence[int], max_output_tokens: int = 8,
                                 host: str = "127.0.0.1") -> None:
    """Serves one instant replica per port on this event loop until cancelled."""
    import uvicorn

    servers = [uvicorn.Server(uvicorn.Config(
        instant_replica_app(f"replica-{i}", max_output_tokens), host=host, port=port,
        log_level="warning", access_log=False)) for i, port in enumerate(ports)]
    await asyncio.gather(*(s.serve() for s in servers))


# --------------------------------------------------------------------------- processes


class Service:
    """A subprocess that is ready once ``ready_url`` answers 200 (bounded wait); its
    output goes to a log file, shown when it fails to start.

    ``log_path``: keep the log there (default: a temporary file, deleted on stop).
    ``own_session``: start it in a session of its own and stop the whole session
    (servers that start worker processes, such as vLLM); ``cpu_s()`` then measures
    the CPU time of every live process of that session."""

    def __init__(self, name: str, argv: Sequence[str], ready_url: str,
                 env: dict[str, str] | None = None, *, log_path: Path | None = None,
                 own_session: bool = False) -> None:
        self.name = name
        self.argv = list(argv)
        self.ready_url = ready_url
        self.env = env
        self.own_session = own_session
        self._keep_log = log_path is not None
        self._log: IO[bytes]
        if log_path is not None:
            log_path.parent.mkdir(parents=True, exist_ok=True)
            self._log = open(log_path, "wb")  # noqa: SIM115 (closed in stop())
        else:
            self._log = tempfile.NamedTemporaryFile(  # noqa: SIM115 (closed in stop())
                prefix=f"war-bench-{name}-", suffix=".log", delete=False)
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self, timeout_s: float = 120.0) -> None:
        """Launches the process and waits until it is ready."""
        self.launch()
        self.wait_ready(timeout_s)

    def launch(self) -> None:
        self.proc = subprocess.Popen(self.argv, stdout=self._log, stderr=subprocess.STDOUT,
                                     stdin=subprocess.DEVNULL, env=self.env,
                                     start_new_session=self.own_session)

    def wait_ready(self, timeout_s: float = 120.0) -> None:
        """Returns once ``ready_url`` answers 200; raises ``RuntimeError`` if the
        process exits or ``timeout_s`` passes first."""
        if self.proc is None:
            raise RuntimeError(f"{self.name} was not launched")
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.name} exited ({self.proc.returncode}): "
                                   f"{self.output()[-2000:]}")
            with contextlib.suppress(httpx.TransportError):
                if httpx.get(self.ready_url, timeout=2.0).status_code == 200:
                    return
            time.sleep(0.2)
        raise RuntimeError(f"{self.name} not ready within {timeout_s:.0f} s: "
                           f"{self.output()[-2000:]}")

    def output(self) -> str:
        self._log.flush()
        return Path(self._log.name).read_text(encoding="utf-8", errors="replace")

    def cpu_s(self) -> float:
        """CPU seconds used so far by the live processes of this service's session
        (``own_session`` services; 0 otherwise)."""
        if self.proc is None or not self.own_session:
            return 0.0
        return session_cpu_s(self.proc.pid)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self._signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=30 if self.own_session else 15)
            except subprocess.TimeoutExpired:
                self._signal(signal.SIGKILL)
                self.proc.wait(timeout=10)
        self._log.close()
        if not self._keep_log:
            with contextlib.suppress(OSError):
                os.unlink(self._log.name)

    def _signal(self, sig: signal.Signals) -> None:
        assert self.proc is not None
        with contextlib.suppress(ProcessLookupError):
            if self.own_session:
                os.killpg(self.proc.pid, sig)
            else:
                self.proc.send_signal(sig)


def session_cpu_s(session: int) -> float:
    """User + system CPU seconds of the live processes whose session id is ``session``
    (from /proc; 0 where there is no /proc)."""
    ticks = 0
    try:
        entries = os.listdir("/proc")
    except OSError:
        return 0.0
    for entry in entries:
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                data = f.read()
        except OSError:  # exited meanwhile
            continue
        fields = data[data.rindex(")") + 2:].split()  # after "(comm)": state, ppid, ...
        if int(fields[3]) == session:
            ticks += int(fields[11]) + int(fields[12])
    return ticks / os.sysconf("SC_CLK_TCK")


def sglang_router_status() -> dict[str, Any]:
    """Whether SGLang's router can be run here: ``{available, version, reason}``."""
    if importlib.util.find_spec("sglang_router") is None:
        return {"available": False, "version": None,
                "reason": "sglang_router is not installed (pip install --only-binary=:all: "
                          "sglang-router)"}
    try:
        version = importlib.metadata.version("sglang-router")
    except importlib.metadata.PackageNotFoundError:
        version = None
    return {"available": True, "version": version, "reason": None}


# --------------------------------------------------------------------------- load client


@dataclass(frozen=True)
class LoadItem:
    session: str
    prompt: tuple[int, ...]


def build_load(num_requests: int, affinity: float, seed: int, prompt_tokens: int = 64,
               turn_tokens: int = 24, max_context: int = 1024,
               vocab: int = 32000) -> list[LoadItem]:
    """``num_requests`` prompts; each continues an earlier session (its prompt plus
    ``turn_tokens`` new tokens) with probability ``affinity``, else starts a session
    with ``prompt_tokens`` fresh tokens. A session that would exceed ``max_context``
    is replaced by a new one in its place. Session ids (``<seed>:s<n>``) are never
    reused, within a load or across loads of different seeds: a router that follows
    trajectories must not see an unrelated conversation come back under an old id."""
    if not 0.0 <= affinity <= 1.0:
        raise ValueError(f"affinity must be in [0, 1], got {affinity}")
    rng = random.Random(seed)
    sessions: list[tuple[str, tuple[int, ...]]] = []
    items = []
    created = 0
    for _ in range(num_requests):
        if sessions and rng.random() < affinity:
            k = rng.randrange(len(sessions))
            sid, prompt = sessions[k]
            prompt = prompt + tuple(rng.randrange(vocab) for _ in range(turn_tokens))
            if len(prompt) > max_context:
                sid, created = f"{seed}:s{created}", created + 1
                prompt = tuple(rng.randrange(vocab) for _ in range(prompt_tokens))
            sessions[k] = (sid, prompt)
        else:
            sid, created = f"{seed}:s{created}", created + 1
            prompt = tuple(rng.randrange(vocab) for _ in range(prompt_tokens))
            sessions.append((sid, prompt))
        items.append(LoadItem(sid, prompt))
    return items


@dataclass(frozen=True)
class LoadFigures:
    rps: float
    p50_ms: float
    p99_ms: float
    errors: int


@dataclass(frozen=True)
class LoadRun:
    """What one ``drive_run`` saw: each answered request's latency (seconds), the
    failures, and the wall time with the requests in flight."""

    latencies: tuple[float, ...]
    errors: int
    wall_s: float


def load_figures(runs: Sequence[LoadRun]) -> LoadFigures:
    """Requests/s and latency percentiles over ``runs`` taken together (answered
    requests over the time spent in them)."""
    latencies = [x for r in runs for x in r.latencies]
    wall = sum(r.wall_s for r in runs)
    return LoadFigures(rps=len(latencies) / wall if wall > 0 else math.nan,
                       p50_ms=1e3 * percentile(latencies, 50),
                       p99_ms=1e3 * percentile(latencies, 99),
                       errors=sum(r.errors for r in runs))


async def drive(url: str, items: Sequence[LoadItem], concurrency: int, api: str = "war",
                max_tokens: int = 8, timeout_s: float = 60.0) -> LoadFigures:
    """Sends ``items`` to ``url`` with ``concurrency`` requests in flight; ``api``:
    ``war`` (``/v1/completions``) or ``sglang`` (``/generate`` with ``input_ids``); the
    session is the ``X-Trajectory-Id`` header on both."""
    return load_figures([await drive_run(url, items, concurrency, api, max_tokens,
                                         timeout_s)])


def client_session(concurrency: int, timeout_s: float = 60.0) -> aiohttp.ClientSession:
    """The load client's session: at most ``concurrency`` kept-alive connections, so
    that runs through one session reuse them (call within a loop). An idle connection
    is dropped after 4 s, before the servers' own 5 s limit (``war route``, uvicorn),
    so that no request goes out on a connection the server is closing."""
    # aiohttp: its client costs a fifth of httpx's CPU per call, so that the load
    # client, which shares the machine, slows the targets as little as it can.
    connector = aiohttp.TCPConnector(limit=concurrency, keepalive_timeout=4.0)
    return aiohttp.ClientSession(connector=connector,
                                 timeout=aiohttp.ClientTimeout(total=timeout_s))


async def drive_run(url: str, items: Sequence[LoadItem], concurrency: int, api: str = "war",
                    max_tokens: int = 8, timeout_s: float = 60.0,
                    session: aiohttp.ClientSession | None = None) -> LoadRun:
    """``drive``, returning what it saw rather than its figures; through ``session``
    (``client_session``, with at least ``concurrency`` connections) when given, so that
    the connections outlive the run, else through a session of its own."""
    if api not in ("war", "sglang"):
        raise ValueError(f"api must be war or sglang, got {api!r}")
    latencies: list[float] = []
    errors = 0
    queue = iter(items)

    async def worker(session: aiohttp.ClientSession) -> None:
        nonlocal errors
        for item in queue:
            # the session rides in a header on both APIs (a router that does not use it
            # reads the same bytes)
            headers = {"X-Trajectory-Id": item.session}
            if api == "war":
                path = "/v1/completions"
                body: dict[str, Any] = {"prompt": list(item.prompt), "max_tokens": max_tokens,
                                        "temperature": 0.0}
            else:
                path = "/generate"
                body = {"input_ids": list(item.prompt),
                        "sampling_params": {"max_new_tokens": max_tokens, "temperature": 0.0}}
            t0 = time.perf_counter()
            try:
                async with session.post(url + path, json=body, headers=headers) as r:
                    await r.read()
                    ok = r.status == 200
            except (aiohttp.ClientError, TimeoutError):
                ok = False
            if ok:
                latencies.append(time.perf_counter() - t0)
            else:
                errors += 1

    async def run(session: aiohttp.ClientSession) -> float:
        t0 = time.perf_counter()
        await asyncio.gather(*(worker(session) for _ in range(concurrency)))
        return time.perf_counter() - t0

    if session is not None:
        wall = await run(session)
    else:
        async with client_session(concurrency, timeout_s) as own:
            wall = await run(own)
    return LoadRun(tuple(latencies), errors, wall)


# --------------------------------------------------------------------------- routing throughput


@dataclass(frozen=True)
class RpsBenchConfig:
    """The routing-throughput measurement: ``num_replicas`` instant replicas; per
    target, affinity, number in flight (each of ``concurrencies``) and repeat,
    ``num_requests`` requests (after ``warmup``), sent in ``slices`` parts for which
    the targets take turns; ``policies`` of ``war route``, each reached over each of
    ``apis`` (``war``: WAR's ``/v1/completions`` to the router and to the replicas;
    ``sglang``: SGLang's ``/generate`` on both legs, as SGLang's router is driven and
    drives its workers); SGLang's router too when ``sglang`` and it is installed."""

    num_replicas: int = 4
    policies: tuple[str, ...] = POLICIES
    affinities: tuple[float, ...] = (0.0, 0.5, 0.9)
    num_requests: int = 1000
    warmup: int = 100
    # 8 in flight: the router's latency on a short path matters; 64: its CPU per
    # request does (a rollout keeps hundreds of requests in flight)
    concurrencies: tuple[int, ...] = (8, 64)
    repeats: int = 15  # a single repeat's ratio to sglang-router spreads 10-30 % here
    slices: int = 5
    max_tokens: int = 8
    sglang: bool = True
    apis: tuple[str, ...] = ("war", "sglang")
    seed: int = 0

    def __post_init__(self) -> None:
        for name in ("num_replicas", "num_requests", "repeats", "slices", "max_tokens"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"{name} must be an int >= 1, got {v!r}")
        if not self.concurrencies or len(set(self.concurrencies)) != len(self.concurrencies) \
                or any(isinstance(c, bool) or not isinstance(c, int) or c < 1
                       for c in self.concurrencies):
            raise ValueError("concurrencies must be distinct ints >= 1, got "
                             f"{self.concurrencies!r}")
        if self.warmup < 0:
            raise ValueError(f"warmup must be >= 0, got {self.warmup}")
        if self.slices > self.num_requests:
            raise ValueError(f"slices ({self.slices}) must be at most num_requests "
                             f"({self.num_requests})")
        if not self.affinities or any(not 0.0 <= a <= 1.0 for a in self.affinities):
            raise ValueError(f"affinities must be in [0, 1], got {self.affinities}")
        unknown = set(self.policies) - set(POLICIES)
        if unknown:
            raise ValueError(f"unknown policies {sorted(unknown)}; known: {POLICIES}")
        if not self.apis or set(self.apis) - {"war", "sglang"}:
            raise ValueError(f"apis must be among war, sglang; got {self.apis}")

    @classmethod
    def quick(cls) -> RpsBenchConfig:
        return cls(affinities=(0.8,), concurrencies=(8,), num_requests=300, warmup=30,
                   repeats=3)


@dataclass(frozen=True)
class _Target:
    router: str  # direct | war | sglang-router
    policy: str | None
    url: str
    api: str


def _war_route_service(replica_urls: Sequence[str], policy: str, port: int,
                       api: str = "war") -> Service:
    """``war route`` with ``policy`` in front of the replicas, reached over ``api``:
    ``war`` (WAR's backends, ``/v1/completions``) or ``sglang`` (SGLang's backends,
    ``/generate``, as sglang-router reaches them)."""
    argv = [sys.executable, "-m", "war.cli.main", "route", "--policy", policy,
            "--port", str(port), "--host", "127.0.0.1", "--log-level", "warning"]
    for url in replica_urls:
        argv += ["--replica", f"{api}+{url}"]
    env = {k: v for k, v in os.environ.items() if k != "WAR_API_KEY"}
    return Service(f"war-route-{policy}-{api}", argv, f"http://127.0.0.1:{port}/health", env)


def _sglang_service(replica_urls: Sequence[str], port: int) -> Service:
    argv = [sys.executable, "-m", "sglang_router.launch_router", "--host", "127.0.0.1", "--port",
            str(port), "--prometheus-host", "127.0.0.1", "--prometheus-port",
            str(free_port()), "--policy", "cache_aware", "--log-level", "warn",
            "--worker-urls", *replica_urls]
    return Service("sglang-router", argv, f"http://127.0.0.1:{port}/health")


async def _take_turns(targets: Sequence[_Target], order: Sequence[int],
                      warm: Sequence[LoadItem], measured: Sequence[LoadItem],
                      config: RpsBenchConfig, concurrency: int) -> dict[int, list[LoadRun]]:
    """One repeat at one affinity with ``concurrency`` requests in flight: each target
    (in ``order``) gets the ``warm`` requests, then the targets take turns slice by
    slice on ``measured`` (the order rotating), so that the machine's drift within a
    repeat falls on each of them alike. Each target has one client session for the
    whole repeat: its connections are opened during the warm-up and kept, as a rollout
    client keeps them, so that no slice pays for connecting."""
    sessions = {t_i: client_session(concurrency) for t_i in order}
    try:
        for t_i in order:
            t = targets[t_i]
            await drive_run(t.url, warm, concurrency, t.api, config.max_tokens,
                            session=sessions[t_i])
        seen: dict[int, list[LoadRun]] = {t_i: [] for t_i in order}
        for k in range(config.slices):
            part = measured[k * len(measured) // config.slices:
                            (k + 1) * len(measured) // config.slices]
            for t_i in list(order[k % len(order):]) + list(order[:k % len(order)]):
                t = targets[t_i]
                seen[t_i].append(await drive_run(t.url, part, concurrency, t.api,
                                                 config.max_tokens, session=sessions[t_i]))
        return seen
    finally:
        for session in sessions.values():
            await session.close()


def run_router_rps(config: RpsBenchConfig, log: Log = _quiet) -> dict[str, Any]:
    """Routing throughput of each target (see the module docstring). Returns
    ``{"router_rps": rows, "sglang_router": status}``; each row has ``router``,
    ``policy``, ``affinity``, ``concurrency``, ``rps``, ``p50_ms``, ``p99_ms`` (medians
    over repeats), ``added_p50_ms`` / ``added_p99_ms`` (over direct calls, per repeat,
    median),
    ``vs_sglang_router`` (requests/s over sglang-router's in the same repeat, median;
    ``None`` without sglang-router), ``errors`` (summed) and ``api``."""
    sglang = sglang_router_status() if config.sglang else {
        "available": False, "version": None, "reason": "disabled (--no-sglang)"}
    ports = [free_port() for _ in range(config.num_replicas)]
    replica_urls = [f"http://127.0.0.1:{p}" for p in ports]
    replicas = Service("instant-replicas", [
        sys.executable, "-m", "war.router.bench", "replicas", "--max-output-tokens",
        str(config.max_tokens), *[a for p in ports for a in ("--port", str(p))]],
        f"{replica_urls[-1]}/health")
    targets = [_Target("direct", None, replica_urls[0], "war")]
    items: list[Service] = [replicas]
    for api in config.apis:
        for policy in config.policies:
            port = free_port()
            items.append(_war_route_service(replica_urls, policy, port, api))
            targets.append(_Target("war", policy, f"http://127.0.0.1:{port}", api))
    if "sglang" in config.apis and not sglang["available"]:
        targets.append(_Target("direct", None, replica_urls[0], "sglang"))
    if sglang["available"]:
        port = free_port()
        items.append(_sglang_service(replica_urls, port))
        targets.append(_Target("sglang-router", "cache_aware", f"http://127.0.0.1:{port}",
                               "sglang"))
        targets.append(_Target("direct", None, replica_urls[0], "sglang"))
    # figures[(target index, affinity, concurrency)] -> one LoadFigures per repeat
    figures: dict[tuple[int, float, int], list[LoadFigures]] = {}
    try:
        # The replicas first (the routers check them as they start), then every
        # router at once.
        replicas.start()
        for s in items[1:]:
            s.launch()
        for s in items[1:]:
            try:
                s.wait_ready()
            except RuntimeError as e:
                if s.name != "sglang-router":
                    raise
                sglang = {**sglang, "available": False, "reason": f"failed to start: {e}"}
                targets = [t for t in targets if t.api != "sglang"]
                log(f"sglang-router: {e}")
        for rep in range(config.repeats):
            for a_i, affinity in enumerate(config.affinities):
                seed = config.seed + 1000 * rep + a_i
                load = build_load(config.warmup + config.num_requests, affinity, seed)
                warm, measured = load[:config.warmup], load[config.warmup:]
                order = list(range(len(targets)))
                shift = (rep + a_i) % len(order)
                order = order[shift:] + order[:shift]
                for conc in config.concurrencies:
                    seen = asyncio.run(_take_turns(targets, order, warm, measured, config,
                                                   conc))
                    for t_i in order:
                        t = targets[t_i]
                        fig = load_figures(seen[t_i])
                        figures.setdefault((t_i, affinity, conc), []).append(fig)
                        log(f"rps rep {rep} affinity {affinity:.2f} in flight {conc} "
                            f"{t.router}/{t.policy} ({t.api}): {fig.rps:.0f}/s p50 "
                            f"{fig.p50_ms:.2f} ms p99 {fig.p99_ms:.2f} ms errors {fig.errors}")
    finally:
        for s in reversed(items):
            s.stop()
    rows = []
    peer = next((i for i, t in enumerate(targets) if t.router == "sglang-router"), None)
    for conc, affinity in itertools.product(config.concurrencies, config.affinities):
        key = (affinity, conc)
        direct = {api: figures.get((i, *key), []) for i, t in enumerate(targets)
                  if t.router == "direct" for api in [t.api]}
        peer_rps = [r.rps for r in figures.get((peer, *key), [])] if peer is not None else []
        for t_i, t in enumerate(targets):
            runs = figures.get((t_i, *key), [])
            base = direct.get(t.api, [])
            added50 = [r.p50_ms - b.p50_ms for r, b in zip(runs, base, strict=False)]
            added99 = [r.p99_ms - b.p99_ms for r, b in zip(runs, base, strict=False)]
            rows.append({
                "router": t.router, "policy": t.policy, "affinity": affinity, "api": t.api,
                "concurrency": conc, "rps": _median([r.rps for r in runs]),
                "p50_ms": _median([r.p50_ms for r in runs]),
                "p99_ms": _median([r.p99_ms for r in runs]),
                "added_p50_ms": _median(added50), "added_p99_ms": _median(added99),
                "vs_sglang_router": paired_ratio([r.rps for r in runs], peer_rps),
                "errors": sum(r.errors for r in runs), "repeats": len(runs),
            })
    return {"router_rps": rows, "sglang_router": sglang}


# --------------------------------------------------------------------------- paced engines


class PacedEngine:
    """An ``Engine`` whose steps take at least ``step_s + prefill_s * prefill tokens +
    decode_s * decoding sequences`` of wall time (the rest is slept, the GIL released):
    a GPU-like replica whose step cost grows with the prompt tokens it computes (so a
    cached prefix saves time) and with its batch (so a crowded replica is slower),
    several of which run in parallel on few cores."""

    def __init__(self, engine: Engine, step_s: float, prefill_s: float, decode_s: float
                 ) -> None:
        if min(step_s, prefill_s, decode_s) < 0:
            raise ValueError("step_s, prefill_s and decode_s must be >= 0")
        self.inner = engine
        self.step_s = step_s
        self.prefill_s = prefill_s
        self.decode_s = decode_s
        self.paced_s = 0.0  # slept in total

    @property
    def model_config(self) -> ModelConfig:
        return self.inner.model_config

    @property
    def tokenizer(self) -> Any:
        return self.inner.tokenizer

    @property
    def max_model_len(self) -> int:
        return self.inner.max_model_len

    @property
    def weight_version(self) -> int:
        return self.inner.weight_version

    @property
    def stats(self) -> EngineStats:
        return self.inner.stats

    def add_request(self, request: GenRequest) -> None:
        self.inner.add_request(request)

    def abort(self, request_id: str) -> GenResult | None:
        return self.inner.abort(request_id)

    def step(self) -> list[GenResult]:
        t0 = time.perf_counter()
        before = self.inner.stats.num_steps
        out = self.inner.step()
        if self.inner.stats.num_steps > before and self.inner.timeline:
            rec = self.inner.timeline[-1]
            prefill = max(0, rec.batch_tokens - rec.num_decoding - rec.draft_tokens)
            cost = self.step_s + self.prefill_s * prefill + self.decode_s * (
                rec.num_decoding + rec.draft_tokens)
            left = cost - (time.perf_counter() - t0)
            if left > 0:
                time.sleep(left)
                self.paced_s += left
        return out

    def has_unfinished(self) -> bool:
        return self.inner.has_unfinished()

    def finish_trajectory(self, trajectory_id: str) -> bool:
        return self.inner.finish_trajectory(trajectory_id)

    def wait_s(self) -> float | None:
        return self.inner.wait_s()

    def load(self) -> ReplicaLoad:
        return self.inner.load()

    def add_history(self, token_ids: Sequence[int], group_id: str | None = None) -> None:
        self.inner.add_history(token_ids, group_id)

    def observe_rl_step(self, rl_step: int) -> None:
        self.inner.observe_rl_step(rl_step)

    def load_weights(self, weights: Any) -> int:
        return self.inner.load_weights(weights)


# --------------------------------------------------------------------------- policies


@dataclass(frozen=True)
class PolicyBenchConfig:
    """The policies measurement (module docstring).

    * ``group_turns``: turns of each group's sessions (one entry per group; a sample
      gets ``+- turn_jitter`` turns): groups differ in length.
    * ``group_size``: sessions (samples) per group, sharing the group's task prompt of
      ``prompt_tokens``; each turn adds ``max_tokens`` of response (no stop token) and
      ``obs_tokens`` of observation to the context.
    * ``step_ms``, ``prefill_us``, ``decode_us``: the pacing of each engine step.
    * ``kv_blocks``, ``block_size``, ``max_num_seqs``, ``max_num_batched_tokens``:
      each replica's KV cache and batch limits.
    * ``rl_steps``: synchronous RL steps, one after another (the same groups).
    * ``threshold_scale``: factor on the policies' absolute load thresholds.
    """

    num_replicas: int = 4
    policies: tuple[str, ...] = POLICIES
    group_turns: tuple[int, ...] = (1, 2, 3, 4, 6, 8, 10, 12)
    group_size: int = 4
    turn_jitter: int = 1
    prompt_tokens: int = 160
    obs_tokens: int = 32
    max_tokens: int = 8
    step_ms: float = 40.0
    prefill_us: float = 150.0
    decode_us: float = 4000.0
    kv_blocks: int = 256
    block_size: int = 16
    max_num_seqs: int = 4
    max_num_batched_tokens: int = 512
    rl_steps: int = 2
    threshold_scale: float = 1 / 16
    repeats: int = 3
    seed: int = 0

    def __post_init__(self) -> None:
        for name in ("num_replicas", "group_size", "prompt_tokens", "obs_tokens",
                     "max_tokens", "kv_blocks", "block_size", "max_num_seqs",
                     "max_num_batched_tokens", "rl_steps", "repeats"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"{name} must be an int >= 1, got {v!r}")
        if not self.group_turns or any(t < 1 for t in self.group_turns):
            raise ValueError(f"group_turns must be >= 1, got {self.group_turns}")
        if self.turn_jitter < 0:
            raise ValueError(f"turn_jitter must be >= 0, got {self.turn_jitter}")
        if min(self.step_ms, self.prefill_us, self.decode_us) < 0:
            raise ValueError("step_ms, prefill_us and decode_us must be >= 0")
        if not self.threshold_scale > 0:
            raise ValueError(f"threshold_scale must be > 0, got {self.threshold_scale}")
        unknown = set(self.policies) - set(POLICIES)
        if unknown:
            raise ValueError(f"unknown policies {sorted(unknown)}; known: {POLICIES}")

    @classmethod
    def quick(cls) -> PolicyBenchConfig:
        return cls(group_turns=(1, 2, 4, 6, 8, 10), group_size=4, repeats=2)

    def policy_kwargs(self, policy: str) -> dict[str, Any]:
        s = self.threshold_scale
        if policy == "war":
            return {"migrate_abs_tokens": max(1, round(32768 * s)),
                    "group_abs_tokens": max(1, round(8192 * s))}
        if policy == "cache_aware":
            return {"balance_abs_threshold": max(1, round(64 * s))}
        return {}


VOCAB = 512
TINY_MODEL: dict[str, Any] = {
    "model_type": "llama", "vocab_size": VOCAB, "hidden_size": 64, "intermediate_size": 128,
    "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
    "max_position_embeddings": 2048, "rms_norm_eps": 1e-6, "rope_theta": 10000.0,
    "tie_word_embeddings": True,
}


@dataclass(frozen=True)
class Session:
    session_id: str
    group_id: str
    prompt: tuple[int, ...]
    observations: tuple[tuple[int, ...], ...]  # one per turn after the first
    seed: int

    @property
    def turns(self) -> int:
        return len(self.observations) + 1


def build_sessions(config: PolicyBenchConfig, vocab: int) -> list[list[Session]]:
    """The sessions of each RL step, in a random arrival order. A group keeps its task
    prompt and its typical length (``group_turns``) across steps; each step draws its
    samples' turns (``+- turn_jitter``), observations and seeds anew."""
    rng = random.Random(config.seed)
    prompts = [tuple(rng.randrange(vocab) for _ in range(config.prompt_tokens))
               for _ in config.group_turns]
    steps = []
    for step in range(config.rl_steps):
        sessions = []
        for g, base in enumerate(config.group_turns):
            for k in range(config.group_size):
                turns = max(1, base + rng.randint(-config.turn_jitter, config.turn_jitter))
                obs = tuple(tuple(rng.randrange(vocab) for _ in range(config.obs_tokens))
                            for _ in range(turns - 1))
                sessions.append(Session(f"r{step}-g{g}-s{k}", f"g{g}", prompts[g], obs,
                                        rng.randrange(1 << 30)))
        rng.shuffle(sessions)
        steps.append(sessions)
    return steps


def _engines(config: PolicyBenchConfig, seed: int) -> list[PacedEngine]:
    cfg = EngineConfig(num_kv_blocks=config.kv_blocks, block_size=config.block_size,
                       max_num_seqs=config.max_num_seqs,
                       max_num_batched_tokens=config.max_num_batched_tokens,
                       spec_mode="off", seed=seed)
    model_config = ModelConfig.from_dict(TINY_MODEL)
    return [PacedEngine(Engine(init_random(model_config, seed=seed, dtype=torch.float32), cfg),
                        config.step_ms / 1e3, config.prefill_us / 1e6, config.decode_us / 1e6)
            for _ in range(config.num_replicas)]


async def _run_sessions(router: Router, sessions: Sequence[Session], max_tokens: int
                        ) -> tuple[list[GenResult], float]:
    """Runs every session (its turns one after another, all sessions at once); a
    finished session is reported to the router (``finish_trajectory``, as a rollout
    driver does). Returns the results and the makespan."""
    results: list[GenResult] = []

    async def one(s: Session) -> None:
        context = s.prompt
        for turn in range(s.turns):
            req = GenRequest(
                request_id=f"{s.session_id}-t{turn}", prompt_ids=context,
                sampling=SamplingParams(temperature=1.0, max_tokens=max_tokens,
                                        seed=s.seed + turn, logprobs=False),
                trajectory_id=s.session_id, group_id=s.group_id)
            result = await router.generate(req)
            results.append(result)
            context = context + result.output_ids
            if turn < len(s.observations):
                context = context + s.observations[turn]
        router.finish_trajectory(s.session_id)

    t0 = time.perf_counter()
    await asyncio.gather(*(one(s) for s in sessions))
    return results, time.perf_counter() - t0


async def run_policy_once(config: PolicyBenchConfig, policy: str,
                          steps: Sequence[Sequence[Session]], seed: int = 0) -> dict[str, Any]:
    """One run over fresh replicas routed by ``policy``: the RL steps one after another
    (the router, its policy and the replicas' caches carry over). ``makespan_s`` is
    the sum of the steps' makespans."""
    engines = _engines(config, seed)
    backends = [InProcessBackend(f"replica-{i}", AsyncEngine(e), owns_engine=True)
                for i, e in enumerate(engines)]
    router = Router(backends, make_policy(policy, **config.policy_kwargs(policy)),
                    RouterConfig(health_interval_s=0.05))
    results: list[GenResult] = []
    makespans = []
    async with router:
        for sessions in steps:
            got, makespan = await _run_sessions(router, sessions, config.max_tokens)
            results += got
            makespans.append(makespan)
        stats = router.stats
        served = dict(stats.per_replica)
    prompt = sum(r.num_prompt_tokens for r in results)
    cached = sum(r.num_cached_tokens for r in results)
    compute = sum(e.inner.stats.total_step_s for e in engines)
    paced = sum(e.paced_s for e in engines)
    return {"policy": policy, "prefix_hit_rate": cached / prompt if prompt else math.nan,
            "makespan_s": sum(makespans), "step_makespans_s": makespans,
            "migrations": stats.migrations,
            "preemptions": sum(r.num_preemptions for r in results),
            "requests": len(results), "per_replica": served,
            "prompt_tokens": prompt, "cached_tokens": cached,
            "steps": sum(e.inner.stats.num_steps for e in engines),
            # share of the replicas' step time that is the pacing (the rest: compute on
            # this machine; near 1 means the cost model, not the machine, sets the pace)
            "paced_fraction": paced / (paced + compute) if paced + compute > 0 else math.nan}


def run_policies(config: PolicyBenchConfig, log: Log = _quiet) -> dict[str, Any]:
    """Each policy over the same sessions, ``repeats`` times, policies taking turns
    (the order rotates). Returns ``{"policies": rows, "policy_runs": runs}``; a row has
    ``policy``, ``prefix_hit_rate``, ``makespan_s``, ``migrations`` (medians)."""
    sessions = build_sessions(config, VOCAB)
    torch.set_num_threads(1)
    # warm-up (first torch calls, allocator), not measured
    warm = dataclasses.replace(config, group_turns=(1,), group_size=1, rl_steps=1)
    asyncio.run(run_policy_once(warm, config.policies[0], build_sessions(warm, VOCAB)))
    runs: list[dict[str, Any]] = []
    for rep in range(config.repeats):
        order = list(config.policies)
        shift = rep % len(order)
        for policy in order[shift:] + order[:shift]:
            run = asyncio.run(run_policy_once(config, policy, sessions, config.seed + rep))
            run["repeat"] = rep
            runs.append(run)
            log(f"policies rep {rep} {policy}: hit rate {run['prefix_hit_rate']:.3f} "
                f"makespan {run['makespan_s']:.2f} s migrations {run['migrations']} "
                f"paced {run['paced_fraction']:.2f} per replica {run['per_replica']}")
    rows = []
    for policy in config.policies:
        mine = [r for r in runs if r["policy"] == policy]
        rows.append({
            "policy": policy,
            "prefix_hit_rate": _median([r["prefix_hit_rate"] for r in mine]),
            "makespan_s": _median([r["makespan_s"] for r in mine]),
            "migrations": _median([float(r["migrations"]) for r in mine]),
            "preemptions": _median([float(r["preemptions"]) for r in mine]),
            "repeats": len(mine),
        })
    return {"policies": rows, "policy_runs": runs}


# --------------------------------------------------------------------------- report


def targets(report: dict[str, Any]) -> dict[str, Any]:
    """The targets the report is checked against: ``war route`` with the ``war`` policy
    over SGLang's API at least sglang-router's requests/s at each number in flight and
    affinity (the median of side-by-side ratios, ``vs_sglang_router``; reported as
    ``{concurrency: {affinity: ratio}}``), when both were measured; ``war`` at least
    ``cache_aware``'s prefix hit rate, and a shorter makespan."""
    out: dict[str, Any] = {}
    vs = {(r["concurrency"], r["affinity"]): r["vs_sglang_router"]
          for r in report.get("router_rps", [])
          if r["router"] == "war" and r["policy"] == "war" and r["api"] == "sglang"
          and r.get("vs_sglang_router") is not None}
    if vs:
        table: dict[str, dict[str, float]] = {}
        for (conc, a), v in sorted(vs.items()):
            table.setdefault(str(conc), {})[str(a)] = round(v, 4)
        out["war_rps_vs_sglang_router"] = table
        out["war_rps_ge_sglang_router"] = all(v >= 1.0 for v in vs.values())
    rows = {r["policy"]: r for r in report.get("policies", [])}
    if "war" in rows and "cache_aware" in rows:
        w, c = rows["war"], rows["cache_aware"]
        out["war_hit_rate_ge_cache_aware"] = bool(
            w["prefix_hit_rate"] >= c["prefix_hit_rate"] - 1e-9)
        out["war_makespan_lt_cache_aware"] = bool(w["makespan_s"] < c["makespan_s"])
        out["makespan_ratio_war_over_cache_aware"] = (
            w["makespan_s"] / c["makespan_s"] if c["makespan_s"] else math.nan)
    return out


def summary_line(report: dict[str, Any]) -> str:
    """One line: router overhead at the highest affinity (per number in flight), then
    the policies."""
    parts = []
    rps = report.get("router_rps", [])
    for conc in sorted({r["concurrency"] for r in rps}):
        top = max(r["affinity"] for r in rps)
        cells = []
        for r in rps:
            if r["affinity"] != top or r["concurrency"] != conc or (
                    r["router"] == "direct" and r["api"] != "war"):
                continue
            name = r["router"] if r["policy"] is None else f"{r['router']}/{r['policy']}"
            if r["router"] == "war" and r["api"] == "sglang":
                name += "[/generate]"
            extra = "" if r["router"] == "direct" else f" +{r['added_p50_ms']:.1f}ms"
            if r["router"] == "war" and r.get("vs_sglang_router") is not None:
                extra += f" {r['vs_sglang_router']:.2f}x"
            cells.append(f"{name} {r['rps']:.0f}/s{extra}")
        parts.append(f"rps@affinity {top:g}, {conc} in flight: " + ", ".join(cells))
    pol = report.get("policies", [])
    if pol:
        parts.append("policies hit/makespan: " + ", ".join(
            f"{r['policy']} {r['prefix_hit_rate']:.2f}/{r['makespan_s']:.1f}s" for r in pol))
    return "bench_router: " + "; ".join(parts)


def _main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m war.router.bench",
                                description="benchmark helpers run as processes")
    sub = p.add_subparsers(dest="command", required=True)
    r = sub.add_parser("replicas", help="serve instant replicas on loopback ports")
    r.add_argument("--port", type=int, action="append", required=True)
    r.add_argument("--max-output-tokens", type=int, default=8)
    args = p.parse_args(argv)
    with contextlib.suppress(KeyboardInterrupt):
        aio.run(serve_instant_replicas(args.port, args.max_output_tokens))
    return 0


if __name__ == "__main__":
    sys.exit(_main())


"""Benchmark: the router's own CPU per routed request, without sockets.

Builds one `war route` app per policy (the app `war route` serves, its generation
endpoint's fast route) over 4 replicas reached through WAR's replica client, whose
HTTP pool (`war.backends.h1.Pool.request`) is replaced in this process by a stand-in
that answers at once as an instant replica would (the prompt's first tokens), so that
everything the router does for a request runs (parsing, the policy, the replica call's
body and answer, rendering, bookkeeping, metrics) and nothing else: no sockets, no
event-loop I/O, no other process. The policies take turns window by window (500
requests each, their order alternating) on the same load as the routing-throughput
benchmark's (`build_load`: a request continues an earlier session with probability
`affinity`); CPU time is the process's (`time.process_time`), the first windows
warm up.

    python benchmarks/router/bench_path_cpu.py --json /tmp/bench_path_cpu.json

Prints one summary line (µs of CPU per request per policy and affinity); `--json OUT`
writes the report. Figures are of this machine: compare policies within one run, or
one policy across code versions run back to back.
"""

from __future__ import annotations

import argparse
import itertools
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

import orjson

from war import aio
from war.backends import h1
from war.cli.route import build_router
from war.engine.bench import machine_info
from war.outputs import output_file_arg, write_json
from war.router.bench import POLICIES, build_load, sglang_answer
from war.router.edge import FastRoute
from war.router.server import build_response, create_router_app
from war.types import GenResult

API_PATHS = {"sglang": "/generate", "war": "/v1/completions"}
WINDOW = 500
_answers = itertools.count()


async def instant_answer(self: h1.Pool, method: str, target: str, *, body: bytes | None = None,
                         headers: tuple[tuple[str, str], ...] = (), timeout_s: float,
                         connect_timeout_s: float) -> h1.Response:
    """Stands in for ``h1.Pool.request``: the answer an instant replica gives (its
    first prompt tokens back, as many as asked), in SGLang's or WAR's shape (the
    instant replica's own: ``sglang_answer``, ``build_response``)."""
    data = orjson.loads(body) if body else {}
    answer: Any
    if target.endswith("/generate"):
        ids, limit = data["input_ids"], data["sampling_params"]["max_new_tokens"]
    elif target.endswith("/v1/completions"):
        ids, limit = data["prompt"], data["max_tokens"]
    else:
        return h1.Response(200, "OK", b'{"status":"ok"}')
    result = GenResult(f"r-{next(_answers)}", tuple(ids[:limit]), (), "length", len(ids))
    if target.endswith("/generate"):
        answer = sglang_answer(result)
    else:
        answer = build_response(result.request_id, "war", [result], ["stand-in"], False)
    return h1.Response(200, "OK", orjson.dumps(answer))


def fast_route(policy: str, api: str) -> FastRoute:
    router = build_router([f"{api}+http://127.0.0.1:{9000 + i}" for i in range(4)], policy)
    app = create_router_app(router)
    return app.state.fast_routes[("POST", API_PATHS[api])]  # type: ignore[no-any-return]


def bodies(api: str, num: int, affinity: float, seed: int, max_tokens: int = 8
           ) -> list[tuple[bytes, dict[str, str]]]:
    out = []
    for item in build_load(num, affinity, seed):
        body: dict[str, Any] = (
            {"input_ids": list(item.prompt),
             "sampling_params": {"max_new_tokens": max_tokens, "temperature": 0.0}}
            if api == "sglang" else
            {"prompt": list(item.prompt), "max_tokens": max_tokens, "temperature": 0.0})
        out.append((orjson.dumps(body), {"x-trajectory-id": item.session,
                                         "content-type": "application/json"}))
    return out


async def measure(routes: dict[str, FastRoute], load: Sequence[tuple[bytes, dict[str, str]]],
                  warm_windows: int) -> dict[str, list[float]]:
    """CPU seconds per request of each route, per window after the warm-up."""
    failed: list[int] = []

    def respond(status: int, payload: bytes) -> None:
        if status != 200:
            failed.append(status)

    names = list(routes)
    per: dict[str, list[float]] = {n: [] for n in names}
    for w, start in enumerate(range(0, len(load), WINDOW)):
        window = load[start:start + WINDOW]
        for name in (names if w % 2 == 0 else names[::-1]):
            handle = routes[name].handle
            t0 = time.process_time()
            for raw, headers in window:
                out = await handle(raw, headers, respond)
                if out is not None:
                    respond(*out)
            # (a last, partial window still runs, so the policies see every request,
            # but is not timed: a window of one request would weigh as one of 500)
            if w >= warm_windows and len(window) == WINDOW:
                per[name].append((time.process_time() - t0) / len(window))
    if failed:
        raise RuntimeError(f"{len(failed)} requests failed (statuses {sorted(set(failed))})")
    return per


def run(policies: Sequence[str], api: str, affinities: Sequence[float], num: int, seed: int,
        log: Callable[[str], None]) -> list[dict[str, Any]]:
    rows = []
    original = h1.Pool.request
    h1.Pool.request = instant_answer  # type: ignore[method-assign]
    try:
        for affinity in affinities:
            routes = {p: fast_route(p, api) for p in policies}  # fresh routers per affinity
            load = bodies(api, num, affinity, seed)
            per = aio.run(measure(routes, load, warm_windows=4))
            for policy, values in per.items():
                us = 1e6 * statistics.median(values)
                rows.append({"policy": policy, "api": api, "affinity": affinity,
                             "cpu_us_per_request": us, "windows": len(values)})
                log(f"affinity {affinity:.2f} {policy}: {us:.1f} µs/request")
    finally:
        h1.Pool.request = original  # type: ignore[method-assign]
    return rows


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--json", type=output_file_arg, metavar="OUT", help="write the report as JSON")
    p.add_argument("--policies", nargs="+", choices=POLICIES, default=list(POLICIES))
    p.add_argument("--api", choices=tuple(API_PATHS), default="sglang",
                   help="the API the router is reached over and reaches its replicas with")
    p.add_argument("--affinities", type=float, nargs="+", default=[0.0, 0.5, 0.9])
    p.add_argument("--requests", type=int, default=20_000, help="requests per policy and affinity")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    if args.requests < 5 * WINDOW:
        p.error(f"--requests must be at least {5 * WINDOW} (4 windows of {WINDOW} warm up)")
    if any(not 0.0 <= a <= 1.0 for a in args.affinities):
        p.error("affinities must be in [0, 1]")
    t0 = time.perf_counter()
    rows = run(args.policies, args.api, args.affinities, args.requests, args.seed,
               lambda m: print(m, file=sys.stderr, flush=True))
    report = {"machine": machine_info(), "api": args.api, "requests": args.requests,
              "window": WINDOW, "rows": rows, "wall_s": time.perf_counter() - t0}
    if args.json is not None:
        write_json(args.json, report)
    cells = [f"{r['policy']}@{r['affinity']:g} {r['cpu_us_per_request']:.0f}" for r in rows]
    print(f"bench_path_cpu ({args.api}): µs of router CPU per request, in process: "
          + ", ".join(cells))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

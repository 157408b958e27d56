"""`war route`: one router in front of several replicas, over HTTP.

Knows the options of the command, how they become backends (``make_backend`` on each
``--replica`` spec), a routing policy (``make_policy``), a ``Router`` and its app, and
how to serve the app with ``war.router.edge`` (its generation endpoints without ASGI,
the rest through the app), the router's health checks running for the app's lifetime
(started and stopped by its lifespan). Binds 127.0.0.1 unless told otherwise;
the API key clients must send comes from ``--api-key`` or ``WAR_API_KEY``, and the key
the router sends every replica (``war serve --api-key`` there) from
``--replica-api-key`` or ``WAR_REPLICA_API_KEY``; neither is ever printed. A spec or
option it cannot use is reported on one line with exit status 2.

Does not know how requests are placed (``war.router``), how replicas are reached
(``war.backends``) nor the HTTP API (``war.router.server``).
"""

from __future__ import annotations

import argparse
import math
import os
import sys
from typing import TYPE_CHECKING, TypeAlias

from war import aio
from war.cli.console import one_line
from war.cli.serve import _is_loopback

if TYPE_CHECKING:
    from fastapi import FastAPI

    from war.router.router import Router

Subparsers: TypeAlias = "argparse._SubParsersAction[argparse.ArgumentParser]"

POLICIES = ("war", "cache_aware", "least_load", "round_robin")
BAD_USAGE_STATUS = 2
REPLICA_KEY_ENV = "WAR_REPLICA_API_KEY"


def add_route_command(commands: Subparsers) -> None:
    p = commands.add_parser(
        "route",
        help="route requests over several replicas (OpenAI-style and SGLang endpoints)",
        description="Serves POST /v1/completions and SGLang's POST /generate (token-id "
        "prompts), POST /v1/rl_step and /v1/trajectories/finish, /health, /v1/load and "
        "/metrics in front of replicas given as specs: war+http://HOST:PORT (war serve), "
        "vllm+http://HOST:PORT/?model=NAME (its served model name), sglang+http://HOST:PORT.",
    )
    p.add_argument("--replica", action="append", required=True, metavar="SPEC",
                   help="a replica (repeat for each): war+http://HOST:PORT, "
                        "vllm+http://HOST:PORT/?model=NAME or sglang+http://HOST:PORT")
    p.add_argument("--policy", choices=POLICIES, default="war",
                   help="routing policy (default: war)")
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default: 127.0.0.1)")
    p.add_argument("--port", type=int, default=8080, help="port to bind (default: 8080)")
    p.add_argument("--api-key", default=None, metavar="KEY",
                   help="require 'Authorization: Bearer KEY' (default: $WAR_API_KEY, if set)")
    p.add_argument("--replica-api-key", default=None, metavar="KEY",
                   help="send 'Authorization: Bearer KEY' on every call to the replicas "
                        "(their war serve --api-key; default: $WAR_REPLICA_API_KEY, if set, "
                        "which other users cannot read from the process list)")
    p.add_argument("--eos-token-id", type=int, action="append", default=[], metavar="ID",
                   help="stop token added to requests without ignore_eos (repeat for several; "
                        "the router has no tokenizer to read it from)")
    p.add_argument("--health-interval", type=float, default=1.0, metavar="S",
                   help="seconds between health checks of the replicas (default: 1)")
    p.add_argument("--health-timeout", type=float, default=5.0, metavar="S",
                   help="seconds one replica's health and load check may take before it "
                        "is marked down (replicas are checked concurrently; default: 5)")
    p.add_argument("--no-failover-in-flight", dest="failover_in_flight",
                   action="store_false",
                   help="leave the requests in flight on a replica that fails its health "
                        "check to their own timeout (default: they are cancelled and sent "
                        "to another replica at once)")
    p.add_argument("--stall-timeout", type=float, default=None, metavar="S",
                   help="mark a replica down when it has had requests in flight for S "
                        "seconds with none completing (its health check answering, its "
                        "engine wedged): its requests go to other replicas, and it "
                        "rejoins once its health check passes with none of them left "
                        "there (default: off)")
    p.add_argument("--auth-retry", type=float, default=30.0, metavar="S",
                   help="seconds before a replica that refused the replica key gets a "
                        "trial request again, where its load poll needs no key "
                        "(default: 30)")
    p.add_argument("--max-attempts", type=int, default=4, metavar="N",
                   help="replicas tried for one request before it fails (default: 4)")
    p.add_argument("--served-model-name", default="war", metavar="NAME",
                   help="the model name reported when a request names none (default: war)")
    p.add_argument("--log-level", default="info",
                   choices=["critical", "error", "warning", "info", "debug"],
                   help="the server's log level (default: info)")
    p.set_defaults(run=run_route)


def _fail(message: str) -> int:
    # (a replica spec's message lists the forms, one a line)
    print(f"war route: error: {one_line(message)}", file=sys.stderr)
    return BAD_USAGE_STATUS


def replica_api_key(args: argparse.Namespace) -> str | None:
    """The key sent to the replicas: ``--replica-api-key``, else ``$WAR_REPLICA_API_KEY``
    (empty: none). Raises ``ValueError`` (without the key) for one that would break the
    ``Authorization`` header."""
    key: str | None = (getattr(args, "replica_api_key", None)
                       or os.environ.get(REPLICA_KEY_ENV) or None)
    _check_replica_key(key)
    return key


def _check_replica_key(key: str | None) -> None:
    if key is None:
        return
    if any((c < " " and c != "\t") or c >= "\x7f" for c in key):
        raise ValueError(f"--replica-api-key (or {REPLICA_KEY_ENV}) holds a control or "
                         "non-ASCII character (a trailing newline?)")
    if not key.strip():
        raise ValueError(f"--replica-api-key (or {REPLICA_KEY_ENV}) is blank")


def build_router(specs: list[str], policy: str, health_interval_s: float = 1.0,
                 max_attempts: int = 4, health_timeout_s: float = 5.0,
                 replica_api_key: str | None = None, failover_in_flight: bool = True,
                 auth_retry_s: float = 30.0, stall_timeout_s: float | None = None
                 ) -> Router:
    """A router over ``make_backend(spec, api_key=replica_api_key)`` for each spec (the
    key goes to every replica as ``Authorization: Bearer``). Raises ``ValueError`` for
    a spec or setting it cannot use."""
    from war.backends import make_backend
    from war.router.policies import make_policy
    from war.router.router import Router, RouterConfig

    if not specs:
        raise ValueError("at least one --replica is needed")
    _check_replica_key(replica_api_key)
    config = RouterConfig(max_attempts=max_attempts, health_interval_s=health_interval_s,
                          health_timeout_s=health_timeout_s,
                          failover_in_flight=failover_in_flight, auth_retry_s=auth_retry_s,
                          stall_timeout_s=stall_timeout_s)
    backends = []
    for spec in specs:
        try:
            backends.append(make_backend(spec, api_key=replica_api_key))
        except ValueError as e:
            raise ValueError(f"--replica {spec!r}: {e}") from None
    names = [b.name for b in backends]
    dup = next((n for n in names if names.count(n) > 1), None)
    if dup is not None:
        raise ValueError(f"two replicas are named {dup!r} (give each replica once)")
    try:
        chosen = make_policy(policy)
    except KeyError as e:
        raise ValueError(str(e.args[0] if e.args else e)) from None
    return Router(backends, chosen, config)


def build_app(args: argparse.Namespace) -> FastAPI:
    """The app for parsed ``war route`` arguments (raises ``ValueError``)."""
    from war.router.server import create_router_app

    if not 0 <= args.port < 65536:
        raise ValueError(f"--port must be in [0, 65536), got {args.port}")
    if not args.host.strip():  # (it would bind every interface, as 0.0.0.0 does)
        raise ValueError("--host is empty; give an address (0.0.0.0: every interface)")
    for option in ("--health-interval", "--health-timeout", "--auth-retry", "--stall-timeout"):
        value = getattr(args, option[2:].replace("-", "_"))
        if value is not None and not 0 < value < math.inf:  # (None: --stall-timeout's off)
            raise ValueError(f"{option} must be a finite number > 0, got {value}")
    if args.max_attempts < 1:
        raise ValueError(f"--max-attempts must be >= 1, got {args.max_attempts}")
    bad = next((t for t in args.eos_token_id if t < 0), None)
    if bad is not None:
        raise ValueError(f"--eos-token-id must be >= 0, got {bad}")
    router = build_router(args.replica, args.policy, args.health_interval, args.max_attempts,
                          args.health_timeout, replica_api_key(args),
                          args.failover_in_flight, args.auth_retry, args.stall_timeout)
    api_key: str | None = args.api_key or os.environ.get("WAR_API_KEY") or None
    return create_router_app(router, api_key=api_key, eos_token_ids=args.eos_token_id,
                             model_name=args.served_model_name, manage_router=True)


def run_route(args: argparse.Namespace) -> int:
    try:
        app = build_app(args)
    except ValueError as e:
        return _fail(str(e))
    if not (args.api_key or os.environ.get("WAR_API_KEY")) and not _is_loopback(args.host):
        print(f"war route: warning: serving on {args.host} without an API key "
              "(set --api-key or WAR_API_KEY)", file=sys.stderr)
    aio.settle_heap()
    try:
        aio.run(_serve(app, args.host, args.port, args.log_level))
    except OSError as e:  # e.g. the port is taken
        return _fail(f"cannot serve on {args.host}:{args.port}: {e.strerror or e}")
    except RuntimeError as e:  # the app's startup failed
        return _fail(str(e))
    return 0


async def _serve(app: FastAPI, host: str, port: int, log_level: str) -> None:
    import logging

    from war.router.edge import Edge, EdgeConfig, serve
    from war.router.server import MAX_BODY_BYTES

    logging.basicConfig(format="%(levelname)s: %(message)s")
    logging.getLogger("war.router.edge").setLevel(log_level.upper())
    edge = Edge(app, app.state.fast_routes, EdgeConfig(max_body_bytes=MAX_BODY_BYTES))
    await serve(edge, host, port)

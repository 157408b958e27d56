"""`war serve`: one replica behind the OpenAI-compatible HTTP API.

Knows the options of the command, how they map to an ``EngineConfig``, and how to
run the app with uvicorn on one event loop with the engine's thread started
before and closed after serving. Binds 127.0.0.1 unless told otherwise. The API
key comes from ``--api-key`` or the environment variable ``WAR_API_KEY``.

Does not know the HTTP API (``war.engine.server``) nor how the engine works.
"""

from __future__ import annotations

import argparse
import ipaddress
import os
import socket
import sys
from pathlib import Path
from typing import TYPE_CHECKING, TypeAlias

from war import aio
from war.engine.config import DTYPES, SPEC_MODES

if TYPE_CHECKING:
    from war.engine.engine import Engine

Subparsers: TypeAlias = "argparse._SubParsersAction[argparse.ArgumentParser]"

MISSING_MODEL_STATUS = 2


def add_serve_command(commands: Subparsers) -> None:
    p = commands.add_parser(
        "serve",
        help="serve a model over an OpenAI-compatible HTTP API (one replica)",
        description="Loads a Hugging Face model folder (config.json, *.safetensors, optional "
        "tokenizer.json) and serves POST /v1/completions, /health, /v1/models, /v1/load, "
        "/v1/history, /v1/weights, /v1/rl_step, /v1/trajectories/finish and /metrics.",
    )
    p.add_argument("--model", required=True, type=Path, metavar="FOLDER",
                   help="Hugging Face model folder")
    p.add_argument("--served-model-name", default="war", metavar="NAME",
                   help="the model name clients send (default: war)")
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default: 127.0.0.1)")
    p.add_argument("--port", type=int, default=8000, help="port to bind (default: 8000)")
    p.add_argument("--api-key", default=None, metavar="KEY",
                   help="require 'Authorization: Bearer KEY' (default: $WAR_API_KEY, if set)")
    p.add_argument("--spec-mode", choices=SPEC_MODES, default="auto",
                   help="speculation: load-aware (auto), always or off")
    p.add_argument("--dtype", choices=DTYPES, default="float32", help="weights, activations, KV")
    p.add_argument("--device", default="cpu", help="torch device (cpu, cuda, cuda:1...)")
    p.add_argument("--kv-cache-mb", type=int, default=256, metavar="MB",
                   help="memory of the paged KV cache in MiB (default: 256)")
    p.add_argument("--block-size", type=int, default=16, help="tokens per KV block")
    p.add_argument("--max-num-seqs", type=int, default=128, help="most sequences in a step")
    p.add_argument("--max-num-batched-tokens", type=int, default=2048,
                   help="most tokens in one forward pass")
    p.add_argument("--max-model-len", type=int, default=None,
                   help="longest sequence (default: the model's max_position_embeddings)")
    p.add_argument("--kv-hold-s", type=float, default=0.0, metavar="S",
                   help="keep a finished turn's KV for its trajectory's next turn this long "
                   "(agentic tool calls; default: 0, off)")
    p.add_argument("--admit-whole-prompt", action="store_true",
                   help="admit a request only when its whole prefill fits the free KV")
    p.add_argument("--seed", type=int, default=0, help="seed of the engine's random stream")
    p.add_argument("--log-level", default="info",
                   choices=["critical", "error", "warning", "info", "debug"],
                   help="uvicorn's log level")
    p.set_defaults(run=run_serve)


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def run_serve(args: argparse.Namespace) -> int:
    folder: Path = args.model
    if not folder.is_dir():
        problem = (f"{folder} is not a folder (--model takes a Hugging Face model folder)"
                   if folder.exists() else f"model folder not found: {folder}")
        print(f"war: error: {problem}", file=sys.stderr)
        return MISSING_MODEL_STATUS
    if not (folder / "config.json").is_file():
        print(f"war: error: {folder} has no config.json (not a Hugging Face model folder)",
              file=sys.stderr)
        return MISSING_MODEL_STATUS
    if not 0 <= args.port < 65536:
        raise ValueError(f"--port must be in [0, 65536), got {args.port}")
    if args.kv_cache_mb < 1:
        raise ValueError(f"--kv-cache-mb must be >= 1, got {args.kv_cache_mb}")
    api_key: str | None = args.api_key or os.environ.get("WAR_API_KEY") or None
    if api_key is None and not _is_loopback(args.host):
        print(f"war: warning: serving on {args.host} without an API key "
              "(set --api-key or WAR_API_KEY)", file=sys.stderr)

    # Heavy imports (torch, fastapi) only once the arguments are known to be sane.
    from war.engine.config import EngineConfig
    from war.engine.engine import Engine

    config = EngineConfig(
        block_size=args.block_size,
        kv_cache_bytes=args.kv_cache_mb * 1024 * 1024,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        max_model_len=args.max_model_len,
        spec_mode=args.spec_mode,
        kv_hold_s=args.kv_hold_s,
        admit_whole_prompt=args.admit_whole_prompt,
        dtype=args.dtype,
        device=args.device,
        seed=args.seed,
    )
    # The address is bound first: a port that is taken (or an address this machine
    # does not have) is one error line before the model is loaded, not uvicorn's log
    # and exit status after it. uvicorn then serves on this very socket (no race).
    try:
        sock = bind_socket(args.host, args.port)
    except OSError as e:
        raise ValueError(f"cannot serve on {args.host}:{args.port}: {e.strerror or e}") from None
    with sock:
        try:
            engine = Engine.from_pretrained(folder, config)
        except (MemoryError, RuntimeError) as e:
            # torch reports a failed allocation (a --kv-cache-mb too large for the device)
            # as a RuntimeError; any other RuntimeError is not a caller's mistake
            if not isinstance(e, MemoryError) and not _is_allocation_failure(e):
                raise
            raise ValueError(f"cannot load the model with a {args.kv_cache_mb} MiB KV cache "
                             f"on {args.device}: out of memory (try a smaller --kv-cache-mb)"
                             ) from None
        aio.run(_serve(engine, args.served_model_name, api_key, sock, args.log_level, folder))
    return 0


def _is_allocation_failure(e: RuntimeError) -> bool:
    """Whether torch raised ``e`` for memory it could not allocate (CPU or GPU)."""
    text = str(e).lower()
    return "out of memory" in text or "can't allocate memory" in text


def bind_socket(host: str, port: int) -> socket.socket:
    """A TCP socket bound to ``host:port`` (a name or an address, IPv4 or IPv6), as
    uvicorn binds one (address reuse on, inheritable); raises ``OSError``."""
    infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    family, kind, proto, _, address = infos[0]
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(address)
    except OSError:
        sock.close()
        raise
    sock.set_inheritable(True)
    return sock


async def _serve(engine: Engine, model_name: str, api_key: str | None, sock: socket.socket,
                 log_level: str, folder: Path) -> None:
    import uvicorn

    from war.engine.async_engine import AsyncEngine
    from war.engine.server import create_app
    from war.rollout.fingerprint import model_fingerprint

    async with AsyncEngine(engine) as async_engine:
        app = create_app(async_engine, model_name=model_name, api_key=api_key,
                         model_folder=folder, fingerprint=model_fingerprint)
        config = uvicorn.Config(app, log_level=log_level, access_log=False)
        await uvicorn.Server(config).serve(sockets=[sock])

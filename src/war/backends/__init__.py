"""How the router reaches replicas: one ``Backend`` per replica.

Knows: the backends (in-process ``AsyncEngine``, a ``war serve`` replica over
HTTP, a vLLM or SGLang server, a Ray actor, simulated and instant replicas for
tests and benchmarks) and how a replica spec string of the command line names one
(``make_backend``). Does not know routing; Ray is imported only when a Ray
backend is made, and torch only when ``InProcessBackend`` is first used (the router
process needs neither).
"""

from __future__ import annotations

import importlib
import math
from typing import TYPE_CHECKING, Any
from urllib.parse import parse_qsl, urlsplit

from war.backends.base import Backend, ReplicaUnavailable
from war.backends.http import WarHttpBackend
from war.backends.openai import OpenAICompatBackend
from war.backends.simulated import InstantBackend, SimulatedBackend

if TYPE_CHECKING:
    from war.backends.inprocess import InProcessBackend
    from war.backends.ray_actor import EngineActor, RayEngineBackend, start_ray_replica

_LAZY = {"InProcessBackend": "inprocess", "EngineActor": "ray_actor",
         "RayEngineBackend": "ray_actor", "start_ray_replica": "ray_actor"}


def __getattr__(name: str) -> Any:
    """The backends that host engines import torch: only when first asked for."""
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"war.backends.{module}"), name)

__all__ = [
    "SPEC_FORMS",
    "Backend",
    "EngineActor",
    "InProcessBackend",
    "InstantBackend",
    "OpenAICompatBackend",
    "RayEngineBackend",
    "ReplicaUnavailable",
    "SimulatedBackend",
    "WarHttpBackend",
    "make_backend",
    "start_ray_replica",
]

SPEC_FORMS = (
    "war+http://HOST:PORT[/PREFIX][?name=NAME&timeout_s=S]",
    "vllm+http://HOST:PORT[/PREFIX][?model=MODEL&name=NAME&timeout_s=S]",
    "sglang+http://HOST:PORT[/PREFIX][?name=NAME&timeout_s=S]",
    "sim://NAME (a simulated replica)",
    "instant://NAME (an instant echo replica)",
)
_KINDS = ("war", "vllm", "sglang")
_QUERY_KEYS = {"war": {"name", "timeout_s"}, "vllm": {"name", "timeout_s", "model"},
               "sglang": {"name", "timeout_s", "model"}}


def _bad(spec: str, why: str) -> ValueError:
    forms = "\n  ".join(SPEC_FORMS)
    return ValueError(f"bad replica spec {spec!r}: {why}; expected one of:\n  {forms}")


def make_backend(spec: str, *, name: str | None = None, api_key: str | None = None
                 ) -> Backend:
    """The backend a spec names (see ``SPEC_FORMS``; ``https`` works too). The
    backend's name is ``name``, else the spec's ``?name=``, else ``HOST:PORT``.
    Raises ValueError naming the problem for a spec it cannot read."""
    if not isinstance(spec, str) or not spec.strip():
        raise _bad(str(spec), "it is empty")
    spec = spec.strip()
    parts = urlsplit(spec)
    scheme = parts.scheme.lower()
    if scheme in ("sim", "instant"):
        label = name or parts.netloc or parts.path.lstrip("/")
        # (``sim://a/b``: a name and a path; the path would be dropped unseen)
        extra = parts.path.strip("/") if parts.netloc else ""
        if not label or extra or parts.query or parts.fragment:
            raise _bad(spec, f"{scheme}:// takes a name and nothing else")
        return SimulatedBackend(label) if scheme == "sim" else InstantBackend(label)
    kind, plus, transport = scheme.partition("+")
    if not plus or kind not in _KINDS or transport not in ("http", "https"):
        raise _bad(spec, f"unknown scheme {parts.scheme!r}")
    if parts.username is not None or parts.password is not None:
        raise _bad(spec, "credentials do not go in the URL (pass api_key)")
    if parts.fragment:
        raise _bad(spec, "a '#fragment' has no meaning here")
    if not parts.hostname:
        raise _bad(spec, "no host")
    try:
        port = parts.port
    except ValueError as e:
        raise _bad(spec, f"bad port ({e})") from None
    if port == 0:  # (a port to bind on, "any free one"; nothing listens there to reach)
        raise _bad(spec, "port 0 cannot be connected to")
    try:
        pairs = parse_qsl(parts.query, keep_blank_values=True, strict_parsing=bool(parts.query))
    except ValueError as e:
        raise _bad(spec, f"bad query ({e})") from None
    query: dict[str, str] = {}
    for key, value in pairs:
        if key not in _QUERY_KEYS[kind]:
            allowed = ", ".join(sorted(_QUERY_KEYS[kind]))
            raise _bad(spec, f"unknown parameter {key!r} for {kind} (allowed: {allowed})")
        if key in query:
            raise _bad(spec, f"parameter {key!r} given twice")
        if not value:
            raise _bad(spec, f"parameter {key!r} is empty")
        query[key] = value
    host = parts.hostname if ":" not in parts.hostname else f"[{parts.hostname}]"
    netloc = host if port is None else f"{host}:{port}"
    base_url = f"{transport}://{netloc}{parts.path.rstrip('/')}"
    label = name or query.get("name") or netloc
    timeout_s: float | None = None
    if "timeout_s" in query:
        try:
            timeout_s = float(query["timeout_s"])
        except ValueError:
            raise _bad(spec, f"timeout_s must be a number, got {query['timeout_s']!r}") from None
        if not (timeout_s > 0 and math.isfinite(timeout_s)):
            raise _bad(spec, f"timeout_s must be > 0, got {query['timeout_s']!r}")
    if kind == "war":
        if timeout_s is None:
            return WarHttpBackend(label, base_url, api_key)
        return WarHttpBackend(label, base_url, api_key, timeout_s=timeout_s)
    if kind == "vllm" and "model" not in query:
        raise _bad(spec, "a vLLM replica needs ?model=NAME (its served model name)")
    if timeout_s is None:
        return OpenAICompatBackend(label, base_url, query.get("model"), api_key, server=kind)
    return OpenAICompatBackend(label, base_url, query.get("model"), api_key, server=kind,
                               timeout_s=timeout_s)

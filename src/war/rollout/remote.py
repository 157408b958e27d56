"""A run's remote replicas: ``war serve`` servers reached over HTTP (``RunConfig.endpoints``).

Knows: how a run connects to its endpoints before any work: each one's ``GET /v1/models``
is read, all at once and each within the probe's bound, and the run is refused, naming
every endpoint at fault, when one does not answer, refuses the key, is not a ``war serve``
replica (its answer states no ``max_model_len`` and ``vocab_size``: a ``war route``
router, or another server), serves a vocabulary smaller than the run's tokenizer (another
model) or states a fingerprint of the weights it serves other than the run's model's
(another checkpoint); what the run then sends turns to: the endpoints themselves, each
a replica that states its context length (whole groups each, as local replicas take them), or one
in-process ``Router`` with a WAR routing policy over them (placement by KV locality,
trajectory progress and load; health checks; a failed endpoint's requests sent elsewhere),
which states the least of their context lengths. The key sent to the servers (their ``war
serve --api-key``) is ``$WAR_REPLICA_API_KEY``'s, as ``war route`` sends it.

Does not know how a server generates, nor the routing policies (``war.router``), nor
which weights a server serves where it states no fingerprint (the run then trusts that
it serves its ``model``, whose folder gives the tokenizer and chat template).
"""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from war.backends.base import CredentialsRefused, ReplicaUnavailable
from war.backends.http import WarHttpBackend
from war.router.policies import make_policy
from war.router.router import Router
from war.types import GenRequest, GenResult

log = logging.getLogger(__name__)

KEY_ENV = "WAR_REPLICA_API_KEY"
"""The environment variable whose value is sent to the endpoints as their bearer token."""
GROUPS = "groups"
"""``RunConfig.routing_policy`` for no router: whole groups go to the least-assigned
endpoint, as they go to local replicas."""
PROBE_TIMEOUT_S = 10.0
"""How long an endpoint's ``/v1/models`` may take when a run connects."""
STEP_TIMEOUT_S = 5.0
"""How long an endpoint may take to take an RL step (``POST /v1/rl_step``), the
router's health timeout: one that accepts connections but does not answer holds up no
step longer (not a generation's timeout, minutes)."""
MAX_FAULTS_SHOWN = 8
"""Endpoints a refused connection names one by one (the rest are counted): a fleet's
worth of faults is no one-line error."""


@dataclass(frozen=True)
class Served:
    """What a ``war serve`` replica says of itself (``GET /v1/models``)."""

    model: str
    max_model_len: int
    vocab_size: int
    weight_version: int
    weights_fingerprint: str | None = None
    """The served weights' content fingerprint (``war.rollout.fingerprint``), where the
    server states it (``war serve`` does; ``None``: not known)."""


class Endpoint(WarHttpBackend):
    """A ``war serve`` replica of a run: its HTTP backend and what it serves (``Served``,
    set by ``connect``); it states its context length (``max_model_len``), which caps the
    run's trajectories on it (``war.rollout.agent.context_length``)."""

    served: Served | None = None

    @property
    def max_model_len(self) -> int | None:
        return None if self.served is None else self.served.max_model_len


class RoutedFleet:
    """The run's endpoints behind one in-process ``Router``: what the rollout driver sends
    every turn to. States the least of the endpoints' context lengths (a turn may be
    placed on any of them) and passes ended trajectories on to the router."""

    def __init__(self, router: Router, max_model_len: int) -> None:
        self.router = router
        self.max_model_len = max_model_len

    async def generate(self, request: GenRequest) -> GenResult:
        return await self.router.generate(request)

    def finish_trajectory(self, trajectory_id: str) -> bool:
        return self.router.finish_trajectory(trajectory_id)


def replica_api_key() -> str | None:
    """``$WAR_REPLICA_API_KEY`` (``None`` when unset or empty); ValueError when it holds
    whitespace only (the backend refuses one that would break its header itself)."""
    key = os.environ.get(KEY_ENV) or None
    if key is None:
        return None
    # (checked here, not by the backend, whose message would name no variable)
    if any((c < " " and c != "\t") or c >= "\x7f" for c in key):
        raise ValueError(f"{KEY_ENV} holds a control or non-ASCII character (a trailing "
                         "newline?)")
    if not key.strip():
        raise ValueError(f"{KEY_ENV} is blank")
    return key


def parse_served(data: Any) -> Served:
    """A ``Served`` from a ``/v1/models`` answer; ValueError saying what is missing."""
    entry = None
    if isinstance(data, dict) and isinstance(data.get("data"), list) and data["data"]:
        entry = data["data"][0]
    if not isinstance(entry, dict):
        raise ValueError("its /v1/models answer lists no model")
    values = {}
    for key in ("max_model_len", "vocab_size"):
        value = entry.get(key)
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(
                f"its /v1/models answer states no {key} (got {value!r}): not a war serve "
                "replica (a war route router, or another server?); endpoints are war "
                "serve replicas, which the run routes over itself")
        values[key] = value
    version = entry.get("weight_version", 0)
    return Served(model=str(entry.get("id", "")), max_model_len=values["max_model_len"],
                  vocab_size=values["vocab_size"],
                  weight_version=version if isinstance(version, int) else 0,
                  weights_fingerprint=fp if isinstance(fp := entry.get("weights_fingerprint"),
                                                       str) and fp else None)


async def connect(urls: Sequence[str], vocab_size: int,
                  probe_timeout_s: float = PROBE_TIMEOUT_S,
                  fingerprint: str | None = None) -> dict[str, Endpoint]:
    """One ``Endpoint`` per URL (``endpoint0``, ``endpoint1``, ...), each probed (see the
    module's docstring); ValueError naming every endpoint that cannot serve the run, with
    nothing left open. ``vocab_size``: the run's tokenizer's. ``fingerprint``: the run's
    model's (``war.rollout.fingerprint``): an endpoint that states another for the weights
    it serves is refused too; one that states none is trusted (and logged)."""
    key = replica_api_key()
    out = {f"endpoint{i}": Endpoint(f"endpoint{i}", url, key,
                                    health_timeout_s=probe_timeout_s)
           for i, url in enumerate(urls)}
    try:
        answers = await asyncio.gather(*(e.models() for e in out.values()),
                                       return_exceptions=True)
    except BaseException:  # (cancelled, Ctrl-C: the probes' connections are closed)
        await asyncio.shield(close_all(out))
        raise
    faults = []
    for (name, endpoint), answer in zip(out.items(), answers, strict=True):
        where = f"{name} ({endpoint.base_url})"
        if isinstance(answer, CredentialsRefused):
            faults.append(f"{where} refused the key ({answer.status}): set {KEY_ENV} to "
                          "its war serve --api-key")
        elif isinstance(answer, (ReplicaUnavailable, ValueError)):
            faults.append(f"{where} does not answer GET /v1/models: {answer}")
        elif isinstance(answer, BaseException):
            faults.append(f"{where}: {type(answer).__name__}: {answer}")
        else:
            try:
                endpoint.served = parse_served(answer)
            except ValueError as exc:
                faults.append(f"{where}: {exc}")
                continue
            if endpoint.served.vocab_size < vocab_size:
                faults.append(
                    f"{where} serves a vocabulary of {endpoint.served.vocab_size} tokens, "
                    f"fewer than the run's tokenizer's {vocab_size}: another model than "
                    "the run's model folder?")
            served = endpoint.served.weights_fingerprint
            if fingerprint is not None and served is not None and served != fingerprint:
                faults.append(
                    f"{where} serves other weights than the run's model (weights_fingerprint "
                    f"{served}, the model folder's {fingerprint}): load the model's weights "
                    "there (POST /v1/weights), or point model at the served checkpoint")
            elif fingerprint is not None and served is None:
                log.info("%s does not state which weights it serves; the run trusts that "
                         "they are its model's", where)
    if faults:
        await close_all(out)
        shown = faults if len(faults) <= MAX_FAULTS_SHOWN + 1 else [
            *faults[:MAX_FAULTS_SHOWN], f"and {len(faults) - MAX_FAULTS_SHOWN} more"]
        raise ValueError(f"the run's endpoints cannot serve it ({len(faults)} of "
                         f"{len(out)}): " + "; ".join(shown))
    return out


def routed(endpoints: Mapping[str, Endpoint], policy: str) -> RoutedFleet:
    """A ``RoutedFleet`` over ``endpoints`` with the routing policy named ``policy``
    (``war.router.policies``; ValueError for an unknown name). The router is not
    started (``await fleet.router.start()`` begins its health checks)."""
    try:
        chosen = make_policy(policy)
    except KeyError as exc:
        raise ValueError(exc.args[0]) from None
    lens = [e.max_model_len for e in endpoints.values()]
    if not lens or any(n is None for n in lens):
        raise ValueError("routed() needs connected endpoints (connect())")
    return RoutedFleet(Router(dict(endpoints), chosen), min(n for n in lens if n is not None))


async def close_all(endpoints: Mapping[str, Endpoint]) -> None:
    """Closes every endpoint's connections (each one's failure is not another's)."""
    await asyncio.gather(*(e.close() for e in endpoints.values()), return_exceptions=True)

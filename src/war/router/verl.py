"""WAR's routing policies as a verl router plugin.

Knows: the load-balancer protocol that verl (0.9) calls on a router plugin (``verl``'s
``RequestLoadBalancer``: ``acquire_server`` / ``release_server`` / ``add_servers`` /
``remove_servers`` / ``get_all_servers`` / ``get_status`` / ``clear_sticky_cache`` /
``get_total_inflight`` and the field declarations ``require_acquire_fields`` /
``require_release_fields``), how verl builds a plugin (``rollout.router_config_path``
names a YAML whose ``router_class`` is this class; verl wraps the class with
``ray.remote`` and constructs it as ``cls(servers, router_kwargs)``, ``router_kwargs``
being the whole YAML, ``router_class`` included), and how an acquire becomes a
``GenRequest`` for a WAR ``RoutingPolicy``: verl's ``request_id`` names one trajectory
and is reused by its turns, so it is the trajectory id; ``prompt_ids`` (the whole
context so far) are the prompt; no group id is known (the ``war`` policy's prefix tree
co-locates a group's samples by their shared prompt); each request counts ``prompt +
max_tokens`` tokens in flight (``max_tokens``: an estimate from the YAML) until it is
released. Time is ``time.monotonic`` (or an injected clock), passed as ``now``.

Does not know Ray or verl (neither is imported: the class is plain Python, usable and
testable without them), the servers' handles (passed back as given), nor what the
servers generate: a release tells only that a request ended, so the policy is told of
a completion with no output tokens.
"""

from __future__ import annotations

import itertools
import threading
import time
import zlib
from collections import OrderedDict
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from war.router.policies.base import ReplicaView, RoutingPolicy
from war.types import GenRequest, GenResult, SamplingParams

NO_SERVERS = "No available servers in load balancer"
KNOWN_KEYS = frozenset({"router_class", "policy", "policy_kwargs", "max_tokens",
                        "max_trajectories"})


@dataclass(frozen=True)
class VerlRouterConfig:
    """The plugin's settings, read from verl's ``router_kwargs`` (the router YAML).

    * ``policy``: a WAR routing policy name (``war``, ``cache_aware``, ``least_load``,
      ``round_robin``), built with ``make_policy(policy, **policy_kwargs)``.
    * ``max_tokens``: new tokens expected per request (load accounting only).
    * ``max_trajectories``: trajectories remembered for stickiness statistics and turn
      numbering (least recently used dropped).
    """

    policy: str = "war"
    policy_kwargs: Mapping[str, Any] = field(default_factory=dict)
    max_tokens: int = 1024
    max_trajectories: int = 100_000

    def __post_init__(self) -> None:
        if not isinstance(self.policy, str) or not self.policy:
            raise ValueError(f"policy must be a non-empty string, got {self.policy!r}")
        if not isinstance(self.policy_kwargs, Mapping):
            raise ValueError(f"policy_kwargs must be a mapping, got {self.policy_kwargs!r}")
        for name, value in (("max_tokens", self.max_tokens),
                            ("max_trajectories", self.max_trajectories)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an int >= 1, got {value!r}")

    @classmethod
    def from_router_kwargs(cls, router_kwargs: Mapping[str, Any] | None) -> VerlRouterConfig:
        """Reads the router YAML's dict; unknown keys are refused (typos)."""
        if router_kwargs is not None and not isinstance(router_kwargs, Mapping):
            raise ValueError(f"router_kwargs must be a mapping, got {router_kwargs!r}")
        kw = dict(router_kwargs or {})
        unknown = sorted(set(kw) - KNOWN_KEYS)
        if unknown:
            raise ValueError(f"unknown router_kwargs {unknown}; known: {sorted(KNOWN_KEYS)}")
        kw.pop("router_class", None)
        if kw.get("policy_kwargs") is None:
            kw.pop("policy_kwargs", None)
        elif not isinstance(kw["policy_kwargs"], Mapping):
            raise ValueError(f"policy_kwargs must be a mapping, got {kw['policy_kwargs']!r}")
        else:
            kw["policy_kwargs"] = dict(kw["policy_kwargs"])
        return cls(**kw)


@dataclass
class _Lease:
    """One acquired server, until it is released."""

    key: int
    server_id: str
    trajectory: str
    request: GenRequest
    size: int
    generation: int  # the policy instance that placed it


def _make_policy(config: VerlRouterConfig) -> RoutingPolicy:
    from war.router.policies import make_policy

    try:
        return make_policy(config.policy, **dict(config.policy_kwargs))
    except (KeyError, TypeError) as e:  # an unknown policy or setting: the YAML's mistake
        raise ValueError(f"router_kwargs: {e.args[0] if e.args else e}") from None


class WarVerlRouter:
    """A verl load balancer that places each request with a WAR routing policy.

    Construct as verl does: ``WarVerlRouter(servers, router_kwargs)``. ``policy_factory``
    (for tests and embedding) replaces ``make_policy``; ``clock`` replaces
    ``time.monotonic``. Methods are thread-safe (one lock).
    """

    def __init__(self, servers: Mapping[str, Any], router_kwargs: Mapping[str, Any] | None = None,
                 *, policy_factory: Callable[[], RoutingPolicy] | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.config = VerlRouterConfig.from_router_kwargs(router_kwargs)
        config = self.config
        self._factory: Callable[[], RoutingPolicy] = (
            policy_factory if policy_factory is not None else lambda: _make_policy(config))
        self.policy = self._factory()
        self._generation = 0
        self._clock = clock
        self._lock = threading.Lock()
        self._servers: dict[str, Any] = dict(servers)
        self._leases: dict[str, OrderedDict[int, _Lease]] = {s: OrderedDict() for s in servers}
        self._tokens: dict[str, int] = dict.fromkeys(servers, 0)
        self._by_trajectory: dict[str, OrderedDict[int, _Lease]] = {}
        self._sticky: OrderedDict[str, tuple[str, int]] = OrderedDict()  # -> (server, turns)
        self._keys = itertools.count()
        self.acquired = 0
        self.released = 0
        self.migrations = 0

    # ------------------------------------------------------------ field declarations

    def require_acquire_fields(self) -> list[str]:
        """verl passes these ``generate()`` fields to ``acquire_server``."""
        return ["prompt_ids"]

    def require_release_fields(self) -> list[str]:
        """verl passes these fields to ``release_server``."""
        return ["request_id"]

    # ------------------------------------------------------------ acquire / release

    def acquire_server(self, request_id: str, prompt_ids: list[int] | None = None,
                       **extra: Any) -> tuple[str, Any]:
        """The server for one turn of trajectory ``request_id`` and its handle. Other
        fields verl may pass (``extra``) are ignored. Raises ``RuntimeError`` when no
        server is registered."""
        with self._lock:
            if not self._servers:
                raise RuntimeError(NO_SERVERS)
            trajectory = str(request_id)
            request, turns = self._request(trajectory, prompt_ids)
            views = [ReplicaView(name=s, num_requests=len(self._leases[s]),
                                 tokens_in_flight=self._tokens[s]) for s in self._servers]
            decision = self.policy.select(request, views, self._clock())
            sid = decision.replica
            if sid not in self._servers:
                # the policy counts the request as placed: it failed
                self.policy.on_complete(request, None, sid, self._clock())
                raise RuntimeError(f"policy {self.policy.name} chose {sid!r}, which is not a "
                                   "registered server")
            if decision.migrated:
                self.migrations += 1
            size = len(request.prompt_ids) + request.sampling.max_tokens
            lease = _Lease(next(self._keys), sid, trajectory, request, size,
                           self._generation)
            self._leases[sid][lease.key] = lease
            self._tokens[sid] += size
            self._by_trajectory.setdefault(lease.trajectory, OrderedDict())[lease.key] = lease
            # (counted only once placed: a failed acquire is not a turn)
            self._sticky[trajectory] = (sid, turns)
            self._sticky.move_to_end(trajectory)
            while len(self._sticky) > self.config.max_trajectories:
                self._sticky.popitem(last=False)
            self.acquired += 1
            return sid, self._servers[sid]

    def _request(self, trajectory: str, prompt_ids: list[int] | None
                 ) -> tuple[GenRequest, int]:
        """The trajectory's next turn as a request, and its turn count after it (the
        plugin's state is not changed: ``acquire_server`` records it once placed)."""
        turns = self._sticky.get(trajectory, ("", 0))[1]
        if prompt_ids:
            prompt = tuple(int(t) for t in prompt_ids)
        else:  # no content known: a token of its own (never a real id), no false sharing;
            # within int32 (the prefix trees' token type), so in [-2**31, -1]
            prompt = (-1 - (zlib.crc32(trajectory.encode()) & 0x7FFF_FFFF),)
        request = GenRequest(request_id=f"{trajectory}#{turns}", prompt_ids=prompt,
                             sampling=SamplingParams(max_tokens=self.config.max_tokens),
                             trajectory_id=trajectory)
        return request, turns + 1

    def release_server(self, server_id: str, request_id: str | None = None) -> None:
        """A request placed on ``server_id`` ended. With ``request_id``, that
        trajectory's oldest open request on the server; without, the server's oldest.
        A release that matches nothing (a removed server, a double release) is ignored."""
        with self._lock:
            lease = self._find(str(server_id), None if request_id is None else str(request_id))
            if lease is None:
                return
            del self._leases[lease.server_id][lease.key]
            self._tokens[lease.server_id] -= lease.size
            open_ = self._by_trajectory.get(lease.trajectory)
            if open_ is not None:
                open_.pop(lease.key, None)
                if not open_:
                    del self._by_trajectory[lease.trajectory]
            self.released += 1
            if lease.generation == self._generation:
                r = lease.request
                done = GenResult(request_id=r.request_id, output_ids=(), logprobs=(),
                                 finish_reason="stop", num_prompt_tokens=len(r.prompt_ids))
                self.policy.on_complete(r, done, lease.server_id, self._clock())

    def _find(self, server_id: str, trajectory: str | None) -> _Lease | None:
        """The lease a release ends: ``trajectory``'s oldest on the server, or with no
        trajectory named, the server's oldest; None when nothing matches."""
        if server_id not in self._leases:
            return None
        if trajectory is None:
            return next(iter(self._leases[server_id].values()), None)
        # A named trajectory with no open lease here (a double release, or one never
        # acquired) ends nothing: falling back to the server's oldest lease would end
        # another trajectory's request, and tell the policy it finished.
        for lease in self._by_trajectory.get(trajectory, OrderedDict()).values():
            if lease.server_id == server_id:
                return lease
        return None

    # ------------------------------------------------------------ the pool

    def add_servers(self, servers: Mapping[str, Any]) -> None:
        """Registers servers (a known id gets the new handle)."""
        with self._lock:
            for sid, handle in servers.items():
                self._servers[sid] = handle
                self._leases.setdefault(sid, OrderedDict())
                self._tokens.setdefault(sid, 0)

    def remove_servers(self, server_ids: list[str]) -> None:
        """Unregisters servers; their open requests are forgotten and the policy told."""
        with self._lock:
            now = self._clock()
            for sid in server_ids:
                if sid not in self._servers:
                    continue
                del self._servers[sid]
                self.policy.on_replica_down(sid, now)
                for lease in self._leases.pop(sid).values():
                    open_ = self._by_trajectory.get(lease.trajectory)
                    if open_ is not None:
                        open_.pop(lease.key, None)
                        if not open_:
                            del self._by_trajectory[lease.trajectory]
                    if lease.generation == self._generation:
                        # its release will never come: the policy learns it failed
                        # there (as the router tells it of a replica's failure), or it
                        # counts the request in flight for good (the war policy's
                        # trajectory never idles, so never counts as finished)
                        self.policy.on_complete(lease.request, None, sid, now)
                del self._tokens[sid]

    def get_all_servers(self) -> list[str]:
        with self._lock:
            return list(self._servers)

    def get_inflight_count(self, server_id: str) -> int:
        with self._lock:
            return len(self._leases.get(server_id, ()))

    def get_total_inflight(self) -> int:
        with self._lock:
            return sum(len(v) for v in self._leases.values())

    def get_status(self) -> dict[str, Any]:
        """verl's status keys (``servers``: in-flight requests per server,
        ``total_inflight``, ``active_servers``) and WAR's figures."""
        with self._lock:
            inflight = {s: len(self._leases[s]) for s in self._servers}
            return {
                "servers": inflight,
                "total_inflight": sum(inflight.values()),
                "active_servers": len(self._servers),
                "registered_handles": list(self._servers),
                "tokens_in_flight": {s: self._tokens[s] for s in self._servers},
                "policy": self.policy.name,
                "acquired": self.acquired,
                "released": self.released,
                "migrations": self.migrations,
                "trajectories": len(self._sticky),
            }

    def clear_sticky_cache(self) -> dict[str, Any]:
        """Forgets every placement (a fresh policy): later turns go wherever the policy
        now chooses. Open requests stay counted until they are released."""
        with self._lock:
            cleared = len(self._sticky)
            self._sticky.clear()
            self.policy = self._factory()
            self._generation += 1
            return {"cleared_entries": cleared,
                    "server_loads": {s: len(self._leases[s]) for s in self._servers}}

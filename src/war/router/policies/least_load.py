"""Least load with trajectory stickiness (the placement verl ships).

Knows: which replica served each recent trajectory (a bounded, least recently used
map), and each replica's in-flight request count as the router reports it. Does not
know tokens, prefixes, KV capacity, the clock, nor how long requests are.

A request goes to the replica with the fewest requests in flight (ties: by name).
A trajectory's later turns go to the replica that served its first turn while that
replica is healthy, so its KV prefix stays warm; if that replica went down, the
turn goes to the least loaded one and ``Decision.migrated`` is set (a request that
``continues`` then needs its whole context, which the router resends).
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

from war.router.policies.base import Decision, ReplicaView
from war.router.policies.round_robin import healthy_sorted
from war.types import GenRequest, GenResult


@dataclass(frozen=True)
class LeastLoadConfig:
    """* ``max_trajectories``: trajectories remembered (least recently used dropped;
    verl keeps 10,000)."""

    max_trajectories: int = 10_000

    def __post_init__(self) -> None:
        value = self.max_trajectories
        if isinstance(value, bool) or not isinstance(value, int):  # (a NaN: no bound)
            raise ValueError(f"max_trajectories must be an int, got {value!r}")
        if self.max_trajectories < 1:
            raise ValueError(f"max_trajectories must be >= 1, got {self.max_trajectories}")


class LeastLoadPolicy:
    """Fewest in-flight requests, sticky per trajectory."""

    name: str = "least_load"

    def __init__(self, config: LeastLoadConfig | None = None) -> None:
        self.config = config if config is not None else LeastLoadConfig()
        # trajectory -> replica that serves it (None: that replica went down)
        self._sticky: OrderedDict[str, str | None] = OrderedDict()

    def select(self, request: GenRequest, replicas: list[ReplicaView], now: float) -> Decision:
        healthy = healthy_sorted(replicas)
        tid = request.trajectory_id
        held = self._sticky.get(tid) if tid is not None else None
        known = tid is not None and tid in self._sticky
        if held is not None and any(r.name == held for r in healthy):
            choice, migrated = held, False
        else:
            choice = min(healthy, key=lambda r: (r.num_requests, r.name)).name
            migrated = known  # it had a replica, which is gone
        if tid is not None:
            self._sticky[tid] = choice
            self._sticky.move_to_end(tid)
            while len(self._sticky) > self.config.max_trajectories:
                self._sticky.popitem(last=False)
        return Decision(choice, migrated=migrated)

    def on_complete(self, request: GenRequest, result: GenResult | None, replica: str,
                    now: float) -> None:
        pass

    def on_replica_down(self, replica: str, now: float) -> None:
        for tid, held in self._sticky.items():
            if held == replica:
                self._sticky[tid] = None

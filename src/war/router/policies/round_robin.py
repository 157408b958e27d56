"""Round robin: each request goes to the next healthy replica in name order.

Knows: the name of the replica it chose last. Does not know load, prefixes,
trajectories or the clock. Also holds ``healthy_sorted``, the fleet view every
policy starts from.
"""

from __future__ import annotations

from collections.abc import Sequence
from operator import attrgetter

from war.router.policies.base import Decision, ReplicaView
from war.types import GenRequest, GenResult

_by_name = attrgetter("name")


def healthy_sorted(replicas: Sequence[ReplicaView]) -> list[ReplicaView]:
    """The healthy replicas sorted by name (policies break ties by name, so their
    decisions do not depend on the order the router lists replicas in)."""
    healthy = sorted([r for r in replicas if r.healthy], key=_by_name)
    if not healthy:
        raise ValueError("no healthy replica to choose from")
    return healthy


class RoundRobinPolicy:
    """Cycles over the healthy replicas in name order: after replica ``x`` comes the
    first healthy replica whose name sorts after ``x`` (wrapping around), so a
    replica that goes down is skipped and one that comes back rejoins its turn."""

    name: str = "round_robin"

    def __init__(self) -> None:
        self._last: str | None = None

    def select(self, request: GenRequest, replicas: list[ReplicaView], now: float) -> Decision:
        healthy = healthy_sorted(replicas)
        choice = healthy[0]
        if self._last is not None:
            choice = next((r for r in healthy if r.name > self._last), healthy[0])
        self._last = choice.name
        return Decision(choice.name)

    def on_complete(self, request: GenRequest, result: GenResult | None, replica: str,
                    now: float) -> None:
        pass

    def on_replica_down(self, replica: str, now: float) -> None:
        pass

"""The contract between the router and its routing policies.

Knows: what a policy sees of each replica (``ReplicaView``), what it decides
(``Decision``) and the calls it receives. Does not know how replicas are reached,
nor the clock: time is always the ``now`` argument, so the simulator can replay a
policy in virtual time.
"""

from __future__ import annotations

from typing import NamedTuple, Protocol

from war.types import GenRequest, GenResult


class ReplicaView(NamedTuple):
    """A replica as the router sees it at ``now``.

    ``num_requests`` and ``tokens_in_flight`` count what this router has sent and
    not yet seen completed (prompt + max new tokens of each request);
    ``kv_free_tokens`` and ``kv_total_tokens`` come from the replica's last load
    report (``None``: not known); ``healthy`` is False while it is marked down.
    (A named tuple: the router builds one per replica for every request, and a
    tuple costs a fifth of a frozen dataclass to build.)
    """

    name: str
    healthy: bool = True
    num_requests: int = 0
    tokens_in_flight: int = 0
    kv_free_tokens: int | None = None
    kv_total_tokens: int | None = None
    num_waiting: int = 0  # the replica's own queue, from its last load report


class Decision(NamedTuple):
    """Where a request goes. ``priority`` (if not None) replaces the request's;
    ``migrated`` is True when a trajectory's turn left the replica that held it."""

    replica: str
    priority: float | None = None
    migrated: bool = False


class RoutingPolicy(Protocol):
    """Chooses replicas. Implementations are deterministic given their inputs and
    never read the clock. ``replicas`` holds only healthy replicas (at least one)."""

    name: str

    def select(self, request: GenRequest, replicas: list[ReplicaView], now: float) -> Decision:
        """Chooses a replica for ``request``. May mutate the policy's own state."""
        ...

    def on_complete(self, request: GenRequest, result: GenResult | None, replica: str,
                    now: float) -> None:
        """``request`` finished on ``replica`` (``result`` None: it failed there)."""
        ...

    def on_replica_down(self, replica: str, now: float) -> None:
        """``replica`` is unreachable: forget what the policy placed on it."""
        ...

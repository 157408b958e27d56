"""The contract of a replica backend: how the router reaches one replica.

Knows: the calls every backend answers and the errors that tell the router a
replica is unusable. Does not know routing policies.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from war.types import GenRequest, GenResult, ReplicaLoad


class ReplicaUnavailable(RuntimeError):
    """The replica did not answer (connection refused or lost, timeout, crashed
    process, 5xx): the router marks it down and retries the request elsewhere."""


class CredentialsRefused(ValueError):
    """The replica refused the caller's credentials (HTTP 401 or 403): the key sent is
    missing or wrong. A ``ValueError`` (the request as sent cannot succeed there), with
    the backend's ``name``, the answer's ``status``, the refused ``call``
    (``"POST /v1/completions"``) and the replica's own ``detail``."""

    def __init__(self, name: str, status: int, call: str, detail: str) -> None:
        super().__init__(f"{name}: {call} refused ({status}): {detail}")
        self.name = name
        self.status = status
        self.call = call
        self.detail = detail


class Backend(Protocol):
    """One replica. ``generate`` is idempotent by ``request.request_id`` as far as
    the caller is concerned: the router may send the same request to another
    replica after this one failed.

    A backend may also say ``takes_priority = False`` when it drops requests'
    ``priority`` (a server scheduling first come, first served): the router then
    sends requests to it as they came rather than with the policy's priority. Without
    the attribute the priority is sent."""

    name: str

    async def generate(self, request: GenRequest) -> GenResult:
        """Raises ``ReplicaUnavailable`` when the replica cannot be used, and
        ``ValueError`` (including ``UnknownTrajectory``) when it refuses the request.
        May be cancelled at any await: by its caller, or by the router when the replica
        fails a health check (it then sends the request elsewhere); it should let the
        ``CancelledError`` through and drop what it holds for the call (its
        connection), so that a late answer reaches no one."""
        ...

    async def load(self) -> ReplicaLoad:
        """The replica's current load (raises ``ReplicaUnavailable``). The router's
        health loop probes a healthy replica with it: it should reach the replica,
        within a bound of its own (a probe's, not a generation's), so that a replica
        that hangs fails it (the router also bounds it, ``health_timeout_s``)."""
        ...

    async def health(self) -> bool:
        """True when the replica answers its health check; never raises."""
        ...

    async def add_history(self, items: Sequence[tuple[Sequence[int], str | None]]) -> None:
        """Shared draft history: completed responses (token ids, group id)."""
        ...

    async def close(self) -> None:
        """Releases connections (and, for backends that own one, the replica)."""
        ...

"""Prometheus metrics of the router.

Knows: which of the router's counters and per-replica figures are exported, under which
names and types, and how to render them in the Prometheus text format. Each
``RouterMetrics`` has its own ``CollectorRegistry`` (never the global one), so many
router apps can live in one process. Router figures (``Router.stats``, the replicas'
in-flight accounting and health) are read at scrape time; HTTP figures are counted by
the server as requests end, in plain counters turned into metric families at scrape
time (a ``prometheus_client`` counter and histogram cost several times more per
request, on the router's hot path).

Does not know how the figures are produced (``war.router.router``) nor HTTP routing
(``war.router.server`` calls ``observe_request``).
"""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Iterator, Mapping
from typing import Protocol

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.exposition import generate_latest
from prometheus_client.registry import Collector

from war.router.router import RouterStats

CONTENT_TYPE = CONTENT_TYPE_LATEST

# (name without _total, RouterStats field, help)
_COUNTERS: tuple[tuple[str, str, str], ...] = (
    ("war_router_requests", "requests", "Requests received by the router."),
    ("war_router_completed", "completed", "Requests answered by some replica."),
    ("war_router_failed", "failed",
     "Requests that failed (no replica left, retries exhausted, context lost)."),
    ("war_router_retries", "retries", "Requests sent again after their replica failed."),
    ("war_router_in_flight_aborted", "in_flight_aborted",
     "Requests in flight cancelled on a replica that failed a health check (each then "
     "sent again elsewhere, or failed)."),
    ("war_router_migrations", "migrations",
     "Trajectory turns placed on another replica than the one holding the trajectory."),
    ("war_router_resent_contexts", "resent_contexts",
     "Continuing turns re-sent with the trajectory's whole context."),
    ("war_router_contexts_dropped", "contexts_dropped",
     "Held trajectory contexts dropped for the router's bounds (max_trajectories, "
     "max_context_tokens)."),
    ("war_router_history_forwarded", "history_forwarded",
     "Completed responses forwarded to other replicas' speculators."),
    ("war_router_replicas_marked_down", "replicas_marked_down",
     "Times a replica was marked down."),
    ("war_router_replicas_stalled", "replicas_stalled",
     "Times a replica was marked down for a stall (requests in flight, none completing "
     "for stall_timeout_s; each also counted in replicas_marked_down)."),
    ("war_router_trajectories_released", "trajectories_released",
     "Ended trajectories reported to the replica holding them."),
    ("war_router_replica_auth_refusals", "auth_refusals",
     "Calls replicas refused for the router's credentials (401/403: a missing or wrong "
     "replica API key)."),
)

# (name, key of the replica's row in ``Router.fleet_load()``, help, kind)
_PER_REPLICA: tuple[tuple[str, str, str, str], ...] = (
    ("war_router_replica_requests_in_flight", "num_requests",
     "Requests sent to the replica and not yet completed.", "gauge"),
    ("war_router_replica_tokens_in_flight", "tokens_in_flight",
     "Prompt + max new tokens of the requests in flight on the replica.", "gauge"),
    ("war_router_replica_healthy", "healthy", "1 while the replica is up, 0 while down.",
     "gauge"),
    ("war_router_replica_served", "served", "Requests the replica answered.", "counter"),
    ("war_router_replica_failures", "failures", "Failures seen on the replica.", "counter"),
    ("war_router_replica_auth_refused", "auth_refused",
     "1 while the replica refuses the router's credentials (left out of placement "
     "until a request to it is served or its load poll, refused, is accepted), else 0.",
     "gauge"),
)


class RouterSource(Protocol):
    """Where the router's figures come from (``Router`` is one)."""

    @property
    def stats(self) -> RouterStats: ...

    def fleet_load(self) -> Mapping[str, Mapping[str, object]]: ...

    @property
    def held_context_tokens(self) -> int: ...


def _number(value: object) -> float:
    if isinstance(value, bool):
        return 1.0 if value else 0.0
    if isinstance(value, int | float):
        return float(value)
    return 0.0


class _RouterCollector(Collector):
    def __init__(self, source: RouterSource) -> None:
        self._source = source

    def collect(self) -> Iterator[Metric]:
        st = self._source.stats
        for name, field, doc in _COUNTERS:
            yield CounterMetricFamily(name, doc, value=float(getattr(st, field)))
        fleet = self._source.fleet_load()
        for name, key, doc, kind in _PER_REPLICA:
            family: CounterMetricFamily | GaugeMetricFamily
            if kind == "counter":
                family = CounterMetricFamily(name, doc, labels=["replica"])
            else:
                family = GaugeMetricFamily(name, doc, labels=["replica"])
            for replica, row in fleet.items():
                family.add_metric([replica], _number(row.get(key)))
            yield family
        healthy = sum(1 for row in fleet.values() if row.get("healthy"))
        yield GaugeMetricFamily("war_router_replicas_healthy", "Replicas up.", value=healthy)
        yield GaugeMetricFamily("war_router_replicas", "Replicas known to the router.",
                                value=len(fleet))
        yield GaugeMetricFamily("war_router_held_context_tokens",
                                "Tokens of the trajectory contexts the router holds.",
                                value=self._source.held_context_tokens)


LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0,
                   10.0, 30.0, 60.0, 120.0, 300.0)


class _HttpCollector(Collector):
    """Completion requests by status, and their latency histogram."""

    def __init__(self) -> None:
        self.by_status: dict[int, int] = {}
        self.buckets = [0] * (len(LATENCY_BUCKETS) + 1)  # the last one: above every bound
        self.seconds = 0.0

    def collect(self) -> Iterator[Metric]:
        requests = CounterMetricFamily("war_router_http_requests",
                                       "Completion requests by status.", labels=["status"])
        for status, n in sorted(self.by_status.items()):
            requests.add_metric([str(status)], float(n))
        yield requests
        cumulative, rows = 0, []
        for bound, n in zip((*LATENCY_BUCKETS, float("inf")), self.buckets, strict=True):
            cumulative += n
            rows.append(("+Inf" if bound == float("inf") else repr(bound), float(cumulative)))
        yield HistogramMetricFamily(
            "war_router_request_seconds", "Seconds from a completion request to its answer.",
            buckets=rows, sum_value=self.seconds)


class RouterMetrics:
    """The router's metrics in their own registry: router figures read at scrape time,
    HTTP requests counted by status and timed as they end."""

    def __init__(self, source: RouterSource) -> None:
        self.registry = CollectorRegistry()
        self.registry.register(_RouterCollector(source))
        self._http = _HttpCollector()
        self.registry.register(self._http)

    def observe_request(self, status: int, seconds: float) -> None:
        http = self._http
        http.by_status[status] = http.by_status.get(status, 0) + 1
        http.buckets[bisect_left(LATENCY_BUCKETS, seconds)] += 1
        http.seconds += seconds

    def render(self) -> bytes:
        return generate_latest(self.registry)

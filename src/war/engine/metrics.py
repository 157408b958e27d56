"""Prometheus metrics of one replica.

Knows: which of the engine's counters and load figures are exported, under which
names and types, and how to render them in the Prometheus text format. Each
``ReplicaMetrics`` has its own ``CollectorRegistry`` (never the global one), so
many apps can live in one process. Engine figures are read at scrape time from
a snapshot source (``AsyncEngine.stats()``/``load()``); HTTP figures are counted
by the server as requests end.

Does not know how the figures are produced (``war.engine.stats``,
``Engine.load``) nor HTTP routing (``war.engine.server`` calls ``observe_request``).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Protocol

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.exposition import generate_latest
from prometheus_client.registry import Collector

from war.engine.stats import EngineStats
from war.types import ReplicaLoad

CONTENT_TYPE = CONTENT_TYPE_LATEST

# (name without _total, EngineStats field, help)
_COUNTERS: tuple[tuple[str, str, str], ...] = (
    ("war_steps", "num_steps", "Engine steps (forward passes of a batch)."),
    ("war_generated_tokens", "num_generated_tokens", "Tokens generated."),
    ("war_decode_passes", "num_decode_passes",
     "Sequence-steps that produced tokens (one sequence in one forward pass)."),
    ("war_prompt_tokens", "num_prompt_tokens", "Prompt tokens of finished requests."),
    ("war_cached_prompt_tokens", "num_cached_prompt_tokens",
     "Prompt tokens served from the prefix cache."),
    ("war_draft_tokens", "num_draft_tokens", "Draft tokens proposed and verified."),
    ("war_accepted_tokens", "num_accepted_tokens", "Draft tokens accepted."),
    ("war_spec_budget_tokens", "total_spec_budget",
     "Draft tokens chosen by the speculation policy, summed over steps."),
    ("war_preemptions", "num_preemptions", "Sequences preempted (recomputed later)."),
    ("war_requests_finished", "num_finished", "Requests finished (stop or length)."),
    ("war_requests_aborted", "num_aborted", "Requests aborted."),
    ("war_step_seconds", "total_step_s", "Seconds spent in engine steps."),
)


class StatsSource(Protocol):
    """Where the engine's figures come from (``AsyncEngine`` is one)."""

    def stats(self) -> EngineStats: ...

    def load(self) -> ReplicaLoad: ...


class _EngineCollector(Collector):
    def __init__(self, source: StatsSource) -> None:
        self._source = source

    def collect(self) -> Iterator[Metric]:
        st = self._source.stats()
        ld = self._source.load()
        for name, field, doc in _COUNTERS:
            yield CounterMetricFamily(name, doc, value=float(getattr(st, field)))
        gauges: tuple[tuple[str, str, float], ...] = (
            ("war_tokens_per_step",
             "Generated tokens per sequence forward pass (1.0 without speculation).",
             st.tokens_per_step),
            ("war_spec_acceptance_rate", "Accepted / proposed draft tokens.",
             st.acceptance_rate),
            ("war_spec_draft_budget_tokens",
             "Draft tokens verified in the latest step (the policy's budget).",
             float(st.last_spec_tokens)),
            ("war_spec_tokens_per_seq", "Draft tokens per sequence in the latest step.",
             ld.spec_tokens_per_seq),
            ("war_prefix_cache_hit_rate", "Cached / total prompt tokens of finished requests.",
             st.prefix_hit_rate),
            ("war_step_last_seconds", "Duration of the latest engine step.", st.last_step_s),
            ("war_step_mean_seconds", "Mean duration of an engine step.", st.mean_step_s),
            ("war_batch_tokens", "Tokens fed in the latest step.",
             float(st.last_batch_tokens)),
            ("war_running_sequences", "Sequences running (holding KV blocks).",
             float(ld.num_running)),
            ("war_waiting_sequences", "Sequences waiting to be scheduled.",
             float(ld.num_waiting)),
            ("war_tokens_in_flight", "Tokens of running and waiting sequences.",
             float(ld.tokens_in_flight)),
            ("war_kv_blocks_used", "KV cache blocks in use.", float(ld.kv_blocks_used)),
            ("war_kv_blocks_total", "KV cache blocks in all.", float(ld.kv_blocks_total)),
            ("war_kv_block_size", "Tokens per KV cache block.", float(ld.block_size)),
            ("war_weight_version", "Version of the loaded weights.",
             float(ld.weight_version)),
        )
        for name, doc, value in gauges:
            yield GaugeMetricFamily(name, doc, value=float(value))


class ReplicaMetrics:
    """A registry with the engine's figures and the server's request counters."""

    def __init__(self, source: StatsSource) -> None:
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(_EngineCollector(source))
        self._requests = Counter(
            "war_http_requests", "Completion requests answered, by HTTP status.",
            ["status"], registry=self.registry)
        self._latency = Histogram(
            "war_http_request_seconds", "Seconds to answer a completion request.",
            registry=self.registry,
            buckets=(0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0))

    def observe_request(self, status: int, seconds: float | None) -> None:
        """Counts one answered completion request (``seconds``: None when unknown)."""
        self._requests.labels(status=str(status)).inc()
        if seconds is not None:
            self._latency.observe(seconds)

    def render(self) -> bytes:
        """The Prometheus text exposition of every metric."""
        return generate_latest(self.registry)

"""Routing policies: where each request goes.

Knows: the policies and their names (``make_policy``). Does not know how replicas
are reached nor the clock; the contract is in ``base``.

* ``round_robin``: the next healthy replica in name order.
* ``least_load``: fewest requests in flight, sticky per trajectory (verl's).
* ``cache_aware``: longest cached prefix unless the fleet is imbalanced (SGLang's).
* ``war``: trajectory and group locality within load tolerances, KV capacity,
  long-tail-first priorities (WAR's default).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from war.router.policies.base import Decision, ReplicaView, RoutingPolicy
from war.router.policies.cache_aware import CacheAwareConfig, CacheAwarePolicy
from war.router.policies.least_load import LeastLoadConfig, LeastLoadPolicy
from war.router.policies.prefix_tree import PrefixTree
from war.router.policies.progress import ProgressConfig, ProgressEstimator
from war.router.policies.round_robin import RoundRobinPolicy
from war.router.policies.war_policy import WarPolicy, WarPolicyConfig, load_score

__all__ = [
    "POLICIES",
    "CacheAwareConfig",
    "CacheAwarePolicy",
    "Decision",
    "LeastLoadConfig",
    "LeastLoadPolicy",
    "PrefixTree",
    "ProgressConfig",
    "ProgressEstimator",
    "ReplicaView",
    "RoundRobinPolicy",
    "RoutingPolicy",
    "WarPolicy",
    "WarPolicyConfig",
    "load_score",
    "make_policy",
]


def _round_robin(**kwargs: Any) -> RoutingPolicy:
    if kwargs:
        raise TypeError(f"round_robin takes no settings, got {sorted(kwargs)}")
    return RoundRobinPolicy()


def _least_load(**kwargs: Any) -> RoutingPolicy:
    return LeastLoadPolicy(LeastLoadConfig(**kwargs))


def _cache_aware(**kwargs: Any) -> RoutingPolicy:
    return CacheAwarePolicy(CacheAwareConfig(**kwargs))


def _war(**kwargs: Any) -> RoutingPolicy:
    return WarPolicy(WarPolicyConfig(**kwargs))


POLICIES: dict[str, Callable[..., RoutingPolicy]] = {
    "round_robin": _round_robin,
    "least_load": _least_load,
    "cache_aware": _cache_aware,
    "war": _war,
}


def make_policy(name: str, **kwargs: Any) -> RoutingPolicy:
    """A new policy by name; ``kwargs`` are fields of its config (e.g.
    ``make_policy("cache_aware", cache_threshold=0.5)``). Unknown names raise
    ``KeyError`` listing the known ones; unknown settings raise ``TypeError``."""
    factory = POLICIES.get(name)
    if factory is None:
        raise KeyError(f"unknown routing policy {name!r}; known: {', '.join(POLICIES)}")
    return factory(**kwargs)

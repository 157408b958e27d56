"""Cache-aware routing: SGLang router's strategy, as a baseline for WAR's own.

Knows: an approximate prefix tree per replica of what the router sent there
(``PrefixTree``), each replica's in-flight request count, and which replica served
each recent trajectory (only to keep continuing turns where their context is).
Does not know what replicas really cache, tokens in flight, KV capacity, trajectory
progress, nor the clock (``now`` is an argument; SGLang's router reads the wall
clock for its LRU times and evicts on a timer, here eviction happens on insert).

Strategy (per request, over the healthy replicas; load = in-flight requests)::

    imbalanced = (max_load - min_load) > balance_abs_threshold
                 and max_load > balance_rel_threshold * min_load
    if imbalanced:
        choose the least loaded replica                        (load balancing)
    else:
        m = the replica holding the longest prefix of the prompt
        if matched_len(m) > 0 and matched_len(m) / len(prompt) >= cache_threshold:
            choose m                                           (cache hit)
        else:
            choose the replica whose tree holds the fewest tokens  (most cache room)
    insert the prompt into the chosen replica's tree

Ties break by load, then by name, so decisions are deterministic. On a miss we
follow SGLang and pick the smallest tree, not the least loaded replica: a new
prefix is then spread over replicas by how much cached context each already
carries, which keeps distinct prompts (new groups) apart and leaves each replica's
cache to the prefixes it already serves; load is still guarded by the imbalance
rule above. When a request completes, its prompt plus output is inserted too (the
next turn of a multi-turn trajectory starts with both).

Parameters (``CacheAwareConfig``; SGLang's defaults):

* ``cache_threshold`` (0.3): the fraction of the prompt a replica must hold for a
  cache hit to decide the placement.
* ``balance_abs_threshold`` (64): the in-flight request difference between the most
  and least loaded replicas above which the fleet may count as imbalanced.
* ``balance_rel_threshold`` (1.5): the ratio of the most to the least loaded above
  which the fleet may count as imbalanced (both must hold).
* ``max_tree_tokens`` (2**21): tokens of the tree per replica before its least
  recently used leaves are evicted; about the replica's KV capacity is a good value
  (SGLang bounds its tree by characters, 2**26 by default, over all replicas).
* ``max_trajectories`` (100,000): trajectories whose replica is remembered.

Requests that ``continue`` a trajectory carry only the new tokens, which match
nothing: they go to the replica that served the trajectory's previous turn while
it is healthy, and are not inserted into the tree (their full context is not
known here). If that replica is down, the request is routed as above and
``Decision.migrated`` is set, so the router resends the whole context.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

from war.router.policies.base import Decision, ReplicaView
from war.router.policies.prefix_tree import PendingEnds, PrefixTree
from war.router.policies.round_robin import healthy_sorted
from war.types import GenRequest, GenResult


@dataclass(frozen=True)
class CacheAwareConfig:
    """Settings of ``CacheAwarePolicy`` (see the module docstring); validated on
    construction."""

    cache_threshold: float = 0.3
    balance_abs_threshold: int = 64
    balance_rel_threshold: float = 1.5
    max_tree_tokens: int = 1 << 21
    max_trajectories: int = 100_000

    def __post_init__(self) -> None:
        for name in ("max_tree_tokens", "max_trajectories"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int):  # (a NaN: no bound)
                raise ValueError(f"{name} must be an int, got {value!r}")
        if not 0.0 <= self.cache_threshold <= 1.0:
            raise ValueError(f"cache_threshold must be in [0, 1], got {self.cache_threshold}")
        if not self.balance_abs_threshold >= 0:  # (a NaN: never imbalanced)
            raise ValueError(
                f"balance_abs_threshold must be >= 0, got {self.balance_abs_threshold}")
        if not self.balance_rel_threshold >= 1.0:
            raise ValueError(
                f"balance_rel_threshold must be >= 1, got {self.balance_rel_threshold}")
        if self.max_tree_tokens < 1:
            raise ValueError(f"max_tree_tokens must be >= 1, got {self.max_tree_tokens}")
        if self.max_trajectories < 1:
            raise ValueError(f"max_trajectories must be >= 1, got {self.max_trajectories}")


def is_imbalanced(max_load: float, min_load: float, abs_threshold: float,
                  rel_threshold: float) -> bool:
    """SGLang's imbalance rule: both the difference and the ratio are too large."""
    return max_load - min_load > abs_threshold and max_load > rel_threshold * min_load


class CacheAwarePolicy:
    """Longest cached prefix when the fleet is balanced, least loaded when not."""

    name: str = "cache_aware"

    def __init__(self, config: CacheAwareConfig | None = None) -> None:
        self.config = config if config is not None else CacheAwareConfig()
        self.tree = PrefixTree(self.config.max_tree_tokens)
        self._ends = PendingEnds()  # request -> where its prompt's path ends
        self._trajectories: OrderedDict[str, str | None] = OrderedDict()
        self.num_cache_hits = 0
        self.num_balanced_misses = 0
        self.num_imbalanced = 0

    def select(self, request: GenRequest, replicas: list[ReplicaView], now: float) -> Decision:
        healthy = healthy_sorted(replicas)
        tid = request.trajectory_id
        known = tid is not None and tid in self._trajectories
        held = self._trajectories.get(tid) if tid is not None else None
        if request.continues and held is not None and any(r.name == held for r in healthy):
            self._remember(tid, held)
            return Decision(held)
        choice = self._choose(request, healthy)
        if not request.continues:
            self._ends.put(request.request_id, self.tree.insert(request.prompt_ids, choice, now))
        self._remember(tid, choice)
        return Decision(choice, migrated=known and held != choice)

    def _choose(self, request: GenRequest, healthy: list[ReplicaView]) -> str:
        cfg = self.config
        loads = [r.num_requests for r in healthy]
        if is_imbalanced(max(loads), min(loads), cfg.balance_abs_threshold,
                         cfg.balance_rel_threshold):
            self.num_imbalanced += 1
            return min(healthy, key=lambda r: (r.num_requests, r.name)).name
        if not request.continues:
            matched = self.tree.match(request.prompt_ids)
            best = min(healthy, key=lambda r: (-matched.get(r.name, 0), r.num_requests, r.name))
            if matched.get(best.name, 0) / len(request.prompt_ids) >= cfg.cache_threshold \
                    and matched.get(best.name, 0) > 0:
                self.num_cache_hits += 1
                return best.name
        self.num_balanced_misses += 1
        return min(healthy, key=lambda r: (self.tree.num_tokens(r.name), r.num_requests,
                                           r.name)).name

    def _remember(self, tid: str | None, replica: str) -> None:
        if tid is None:
            return
        self._trajectories[tid] = replica
        self._trajectories.move_to_end(tid)
        while len(self._trajectories) > self.config.max_trajectories:
            self._trajectories.popitem(last=False)

    def on_complete(self, request: GenRequest, result: GenResult | None, replica: str,
                    now: float) -> None:
        end = self._ends.pop(request.request_id)
        if result is not None and not request.continues:
            self.tree.extend(end, request.prompt_ids, result.output_ids, replica, now)

    def on_replica_down(self, replica: str, now: float) -> None:
        self.tree.remove_replica(replica)
        for tid, held in self._trajectories.items():
            if held == replica:
                self._trajectories[tid] = None

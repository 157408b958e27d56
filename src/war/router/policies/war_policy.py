"""WAR's routing policy: trajectory and group locality, bounded by load, long tail first.

Knows: which replica holds each recent trajectory's KV (the one that served its
previous turn) and how long its context is, an approximate prefix tree per replica
(``PrefixTree``: where groups' shared prompts are cached), each replica's load as
the router sees it, and trajectories' progress against their groups' finished
samples (``ProgressEstimator``). Does not know what replicas really cache, how a
replica schedules, nor the clock: every time is ``now``, so the simulator replays it.

Load score (tokens; one number per replica, ``load_score``)::

    load = max(tokens_in_flight, kv_total_tokens - kv_free_tokens)

``tokens_in_flight`` is what this router sent and has not seen completed (prompt +
max new tokens of each request, so queued requests count too); the KV term is
what the replica last reported in use (it also sees other clients' requests, and
lags by one load report). Their maximum is the better-informed of the two, without
double counting this router's own requests. Tokens, not request counts, because
agentic requests differ by orders of magnitude in context and output length.

Rules, per request, over the healthy replicas:

1. Capacity: only replicas whose KV can hold the request (context + max_tokens <=
   ``kv_total_tokens``; unknown capacity counts as enough) are candidates; if none
   can, the largest ones are.
2. Stickiness: a trajectory's next turn goes to the replica holding its KV unless
   that replica is overloaded against the least loaded candidate: ``load - min >
   max(migrate_abs_tokens, migrate_own_weight * own)`` and ``load > migrate_rel *
   min`` (both), ``own`` being the request's own tokens (context + max_tokens). The
   ``own`` term keeps a move from leaving its target busier than the holder was:
   moving a long context from one replica to the next and back (ping-pong) costs
   a recomputation of that context each time, and the longest trajectories, the
   ones a step waits for, are the ones that move. With ``migrate_needs_room`` a
   turn moves only to a replica whose last report shows free KV for all of it
   (context + max_tokens; unknown counts as room), and stays if none does: a
   context that moves to a full replica waits there for room, recomputed, while
   its old replica still holds it. Then it moves
   (rule 3 picks the target, without the holder), ``Decision.migrated`` is set and
   ``stats.migrations`` counts it. A request that ``continues`` (it carries only new
   tokens; the other replicas lack its context) never moves for load: only when its
   replica is down or cannot hold it (``stats.failovers``; the router then resends
   the whole context, as it does on ``UnknownTrajectory``).
3. Placement (new trajectories, moves, requests without a trajectory): each
   candidate's *committed work* is the expected generated tokens still to come from
   the trajectories placed on it, in flight or between turns (``ProgressEstimator``,
   from their groups' finished samples, else the fleet's, else one turn each). A
   new trajectory joins its group's cached prompt (candidates holding at least
   ``group_match_threshold`` of the prompt; the longest match wins,
   ``stats.co_located``) unless that replica's committed work exceeds the least
   committed candidate's by more than ``group_work_slack`` times the trajectory's
   own expected work and by ``group_rel``, its load score by ``group_abs_tokens``
   and ``group_rel``, or its requests in flight by ``group_abs_requests`` and
   ``group_rel`` (both, in each pair). Otherwise the candidate with the least load
   score plus committed work takes it (``stats.spread``; the load score counts what
   is in flight and in KV, committed work what is still to come). A group's samples have alike
   lengths, so stacking them stacks the long tail: the work tolerance lets a long
   group share a cached prompt only as far as balance allows, and a group whose
   length nothing tells yet (no finished sample of its own) is spread evenly, its
   prompt shared only among the replicas holding fewest of its samples. The
   request rule matters when requests are small against the token tolerance. A
   trajectory stops counting when it finishes (``finish_trajectory``) or after
   ``finish_idle_s`` idle.
4. Priority: ``Decision.priority`` is the trajectory's expected remaining generated
   tokens (``ProgressEstimator``: from its group's finished samples, this step's
   and earlier steps' with exponential decay, given the turns and tokens it has
   done), so replicas serve the long tail first; with ``age_priority``, at least
   the tokens it has generated so far (late trajectories first: the samples that
   finish first in a step are its short ones, so they say little of one that has
   outlived them, which is the step's long tail; the mean residual life of a
   heavy tail grows with age). ``None`` (the request keeps its own priority) while
   nothing is known: no finished sample and nothing generated yet.

Ties break by committed work, load, then name: the same inputs give the same
decisions. Memory is bounded: trajectories unseen for ``trajectory_ttl_s`` are forgotten and at most
``max_trajectories`` are kept (also in the progress estimator, with its own
``ProgressConfig``); the tree keeps at most ``max_tree_tokens`` per replica.
``on_replica_down`` drops the replica's tree and the stickiness to it.

The rules and the bookkeeping (placements, commitments, pending path ends, stats)
are C++ (csrc/war_policy.cc, bound as ``_war_policy``; this is the only module that
imports it); ``WarPolicy`` is a thin subclass here adding the default config, the
tree, the estimator and ``stats``. Its specification is the pure-Python
``war_policy_reference.ReferenceWarPolicy``, which it matches decision for decision,
bit for bit (priorities, committed work, stats, the same TTL, capacities and expiry
order), calling the tree and the estimator (Python objects here, through their
cached bound methods) in the same order with the same arguments, so the simulator
decides as it did with the Python policy. ``select`` and ``on_complete`` are the
native methods themselves (no Python frame): 5-7 us a request together, the tree's
and the estimator's calls included (the reference: 16-19 us). Inputs: requests are
read by attribute (ids ``str``, or ``None`` where the reference allows it; counts
ints within int64), replica views by index (a ``ReplicaView``), times are numbers,
not NaN; a bad type raises TypeError (a NaN time ValueError) and leaves the policy
unchanged. Config thresholds keep Python's int/float semantics.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from war.router.policies._war_policy import WarPolicy as _NativeWarPolicy
from war.router.policies.base import Decision, ReplicaView
from war.router.policies.prefix_tree import PrefixTree
from war.router.policies.progress import ProgressConfig, ProgressEstimator


@dataclass(frozen=True)
class WarPolicyConfig:
    """Settings of ``WarPolicy`` (rules in the module docstring); validated on
    construction.

    * ``migrate_abs_tokens``, ``migrate_rel``: how far a trajectory's replica may
      run ahead of the least loaded one (in load-score tokens, and as a ratio;
      exceeding both moves the turn). Defaults mirror SGLang's 64 requests and 1.5
      at ~512 tokens a request.
    * ``migrate_own_weight``: the tokens of the moving request itself, times this,
      are a floor under ``migrate_abs_tokens`` (1: a move must not leave its
      target busier than the holder; 0: the plain SGLang rule).
    * ``migrate_needs_room``: a move for load goes only to a replica that reports
      free KV for the whole request; none: the turn stays.
    * ``group_abs_tokens``, ``group_rel``: the same tolerance for placing a new
      trajectory with its group's cached prompt.
    * ``group_abs_requests``: the tolerance in requests in flight (with
      ``group_rel``) for placing a new trajectory with its group's cached prompt.
    * ``group_work_slack``: the tolerance in committed work (with ``group_rel``), in
      units of the new trajectory's own expected work: a group's samples have
      alike lengths, so stacking more of them on one replica than this stacks its
      long tail there.
    * ``spread_unknown_groups``: spread the samples of a group of unknown length
      evenly (rule 3) instead of placing them by work and tolerance alone.
    * ``group_match_threshold``: fraction of the prompt a replica must hold for it
      to count as holding the group's prefix (a group's first turns share all of
      it; other groups share a system prompt at most).
    * ``max_tree_tokens``: prefix-tree tokens per replica (about its KV capacity).
    * ``trajectory_ttl_s``, ``max_trajectories``: bounds on remembered placements.
    * ``progress_priority``: set ``Decision.priority`` from expected remaining work.
    * ``age_priority``: that priority is at least the tokens the trajectory has
      generated so far (rule 4).
    * ``progress``: the progress estimator's settings.
    """

    migrate_abs_tokens: int = 32_768
    migrate_rel: float = 1.5
    migrate_own_weight: float = 1.0
    migrate_needs_room: bool = True
    group_abs_tokens: int = 8_192
    group_rel: float = 1.1
    group_abs_requests: int = 1
    group_work_slack: float = 1.0
    spread_unknown_groups: bool = True
    group_match_threshold: float = 0.5
    max_tree_tokens: int = 1 << 21
    trajectory_ttl_s: float = 1800.0
    max_trajectories: int = 100_000
    progress_priority: bool = True
    age_priority: bool = True
    progress: ProgressConfig = field(default_factory=ProgressConfig)

    def __post_init__(self) -> None:
        for name in ("migrate_abs_tokens", "group_abs_tokens", "group_abs_requests"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")
        if not self.migrate_own_weight >= 0:
            raise ValueError(f"migrate_own_weight must be >= 0, got {self.migrate_own_weight}")
        if not self.group_work_slack >= 0:
            raise ValueError(f"group_work_slack must be >= 0, got {self.group_work_slack}")
        for name in ("migrate_rel", "group_rel"):
            if not getattr(self, name) >= 1.0:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if not 0.0 <= self.group_match_threshold <= 1.0:
            raise ValueError(
                f"group_match_threshold must be in [0, 1], got {self.group_match_threshold}")
        if self.max_tree_tokens < 1:
            raise ValueError(f"max_tree_tokens must be >= 1, got {self.max_tree_tokens}")
        if not self.trajectory_ttl_s > 0:
            raise ValueError(f"trajectory_ttl_s must be > 0, got {self.trajectory_ttl_s}")
        if self.max_trajectories < 1:
            raise ValueError(f"max_trajectories must be >= 1, got {self.max_trajectories}")
        if not isinstance(self.progress, ProgressConfig):
            raise ValueError(f"progress must be a ProgressConfig, got {self.progress!r}")


def load_score(replica: ReplicaView) -> float:
    """The replica's load in tokens (module docstring)."""
    used = 0
    if replica.kv_total_tokens is not None and replica.kv_free_tokens is not None:
        used = max(0, replica.kv_total_tokens - replica.kv_free_tokens)
    return float(max(replica.tokens_in_flight, used))


@dataclass
class WarPolicyStats:
    """Counts of the decisions taken, by rule."""

    sticky: int = 0  # a turn stayed on its trajectory's replica
    migrations: int = 0  # a turn left its replica for load
    failovers: int = 0  # a turn left its replica: down, or too small for it
    co_located: int = 0  # placed with the longest cached prefix
    spread: int = 0  # placed on the least loaded replica


class WarPolicy(_NativeWarPolicy):
    """WAR's default routing policy (module docstring): ``select``, ``on_complete``,
    ``committed_work``, ``on_replica_down``, ``finish_trajectory`` and
    ``num_trajectories`` are native; ``tree`` is its ``PrefixTree``, ``progress`` its
    ``ProgressEstimator`` and ``config`` its ``WarPolicyConfig``."""

    name: str = "war"

    def __init__(self, config: WarPolicyConfig | None = None) -> None:
        config = config if config is not None else WarPolicyConfig()
        super().__init__(config, PrefixTree(config.max_tree_tokens),
                         ProgressEstimator(config.progress), Decision)

    @property
    def stats(self) -> WarPolicyStats:
        """Counts of the decisions taken so far (a snapshot)."""
        return WarPolicyStats(*self._stats())

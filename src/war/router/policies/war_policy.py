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
   done), so replicas serve the long tail first; ``None`` (the request keeps its
   own priority) while no finished sample is known.

Ties break by committed work, load, then name: the same inputs give the same
decisions. Memory is bounded: trajectories unseen for ``trajectory_ttl_s`` are forgotten and at most
``max_trajectories`` are kept (also in the progress estimator, with its own
``ProgressConfig``); the tree keeps at most ``max_tree_tokens`` per replica.
``on_replica_down`` drops the replica's tree and the stickiness to it.
"""

from __future__ import annotations

import heapq
from collections import OrderedDict
from dataclasses import dataclass, field

from war.router.policies.base import Decision, ReplicaView
from war.router.policies.cache_aware import is_imbalanced
from war.router.policies.prefix_tree import PendingEnds, PrefixTree
from war.router.policies.progress import ProgressConfig, ProgressEstimator
from war.router.policies.round_robin import healthy_sorted
from war.types import GenRequest, GenResult


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


class _Placement:
    """Where a trajectory's KV is, updated in place turn after turn."""

    __slots__ = ("at", "context_len", "replica")

    def __init__(self, replica: str | None, context_len: int, at: float) -> None:
        self.replica = replica  # holds the trajectory's KV; None: that replica went down
        self.context_len = context_len  # tokens of the trajectory's context known here
        self.at = at  # last put: the map is ordered by it, and forgets it after the TTL


class WarPolicy:
    """WAR's default routing policy (module docstring)."""

    name: str = "war"

    def __init__(self, config: WarPolicyConfig | None = None) -> None:
        self.config = config if config is not None else WarPolicyConfig()
        self.tree = PrefixTree(self.config.max_tree_tokens)
        self._ends = PendingEnds()  # request -> where its prompt's path ends
        self.progress = ProgressEstimator(self.config.progress)
        self.stats = WarPolicyStats()
        # trajectory -> placement, least recently put first; forgotten after
        # ``trajectory_ttl_s`` unput and beyond ``max_trajectories`` (values updated in
        # place: one lookup and no allocation per turn)
        self._placements: OrderedDict[str, _Placement] = OrderedDict()
        # committed work: trajectory -> (replica, expected remaining tokens, last seen)
        # trajectory -> (replica, expected work, last seen, group)
        self._committed: dict[str, tuple[str, float, float, str | None]] = {}
        self._group_counts: dict[tuple[str, str], int] = {}  # (group, replica) -> active
        self._work: dict[str, float] = {}
        self._seen: list[tuple[float, str]] = []  # (last seen, trajectory), lazy heap

    # ------------------------------------------------------------------ routing

    def select(self, request: GenRequest, replicas: list[ReplicaView], now: float) -> Decision:
        cfg = self.config
        healthy = healthy_sorted(replicas)
        placements = self._placements
        ttl = cfg.trajectory_ttl_s
        if placements and next(iter(placements.values())).at + ttl < now:
            self._expire_placements(now)
        tid = request.trajectory_id
        state = None
        if tid is not None:
            state = placements.get(tid)
            if state is not None and state.at + ttl < now:  # (out of order times)
                del placements[tid]
                state = None
        prompt_len = len(request.prompt_ids)
        context_len = prompt_len
        if request.continues and state is not None:
            context_len += state.context_len
        loads = {r.name: load_score(r) for r in healthy}
        seen = self._seen
        if seen and seen[0][0] < now - cfg.progress.finish_idle_s:
            self._expire_committed(now)
        candidates = _fitting(healthy, context_len + request.sampling.max_tokens)
        if candidates is healthy:  # (the common case: every replica fits)
            min_load = min(loads.values())
            holder_fits = state is not None and state.replica in loads
        else:
            min_load = min(loads[r.name] for r in candidates)
            holder_fits = state is not None and any(r.name == state.replica
                                                    for r in candidates)
        holder = state.replica if state is not None else None
        migrated = False
        others: list[ReplicaView] = []
        if holder is not None and holder_fits and not request.continues:
            need = context_len + request.sampling.max_tokens
            if is_imbalanced(loads[holder], min_load,
                             max(cfg.migrate_abs_tokens, cfg.migrate_own_weight * need),
                             cfg.migrate_rel):
                others = [r for r in candidates if r.name != holder
                          and (not cfg.migrate_needs_room or r.kv_free_tokens is None
                               or r.kv_free_tokens >= need)]
        if holder is not None and holder_fits and not others:
            choice = holder
            self.stats.sticky += 1
        elif state is not None:  # it had a replica: down, too small, or overloaded
            if not others:
                others = [r for r in candidates if r.name != holder]
            choice = self._place(request, others or candidates, loads, tid)
            migrated = True
            if any(r.name == holder for r in candidates):
                self.stats.migrations += 1
            else:
                self.stats.failovers += 1
        else:
            choice = self._place(request, candidates, loads, tid)
        if not request.continues:
            self._ends.put(request.request_id, self.tree.insert(request.prompt_ids, choice, now))
        priority = None
        if tid is not None:
            self._put_placement(tid, state, choice, context_len, now)
            remaining = self.progress.begin(tid, request.group_id, now)  # (as it stood)
            if cfg.progress_priority:
                priority = remaining
            # everything expected of it, this turn included, is committed to the replica
            # (no estimate: no finished sample at all, so none from the fleet either)
            self._commit(tid, choice, float(request.sampling.max_tokens) if remaining is None
                         else max(float(remaining), 1.0), now, request.group_id)
        elif cfg.progress_priority and request.group_id is not None:
            priority = self.progress.expected_remaining(request.group_id, 0, 0)
        return Decision(choice, priority, migrated)

    def _place(self, request: GenRequest, candidates: list[ReplicaView],
               loads: dict[str, float], tid: str | None) -> str:
        """Rule 3: with the group's cached prompt within tolerance, else the candidate
        with the least load plus committed work."""
        cfg = self.config
        gid = request.group_id
        work = {r.name: self._work.get(r.name, 0.0) for r in candidates}
        old = self._committed.get(tid) if tid is not None else None
        if old is not None and old[0] in work:  # a move: its work leaves its old replica
            work[old[0]] -= old[1]
        min_work = min(work.values())
        # A group whose length nothing tells yet is spread evenly: its samples' lengths
        # are alike, so stacking them gambles the replica's share of the long tail.
        spread_group = (cfg.spread_unknown_groups and gid is not None
                        and not self.progress.has_samples(gid))
        counts = (None if gid is None else
                  {r.name: self._group_counts.get((gid, r.name), 0) for r in candidates})
        matched = {} if request.continues else self.tree.match(request.prompt_ids)
        hits = []
        if matched:  # (nobody holding any of the prompt: no candidate can be a hit)
            mine = self._expected_work(self.progress.remaining_for(tid, gid)
                                       if tid is not None else None, request)
            need = max(1.0, cfg.group_match_threshold * len(request.prompt_ids))
            min_count = 0 if counts is None else min(counts.values())
            min_load = min(loads[r.name] for r in candidates)
            min_requests = min(r.num_requests for r in candidates)
            hits = [r for r in candidates if matched.get(r.name, 0) >= need
                    and not (spread_group and counts is not None
                             and counts[r.name] > min_count)
                    and not is_imbalanced(work[r.name], min_work,
                                          cfg.group_work_slack * mine, cfg.group_rel)
                    and not is_imbalanced(loads[r.name], min_load, cfg.group_abs_tokens,
                                          cfg.group_rel)
                    and not is_imbalanced(r.num_requests, min_requests,
                                          cfg.group_abs_requests, cfg.group_rel)]
        if hits:
            self.stats.co_located += 1
            return min(hits, key=lambda r: (-matched[r.name], loads[r.name] + work[r.name],
                                            r.name)).name
        self.stats.spread += 1
        if counts is None:  # (no group: its count is 0 everywhere)
            return min(candidates, key=lambda r: (loads[r.name] + work[r.name],
                                                  -matched.get(r.name, 0), r.num_requests,
                                                  r.name)).name
        return min(candidates, key=lambda r: (loads[r.name] + work[r.name], counts[r.name],
                                              -matched.get(r.name, 0), r.num_requests,
                                              r.name)).name

    def _expected_work(self, remaining: float | None, request: GenRequest) -> float:
        """Expected generated tokens still to come from a trajectory (this turn
        included): the progress estimate, else the fleet's, else one turn."""
        if remaining is None:
            remaining = self.progress.expected_remaining(None, 0, 0)
        if remaining is None:
            return float(request.sampling.max_tokens)
        return max(float(remaining), 1.0)

    # ------------------------------------------------------------------ feedback

    def on_complete(self, request: GenRequest, result: GenResult | None, replica: str,
                    now: float) -> None:
        tid = request.trajectory_id
        end = self._ends.pop(request.request_id)
        if result is None:
            if tid is not None:
                self.progress.abort(tid, now)
            return
        if not request.continues:
            self.tree.extend(end, request.prompt_ids, result.output_ids, replica, now)
        if tid is None:
            return
        generated = len(result.output_ids)
        remaining = self.progress.observe(tid, request.group_id, generated, now)
        state = self._placements.get(tid)
        if state is not None and state.at + self.config.trajectory_ttl_s < now:
            del self._placements[tid]  # (expired: as if forgotten already)
            state = None
        if state is not None:  # the replica that served the turn holds its context now
            self._put_placement(tid, state, replica, state.context_len + generated, now)
            self._commit(tid, replica, float(request.sampling.max_tokens) if remaining is None
                         else max(float(remaining), 1.0), now)  # (as in ``select``)

    def _put_placement(self, tid: str, state: _Placement | None, replica: str,
                       context_len: int, now: float) -> None:
        """Records where the trajectory is (``state``: its current placement, if any),
        as the most recently put; forgets the oldest beyond ``max_trajectories``."""
        placements = self._placements
        if state is None:
            placements[tid] = _Placement(replica, context_len, now)
            while len(placements) > self.config.max_trajectories:
                placements.popitem(last=False)
        else:
            state.replica = replica
            state.context_len = context_len
            state.at = now
            placements.move_to_end(tid)

    def _expire_placements(self, now: float) -> None:
        """Forgets placements not put for ``trajectory_ttl_s`` (oldest first)."""
        placements = self._placements
        horizon = now - self.config.trajectory_ttl_s
        while placements:
            tid, state = next(iter(placements.items()))
            if state.at >= horizon:
                break
            del placements[tid]

    def _commit(self, tid: str, replica: str, work: float, now: float,
                group: str | None = None) -> None:
        old = self._committed.pop(tid, None)
        same_group = False
        if old is not None:
            if group is None:
                group = old[3]
            # the same group on the same replica: -1 then +1 would leave its count as is
            same_group = group is not None and old[3] == group and old[0] == replica
            self._release(old, keep_count=same_group)
        self._committed[tid] = (replica, work, now, group)
        if work > 0:
            self._work[replica] = self._work.get(replica, 0.0) + work
        if group is not None and not same_group:
            key = (group, replica)
            self._group_counts[key] = self._group_counts.get(key, 0) + 1
        heapq.heappush(self._seen, (now, tid))
        if len(self._seen) > 4 * len(self._committed) + 64:  # drop stale heap entries
            self._seen = [(t, k) for k, (_, _, t, _) in self._committed.items()]
            heapq.heapify(self._seen)

    def _uncommit(self, tid: str) -> None:
        old = self._committed.pop(tid, None)
        if old is not None:
            self._release(old)

    def _release(self, entry: tuple[str, float, float, str | None],
                 keep_count: bool = False) -> None:
        """Takes a removed commitment's work off its replica and, unless ``keep_count``,
        its trajectory off its group's count there."""
        replica, work, _, group = entry
        left = self._work.get(replica, 0.0) - work
        if left <= 1e-9:
            self._work.pop(replica, None)
        else:
            self._work[replica] = left
        if group is not None and not keep_count:
            key = (group, replica)
            n = self._group_counts.get(key, 0) - 1
            if n > 0:
                self._group_counts[key] = n
            else:
                self._group_counts.pop(key, None)

    def _expire_committed(self, now: float) -> None:
        horizon = now - self.config.progress.finish_idle_s
        while self._seen and self._seen[0][0] < horizon:
            seen, tid = heapq.heappop(self._seen)
            entry = self._committed.get(tid)
            if entry is not None and entry[2] == seen:
                self._uncommit(tid)

    def committed_work(self) -> dict[str, float]:
        """Expected remaining tokens of the trajectories placed on each replica."""
        return dict(self._work)

    def on_replica_down(self, replica: str, now: float) -> None:
        for tid in [t for t, (r, _, _, _) in self._committed.items() if r == replica]:
            self._uncommit(tid)
        self.tree.remove_replica(replica)
        for state in self._placements.values():
            if state.replica == replica:
                state.replica = None

    def finish_trajectory(self, trajectory_id: str, now: float) -> None:
        """The trajectory ended (optional; otherwise idleness tells): its totals join
        its group's finished samples and its placement is forgotten."""
        self.progress.finish(trajectory_id, now)
        self._placements.pop(trajectory_id, None)
        self._uncommit(trajectory_id)

    def num_trajectories(self) -> int:
        """Trajectories whose placement is remembered."""
        return len(self._placements)


def _fitting(healthy: list[ReplicaView], need: int) -> list[ReplicaView]:
    """Rule 1: replicas whose KV can hold ``need`` tokens, else the largest ones."""
    for r in healthy:  # (the common case, every replica fits, without a new list)
        total = r.kv_total_tokens
        if total is not None and total < need:
            break
    else:
        return healthy
    fit = [r for r in healthy if r.kv_total_tokens is None or r.kv_total_tokens >= need]
    if len(fit) == len(healthy):
        return healthy
    if fit:
        return fit
    largest = max(r.kv_total_tokens or 0 for r in healthy)
    return [r for r in healthy if r.kv_total_tokens == largest]

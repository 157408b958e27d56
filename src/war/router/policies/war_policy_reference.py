"""The war routing policy in pure Python: the specification of the native one.

Knows: everything ``war_policy.WarPolicy`` knows, and decides exactly as it does
(the rules are in ``war_policy``'s module docstring). ``WarPolicy`` is C++
(``_war_policy``); this readable implementation is its specification, which the
native policy matches decision for decision, bit for bit (priorities, committed
work, stats, memory: TTL, capacities and expiry order), and the progress
estimator's and the prefix tree's calls in the same order with the same
arguments. Tests run both on the same random streams. Does not know anything
``WarPolicy`` does not; nothing in the router uses it.
"""

from __future__ import annotations

import heapq
from collections import OrderedDict

from war.router.policies.base import Decision, ReplicaView
from war.router.policies.cache_aware import is_imbalanced
from war.router.policies.prefix_tree import PendingEnds, PrefixTree
from war.router.policies.progress import ProgressEstimator
from war.router.policies.round_robin import healthy_sorted
from war.router.policies.war_policy import WarPolicyConfig, WarPolicyStats, load_score
from war.types import GenRequest, GenResult


class _Placement:
    """Where a trajectory's KV is, updated in place turn after turn."""

    __slots__ = ("at", "context_len", "replica")

    def __init__(self, replica: str | None, context_len: int, at: float) -> None:
        self.replica = replica  # holds the trajectory's KV; None: that replica went down
        self.context_len = context_len  # tokens of the trajectory's context known here
        self.at = at  # last put: the map is ordered by it, and forgets it after the TTL


class ReferenceWarPolicy:
    """The war policy in Python (module docstring; rules in ``war_policy``)."""

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
                if cfg.age_priority:  # at least what it has generated so far
                    done = self.progress.progress(tid)
                    if done is not None and done.tokens > 0 and (
                            priority is None or done.tokens > priority):
                        priority = float(done.tokens)
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

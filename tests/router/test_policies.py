"""Routing policies with injected time and fake replica views."""

from __future__ import annotations

import math
import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from war.router.policies import (
    POLICIES,
    CacheAwareConfig,
    CacheAwarePolicy,
    LeastLoadConfig,
    LeastLoadPolicy,
    PrefixTree,
    ProgressConfig,
    ProgressEstimator,
    RoundRobinPolicy,
    RoutingPolicy,
    WarPolicy,
    WarPolicyConfig,
    load_score,
    make_policy,
)
from war.router.policies.base import ReplicaView
from war.router.policies.prefix_tree_reference import ReferencePrefixTree
from war.router.policies.progress import Sample
from war.types import GenRequest, GenResult, SamplingParams


def view(name: str, **kw: object) -> ReplicaView:
    return ReplicaView(name, **kw)  # type: ignore[arg-type]


def req(rid: str, prompt: tuple[int, ...] | list[int] = (1, 2, 3), *, tid: str | None = None,
        gid: str | None = None, max_tokens: int = 16, continues: bool = False,
        priority: float = 0.0) -> GenRequest:
    return GenRequest(rid, tuple(prompt), SamplingParams(max_tokens=max_tokens),
                      trajectory_id=tid, group_id=gid, continues=continues, priority=priority)


def res(rid: str, output: tuple[int, ...] | list[int] = (7,)) -> GenResult:
    out = tuple(output)
    return GenResult(rid, out, (), "stop", num_prompt_tokens=1)


def fleet(*names: str, **loads: int) -> list[ReplicaView]:
    return [view(n, num_requests=loads.get(n, 0)) for n in names]


class Fleet:
    """Replica views whose in-flight counts follow the decisions (a tiny router)."""

    def __init__(self, *names: str, kv_total: int | None = None) -> None:
        self.names = list(names)
        self.requests = dict.fromkeys(names, 0)
        self.tokens = dict.fromkeys(names, 0)
        self.kv_total = kv_total
        self.down: set[str] = set()

    def views(self) -> list[ReplicaView]:
        return [view(n, num_requests=self.requests[n], tokens_in_flight=self.tokens[n],
                     kv_total_tokens=self.kv_total) for n in self.names if n not in self.down]

    def send(self, policy: RoutingPolicy, request: GenRequest, now: float) -> str:
        d = policy.select(request, self.views(), now)
        self.requests[d.replica] += 1
        self.tokens[d.replica] += len(request.prompt_ids) + request.sampling.max_tokens
        return d.replica


# ------------------------------------------------------------------ round robin


def test_round_robin_cycles_in_name_order_and_skips_down() -> None:
    p = RoundRobinPolicy()
    names = [p.select(req(f"r{i}"), fleet("c", "a", "b"), 0.0).replica for i in range(4)]
    assert names == ["a", "b", "c", "a"]
    b_down = [view("a"), view("b", healthy=False), view("c")]
    names = [p.select(req(f"s{i}"), b_down, 0.0).replica for i in range(4)]
    assert names == ["c", "a", "c", "a"]
    assert p.select(req("t"), fleet("a", "b", "c"), 0.0).replica == "b"  # b rejoins its turn
    with pytest.raises(ValueError, match="no healthy replica"):
        p.select(req("u"), [view("a", healthy=False)], 0.0)


# ------------------------------------------------------------------ least load


def test_least_load_picks_fewest_and_sticks_per_trajectory() -> None:
    p = LeastLoadPolicy()
    assert p.select(req("1", tid="t1"), fleet("a", "b", "c", a=3, b=1, c=2), 0.0).replica == "b"
    assert p.select(req("2"), fleet("a", "b", a=1, b=1), 0.0).replica == "a"  # tie: by name
    # t1's later turns stay on b although b is now the busiest
    d = p.select(req("3", tid="t1"), fleet("a", "b", "c", a=0, b=9, c=0), 1.0)
    assert d == ("b", None, False)
    assert p.select(req("4", tid="t2"), fleet("a", "b", "c", a=0, b=9, c=0), 1.0).replica == "a"
    p.on_replica_down("b", 2.0)
    d = p.select(req("5", tid="t1", continues=True), fleet("a", "c", a=2, c=1), 3.0)
    assert d.replica == "c" and d.migrated
    assert p.select(req("6", tid="t1"), fleet("a", "c", a=0, c=5), 4.0) == ("c", None, False)


def test_least_load_memory_is_bounded() -> None:
    p = LeastLoadPolicy(LeastLoadConfig(max_trajectories=3))
    for i in range(10):
        p.select(req(str(i), tid=f"t{i}"), fleet("a", "b"), float(i))
    assert len(p._sticky) == 3
    with pytest.raises(ValueError, match="max_trajectories"):
        LeastLoadConfig(max_trajectories=0)
    for value in (math.nan, 2.5, True):
        with pytest.raises(ValueError, match="max_trajectories must be an int"):
            LeastLoadConfig(max_trajectories=value)  # type: ignore[arg-type]


# ------------------------------------------------------------------ prefix tree
# The native tree and its specification, the reference (test_prefix_tree_native.py
# compares the two operation by operation).

TREES = pytest.mark.parametrize("tree", [PrefixTree, ReferencePrefixTree])


@TREES
def test_prefix_tree_matches_longest_prefix_per_replica(tree: type[PrefixTree]) -> None:
    t = tree(1000)
    t.insert([1, 2, 3, 4], "a", 0.0)
    t.insert([1, 2, 5], "b", 1.0)
    t.insert([1, 2, 3, 4, 6, 7], "b", 2.0)
    t.check_integrity()
    assert t.match([1, 2, 3, 9]) == {"a": 3, "b": 3}
    assert t.match([1, 2, 5, 5]) == {"a": 2, "b": 3}
    assert t.match([1, 2, 3, 4, 6]) == {"a": 4, "b": 5}
    assert t.match([9]) == {}
    assert t.num_tokens("a") == 4 and t.num_tokens("b") == 7
    assert t.replicas() == ["a", "b"]


@TREES
def test_prefix_tree_long_prompts(tree: type[PrefixTree]) -> None:
    rng = random.Random(0)
    base = [rng.randrange(50_000) for _ in range(5000)]
    t = tree(1 << 20)
    t.insert(base, "a", 0.0)
    other = list(base)
    other[4321] = -1
    t.insert(other, "b", 1.0)
    t.check_integrity()
    assert t.match(base) == {"a": 5000, "b": 4321}
    assert t.match([*base[:100], -5]) == {"a": 100, "b": 100}
    assert t.num_tokens("b") == 5000


@TREES
def test_prefix_tree_evicts_least_recently_used_leaves_by_now(tree: type[PrefixTree]) -> None:
    t = tree(10)
    t.insert([1, 2, 3, 4, 5], "a", 0.0)
    t.insert([6, 7, 8, 9, 10], "a", 1.0)
    t.insert([1, 2, 3, 4, 5], "a", 2.0)  # touched again: now [6..10] is the oldest
    t.insert([11, 12, 13], "a", 3.0)
    t.check_integrity()
    assert t.match([6, 7]) == {}
    assert t.match([1, 2, 3, 4, 5]) == {"a": 5}
    assert t.match([11, 12, 13]) == {"a": 3}
    assert t.num_tokens("a") == 8


@TREES
def test_prefix_tree_evicts_leaves_before_shared_prefixes(tree: type[PrefixTree]) -> None:
    t = tree(9)
    t.insert([1, 2, 3, 4, 5, 6], "a", 0.0)  # node [1,2,3,4,5,6]
    t.insert([1, 2, 3, 7, 8], "a", 1.0)  # splits: [1,2,3] -> [4,5,6], [7,8]
    t.check_integrity()
    assert t.num_tokens("a") == 8
    t.insert([1, 2, 3, 9, 9], "a", 2.0)  # 10 tokens > 9: the oldest leaf [4,5,6] goes
    t.check_integrity()
    assert t.match([1, 2, 3, 4, 5, 6]) == {"a": 3}  # the shared prefix stays
    assert t.match([1, 2, 3, 7, 8]) == {"a": 5}
    assert t.num_tokens("a") == 7
    # budgets are per replica: b's inserts do not evict a's
    t.insert(list(range(100, 109)), "b", 3.0)
    assert t.num_tokens("a") == 7 and t.num_tokens("b") == 9


@TREES
def test_prefix_tree_remove_replica(tree: type[PrefixTree]) -> None:
    t = tree(100)
    t.insert([1, 2, 3], "a", 0.0)
    t.insert([1, 2, 3, 4], "b", 1.0)
    t.insert([5, 6], "a", 2.0)
    t.remove_replica("a")
    t.check_integrity()
    assert t.match([1, 2, 3, 4]) == {"b": 4}
    assert t.match([5, 6]) == {}
    assert t.replicas() == ["b"] and t.num_tokens("a") == 0
    t.insert([5, 6], "a", 3.0)  # it may come back
    assert t.match([5, 6]) == {"a": 2}


@TREES
def test_prefix_tree_heap_stays_bounded_under_repeated_touches(tree: type[PrefixTree]) -> None:
    t = tree(100)
    for i in range(1000):
        t.insert([1, 2, 3], "a", float(i))
    assert t.heap_size("a") <= 2 * 1 + 64 + 1
    t.check_integrity()


@settings(max_examples=200, deadline=None)
@given(st.data())
def test_prefix_tree_extend_equals_inserting_the_whole_path(data: st.DataObject) -> None:
    """A prompt inserted at routing and extended with its output at completion leaves the
    tree exactly as inserting prompt + output does, with evictions, replica removals
    and other inserts in between (which can split, evict or detach the handle)."""
    budget = data.draw(st.integers(4, 40))
    fast, slow = PrefixTree(budget), PrefixTree(budget)
    tokens = st.lists(st.integers(0, 3), min_size=1, max_size=12)
    pending: list[tuple[object, tuple[int, ...], str]] = []
    now = 0.0
    for _ in range(data.draw(st.integers(1, 25))):
        now += 1.0
        op = data.draw(st.sampled_from(["route", "complete", "remove"]))
        replica = data.draw(st.sampled_from(["a", "b"]))
        if op == "route":
            prompt = tuple(data.draw(tokens))
            end = fast.insert(prompt, replica, now)
            slow.insert(prompt, replica, now)
            pending.append((end, prompt, replica))
        elif op == "complete" and pending:
            end, prompt, where = pending.pop(data.draw(st.integers(0, len(pending) - 1)))
            output = tuple(data.draw(st.lists(st.integers(0, 3), max_size=6)))
            fast.extend(end, prompt, output, where, now)  # type: ignore[arg-type]
            slow.insert(prompt + output, where, now)
        elif op == "remove":
            fast.remove_replica(replica)
            slow.remove_replica(replica)
        fast.check_integrity()
        assert fast.dump() == slow.dump()
        for probe in ([0, 1, 2, 3], [1, 1, 1], [3, 2]):
            assert fast.match(probe) == slow.match(probe)


@TREES
def test_prefix_tree_extend_without_a_handle_inserts_from_the_root(tree: type[PrefixTree]) -> None:
    t = tree(100)
    assert t.extend(None, [1, 2], [3], "a", 0.0) is not None
    assert t.match([1, 2, 3, 4]) == {"a": 3}
    assert t.insert([], "a", 1.0) is None


# ------------------------------------------------------------------ cache aware


def test_cache_aware_follows_prefixes_when_balanced() -> None:
    p = CacheAwarePolicy()
    prompt = tuple(range(100))
    assert p.select(req("1", prompt), fleet("a", "b"), 0.0).replica == "a"
    # the same prefix goes back to a although b is less loaded (balanced fleet)
    d = p.select(req("2", (*prompt, 500, 501)), fleet("a", "b", a=5, b=0), 1.0)
    assert d.replica == "a" and p.num_cache_hits == 1
    # a new prompt: the smallest tree (b holds nothing)
    assert p.select(req("3", (900, 901)), fleet("a", "b", a=0, b=5), 2.0).replica == "b"


def test_cache_aware_threshold_is_inclusive() -> None:
    p = CacheAwarePolicy(CacheAwareConfig(cache_threshold=0.3))
    p.tree.insert(list(range(3)), "b", 0.0)
    p.tree.insert(list(range(1000, 1010)), "a", 0.0)  # a's tree is larger
    assert p.select(req("1", [0, 1, 2, *range(50, 57)]), fleet("a", "b"), 1.0).replica == "b"
    p2 = CacheAwarePolicy(CacheAwareConfig(cache_threshold=0.3))
    p2.tree.insert(list(range(2)), "b", 0.0)
    p2.tree.insert(list(range(1000, 1010)), "c", 0.0)
    p2.tree.insert(list(range(1000, 1001)), "a", 0.0)
    # 2/10 < 0.3: a miss, so the smallest tree (a: 1 token) wins over b's match
    assert p2.select(req("1", [0, 1, *range(50, 58)]), fleet("a", "b", "c"), 1.0).replica == "a"


def test_cache_aware_balances_under_imbalance() -> None:
    p = CacheAwarePolicy()
    prompts = [tuple(range(100 * i, 100 * i + 50)) for i in range(3)]
    for prompt in prompts:
        p.tree.insert(prompt, "a", 0.0)
    # diff 70 > 64 and 100 > 1.5 * 30: imbalanced -> least loaded, prefix ignored
    assert p.select(req("1", prompts[0]), fleet("a", "b", a=100, b=30), 1.0).replica == "b"
    assert p.num_imbalanced == 1
    # diff 30: balanced -> the prefix wins
    assert p.select(req("2", prompts[1]), fleet("a", "b", a=100, b=70), 1.0).replica == "a"
    # diff 90 > 64 but 300 <= 1.5 * 210: balanced
    assert p.select(req("3", prompts[2]), fleet("a", "b", a=300, b=210), 1.0).replica == "a"


def test_cache_aware_completion_inserts_output_and_continues_stay() -> None:
    p = CacheAwarePolicy()
    r1 = req("1", (1, 2, 3), tid="t")
    assert p.select(r1, fleet("a", "b"), 0.0).replica == "a"
    p.on_complete(r1, res("1", (4, 5, 6, 7, 8, 9)), "a", 1.0)
    assert p.tree.match([1, 2, 3, 4, 5, 6, 7, 8, 9]) == {"a": 9}
    # a continuing turn goes to the trajectory's replica whatever the tree says
    d = p.select(req("2", (10,), tid="t", continues=True), fleet("a", "b", a=3), 2.0)
    assert d == ("a", None, False)
    p.on_replica_down("a", 3.0)
    assert p.tree.match([1, 2, 3]) == {}
    d = p.select(req("3", (11,), tid="t", continues=True), fleet("b"), 4.0)
    assert d.replica == "b" and d.migrated


def test_cache_aware_config_validation() -> None:
    with pytest.raises(ValueError, match="cache_threshold"):
        CacheAwareConfig(cache_threshold=1.5)
    with pytest.raises(ValueError, match="balance_rel_threshold"):
        CacheAwareConfig(balance_rel_threshold=0.5)
    # a NaN passes every comparison: the bounds and the imbalance rule would be off
    for name in ("max_tree_tokens", "max_trajectories"):
        for value in (math.nan, 2.5, True):
            with pytest.raises(ValueError, match=f"{name} must be an int"):
                CacheAwareConfig(**{name: value})  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="balance_abs_threshold"):
        CacheAwareConfig(balance_abs_threshold=math.nan)  # type: ignore[arg-type]


# ------------------------------------------------------------------ war policy


def war(**kw: object) -> WarPolicy:
    return WarPolicy(WarPolicyConfig(**kw))  # type: ignore[arg-type]


def tok_fleet(**tokens: int) -> list[ReplicaView]:
    return [view(n, tokens_in_flight=t) for n, t in sorted(tokens.items())]


def test_load_score_uses_tokens_and_kv() -> None:
    assert load_score(view("a", tokens_in_flight=500)) == 500.0
    assert load_score(view("a", tokens_in_flight=500, kv_total_tokens=10_000,
                           kv_free_tokens=2_000)) == 8_000.0
    assert load_score(view("a", tokens_in_flight=9_000, kv_total_tokens=10_000,
                           kv_free_tokens=2_000)) == 9_000.0


def test_war_sticks_and_migrates_past_tolerance() -> None:
    p = war(migrate_abs_tokens=1000, migrate_rel=1.5)
    assert p.select(req("1", tid="t"), tok_fleet(a=0, b=0), 0.0).replica == "a"
    p.on_complete(req("1", tid="t"), res("1"), "a", 1.0)
    # within tolerance (diff 1000 is not > 1000): stays
    d = p.select(req("2", tid="t"), tok_fleet(a=1500, b=500), 2.0)
    assert d.replica == "a" and not d.migrated
    # diff large but ratio 1.4 < 1.5: stays
    assert p.select(req("3", tid="t"), tok_fleet(a=14_000, b=10_000), 3.0).replica == "a"
    assert p.stats.sticky == 2
    d = p.select(req("4", tid="t"), tok_fleet(a=20_000, b=10_000), 4.0)
    assert d.replica == "b" and d.migrated and p.stats.migrations == 1
    # it now sticks to b
    d = p.select(req("5", tid="t"), tok_fleet(a=0, b=900), 5.0)
    assert d.replica == "b" and not d.migrated


def test_war_does_not_move_a_long_context_to_make_its_target_busier() -> None:
    """A move must leave the target less loaded than the holder was: the gap must
    exceed the request's own tokens (context + max_tokens), else a long context
    ping-pongs between replicas, recomputed at every move."""
    long = tuple(range(40_000))
    p = war(migrate_abs_tokens=1000)
    p.select(req("1", long, tid="t", max_tokens=2_000), tok_fleet(a=0, b=0), 0.0)
    p.on_complete(req("1", long, tid="t"), res("1"), "a", 1.0)
    # gap 40,000 > 1,000 and ratio 1.8: the plain rule would move it; its own 42,001
    # tokens would leave b at 92,001, busier than a is: stays
    d = p.select(req("2", (*long, 7), tid="t", max_tokens=2_000),
                 tok_fleet(a=90_000, b=50_000), 2.0)
    assert d.replica == "a" and not d.migrated and p.stats.migrations == 0
    # gap 80,000 > 42,002: moves
    d = p.select(req("3", (*long, 7, 8), tid="t", max_tokens=2_000),
                 tok_fleet(a=90_000, b=10_000), 3.0)
    assert d.replica == "b" and d.migrated and p.stats.migrations == 1
    # weight 0: the plain rule
    q = war(migrate_abs_tokens=1000, migrate_own_weight=0.0)
    q.select(req("1", long, tid="t", max_tokens=2_000), tok_fleet(a=0, b=0), 0.0)
    q.on_complete(req("1", long, tid="t"), res("1"), "a", 1.0)
    d = q.select(req("2", (*long, 7), tid="t", max_tokens=2_000),
                 tok_fleet(a=90_000, b=50_000), 2.0)
    assert d.replica == "b" and d.migrated


def test_war_moves_for_load_only_to_a_replica_with_room() -> None:
    """A turn moved to a replica whose KV is full would wait there, recomputed: it
    moves only where the last report shows free KV for the whole request."""
    def kv_fleet(free_b: int, free_c: int) -> list[ReplicaView]:
        # loads: a 250,000 (queued work), b 100,000 - free_b, c 85,000 (in flight)
        return [view("a", tokens_in_flight=250_000, kv_total_tokens=100_000,
                     kv_free_tokens=0),
                view("b", tokens_in_flight=1_000, kv_total_tokens=100_000,
                     kv_free_tokens=free_b),
                view("c", tokens_in_flight=85_000, kv_total_tokens=100_000,
                     kv_free_tokens=free_c)]

    prompt = tuple(range(29_500))  # + 500 new tokens: the request needs 30,000
    p = war(migrate_abs_tokens=1000)
    p.select(req("1", prompt, tid="t", max_tokens=500), tok_fleet(a=0, b=0, c=0), 0.0)
    p.on_complete(req("1", prompt, tid="t"), res("1"), "a", 1.0)
    # a is overloaded; b (load 80,000) and c (85,000) lack room: stays
    d = p.select(req("2", prompt, tid="t", max_tokens=500), kv_fleet(20_000, 10_000), 2.0)
    assert d.replica == "a" and not d.migrated and p.stats.migrations == 0
    # c has room now, b (less loaded) still not: c
    d = p.select(req("3", prompt, tid="t", max_tokens=500), kv_fleet(20_000, 50_000), 3.0)
    assert d.replica == "c" and d.migrated and p.stats.migrations == 1
    # without the rule the least loaded takes it, room or not
    q = war(migrate_abs_tokens=1000, migrate_needs_room=False)
    q.select(req("1", prompt, tid="t", max_tokens=500), tok_fleet(a=0, b=0, c=0), 0.0)
    q.on_complete(req("1", prompt, tid="t"), res("1"), "a", 1.0)
    d = q.select(req("2", prompt, tid="t", max_tokens=500), kv_fleet(20_000, 10_000), 2.0)
    assert d.replica == "b" and d.migrated


def test_war_continues_moves_only_when_its_replica_is_down() -> None:
    p = war(migrate_abs_tokens=1000)
    p.select(req("1", tid="t"), tok_fleet(a=0, b=0), 0.0)
    p.on_complete(req("1", tid="t"), res("1"), "a", 1.0)
    d = p.select(req("2", (5,), tid="t", continues=True), tok_fleet(a=90_000, b=0), 2.0)
    assert d.replica == "a" and not d.migrated and p.stats.migrations == 0
    p.on_replica_down("a", 3.0)
    d = p.select(req("3", (6,), tid="t", continues=True), tok_fleet(b=0, c=10), 4.0)
    assert d.replica == "b" and d.migrated and p.stats.failovers == 1
    assert p.tree.match([1, 2, 3]) == {}  # a's tree is gone


def test_war_spreads_a_group_whose_length_is_unknown() -> None:
    # nothing tells how long group g runs: its samples (alike in length) are spread
    # evenly, co-located with the cached prompt only among replicas holding as few
    p = war(group_abs_tokens=10_000, group_abs_requests=100)
    f = Fleet("a", "b", "c")
    prompt = tuple(range(1000, 1100))
    placed = [f.send(p, req(f"g{i}", prompt, tid=f"g/{i}", gid="g"), float(i))
              for i in range(8)]
    assert placed == ["a", "b", "c", "a", "b", "c", "a", "b"]
    assert p.stats.spread == 3 and p.stats.co_located == 5  # a, b, c took it first


def test_war_groups_colocate_within_their_work_tolerance() -> None:
    # group g ran 2 turns of 50 tokens before: a new sample is worth 100 tokens of work
    p = war(group_abs_tokens=10_000, group_abs_requests=100, group_rel=1.25)
    p.progress.add_sample("g", turns=2, tokens=100, now=0.0)
    assert p.progress.has_samples("g") and p.progress.has_samples(None)
    assert not p.progress.has_samples("h")
    f = Fleet("a", "b", "c")
    prompt = tuple(range(1000, 1100))
    placed = [f.send(p, req(f"g{i}", prompt, tid=f"g/{i}", gid="g"), float(i))
              for i in range(6)]
    # a takes a second sample (its work 100 <= min 0 + one sample's 100), not a third
    assert placed[:3] == ["a", "a", "b"]
    assert sorted(placed) == ["a", "a", "b", "b", "c", "c"]
    assert p.committed_work() == {n: pytest.approx(200) for n in "abc"}
    # a known short group's samples stack within the same slack; another group's
    # prompt does not pull towards a
    other = tuple(range(5000, 5100))
    assert f.send(p, req("h0", other, tid="h/0", gid="h"), 9.0) == "a"  # all tie: name


def test_war_groups_spread_by_requests_when_requests_are_small() -> None:
    # a few short requests never reach the token tolerance; the request count still
    # keeps one replica from queueing a whole group while another idles
    p = war(group_work_slack=100.0)  # the work rule out of the way
    p.progress.add_sample("g", turns=1, tokens=16, now=0.0)  # a group of known length
    f = Fleet("a", "b")
    prompt = tuple(range(1000, 1100))
    placed = [f.send(p, req(f"g{i}", prompt, tid=f"g/{i}", gid="g"), float(i))
              for i in range(4)]
    assert placed == ["a", "a", "b", "b"]  # a: 2 vs b: 0 > 1 -> spread; then both match
    assert p.stats.co_located == 2 and p.stats.spread == 2
    # at scale the relative tolerance keeps the group together
    q = war()
    q.tree.insert(prompt, "a", 0.0)

    def busy(b_requests: int) -> list[ReplicaView]:
        return [view("a", num_requests=60, tokens_in_flight=60 * 116),
                view("b", num_requests=b_requests, tokens_in_flight=b_requests * 116)]

    assert q.select(req("h1", prompt, tid="h/1", gid="h"), busy(56), 1.0).replica == "a"
    assert q.select(req("h2", prompt, tid="h/2", gid="h"), busy(40), 2.0).replica == "b"
    with pytest.raises(ValueError, match="group_abs_requests"):
        war(group_abs_requests=-1)


def test_war_group_match_needs_threshold() -> None:
    p = war(group_match_threshold=0.5)
    shared = tuple(range(40))
    p.tree.insert((*shared, *range(100, 160)), "a", 0.0)
    # 40/100 < 0.5: not the group's prefix -> least loaded
    assert p.select(req("1", (*shared, *range(200, 260))), tok_fleet(a=10, b=0), 1.0).replica \
        == "b"
    # 60/100 >= 0.5 -> a although it is (within tolerance) busier
    assert p.select(req("2", (*shared, *range(100, 120), *range(300, 340))),
                    tok_fleet(a=10, b=0), 2.0).replica == "a"


def test_war_respects_kv_capacity() -> None:
    p = war()
    small = view("a", tokens_in_flight=0, kv_total_tokens=1000, kv_free_tokens=1000)
    big = view("b", tokens_in_flight=5000, kv_total_tokens=100_000, kv_free_tokens=95_000)
    assert p.select(req("1", tuple(range(990)), max_tokens=20), [small, big], 0.0).replica == "b"
    assert p.select(req("2", tuple(range(5000, 5900)), max_tokens=20), [small, big],
                    0.0).replica == "a"
    bigger = view("c", tokens_in_flight=9000, kv_total_tokens=150_000, kv_free_tokens=0)
    # nothing can hold 200k tokens: the largest replica
    assert p.select(req("3", tuple(range(200_000)), max_tokens=1), [small, big, bigger],
                    0.0).replica == "c"


def test_war_moves_a_trajectory_its_replica_cannot_hold() -> None:
    p = war()
    a = view("a", kv_total_tokens=200, kv_free_tokens=200)
    b = view("b", tokens_in_flight=50_000, kv_total_tokens=10_000, kv_free_tokens=10_000)
    r1 = req("1", tuple(range(100)), tid="t", max_tokens=50)
    assert p.select(r1, [a, b], 0.0).replica == "a"
    p.on_complete(r1, res("1", tuple(range(80))), "a", 1.0)
    # context 100 + 80 + 10 new + 50 max > 200: a cannot hold the next turn
    d = p.select(req("2", tuple(range(10)), tid="t", continues=True, max_tokens=50),
                 [a, b], 2.0)
    assert d.replica == "b" and d.migrated and p.stats.failovers == 1


def _run_trajectory(p: WarPolicy, tid: str, gid: str, turns: int, tokens_per_turn: int,
                    now: float) -> float:
    for k in range(turns):
        r = req(f"{tid}/{k}", tuple(range(10 + k)), tid=tid, gid=gid)
        d = p.select(r, tok_fleet(a=0), now)
        p.on_complete(r, res(r.request_id, (1,) * tokens_per_turn), d.replica, now + 1)
        now += 2
    return now


def test_war_priority_favours_groups_whose_siblings_ran_long() -> None:
    p = war(progress=ProgressConfig(finish_idle_s=10.0, trajectory_ttl_s=100.0))
    # nothing known: the request keeps its own priority
    assert p.select(req("x", tid="x", gid="L", priority=3.0), tok_fleet(a=0), 0.0).priority \
        is None
    p.on_complete(req("x", tid="x", gid="L"), None, "a", 0.5)
    now = 1.0
    for i in range(2):
        now = _run_trajectory(p, f"L/{i}", "L", turns=6, tokens_per_turn=400, now=now)
        now = _run_trajectory(p, f"S/{i}", "S", turns=1, tokens_per_turn=50, now=now)
    now += 20.0  # idle past finish_idle_s: the siblings count as finished
    long_p = p.select(req("l", tid="L/9", gid="L"), tok_fleet(a=0), now).priority
    short_p = p.select(req("s", tid="S/9", gid="S"), tok_fleet(a=0), now).priority
    assert long_p is not None and short_p is not None
    assert long_p == pytest.approx(6 * 400) and short_p == pytest.approx(50)
    assert long_p > short_p
    # an unknown group falls back to the fleet-wide samples
    other = p.select(req("o", tid="O/0", gid="O"), tok_fleet(a=0), now).priority
    assert other is not None and short_p < other < long_p


def test_war_priority_is_at_least_what_a_trajectory_generated() -> None:
    # Rule 4's age floor: the first samples of a step are its short ones, so a
    # trajectory that has outlived them gets at least its own tokens so far.
    for age in (True, False):
        p = war(age_priority=age, progress=ProgressConfig(finish_idle_s=10.0,
                                                          trajectory_ttl_s=100.0))
        first = req("a/0", tid="a", gid="A", priority=3.0)
        assert p.select(first, tok_fleet(a=0), 0.0).priority is None  # nothing known
        p.on_complete(first, res("a/0", (1,) * 300), "a", 1.0)
        second = p.select(req("a/1", tid="a", gid="A"), tok_fleet(a=0), 2.0).priority
        assert second == (300.0 if age else None)  # no finished sample anywhere yet
        # a finished short sibling: one turn of 40 tokens
        now = _run_trajectory(p, "s", "A", turns=1, tokens_per_turn=40, now=3.0)
        p.finish_trajectory("s", now)
        third = p.select(req("a/2", tid="a", gid="A"), tok_fleet(a=0), now).priority
        assert third is not None
        estimate = p.progress.expected_remaining("A", 1, 300)
        assert estimate is not None and estimate < 300
        assert third == (300.0 if age else estimate)
        # a new trajectory: the estimate alone (nothing generated)
        fresh = p.select(req("b/0", tid="b", gid="A"), tok_fleet(a=0), now).priority
        assert fresh == p.progress.expected_remaining("A", 0, 0)


def test_progress_estimate_numbers() -> None:
    est = ProgressEstimator(ProgressConfig(rate_prior_turns=2.0, half_life_s=100.0))
    assert est.expected_remaining("g", 0, 0) is None
    est.add_sample("g", 2, 200, 0.0)
    est.add_sample("g", 4, 600, 0.0)
    rate = 800 / 6
    assert est.expected_remaining("g", 0, 0) == pytest.approx(3 * rate)  # (2 + 4) / 2 turns
    # 2 turns, 300 tokens done: only the 4-turn sample is ahead (2 more turns)
    assert est.expected_remaining("g", 2, 300) == pytest.approx(2 * (300 + 2 * rate) / 4)
    # past every sample: one more turn at the blended rate
    assert est.expected_remaining("g", 4, 800) == pytest.approx((800 + 2 * rate) / 6)
    # decay: a sample half a life older weighs half
    est.add_sample("h", 2, 100, 0.0)
    est.add_sample("h", 6, 600, 100.0)
    w = 0.5
    rate_h = (w * 100 + 600) / (w * 2 + 6)
    turns_h = (w * 2 + 6) / (w + 1)
    assert est.expected_remaining("h", 0, 0) == pytest.approx(turns_h * rate_h)
    # unknown groups use every sample
    assert est.expected_remaining("zzz", 0, 0) is not None
    assert len(est.samples(None)) == 4


def _brute_remaining(samples: list[Sample], k: int, d: int, c: float, h: float) -> float:
    """The module docstring's estimate, computed from the samples directly."""
    newest = max(x.end for x in samples)
    swt = swk = ahead = ahead_k = 0.0
    for x in samples:
        w = 0.5 ** ((newest - x.end) / h)
        swt += w * x.tokens
        swk += w * x.turns
        if x.turns > k:
            ahead += w
            ahead_k += w * (x.turns - k)
    rate = (d + c * (swt / swk if swk > 0 else 0.0)) / (k + c)
    return (ahead_k / ahead if ahead > 0 else 1.0) * rate


@settings(max_examples=60, deadline=None)
@given(st.data())
def test_progress_sums_match_the_samples(data: st.DataObject) -> None:
    """The estimate keeps running sums as samples come, go (evicted, or taken back when a
    trajectory resumes) and age past the weights' range; it equals the formula computed
    from the held samples."""
    cfg = ProgressConfig(half_life_s=data.draw(st.sampled_from([1.0, 50.0])),
                         max_samples_per_group=data.draw(st.integers(1, 6)),
                         max_global_samples=data.draw(st.integers(1, 12)),
                         finish_idle_s=5.0, trajectory_ttl_s=1e9)
    est = ProgressEstimator(cfg)
    now = 0.0
    for _ in range(data.draw(st.integers(1, 60))):
        now += data.draw(st.sampled_from([0.0, 0.5, 3.0, 400.0]))  # 400 s: past 2**256
        tid = f"t{data.draw(st.integers(0, 8))}"
        gid = data.draw(st.sampled_from([None, "a", "b"]))
        op = data.draw(st.sampled_from(["sample", "turn", "finish"]))
        if op == "sample":
            est.add_sample(gid, data.draw(st.integers(1, 9)), data.draw(st.integers(0, 500)),
                           now, trajectory_id=tid)
        elif op == "turn":  # a trajectory begins (taking back a counted sample) and ends
            est.begin(tid, gid, now)
            est.observe(tid, gid, data.draw(st.integers(0, 300)), now)
        else:
            est.finish(tid, now)
        for group in (None, "a", "b"):
            held = est.samples(group)
            fallback = held or est.samples(None)
            for k, d in ((0, 0), (2, 90), (7, 10)):
                got = est.expected_remaining(group, k, d)
                if not fallback:
                    assert got is None
                    continue
                want = _brute_remaining(fallback, k, d, cfg.rate_prior_turns, cfg.half_life_s)
                assert got == pytest.approx(want, rel=1e-9, abs=1e-9)


def test_progress_idle_finish_and_comeback() -> None:
    est = ProgressEstimator(ProgressConfig(finish_idle_s=10.0, trajectory_ttl_s=50.0))
    est.begin("t", "g", 0.0)
    est.observe("t", "g", 100, 1.0)
    est.begin("t", "g", 2.0)
    est.observe("t", "g", 50, 3.0)
    assert est.progress("t") == ("g", 2, 150, 0)
    est.expire(12.9)
    assert est.samples("g") == []
    est.expire(13.0)
    assert est.samples("g") == [(2, 150, 3.0)]
    est.begin("t", "g", 20.0)  # it was not finished: taken out again
    assert est.samples("g") == []
    est.observe("t", "g", 10, 21.0)
    est.finish("t", 22.0)
    assert est.samples("g") == [(3, 160, 22.0)]
    est.expire(22.0 + 50.1)
    assert est.progress("t") is None and est.samples("g") == [(3, 160, 22.0)]


def test_war_memory_is_bounded() -> None:
    p = war(max_trajectories=10, trajectory_ttl_s=100.0,
            progress=ProgressConfig(max_trajectories=20, finish_idle_s=5.0,
                                    trajectory_ttl_s=100.0, max_samples_per_group=4,
                                    max_groups=3))
    for i in range(200):
        r = req(str(i), tid=f"t{i}", gid=f"g{i % 7}")
        d = p.select(r, tok_fleet(a=0, b=0), float(i))
        p.on_complete(r, res(str(i)), d.replica, float(i) + 0.5)
        assert p.num_trajectories() <= 10 and p.progress.num_tracked() <= 20
    assert len(p.progress._groups) <= 3
    assert all(len(g) <= 4 for g in p.progress._groups.values())
    p.select(req("late", tid="late"), tok_fleet(a=0), 1000.0)
    assert p.num_trajectories() == 1  # the others were forgotten by time
    assert p.progress.num_tracked() == 1


def test_war_config_validation() -> None:
    with pytest.raises(ValueError, match="migrate_rel"):
        WarPolicyConfig(migrate_rel=0.9)
    with pytest.raises(ValueError, match="migrate_own_weight"):
        WarPolicyConfig(migrate_own_weight=-1.0)
    with pytest.raises(ValueError, match="group_match_threshold"):
        WarPolicyConfig(group_match_threshold=2.0)
    with pytest.raises(ValueError, match="trajectory_ttl_s"):
        ProgressConfig(finish_idle_s=100.0, trajectory_ttl_s=10.0)


# ------------------------------------------------------------------ all policies


def test_make_policy() -> None:
    assert set(POLICIES) == {"round_robin", "least_load", "cache_aware", "war"}
    for name in POLICIES:
        assert make_policy(name).name == name
    p = make_policy("cache_aware", cache_threshold=0.5)
    assert isinstance(p, CacheAwarePolicy) and p.config.cache_threshold == 0.5
    with pytest.raises(KeyError, match="known: round_robin, least_load, cache_aware, war"):
        make_policy("nope")
    with pytest.raises(TypeError):
        make_policy("war", bogus=1)


def _script(seed: int) -> list[tuple[GenRequest, list[ReplicaView], float]]:
    rng = random.Random(seed)
    out = []
    for i in range(60):
        g = rng.randrange(3)
        prompt = (g, g, g, *(rng.randrange(5) for _ in range(rng.randrange(1, 6))))
        views = [view(n, num_requests=rng.randrange(10), tokens_in_flight=rng.randrange(10_000),
                      kv_total_tokens=rng.choice([None, 20_000]), kv_free_tokens=5_000)
                 for n in ("a", "b", "c")]
        out.append((req(str(i), prompt, tid=f"t{rng.randrange(8)}", gid=f"g{g}"), views,
                    float(i)))
    return out


@pytest.mark.parametrize("name", sorted(POLICIES))
def test_policies_are_deterministic(name: str) -> None:
    decisions = []
    for attempt in range(2):
        p = make_policy(name)
        got = []
        for request, views, now in _script(7):
            if attempt:  # the order the router lists replicas in does not matter
                views = list(reversed(views))
            d = p.select(request, views, now)
            got.append(d)
            p.on_complete(request, res(request.request_id, (9, 9)), d.replica, now + 0.5)
        decisions.append(got)
    assert decisions[0] == decisions[1]


_view = st.builds(
    lambda name, healthy, n, t, total, free: view(
        name, healthy=healthy, num_requests=n, tokens_in_flight=t, kv_total_tokens=total,
        kv_free_tokens=None if total is None else min(free, total)),
    st.sampled_from(["a", "b", "c", "d"]), st.booleans(), st.integers(0, 200),
    st.integers(0, 100_000), st.one_of(st.none(), st.integers(1, 50_000)),
    st.integers(0, 50_000))

_step = st.tuples(
    st.lists(_view, min_size=1, max_size=4, unique_by=lambda v: v.name),
    st.lists(st.integers(0, 4), min_size=1, max_size=30),  # prompt
    st.integers(0, 5),  # trajectory
    st.booleans(),  # continues
    st.integers(1, 5000),  # max tokens
    st.sampled_from(["ok", "fail", "down"]),
)


@settings(max_examples=60, deadline=None)
@given(st.lists(_step, min_size=1, max_size=25))
def test_every_policy_returns_a_given_healthy_replica(steps: list[tuple]) -> None:  # type: ignore[type-arg]
    policies: list[RoutingPolicy] = [RoundRobinPolicy(), LeastLoadPolicy(), CacheAwarePolicy(
        CacheAwareConfig(max_tree_tokens=64)), WarPolicy(WarPolicyConfig(max_tree_tokens=64))]
    for i, (views, prompt, traj, cont, max_tokens, outcome) in enumerate(steps):
        views = list(views)
        if not any(v.healthy for v in views):
            views[0] = views[0]._replace(healthy=True)
        healthy = {v.name for v in views if v.healthy}
        request = req(str(i), prompt, tid=f"t{traj}", gid="g", continues=cont,
                      max_tokens=max_tokens)
        now = float(i)
        for p in policies:
            d = p.select(request, views, now)
            assert d.replica in healthy, p.name
            if outcome == "ok":
                p.on_complete(request, res(str(i), prompt[:3]), d.replica, now + 0.5)
            elif outcome == "fail":
                p.on_complete(request, None, d.replica, now + 0.5)
            else:
                p.on_complete(request, None, d.replica, now + 0.5)
                p.on_replica_down(d.replica, now + 0.5)
    for p in policies:
        if isinstance(p, CacheAwarePolicy | WarPolicy):
            p.tree.check_integrity()


def test_war_counts_trajectories_between_turns_as_committed_work() -> None:
    p = war(group_abs_tokens=100, group_rel=1.1, group_work_slack=10.0)
    p.progress.add_sample("g", turns=3, tokens=90, now=0.0)  # 90 tokens expected each
    reqs = [req(f"g{i}", tuple(range(100)), tid=f"g/{i}", gid="g", max_tokens=50)
            for i in range(4)]
    # the group's four first turns go to a together (its work stays within tolerance)
    assert [p.select(r, tok_fleet(a=0, b=0), 0.0).replica for r in reqs] == ["a"] * 4
    assert p.committed_work() == {"a": pytest.approx(4 * 90)}
    for r in reqs:  # their turns end (30 tokens); the trajectories now run tools
        p.on_complete(r, res(r.request_id, (1,) * 30), "a", 1.0)
    assert p.committed_work() == {"a": pytest.approx(4 * 60)}  # 2 turns of 30 to come
    # nothing is in flight anywhere, yet a new group goes where no one is waiting
    other = req("h0", tuple(range(500, 600)), tid="h/0", gid="h")
    assert p.select(other, tok_fleet(a=0, b=0), 2.0).replica == "b"
    # finishing forgets a trajectory's work
    p.finish_trajectory("g/1", 4.0)
    assert p.committed_work()["a"] == pytest.approx(3 * 60)
    # idle past finish_idle_s: no longer committed
    p.select(req("x", (1,)), tok_fleet(a=0, b=0), 4.0 + p.config.progress.finish_idle_s + 1)
    assert p.committed_work() == {}

"""The native war policy against its specification, the pure-Python reference.

Random streams (new and continuing trajectories, requests that ``continue``, a few
groups and none, replicas with and without KV reports, some too small for some
requests, varying loads, healthy subsets, replicas going down, finished
trajectories, failed completions, times that stand still, go back and jump past
the idle and TTL horizons, tiny caps, finished samples added to the estimator)
under several configs (int-valued ones too: Python compares ints exactly) must give
the same results bit for bit: every Decision, and after every step the stats, the
committed work (its order too), the trajectories remembered, the estimator's
tracked trajectories and the tree's matches. Also: bad arguments raise TypeError or
ValueError and leave the policy unchanged, and the hot methods are the native ones.
"""

from __future__ import annotations

import math
import random
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from war.router.policies import ReplicaView, WarPolicy, WarPolicyConfig, _war_policy
from war.router.policies.progress import ProgressConfig
from war.router.policies.war_policy_reference import ReferenceWarPolicy
from war.types import GenRequest, GenResult, SamplingParams

NAMES = ("a", "b", "c", "d")
TIDS = ("t0", "t1", "t2", "t3", "t4", "t5", "\ud800")
GROUPS = (None, "g0", "g1", "g2")

_SMALL = ProgressConfig(finish_idle_s=5.0, trajectory_ttl_s=20.0, max_trajectories=4,
                        max_samples_per_group=3, max_groups=2, max_global_samples=5)
CONFIGS = (
    WarPolicyConfig(),
    WarPolicyConfig(trajectory_ttl_s=30.0, max_trajectories=3, max_tree_tokens=300,
                    progress=_SMALL),
    WarPolicyConfig(migrate_needs_room=False, spread_unknown_groups=False,
                    progress_priority=False, migrate_abs_tokens=0, group_abs_tokens=0,
                    group_abs_requests=0, group_work_slack=0.0, progress=_SMALL),
    WarPolicyConfig(migrate_abs_tokens=50, migrate_rel=1.0, migrate_own_weight=0.0,
                    group_abs_tokens=20, group_rel=1.0, group_match_threshold=0.3,
                    trajectory_ttl_s=12.0, max_trajectories=2, progress=_SMALL),
    # ints where floats are usual (Python mixes int and float comparisons exactly)
    WarPolicyConfig(migrate_rel=2, migrate_own_weight=0, group_rel=1, group_work_slack=0,
                    group_match_threshold=1, migrate_abs_tokens=10, group_abs_tokens=0,
                    trajectory_ttl_s=8, progress=ProgressConfig(finish_idle_s=3,
                                                                trajectory_ttl_s=8)),
    WarPolicyConfig(migrate_rel=1.25, migrate_own_weight=2, group_match_threshold=0,
                    group_work_slack=3, group_abs_requests=2, max_tree_tokens=80),
    WarPolicyConfig(age_priority=False, max_trajectories=3, progress=_SMALL),
)


def same(a: Any, b: Any) -> bool:
    """Equal, floats bit for bit (the sign of zero too)."""
    if isinstance(a, float) or isinstance(b, float):
        if type(a) is not type(b):
            return False
        if math.isnan(a) or math.isnan(b):
            return math.isnan(a) and math.isnan(b)
        return bool(a == b) and math.copysign(1.0, a) == math.copysign(1.0, b)
    if isinstance(a, tuple | list) and isinstance(b, tuple | list):
        return (type(a) is type(b) and len(a) == len(b)
                and all(same(u, v) for u, v in zip(a, b, strict=True)))
    if isinstance(a, dict) and isinstance(b, dict):
        return list(a) == list(b) and all(same(a[k], b[k]) for k in a)
    return type(a) is type(b) and bool(a == b)


class Pair:
    """A native policy and a reference one driven by the same calls."""

    def __init__(self, cfg: WarPolicyConfig) -> None:
        self.native = WarPolicy(cfg)
        self.ref = ReferenceWarPolicy(cfg)

    def call(self, name: str, *args: Any) -> Any:
        results = []
        for p in (self.native, self.ref):
            try:
                results.append((getattr(p, name)(*args), None))
            except (ValueError, TypeError) as e:
                results.append((None, e))
        (got, err), (want, ref_err) = results
        assert type(err) is type(ref_err), (name, args, err, ref_err)
        assert same(got, want), (name, args, got, want)
        return got

    def progress(self, name: str, *args: Any) -> None:
        for p in (self.native, self.ref):
            getattr(p.progress, name)(*args)

    def check(self, probes: list[tuple[int, ...]]) -> None:
        n, r = self.native, self.ref
        assert n.stats == r.stats
        assert same(n.committed_work(), r.committed_work())
        assert n.num_trajectories() == r.num_trajectories()
        assert n.progress.num_tracked() == r.progress.num_tracked()
        assert n._num_pending_ends() == len(r._ends)
        for prompt in probes:
            assert n.tree.match(prompt) == r.tree.match(prompt)


def _prompt(rng: random.Random, group: str | None) -> tuple[int, ...]:
    base = (100 + GROUPS.index(group),) * rng.choice((4, 12, 20))
    if rng.random() < 0.2:
        base = (7, 7, 7)  # shared by every group
    return base + tuple(rng.randrange(6) for _ in range(rng.randrange(0, 24)))


def _views(rng: random.Random) -> list[ReplicaView]:
    if rng.random() < 0.3:  # alike: ties decide
        load = rng.choice((0, 0, 50))
        return [ReplicaView(name, True, load // 50, load) for name in NAMES]
    views = []
    for name in rng.sample(NAMES, rng.randint(1, 4)):
        total = rng.choice((None, None, 30, 60, 120, 400, 5000))
        free = None if total is None or rng.random() < 0.2 else rng.randint(0, total)
        if total is None and rng.random() < 0.1:
            free = rng.randint(0, 100)  # (free without total: ignored by the load)
        views.append(ReplicaView(name, rng.random() < 0.9, rng.randint(0, 6),
                                 rng.choice((0, 10, 100, 1000, rng.randint(0, 5000),
                                             rng.randint(30000, 90000))),
                                 free, total, rng.randint(0, 3)))
    return views


def run_stream(cfg: WarPolicyConfig, seed: int, steps: int) -> None:
    rng = random.Random(seed)
    pair = Pair(cfg)
    now = 100.0
    pending: list[tuple[GenRequest, str]] = []
    probes: list[tuple[int, ...]] = [(100,) * 12, (101,) * 20 + (1,), (7, 7, 7, 0)]
    counter = 0
    for _ in range(steps):
        u = rng.random()
        if u < 0.08:
            now -= rng.random() * 3  # out of order
        elif u < 0.14:
            now += rng.choice((4.0, 10.0, 25.0, 70.0, 2000.0))  # past idle, TTL
        elif u < 0.2:
            pass  # the same time again
        else:
            now += rng.random() * 0.5
        op = rng.random()
        if op < 0.5 or not pending:
            counter += 1
            group = rng.choice(GROUPS)
            tid = rng.choice(TIDS) if rng.random() < 0.85 else None
            continues = tid is not None and rng.random() < 0.25
            prompt = (tuple(rng.randrange(6) for _ in range(rng.randint(1, 5))) if continues
                      else _prompt(rng, group))
            if rng.random() < 0.1:
                probes.append(prompt)
            req = GenRequest(f"q{counter}", prompt,
                             SamplingParams(max_tokens=rng.choice((1, 8, 32, 64))),
                             trajectory_id=tid, group_id=group, continues=continues)
            d = pair.call("select", req, _views(rng), now)
            if d is not None:
                pending.append((req, d.replica))
                if rng.random() < 0.05:  # the same request id routed again
                    pending.append((req, d.replica))
        elif op < 0.85:
            req, replica = pending.pop(rng.randrange(len(pending)))
            if rng.random() < 0.05:
                replica = rng.choice(NAMES)
            result = None
            if rng.random() > 0.15:
                out = tuple(rng.randrange(6) for _ in range(rng.randint(0, 20)))
                result = GenResult(req.request_id, out, (), "stop", len(req.prompt_ids))
            pair.call("on_complete", req, result, replica, now)
        elif op < 0.89:
            pair.call("on_replica_down", rng.choice(NAMES), now)
        elif op < 0.95:
            pair.call("finish_trajectory", rng.choice(TIDS), now)
        else:
            pair.progress("add_sample", rng.choice(GROUPS), rng.randint(1, 6),
                          rng.randint(0, 300), now, None)
        pair.check(probes[-6:])


@settings(max_examples=150, deadline=None)
@given(st.integers(0, len(CONFIGS) - 1), st.integers(0, 2**32 - 1), st.integers(20, 200))
def test_native_matches_reference(config: int, seed: int, steps: int) -> None:
    run_stream(CONFIGS[config], seed, steps)


@pytest.mark.parametrize("config", range(len(CONFIGS)))
def test_native_matches_reference_long(config: int) -> None:
    run_stream(CONFIGS[config], 1234 + config, 2500)


# ---------------------------------------------------------------- bad inputs


def _snapshot(p: WarPolicy) -> tuple[Any, ...]:
    return (p.stats, p.committed_work(), p.num_trajectories(), p.progress.num_tracked(),
            p._num_pending_ends(), p.tree.match((1, 2, 3)))


def _busy_policy() -> WarPolicy:
    p = WarPolicy()
    views = [ReplicaView("a"), ReplicaView("b")]
    for i in range(4):
        p.select(GenRequest(f"r{i}", (1, 2, 3, i), trajectory_id=f"t{i}", group_id="g"),
                 views, 1.0)
    return p


class _Req:
    """A request-like object whose attributes can be wrong."""

    def __init__(self, **kw: Any) -> None:
        self.request_id: Any = "x"
        self.prompt_ids: Any = (1, 2, 3)
        self.sampling: Any = SamplingParams(max_tokens=4)
        self.trajectory_id: Any = "t9"
        self.group_id: Any = None
        self.priority = 0.0
        self.continues: Any = False
        self.__dict__.update(kw)


@pytest.mark.parametrize("request_, replicas, now, error", [
    (_Req(), [ReplicaView("a", healthy=False)], 1.0, ValueError),  # none healthy
    (_Req(), [], 1.0, ValueError),
    (_Req(), None, 1.0, TypeError),
    (_Req(), [("a",)], 1.0, TypeError),  # not a ReplicaView
    (_Req(), [ReplicaView(3)], 1.0, TypeError),  # type: ignore[arg-type]
    (_Req(), [ReplicaView("a", num_requests="1")], 1.0, TypeError),  # type: ignore[arg-type]
    (_Req(), [ReplicaView("a", kv_total_tokens=1.5)], 1.0, TypeError),  # type: ignore[arg-type]
    (_Req(), [ReplicaView("a")], "now", TypeError),
    (_Req(), [ReplicaView("a")], float("nan"), ValueError),
    (_Req(trajectory_id=5), [ReplicaView("a")], 1.0, TypeError),
    (_Req(group_id=b"g"), [ReplicaView("a")], 1.0, TypeError),
    (_Req(request_id=None), [ReplicaView("a")], 1.0, TypeError),
    (_Req(prompt_ids=5), [ReplicaView("a")], 1.0, TypeError),
    (_Req(sampling=None), [ReplicaView("a")], 1.0, TypeError),
    (None, [ReplicaView("a")], 1.0, TypeError),
])
def test_select_bad_arguments_leave_it_unchanged(request_: Any, replicas: Any, now: Any,
                                                 error: type[Exception]) -> None:
    p = _busy_policy()
    before = _snapshot(p)
    with pytest.raises(error):
        p.select(request_, replicas, now)
    assert _snapshot(p) == before


def test_select_bad_tokens_raise_as_the_reference() -> None:
    """The tree rejects the prompt after rules 1-3 ran: the stats and expiries stand,
    as in the reference; nothing else changed."""
    for bad in ((1, "x"), (1, 2**40)):
        pair = Pair(WarPolicyConfig())
        views = [ReplicaView("a"), ReplicaView("b")]
        pair.call("select", GenRequest("r0", (1, 2), trajectory_id="t"), views, 1.0)
        req = GenRequest("r1", bad, trajectory_id="u")  # type: ignore[arg-type]
        pair.call("select", req, views, 2.0)
        pair.check([(1, 2)])


def test_on_complete_and_others_bad_arguments() -> None:
    p = _busy_policy()
    before = _snapshot(p)
    req = GenRequest("r0", (1, 2, 3, 0), trajectory_id="t0", group_id="g")
    result = GenResult("r0", (1,), (), "stop", 4)
    for args, error in [((None, result, "a", 2.0), TypeError),
                        ((req, object(), "a", 2.0), TypeError),
                        ((req, result, 5, 2.0), TypeError),
                        ((req, result, "a", "later"), TypeError),
                        ((req, result, "a", float("nan")), ValueError),
                        ((_Req(request_id=3), result, "a", 2.0), TypeError)]:
        with pytest.raises(error):
            p.on_complete(*args)
        assert _snapshot(p) == before, args
    with pytest.raises(TypeError):
        p.on_replica_down(None, 2.0)  # type: ignore[arg-type]
    with pytest.raises(TypeError):
        p.finish_trajectory(None, 2.0)  # type: ignore[arg-type]
    with pytest.raises(TypeError):
        p.finish_trajectory("t0", "later")  # type: ignore[arg-type]
    assert _snapshot(p) == before
    with pytest.raises(TypeError):
        WarPolicy(WarPolicyConfig(migrate_rel="2"))  # type: ignore[arg-type]


def test_the_hot_methods_are_native() -> None:
    for name in ("select", "on_complete", "committed_work", "on_replica_down",
                 "finish_trajectory", "num_trajectories"):
        assert getattr(WarPolicy, name) is getattr(_war_policy.WarPolicy, name), name
    p = WarPolicy()
    assert p.name == "war" and isinstance(p.stats.sticky, int)
    assert type(p.tree).__name__ == "PrefixTree"
    assert type(p.progress).__name__ == "ProgressEstimator"


def test_select_reads_its_own_copy_of_the_replicas() -> None:
    """Python code run during a select (a view's ``__bool__`` here) may empty the
    caller's list: the native policy reads a tuple of its own (it read the list's freed
    array before: a crash). Run in a child process, so a regression fails this test
    rather than ending the run."""
    import subprocess
    import sys

    code = """
from war.router.policies import ReplicaView, WarPolicy
from war.router.policies.war_policy_reference import ReferenceWarPolicy
from war.types import GenRequest, SamplingParams

def views(target):
    class Healthy:
        def __bool__(self):
            target.clear()
            return True
    target += [ReplicaView("r0", Healthy())] + [ReplicaView(f"r{i}") for i in range(1, 8)]
    return target

req = GenRequest("q", (1, 2, 3), SamplingParams(max_tokens=4))
for _ in range(50):
    a = WarPolicy().select(req, views([]), 0.0)
    b = ReferenceWarPolicy().select(req, views([]), 0.0)
    assert a == b, (a, b)
print("ok")
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "ok", (out.returncode, out.stderr)


def test_a_huge_max_tokens_does_not_wrap() -> None:
    """``SamplingParams`` allows max_tokens up to 2**63 - 1: context plus that must not
    wrap to a negative need that every replica fits (the reference computes in Python
    ints: no replica fits, so the largest is taken)."""
    views = [ReplicaView("a", True, 0, 0, 10, 10), ReplicaView("b", True, 0, 0, 20, 20)]
    for max_tokens in (2**63 - 1, 2**63 - 3, 2**62):
        req = GenRequest("q", (1, 2, 3), SamplingParams(max_tokens=max_tokens))
        native = WarPolicy().select(req, views, 0.0)
        assert native == ReferenceWarPolicy().select(req, views, 0.0)
        assert native.replica == "b"

"""The native progress estimator against its specification, the pure-Python reference.

Random call sequences (tiny caps so that every bound evicts, short idle and ttl times
so that idle trajectories count as finished and are forgotten, time that stands still,
goes back and jumps far enough to move the weights' reference time and underflow old
weights) must give the same results bit for bit: every return value, and after every
call the progress of each id, the samples of each group, ``has_samples``,
``num_tracked`` and some estimates. Also: the error messages, bad argument types
(TypeError, the estimator unchanged), and that the hot methods are the native ones.
"""

from __future__ import annotations

import math
import random
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from war.router.policies import _progress
from war.router.policies.progress import Progress, ProgressConfig, ProgressEstimator, Sample
from war.router.policies.progress_reference import ReferenceProgressEstimator

IDS = ("t0", "t1", "t2", "t3", "\0sample0", "\ud800")  # (an anonymous key; a lone surrogate)
GROUPS = (None, "a", "b", "c")
QUERIES = ((0, 0), (1, 50), (2, 90), (3, 0), (7, 10))


def same(a: Any, b: Any) -> bool:
    """Equal, floats bit for bit (the sign of zero too; NaN equals NaN)."""
    if isinstance(a, float) or isinstance(b, float):
        if not isinstance(a, int | float) or not isinstance(b, int | float):
            return False
        x, y = float(a), float(b)
        if math.isnan(x) or math.isnan(y):
            return math.isnan(x) and math.isnan(y)
        return x == y and math.copysign(1.0, x) == math.copysign(1.0, y)
    if isinstance(a, tuple | list) and isinstance(b, tuple | list):
        return len(a) == len(b) and all(same(u, v) for u, v in zip(a, b, strict=True))
    return bool(a == b)


class Pair:
    """A native estimator and a reference one driven by the same calls."""

    def __init__(self, cfg: ProgressConfig) -> None:
        self.native = ProgressEstimator(cfg)
        self.ref = ReferenceProgressEstimator(cfg)

    def call(self, name: str, *args: Any, **kwargs: Any) -> Any:
        results = []
        for est in (self.native, self.ref):
            try:
                results.append((getattr(est, name)(*args, **kwargs), None))
            except (ValueError, TypeError) as e:
                results.append((None, e))
        (got, err), (want, ref_err) = results
        assert type(err) is type(ref_err), (name, args, err, ref_err)
        assert str(err) == str(ref_err)
        assert same(got, want), (name, args, got, want)
        return got

    def check(self, ids: tuple[str, ...] = IDS, groups: tuple[str | None, ...] = GROUPS) -> None:
        n, r = self.native, self.ref
        assert n.num_tracked() == r.num_tracked()
        for tid in ids:
            got, want = n.progress(tid), r.progress(tid)
            assert same(got, want), (tid, got, want)
            assert got is None or type(got) is Progress
        for gid in groups:
            got_s, want_s = n.samples(gid), r.samples(gid)
            assert same(got_s, want_s), (gid, got_s, want_s)
            assert all(type(x) is Sample for x in got_s)
            assert n.has_samples(gid) == r.has_samples(gid)
            for k, d in QUERIES:
                assert same(n.expected_remaining(gid, k, d), r.expected_remaining(gid, k, d))
        for tid in ids[:2]:
            for gid in groups[:2]:
                assert same(n.remaining_for(tid, gid), r.remaining_for(tid, gid))
        assert list(n._groups) == list(r._groups)  # the groups' order, too


configs = st.builds(
    lambda idle, ttl_factor, cap, per_group, groups, global_, half_life, c: ProgressConfig(
        finish_idle_s=idle, trajectory_ttl_s=idle * ttl_factor, max_trajectories=cap,
        half_life_s=half_life, max_samples_per_group=per_group, max_groups=groups,
        max_global_samples=global_, rate_prior_turns=c),
    st.sampled_from([0.5, 1.0, 4.0]),
    st.sampled_from([1.0, 2.0, 10.0]),
    st.sampled_from([1, 2, 3, 100]),
    st.sampled_from([1, 2, 3, 64]),
    st.sampled_from([1, 2, 100]),
    st.sampled_from([1, 2, 3, 4, 1024]),
    st.sampled_from([0.01, 1.0, 30.0, 1800]),
    st.sampled_from([0, 0.0, 0.5, 2.0]),
)

# time steps: standing still, small steps, going back, jumps of many half-lives
STEPS = (0.0, 0.0, 0.25, 0.5, 1.0, 3.0, -0.5, -4.0, 1e3, 1e7)
KINDS = ("begin", "begin", "observe", "observe", "turn", "abort", "finish", "sample",
         "sample_anon", "expire", "remaining")

ops = st.lists(
    st.tuples(st.sampled_from(KINDS), st.sampled_from(IDS), st.sampled_from(GROUPS),
              st.sampled_from([0, 0, 1, 7, 50, 300, -1]), st.integers(1, 6),
              st.sampled_from(STEPS), st.booleans()),
    max_size=70)


def _run(pair: Pair, op: tuple[str, str, str | None, int, int, float, bool], now: float) -> None:
    kind, tid, gid, tokens, turns, _, _ = op
    if kind == "begin":
        pair.call("begin", tid, gid, now)
    elif kind == "observe":
        pair.call("observe", tid, gid, tokens, now)
    elif kind == "turn":
        pair.call("begin", tid, gid, now)
        pair.call("observe", tid, gid, tokens, now)
    elif kind == "abort":
        pair.call("abort", tid, now)
    elif kind == "finish":
        pair.call("finish", tid, now)
    elif kind == "sample":
        pair.call("add_sample", gid, turns, tokens, now, trajectory_id=tid)
    elif kind == "sample_anon":
        pair.call("add_sample", gid, turns if tokens >= 0 else 0, tokens, now)
    elif kind == "expire":
        pair.call("expire", now)
    else:
        pair.call("remaining_for", tid, gid)
        pair.call("expected_remaining", gid, turns, max(tokens, 0))


@settings(max_examples=500, deadline=None)
@given(cfg=configs, steps=ops)
def test_random_calls_match_the_reference(cfg: ProgressConfig,
                                          steps: list[tuple[Any, ...]]) -> None:
    pair = Pair(cfg)
    now = 0.0
    for op in steps:
        now += op[5]
        # (an integral time sometimes passed as an int, as the reference allows)
        when: float = int(now) if op[6] and now.is_integer() else now
        _run(pair, op, when)
        pair.check()


def test_long_random_sequences_match_the_reference() -> None:
    """Many calls on one estimator: sums recomputed after many changes, heavy removals,
    turn counts leaving and coming back (the order of the estimate's pass)."""
    for seed, cfg in enumerate([
        ProgressConfig(finish_idle_s=2.0, trajectory_ttl_s=20.0, max_trajectories=40,
                       half_life_s=30.0, max_samples_per_group=8, max_groups=4,
                       max_global_samples=100),
        ProgressConfig(finish_idle_s=1.0, trajectory_ttl_s=3.0, max_trajectories=12,
                       half_life_s=0.5, max_samples_per_group=3, max_groups=3,
                       max_global_samples=30, rate_prior_turns=0.0),
    ]):
        rng = random.Random(seed)
        pair = Pair(cfg)
        ids = tuple(f"t{i}" for i in range(60))
        groups = (None, "g0", "g1", "g2", "g3", "g4")
        now = 0.0
        for step in range(4000):
            now += rng.choice((0.0, 0.05, 0.1, 0.3, 1.0, -0.2)) + (50.0 if step % 997 == 0 else 0)
            tid, gid = rng.choice(ids), rng.choice(groups)
            x = rng.random()
            if x < 0.4:
                pair.call("begin", tid, gid, now)
            elif x < 0.8:
                pair.call("observe", tid, gid, rng.randrange(0, 400), now)
            elif x < 0.85:
                pair.call("abort", tid, now)
            elif x < 0.93:
                pair.call("finish", tid, now)
            else:
                pair.call("add_sample", gid, rng.randint(1, 40), rng.randrange(2000), now,
                          trajectory_id=rng.choice((None, tid)))
            if step % 7 == 0:
                pair.check(ids=(tid, ids[0]), groups=(None, gid))
        pair.check(ids=ids, groups=groups)


def test_many_turn_counts_queried_between_changes() -> None:
    pair = Pair(ProgressConfig())
    for i in range(300):
        pair.call("add_sample", f"g{i % 2}", 1 + (i * 37) % 150, 10 * i, float(i) / 7)
        if i % 50 == 0:
            pair.call("observe", f"t{i}", "g0", i, float(i) / 7)
    for _ in range(2):
        for k in range(160):
            for gid in (None, "g0", "g1", "zz"):
                pair.call("expected_remaining", gid, k, 3 * k)


def test_non_finite_times_match_the_reference() -> None:
    pair = Pair(ProgressConfig(finish_idle_s=1.0, trajectory_ttl_s=5.0))
    for i, now in enumerate((0.0, 1.0, math.inf, 2.0, -math.inf, math.nan, 3.0, 1e308,
                             -1e308, 4.0)):
        tid, gid = f"t{i % 3}", ("a", None)[i % 2]
        pair.call("begin", tid, gid, now)
        pair.call("observe", tid, gid, 10 * i, now)
        pair.call("add_sample", gid, 1 + i % 4, 5 * i, now)
        if i % 3 == 2:
            pair.call("finish", tid, now)
        pair.check()


def test_error_messages_and_state_unchanged() -> None:
    pair = Pair(ProgressConfig())
    pair.call("begin", "t", "g", 0.0)
    with pytest.raises(ValueError, match=r"^trajectory t: generated_tokens < 0$"):
        pair.native.observe("t", "g", -1, 1.0)
    pair.call("observe", "t", "g", -1, 1.0)  # (the reference's message, too)
    with pytest.raises(ValueError, match=r"^a sample needs turns >= 1 and tokens >= 0, "
                                         r"got 0, 5$"):
        pair.native.add_sample("g", 0, 5, 1.0)
    pair.call("add_sample", "g", 1, -1, 1.0, trajectory_id="x")
    pair.check(ids=("t", "x"), groups=(None, "g"))
    assert pair.native.progress("t") == ("g", 0, 0, 1)


@pytest.mark.parametrize("call", [
    lambda e: e.begin(1, None, 0.0),
    lambda e: e.begin(b"t", None, 0.0),
    lambda e: e.begin("t", 3, 0.0),
    lambda e: e.begin("t", None, "now"),
    lambda e: e.begin("t", None, None),
    lambda e: e.observe("t", None, 1.5, 0.0),
    lambda e: e.observe("t", None, "5", 0.0),
    lambda e: e.observe(None, None, 5, 0.0),
    lambda e: e.abort(7, 0.0),
    lambda e: e.finish(("t",), 0.0),
    lambda e: e.add_sample("g", 1.0, 5, 0.0),
    lambda e: e.add_sample("g", 1, 5, 0.0, trajectory_id=5),
    lambda e: e.add_sample(5, 1, 5, 0.0),
    lambda e: e.progress(5),
    lambda e: e.samples(5),
    lambda e: e.has_samples(5),
    lambda e: e.expected_remaining("g", "1", 0),
    lambda e: e.expected_remaining(5, 1, 0),
    lambda e: e.remaining_for(5, None),
    lambda e: e.expire("later"),
])
def test_bad_argument_types_raise_type_error(call: Any) -> None:
    est = ProgressEstimator(ProgressConfig(finish_idle_s=1.0, trajectory_ttl_s=2.0))
    est.begin("t", "g", 0.0)
    est.observe("t", "g", 10, 0.5)
    est.add_sample("g", 2, 20, 0.5)
    before = (est.progress("t"), est.samples("g"), est.samples(None), est.num_tracked())
    with pytest.raises(TypeError):
        call(est)
    assert (est.progress("t"), est.samples("g"), est.samples(None), est.num_tracked()) == before


def test_huge_ints_raise_overflow_error() -> None:
    est = ProgressEstimator()
    with pytest.raises(OverflowError):
        est.observe("t", None, 2**64, 0.0)
    with pytest.raises(OverflowError):
        est.add_sample("g", 2**63, 1, 0.0)
    est.observe("t", None, 2**63 - 1, 0.0)
    with pytest.raises(OverflowError):
        est.observe("t", None, 1, 0.0)  # the total would pass int64
    assert est.progress("t") == (None, 1, 2**63 - 1, 0)


def test_api_config_types_and_native_hot_methods() -> None:
    cfg = ProgressConfig(half_life_s=10.0)
    est = ProgressEstimator(cfg)
    assert est.config is cfg and ProgressEstimator().config == ProgressConfig()
    assert isinstance(est, _progress.ProgressEstimator)
    for name in ("begin", "observe", "remaining_for", "expected_remaining", "has_samples",
                 "abort", "finish", "add_sample", "progress", "samples", "expire"):
        # inherited as they are: no Python frame in between
        assert getattr(ProgressEstimator, name) is getattr(_progress.ProgressEstimator, name)
    assert est.begin("t", "g", 0.0) is None
    assert est.observe("t", "g", 30, 1.0) is None
    est.add_sample("g", 2, 100, 1.0)
    est.add_sample("g", 3, 90, 1.0)
    assert est.samples("g") == [Sample(2, 100, 1.0), Sample(3, 90, 1.0)]
    assert type(est.progress("t")) is Progress and est.progress("t") == ("g", 1, 30, 0)
    assert est._groups == {"g": est.samples("g")}
    assert isinstance(est.expected_remaining("g", 1, 30), float)
    with pytest.raises(ValueError, match="half_life_s"):
        ProgressEstimator(ProgressConfig(half_life_s=0.0))


def test_reference_time_moves_at_256_half_lives_exactly() -> None:
    for half_life in (1.0, 0.3, 7.0):
        pair = Pair(ProgressConfig(half_life_s=half_life, max_global_samples=8))
        for i, age in enumerate((0.0, 255.5, 256.0, 255.9, 511.0, 511.75, 512.5, 767.0, 1100.0,
                                 1355.99, 1356.0, 1356.01)):
            pair.call("add_sample", ("a", "b")[i % 2], 1 + i % 5, 37 * i + 11, age * half_life)
            pair.check(ids=(), groups=(None, "a", "b"))

"""The load-aware speculation budget: time model, calibration, prefix choice."""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from war.engine.spec_policy import (
    AcceptanceCalibrator,
    CalibratorConfig,
    SpecPolicy,
    SpecPolicyConfig,
    StepTimeConfig,
    StepTimeModel,
)


def _policy(mode: str = "auto", intercept: float = 0.01, per_token: float = 1e-6,
            per_context: float = 0.0, **kw: object) -> SpecPolicy:
    time = StepTimeConfig(prior_intercept_s=intercept, prior_per_token_s=per_token,
                          prior_per_context_token_s=per_context)
    return SpecPolicy(SpecPolicyConfig(mode=mode, time=time, **kw))  # type: ignore[arg-type]


def _chain(n: int, decay: float, first: float = 0.95) -> np.ndarray:
    return first * decay ** np.arange(n)


# ---------------------------------------------------------------------- time model


def test_time_model_starts_at_prior() -> None:
    m = StepTimeModel(StepTimeConfig(prior_intercept_s=0.02, prior_per_token_s=1e-5,
                                     prior_per_context_token_s=1e-8))
    assert m.num_observations == 0
    c = m.coefficients
    assert c.intercept_s == pytest.approx(0.02)
    assert c.per_token_s == pytest.approx(1e-5)
    assert c.per_context_token_s == pytest.approx(1e-8)
    assert m.predict(1000, 10**6) == pytest.approx(0.02 + 1e-2 + 1e-2)


def test_time_model_recovers_known_coefficients() -> None:
    rng = np.random.default_rng(0)
    m = StepTimeModel(StepTimeConfig(forgetting=0.999))
    truth = (0.008, 3e-5, 1.5e-8)
    for _ in range(2000):
        b = int(rng.integers(1, 4096))
        c = int(rng.integers(0, 4_000_000))
        y = truth[0] + truth[1] * b + truth[2] * c + rng.normal(0, 2e-4)
        m.observe(b, c, max(y, 1e-4))
    got = m.coefficients
    assert m.num_observations == 2000
    assert got.intercept_s == pytest.approx(truth[0], rel=0.05)
    assert got.per_token_s == pytest.approx(truth[1], rel=0.05)
    assert got.per_context_token_s == pytest.approx(truth[2], rel=0.05)
    assert m.predict(2048, 10**6) == pytest.approx(
        truth[0] + truth[1] * 2048 + truth[2] * 1e6, rel=0.02)


def test_time_model_forgetting_follows_a_change_in_cost() -> None:
    rng = np.random.default_rng(1)
    m = StepTimeModel(StepTimeConfig(forgetting=0.97))
    for slope in (1e-5, 1e-4):
        for _ in range(400):
            b = int(rng.integers(1, 2048))
            m.observe(b, 100_000, 0.01 + slope * b + rng.normal(0, 1e-4))
    assert m.coefficients.per_token_s == pytest.approx(1e-4, rel=0.05)
    assert m.predict(1024, 100_000) == pytest.approx(0.01 + 0.1024, rel=0.03)
    # Without forgetting the old regime drags the slope down.
    stuck = StepTimeModel(StepTimeConfig(forgetting=1.0))
    for slope in (1e-5, 1e-4):
        for _ in range(400):
            b = int(rng.integers(1, 2048))
            stuck.observe(b, 100_000, 0.01 + slope * b)
    assert stuck.coefficients.per_token_s < 0.8e-4


def test_time_model_degenerate_data_falls_back_to_prior() -> None:
    rng = np.random.default_rng(2)
    cfg = StepTimeConfig(prior_intercept_s=0.01, prior_per_token_s=2e-5,
                         prior_per_context_token_s=2e-8)
    m = StepTimeModel(cfg)
    for _ in range(5000):
        m.observe(512, 300_000, 0.03 + rng.normal(0, 1e-4))
    c = m.coefficients
    assert all(math.isfinite(v) for v in (c.intercept_s, c.per_token_s, c.per_context_token_s))
    assert c.intercept_s > 0 and c.per_token_s >= 0 and c.per_context_token_s >= 0
    assert m.predict(512, 300_000) == pytest.approx(0.03, rel=0.01)
    for b, ctx in [(0, 0), (1, 0), (512, 0), (4096, 300_000), (100_000, 10**8)]:
        p = m.predict(b, ctx)
        assert math.isfinite(p) and p > 0
    # Slope stays of the prior's order (neither exploded nor negative).
    assert 0 < c.per_token_s < 1e-3


def test_time_model_projects_onto_non_negative_costs() -> None:
    m = StepTimeModel(StepTimeConfig(min_intercept_s=1e-4))
    # Steps get faster as the batch grows: the unconstrained slope is negative.
    for b in range(1, 400):
        m.observe(b, 1000, 0.05 - 1e-4 * b)
    c = m.coefficients
    assert c.per_token_s == 0.0 and c.per_context_token_s >= 0.0 and c.intercept_s >= 1e-4
    # Steps that cost almost nothing: the intercept is held at its lower bound.
    z = StepTimeModel(StepTimeConfig(min_intercept_s=1e-4))
    for b in range(1, 400):
        z.observe(b, 10 * b, 1e-9)
    assert z.coefficients.intercept_s == pytest.approx(1e-4)
    assert z.predict(0, 0) >= 1e-4


# ---------------------------------------------------------------------- calibrator


def test_calibrator_is_the_identity_without_data() -> None:
    cal = AcceptanceCalibrator()
    p = np.linspace(0, 1, 101)
    np.testing.assert_allclose(cal.calibrate(p), p, atol=1e-12)


def test_calibrator_learns_overconfidence_and_stays_monotone() -> None:
    rng = np.random.default_rng(3)
    cal = AcceptanceCalibrator(CalibratorConfig(num_bins=10, prior_strength=20, forgetting=0.995))
    for _ in range(100):
        p = np.full(50, 0.8)
        cal.observe(p, rng.random(50) < 0.4)
    assert cal.num_observations == 5000
    assert float(cal.calibrate(np.array([0.8]))[0]) == pytest.approx(0.4, abs=0.03)
    grid = np.linspace(0, 1, 1001)
    out = cal.calibrate(grid)
    assert np.all(np.diff(out) >= -1e-12)
    assert out.min() >= 0.0 and out.max() <= 1.0
    # Far from the data the prior keeps it near the raw prob.
    assert float(cal.calibrate(np.array([0.1]))[0]) == pytest.approx(0.1, abs=0.02)


def test_calibrator_monotone_under_random_observations() -> None:
    rng = np.random.default_rng(4)
    cal = AcceptanceCalibrator(CalibratorConfig(prior_strength=1.0))
    for _ in range(50):
        p = rng.random(30)
        cal.observe(p, rng.random(30) < rng.random())
        out = cal.calibrate(np.linspace(0, 1, 201))
        assert np.all(np.diff(out) >= -1e-12) and out.min() >= 0 and out.max() <= 1


def test_calibrator_plain_python_path_equals_numpy_interpolation() -> None:
    """``calibrate_list`` (the policy's per-step path) gives exactly ``np.interp``'s
    values, knots and the ends included."""
    rng = np.random.default_rng(6)
    cal = AcceptanceCalibrator(CalibratorConfig(prior_strength=2.0))
    for _ in range(30):
        p = rng.random(25) ** 2
        cal.observe(p, rng.random(25) < 0.6 * p)
        xs, _, _ = cal._curve()
        probe = [*rng.random(200).tolist(), 0.0, 1.0, *xs]
        assert cal.calibrate_list(probe) == cal.calibrate(np.array(probe)).tolist()


def test_linear_solve_pivots_and_reports_singular() -> None:
    from war.engine.spec_policy import _solve_linear

    a = [[0.0, 2.0, 1.0], [1.0, 1.0, 0.0], [3.0, 0.0, 1.0]]  # needs a row swap
    x = _solve_linear(a, [5.0, 3.0, 6.0])
    assert x is not None
    np.testing.assert_allclose(np.array(a) @ np.array(x), [5.0, 3.0, 6.0], atol=1e-12)
    assert a == [[0.0, 2.0, 1.0], [1.0, 1.0, 0.0], [3.0, 0.0, 1.0]]  # not modified
    assert _solve_linear([[1.0, 2.0], [2.0, 4.0]], [1.0, 2.0]) is None


def test_calibrator_forgets() -> None:
    rng = np.random.default_rng(5)
    cal = AcceptanceCalibrator(CalibratorConfig(forgetting=0.95))
    for rate in (0.2, 0.9):
        for _ in range(200):
            cal.observe(np.full(40, 0.7), rng.random(40) < rate)
    assert float(cal.calibrate(np.array([0.7]))[0]) == pytest.approx(0.9, abs=0.05)


# ---------------------------------------------------------------------- policy


def test_off_and_always() -> None:
    drafts = [_chain(5, 0.5), np.zeros(0), _chain(40, 0.9)]
    off = _policy("off").choose(drafts, 3, 1000)
    assert off.tolist() == [0, 0, 0]
    always = _policy("always", max_spec_tokens_per_seq=32)
    assert always.choose(drafts, 3, 1000).tolist() == [5, 0, 32]
    capped = _policy("always", max_spec_tokens_per_seq=32, max_spec_tokens_per_step=10)
    k = capped.choose(drafts, 3, 1000)
    assert k.sum() == 10 and k[1] == 0
    assert capped.stats.last_budget_total == 10
    assert _policy("auto").choose([], 0, 0).tolist() == []


def test_auto_low_load_takes_long_drafts() -> None:
    pol = _policy("auto", intercept=0.01, per_token=1e-6, max_spec_tokens_per_seq=16)
    drafts = [_chain(24, 0.9) for _ in range(4)]
    k = pol.choose(drafts, 4, 40_000)
    assert k.tolist() == [16] * 4
    assert pol.stats.last_budget_mean == 16.0 and pol.stats.last_num_seqs == 4
    assert pol.stats.last_predicted_s == pytest.approx(0.01 + 68e-6)


def test_auto_saturation_takes_nothing() -> None:
    drafts = [_chain(8, 0.9, first=0.45) for _ in range(64)]
    # Per-token cost intercept/64: a token pays only when accepted with p > 0.5.
    pol = _policy("auto", intercept=0.01, per_token=0.01 / 64)
    assert pol.choose(drafts, 64, 64 * 2000).sum() == 0
    # Heavier per-token cost: even confident drafts don't pay.
    heavy = _policy("auto", intercept=0.01, per_token=0.01 / 8)
    assert heavy.choose([_chain(8, 0.95, first=0.85) for _ in range(64)], 64, 10**5).sum() == 0


def test_auto_learns_saturation_from_measured_steps() -> None:
    pol = _policy("auto", intercept=0.01, per_token=1e-7)
    drafts = [_chain(8, 0.9, first=0.8) for _ in range(64)]
    assert pol.choose(drafts, 64, 10**5).sum() == 64 * 8
    rng = np.random.default_rng(6)
    for _ in range(300):
        b = int(rng.integers(64, 64 * 9))
        pol.observe_step(b, 10**5 + b, 0.005 + 1e-3 * b)
    assert pol.choose(drafts, 64, 10**5).sum() == 0
    s = pol.stats
    assert s.last_observed_s is not None and s.mean_abs_rel_error is not None
    assert s.last_observed_predicted_s == pytest.approx(s.last_observed_s, rel=0.05)


def test_auto_uses_calibrated_probs() -> None:
    pol = _policy("auto", intercept=0.01, per_token=0.01 / 64,
                  calibration=CalibratorConfig(prior_strength=5.0))
    drafts = [np.full(4, 0.85) for _ in range(64)]
    assert pol.choose(drafts, 64, 10**5).sum() > 0
    rng = np.random.default_rng(7)
    for _ in range(200):
        pol.observe_verification(np.full(64, 0.85), rng.random(64) < 0.2)
    assert pol.stats.last_accepted is not None and pol.stats.last_expected_accepted is not None
    assert pol.choose(drafts, 64, 10**5).sum() == 0


def test_prefill_value_makes_drafting_reluctant() -> None:
    drafts = [_chain(8, 0.9, first=0.7) for _ in range(64)]
    plain = _policy("auto", intercept=0.01, per_token=2e-5)
    valued = _policy("auto", intercept=0.01, per_token=2e-5, prefill_token_value=1.0)
    assert plain.choose(drafts, 64 + 2048, 10**5).sum() > 0
    assert valued.choose(drafts, 64 + 2048, 10**5).sum() == 0


def test_auto_takes_prefixes_of_non_monotone_drafts() -> None:
    # A low token followed by high ones: the running minimum makes them worth the
    # low token's value, and the choice is still a prefix.
    pol = _policy("auto", intercept=0.01, per_token=1e-6)
    k = pol.choose([np.array([0.9, 0.01, 0.9, 0.9])], 1, 100)
    assert k.tolist() in ([1], [4])


def _brute_force(pol: SpecPolicy, drafts: list[np.ndarray], base: int, ctx: int,
                 step_cap: int | None) -> float:
    n = len(drafts)
    qs = [np.minimum.accumulate(pol.calibrator.calibrate(d)) if len(d) else d for d in drafts]
    best = -1.0
    for ks in itertools.product(*[range(len(d) + 1) for d in drafts]):
        k = sum(ks)
        if step_cap is not None and k > step_cap:
            continue
        num = n + sum(float(q[:ki].sum()) for q, ki in zip(qs, ks, strict=True))
        best = max(best, num / pol.time_model.predict(base + k, ctx + k))
    return best


@settings(max_examples=150, deadline=None)
@given(
    drafts=st.lists(st.lists(st.floats(0.0, 1.0), max_size=4), min_size=1, max_size=3),
    intercept=st.floats(1e-3, 0.1),
    per_token=st.floats(0.0, 0.05),
    per_context=st.floats(0.0, 1e-5),
    prefill=st.integers(0, 50),
    ctx=st.integers(0, 10_000),
    step_cap=st.none() | st.integers(0, 12),
    sort=st.booleans(),
)
def test_auto_matches_brute_force(drafts: list[list[float]], intercept: float, per_token: float,
                                  per_context: float, prefill: int, ctx: int,
                                  step_cap: int | None, sort: bool) -> None:
    arrays = [np.sort(np.array(d))[::-1] if sort else np.array(d, dtype=np.float64)
              for d in drafts]
    pol = _policy("auto", intercept=intercept, per_token=per_token, per_context=per_context,
                  min_gain=0.0, max_spec_tokens_per_step=step_cap)
    base = len(arrays) + prefill
    k = pol.choose(arrays, base, ctx)
    assert all(0 <= ki <= len(a) for ki, a in zip(k.tolist(), arrays, strict=True))
    qs = [np.minimum.accumulate(a) if len(a) else a for a in arrays]
    total = int(k.sum())
    got = (len(arrays) + sum(float(q[:ki].sum()) for q, ki in zip(qs, k.tolist(), strict=True))
           ) / pol.time_model.predict(base + total, ctx + total)
    assert got == pytest.approx(_brute_force(pol, arrays, base, ctx, step_cap), rel=1e-9)


# ---------------------------------------------------------------------- bad inputs


@pytest.mark.parametrize("kwargs", [
    {"mode": "sometimes"},
    {"max_spec_tokens_per_seq": -1},
    {"max_spec_tokens_per_step": -2},
    {"min_gain": float("nan")},
    {"prefill_token_value": -1.0},
    {"time": 3},
])
def test_bad_policy_config(kwargs: dict[str, object]) -> None:
    with pytest.raises(ValueError):
        SpecPolicyConfig(**kwargs)  # type: ignore[arg-type]


@pytest.mark.parametrize("kwargs", [
    {"forgetting": 0.0},
    {"forgetting": 1.5},
    {"prior_strength": 0.0},
    {"prior_intercept_s": float("inf")},
    {"prior_per_token_s": -1e-5},
    {"min_intercept_s": 1.0},
])
def test_bad_time_config(kwargs: dict[str, object]) -> None:
    with pytest.raises(ValueError):
        StepTimeConfig(**kwargs)  # type: ignore[arg-type]


def test_bad_calibrator_config() -> None:
    with pytest.raises(ValueError):
        CalibratorConfig(num_bins=0)
    with pytest.raises(ValueError):
        CalibratorConfig(prior_strength=-1.0)


def test_bad_inputs() -> None:
    m = StepTimeModel()
    for args in [(-1, 0, 0.01), (1, -1, 0.01), (1, 1, float("nan")), (1, 1, 0.0),
                 (1.5, 1, 0.01), (True, 1, 0.01)]:
        with pytest.raises(ValueError):
            m.observe(*args)  # type: ignore[arg-type]
    with pytest.raises(ValueError):
        m.predict(-3, 0)
    assert m.num_observations == 0

    cal = AcceptanceCalibrator()
    with pytest.raises(ValueError):
        cal.observe([0.5, 1.2], [True, False])
    with pytest.raises(ValueError):
        cal.observe([0.5, float("nan")], [True, False])
    with pytest.raises(ValueError):
        cal.observe([0.5], [True, False])
    with pytest.raises(ValueError):
        cal.observe([0.5], [2])  # type: ignore[list-item]
    with pytest.raises(ValueError):
        cal.calibrate(np.array([-0.1]))

    pol = _policy("auto")
    good = [np.array([0.5])]
    for drafts, base, ctx in [
        ([np.array([1.5])], 1, 0),
        ([np.array([np.nan])], 1, 0),
        ([np.array([[0.5]])], 1, 0),
        (good, -1, 0),
        (good, 1, -5),
        (good, 0, 0),  # fewer base tokens than decoding sequences
        ([np.array([np.inf])], 1, 0),
        ([np.array([0.5 + 1j])], 1, 0),
        ([[0.2, -0.1]], 1, 0),
        ([["x"]], 1, 0),
        ([0.5], 1, 0),  # a draft must be a sequence
    ]:
        with pytest.raises(ValueError):
            pol.choose(drafts, base, ctx)  # type: ignore[arg-type]
    assert pol.stats.steps == 0  # nothing was recorded
    with pytest.raises(ValueError):
        cal.observe([0.5, float("inf")], [True, False])
    with pytest.raises(ValueError):
        cal.observe(np.array([0.5 + 1j]), [True])
    assert cal.num_observations == 0
    with pytest.raises(ValueError):
        pol.observe_step(10, 10, -1.0)
    with pytest.raises(ValueError):
        pol.observe_verification([0.5], [True, True])


def test_box_qp_meets_the_exhaustive_optimum() -> None:
    from itertools import combinations

    from war.engine.spec_policy import _box_qp, _faces

    def brute(h: np.ndarray, g: np.ndarray, lower: np.ndarray) -> float:
        best = float("inf")
        n = len(g)
        for size in range(n + 1):
            for held in combinations(range(n), size):
                free = [i for i in range(n) if i not in held]
                cand = lower.copy()
                if free:
                    rhs = g[free] - h[np.ix_(free, list(held))] @ lower[list(held)]
                    cand[free] = np.linalg.solve(h[np.ix_(free, free)], rhs)
                if np.all(cand >= lower - 1e-12):
                    best = min(best, float(cand @ h @ cand - 2 * g @ cand))
        return best

    rng = np.random.default_rng(12)
    for _ in range(300):
        n = int(rng.integers(1, 5))
        a = rng.normal(size=(n + 3, n))
        h = a.T @ a + 1e-3 * np.eye(n)
        g = rng.normal(size=n) * 3
        lower = rng.normal(size=n)
        faces = _faces(n)
        hint = faces[int(rng.integers(len(faces)))]  # any hint, right or wrong
        best = brute(h, g, lower)
        for got in (_box_qp(h, g, lower), _box_qp(h, g, lower, hint)):
            assert np.all(got >= lower - 1e-12)
            assert float(got @ h @ got - 2 * g @ got) == pytest.approx(best, rel=1e-9,
                                                                       abs=1e-9)

"""Load-aware speculation budget: how many draft tokens each sequence verifies per step.

Knows: a linear model of a step's duration fitted online from measured steps
(``StepTimeModel``), an online calibration of the speculator's acceptance
probabilities from verification outcomes (``AcceptanceCalibrator``), and the choice
of draft prefixes that maximizes expected generated tokens per second
(``SpecPolicy``). Does not know: models, KV blocks, drafts' token ids or tree
shape beyond "index order lists parents before children", the clock (every time
is a parameter, so a simulator can replay a run), nor how the engine schedules
prefill.

The objective of ``SpecPolicy.choose`` in ``"auto"`` mode, with ``n`` decoding
sequences, ``B`` the step's tokens without drafts, ``C`` its context and ``K`` the
draft tokens chosen::

    f(K) = (n + prefill_token_value * (B - n) + sum of chosen calibrated probs)
           / predict(B + K, C + K)

Each draft token also extends its sequence's KV by one, hence ``C + K``; the
engine must report a step's ``context_tokens`` the same way (the KV length that
attention reads, this step's tokens included). Per sequence the calibrated probs
are made non-increasing along index order (a running minimum), so taking tokens
in descending order of probability always takes prefixes of every draft; the
best ``K`` over that merged order is the exact optimum over all prefix
combinations, because for a fixed ``K`` the cost is fixed and the top ``K``
values maximize the numerator. Under saturation (cost per token large next to
the step's fixed cost) no draft token pays for itself and the budget is zero.

Not thread-safe: one engine loop owns a policy.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from itertools import combinations

import numpy as np
import numpy.typing as npt

MODES = ("auto", "always", "off")

FloatArray = npt.NDArray[np.float64]
IntArray = npt.NDArray[np.int64]


# --------------------------------------------------------------------------- configs


@dataclass(frozen=True)
class StepTimeConfig:
    """Settings of ``StepTimeModel``; validated on construction.

    The model is ``seconds = intercept + per_token * batch_tokens + per_context_token
    * context_tokens``.

    * ``prior_intercept_s``, ``prior_per_token_s``, ``prior_per_context_token_s``:
      the coefficients before any data, and where an unidentified direction of
      the fit falls back to (e.g. the per-token cost while every step had the
      same batch size).
    * ``prior_strength``: weight of the prior, in pseudo-observations at unit
      (scaled) features; in Bayesian terms ``noise_variance / prior_variance`` of a
      scaled coefficient, so the default ``0.01`` says "the prior is uncertain by
      about ten times a step's timing noise". Keep it small next to the
      information in the window (about ``window * variance of the scaled
      features``), else the prior biases slopes learned from narrow load ranges;
      any positive value keeps an unidentified direction at the prior.
    * ``forgetting``: each observation multiplies the weight of all earlier ones
      by this (``1``: no forgetting); the effective window is about
      ``1 / (1 - forgetting)`` steps.
    * ``min_intercept_s``: the intercept's lower bound (keeps predictions positive).
    * ``token_scale``, ``context_scale``: features are divided by these before
      fitting, so that the normal equations are well conditioned and the prior's
      strength means the same for each coefficient.
    """

    prior_intercept_s: float = 0.01
    prior_per_token_s: float = 2e-5
    prior_per_context_token_s: float = 2e-8
    prior_strength: float = 0.01
    forgetting: float = 0.99
    min_intercept_s: float = 1e-5
    token_scale: float = 1024.0
    context_scale: float = 1048576.0

    def __post_init__(self) -> None:
        _check_float("prior_intercept_s", self.prior_intercept_s, 0.0, strict=True)
        _check_float("prior_per_token_s", self.prior_per_token_s, 0.0)
        _check_float("prior_per_context_token_s", self.prior_per_context_token_s, 0.0)
        _check_float("prior_strength", self.prior_strength, 0.0, strict=True)
        _check_float("forgetting", self.forgetting, 0.0, 1.0, strict=True)
        _check_float("min_intercept_s", self.min_intercept_s, 0.0, strict=True)
        _check_float("token_scale", self.token_scale, 0.0, strict=True)
        _check_float("context_scale", self.context_scale, 0.0, strict=True)
        if self.min_intercept_s > self.prior_intercept_s:
            raise ValueError(
                f"min_intercept_s ({self.min_intercept_s}) must be <= prior_intercept_s "
                f"({self.prior_intercept_s})"
            )


@dataclass(frozen=True)
class CalibratorConfig:
    """Settings of ``AcceptanceCalibrator``; validated on construction.

    * ``num_bins``: equal-width bins over ``[0, 1]`` of the predicted probability.
    * ``prior_strength``: pseudo-observations per bin accepted at exactly the
      predicted rate (a Beta prior centred on the identity); more trusts the
      speculator longer.
    * ``forgetting``: each ``observe`` call (one step's verification) multiplies
      the weight of all earlier observations by this (``1``: no forgetting).
    """

    num_bins: int = 10
    prior_strength: float = 20.0
    forgetting: float = 0.995

    def __post_init__(self) -> None:
        _check_int("num_bins", self.num_bins, 1)
        _check_float("prior_strength", self.prior_strength, 0.0, strict=True)
        _check_float("forgetting", self.forgetting, 0.0, 1.0, strict=True)


@dataclass(frozen=True)
class SpecPolicyConfig:
    """Settings of ``SpecPolicy``; validated on construction.

    * ``mode``: ``"auto"`` (maximize expected tokens per second), ``"always"``
      (verify whole drafts, within the caps) or ``"off"`` (verify nothing).
    * ``max_spec_tokens_per_seq``: most draft tokens one sequence verifies per step.
    * ``max_spec_tokens_per_step``: most draft tokens over the whole batch per step
      (``None``: no cap).
    * ``min_gain``: relative improvement of the objective over verifying nothing
      that a non-empty budget must reach (ties and noise-level gains give zero).
    * ``prefill_token_value``: how many generated tokens one prefill token in the
      batch is worth in the objective's numerator. ``0`` counts only generated
      tokens (prefill is pure cost); ``1`` counts prefill as useful work, which
      makes drafting more reluctant while large prefill chunks share the step.
    * ``time``, ``calibration``: the time model's and the calibrator's settings.
    """

    mode: str = "auto"
    max_spec_tokens_per_seq: int = 32
    max_spec_tokens_per_step: int | None = None
    min_gain: float = 1e-3
    prefill_token_value: float = 0.0
    time: StepTimeConfig = field(default_factory=StepTimeConfig)
    calibration: CalibratorConfig = field(default_factory=CalibratorConfig)

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"unknown mode {self.mode!r} (expected one of {MODES})")
        _check_int("max_spec_tokens_per_seq", self.max_spec_tokens_per_seq, 0)
        if self.max_spec_tokens_per_step is not None:
            _check_int("max_spec_tokens_per_step", self.max_spec_tokens_per_step, 0)
        _check_float("min_gain", self.min_gain, 0.0)
        _check_float("prefill_token_value", self.prefill_token_value, 0.0)
        if not isinstance(self.time, StepTimeConfig):
            raise ValueError(f"time must be a StepTimeConfig, got {self.time!r}")
        if not isinstance(self.calibration, CalibratorConfig):
            raise ValueError(
                f"calibration must be a CalibratorConfig, got {self.calibration!r}"
            )


# --------------------------------------------------------------------------- step time


@dataclass(frozen=True)
class StepTimeCoefficients:
    """The time model's coefficients in seconds, seconds per token and seconds per
    context token."""

    intercept_s: float
    per_token_s: float
    per_context_token_s: float


class StepTimeModel:
    """Online, recency-weighted, prior-regularized least squares for a step's duration.

    Features: an intercept, ``batch_tokens`` (every token of the forward pass:
    prefill chunks, one per decoding sequence, draft tokens) and
    ``context_tokens`` (the KV length attention reads, summed over sequences).
    The number of sequences is not a feature: in decoding steps it is nearly
    collinear with ``batch_tokens`` and ``context_tokens``, so a fourth
    coefficient would be weakly identified and make the fit noisier; its
    per-sequence overheads are absorbed by the others.

    The fit minimizes ``sum_t forgetting**(age_t) * (y_t - x_t . theta)**2 +
    prior_strength * |theta - theta_prior|**2`` over scaled features, subject to
    ``intercept >= min_intercept_s`` and non-negative per-token and per-context
    costs (an exact active-set solve over the 3x3 system). The prior is not
    forgotten, so a direction the data does not identify (say, every step had
    the same batch size) stays at the prior instead of exploding. Because the
    window is recent, the linear fit tracks the local slope of the true
    (piecewise: memory-bound, then compute-bound) cost curve around the current
    load. ``observe`` and ``predict`` are O(1); the solve is redone lazily on the
    first ``predict`` after new data.
    """

    def __init__(self, config: StepTimeConfig | None = None) -> None:
        self.config = config if config is not None else StepTimeConfig()
        c = self.config
        self._scale: FloatArray = np.array([1.0, c.token_scale, c.context_scale])
        self._prior: FloatArray = np.array([
            c.prior_intercept_s,
            c.prior_per_token_s * c.token_scale,
            c.prior_per_context_token_s * c.context_scale,
        ])
        self._lower: FloatArray = np.array([c.min_intercept_s, 0.0, 0.0])
        self._gram: FloatArray = np.zeros((3, 3))
        self._moment: FloatArray = np.zeros(3)
        self._weight = 0.0
        self._count = 0
        self._theta: FloatArray | None = self._prior.copy()
        self._face: tuple[IntArray, IntArray] | None = None  # the last fit's active set

    @property
    def num_observations(self) -> int:
        """Steps observed so far (ignoring forgetting)."""
        return self._count

    @property
    def effective_observations(self) -> float:
        """Total weight of the observations after forgetting."""
        return self._weight

    @property
    def coefficients(self) -> StepTimeCoefficients:
        """The current fit, in unscaled units."""
        theta = self._solve() / self._scale
        return StepTimeCoefficients(float(theta[0]), float(theta[1]), float(theta[2]))

    def observe(self, batch_tokens: int, context_tokens: int, seconds: float) -> None:
        """Add one measured step."""
        x = self._features(batch_tokens, context_tokens)
        _check_float("seconds", seconds, 0.0, strict=True)
        lam = self.config.forgetting
        self._gram *= lam
        self._gram += np.outer(x, x)
        self._moment *= lam
        self._moment += float(seconds) * x
        self._weight = self._weight * lam + 1.0
        self._count += 1
        self._theta = None

    def predict(self, batch_tokens: int, context_tokens: int) -> float:
        """Predicted duration in seconds of a step with these features (positive)."""
        return float(self._features(batch_tokens, context_tokens) @ self._solve())

    def predict_many(self, batch_tokens: IntArray, context_tokens: IntArray) -> FloatArray:
        """``predict`` over arrays of non-negative features (not validated)."""
        theta = self._solve() / self._scale
        return np.asarray(
            theta[0] + theta[1] * batch_tokens + theta[2] * context_tokens, dtype=np.float64
        )

    def _features(self, batch_tokens: int, context_tokens: int) -> FloatArray:
        _check_count("batch_tokens", batch_tokens)
        _check_count("context_tokens", context_tokens)
        return np.array([1.0, float(batch_tokens), float(context_tokens)]) / self._scale

    def _solve(self) -> FloatArray:
        if self._theta is None:
            s = self.config.prior_strength
            h = self._gram + s * np.eye(3)
            g = self._moment + s * self._prior
            self._theta = _box_qp(h, g, self._lower, self._face)
            self._face = _held_face(self._theta, self._lower)
        return self._theta


def _box_qp(h: FloatArray, g: FloatArray, lower: FloatArray,
            hint: tuple[IntArray, IntArray] | None = None) -> FloatArray:
    """Minimize ``theta' h theta - 2 g' theta`` subject to ``theta >= lower``, with ``h``
    positive definite. The problem is convex, so the point that meets the KKT
    conditions is the optimum: on some face (the variables of an active set held at
    their bounds) the free variables solve their equations and stay above their
    bounds, and the held ones' gradient ``2 (h theta - g)`` is non-negative. The
    face ``hint`` (the last fit's, which rarely changes between steps) is tried
    first, then the unconstrained solution, then faces from the fewest held
    variables up."""
    if hint is not None:
        got = _on_face(h, g, lower, *hint)
        if got is not None:
            return got
    theta = np.linalg.solve(h, g)
    if np.all(theta >= lower):
        return np.asarray(theta, dtype=np.float64)
    for free, held in _faces(len(g)):
        got = _on_face(h, g, lower, free, held)
        if got is not None:
            return got
    return lower.copy()  # not reached for a positive definite ``h``


def _on_face(h: FloatArray, g: FloatArray, lower: FloatArray, free: IntArray,
             held: IntArray) -> FloatArray | None:
    """The minimizer on the face holding ``held`` at their bounds, if it is the
    optimum (module of ``_box_qp``); else None."""
    cand = lower.copy()
    if free.size:
        rhs = g[free] - h[free][:, held] @ lower[held]
        cand[free] = np.linalg.solve(h[free][:, free], rhs)
        if np.any(cand[free] < lower[free]):
            return None
    if held.size:
        grad = h[held] @ cand - g[held]
        if np.any(grad < -1e-12 * (1.0 + np.abs(g[held]))):
            return None
    return cand


def _held_face(theta: FloatArray, lower: FloatArray) -> tuple[IntArray, IntArray]:
    at = theta <= lower
    return np.flatnonzero(~at), np.flatnonzero(at)


@functools.cache
def _faces(n: int) -> tuple[tuple[IntArray, IntArray], ...]:
    """(free, held) index arrays of every non-empty active set, fewest held first."""
    out = []
    for size in range(1, n + 1):
        for held in combinations(range(n), size):
            free = [i for i in range(n) if i not in held]
            out.append((np.array(free, dtype=np.int64), np.array(held, dtype=np.int64)))
    return tuple(out)


# --------------------------------------------------------------------------- calibration


class AcceptanceCalibrator:
    """Online calibration of predicted acceptance probabilities.

    Observations are binned by predicted probability; each bin keeps the
    forgotten sums of outcomes, of predicted probabilities and of counts. A bin's
    calibrated value at its (prior-smoothed) mean predicted probability ``x`` is
    ``x + (accepted - predicted_sum) / (count + prior_strength)``: the posterior
    mean under a Beta prior of ``prior_strength`` pseudo-observations accepted at
    exactly the predicted rate, so without data the map is the identity. The bin
    values are made non-decreasing by weighted pool-adjacent-violators, joined by
    linear interpolation and extended with slope one to ``0`` and ``1``, then
    clipped to ``[0, 1]``: the map is monotone non-decreasing and within
    ``[0, 1]``.
    """

    def __init__(self, config: CalibratorConfig | None = None) -> None:
        self.config = config if config is not None else CalibratorConfig()
        nb = self.config.num_bins
        self._centers = (np.arange(nb) + 0.5) / nb
        self._count = np.zeros(nb)
        self._accepted = np.zeros(nb)
        self._predicted = np.zeros(nb)
        self._num_observed = 0
        self._knots: tuple[FloatArray, FloatArray] | None = None

    @property
    def num_observations(self) -> int:
        """Draft tokens observed so far (ignoring forgetting)."""
        return self._num_observed

    def observe(self, predicted_probs: Sequence[float] | FloatArray,
                accepted: Sequence[bool] | npt.NDArray[np.bool_]) -> None:
        """Add one step's verification: each proposed draft token's predicted path
        probability and whether it was accepted."""
        p = _as_probs("predicted_probs", predicted_probs)
        a = np.asarray(accepted)
        if a.ndim != 1 or len(a) != len(p):
            raise ValueError(
                f"accepted must be 1-D with one entry per predicted prob ({len(p)}), "
                f"got shape {a.shape}"
            )
        if a.dtype != np.bool_:
            if a.size and (a.dtype.kind not in "iuf" or not np.all((a == 0) | (a == 1))):
                raise ValueError("accepted must hold booleans (or 0/1)")
            a = a.astype(bool) if a.size else np.zeros(0, dtype=bool)
        lam = self.config.forgetting
        nb = self.config.num_bins
        self._count *= lam
        self._accepted *= lam
        self._predicted *= lam
        if len(p):
            idx = np.minimum((p * nb).astype(np.int64), nb - 1)
            self._count += np.bincount(idx, minlength=nb)
            self._accepted += np.bincount(idx, weights=a.astype(np.float64), minlength=nb)
            self._predicted += np.bincount(idx, weights=p, minlength=nb)
            self._num_observed += len(p)
        self._knots = None

    def calibrate(self, probs: FloatArray | Sequence[float]) -> FloatArray:
        """Calibrated acceptance probabilities (same shape as ``probs``)."""
        p = np.asarray(probs, dtype=np.float64)
        _check_prob_array("probs", p)
        xs, ys = self._curve()
        return np.asarray(np.interp(p, xs, ys), dtype=np.float64)

    def _curve(self) -> tuple[FloatArray, FloatArray]:
        if self._knots is None:
            m = self.config.prior_strength
            weight = self._count + m
            x = (self._predicted + m * self._centers) / weight
            y = np.clip(x + (self._accepted - self._predicted) / weight, 0.0, 1.0)
            y = _pava(y, weight)
            xs = np.concatenate(([0.0], x, [1.0]))
            ys = np.concatenate(([max(0.0, y[0] - x[0])], y, [min(1.0, y[-1] + 1.0 - x[-1])]))
            self._knots = (xs, ys)
        return self._knots


def _pava(y: FloatArray, w: FloatArray) -> FloatArray:
    """Weighted pool-adjacent-violators: the non-decreasing fit closest to ``y``."""
    values: list[float] = []
    weights: list[float] = []
    sizes: list[int] = []
    for yi, wi in zip(y.tolist(), w.tolist(), strict=True):
        v, wt, sz = yi, wi, 1
        while values and values[-1] > v:
            pv, pw, ps = values.pop(), weights.pop(), sizes.pop()
            v = (pv * pw + v * wt) / (pw + wt)
            wt += pw
            sz += ps
        values.append(v)
        weights.append(wt)
        sizes.append(sz)
    return np.repeat(np.array(values), sizes)


# --------------------------------------------------------------------------- policy


@dataclass(frozen=True)
class SpecPolicyStats:
    """What the policy last did and how well it predicted.

    * ``steps``: ``choose`` calls; ``last_budget_total``, ``last_budget_mean``:
      draft tokens chosen in the last one, in total and per sequence;
      ``last_num_seqs``: its sequences.
    * ``last_predicted_s``, ``last_expected_tokens``: the predicted duration of the
      last chosen step and its expected generated tokens.
    * ``last_observed_s``, ``last_observed_predicted_s``: the last measured step and
      what the time model predicted for it just before learning from it;
      ``mean_abs_rel_error``: running mean (recency-weighted like the time model)
      of ``|predicted - observed| / observed``.
    * ``last_expected_accepted``, ``last_accepted``: the calibrated expected and the
      actual number of accepted draft tokens of the last verification observed
      (expectation from the calibration before that observation).
    """

    steps: int = 0
    last_budget_total: int = 0
    last_budget_mean: float = 0.0
    last_num_seqs: int = 0
    last_predicted_s: float | None = None
    last_expected_tokens: float | None = None
    last_observed_s: float | None = None
    last_observed_predicted_s: float | None = None
    mean_abs_rel_error: float | None = None
    last_expected_accepted: float | None = None
    last_accepted: int | None = None


class SpecPolicy:
    """Chooses each sequence's draft budget per step (see the module docstring)."""

    def __init__(self, config: SpecPolicyConfig | None = None) -> None:
        self.config = config if config is not None else SpecPolicyConfig()
        self.time_model = StepTimeModel(self.config.time)
        self.calibrator = AcceptanceCalibrator(self.config.calibration)
        self._stats = SpecPolicyStats()
        self._err_num = 0.0
        self._err_den = 0.0

    @property
    def stats(self) -> SpecPolicyStats:
        return self._stats

    def choose(self, draft_probs: Sequence[FloatArray | Sequence[float]],
               base_batch_tokens: int, context_tokens: int) -> IntArray:
        """Number of draft tokens (a prefix in index order) each sequence verifies.

        ``draft_probs[i]``: sequence ``i``'s draft path probabilities in index order
        (may be empty); ``base_batch_tokens``: the step's tokens without drafts
        (prefill chunks plus one per decoding sequence); ``context_tokens``: the
        step's total context without drafts.
        """
        _check_count("base_batch_tokens", base_batch_tokens)
        _check_count("context_tokens", context_tokens)
        n = len(draft_probs)
        if base_batch_tokens < n:
            raise ValueError(
                f"base_batch_tokens ({base_batch_tokens}) must count one token per "
                f"decoding sequence ({n})"
            )
        cap = self.config.max_spec_tokens_per_seq
        drafts = _as_drafts(draft_probs, cap)
        lengths = np.array([len(d) for d in drafts], dtype=np.int64)
        counts = np.zeros(n, dtype=np.int64)
        mode = self.config.mode
        total = int(lengths.sum())
        step_cap = self.config.max_spec_tokens_per_step
        max_k = total if step_cap is None else min(total, step_cap)
        if mode == "off" or max_k == 0:
            return self._record(counts, np.zeros(0), n, base_batch_tokens, context_tokens)
        raw = np.concatenate(drafts)
        seg = np.repeat(np.arange(n, dtype=np.int64), lengths)
        starts = np.concatenate(([0], np.cumsum(lengths)[:-1]))
        q = _segment_running_min(self.calibrator.calibrate(raw), starts, lengths)
        if mode == "always" and max_k == total:
            return self._record(lengths, q, n, base_batch_tokens, context_tokens)
        order = np.argsort(-q, kind="stable")[:max_k]
        if mode == "always":
            k = max_k
        else:
            value = (n + self.config.prefill_token_value * (base_batch_tokens - n)
                     + np.concatenate(([0.0], np.cumsum(q[order]))))
            ks = np.arange(max_k + 1, dtype=np.int64)
            cost = self.time_model.predict_many(base_batch_tokens + ks, context_tokens + ks)
            rate = value / cost
            k = int(np.argmax(rate))
            if not rate[k] > rate[0] * (1.0 + self.config.min_gain):
                k = 0
        counts = np.bincount(seg[order[:k]], minlength=n).astype(np.int64)
        return self._record(counts, q[order[:k]], n, base_batch_tokens, context_tokens)

    def observe_step(self, batch_tokens: int, context_tokens: int, seconds: float) -> None:
        """Learn from a measured step (see ``StepTimeModel.observe``)."""
        _check_float("seconds", seconds, 0.0, strict=True)
        predicted = self.time_model.predict(batch_tokens, context_tokens)
        self.time_model.observe(batch_tokens, context_tokens, seconds)
        lam = self.config.time.forgetting
        self._err_num = lam * self._err_num + abs(predicted - seconds) / seconds
        self._err_den = lam * self._err_den + 1.0
        self._stats = replace(
            self._stats, last_observed_s=float(seconds), last_observed_predicted_s=predicted,
            mean_abs_rel_error=self._err_num / self._err_den,
        )

    def observe_verification(self, predicted_probs: Sequence[float] | FloatArray,
                             accepted: Sequence[bool] | npt.NDArray[np.bool_]) -> None:
        """Learn from one step's verification (see ``AcceptanceCalibrator.observe``)."""
        p = _as_probs("predicted_probs", predicted_probs)
        expected = float(self.calibrator.calibrate(p).sum())
        self.calibrator.observe(p, accepted)
        self._stats = replace(
            self._stats, last_expected_accepted=expected,
            last_accepted=int(np.count_nonzero(np.asarray(accepted))),
        )

    def _record(self, counts: IntArray, chosen: FloatArray, n: int, base: int,
                context: int) -> IntArray:
        k = int(counts.sum())
        s = self._stats
        self._stats = replace(
            s, steps=s.steps + 1, last_budget_total=k,
            last_budget_mean=k / n if n else 0.0, last_num_seqs=n,
            last_predicted_s=self.time_model.predict(base + k, context + k),
            last_expected_tokens=(n + self.config.prefill_token_value * (base - n)
                                  + float(chosen.sum())),
        )
        return counts


def _segment_running_min(q: FloatArray, starts: IntArray, lengths: IntArray) -> FloatArray:
    """Running minimum of ``q`` within each segment (exact; loops only over segments
    that are not already non-increasing)."""
    if len(q) < 2:
        return q
    rising = np.flatnonzero(np.diff(q) > 0) + 1
    if len(rising) == 0:
        return q
    seg_of = np.searchsorted(starts, rising, side="right") - 1
    rising_within = seg_of[rising != starts[seg_of]]
    out = q.copy()
    for s in np.unique(rising_within).tolist():
        a = int(starts[s])
        b = a + int(lengths[s])
        out[a:b] = np.minimum.accumulate(q[a:b])
    return out


# --------------------------------------------------------------------------- checks


def _check_int(name: str, value: object, low: int) -> None:
    if not isinstance(value, int) or isinstance(value, bool):
        raise ValueError(f"{name} must be an int, got {value!r}")
    if value < low:
        raise ValueError(f"{name} must be >= {low}, got {value}")


def _check_count(name: str, value: object) -> None:
    if not isinstance(value, (int, np.integer)) or isinstance(value, (bool, np.bool_)):
        raise ValueError(f"{name} must be an int, got {value!r}")
    if value < 0:
        raise ValueError(f"{name} must be >= 0, got {value}")


def _check_float(name: str, value: object, low: float | None, high: float | None = None,
                 *, strict: bool = False) -> None:
    if not isinstance(value, (int, float, np.floating, np.integer)) \
            or isinstance(value, (bool, np.bool_)):
        raise ValueError(f"{name} must be a number, got {value!r}")
    v = float(value)
    if not math.isfinite(v):
        raise ValueError(f"{name} must be finite, got {value!r}")
    if low is not None and (v <= low if strict else v < low):
        raise ValueError(f"{name} must be {'>' if strict else '>='} {low}, got {value!r}")
    if high is not None and v > high:
        raise ValueError(f"{name} must be <= {high}, got {value!r}")


def _check_prob_array(name: str, p: FloatArray) -> None:
    if p.size and not (np.all(np.isfinite(p)) and p.min() >= 0.0 and p.max() <= 1.0):
        raise ValueError(f"{name} must hold finite probabilities in [0, 1]")


def _as_drafts(draft_probs: Sequence[FloatArray | Sequence[float]], cap: int) -> list[FloatArray]:
    """Each draft as a 1-D float array cut to ``cap`` tokens, validated in one pass."""
    drafts: list[FloatArray] = []
    for d in draft_probs:
        p = d if isinstance(d, np.ndarray) and d.dtype == np.float64 else None
        if p is None:
            try:
                p = np.asarray(d, dtype=np.float64)
            except (TypeError, ValueError) as e:
                raise ValueError(f"draft_probs[{len(drafts)}] must be 1-D probabilities: {e}") \
                    from None
        if p.ndim != 1:
            raise ValueError(f"draft_probs[{len(drafts)}] must be 1-D, got shape {p.shape}")
        drafts.append(p[:cap])
    if drafts:
        try:
            _check_prob_array("draft_probs", np.concatenate(drafts))
        except ValueError:
            for i, p in enumerate(drafts):
                _check_prob_array(f"draft_probs[{i}]", p)
            raise
    return drafts


def _as_probs(name: str, values: Sequence[float] | FloatArray) -> FloatArray:
    try:
        p = np.asarray(values, dtype=np.float64)
    except (TypeError, ValueError) as e:
        raise ValueError(f"{name} must be a 1-D sequence of probabilities: {e}") from None
    if p.ndim != 1:
        raise ValueError(f"{name} must be 1-D, got shape {p.shape}")
    _check_prob_array(name, p)
    return p

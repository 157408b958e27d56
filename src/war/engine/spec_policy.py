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

import bisect
import functools
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from itertools import combinations
from typing import NamedTuple

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
    first ``predict`` after new data. The arithmetic is plain Python on a 3x3
    system: called once per engine step, right after a forward pass has evicted
    the caches, each small numpy call would cost tens of microseconds.
    """

    def __init__(self, config: StepTimeConfig | None = None) -> None:
        self.config = config if config is not None else StepTimeConfig()
        c = self.config
        self._scale = (1.0, float(c.token_scale), float(c.context_scale))
        self._prior = [float(c.prior_intercept_s), c.prior_per_token_s * c.token_scale,
                       c.prior_per_context_token_s * c.context_scale]
        self._lower = [float(c.min_intercept_s), 0.0, 0.0]
        self._gram = [[0.0] * 3 for _ in range(3)]
        self._moment = [0.0] * 3
        self._weight = 0.0
        self._count = 0
        self._theta: list[float] | None = list(self._prior)
        self._unscaled: tuple[float, float, float] | None = None
        self._face: Face | None = None  # the last fit's active set

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
        return StepTimeCoefficients(*self.unscaled_coefficients())

    def observe(self, batch_tokens: int, context_tokens: int, seconds: float) -> None:
        """Add one measured step."""
        x = self._features(batch_tokens, context_tokens)
        _check_float("seconds", seconds, 0.0, strict=True)
        self._add(x, float(seconds))

    def predict_then_observe(self, batch_tokens: int, context_tokens: int,
                             seconds: float) -> float:
        """``predict`` for a measured step, then ``observe`` it; returns the prediction
        (what the model expected before learning from the step)."""
        x = self._features(batch_tokens, context_tokens)
        _check_float("seconds", seconds, 0.0, strict=True)
        t = self._solve()
        predicted = x[0] * t[0] + x[1] * t[1] + x[2] * t[2]
        self._add(x, float(seconds))
        return predicted

    def _add(self, x: list[float], seconds: float) -> None:
        lam = self.config.forgetting
        for i, row in enumerate(self._gram):
            xi = x[i]
            row[0] = row[0] * lam + xi * x[0]
            row[1] = row[1] * lam + xi * x[1]
            row[2] = row[2] * lam + xi * x[2]
            self._moment[i] = self._moment[i] * lam + seconds * xi
        self._weight = self._weight * lam + 1.0
        self._count += 1
        self._theta = None
        self._unscaled = None

    def predict(self, batch_tokens: int, context_tokens: int) -> float:
        """Predicted duration in seconds of a step with these features (positive)."""
        x = self._features(batch_tokens, context_tokens)
        t = self._solve()
        return x[0] * t[0] + x[1] * t[1] + x[2] * t[2]

    def unscaled_coefficients(self) -> tuple[float, float, float]:
        """The current fit (intercept, per token, per context token) in seconds."""
        if self._unscaled is None:
            t = self._solve()
            s = self._scale
            self._unscaled = (t[0] / s[0], t[1] / s[1], t[2] / s[2])
        return self._unscaled

    def _features(self, batch_tokens: int, context_tokens: int) -> list[float]:
        _check_count("batch_tokens", batch_tokens)
        _check_count("context_tokens", context_tokens)
        s = self._scale
        return [1.0 / s[0], float(batch_tokens) / s[1], float(context_tokens) / s[2]]

    def _solve(self) -> list[float]:
        if self._theta is None:
            st = self.config.prior_strength
            h = [[v + (st if i == j else 0.0) for j, v in enumerate(row)]
                 for i, row in enumerate(self._gram)]
            g = [m + st * p for m, p in zip(self._moment, self._prior, strict=True)]
            self._theta = _box_qp(h, g, self._lower, self._face)
            self._face = _held_face(self._theta, self._lower)
        return self._theta


Face = tuple[tuple[int, ...], tuple[int, ...]]
"""(free, held) variable indices of an active set."""


def _box_qp(h: Sequence[Sequence[float]], g: Sequence[float], lower: Sequence[float],
            hint: Face | None = None) -> list[float]:
    """Minimize ``theta' h theta - 2 g' theta`` subject to ``theta >= lower``, with ``h``
    positive definite. The problem is convex, so the point that meets the KKT
    conditions is the optimum: on some face (the variables of an active set held at
    their bounds) the free variables solve their equations and stay above their
    bounds, and the held ones' gradient ``2 (h theta - g)`` is non-negative. The
    face ``hint`` (the last fit's, which rarely changes between steps) is tried
    first, then the unconstrained solution, then faces from the fewest held
    variables up."""
    n = len(g)
    if hint is not None:
        got = _on_face(h, g, lower, *hint)
        if got is not None:
            return got
    for free, held in ((tuple(range(n)), ()), *_faces(n)):
        got = _on_face(h, g, lower, free, held)
        if got is not None:
            return got
    return [float(v) for v in lower]  # not reached for a positive definite ``h``


def _on_face(h: Sequence[Sequence[float]], g: Sequence[float], lower: Sequence[float],
             free: tuple[int, ...], held: tuple[int, ...]) -> list[float] | None:
    """The minimizer on the face holding ``held`` at their bounds, if it is the
    optimum (module of ``_box_qp``); else None."""
    cand = [float(v) for v in lower]
    if free:
        rhs = [g[i] - sum(h[i][j] * lower[j] for j in held) for i in free]
        sol = _solve_linear([[h[i][j] for j in free] for i in free], rhs)
        if sol is None:
            return None
        for i, v in zip(free, sol, strict=True):
            if v < lower[i]:
                return None
            cand[i] = v
    for i in held:
        grad = sum(h[i][j] * cand[j] for j in range(len(cand))) - g[i]
        if grad < -1e-12 * (1.0 + abs(g[i])):
            return None
    return cand


def _solve_linear(a: list[list[float]], b: list[float]) -> list[float] | None:
    """``a x = b`` by Gaussian elimination with partial pivoting (``a`` is not
    modified); None if ``a`` is singular."""
    n = len(b)
    m = [[*row, b[i]] for i, row in enumerate(a)]
    for c in range(n):
        p = max(range(c, n), key=lambda r: abs(m[r][c]))
        if m[p][c] == 0.0:
            return None
        m[c], m[p] = m[p], m[c]
        pivot = m[c]
        for r in range(c + 1, n):
            row = m[r]
            f = row[c] / pivot[c]
            if f:
                for j in range(c, n + 1):
                    row[j] -= f * pivot[j]
    x = [0.0] * n
    for c in range(n - 1, -1, -1):
        row = m[c]
        x[c] = (row[n] - sum(row[j] * x[j] for j in range(c + 1, n))) / row[c]
    return x


def _held_face(theta: Sequence[float], lower: Sequence[float]) -> Face:
    free = tuple(i for i, (t, low) in enumerate(zip(theta, lower, strict=True)) if t > low)
    held = tuple(i for i, (t, low) in enumerate(zip(theta, lower, strict=True)) if t <= low)
    return free, held


@functools.cache
def _faces(n: int) -> tuple[Face, ...]:
    """(free, held) indices of every non-empty active set, fewest held first."""
    out = []
    for size in range(1, n + 1):
        for held in combinations(range(n), size):
            out.append((tuple(i for i in range(n) if i not in held), held))
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
        self._centers = [(i + 0.5) / nb for i in range(nb)]
        self._count = [0.0] * nb
        self._accepted = [0.0] * nb
        self._predicted = [0.0] * nb
        self._num_observed = 0
        # the map's knots (xs, ys) and the slopes between them
        self._knots: tuple[list[float], list[float], list[float]] | None = None

    @property
    def num_observations(self) -> int:
        """Draft tokens observed so far (ignoring forgetting)."""
        return self._num_observed

    def observe(self, predicted_probs: Sequence[float] | FloatArray,
                accepted: Sequence[bool] | npt.NDArray[np.bool_]) -> None:
        """Add one step's verification: each proposed draft token's predicted path
        probability and whether it was accepted."""
        p = _prob_list("predicted_probs", predicted_probs)
        self.observe_checked(p, _accepted_list(accepted, len(p)))

    def observe_checked(self, p: list[float], accepted: list[bool]) -> None:
        """``observe`` of inputs already validated (``_prob_list``, ``_accepted_list``)."""
        lam = self.config.forgetting
        nb = self.config.num_bins
        count, hits, pred = [0.0] * nb, [0.0] * nb, [0.0] * nb  # this step's, per bin
        for x, ok in zip(p, accepted, strict=True):
            i = min(int(x * nb), nb - 1)
            count[i] += 1.0
            pred[i] += x
            if ok:
                hits[i] += 1.0
        for i in range(nb):
            self._count[i] = self._count[i] * lam + count[i]
            self._accepted[i] = self._accepted[i] * lam + hits[i]
            self._predicted[i] = self._predicted[i] * lam + pred[i]
        self._num_observed += len(p)
        self._knots = None

    def calibrate(self, probs: FloatArray | Sequence[float]) -> FloatArray:
        """Calibrated acceptance probabilities (same shape as ``probs``)."""
        p = np.asarray(probs, dtype=np.float64)
        _check_prob_array("probs", p)
        xs, ys, _ = self._curve()
        return np.asarray(np.interp(p, xs, ys), dtype=np.float64)

    def calibrate_list(self, probs: list[float]) -> list[float]:
        """``calibrate`` of probabilities already validated, as plain floats (numpy's
        interpolation arithmetic, so the same values)."""
        xs, ys, slopes = self._curve()
        last = len(xs) - 1
        out = []
        for v in probs:
            j = bisect.bisect_right(xs, v) - 1
            if j < 0:
                out.append(ys[0])
            elif j >= last:
                out.append(ys[last])
            elif xs[j] == v:
                out.append(ys[j])
            else:
                out.append(slopes[j] * (v - xs[j]) + ys[j])
        return out

    def _curve(self) -> tuple[list[float], list[float], list[float]]:
        if self._knots is None:
            m = self.config.prior_strength
            weight = [c + m for c in self._count]
            x = [(p + m * c) / w for p, c, w in zip(self._predicted, self._centers, weight,
                                                     strict=True)]
            y = [min(1.0, max(0.0, xi + (a - p) / w)) for xi, a, p, w in
                 zip(x, self._accepted, self._predicted, weight, strict=True)]
            y = _pava(y, weight)
            xs = [0.0, *x, 1.0]
            ys = [max(0.0, y[0] - x[0]), *y, min(1.0, y[-1] + 1.0 - x[-1])]
            slopes = [(ys[j + 1] - ys[j]) / (xs[j + 1] - xs[j]) if xs[j + 1] > xs[j] else 0.0
                      for j in range(len(xs) - 1)]
            self._knots = (xs, ys, slopes)
        return self._knots


def _pava(y: Sequence[float], w: Sequence[float]) -> list[float]:
    """Weighted pool-adjacent-violators: the non-decreasing fit closest to ``y``."""
    values: list[float] = []
    weights: list[float] = []
    sizes: list[int] = []
    for yi, wi in zip(y, w, strict=True):
        v, wt, sz = yi, wi, 1
        while values and values[-1] > v:
            pv, pw, ps = values.pop(), weights.pop(), sizes.pop()
            v = (pv * pw + v * wt) / (pw + wt)
            wt += pw
            sz += ps
        values.append(v)
        weights.append(wt)
        sizes.append(sz)
    return [v for v, size in zip(values, sizes, strict=True) for _ in range(size)]


# --------------------------------------------------------------------------- policy


class SpecPolicyStats(NamedTuple):
    """What the policy last did and how well it predicted (a named tuple: it is
    replaced every step, and ``_replace`` costs a tenth of ``dataclasses.replace``).

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
        # Plain Python on short lists: one step's drafts are tens of tokens, and after a
        # forward pass has evicted the caches each small numpy call costs tens of
        # microseconds. The arithmetic is numpy's (sequential prefix sums, stable
        # order), so the choices are the same.
        cap = self.config.max_spec_tokens_per_seq
        drafts = _draft_lists(draft_probs, cap)
        lengths = [len(d) for d in drafts]
        total = sum(lengths)
        mode = self.config.mode
        step_cap = self.config.max_spec_tokens_per_step
        max_k = total if step_cap is None else min(total, step_cap)
        if mode == "off" or max_k == 0:
            return self._record([0] * n, 0.0, n, base_batch_tokens, context_tokens)
        flat = [x for d in drafts for x in d]
        q = self.calibrator.calibrate_list(flat)
        _running_min_inplace(q, lengths)
        if mode == "always" and max_k == total:
            return self._record(lengths, sum(q), n, base_batch_tokens, context_tokens)
        order = sorted(range(total), key=q.__getitem__, reverse=True)[:max_k]  # stable
        if mode == "always":
            k = max_k
        else:
            t0, t1, t2 = self.time_model.unscaled_coefficients()
            base = n + self.config.prefill_token_value * (base_batch_tokens - n)
            rate0 = base / (t0 + t1 * base_batch_tokens + t2 * context_tokens)
            k, best, acc = 0, rate0, 0.0
            for j in range(1, max_k + 1):
                acc += q[order[j - 1]]
                rate = (base + acc) / (t0 + t1 * (base_batch_tokens + j)
                                       + t2 * (context_tokens + j))
                if rate > best:  # (the first maximum, as numpy's argmax)
                    k, best = j, rate
            if not best > rate0 * (1.0 + self.config.min_gain):
                k = 0
        counts = [0] * n
        if k:
            seg = [i for i, size in enumerate(lengths) for _ in range(size)]
            for j in order[:k]:
                counts[seg[j]] += 1
        return self._record(counts, sum(q[j] for j in order[:k]), n, base_batch_tokens,
                            context_tokens)

    def observe_step(self, batch_tokens: int, context_tokens: int, seconds: float) -> None:
        """Learn from a measured step (see ``StepTimeModel.observe``)."""
        predicted = self.time_model.predict_then_observe(batch_tokens, context_tokens, seconds)
        lam = self.config.time.forgetting
        self._err_num = lam * self._err_num + abs(predicted - seconds) / seconds
        self._err_den = lam * self._err_den + 1.0
        self._stats = self._stats._replace(
            last_observed_s=float(seconds), last_observed_predicted_s=predicted,
            mean_abs_rel_error=self._err_num / self._err_den)

    def observe_verification(self, predicted_probs: Sequence[float] | FloatArray,
                             accepted: Sequence[bool] | npt.NDArray[np.bool_]) -> None:
        """Learn from one step's verification, every sequence's draft tokens in one call
        (see ``AcceptanceCalibrator.observe``)."""
        p = _prob_list("predicted_probs", predicted_probs)
        ok = _accepted_list(accepted, len(p))
        expected = sum(self.calibrator.calibrate_list(p))
        self.calibrator.observe_checked(p, ok)
        self._stats = self._stats._replace(last_expected_accepted=expected,
                                           last_accepted=sum(ok))

    def _record(self, counts: list[int], chosen: float, n: int, base: int,
                context: int) -> IntArray:
        """Updates the stats for a choice (``chosen``: the sum of its calibrated
        probabilities) and returns ``counts`` as an array."""
        k = sum(counts)
        t0, t1, t2 = self.time_model.unscaled_coefficients()
        self._stats = self._stats._replace(
            steps=self._stats.steps + 1, last_budget_total=k,
            last_budget_mean=k / n if n else 0.0, last_num_seqs=n,
            last_predicted_s=t0 + t1 * (base + k) + t2 * (context + k),
            last_expected_tokens=n + self.config.prefill_token_value * (base - n) + chosen)
        return np.array(counts, dtype=np.int64)


def _running_min_inplace(q: list[float], lengths: Sequence[int]) -> None:
    """Running minimum of ``q`` within each segment (``lengths``: the segments' sizes,
    in order), in place."""
    start = 0
    for size in lengths:
        low = 1.0
        for i in range(start, start + size):
            if q[i] < low:
                low = q[i]
            else:
                q[i] = low
        start += size


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


def _draft_lists(draft_probs: Sequence[FloatArray | Sequence[float]],
                 cap: int) -> list[list[float]]:
    """Each draft as a list of floats cut to ``cap`` tokens, validated (1-D, finite
    probabilities in [0, 1])."""
    return [_prob_list(f"draft_probs[{i}]", d, cap) for i, d in enumerate(draft_probs)]


def _accepted_list(accepted: Sequence[bool] | npt.NDArray[np.bool_], n: int) -> list[bool]:
    """``accepted`` as a list of ``n`` booleans, validated (1-D, booleans or 0/1)."""
    a = np.asarray(accepted)
    if a.ndim != 1 or len(a) != n:
        raise ValueError(
            f"accepted must be 1-D with one entry per predicted prob ({n}), "
            f"got shape {a.shape}"
        )
    if a.dtype != np.bool_ and a.size and (
            a.dtype.kind not in "iuf" or not np.all((a == 0) | (a == 1))):
        raise ValueError("accepted must hold booleans (or 0/1)")
    return [bool(x) for x in a.tolist()]


def _prob_list(name: str, values: Sequence[float] | FloatArray,
               cap: int | None = None) -> list[float]:
    """``values`` (its first ``cap``, if given) as a list of floats, validated: 1-D,
    finite probabilities in [0, 1]."""
    if not (isinstance(values, np.ndarray) and values.dtype.kind == "f"):
        if isinstance(values, np.ndarray) and values.dtype.kind not in "biu":
            raise ValueError(f"{name} must hold real probabilities, got dtype {values.dtype}")
        try:
            values = np.asarray(values, dtype=np.float64)
        except (TypeError, ValueError) as e:
            raise ValueError(f"{name} must be a 1-D sequence of probabilities: {e}") from None
    if values.ndim != 1:
        raise ValueError(f"{name} must be 1-D, got shape {values.shape}")
    out: list[float] = (values if cap is None else values[:cap]).tolist()
    # (NaN fails the comparison; an infinity is out of range)
    if not all(0.0 <= x <= 1.0 for x in out):
        raise ValueError(f"{name} must hold finite probabilities in [0, 1]")
    return out

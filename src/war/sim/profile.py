"""A cost model fitted to a replica's measured cost curve.

Knows: the cost-curve records the engine's load benchmark writes (``cost_curve``: a
list of ``{batch, draft_tokens, step_ms}``, each one forward pass of ``batch``
sequences with ``context`` cached tokens and ``1 + draft_tokens`` new tokens; the
context is the record's ``context`` or the report's ``config.cost_context``), how to
turn a record into a step's shape, and a non-negative least-squares fit of::

    seconds = c0 + c1 * max(batch_tokens - knot, 0) + c2 * context_tokens
              + c3 * num_seqs + c4 * pairs + c5 * min(batch_tokens, knot)

where ``pairs = batch_tokens * context_tokens / num_seqs`` (attention's query-key
pairs), minimizing relative error. A step's first ``knot`` tokens and the rest have
their own cost per token (``c5`` and ``c1``): on a CPU the first cost more (matrix
products over a handful of rows leave most of the vector units idle), on a GPU they
cost less (decoding reads the weights whatever the batch, until the batch fills the
compute units). ``knot`` is chosen by cross-validation (``fit``: leave one measured
batch size out, least root-mean-square relative error over ``BATCH_KNOTS`` and
``0``, one cost for every token), so a curve without such a bend gets none. Does not
know the engine or hardware: the profile is only as good as the shapes it was
measured on (a curve measured at one context length cannot separate the
per-sequence and per-context terms; measure two).
"""

from __future__ import annotations

import itertools
import json
import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

# ("batch_tokens": those beyond the knot; all of them without one)
FEATURES = ("intercept", "batch_tokens", "context_tokens", "num_seqs", "pairs",
            "first_batch_tokens")
# candidate knots (tokens in a step); ``fit`` picks one or none
BATCH_KNOTS = (2, 4, 8, 16, 32, 64, 128)


@dataclass(frozen=True)
class CurvePoint:
    """One measured shape: ``batch`` sequences, ``draft_tokens`` drafts each after the
    pending token, ``context`` cached tokens each; ``step_ms`` its duration."""

    batch: int
    draft_tokens: int
    context: int
    step_ms: float

    def __post_init__(self) -> None:
        if self.batch < 1 or self.draft_tokens < 0 or self.context < 0:
            raise ValueError(f"bad cost-curve shape {self}")
        if not 0 < self.step_ms < math.inf:
            raise ValueError(f"step_ms must be > 0 and finite, got {self.step_ms}")

    def shape(self) -> tuple[int, int, int, int]:
        """(num_seqs, batch_tokens, context_tokens, draft_tokens) of the step."""
        fed = 1 + self.draft_tokens
        return (self.batch, self.batch * fed, self.batch * (self.context + fed),
                self.batch * self.draft_tokens)


def features(num_seqs: int, batch_tokens: int, context_tokens: int,
             knot: int = 0) -> list[float]:
    """The model's features of a step (``FEATURES``; the last is 0 without a knot)."""
    first = min(batch_tokens, knot)
    return [1.0, float(batch_tokens - first), float(context_tokens), float(num_seqs),
            batch_tokens * context_tokens / max(num_seqs, 1), float(first)]


def load_cost_curve(path: str | Path, context: int | None = None) -> list[CurvePoint]:
    """The points of a cost-curve JSON (``benchmarks/engine/bench_load.py``'s report or
    ``benchmarks/sim/measure_cost_curve.py``'s). ``context`` applies to records
    without their own (default: the report's ``config.cost_context``). A file that is
    not there is a FileNotFoundError, one that is not such a report a ValueError, both
    naming the file."""
    p = Path(path)
    if not p.is_file():
        raise FileNotFoundError(f"cost curve file not found: {p}" if not p.exists()
                                else f"cost curve file {p} is not a file")
    try:
        report = json.loads(p.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"cost curve {p}: not a valid JSON file: {e}") from None
    try:
        return parse_cost_curve(report, context)
    except ValueError as e:
        raise ValueError(f"cost curve {p}: {e}") from None


def parse_cost_curve(report: Any, context: int | None = None) -> list[CurvePoint]:
    if not isinstance(report, dict):
        raise ValueError(f"a cost-curve report is a JSON object, got {type(report).__name__}")
    records = report.get("cost_curve")
    if not isinstance(records, list) or not records:
        raise ValueError("the report has no cost_curve records")
    default = context
    if default is None:
        config = report.get("config") or {}
        if not isinstance(config, dict):
            raise ValueError(f"the report's config must be an object, got {config!r}")
        default = config.get("cost_context")
    points = []
    for i, r in enumerate(records):
        if not isinstance(r, dict):
            raise ValueError(f"cost_curve record {i} must be an object, got {r!r}")
        missing = [k for k in ("batch", "draft_tokens", "step_ms") if k not in r]
        if missing:
            raise ValueError(f"cost_curve record {i} has no {', '.join(missing)}")
        ctx = r.get("context", default)
        if ctx is None:
            raise ValueError("a cost-curve record has no context; pass context=")
        # (int() would silently truncate a fractional shape, or overflow on inf)
        shape = {k: _whole(f"cost_curve record {i}: {k}", v) for k, v in
                 (("batch", r["batch"]), ("draft_tokens", r["draft_tokens"]),
                  ("context", ctx))}
        step_ms = r["step_ms"]
        if isinstance(step_ms, bool) or not isinstance(step_ms, (int, float)):
            raise ValueError(f"cost_curve record {i}: step_ms must be a number, "
                             f"got {step_ms!r}")
        points.append(CurvePoint(shape["batch"], shape["draft_tokens"], shape["context"],
                                 float(step_ms)))
    return points


def _whole(name: str, value: Any) -> int:
    """``value`` as an int if it is a whole number, else ValueError naming it."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or (
            isinstance(value, float) and not value.is_integer()):
        raise ValueError(f"{name} must be a whole number, got {value!r}")
    return int(value)


@dataclass(frozen=True)
class ProfileCost:
    """The fitted model (module docstring); ``coefficients`` in seconds per feature
    (``FEATURES``; five of them mean no knot), ``knot`` in tokens (0: none)."""

    coefficients: tuple[float, ...]
    kv_tokens: int | None = None
    name: str = "profile"
    knot: int = 0

    def __post_init__(self) -> None:
        coef = tuple(float(c) for c in self.coefficients)
        if len(coef) == len(FEATURES) - 1:
            coef += (0.0,)
        if len(coef) != len(FEATURES) or not all(c >= 0 for c in coef):
            raise ValueError(f"need {len(FEATURES)} (or {len(FEATURES) - 1}) non-negative "
                             f"coefficients, got {self.coefficients!r}")
        if not sum(coef) > 0 or not all(c < float("inf") for c in coef):
            raise ValueError(f"coefficients must be finite and not all zero, got {coef!r}")
        if isinstance(self.knot, bool) or not isinstance(self.knot, int) or self.knot < 0:
            raise ValueError(f"knot must be an int >= 0, got {self.knot!r}")
        if self.kv_tokens is not None and self.kv_tokens < 1:
            raise ValueError(f"kv_tokens must be >= 1, got {self.kv_tokens}")
        object.__setattr__(self, "coefficients", coef)

    def step_time(self, num_seqs: int, batch_tokens: int, context_tokens: int,
                  draft_tokens: int = 0) -> float:
        x = features(num_seqs, batch_tokens, context_tokens, self.knot)
        t = sum(c * v for c, v in zip(self.coefficients, x, strict=True))
        return max(t, 1e-6)

    def kv_capacity_tokens(self) -> int | None:
        return self.kv_tokens

    @classmethod
    def fit(cls, points: Sequence[CurvePoint], kv_tokens: int | None = None,
            knots: Sequence[int] = BATCH_KNOTS) -> ProfileCost:
        """Fits the coefficients to ``points`` (at least one), with the knot
        of ``knots`` (or none) whose leave-one-batch-size-out predictions have the least
        root-mean-square relative error; ties keep the earlier candidate, none first.
        With fewer than three batch sizes there is nothing to validate on: no knot."""
        if not points:
            raise ValueError("no points to fit")
        if any(isinstance(k, bool) or not isinstance(k, int) or k < 1 for k in knots):
            raise ValueError(f"knots must be ints >= 1, got {list(knots)!r}")
        sizes = sorted({p.batch for p in points})
        best_knot = 0
        if len(sizes) >= 3 and knots:
            best = math.inf
            for knot in (0, *knots):
                errors: list[float] = []
                for size in sizes:
                    train = [p for p in points if p.batch != size]
                    test = [p for p in points if p.batch == size]
                    errors += cls._fit_knot(train, knot, kv_tokens).errors(test)
                rms = math.sqrt(sum(e * e for e in errors) / len(errors))
                if rms < best:
                    best, best_knot = rms, knot
        return cls._fit_knot(points, best_knot, kv_tokens)

    @classmethod
    def _fit_knot(cls, points: Sequence[CurvePoint], knot: int,
                  kv_tokens: int | None) -> ProfileCost:
        x = np.array([features(*p.shape()[:3], knot) for p in points])
        if knot == 0:
            x = x[:, :-1]  # (an all-zero column)
        y = np.array([p.step_ms / 1e3 for p in points])
        w = 1.0 / y  # relative error
        coef = [float(v) for v in nnls(x * w[:, None], y * w)]
        if sum(coef) <= 0:
            coef[0] = float(np.median(y))
        return cls(tuple(coef), kv_tokens, knot=knot)

    def errors(self, points: Sequence[CurvePoint]) -> list[float]:
        """``|predicted - measured| / measured`` of each point."""
        out = []
        for p in points:
            pred = self.step_time(*p.shape())
            out.append(abs(pred - p.step_ms / 1e3) / (p.step_ms / 1e3))
        return out


def nnls(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """``argmin |a x - b|`` subject to ``x >= 0``, exactly, by trying every support
    (a handful of columns here)."""
    n = a.shape[1]
    best, best_res = np.zeros(n), float(b @ b)
    for size in range(1, n + 1):
        for cols in itertools.combinations(range(n), size):
            sol, *_ = np.linalg.lstsq(a[:, cols], b, rcond=None)
            if np.any(sol < 0):
                continue
            x = np.zeros(n)
            x[list(cols)] = sol
            r = a @ x - b
            res = float(r @ r)
            if res < best_res - 1e-15:
                best, best_res = x, res
    return best


def split_by_batch(points: Sequence[CurvePoint]) -> tuple[list[CurvePoint], list[CurvePoint]]:
    """Fit / held-out split for validation: shapes whose batch size is the smallest, the
    largest, or every other size in between are fitted; the others are held out (so
    held-out batch sizes lie inside the fitted range)."""
    sizes = sorted({p.batch for p in points})
    fit_sizes = {s for i, s in enumerate(sizes) if i % 2 == 0 or s == sizes[-1]}
    fit = [p for p in points if p.batch in fit_sizes]
    held = [p for p in points if p.batch not in fit_sizes]
    return fit, held

"""A cost model fitted to a replica's measured cost curve.

Knows: the cost-curve records the engine's load benchmark writes (``cost_curve``: a
list of ``{batch, draft_tokens, step_ms}``, each one forward pass of ``batch``
sequences with ``context`` cached tokens and ``1 + draft_tokens`` new tokens; the
context is the record's ``context`` or the report's ``config.cost_context``), how to
turn a record into a step's shape, and a non-negative least-squares fit of::

    seconds = c0 + c1 * batch_tokens + c2 * context_tokens + c3 * num_seqs + c4 * pairs

where ``pairs = batch_tokens * context_tokens / num_seqs`` (attention's query-key
pairs), minimizing relative error. Does not know the engine or hardware: the
profile is only as good as the shapes it was measured on (a curve measured at one
context length cannot separate the per-sequence and per-context terms; measure two).
"""

from __future__ import annotations

import itertools
import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

FEATURES = ("intercept", "batch_tokens", "context_tokens", "num_seqs", "pairs")


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
        if not self.step_ms > 0:
            raise ValueError(f"step_ms must be > 0, got {self.step_ms}")

    def shape(self) -> tuple[int, int, int, int]:
        """(num_seqs, batch_tokens, context_tokens, draft_tokens) of the step."""
        fed = 1 + self.draft_tokens
        return (self.batch, self.batch * fed, self.batch * (self.context + fed),
                self.batch * self.draft_tokens)


def features(num_seqs: int, batch_tokens: int, context_tokens: int) -> list[float]:
    return [1.0, float(batch_tokens), float(context_tokens), float(num_seqs),
            batch_tokens * context_tokens / max(num_seqs, 1)]


def load_cost_curve(path: str | Path, context: int | None = None) -> list[CurvePoint]:
    """The points of a cost-curve JSON (``benchmarks/engine/bench_load.py``'s report or
    ``benchmarks/sim/measure_cost_curve.py``'s). ``context`` applies to records
    without their own (default: the report's ``config.cost_context``)."""
    report = json.loads(Path(path).read_text(encoding="utf-8"))
    return parse_cost_curve(report, context)


def parse_cost_curve(report: dict[str, Any], context: int | None = None) -> list[CurvePoint]:
    records = report.get("cost_curve")
    if not isinstance(records, list) or not records:
        raise ValueError("the report has no cost_curve records")
    default = context
    if default is None:
        default = (report.get("config") or {}).get("cost_context")
    points = []
    for r in records:
        ctx = r.get("context", default)
        if ctx is None:
            raise ValueError("a cost-curve record has no context; pass context=")
        points.append(CurvePoint(int(r["batch"]), int(r["draft_tokens"]), int(ctx),
                                 float(r["step_ms"])))
    return points


@dataclass(frozen=True)
class ProfileCost:
    """The fitted model (module docstring); ``coefficients`` in seconds per feature."""

    coefficients: tuple[float, float, float, float, float]
    kv_tokens: int | None = None
    name: str = "profile"

    def __post_init__(self) -> None:
        if len(self.coefficients) != len(FEATURES) or min(self.coefficients) < 0:
            raise ValueError(f"need {len(FEATURES)} non-negative coefficients")
        if not sum(self.coefficients) > 0:
            raise ValueError("all coefficients are zero")

    def step_time(self, num_seqs: int, batch_tokens: int, context_tokens: int,
                  draft_tokens: int = 0) -> float:
        x = features(num_seqs, batch_tokens, context_tokens)
        t = sum(c * v for c, v in zip(self.coefficients, x, strict=True))
        return max(t, 1e-6)

    def kv_capacity_tokens(self) -> int | None:
        return self.kv_tokens

    @classmethod
    def fit(cls, points: Sequence[CurvePoint], kv_tokens: int | None = None) -> ProfileCost:
        """Fits the coefficients to ``points`` (at least one)."""
        if not points:
            raise ValueError("no points to fit")
        x = np.array([features(*p.shape()[:3]) for p in points])
        y = np.array([p.step_ms / 1e3 for p in points])
        w = 1.0 / y  # relative error
        coef = nnls(x * w[:, None], y * w)
        c0, c1, c2, c3, c4 = (float(v) for v in coef)
        if c0 + c1 + c2 + c3 + c4 <= 0:
            c0 = float(np.median(y))
        return cls((c0, c1, c2, c3, c4), kv_tokens)

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

"""Cost models: roofline presets against the datasheets, the linear model, and the
profile fitted to the CPU engine's measured cost curve."""

from __future__ import annotations

import json
import math
import statistics
from pathlib import Path

import pytest

from war.sim.costs import ACCELERATORS, MODELS, LinearCost, RooflineCost
from war.sim.profile import (
    CurvePoint,
    ProfileCost,
    load_cost_curve,
    parse_cost_curve,
    split_by_batch,
)

CURVE = Path(__file__).resolve().parents[2] / "benchmarks" / "sim" / "data" / "cpu_cost_curve.json"


def test_accelerator_presets_are_the_datasheets() -> None:
    got = {k: (a.peak_flops, a.mem_bandwidth) for k, a in ACCELERATORS.items()}
    assert got == {"A100": (312e12, 2.0e12), "H100": (989e12, 3.35e12),
                   "H200": (989e12, 4.8e12)}


def test_roofline_is_memory_bound_alone_and_compute_bound_in_bulk() -> None:
    c = RooflineCost("H100", "llama-8b", compute_efficiency=1.0, memory_efficiency=1.0,
                     overhead_s=0.0)
    m = MODELS["llama-8b"]
    alone = c.step_time(1, 1, 0)
    assert alone == pytest.approx((m.num_params * 2 + m.kv_bytes_per_token) / 3.35e12)
    bulk = c.step_time(1, 8192, 0)
    assert bulk == pytest.approx(2 * m.num_params * 8192 / 989e12, rel=1e-6)
    # More bandwidth speeds decoding, not a compute-bound prefill.
    h200 = RooflineCost("H200", "llama-8b", compute_efficiency=1.0, memory_efficiency=1.0,
                        overhead_s=0.0)
    assert h200.step_time(1, 1, 0) < alone
    assert h200.step_time(1, 8192, 0) == pytest.approx(bulk)
    # Drafts are nearly free while memory-bound.
    assert c.step_time(8, 8 * 5, 8 * 2000) < 1.05 * c.step_time(8, 8, 8 * 2000)


def test_tensor_parallelism_and_memory() -> None:
    one = RooflineCost("A100", "llama-70b", tp=4)
    two = RooflineCost("A100", "llama-70b", tp=8)
    assert two.step_time(1, 1, 1000) < one.step_time(1, 1, 1000)
    assert two.kv_capacity_tokens() > 2 * one.kv_capacity_tokens()
    with pytest.raises(ValueError, match="does not fit"):
        RooflineCost("A100", "llama-70b", tp=1)
    with pytest.raises(ValueError):
        RooflineCost("TPU", "llama-8b")


def test_linear_cost() -> None:
    c = LinearCost(0.01, 1e-4, 1e-7, 1e-3, kv_tokens=1000)
    assert c.step_time(2, 10, 100) == pytest.approx(0.01 + 1e-3 + 1e-5 + 2e-3)
    assert c.kv_capacity_tokens() == 1000
    with pytest.raises(ValueError):
        LinearCost(0.0)


def _exact_points(truth: ProfileCost) -> list[CurvePoint]:
    return [CurvePoint(b, k, c, 1e3 * truth.step_time(*CurvePoint(b, k, c, 1.0).shape()))
            for b in (1, 2, 4, 8, 16, 64) for k in (0, 2, 4, 16) for c in (128, 512)]


def test_profile_recovers_an_exact_model() -> None:
    truth = ProfileCost((0.002, 1e-5, 2e-7, 3e-4, 1e-9))
    assert truth.coefficients[-1] == 0.0 and truth.knot == 0
    pts = _exact_points(truth)
    fit = ProfileCost.fit(pts)
    assert max(fit.errors(pts)) < 1e-6
    if fit.knot:  # a knot, if any, with the same cost per token on both sides
        assert fit.coefficients[-1] == pytest.approx(fit.coefficients[1], rel=1e-6)


def test_profile_finds_the_knot() -> None:
    """Steps whose first 8 tokens cost more each (a CPU), or whose first 32 cost
    nothing (a GPU decoding below its compute bound): cross-validation picks the knot
    among the candidates and recovers the model; with two batch sizes it cannot
    validate and fits no knot."""
    truth = ProfileCost((0.002, 1e-5, 2e-7, 3e-4, 1e-9, 2e-4), knot=8)
    pts = _exact_points(truth)
    fit = ProfileCost.fit(pts)
    assert fit.knot == 8
    assert max(fit.errors(pts)) < 1e-6
    assert fit.coefficients[-1] == pytest.approx(2e-4, rel=1e-6)
    # a token beyond the knot: its own cost, a context token and 9*100 - 8*99 pairs
    assert fit.step_time(1, 9, 100) - fit.step_time(1, 8, 99) == pytest.approx(
        1e-5 + 2e-7 + 1e-9 * 108, rel=1e-6)
    gpu = ProfileCost((0.005, 1e-4, 1e-7, 0.0, 0.0, 0.0), knot=32)
    assert gpu.step_time(4, 4, 400) == gpu.step_time(4, 32, 400)  # flat below the knot
    pts = [CurvePoint(b, k, c, 1e3 * gpu.step_time(*CurvePoint(b, k, c, 1.0).shape()))
           for b in (1, 2, 4, 8, 16, 32, 64) for k in (0, 3, 7) for c in (128, 512)]
    fit = ProfileCost.fit(pts)
    assert fit.knot == 32
    assert max(fit.errors(pts)) < 1e-6
    two = [p for p in pts if p.batch in (1, 64)]
    assert ProfileCost.fit(two).knot == 0
    assert ProfileCost.fit(pts, knots=()).knot == 0
    assert ProfileCost.fit(pts, knots=(4, 16)).knot in (4, 16)


def test_profile_refuses_bad_settings() -> None:
    for coef in [(1.0,) * 4, (1.0,) * 7, (1.0, -1.0, 0, 0, 0), (0.0,) * 6,
                 (math.inf, 0, 0, 0, 0)]:
        with pytest.raises(ValueError):
            ProfileCost(coef)
    for knot in (-1, 2.5, True):
        with pytest.raises(ValueError):
            ProfileCost((1.0,) * 6, knot=knot)  # type: ignore[arg-type]
    pts = _exact_points(ProfileCost((0.002, 1e-5, 2e-7, 3e-4, 1e-9)))
    for knots in [(0,), (-4,), (2.0,)]:
        with pytest.raises(ValueError):
            ProfileCost.fit(pts, knots=knots)  # type: ignore[arg-type]
    with pytest.raises(ValueError):
        ProfileCost.fit([])


def test_profile_predicts_held_out_shapes_of_the_cpu_engine() -> None:
    """Real data: the CPU engine's forward pass (``measure_cost_curve``, the function
    ``bench_load.py`` uses), measured once on this project's benchmark model shape and
    checked in. Fitted on batch sizes 1, 4, 16, 64 it predicts every shape of 2, 8, 32
    within 15%."""
    points = load_cost_curve(CURVE)
    fit, held = split_by_batch(points)
    assert {p.batch for p in fit} == {1, 4, 16, 64} and {p.batch for p in held} == {2, 8, 32}
    assert len(held) == 30
    errors = ProfileCost.fit(fit).errors(held)
    assert max(errors) <= 0.15
    assert statistics.mean(errors) <= 0.06


def test_bench_load_report_format() -> None:
    report = {"config": {"cost_context": 320},
              "cost_curve": [{"batch": 1, "draft_tokens": 0, "step_ms": 8.0},
                             {"batch": 4, "draft_tokens": 4, "step_ms": 12.0}]}
    pts = parse_cost_curve(report)
    assert [p.context for p in pts] == [320, 320]
    assert pts[1].shape() == (4, 20, 4 * 325, 16)
    with pytest.raises(ValueError):
        parse_cost_curve({"cost_curve": []})
    data = json.loads(CURVE.read_text())
    assert all("context" in r for r in data["cost_curve"])

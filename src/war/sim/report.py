"""The sweep's targets, checked against its results.

Knows: the four configurations of the load sweep (``rr_nospec``, ``rr_spec``,
``cache_nospec``, ``war``) and the targets of the simulator's issue: at the lowest
load WAR's throughput over the best configuration without speculation, at the highest
load over round robin (with or without speculation) and over cache-aware routing
alone, WAR against the best fixed configuration at every load, WAR's makespan against
its lower bound, and the sweep's wall time. Does not know how results are produced.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

FIXED = ("rr_nospec", "rr_spec", "cache_nospec")
WALL_LIMIT_S = 600.0


def _met(value: float, goal: float, higher: bool = True) -> dict[str, Any]:
    return {"value": round(value, 4), "goal": goal,
            "met": bool(value >= goal if higher else value <= goal)}


def targets(results: Sequence[dict[str, Any]], wall_s: float | None = None) -> dict[str, Any]:
    """The targets that the results allow checking (those needing an absent
    configuration are left out)."""
    by = {(r["config"], r["requested_load"]): r for r in results}
    loads = sorted({r["requested_load"] for r in results})
    out: dict[str, Any] = {}

    def tput(config: str, load: float) -> float | None:
        row = by.get((config, load))
        return None if row is None else float(row["throughput"])

    if not loads or not any(c == "war" for c, _ in by):
        return out
    low, high = loads[0], loads[-1]
    war_low, war_high = tput("war", low), tput("war", high)
    nospec = [v for v in (tput("rr_nospec", low), tput("cache_nospec", low)) if v]
    if war_low and nospec:
        out["low_load_vs_nospec"] = {**_met(war_low / max(nospec), 1.4), "load": low}
    rr = [v for v in (tput("rr_nospec", high), tput("rr_spec", high)) if v]
    if war_high and rr:
        out["high_load_vs_round_robin"] = {**_met(war_high / max(rr), 1.6), "load": high}
    cache = tput("cache_nospec", high)
    if war_high and cache:
        out["high_load_vs_cache_aware"] = {**_met(war_high / cache, 1.15), "load": high}
    per_load = {}
    for ld in loads:
        w = tput("war", ld)
        fixed = [v for v in (tput(c, ld) for c in FIXED) if v]
        if w and fixed:
            per_load[str(ld)] = round(w / max(fixed), 4)
    if per_load:
        out["war_vs_best_fixed"] = {"per_load": per_load, "goal": 1.0,
                                    "met": all(v >= 1.0 for v in per_load.values())}
    bound = {str(ld): round(float(by[("war", ld)]["lower_bound_ratio"]), 4)
             for ld in loads if ("war", ld) in by}
    out["war_makespan_vs_bound"] = {"per_load": bound, "goal": 1.25,
                                    "met": all(v <= 1.25 for v in bound.values())}
    if wall_s is not None:
        out["wall_s"] = _met(wall_s, WALL_LIMIT_S, higher=False)
    return out


def summary_lines(report: dict[str, Any]) -> list[str]:
    """One line per target: name, value, goal, met."""
    lines = []
    for name, t in report.get("targets", {}).items():
        value = t.get("value", t.get("per_load"))
        lines.append(f"{name}: {value} (goal {t['goal']}): {'met' if t['met'] else 'NOT met'}")
    return lines

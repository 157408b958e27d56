"""Plots of a sweep: throughput against load, makespan CDF, fleet timeline.

Knows: the rows of a sweep report (``war.sim.experiment``) and matplotlib (Agg
backend, files only). Does not know how the rows were produced.
"""

from __future__ import annotations

import io
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt

from war.outputs import write_bytes_atomic


def throughput_vs_load(rows: Sequence[dict[str, Any]], path: Path) -> None:
    fig, ax = plt.subplots(figsize=(6, 4))
    for config in dict.fromkeys(r["config"] for r in rows):
        pts = sorted((r["load"], r["throughput"]) for r in rows if r["config"] == config)
        ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=config)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("trajectories per replica (RL step)")
    ax.set_ylabel("throughput (generated tokens / s)")
    ax.grid(True, alpha=0.3)
    if ax.get_legend_handles_labels()[0]:  # (none on empty data: matplotlib warns)
        ax.legend()
    fig.tight_layout()
    _save(fig, path)


def makespan_cdf(rows: Sequence[dict[str, Any]], path: Path) -> None:
    """CDF of trajectories' completion times (from their RL step's start)."""
    fig, ax = plt.subplots(figsize=(6, 4))
    for r in rows:
        times = sorted(r.get("finish_times", []))
        if times:
            ax.step(times, [(i + 1) / len(times) for i in range(len(times))], where="post",
                    label=f"{r['config']} (load {r['load']:.0f})")
    ax.set_xlabel("trajectory completion time since step start (s)")
    ax.set_ylabel("fraction of trajectories done")
    ax.grid(True, alpha=0.3)
    if ax.get_legend_handles_labels()[0]:  # (none on empty data: matplotlib warns)
        ax.legend()
    fig.tight_layout()
    _save(fig, path)


def fleet_timeline(row: dict[str, Any], path: Path) -> None:
    """Requests in flight over the fleet and draft tokens verified per decoding
    sequence and step, over virtual time."""
    tl = row.get("timeline")
    if not tl:
        return
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot(tl["t"], tl["in_flight"], color="tab:blue", label="requests in flight")
    ax.set_xlabel("virtual time (s)")
    ax.set_ylabel("requests in flight (fleet)", color="tab:blue")
    ax2 = ax.twinx()
    ax2.plot(tl["t"], tl["budget_per_seq"], color="tab:red", alpha=0.7,
             label="speculation budget")
    ax2.set_ylabel("draft tokens per sequence and step", color="tab:red")
    ax.set_title(f"{row['config']}, load {row['load']:.0f}")
    fig.tight_layout()
    _save(fig, path)


def _save(fig: Any, path: Path) -> None:
    """Writes the figure whole (an interrupted run leaves no truncated PNG) and closes it."""
    try:
        image = io.BytesIO()
        fig.savefig(image, format="png", dpi=120)
    finally:
        plt.close(fig)
    write_bytes_atomic(path, image.getvalue())


def _file_part(name: str) -> str:
    """``name`` as part of a file name: a configuration may be called anything."""
    return re.sub(r"[^A-Za-z0-9._-]", "_", name) or "_"


def write_plots(rows: Sequence[dict[str, Any]], folder: Path) -> list[Path]:
    """Every plot the rows allow, into ``folder``; returns the files written."""
    folder.mkdir(parents=True, exist_ok=True)
    out = [folder / "throughput_vs_load.png"]
    throughput_vs_load(rows, out[0])
    detailed = [r for r in rows if "finish_times" in r]
    if detailed:
        out.append(folder / "makespan_cdf.png")
        makespan_cdf(detailed, out[-1])
    taken: set[str] = set()
    for r in detailed:
        if r.get("timeline"):
            # (two names may map to one file part, "war a" and "war/a": number the later)
            part = base = _file_part(str(r["config"]))
            n = 1
            while part in taken:
                n += 1
                part = f"{base}-{n}"
            taken.add(part)
            p = folder / f"timeline_{part}.png"
            fleet_timeline(r, p)
            out.append(p)
    return out

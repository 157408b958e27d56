"""The PNG report of a rollout run: what each replica did over time.

Knows: how to draw, per replica, the sequences in flight and the speculation
budget (draft tokens verified per decoding sequence) over the run, with the RL
steps' boundaries, using matplotlib without a display, and writing the image
atomically (a crash mid-write leaves the earlier report, never half of one). Does
not know how the figures were produced.
"""

from __future__ import annotations

import io
from collections.abc import Mapping, Sequence
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt

from war.engine.stats import StepRecord
from war.outputs import write_bytes_atomic


def _smooth(values: Sequence[float], window: int) -> list[float]:
    out, acc = [], 0.0
    for i, v in enumerate(values):
        acc += v
        if i >= window:
            acc -= values[i - window]
        out.append(acc / min(i + 1, window))
    return out


def plot_timeline(
    timelines: Mapping[str, Sequence[StepRecord]],
    step_bounds: Sequence[tuple[float, float]],
    path: str | Path,
    title: str = "WAR rollout",
    empty_note: str = "no engine steps in this run",
) -> Path:
    """Writes the two-panel timeline to ``path`` (PNG) and returns it; ``empty_note`` is
    written across it when no timeline has a step."""
    origin = min([b[0] for b in step_bounds]
                 + [r[0].time_s - r[0].step_s for r in timelines.values() if r], default=0.0)
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(10, 6), sharex=True)
    for name, records in sorted(timelines.items()):
        if not records:
            continue
        t = [r.time_s - origin for r in records]
        inflight = [r.num_seqs + r.num_waiting for r in records]
        budget = [r.draft_tokens / r.num_decoding if r.num_decoding else 0.0 for r in records]
        window = max(1, len(records) // 200)
        top.plot(t, inflight, lw=1, label=name, drawstyle="steps-post")
        bottom.plot(t, _smooth(budget, window), lw=1, label=name)
    for i, (a, b) in enumerate(step_bounds):
        for ax in (top, bottom):
            ax.axvspan(a - origin, b - origin, color="0.9" if i % 2 else "0.95", zorder=0)
        top.text(a - origin, 0.98, f" step {i}", va="top", fontsize=8, color="0.4",
                 transform=top.get_xaxis_transform())
    top.set_ylabel("sequences in flight")
    bottom.set_ylabel("draft tokens / decoding seq")
    bottom.set_xlabel("seconds")
    top.set_title(title)
    if top.get_legend_handles_labels()[0]:
        top.legend(loc="upper right", fontsize=8)
    else:  # (a resumed run whose trajectories were all written before: no engine steps)
        top.text(0.5, 0.5, empty_note, ha="center", va="center",
                 transform=top.transAxes, color="0.4")
    fig.tight_layout()
    out = Path(path)
    image = io.BytesIO()
    try:
        # (the format from the name, as savefig(path) would; PNG without a suffix)
        fig.savefig(image, format=out.suffix[1:].lower() or "png", dpi=110)
    finally:
        plt.close(fig)
    write_bytes_atomic(out, image.getvalue())
    return out


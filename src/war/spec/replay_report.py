"""Metrics of a trace replay: the report and the recorder that gathers it.

Knows: the counters and latency samples of one replay, how to merge replays of
several files, and how to turn them into a `ReplayReport` (JSON-ready). Does not
know how a replay runs (`war.spec.replay`) or what a speculator is.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, fields

import numpy as np


@dataclass(frozen=True)
class ReplayReport:
    """Metrics of one replay (see the module docstring for the two passes).

    Latencies are wall-clock microseconds (`time.perf_counter_ns`), percentiles over calls.
    `per_file` holds the same report for each trace file when the replay was split by file
    (`replay_by_file`); this report is then their sum (counters added, latency samples
    pooled, memory and cached tokens added).
    """

    num_trajectories: int
    num_turns: int
    num_steps: int  # decoding steps = propose calls of the sequential pass
    num_prompt_tokens: int
    num_generated_tokens: int  # response tokens, all of them generated
    num_proposed_tokens: int  # draft tokens proposed, every token of tree drafts
    num_accepted_tokens: int  # draft tokens accepted (bonus tokens not included)
    tokens_per_step: float  # generated / steps
    acceptance_rate: float  # accepted / proposed
    mean_draft_len: float  # proposed / steps, empty drafts included
    source_steps: Mapping[str, int]  # steps whose draft came from each source
    source_accepted: Mapping[str, int]  # accepted draft tokens by source
    propose_us_p50: float  # one sequence per call
    propose_us_p99: float
    append_us_p50: float  # extend
    append_us_p99: float
    response_end_us_p50: float  # end_response: the response enters the history
    response_end_us_p99: float
    turn_start_us_p50: float  # new_turn: the next prompt's new tokens appended
    turn_start_us_p99: float
    finish_us_p50: float
    finish_us_p99: float
    memory_bytes: int  # memory_bytes() after the sequential pass
    num_cached_tokens: int  # num_cached_tokens after the sequential pass
    bytes_per_cached_token: float  # 0.0 when nothing is cached
    max_batch: int  # the batch asked for (64 by default); keys the batched latencies
    batch_size: int  # sequences per call of the full batches the latencies below come from
    num_full_batch_calls: int  # batched propose calls with `batch_size` sequences
    mean_batch: float  # mean sequences per batched propose call, all calls
    propose_us_p50_batched: float  # full-batch call time / batch_size
    propose_us_p99_batched: float
    tokens_per_step_batched: float
    acceptance_rate_batched: float
    seconds: float  # wall time of both passes
    per_file: Mapping[str, ReplayReport] = field(default_factory=dict)

    def to_dict(self) -> dict[str, object]:
        """JSON-ready dict; the batched latencies are keyed `propose_us_p50_batched{B}`
        with B = `max_batch` (`..._batched64` by default); `batch_size` says how many
        sequences the measured calls held (fewer when there are fewer trajectories)."""
        out: dict[str, object] = {}
        for f in fields(self):
            value = getattr(self, f.name)
            if f.name == "per_file":
                value = {name: report.to_dict() for name, report in value.items()}
            elif isinstance(value, Mapping):
                value = dict(value)
            if f.name.startswith("propose_us_p") and f.name.endswith("_batched"):
                out[f"{f.name}{self.max_batch}"] = value
            else:
                out[f.name] = value
        return out


def ratios(report: ReplayReport, baseline: ReplayReport) -> dict[str, float | None]:
    """report / baseline for the headline metrics (None where the baseline is 0), keyed
    as in `ReplayReport.to_dict`."""
    keys = (
        "tokens_per_step",
        "acceptance_rate",
        "mean_draft_len",
        "propose_us_p50",
        "propose_us_p50_batched",
        "append_us_p50",
        "response_end_us_p50",
        "turn_start_us_p50",
        "bytes_per_cached_token",
        "tokens_per_step_batched",
    )
    out: dict[str, float | None] = {}
    for key in keys:
        a, b = float(getattr(report, key)), float(getattr(baseline, key))
        name = f"{key}{report.max_batch}" if key.endswith("_batched") else key
        out[name] = a / b if b else None
    return out


@dataclass
class Recorder:
    """Mutable counters and latency samples (ns) of one replay; `report()` freezes them."""

    num_trajectories: int = 0
    num_turns: int = 0
    num_steps: int = 0
    num_prompt_tokens: int = 0
    num_generated_tokens: int = 0
    num_proposed_tokens: int = 0
    num_accepted_tokens: int = 0
    source_steps: Counter[str] = field(default_factory=Counter)
    source_accepted: Counter[str] = field(default_factory=Counter)
    propose_ns: list[int] = field(default_factory=list)
    append_ns: list[int] = field(default_factory=list)
    response_end_ns: list[int] = field(default_factory=list)
    turn_start_ns: list[int] = field(default_factory=list)
    finish_ns: list[int] = field(default_factory=list)
    memory_bytes: int = 0
    num_cached_tokens: int = 0
    max_batch: int = 64  # the batch asked for
    batch_size: int = 0  # the full batch; batched_ns_per_seq holds its calls only
    batch_sizes: list[int] = field(default_factory=list)  # of every batched call
    batched_ns_per_seq: list[float] = field(default_factory=list)
    batched_steps: int = 0  # sequence-steps of the batched pass
    batched_proposed: int = 0
    batched_accepted: int = 0
    seconds: float = 0.0

    def merge(self, other: Recorder) -> None:
        """Adds `other`'s counters and samples; full-batch latencies are pooled only
        between equal full batches, the larger batch winning."""
        if other.batch_size > self.batch_size:
            self.batch_size, self.batched_ns_per_seq = other.batch_size, []
        if other.batch_size == self.batch_size:
            self.batched_ns_per_seq.extend(other.batched_ns_per_seq)
        for f in fields(self):
            if f.name in ("max_batch", "batch_size", "batched_ns_per_seq"):
                continue
            mine, theirs = getattr(self, f.name), getattr(other, f.name)
            if isinstance(mine, Counter):
                mine.update(theirs)  # keeps zero counts, unlike +=
            elif isinstance(mine, list):
                mine.extend(theirs)
            else:
                setattr(self, f.name, mine + theirs)

    def report(self, per_file: Mapping[str, ReplayReport] | None = None) -> ReplayReport:
        steps, batched_steps = self.num_steps, self.batched_steps
        return ReplayReport(
            num_trajectories=self.num_trajectories,
            num_turns=self.num_turns,
            num_steps=steps,
            num_prompt_tokens=self.num_prompt_tokens,
            num_generated_tokens=self.num_generated_tokens,
            num_proposed_tokens=self.num_proposed_tokens,
            num_accepted_tokens=self.num_accepted_tokens,
            tokens_per_step=_ratio(self.num_generated_tokens, steps),
            acceptance_rate=_ratio(self.num_accepted_tokens, self.num_proposed_tokens),
            mean_draft_len=_ratio(self.num_proposed_tokens, steps),
            source_steps=dict(sorted(self.source_steps.items())),
            source_accepted=dict(sorted(self.source_accepted.items())),
            propose_us_p50=_us(self.propose_ns, 50),
            propose_us_p99=_us(self.propose_ns, 99),
            append_us_p50=_us(self.append_ns, 50),
            append_us_p99=_us(self.append_ns, 99),
            response_end_us_p50=_us(self.response_end_ns, 50),
            response_end_us_p99=_us(self.response_end_ns, 99),
            turn_start_us_p50=_us(self.turn_start_ns, 50),
            turn_start_us_p99=_us(self.turn_start_ns, 99),
            finish_us_p50=_us(self.finish_ns, 50),
            finish_us_p99=_us(self.finish_ns, 99),
            memory_bytes=self.memory_bytes,
            num_cached_tokens=self.num_cached_tokens,
            bytes_per_cached_token=_ratio(self.memory_bytes, self.num_cached_tokens),
            max_batch=self.max_batch,
            batch_size=self.batch_size,
            num_full_batch_calls=len(self.batched_ns_per_seq),
            mean_batch=_ratio(sum(self.batch_sizes), len(self.batch_sizes)),
            propose_us_p50_batched=_us(self.batched_ns_per_seq, 50),
            propose_us_p99_batched=_us(self.batched_ns_per_seq, 99),
            tokens_per_step_batched=_ratio(self.num_generated_tokens, batched_steps),
            acceptance_rate_batched=_ratio(self.batched_accepted, self.batched_proposed),
            seconds=self.seconds,
            per_file=dict(per_file or {}),
        )


def _ratio(a: float, b: float) -> float:
    return a / b if b else 0.0


def _us(samples_ns: Sequence[float], q: float) -> float:
    return float(np.percentile(samples_ns, q)) / 1e3 if samples_ns else 0.0

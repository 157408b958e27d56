"""Replay harness: decodes recorded trajectories with a speculator and measures it.

The harness plays an inference engine whose target model always emits the recorded
response. Each decoding step asks the speculator for a draft (`propose`), verifies it
against the real continuation, emits the accepted draft tokens plus one bonus token (the
target model's own next token; none once the response is complete), and feeds them back
(`extend`). Between turns it hands over the next prompt delta (`new_turn`); at the end of
a trajectory it calls `finish`, which moves the last response into history.

A trajectory's RL step is the number of trajectories of the same task before it in the
replay order (in trial-major order: its round); the speculator is told with
`observe_step` whenever that grows, so history windows behave as in training.

Two passes over the same trajectories, each with a fresh speculator:

* sequential: one trajectory at a time, one sequence per `propose` call; gives the
  acceptance metrics and the latency of single calls, `extend`, `new_turn`, `finish`,
  and memory per cached token at the end;
* batched: `batch_size` trajectories at a time in lockstep, one `propose` call per engine
  step for every live sequence; gives the latency per sequence of batched calls (call
  time / number of sequences in the call) and the acceptance seen when siblings run
  concurrently rather than one after another. A group shrinks as its trajectories end,
  so latency percentiles count only the calls with a full batch (`batch_size` sequences,
  or every trajectory when there are fewer): a tail of small batches would otherwise
  measure per-call overhead rather than batching.

This module knows the `Speculator` protocol below (which `war.spec.SuffixSpeculator`
implements), `war.spec.traces.Trajectory` and the two drafting modes' presets
(`MODES`). It knows nothing about trees, the native core or the trace file format, and
never builds a speculator itself: callers pass a factory, so tests can drive it with a
fake.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable, Hashable, Mapping, Sequence
from dataclasses import dataclass, field, fields
from typing import Protocol

import numpy as np

from war.spec.config import SpecConfig
from war.spec.traces import TokenArray, Trajectory


class DraftView(Protocol):
    """What the harness reads from a draft (`war.types.Draft` has these fields)."""

    @property
    def token_ids(self) -> Sequence[int]: ...  # in emission order
    @property
    def parents(self) -> Sequence[int]: ...  # -1 = attached to the context; parents[i] < i
    @property
    def source(self) -> str: ...  # "group" | "local" | "global" | "none"


class Speculator(Protocol):
    """The calls the harness makes (a subset of `war.spec.SuffixSpeculator`)."""

    def start(
        self, seq_id: int, prompt_ids: TokenArray, /, group_id: Hashable | None = None
    ) -> None: ...
    def extend(self, seq_id: int, token_ids: Sequence[int], /) -> None: ...
    def new_turn(self, seq_id: int, new_prompt_ids: TokenArray, /) -> None: ...
    def finish(self, seq_id: int, /) -> None: ...
    def observe_step(self, rl_step: int, /) -> None: ...
    def propose(self, seq_ids: Sequence[int], budgets: int | None, /) -> Sequence[DraftView]: ...
    def memory_bytes(self) -> int: ...
    @property
    def num_cached_tokens(self) -> int: ...


MODES = ("path", "tree")


def mode_config(mode: str) -> SpecConfig:
    """The tuned configuration of `mode` ("path" or "tree")."""
    return SpecConfig.for_mode(mode)


def baseline_config(mode: str, max_depth: int = 64) -> SpecConfig:
    """The published SuffixDecoding configuration of `mode`, for comparisons."""
    return SpecConfig.baseline(mode, max_depth=max_depth)


def accepted_len(
    token_ids: Sequence[int], parents: Sequence[int], target: Sequence[int], start: int
) -> int:
    """How many draft tokens the target model accepts when the real continuation is
    `target[start:]`: the length of the longest root path of the draft tree whose tokens
    equal the continuation. At each level the first child (in emission order) carrying
    the next real token is taken; for a chain this is the longest matching prefix.

    Raises ValueError for a malformed draft (lengths differ, or not parents[i] in [-1, i)).
    """
    if len(parents) != len(token_ids):
        raise ValueError(f"draft has {len(token_ids)} tokens but {len(parents)} parents")
    node, n, limit = -1, 0, len(target) - start
    # One pass suffices: a node's children all come after it in emission order.
    for i, (token, parent) in enumerate(zip(token_ids, parents, strict=True)):
        if not -1 <= parent < i:
            raise ValueError(f"draft parents[{i}] = {parent} is not in [-1, {i})")
        if n == limit:
            break
        if parent == node and token == target[start + n]:
            node, n = i, n + 1
    return n


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
    turn_start_us_p50: float  # new_turn
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
class _Recorder:
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

    def merge(self, other: _Recorder) -> None:
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


class _Cursor:
    """Where one trajectory's replay stands: turn index and position in its response."""

    __slots__ = ("pos", "response", "seq_id", "traj", "turn")

    def __init__(self, seq_id: int, traj: Trajectory) -> None:
        self.seq_id, self.traj, self.turn, self.pos = seq_id, traj, 0, 0
        self.response: list[int] = traj.turns[0].response.tolist()

    def step(self, draft: DraftView) -> tuple[int, list[int]]:
        """Verifies `draft`; returns (accepted draft tokens, tokens emitted this step)."""
        n = accepted_len(draft.token_ids, draft.parents, self.response, self.pos)
        end = min(self.pos + n + 1, len(self.response))  # + bonus token, if any left
        emitted = self.response[self.pos : end]
        self.pos = end
        return n, emitted

    @property
    def turn_done(self) -> bool:
        return self.pos == len(self.response)

    def next_turn(self) -> TokenArray | None:
        """Advances to the next turn and returns its prompt delta; None after the last."""
        self.turn += 1
        if self.turn == len(self.traj.turns):
            return None
        turn = self.traj.turns[self.turn]
        self.response, self.pos = turn.response.tolist(), 0
        return turn.prompt_delta


def rl_steps(trajectories: Sequence[Trajectory]) -> list[int]:
    """Each trajectory's RL step: how many trajectories of its task precede it."""
    seen: Counter[str] = Counter()
    steps = []
    for traj in trajectories:
        steps.append(seen[traj.task_id])
        seen[traj.task_id] += 1
    return steps


def _sequential(trajs: Sequence[Trajectory], spec: Speculator, budget: int | None) -> _Recorder:
    rec = _Recorder()
    clock = time.perf_counter_ns
    rl_step = 0
    for seq_id, (traj, step) in enumerate(zip(trajs, rl_steps(trajs), strict=True)):
        if not traj.turns:
            continue
        if step > rl_step:
            rl_step = step
            spec.observe_step(rl_step)
        rec.num_trajectories += 1
        rec.num_turns += len(traj.turns)
        rec.num_prompt_tokens += traj.num_prompt_tokens
        rec.num_generated_tokens += traj.num_response_tokens
        spec.start(seq_id, traj.turns[0].prompt_delta, group_id=traj.task_id)
        cur = _Cursor(seq_id, traj)
        while True:
            t0 = clock()
            draft = spec.propose([seq_id], budget)[0]
            t1 = clock()
            n, emitted = cur.step(draft)
            t2 = clock()
            spec.extend(seq_id, emitted)
            t3 = clock()
            rec.propose_ns.append(t1 - t0)
            rec.append_ns.append(t3 - t2)
            rec.num_steps += 1
            rec.num_proposed_tokens += len(draft.token_ids)
            rec.num_accepted_tokens += n
            rec.source_steps[draft.source] += 1
            rec.source_accepted[draft.source] += n
            if not cur.turn_done:
                continue
            prompt = cur.next_turn()
            t0 = clock()
            if prompt is None:
                spec.finish(seq_id)
                rec.finish_ns.append(clock() - t0)
                break
            spec.new_turn(seq_id, prompt)
            rec.turn_start_ns.append(clock() - t0)
    rec.memory_bytes = spec.memory_bytes()
    rec.num_cached_tokens = spec.num_cached_tokens
    return rec


def _batched(
    trajs: Sequence[Trajectory], spec: Speculator, budget: int | None, batch_size: int
) -> _Recorder:
    rec = _Recorder()
    clock = time.perf_counter_ns
    steps, rl_step = rl_steps(trajs), 0
    calls: list[tuple[int, float]] = []  # (sequences, ns per sequence) of every call
    for lo in range(0, len(trajs), batch_size):
        live = [
            _Cursor(seq_id, traj)
            for seq_id, traj in enumerate(trajs[lo : lo + batch_size], start=lo)
            if traj.turns
        ]
        for cur in live:
            if steps[cur.seq_id] > rl_step:
                rl_step = steps[cur.seq_id]
                spec.observe_step(rl_step)
            spec.start(cur.seq_id, cur.traj.turns[0].prompt_delta, group_id=cur.traj.task_id)
        while live:
            seq_ids = [cur.seq_id for cur in live]
            t0 = clock()
            drafts = spec.propose(seq_ids, budget)
            elapsed = clock() - t0
            if len(drafts) != len(live):
                raise ValueError(f"propose returned {len(drafts)} drafts for {len(live)} ids")
            calls.append((len(live), elapsed / len(live)))
            still_live: list[_Cursor] = []
            for cur, draft in zip(live, drafts, strict=True):
                n, emitted = cur.step(draft)
                spec.extend(cur.seq_id, emitted)
                rec.batched_steps += 1
                rec.batched_proposed += len(draft.token_ids)
                rec.batched_accepted += n
                if cur.turn_done:
                    prompt = cur.next_turn()
                    if prompt is None:
                        spec.finish(cur.seq_id)
                        continue
                    spec.new_turn(cur.seq_id, prompt)
                still_live.append(cur)
            live = still_live
    rec.batch_sizes = [n for n, _ in calls]
    rec.batch_size = max(rec.batch_sizes, default=0)
    rec.batched_ns_per_seq = [ns for n, ns in calls if n == rec.batch_size]
    return rec


def _replay(
    trajs: Sequence[Trajectory],
    make_speculator: Callable[[], Speculator],
    budget: int | None,
    batch_size: int,
) -> _Recorder:
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    if budget is not None and budget < 0:
        raise ValueError(f"budget must be >= 0 or None, got {budget}")
    t0 = time.perf_counter()
    rec = _sequential(trajs, make_speculator(), budget)
    batched = _batched(trajs, make_speculator(), budget, batch_size)
    rec.max_batch = batch_size
    rec.batch_size = batched.batch_size
    rec.batch_sizes = batched.batch_sizes
    rec.batched_ns_per_seq = batched.batched_ns_per_seq
    rec.batched_steps = batched.batched_steps
    rec.batched_proposed = batched.batched_proposed
    rec.batched_accepted = batched.batched_accepted
    rec.seconds = time.perf_counter() - t0
    return rec


def replay(
    trajectories: Sequence[Trajectory],
    make_speculator: Callable[[], Speculator],
    *,
    budget: int | None = None,
    batch_size: int = 64,
) -> ReplayReport:
    """Replays `trajectories` in the given order as one workload (module docstring).

    `make_speculator` is called once per pass; `budget` is passed to every `propose`
    (None = the speculator's own limit). Sequence ids are positions in `trajectories`;
    group ids are task ids. Trajectories without turns are skipped.
    """
    return _replay(trajectories, make_speculator, budget, batch_size).report()


def replay_by_file(
    trajectories: Sequence[Trajectory],
    make_speculator: Callable[[], Speculator],
    *,
    budget: int | None = None,
    batch_size: int = 64,
) -> ReplayReport:
    """Replays each trace file's trajectories as its own workload (fresh speculators, the
    given order kept within each file) and returns their sum, with `per_file` filled in.
    A file's numbers thus do not depend on which other files were replayed."""
    by_file: dict[str, list[Trajectory]] = {}
    for traj in trajectories:
        by_file.setdefault(traj.file, []).append(traj)
    total = _Recorder(max_batch=batch_size)
    per_file: dict[str, ReplayReport] = {}
    for name, trajs in by_file.items():
        rec = _replay(trajs, make_speculator, budget, batch_size)
        per_file[name] = rec.report()
        total.merge(rec)
    return total.report(per_file)

"""Replay harness: decodes recorded trajectories with a speculator and measures it.

The harness plays an inference engine whose target model always emits the recorded
response. Each decoding step asks the speculator for a draft (`propose`), verifies it
against the real continuation, emits the accepted draft tokens plus one bonus token (the
target model's own next token; none once the response is complete), and feeds them back
(`extend`). When a response is complete it says so (`end_response`: the response enters
the history, as an engine does when a turn's generation stops); the next turn then hands
over only its prompt delta (`new_turn`), and the end of a trajectory calls `finish`.

A trajectory's RL step is the number of trajectories of the same task before it in the
replay order (in trial-major order: its round); the speculator is told with
`observe_step` whenever that grows, so history windows behave as in training.

Two passes over the same trajectories, each with a fresh speculator:

* sequential: one trajectory at a time, one sequence per `propose` call; gives the
  acceptance metrics and the latency of single calls, `extend`, `end_response`,
  `new_turn` (a turn's start), `finish`,
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
from collections.abc import Callable, Hashable, Sequence
from typing import Protocol

from war.spec.config import SpecConfig
from war.spec.replay_report import Recorder, ReplayReport, ratios
from war.spec.traces import TokenArray, Trajectory

__all__ = [
    "MODES",
    "ReplayReport",
    "accepted_len",
    "baseline_config",
    "mode_config",
    "ratios",
    "replay",
    "replay_by_file",
    "rl_steps",
]


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
    def end_response(self, seq_id: int, /) -> None: ...
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
    if not 0 <= start <= len(target):
        raise ValueError(f"start {start} is not in [0, {len(target)}]")
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


def _sequential(trajs: Sequence[Trajectory], spec: Speculator, budget: int | None) -> Recorder:
    rec = Recorder()
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
            t0 = clock()
            spec.end_response(seq_id)
            rec.response_end_ns.append(clock() - t0)
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
) -> Recorder:
    rec = Recorder()
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
                    spec.end_response(cur.seq_id)
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
) -> Recorder:
    _check_args(budget, batch_size)
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


def _check_args(budget: int | None, batch_size: int) -> None:
    if not isinstance(batch_size, int) or isinstance(batch_size, bool) or batch_size < 1:
        raise ValueError(f"batch_size must be an int >= 1, got {batch_size!r}")
    if budget is not None and (
        not isinstance(budget, int) or isinstance(budget, bool) or budget < 0
    ):
        raise ValueError(f"budget must be an int >= 0 or None, got {budget!r}")


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
    _check_args(budget, batch_size)  # (also when there is no file to replay)
    by_file: dict[str, list[Trajectory]] = {}
    for traj in trajectories:
        by_file.setdefault(traj.file, []).append(traj)
    total = Recorder(max_batch=batch_size)
    per_file: dict[str, ReplayReport] = {}
    for name, trajs in by_file.items():
        rec = _replay(trajs, make_speculator, budget, batch_size)
        per_file[name] = rec.report()
        total.merge(rec)
    return total.report(per_file)

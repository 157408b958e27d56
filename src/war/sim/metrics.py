"""What a simulation measured: per RL step, per run, and the makespan's lower bound.

Knows: the metrics of ``DESIGN.md`` (tokens/step, acceptance, makespan, throughput,
prefix-cache hit rate, the lower bound of a step's makespan and the ratio to it),
per-turn records of each trajectory (``TurnRecord``), the fleet timeline (in-flight
requests and speculation budget per time bin) and how to summarise a run. Does not
know the event loop; ``war.sim.simulator`` fills these in.

Lower bound of a step's makespan: ``max(work / fleet capacity, the longest
trajectory's sequential time, KV occupancy / fleet KV, the work with what the gaps
between turns keep)``, for the run's own speculation quality:

* capacity of a replica: the best over every batch size ``b`` up to ``max_num_seqs``
  that the KV holds of ``b * tau / step_time(b, ...)``, with ``tau`` the run's tokens
  per sampling pass and ``k`` its mean verified drafts per pass (a fractional mean is
  the mix of its two whole neighbours, ``decode_step_time``). A sequence's context is
  the step's mean less the first tokens it shares with others (a group's first prompt,
  or a system prompt every task has: ``shared_prefix_lens``), which the batch holds
  once; where the KV holds part of one more sequence, the mix of the two batch sizes
  that fills it. Work: the step's generated tokens at that capacity, and its prompt
  tokens (less what a group's samples share of their first prompt) at the least they
  add riding along those decoding steps (chunked prefill, spread over them) or in
  chunks of their own (``prefill_time_bound``).
* a trajectory's sequential time: its tool latencies, plus per turn the prefill of
  its new prompt tokens alone and its sampling passes at batch 1 (with its own mean
  verified drafts per pass).
* KV occupancy: a sequence keeps its context's KV resident while it runs, so the
  fleet's KV tokens times the makespan hold at least, summed over turns, the turn's
  context (less its shared first tokens) times its time alone (prefill chunk by chunk,
  each chunk holding the context before it; each sampling pass holding the context and
  prompt). Tool calls count nothing (a context may leave the KV meanwhile). This term
  binds when contexts are long for the KV (tens of thousands of tokens per
  trajectory): a replica then cannot run enough trajectories at once to reach its
  compute capacity.
* the gaps between turns (``hold_time``): across a tool call a trajectory's context
  either stays in a KV for the whole latency, leaving less of the KV to decode with,
  or is computed again, adding prompt work. The work term at the KV left beside the
  held token-seconds (their mean over the makespan), plus what is recomputed, for the
  best such choice. It binds when contexts are long, the KV holds few of them and
  recomputing a context costs more than a short wait.

The terms use per-turn and per-step means, so the bound is an estimate: a step can
end up to about 1 % before it (``tests/sim/test_bound.py`` checks that on small
fleets of every kind).
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from war.sim.costs import CostModel
from war.sim.kvcache import common_prefix_len
from war.sim.workload import SimTrajectory, Tokens


@dataclass(frozen=True, slots=True)
class TurnRecord:
    """A completed turn: context before its new prompt, new prompt and response
    lengths, sampling passes and verified draft tokens, and the latency after it."""

    context: int
    prompt: int
    response: int
    passes: int
    drafted: int
    tool_s: float


@dataclass
class StepMetrics:
    """One synchronous RL step."""

    rl_step: int
    start: float
    end: float = 0.0
    trajectories: int = 0
    generated: int = 0
    passes: int = 0
    drafted: int = 0
    accepted: int = 0
    context_sum: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    work_s: float = 0.0
    longest_s: float = 0.0
    kv_s: float = 0.0
    hold_s: float = 0.0
    finish_times: list[float] = field(default_factory=list)  # trajectories, from start

    @property
    def makespan(self) -> float:
        return self.end - self.start

    @property
    def lower_bound(self) -> float:
        return max(self.work_s, self.longest_s, self.kv_s, self.hold_s)


def prefill_time(cost: CostModel, tokens: int, context: int, chunk: int) -> float:
    """Seconds to prefill ``tokens`` new tokens after ``context`` alone, in chunks."""
    t, done = 0.0, 0
    while done < tokens:
        n = min(chunk, tokens - done)
        done += n
        t += cost.step_time(1, n, context + done, 0)
    return t


def decode_step_time(cost: CostModel, num_seqs: int, k: float, context: float,
                     prompt_tokens: int = 0) -> float:
    """Seconds of a decoding step of ``num_seqs`` sequences verifying ``k`` draft tokens
    each on average (``context``: their KV, this step's tokens included), with
    ``prompt_tokens`` of prefill riding along. Passes verify whole numbers of drafts, so
    a fractional mean is the mix of its two neighbours that has that mean: the cost at
    ``floor(k)`` and ``floor(k) + 1``, linearly interpolated (rounding the mean instead
    charged, or spared, every pass up to half a draft token: up to 6 % of a lone
    trajectory's time where drafts cost real step time)."""
    k0 = math.floor(k)
    w = k - k0

    def at(kk: int) -> float:
        # the KV of this neighbour's drafts, not the mean's, and the riding prompt's
        ctx = max(1, int(context + num_seqs * (kk - k) + prompt_tokens + 0.5))
        return cost.step_time(num_seqs, num_seqs * (1 + kk) + prompt_tokens, ctx,
                              num_seqs * kk)

    t = at(k0)
    return t if w == 0.0 else (1.0 - w) * t + w * at(k0 + 1)


def sequential_time(turns: Sequence[TurnRecord], cost: CostModel, chunk: int) -> float:
    """A trajectory's time alone on a replica (module docstring)."""
    total = 0.0
    for i, r in enumerate(turns):
        k = r.drafted / r.passes if r.passes else 0.0
        ctx = r.context + r.prompt + r.response // 2
        total += prefill_time(cost, r.prompt, r.context, chunk)
        total += max(r.passes - 1, 0) * decode_step_time(cost, 1, k, ctx + 1 + k)
        if i < len(turns) - 1:
            total += r.tool_s
    return total


def kv_token_seconds(turns: Sequence[TurnRecord], cost: CostModel, chunk: int,
                     shared: int = 0) -> float:
    """KV tokens times seconds that a trajectory's turns hold at least (module
    docstring): each turn alone, its tool calls excluded. ``shared``: the length of the
    context's first tokens that other trajectories hold too (``shared_prefix_lens``): a
    replica keeps one copy of them for all, so they are not counted here."""
    total = 0.0
    for r in turns:
        k = r.drafted / r.passes if r.passes else 0.0
        done = 0
        while done < r.prompt:
            n = min(chunk, r.prompt - done)
            held = max(0, r.context + done - shared)
            total += held * cost.step_time(1, n, r.context + done + n, 0)
            done += n
        ctx = r.context + r.prompt
        mid = ctx + r.response // 2 + 1 + k
        total += max(r.passes - 1, 0) * max(0, ctx - shared) * decode_step_time(cost, 1, k, mid)
    return total


def replica_capacity(cost: CostModel, tau: float, k: float, context: float, kv_tokens: int,
                     max_num_seqs: int, shared: float = 0.0, shared_once: int = 0) -> float:
    """Generated tokens per second of one replica at its best batch size: every size
    from 1 to ``max_num_seqs`` whose sequences' KV fits. ``context``: a sequence's mean
    context; ``shared``: how many of those tokens, on average, it shares with others
    (first prompts), which the replica stores once for the whole batch, taking
    ``shared_once`` tokens (attention still reads them for each sequence: the step's
    cost counts the whole context)."""
    return _best_batch(cost, tau, k, context, kv_tokens, max_num_seqs, shared,
                       shared_once)[0]


def _best_batch(cost: CostModel, tau: float, k: float, context: float, kv_tokens: float,
                max_num_seqs: int, shared: float, shared_once: int, partial: bool = False,
                ) -> tuple[float, int, float]:
    """(rate, batch size, the batch's context read) of ``replica_capacity``. With
    ``partial``, a KV that holds less than one sequence runs one that fraction of the
    time (without it, one sequence always runs: the full KV of a replica holds every
    turn the simulator lets run)."""
    read = context + 1 + k  # a sequence's KV that a step reads
    own = max(0.0, read - shared)  # and stores beside the shared prefixes
    if partial and own + shared_once > kv_tokens:
        frac = max(0.0, kv_tokens - shared_once) / (own if own > 0 else 1.0)
        return frac * tau / decode_step_time(cost, 1, k, read), 1, read
    best = (0.0, 1, read)
    for b in range(1, max_num_seqs + 1):
        if b > 1 and b * own + shared_once > kv_tokens:
            # Where the KV holds b - 1 such sequences and a part of one more, a replica
            # alternates steps of b - 1 and b of them (contexts differ, the mean is what
            # is known): the mix whose mean fills the KV, each step's time interpolated.
            n = b - 1
            frac = (kv_tokens - shared_once) / own - n if own > 0 else 0.0
            if frac > 0:
                t0 = decode_step_time(cost, n, k, n * read)
                t1 = decode_step_time(cost, b, k, b * read)
                rate = (n + frac) * tau / ((1.0 - frac) * t0 + frac * t1)
                if rate > best[0]:
                    best = (rate, n, n * read)
            break
        rate = b * tau / decode_step_time(cost, b, k, b * read)
        if rate > best[0]:
            best = (rate, b, b * read)
    return best


def prefill_time_bound(cost: CostModel, num_seqs: int, k: float, context: float,
                       chunk: int, tokens: int, steps: float) -> float:
    """The least time ``tokens`` prompt tokens add to ``steps`` decoding steps of
    ``num_seqs`` sequences (``k`` drafts each, ``context`` tokens of KV read): they ride
    along those steps (chunked prefill), at most the room a step has left under
    ``chunk`` tokens each, every step adding its growth; what does not fit fills steps
    of its own. Spread evenly, ``tokens / steps`` a step, is the least for a step time
    convex in its tokens (a roofline); larger pieces in fewer steps are tried too (a
    profile whose first tokens cost more), and the cheaper of riding and a step alone
    is taken for each size."""
    if tokens <= 0:
        return 0.0
    base = decode_step_time(cost, num_seqs, k, context)
    room = max(0, chunk - int(num_seqs * (1 + k) + 0.5))

    def riding(x: int) -> float:  # seconds x prompt tokens add to one decoding step
        return max(0.0, decode_step_time(cost, num_seqs, k, context, x) - base)

    def per_token(least: int, most: int) -> float:  # cheapest mean over piece sizes
        best, x = math.inf, max(1, least)
        while True:
            x = min(x, most)
            best = min(best, riding(x) / x, cost.step_time(1, x, x, 0) / x)
            if x == most:
                return best
            x *= 2

    alone = min(cost.step_time(1, x, x, 0) / x for x in {chunk, max(1, chunk // 2)})
    if room == 0:
        return tokens * alone
    along = min(tokens, steps * room)  # what the decoding steps can carry
    least = math.ceil(along / steps) if steps > 0 else room
    return along * per_token(min(least, room), room) + (tokens - along) * alone


def shared_prefix_lens(trajs: Sequence[SimTrajectory]) -> list[int]:
    """Per trajectory of a step: how many of its first prompt's first tokens another
    trajectory of the step has too (a prefix cache holds them once): its group's common
    first prompt, or every trajectory's (a system prompt that all tasks share), the
    longer; 0 for a trajectory that shares nothing."""
    firsts = [t.turns[0].prompt if t.turns else () for t in trajs]
    if len(firsts) < 2:
        return [0] * len(firsts)
    out = [_common_prefix(firsts)] * len(trajs)
    by_group: dict[str, list[int]] = {}
    for i, t in enumerate(trajs):
        by_group.setdefault(t.group_id, []).append(i)
    for members in by_group.values():
        if len(members) > 1:
            n = _common_prefix([firsts[i] for i in members])
            for i in members:
                out[i] = max(out[i], n)
    return out


def _common_prefix(prompts: Sequence[Tokens]) -> int:
    """How many first tokens all of ``prompts`` (at least one) have in common."""
    first, n = prompts[0], min(len(p) for p in prompts)
    for p in prompts[1:]:
        n = common_prefix_len(first, p, 0, n)
    return n


def min_prefill_tokens(trajs: Sequence[SimTrajectory]) -> int:
    """Prompt tokens of ``trajs`` less what each group's samples share of their first
    prompt (computed once per group at best)."""
    total = 0
    firsts: dict[str, list[Tokens]] = {}
    for t in trajs:
        total += sum(len(u.prompt) for u in t.turns)
        firsts.setdefault(t.group_id, []).append(t.turns[0].prompt)
    for prompts in firsts.values():
        total -= (len(prompts) - 1) * _common_prefix(prompts)
    return total


def work_time(m: StepMetrics, prefill_tokens: int, cost: CostModel, kv_tokens: float,
              max_num_seqs: int, chunk: int, num_replicas: int, shared_sum: int = 0,
              shared_min: int = 0, partial: bool = False) -> float:
    """The step's work over the fleet's capacity (module docstring). ``shared_sum``: the
    shared first tokens (``shared_prefix_lens``) summed over the step's sampling passes,
    ``shared_min``: the least a trajectory that shares any shares (a batch of them holds
    at least that once). ``partial``: see ``_best_batch`` (a KV of less than one
    sequence gives a capacity below one sequence's rate; infinite time at none)."""
    if m.passes == 0:
        return 0.0
    tau = m.generated / m.passes
    k = m.drafted / m.passes
    mean = m.context_sum / m.passes
    cap, b, ctx = _best_batch(cost, tau, k, mean, kv_tokens, max_num_seqs,
                              shared_sum / m.passes, shared_min, partial)
    prefill = prefill_time_bound(cost, b, k, ctx, chunk, prefill_tokens, m.passes / b)
    # (a step whose turns all have empty responses generates nothing: cap is 0 then)
    if m.generated and cap <= 0.0:
        return math.inf
    generate = m.generated / cap if m.generated else 0.0
    return (generate + prefill) / num_replicas


HOLD_GRID = 32
"""Cut points of ``hold_time``'s search over which contexts to recompute."""


def hold_time(m: StepMetrics, prefill_tokens: int, cost: CostModel, kv_tokens: int,
              max_num_seqs: int, chunk: int, num_replicas: int,
              gaps: Sequence[tuple[int, float]], shared_sum: int = 0,
              shared_min: int = 0) -> float:
    """The work term with what the turns' gaps take (module docstring): the least
    makespan ``T`` for which some choice of which gaps' contexts to recompute has
    ``work(KV less the held contexts' mean) + recompute <= T``.

    ``gaps``: per gap between two turns of a trajectory, the context its next turn
    needs (less its shared first tokens) and the tool latency between them. Across a
    gap a context is either resident for the whole latency (a replica's KV over the
    step holds, besides its decoding sequences, ``tokens * seconds`` of it, which
    leaves a mean of ``KV - held / T`` tokens for decoding) or recomputed (its tokens
    prefilled again: prompt tokens of the work term). Recomputing the gaps of the
    longest latencies first frees the most KV per recomputed token; the search tries
    ``HOLD_GRID`` cut points in that order and, between two of them, charges the larger
    saving with the smaller recompute, so its value is never above the best fractional
    choice. Capacity is taken at the mean free KV (the rate is
    concave in the KV: a time-varying split does no better). ``T`` is found by
    bisection: the condition only gets easier as ``T`` grows."""
    gaps = sorted(((n, s) for n, s in gaps if n > 0 and s > 0), key=lambda g: -g[1])

    def work(kv: float, extra: int = 0) -> float:
        return work_time(m, prefill_tokens + extra, cost, kv, max_num_seqs, chunk,
                         num_replicas, shared_sum, shared_min, partial=True)

    base = work(kv_tokens)
    if not gaps or m.passes == 0:
        return base
    # token-seconds per replica still held, and tokens recomputed, when the first j
    # gaps' contexts are recomputed
    held, recomputed = [sum(n * s for n, s in gaps) / num_replicas], [0]
    for n, s in gaps:
        held.append(max(0.0, held[-1] - n * s / num_replicas))
        recomputed.append(recomputed[-1] + n)
    held[-1] = 0.0
    cuts = sorted({round(i * len(gaps) / HOLD_GRID) for i in range(HOLD_GRID + 1)})

    def feasible(t: float) -> bool:
        # between cuts a < b: no more KV held than at b, no more recomputed than at a
        return any(work(kv_tokens - held[b] / t, recomputed[a]) <= t
                   for a, b in itertools.pairwise(cuts))

    hi = work(kv_tokens, recomputed[-1])  # every context recomputed: the full KV decodes
    lo = base
    if hi <= lo or not feasible(hi):
        return lo
    for _ in range(40):
        mid = (lo + hi) / 2
        if feasible(mid):
            hi = mid
        else:
            lo = mid
        if hi - lo <= 1e-6 * hi:
            break
    return lo


@dataclass
class Timeline:
    """Per bin of ``width`` seconds: requests in flight (last seen), draft tokens
    verified and sequences decoded (sums over the fleet's steps)."""

    width: float
    bins: dict[int, list[float]] = field(default_factory=dict)

    def record(self, now: float, in_flight: int, drafted: int, decodes: int) -> None:
        b = self.bins.setdefault(int(now // self.width), [0.0, 0.0, 0.0])
        b[0] = in_flight
        b[1] += drafted
        b[2] += decodes

    def series(self) -> dict[str, list[float]]:
        keys = sorted(self.bins)
        return {
            "t": [k * self.width for k in keys],
            "in_flight": [self.bins[k][0] for k in keys],
            "budget_per_seq": [self.bins[k][1] / self.bins[k][2] if self.bins[k][2] else 0.0
                               for k in keys],
        }


@dataclass
class SimResult:
    """A run's metrics (``summary()`` for reports)."""

    steps: list[StepMetrics]
    migrations: int = 0  # turns that left the replica holding their trajectory's KV
    policy_migrations: int = 0  # turns the policy flagged as migrated
    preemptions: int = 0
    replica_steps: int = 0
    timeline: Timeline | None = None
    truncated: int = 0  # trajectories cut before a turn that the KV cannot hold
    dropped: int = 0  # trajectories whose first turn the KV cannot hold: left out

    def summary(self) -> dict[str, Any]:
        s = self.steps
        gen = sum(m.generated for m in s)
        span = sum(m.makespan for m in s)
        passes = sum(m.passes for m in s)
        drafted = sum(m.drafted for m in s)
        prompt = sum(m.prompt_tokens for m in s)
        # A step whose every trajectory was left out (beyond the KV) has neither a
        # makespan nor a bound: the means are over the steps that ran something.
        ran = [m for m in s if m.trajectories]
        bounded = [m for m in ran if m.lower_bound > 0]
        return {
            "throughput": gen / span if span > 0 else 0.0,
            "makespan_s": span / len(ran) if ran else 0.0,
            "lower_bound_ratio": (sum(m.makespan / m.lower_bound for m in bounded)
                                  / len(bounded) if bounded else 0.0),
            "prefix_hit_rate": sum(m.cached_tokens for m in s) / prompt if prompt else 0.0,
            "tokens_per_step": gen / passes if passes else 0.0,
            "acceptance_rate": sum(m.accepted for m in s) / drafted if drafted else 0.0,
            "spec_tokens_per_pass": drafted / passes if passes else 0.0,
            "migrations": self.migrations, "policy_migrations": self.policy_migrations,
            "preemptions": self.preemptions, "generated_tokens": gen,
            "trajectories": sum(m.trajectories for m in s), "replica_steps": self.replica_steps,
            "truncated_trajectories": self.truncated, "dropped_trajectories": self.dropped,
            "steps": [{"makespan_s": m.makespan, "lower_bound_s": m.lower_bound,
                       "work_s": m.work_s, "longest_s": m.longest_s, "kv_s": m.kv_s,
                       "hold_s": m.hold_s, "generated": m.generated} for m in s],
        }

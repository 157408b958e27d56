"""What a simulation measured: per RL step, per run, and the makespan's lower bound.

Knows: the metrics of ``DESIGN.md`` (tokens/step, acceptance, makespan, throughput,
prefix-cache hit rate, the lower bound of a step's makespan and the ratio to it),
per-turn records of each trajectory (``TurnRecord``), the fleet timeline (in-flight
requests and speculation budget per time bin) and how to summarise a run. Does not
know the event loop; ``war.sim.simulator`` fills these in.

Lower bound of a step's makespan: ``max(work / fleet capacity, the longest
trajectory's sequential time, KV occupancy / fleet KV)``, for the run's own
speculation quality:

* capacity of a replica: the best over batch sizes ``b`` (that the KV holds at the
  step's mean context ``c``) of ``b * tau / step_time(b, b(1+k), b(c+1+k))``, with
  ``tau`` the run's tokens per sampling pass and ``k`` its verified drafts per pass;
  prefill at ``max_num_batched_tokens`` per step. Work: the step's generated tokens,
  and its prompt tokens less what a group's samples share of their first prompt.
* a trajectory's sequential time: its tool latencies, plus per turn the prefill of
  its new prompt tokens alone and its sampling passes at batch 1 (with its own
  verified drafts per pass).
* KV occupancy: a sequence keeps its context's KV resident while it runs, so the
  fleet's KV tokens times the makespan hold at least, summed over turns, the turn's
  context times its time alone (prefill chunk by chunk, each chunk holding the
  context before it; each sampling pass holding the context and prompt). Tool calls
  count nothing (a context may leave the KV meanwhile). This term binds when
  contexts are long for the KV (tens of thousands of tokens per trajectory): a
  replica then cannot run enough trajectories at once to reach its compute capacity.
"""

from __future__ import annotations

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
    finish_times: list[float] = field(default_factory=list)  # trajectories, from start

    @property
    def makespan(self) -> float:
        return self.end - self.start

    @property
    def lower_bound(self) -> float:
        return max(self.work_s, self.longest_s, self.kv_s)


def prefill_time(cost: CostModel, tokens: int, context: int, chunk: int) -> float:
    """Seconds to prefill ``tokens`` new tokens after ``context`` alone, in chunks."""
    t, done = 0.0, 0
    while done < tokens:
        n = min(chunk, tokens - done)
        done += n
        t += cost.step_time(1, n, context + done, 0)
    return t


def sequential_time(turns: Sequence[TurnRecord], cost: CostModel, chunk: int) -> float:
    """A trajectory's time alone on a replica (module docstring)."""
    total = 0.0
    for i, r in enumerate(turns):
        k = round(r.drafted / r.passes) if r.passes else 0
        ctx = r.context + r.prompt + r.response // 2
        total += prefill_time(cost, r.prompt, r.context, chunk)
        total += max(r.passes - 1, 0) * cost.step_time(1, 1 + k, ctx + 1 + k, k)
        if i < len(turns) - 1:
            total += r.tool_s
    return total


def kv_token_seconds(turns: Sequence[TurnRecord], cost: CostModel, chunk: int) -> float:
    """KV tokens times seconds that a trajectory's turns hold at least (module
    docstring): each turn alone, its tool calls excluded."""
    total = 0.0
    for r in turns:
        k = round(r.drafted / r.passes) if r.passes else 0
        done = 0
        while done < r.prompt:
            n = min(chunk, r.prompt - done)
            total += (r.context + done) * cost.step_time(1, n, r.context + done + n, 0)
            done += n
        ctx = r.context + r.prompt
        mid = ctx + r.response // 2 + 1 + k
        total += max(r.passes - 1, 0) * ctx * cost.step_time(1, 1 + k, mid, k)
    return total


def replica_capacity(cost: CostModel, tau: float, k: int, context: float, kv_tokens: int,
                     max_num_seqs: int) -> float:
    """Generated tokens per second of one replica at its best batch size."""
    best, b = 0.0, 1
    while True:
        b = min(b, max_num_seqs)
        if b > 1 and b * (context + 1 + k) > kv_tokens:
            break
        ctx = int(b * (context + 1 + k))
        best = max(best, b * tau / cost.step_time(b, b * (1 + k), ctx, b * k))
        if b == max_num_seqs:
            break
        b *= 2
    return best


def min_prefill_tokens(trajs: Sequence[SimTrajectory]) -> int:
    """Prompt tokens of ``trajs`` less what each group's samples share of their first
    prompt (computed once per group at best)."""
    total = 0
    firsts: dict[str, list[Tokens]] = {}
    for t in trajs:
        total += sum(len(u.prompt) for u in t.turns)
        firsts.setdefault(t.group_id, []).append(t.turns[0].prompt)
    for prompts in firsts.values():
        first, n = prompts[0], min(len(p) for p in prompts)
        for p in prompts[1:]:
            n = common_prefix_len(first, p, 0, n)
        total -= (len(prompts) - 1) * n
    return total


def work_time(m: StepMetrics, prefill_tokens: int, cost: CostModel, kv_tokens: int,
              max_num_seqs: int, chunk: int, num_replicas: int) -> float:
    """The step's work over the fleet's capacity (module docstring)."""
    if m.passes == 0:
        return 0.0
    tau = m.generated / m.passes
    k = round(m.drafted / m.passes)
    cap = replica_capacity(cost, tau, k, m.context_sum / m.passes, kv_tokens, max_num_seqs)
    per_prefill = cost.step_time(1, chunk, chunk, 0) / chunk
    return (m.generated / cap + prefill_tokens * per_prefill) / num_replicas


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
        return {
            "throughput": gen / span if span > 0 else 0.0,
            "makespan_s": span / len(s) if s else 0.0,
            "lower_bound_ratio": (sum(m.makespan / m.lower_bound for m in s) / len(s)
                                  if s and all(m.lower_bound > 0 for m in s) else 0.0),
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
                       "generated": m.generated} for m in s],
        }

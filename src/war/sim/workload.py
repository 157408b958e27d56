"""Workloads of synchronous RL steps, built from agent traces.

Knows: what the simulator replays (``SimTrajectory``: turns of prompt tokens, the
response tokens the policy generates and the environment's latency after each
response; ``Workload``: the trajectories of each RL step), how tool latencies are
drawn (the traces carry no timestamps, so per gap between two assistant messages a
documented distribution per kind of message: ``LatencyModel``), and how RL steps are
cut from traces: each step samples ``tasks_per_step`` tasks, a task's trials are its
group's samples, and later steps take the next tasks so history accumulates across
steps without replaying a trajectory twice (``build_trace_steps``). Does not know
replicas, speculation or time beyond the latencies it draws.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from war.sim.acceptance import source_key
from war.spec.traces import (
    TraceRecord,
    TraceSource,
    Trajectory,
    load_records,
    load_tokenizer,
    tokenize,
)

Tokens = tuple[int, ...]


@dataclass(frozen=True, eq=False)
class SimTurn:
    """One request of a trajectory: the prompt tokens since the previous response, the
    response the policy generates, and the environment's latency after it."""

    prompt: Tokens
    response: Tokens
    tool_s: float


@dataclass(frozen=True, eq=False)
class SimTrajectory:
    """A trajectory to replay. ``source`` names its token stream (for cached
    acceptance: copies of one trace trajectory share it)."""

    traj_id: str
    group_id: str
    rl_step: int
    turns: tuple[SimTurn, ...]
    source: str

    @property
    def num_generated(self) -> int:
        return sum(len(t.response) for t in self.turns)


@dataclass(frozen=True)
class Workload:
    """The trajectories of each RL step, in order; ``reused`` counts samples that
    repeat a trace trajectory already used (0 for a clean workload)."""

    name: str
    steps: tuple[tuple[SimTrajectory, ...], ...]
    reused: int = 0

    @property
    def num_trajectories(self) -> int:
        return sum(len(s) for s in self.steps)

    def summary(self) -> dict[str, float | int | str]:
        trajs = [t for s in self.steps for t in s]
        return {
            "name": self.name, "rl_steps": len(self.steps), "trajectories": len(trajs),
            "groups": len({t.group_id for t in trajs}),
            "turns": sum(len(t.turns) for t in trajs),
            "generated_tokens": sum(t.num_generated for t in trajs),
            "prompt_tokens": sum(len(u.prompt) for t in trajs for u in t.turns),
            "tool_s": sum(u.tool_s for t in trajs for u in t.turns), "reused": self.reused,
        }


@dataclass(frozen=True)
class LatencyModel:
    """Latency of the messages between two responses: each ``tool`` message and each
    ``user`` message (tau-bench's simulated user is an LLM call) adds a lognormal
    draw (median, sigma of the log), capped; the draw is a hash of (seed, trajectory,
    turn, message), so it does not depend on the order of the simulation."""

    tool_median_s: float = 0.5
    tool_sigma: float = 1.0
    user_median_s: float = 2.0
    user_sigma: float = 0.5
    max_s: float = 30.0
    seed: int = 0

    def __post_init__(self) -> None:
        # (an infinite median would make every tool call last forever)
        for f in ("tool_median_s", "user_median_s"):
            if not 0 < getattr(self, f) < math.inf:
                raise ValueError(f"{f} must be > 0 and finite, got {getattr(self, f)}")
        if not self.max_s > 0:
            raise ValueError(f"max_s must be > 0, got {self.max_s}")
        for f in ("tool_sigma", "user_sigma"):
            if not 0 <= getattr(self, f) < math.inf:
                raise ValueError(f"{f} must be >= 0 and finite, got {getattr(self, f)}")

    def draw(self, roles: Sequence[str], key: str) -> float:
        total = 0.0
        for i, role in enumerate(roles):
            if role not in ("tool", "user"):
                continue
            median, sigma = ((self.tool_median_s, self.tool_sigma) if role == "tool"
                             else (self.user_median_s, self.user_sigma))
            # (the exponent is clipped where math.exp would overflow: a draw that is
            # capped at max_s anyway)
            z = min(sigma * _normal(f"{self.seed}:{key}:{i}"), _MAX_EXP)
            total += min(self.max_s, median * math.exp(z))
        return total


_MAX_EXP = 700.0  # math.exp overflows just above 709


def _normal(key: str) -> float:
    """A standard normal draw fixed by ``key`` (Box-Muller on two hashed uniforms)."""
    h = hashlib.blake2b(key.encode(), digest_size=16).digest()
    u1 = (int.from_bytes(h[:8], "little") + 0.5) / 2**64
    u2 = int.from_bytes(h[8:], "little") / 2**64
    return math.sqrt(-2.0 * math.log(u1)) * math.cos(2.0 * math.pi * u2)


@dataclass(frozen=True)
class TraceSet:
    """Tokenized trace trajectories with the roles of the messages after each response."""

    trajectories: tuple[Trajectory, ...]
    gaps: tuple[tuple[tuple[str, ...], ...], ...]  # [trajectory][turn] -> roles after it

    @classmethod
    def load(cls, paths: Sequence[TraceSource]) -> TraceSet:
        records = load_records(paths)
        return cls.of(records, tokenize(records, load_tokenizer()))

    @classmethod
    def of(cls, records: Sequence[TraceRecord], trajs: Sequence[Trajectory]) -> TraceSet:
        gaps = []
        for rec in records:
            per_turn: list[list[str]] = []
            for m in rec.messages:
                if m.role == "assistant":
                    per_turn.append([])
                elif per_turn:
                    per_turn[-1].append(m.role)
            gaps.append(tuple(tuple(g) for g in per_turn))
        return cls(tuple(trajs), tuple(gaps))


def _sim_turns(base: Sequence[tuple[Tokens, Tokens]], gaps: Sequence[tuple[str, ...]],
               latency: LatencyModel, key: str, salt: Tokens) -> tuple[SimTurn, ...]:
    turns = []
    last = len(base) - 1
    for i, (prompt, response) in enumerate(base):
        if i == 0 and salt:
            prompt = salt + prompt
        tool_s = 0.0 if i == last else latency.draw(gaps[i] if i < len(gaps) else (), f"{key}:{i}")
        turns.append(SimTurn(prompt, response, tool_s))
    return tuple(turns)


def _base_turns(traj: Trajectory) -> list[tuple[Tokens, Tokens]]:
    return [(tuple(t.prompt_delta.tolist()), tuple(t.response.tolist())) for t in traj.turns]


def build_trace_steps(traces: TraceSet, tasks_per_step: int, rl_steps: int,
                      group_size: int | None = None, latency: LatencyModel | None = None,
                      seed: int = 0, copies: bool = False, name: str = "traces") -> Workload:
    """``rl_steps`` synchronous steps of ``tasks_per_step`` tasks each, ``group_size``
    samples per task (its trials, in trial order; ``None``: all of them).

    Tasks are taken in a seeded random order, step after step; when they run out the
    order starts again with the task's next trials. A sample that would repeat a trace
    trajectory raises ``ValueError`` unless ``copies``: then it becomes a copy with
    its own group (a salt token, outside the vocabulary, starts its first prompt, so
    copies share no prefix) and counts in ``Workload.reused``.
    """
    if tasks_per_step < 1 or rl_steps < 1:
        raise ValueError(f"need tasks_per_step, rl_steps >= 1, got {tasks_per_step}, {rl_steps}")
    latency = latency if latency is not None else LatencyModel(seed=seed)
    by_task: dict[str, list[int]] = {}
    for i, t in enumerate(traces.trajectories):
        if t.turns:
            by_task.setdefault(t.task_id, []).append(i)
    if not by_task:
        raise ValueError("no trajectory with turns in the traces")
    for idx in by_task.values():
        idx.sort(key=lambda i: (traces.trajectories[i].trial, traces.trajectories[i].source))
    order = sorted(by_task)
    np.random.default_rng(seed).shuffle(order)
    steps: list[tuple[SimTrajectory, ...]] = []
    reused, slot = 0, 0
    bases: dict[int, list[tuple[Tokens, Tokens]]] = {}  # token tuples shared by copies
    for s in range(rl_steps):
        step: list[SimTrajectory] = []
        for _ in range(tasks_per_step):
            task = order[slot % len(order)]
            occurrence = slot // len(order)
            slot += 1
            trials = by_task[task]
            g = len(trials) if group_size is None else group_size
            first = occurrence * g
            copy = first + g > len(trials)
            if copy and not copies:
                raise ValueError(
                    f"{tasks_per_step} tasks x {rl_steps} steps x {g} samples need more trials "
                    f"of task {task!r} than the traces hold ({len(trials)}); use fewer, or "
                    "allow copies")
            group = f"{task}#{occurrence}" if copy else task
            salt: Tokens = (1_000_000_000 + slot,) if copy else ()
            for j in range(g):
                ti = trials[(first + j) % len(trials)]
                tr = traces.trajectories[ti]
                reused += copy
                tid = f"s{s}/{group}/{j}"
                base = bases.get(ti)
                if base is None:
                    base = bases[ti] = _base_turns(tr)
                step.append(SimTrajectory(
                    tid, group, s, _sim_turns(base, traces.gaps[ti], latency, tid, salt),
                    source_key(tr)))
        steps.append(tuple(step))
    return Workload(name, tuple(steps), reused)

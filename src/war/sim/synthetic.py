"""Synthetic long-tail workloads: groups of multi-turn trajectories with heavy tails.

Knows: how to draw a group's task (a prompt shared by its samples, after a system
prompt every group shares) and its template turns (response and tool-output tokens),
and its samples: a long-tailed multiplier per sample scales its number of turns and
its response lengths, and a fraction ``divergence`` of each response's tokens differ
from the template (so a group's samples are alike, as RL samples of one task are,
without being copies). Tasks recur across RL steps (the same ``num_tasks`` tasks are
drawn again), so history accumulates. With ``copies`` a task's sample ``j`` is the
same token stream in every group of that task (so a replay of the few distinct
streams can stand for all of them, ``war.sim.acceptance``); a salt token after the
system prompt keeps copies from sharing more than the system prompt. Everything is a
seeded draw; the tokens mean nothing. Does not know replicas or speculation.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from war.sim.workload import SimTrajectory, SimTurn, Tokens, Workload


@dataclass(frozen=True)
class SyntheticConfig:
    """Shape of a synthetic workload (lognormal draws: median, sigma of the log)."""

    group_size: int = 8
    num_tasks: int | None = None  # tasks drawn from (None: one per group of a step)
    system_tokens: int = 600
    task_tokens_median: float = 400.0
    turns_median: float = 4.0
    turns_sigma: float = 0.6
    max_turns: int = 64
    response_median: float = 120.0
    response_sigma: float = 1.0
    max_response: int = 4096
    tool_tokens_median: float = 150.0
    tool_tokens_sigma: float = 1.0
    max_tool_tokens: int = 4096
    sample_sigma: float = 0.7  # per-sample multiplier on turns and lengths: the long tail
    divergence: float = 0.2
    tool_median_s: float = 0.5
    tool_sigma: float = 1.0
    max_tool_s: float = 30.0
    vocab: int = 50_000
    copies: bool = False  # a task's sample j is the same stream in all its groups
    seed: int = 0

    def __post_init__(self) -> None:
        for f in ("group_size", "max_turns", "max_response", "max_tool_tokens", "vocab"):
            if getattr(self, f) < 1:
                raise ValueError(f"{f} must be >= 1, got {getattr(self, f)}")
        if self.num_tasks is not None and self.num_tasks < 1:
            raise ValueError(f"num_tasks must be >= 1, got {self.num_tasks}")
        if not 0.0 <= self.divergence <= 1.0:
            raise ValueError(f"divergence must be in [0, 1], got {self.divergence}")
        if self.system_tokens < 0:
            raise ValueError(f"system_tokens must be >= 0, got {self.system_tokens}")
        # (an infinite median or a nan sigma is a token count no draw can round)
        for f in ("task_tokens_median", "turns_median", "response_median",
                  "tool_tokens_median", "tool_median_s"):
            if not 0 < getattr(self, f) < math.inf:
                raise ValueError(f"{f} must be > 0 and finite, got {getattr(self, f)}")
        if not self.max_tool_s > 0:
            raise ValueError(f"max_tool_s must be > 0, got {self.max_tool_s}")
        for f in ("turns_sigma", "response_sigma", "tool_tokens_sigma", "sample_sigma",
                  "tool_sigma"):
            if not 0 <= getattr(self, f) < math.inf:
                raise ValueError(f"{f} must be >= 0 and finite, got {getattr(self, f)}")


def _lognormal(rng: np.random.Generator, median: float, sigma: float) -> float:
    # (clipped where math.exp would overflow; every draw is capped by a max_* setting)
    return float(median * math.exp(min(sigma * rng.standard_normal(), 700.0)))


def _tokens(rng: np.random.Generator, n: int, vocab: int) -> np.ndarray:
    return rng.integers(0, vocab, size=max(n, 1), dtype=np.int64)


def _diverge(rng: np.random.Generator, template: np.ndarray, n: int, p: float,
             vocab: int) -> Tokens:
    """``n`` tokens of ``template`` (repeated as needed), a fraction ``p`` replaced."""
    reps = -(-n // len(template))
    out = np.tile(template, reps)[:n].copy()
    mask = rng.random(n) < p
    out[mask] = rng.integers(0, vocab, size=int(mask.sum()))
    return tuple(out.tolist())


def _task(cfg: SyntheticConfig, task: int, system: Tokens) -> tuple[Tokens, list[np.ndarray],
                                                                       list[np.ndarray], int]:
    rng = np.random.default_rng((cfg.seed, 1, task))
    prompt = system + tuple(_tokens(rng, round(_lognormal(rng, cfg.task_tokens_median, 0.5)),
                                    cfg.vocab).tolist())
    turns = max(1, min(cfg.max_turns, round(_lognormal(rng, cfg.turns_median, cfg.turns_sigma))))
    resp = [_tokens(rng, min(cfg.max_response, round(_lognormal(
        rng, cfg.response_median, cfg.response_sigma))), cfg.vocab) for _ in range(cfg.max_turns)]
    tool = [_tokens(rng, min(cfg.max_tool_tokens, round(_lognormal(
        rng, cfg.tool_tokens_median, cfg.tool_tokens_sigma))), cfg.vocab)
        for _ in range(cfg.max_turns)]
    return prompt, resp, tool, turns


def _sample(cfg: SyntheticConfig, rng: np.random.Generator, prompt: Tokens,
            resp: list[np.ndarray], tool: list[np.ndarray], base_turns: int
            ) -> tuple[SimTurn, ...]:
    m = math.exp(min(cfg.sample_sigma * rng.standard_normal(), 700.0))
    n = max(1, min(cfg.max_turns, round(base_turns * m)))
    turns = []
    for t in range(n):
        size = min(cfg.max_response, max(1, round(len(resp[t]) * m ** 0.5)))
        response = _diverge(rng, resp[t], size, cfg.divergence, cfg.vocab)
        delta = prompt if t == 0 else _diverge(
            rng, tool[t - 1], len(tool[t - 1]), cfg.divergence, cfg.vocab)
        tool_s = 0.0 if t == n - 1 else min(
            cfg.max_tool_s, _lognormal(rng, cfg.tool_median_s, cfg.tool_sigma))
        turns.append(SimTurn(delta, response, tool_s))
    return tuple(turns)


def synthetic_workload(cfg: SyntheticConfig, groups_per_step: int, rl_steps: int,
                       name: str = "synthetic") -> Workload:
    """``rl_steps`` steps of ``groups_per_step`` groups of ``cfg.group_size`` samples."""
    if groups_per_step < 1 or rl_steps < 1:
        raise ValueError("need groups_per_step, rl_steps >= 1")
    num_tasks = cfg.num_tasks or groups_per_step
    system = tuple(_tokens(np.random.default_rng((cfg.seed, 0)), cfg.system_tokens,
                           cfg.vocab).tolist())
    tasks: dict[int, tuple[Tokens, list[np.ndarray], list[np.ndarray], int]] = {}
    samples: dict[tuple[int, int], tuple[SimTurn, ...]] = {}
    steps = []
    for s in range(rl_steps):
        step = []
        for g in range(groups_per_step):
            task = (s * groups_per_step + g) % num_tasks
            if task not in tasks:
                tasks[task] = _task(cfg, task, system)
            prompt, resp, tool, base_turns = tasks[task]
            salt = (cfg.vocab + s * groups_per_step + g,) if cfg.copies else ()
            first = system + salt + prompt[len(system):]
            group = f"t{task}#{s}.{g}" if cfg.copies else f"t{task}"
            for j in range(cfg.group_size):
                tid = f"s{s}/t{task}/g{g}/{j}"
                if cfg.copies:
                    if (task, j) not in samples:
                        samples[task, j] = _sample(cfg, np.random.default_rng(
                            (cfg.seed, 3, task, j)), prompt, resp, tool, base_turns)
                    same = samples[task, j]
                    turns = (SimTurn(first, same[0].response, same[0].tool_s), *same[1:])
                else:
                    turns = _sample(cfg, np.random.default_rng((cfg.seed, 2, s, g, j)), first,
                                    resp, tool, base_turns)
                step.append(SimTrajectory(tid, group, s, turns,
                                          f"t{task}/{j}" if cfg.copies else tid))
        steps.append(tuple(step))
    return Workload(name, tuple(steps))

"""The rollout step benchmark: WAR's load-aware speculation against fixed baselines.

Knows: how to run the same RL steps (same tasks, seeds, policy) on fresh local
replicas with speculation ``auto`` (WAR), ``off`` and ``always``, at a low load
(a few trajectories in flight per replica) and at saturation (every trajectory
in flight), interleaved and repeated; and how to report each run's makespan,
throughput, tokens/step, reward and ratio to the step's makespan lower bound.
Does not know the engine's internals; ``benchmarks/rollout/bench_step.py`` is its
command line.

Lower bound of a run's makespan: ``max(total work / capacity, longest trajectory
alone)``, where capacity is the best throughput any run reached in the same repeat
(at any load: where the driver shares the machine, a low load can beat saturation),
and a trajectory's time alone is its sampled
tokens at the best single-trajectory rate seen at low load plus its tool time.
"""

from __future__ import annotations

import asyncio
import dataclasses
import statistics
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from war.rollout.agent import AgentConfig, PolicyIO
from war.rollout.driver import RolloutConfig, run_step_async
from war.rollout.envs import Task
from war.rollout.run import RunConfig, make_replicas, step_tasks, task_pool
from war.rollout.trajectory import Trajectory

CONFIGS = {"war": "auto", "spec_off": "off", "spec_always": "always"}


@dataclass(frozen=True)
class BenchConfig:
    run: RunConfig  # replicas, envs, tasks per step, group size, steps, agent, engine
    low_in_flight: int = 2  # trajectories in flight per replica at low load
    low_tasks: int = 2  # tasks per step at low load (the group size is kept)
    repeats: int = 3


@dataclass(frozen=True)
class RunFigures:
    load: str
    config: str
    repeat: int
    makespan_s: float
    generated_tokens: int
    tokens_per_s: float
    tokens_per_step: float
    acceptance: float
    mean_reward: float
    success_rate: float
    longest_tokens: int
    longest_tool_s: float
    single_rate: float  # median sampled tokens/s of a trajectory's own generation
    lower_bound_ratio: float = 0.0


async def run_config(cfg: RunConfig, model_dir: Path, tasks_by_step: Sequence[list[Task]],
                     spec_mode: str, per_replica: int | None) -> list[Trajectory]:
    """One configuration on fresh replicas: every step in turn; all trajectories."""
    run = dataclasses.replace(cfg, engine=dataclasses.replace(cfg.engine, spec_mode=spec_mode))
    replicas = make_replicas(run, model_dir)
    out: list[Trajectory] = []
    try:
        # (in the try: a replica that fails to start, or a model folder without a
        # tokenizer, must not leave the replicas already started running)
        for r in replicas.values():
            r.start()
        io = PolicyIO.from_folder(model_dir)
        for step, tasks in enumerate(tasks_by_step):
            for r in replicas.values():
                await r.observe_rl_step(step)
            out += await run_step_async(
                tasks, replicas, io,
                RolloutConfig(group_size=run.group_size, agent=run.agent, rl_step=step,
                              seed=run.seed, max_in_flight_per_replica=per_replica))
    finally:
        for r in replicas.values():
            await r.close()
    return out


def makespan(trajs: Sequence[Trajectory]) -> float:
    """Sum over the RL steps of (last trajectory's end - first trajectory's start)."""
    total = 0.0
    for step in {t.rl_step for t in trajs}:
        mine = [t for t in trajs if t.rl_step == step and "start" in t.timings]
        if mine:
            total += max(t.timings["end"] for t in mine) - min(t.timings["start"] for t in mine)
    return total


def figures(load: str, config: str, repeat: int, trajs: Sequence[Trajectory]) -> RunFigures:
    wall_s = makespan(trajs)
    ok = [t for t in trajs if t.finish_reason != "error"]
    gen = sum(t.num_sampled_tokens for t in ok)
    passes = sum(t.spec.get("forward_passes", 0.0) for t in ok)
    draft = sum(t.spec.get("draft_tokens", 0.0) for t in ok)
    acc = sum(t.spec.get("accepted_tokens", 0.0) for t in ok)
    longest = max(ok, key=lambda t: t.num_sampled_tokens, default=None)
    rates = [t.num_sampled_tokens / t.timings["generation"] for t in ok
             if t.timings.get("generation", 0.0) > 0]
    return RunFigures(
        load=load, config=config, repeat=repeat, makespan_s=wall_s, generated_tokens=gen,
        tokens_per_s=gen / wall_s if wall_s > 0 else 0.0,
        tokens_per_step=gen / passes if passes else 0.0,
        acceptance=acc / draft if draft else 0.0,
        mean_reward=sum(t.reward for t in trajs) / len(trajs) if trajs else 0.0,
        success_rate=sum(t.reward >= 1.0 for t in trajs) / len(trajs) if trajs else 0.0,
        longest_tokens=longest.num_sampled_tokens if longest else 0,
        longest_tool_s=longest.timings.get("tool", 0.0) if longest else 0.0,
        single_rate=statistics.median(rates) if rates else 0.0)


def with_lower_bounds(runs: Sequence[RunFigures]) -> list[RunFigures]:
    """Fills ``lower_bound_ratio`` per repeat (see the module docstring)."""
    out = []
    for repeat in sorted({r.repeat for r in runs}):
        mine = [r for r in runs if r.repeat == repeat]
        capacity = max((r.tokens_per_s for r in mine), default=0.0)
        single = max((r.single_rate for r in mine if r.load == "low"), default=0.0)
        for r in mine:
            work = r.generated_tokens / capacity if capacity else 0.0
            alone = (r.longest_tokens / single if single else 0.0) + r.longest_tool_s
            bound = max(work, alone)
            out.append(dataclasses.replace(
                r, lower_bound_ratio=r.makespan_s / bound if bound > 0 else 0.0))
    return out


def run_bench(cfg: BenchConfig, model_dir: Path,
              log: Callable[[str], None] = print) -> dict[str, Any]:
    """All loads x configurations x repeats, interleaved; the JSON report."""
    pool = task_pool(cfg.run)
    loads = {
        "low": ([step_tasks(pool, cfg.low_tasks, cfg.run.seed, s) for s in range(cfg.run.steps)],
                cfg.low_in_flight),
        "high": ([step_tasks(pool, cfg.run.tasks_per_step, cfg.run.seed, s)
                  for s in range(cfg.run.steps)], None),
    }
    runs: list[RunFigures] = []
    for repeat in range(cfg.repeats):
        for load, (tasks_by_step, per_replica) in loads.items():
            for name, mode in CONFIGS.items():
                trajs = asyncio.run(run_config(cfg.run, model_dir, tasks_by_step, mode,
                                               per_replica))
                fig = figures(load, name, repeat, trajs)
                runs.append(fig)
                log(f"repeat {repeat} {load:4s} {name:11s} {fig.tokens_per_s:7.1f} tok/s "
                    f"{fig.tokens_per_step:.2f} tok/step reward {fig.mean_reward:.2f}")
    runs = with_lower_bounds(runs)
    return report(runs, cfg)


def report(runs: Sequence[RunFigures], cfg: BenchConfig) -> dict[str, Any]:
    medians: list[dict[str, Any]] = []
    for load in ("low", "high"):
        for name in CONFIGS:
            mine = [r for r in runs if r.load == load and r.config == name]
            if not mine:
                continue
            medians.append({
                "load": load, "config": name,
                "makespan_s": statistics.median(r.makespan_s for r in mine),
                "tokens_per_s": statistics.median(r.tokens_per_s for r in mine),
                "tokens_per_step": statistics.median(r.tokens_per_step for r in mine),
                "lower_bound_ratio": statistics.median(r.lower_bound_ratio for r in mine),
                "mean_reward": statistics.median(r.mean_reward for r in mine),
                "acceptance": statistics.median(r.acceptance for r in mine),
            })
    ratios: dict[str, dict[str, float]] = {}
    for load in ("low", "high"):
        per_repeat: dict[str, list[float]] = {"war_vs_off": [], "war_vs_always": []}
        for repeat in sorted({r.repeat for r in runs}):
            got = {r.config: r.tokens_per_s for r in runs if r.load == load and r.repeat == repeat}
            if got.get("spec_off"):
                per_repeat["war_vs_off"].append(got.get("war", 0.0) / got["spec_off"])
            if got.get("spec_always"):
                per_repeat["war_vs_always"].append(got.get("war", 0.0) / got["spec_always"])
        ratios[load] = {k: statistics.median(v) for k, v in per_repeat.items() if v}
    rewards = [r.success_rate for r in runs]
    return {
        "runs": medians,
        "all_runs": [dataclasses.asdict(r) for r in runs],
        "ratios": ratios,
        "policy_success_rate": statistics.median(rewards) if rewards else 0.0,
        "targets": {"low_war_vs_off": 1.4, "high_war_vs_off": 0.98, "high_war_vs_always": 1.1},
        "config": {"replicas": cfg.run.replicas, "tasks_per_step": cfg.run.tasks_per_step,
                   "low_tasks": cfg.low_tasks, "group_size": cfg.run.group_size,
                   "steps": cfg.run.steps, "low_in_flight_per_replica": cfg.low_in_flight,
                   "repeats": cfg.repeats, "agent": dataclasses.asdict(cfg.run.agent)},
    }


__all__ = ["CONFIGS", "AgentConfig", "BenchConfig", "RunFigures", "run_bench"]

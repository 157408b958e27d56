"""One synchronous RL rollout step: every task sampled ``group_size`` times, all in flight.

Knows: how a step's trajectories are named and seeded, which replica serves each
group when no router is in front (groups stay together for prefix and draft
locality; groups go to the replica with the fewest trajectories assigned), how
many trajectories may be in flight, writing every finished trajectory at once
(atomic JSONL appends) and resuming a crashed step without redoing finished
trajectories. Does not know replicas' internals, environments' tools or how
tokens are rendered (``agent.py``).

A trajectory that fails (a replica error, an environment that cannot reset) is
returned and written with ``finish_reason="error"`` and its message; the other
trajectories of the step go on. On resume such trajectories are run again.

An environment's calls never overlap its ``close`` (``SerialEnv``): when a step is
cancelled (Ctrl-C, a timeout, a trajectory abandoned) while a ``reset`` or tool call
runs in its worker thread (threads cannot be stopped), closing waits for that call
to return, up to ``ENV_CLOSE_WAIT_S``; past that it logs a warning and the call's
own thread closes the environment when the call returns.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import threading
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

from war.rollout.agent import AgentConfig, PolicyIO, Replica, run_episode
from war.rollout.envs import Environment, Task, ToolSpec, make
from war.rollout.trajectory import JsonlWriter, Trajectory, read_jsonl

log = logging.getLogger(__name__)

# How long closing an environment waits for a call still running in its worker thread
# (a cancelled episode's reset or tool call) before it leaves the close to that call.
ENV_CLOSE_WAIT_S = 30.0

_T = TypeVar("_T")


class SerialEnv:
    """An ``Environment`` whose calls run one at a time and never overlap ``close``.

    The agent loop runs ``reset`` and tools in worker threads; when its episode is
    cancelled the thread goes on. ``close`` then waits for that call (up to
    ``wait_s``, default ``ENV_CLOSE_WAIT_S``); if it is still running past that, a
    warning names it and the close is left to the call's thread, which closes the
    environment as soon as the call returns. Once ``close`` is called no new call
    starts (``RuntimeError``); the environment is closed exactly once.
    """

    def __init__(self, env: Environment, label: str = "", wait_s: float | None = None) -> None:
        self.env = env
        self.name = env.name
        self._label = label or env.name
        self._wait_s = wait_s
        self._cond = threading.Condition()
        self._busy: str | None = None  # the call running now
        self._closing = False  # close was called: no new call starts
        self._deferred = False  # the running call's thread is to close the env
        self._closed = False

    def _call(self, what: str, fn: Callable[..., _T], *args: Any) -> _T:
        with self._cond:
            # (one episode's calls come one after another; this only waits behind a
            # call whose episode was cancelled)
            self._cond.wait_for(lambda: self._busy is None or self._closing)
            if self._closing:
                raise RuntimeError(f"environment {self._label} is closed")
            self._busy = what
        try:
            return fn(*args)
        finally:
            with self._cond:
                self._busy = None
                close_now = self._deferred
                if close_now:
                    self._deferred, self._closed = False, True
                self._cond.notify_all()
            if close_now:
                log.warning("environment %s: the %s call returned; closing it now",
                            self._label, what)
                try:
                    self.env.close()
                except Exception as exc:
                    log.warning("closing environment %s failed: %r", self._label, exc)

    def system_prompt(self) -> str:
        return self._call("system_prompt", self.env.system_prompt)

    def tools(self) -> list[ToolSpec]:
        return self._call("tools", self.env.tools)

    def reset(self, task: Task) -> str:
        return self._call("reset", self.env.reset, task)

    def call_tool(self, name: str, arguments: dict[str, Any]) -> str:
        return self._call(f"tool {name}", self.env.call_tool, name, arguments)

    def score(self, final_answer: str) -> float:
        return self._call("score", self.env.score, final_answer)

    def close(self) -> None:
        """Closes the environment once no call runs (blocking: call it in a worker
        thread from async code); returns without closing, after a warning, when a call
        still runs after the wait; that call's thread closes it when it returns."""
        wait_s = ENV_CLOSE_WAIT_S if self._wait_s is None else self._wait_s
        with self._cond:
            if self._closing:
                return
            self._closing = True
            self._cond.notify_all()  # (a call waiting to start gives up)
            if not self._cond.wait_for(lambda: self._busy is None, wait_s):
                self._deferred = True
                log.warning("environment %s: its %s call is still running %.0f s after the "
                            "episode ended; it is closed when that call returns",
                            self._label, self._busy, wait_s)
                return
            self._closed = True
        self.env.close()

    @property
    def closed(self) -> bool:
        """Whether the environment has been closed."""
        with self._cond:
            return self._closed


@dataclass(frozen=True)
class RolloutConfig:
    """One RL step's shape; validated on construction.

    * ``group_size``: samples per task (a GRPO group).
    * ``agent``: limits and sampling of each episode.
    * ``rl_step``: the RL step's number (names trajectories; slides draft history).
    * ``seed``: sampling seeds of the step's trajectories derive from it.
    * ``max_in_flight``: most trajectories running at once (``None``: all).
    * ``max_in_flight_per_replica``: most trajectories running at once on each
      replica (``None``: no per-replica limit); sets a load level per replica.
    """

    group_size: int = 8
    agent: AgentConfig = field(default_factory=AgentConfig)
    rl_step: int = 0
    seed: int = 0
    max_in_flight: int | None = None
    max_in_flight_per_replica: int | None = None

    def __post_init__(self) -> None:
        if isinstance(self.group_size, bool) or not isinstance(self.group_size, int) \
                or self.group_size < 1:
            raise ValueError(f"group_size must be an int >= 1, got {self.group_size!r}")
        if isinstance(self.rl_step, bool) or not isinstance(self.rl_step, int) \
                or self.rl_step < 0:
            raise ValueError(f"rl_step must be an int >= 0, got {self.rl_step!r}")
        if isinstance(self.seed, bool) or not isinstance(self.seed, int):
            # (a float or string would silently seed every trajectory from its repr)
            raise ValueError(f"seed must be an int, got {self.seed!r}")
        if not isinstance(self.agent, AgentConfig):
            raise ValueError(f"agent must be an AgentConfig, got {self.agent!r}")
        for name in ("max_in_flight", "max_in_flight_per_replica"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int)
                                      or value < 1):
                raise ValueError(f"{name} must be an int >= 1, got {value!r}")


def trajectory_id(rl_step: int, task_id: str, sample: int) -> str:
    return f"step{rl_step}/{task_id}/{sample}"


def reusable(output: str | Path, ids: Collection[str]) -> dict[str, Trajectory]:
    """The trajectories in ``output`` (a JSONL file; none when it does not exist) that a
    step wanting ``ids`` reuses instead of running again: those of ``ids`` that did not
    fail (failed ones are redone), the last one written where an id recurs. One
    definition for the driver and for what ``war rollout`` says it will reuse."""
    if not Path(output).exists():
        return {}
    wanted = set(ids)
    if not wanted:
        return {}
    # Only lines holding the ids' common start (a step's "step3/") are decoded, as the
    # writer encodes it; a line that encodes it otherwise is run again, not lost.
    low, high = min(wanted), max(wanted)  # (every id lies between: their common start)
    n = next((i for i, (a, b) in enumerate(zip(low, high, strict=False)) if a != b),
             min(len(low), len(high)))
    prefix = low[:n]
    containing = json.dumps(prefix, ensure_ascii=False)[1:-1].encode() if prefix else None
    return {t.trajectory_id: t for t in read_jsonl(output, containing)
            if t.trajectory_id in wanted and t.finish_reason != "error"}


def _seed(base: int, traj_id: str) -> int:
    digest = hashlib.sha256(f"{base}:{traj_id}".encode()).digest()
    return int.from_bytes(digest[:4], "little")


def assign_groups(tasks: Sequence[Task], names: Sequence[str], group_size: int) -> dict[str, str]:
    """Task id -> replica name: whole groups, each to the least-assigned replica."""
    load = dict.fromkeys(names, 0)
    out: dict[str, str] = {}
    for task in tasks:
        name = min(names, key=lambda n: (load[n], names.index(n)))
        out[task.task_id] = name
        load[name] += group_size
    return out


async def run_step_async(
    tasks: Sequence[Task],
    replicas: Sequence[Replica] | Mapping[str, Replica],
    io: PolicyIO,
    config: RolloutConfig | None = None,
    *,
    output: str | Path | None = None,
    on_done: Callable[[Trajectory], None] | None = None,
) -> list[Trajectory]:
    """Runs one step; returns its trajectories in (task, sample) order.

    ``output``: a JSONL file every finished trajectory is appended to at once; if it
    already holds finished trajectories of this step they are returned as they are
    and not run again. ``on_done`` is called for each trajectory as it finishes.
    """
    cfg = config if config is not None else RolloutConfig()
    named = dict(replicas) if isinstance(replicas, Mapping) else {
        f"replica{i}": r for i, r in enumerate(replicas)}
    if not named:
        raise ValueError("no replicas")
    ids = [t.task_id for t in tasks]
    if len(set(ids)) != len(ids):
        raise ValueError("task ids must be distinct within a step")
    wanted = [(task, g, trajectory_id(cfg.rl_step, task.task_id, g))
              for task in tasks for g in range(cfg.group_size)]
    done = reusable(output, [tid for _, _, tid in wanted]) if output is not None else {}
    placement = assign_groups(tasks, list(named), cfg.group_size)
    limit = asyncio.Semaphore(cfg.max_in_flight or max(len(wanted), 1))
    per_replica = {name: asyncio.Semaphore(cfg.max_in_flight_per_replica or max(len(wanted), 1))
                   for name in named}
    writer = JsonlWriter(output) if output is not None else None

    async def episode(task: Task, sample: int, traj_id: str, name: str) -> Trajectory:
        try:
            env = SerialEnv(make(task.env), f"{task.env} of {traj_id}")
        except Exception as exc:  # a broken environment fails this trajectory only
            # (and is written and reported like any other failed trajectory)
            return _failed(task, sample, traj_id, cfg, f"cannot make env: {exc!r}")
        try:
            return await run_episode(
                task, env, named[name], io, cfg.agent, trajectory_id=traj_id,
                group_id=task.task_id, rl_step=cfg.rl_step, sample_index=sample,
                seed=_seed(cfg.seed, traj_id), replica_name=name)
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            return _failed(task, sample, traj_id, cfg, repr(exc))
        finally:
            try:
                # (waits for a reset or tool call still running in its thread: see
                # SerialEnv; cancelled again here, the close goes on in its thread)
                await asyncio.to_thread(env.close)
            except Exception as exc:  # the episode is over: it keeps its outcome
                log.warning("closing env %s of %s failed: %r", task.env, traj_id, exc)

    async def one(task: Task, sample: int, traj_id: str) -> Trajectory:
        name = placement[task.task_id]
        # The replica's slot first: a trajectory waiting for its replica must not hold
        # one of the step's slots, which another replica's trajectory could use.
        async with per_replica[name], limit:
            traj = await episode(task, sample, traj_id, name)
        if writer is not None:
            writer.append(traj)
        if on_done is not None:
            on_done(traj)
        return traj

    todo = [asyncio.ensure_future(one(task, g, tid))
            for task, g, tid in wanted if tid not in done]
    try:
        for traj in await asyncio.gather(*todo):
            done[traj.trajectory_id] = traj
    except BaseException:
        # One trajectory failed outside its episode (writing it, ``on_done``) or the step
        # was cancelled: stop the others before the writer closes under them.
        for fut in todo:
            fut.cancel()
        await asyncio.gather(*todo, return_exceptions=True)
        raise
    finally:
        if writer is not None:
            writer.close()
    return [done[tid] for _, _, tid in wanted]


def run_step(
    tasks: Sequence[Task],
    replicas: Sequence[Replica] | Mapping[str, Replica],
    io: PolicyIO,
    config: RolloutConfig | None = None,
    *,
    output: str | Path | None = None,
    on_done: Callable[[Trajectory], None] | None = None,
) -> list[Trajectory]:
    """``run_step_async`` from synchronous code."""
    return asyncio.run(run_step_async(tasks, replicas, io, config, output=output,
                                      on_done=on_done))


def _failed(task: Task, sample: int, traj_id: str, cfg: RolloutConfig, error: str) -> Trajectory:
    return Trajectory(
        trajectory_id=traj_id, group_id=task.task_id, task_id=task.task_id, env=task.env,
        rl_step=cfg.rl_step, sample_index=sample, finish_reason="error", error=error).check()

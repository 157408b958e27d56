"""Small workloads and policies for the simulator's tests."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

from war.router.policies.base import Decision, ReplicaView, RoutingPolicy
from war.sim.workload import SimTrajectory, SimTurn, Workload
from war.types import GenRequest, GenResult


def trajectory(tid: str, prompt: int, responses: list[int], tool_s: float = 0.0,
               group: str | None = None, base: int = 0, rl_step: int = 0) -> SimTrajectory:
    """A trajectory whose first prompt has ``prompt`` tokens, later prompts 5 tokens,
    and whose turns generate ``responses[i]`` tokens; token ids start at ``base``."""
    turns = []
    nxt = base
    for i, n in enumerate(responses):
        p = prompt if i == 0 else 5
        turns.append(SimTurn(tuple(range(nxt, nxt + p)), tuple(range(nxt + p, nxt + p + n)),
                             tool_s if i < len(responses) - 1 else 0.0))
        nxt += p + n
    return SimTrajectory(tid, group or tid, rl_step, tuple(turns), tid)


def workload(*trajs: SimTrajectory) -> Workload:
    return Workload("test", (tuple(trajs),))


class FixedPolicy:
    """Sends every request to one replica."""

    name = "fixed"

    def __init__(self, replica: str) -> None:
        self.replica = replica

    def select(self, request: GenRequest, replicas: list[ReplicaView], now: float) -> Decision:
        return Decision(self.replica)

    def on_complete(self, request: GenRequest, result: GenResult | None, replica: str,
                    now: float) -> None:
        pass

    def on_replica_down(self, replica: str, now: float) -> None:
        pass


_CLOCKS = ("time", "monotonic", "perf_counter", "time_ns", "monotonic_ns", "perf_counter_ns")


@contextmanager
def no_wall_clock() -> Iterator[None]:
    """Makes every wall-clock function of ``time`` raise while inside."""
    saved = {name: getattr(time, name) for name in _CLOCKS}

    def forbidden(*_a: Any) -> float:
        raise AssertionError("a policy read the wall clock")

    try:
        for name in _CLOCKS:
            setattr(time, name, forbidden)
        yield
    finally:
        for name, fn in saved.items():
            setattr(time, name, fn)


class ClockGuard:
    """Wraps a policy: asserts that virtual time never goes backwards and that the
    wrapped policy never reads the wall clock; records every ``now`` it saw."""

    def __init__(self, inner: RoutingPolicy) -> None:
        self.inner = inner
        self.name = inner.name
        self.times: list[float] = []

    def _see(self, now: float) -> None:
        assert isinstance(now, float)
        assert not self.times or now >= self.times[-1], "virtual time went backwards"
        self.times.append(now)

    def _call(self, fn: Callable[..., Any], *args: Any) -> Any:
        with no_wall_clock():
            return fn(*args)

    def select(self, request: GenRequest, replicas: list[ReplicaView], now: float) -> Decision:
        self._see(now)
        decision: Decision = self._call(self.inner.select, request, replicas, now)
        return decision

    def on_complete(self, request: GenRequest, result: GenResult | None, replica: str,
                    now: float) -> None:
        self._see(now)
        self._call(self.inner.on_complete, request, result, replica, now)

    def on_replica_down(self, replica: str, now: float) -> None:
        self._see(now)
        self._call(self.inner.on_replica_down, replica, now)

    def finish_trajectory(self, trajectory_id: str, now: float) -> None:
        self._see(now)
        finish = getattr(self.inner, "finish_trajectory", None)
        if finish is not None:
            self._call(finish, trajectory_id, now)

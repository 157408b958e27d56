"""Kill one replica process in the middle of a rollout step: every trajectory
completes, and greedy outputs equal those of a run without the fault."""

from __future__ import annotations

import asyncio
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import httpx
import pytest

from war.backends.http import WarHttpBackend
from war.rollout.agent import AgentConfig, PolicyIO
from war.rollout.driver import RolloutConfig, run_step_async
from war.rollout.envs import sample_tasks
from war.rollout.trajectory import Trajectory
from war.router.policies import make_policy
from war.router.router import Router, RouterConfig


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _serve(folder: Path) -> tuple[subprocess.Popen[bytes], str]:
    port = _free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "war.cli.main", "serve", "--model", str(folder), "--port",
         str(port), "--dtype", "float64", "--kv-cache-mb", "32", "--log-level", "warning"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return proc, f"http://127.0.0.1:{port}"


def _wait_healthy(procs: list[subprocess.Popen[bytes]], urls: list[str]) -> None:
    deadline = time.monotonic() + 60.0
    for proc, url in zip(procs, urls, strict=True):
        while True:
            assert proc.poll() is None, "war serve exited"
            try:
                if httpx.get(f"{url}/health", timeout=1.0).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert time.monotonic() < deadline, "war serve did not become healthy"
            time.sleep(0.2)


async def _step(urls: list[str], io: PolicyIO, rl_step: int,
                kill: subprocess.Popen[bytes] | None) -> tuple[list[Trajectory], Router]:
    backends = [WarHttpBackend(f"r{i}", url, timeout_s=60.0) for i, url in enumerate(urls)]
    router = Router(backends, make_policy("war"), RouterConfig(health_interval_s=0.2))
    tasks = [*sample_tasks("calculator", 2, 4), *sample_tasks("files", 2, 4)]
    agent = AgentConfig(max_turns=3, max_tokens_per_turn=48, temperature=0.0)

    async def killer() -> None:
        assert kill is not None
        for _ in range(2000):
            if router.replicas["r1"].num_requests > 0:
                await asyncio.sleep(0.05)
                kill.kill()  # SIGKILL: no goodbye, its requests in flight are lost
                return
            await asyncio.sleep(0.005)

    async with router:
        task = asyncio.create_task(killer()) if kill is not None else None
        out = await run_step_async(tasks, {"router": router}, io,
                                   RolloutConfig(group_size=3, agent=agent, rl_step=rl_step))
        if task is not None:
            await task
    return out, router


@pytest.mark.slow
def test_killing_a_replica_mid_step_loses_nothing(
        tmp_path: Path, make_random_policy: Callable[[Path, int], Path]) -> None:
    folder = make_random_policy(tmp_path, 3)
    io = PolicyIO.from_folder(folder)
    servers = [_serve(folder) for _ in range(2)]
    procs = [p for p, _ in servers]
    urls = [u for _, u in servers]
    try:
        _wait_healthy(procs, urls)
        clean, _ = asyncio.run(_step(urls, io, 0, None))
        faulty, router = asyncio.run(_step(urls, io, 1, procs[1]))
        assert procs[1].wait(timeout=10) != 0
        assert router.stats.replicas_marked_down >= 1 and router.stats.retries >= 1
        assert len(faulty) == len(clean) == 12
        for a, b in zip(clean, faulty, strict=True):
            assert b.finish_reason != "error", b.error
            assert (a.task_id, a.sample_index) == (b.task_id, b.sample_index)
            assert a.token_ids == b.token_ids
            assert a.logprobs == pytest.approx(b.logprobs, abs=1e-9)
    finally:
        for p in procs:
            p.kill()
            p.wait(timeout=10)

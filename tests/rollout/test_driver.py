"""The agent loop and the step driver: exact token bookkeeping with a scripted
replica, a real engine end to end, error handling, resume after a crash."""

from __future__ import annotations

import asyncio
import dataclasses
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from tokenizers import Tokenizer

from war.data import gpt2_tokenizer_json
from war.engine.async_engine import AsyncEngine
from war.engine.config import EngineConfig
from war.engine.engine import Engine
from war.engine.loader import init_random
from war.engine.model_config import ModelConfig
from war.rollout.agent import AgentConfig, PolicyIO, context_length
from war.rollout.chat import HermesTemplate, end_of_turn_ids
from war.rollout.driver import RolloutConfig, run_step, trajectory_id
from war.rollout.envs import expert_actions, make, sample_tasks
from war.rollout.trajectory import read_jsonl
from war.types import GenRequest, GenResult, UnknownTrajectory


def gpt2_io() -> PolicyIO:
    tok = Tokenizer.from_str(gpt2_tokenizer_json())
    tok.add_special_tokens(["<|im_start|>", "<|im_end|>"])
    template = HermesTemplate()
    return PolicyIO(tok, template, end_of_turn_ids(tok, template))


IO = gpt2_io()


class ScriptedReplica:
    """Answers each turn with the scripted expert's text (so rewards must be 1), and
    checks that a continuing request extends exactly what it sent before."""

    def __init__(self, forget_every: int = 0) -> None:
        self.scripts: dict[str, list[str]] = {}
        self.context: dict[str, list[int]] = {}
        self.requests: list[GenRequest] = []
        self.forget_every = forget_every

    def script(self, traj_id: str, task: Any) -> None:
        env = make(task.env)
        try:
            self.scripts[traj_id] = expert_actions(env, task)
        finally:
            env.close()

    async def generate(self, req: GenRequest) -> GenResult:
        self.requests.append(req)
        assert req.trajectory_id is not None
        tid = req.trajectory_id
        if req.continues:
            if self.forget_every and len(self.requests) % self.forget_every == 0:
                raise UnknownTrajectory("forgotten")
            prompt = self.context[tid] + list(req.prompt_ids)
        else:
            prompt = list(req.prompt_ids)
        text = self.scripts[tid].pop(0)
        out = IO.encode(text) + list(IO.stop_token_ids)
        self.context[tid] = prompt + out
        await asyncio.sleep(0)
        return GenResult(req.request_id, tuple(out), tuple([-0.25] * len(out)), "stop",
                         len(prompt), num_forward_passes=len(out))


@pytest.mark.parametrize("forget_every", [0, 3])
def test_expert_scripts_get_full_reward_with_exact_tokens(tmp_path: Path,
                                                          forget_every: int) -> None:
    tasks = [*sample_tasks("calculator", 2, 1), *sample_tasks("sqlite", 2, 1),
             *sample_tasks("files", 2, 1)]
    replica = ScriptedReplica(forget_every)
    cfg = RolloutConfig(group_size=2, rl_step=3)
    for t in tasks:
        for g in range(2):
            replica.script(trajectory_id(3, t.task_id, g), t)
    out = run_step(tasks, [replica], IO, cfg, output=tmp_path / "s.jsonl")
    assert len(out) == 12
    for traj in out:
        assert traj.finish_reason == "done" and traj.reward == 1.0, traj.messages[-1]
        assert traj.num_turns >= 2 and traj.group_id == traj.task_id
        # The tokens are exactly the replica's context, and decode to the full render.
        assert traj.token_ids == replica.context[traj.trajectory_id]
        text = IO.tokenizer.decode(traj.token_ids, skip_special_tokens=False)
        tools = [t.to_openai() for t in make(traj.env).tools()]
        assert text + "\n" == HermesTemplate().render(traj.messages, tools)
        sampled = [t for t, m in zip(traj.token_ids, traj.loss_mask, strict=True) if m]
        assert IO.decode(sampled).count("The answer is") == 1
        assert all(lp == -0.25 for lp, m in zip(traj.logprobs, traj.loss_mask, strict=True)
                   if m)
        assert traj.spec["tokens_per_step"] == 1.0
    assert any(r.continues for r in replica.requests)  # only new tokens were sent
    assert len(read_jsonl(tmp_path / "s.jsonl")) == 12


def test_resume_skips_finished_trajectories(tmp_path: Path) -> None:
    tasks = sample_tasks("calculator", 3, 2)
    path = tmp_path / "step.jsonl"
    first = ScriptedReplica()
    for t in tasks:
        for g in range(2):
            first.script(trajectory_id(0, t.task_id, g), t)
    cfg = RolloutConfig(group_size=2)
    run_step(tasks[:2], [first], IO, cfg, output=path)  # "crashed" before the third task
    again = ScriptedReplica()
    for g in range(2):
        again.script(trajectory_id(0, tasks[2].task_id, g), tasks[2])
    out = run_step(tasks, [again], IO, cfg, output=path)
    assert [t.trajectory_id for t in out] == [
        trajectory_id(0, t.task_id, g) for t in tasks for g in range(2)]
    assert {r.trajectory_id for r in again.requests} == {
        trajectory_id(0, tasks[2].task_id, g) for g in range(2)}
    assert all(t.reward == 1.0 for t in out)
    assert len(read_jsonl(path)) == 6


class FinishingReplica(ScriptedReplica):
    """A scripted replica that, like a router, takes ended-episode reports."""

    def __init__(self) -> None:
        super().__init__()
        self.finished: list[str] = []
        self.finished_at: dict[str, int] = {}  # requests seen when the report came

    def finish_trajectory(self, trajectory_id: str) -> bool:
        self.finished.append(trajectory_id)
        self.finished_at[trajectory_id] = len(self.requests)
        return True


def test_episodes_that_end_are_reported_to_a_router() -> None:
    tasks = sample_tasks("calculator", 2, 3)
    replica = FinishingReplica()
    for t in tasks:
        for g in range(2):
            replica.script(trajectory_id(0, t.task_id, g), t)
    out = run_step(tasks, [replica], IO, RolloutConfig(group_size=2))
    assert sorted(replica.finished) == sorted(t.trajectory_id for t in out)
    # each report came after the trajectory's last request
    last = {r.trajectory_id: i for i, r in enumerate(replica.requests)}
    assert all(replica.finished_at[tid] > i for tid, i in last.items())


class AsyncFinishingReplica(ScriptedReplica):
    """A scripted replica whose reports are coroutines (as replica backends' are);
    with ``fail``, every report raises."""

    def __init__(self, fail: bool = False) -> None:
        super().__init__()
        self.fail = fail
        self.finished: list[str] = []

    async def finish_trajectory(self, trajectory_id: str) -> bool:
        await asyncio.sleep(0)
        if self.fail:
            raise ConnectionError("replica went away")
        self.finished.append(trajectory_id)
        return True


@pytest.mark.parametrize("fail", [False, True])
def test_episodes_that_end_are_reported_to_a_replica_backend(fail: bool) -> None:
    tasks = sample_tasks("calculator", 2, 3)
    replica = AsyncFinishingReplica(fail)
    for t in tasks:
        for g in range(2):
            replica.script(trajectory_id(0, t.task_id, g), t)
    out = run_step(tasks, [replica], IO, RolloutConfig(group_size=2))
    assert all(t.reward == 1.0 for t in out)  # a failed report loses nothing
    assert sorted(replica.finished) == ([] if fail else sorted(t.trajectory_id for t in out))


class BrokenReplica:
    async def generate(self, req: GenRequest) -> GenResult:
        raise ConnectionError("replica died")


class BabblingReplica:
    """Returns malformed tool calls, then text without an end-of-turn token."""

    def __init__(self) -> None:
        self.turn = 0

    async def generate(self, req: GenRequest) -> GenResult:
        self.turn += 1
        text = ('<tool_call>{"name": "calculate", "arguments": {"expr": 1}}</tool_call>'
                '<tool_call>{not json</tool_call>' if self.turn == 1 else "and then")
        out = IO.encode(text) + (list(IO.stop_token_ids) if self.turn == 1 else [])
        return GenResult(req.request_id, tuple(out), tuple([-1.0] * len(out)),
                         "stop" if self.turn == 1 else "length", len(req.prompt_ids))


def test_bad_model_output_and_dead_replicas_do_not_crash_the_step() -> None:
    task = sample_tasks("calculator", 1, 5)
    out = run_step(task, [BabblingReplica()], IO, RolloutConfig(group_size=1))[0]
    assert out.finish_reason == "length" and out.num_turns == 2 and out.reward == 0.0
    tool_msgs = [m for m in out.messages if m["role"] == "tool"]
    assert len(tool_msgs) == 2 and all("error" in m["content"] for m in tool_msgs)
    dead = run_step(task, [BrokenReplica()], IO, RolloutConfig(group_size=2))
    assert [t.finish_reason for t in dead] == ["error", "error"]
    assert all("replica died" in (t.error or "") for t in dead)


def test_limits_end_episodes() -> None:
    task = sample_tasks("sqlite", 1, 0)
    rep = ScriptedReplica()
    rep.script(trajectory_id(0, task[0].task_id, 0), task[0])
    out = run_step(task, [rep], IO, RolloutConfig(group_size=1, agent=AgentConfig(max_turns=1)))
    assert out[0].finish_reason == "max_turns" and out[0].num_turns == 1
    with pytest.raises(ValueError):
        AgentConfig(max_turns=0)
    with pytest.raises(ValueError):
        RolloutConfig(group_size=0)
    with pytest.raises(ValueError, match="distinct"):
        run_step([task[0], task[0]], [rep], IO)



def _tiny_llama() -> ModelConfig:
    """A one-layer Llama over the test tokenizer's vocabulary (random weights)."""
    return ModelConfig.from_dict({
        "model_type": "llama", "vocab_size": IO.tokenizer.get_vocab_size(), "hidden_size": 32,
        "intermediate_size": 64, "num_hidden_layers": 1, "num_attention_heads": 2,
        "num_key_value_heads": 1, "max_position_embeddings": 4096, "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0, "tie_word_embeddings": True})

def test_real_engines_end_to_end(tmp_path: Path) -> None:
    """A random model over two in-process replicas: the loop runs, tokens, masks and
    logprobs line up with what the engine sampled, and groups stay on one replica."""
    cfg = _tiny_llama()
    replicas = {f"r{i}": AsyncEngine(Engine(init_random(cfg, seed=i, dtype=torch.float32),
                                            EngineConfig(num_kv_blocks=512, block_size=16)))
                for i in range(2)}
    tasks = [*sample_tasks("calculator", 1, 0), *sample_tasks("files", 1, 0)]
    agent = AgentConfig(max_turns=2, max_tokens_per_turn=12, max_total_tokens=2048)

    async def main() -> list[Any]:
        from war.rollout.driver import run_step_async
        for r in replicas.values():
            r.start()
        try:
            return await run_step_async(tasks, replicas, IO,
                                        RolloutConfig(group_size=3, agent=agent))
        finally:
            for r in replicas.values():
                await r.close()

    out = asyncio.run(main())
    assert len(out) == 6
    for traj in out:
        traj.check()
        assert traj.finish_reason in ("done", "length", "max_turns")
        assert 1 <= traj.num_sampled_tokens <= 24
        assert len(set(traj.replica_ids)) == 1
    by_group = {g: {t.replica_ids[0] for t in out if t.group_id == g}
                for g in {t.group_id for t in out}}
    assert sorted(len(r) for r in by_group.values()) == [1, 1]  # a group stays together
    assert {out[0].replica_ids[0], out[3].replica_ids[0]} == {"r0", "r1"}


def test_in_flight_limits_per_replica() -> None:
    class Counting(ScriptedReplica):
        def __init__(self) -> None:
            super().__init__()
            self.now = 0
            self.peak = 0

        async def generate(self, req: GenRequest) -> GenResult:
            self.now += 1
            self.peak = max(self.peak, self.now)
            try:
                await asyncio.sleep(0.001)
                return await super().generate(req)
            finally:
                self.now -= 1

    tasks = sample_tasks("calculator", 4, 9)
    reps = {"a": Counting(), "b": Counting()}
    for t in tasks:
        for g in range(3):
            for r in reps.values():
                r.script(trajectory_id(0, t.task_id, g), t)
    out = run_step(tasks, reps, IO, RolloutConfig(group_size=3, max_in_flight_per_replica=2))
    assert all(t.reward == 1.0 for t in out)
    assert reps["a"].peak == 2 and reps["b"].peak == 2
    with pytest.raises(ValueError, match="max_in_flight_per_replica"):
        RolloutConfig(max_in_flight_per_replica=0)


class ObedientReplica(ScriptedReplica):
    """A scripted replica that, like an engine, samples at most ``max_tokens`` (then
    ends with "length") and, given ``max_model_len``, refuses a request whose context
    plus ``max_tokens`` would not fit (as ``Engine.add_request`` does)."""

    def __init__(self, max_model_len: int | None = None) -> None:
        super().__init__()
        if max_model_len is not None:
            self.max_model_len = max_model_len

    async def generate(self, req: GenRequest) -> GenResult:
        assert req.trajectory_id is not None
        held = self.context.get(req.trajectory_id, []) if req.continues else []
        limit = getattr(self, "max_model_len", None)
        if limit is not None and len(held) + len(req.prompt_ids) + req.sampling.max_tokens > limit:
            raise ValueError(f"request {req.request_id} exceeds the context length {limit}")
        res = await super().generate(req)
        if len(res.output_ids) <= req.sampling.max_tokens:
            return res
        out = res.output_ids[:req.sampling.max_tokens]
        tid = req.trajectory_id
        self.context[tid] = self.context[tid][:len(self.context[tid]) - len(res.output_ids)
                                              + len(out)]
        return dataclasses.replace(res, output_ids=out, logprobs=res.logprobs[:len(out)],
                                   finish_reason="length")


def _segments() -> tuple[Any, int, int, int]:
    """A calculator task whose expert calls a tool first, and the lengths of its first
    prompt, first sampled turn and first observation, from an unlimited episode."""
    task = sample_tasks("calculator", 1, 0)[0]
    rep = ObedientReplica()
    rep.script(trajectory_id(0, task.task_id, 0), task)
    traj = run_step([task], [rep], IO, RolloutConfig(group_size=1))[0]
    assert traj.finish_reason == "done" and traj.num_turns >= 2
    runs: list[list[int]] = []  # (mask, length) runs of the loss mask
    for m in traj.loss_mask:
        if runs and runs[-1][0] == m:
            runs[-1][1] += 1
        else:
            runs.append([m, 1])
    assert [m for m, _ in runs[:3]] == [0, 1, 0]
    return task, runs[0][1], runs[1][1], runs[2][1]


def _run_limited(task: Any, agent: AgentConfig, max_model_len: int | None = None) -> Any:
    rep = ObedientReplica(max_model_len)
    rep.script(trajectory_id(0, task.task_id, 0), task)
    return run_step([task], [rep], IO, RolloutConfig(group_size=1, agent=agent))[0]


def test_max_total_tokens_is_a_hard_cap() -> None:
    task, prompt, first, obs = _segments()
    # The first observation does not fit, or fits with no token left to answer: it is
    # not appended (to the tokens nor to the messages), and the budget is used up.
    for budget in (prompt + first + obs - 1, prompt + first + obs):
        traj = _run_limited(task, AgentConfig(max_total_tokens=budget))
        assert traj.finish_reason == "max_tokens" and traj.num_turns == 1, budget
        assert len(traj.token_ids) == prompt + first <= budget
        assert traj.messages[-1]["role"] == "assistant"
        assert not any(m["role"] == "tool" for m in traj.messages)
    # One token of room after it: the second turn is cut by the budget, which ends
    # the trajectory exactly at the budget: max_tokens, not length.
    budget = prompt + first + obs + 1
    traj = _run_limited(task, AgentConfig(max_total_tokens=budget))
    assert traj.finish_reason == "max_tokens" and traj.num_turns == 2
    assert len(traj.token_ids) == budget
    # The first turn cut by the budget (max_tokens) or by the turn's own limit (length).
    traj = _run_limited(task, AgentConfig(max_total_tokens=prompt + 3))
    assert traj.finish_reason == "max_tokens" and len(traj.token_ids) == prompt + 3
    traj = _run_limited(task, AgentConfig(max_tokens_per_turn=3))
    assert traj.finish_reason == "length" and len(traj.token_ids) == prompt + 3


def test_a_first_prompt_over_the_budget_fails_the_trajectory() -> None:
    task, prompt, _, _ = _segments()
    for budget in (prompt - 1, prompt):  # no room for one sampled token
        traj = _run_limited(task, AgentConfig(max_total_tokens=budget))
        assert traj.finish_reason == "error" and not traj.token_ids
        assert f"first prompt ({prompt} tokens)" in (traj.error or "")
        assert f"max_total_tokens ({budget})" in (traj.error or "")
    traj = _run_limited(task, AgentConfig(), max_model_len=prompt)
    assert traj.finish_reason == "error" and "max_model_len" in (traj.error or "")


def test_turns_fit_the_replicas_context_length() -> None:
    task, prompt, first, obs = _segments()
    # max_tokens_per_turn (256) would pass the context: each turn asks for what is left.
    traj = _run_limited(task, AgentConfig(), max_model_len=prompt + first + obs + 5)
    assert traj.finish_reason == "max_tokens" and traj.error is None
    assert len(traj.token_ids) == prompt + first + obs + 5
    traj = _run_limited(task, AgentConfig(), max_model_len=prompt + first + obs - 1)
    assert traj.finish_reason == "max_tokens" and len(traj.token_ids) == prompt + first
    # Where the replica says it: itself, an AsyncEngine's engine, a backend's engine.
    assert context_length(SimpleNamespace(max_model_len=9)) == 9
    assert context_length(SimpleNamespace(engine=SimpleNamespace(max_model_len=8))) == 8
    inner = SimpleNamespace(engine=SimpleNamespace(max_model_len=7))
    assert context_length(SimpleNamespace(async_engine=inner)) == 7
    for unknown in (object(), SimpleNamespace(max_model_len=True),
                    SimpleNamespace(engine=SimpleNamespace(max_model_len=None))):
        assert context_length(unknown) is None  # then only max_total_tokens caps


def test_real_engine_with_a_short_context() -> None:
    """An in-process engine whose max_model_len is just past the first prompt: turns
    are sized to fit, so no trajectory fails (before, every request was refused)."""
    cfg = _tiny_llama()
    _, prompt, _, _ = _segments()
    limit = prompt + 6
    engine = AsyncEngine(Engine(init_random(cfg, seed=0, dtype=torch.float32),
                                EngineConfig(num_kv_blocks=128, block_size=16,
                                             max_model_len=limit)))
    tasks = sample_tasks("calculator", 1, 0)

    async def main() -> list[Any]:
        from war.rollout.driver import run_step_async
        engine.start()
        try:
            return await run_step_async(tasks, [engine], IO, RolloutConfig(group_size=2))
        finally:
            await engine.close()

    out = asyncio.run(main())
    assert len(out) == 2
    for traj in out:
        assert traj.finish_reason != "error", traj.error
        assert len(traj.token_ids) <= limit


class FailingFinishingReplica(FinishingReplica):
    """Serves a trajectory's first turn, then dies: the held turn must still be released."""

    async def generate(self, req: GenRequest) -> GenResult:
        if req.request_id.endswith("/t1"):
            raise ConnectionError("replica died")
        return await super().generate(req)


def test_failed_and_cancelled_episodes_are_reported_too() -> None:
    from war.rollout.agent import run_episode
    tasks = sample_tasks("calculator", 1, 3)
    replica = FailingFinishingReplica()
    tid = trajectory_id(0, tasks[0].task_id, 0)
    replica.script(tid, tasks[0])
    out = run_step(tasks, [replica], IO, RolloutConfig(group_size=1))
    assert out[0].finish_reason == "error" and "replica died" in (out[0].error or "")
    assert replica.finished == [tid]  # the replica's hold of turn 0 is freed at once

    class Hanging(FinishingReplica):
        async def generate(self, req: GenRequest) -> GenResult:
            self.requests.append(req)
            await asyncio.sleep(3600)
            raise AssertionError("unreachable")

    hanging = Hanging()

    async def main() -> None:
        env = make("calculator")
        try:
            episode = asyncio.ensure_future(run_episode(
                tasks[0], env, hanging, IO, AgentConfig(), trajectory_id="t", group_id="g"))
            while not hanging.requests:
                await asyncio.sleep(0)
            episode.cancel()
            with pytest.raises(asyncio.CancelledError):
                await episode
        finally:
            env.close()

    asyncio.run(main())
    assert hanging.finished == ["t"]


def test_a_failing_sync_report_loses_no_trajectory() -> None:
    class Refusing(ScriptedReplica):
        def finish_trajectory(self, trajectory_id: str) -> bool:
            raise ValueError("router refuses")

    tasks = sample_tasks("calculator", 2, 3)
    replica = Refusing()
    for t in tasks:
        replica.script(trajectory_id(0, t.task_id, 0), t)
    out = run_step(tasks, [replica], IO, RolloutConfig(group_size=1))
    assert [t.finish_reason for t in out] == ["done", "done"]


def test_an_env_that_fails_to_close_keeps_its_trajectory(tmp_path: Path) -> None:
    from war.rollout.envs import CalculatorEnv, register, unregister

    class BadCloseEnv(CalculatorEnv):
        name = "bad_close"

        def close(self) -> None:
            built = self._task is not None  # (reset closes first: only that close works)
            super().close()
            if built:
                raise OSError("cannot remove sandbox")

    def tasks_of(n: int, seed: int) -> list[Any]:
        return [dataclasses.replace(t, task_id=f"bc-{t.task_id}", env="bad_close")
                for t in sample_tasks("calculator", n, seed)]

    register("bad_close", BadCloseEnv, tasks_of)
    try:
        tasks = tasks_of(2, 4)
        replica = ScriptedReplica()
        for t in tasks:
            replica.scripts[trajectory_id(0, t.task_id, 0)] = expert_actions(
                CalculatorEnv(), dataclasses.replace(t, env="calculator"))
        out = run_step(tasks, [replica], IO, RolloutConfig(group_size=1),
                       output=tmp_path / "s.jsonl")
    finally:
        unregister("bad_close")
    assert [t.finish_reason for t in out] == ["done", "done"]
    assert [t.reward for t in out] == [1.0, 1.0]
    assert len(read_jsonl(tmp_path / "s.jsonl")) == 2


def test_a_failing_step_stops_its_other_trajectories(tmp_path: Path) -> None:
    """When one trajectory fails outside its episode (here ``on_done``), the step's
    other trajectories are stopped, not left running against a closed writer."""
    from war.rollout.driver import run_step_async

    class Slow(ScriptedReplica):
        async def generate(self, req: GenRequest) -> GenResult:
            await asyncio.sleep(0.005 * (1 + len(self.requests)))
            return await super().generate(req)

    tasks = sample_tasks("calculator", 4, 6)
    replica = Slow()
    for t in tasks:
        replica.script(trajectory_id(0, t.task_id, 0), t)

    def on_done(traj: Any) -> None:
        raise RuntimeError("consumer died")

    async def main() -> tuple[int, int]:
        with pytest.raises(RuntimeError, match="consumer died"):
            await run_step_async(tasks, [replica], IO, RolloutConfig(group_size=1),
                                 output=tmp_path / "s.jsonl", on_done=on_done)
        seen = len(replica.requests)
        await asyncio.sleep(0.3)
        others = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
        return seen, len(others)

    seen, left = asyncio.run(main())
    assert left == 0
    assert len(replica.requests) == seen  # nothing ran after the step failed


def test_rollout_config_checks_seed_and_agent() -> None:
    for bad in (1.5, "7", True, None):
        with pytest.raises(ValueError, match="seed"):
            RolloutConfig(seed=bad)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="agent"):
        RolloutConfig(agent={"max_turns": 2})  # type: ignore[arg-type]


class FixedTextReplica:
    """Answers every turn with the same text (and the end-of-turn token)."""

    def __init__(self, text: str) -> None:
        self.text = text

    async def generate(self, req: GenRequest) -> GenResult:
        out = IO.encode(self.text) + list(IO.stop_token_ids)
        return GenResult(req.request_id, tuple(out), tuple([-0.5] * len(out)), "stop",
                         len(req.prompt_ids))


def test_a_lone_surrogate_in_a_tool_call_does_not_break_the_step(tmp_path: Path) -> None:
    replica = FixedTextReplica('<tool_call>{"name": "\\udc80", "arguments": {}}</tool_call>')
    cfg = RolloutConfig(group_size=1, agent=AgentConfig(max_turns=2))
    out = run_step(sample_tasks("calculator", 1, 0), [replica], IO, cfg,
                   output=tmp_path / "s.jsonl")
    assert out[0].finish_reason == "max_turns" and out[0].num_turns == 2
    assert "surrogate" in out[0].messages[3]["content"]
    assert read_jsonl(tmp_path / "s.jsonl") == out


@pytest.mark.parametrize("score", [float("nan"), 1.5, -0.5, float("inf")])
def test_a_score_outside_zero_one_is_an_error_not_a_reward(score: float) -> None:
    from war.rollout.agent import run_episode
    from war.rollout.envs import CalculatorEnv

    class BadScoreEnv(CalculatorEnv):
        def score(self, final_answer: str) -> float:
            return score

    task = sample_tasks("calculator", 1, 5)[0]
    replica = ScriptedReplica()
    replica.script("t", task)
    env = BadScoreEnv()
    try:
        traj = asyncio.run(run_episode(task, env, replica, IO, AgentConfig(),
                                       trajectory_id="t", group_id="g"))
    finally:
        env.close()
    assert traj.finish_reason == "error" and traj.reward == 0.0
    assert traj.error is not None and "[0, 1]" in traj.error
    assert traj.num_turns == 2 and traj.messages[-1]["role"] == "assistant"


def test_an_env_that_cannot_be_made_is_written_and_reported(tmp_path: Path) -> None:
    """A trajectory whose environment cannot be built fails like any other: it is
    written to the step's file and ``on_done`` hears of it (the progress counts it)."""
    from war.rollout.envs import register, unregister

    def broken(**kwargs: Any) -> Any:
        raise OSError("no sandbox")

    def tasks_of(n: int, seed: int) -> list[Any]:
        return [dataclasses.replace(t, task_id=f"nb-{t.task_id}", env="no_build")
                for t in sample_tasks("calculator", n, seed)]

    register("no_build", broken, tasks_of)
    seen: list[str] = []
    try:
        out = run_step(tasks_of(2, 0), [ScriptedReplica()], IO, RolloutConfig(group_size=1),
                       output=tmp_path / "s.jsonl", on_done=lambda t: seen.append(
                           t.trajectory_id))
    finally:
        unregister("no_build")
    assert [t.finish_reason for t in out] == ["error", "error"]
    assert all("cannot make env" in (t.error or "") for t in out)
    assert sorted(seen) == sorted(t.trajectory_id for t in out)
    assert read_jsonl(tmp_path / "s.jsonl") == out


def test_a_replica_at_its_limit_does_not_hold_the_step_limit() -> None:
    """With both ``max_in_flight`` and ``max_in_flight_per_replica``, a trajectory
    waiting for its replica's slot does not hold one of the step's slots: the other
    replica starts at once instead of after the first replica's trajectories."""
    events: list[str] = []

    class Named(ScriptedReplica):
        def __init__(self, name: str) -> None:
            super().__init__()
            self.name = name

        async def generate(self, req: GenRequest) -> GenResult:
            events.append(self.name)
            await asyncio.sleep(0.002)
            return await super().generate(req)

    tasks = sample_tasks("calculator", 2, 11)
    reps = {"a": Named("a"), "b": Named("b")}
    for t in tasks:
        for g in range(3):
            for r in reps.values():
                r.script(trajectory_id(0, t.task_id, g), t)
    out = run_step(tasks, reps, IO, RolloutConfig(group_size=3, max_in_flight=2,
                                                  max_in_flight_per_replica=1),
                   on_done=lambda t: events.append("done"))
    assert all(t.reward == 1.0 for t in out)
    assert {t.replica_ids[0] for t in out} == {"a", "b"}
    first_done = events.index("done")
    assert {"a", "b"} <= set(events[:first_done]), events  # both replicas busy at once


class BlockingResetEnv:
    """An environment whose ``reset`` blocks until ``release`` is set; it records each
    call's start and end and every call that began while another one was running."""

    name = "blocking_reset"

    def __init__(self) -> None:
        import threading

        self.entered = threading.Event()
        self.release = threading.Event()
        self.calls: list[str] = []
        self.overlaps: list[str] = []
        self._active: list[str] = []
        self._lock = threading.Lock()

    def _enter(self, what: str) -> None:
        with self._lock:
            if self._active:
                self.overlaps.append(f"{what} during {self._active}")
            self._active.append(what)
            self.calls.append(f"{what} start")

    def _leave(self, what: str) -> None:
        with self._lock:
            self._active.remove(what)
            self.calls.append(f"{what} end")

    def system_prompt(self) -> str:
        return "Answer."

    def tools(self) -> list[Any]:
        return []

    def reset(self, task: Any) -> str:
        self._enter("reset")
        try:
            self.entered.set()
            assert self.release.wait(10), "the test never released reset"
            return str(task.prompt)
        finally:
            self._leave("reset")

    def call_tool(self, name: str, arguments: dict[str, Any]) -> str:
        return "unused"

    def score(self, final_answer: str) -> float:
        return 0.0

    def close(self) -> None:
        self._enter("close")
        self._leave("close")


def _cancel_during_reset(env: BlockingResetEnv, release_after_s: float | None) -> None:
    """Runs a step of one ``blocking_reset`` task and cancels it while its reset blocks;
    the reset is released ``release_after_s`` later (``None``: once the step is
    cancelled and the close has given up waiting)."""
    import threading

    from war.rollout.driver import run_step_async
    from war.rollout.envs import Task, register, unregister

    def tasks_of(n: int, seed: int) -> list[Task]:
        return [Task(f"br-{seed}-{i}", "blocking_reset", "What is 1?", "1") for i in range(n)]

    register("blocking_reset", lambda: env, tasks_of)

    async def main() -> None:
        step = asyncio.ensure_future(run_step_async(
            tasks_of(1, 0), [ScriptedReplica()], IO, RolloutConfig(group_size=1)))
        assert await asyncio.to_thread(env.entered.wait, 10)
        if release_after_s is not None:
            threading.Timer(release_after_s, env.release.set).start()
        step.cancel()
        with pytest.raises(asyncio.CancelledError):
            await step

    try:
        asyncio.run(main())  # (returns once the worker threads are done)
    finally:
        env.release.set()
        unregister("blocking_reset")


def test_a_step_cancelled_during_reset_closes_the_env_after_the_reset() -> None:
    """Cancelled while an environment's reset runs in its worker thread, the step
    closes that environment only once the reset has returned, never during it."""
    env = BlockingResetEnv()
    _cancel_during_reset(env, release_after_s=0.3)
    assert env.overlaps == []
    assert env.calls == ["reset start", "reset end", "close start", "close end"]


def test_a_reset_that_outlasts_the_close_wait_is_closed_when_it_returns(
        monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    """Past ``ENV_CLOSE_WAIT_S`` the close gives up waiting with a warning naming the
    call, and the reset's own thread closes the environment when it returns."""
    import logging
    import threading
    import time

    from war.rollout import driver

    monkeypatch.setattr(driver, "ENV_CLOSE_WAIT_S", 0.05)
    env = BlockingResetEnv()

    def release_once_warned() -> None:
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and "still running" not in caplog.text:
            time.sleep(0.01)
        assert env.calls == ["reset start"]  # not closed while the reset runs
        env.release.set()

    caplog.set_level(logging.WARNING, logger="war.rollout.driver")
    watcher = threading.Thread(target=release_once_warned)
    watcher.start()
    _cancel_during_reset(env, release_after_s=None)
    watcher.join()
    assert "blocking_reset of step0/br-0-0/0: its reset call is still running" in caplog.text
    assert "the reset call returned; closing it now" in caplog.text
    assert env.overlaps == []
    assert env.calls == ["reset start", "reset end", "close start", "close end"]


def test_serial_env_closes_once_and_refuses_calls_after_close() -> None:
    from war.rollout.driver import SerialEnv

    inner = BlockingResetEnv()
    inner.release.set()
    env = SerialEnv(inner, "test env", wait_s=1.0)
    task = SimpleNamespace(prompt="q")
    assert env.reset(task) == "q"  # type: ignore[arg-type]
    assert not env.closed
    env.close()
    env.close()
    assert env.closed and inner.calls == ["reset start", "reset end", "close start", "close end"]
    with pytest.raises(RuntimeError, match="test env is closed"):
        env.reset(task)  # type: ignore[arg-type]

"""The agent loop of one trajectory: generate, parse tool calls, run tools, continue.

Knows: how one episode proceeds — render the first prompt with the chat template,
send token ids to a replica, parse ``<tool_call>`` blocks from the sampled text,
run the tools in the environment (in a worker thread), append the tool responses
as a rendered continuation, until the policy answers without a tool call, a turn
limit or a token limit — and how to account for every token (loss mask,
logprobs), timings and speculation counters. Does not know how replicas are
chosen (``Replica`` is any object with ``async generate``), the engine's
internals, or how trajectories are stored.

Token limits are hard caps: a trajectory never holds more than
``max_total_tokens``, nor more than the replica's context length where the
replica says what it is (``context_length``). Each turn asks for at most the
tokens left; a tool observation that does not fit (with room for one more
sampled token) is not appended, and the trajectory ends with ``max_tokens``. A
first prompt that leaves no room is an error (``ValueError``): no turn of that
task can run under these limits.

Token bookkeeping is exact: each turn only the new segment (tool responses and
the next generation prompt) is tokenized and appended; the sampled tokens are
the replica's, never re-tokenized. A trajectory's next turn sends only those new
tokens (``GenRequest.continues``); if the replica no longer holds the trajectory
the whole context is sent instead.

A score outside [0, 1] (or NaN) from the environment ends the episode with
``finish_reason="error"`` and reward 0, so it never reaches a trainer as a reward.

Model output never crashes the loop: malformed tool calls (bad JSON, unknown
tool, wrong arguments) and failing tools become error observations for the
policy, as real agent frameworks do.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from tokenizers import Tokenizer

from war.rollout.chat import ChatTemplate, encode_segment, end_of_turn_ids, load_chat_template
from war.rollout.envs import Environment, Task, ToolError
from war.rollout.toolcalls import format_tool_response, parse_tool_calls
from war.rollout.trajectory import Trajectory, TrajectoryBuilder
from war.types import GenRequest, GenResult, SamplingParams, UnknownTrajectory

log = logging.getLogger(__name__)


class Replica(Protocol):
    """Anything that generates: an in-process ``AsyncEngine``, an HTTP client, a router."""

    async def generate(self, request: GenRequest) -> GenResult: ...


def context_length(replica: object) -> int | None:
    """The longest sequence (prompt + output) ``replica`` accepts, where it says: an
    engine's ``max_model_len``, on the replica itself, on an ``AsyncEngine``'s
    ``engine`` or on an in-process backend's ``async_engine.engine``. ``None`` where
    it does not (an HTTP backend, a router over replicas that may differ)."""
    # Only immutable engine attributes are read (AsyncEngine.engine allows these from
    # any thread); anything that is not a positive int counts as not saying.
    inner = getattr(replica, "async_engine", None)
    for obj in (replica, getattr(replica, "engine", None), getattr(inner, "engine", None)):
        value = getattr(obj, "max_model_len", None)
        if isinstance(value, int) and not isinstance(value, bool) and value >= 1:
            return value
    return None


@dataclass(frozen=True)
class PolicyIO:
    """How text becomes tokens for one policy: its tokenizer and chat template."""

    tokenizer: Tokenizer
    template: ChatTemplate
    stop_token_ids: tuple[int, ...]

    @classmethod
    def from_folder(cls, folder: str | Path) -> PolicyIO:
        """The tokenizer (``tokenizer.json``) and chat template of a model folder."""
        path = Path(folder) / "tokenizer.json"
        if not path.is_file():
            raise ValueError(f"no tokenizer.json in {folder}")
        tokenizer = Tokenizer.from_file(str(path))
        template = load_chat_template(folder)
        return cls(tokenizer, template, end_of_turn_ids(tokenizer, template))

    def encode(self, text: str) -> list[int]:
        return encode_segment(self.tokenizer, text)

    def decode(self, ids: Sequence[int]) -> str:
        return str(self.tokenizer.decode(list(ids), skip_special_tokens=True))


@dataclass(frozen=True)
class AgentConfig:
    """Limits of one episode and how to sample it; validated on construction.

    * ``max_turns``: assistant turns before the episode is cut (``max_turns``).
    * ``max_tokens_per_turn``: most tokens sampled in one turn.
    * ``max_total_tokens``: most tokens of the whole trajectory (prompt, tool output
      and sampled tokens), a hard cap (``max_tokens`` once it is used up).
    * ``temperature``, ``top_p``, ``top_k``: sampling.
    * ``send_only_new_tokens``: continue trajectories on the replica that holds them.
    """

    max_turns: int = 8
    max_tokens_per_turn: int = 256
    max_total_tokens: int = 2048
    temperature: float = 0.7
    top_p: float = 1.0
    top_k: int = 0
    send_only_new_tokens: bool = True

    def __post_init__(self) -> None:
        for name in ("max_turns", "max_tokens_per_turn", "max_total_tokens"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an int >= 1, got {value!r}")
        # SamplingParams compares these: a string would raise a TypeError naming nothing.
        for name in ("temperature", "top_p"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise ValueError(f"{name} must be a number, got {value!r}")
        if not isinstance(self.send_only_new_tokens, bool):
            raise ValueError(f"send_only_new_tokens must be true or false, "
                             f"got {self.send_only_new_tokens!r}")
        SamplingParams(temperature=self.temperature, top_p=self.top_p, top_k=self.top_k)


@dataclass
class _Counters:
    draft: int = 0
    accepted: int = 0
    passes: int = 0
    cached: int = 0
    prompt: int = 0
    generation_s: float = 0.0
    tool_s: float = 0.0
    weight_version: int = 0
    replicas: list[str] = field(default_factory=list)


async def _finish_trajectory(replica: Replica, trajectory_id: str) -> None:
    """Tells ``replica``, where it takes such reports, that the trajectory ended: a router
    (its policy learns the episode's length; it tells the replica) or a replica backend
    (it frees KV held for a next turn, EngineConfig.kv_hold_s). An optimization: a
    failing report is logged, never raised (the replica's hold expires anyway)."""
    finish_trajectory = getattr(replica, "finish_trajectory", None)
    if not callable(finish_trajectory):
        return
    try:
        done = finish_trajectory(trajectory_id)
        if inspect.isawaitable(done):
            await done
    except Exception as exc:
        log.debug("finishing trajectory %s failed: %r", trajectory_id, exc)


async def run_episode(
    task: Task,
    env: Environment,
    replica: Replica,
    io: PolicyIO,
    config: AgentConfig,
    *,
    trajectory_id: str,
    group_id: str,
    rl_step: int = 0,
    sample_index: int = 0,
    seed: int | None = None,
    replica_name: str = "replica",
    priority: Callable[[int], float] | None = None,
    clock: Callable[[], float] = time.time,
) -> Trajectory:
    """Runs one episode of ``task`` in ``env`` (already constructed; it is reset
    here and not closed) and returns its trajectory. Replica errors other than a
    refused continuation propagate (the caller decides whether to retry), and so
    does the ``ValueError`` of a first prompt that leaves no room for a sampled
    token under ``max_total_tokens`` or the replica's context length."""
    start = clock()
    tools = [t.to_openai() for t in env.tools()]
    first_user = await asyncio.to_thread(env.reset, task)
    messages: list[dict[str, Any]] = [
        {"role": "system", "content": env.system_prompt()},
        {"role": "user", "content": first_user},
    ]
    # The trajectory's hard cap: its token budget, and the replica's context where the
    # replica says (the engine refuses a request whose prompt + max_tokens exceeds it).
    limit, limit_name = config.max_total_tokens, "max_total_tokens"
    ctx = context_length(replica)
    if ctx is not None and ctx < limit:
        limit, limit_name = ctx, "the replica's context length (max_model_len)"
    prompt_ids = io.encode(io.template.render_prompt(messages, tools))
    if len(prompt_ids) >= limit:
        raise ValueError(f"task {task.task_id}: its first prompt ({len(prompt_ids)} tokens) "
                         f"leaves no room to generate under {limit_name} ({limit})")
    builder = TrajectoryBuilder()
    builder.append_prompt(prompt_ids)
    c = _Counters()
    new_ids = builder.token_ids
    held = False  # whether the replica holds this trajectory's earlier turns
    reward, finish, turns, error = 0.0, "max_turns", 0, None
    try:
        while turns < config.max_turns:
            room = limit - len(builder)  # >= 1: the prompt and every observation left room
            if room < 1:  # (only after a replica returned more tokens than it was asked for)
                finish = "max_tokens"
                break
            sampling = SamplingParams(
                temperature=config.temperature, top_p=config.top_p, top_k=config.top_k,
                max_tokens=min(config.max_tokens_per_turn, room), stop_token_ids=io.stop_token_ids,
                seed=None if seed is None else seed * 1000 + turns, logprobs=True)
            request_id = f"{trajectory_id}/t{turns}"
            cont = held and config.send_only_new_tokens
            req = GenRequest(request_id, tuple(new_ids if cont else builder.token_ids), sampling,
                             trajectory_id=trajectory_id, group_id=group_id,
                             priority=priority(turns) if priority else float(turns), continues=cont)
            t0 = time.perf_counter()
            try:
                res = await replica.generate(req)
            except UnknownTrajectory:
                req = GenRequest(request_id, tuple(builder.token_ids), sampling,
                                 trajectory_id=trajectory_id, group_id=group_id,
                                 priority=req.priority)
                res = await replica.generate(req)
            c.generation_s += time.perf_counter() - t0
            held = True
            turns += 1
            c.draft += res.num_draft_tokens
            c.accepted += res.num_accepted_tokens
            c.passes += res.num_forward_passes
            c.cached += res.num_cached_tokens
            c.prompt += res.num_prompt_tokens
            c.weight_version = res.weight_version
            c.replicas.append(replica_name)
            out = list(res.output_ids)
            builder.append_sampled(out, res.logprobs)
            ended_turn = bool(out) and out[-1] in io.stop_token_ids
            text = io.decode(out)
            messages.append({"role": "assistant", "content": text})
            if not ended_turn:  # cut by a token limit in the middle of a turn
                if res.finish_reason == "length":
                    # "max_tokens" when the trajectory's cap cut it (the budget is used up),
                    # "length" when only the turn's own max_tokens_per_turn did.
                    finish = "max_tokens" if len(builder) >= limit else "length"
                else:
                    finish, error = "error", f"turn ended with {res.finish_reason}"
                break
            parsed = parse_tool_calls(text)
            if not parsed.has_calls and not parsed.errors:
                reward = float(env.score(parsed.content))
                finish = "done"
                if not 0.0 <= reward <= 1.0:  # (NaN too) a broken environment, not a reward
                    finish, error = "error", (f"environment {task.env} scored {reward!r}; a "
                                              "reward is a number in [0, 1]")
                    reward = 0.0
                break
            observations: list[dict[str, Any]] = []
            t1 = time.perf_counter()
            for call in parsed.calls:
                try:
                    output = await asyncio.to_thread(env.call_tool, call.name, dict(call.arguments))
                except ToolError as exc:
                    output = f"error: {exc}"
                observations.append(format_tool_response(call.name, output))
            for problem in parsed.errors:
                observations.append(format_tool_response("invalid_tool_call", f"error: {problem}"))
            c.tool_s += time.perf_counter() - t1
            cont_text = io.template.render_continuation(messages, observations, tools)
            new_ids = io.encode(cont_text)
            if len(builder) + len(new_ids) >= limit:
                # The tool responses (and the next generation prompt) would pass the cap or
                # leave the policy no token to answer with: the budget is used up. They are
                # left out of both tokens and messages, which must stay each other's render.
                finish = "max_tokens"
                break
            builder.append_observation(new_ids)
            messages.extend(observations)
        end = clock()
    finally:
        # Also when the episode fails (a replica or environment error) or is cancelled:
        # otherwise the replica keeps its KV and a router counts the trajectory in
        # flight until their timeouts.
        await _finish_trajectory(replica, trajectory_id)
    spec = {
        "draft_tokens": float(c.draft), "accepted_tokens": float(c.accepted),
        "forward_passes": float(c.passes),
        "tokens_per_step": builder.num_sampled_tokens / c.passes if c.passes else 0.0,
        "cached_prompt_tokens": float(c.cached), "prompt_tokens": float(c.prompt),
    }
    return builder.build(
        trajectory_id=trajectory_id, group_id=group_id, task_id=task.task_id, env=task.env,
        rl_step=rl_step, sample_index=sample_index, reward=reward, num_turns=turns,
        finish_reason=finish, messages=messages,
        timings={"start": start, "end": end, "total": end - start,
                 "generation": c.generation_s, "tool": c.tool_s},
        spec=spec, weight_version=c.weight_version, replica_ids=c.replicas, error=error)

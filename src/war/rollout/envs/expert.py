"""Scripted experts and the demonstration episodes they produce.

Knows: what an expert turn is (one short thought line plus Hermes-style tool calls, or a final
answer rendered ``The answer is X.``), how a turn is written as assistant text
(``<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>``, JSON with ``", "`` and
``": "`` separators, calls one per block), and how to play an expert episode: reset, then for
each turn the expert sees the tool outputs so far, its calls run through the environment and
their outputs come back as tool messages, until the final answer.

Does not know: how a policy's text is parsed (``war.rollout.toolcalls``), chat templates,
tokenization, or what any environment's expert does (each environment's ``expert_turn``).
Experts are deterministic: the same task gives the same demonstration.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

from war.rollout.envs.base import Environment, Task, ToolError


def format_tool_call(name: str, arguments: Mapping[str, Any]) -> str:
    """One Hermes tool-call block."""
    body = json.dumps({"name": name, "arguments": dict(arguments)}, separators=(", ", ": "))
    return f"<tool_call>\n{body}\n</tool_call>"


@dataclass(frozen=True)
class ExpertTurn:
    """One assistant turn of a scripted expert: ``calls`` (tool name, arguments) with an
    optional one-line ``thought``, or a final ``answer`` (exactly one of the two)."""

    thought: str = ""
    calls: tuple[tuple[str, Mapping[str, Any]], ...] = ()
    answer: str | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.thought, str) or "\n" in self.thought:
            raise ValueError(f"thought must be a one-line string, got {self.thought!r}")
        if bool(self.calls) == (self.answer is not None):
            raise ValueError("an expert turn has tool calls or a final answer, exactly one")
        if self.answer is not None and (not isinstance(self.answer, str)
                                        or not self.answer.strip() or "\n" in self.answer):
            raise ValueError(f"answer must be a non-empty one-line string, got {self.answer!r}")
        for call in self.calls:
            if (not isinstance(call, tuple) or len(call) != 2 or not isinstance(call[0], str)
                    or not isinstance(call[1], Mapping)):
                raise ValueError(f"each call must be (tool name, arguments), got {call!r}")
            format_tool_call(*call)  # arguments must be JSON-serializable

    @classmethod
    def call(cls, thought: str, tool: str, **arguments: Any) -> ExpertTurn:
        """A turn with one tool call."""
        return cls(thought=thought, calls=((tool, arguments),))

    @classmethod
    def final(cls, answer: str) -> ExpertTurn:
        """The final turn, answering ``answer``."""
        return cls(answer=answer)

    @property
    def text(self) -> str:
        """The full assistant text of the turn."""
        if self.answer is not None:
            body = f"The answer is {self.answer}."
            return f"{self.thought}\n{body}" if self.thought else body
        blocks = "\n".join(format_tool_call(name, args) for name, args in self.calls)
        return f"{self.thought}\n{blocks}" if self.thought else blocks


@runtime_checkable
class ExpertEnvironment(Environment, Protocol):
    """An environment with a scripted expert. ``expert_turn`` gets the task and the outputs
    of every tool call so far (in order) and returns the next turn; it must be called on an
    environment that was ``reset`` to ``task``."""

    def expert_turn(self, task: Task, outputs: Sequence[str]) -> ExpertTurn: ...


def run_tool(env: Environment, name: str, arguments: dict[str, Any]) -> str:
    """``env.call_tool`` with a ToolError turned into an ``"error: ..."`` observation."""
    try:
        return env.call_tool(name, arguments)
    except ToolError as exc:
        return f"error: {exc}"


def demonstration(env: Environment, task: Task, max_turns: int = 8) -> list[dict[str, str]]:
    """The messages of an expert episode on ``task``: system, user, then assistant turns
    with one ``{"role": "tool", "name": ..., "content": ...}`` message per call, ending with
    the final answer. ``env`` is left reset on ``task`` (score it, then ``close`` it);
    ValueError if it has no scripted expert."""
    if not isinstance(env, ExpertEnvironment):
        raise ValueError(f"environment {getattr(env, 'name', env)!r} has no scripted expert "
                         "(expert_turn)")
    if isinstance(max_turns, bool) or not isinstance(max_turns, int) or max_turns < 1:
        raise ValueError(f"max_turns must be a positive int, got {max_turns!r}")
    messages = [{"role": "system", "content": env.system_prompt()}]
    messages.append({"role": "user", "content": env.reset(task)})
    outputs: list[str] = []
    for _ in range(max_turns):
        turn = env.expert_turn(task, tuple(outputs))
        messages.append({"role": "assistant", "content": turn.text})
        if turn.answer is not None:
            return messages
        for name, arguments in turn.calls:
            output = run_tool(env, name, dict(arguments))
            messages.append({"role": "tool", "name": name, "content": output})
            outputs.append(output)
    raise RuntimeError(f"expert of {env.name} gave no final answer in {max_turns} turns "
                       f"on task {task.task_id}")


def expert_actions(env: Environment, task: Task, max_turns: int = 8) -> list[str]:
    """The expert's assistant texts on ``task``, one per turn, the last the final answer."""
    return [m["content"] for m in demonstration(env, task, max_turns)
            if m["role"] == "assistant"]

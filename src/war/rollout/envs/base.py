"""The environment contract of agentic rollouts and the shared machinery of tool environments.

Knows: what a task is (``Task``: the user's question, its verifiable answer and the
env-specific, JSON-serializable data that rebuilds the environment), how a tool is described
(``ToolSpec`` and its OpenAI/Hermes function form), the ``Environment`` protocol an agent loop
drives (``reset`` -> ``call_tool``* -> ``score`` -> ``close``), and ``ToolEnv``, a base class
that validates arguments against a tool's JSON schema, runs the tool in a worker thread under a
deadline, turns any failure inside a tool into an ``"error: ..."`` observation and bounds the
output's length.

Does not know: chat templates, tokenization, parsing the policy's tool calls (that is
``war.rollout.toolcalls``), the agent loop, scripted experts (``expert.py``) or any particular
environment. A tool that ignores its deadline keeps running in its daemon thread after the
timeout (Python threads cannot be killed), so tools bound their own work as well (sqlite: a
progress handler; files: size limits); calls to one environment run one at a time. While a
timed-out call still runs, the environment says so (``ToolEnv.running_tool``, a warning in the
log) and every further call is answered at once with an ``"error: previous tool call ... still
running"`` observation, neither waiting for it nor running beside it; ``close`` waits for it a
bounded time (``ToolEnv.close_wait_s``), then frees the state anyway.
"""

from __future__ import annotations

import json
import logging
import math
import re
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, Protocol, runtime_checkable

from war.rollout.envs.answers import score_answer

JSON_TYPES: Mapping[str, tuple[type, ...]] = MappingProxyType(
    {"string": (str,), "integer": (int,), "number": (int, float), "boolean": (bool,)}
)
_TOOL_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
_TASK_KEYS = ("task_id", "env", "prompt", "answer", "data")

log = logging.getLogger(__name__)


def _frozen_json(value: Any, what: str) -> Any:
    """A deep, JSON-normalised copy of ``value``; ValueError if it is not JSON-serializable."""
    try:
        return json.loads(json.dumps(value, allow_nan=False))
    except (TypeError, ValueError) as exc:
        raise ValueError(f"{what} must be JSON-serializable: {exc}") from None


@dataclass(frozen=True)
class Task:
    """One question of an environment. ``data`` is everything needed to rebuild the
    environment deterministically (e.g. a seed); it is copied and stored read-only."""

    task_id: str
    env: str
    prompt: str
    answer: str
    data: Mapping[str, Any] = field(default_factory=dict, hash=False)

    def __post_init__(self) -> None:
        for name in _TASK_KEYS[:4]:
            value = getattr(self, name)
            if not isinstance(value, str) or not value.strip():
                raise ValueError(f"Task.{name} must be a non-empty string, got {value!r}")
        if not isinstance(self.data, Mapping):
            raise ValueError(f"Task.data must be a mapping, got {type(self.data).__name__}")
        object.__setattr__(
            self, "data", MappingProxyType(_frozen_json(dict(self.data), "Task.data"))
        )

    def to_dict(self) -> dict[str, Any]:
        """The task as plain JSON-serializable values."""
        return {"task_id": self.task_id, "env": self.env, "prompt": self.prompt,
                "answer": self.answer, "data": _frozen_json(dict(self.data), "Task.data")}

    @classmethod
    def from_dict(cls, values: Mapping[str, Any]) -> Task:
        """Inverse of ``to_dict``; ValueError on missing or unknown keys."""
        missing = [k for k in _TASK_KEYS[:4] if k not in values]
        unknown = sorted(set(values) - set(_TASK_KEYS))
        if missing or unknown:
            raise ValueError(f"bad task dict: missing keys {missing}, unknown keys {unknown}")
        return cls(values["task_id"], values["env"], values["prompt"], values["answer"],
                   values.get("data", {}))


@dataclass(frozen=True)
class ToolSpec:
    """A tool's name, description and JSON-schema ``parameters`` (``type: object`` with
    ``properties`` of type string/integer/number/boolean and a ``required`` list)."""

    name: str
    description: str
    parameters: Mapping[str, Any] = field(hash=False)

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not _TOOL_NAME.match(self.name):
            raise ValueError(f"tool name must be an identifier, got {self.name!r}")
        if not isinstance(self.description, str) or not self.description.strip():
            raise ValueError(f"tool {self.name}: description must be a non-empty string")
        params = _frozen_json(self.parameters, f"tool {self.name}: parameters")
        if not isinstance(params, dict) or params.get("type") != "object":
            raise ValueError(f"tool {self.name}: parameters must be a JSON schema of type object")
        props = params.setdefault("properties", {})
        if not isinstance(props, dict):
            raise ValueError(f"tool {self.name}: properties must be an object")
        for key, prop in props.items():
            if not isinstance(prop, dict) or prop.get("type") not in JSON_TYPES:
                raise ValueError(f"tool {self.name}: property {key!r} needs a type among "
                                 f"{sorted(JSON_TYPES)}")
        required = params.setdefault("required", [])
        if not isinstance(required, list) or any(r not in props for r in required):
            raise ValueError(f"tool {self.name}: required must list declared properties")
        object.__setattr__(self, "parameters", MappingProxyType(params))

    @classmethod
    def build(cls, name: str, description: str, **params: tuple[str, str]) -> ToolSpec:
        """A spec whose parameters, given as ``name=(type, description)``, are all required."""
        props = {k: {"type": t, "description": d} for k, (t, d) in params.items()}
        return cls(name, description, {"type": "object", "properties": props,
                                       "required": list(props)})

    def to_openai(self) -> dict[str, Any]:
        """``{"type": "function", "function": {name, description, parameters}}``."""
        return {"type": "function", "function": {
            "name": self.name, "description": self.description,
            "parameters": _frozen_json(dict(self.parameters), "parameters")}}


class ToolError(Exception):
    """A bad tool call (unknown tool, bad arguments, a path outside the sandbox, ...);
    the message is meant to be shown to the policy."""


def validate_arguments(spec: ToolSpec, arguments: object) -> dict[str, Any]:
    """``arguments`` checked against ``spec``'s schema; ToolError naming the problem."""
    if not isinstance(arguments, Mapping):
        raise ToolError(f"{spec.name}: arguments must be a JSON object, "
                        f"got {type(arguments).__name__}")
    props: Mapping[str, Any] = spec.parameters["properties"]
    unknown = sorted(str(k) for k in arguments if k not in props)
    if unknown:
        raise ToolError(f"{spec.name}: unknown argument(s) {', '.join(unknown)} "
                        f"(expected: {', '.join(props) or 'none'})")
    missing = [k for k in spec.parameters["required"] if k not in arguments]
    if missing:
        raise ToolError(f"{spec.name}: missing required argument(s) {', '.join(missing)}")
    for key, value in arguments.items():
        kind = props[key]["type"]
        ok = isinstance(value, JSON_TYPES[kind]) and (kind == "boolean" or
                                                       not isinstance(value, bool))
        # (only floats can be inf/nan; math.isfinite of an int past a float's range, as
        # JSON may spell it, raises OverflowError)
        if ok and isinstance(value, float) and not math.isfinite(value):
            ok = False
        if not ok:
            raise ToolError(f"{spec.name}: argument {key!r} must be a{'n' * (kind[0] == 'i')} "
                            f"{kind}, got {json.dumps(value, default=repr)[:40]}")
    return dict(arguments)


@runtime_checkable
class Environment(Protocol):
    """What the agent loop drives. ``call_tool`` raises ToolError for an unknown tool or bad
    arguments (the loop shows the message to the policy); failures inside a tool come back as
    ``"error: ..."`` observations. ``score`` is a verifiable reward in [0, 1]."""

    name: str

    def system_prompt(self) -> str: ...

    def tools(self) -> list[ToolSpec]: ...

    def reset(self, task: Task) -> str: ...

    def call_tool(self, name: str, arguments: dict[str, Any]) -> str: ...

    def score(self, final_answer: str) -> float: ...

    def close(self) -> None: ...


@dataclass(frozen=True)
class ToolEnvConfig:
    """Limits of ``ToolEnv``: ``timeout_s`` per tool call (``None``: run inline, no deadline)
    and ``max_output_chars`` kept of an observation (the rest is replaced by a marker)."""

    timeout_s: float | None = 5.0
    max_output_chars: int = 4000

    def __post_init__(self) -> None:
        if self.timeout_s is not None and (
            isinstance(self.timeout_s, bool) or not isinstance(self.timeout_s, int | float)
            or not math.isfinite(self.timeout_s) or self.timeout_s <= 0
        ):
            raise ValueError(f"timeout_s must be a positive number or None, got {self.timeout_s!r}")
        if (isinstance(self.max_output_chars, bool) or not isinstance(self.max_output_chars, int)
                or self.max_output_chars < 16):
            raise ValueError(f"max_output_chars must be an int >= 16, "
                             f"got {self.max_output_chars!r}")


def truncate(text: str, limit: int) -> str:
    """``text`` cut to ``limit`` characters plus a marker saying how many were dropped."""
    if len(text) <= limit:
        return text
    return f"{text[:limit]}\n[... truncated {len(text) - limit} chars]"


@dataclass
class _ToolCall:
    """A tool call whose handler runs now; ``timed_out`` once its caller stopped waiting."""

    name: str
    started: float
    timed_out: bool = False


class ToolEnv:
    """Base of tool environments. Subclasses set ``name``, implement ``system_prompt``,
    ``tools``, ``_handlers`` (tool name -> callable taking the validated arguments as keywords
    and returning text), ``_build(task)`` and, if they hold resources, ``_teardown()``.

    Tool calls run one at a time: a call from another thread waits for the one running (at
    most that call's deadline). A call that timed out but whose handler still runs holds the
    environment: later calls return ``"error: previous tool call ... still running ..."`` at
    once (not run) until it returns; ``close`` waits ``close_wait_s`` for it, no longer."""

    name: str = ""
    close_wait_s: float = 1.0
    """How long ``close`` (and so ``reset``) waits for a timed-out tool call that still runs
    before it frees the state anyway (the abandoned call may then fail; its output is
    dropped)."""

    def __init__(self, config: ToolEnvConfig | None = None) -> None:
        if config is not None and not isinstance(config, ToolEnvConfig):
            raise ValueError(f"config must be a ToolEnvConfig, got {type(config).__name__}")
        self.config = config if config is not None else ToolEnvConfig()
        self._task: Task | None = None
        # the tool call whose handler runs now (None: none), guarded by _calls
        self._calls = threading.Condition()
        self._running: _ToolCall | None = None
        # reset and close each run whole: a close from another thread (an episode cancelled
        # while its reset runs in a worker thread) must not miss what the reset builds.
        self._state_lock = threading.RLock()

    def system_prompt(self) -> str:
        raise NotImplementedError

    def tools(self) -> list[ToolSpec]:
        raise NotImplementedError

    def _handlers(self) -> Mapping[str, Callable[..., str]]:
        raise NotImplementedError

    def _build(self, task: Task) -> None:
        raise NotImplementedError

    def _teardown(self) -> None:
        """Free what ``_build`` made (default: nothing)."""

    @property
    def task(self) -> Task:
        """The current task; ValueError before ``reset``."""
        if self._task is None:
            raise ValueError(f"{self.name}: call reset(task) first")
        return self._task

    def reset(self, task: Task) -> str:
        """Rebuild the state from ``task.data``; returns the first user message."""
        if not isinstance(task, Task) or task.env != self.name:
            raise ValueError(f"{self.name}: reset needs a Task of env {self.name!r}, got "
                             f"{getattr(task, 'env', type(task).__name__)!r}")
        with self._state_lock:
            self.close()
            self._build(task)
            self._task = task
        return task.prompt

    @property
    def running_tool(self) -> str | None:
        """The name of the tool call that timed out and still runs (it holds the
        environment: further calls are refused until it returns), or ``None``."""
        with self._calls:
            call = self._running
            return call.name if call is not None and call.timed_out else None

    def call_tool(self, name: str, arguments: dict[str, Any]) -> str:
        """Run one tool; ToolError for an unknown tool or bad arguments, otherwise the bounded
        output text (failures and timeouts inside the tool become ``"error: ..."``, and so
        does a call made while an earlier one that timed out still runs: it is not run)."""
        _ = self.task  # ValueError before reset
        specs = {spec.name: spec for spec in self.tools()}
        if name not in specs:
            raise ToolError(f"unknown tool {name!r} (available: {', '.join(specs)})")
        args = validate_arguments(specs[name], arguments)
        handler = self._handlers()[name]
        timeout = self.config.timeout_s
        with self._calls:
            # Another thread's call within its deadline: wait for it (its caller marks
            # it timed out, and wakes us, once the deadline passes). A timed-out one: no.
            self._calls.wait_for(lambda: self._running is None or self._running.timed_out)
            if self._running is not None:
                busy = self._running
                return (f"error: previous tool call {busy.name} still running after its "
                        f"timeout of {timeout or 0:g} s ({time.monotonic() - busy.started:.1f} s "
                        f"in); tool {name} was not run")
            call = self._running = _ToolCall(name, time.monotonic())
        box: list[str] = []

        def work() -> None:
            try:
                box.append(str(handler(**args)))
            except Exception as exc:  # every failure inside a tool is an observation
                box.append(f"error: {exc}" if str(exc) else f"error: {type(exc).__name__}")
            finally:
                with self._calls:
                    if self._running is call:
                        self._running = None
                    self._calls.notify_all()
                if call.timed_out:
                    log.warning("environment %s: tool %s returned %.1f s after it started, "
                                "past its timeout of %g s; its output was dropped", self.name,
                                name, time.monotonic() - call.started, timeout or 0)

        if timeout is None:
            work()
        else:
            worker = threading.Thread(target=work, name=f"war-tool-{name}", daemon=True)
            try:
                worker.start()
            except BaseException:  # (no thread to run it: the environment is free again)
                with self._calls:
                    self._running = None
                    self._calls.notify_all()
                raise
            worker.join(timeout)
            with self._calls:
                if not box and self._running is call:  # (still running: abandoned)
                    call.timed_out = True
                    self._calls.notify_all()
                    log.warning("environment %s: tool %s timed out after %g s and still "
                                "runs (threads cannot be stopped); further calls are refused "
                                "until it returns", self.name, name, timeout)
                    return f"error: tool {name} timed out after {timeout:g} s"
        if not box:
            return f"error: tool {name} crashed"
        return truncate(box[0], self.config.max_output_chars)

    def score(self, final_answer: str) -> float:
        """1.0 when ``final_answer`` holds the task's answer (see ``answers.score_answer``)."""
        return score_answer(final_answer, self.task.answer)

    def close(self) -> None:
        """Free the task's resources; the environment can be ``reset`` again. Called from
        another thread during a ``reset``, it waits for the reset and frees what it built.
        A timed-out tool call that still runs is waited for ``close_wait_s`` at most; then
        the resources are freed anyway, with a warning (that call may fail; its output is
        dropped, and further calls are refused until it returns)."""
        with self._calls:
            if not self._calls.wait_for(lambda: self._running is None, self.close_wait_s):
                call = self._running
                assert call is not None
                log.warning("environment %s: closing while tool %s still runs %.1f s after "
                            "it started (it timed out); its state is freed under it",
                            self.name, call.name, time.monotonic() - call.started)
        with self._state_lock:
            self._task = None
            self._teardown()

    def __enter__(self) -> ToolEnv:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

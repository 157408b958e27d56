"""Registry of environments by name.

Knows: for each registered name, a factory that builds a fresh environment (keyword arguments
of ``make`` go to it) and a task sampler ``(n, seed) -> list[Task]``; it checks what they return
(an environment of that name; ``n`` tasks of that env with distinct ids). Does not know what
an environment does, and is not thread-safe for concurrent registration (register at import).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from war.rollout.envs.base import Environment, Task

EnvFactory = Callable[..., Environment]
TaskSampler = Callable[[int, int], list[Task]]


@dataclass(frozen=True)
class _Entry:
    factory: EnvFactory
    sampler: TaskSampler


_REGISTRY: dict[str, _Entry] = {}


def _known() -> str:
    return ", ".join(sorted(_REGISTRY)) or "none"


def _entry(name: str) -> _Entry:
    if name not in _REGISTRY:
        raise KeyError(f"unknown environment {name!r} (known: {_known()})")
    return _REGISTRY[name]


def register(name: str, factory: EnvFactory, task_sampler: TaskSampler) -> None:
    """Make ``name`` available to ``make`` and ``sample_tasks``; ValueError if it is taken."""
    if not isinstance(name, str) or not name or name != name.strip() or " " in name:
        raise ValueError(f"environment name must be a non-empty word, got {name!r}")
    if not callable(factory) or not callable(task_sampler):
        raise ValueError(f"environment {name!r}: factory and task_sampler must be callable")
    if name in _REGISTRY:
        raise ValueError(f"environment {name!r} is already registered")
    _REGISTRY[name] = _Entry(factory, task_sampler)


def unregister(name: str) -> None:
    """Remove ``name``; KeyError listing the known names if it is not registered."""
    _entry(name)
    del _REGISTRY[name]


def names() -> list[str]:
    """The registered names, sorted."""
    return sorted(_REGISTRY)


def make(name: str, **kwargs: Any) -> Environment:
    """A fresh environment ``name`` (``kwargs`` go to its factory); KeyError if unknown."""
    env = _entry(name).factory(**kwargs)
    if getattr(env, "name", None) != name:
        raise ValueError(f"factory of {name!r} built an environment named "
                         f"{getattr(env, 'name', None)!r}")
    return env


def sample_tasks(name: str, n: int, seed: int) -> list[Task]:
    """``n`` tasks of ``name``, the same for the same seed, with distinct ids."""
    entry = _entry(name)
    if isinstance(n, bool) or not isinstance(n, int) or n < 0:
        raise ValueError(f"n must be a non-negative int, got {n!r}")
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise ValueError(f"seed must be an int, got {seed!r}")
    tasks = entry.sampler(n, seed)
    if len(tasks) != n or any(not isinstance(t, Task) or t.env != name for t in tasks):
        raise ValueError(f"task sampler of {name!r} must return {n} Tasks of env {name!r}")
    if len({t.task_id for t in tasks}) != n:
        raise ValueError(f"task sampler of {name!r} returned duplicate task ids")
    return tasks

"""Tool environments of agentic rollouts, with scripted experts and a registry.

Knows: the environment contract (``base``), answer checking (``answers``), expert
demonstrations (``expert``), the registry (``registry``) and three built-in environments,
registered on import: ``calculator`` (arithmetic, word problems, unit conversions),
``sqlite`` (questions about a generated read-only shop database) and ``files`` (questions
about a generated file tree in a sandboxed temporary directory). Does not know the agent loop,
chat templates or tool-call parsing (``war.rollout.toolcalls``).

Using one::

    from war.rollout.envs import demonstration, make, sample_tasks

    task = sample_tasks("sqlite", 1, seed=0)[0]
    env = make("sqlite")
    messages = demonstration(env, task)        # system, user, assistant, tool, ..., answer
    assert env.score(messages[-1]["content"]) == 1.0
    env.close()

Adding your own: subclass ``ToolEnv`` (or implement the ``Environment`` protocol; add
``expert_turn`` for demonstrations), write a task sampler ``(n, seed) -> list[Task]`` that is
deterministic and gives distinct ids, and register both under the env's ``name``::

    import random
    from war.rollout.envs import ExpertTurn, Task, ToolEnv, ToolSpec, register

    class EchoEnv(ToolEnv):
        name = "echo"

        def system_prompt(self):
            return "Repeat the word with the echo tool, then answer: The answer is <word>."

        def tools(self):
            return [ToolSpec.build("echo", "Return the text.", text=("string", "The text"))]

        def _handlers(self):
            return {"echo": lambda text: text}

        def _build(self, task):  # nothing to build: the tool is stateless
            pass

        def expert_turn(self, task, outputs):
            if outputs:
                return ExpertTurn.final(outputs[-1])
            return ExpertTurn.call("I echo the word.", "echo", text=task.data["word"])

    def echo_tasks(n, seed):
        rng = random.Random(seed)
        words = [rng.choice(["apple", "river", "cloud"]) for _ in range(n)]
        return [Task(f"echo-{seed}-{i}", "echo", f"Echo the word {w}.", w, {"word": w})
                for i, w in enumerate(words)]

    register("echo", EchoEnv, echo_tasks)
"""

from war.rollout.envs import calculator, files, sqlite_db
from war.rollout.envs.answers import extract_answer, score_answer
from war.rollout.envs.base import (
    Environment,
    Task,
    ToolEnv,
    ToolEnvConfig,
    ToolError,
    ToolSpec,
    validate_arguments,
)
from war.rollout.envs.calculator import CalculatorEnv
from war.rollout.envs.expert import (
    ExpertEnvironment,
    ExpertTurn,
    demonstration,
    expert_actions,
    format_tool_call,
    run_tool,
)
from war.rollout.envs.files import FilesEnv
from war.rollout.envs.registry import make, names, register, sample_tasks, unregister
from war.rollout.envs.sqlite_db import SqliteEnv

register("calculator", CalculatorEnv, calculator.sample_tasks)
register("sqlite", SqliteEnv, sqlite_db.sample_tasks)
register("files", FilesEnv, files.sample_tasks)

__all__ = [
    "CalculatorEnv",
    "Environment",
    "ExpertEnvironment",
    "ExpertTurn",
    "FilesEnv",
    "SqliteEnv",
    "Task",
    "ToolEnv",
    "ToolEnvConfig",
    "ToolError",
    "ToolSpec",
    "demonstration",
    "expert_actions",
    "extract_answer",
    "format_tool_call",
    "make",
    "names",
    "register",
    "run_tool",
    "sample_tasks",
    "score_answer",
    "unregister",
    "validate_arguments",
]

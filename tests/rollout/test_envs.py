"""The built-in tool environments, their scripted experts, scoring and the registry."""

from __future__ import annotations

import json
import random
import re
import tempfile
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import pytest

from war.rollout.envs import (
    Environment,
    ExpertEnvironment,
    ExpertTurn,
    FilesEnv,
    SqliteEnv,
    Task,
    ToolEnv,
    ToolEnvConfig,
    ToolError,
    ToolSpec,
    calculator,
    demonstration,
    expert_actions,
    files,
    make,
    names,
    register,
    run_tool,
    sample_tasks,
    score_answer,
    sqlite_db,
    unregister,
    validate_arguments,
)
from war.rollout.envs.answers import parse_number

BUILTINS = {"calculator": calculator.KINDS, "files": files.KINDS, "sqlite": sqlite_db.KINDS}
_CALL = re.compile(r"<tool_call>\n(.*?)\n</tool_call>", re.DOTALL)


def calls_in(text: str) -> list[tuple[str, dict[str, Any]]]:
    """The tool calls of an assistant text (a tiny stand-in for war.rollout.toolcalls)."""
    return [(obj["name"], obj["arguments"]) for obj in map(json.loads, _CALL.findall(text))]


def wrong(answer: str) -> str:
    number = parse_number(answer)
    return f"The answer is {number + 1 if number is not None else answer + 'x'}."


@pytest.mark.parametrize("name", sorted(BUILTINS))
def test_expert_solves_every_task_by_copying(name: str) -> None:
    tasks = sample_tasks(name, 30, seed=0)
    assert {t.data["kind"] for t in tasks} == set(BUILTINS[name])
    env = make(name)
    assert isinstance(env, ExpertEnvironment)
    try:
        for task in tasks:
            messages = demonstration(env, task)
            assert messages[0] == {"role": "system", "content": env.system_prompt()}
            assert messages[1] == {"role": "user", "content": task.prompt}
            outputs: list[str] = []
            i = 2
            while i < len(messages):
                assert messages[i]["role"] == "assistant"
                calls = calls_in(messages[i]["content"])
                tool_msgs = messages[i + 1:i + 1 + len(calls)]
                assert [(m["role"], m["name"]) for m in tool_msgs] == [
                    ("tool", c[0]) for c in calls]
                for (tool, args), msg in zip(calls, tool_msgs, strict=True):
                    assert not msg["content"].startswith("error"), msg
                    assert env.call_tool(tool, args) == msg["content"]  # replayable
                    outputs.append(msg["content"])
                i += 1 + len(calls)
            final = messages[-1]["content"]
            assert not calls_in(final) and final == f"The answer is {final[14:-1]}."
            assert task.answer in "\n".join(outputs)  # the answer can be copied
            assert env.score(final) == 1.0
            assert env.score(wrong(task.answer)) == 0.0
            assert env.score("I do not know.") == 0.0
    finally:
        env.close()


def test_expert_actions_are_the_assistant_turns() -> None:
    task = sample_tasks("sqlite", 2, seed=3)[1]
    env = make("sqlite")
    messages = demonstration(env, task)
    assert expert_actions(env, task) == [m["content"] for m in messages
                                         if m["role"] == "assistant"]
    env.close()


@pytest.mark.parametrize("name", sorted(BUILTINS))
def test_determinism(name: str) -> None:
    first, again = sample_tasks(name, 12, seed=7), sample_tasks(name, 12, seed=7)
    assert [t.to_dict() for t in first] == [t.to_dict() for t in again]
    assert sample_tasks(name, 5, seed=7) == first[:5]
    assert [t.prompt for t in sample_tasks(name, 12, seed=8)] != [t.prompt for t in first]
    assert len({t.task_id for t in first + sample_tasks(name, 12, seed=8)}) == 24
    env_a, env_b = make(name), make(name)
    try:
        for task in first:
            assert demonstration(env_a, task) == demonstration(env_b, task)
    finally:
        env_a.close()
        env_b.close()


def test_task_and_toolspec_round_trip() -> None:
    task = Task("t-1", "calculator", "What is 2 + 2?", "4", {"kind": "arithmetic", "x": (1, 2)})
    assert task.data["x"] == [1, 2]  # JSON-normalised
    assert Task.from_dict(json.loads(json.dumps(task.to_dict()))) == task
    with pytest.raises(TypeError):
        task.data["x"] = 3  # type: ignore[index]
    for bad in ({"task_id": ""}, {"answer": 4}, {"data": {"f": object()}}):
        with pytest.raises(ValueError):
            Task(**{**task.to_dict(), **bad})
    with pytest.raises(ValueError, match="unknown keys"):
        Task.from_dict({**task.to_dict(), "extra": 1})
    spec = ToolSpec.build("query", "Run SQL.", sql=("string", "The query"))
    assert spec.to_openai() == {"type": "function", "function": {
        "name": "query", "description": "Run SQL.", "parameters": {
            "type": "object", "properties": {"sql": {"type": "string", "description": "The query"}},
            "required": ["sql"]}}}
    with pytest.raises(ValueError):
        ToolSpec("bad name", "x", {"type": "object"})
    with pytest.raises(ValueError):
        ToolSpec("f", "x", {"type": "object", "properties": {"a": {"type": "list"}}})
    with pytest.raises(ValueError):
        ToolSpec("f", "x", {"type": "object", "properties": {}, "required": ["a"]})
    with pytest.raises(ValueError):
        ExpertTurn(thought="two\nlines", answer="4")
    with pytest.raises(ValueError):
        ExpertTurn()
    assert ExpertTurn.call("I add.", "calculate", expression="1 + 2").text == (
        'I add.\n<tool_call>\n{"name": "calculate", "arguments": {"expression": "1 + 2"}}'
        "\n</tool_call>")
    assert ExpertTurn.final("3").text == "The answer is 3."


def test_scoring_is_tolerant_but_exact() -> None:
    assert score_answer("The answer is  1,234 .", "1234") == 1.0
    assert score_answer("the answer is 8.050", "8.05") == 1.0
    assert score_answer("Answer: **PARIS**", "Paris") == 1.0
    assert score_answer("<think>maybe 3</think>The answer is 449 apples.", "449") == 1.0
    assert score_answer("10.0.3.7", "10.0.3.7") == 1.0
    assert score_answer("The answer is Paris, France.", "Paris") == 0.0
    assert score_answer("The answer is 8.06.", "8.05") == 0.0
    assert score_answer("", "4") == 0.0
    with pytest.raises(ValueError):
        score_answer("4", " ")


def test_argument_errors_raise_tool_error_and_become_observations() -> None:
    env = make("calculator")
    with pytest.raises(ValueError, match="reset"):
        env.call_tool("calculate", {"expression": "1 + 1"})
    env.reset(sample_tasks("calculator", 1, seed=0)[0])
    bad_calls: list[tuple[str, Any, str]] = [
        ("nope", {}, "unknown tool 'nope'"),
        ("calculate", {}, "missing required argument"),
        ("calculate", {"expression": "1", "x": 2}, "unknown argument"),
        ("calculate", {"expression": 5}, "must be a string"),
        ("convert", {"value": "5", "from_unit": "m", "to_unit": "km"}, "must be a number"),
        ("convert", {"value": True, "from_unit": "m", "to_unit": "km"}, "must be a number"),
        ("convert", {"value": float("nan"), "from_unit": "m", "to_unit": "km"}, "number"),
        ("calculate", ["1 + 1"], "JSON object"),
    ]
    for tool, args, message in bad_calls:
        with pytest.raises(ToolError, match=message):
            env.call_tool(tool, args)
        assert run_tool(env, tool, args).startswith("error: ")
    for expression in ("9**9**9", "__import__('os')", "(1).real", "x + 1", "1/0", "(-8)**0.5",
                       "round(5, -10**9)", "10**100 * 10", "1" * 300, "'a' * 3", "1; 2"):
        assert env.call_tool("calculate", {"expression": expression}).startswith("error: ")
    assert env.call_tool("calculate", {"expression": "(37 + 5) * 2 / 4"}) == "21"
    assert env.call_tool("convert", {"value": 5, "from_unit": "mi", "to_unit": "km"}) == "8.05"
    assert "cannot convert" in env.call_tool(
        "convert", {"value": 5, "from_unit": "kg", "to_unit": "km"})
    with pytest.raises(ValueError):
        env.reset(sample_tasks("sqlite", 1, seed=0)[0])
    env.close()


class SlowEnv(ToolEnv):
    """A test environment with a slow, a crashing and a verbose tool."""

    name = "slow"

    def system_prompt(self) -> str:
        return "Test tools."

    def tools(self) -> list[ToolSpec]:
        return [ToolSpec.build("sleep", "Sleep.", seconds=("number", "How long")),
                ToolSpec.build("boom", "Crash."), ToolSpec.build("big", "Talk a lot.")]

    def _handlers(self) -> Mapping[str, Callable[..., str]]:
        def sleep(seconds: float) -> str:
            time.sleep(seconds)
            return "slept"

        def boom() -> str:
            raise RuntimeError("kaboom")

        return {"sleep": sleep, "boom": boom, "big": lambda: "x" * 10_000}

    def _build(self, task: Task) -> None:
        pass


def test_timeouts_crashes_and_long_outputs_are_observations() -> None:
    env = SlowEnv(ToolEnvConfig(timeout_s=0.1, max_output_chars=100))
    assert isinstance(env, Environment)
    task = Task("s-0", "slow", "Sleep.", "slept")
    env.reset(task)
    start = time.monotonic()
    assert env.call_tool("sleep", {"seconds": 0.4}) == "error: tool sleep timed out after 0.1 s"
    assert time.monotonic() - start < 0.35
    until = time.monotonic() + 5.0  # the abandoned call holds the env until it returns
    while (out := env.call_tool("sleep", {"seconds": 0})) != "slept" and time.monotonic() < until:
        pass
    assert out == "slept"
    assert env.call_tool("boom", {}) == "error: kaboom"
    big = env.call_tool("big", {})
    assert big.startswith("x" * 100) and big.endswith("[... truncated 9900 chars]")
    with pytest.raises(ValueError, match="no scripted expert"):
        demonstration(env, task)
    inline = SlowEnv(ToolEnvConfig(timeout_s=None))
    inline.reset(Task("s-0", "slow", "Sleep.", "slept"))
    assert inline.call_tool("boom", {}) == "error: kaboom"
    for bad in ({"timeout_s": 0}, {"timeout_s": float("inf")}, {"max_output_chars": 3}):
        with pytest.raises(ValueError):
            ToolEnvConfig(**bad)


def test_sqlite_is_read_only_and_bounded() -> None:
    env = SqliteEnv(max_rows=5, query_time_s=0.2)
    env.reset(sample_tasks("sqlite", 1, seed=0)[0])
    count = env.call_tool("query", {"sql": "SELECT COUNT(*) FROM orders"})
    for sql in ("DELETE FROM orders", "DROP TABLE orders", "UPDATE orders SET amount = 0",
                "INSERT INTO customers VALUES (99, 'Eve', 'Nowhere')", "PRAGMA query_only = OFF",
                "ATTACH DATABASE 'x.db' AS x", "CREATE TABLE t (x)"):
        assert env.call_tool("query", {"sql": sql}).startswith("error: not allowed"), sql
    assert env.call_tool("query", {"sql": "SELECT COUNT(*) FROM orders"}) == count
    assert env.call_tool("query", {"sql": "SELEC 1"}).startswith("error: SQL error")
    assert env.call_tool("query", {"sql": "SELECT * FROM nope"}).startswith("error: SQL error")
    rows = env.call_tool("query", {"sql": "SELECT * FROM orders"}).splitlines()
    assert rows[0] == "id | customer_id | product | amount | year" and len(rows) == 7
    assert rows[-1].startswith("... (more than 5 rows")
    start = time.monotonic()
    endless = ("WITH RECURSIVE c(x) AS (SELECT 1 UNION ALL SELECT x + 1 FROM c) "
               "SELECT COUNT(*) FROM c")
    assert env.call_tool("query", {"sql": endless}) == "error: query took longer than 0.2 s"
    assert time.monotonic() - start < 2.0
    env.close()
    with pytest.raises(ValueError, match="reset"):
        env.call_tool("query", {"sql": "SELECT 1"})


def test_files_sandbox(tmp_path: Path) -> None:
    env = FilesEnv(ToolEnvConfig(max_output_chars=500))
    env.reset(sample_tasks("files", 1, seed=0)[0])
    root = env.root
    assert root is not None and root.is_dir()
    assert env.call_tool("ls", {"path": "/"}) == "etc/\nhome/\nsrv/\nvar/"
    assert env.call_tool("cat", {"path": "etc/hostname"}).startswith("node-")
    (tmp_path / "secret.txt").write_text("password = hunter2\n")
    (root / "srv" / "link").symlink_to(tmp_path)
    (root / "etc" / "passwd").symlink_to(tmp_path / "secret.txt")
    for tool, args in (("cat", {"path": "../secret.txt"}), ("cat", {"path": "/srv/../../x"}),
                       ("ls", {"path": ".."}), ("cat", {"path": "/srv/link/secret.txt"}),
                       ("cat", {"path": "/etc/passwd"}), ("grep", {"pattern": "x", "path": "/.."}),
                       ("cat", {"path": "/nope"}), ("cat", {"path": "/srv"})):
        assert env.call_tool(tool, args).startswith("error: "), (tool, args)
    assert "hunter2" not in env.call_tool("grep", {"pattern": "password", "path": "/"})
    assert str(root) not in env.call_tool("cat", {"path": "/srv/link/secret.txt"})
    (root / "var" / "big.log").write_text("ERROR disk full\n" * 10_000)
    big = env.call_tool("cat", {"path": "/var/big.log"})
    assert len(big) < 600 and big.endswith("chars]")
    grep = env.call_tool("grep", {"pattern": "disk full", "path": "/var"})
    assert grep.startswith("10000 matches\n/var/big.log:1:ERROR disk full") and len(grep) < 600
    env.reset(sample_tasks("files", 2, seed=0)[1])
    assert not root.exists() and env.root is not None and env.root.is_dir()
    second = env.root
    env.close()
    assert not second.exists() and env.root is None


class EchoEnv(ToolEnv):
    """The user-defined environment of the package docstring."""

    name = "echo"

    def system_prompt(self) -> str:
        return "Repeat the word with the echo tool, then answer: The answer is <word>."

    def tools(self) -> list[ToolSpec]:
        return [ToolSpec.build("echo", "Return the text.", text=("string", "The text"))]

    def _handlers(self) -> Mapping[str, Callable[..., str]]:
        return {"echo": lambda text: text}

    def _build(self, task: Task) -> None:
        pass

    def expert_turn(self, task: Task, outputs: Sequence[str]) -> ExpertTurn:
        if outputs:
            return ExpertTurn.final(outputs[-1])
        return ExpertTurn.call("I echo the word.", "echo", text=task.data["word"])


def echo_tasks(n: int, seed: int) -> list[Task]:
    rng = random.Random(seed)
    words = [rng.choice(["apple", "river", "cloud"]) for _ in range(n)]
    return [Task(f"echo-{seed}-{i}", "echo", f"Echo the word {w}.", w, {"word": w})
            for i, w in enumerate(words)]


def test_registry() -> None:
    assert set(BUILTINS) <= set(names())
    with pytest.raises(ValueError, match="already registered"):
        register("sqlite", SqliteEnv, sqlite_db.sample_tasks)
    with pytest.raises(KeyError, match="calculator"):
        make("nope")
    with pytest.raises(KeyError):
        sample_tasks("nope", 1, seed=0)
    with pytest.raises(ValueError):
        sample_tasks("sqlite", -1, seed=0)
    register("echo", EchoEnv, echo_tasks)
    register("echo-dups", EchoEnv, lambda n, seed: [Task("same", "echo-dups", "Hi.", "hi")] * n)
    register("sqlite-bad", SqliteEnv, echo_tasks)
    try:
        assert "echo" in names()
        env = make("echo", config=ToolEnvConfig(timeout_s=1.0))
        for task in sample_tasks("echo", 5, seed=1):
            messages = demonstration(env, task)
            assert messages[3] == {"role": "tool", "name": "echo", "content": task.answer}
            assert env.score(messages[-1]["content"]) == 1.0
        env.close()
        with pytest.raises(ValueError, match="named 'echo'"):
            make("echo-dups")
        with pytest.raises(ValueError, match="duplicate task ids"):
            sample_tasks("echo-dups", 2, seed=0)
        with pytest.raises(ValueError, match="Tasks of env 'sqlite-bad'"):
            sample_tasks("sqlite-bad", 1, seed=0)
    finally:
        unregister("echo")
        unregister("echo-dups")
        unregister("sqlite-bad")
    assert "echo" not in names()
    with pytest.raises(KeyError):
        unregister("echo")


def test_integers_past_a_floats_range_are_observations_not_crashes() -> None:
    """JSON spells integers of any size; a 400-digit one for a number parameter must
    not escape call_tool as an OverflowError (which would fail the whole episode)."""
    env = make("calculator")
    env.reset(sample_tasks("calculator", 1, seed=0)[0])
    spec = next(s for s in env.tools() if s.name == "convert")
    huge = {"value": 10**400, "from_unit": "m", "to_unit": "km"}
    assert validate_arguments(spec, huge)["value"] == 10**400
    assert env.call_tool("convert", huge).startswith("error: ")
    with pytest.raises(ToolError, match="must be a number"):
        env.call_tool("convert", {**huge, "value": float("inf")})
    env.close()


def test_calculator_bounds_the_magnitude_of_literals_too() -> None:
    for expression in ("1e200", "-1e200", "1" + "0" * 150, "1e999"):
        with pytest.raises(ToolError, match="below 1e100"):
            calculator.evaluate(expression)
    assert calculator.evaluate("1e99") == 1e99


def test_files_reset_that_fails_leaves_no_temporary_tree(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    real_write = Path.write_text
    written: list[Path] = []

    def failing_write(self: Path, *args: Any, **kwargs: Any) -> int:
        if len(written) == 3:
            raise OSError("disk full")
        written.append(self)
        return real_write(self, *args, **kwargs)

    env = FilesEnv()
    monkeypatch.setattr(Path, "write_text", failing_write)
    with pytest.raises(OSError, match="disk full"):
        env.reset(sample_tasks("files", 1, seed=0)[0])
    monkeypatch.setattr(Path, "write_text", real_write)
    assert list(tmp_path.iterdir()) == []  # the half-written tree is gone
    env.reset(sample_tasks("files", 1, seed=0)[0])  # and the env still works
    assert env.root is not None and env.root.parent == tmp_path.resolve()
    env.close()
    assert list(tmp_path.iterdir()) == []


def test_files_errors_never_show_the_real_path() -> None:
    env = FilesEnv()
    env.reset(sample_tasks("files", 1, seed=0)[0])
    root = env.root
    assert root is not None
    for tool, args in (("cat", {"path": "/" + "a" * 300}), ("ls", {"path": "/etc/" + "b" * 3000}),
                       ("grep", {"pattern": "x", "path": "/srv/" + "c" * 300})):
        out = env.call_tool(tool, args)
        assert out.startswith("error: cannot access /") and "too long" in out, out[:120]
        assert str(root) not in out and "war-files-" not in out
    env.close()


def test_sqlite_bounds_the_size_of_a_result() -> None:
    env = SqliteEnv()
    env.reset(sample_tasks("sqlite", 1, seed=0)[0])
    wide = "SELECT " + ", ".join(["randomblob(3999)"] * 150)  # 2.7 kB of SQL, 600 kB of row
    assert env.call_tool("query", {"sql": wide}) == (
        "error: SQL error: too many columns in result set")
    big = env.call_tool("query", {"sql": "SELECT zeroblob(4001)"})  # values are capped at 4 kB
    assert big == "error: SQL error: string or blob too big"
    tall = ("WITH RECURSIVE c(x) AS (SELECT 1 UNION ALL SELECT x + 1 FROM c LIMIT 12) "
            "SELECT x, " + ", ".join(["zeroblob(3999)"] * 99) + " FROM c")  # 396 kB a row
    lines = env._handlers()["query"](sql=tall).splitlines()  # (before call_tool truncates)
    assert [line[:4] for line in lines[:4]] == ["x | ", "1 | ", "2 | ", "3 | "]
    assert lines[10].startswith("10 | ")
    assert len(lines) == 12 and lines[-1].startswith("... (rows left out: the result passes")
    small = env.call_tool("query", {"sql": "SELECT id, name FROM customers LIMIT 2"})
    assert small.splitlines()[0] == "id | name" and len(small.splitlines()) == 3
    env.close()


def test_a_close_during_a_reset_frees_what_the_reset_builds(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """An episode cancelled while its reset runs in a worker thread: the driver closes the
    environment from another thread; the tree the reset is writing must still be deleted."""
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    entered, release = threading.Event(), threading.Event()
    real_generate = files.generate

    def slow_generate(seed: int) -> files.World:
        entered.set()
        release.wait(10)
        return real_generate(seed)

    task = sample_tasks("files", 1, seed=0)[0]
    monkeypatch.setattr(files, "generate", slow_generate)
    env = FilesEnv()
    resetting = threading.Thread(target=env.reset, args=(task,))
    resetting.start()
    assert entered.wait(10)
    closing = threading.Thread(target=env.close)
    closing.start()
    closing.join(0.2)
    release.set()
    resetting.join(10)
    closing.join(10)
    assert env.root is None and list(tmp_path.iterdir()) == []


def test_sqlite_names_an_sql_error_that_mentions_interrupted_as_such() -> None:
    env = SqliteEnv(query_time_s=0.2)
    env.reset(sample_tasks("sqlite", 1, seed=0)[0])
    assert env.call_tool("query", {"sql": "SELECT * FROM interrupted"}) == (
        "error: SQL error: no such table: interrupted")
    endless = ("WITH RECURSIVE c(x) AS (SELECT 1 UNION ALL SELECT x + 1 FROM c) "
               "SELECT COUNT(*) FROM c")
    assert env.call_tool("query", {"sql": endless}) == "error: query took longer than 0.2 s"
    env.close()


class BlockingEnv(ToolEnv):
    """A test environment whose ``wait`` tool blocks on an event (past any small timeout)
    and whose ``echo`` tool counts how often, and how concurrently, it runs."""

    name = "blocking"

    def __init__(self, config: ToolEnvConfig | None = None) -> None:
        super().__init__(config)
        self.release = threading.Event()
        self.entered = threading.Event()
        self.echoes = 0
        self.active = 0
        self.most_active = 0
        self.teardowns = 0

    def system_prompt(self) -> str:
        return "Test tools."

    def tools(self) -> list[ToolSpec]:
        return [ToolSpec.build("wait", "Wait."), ToolSpec.build("echo", "Echo.")]

    def _handlers(self) -> Mapping[str, Callable[..., str]]:
        def wait() -> str:
            self._enter()
            self.entered.set()
            try:
                self.release.wait(10)
                return "waited"
            finally:
                self.active -= 1

        def echo() -> str:
            self._enter()
            self.echoes += 1
            time.sleep(0.02)
            self.active -= 1
            return "echo"

        return {"wait": wait, "echo": echo}

    def _enter(self) -> None:
        self.active += 1
        self.most_active = max(self.most_active, self.active)

    def _build(self, task: Task) -> None:
        pass

    def _teardown(self) -> None:
        self.teardowns += 1


def _until(condition: Callable[[], bool], seconds: float = 5.0) -> bool:
    deadline = time.monotonic() + seconds
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)
    return True


_BLOCKING_TASK = Task("b-0", "blocking", "Wait.", "waited")


def test_a_call_while_a_timed_out_one_still_runs_is_refused_at_once(
        caplog: pytest.LogCaptureFixture) -> None:
    env = BlockingEnv(ToolEnvConfig(timeout_s=0.05))
    env.reset(_BLOCKING_TASK)
    try:
        assert env.running_tool is None
        with caplog.at_level("WARNING", logger="war.rollout.envs.base"):
            assert env.call_tool("wait", {}) == "error: tool wait timed out after 0.05 s"
        assert env.running_tool == "wait"
        assert "tool wait timed out after 0.05 s and still runs" in caplog.text
        worker = next(t for t in threading.enumerate() if t.name == "war-tool-wait")
        assert worker.daemon  # (the process can exit while it runs)
        start = time.monotonic()
        out = env.call_tool("echo", {})
        assert time.monotonic() - start < 0.5  # neither blocked nor waited a deadline
        assert out.startswith("error: previous tool call wait still running after its "
                              "timeout of 0.05 s"), out
        assert out.endswith("tool echo was not run")
        assert env.echoes == 0  # not run beside it
        env.release.set()
        assert _until(lambda: env.running_tool is None)
        assert _until(lambda: "tool wait returned" in caplog.text)
        assert env.call_tool("echo", {}) == "echo"
        assert env.echoes == 1 and env.most_active == 1
    finally:
        env.release.set()
        env.close()


def test_close_does_not_hang_on_a_timed_out_call(caplog: pytest.LogCaptureFixture) -> None:
    env = BlockingEnv(ToolEnvConfig(timeout_s=0.05))
    env.close_wait_s = 0.1
    env.reset(_BLOCKING_TASK)
    try:
        assert env.call_tool("wait", {}).startswith("error: tool wait timed out")
        start = time.monotonic()
        with caplog.at_level("WARNING", logger="war.rollout.envs.base"):
            env.close()
        assert time.monotonic() - start < 2.0 and env.teardowns >= 2  # (reset's and this)
        assert "closing while tool wait still runs" in caplog.text
        # reset again: the abandoned call still holds the environment's state
        env.reset(_BLOCKING_TASK)
        assert env.call_tool("echo", {}).startswith("error: previous tool call wait")
        env.release.set()
        assert _until(lambda: env.running_tool is None)
        assert env.call_tool("echo", {}) == "echo"
    finally:
        env.release.set()
        env.close()


def test_close_waits_for_a_timed_out_call_that_returns_soon() -> None:
    env = BlockingEnv(ToolEnvConfig(timeout_s=0.05))
    env.close_wait_s = 5.0
    env.reset(_BLOCKING_TASK)
    assert env.call_tool("wait", {}).startswith("error: tool wait timed out")
    timer = threading.Timer(0.1, env.release.set)
    timer.start()
    start = time.monotonic()
    env.close()  # returns once the call does, not after close_wait_s
    assert time.monotonic() - start < 4.0 and env.running_tool is None
    timer.join(5)


def test_calls_from_two_threads_run_one_at_a_time() -> None:
    env = BlockingEnv(ToolEnvConfig(timeout_s=5.0))
    env.reset(_BLOCKING_TASK)
    outs: list[str] = []
    waiting = threading.Thread(target=lambda: outs.append(env.call_tool("wait", {})))
    waiting.start()
    try:
        assert env.entered.wait(5)
        echoing = threading.Thread(target=lambda: outs.append(env.call_tool("echo", {})))
        echoing.start()
        echoing.join(0.1)
        assert echoing.is_alive() and env.echoes == 0  # waits for the call within its deadline
        env.release.set()
        waiting.join(5)
        echoing.join(5)
        assert sorted(outs) == ["echo", "waited"] and env.most_active == 1
    finally:
        env.release.set()
        env.close()

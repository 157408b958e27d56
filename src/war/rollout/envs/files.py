"""The ``files`` environment: questions answered by exploring a small generated file tree.

Knows: how to generate a tree from a seed (``/etc`` host files, ``/srv/<service>/`` configs of
``key = value`` lines, ``/var/log/<service>.log`` logs, ``/home/<user>/`` notes and one needle
fact hidden in one user's sub-folder), its question kinds and their answers, the ``ls``, ``cat``
and ``grep`` tools, and its scripted expert (grep for ``key =`` or the log level, then read the
value off the matching line, or ``cat`` the file the first grep found).

Sandbox: each ``reset`` writes the tree to a fresh temporary directory (deleted by ``close``);
tool paths are virtual (``/srv/app.conf`` lives under that directory), ``..`` is refused and a
path whose real location (symlinks resolved) is outside the directory is rejected; outputs
never show real paths, nor do errors (an OSError becomes a ToolError naming the path given).
``grep`` matches a fixed string (no regexes: a Python regex cannot be interrupted), skips
symlinks and big files and stops at a deadline. Does not know binary files.
"""

from __future__ import annotations

import math
import random
import shutil
import tempfile
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from war.rollout.envs.base import Task, ToolEnv, ToolEnvConfig, ToolError, ToolSpec
from war.rollout.envs.expert import ExpertTurn

KINDS = ("config", "needle", "errors", "which_service", "two_step")
_SERVICES = ("payments", "search", "auth", "billing", "inventory", "gateway", "mailer",
             "reports", "catalog", "checkout", "ledger", "notify")
_USERS = ("alice", "bob", "carol", "dave", "erin", "frank", "grace", "heidi", "ivan", "judy")
_CONFIG_NAMES = ("app.conf", "service.conf", "settings.ini", "config.ini")
_MESSAGES = ("request handled", "cache miss for user session", "connection reset by peer",
             "retrying upstream call", "health check ok", "slow query detected",
             "worker restarted", "config reloaded", "payment provider timeout", "disk usage high")
_FILLER = ("- buy coffee beans", "standup moved to 10:30", "review open pull requests",
           "ask about the new laptop", "water the plants on friday", "read the design doc")
_ASK = {
    "port": ("What port does the {service} service use?",
             "Which port is the {service} service configured to listen on?"),
    "host": ("What host address is the {service} service bound to?",
             "Which host does the {service} service run on?"),
    "workers": ("How many workers does the {service} service run?",
                "What is the worker count of the {service} service?"),
    "log_level": ("What is the log level of the {service} service?",
                  "Which log level is set for the {service} service?"),
    "owner": ("Who owns the {service} service?", "Which user owns the {service} service?"),
    "timeout": ("What timeout is configured for the {service} service?",
                "How long is the timeout of the {service} service?"),
}
_LABELS = {"host": "host address", "workers": "number of workers", "log_level": "log level",
           "owner": "owner", "timeout": "timeout"}
_WHERE = (" The configs are under /srv.", " Configs live in /srv/<service>/.", " Look in /srv.")
_NEEDLES = {"code_name": "code name", "locker_id": "locker id", "backup_host": "backup host"}


@dataclass(frozen=True)
class World:
    """A generated tree: ``files`` (virtual path -> text) and the facts questions ask about."""

    files: dict[str, str]
    configs: dict[str, dict[str, str]]
    errors: dict[str, int]
    needle: tuple[str, str, str]


def generate(seed: int) -> World:
    """The tree of ``seed``."""
    rng = random.Random(seed)
    services, users = rng.sample(_SERVICES, rng.randint(3, 5)), rng.sample(_USERS, 3)
    host = f"node-{rng.randint(1, 99)}"
    files = {"/etc/hostname": f"{host}\n",
             "/etc/motd": f"Welcome to {host}. Maintenance window: Sundays 02:00-04:00.\n"}
    configs, errors = {}, {}
    for service, port in zip(services, rng.sample(range(1024, 10000), len(services)), strict=True):
        conf = {"name": service, "port": str(port), "workers": str(rng.randint(1, 32)),
                "host": f"10.0.{rng.randint(0, 255)}.{rng.randint(1, 254)}",
                "log_level": rng.choice(("debug", "info", "warning", "error")),
                "owner": rng.choice(users), "timeout": f"{rng.choice((5, 10, 15, 30, 60))}s"}
        configs[service], keys = conf, rng.sample(list(conf), len(conf))
        files[f"/srv/{service}/{rng.choice(_CONFIG_NAMES)}"] = (
            f"# {service} service configuration\n" + "".join(f"{k} = {conf[k]}\n" for k in keys))
        files[f"/srv/{service}/README.md"] = f"# {service}\nThe {service} service lives here.\n"
        levels = rng.choices(("INFO", "WARN", "ERROR"), weights=(6, 2, 2), k=rng.randint(6, 16))
        errors[service] = levels.count("ERROR")
        files[f"/var/log/{service}.log"] = "".join(sorted(
            f"2024-{rng.randint(1, 12):02d}-{rng.randint(1, 28):02d} {rng.randint(0, 23):02d}:"
            f"{rng.randint(0, 59):02d} {level} {rng.choice(_MESSAGES)}\n" for level in levels))
    for user in users:
        files[f"/home/{user}/notes.txt"] = (
            f"editor = {rng.choice(('vim', 'emacs', 'nano', 'helix'))}\n"
            f"desk = {rng.choice('ABCDEF')}-{rng.randint(1, 40)}\nteam = {rng.choice(services)}\n")
    key = rng.choice(sorted(_NEEDLES))
    value = {"code_name": f"{rng.choice(('blue', 'silent', 'amber', 'rapid'))}-"
                          f"{rng.choice(('falcon', 'otter', 'lynx', 'heron'))}",
             "locker_id": f"L-{rng.randint(100, 999)}",
             "backup_host": f"db{rng.randint(1, 9)}.internal"}[key]
    lines = rng.sample(_FILLER, 4)
    lines.insert(rng.randint(0, 4), f"{key} = {value}")
    owner = rng.choice(users)
    path = (f"/home/{owner}/{rng.choice(('projects', 'docs', 'archive'))}/"
            f"{rng.choice(('todo.txt', 'ideas.md', 'plan.txt'))}")
    files[path] = "\n".join(lines) + "\n"
    return World(files, configs, errors, (owner, key, value))


def _question(rng: random.Random, kind: str, seed: int) -> tuple[dict[str, Any], str, str]:
    world = generate(seed)
    service = rng.choice(sorted(world.configs))
    conf = world.configs[service]
    data: dict[str, Any] = {"kind": kind, "seed": seed}
    if kind == "config":
        data |= {"service": service, "key": rng.choice(sorted(_ASK))}
        return data, rng.choice(_ASK[data["key"]]).format(**data) + rng.choice(_WHERE), \
            conf[data["key"]]
    if kind == "needle":
        user, key, value = world.needle
        label = _NEEDLES[key]
        data |= {"user": user, "key": key}
        return data, rng.choice((f"One of the notes under /home/{user} mentions a {label}. "
                                 "What is it?", f"What is the {label} written in {user}'s files "
                                 f"under /home/{user}?")), value
    if kind == "errors":
        data["service"] = service
        return data, rng.choice((f"How many ERROR lines are in /var/log/{service}.log?",
                                 f"Count the ERROR entries in the log /var/log/{service}.log.")
                                ), str(world.errors[service])
    data["port"] = conf["port"]
    if kind == "which_service":
        return data, f"Which service listens on port {conf['port']}?" + rng.choice(_WHERE), \
            service
    data["key"] = rng.choice(sorted(_LABELS))
    return data, (f"What is the {_LABELS[data['key']]} of the service that listens on port "
                  f"{conf['port']}?" + rng.choice(_WHERE)), conf[data["key"]]


def sample_tasks(n: int, seed: int) -> list[Task]:
    """``n`` tasks from ``seed``, kinds in rotation, each with its own tree."""
    if isinstance(n, bool) or not isinstance(n, int) or n < 0:
        raise ValueError(f"n must be a non-negative int, got {n!r}")
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise ValueError(f"seed must be an int, got {seed!r}")
    rng, tasks = random.Random(seed), []
    for i in range(n):
        data, prompt, answer = _question(rng, KINDS[(seed + i) % len(KINDS)], rng.getrandbits(32))
        tasks.append(Task(f"files-{seed}-{i}", "files", prompt, answer, data))
    return tasks


def _value(output: str) -> str:
    """The value of the last ``path:line:key = value`` (or ``key = value``) line of ``output``."""
    return output.strip().splitlines()[-1].split(" = ", 1)[-1].strip()


def _match_path(grep_output: str) -> str:
    return grep_output.strip().splitlines()[-1].split(":", 1)[0]


def _virtual_errors(tool: Callable[..., str]) -> Callable[..., str]:
    """``tool`` with an OSError (whose message names the real path, e.g. a name too long)
    turned into a ToolError naming the path the policy gave."""
    def run(**args: Any) -> str:
        try:
            return tool(**args)
        except OSError as exc:
            reason = exc.strerror or type(exc).__name__
            raise ToolError(f"cannot access {str(args.get('path', '')).strip()}: {reason}"
                            ) from None
    return run


class FilesEnv(ToolEnv):
    """A generated tree in a temporary directory per task; tools see it as ``/``."""

    name = "files"

    def __init__(self, config: ToolEnvConfig | None = None, *, max_matches: int = 50,
                 max_file_bytes: int = 1_000_000, grep_time_s: float = 2.0) -> None:
        super().__init__(config)
        for what, value in (("max_matches", max_matches), ("max_file_bytes", max_file_bytes)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{what} must be a positive int, got {value!r}")
        if (isinstance(grep_time_s, bool) or not isinstance(grep_time_s, int | float)
                or not math.isfinite(grep_time_s) or grep_time_s <= 0):
            raise ValueError(f"grep_time_s must be a positive number, got {grep_time_s!r}")
        self.max_matches, self.max_file_bytes = max_matches, max_file_bytes
        self.grep_time_s = float(grep_time_s)
        self.root: Path | None = None

    def system_prompt(self) -> str:
        return ("You answer questions about the files of a server with the ls, cat and grep "
                "tools. Paths start at /. When you know the answer, reply with: The answer is "
                "<answer>.")

    def tools(self) -> list[ToolSpec]:
        return [
            ToolSpec.build("ls", "List a directory (folders end with /).",
                           path=("string", "The directory, e.g. /srv")),
            ToolSpec.build("cat", "Show the content of a file.",
                           path=("string", "The file, e.g. /etc/hostname")),
            ToolSpec.build("grep", "Find the lines containing a fixed string in a file or, "
                           "recursively, a directory; prints path:line:text.",
                           pattern=("string", "The text to find (not a regex)"),
                           path=("string", "The file or directory to search")),
        ]

    def _handlers(self) -> Mapping[str, Callable[..., str]]:
        return {name: _virtual_errors(tool)
                for name, tool in (("ls", self._ls), ("cat", self._cat), ("grep", self._grep))}

    def _build(self, task: Task) -> None:
        if task.data.get("kind") not in KINDS or not isinstance(task.data.get("seed"), int):
            raise ValueError(f"files task {task.task_id}: data needs a known kind and an int seed")
        root = Path(tempfile.mkdtemp(prefix="war-files-")).resolve()
        try:
            for path, text in generate(task.data["seed"]).files.items():
                real = root / path.lstrip("/")
                real.parent.mkdir(parents=True, exist_ok=True)
                real.write_text(text, encoding="utf-8")
        except BaseException:  # (a half-written tree is no one's to delete later)
            shutil.rmtree(root, ignore_errors=True)
            raise
        self.root = root

    def _teardown(self) -> None:
        if self.root is not None:
            shutil.rmtree(self.root, ignore_errors=True)
            self.root = None

    def _resolve(self, path: str) -> tuple[str, Path]:
        """(virtual path, real path) of an existing path inside the sandbox."""
        root = self.root
        if root is None:
            raise ToolError("the file tree is closed")
        parts = [p for p in path.strip().split("/") if p not in ("", ".")]
        if ".." in parts or "\x00" in path:
            raise ToolError(f"path {path!r} is not allowed ('..' leaves the root)")
        virtual, real = "/" + "/".join(parts), root.joinpath(*parts)
        resolved = real.resolve()
        if resolved != root and root not in resolved.parents:
            raise ToolError(f"path {virtual} points outside the root")
        if not real.exists():
            raise ToolError(f"no such file or directory: {virtual}")
        return virtual, real

    def _ls(self, path: str) -> str:
        virtual, real = self._resolve(path)
        if not real.is_dir():
            return virtual
        entries = sorted(p.name + "/" * p.is_dir() for p in real.iterdir())
        return "\n".join(entries) if entries else "(empty directory)"

    def _cat(self, path: str) -> str:
        virtual, real = self._resolve(path)
        if real.is_dir():
            raise ToolError(f"{virtual} is a directory (use ls)")
        with real.open("rb") as handle:
            data = handle.read(self.max_file_bytes + 1)
        text = data[:self.max_file_bytes].decode("utf-8", errors="replace")
        return text + ("\n[... file is longer]" if len(data) > self.max_file_bytes else "")

    def _grep(self, pattern: str, path: str) -> str:
        if not pattern or len(pattern) > 200:
            raise ToolError("pattern must be 1 to 200 characters")
        virtual, real = self._resolve(path)
        root, deadline = self.root or real, time.monotonic() + self.grep_time_s
        targets = [real] if real.is_file() else sorted(p for p in real.rglob("*") if p.is_file())
        matches: list[str] = []
        count = 0
        for target in targets:
            if time.monotonic() > deadline:
                raise ToolError(f"grep took longer than {self.grep_time_s:g} s")
            if (target.is_symlink() or root not in target.resolve().parents
                    or target.stat().st_size > self.max_file_bytes):
                continue
            shown = "/" + target.relative_to(root).as_posix() if target != real else virtual
            text = target.read_text(encoding="utf-8", errors="replace")
            for number, line in enumerate(text.splitlines(), 1):
                if pattern in line:
                    count += 1
                    if len(matches) < self.max_matches:
                        matches.append(f"{shown}:{number}:{line}")
        head = f"{count} match" + "es" * (count != 1)
        more = [f"... ({count - len(matches)} more)"] if count > len(matches) else []
        return "\n".join([head, *matches, *more])

    def expert_turn(self, task: Task, outputs: Sequence[str]) -> ExpertTurn:
        """grep for the fact's ``key =`` line and read the value; ``two_step`` cats the file."""
        data, kind = task.data, task.data["kind"]
        if not outputs:
            if kind == "config":
                return ExpertTurn.call(f"I search the {data['service']} config for {data['key']}.",
                                       "grep", pattern=f"{data['key']} =",
                                       path=f"/srv/{data['service']}")
            if kind == "needle":
                return ExpertTurn.call(f"I search the files of {data['user']} for {data['key']}.",
                                       "grep", pattern=f"{data['key']} =",
                                       path=f"/home/{data['user']}")
            if kind == "errors":
                return ExpertTurn.call("I search the log for ERROR lines.", "grep",
                                       pattern="ERROR", path=f"/var/log/{data['service']}.log")
            return ExpertTurn.call(f"I search the configs for port {data['port']}.", "grep",
                                   pattern=f"port = {data['port']}", path="/srv")
        if kind == "errors":
            return ExpertTurn.final(outputs[0].split()[0])
        if kind == "which_service":
            return ExpertTurn.final(_match_path(outputs[0]).split("/")[2])
        if kind == "two_step" and len(outputs) == 1:
            path = _match_path(outputs[0])
            return ExpertTurn.call(f"The config is {path}. I read it.", "cat", path=path)
        if kind == "two_step":
            line = next(x for x in outputs[-1].splitlines() if x.startswith(f"{data['key']} ="))
            return ExpertTurn.final(_value(line))
        return ExpertTurn.final(_value(outputs[0]))

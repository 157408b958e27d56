"""A rollout run: several synchronous RL steps over local replicas, with figures.

Knows: the run's configuration (model, replicas, environments, sizes; from a YAML
or JSON file), how tasks are drawn for each step (from a fixed pool, so tasks
recur across steps as they do over an RL dataset's epochs), how local replicas are
built (one engine thread each), the figures of each step: makespan,
throughput, tokens/step, acceptance, prefix-cache hit rate, reward, and the run
folder's files: which settings determine its trajectories (recorded in
``run_settings.json`` when a run starts, so that a resume under other settings is
refused instead of mixing data; the model by its folder and its weights' fingerprint,
``fingerprint.py``), checking up front that every file the run writes at its end can be
written, and removing again the folders a refused start created (still empty). Does not
know progress bars or plots
(``war.cli``, ``report.py``), nor the engine's internals.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import logging
import random
import time
from collections.abc import Callable, Collection, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import torch
import yaml

from war.backends.base import ReplicaUnavailable
from war.backends.http import check_base_url
from war.data import policy_path
from war.engine.async_engine import AsyncEngine
from war.engine.config import EngineConfig
from war.engine.engine import Engine
from war.engine.stats import StepRecord
from war.outputs import (
    check_output_dir,
    check_output_file,
    removing_created_folders,
    write_json,
)
from war.rollout.agent import AgentConfig, PolicyIO
from war.rollout.driver import RolloutConfig, run_step_async, trajectory_id
from war.rollout.envs import Task, names, sample_tasks
from war.rollout.fingerprint import model_fingerprint
from war.rollout.limits import MAX_REPLICAS, MAX_TORCH_THREADS
from war.rollout.remote import GROUPS, STEP_TIMEOUT_S, Endpoint, close_all, connect, routed
from war.rollout.trajectory import Trajectory, write_parquet
from war.router.policies import POLICIES
from war.router.router import Router
from war.spec.config import SpecConfig

log = logging.getLogger(__name__)


def _default_engine() -> EngineConfig:
    return EngineConfig(kv_cache_bytes=64 * 1024 * 1024, max_num_seqs=64,
                        max_num_batched_tokens=2048)


@dataclass(frozen=True)
class RunConfig:
    """A rollout run; validated on construction.

    * ``model``: a Hugging Face folder (weights, config, tokenizer); ``None``: the
      built-in policy shipped with WAR.
    * ``replicas``: local replicas (one engine each, in this process), at most
      ``MAX_REPLICAS`` (256).
    * ``envs``: registered environments the tasks come from (round robin), each
      named once.
    * ``tasks_per_step``, ``group_size``, ``steps``: the RL steps' shape.
    * ``task_pool``: distinct tasks the steps draw from (default: twice
      ``tasks_per_step``), so that tasks recur across steps.
    * ``torch_threads``: CPU threads of torch, at most ``MAX_TORCH_THREADS`` (1024)
      (``None``: the machine's cores divided among the replicas).
    * ``endpoints``: base URLs of ``war serve`` replicas to run on instead of local
      ones (``war.rollout.remote``); with them ``replicas``, ``torch_threads`` and
      ``engine`` do not apply (a config file or command line that sets them as well
      is refused), and ``model`` gives the tokenizer and chat template (the servers
      should serve its weights).
    * ``routing_policy``: with ``endpoints``, how turns are placed: a WAR routing
      policy's name (``war``, ``cache_aware``, ``least_load``, ``round_robin``; an
      in-process router over the endpoints, with health checks and failover), or
      ``"groups"`` (whole groups to the least-assigned endpoint, as local replicas
      get them). ``None``: ``war``. Refused without ``endpoints``.
    """

    name: str = "rollout"
    model: str | None = None
    replicas: int = 2
    envs: tuple[str, ...] = ("calculator", "sqlite", "files")
    tasks_per_step: int = 16
    group_size: int = 8
    steps: int = 3
    task_pool: int | None = None
    seed: int = 0
    agent: AgentConfig = field(default_factory=AgentConfig)
    engine: EngineConfig = field(default_factory=_default_engine)
    output_dir: str = "runs"
    torch_threads: int | None = None
    endpoints: tuple[str, ...] = ()
    routing_policy: str | None = None

    def __post_init__(self) -> None:
        # Every check runs here, before any model is loaded or file written: a config
        # file's wrong type is one error naming the setting, not a traceback later.
        for name in ("name", "output_dir"):
            value = getattr(self, name)
            if not isinstance(value, str) or not value:
                hint = " (quote it: YAML reads it as a number)" if isinstance(
                    value, (int, float)) and not isinstance(value, bool) else ""
                raise ValueError(f"{name} must be a non-empty string, got {value!r}{hint}")
        # The run's folder is output_dir/name: a name with a separator, or "." / "..",
        # would write somewhere else (another run's folder, or above output_dir).
        if self.name in (".", "..") or "/" in self.name or "\\" in self.name:
            raise ValueError(f"name must be a folder name (no '/', '\\', '.' or '..'), "
                             f"got {self.name!r}")
        if self.model is not None and (not isinstance(self.model, str) or not self.model):
            raise ValueError(f"model must be a model folder (a string) or null, "
                             f"got {self.model!r}")
        for name in ("replicas", "tasks_per_step", "group_size", "steps"):
            value = getattr(self, name)
            if not _is_int(value) or value < 1:
                raise ValueError(f"{name} must be an int >= 1, got {value!r}")
        if not _is_int(self.seed):
            raise ValueError(f"seed must be an int, got {self.seed!r}")
        # A bare string is a sequence too: "calculator" would be read as its letters.
        if isinstance(self.envs, str) or not isinstance(self.envs, (list, tuple)):
            raise ValueError(f"envs must be a list of environment names, got {self.envs!r}")
        object.__setattr__(self, "envs", tuple(self.envs))  # a list is kept as a tuple
        if not self.envs:
            raise ValueError("envs is empty")
        not_names = [e for e in self.envs if not isinstance(e, str)]
        if not_names:
            raise ValueError(f"envs must be environment names (strings), got {not_names}")
        twice = sorted({e for e in self.envs if self.envs.count(e) > 1})
        if twice:  # the pool would hold the same tasks twice, and a step could draw both
            raise ValueError(f"envs lists {twice} more than once; name each environment once")
        unknown = [e for e in self.envs if e not in names()]
        if unknown:
            raise ValueError(f"unknown environments {unknown} (registered: {names()})")
        if self.task_pool is not None:
            if not _is_int(self.task_pool):
                raise ValueError(f"task_pool must be an int or null, got {self.task_pool!r}")
            if self.task_pool < self.tasks_per_step:
                raise ValueError(f"task_pool ({self.task_pool}) < tasks_per_step "
                                 f"({self.tasks_per_step})")
        if self.replicas > MAX_REPLICAS:  # (each one builds an engine and its KV cache)
            raise ValueError(f"replicas must be an int from 1 to {MAX_REPLICAS}, "
                             f"got {self.replicas!r}")
        if self.torch_threads is not None and (not _is_int(self.torch_threads)
                                               or not 1 <= self.torch_threads
                                               <= MAX_TORCH_THREADS):
            raise ValueError(f"torch_threads must be an int from 1 to {MAX_TORCH_THREADS} "
                             f"or null, got {self.torch_threads!r}")
        self._check_endpoints()
        if not isinstance(self.agent, AgentConfig):
            raise ValueError(f"agent must be an AgentConfig, got {self.agent!r}")
        if not isinstance(self.engine, EngineConfig):
            raise ValueError(f"engine must be an EngineConfig, got {self.engine!r}")


    def _check_endpoints(self) -> None:
        if isinstance(self.endpoints, str) or not isinstance(self.endpoints, (list, tuple)):
            raise ValueError(f"endpoints must be a list of war serve URLs, got "
                             f"{self.endpoints!r}")
        urls = []
        for url in self.endpoints:
            if not isinstance(url, str):
                raise ValueError(f"endpoints must be URLs (strings), got {url!r}")
            try:
                urls.append(check_base_url(url))
            except ValueError as exc:
                raise ValueError(f"endpoints: {exc}") from None
        # (one server counted twice would take twice its share; HTTP://H:80 is http://h)
        spellings: dict[tuple[str, str, int | None, str], list[str]] = {}
        for url in urls:
            spellings.setdefault(_server_key(url), []).append(url)
        twice = sorted(v[0] for v in spellings.values() if len(v) > 1)
        if twice:
            same = "; ".join(" = ".join(dict.fromkeys(v)) for v in spellings.values()
                             if len(set(v)) > 1)
            raise ValueError(f"endpoints lists {twice} more than once"
                             f"{f' ({same}: the same server)' if same else ''}; "
                             "name each server once")
        object.__setattr__(self, "endpoints", tuple(urls))
        policy = self.routing_policy
        if policy is None:
            return
        if not self.endpoints:
            raise ValueError(f"routing_policy ({policy!r}) applies to endpoints only (local "
                             "replicas take whole groups each); set endpoints or remove it")
        if policy != GROUPS and policy not in POLICIES:
            raise ValueError(f"routing_policy must be {GROUPS!r} or a routing policy "
                             f"({', '.join(POLICIES)}), got {policy!r}")

    @property
    def remote(self) -> bool:
        """Whether the run's replicas are ``endpoints`` (``war serve`` servers)."""
        return bool(self.endpoints)


LOCAL_ONLY = ("replicas", "torch_threads", "engine")
"""``RunConfig`` settings of local replicas, refused in a config that sets endpoints."""


def _server_key(url: str) -> tuple[str, str, int | None, str]:
    """What names a server in a base URL (checked by ``check_base_url``): the scheme and
    host in lower case, the port unless it is the scheme's default, the path."""
    u = httpx.URL(url)
    return u.scheme, u.host, u.port, u.raw_path.decode("ascii").rstrip("/")


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def load_run_config(path: str | Path, **overrides: Any) -> RunConfig:
    """A ``RunConfig`` from a YAML or JSON file: top-level keys are its fields;
    ``agent`` and ``engine`` (with ``engine.spec``) are nested mappings. Unknown
    keys raise ValueError naming them."""
    text = Path(path).read_text()
    raw = _parse_config_text(text, path)
    if raw is None:
        raw = {}
    if not isinstance(raw, dict):
        raise ValueError(f"{path}: the top level must be a mapping")
    raw.update({k: v for k, v in overrides.items() if v is not None})
    return run_config_from_dict(raw, str(path))


def _parse_config_text(text: str, path: str | Path) -> Any:
    """A config file's text parsed by its suffix: ``.yaml``/``.yml`` (any case) as YAML,
    ``.json`` as JSON, any other as JSON when it is valid JSON and as YAML otherwise
    (JSON first: PyYAML reads YAML 1.1, where JSON's ``1e5`` is a string and a tab
    between tokens an error). ValueError naming the file and how it was read."""
    suffix = Path(path).suffix.lower()
    if suffix in (".yaml", ".yml"):  # (config.YAML is YAML too)
        try:
            return yaml.safe_load(text)
        except yaml.YAMLError as exc:
            raise ValueError(f"{path}: not valid YAML: {exc}") from None
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        if suffix == ".json":
            raise ValueError(f"{path}: not valid JSON (read as JSON for its .json suffix; "
                             f"a YAML file is named .yaml or .yml): {exc}") from None
        json_error = exc
    try:
        return yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise ValueError(f"{path}: neither valid JSON ({json_error}) nor valid YAML ({exc}); "
                         "name it .json or .yaml to be told only that format's error"
                         ) from None


def _build(cls: Any, raw: Any, where: str) -> Any:
    if not isinstance(raw, Mapping):
        raise ValueError(f"{where} must be a mapping, got {raw!r}")
    known = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(raw) - known, key=str)  # (YAML keys may be numbers)
    if unknown:
        raise ValueError(f"{where}: unknown keys {unknown} (known: {sorted(known)})")
    try:
        return cls(**raw)
    except (TypeError, ValueError) as exc:  # (say which file and section the setting is in)
        raise ValueError(f"{where}: {exc}") from None


def run_config_from_dict(raw: Mapping[str, Any], where: str = "config") -> RunConfig:
    data = dict(raw)
    if "agent" in data:
        data["agent"] = _build(AgentConfig, data["agent"], f"{where}: agent")
    if "engine" in data:
        eng = dict(_as_mapping(data["engine"], f"{where}: engine"))
        if eng.get("spec_mode") is False:  # YAML reads a bare `off` as false
            eng["spec_mode"] = "off"
        if "spec" in eng:
            eng["spec"] = _build(SpecConfig, eng["spec"], f"{where}: engine.spec")
        base = dataclasses.asdict(_default_engine())
        base.pop("spec")
        base.update(eng)
        data["engine"] = _build(EngineConfig, base, f"{where}: engine")
    cfg: RunConfig = _build(RunConfig, data, where)
    local = [k for k in LOCAL_ONLY if k in raw]
    if cfg.remote and local:
        raise ValueError(f"{where}: {', '.join(local)} set with endpoints: they are "
                         "settings of local replicas (the servers' engines are set where "
                         "they run: war serve); remove them, or the endpoints")
    return cfg


def _as_mapping(value: Any, where: str) -> Mapping[str, Any]:
    if not isinstance(value, Mapping):
        raise ValueError(f"{where} must be a mapping, got {value!r}")
    return value


def builtin_policy() -> Path:
    """The folder of the built-in policy shipped with WAR (``war train-policy`` made it)."""
    try:
        return policy_path()
    except FileNotFoundError as exc:
        raise ValueError(f"{exc}; build it with `war train-policy --out` that folder "
                         "(war/data/policy)") from None


def task_pool(cfg: RunConfig) -> list[Task]:
    """The run's distinct tasks, round robin over its environments."""
    size = cfg.task_pool or 2 * cfg.tasks_per_step
    per_env = -(-size // len(cfg.envs))
    pools = [sample_tasks(env, per_env, cfg.seed) for env in cfg.envs]
    mixed = [pool[i] for i in range(per_env) for pool in pools]
    return mixed[:size]


def step_tasks(pool: Sequence[Task], n: int, seed: int, rl_step: int) -> list[Task]:
    """The tasks of one RL step: a seeded draw from the pool."""
    rng = random.Random(f"{seed}:{rl_step}")
    return rng.sample(list(pool), n)


def _step_config(cfg: RunConfig, rl_step: int) -> RolloutConfig:
    return RolloutConfig(group_size=cfg.group_size, agent=cfg.agent, rl_step=rl_step,
                         seed=cfg.seed)


def trajectory_ids(cfg: RunConfig) -> set[str]:
    """The ids of every trajectory of the run's steps: what a resumed run may reuse
    (``driver.reusable``). Draws the steps' tasks as ``run_rollout`` does; no model."""
    pool = task_pool(cfg)
    out: set[str] = set()
    for step in range(cfg.steps):  # (each step's RolloutConfig: rl_step=step, group_size)
        for task in step_tasks(pool, cfg.tasks_per_step, cfg.seed, step):
            out.update(trajectory_id(step, task.task_id, g) for g in range(cfg.group_size))
    return out


# ---------------------------------------------------------------- the run's folder

TRAJECTORIES_FILE = "trajectories.jsonl"
PARQUET_FILE = "trajectories.parquet"
SUMMARY_FILE = "summary.json"
SETTINGS_FILE = "run_settings.json"
RUN_FILES = (TRAJECTORIES_FILE, PARQUET_FILE, SUMMARY_FILE, SETTINGS_FILE)
"""The files ``run_rollout`` writes in the run's folder (``war rollout`` adds
``report.png``)."""

SETTINGS_FORMAT = 1


def run_folder(cfg: RunConfig) -> Path:
    """The run's folder: ``output_dir/name``."""
    return Path(cfg.output_dir) / cfg.name


FINGERPRINT_KEY = "model_fingerprint"


def run_model_fingerprint(cfg: RunConfig) -> str | None:
    """``fingerprint.model_fingerprint`` of the run's model folder (the built-in
    policy's for ``model: null``); ``None`` when there is nothing to fingerprint (the
    folder is missing or holds no model files: loading it fails, saying why)."""
    if cfg.model is not None:
        return model_fingerprint(cfg.model)
    try:
        return model_fingerprint(builtin_policy())
    except ValueError:  # (not built: the run says so when it loads it)
        return None


def trajectory_settings(cfg: RunConfig) -> dict[str, Any]:
    """The settings that determine what the run's trajectories hold, as JSON values:
    the policy (``model``, its folder made absolute; ``null`` for the built-in one;
    ``model_fingerprint``, a content fingerprint of that folder's config, tokenizer and
    weights, ``run_model_fingerprint``; and the weights' ``engine.dtype``), the tasks
    (``envs``, ``task_pool``, ``tasks_per_step``, ``seed``), the groups
    (``group_size``), how each episode is sampled and cut (``agent``: turns, token
    limits, temperature, top_p, top_k) and the context cap (``engine.max_model_len``).

    Not in it, since they change how fast trajectories are made but not what they
    hold: ``steps`` (a resumed run may do more or fewer), ``replicas``,
    ``torch_threads``, the engine's memory, batching and speculation settings
    (verification is lossless), ``agent.send_only_new_tokens``, ``name`` and
    ``output_dir``; nor the command's progress bars, nor ``endpoints`` and
    ``routing_policy`` (where a run's servers are and how it places turns on them).
    For a run on ``endpoints``, ``engine`` is ``null``: the servers' dtype and context
    length are set where they run and not known here."""
    agent = cfg.agent
    return {
        "format": SETTINGS_FORMAT,
        "model": None if cfg.model is None else str(Path(cfg.model).resolve()),
        FINGERPRINT_KEY: run_model_fingerprint(cfg),
        "envs": list(cfg.envs),
        "task_pool": cfg.task_pool or 2 * cfg.tasks_per_step,
        "tasks_per_step": cfg.tasks_per_step,
        "group_size": cfg.group_size,
        "seed": cfg.seed,
        "agent": {
            "max_turns": agent.max_turns,
            "max_tokens_per_turn": agent.max_tokens_per_turn,
            "max_total_tokens": agent.max_total_tokens,
            "temperature": float(agent.temperature),
            "top_p": float(agent.top_p),
            "top_k": agent.top_k,
        },
        # (a run on endpoints: their engines' settings are the servers', not recorded)
        "engine": None if cfg.remote else {"dtype": cfg.engine.dtype,
                                           "max_model_len": cfg.engine.max_model_len},
    }


def settings_changes(old: Mapping[str, Any], new: Mapping[str, Any]) -> list[str]:
    """``"setting: old -> new"`` for each setting (dotted: ``agent.temperature``) whose
    value differs between two ``trajectory_settings``; one missing from either side
    shows as ``(not recorded)``."""
    a, b = _flatten(old, new), _flatten(new, old)
    missing = "(not recorded)"
    out = []
    for key in sorted(set(a) | set(b)):
        va, vb = a.get(key, missing), b.get(key, missing)
        if va != vb:  # (1 and 1.0 are the same temperature)
            out.append(f"{key}: {_shown(va, missing)} -> {_shown(vb, missing)}")
    return out


def _shown(value: Any, missing: str) -> str:
    return missing if value is missing else json.dumps(value)


def _flatten(d: Mapping[str, Any], other: Mapping[str, Any], prefix: str = ""
             ) -> dict[str, Any]:
    """``d`` with dotted keys, but for a mapping that ``other`` (the settings it is
    compared with) holds as something else (a run on endpoints' ``engine: null``): kept
    whole, so that the change shows as one, ``engine: null -> {...}``."""
    out: dict[str, Any] = {}
    for key, value in d.items():
        there = other.get(key, {})
        if isinstance(value, Mapping) and isinstance(there, Mapping):
            out.update(_flatten(value, there, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out


def read_run_settings(cfg: RunConfig) -> dict[str, Any] | None:
    """The settings recorded in the run's folder, or ``None`` where there are none (a
    folder of a run older than the file). Raises ValueError naming the file when it
    is not a JSON object."""
    path = run_folder(cfg) / SETTINGS_FILE
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        return None
    except (OSError, UnicodeDecodeError) as exc:
        raise ValueError(f"{path}: cannot read the recorded run settings: {exc}") from None
    try:
        data = json.loads(text)
    except ValueError as exc:
        raise ValueError(f"{path}: the recorded run settings are not JSON ({exc}); "
                         "delete it only if its folder's trajectories are of this run's "
                         "settings") from None
    if not isinstance(data, dict):
        raise ValueError(f"{path}: the recorded run settings are not a JSON object")
    return data


def _has_trajectories(cfg: RunConfig) -> bool:
    path = run_folder(cfg) / TRAJECTORIES_FILE
    try:
        return path.is_file() and path.stat().st_size > 0
    except OSError:
        return False


def check_run_settings(cfg: RunConfig) -> None:
    """Raises ValueError, naming each setting that differs (old -> new), when the run's
    folder holds trajectories written under other ``trajectory_settings``: resuming
    would reuse them, mixing two runs' data. A folder without trajectories, or
    without recorded settings (a run older than ``run_settings.json``), passes.

    The model is compared by its fingerprint where both runs have one: a different
    fingerprint is refused (the folder's weights changed, say a new checkpoint written
    in place, even at the same path), the same fingerprint passes even from another
    path (the same weights, moved or copied). Where either has none (settings recorded
    before the fingerprint existed, or a folder with nothing to fingerprint) the model
    is compared by its path alone, as before."""
    _check_settings(cfg, trajectory_settings(cfg))


def _check_settings(cfg: RunConfig, new: Mapping[str, Any]) -> None:
    if not _has_trajectories(cfg):
        return
    old = read_run_settings(cfg)
    if old is None:
        return
    old_fp, new_fp = old.get(FINGERPRINT_KEY), new.get(FINGERPRINT_KEY)
    a = {k: v for k, v in old.items() if k != FINGERPRINT_KEY}
    b = {k: v for k, v in new.items() if k != FINGERPRINT_KEY}
    both = old_fp is not None and new_fp is not None
    if both and old_fp == new_fp:  # the same weights: where they are is no matter
        a.pop("model", None)
        b.pop("model", None)
    changes = settings_changes(a, b)
    folder = run_folder(cfg)
    how = (f"use a new run folder (another name or output_dir), or delete "
           f"{folder / TRAJECTORIES_FILE} to start afresh")
    if "engine" in a and "engine" in b and (a["engine"] is None) != (b["engine"] is None):
        was, now = ("endpoints", "local replicas") if a["engine"] is None else (
            "local replicas", "endpoints")
        how = (f"its trajectories were made on {was} and this run is on {now}, whose "
               f"engines' dtype and context length are not known to be the same; {how}")
    if both and old_fp != new_fp:
        model = b.get("model") or "the built-in policy"
        more = f"; and other settings differ: {'; '.join(changes)}" if changes else ""
        raise ValueError(
            f"{folder} holds trajectories made by other model weights than this run's: "
            f"{FINGERPRINT_KEY}: {json.dumps(old_fp)} -> {json.dumps(new_fp)} (model "
            f"{model}; recorded in {folder / SETTINGS_FILE}){more}. The model folder's "
            f"config, tokenizer or weights changed since (a new checkpoint written in "
            f"place?), and resuming would mix two policies' trajectories: point model at "
            f"the weights those trajectories were made with to resume, or {how}")
    if changes:
        raise ValueError(
            f"{folder} holds trajectories of a run with other settings, which resuming "
            f"would mix with this run's: {'; '.join(changes)} "
            f"(recorded in {folder / SETTINGS_FILE}); {how}")


def record_run_settings(cfg: RunConfig) -> None:
    """``check_run_settings``, then records the run's ``trajectory_settings`` in
    ``run_settings.json`` (atomically; not rewritten when it already says so)."""
    settings = trajectory_settings(cfg)
    _check_settings(cfg, settings)
    path = run_folder(cfg) / SETTINGS_FILE
    try:
        same = read_run_settings(cfg) == settings
    except ValueError:  # (unreadable, and no trajectories rely on it: replaced)
        same = False
    if not same:
        write_json(path, settings, indent=2)


@contextlib.contextmanager
def removing_created_folder(cfg: RunConfig) -> Iterator[None]:
    """Runs the body; when it raises, removes again the folders of the run's path
    (``output_dir/name`` and those above it) that did not exist before it and are
    still empty: a refused start (bad settings, a settings or model mismatch, a model
    that does not load) leaves no empty run folder behind. A folder that existed
    before (the user's, or a resumed run's) is never removed, nor one that holds
    anything."""
    with removing_created_folders([run_folder(cfg)]):
        yield


def check_run_paths(cfg: RunConfig, extra: Sequence[str] = ()) -> Path:
    """Checks, before any work, that the run's folder takes files and that nothing
    (a folder, a file that cannot be replaced) sits where one of the files the run
    writes (``RUN_FILES`` and ``extra``) goes; creates the folder and returns it.
    Raises ValueError naming the path otherwise."""
    folder = check_output_dir(run_folder(cfg), "run folder (output_dir/name)")
    for name in (*RUN_FILES, *extra):
        path = folder / name
        try:
            in_the_way = path.is_dir()
        except OSError:
            in_the_way = False  # (check_output_file says why)
        if in_the_way:
            raise ValueError(f"{path} is a folder where the run writes its {name}: move it "
                             "away or use another run folder (name or output_dir)")
        check_output_file(path, "the run's output file")
    return folder


@dataclass(frozen=True)
class StepSummary:
    rl_step: int
    num_trajectories: int
    num_errors: int
    makespan_s: float
    generated_tokens: int
    tokens_per_s: float
    tokens_per_step: float
    acceptance: float
    prefix_hit_rate: float
    mean_reward: float
    success_by_env: dict[str, float]
    mean_turns: float
    num_reused: int = 0  # trajectories an earlier, stopped run had already finished


def summarize(rl_step: int, trajs: Sequence[Trajectory],
              reused: Collection[str] = ()) -> StepSummary:
    """The figures of one step from its trajectories (see docs: metrics).

    ``reused``: ids of trajectories taken over from an earlier run of the step (a
    resumed run). They count in every figure but the timing ones: the makespan and
    tokens/s are those of the trajectories this run generated (a step whose
    trajectories were all reused has neither)."""
    ok = [t for t in trajs if t.finish_reason != "error"]
    fresh = [t for t in ok if t.trajectory_id not in reused]
    gen = sum(t.num_sampled_tokens for t in ok)
    fresh_gen = sum(t.num_sampled_tokens for t in fresh)
    passes = sum(t.spec.get("forward_passes", 0.0) for t in ok)
    draft = sum(t.spec.get("draft_tokens", 0.0) for t in ok)
    acc = sum(t.spec.get("accepted_tokens", 0.0) for t in ok)
    prompt = sum(t.spec.get("prompt_tokens", 0.0) for t in ok)
    cached = sum(t.spec.get("cached_prompt_tokens", 0.0) for t in ok)
    starts = [t.timings["start"] for t in fresh if "start" in t.timings]
    ends = [t.timings["end"] for t in fresh if "end" in t.timings]
    makespan = max(ends) - min(starts) if starts and ends else 0.0
    by_env: dict[str, list[float]] = {}
    for t in trajs:
        by_env.setdefault(t.env, []).append(t.reward)
    return StepSummary(
        rl_step=rl_step, num_trajectories=len(trajs), num_errors=len(trajs) - len(ok),
        makespan_s=makespan, generated_tokens=gen,
        tokens_per_s=fresh_gen / makespan if makespan > 0 else 0.0,
        tokens_per_step=gen / passes if passes else 0.0,
        acceptance=acc / draft if draft else 0.0,
        prefix_hit_rate=cached / prompt if prompt else 0.0,
        mean_reward=sum(t.reward for t in trajs) / len(trajs) if trajs else 0.0,
        success_by_env={e: sum(r >= 1.0 for r in rs) / len(rs) for e, rs in by_env.items()},
        mean_turns=sum(t.num_turns for t in ok) / len(ok) if ok else 0.0,
        num_reused=sum(t.trajectory_id in reused for t in trajs))


@dataclass
class RunResult:
    config: RunConfig
    run_dir: Path
    steps: list[StepSummary]
    timelines: dict[str, list[StepRecord]]
    step_bounds: list[tuple[float, float]]  # (start, end) of each step, engine clock
    trajectories: list[Trajectory]


def make_replicas(cfg: RunConfig, model_dir: Path) -> dict[str, AsyncEngine]:
    """One engine per replica, each driven by its own thread."""
    threads = cfg.torch_threads or max(1, (torch.get_num_threads()) // cfg.replicas)
    torch.set_num_threads(threads)
    out = {}
    for i in range(cfg.replicas):
        engine = Engine.from_pretrained(model_dir, cfg.engine)
        out[f"replica{i}"] = AsyncEngine(engine)
    return out


async def run_rollout(
    cfg: RunConfig,
    *,
    on_done: Callable[[Trajectory], None] | None = None,
    on_step: Callable[[int, list[Task]], None] | None = None,
    replicas: Mapping[str, AsyncEngine] | Mapping[str, Endpoint] | None = None,
) -> RunResult:
    """Runs ``cfg.steps`` synchronous steps; writes trajectories (JSONL as they
    finish, Parquet at the end) and ``summary.json`` under ``output_dir/name``.
    ``replicas``: the run's local engines (not started; the run starts them) or, for a
    run on ``endpoints``, its connected endpoints (``war.rollout.remote.connect``); a
    caller that passes them closes them. ``None``: the run makes (or connects) and
    closes its own."""
    with removing_created_folder(cfg):  # (a refused start leaves no empty folder)
        return await _run_rollout(cfg, on_done, on_step, replicas)


async def connect_endpoints(cfg: RunConfig, io: PolicyIO) -> dict[str, Endpoint]:
    """The run's ``endpoints``, connected and checked against its tokenizer and its
    model's fingerprint (``war.rollout.remote.connect``; ValueError naming each that
    cannot serve it)."""
    if not cfg.remote:
        raise ValueError("the run has no endpoints (it runs local replicas)")
    return await connect(cfg.endpoints, io.tokenizer.get_vocab_size(),
                         fingerprint=run_model_fingerprint(cfg))


async def _run_rollout(
    cfg: RunConfig,
    on_done: Callable[[Trajectory], None] | None,
    on_step: Callable[[int, list[Task]], None] | None,
    replicas: Mapping[str, AsyncEngine] | Mapping[str, Endpoint] | None,
) -> RunResult:
    # Before any model is loaded or trajectory generated: every file the run writes
    # can be written, and the folder's trajectories (if any) are of these settings.
    run_dir = check_run_paths(cfg)
    check_run_settings(cfg)
    model_dir = Path(cfg.model) if cfg.model else builtin_policy()
    io = PolicyIO.from_folder(model_dir)
    own = replicas is None
    reps: dict[str, Any]
    if replicas is not None:
        reps = dict(replicas)
    else:
        reps = dict(await connect_endpoints(cfg, io) if cfg.remote
                    else make_replicas(cfg, model_dir))
    engines: dict[str, Any] = {} if cfg.remote else reps  # (the local ones: started here)
    summaries: list[StepSummary] = []
    bounds: list[tuple[float, float]] = []
    every: list[Trajectory] = []
    fleet = None
    try:
        # (recorded once the model loads, so that a model that does not load leaves
        # nothing; checked again: the fingerprint is of the weights as they are now)
        record_run_settings(cfg)
        # (in the try: a replica that fails to start, or a task pool that cannot be
        # drawn, must not leave the replicas already started running)
        for engine in engines.values():
            engine.start()
        targets: Mapping[str, Any] = reps
        policy = cfg.routing_policy or "war"
        if cfg.remote and policy != GROUPS:
            fleet = routed(reps, policy)
            await fleet.router.start()
            targets = {"router": fleet}
        pool = task_pool(cfg)
        for step in range(cfg.steps):
            tasks = step_tasks(pool, cfg.tasks_per_step, cfg.seed, step)
            await _observe_step(reps, step, cfg.remote,
                                None if fleet is None else fleet.router)
            if on_step is not None:
                on_step(step, tasks)
            t0 = time.perf_counter()
            fresh: set[str] = set()  # generated now (the others resume an earlier run)
            trajs = await run_step_async(
                tasks, targets, io, _step_config(cfg, step),
                output=run_dir / TRAJECTORIES_FILE, on_done=_noting(fresh, on_done))
            bounds.append((t0, time.perf_counter()))
            summaries.append(summarize(
                step, trajs, {t.trajectory_id for t in trajs} - fresh))
            every.extend(trajs)
        # (engine steps are recorded by local engines only; a server keeps its own)
        timelines = {name: await e.call(_timeline) for name, e in engines.items()}
    finally:
        if fleet is not None:
            await fleet.router.close(close_backends=False)
        if own:
            if cfg.remote:
                await close_all(reps)
            else:
                for r in reps.values():
                    await r.close()
    write_parquet(every, run_dir / PARQUET_FILE)
    result = RunResult(cfg, run_dir, summaries, timelines, bounds, every)
    # (atomically: a crash mid-write leaves the earlier summary, never half of one)
    write_json(run_dir / SUMMARY_FILE,
               {"config": _jsonable(dataclasses.asdict(cfg)),
                "steps": [dataclasses.asdict(s) for s in summaries]}, indent=2)
    return result


async def _observe_step(replicas: Mapping[str, Any], step: int, remote: bool,
                        router: Router | None = None) -> None:
    """Tells every replica that RL step ``step`` begins (its draft history's window).
    Local engines must take it; an endpoint that refuses it (a server that outlives runs
    has seen later steps: its window follows those), fails or does not answer within
    ``STEP_TIMEOUT_S`` (with a ``router``, its health timeout) is warned of, and the step
    goes on. With a ``router`` the endpoints are told through it: it skips those down
    and tells one that rejoins later."""
    if not remote:
        for r in replicas.values():
            await r.observe_rl_step(step)
        return
    told: dict[str, str]
    if router is not None:
        told = await router.observe_rl_step(step)
    else:
        async def one(r: Any) -> None:
            async with asyncio.timeout(STEP_TIMEOUT_S):
                await r.observe_rl_step(step)

        answers = await asyncio.gather(*(one(r) for r in replicas.values()),
                                       return_exceptions=True)
        told = {}
        for name, answer in zip(replicas, answers, strict=True):
            if isinstance(answer, TimeoutError):
                told[name] = f"no answer within {STEP_TIMEOUT_S} s"
            elif isinstance(answer, (ValueError, ReplicaUnavailable)):
                told[name] = str(answer) or type(answer).__name__
            elif isinstance(answer, BaseException):
                raise answer
    for name, outcome in told.items():
        if outcome == "down":
            outcome = "it is down; the router tells it when it rejoins"
        if outcome not in ("ok", "unsupported"):
            log.warning("%s did not take RL step %d (its draft history window stays "
                        "where it is): %s", name, step, outcome)


def _noting(ids: set[str], on_done: Callable[[Trajectory], None] | None
            ) -> Callable[[Trajectory], None]:
    """``on_done`` that also adds each finished trajectory's id to ``ids``."""
    def done(traj: Trajectory) -> None:
        ids.add(traj.trajectory_id)
        if on_done is not None:
            on_done(traj)
    return done


def _timeline(engine: object) -> list[StepRecord]:
    return list(getattr(engine, "timeline", ()))


def _jsonable(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    return value

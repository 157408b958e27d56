"""Experiments from YAML: a load sweep of routing and speculation configurations.

Knows: the experiment file's schema (``Experiment``; ``benchmarks/sim/*.yaml`` and
docs/sim.md), how its sections become a cost model, a workload for each load (load =
trajectories of an RL step per replica) and a ``SimConfig`` for each configuration,
and how to run every (configuration, load) pair, in worker processes if asked, into
one report. Does not know the event loop (``war.sim.simulator``), the targets
(``war.sim.report``) or files other than the experiment and its traces.
"""

from __future__ import annotations

import dataclasses
import math
import multiprocessing
import time
import types
import typing
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NamedTuple, TypeVar

import yaml

from war.router.policies import (
    POLICIES,
    CacheAwareConfig,
    LeastLoadConfig,
    WarPolicyConfig,
    make_policy,
)
from war.sim.acceptance import AcceptanceTable, record_acceptance
from war.sim.costs import CostModel, LinearCost, RooflineCost
from war.sim.drafter import CachedDrafter, Drafter
from war.sim.profile import ProfileCost, load_cost_curve
from war.sim.replica import ReplicaConfig, kv_blocks
from war.sim.simulator import SimConfig, Simulator
from war.sim.synthetic import SyntheticConfig, synthetic_workload
from war.sim.workload import LatencyModel, TraceSet, Workload, build_trace_steps
from war.spec.config import SpecConfig
from war.spec.traces import missing_trace_file

Log = Callable[[str], None]
T = TypeVar("T")

POLICY_CONFIGS: dict[str, type] = {"least_load": LeastLoadConfig,
                                    "cache_aware": CacheAwareConfig, "war": WarPolicyConfig}
"""The settings dataclass of each routing policy that takes settings (their types are
checked as a section's are: the policies themselves take a string for a bool)."""

TRACE_WORKLOAD_KEYS = ("kind", "rl_steps", "group_size", "copies", "seed", "latency")
"""Settings of a ``kind: traces`` workload section."""


@dataclass(frozen=True)
class Experiment:
    """A parsed experiment file (sections as in docs/sim.md); its shape is validated on
    construction, the settings of its sections by ``check_experiment``, which ``load``
    runs (it builds the cost model, reading a profile's curve: no I/O here)."""

    name: str
    base_dir: Path
    workload: Mapping[str, Any]
    cost: Mapping[str, Any]
    configs: Mapping[str, Mapping[str, Any]]
    loads: tuple[float, ...]
    replica: Mapping[str, Any] = field(default_factory=dict)
    spec: Mapping[str, Any] = field(default_factory=dict)
    sim: Mapping[str, Any] = field(default_factory=dict)
    traces: tuple[str, ...] = ()
    drafts: str = "live"
    plot_load: float | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.name, str):
            raise ValueError(f"name must be a string, got {self.name!r}")
        if not self.configs:
            raise ValueError("an experiment needs at least one configuration")
        for name, c in self.configs.items():
            if not isinstance(name, str):  # (it names rows and plot files)
                raise ValueError(f"configuration names must be strings, got {name!r}")
            if not isinstance(c, Mapping) or "policy" not in c:
                raise ValueError(f"configuration {name!r} needs a policy")
        check_loads(self.loads, "loads")
        if self.drafts not in ("live", "cached"):
            raise ValueError(f"drafts must be 'live' or 'cached', got {self.drafts!r}")
        for section in ("workload", "cost", "replica", "spec", "sim"):
            if not isinstance(getattr(self, section), Mapping):
                raise ValueError(f"{section} must be a mapping of settings, "
                                 f"got {getattr(self, section)!r}")
        if self.workload.get("kind", "traces") not in ("traces", "synthetic"):
            raise ValueError(f"unknown workload kind {self.workload.get('kind')!r}")
        if self.plot_load is not None:
            check_loads([self.plot_load], "plot_load")
            if self.loads and float(self.plot_load) not in map(float, self.loads):
                raise ValueError(f"plot_load {self.plot_load:g} is not one of the loads "
                                 f"{list(self.loads)} (its plots would not be drawn)")
        if not all(isinstance(t, str) for t in self.traces):
            raise ValueError(f"traces must be a list of file names, got {list(self.traces)!r}")

    @classmethod
    def load(cls, path: str | Path) -> Experiment:
        p = Path(path)
        if not p.is_file():
            raise FileNotFoundError(f"experiment file not found: {p}" if not p.exists()
                                    else f"experiment file {p} is not a file")
        try:
            raw = yaml.load(p.read_text(encoding="utf-8"), Loader=_UniqueKeyLoader)
        except (yaml.YAMLError, UnicodeDecodeError) as e:
            raise ValueError(f"{p}: not a valid YAML file: {e}") from None
        except ValueError as e:  # (a duplicate key)
            raise ValueError(f"{p}: {e}") from None
        if not isinstance(raw, dict):
            raise ValueError(f"{p}: an experiment file is a mapping")
        try:
            exp = cls._from_mapping(raw, p)
            check_experiment(exp)  # (builds its cost model: a profile reads its curve)
        except ValueError as e:
            raise ValueError(f"{p}: {e}") from None
        return exp

    @classmethod
    def _from_mapping(cls, raw: dict[str, Any], p: Path) -> Experiment:
        known = {f.name for f in dataclasses.fields(cls)} - {"base_dir"}
        unknown = set(raw) - known
        if unknown:
            raise ValueError(f"unknown section(s) {sorted(unknown)}")
        required = [f.name for f in dataclasses.fields(cls) if f.default is dataclasses.MISSING
                    and f.default_factory is dataclasses.MISSING and f.name != "base_dir"]
        missing = [name for name in required if name not in raw and name != "name"]
        if missing:
            raise ValueError(f"missing section(s) {missing}")
        if not isinstance(raw.get("configs"), dict):
            raise ValueError(f"configs must map names to configurations, "
                             f"got {raw.get('configs')!r}")
        raw["base_dir"] = p.resolve().parent
        loads = raw.get("loads", ())
        if not isinstance(loads, list) or not all(
                isinstance(x, (int, float)) and not isinstance(x, bool) for x in loads):
            raise ValueError(f"loads must be a list of numbers, got {loads!r}")
        raw["loads"] = tuple(float(x) for x in loads)
        traces = raw.get("traces", [])
        if not isinstance(traces, list):
            raise ValueError(f"traces must be a list of file names, got {traces!r}")
        raw["traces"] = tuple(traces)
        raw.setdefault("name", p.stem)
        return cls(**raw)


class _UniqueKeyLoader(yaml.SafeLoader):
    """``yaml.SafeLoader`` that refuses a key given twice in one mapping (PyYAML keeps
    the last silently: a configuration or a section would be dropped unseen)."""

    def construct_mapping(self, node: yaml.MappingNode,
                          deep: bool = False) -> dict[Any, Any]:
        seen = set()
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=True)
            if isinstance(key, typing.Hashable) and key in seen:
                raise ValueError(f"duplicate key {key!r} (line {key_node.start_mark.line + 1})")
            seen.add(key)
        return super().construct_mapping(node, deep)


def build_cost(spec: Mapping[str, Any], base_dir: Path) -> CostModel:
    """A cost model from the ``cost`` section (``kind``: roofline, profile, linear)."""
    args = dict(spec)
    kind = args.pop("kind", "roofline")
    if kind == "roofline":
        return build_section(RooflineCost, "cost", args)
    if kind == "linear":
        return build_section(LinearCost, "cost", args)
    if kind == "profile":
        if "curve" not in args:
            raise ValueError("cost: a profile needs a curve (a cost_curve JSON file)")
        name = args.pop("curve")
        context, kv_tokens = args.pop("context", None), args.pop("kv_tokens", None)
        if args:
            raise ValueError(f"cost: unknown profile setting(s) {sorted(args)}; "
                             "known: ['context', 'curve', 'kind', 'kv_tokens']")
        _check_value("cost.curve", name, str)
        _check_value("cost.context", context, int | None)
        _check_value("cost.kv_tokens", kv_tokens, int | None)
        if context is not None and context < 0:
            raise ValueError(f"cost.context must be >= 0, got {context}")
        if kv_tokens is not None and kv_tokens < 1:
            raise ValueError(f"cost.kv_tokens must be >= 1, got {kv_tokens}")
        return ProfileCost.fit(load_cost_curve(base_dir / name, context), kv_tokens)
    raise ValueError(f"unknown cost model kind {kind!r}")


def build_section(cls: type[T], section: str, values: Mapping[str, Any],
                  **fixed: Any) -> T:
    """``cls(**values, **fixed)`` for a dataclass that a section of an experiment file
    configures: an unknown setting, a value of the wrong type (an int, a float, a bool,
    a string or null where the field's annotation says so) or one that ``cls`` refuses
    raises ValueError naming the section and the setting, never a TypeError."""
    if not isinstance(values, Mapping):
        raise ValueError(f"{section} must be a mapping of settings, got {values!r}")
    hints = typing.get_type_hints(cls)
    known = sorted(f.name for f in dataclasses.fields(cls)  # type: ignore[arg-type]
                   if f.init and f.name not in fixed)
    unknown = sorted(str(k) for k in values if k not in known)
    if unknown:
        raise ValueError(f"{section}: unknown setting(s) {unknown}; known: {known}")
    for key, value in values.items():
        _check_value(f"{section}.{key}", value, hints[key])
    try:
        return cls(**values, **fixed)
    except ValueError as e:
        raise ValueError(f"{section}: {e}") from None


def _check_value(name: str, value: Any, annotation: Any) -> None:
    """ValueError unless ``value`` fits ``annotation`` (checked: int, float, bool, str,
    None and unions of them; an int is a float, a bool is neither; others pass)."""
    options = (typing.get_args(annotation)
               if isinstance(annotation, types.UnionType) or typing.get_origin(annotation)
               is typing.Union else (annotation,))
    checkable = {int, float, bool, str, type(None)}
    if not all(o in checkable for o in options):
        return
    for o in options:
        if o is type(None) and value is None:
            return
        if o is bool and isinstance(value, bool):
            return
        if o is int and isinstance(value, int) and not isinstance(value, bool):
            return
        if o is float and isinstance(value, (int, float)) and not isinstance(value, bool):
            return
        if o is str and isinstance(value, str):
            return
    names = " or ".join("null" if o is type(None) else o.__name__ for o in options)
    raise ValueError(f"{name} must be {'an' if names[0] in 'aeiou' else 'a'} {names}, "
                     f"got {value!r}")


def check_experiment(exp: Experiment) -> None:
    """Builds what every run of ``exp`` builds from its sections (cost model, each
    configuration's settings and routing policy, the workload's settings) so that a bad
    setting is one ValueError before anything runs, not a failure in the middle of a
    sweep. What needs the traces (enough trials for the group size) is checked by
    ``check_workloads``."""
    cost = build_cost(exp.cost, exp.base_dir)
    for name, config in exp.configs.items():
        try:
            sim = sim_config(exp, config)  # (refuses an unknown policy name)
            kv_blocks(sim.replica, cost)
            settings_class = POLICY_CONFIGS.get(sim.policy)
            if settings_class is not None:  # (checked as a section is)
                build_section(settings_class, "policy_settings", sim.policy_settings)
            try:
                make_policy(sim.policy, **sim.policy_settings)
            except TypeError as e:
                raise ValueError(f"policy_settings: {e}") from None
        except ValueError as e:
            raise ValueError(f"configuration {name!r}: {e}") from None
    if exp.workload.get("kind", "traces") == "synthetic":
        synthetic_settings(exp.workload)
    else:
        trace_settings(exp.workload)


class TraceSettings(NamedTuple):
    """A ``kind: traces`` workload section, checked (``trace_settings``)."""

    rl_steps: int
    group_size: int | None  # None: every trial of a task
    copies: bool
    seed: int
    latency: LatencyModel


def trace_settings(workload: Mapping[str, Any]) -> TraceSettings:
    """The settings of a trace workload section; ValueError naming a bad one."""
    unknown = sorted(str(k) for k in workload if k not in TRACE_WORKLOAD_KEYS)
    if unknown:
        raise ValueError(f"workload: unknown setting(s) {unknown}; "
                         f"known: {sorted(TRACE_WORKLOAD_KEYS)}")
    group_size = workload.get("group_size")
    _check_value("workload.group_size", group_size, int | None)
    if group_size is not None and group_size < 1:
        raise ValueError(f"workload.group_size must be >= 1 (or null: every trial), "
                         f"got {group_size}")
    copies, seed = workload.get("copies", False), workload.get("seed", 0)
    _check_value("workload.copies", copies, bool)
    _check_value("workload.seed", seed, int)
    latency = build_section(LatencyModel, "workload.latency", workload.get("latency", {}),
                            seed=seed)
    return TraceSettings(_rl_steps(workload), group_size, copies, seed, latency)


def synthetic_settings(workload: Mapping[str, Any]) -> tuple[int, SyntheticConfig]:
    """(RL steps, the generator's settings) of a synthetic workload section."""
    w = {k: v for k, v in workload.items() if k not in ("kind", "rl_steps")}
    return _rl_steps(workload), build_section(SyntheticConfig, "workload", w)


def _rl_steps(workload: Mapping[str, Any]) -> int:
    rl_steps = workload.get("rl_steps", 1)
    _check_value("workload.rl_steps", rl_steps, int)
    if rl_steps < 1:
        raise ValueError(f"workload.rl_steps must be >= 1, got {rl_steps}")
    return int(rl_steps)


def check_loads(loads: Sequence[float], what: str) -> None:
    """Loads (trajectories per replica) must be finite and positive: ValueError naming
    ``what`` otherwise."""
    if not loads:
        raise ValueError(f"{what}: at least one load is needed")
    bad = [x for x in loads if isinstance(x, bool) or not (
        isinstance(x, (int, float)) and math.isfinite(x) and x > 0)]
    if bad:
        raise ValueError(f"{what} must be positive finite numbers, got {bad}")


def resolve_traces(names: Sequence[str], base_dir: Path) -> list[Path]:
    """Trace files: paths as given, else relative to the experiment, else in the nearest
    ``shared/data/traces`` above it."""
    out = []
    for name in names:
        candidates = [Path(name), base_dir / name]
        for folder in (base_dir, *base_dir.parents):
            candidates.append(folder / "shared" / "data" / "traces" / name)
        found = next((c for c in candidates if c.is_file()), None)
        if found is None:
            raise missing_trace_file(Path(name), name)
        out.append(found)
    return out


def build_workload(exp: Experiment, load: float, traces: TraceSet | None) -> Workload:
    """The workload at ``load`` trajectories per replica and RL step."""
    if exp.workload.get("kind", "traces") == "synthetic":
        rl_steps, cfg = synthetic_settings(exp.workload)
        replicas = int(exp.sim.get("num_replicas", 4))
        groups = max(1, round(load * replicas / cfg.group_size))
        return synthetic_workload(cfg, groups, rl_steps)
    if traces is None:
        raise ValueError("a trace workload needs traces")
    ts = trace_settings(exp.workload)
    per_step, rl_steps = trace_shape(exp, load, traces)
    return build_trace_steps(traces, per_step, rl_steps, ts.group_size, ts.latency, ts.seed,
                             ts.copies)


def trace_shape(exp: Experiment, load: float, traces: TraceSet) -> tuple[int, int]:
    """(tasks per step, RL steps) of ``exp``'s trace workload at ``load`` trajectories
    per replica. Without ``copies`` no trajectory is replayed twice: fewer steps when
    the tasks run out, and at most every task in one step (a load above that is the
    traces' largest)."""
    ts = trace_settings(exp.workload)
    replicas = int(exp.sim.get("num_replicas", 4))
    rl_steps, group_size, copies = ts.rl_steps, ts.group_size, ts.copies
    tasks = {t.task_id: 0 for t in traces.trajectories if t.turns}
    for t in traces.trajectories:
        if t.turns:
            tasks[t.task_id] += 1
    if not tasks:
        raise ValueError("no trajectory with turns in the traces")
    per_group = group_size or max(tasks.values())
    per_step = max(1, round(load * replicas / per_group))
    if not copies:
        per_step = min(per_step, len(tasks))
        rl_steps = max(1, min(rl_steps, len(tasks) // per_step))
    return per_step, rl_steps


def check_workloads(exp: Experiment, loads: Sequence[float], traces: TraceSet | None) -> None:
    """Builds the workload of every load once (a trace workload at a load asking for more
    trials of a task than the traces hold fails here, before any run), then drops it."""
    for load in loads:
        try:
            build_workload(exp, load, traces)
        except ValueError as e:
            raise ValueError(f"load {load:g}: {e}") from None


def workload_key(exp: Experiment, load: float, traces: TraceSet | None) -> Any:
    """What decides the workload at ``load``: loads with equal keys run the same
    trajectories (a trace workload's tasks per step and steps; the load itself
    otherwise)."""
    if exp.workload.get("kind", "traces") != "traces" or traces is None:
        return ("load", load)
    return trace_shape(exp, load, traces)


def sim_config(exp: Experiment, config: Mapping[str, Any]) -> SimConfig:
    c = dict(config)
    policy = c.pop("policy")
    settings = c.pop("policy_settings", {})
    own = c.pop("replica", {})
    if not isinstance(own, Mapping):
        raise ValueError(f"replica must be a mapping of settings, got {own!r}")
    replica = {**exp.replica, **own}
    if "spec_mode" in c:
        replica["spec_mode"] = c.pop("spec_mode")
    if c:
        raise ValueError(f"unknown configuration settings {sorted(c)}")
    if not isinstance(policy, str):
        raise ValueError(f"policy must be a name, got {policy!r}")
    if policy not in POLICIES:
        raise ValueError(f"unknown routing policy {policy!r}; known: {', '.join(POLICIES)}")
    if not isinstance(settings, Mapping):
        raise ValueError(f"policy_settings must be a mapping, got {settings!r}")
    spec = build_section(SpecConfig, "spec", exp.spec)
    replica.setdefault("max_spec_tokens", spec.max_spec_tokens)
    return build_section(SimConfig, "sim", exp.sim, policy=policy, policy_settings=settings,
                         replica=build_section(ReplicaConfig, "replica", replica), spec=spec)


# ------------------------------------------------------------------ running

_STATE: dict[str, Any] = {}  # set before forking workers: experiment, traces; tables


def _run_one(job: tuple[str, float]) -> dict[str, Any]:
    name, load = job
    exp: Experiment = _STATE["exp"]
    cost = build_cost(exp.cost, exp.base_dir)
    workload = build_workload(exp, load, _STATE.get("traces"))
    make: Callable[[int], Drafter] | None = None
    table: AcceptanceTable | None = None
    record_s = 0.0
    if exp.drafts == "cached":
        # One table per workload: a stream's drafts depend on the replay that recorded
        # it (its history is that workload's earlier rounds and its round's streams),
        # so a table shared across loads would replay a stream as whichever load ran
        # first in this process recorded it, and a row would depend on the jobs before
        # it. Configurations at the same load share the one recording.
        tables: dict[Any, tuple[AcceptanceTable, float]] = _STATE.setdefault("tables", {})
        key = workload_key(exp, load, _STATE.get("traces"))
        if key not in tables:
            t0 = time.perf_counter()
            recorded = record_acceptance([t for s in workload.steps for t in s],
                                         build_section(SpecConfig, "spec", exp.spec))
            tables[key] = (recorded, time.perf_counter() - t0)
        cached, record_s = tables[key]
        table = cached
        make = lambda _i: CachedDrafter(cached)  # noqa: E731
    t0 = time.perf_counter()
    sim = Simulator(sim_config(exp, exp.configs[name]), cost, workload, make_drafter=make)
    result = sim.run()
    row: dict[str, Any] = {"config": name,
                           "load": workload.num_trajectories / len(workload.steps)
                           / sim.config.num_replicas, "requested_load": load}
    row.update(result.summary())
    row["wall_s"] = time.perf_counter() - t0
    if table is not None:  # this row's workload's table only
        row["acceptance_table"] = {**table.summary(), "record_s": record_s}
    row["rl_steps"] = len(workload.steps)
    if load == _STATE.get("plot_load"):
        row["finish_times"] = [t for m in result.steps for t in m.finish_times]
        if result.timeline is not None:
            row["timeline"] = result.timeline.series()
    return row


def run_experiment(exp: Experiment, trace_paths: Sequence[Path] | None = None,
                   workers: int = 1, log: Log | None = None,
                   loads: Sequence[float] | None = None,
                   configs: Sequence[str] | None = None) -> dict[str, Any]:
    """Runs every (configuration, load) of ``exp``; returns the report's ``results``,
    ``workload`` and ``wall_s`` (targets are added by ``war.sim.report``)."""
    if loads is not None:
        check_loads(loads, "loads")
    if configs is not None:  # (before traces load: an unknown name failed in a worker)
        unknown = [n for n in configs if n not in exp.configs]
        if unknown:
            raise ValueError(f"unknown configurations {unknown} (the experiment has "
                             f"{sorted(exp.configs)})")
    t0 = time.perf_counter()
    emit = log or (lambda _m: None)
    _STATE.clear()
    _STATE["exp"] = exp
    kind = exp.workload.get("kind", "traces")
    if kind == "traces":
        paths = list(trace_paths) if trace_paths else resolve_traces(exp.traces, exp.base_dir)
        _STATE["traces"] = TraceSet.load(paths)
        emit(f"traces: {len(_STATE['traces'].trajectories)} trajectories "
             f"({time.perf_counter() - t0:.1f} s)")
    names = list(configs) if configs else list(exp.configs)
    asked = loads or exp.loads
    # Loads that give the same workload (the traces hold no more) run once, as the
    # smallest of them.
    same_as: dict[float, float] = {}
    first: dict[Any, float] = {}
    run_loads = []
    for ld in sorted(asked):
        key = workload_key(exp, ld, _STATE.get("traces"))
        if key in first:
            same_as[ld] = first[key]
            emit(f"load {ld:g}: the traces give the same workload as load {first[key]:g} "
                 "(no more trajectories); not run again")
            continue
        first[key] = ld
        run_loads.append(ld)
    check_workloads(exp, run_loads, _STATE.get("traces"))
    plot = max(asked)
    if exp.plot_load is not None and exp.plot_load in asked:
        plot = exp.plot_load
    elif exp.plot_load is not None:  # (--loads leaves out the file's plot_load)
        emit(f"plot_load {exp.plot_load:g} is not among the loads run: plotting load "
             f"{plot:g}")
    _STATE["plot_load"] = same_as.get(plot, plot)
    jobs = [(n, ld) for ld in run_loads for n in names]
    rows: list[dict[str, Any]] = []
    if workers > 1:
        # The costliest runs first (higher loads, speculating configurations), so that
        # no worker is left with a long one at the end; the report keeps job order.
        def cost(job: tuple[str, float]) -> tuple[float, bool]:
            return job[1], exp.configs[job[0]].get("spec_mode", "auto") != "off"

        order = sorted(jobs, key=cost, reverse=True)
        ctx = multiprocessing.get_context("fork")
        with ctx.Pool(min(workers, len(jobs))) as pool:
            done = {}
            for row in pool.imap_unordered(_run_one, order):
                done[(row["config"], row["requested_load"])] = row
                emit(_line(row))
        rows = [done[job] for job in jobs]
    else:
        for job in jobs:
            rows.append(_run_one(job))
            emit(_line(rows[-1]))
    out: dict[str, Any] = {"name": exp.name, "results": rows,
                           "wall_s": time.perf_counter() - t0}
    if same_as:
        out["same_loads"] = [{"load": ld, "same_as": rep} for ld, rep in same_as.items()]
    return out


def _line(row: dict[str, Any]) -> str:
    cut, out = row.get("truncated_trajectories", 0), row.get("dropped_trajectories", 0)
    kv = f", beyond the KV: {cut} cut short, {out} left out" if cut or out else ""
    return (f"{row['config']:>14} load {row['load']:6.1f}: {row['throughput']:9.1f} tok/s, "
            f"makespan {row['makespan_s']:7.1f} s (x{row['lower_bound_ratio']:.2f} bound), "
            f"hit {row['prefix_hit_rate']:.2f}, {row['tokens_per_step']:.2f} tok/step{kv} "
            f"[{row['wall_s']:.1f} s]")

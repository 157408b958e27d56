"""`war demo` and `war rollout`: synchronous RL steps over local replicas (or, for
``war rollout``, over ``war serve`` endpoints: ``--endpoint``, ``endpoints:``).

Knows: the commands' options, the live progress display (trajectories done,
tokens generated, current speculation budget per replica or endpoint), the summary table,
where the run's files go, and what becomes of an earlier run's trajectories in the
same folder (``war demo`` moves them aside and starts afresh; ``war rollout`` resumes,
reusing them, and says so, or refuses before any work when the earlier run's
trajectories were made under other settings or model weights; a refused start removes
the run folder again when it created it and it is still empty). Does not know how a
step runs
(``war.rollout.run``).
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeAlias

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from war import aio
from war.cli.console import make_console
from war.rollout.limits import MAX_REPLICAS

if TYPE_CHECKING:  # the run's modules import torch: only when a command runs
    from war.engine.async_engine import AsyncEngine
    from war.rollout.envs import Task
    from war.rollout.remote import Endpoint
    from war.rollout.run import RunConfig, RunResult
    from war.rollout.trajectory import Trajectory
    from war.types import ReplicaLoad

Subparsers: TypeAlias = "argparse._SubParsersAction[argparse.ArgumentParser]"


def add_demo_command(commands: Subparsers) -> None:
    p = commands.add_parser(
        "demo",
        help="three RL steps of 16 tasks x 8 samples with the built-in policy on two local "
        "replicas",
    )
    _add_common(p)
    p.set_defaults(run=run_demo, config=None)


def add_rollout_command(commands: Subparsers) -> None:
    p = commands.add_parser("rollout", help="RL rollout steps as a config file describes")
    p.add_argument("--config", required=True, help="YAML or JSON file (see docs/rollout.md)")
    p.add_argument("--endpoint", action="append", dest="endpoints", metavar="URL",
                   help="a war serve replica to run on instead of local replicas "
                        "(repeat for each; replaces the config's endpoints; the key sent "
                        "is $WAR_REPLICA_API_KEY)")
    _add_common(p)
    p.set_defaults(run=run_rollout_command)


def int_in_range(low: int, high: int) -> Callable[[str], int]:
    """An argparse ``type``: an int from ``low`` to ``high``; anything else is argparse's
    one-line error naming the option (``argument --replicas: ...``), exit status 2."""
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            value = None
        if value is None or not low <= value <= high:
            raise argparse.ArgumentTypeError(f"must be an int from {low} to {high}, "
                                             f"got {text!r}")
        return value
    return parse


def _add_common(p: argparse.ArgumentParser) -> None:
    p.add_argument("--steps", type=int, help="RL steps")
    p.add_argument("--tasks", type=int, dest="tasks_per_step", help="tasks per step")
    p.add_argument("--group-size", type=int, help="samples per task")
    p.add_argument("--replicas", type=int_in_range(1, MAX_REPLICAS), metavar="N",
                   help=f"local replicas, one engine each (1 to {MAX_REPLICAS})")
    p.add_argument("--spec-mode", choices=["auto", "always", "off"], help="speculation mode")
    p.add_argument("--output-dir", help="where runs/<name>/ goes (default: runs)")
    p.add_argument("--name", help="the run's name (its folder under the output dir)")
    p.add_argument("--seed", type=int)
    p.add_argument("--quiet", action="store_true", help="no progress bars")


def _config(args: argparse.Namespace, base: RunConfig) -> RunConfig:
    changes = {k: getattr(args, k) for k in ("steps", "tasks_per_step", "group_size",
                                             "replicas", "output_dir", "name", "seed")
               if getattr(args, k, None) is not None}
    cfg = dataclasses.replace(base, **changes)
    if cfg.remote:
        local = [flag for flag, key in (("--replicas", "replicas"), ("--spec-mode", "spec_mode"))
                 if getattr(args, key, None) is not None]
        if local:
            raise ValueError(f"{' and '.join(local)} set a run's local replicas; this run is "
                             "on endpoints (their engines are set where they run: war serve)")
        return cfg
    if args.spec_mode is not None:
        cfg = dataclasses.replace(cfg, engine=dataclasses.replace(cfg.engine,
                                                                  spec_mode=args.spec_mode))
    return cfg


def run_demo(args: argparse.Namespace) -> int:
    from war.rollout.run import RunConfig

    cfg = _config(args, RunConfig(name="demo"))
    return _run(cfg, quiet=args.quiet, fresh=True)


def run_rollout_command(args: argparse.Namespace) -> int:
    from war.rollout.run import load_run_config

    try:
        # (--endpoint replaces the file's endpoints before the file is checked: a file
        # that sets local replicas' settings is refused with them too)
        base = load_run_config(args.config, endpoints=args.endpoints)
    except UnicodeDecodeError as e:  # (its message names no file)
        raise ValueError(f"{args.config}: not UTF-8: {e}") from None
    return _run(_config(args, base), quiet=args.quiet, fresh=False)


# Where `war demo` moves an earlier run's files before it starts afresh.
_PREVIOUS = {"trajectories.jsonl": "trajectories.previous.jsonl",
             "run_settings.json": "run_settings.previous.json"}


def _earlier_run(cfg: RunConfig, console: Console, fresh: bool) -> None:
    """Says what happens to the trajectories an earlier run left in the run's folder: a
    demo moves them (and the settings they were made under) aside and starts afresh; a
    rollout reuses them (a restarted step skips the trajectories it already wrote), and
    says so, unless they were made under other settings (ValueError naming them)."""
    from war.rollout.driver import reusable
    from war.rollout.run import SETTINGS_FILE, check_run_settings, trajectory_ids

    path = Path(cfg.output_dir) / cfg.name / "trajectories.jsonl"
    if not path.exists() or path.stat().st_size == 0:
        return
    if fresh:
        kept = path.with_name(_PREVIOUS["trajectories.jsonl"])
        path.replace(kept)
        settings = path.with_name(SETTINGS_FILE)
        if settings.exists():  # (the settings they were made under go with them)
            settings.replace(settings.with_name(_PREVIOUS[SETTINGS_FILE]))
        console.print(f"{path.parent}: the earlier run's trajectories are now in {kept.name}; "
                      "this run starts afresh")
        return
    # Before saying they are reused: refused if they were made under other settings.
    check_run_settings(cfg)
    # What the driver will reuse: this run's steps' trajectories that did not fail (the
    # file may also hold failed ones, which are redone, and other steps' or tasks').
    n = len(reusable(path, trajectory_ids(cfg)))
    console.print(f"[yellow]resuming[/] {path.parent}: {n} trajectories already in "
                  f"{path.name} are reused, not generated again (delete it to start afresh)")


def _run(cfg: RunConfig, quiet: bool, fresh: bool) -> int:
    from war.rollout.run import removing_created_folder

    # A start refused before anything is written (the settings, the model) removes the
    # run folder again if this run created it; a folder that was there stays.
    with removing_created_folder(cfg):
        return _run_in_folder(cfg, quiet, fresh)


def _run_in_folder(cfg: RunConfig, quiet: bool, fresh: bool) -> int:
    from war.rollout.report import plot_timeline
    from war.rollout.run import builtin_policy, check_run_paths

    console = make_console()
    # Where the run's files go is checked before any model is loaded: the folder, and
    # every file written at the end (a folder in the way would fail after all the work).
    check_run_paths(cfg, ("report.png", *(_PREVIOUS.values() if fresh else ())))
    _earlier_run(cfg, console, fresh)  # (run_rollout records the run's settings)
    model = cfg.model or str(builtin_policy())
    where = (f"{len(cfg.endpoints)} endpoints, routing {cfg.routing_policy or 'war'}"
             if cfg.remote else f"{cfg.replicas} replicas, spec {cfg.engine.spec_mode}")
    console.print(f"[bold]WAR rollout[/] {cfg.name}: {cfg.steps} steps x {cfg.tasks_per_step} "
                  f"tasks x {cfg.group_size} samples, {where}, model {model}")
    result = aio.run(_run_with_progress(cfg, console, quiet))
    console.print(summary_table(result))
    note = ("engine steps are recorded where the endpoints run (war serve's /metrics)"
            if cfg.remote else "no engine steps in this run")
    png = plot_timeline(result.timelines, result.step_bounds, result.run_dir / "report.png",
                        title=f"WAR rollout {cfg.name}", empty_note=note)
    console.print(f"trajectories: {result.run_dir / 'trajectories.jsonl'} (and .parquet); "
                  f"report: {png}; summary: {result.run_dir / 'summary.json'}")
    return 0


async def _run_with_progress(cfg: RunConfig, console: Console, quiet: bool) -> RunResult:
    from war.rollout.agent import PolicyIO
    from war.rollout.driver import reusable, trajectory_id
    from war.rollout.remote import close_all
    from war.rollout.run import builtin_policy, connect_endpoints, make_replicas, run_rollout

    output = Path(cfg.output_dir) / cfg.name / "trajectories.jsonl"  # (as run_rollout's)
    model_dir = Path(cfg.model) if cfg.model else builtin_policy()
    replicas: dict[str, Any]
    if cfg.remote:  # (connected before the bars: a refused endpoint is one error line)
        replicas = dict(await connect_endpoints(cfg, PolicyIO.from_folder(model_dir)))
    else:
        replicas = dict(make_replicas(cfg, model_dir))
    progress = Progress(
        TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
        TextColumn("{task.fields[info]}"), TimeElapsedColumn(),
        console=console, disable=quiet, transient=False)
    bar = progress.add_task("step", total=1, info="")
    tokens = 0
    done = 0

    def on_step(step: int, tasks: list[Task]) -> None:
        nonlocal done
        # a resumed step's trajectories already in the file count as done: the driver
        # reuses them without calling on_done
        ids = [trajectory_id(step, t.task_id, g) for t in tasks for g in range(cfg.group_size)]
        done = len(reusable(output, ids))
        progress.reset(bar, total=len(ids), completed=done, description=f"step {step}",
                       info="")

    def on_done(traj: Trajectory) -> None:
        nonlocal tokens, done
        tokens += traj.num_sampled_tokens
        done += 1
        progress.update(bar, completed=done)

    async def refresh() -> None:
        while True:
            if cfg.remote:
                info = await _remote_info(replicas, tokens)
            else:
                info = _live_info(replicas, tokens)
            progress.update(bar, info=info)
            await asyncio.sleep(0.5)

    with progress:
        # (no bars, no polls: a fleet's endpoints are not asked their load for nothing)
        ticker = None if quiet else asyncio.create_task(refresh())
        try:
            return await run_rollout(cfg, on_done=on_done, on_step=on_step, replicas=replicas)
        finally:
            if ticker is not None:
                ticker.cancel()
                await asyncio.wait([ticker])  # (its polls end before the endpoints close)
            if cfg.remote:
                await close_all(replicas)
            else:
                for r in replicas.values():
                    await r.close()


def _live_info(replicas: Mapping[str, AsyncEngine], tokens: int) -> str:
    return _info_line(tokens, {name: r.load() for name, r in replicas.items()})


def _info_line(tokens: int, loads: Mapping[str, ReplicaLoad | None]) -> str:
    parts = [f"{tokens} tokens"]
    for name, load in loads.items():
        parts.append(f"{name}: ?" if load is None else
                     f"{name}: {load.num_running} running, "
                     f"budget {load.spec_tokens_per_seq:.1f} tok/seq")
    return " | ".join(parts)


async def _remote_info(endpoints: Mapping[str, Endpoint], tokens: int) -> str:
    """The progress line of a run on endpoints: each one's ``/v1/load`` (``?`` where it
    does not answer within a second: the bar never waits on a server)."""
    async def one(e: Endpoint) -> ReplicaLoad | None:
        try:
            return await asyncio.wait_for(e.load(), 1.0)
        except Exception:  # (down, slow or refusing: the run itself says so if it matters)
            return None
    loads = await asyncio.gather(*(one(e) for e in endpoints.values()))
    return _info_line(tokens, dict(zip(endpoints, loads, strict=True)))


def summary_table(result: RunResult) -> Table:
    table = Table(title=f"WAR rollout: {result.config.name}")
    for col in ("step", "traj", "makespan", "tok/s", "tok/step", "accept", "prefix", "reward",
                "turns", "err"):
        table.add_column(col, justify="right", no_wrap=True)
    for s in result.steps:
        timed = s.num_reused < s.num_trajectories  # (a step wholly resumed has no timing)
        table.add_row(str(s.rl_step), str(s.num_trajectories),
                      f"{s.makespan_s:.1f}s" if timed else "-",
                      f"{s.tokens_per_s:.0f}" if timed else "-",
                      f"{s.tokens_per_step:.2f}", f"{s.acceptance:.2f}",
                      f"{s.prefix_hit_rate:.2f}", f"{s.mean_reward:.2f}", f"{s.mean_turns:.1f}",
                      str(s.num_errors))
    notes = []
    envs = sorted({e for s in result.steps for e in s.success_by_env})
    if envs:
        last = result.steps[-1]
        notes.append("success by environment (last step): " + ", ".join(
            f"{e} {last.success_by_env.get(e, 0.0):.0%}" for e in envs))
    reused = sum(s.num_reused for s in result.steps)
    if reused:
        notes.append(f"{reused} trajectories reused from the stopped run: makespan and "
                     "tok/s time only this run's")
    if notes:
        table.caption = "\n".join(notes)
    return table

"""End to end: synchronous RL steps with WAR against the stack users would pick instead.

Five configurations run the same RL steps (same built-in policy, environments, tasks,
group size 8 and sampling seeds) on two replicas, at a low load (a few trajectories in
flight per replica) and at saturation (every trajectory of the step in flight):

1. ``vllm+rr``: vLLM without speculation behind sglang-router, round robin;
2. ``vllm-suffix+sglang-ca``: vLLM with suffix decoding behind sglang-router, cache_aware;
3. ``vllm-suffix+least_load``: vLLM with suffix decoding behind WAR's router with the
   ``least_load`` policy (verl's sticky least-loaded balancing);
4. ``war``: WAR replicas (``war serve``, load-aware speculation ``auto``) behind WAR's
   router with the ``war`` policy;
5. ``vllm-suffix+war-router``: vLLM with suffix decoding behind WAR's router, ``war``
   policy.

Every run starts its replicas afresh (no prefix cache or draft history carried over
from another run), each replica pinned to its own core (``taskset -c i``; vLLM also
gets ``VLLM_CPU_OMP_THREADS_BIND=i``, WAR ``OMP_NUM_THREADS=1``). The rollout driver
and the routers run unpinned. Configurations are interleaved and their order rotates
from repeat to repeat.

Figures per run: makespan (sum over steps of last end - first start), generated
tokens/s, ratio to the step's lower bound (``war.rollout.bench``), prefix-cache hit
rate and tokens per forward pass (``generated / (generated - accepted draft
tokens)``), both from the replicas' own Prometheus counters, and mean reward. The
report holds medians over the repeats and, per repeat, each configuration's
throughput over configuration 2's.

The vLLM configurations need the peer environment (``benchmarks/e2e/setup_peer.sh``,
see PEER.md); ``--configs 4`` runs WAR alone without it. Prints one summary line,
writes JSON (``--json``) and Markdown tables (``--markdown``).

    python benchmarks/e2e/bench_e2e.py --json e2e.json --markdown e2e.md
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import os
import resource
import shutil
import statistics
import sys
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
from prometheus_client.parser import text_string_to_metric_families

from war.backends import OpenAICompatBackend, WarHttpBackend
from war.backends.base import Backend
from war.outputs import check_output_dir, output_file_arg, write_json, write_text_atomic
from war.rollout.agent import AgentConfig, PolicyIO
from war.rollout.bench import RunFigures, figures, with_lower_bounds
from war.rollout.driver import RolloutConfig, run_step_async
from war.rollout.envs import Task
from war.rollout.run import RunConfig, builtin_policy, step_tasks, task_pool
from war.router.bench import Service
from war.router.policies import make_policy
from war.router.router import Router

HERE = Path(__file__).resolve().parent
PEER_PYTHON = HERE / ".peer-venv" / "bin" / "python"
MODEL_NAME = "policy"


@dataclass(frozen=True)
class Setup:
    """One configuration: which replicas, which speculation, which front."""

    key: int
    name: str
    engine: str  # "vllm" | "war"
    speculation: bool
    front: str  # "sglang" | "war"
    policy: str  # the front's routing policy


SETUPS = {
    1: Setup(1, "vllm+rr", "vllm", False, "sglang", "round_robin"),
    2: Setup(2, "vllm-suffix+sglang-ca", "vllm", True, "sglang", "cache_aware"),
    3: Setup(3, "vllm-suffix+least_load", "vllm", True, "war", "least_load"),
    4: Setup(4, "war", "war", True, "war", "war"),
    5: Setup(5, "vllm-suffix+war-router", "vllm", True, "war", "war"),
}
REFERENCE = 2  # ratios are against this configuration
REPLICAS = 2


@dataclass(frozen=True)
class BenchSettings:
    run: RunConfig
    model: Path
    low_tasks: int = 2
    low_in_flight_per_replica: int = 2
    repeats: int = 3
    port_base: int = 18100
    max_num_seqs: int = 128
    suffix_config: str = '{"method": "suffix", "num_speculative_tokens": 16}'
    vllm_kv_gb: int = 1
    pin: bool = True
    log_dir: Path = Path("runs/e2e/logs")
    war_policy: str = "{}"  # settings of the ``war`` policy (WarPolicyConfig fields), JSON
    startup_timeout_s: float = 300.0


# ---------------------------------------------------------------- processes


def _pinned(argv: list[str], core: int | None) -> list[str]:
    return argv if core is None else ["taskset", "-c", str(core), *argv]


def _cores(settings: BenchSettings) -> list[int | None]:
    n = settings.run.replicas
    usable = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []
    if not settings.pin or shutil.which("taskset") is None or len(usable) < n:
        return [None] * n
    return usable[:n]


def _server(name: str, argv: list[str], env: dict[str, str], ready_url: str,
            log_path: Path) -> Service:
    """A server in a session of its own (so its workers stop with it), logging to
    ``log_path``."""
    return Service(name, argv, ready_url, env, log_path=log_path, own_session=True)


def replica_servers(setup: Setup, settings: BenchSettings, run_dir: Path) -> list[Service]:
    out = []
    for i, core in enumerate(_cores(settings)):
        port = settings.port_base + 1 + i
        env = dict(os.environ)
        if setup.engine == "war":
            env["OMP_NUM_THREADS"] = "1"
            argv = [sys.executable, "-m", "war.cli.main", "serve", "--model",
                    str(settings.model), "--served-model-name", MODEL_NAME,
                    "--host", "127.0.0.1", "--port", str(port), "--spec-mode", "auto",
                    "--kv-cache-mb", "64", "--max-num-seqs", str(settings.max_num_seqs),
                    "--max-num-batched-tokens", "2048", "--log-level", "warning"]
            ready = f"http://127.0.0.1:{port}/health"
        else:
            env.update(VLLM_HOST_IP="127.0.0.1", VLLM_LOOPBACK_IP="127.0.0.1",
                       HF_HUB_OFFLINE="1", VLLM_CPU_KVCACHE_SPACE=str(settings.vllm_kv_gb),
                       VLLM_CPU_OMP_THREADS_BIND=str(core) if core is not None else "auto")
            iomp = PEER_PYTHON.parent.parent / "lib" / "libiomp5.so"
            if iomp.exists():  # vLLM's speculative decoding on CPU wants Intel OpenMP
                env["LD_PRELOAD"] = str(iomp)
            # Block size 32: vLLM's CPU default (128) reuses no prefix of these short
            # episodes; 32 is the smallest its CPU kernels take without a warning.
            argv = [str(PEER_PYTHON), "-m", "vllm.entrypoints.openai.api_server",
                    "--model", str(settings.model), "--served-model-name", MODEL_NAME,
                    "--host", "127.0.0.1", "--port", str(port), "--dtype", "float32",
                    "--block-size", "32", "--max-num-seqs", str(settings.max_num_seqs),
                    "--max-model-len", "2048", "--enable-prefix-caching",
                    "--seed", str(settings.run.seed)]
            if setup.speculation:
                argv += ["--speculative-config", settings.suffix_config]
            ready = f"http://127.0.0.1:{port}/health"
        out.append(_server(f"{setup.engine}{i}", _pinned(argv, core), env, ready,
                           run_dir / f"{setup.engine}{i}.log"))
    return out


SGLANG_METRICS_OFFSET = 50  # sglang-router's Prometheus port, above its own


def used_ports(port_base: int, replicas: int, keys: Sequence[int]) -> list[int]:
    """The loopback ports the configurations ``keys`` listen on: a replica each at
    ``port_base + 1 + i``; sglang-router at ``port_base`` and its metrics above (WAR's
    router runs in process)."""
    ports = [port_base + 1 + i for i in range(replicas)]
    if any(SETUPS[k].front == "sglang" for k in keys):
        ports += [port_base, port_base + SGLANG_METRICS_OFFSET]
    return sorted(ports)


def sglang_router(setup: Setup, settings: BenchSettings, run_dir: Path) -> Service:
    port = settings.port_base
    workers = [f"http://127.0.0.1:{settings.port_base + 1 + i}"
               for i in range(settings.run.replicas)]
    argv = [str(PEER_PYTHON), "-m", "sglang_router.launch_router", "--worker-urls", *workers,
            "--policy", setup.policy, "--host", "127.0.0.1", "--port", str(port),
            "--prometheus-host", "127.0.0.1",
            "--prometheus-port", str(port + SGLANG_METRICS_OFFSET)]
    return _server("sglang-router", argv, dict(os.environ),
                   f"http://127.0.0.1:{port}/health", run_dir / "sglang-router.log")


# ---------------------------------------------------------------- metrics


def scrape(url: str) -> dict[str, float]:
    """Sums of every sample of a Prometheus text page, by sample name."""
    text = httpx.get(url, timeout=10.0).text
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            out[sample.name] = out.get(sample.name, 0.0) + float(sample.value)
    return out


# Counters per engine: (generated, accepted draft tokens, prompt tokens, cached prompt).
COUNTERS = {
    "vllm": ("vllm:generation_tokens_total", "vllm:spec_decode_num_accepted_tokens_total",
             "vllm:prefix_cache_queries_total", "vllm:prefix_cache_hits_total"),
    "war": ("war_generated_tokens_total", "war_accepted_tokens_total",
            "war_prompt_tokens_total", "war_cached_prompt_tokens_total"),
}


def engine_figures(engine: str, pages: Sequence[Mapping[str, float]]) -> dict[str, float]:
    """Tokens per forward pass and prefix-cache hit rate from the replicas' counters."""
    names = COUNTERS[engine]
    gen, acc, prompt, hit = (sum(p.get(n, 0.0) for p in pages) for n in names)
    return {
        "engine_generated_tokens": gen,
        "tokens_per_step": gen / (gen - acc) if gen > acc else 0.0,
        "prefix_hit_rate": hit / prompt if prompt else 0.0,
    }


# ---------------------------------------------------------------- one run


def front_backends(setup: Setup, settings: BenchSettings, io: PolicyIO) -> dict[str, Backend]:
    if setup.front == "sglang":
        # sglang-router's /v1/completions refuses token-id prompts: send the text, which
        # vLLM tokenizes again (answers that tokenize otherwise are counted).
        def text(ids: Sequence[int]) -> str:
            return io.tokenizer.decode(list(ids), skip_special_tokens=False)

        return {"sglang": OpenAICompatBackend(
            "sglang", f"http://127.0.0.1:{settings.port_base}", MODEL_NAME, server="vllm",
            text_prompt=text)}
    out: dict[str, Backend] = {}
    for i in range(settings.run.replicas):
        url = f"http://127.0.0.1:{settings.port_base + 1 + i}"
        name = f"replica{i}"
        out[name] = (WarHttpBackend(name, url, model=MODEL_NAME) if setup.engine == "war"
                     else OpenAICompatBackend(name, url, MODEL_NAME, server="vllm"))
    return out


async def drive(setup: Setup, settings: BenchSettings, tasks_by_step: Sequence[list[Task]],
                in_flight: int | None) -> tuple[list[Any], int]:
    """Every step in turn through the configuration's front; all trajectories and the
    number of text prompts the server tokenized otherwise than the driver."""
    io = PolicyIO.from_folder(settings.model)
    backends = front_backends(setup, settings, io)
    front: Any
    if setup.front == "war":
        settings_ = json.loads(settings.war_policy) if setup.policy == "war" else {}
        front = Router(backends, make_policy(setup.policy, **settings_))
        await front.start()
    else:
        front = backends["sglang"]
    trajs: list[Any] = []
    try:
        for step, tasks in enumerate(tasks_by_step):
            if setup.engine == "war":
                await asyncio.gather(*(b.observe_rl_step(step) for b in backends.values()
                                       if isinstance(b, WarHttpBackend)))
            trajs += await run_step_async(
                tasks, {"front": front}, io,
                RolloutConfig(group_size=settings.run.group_size, agent=settings.run.agent,
                              rl_step=step, seed=settings.run.seed, max_in_flight=in_flight))
    finally:
        await front.close()
    mismatches = sum(getattr(b, "prompt_mismatches", 0) for b in backends.values())
    return trajs, mismatches


def run_once(setup: Setup, settings: BenchSettings, load: str,
             tasks_by_step: Sequence[list[Task]], in_flight: int | None, repeat: int
             ) -> tuple[RunFigures, dict[str, float]]:
    run_dir = settings.log_dir / f"r{repeat}-{load}-{setup.key}"
    servers = replica_servers(setup, settings, run_dir)
    if setup.front == "sglang":
        servers.append(sglang_router(setup, settings, run_dir))
    try:
        t0 = time.monotonic()
        for s in servers[: settings.run.replicas]:
            s.launch()
        for s in servers[: settings.run.replicas]:
            s.wait_ready(settings.startup_timeout_s)
        for s in servers[settings.run.replicas:]:  # the router needs its workers up
            s.start(settings.startup_timeout_s)
        startup_s = time.monotonic() - t0
        cpu0 = [s.cpu_s() for s in servers]
        self0 = resource.getrusage(resource.RUSAGE_SELF)
        trajs, mismatches = asyncio.run(drive(setup, settings, tasks_by_step, in_flight))
        self1 = resource.getrusage(resource.RUSAGE_SELF)
        cpu = [s.cpu_s() - c for s, c in zip(servers, cpu0, strict=True)]
        pages = [scrape(f"http://127.0.0.1:{settings.port_base + 1 + i}/metrics")
                 for i in range(settings.run.replicas)]
    finally:
        stop_all(servers)
    fig = figures(load, str(setup.key), repeat, trajs)
    extra = engine_figures(setup.engine, pages)
    extra["startup_s"] = startup_s
    extra["errors"] = float(sum(t.finish_reason == "error" for t in trajs))
    extra["prompt_mismatches"] = float(mismatches)
    extra["requests"] = float(sum(t.num_turns for t in trajs))
    # Where the time goes: CPU seconds of the replicas, of sglang-router, and of this
    # process (the agent loops, tools, tokenization, HTTP clients and WAR's router).
    extra["replica_cpu_s"] = sum(cpu[: settings.run.replicas])
    extra["front_cpu_s"] = sum(cpu[settings.run.replicas:])
    extra["driver_cpu_s"] = (self1.ru_utime - self0.ru_utime) + (self1.ru_stime - self0.ru_stime)
    wall = fig.makespan_s
    extra["replica_busy"] = (extra["replica_cpu_s"] / (settings.run.replicas * wall)
                             if wall > 0 else 0.0)
    return fig, extra


def stop_all(servers: Sequence[Service]) -> None:
    """Stops every server, last first, even when stopping one fails or is interrupted;
    then raises the first such error."""
    error: BaseException | None = None
    for s in reversed(servers):
        try:
            s.stop()
        except BaseException as exc:  # raised below, once all are stopped
            error = error or exc
    if error is not None:
        raise error


# ---------------------------------------------------------------- the bench


LOADS = ("low", "high")


def schedule(keys: Sequence[int], repeats: int,
             loads: Sequence[str] = LOADS) -> Iterator[tuple[int, str, int]]:
    """(repeat, load, key) in run order: loads in turn, configurations rotated per
    repeat so slow drift of the machine does not favour one of them."""
    for repeat in range(repeats):
        shift = repeat % len(keys)
        order = list(keys[shift:]) + list(keys[:shift])
        for load in loads:
            for key in order:
                yield repeat, load, key


def run_bench(settings: BenchSettings, keys: Sequence[int], log: Any = print,
              loads_run: Sequence[str] = LOADS) -> dict[str, Any]:
    pool = task_pool(settings.run)
    steps = range(settings.run.steps)
    loads = {
        "low": ([step_tasks(pool, settings.low_tasks, settings.run.seed, s) for s in steps],
                settings.low_in_flight_per_replica * settings.run.replicas),
        "high": ([step_tasks(pool, settings.run.tasks_per_step, settings.run.seed, s)
                  for s in steps], None),
    }
    figs: list[RunFigures] = []
    extras: dict[tuple[int, str, str], dict[str, float]] = {}
    for repeat, load, key in schedule(keys, settings.repeats, loads_run):
        tasks_by_step, in_flight = loads[load]
        fig, extra = run_once(SETUPS[key], settings, load, tasks_by_step, in_flight, repeat)
        figs.append(fig)
        extras[(repeat, load, str(key))] = extra
        log(f"repeat {repeat} {load:4s} {key} {SETUPS[key].name:24s} "
            f"{fig.tokens_per_s:7.1f} tok/s makespan {fig.makespan_s:6.1f} s "
            f"{extra['tokens_per_step']:.2f} tok/step hit {extra['prefix_hit_rate']:.2f} "
            f"reward {fig.mean_reward:.2f} errors {extra['errors']:.0f} "
            f"cpu s: replicas {extra['replica_cpu_s']:.1f} (busy {extra['replica_busy']:.0%}) "
            f"front {extra['front_cpu_s']:.1f} driver {extra['driver_cpu_s']:.1f} "
            f"retokenized {extra['prompt_mismatches']:.0f}/{extra['requests']:.0f} "
            f"(start-up {extra['startup_s']:.0f} s)")
    runs = [dict(dataclasses.asdict(f), **extras[(f.repeat, f.load, f.config)])
            for f in with_lower_bounds(figs)]
    return report(runs, settings, keys)


_MEDIANS = ("makespan_s", "tokens_per_s", "lower_bound_ratio", "prefix_hit_rate",
            "tokens_per_step", "mean_reward", "success_rate", "errors", "startup_s",
            "prompt_mismatches", "replica_cpu_s", "front_cpu_s", "driver_cpu_s",
            "replica_busy")


def report(runs: Sequence[dict[str, Any]], settings: BenchSettings,
           keys: Sequence[int]) -> dict[str, Any]:
    tables: dict[str, list[dict[str, Any]]] = {}
    for load in ("low", "high"):
        rows = []
        for key in keys:
            mine = [r for r in runs if r["load"] == load and r["config"] == str(key)]
            if not mine:
                continue
            row: dict[str, Any] = {"config": key, "name": SETUPS[key].name,
                                   "repeats": len(mine)}
            for field in _MEDIANS:
                row[field] = statistics.median(r[field] for r in mine)
            ratios = []
            for r in mine:
                ref = [x for x in runs if x["load"] == load and x["repeat"] == r["repeat"]
                       and x["config"] == str(REFERENCE)]
                if ref and ref[0]["tokens_per_s"] > 0:
                    ratios.append(r["tokens_per_s"] / ref[0]["tokens_per_s"])
            row["vs_config2"] = statistics.median(ratios) if ratios else None
            rows.append(row)
        tables[load] = rows
    return {
        "tables": tables,
        "runs": list(runs),
        "targets": {"low": {"4_vs_2": 1.3}, "high": {"4_vs_2": 1.2, "5_vs_2": 1.0}},
        "settings": {
            "replicas": settings.run.replicas, "group_size": settings.run.group_size,
            "steps": settings.run.steps, "tasks_per_step_high": settings.run.tasks_per_step,
            "tasks_per_step_low": settings.low_tasks,
            "in_flight_per_replica_low": settings.low_in_flight_per_replica,
            "repeats": settings.repeats, "max_num_seqs": settings.max_num_seqs,
            "suffix_config": json.loads(settings.suffix_config), "pinned": settings.pin,
            "cores": [c for c in _cores(settings)], "seed": settings.run.seed,
            "war_policy": json.loads(settings.war_policy),
            "agent": dataclasses.asdict(settings.run.agent),
        },
    }


def markdown(out: Mapping[str, Any]) -> str:
    lines = []
    for load, rows in out["tables"].items():
        lines += [f"**{load} load**", "",
                  "| # | configuration | makespan s | tokens/s | vs #2 | lower-bound ratio "
                  "| prefix hit | tokens/step | reward |",
                  "|---|---|---|---|---|---|---|---|---|"]
        for r in rows:
            vs = f"{r['vs_config2']:.2f}x" if r["vs_config2"] is not None else "-"
            lines.append(
                f"| {r['config']} | {r['name']} | {r['makespan_s']:.1f} | "
                f"{r['tokens_per_s']:.0f} | {vs} | {r['lower_bound_ratio']:.2f} | "
                f"{r['prefix_hit_rate']:.2f} | {r['tokens_per_step']:.2f} | "
                f"{r['mean_reward']:.2f} |")
        lines.append("")
    lines += ["**Where the time goes** (CPU seconds per run, medians; replicas busy = their "
              "CPU / (replicas x makespan))", "",
              "| load | # | configuration | replicas CPU s | replicas busy | sglang-router CPU s "
              "| driver + WAR router CPU s |", "|---|---|---|---|---|---|---|"]
    for load, rows in out["tables"].items():
        for r in rows:
            lines.append(f"| {load} | {r['config']} | {r['name']} | {r['replica_cpu_s']:.1f} | "
                         f"{r['replica_busy']:.0%} | {r['front_cpu_s']:.1f} | "
                         f"{r['driver_cpu_s']:.1f} |")
    lines.append("")
    return "\n".join(lines)


def _ratio(out: Mapping[str, Any], load: str, key: int) -> float:
    for r in out["tables"].get(load, []):
        if r["config"] == key and r["vs_config2"] is not None:
            return float(r["vs_config2"])
    return float("nan")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--json", type=output_file_arg, required=True, help="output file")
    p.add_argument("--markdown", type=output_file_arg, help="also write the tables here")
    p.add_argument("--configs", default="1,2,3,4,5", help="comma-separated keys (1-5)")
    p.add_argument("--model", type=Path, help="policy folder (default: the built-in policy)")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--steps", type=int, default=3, help="synchronous RL steps per run")
    p.add_argument("--tasks", type=int, default=16, help="tasks per step at saturation")
    p.add_argument("--low-tasks", type=int, default=2, help="tasks per step at low load")
    p.add_argument("--low-in-flight", type=int, default=2,
                   help="trajectories in flight per replica at low load")
    p.add_argument("--loads", default="low,high", help="comma-separated: low, high")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--port-base", type=int, default=18100,
                   help="replicas listen from port-base + 1 on; sglang-router (configurations "
                        f"1, 2) on port-base and port-base + {SGLANG_METRICS_OFFSET}")
    p.add_argument("--suffix-config", default=BenchSettings.suffix_config,
                   help="vLLM --speculative-config of configurations 2, 3 and 5")
    p.add_argument("--war-policy", default="{}",
                   help="JSON settings of the war policy (configurations 4 and 5), e.g. "
                        "'{\"group_rel\": 1.1}'")
    p.add_argument("--no-pin", action="store_true", help="do not pin replicas to cores")
    p.add_argument("--log-dir", type=Path, default=Path("runs/e2e/logs"),
                   help="the servers' logs, a folder per run")
    args = p.parse_args(argv)
    try:
        keys = [int(k) for k in args.configs.split(",") if k.strip()]
    except ValueError:
        p.error(f"--configs must be comma-separated numbers, got {args.configs!r}")
    unknown = [k for k in keys if k not in SETUPS]
    if unknown or not keys or len(set(keys)) != len(keys):
        p.error(f"--configs takes distinct keys among {sorted(SETUPS)}, got {args.configs!r}")
    if any(SETUPS[k].engine == "vllm" or SETUPS[k].front == "sglang" for k in keys) \
            and not PEER_PYTHON.exists():
        p.error(f"configurations {keys} need the peer environment {PEER_PYTHON}: "
                "run benchmarks/e2e/setup_peer.sh first (or --configs 4)")
    loads_run = [x.strip() for x in args.loads.split(",") if x.strip()]
    if not loads_run or any(x not in LOADS for x in loads_run) \
            or len(set(loads_run)) != len(loads_run):
        p.error(f"--loads takes distinct names among {LOADS}, got {args.loads!r}")
    if args.repeats < 1 or args.steps < 1 or args.tasks < 1 or args.low_tasks < 1 \
            or args.low_in_flight < 1:
        p.error("--repeats, --steps, --tasks, --low-tasks and --low-in-flight must be >= 1")
    try:
        suffix = json.loads(args.suffix_config)
    except json.JSONDecodeError as exc:
        p.error(f"--suffix-config is not JSON: {exc}")
    if not isinstance(suffix, dict):  # vLLM's --speculative-config takes an object
        p.error(f"--suffix-config must be a JSON object, got {args.suffix_config!r}")
    try:
        make_policy("war", **json.loads(args.war_policy))
    except (json.JSONDecodeError, TypeError, ValueError) as exc:
        p.error(f"--war-policy: {exc}")
    # the rest is checked before the first server starts, not when it fails (or, for a
    # bad --markdown, after the whole run)
    if args.model is not None and not args.model.is_dir():
        p.error(f"--model {args.model} is not a folder" if args.model.exists()
                else f"--model folder not found: {args.model}")
    if args.model is not None and not (args.model / "config.json").is_file():
        p.error(f"--model {args.model} has no config.json (not a Hugging Face model folder)")
    if args.markdown is not None and args.markdown.resolve() == args.json.resolve():
        p.error(f"--markdown {args.markdown} is the --json file: the tables would replace "
                "the report")
    ports = used_ports(args.port_base, REPLICAS, keys)
    if args.port_base < 1 or ports[-1] > 65535:
        p.error(f"--port-base {args.port_base}: configurations {keys} listen on ports "
                f"{ports[0]}-{ports[-1]}; --port-base must be >= 1 and the last port "
                "at most 65535")
    try:
        check_output_dir(args.log_dir, "--log-dir")
        model = args.model or builtin_policy()
        run = RunConfig(name="e2e", model=str(model), replicas=REPLICAS,
                        tasks_per_step=args.tasks, group_size=8, steps=args.steps,
                        seed=args.seed, agent=AgentConfig())
    except ValueError as exc:
        p.error(str(exc))
    pool = len(task_pool(run))  # every step's tasks at both loads are drawn from it
    if args.low_tasks > pool:
        p.error(f"--low-tasks ({args.low_tasks}) must be at most the task pool's {pool} "
                f"tasks (twice --tasks)")
    settings = BenchSettings(run=run, model=Path(model), low_tasks=args.low_tasks,
                             low_in_flight_per_replica=args.low_in_flight,
                             repeats=args.repeats, port_base=args.port_base,
                             suffix_config=args.suffix_config, pin=not args.no_pin,
                             log_dir=args.log_dir, war_policy=args.war_policy)
    out = run_bench(settings, keys, log=lambda s: print(s, file=sys.stderr, flush=True),
                    loads_run=loads_run)
    write_json(args.json, out, indent=2)
    if args.markdown is not None:
        write_text_atomic(args.markdown, markdown(out))
    print(f"e2e: low load war/#2 {_ratio(out, 'low', 4):.2f}x, high load war/#2 "
          f"{_ratio(out, 'high', 4):.2f}x, war-router+vLLM/#2 {_ratio(out, 'high', 5):.2f}x "
          f"-> {args.json}")
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except (ValueError, OSError, RuntimeError) as e:  # e.g. a server that did not start
        sys.exit(f"bench_e2e: error: {e}")

"""Benchmark: the router's own cost, and its policies on real replicas.

1. Routing throughput: instant replicas (they echo the prompt) over HTTP; `war route`
   in front of them for each policy, reached over WAR's API (`/v1/completions`, WAR
   backends) and over SGLang's (`/generate`, SGLang backends: the API sglang-router is
   driven with), SGLang's router (`sglang-router`, cache_aware) in front of the same
   replicas when it is installed, and direct calls to one replica over each API;
   a load client keeps `--concurrency` requests in flight (8 and 64 by default, each
   measured), each continuing an earlier
   session (a prefix shared with an earlier prompt) with probability `affinity`.
   Requests/s, p50/p99 latency, and the latency a router adds over direct calls.
2. Policies on real replicas: 4 in-process engines over a tiny random model, each step
   paced to a GPU-like cost, serving multi-turn sessions in groups whose lengths differ;
   per policy the prefix-cache hit rate, the makespan and the migrations.

Targets and policies take turns within each repeat; figures are medians over repeats.
Wall-clock figures are of this machine; compare within one run.

    python benchmarks/router/bench_router.py --quick --json /tmp/bench_router.json

Prints one summary line; `--json OUT` writes the report. Progress goes to stderr.
"""

from __future__ import annotations

import argparse
import dataclasses
import re
import sys
import time
from typing import Any

from war.engine.bench import machine_info
from war.outputs import output_file_arg, write_json
from war.router.bench import (
    POLICIES,
    PolicyBenchConfig,
    RpsBenchConfig,
    run_policies,
    run_router_rps,
    summary_line,
    targets,
)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--json", type=output_file_arg, metavar="OUT", help="write the report as JSON")
    p.add_argument("--quick", action="store_true", help="fewer requests and repeats (< 3 min)")
    p.add_argument("--policies", nargs="+", choices=POLICIES, help="policies to compare")
    p.add_argument("--repeats", type=int, help="repeats of each measurement")
    p.add_argument("--requests", type=int, help="requests per throughput run")
    p.add_argument("--concurrency", type=int, nargs="+", metavar="C",
                   help="requests in flight, each measured (throughput; default 8 64)")
    p.add_argument("--slices", type=int,
                   help="parts of each run for which the targets take turns (throughput)")
    p.add_argument("--affinities", type=float, nargs="+", metavar="A",
                   help="fractions of requests continuing an earlier session")
    p.add_argument("--group-turns", type=int, nargs="+", metavar="T",
                   help="turns of each group's sessions (policies)")
    p.add_argument("--group-size", type=int, help="sessions per group (policies)")
    p.add_argument("--rl-steps", type=int, help="RL steps per run (policies)")
    p.add_argument("--apis", nargs="+", choices=("war", "sglang"),
                   help="APIs war route is reached over (throughput; default both)")
    p.add_argument("--no-sglang", action="store_true", help="skip SGLang's router")
    p.add_argument("--no-rps", action="store_true", help="skip the throughput measurement")
    p.add_argument("--no-policies", action="store_true", help="skip the policies measurement")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    if args.no_rps and args.no_policies:  # a report without a figure, and exit 0
        p.error("--no-rps and --no-policies together leave nothing to measure")
    try:  # the configs check every value: refuse a bad one now, not as a traceback
        configs(args)
    except ValueError as e:
        p.error(flag_names(str(e)))
    return args


# The configs' fields that options set, as the options are spelled.
FLAGS = {"num_requests": "--requests", "concurrencies": "--concurrency",
         "affinities": "--affinities", "slices": "--slices", "repeats": "--repeats",
         "group_turns": "--group-turns", "group_size": "--group-size",
         "rl_steps": "--rl-steps", "policies": "--policies", "apis": "--apis"}


def flag_names(message: str) -> str:
    """A config's error message with its field names spelled as the options."""
    return re.sub(r"\b(" + "|".join(FLAGS) + r")\b", lambda m: FLAGS[m.group(1)], message)


def configs(args: argparse.Namespace) -> tuple[RpsBenchConfig, PolicyBenchConfig]:
    rps = RpsBenchConfig.quick() if args.quick else RpsBenchConfig()
    pol = PolicyBenchConfig.quick() if args.quick else PolicyBenchConfig()
    common: dict[str, Any] = {"seed": args.seed}
    if args.policies:
        common["policies"] = tuple(args.policies)
    if args.repeats is not None:
        common["repeats"] = args.repeats
    rps_over = dict(common, sglang=not args.no_sglang)
    for flag, name in (("requests", "num_requests"), ("slices", "slices")):
        if getattr(args, flag) is not None:
            rps_over[name] = getattr(args, flag)
    if args.concurrency:
        rps_over["concurrencies"] = tuple(args.concurrency)
    if args.affinities:
        rps_over["affinities"] = tuple(args.affinities)
    if args.apis:
        rps_over["apis"] = tuple(args.apis)
    pol_over = dict(common)
    if args.group_turns:
        pol_over["group_turns"] = tuple(args.group_turns)
    for flag in ("group_size", "rl_steps"):
        if getattr(args, flag) is not None:
            pol_over[flag] = getattr(args, flag)
    return dataclasses.replace(rps, **rps_over), dataclasses.replace(pol, **pol_over)


def log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    rps_config, pol_config = configs(args)
    t0 = time.perf_counter()
    report: dict[str, Any] = {"machine": machine_info(), "quick": args.quick}
    if not args.no_rps:
        report["rps_config"] = dataclasses.asdict(rps_config)
        report.update(run_router_rps(rps_config, log))
    if not args.no_policies:
        report["policies_config"] = dataclasses.asdict(pol_config)
        report.update(run_policies(pol_config, log))
    report["targets"] = targets(report)
    report["wall_s"] = time.perf_counter() - t0
    if args.json is not None:
        write_json(args.json, report)
    print(summary_line(report))
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except (OSError, RuntimeError) as e:  # e.g. a replica or router that did not start
        sys.exit(f"bench_router: error: {e}")

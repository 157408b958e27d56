"""`war sim`: run a simulator experiment (a load sweep, or one large run) from YAML.

Knows the command's options, how to report progress (stderr) and the targets (stdout),
and where the JSON report and the plots go. Does not know the simulator's internals
(``war.sim``).
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import TypeAlias

Subparsers: TypeAlias = "argparse._SubParsersAction[argparse.ArgumentParser]"


def add_sim_command(commands: Subparsers) -> None:
    p = commands.add_parser(
        "sim", help="simulate a rollout fleet in virtual time (load sweeps, scale runs)",
        description="Runs every configuration of an experiment file at every load and "
        "writes a JSON report: results (throughput, makespan, lower-bound ratio, prefix "
        "hit rate, tokens/step per configuration and load), targets and wall_s.")
    p.add_argument("--config", type=Path, required=True, metavar="YAML",
                   help="experiment file (e.g. benchmarks/sim/sweep.yaml)")
    p.add_argument("--traces", type=Path, nargs="+", metavar="FILE",
                   help="trace files (default: the experiment's)")
    p.add_argument("--json", type=Path, required=True, metavar="OUT", help="write the report")
    p.add_argument("--plots", type=Path, metavar="DIR", help="write plots (PNG) here")
    p.add_argument("--workers", type=int, default=None, metavar="N",
                   help="worker processes (default: one per CPU this process may use)")
    p.add_argument("--loads", type=float, nargs="+", metavar="L",
                   help="only these loads (trajectories per replica)")
    p.add_argument("--configs", nargs="+", metavar="NAME", help="only these configurations")
    p.set_defaults(run=run_sim)


def run_sim(args: argparse.Namespace) -> int:
    from war.cli.paths import check_not_input, same_file
    from war.outputs import check_output_dir, check_output_file, write_json
    from war.sim.experiment import Experiment, check_loads, resolve_traces, run_experiment
    from war.sim.plots import write_plots
    from war.sim.report import summary_lines, targets

    if args.workers is None:
        args.workers = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") \
            else (os.cpu_count() or 1)
    if args.workers < 1:
        raise ValueError(f"--workers must be >= 1, got {args.workers}")
    if args.loads is not None:
        check_loads(args.loads, "--loads")
    # A sweep takes minutes: where its report and plots go is checked first.
    check_output_file(args.json, "--json")
    check_not_input(args.json, "--json", [("--config", args.config),
                                          *(("--traces", t) for t in args.traces or ())])
    if args.plots is not None:
        # (the folder made for the plots would be in the report's way once the sweep ends)
        if same_file(args.json, args.plots):
            raise ValueError(f"--json {args.json} is the --plots folder {args.plots}; give "
                             "the report a file name of its own")
        check_output_dir(args.plots, "--plots")
    exp = Experiment.load(args.config)
    if exp.workload.get("kind", "traces") != "traces":
        if args.traces:  # (the run would read none of them)
            raise ValueError(f"--traces: the experiment's workload is "
                             f"{exp.workload.get('kind')!r}, which reads no trace files")
    elif not args.traces:
        check_not_input(args.json, "--json", (("experiment's trace", t)
                                              for t in resolve_traces(exp.traces, exp.base_dir)))
    if args.configs:
        args.configs = list(dict.fromkeys(args.configs))  # (each configuration runs once)
        missing = sorted(set(args.configs) - set(exp.configs))
        if missing:
            raise ValueError(f"unknown configuration(s) {missing}; known: {sorted(exp.configs)}")

    def log(line: str) -> None:
        print(line, file=sys.stderr, flush=True)

    report = run_experiment(exp, args.traces, args.workers, log, args.loads, args.configs)
    report["targets"] = targets(report["results"], report["wall_s"])
    report["experiment"] = str(args.config)
    write_json(args.json, report)
    if args.plots is not None:
        for path in write_plots(report["results"], args.plots):
            log(f"plot: {path}")
    for line in summary_lines(report):
        print(line)
    print(f"wall {report['wall_s']:.1f} s -> {args.json}")
    return 0

"""Synchronous RL steps with WAR (load-aware speculation) against speculation off and
always on, at low load and at saturation, on two local replicas.

Prints one summary line and writes JSON (``runs``: medians per load and config;
``ratios``; ``policy_success_rate``). See ``war.rollout.bench``.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from war.outputs import output_file_arg, write_json
from war.rollout.bench import BenchConfig, run_bench
from war.rollout.run import RunConfig, builtin_policy


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--json", required=True, type=output_file_arg, help="output file")
    p.add_argument("--model", type=Path, help="policy folder (default: the built-in policy)")
    p.add_argument("--quick", action="store_true", help="fewer tasks and one repeat")
    p.add_argument("--repeats", type=int, help="repetitions (default 3, quick 1)")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    # checked before the replicas start (BenchConfig checks nothing): 0 repeats would
    # measure nothing and report ratios of 0
    if args.repeats is not None and args.repeats < 1:
        p.error(f"--repeats must be >= 1, got {args.repeats}")
    if args.model is not None and not args.model.is_dir():
        p.error(f"--model {args.model} is not a folder" if args.model.exists()
                else f"--model folder not found: {args.model}")
    if args.model is not None and not (args.model / "config.json").is_file():
        p.error(f"--model {args.model} has no config.json (not a Hugging Face model folder)")
    try:
        model = args.model or builtin_policy()
        run = RunConfig(name="bench", model=str(model), replicas=2,
                        tasks_per_step=8 if args.quick else 16, group_size=8,
                        steps=1 if args.quick else 2, seed=args.seed)
    except ValueError as e:
        p.error(str(e))
    repeats = args.repeats if args.repeats is not None else (1 if args.quick else 3)
    cfg = BenchConfig(run=run, low_tasks=1 if args.quick else 2, repeats=repeats)
    out = run_bench(cfg, model, log=lambda s: print(s, file=sys.stderr))
    write_json(args.json, out, indent=2)
    r = out["ratios"]
    print(f"rollout step: low load war/off {r['low'].get('war_vs_off', 0):.2f}x, "
          f"high load war/off {r['high'].get('war_vs_off', 0):.2f}x "
          f"war/always {r['high'].get('war_vs_always', 0):.2f}x, "
          f"policy success {out['policy_success_rate']:.0%} -> {args.json}")
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except (ValueError, OSError) as e:  # a caller's mistake found later: one line
        sys.exit(f"bench_step: error: {e}")

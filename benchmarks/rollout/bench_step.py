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
    model = args.model or builtin_policy()
    run = RunConfig(name="bench", model=str(model), replicas=2,
                    tasks_per_step=8 if args.quick else 16, group_size=8,
                    steps=1 if args.quick else 2, seed=args.seed)
    cfg = BenchConfig(run=run, low_tasks=1 if args.quick else 2,
                      repeats=args.repeats or (1 if args.quick else 3))
    out = run_bench(cfg, model, log=lambda s: print(s, file=sys.stderr))
    write_json(args.json, out, indent=2)
    r = out["ratios"]
    print(f"rollout step: low load war/off {r['low'].get('war_vs_off', 0):.2f}x, "
          f"high load war/off {r['high'].get('war_vs_off', 0):.2f}x "
          f"war/always {r['high'].get('war_vs_always', 0):.2f}x, "
          f"policy success {out['policy_success_rate']:.0%} -> {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Measures the CPU engine's forward-pass cost curve once, for the simulator's profile.

The simulator's ``ProfileCost`` (``war.sim.profile``) is fitted to the cost curve the
engine's load benchmark measures (``war.engine.bench.measure_cost_curve``: one paged
forward pass of ``batch`` sequences, each with ``context`` cached tokens and ``1 +
draft_tokens`` new ones, median of interleaved repeats). This script measures that
curve for the benchmark's small trace model shape (random weights: the cost of a
forward pass does not depend on their values) at two context lengths, so that the
context term of the fit is identified, and writes it as JSON::

    python benchmarks/sim/measure_cost_curve.py --json benchmarks/sim/data/cpu_cost_curve.json

The checked-in ``data/cpu_cost_curve.json`` was measured with this script's defaults
(9 passes of 9 repeats: about 4 minutes); the tests fit the profile on some of its
shapes and check the predictions on the others. Within a pass a shape's figure is the
fastest of its repeats; across passes it is their median, because a shared machine
also shifts whole passes (one earlier measurement's 512-token half ran 5% faster in
one pass than in the others, and over 7% faster on 15 of its 35 shapes; the fastest
pass per shape mixed such a pass's figures with normal ones), and on a busy machine
five passes still left one shape's passes 25% apart. Each record keeps its passes'
figures (``step_ms_passes``).
"""

from __future__ import annotations

import argparse
import dataclasses
import time
from typing import Any

import torch

from war.engine.bench import (
    COST_STATISTICS,
    TraceModelConfig,
    machine_info,
    measure_cost_curve,
)
from war.engine.loader import init_random
from war.outputs import output_file_arg, write_json


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--json", type=output_file_arg, required=True, metavar="OUT", help="write here")
    p.add_argument("--batches", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32, 64])
    p.add_argument("--drafts", type=int, nargs="+", default=[0, 2, 4, 8, 16])
    p.add_argument("--contexts", type=int, nargs="+", default=[128, 512])
    p.add_argument("--repeats", type=int, default=9, help="repeats per pass")
    p.add_argument("--passes", type=int, default=9,
                   help="passes over the whole grid; a shape's figure is the --pass-statistic "
                        "of its passes' figures (the machine is shared: one pass alone is noisy)")
    p.add_argument("--statistic", choices=sorted(COST_STATISTICS), default="min",
                   help="how a pass's repeats of a shape combine (min: other work on a shared "
                        "machine only slows a repeat down)")
    p.add_argument("--pass-statistic", choices=sorted(COST_STATISTICS), default="median",
                   help="how a shape's passes combine (median: a shared machine also shifts\n"
                        "whole passes, faster or slower; the min of passes would take some\n"
                        "shapes from a fast pass and others from a normal one)")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    # checked before the model is built: torch refuses 0 threads with a traceback, and
    # 0 passes would write an empty curve and exit 0
    for flag in ("threads", "passes", "repeats"):
        if getattr(args, flag) < 1:
            p.error(f"--{flag} must be >= 1, got {getattr(args, flag)}")
    if any(b < 1 for b in args.batches):
        p.error(f"--batches must be >= 1, got {args.batches}")
    for flag in ("drafts", "contexts"):
        if any(v < 0 for v in getattr(args, flag)):
            p.error(f"--{flag} must be >= 0, got {getattr(args, flag)}")
    # a shape listed twice would be measured twice per pass: its record would hold twice
    # the passes it says
    for flag in ("batches", "drafts", "contexts"):
        values = getattr(args, flag)
        if len(set(values)) != len(values):
            p.error(f"--{flag} must be distinct, got {values}")
    if not 0 <= args.seed < 2**63:
        p.error(f"--seed must be in [0, 2**63), got {args.seed}")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    threads = torch.get_num_threads()
    torch.set_num_threads(args.threads)
    try:
        return run(args)
    finally:  # the caller's setting again (main may run in a test's process)
        torch.set_num_threads(threads)


def run(args: argparse.Namespace) -> int:
    recipe = TraceModelConfig()
    config = recipe.model_config(eos_id=0, pad_id=0)
    model = init_random(config, args.seed)
    t0 = time.perf_counter()
    passes: dict[tuple[int, int, int], list[float]] = {}
    for i in range(args.passes):
        for context in args.contexts:
            for p in measure_cost_curve(model, args.batches, args.drafts, context, args.repeats,
                                        args.seed + i, args.statistic):
                passes.setdefault((context, p.batch, p.draft_tokens), []).append(p.step_ms)
    points: list[dict[str, Any]] = [
        {"batch": b, "draft_tokens": k, "context": c,
         "step_ms": COST_STATISTICS[args.pass_statistic](ms),
         "step_ms_passes": ms}
        for (c, b, k), ms in passes.items()
    ]
    report = {
        "cost_curve": points,
        "model": {"recipe": dataclasses.asdict(recipe),
                  "num_params": sum(p.numel() for p in model.parameters()),
                  "weights": "random (init_random)", "dtype": "float32"},
        "settings": {"repeats": args.repeats, "passes": args.passes, "threads": args.threads,
                     "seed": args.seed, "statistic": args.statistic,
                     "pass_statistic": args.pass_statistic, "order": "shuffled"},
        "machine": machine_info(),
        "seconds": time.perf_counter() - t0,
    }
    write_json(args.json, report)
    print(f"{len(points)} shapes in {report['seconds']:.0f} s -> {args.json}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

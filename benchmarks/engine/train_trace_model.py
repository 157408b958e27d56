"""Train (or find cached) the small trace model that the engine benchmarks run.

Fits a byte-level BPE tokenizer (4096 tokens) and a tiny Llama to the ChatML rendering
of every trajectory in the trace files, for a few minutes on the CPU, and writes a
Hugging Face folder (config.json, model.safetensors, tokenizer.json,
tokenizer_config.json) plus a stamp of the recipe. A folder whose stamp matches is left
as it is; the folder is a cache, not committed.

    python benchmarks/engine/train_trace_model.py [--out DIR] [--steps N] [--minutes M] [--seed S]

Defaults: `.cache/war/trace-model` under the repository, every `*.jsonl` in the nearest
`shared/data/traces` above this script, 500 steps (about 8 minutes on one core) capped
at 20 minutes, seed 0. Progress goes to stderr; one
summary line to stdout.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from pathlib import Path

from war.engine.bench import STAMP_FILE, TraceModelConfig, ensure_trace_model, find_traces
from war.outputs import check_output_dir

REPO = Path(__file__).resolve().parents[2]
DEFAULT_OUT = REPO / ".cache" / "war" / "trace-model"


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--out", type=Path, default=DEFAULT_OUT, help="model folder (the cache)")
    p.add_argument("--steps", type=int, default=TraceModelConfig.steps,
                   help="optimizer steps (same steps, seed and threads: same weights)")
    p.add_argument("--minutes", type=float, default=TraceModelConfig.minutes,
                   help="wall-clock cap on training (reached first only on a busy machine)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=TraceModelConfig.threads)
    p.add_argument("--traces", nargs="+", type=Path, metavar="FILE",
                   help="trace JSONL files (default: shared/data/traces/*.jsonl)")
    args = p.parse_args(argv)
    # checked before training (minutes): the recipe refuses bad values with a traceback,
    # a missing trace file fails on hashing, and an --out that is a file on the rename
    if args.seed < 0:
        p.error(f"--seed must be >= 0, got {args.seed}")
    try:
        recipe(args)
    except ValueError as e:
        p.error(f"--{str(e).replace('_', '-')}")
    missing = [t for t in args.traces or () if not t.is_file()]
    if missing:
        p.error(f"--traces: no such file {missing[0]}")
    try:
        check_output_dir(args.out, "--out")
    except ValueError as e:
        p.error(str(e))
    return args


def recipe(args: argparse.Namespace) -> TraceModelConfig:
    return TraceModelConfig(steps=args.steps, minutes=args.minutes, seed=args.seed,
                            threads=args.threads)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    traces = sorted(args.traces) if args.traces else find_traces(Path(__file__).resolve().parent)
    if not traces:
        sys.exit("train_trace_model: no shared/data/traces/*.jsonl found; pass --traces FILE ...")
    config = recipe(args)
    t0 = time.perf_counter()
    built = ensure_trace_model(args.out, traces, config,
                               log=lambda s: print(s, file=sys.stderr, flush=True))
    stamp = json.loads((args.out / STAMP_FILE).read_text(encoding="utf-8"))
    train = stamp["train"]
    print(f"train_trace_model: {'built' if built else 'cached'} {args.out} "
          f"({stamp['num_params']} params, {train['steps']} steps, "
          f"loss {train['first_loss']:.3f} -> {train['final_loss']:.3f}, "
          f"{time.perf_counter() - t0:.0f} s); recipe {dataclasses.asdict(config)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

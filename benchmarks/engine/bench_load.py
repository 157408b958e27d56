"""Benchmark: the engine's throughput under load, speculation `auto` vs `off` vs `always`.

Runs the trace-trained model (`train_trace_model.py`; trained first if the cache is
missing) on an RL-rollout-like workload cut from the traces: one prompt per task (a
conversation prefix up to an assistant turn, ChatML, truncated to its last tokens), each
sampled 8 times at temperature 0.7 as a group, over several synchronous RL steps (earlier
samples and steps are the draft history), stopping at `<|im_end|>`. For each concurrency
(sequences kept in flight until the step's pool runs out) each mode gets a fresh engine and
the engines take turns, one step each, so that other jobs on the machine slow every mode
alike; a mode's time is that of its own steps. Several repeats; the report has medians per
mode, per-repeat ratios `auto/off` and `auto/always` (median over repeats), the crossover,
and the cost curve of the forward pass (step time against batch size and draft tokens per
sequence).

    python benchmarks/engine/bench_load.py --quick --json /tmp/bench_load_quick.json

`--quick` takes about 3 minutes with the model cached (4 if it trains a quick one); the full
sweep about 15 minutes on an idle 2-core machine (33 measured on a busy one).

Prints one summary line; `--json OUT` writes the report. Training progress and per-run
lines go to stderr. Wall-clock figures are of this machine; compare within one run. One
torch thread by default (`--threads`), so that other jobs on the machine do not stall it.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import re
import sys
import time
from pathlib import Path
from typing import Any

import torch

from war.engine.bench import (
    STAMP_FILE,
    LoadBenchConfig,
    TraceModelConfig,
    build_prompts,
    ensure_trace_model,
    find_traces,
    is_current,
    machine_info,
    measure_cost_curve,
    run_sweep,
    summarize,
    summary_line,
)
from war.engine.loader import load_model
from war.outputs import output_file_arg, write_json
from war.spec.config import SpecConfig
from war.spec.traces import IM_END, load_records, load_tokenizer

REPO = Path(__file__).resolve().parents[2]
CACHE = REPO / ".cache" / "war"


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--json", type=output_file_arg, metavar="OUT", help="write the report as JSON")
    p.add_argument("--quick", action="store_true",
                   help="fewer concurrencies, shorter outputs, fewer repeats (< 5 min); the\n"
                        "cached full model if current, else a quickly trained one")
    p.add_argument("--model", type=Path, metavar="DIR",
                   help="model folder (default: the cached trace model, trained if missing)")
    p.add_argument("--repeats", type=int, help="repeats of the sweep")
    p.add_argument("--traces", nargs="+", type=Path, metavar="FILE",
                   help="trace JSONL files (default: shared/data/traces/*.jsonl)")
    p.add_argument("--concurrencies", type=int, nargs="+", metavar="C")
    p.add_argument("--max-tokens", type=int, help="max_tokens of each sample")
    p.add_argument("--rl-steps", type=int, help="synchronous RL steps per run")
    p.add_argument("--drafts", choices=("path", "tree"), default="path",
                   help="the speculator's tuned preset (SpecConfig.for_mode)")
    p.add_argument("--min-prob", type=float, help="SpecConfig.min_prob override")
    p.add_argument("--no-cost-curve", action="store_true", help="skip the cost curve")
    p.add_argument("--threads", type=int, default=1,
                   help="torch CPU threads (default 1: on a machine shared with other jobs,\n"
                        "two threads on two cores stall each other, measured 5-12x slower)")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    # checked before any work: the trace model may take minutes to train first
    if args.threads < 1:
        p.error(f"--threads must be >= 1, got {args.threads}")
    # the prompts' seeded draw refuses a negative seed, after the model is trained
    if args.seed < 0:
        p.error(f"--seed must be >= 0, got {args.seed}")
    inputs = args.traces or find_traces(Path(__file__).resolve().parent)
    if args.json is not None and any(args.json.resolve() == t.resolve() for t in inputs):
        p.error(f"--json {args.json} is one of the --traces: the report would replace it")
    try:
        config = bench_config(args)
    except ValueError as e:  # the config names its fields: name the options instead
        p.error(re.sub(r"\b(" + "|".join(FLAGS) + r")\b", lambda m: FLAGS[m.group(1)],
                       str(e)))
    # the cached trace models' context (both recipes'): a prompt and max_tokens must fit
    context = TraceModelConfig.max_position_embeddings
    if args.model is None and config.max_tokens >= context:
        p.error(f"--max-tokens must be < {context} (the trace model's context), "
                f"got {config.max_tokens}")
    return args


# The config's fields that options set, as the options are spelled.
FLAGS = {"repeats": "--repeats", "max_tokens": "--max-tokens", "rl_steps": "--rl-steps",
         "concurrencies": "--concurrencies", "min_prob": "--min-prob"}


def bench_config(args: argparse.Namespace) -> LoadBenchConfig:
    base = LoadBenchConfig.quick() if args.quick else LoadBenchConfig()
    overrides: dict[str, Any] = {"seed": args.seed}
    for flag, field in (("repeats", "repeats"), ("max_tokens", "max_tokens"),
                        ("rl_steps", "rl_steps")):
        if getattr(args, flag) is not None:
            overrides[field] = getattr(args, flag)
    if args.concurrencies:
        overrides["concurrencies"] = tuple(args.concurrencies)
    spec = {} if args.min_prob is None else {"min_prob": args.min_prob}
    overrides["spec"] = SpecConfig.for_mode(args.drafts, **spec)
    return dataclasses.replace(base, **overrides)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    threads = torch.get_num_threads()
    torch.set_num_threads(args.threads)
    try:
        return run(args)
    finally:
        torch.set_num_threads(threads)


def run(args: argparse.Namespace) -> int:
    t0 = time.perf_counter()
    traces = sorted(args.traces) if args.traces else find_traces(Path(__file__).resolve().parent)
    if not traces:
        sys.exit("bench_load: no shared/data/traces/*.jsonl found; pass --traces FILE ...")

    def log(line: str) -> None:
        print(line, file=sys.stderr, flush=True)

    config = bench_config(args)  # before the model, which may be trained first
    folder = args.model
    if folder is None:  # the full model; --quick trains a quick one if that is not cached
        folder, recipe = CACHE / "trace-model", TraceModelConfig()
        if args.quick and not is_current(folder, recipe, traces):
            folder, recipe = CACHE / "trace-model-quick", TraceModelConfig.quick()
        ensure_trace_model(folder, traces, recipe, log)
    model = load_model(folder)
    tokenizer = load_tokenizer(folder / "tokenizer.json")
    stop_id = tokenizer.token_to_id(IM_END)
    assert stop_id is not None
    room = model.config.max_position_embeddings - config.max_tokens
    if room < 1:  # refused now, not by the engine after the cost curve
        raise ValueError(f"--max-tokens {config.max_tokens} leaves no room for a prompt in "
                         f"the model's context ({model.config.max_position_embeddings})")
    if config.max_prompt_tokens > room:  # the prompt's tail must fit the model's context
        config = dataclasses.replace(config, max_prompt_tokens=max(room, 1))
    prompts = build_prompts(load_records(traces), tokenizer, config.max_num_tasks,
                            config.max_prompt_tokens, config.seed)
    cost = [] if args.no_cost_curve else measure_cost_curve(
        model, config.cost_batches, config.cost_drafts, config.cost_context,
        config.cost_repeats, config.seed)
    runs = run_sweep(model, prompts, config, stop_id, log)
    report: dict[str, Any] = {"cost_curve": [dataclasses.asdict(c) for c in cost]}
    report.update(summarize(runs, config.modes))
    stamp_path = Path(folder) / STAMP_FILE
    report["model"] = {
        "folder": str(folder), "config": model.config.to_dict(),
        "num_params": sum(p.numel() for p in model.parameters()),
        "stamp": json.loads(stamp_path.read_text(encoding="utf-8")) if stamp_path.is_file()
        else None,
    }
    report["runs"] = [dict(dataclasses.asdict(r), tokens_per_s=r.tokens_per_s,
                           tokens_per_step=r.tokens_per_step,
                           spec_tokens_per_seq=r.spec_tokens_per_seq) for r in runs]
    report["config"] = dataclasses.asdict(config)
    report["workload"] = {"traces": [p.name for p in traces], "num_prompts": len(prompts),
                          "mean_prompt_tokens": sum(len(p.prompt_ids) for p in prompts)
                          / max(len(prompts), 1), "quick": args.quick}
    report["machine"] = machine_info()
    report["seconds"] = time.perf_counter() - t0
    print(summary_line(report))
    if args.json is not None:
        write_json(args.json, report, indent=2)
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except (ValueError, FileNotFoundError) as e:
        sys.exit(f"bench_load: error: {e}")

"""Benchmark: suffix speculation replayed over real agent traces.

Replays every trajectory of the trace files through `war.spec.SuffixSpeculator` (the
target model emitting the recorded responses; see `war.spec.replay`), each file as its
own workload, and prints one summary line; `--json OUT` writes the full report (top-level
metrics, per-file breakdown, config, and with `--baseline` the baseline and the ratios).

    python benchmarks/spec/bench_replay.py --mode tree --baseline --json bench-spec-tree.json

Defaults: every `*.jsonl` in `shared/data/traces` (the `shared` folder found by walking up
from this script, normally beside the repository), trial-major order, GPT-2 tokenizer from
`shared/data/tokenizer/gpt2` (the bundled copy if absent). The baseline is SuffixDecoding
as published (`SpecConfig.baseline`: trajectory-local and global trees of bare responses,
no groups, no smoothing, factor 1 for chains and 2 for trees, min prob 0.1), run on the
same native trees in the same process.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path
from typing import Any

from war.outputs import output_file_arg, write_json
from war.spec import SpecConfig, SuffixSpeculator
from war.spec.config import COMBINES
from war.spec.replay import (
    MODES,
    ReplayReport,
    baseline_config,
    mode_config,
    ratios,
    replay_by_file,
)
from war.spec.traces import ORDERS, load_tokenizer, load_trajectories, ordered, shared_inputs

_FLAG_TYPES = {
    "int": int, "float": float, "str": str, "int | None": int, "float | None": float,
}


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--traces", nargs="+", type=Path, metavar="FILE", help="trace JSONL files")
    p.add_argument("--order", choices=ORDERS, default="trial-major")
    p.add_argument("--seed", type=int, default=0, help="seed of --order shuffled")
    p.add_argument(
        "--mode",
        choices=list(MODES),
        default="path",
        help="path: chains (SpecConfig()); tree: token trees (SpecConfig.tree_preset())",
    )
    p.add_argument("--limit", type=int, metavar="N", help="first N trajectories of each file")
    p.add_argument(
        "--baseline",
        action="store_true",
        help="also run published SuffixDecoding (SpecConfig.baseline) and report ratios",
    )
    p.add_argument("--tokenizer", type=Path, help="tokenizer.json (default: shared GPT-2)")
    p.add_argument("--budget", type=int, help="draft budget per propose (default: config's)")
    p.add_argument("--json", type=output_file_arg, metavar="OUT", help="write the report as JSON")
    cfg = p.add_argument_group("SpecConfig overrides (default: the mode's preset, else SpecConfig)")
    cfg.add_argument(
        "--no-global", dest="use_global", action="store_const", const=False, help="use_global=False"
    )
    for f in dataclasses.fields(SpecConfig):  # one flag per field, so new knobs appear here
        if f.name in ("tree", "use_global"):  # --mode, --no-global
            continue
        flag, default = "--" + f.name.replace("_", "-"), f"default {f.default}"
        if f.name in ("factor", "max_spec_tokens", "min_prob", "alpha", "alpha_decay",
                      "local_alpha", "global_alpha", "merge_threshold"):
            default = ", ".join(f"{getattr(mode_config(m), f.name)} ({m})" for m in MODES)
        if str(f.type) == "bool":
            cfg.add_argument(flag, action=argparse.BooleanOptionalAction, help=default)
        elif f.name == "combine":
            cfg.add_argument(flag, choices=COMBINES, help=default)
        elif str(f.type) in _FLAG_TYPES:
            cfg.add_argument(flag, type=_FLAG_TYPES[str(f.type)], help=default)
        else:
            raise TypeError(f"bench_replay has no flag type for SpecConfig.{f.name}: {f.type}")
    return p.parse_args(argv)


def spec_config(args: argparse.Namespace) -> SpecConfig:
    overrides: dict[str, Any] = {
        f.name: getattr(args, f.name)
        for f in dataclasses.fields(SpecConfig)
        if getattr(args, f.name, None) is not None
    }
    return dataclasses.replace(mode_config(args.mode), **overrides)


def summary(args: argparse.Namespace, n: int, r: ReplayReport, base: ReplayReport | None) -> str:
    line = (
        f"bench_replay mode={args.mode} order={args.order} trajectories={n}: "
        f"tokens/step {r.tokens_per_step:.3f}, acceptance {r.acceptance_rate:.3f}, "
        f"draft {r.mean_draft_len:.2f}, propose {r.propose_us_p50:.1f} us "
        f"(b{r.batch_size} {r.propose_us_p50_batched:.2f} us/seq), "
        f"append {r.append_us_p50:.1f} us, response end {r.response_end_us_p50:.0f} us, "
        f"turn start {r.turn_start_us_p50:.0f} us, "
        f"{r.bytes_per_cached_token:.0f} B/token"
    )
    if base is not None:
        line += (
            f" | baseline: tokens/step {base.tokens_per_step:.3f} "
            f"(x{r.tokens_per_step / base.tokens_per_step if base.tokens_per_step else 0:.3f}), "
            f"acceptance {base.acceptance_rate:.3f}"
        )
    return line


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    found, shared_tokenizer = shared_inputs(Path(__file__).resolve().parent)
    traces: list[Path] = args.traces or found
    if not traces:
        sys.exit("bench_replay: no shared/data/traces/*.jsonl found above this script; "
                 "pass --traces FILE ...")
    tokenizer_path = args.tokenizer or shared_tokenizer
    cfg = spec_config(args)
    base_cfg = baseline_config(args.mode, cfg.max_depth)

    trajs = ordered(
        load_trajectories(traces, load_tokenizer(tokenizer_path), args.limit), args.order, args.seed
    )
    report = replay_by_file(trajs, lambda: SuffixSpeculator(cfg), budget=args.budget)
    base = None
    if args.baseline:
        base = replay_by_file(trajs, lambda: SuffixSpeculator(base_cfg), budget=args.budget)
    print(summary(args, len(trajs), report, base))

    if args.json is not None:
        out: dict[str, Any] = report.to_dict()
        out["config"] = dataclasses.asdict(cfg)
        out["run"] = {
            "mode": args.mode,
            "order": args.order,
            "seed": args.seed,
            "limit": args.limit,
            "budget": args.budget,
            "traces": [p.name for p in traces],
            "tokenizer": tokenizer_path.name if tokenizer_path else "bundled gpt2",
        }
        if base is not None:
            out["baseline"] = {"config": dataclasses.asdict(base_cfg), **base.to_dict()}
            out["ratios"] = ratios(report, base)
            out["ratios_per_file"] = {
                name: ratios(file_report, base.per_file[name])
                for name, file_report in report.per_file.items()
            }
        write_json(args.json, out, indent=2)
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except (ValueError, FileNotFoundError) as e:
        sys.exit(f"bench_replay: error: {e}")

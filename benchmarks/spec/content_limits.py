"""Benchmark: how much of each draft's target the history could have supplied.

Replays the trace files as `bench_replay.py` does (sequential pass, the mode's tuned
`SuffixSpeculator`, the same steps) and asks, at every decoding step, what a drafter
drawing on the same text could accept at best. With `truth` the next `--cap` tokens of
the recorded response and `ctx` the context so far:

* `accepted`: the tuned speculator's accepted draft tokens, at most `cap`;
* `available[j]`: the longest prefix of `truth` (at most `cap` tokens) that follows the
  context's last `j` tokens somewhere in that text, that is, for which
  `ctx[-j:] + truth[:m]` occurs in a history entry (a completed response with its
  lead-in, as the speculator stores it; every group's) or earlier in the trajectory's
  own context. `available[0]` asks only that the continuation occurs.

A suffix drafter proposes what follows a match of at least one context token, so each
step's `accepted` is at most its `available[1]` (the script checks this); the gap
between them is what a better choice among the continuations the text holds (which
occurrence, how long a draft) could gain, and `available[0] - available[1]` what no
choice keyed on the context's end can reach (the continuation follows other text).
The figures are means over steps; `missed_share[j]` is the share of the steps'
shortfall `available[0] - accepted` that lies beyond `available[j]`.

    python benchmarks/spec/content_limits.py --mode path --json limits.json

One summary line per run; `--json OUT` writes the figures per file.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from war.outputs import output_file_arg, write_json
from war.spec import SpecConfig, SuffixSpeculator
from war.spec.replay import MODES, accepted_len, rl_steps
from war.spec.traces import (
    ORDERS,
    Trajectory,
    load_tokenizer,
    load_trajectories,
    ordered,
    shared_inputs,
)
from war.spec.tree import SuffixTree

CONTEXT_LENGTHS = (0, 1, 2, 4, 8)


class _Text:
    """The text a drafter could draw on: every history entry, and one trajectory's own
    context, each in a suffix tree only as deep as the longest string asked about."""

    def __init__(self, depth: int) -> None:
        self.depth = depth
        self.history = SuffixTree(depth)
        self.entries = 0
        self.own = SuffixTree(depth)

    def occurs(self, tokens: list[int]) -> bool:
        return self.history.count(tokens) > 0 or self.own.count(tokens) > 0

    def available(self, ctx: list[int], truth: list[int], j: int, start: int) -> int:
        """The longest m <= len(truth), known to be >= `start`, with ctx[-j:] +
        truth[:m] occurring (m = 0 when j = 0 and nothing occurs)."""
        lead = ctx[len(ctx) - j:] if j else []
        m = start
        while m < len(truth) and self.occurs(lead + truth[: m + 1]):
            m += 1
        return m


def measure(trajs: Sequence[Trajectory], config: SpecConfig, cap: int) -> dict[str, Any]:
    """The figures of one workload (module docstring)."""
    spec = SuffixSpeculator(config)
    text = _Text(cap + max(CONTEXT_LENGTHS))
    steps = accepted_sum = 0
    avail = dict.fromkeys(CONTEXT_LENGTHS, 0)
    rl_step = 0
    for seq_id, (traj, step) in enumerate(zip(trajs, rl_steps(trajs), strict=True)):
        if not traj.turns:
            continue
        if step > rl_step:
            rl_step = step
            spec.observe_step(rl_step)
        ctx = traj.turns[0].prompt_delta.tolist()
        spec.start(seq_id, traj.turns[0].prompt_delta, group_id=traj.task_id)
        text.own = SuffixTree(text.depth)
        text.own.append(0, ctx)
        for t, turn in enumerate(traj.turns):
            if t:
                delta = turn.prompt_delta.tolist()
                spec.new_turn(seq_id, turn.prompt_delta)
                text.own.append(0, delta)
                ctx += delta
            response = turn.response.tolist()
            response_start, pos = len(ctx), 0
            while pos < len(response):
                draft = spec.propose([seq_id], None)[0]
                n = accepted_len(draft.token_ids, draft.parents, response, pos)
                truth = response[pos : pos + cap]
                got = min(n, cap)
                found = 0
                for j in sorted(CONTEXT_LENGTHS, reverse=True):  # (shorter: never less)
                    found = text.available(ctx, truth, min(j, len(ctx)), found)
                    avail[j] += found
                    if j == 1 and found < got:
                        raise AssertionError(f"step {steps}: {got} tokens accepted from "
                                             f"text that holds only {found}")
                steps += 1
                accepted_sum += got
                emitted = response[pos : pos + n + 1]
                pos += len(emitted)
                spec.extend(seq_id, emitted)
                text.own.append(0, emitted)
                ctx += emitted
            spec.end_response(seq_id)
            entry = ctx[max(0, response_start - config.lead_in):]
            text.history.append(text.entries, entry)
            text.entries += 1
        spec.finish(seq_id)
    mean = (lambda v: v / steps) if steps else (lambda v: 0.0)
    shortfall = avail[0] - accepted_sum
    return {
        "steps": steps,
        "cap": cap,
        "accepted": mean(accepted_sum),
        "available": {str(j): mean(v) for j, v in avail.items()},
        "missed_share": {
            str(j): (avail[0] - max(v, accepted_sum)) / shortfall if shortfall > 0 else 0.0
            for j, v in avail.items()
        },
    }


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--traces", nargs="+", type=Path, metavar="FILE", help="trace JSONL files")
    p.add_argument("--order", choices=ORDERS, default="trial-major")
    p.add_argument("--seed", type=int, default=0, help="seed of --order shuffled")
    p.add_argument("--mode", choices=list(MODES), default="path")
    p.add_argument("--cap", type=int, default=8, help="tokens of the target asked about")
    p.add_argument("--limit", type=int, metavar="N", help="first N trajectories of each file")
    p.add_argument("--tokenizer", type=Path, help="tokenizer.json (default: shared GPT-2)")
    p.add_argument("--json", type=output_file_arg, metavar="OUT", help="write the figures")
    args = p.parse_args(argv)
    if args.cap < 1:
        p.error(f"--cap must be >= 1, got {args.cap}")
    if args.limit is not None and args.limit < 1:
        p.error(f"--limit must be >= 1, got {args.limit}")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    found, shared_tokenizer = shared_inputs(Path(__file__).resolve().parent)
    traces: list[Path] = args.traces or found
    if not traces:
        sys.exit("content_limits: no shared/data/traces/*.jsonl found above this script; "
                 "pass --traces FILE ...")
    tokenizer_path = args.tokenizer or shared_tokenizer
    tokenizer = load_tokenizer(tokenizer_path)
    config = SpecConfig.for_mode(args.mode)
    per_file: dict[str, Any] = {}
    for path in traces:  # each file its own workload, as bench_replay replays them
        trajs = ordered(load_trajectories([path], tokenizer, args.limit), args.order, args.seed)
        per_file[path.name] = measure(trajs, config, args.cap)
    parts = []
    for name, r in per_file.items():
        a = r["available"]
        parts.append(f"{name}: accepted {r['accepted']:.2f} of {args.cap}, available "
                     + ", ".join(f"{a[str(j)]:.2f} after {j}" for j in CONTEXT_LENGTHS)
                     + f" context tokens; shortfall beyond a 1-token match "
                     f"{r['missed_share']['1']:.0%}")
    print(f"content_limits mode={args.mode} order={args.order} " + " | ".join(parts))
    if args.json is not None:
        write_json(args.json, {"mode": args.mode, "order": args.order, "cap": args.cap,
                               "context_lengths": list(CONTEXT_LENGTHS),
                               "per_file": per_file}, indent=2)
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except (ValueError, FileNotFoundError) as e:
        sys.exit(f"content_limits: error: {e}")

"""`war spec replay` and `war spec demo`: suffix speculation replayed over agent traces.

Knows the options of these commands and how to show a `ReplayReport` as a rich table.
The replay itself is `war.spec.replay`; traces and tokenization are `war.spec.traces`.
Without `--traces`, both commands use the sample bundled in `war.data`.
"""

from __future__ import annotations

import argparse
import dataclasses
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import TypeAlias

from rich import box
from rich.table import Table

from war import data
from war.cli.console import make_console
from war.cli.paths import check_not_input
from war.outputs import check_output_file, write_json
from war.spec import SpecConfig, SuffixSpeculator
from war.spec.replay import MODES, ReplayReport, baseline_config, mode_config, replay_by_file
from war.spec.traces import ORDERS, TraceSource, Trajectory, load_trajectories, ordered

Subparsers: TypeAlias = "argparse._SubParsersAction[argparse.ArgumentParser]"


def add_spec_command(commands: Subparsers) -> None:
    spec = commands.add_parser("spec", help="suffix speculation tools")
    sub = spec.add_subparsers(dest="spec_command", required=True, metavar="COMMAND")
    p = sub.add_parser(
        "replay",
        help="replay agent traces through the suffix speculator and report its metrics",
        description="Decodes recorded trajectories with the suffix speculator as draft model "
        "(the target model emits the recorded responses) and reports acceptance, latency "
        "and memory.",
    )
    _add_trace_options(p)
    p.add_argument("--mode", choices=list(MODES), default="path", help="draft chains or trees")
    p.add_argument("--json", metavar="OUT", type=Path, help="also write the report as JSON")
    p.set_defaults(run=run_replay)
    p = sub.add_parser(
        "demo",
        help="replay the bundled sample in path and tree mode, beside published SuffixDecoding",
    )
    _add_trace_options(p)
    p.set_defaults(run=run_demo)


def _add_trace_options(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--traces",
        nargs="+",
        type=Path,
        metavar="FILE",
        help="trace JSONL files (default: the bundled sample of tau-bench airline)",
    )
    p.add_argument("--order", choices=ORDERS, default="trial-major", help="replay order")
    p.add_argument("--seed", type=int, default=0, help="seed of --order shuffled")
    p.add_argument(
        "--limit", type=int, metavar="N", help="only the first N trajectories of each file"
    )


def _trajectories(args: argparse.Namespace) -> list[Trajectory]:
    paths: Sequence[Path] | None = args.traces
    sources: list[TraceSource] = list(paths) if paths else [data.resource(data.SAMPLE_TRACES)]
    trajs = load_trajectories(sources, limit=args.limit)
    if not trajs and args.limit != 0:  # (a report of zeros would look like a result)
        raise ValueError(f"no trajectories in the trace file(s) "
                         f"{', '.join(str(s) for s in sources)}")
    return ordered(trajs, args.order, args.seed)


def _replay(trajs: Sequence[Trajectory], cfg: SpecConfig) -> ReplayReport:
    return replay_by_file(trajs, lambda: SuffixSpeculator(cfg))


def run_replay(args: argparse.Namespace) -> int:
    if args.json is not None:
        check_output_file(args.json, "--json")
        check_not_input(args.json, "--json", (("--traces", t) for t in args.traces or ()))
    trajs = _trajectories(args)
    cfg = mode_config(args.mode)
    report = _replay(trajs, cfg)
    console = make_console()
    console.print(report_table(report, title=f"suffix speculation replay ({args.mode})"))
    if args.json is not None:
        out = {"config": dataclasses.asdict(cfg), "order": args.order, **report.to_dict()}
        write_json(args.json, out, indent=2)
        console.print(f"wrote {args.json}")
    return 0


def run_demo(args: argparse.Namespace) -> int:
    trajs = _trajectories(args)
    console = make_console()
    console.print(
        f"Replaying {len(trajs)} trajectories ({args.order}) through the suffix speculator: "
        "drafts verified against the recorded responses."
    )
    reports: dict[str, ReplayReport] = {}
    for mode in MODES:
        cfg = mode_config(mode)
        reports[mode] = _replay(trajs, cfg)
        reports[f"{mode}, baseline"] = _replay(trajs, baseline_config(mode))
    console.print(configs_table(reports))
    return 0


def configs_table(reports: Mapping[str, ReplayReport]) -> Table:
    """One row per configuration, the headline metrics as columns."""
    batch = max((r.batch_size for r in reports.values()), default=0)
    table = Table(
        title="suffix speculation replay",
        box=box.SIMPLE_HEAD,
        pad_edge=False,
        collapse_padding=True,
        caption_justify="left",
    )
    columns: list[tuple[str, Callable[[ReplayReport], str]]] = [
        ("tok/step", lambda r: f"{r.tokens_per_step:.2f}"),
        ("accept", lambda r: f"{r.acceptance_rate:.1%}"),
        ("draft", lambda r: f"{r.mean_draft_len:.1f}"),
        ("propose", lambda r: f"{r.propose_us_p50:.1f}"),
        (f"b{batch}/seq", lambda r: f"{r.propose_us_p50_batched:.2f}"),
        ("extend", lambda r: f"{r.append_us_p50:.1f}"),
        ("end", lambda r: f"{r.response_end_us_p50:.0f}"),
        ("turn", lambda r: f"{r.turn_start_us_p50:.0f}"),
        ("B/tok", lambda r: f"{r.bytes_per_cached_token:.0f}"),
    ]
    table.add_column("config", no_wrap=True)
    for name, _ in columns:
        table.add_column(name, justify="right", no_wrap=True)
    for config, r in reports.items():
        table.add_row(config, *(fmt(r) for _, fmt in columns))
    table.caption = (
        "tok/step: generated tokens per decoding step; accept: accepted / proposed draft "
        "tokens; draft: mean draft tokens per step; propose, extend, end "
        "(end_response: the response enters the history), turn (new_turn: the next "
        f"prompt's new tokens): p50 µs per call; b{batch}/seq: p50 µs per sequence of a batched "
        "propose call; B/tok: memory bytes per cached token"
    )
    return table


def report_table(report: ReplayReport, title: str) -> Table:
    """The metrics of one replay, one per row."""
    r = report
    table = Table(title=title)
    table.add_column("metric")
    table.add_column("value", justify="right")
    rows = [
        ("trajectories / turns", f"{r.num_trajectories} / {r.num_turns}"),
        ("generated tokens / steps", f"{r.num_generated_tokens} / {r.num_steps}"),
        ("tokens per step", f"{r.tokens_per_step:.3f}"),
        ("acceptance rate", f"{r.acceptance_rate:.1%}"),
        ("mean draft length", f"{r.mean_draft_len:.2f}"),
        *(
            (f"{source} drafts: steps / accepted", f"{n} / {r.source_accepted.get(source, 0)}")
            for source, n in r.source_steps.items()
        ),
        ("propose µs p50 / p99", f"{r.propose_us_p50:.1f} / {r.propose_us_p99:.1f}"),
        (
            f"propose µs/seq in batches of {r.batch_size}, p50 / p99",
            f"{r.propose_us_p50_batched:.2f} / {r.propose_us_p99_batched:.2f}",
        ),
        ("full batches / mean batch", f"{r.num_full_batch_calls} / {r.mean_batch:.1f}"),
        ("append µs p50 / p99", f"{r.append_us_p50:.1f} / {r.append_us_p99:.1f}"),
        (
            "response end µs p50 / p99",
            f"{r.response_end_us_p50:.1f} / {r.response_end_us_p99:.1f}",
        ),
        ("turn start µs p50 / p99", f"{r.turn_start_us_p50:.1f} / {r.turn_start_us_p99:.1f}"),
        ("finish µs p50 / p99", f"{r.finish_us_p50:.1f} / {r.finish_us_p99:.1f}"),
        ("bytes per cached token", f"{r.bytes_per_cached_token:.1f}"),
        ("tokens per step, batched", f"{r.tokens_per_step_batched:.3f}"),
        ("replay seconds", f"{r.seconds:.2f}"),
    ]
    for name, value in rows:
        table.add_row(name, value)
    return table

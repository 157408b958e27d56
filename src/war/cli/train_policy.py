"""`war train-policy`: make a tiny policy from expert demonstrations, then evaluate it.

Knows the command's options, how they map to a ``PolicyTrainConfig``, and how to show
progress, the loss curve and the per-environment success rates. The work itself is
``war.train.policy``; the defaults are the settings of the policy shipped in
``war.data`` (see its README.md).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
from pathlib import Path
from typing import TypeAlias

from rich.table import Table

from war.cli.console import make_console
from war.cli.paths import check_not_input, same_file
from war.outputs import (
    check_output_dir,
    check_output_file,
    removing_created_folders,
    write_json,
)

Subparsers: TypeAlias = "argparse._SubParsersAction[argparse.ArgumentParser]"
SEED_LIMIT = 2**63  # seeds of the training config and of the evaluation's engine (check_seed)


def add_train_policy_command(commands: Subparsers) -> None:
    p = commands.add_parser(
        "train-policy",
        help="train a tiny tool-use policy on expert demonstrations and evaluate it",
        description="Builds demonstrations from the scripted experts of the built-in "
        "environments, fits a BPE tokenizer, trains a small Llama on the assistant turns, "
        "writes a Hugging Face folder and reports its success rate per environment at "
        "temperature 0.7 on held-out tasks.",
    )
    p.add_argument("--out", required=True, type=Path, metavar="DIR",
                   help="folder of the trained policy (created). An earlier policy there is "
                   "replaced as a whole once training ends (the new one is written beside "
                   "it first, so the folder never mixes the two; its other files are kept); "
                   "a folder holding another model's files (*.safetensors shards, an index, "
                   "chat_template.jinja...) is refused")
    p.add_argument("--seed", type=int, default=0,
                   help="seed of tasks, weights and batches, in [0, 2**63)")
    p.add_argument("--steps", type=int, default=None, help="optimizer steps")
    p.add_argument("--tasks-per-env", type=int, default=None,
                   help="demonstrations per environment")
    p.add_argument("--threads", type=int, default=None,
                   help="torch CPU threads of training (the weights depend on it; default: 1)")
    p.add_argument("--eval-tasks", type=int, default=100, metavar="N",
                   help="held-out tasks per environment to evaluate on (0: skip)")
    p.add_argument("--eval-seed", type=int, default=None,
                   help="seed of the held-out tasks, in [0, 2**63) (default: seed + 1000)")
    p.add_argument("--json", type=Path, default=None, metavar="FILE",
                   help="also write the training summary and evaluation as JSON")
    p.set_defaults(run=run_train_policy)


def run_train_policy(args: argparse.Namespace) -> int:
    # a refused or failed run removes again the folders its checks made (--out and the
    # report's folder, with those above them) while they are still empty
    with removing_created_folders([args.out, *([args.json.parent] if args.json else [])]):
        return _train_and_report(args)


def _train_and_report(args: argparse.Namespace) -> int:
    from war.train.lm import check_seed
    from war.train.policy import (
        POLICY_FILES,
        PolicyTrainConfig,
        check_policy_out,
        evaluate_policy,
        train_policy,
    )

    console = make_console()
    # every value is checked here, before the demonstrations are built: the evaluation
    # seed is used only after the whole training run, and the report after that
    check_seed("--seed", args.seed)
    changes = {k: getattr(args, k) for k in ("steps", "tasks_per_env", "threads")
               if getattr(args, k) is not None}
    config = dataclasses.replace(PolicyTrainConfig(seed=args.seed), **changes)
    if args.eval_tasks < 0:
        raise ValueError(f"--eval-tasks must be >= 0, got {args.eval_tasks}")
    if args.eval_seed is not None:
        check_seed("--eval-seed", args.eval_seed)
    eval_seed = args.eval_seed if args.eval_seed is not None else args.seed + 1000
    if args.eval_tasks > 0 and eval_seed >= SEED_LIMIT:
        raise ValueError(f"--seed {args.seed} leaves no default --eval-seed (seed + 1000 must "
                         "be below 2**63): give --eval-seed")
    if eval_seed == args.seed:
        raise ValueError("--eval-seed must differ from --seed (held-out tasks)")
    if args.json is not None:
        # the policy's own files in --out are replaced by the new policy's: a report
        # written there would overwrite one of them (or be replaced by it)
        check_not_input(args.json, "--json", (("--out policy", args.out / name)
                                              for name in POLICY_FILES))
        # (the policy's folder is made there: the report could not be written after training)
        if same_file(args.json, args.out):
            raise ValueError(f"--json {args.json} is the --out folder {args.out}; give the "
                             "report a file name of its own")
        if Path(os.path.realpath(args.out)).is_relative_to(os.path.realpath(args.json)):
            raise ValueError(f"--json {args.json} is a folder of the --out path {args.out} "
                             "(made for the policy); give the report a file name of its own")
        check_output_file(args.json, "--json")
    check_policy_out(args.out, "--out")
    check_output_dir(args.out, "--out")
    console.print(f"[bold]war train-policy[/] -> {args.out} (seed {config.seed}, "
                  f"{config.steps} steps, {config.tasks_per_env} tasks per env)")
    summary = train_policy(
        config, args.out, log=console.print,
        on_step=lambda p: console.print(f"  step {p.step:5d}  loss {p.loss:.4f}  "
                                        f"lr {p.lr:.2e}  {p.elapsed_s:6.0f} s"))
    console.print(f"saved {args.out}: {summary.folder_bytes / 1e6:.1f} MB, "
                  f"{summary.parameters / 1e6:.2f} M parameters, vocabulary "
                  f"{summary.vocab_size}; training {summary.train_seconds:.0f} s, total "
                  f"{summary.total_seconds:.0f} s")
    report: dict[str, object] = {"train": summary.to_dict()}
    if args.eval_tasks > 0:
        console.print(f"evaluating on {args.eval_tasks} held-out tasks per environment "
                      f"(seed {eval_seed}, temperature 0.7)...")
        result = evaluate_policy(args.out, envs=config.envs, tasks_per_env=args.eval_tasks,
                                 seed=eval_seed, threads=config.threads)
        table = Table(title=f"success rate at temperature {result.temperature}")
        table.add_column("environment")
        table.add_column("tasks", justify="right")
        table.add_column("success", justify="right")
        for env, rate in result.success_by_env.items():
            table.add_row(env, str(result.tasks_per_env), f"{rate:.1%}")
        table.add_row("[bold]overall[/]", str(result.tasks_per_env * len(result.success_by_env)),
                      f"[bold]{result.overall:.1%}[/]")
        console.print(table)
        console.print(f"finish reasons {result.finish_reasons}, mean turns "
                      f"{result.mean_turns:.2f}, {result.seconds:.0f} s")
        report["eval"] = result.to_dict()
    if args.json is not None:
        write_json(args.json, report, indent=2)
    return 0

"""Entry point of the `war` command (`war = "war.cli.main:main"` in pyproject).

Knows the subcommands and how to report a caller's mistake (one line on stderr, exit
status 1: ValueError and OSError) and an interrupt (Ctrl-C: one line, exit status 130);
each subcommand's options and work live in its own module.
"""

from __future__ import annotations

import argparse
import sys

from war.cli import rollout, route, serve, sim, spec, train_policy
from war.cli.console import one_line

INTERRUPTED_STATUS = 130  # (128 + SIGINT, as a shell reports it)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="war", description="Workload-Aware Rollout: fast rollouts for agentic RL."
    )
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    rollout.add_demo_command(commands)
    rollout.add_rollout_command(commands)
    spec.add_spec_command(commands)
    serve.add_serve_command(commands)
    route.add_route_command(commands)
    train_policy.add_train_policy_command(commands)
    sim.add_sim_command(commands)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Runs `war` with `argv` (default: the process arguments); returns the exit status."""
    args = build_parser().parse_args(argv)
    try:
        status: int = args.run(args)
    except (ValueError, OSError) as e:
        # A caller's mistake (bad value, missing or unreadable file, a folder given for
        # a file): one line, no traceback. (A YAML parser's message spans lines.)
        print(f"war: error: {one_line(str(e))}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        # Ctrl-C: reports are written whole or not at all; a traceback adds nothing
        print("war: interrupted", file=sys.stderr)
        return INTERRUPTED_STATUS
    return status


if __name__ == "__main__":
    sys.exit(main())

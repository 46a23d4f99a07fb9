"""The `drafter` command line."""

from __future__ import annotations

import argparse
import logging
import signal
import sys

from drafter_service.bench.commands import add_bench_commands
from drafter_service.cli.corpus import add_corpus_commands
from drafter_service.cli.serve import add_serve_commands
from drafter_service.cli.warm import add_warm_command
from drafter_service.model.distill import add_distill_command


def build_parser() -> argparse.ArgumentParser:
    """The full argument parser (subcommands attach themselves)."""
    parser = argparse.ArgumentParser(prog="drafter", description="drafting service for speculative decoding")
    parser.add_argument("--log-level", default="WARNING", help="logging level (DEBUG, INFO, WARNING, ...)")
    sub = parser.add_subparsers(dest="command", required=True)
    add_serve_commands(sub)
    add_warm_command(sub)
    add_bench_commands(sub)
    add_distill_command(sub)
    add_corpus_commands(sub)
    return parser


def exit_on_sigterm(signum: int, frame: object) -> None:
    """SIGTERM ends a command as Ctrl-C would: ``finally`` blocks run, so a bench stops the services it started."""
    raise SystemExit(128 + signum)


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``drafter`` script."""
    args = build_parser().parse_args(argv)
    signal.signal(signal.SIGTERM, exit_on_sigterm)  # (`serve` installs its own: a graceful stop)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())

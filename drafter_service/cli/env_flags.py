"""Command-line flags that also read a DRAFTER_* environment variable."""

from __future__ import annotations

import argparse
import os
from typing import Any, Callable


def env_var(flag: str) -> str:
    """The environment variable of a flag: ``--max-nodes`` reads DRAFTER_MAX_NODES."""
    return "DRAFTER_" + flag.lstrip("-").replace("-", "_").upper()


def env_flag(parser: argparse.ArgumentParser, flag: str, kind: Callable[[str], Any], default: Any, help: str) -> None:
    """A flag whose default comes from its environment variable (DRAFTER_<FLAG>) when set."""
    var = env_var(flag)
    raw = os.environ.get(var)
    try:
        value = kind(raw) if raw is not None else default
    except ValueError as exc:
        raise SystemExit(f"{var}={raw!r}: {exc}") from None
    parser.add_argument(flag, type=kind, default=value, help=f"{help} [env {var}; default {default!r}]")

"""Command-line flags that also read a DRAFTER_* environment variable (for flags that are no declared setting)."""

from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import Any

from drafter_service.core.settings import env_default, env_var

__all__ = ["env_flag", "env_var"]


def env_flag(parser: argparse.ArgumentParser, flag: str, kind: Callable[[str], Any], default: Any, help: str) -> None:
    """A flag whose default comes from its environment variable (DRAFTER_<FLAG>) when set."""
    var = env_var(flag)
    parser.add_argument(flag, type=kind, default=env_default(var, kind, default),
                        help=f"{help} [env {var}; default {default!r}]")

"""Names shared by client and service: the default namespace and what a namespace or table may be called."""

from __future__ import annotations

import re

NAME_RE = re.compile(r"^[A-Za-z0-9_.-]{1,64}$")
DEFAULT_NAMESPACE = "default"


def check_name(name: str, what: str = "namespace") -> str:
    """Return ``name`` when it is a valid namespace or table name, else raise ValueError."""
    if not NAME_RE.match(name or ""):
        raise ValueError(f"bad {what} name {name!r}: use 1-64 letters, digits, '_', '.', '-'")
    return name

"""Bearer tokens as client and service read them: what a token may be, @FILE secrets, the authorization header."""

from __future__ import annotations

import re
from pathlib import Path

from drafter_service.api.errors import Unauthenticated

MIN_TOKEN_CHARS = 16
"""Shortest token accepted (use long random ones, e.g. ``openssl rand -hex 32``)."""
_TOKEN_RE = re.compile(r"^[\x21-\x7e]+$")  # printable ASCII without spaces: valid in gRPC metadata and HTTP headers
_BEARER = "bearer "


def check_token(token: str, what: str) -> str:
    """Return ``token`` when it is usable as a bearer token, else raise ValueError (the token is never echoed)."""
    if len(token) < MIN_TOKEN_CHARS:
        raise ValueError(f"{what}: a token needs at least {MIN_TOKEN_CHARS} characters, got {len(token)}")
    if not _TOKEN_RE.match(token):
        raise ValueError(f"{what}: a token may hold only printable ASCII characters without spaces")
    return token


def read_secret(value: str, what: str) -> str:
    """``value`` itself, or the contents of the file ``@PATH`` names (surrounding whitespace stripped).

    Raises:
        ValueError: the file cannot be read or is empty.
    """
    if not value.startswith("@"):
        return value.strip()
    path = Path(value[1:]).expanduser()
    try:
        text = path.read_text().strip()
    except (OSError, UnicodeDecodeError) as exc:
        raise ValueError(f"{what}: cannot read {path}: {getattr(exc, 'strerror', None) or exc}") from None
    if not text:
        raise ValueError(f"{what}: {path} is empty")
    return text


def bearer_token(value: str | bytes) -> str:
    """The token of an ``authorization: Bearer <token>`` value.

    Raises:
        Unauthenticated: the value is not a bearer credential.
    """
    if isinstance(value, bytes):
        value = value.decode("latin-1")
    if value[:len(_BEARER)].lower() != _BEARER or not value[len(_BEARER):].strip():
        raise Unauthenticated("the authorization metadata must be 'Bearer <token>'")
    return value[len(_BEARER):].strip()

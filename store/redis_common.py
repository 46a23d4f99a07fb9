"""What every part of the Redis layout shares: its version, name rules and errors."""

from __future__ import annotations

import re
from collections.abc import Iterator
from contextlib import contextmanager

import redis
from redis.exceptions import RedisClusterException

FORMAT_VERSION = 1
"""Layout version of every key; part of each key name and recorded per namespace."""

NAME_PATTERN = re.compile(r"[A-Za-z0-9_.-]{1,64}")
"""Namespaces and frozen-table names."""


StreamEntry = tuple[bytes, dict[bytes, bytes]]
"""One stream entry as XRANGE, XREVRANGE and XREAD give it: (entry id, {field: value}).

redis-py types every reply as ``bytes | str`` because it cannot tell whether a client decodes responses; the
clients here never do (``RedisPersistence`` refuses one that does), so replies read as bytes are cast to this form.
"""


class PersistenceError(RuntimeError):
    """Stored data cannot be used as asked (other layout version or vocabulary) or a write is not durable."""


class PersistenceUnavailable(PersistenceError):
    """The Redis server cannot be reached or failed the command."""


def validate_name(name: str, what: str = "name") -> str:
    """Return ``name`` when it matches ``[A-Za-z0-9_.-]{1,64}``; raise ValueError otherwise."""
    if not isinstance(name, str) or not NAME_PATTERN.fullmatch(name):
        raise ValueError(f"{what} must match [A-Za-z0-9_.-]{{1,64}}, got {name!r}")
    return name


@contextmanager
def redis_errors(action: str) -> Iterator[None]:
    """Turn Redis client errors raised inside (a cluster client's own included) into PersistenceUnavailable
    naming ``action``."""
    try:
        yield
    except (redis.RedisError, RedisClusterException) as exc:
        raise PersistenceUnavailable(f"Redis failed to {action}: {exc}") from exc

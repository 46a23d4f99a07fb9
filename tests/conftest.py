"""Shared fixtures: a real Redis-protocol server process per test."""

from __future__ import annotations

import pytest

from store.embedded_redis import EmbeddedRedis


@pytest.fixture
def redis_server(tmp_path):
    """A running ``valkey-server`` (append-only, fsync always) on a free port with its data in ``tmp_path``."""
    with EmbeddedRedis(tmp_path / "redis-data") as server:
        yield server

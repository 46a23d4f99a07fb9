"""Shared fixtures: a real Redis-protocol server process per test."""

from __future__ import annotations

import pytest
from redis_topologies import Cluster, SentinelSet

from store.embedded_redis import EmbeddedRedis


@pytest.fixture
def redis_server(tmp_path):
    """A running ``valkey-server`` (append-only, fsync always) on a free port with its data in ``tmp_path``."""
    with EmbeddedRedis(tmp_path / "redis-data") as server:
        yield server


@pytest.fixture
def cluster(tmp_path):
    """A three-node Redis Cluster of ``valkey-server`` processes over every slot (``redis_topologies.Cluster``)."""
    nodes = Cluster(tmp_path / "cluster")
    try:
        yield nodes
    finally:
        nodes.stop()


@pytest.fixture
def sentinels(tmp_path):
    """A primary, a replica and three sentinels as ``valkey-server`` processes (``redis_topologies.SentinelSet``)."""
    deployment = SentinelSet(tmp_path / "redis")
    try:
        yield deployment
    finally:
        deployment.stop()

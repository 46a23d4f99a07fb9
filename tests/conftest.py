"""Shared fixtures: a real Redis-protocol server process per test; no test writes into the default data folder."""

from __future__ import annotations

from pathlib import Path

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


def _files(folder: Path) -> dict[str, tuple[int, int]]:
    return {str(p): (p.stat().st_size, p.stat().st_mtime_ns) for p in folder.rglob("*") if p.is_file()}


@pytest.fixture(scope="session", autouse=True)
def default_data_folder_untouched():
    """Fails the run when a test wrote into ``./drafter-data``, the folder ``drafter serve`` (``make run``) keeps a
    user's data in by default: a test's services keep theirs under its temporary folder."""
    folder = Path("drafter-data")
    before = _files(folder)
    yield
    after = _files(folder)
    changed = sorted(p for p in after.keys() | before.keys() if after.get(p) != before.get(p))
    assert not changed, f"tests wrote into {folder.resolve()} (pass --data-dir): {changed[:10]}"

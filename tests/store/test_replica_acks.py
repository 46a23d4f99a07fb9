"""Appends that wait for replicas, against a real primary and replica: confirmed, refused, and health."""

from __future__ import annotations

import numpy as np
import pytest
from redis_topologies import REPLICATION_ARGS, SentinelSet, plain, wait_until

from store.embedded_redis import EmbeddedRedis
from store.persistence import PersistenceError, RedisPersistence


@pytest.fixture
def primary(tmp_path):
    with EmbeddedRedis(tmp_path / "primary", extra_args=REPLICATION_ARGS) as server:
        yield server


def test_an_append_waits_for_the_replicas_asked_for_and_fails_without_them(primary, tmp_path):
    replica = SentinelSet.replica_of(primary, tmp_path / "replica")
    try:
        p = RedisPersistence(primary.url, "default", fsync_timeout_ms=300, replica_acks=1)
        assert p.ping() and p.info()["connected_slaves"] == 1
        assert p.append_requests([(np.array([1, 2]), "a")], [1], writer=("ab", 1)) == ["3-0"]
        # acknowledged means the replica holds it: nothing to wait for when asked at once
        assert plain(replica).xlen(p.stream_key) == 1
    finally:
        replica.stop()
    wait_until(lambda: not p.ping(), 10, "the primary to notice its replica is gone")
    with pytest.raises(PersistenceError, match="0 of the 1 replicas required received 1 appended requests"):
        p.append_requests([(np.array([3]), "b")], [1], writer=("ab", 2))
    # The primary holds it all the same, and its writer mark says so: the append retried (from a spool, once a
    # replica is back) stores nothing twice.
    assert p.writer_mark("ab") == 2 and p.request_count() == 2
    replica = SentinelSet.replica_of(primary, tmp_path / "replica")
    try:
        assert p.ping()
        assert p.append_requests([(np.array([3]), "b")], [1], writer=("ab", 2)) == [None]
        assert p.request_count() == 2 and plain(replica).xlen(p.stream_key) == 2
    finally:
        replica.stop()


def test_replica_acks_must_not_be_negative(primary):
    with pytest.raises(ValueError, match="replica_acks"):
        RedisPersistence(primary.url, "default", replica_acks=-1)
    assert RedisPersistence(primary.url, "default").ping()  # none asked for: a primary alone is healthy

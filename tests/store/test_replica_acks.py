"""Appends that wait for replicas, against a real primary and replica: confirmed, refused at once, refused after
the wait, and health."""

from __future__ import annotations

import os
import signal
import time

import numpy as np
import pytest
from redis_topologies import REPLICATION_ARGS, SentinelSet, plain, wait_until

from store.embedded_redis import EmbeddedRedis
from store.persistence import PersistenceError, RedisPersistence
from store.server_acks import ServerState, online_replicas, wait_budget_ms


@pytest.fixture
def primary(tmp_path):
    with EmbeddedRedis(tmp_path / "primary", extra_args=REPLICATION_ARGS) as server:
        yield server


def test_an_append_waits_for_the_replicas_asked_for_and_fails_when_they_do_not_acknowledge(primary, tmp_path):
    replica = SentinelSet.replica_of(primary, tmp_path / "replica")
    try:
        p = RedisPersistence(primary.url, "default", fsync_timeout_ms=300, replica_acks=1)
        assert p.ping() and p.info()["connected_slaves"] == 1 and p.server_state().replicas == 1
        assert p.append_requests([(np.array([1, 2]), "a")], [1], writer=("ab", 1)) == ["3-0"]
        # acknowledged means the replica holds it: nothing to wait for when asked at once
        assert plain(replica).xlen(p.stream_key) == 1
        # A replica that is online but does not answer (stopped): the append waits the 300 ms, then fails.
        os.kill(replica.pid, signal.SIGSTOP)
        try:
            t0 = time.monotonic()
            with pytest.raises(PersistenceError, match="0 of the 1 replicas required received 1 appended requests"):
                p.append_requests([(np.array([3]), "b")], [1], writer=("ab", 2))
            assert 0.25 < time.monotonic() - t0 < 2.0
        finally:
            os.kill(replica.pid, signal.SIGCONT)
        # The primary holds it all the same, and its writer mark says so: the append retried (from a spool, once
        # the replica answers) stores nothing twice and answers where the first attempt put it.
        assert p.writer_mark("ab") == 2 and p.request_count() == 2
        assert p.append_requests([(np.array([3]), "b")], [1], writer=("ab", 2)) == ["5-0"]
        wait_until(lambda: plain(replica).xlen(p.stream_key) == 2, 10, "the replica to catch up")
    finally:
        replica.stop()


def test_with_fewer_replicas_online_than_asked_for_an_append_fails_at_once_and_writes_nothing(primary, tmp_path):
    p = RedisPersistence(primary.url, "default", fsync_timeout_ms=5000, replica_acks=1)
    assert not p.ping()
    state = p.server_state()
    assert state.reachable and state.replicas == 0 and state.replica_acks == 1 and not state.ok
    assert "0 replicas online" in state.problem() and "at least 2 replicas" in state.problem()
    t0 = time.monotonic()
    with pytest.raises(PersistenceError, match="0 replicas online and each append needs 1"):
        p.append_requests([(np.array([1, 2]), "a")], [1], writer=("ab", 1))
    assert time.monotonic() - t0 < 1.0  # not the 5 s WAIT for an acknowledgement that cannot come
    assert p.request_count() == 0 and p.writer_mark("ab") == 0
    replica = SentinelSet.replica_of(primary, tmp_path / "replica")
    try:
        wait_until(p.ping, 10, "the replica to be online")
        assert p.append_requests([(np.array([1, 2]), "a")], [1], writer=("ab", 1)) == ["3-0"]
    finally:
        replica.stop()


def test_a_health_check_loads_the_append_script_where_it_is_missing(primary):
    p = RedisPersistence(primary.url, "default")
    client = plain(primary)
    client.script_flush()  # as on a replica promoted to primary: scripts are not replicated
    assert client.script_exists(p._append.sha) == [False]
    assert p.check_server().ok
    assert client.script_exists(p._append.sha) == [True]


def test_only_replicas_online_count_and_each_wait_has_its_share_of_the_write_timeout():
    info = {"role": "master", "connected_slaves": 3,
            "slave0": {"ip": "10.0.0.1", "port": 6379, "state": "online", "offset": 10, "lag": 0},
            "slave1": {"ip": "10.0.0.2", "port": 6379, "state": "wait_bgsave", "offset": 0, "lag": 0},
            "slave2": {"ip": "10.0.0.3", "port": 6379, "state": "online", "offset": 10, "lag": 1}}
    assert online_replicas(info) == 2 and online_replicas({"role": "master", "connected_slaves": 0}) == 0
    assert wait_budget_ms(1.0, 0) == 800 and wait_budget_ms(1.0, 1) == 400 and wait_budget_ms(2.5, 2) == 1000
    assert ServerState(False, 0, 1, error="refused").problem() == "Redis does not answer (refused)"
    assert ServerState(True, 1, 1).ok and ServerState(True, 1, 1).problem() == ""


def test_replica_acks_must_not_be_negative(primary):
    with pytest.raises(ValueError, match="replica_acks"):
        RedisPersistence(primary.url, "default", replica_acks=-1)
    assert RedisPersistence(primary.url, "default").ping()  # none asked for: a primary alone is healthy

"""Redis persistence and the embedded server, against real valkey-server processes."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import redis

from drafter_service.core.acceptance import AcceptanceModel
from store.corpus_counts import build_frozen_table
from store.embedded_redis import EmbeddedRedis, EmbeddedRedisError
from store.ngram_table import FrozenNGramTable, LRUNGramTable, PyLRUNGramTable
from store.persistence import PersistenceError, PersistenceUnavailable, RedisPersistence
from store.ring_buffer import RingBuffer

VOCAB = 1000


def docs_of(lengths, seed=0, ids=True):
    rng = np.random.default_rng(seed)
    return [(rng.integers(0, VOCAB, n, dtype=np.int32), f"req-{i}" if ids and i % 3 else None)
            for i, n in enumerate(lengths)]


def assert_same_requests(got, docs):
    assert len(got) == len(docs)
    for (_, tokens, rid), (want, want_id) in zip(got, docs, strict=True):
        assert tokens.dtype == np.int32 and tokens.tobytes() == want.astype(np.int32).tobytes()
        assert rid == want_id


def process_gone(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/status") as f:
            return any(line.startswith("State:") and "Z" in line for line in f)  # zombie: exited
    except FileNotFoundError:
        return True


# -- embedded server ---------------------------------------------------------------------------------------


def test_embedded_server_serves_with_aof(redis_server):
    assert redis_server.url == f"redis://127.0.0.1:{redis_server.port}/0"
    client = redis.Redis.from_url(redis_server.url)
    assert client.ping()
    assert client.info("persistence")["aof_enabled"] == 1
    assert client.config_get("appendfsync")["appendfsync"] == "always"
    assert (redis_server.data_dir / "valkey.log").exists()


def test_embedded_server_start_failure_reports_log(tmp_path):
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        server = EmbeddedRedis(tmp_path, port=busy.getsockname()[1], startup_timeout=3)
        with pytest.raises(EmbeddedRedisError, match="did not start") as err:
            server.start()
    assert "valkey.log" in str(err.value) and server.pid is None


def test_embedded_server_that_exits_at_once_reports_its_status_and_what_it_printed(tmp_path):
    server = EmbeddedRedis(tmp_path, extra_args=("--no-such-option", "1"))
    with pytest.raises(EmbeddedRedisError, match="exited with status 1") as err:
        server.start()
    assert "Bad directive" in str(err.value) and server.pid is None  # its stderr, before any log was open


def test_embedded_server_outlives_the_thread_that_started_it(tmp_path):
    server = EmbeddedRedis(tmp_path)
    starter = threading.Thread(target=server.start)
    starter.start()
    starter.join()
    try:
        time.sleep(0.3)
        assert server.pid is not None and redis.Redis.from_url(server.url).ping()
    finally:
        server.stop()
    assert server.pid is None


@pytest.mark.parametrize("from_thread", [False, True])
def test_embedded_server_dies_with_parent(tmp_path, from_thread):
    child = subprocess.Popen([sys.executable, "-c", textwrap.dedent(f"""
        import sys, threading, time
        sys.path.insert(0, {str(Path(__file__).resolve().parents[2])!r})
        from store.embedded_redis import EmbeddedRedis
        server = EmbeddedRedis({str(tmp_path)!r})
        if {from_thread}:
            starter = threading.Thread(target=server.start)
            starter.start()
            starter.join()
        else:
            server.start()
        print(server.pid, flush=True)
        time.sleep(60)
        """)], stdout=subprocess.PIPE, text=True)
    try:
        pid = int(child.stdout.readline())
        assert not process_gone(pid)
    finally:
        child.send_signal(signal.SIGKILL)
        child.wait()
    deadline = time.monotonic() + 5
    while not process_gone(pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert process_gone(pid), "valkey-server outlived its SIGKILLed parent"


# -- request log -------------------------------------------------------------------------------------------


def test_requests_round_trip(redis_server):
    p = RedisPersistence(redis_server.url, "default", vocab_size=VOCAB)
    assert p.request_count() == 0 and p.last_id() == "0-0" and list(p.iter_requests()) == []
    docs = docs_of([5, 0, 17, 1, 300]) + [(np.arange(1_000_000, dtype=np.int64) % VOCAB, "big")]
    ids = p.append_requests(docs[:3])
    redis.Redis.from_url(redis_server.url).script_flush()  # the script is loaded again when missing
    ids += p.append_requests(docs[3:])
    # an id is "<end>-0": slots (tokens + one separator each) given to all requests up to this one
    assert ids == ["6-0", "7-0", "25-0", "27-0", "328-0", "1000329-0"]
    got = list(p.iter_requests(batch=2))
    assert [g[0] for g in got] == ids
    assert_same_requests(got, docs)
    assert p.request_count() == 6 and p.last_id() == ids[-1]
    assert_same_requests(list(p.iter_requests(after=ids[2])), docs[3:])
    assert list(p.iter_requests(after=ids[-1])) == []
    assert p.append_requests([]) == []


def test_bad_requests_write_nothing(redis_server):
    p = RedisPersistence(redis_server.url, "default", vocab_size=VOCAB)
    p.append_requests(docs_of([4]))
    for bad in (np.array([1, -1]), np.array([1, VOCAB]), np.zeros((2, 2), dtype=np.int32), np.array([0.5])):
        with pytest.raises(ValueError):
            p.append_requests([(np.array([1, 2]), "ok"), (bad, "bad")])
    assert p.request_count() == 1 and p.last_id() == "5-0"


def test_requests_survive_server_restart(tmp_path):
    docs = docs_of([10, 20, 30])
    with EmbeddedRedis(tmp_path) as server:
        RedisPersistence(server.url, "default", vocab_size=VOCAB).append_requests(docs)
    with EmbeddedRedis(tmp_path) as server:
        p = RedisPersistence(server.url, "default", vocab_size=VOCAB)
        assert_same_requests(list(p.iter_requests()), docs)
        assert p.append_requests(docs_of([1])) == ["65-0"]  # positions continue


def test_acknowledged_requests_survive_sigkill(tmp_path):
    docs = docs_of([100] * 50, seed=3)
    server = EmbeddedRedis(tmp_path).start()
    p = RedisPersistence(server.url, "default", vocab_size=VOCAB)
    for i in range(0, 50, 10):
        p.append_requests(docs[i:i + 10])
    os.kill(server.pid, signal.SIGKILL)  # right after the last acknowledgement
    server.kill()
    with EmbeddedRedis(tmp_path) as server:
        assert_same_requests(list(RedisPersistence(server.url, "default").iter_requests()), docs)


def test_trim_keeps_what_a_ring_of_that_size_holds(redis_server):
    p = RedisPersistence(redis_server.url, "default")
    lengths = [7, 3, 0, 12, 5, 9, 1, 4]
    docs = docs_of(lengths, ids=False)
    p.append_requests(docs)  # request ends: 8, 12, 13, 26, 32, 42, 44, 49
    assert p.trim_requests(1000) == 0
    assert p.trim_requests(20) == 4  # slots 29..48 remain: the request ending at 32 is partly among them
    kept = list(p.iter_requests())
    assert [k[0] for k in kept] == ["32-0", "42-0", "44-0", "49-0"]
    full, part = RingBuffer(20), RingBuffer(20)
    for tokens, _ in docs:
        full.append(tokens)
    for _, tokens, _ in kept:
        part.append(tokens)
    assert np.array_equal(full.snapshot()[0], part.snapshot()[0])
    assert p.trim_requests(6) == 2 and p.request_count() == 2  # slots 43..48: 43 is the separator ending at 44
    assert p.trim_requests(5) == 1 and p.request_count() == 1
    assert p.trim_requests(0) == 1 and p.request_count() == 0
    assert p.last_id() == "49-0" and p.append_requests(docs_of([2])) == ["52-0"]
    with pytest.raises(ValueError):
        p.trim_requests(-1)


# -- tables and statistics ---------------------------------------------------------------------------------


@pytest.mark.parametrize("table_cls", sorted({PyLRUNGramTable, LRUNGramTable}, key=lambda c: c.__name__))
def test_dynamic_table_round_trip(redis_server, table_cls):
    p = RedisPersistence(redis_server.url, "default", vocab_size=VOCAB)
    assert p.load_table() == [] and p.table_info() is None and p.load_table_snapshot() is None
    table = table_cls(leader_len=1, follower_len=3, leader_capacity=50, follower_capacity=8)
    rng = np.random.default_rng(1)
    for _ in range(20):
        table.update(rng.integers(0, 60, 200).tolist())
    table.query([3])  # recency of leaders changes on queries
    items = list(table.items())
    header = p.save_table(items, last_request_id="42-0")
    assert header["leaders"] == len(items) == 50 and header["follower_len"] == 3
    loaded = p.load_table()
    assert loaded == [(tuple(lead), [(tuple(f), c) for f, c in fols]) for lead, fols in items]
    restored = table_cls(leader_len=1, follower_len=3, leader_capacity=50, follower_capacity=8)
    restored.load(loaded)
    assert list(restored.items()) == items
    assert p.table_info()["last_request_id"] == "42-0"
    again, info = p.load_table_snapshot()
    assert again == loaded and info["last_request_id"] == "42-0" and info["followers"] == table.followers
    p.save_table([])
    assert p.load_table() == []


def test_failed_snapshot_keeps_the_previous_one(redis_server):
    p = RedisPersistence(redis_server.url, "default")
    old = [((1,), [((2, 3, 4), 5)]), ((7,), [((8, 9, 9), 1), ((0, 0, 0), 2)])]
    p.save_table(old)

    def broken():
        yield (5,), [((6, 6, 6), 1)]
        raise RuntimeError("table changed during the snapshot")

    with pytest.raises(RuntimeError):
        p.save_table(broken())
    # the server refuses the writes half way (out of memory): nothing replaces the old snapshot
    client = redis.Redis.from_url(redis_server.url)
    client.config_set("maxmemory-policy", "noeviction")
    client.config_set("maxmemory", client.info("memory")["used_memory"] + (2 << 20))
    big = [((i,), [((j, 1, 2), 1) for j in range(16)]) for i in range(VOCAB)] * 20  # 7.7 MB of arrays
    with pytest.raises(PersistenceUnavailable, match="OOM|memory"):
        p.save_table(big)
    client.config_set("maxmemory", 0)
    assert p.load_table() == old
    assert [k for k in client.scan_iter("*tmp*")] == []


def test_frozen_tables(redis_server):
    p = RedisPersistence(redis_server.url, "default", vocab_size=VOCAB)
    rng = np.random.default_rng(2)
    frozen = build_frozen_table([rng.integers(0, 30, 500) for _ in range(4)], 1, 3, 20, 5)
    p.save_frozen("code-v1.0", frozen.items())
    p.save_frozen("chat_2", {(1,): [((2, 3, 4), 9)]})
    assert p.list_frozen() == ["chat_2", "code-v1.0"]
    loaded = p.load_frozen("code-v1.0")
    assert list(loaded.items()) == list(frozen.items())
    FrozenNGramTable(1, 3, loaded).check_invariants(20, 5)
    assert p.delete_frozen("chat_2") and not p.delete_frozen("chat_2")
    assert p.list_frozen() == ["code-v1.0"]
    with pytest.raises(KeyError):
        p.load_frozen("chat_2")
    for bad in ("", "a/b", "x" * 65, "sp ace", "a:b", "{a}"):
        with pytest.raises(ValueError):
            p.save_frozen(bad, {})
        with pytest.raises(ValueError):
            p.load_frozen(bad)
    with pytest.raises(ValueError):
        p.save_frozen("outside", {(VOCAB,): [((1, 2, 3), 1)]})


def test_model_round_trip(redis_server):
    p = RedisPersistence(redis_server.url, "default")
    assert p.load_model() == {}
    model = AcceptanceModel()
    model.record([(3, 0.5, True), (3, 0.5, False), (120, 0.1, True), (7, 0.9, True)])
    p.save_model(model.snapshot())
    again = AcceptanceModel()
    again.load(p.load_model())
    assert again.snapshot() == model.snapshot()


# -- layout, namespaces, health ----------------------------------------------------------------------------


def test_version_and_vocab_mismatch_raise(redis_server):
    client = redis.Redis.from_url(redis_server.url)
    p = RedisPersistence(client, "default", vocab_size=VOCAB)
    p.save_table([((1,), [((2, 3, 4), 1)])])
    with pytest.raises(PersistenceError, match="vocab_size 1000"):
        RedisPersistence(client, "default", vocab_size=VOCAB + 1)
    assert RedisPersistence(client, "default").vocab_size == VOCAB
    client.hset(p.table_key, "header", client.hget(p.table_key, "header").replace(b'"format": 1', b'"format": 2'))
    with pytest.raises(PersistenceError, match="format"):
        p.load_table()
    client.hset(p.meta_key, "format", 2)
    with pytest.raises(PersistenceError, match="expected 1"):
        RedisPersistence(client, "default", vocab_size=VOCAB)
    client.hset("drafter:formats", "other", 2)  # a later layout owns this namespace
    with pytest.raises(PersistenceError, match="layout version 2"):
        RedisPersistence(client, "other")
    with pytest.raises(ValueError):
        RedisPersistence(client, "bad name")
    with pytest.raises(ValueError):
        RedisPersistence(redis.Redis.from_url(redis_server.url, decode_responses=True), "default")


def test_namespaces_never_share(redis_server):
    a = RedisPersistence(redis_server.url, "a", vocab_size=VOCAB)
    b = RedisPersistence(redis_server.url, "b", vocab_size=50)
    a.append_requests(docs_of([3, 4]))
    b.append_requests([(np.array([49, 0]), "only-b")])
    a.save_table([((1,), [((2, 3, 4), 1)])])
    a.save_frozen("f", {(1,): [((2, 3, 4), 1)]})
    a.save_model({1: (1.0, 2.0)})
    assert [r[2] for r in b.iter_requests()] == ["only-b"] and b.last_id() == "3-0"
    assert b.load_table() == [] and b.list_frozen() == [] and b.load_model() == {}
    assert b.drop() > 0
    assert a.request_count() == 2 and a.list_frozen() == ["f"]
    with pytest.raises(ValueError):
        b.append_requests([(np.array([50]), None)])  # b's own vocabulary


def test_ping_info_and_durability_requirements(tmp_path):
    with EmbeddedRedis(tmp_path / "aof") as server:
        p = RedisPersistence(server.url, "default")
        assert p.ping()
        p.append_requests(docs_of([9]))
        info = p.info()
        assert info["aof_enabled"] == 1 and info["requests"] == 1 and info["used_memory"] > 0
        assert info["valkey_version"].startswith("9.")
    assert not p.ping()
    with EmbeddedRedis(tmp_path / "no-aof", extra_args=("--appendonly", "no")) as server:
        with pytest.raises(PersistenceError, match="appendonly"):
            RedisPersistence(server.url, "default")
        loose = RedisPersistence(server.url, "default", durable=False)
        assert loose.append_requests(docs_of([2])) == ["3-0"]

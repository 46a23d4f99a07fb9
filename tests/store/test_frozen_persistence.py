"""Frozen tables in Redis as arrays: round trip with their header, replacement, refusal, and older snapshots."""

import numpy as np
import pytest
import redis

from store.corpus_counts import build_frozen_table
from store.frozen_table import FrozenNGramTable
from store.persistence import PersistenceError, RedisPersistence

VOCAB = 1000


def corpus_table(seed=0, lc=50, fc=8):
    rng = np.random.default_rng(seed)
    return build_frozen_table([rng.integers(0, 60, 800) for _ in range(5)], 1, 3, lc, fc)


def same(a, b):
    return all(np.array_equal(x, y) for x, y in zip(a.arrays().values(), b.arrays().values(), strict=True))


def test_arrays_round_trip_with_their_header_and_replace(redis_server):
    p = RedisPersistence(redis_server.url, "default", vocab_size=VOCAB)
    table = corpus_table()
    header = p.save_frozen_table("chat", table, "five random documents")
    assert header["leaders"] == len(table) and header["followers"] == table.followers
    loaded, stored = p.load_frozen_table("chat")
    assert same(loaded, table) and list(loaded.items()) == list(table.items())
    loaded.check_invariants(50, 8)
    assert {k: stored[k] for k in ("name", "source", "leader_len", "follower_len", "leaders", "followers")} == {
        "name": "chat", "source": "five random documents", "leader_len": 1, "follower_len": 3,
        "leaders": len(table), "followers": table.followers}
    assert stored["saved_at"] == pytest.approx(header["saved_at"])
    bigger = corpus_table(seed=1, lc=60, fc=16)
    p.save_frozen_table("chat", bigger, "again")
    loaded, stored = p.load_frozen_table("chat")
    assert same(loaded, bigger) and stored["source"] == "again" and p.list_frozen() == ["chat"]
    assert p.delete_frozen("chat") and p.list_frozen() == []
    with pytest.raises(KeyError):
        p.load_frozen_table("chat")


def test_bad_tables_are_refused_and_nothing_is_written(redis_server):
    p = RedisPersistence(redis_server.url, "default", vocab_size=VOCAB)
    outside = FrozenNGramTable(1, 3, {(5,): [((1, 2, VOCAB), 3)]})
    with pytest.raises(ValueError, match="outside"):
        p.save_frozen_table("outside", outside)
    with pytest.raises(ValueError):
        p.save_frozen_table("bad name", corpus_table())
    assert p.list_frozen() == [] and list(redis.Redis.from_url(redis_server.url).scan_iter("*frozen*")) == []


def test_tables_saved_as_items_still_load(redis_server):
    p = RedisPersistence(redis_server.url, "default", vocab_size=VOCAB)
    table = corpus_table(seed=3)
    p.save_frozen("old", table.items())
    p.save_frozen("hand", {(9,): [((1, 2, 3), 1), ((4, 5, 6), 7)]})
    loaded, header = p.load_frozen_table("old")
    assert same(loaded, table) and header["source"] == "" and header["name"] == "old"
    hand, _ = p.load_frozen_table("hand")
    assert hand.query((9,)) == [((4, 5, 6), 7), ((1, 2, 3), 1)]  # most frequent first once loaded
    assert sorted(p.list_frozen()) == ["hand", "old"]


def test_a_stored_blob_that_is_no_table_is_reported(redis_server):
    p = RedisPersistence(redis_server.url, "default", vocab_size=VOCAB)
    p.save_frozen("broken", {(1,): [((2, 3, 4), 5)]})
    client = redis.Redis.from_url(redis_server.url)
    key = p.prefix + "frozen:broken"
    fanout = np.array([2], dtype="<i4").tobytes()  # says two followers; one is stored
    client.hset(key, "fanout.0", fanout)
    with pytest.raises(PersistenceError, match="frozen table"):
        p.load_frozen_table("broken")

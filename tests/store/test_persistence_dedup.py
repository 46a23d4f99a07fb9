"""The request log's prompt lengths and duplicate detection, against a real valkey-server (and the memory twin)."""

from __future__ import annotations

import numpy as np
import pytest
import redis

from store.persistence import RedisPersistence
from store.request_log import Duplicates, SeenKeys, content_digest, duplicate_keys

VOCAB = 1000


def arr(*ids):
    return np.array(ids, dtype=np.int32)


@pytest.fixture
def p(redis_server):
    return RedisPersistence(redis_server.url, "dedup", vocab_size=VOCAB)


def test_prompt_lengths_are_recorded_and_old_entries_have_none(p):
    ids = p.append_requests([(arr(1, 2, 3), "a"), (arr(4, 5), None)], prompt_lens=[2, 0])
    p.append_requests([(arr(6, 7), "old")])  # the call form without prompt lengths
    recs = list(p.iter_request_records())
    assert [r.stream_id for r in recs[:2]] == ids == ["4-0", "7-0"]
    assert [(r.tokens.tolist(), r.request_id, r.prompt_len) for r in recs] == [
        ([1, 2, 3], "a", 2), ([4, 5], None, 0), ([6, 7], "old", None)]
    assert recs[0].tokens.dtype == np.int32
    assert [r.stream_id for r in p.iter_request_records(after=ids[0], batch=1)] == ["7-0", "10-0"]
    assert [(sid, t.tolist(), rid) for sid, t, rid in p.iter_requests()][0] == ("4-0", [1, 2, 3], "a")


def test_duplicates_by_request_id_and_by_content_are_skipped_atomically(p):
    p.append_requests([(arr(1, 2, 3), "a"), (arr(4, 5, 6), None)], prompt_lens=[1, 1])
    got = p.append_requests([(arr(9, 9), "a"),            # same id, other content
                             (arr(4, 5, 6), "new-id"),     # same content (and prompt length), other id
                             (arr(4, 5, 6), None),         # same content, no id
                             (arr(4, 5, 6), "x"),          # same tokens, other prompt length: a new request
                             (arr(7, 8), "b"), (arr(7, 8), "c"), (arr(0, 1), "b")],  # duplicates within the batch
                            prompt_lens=[1, 1, 1, 2, 1, 1, 1], skip_duplicates=True)
    assert got == [None, None, None, "12-0", "15-0", None, None]
    assert p.request_count() == 4
    assert [(r.tokens.tolist(), r.request_id) for r in p.iter_request_records()][2:] == [([4, 5, 6], "x"),
                                                                                         ([7, 8], "b")]
    assert p.last_id() == "15-0"  # skipped requests take no ring slots


def test_skipping_same_ids_compares_ids_only(p):
    p.append_requests([(arr(1, 2, 3), "a"), (arr(4, 5, 6), None)], prompt_lens=[1, 1])
    got = p.append_requests([(arr(1, 2, 3), "a"),         # a retry of a request whose answer was lost
                             (arr(4, 5, 6), "new-id"),     # same content, another id: a request of its own
                             (arr(4, 5, 6), None),         # same content, no id: stored
                             (arr(7, 8), "b"), (arr(0, 1), "b")],  # a retry within the batch
                            prompt_lens=[1, 1, 1, 1, 1], skip_duplicates=Duplicates.SKIP_SAME_ID)
    assert got == [None, "12-0", "16-0", "19-0", None]
    assert [r.request_id for r in p.iter_request_records()] == ["a", None, "new-id", None, "b"]


def test_without_skipping_duplicates_are_stored_and_still_remembered(p):
    docs = [(arr(1, 2), "a"), (arr(1, 2), "a")]
    assert p.append_requests(docs, prompt_lens=[1, 1]) == ["3-0", "6-0"]  # engines' Ingest: stored as sent
    assert p.append_requests(docs, prompt_lens=[1, 1], skip_duplicates=True) == [None, None]
    assert p.request_count() == 2
    members = p.client.smembers(p.seen_key)
    digest = content_digest(arr(1, 2).astype("<i4").tobytes(), 1)
    assert members == {b"i:a", b"h:" + digest}


def test_a_bad_request_or_prompt_length_writes_nothing(p):
    for docs, lens in [([(arr(1), "ok"), (arr(VOCAB), "bad")], [0, 0]),
                       ([(arr(1, 2), "ok")], [3]), ([(arr(1, 2), "ok")], [-1]), ([(arr(1, 2), "ok")], [1, 1])]:
        with pytest.raises(ValueError):
            p.append_requests(docs, prompt_lens=lens, skip_duplicates=True)
    assert p.request_count() == 0 and not p.client.exists(p.seen_key)
    assert p.append_requests([(arr(1, 2), "ok")], prompt_lens=[1], skip_duplicates=True) == ["3-0"]


def test_the_seen_set_survives_trimming_and_drop_deletes_it(p, redis_server):
    p.append_requests([(arr(1, 2), "a"), (arr(3, 4), "b")], prompt_lens=[1, 1])
    assert p.trim_requests(0) == 2 and p.request_count() == 0
    assert p.append_requests([(arr(1, 2), "z"), (arr(5), "b")], prompt_lens=[1, 0], skip_duplicates=True) == [None,
                                                                                                            None]
    other = RedisPersistence(redis_server.url, "other", vocab_size=VOCAB)  # namespaces never share the set
    assert other.append_requests([(arr(1, 2), "a")], prompt_lens=[1], skip_duplicates=True) == ["3-0"]
    assert p.drop() >= 2
    assert not p.client.exists(p.seen_key) and other.client.exists(other.seen_key)


def test_keys_and_the_memory_twin_agree_with_redis(p):
    blob = arr(1, 2, 3).astype("<i4").tobytes()
    assert duplicate_keys(blob, 2, "r") == (b"i:r", b"h:" + content_digest(blob, 2))
    assert duplicate_keys(blob, 2, None)[0] == b"" and duplicate_keys(blob, 2, "")[0] == b""
    assert content_digest(blob, 2) != content_digest(blob, 1) != content_digest(blob, None)
    rng = np.random.default_rng(3)
    docs = [(rng.integers(0, 4, rng.integers(1, 3)).astype(np.int32), rng.choice(["", "a", "b", None]))
            for _ in range(60)]
    lens = [int(rng.integers(0, len(d) + 1)) for d, _ in docs]
    docs = [(d, rid or None) for d, rid in docs]
    twin = SeenKeys()
    for i in range(0, 60, 7):
        chunk, chunk_lens = docs[i:i + 7], lens[i:i + 7]
        rule = Duplicates(i % 3)
        assert twin.append(chunk, chunk_lens, rule) == p.append_requests(chunk, chunk_lens, rule)


def test_a_client_that_decodes_responses_is_refused(redis_server):
    with pytest.raises(ValueError):
        RedisPersistence(redis.Redis.from_url(redis_server.url, decode_responses=True), "x")

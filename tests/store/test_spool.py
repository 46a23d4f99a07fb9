"""The spool journal: round trips, locking, torn tails, checksums, its bound; and the writer mark in Redis."""

import os

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from store.persistence import RedisPersistence
from store.request_log import Duplicates
from store.spool import HEADER_BYTES, Spool, SpoolBusy, SpoolCorrupt, SpoolFull, SpoolRecord, new_id, record_bytes

WRITER, STORE = "0123456789abcdef" * 2, "fedcba9876543210" * 2


def rec(seq, tokens, prompt_len=None, request_id=None, skip=False):
    return SpoolRecord(seq, np.asarray(tokens, dtype=np.int32), prompt_len, request_id, skip)


def same(a, b):
    return (a.seq, a.tokens.tolist(), a.prompt_len, a.request_id, a.skip_duplicates) == \
        (b.seq, b.tokens.tolist(), b.prompt_len, b.request_id, b.skip_duplicates)


RECORDS = [rec(1, [5, 6, 7], 1, "r-1"), rec(2, [], None, None, True),
           rec(3, [2**31 - 1, 0], 2, "", Duplicates.SKIP_SAME_ID), rec(7, list(range(100)), 40, "ünïcode id", True)]


def test_append_read_back_reopen_and_truncate(tmp_path):
    path = tmp_path / "ns" / "a.spool"
    spool = Spool.create(path, WRITER, STORE)
    assert (spool.size, spool.count) == (HEADER_BYTES, 0) and path.stat().st_size == HEADER_BYTES
    written = spool.append(RECORDS[:2]) + spool.append(RECORDS[2:])
    assert written == sum(len(record_bytes(r)) for r in RECORDS) == spool.size - HEADER_BYTES
    spool.check_invariants()
    got, end = spool.read()
    assert end == spool.size and len(got) == 4 and all(same(a, b) for a, b in zip(got, RECORDS, strict=True))
    assert got[1].request_id is None and got[2].request_id == ""  # no id and an empty id stay apart
    first, mid = spool.read(limit=1)
    rest, _ = spool.read(mid)
    assert [r.seq for r in first + rest] == [1, 2, 3, 7]
    with pytest.raises(SpoolBusy):  # a live owner holds the lock
        Spool.open(path)
    spool.close()
    again = Spool.open(path)  # its owner is gone: adoptable, with everything it held
    assert (again.writer_id, again.store_id, again.count, again.size) == (WRITER, STORE, 4, end)
    assert all(same(a, b) for a, b in zip(again.read()[0], RECORDS, strict=True))
    again.truncate()
    assert (again.count, again.read()[0], path.stat().st_size) == (0, [], HEADER_BYTES)
    again.check_invariants()
    again.close(remove=True)
    assert not path.exists()
    Spool.create(tmp_path / "x.spool", WRITER, STORE).close()
    with pytest.raises(FileExistsError):
        Spool.create(tmp_path / "x.spool", WRITER, STORE)


def test_a_torn_last_record_is_dropped_when_the_file_is_opened(tmp_path):
    path = tmp_path / "a.spool"
    spool = Spool.create(path, WRITER, STORE)
    spool.append(RECORDS[:3])
    whole = spool.size
    spool.close()
    tail = record_bytes(RECORDS[3])
    for cut in (1, 7, 8, len(tail) // 2, len(tail) - 1):  # a write cut short anywhere, even inside the frame
        with open(path, "r+b") as f:
            f.truncate(whole)
            f.seek(whole)
            f.write(tail[:cut])
        spool = Spool.open(path)
        assert (spool.count, spool.size, spool.unreadable) == (3, whole, 0)
        assert path.stat().st_size == whole  # the torn bytes are gone
        spool.check_invariants()
        spool.close()
    garbled = bytearray(tail)  # whole length, but its bytes never all reached the disk
    garbled[-3] ^= 0xFF
    with open(path, "r+b") as f:
        f.seek(whole)
        f.write(garbled)
    spool = Spool.open(path)
    assert (spool.count, spool.size, spool.unreadable) == (3, whole, 0)
    spool.append(RECORDS[3:])  # appends go on after the dropped tail
    assert [r.seq for r in spool.read()[0]] == [1, 2, 3, 7]
    spool.close()


def test_a_checksum_mismatch_with_records_after_it_is_corruption_not_a_torn_tail(tmp_path):
    path = tmp_path / "a.spool"
    spool = Spool.create(path, WRITER, STORE)
    spool.append(RECORDS)
    spool.close()
    second = HEADER_BYTES + len(record_bytes(RECORDS[0]))
    data = bytearray(path.read_bytes())
    data[second + 12] ^= 0x01  # one bit of the second record's payload
    path.write_bytes(bytes(data))
    spool = Spool.open(path)
    assert spool.count == 1 and spool.size == second and spool.unreadable == len(data) - second
    assert [r.seq for r in spool.read()[0]] == [1]  # what came before it is readable
    spool.check_invariants()
    with pytest.raises(SpoolCorrupt):  # never appended to, never cut: its bytes stay for inspection
        spool.append(RECORDS[:1])
    assert path.stat().st_size == len(data)
    spool.close()
    data[:4] = b"XXXX"
    path.write_bytes(bytes(data))
    with pytest.raises(SpoolCorrupt, match="bad header"):
        Spool.open(path)


def test_the_bound_refuses_whole_batches_and_writes_nothing(tmp_path):
    one = len(record_bytes(RECORDS[0]))
    spool = Spool.create(tmp_path / "a.spool", WRITER, STORE, max_bytes=HEADER_BYTES + 2 * one)
    spool.append([RECORDS[0]])
    with pytest.raises(SpoolFull, match="bound"):
        spool.append([rec(2, [5, 6, 7], 1, "r-1"), rec(3, [5, 6, 7], 1, "r-1")])  # one would fit, not both
    assert spool.count == 1 and (tmp_path / "a.spool").stat().st_size == HEADER_BYTES + one
    spool.append([rec(2, [5, 6, 7], 1, "r-1")])
    assert spool.size == spool.max_bytes
    with pytest.raises(SpoolFull):
        spool.append([rec(3, [])])
    spool.check_invariants()
    spool.close()
    with pytest.raises(ValueError):
        Spool.create(tmp_path / "b.spool", WRITER, STORE, max_bytes=HEADER_BYTES - 1)
    with pytest.raises(ValueError, match="hex"):
        Spool.create(tmp_path / "c.spool", "not hex", STORE)
    assert not (tmp_path / "c.spool").exists()


def test_a_failed_fsync_cuts_the_file_back(tmp_path, monkeypatch):
    spool = Spool.create(tmp_path / "a.spool", WRITER, STORE)
    spool.append(RECORDS[:1])
    before = spool.size

    def broken(fd):
        raise OSError(5, "Input/output error")
    monkeypatch.setattr(os, "fdatasync", broken)
    with pytest.raises(OSError):
        spool.append(RECORDS[1:])
    monkeypatch.undo()
    assert spool.size == before and (tmp_path / "a.spool").stat().st_size == before
    spool.check_invariants()
    spool.close()


records_st = st.lists(st.builds(
    lambda toks, plen, rid, skip: (toks, None if plen is None else min(plen, len(toks)), rid, skip),
    st.lists(st.integers(0, 2**31 - 1), max_size=40), st.none() | st.integers(0, 40),
    st.none() | st.text(max_size=12), st.booleans()), min_size=1, max_size=12)


@settings(max_examples=60, deadline=None)
@given(records=records_st, cut=st.floats(0, 1))
def test_cutting_the_file_anywhere_keeps_exactly_the_whole_records_before_the_cut(tmp_path_factory, records, cut):
    path = tmp_path_factory.mktemp("cut") / "a.spool"
    recs = [rec(i + 1, *r) for i, r in enumerate(records)]
    spool = Spool.create(path, WRITER, STORE)
    ends = []
    for r in recs:
        spool.append([r])
        ends.append(spool.size)
    spool.close()
    at = HEADER_BYTES + int(cut * (ends[-1] - HEADER_BYTES))
    os.truncate(path, at)
    spool = Spool.open(path)
    kept = sum(1 for e in ends if e <= at)
    got, _ = spool.read()
    assert len(got) == kept and all(same(a, b) for a, b in zip(got, recs, strict=False))
    spool.check_invariants()
    spool.close()


def test_the_writer_mark_makes_a_retried_append_store_nothing_twice(redis_server):
    p = RedisPersistence(redis_server.url, "w", vocab_size=100)
    writer = new_id()
    docs = [(np.array([1, 2, 3]), "a"), (np.array([1, 2, 3]), None), (np.array([4]), "c")]
    ids = p.append_requests(docs, [1, 1, 0], writer=(writer, 10))
    assert all(ids) and p.writer_mark(writer) == 12
    again = p.append_requests(docs, [1, 1, 0], writer=(writer, 10))  # the same attempt, retried: the same ids
    assert again == ids and p.request_count() == 3
    tail = p.append_requests(docs[2:] + [(np.array([9]), "d"), (np.array([8]), "e")], [0, 0, 0],
                             writer=(writer, 12))  # overlaps the last append by one
    assert tail[0] == ids[2] and all(tail[1:]) and p.request_count() == 5 and p.writer_mark(writer) == 14
    # a retry reaching back past the last append that stored anything: those requests' ids are not known
    assert p.append_requests(docs, [1, 1, 0], writer=(writer, 10)) == [None, None, tail[0]]
    assert p.append_requests(docs[2:], [0], writer=(writer, 12)) == [tail[0]]  # (a retry stores nothing)
    other = new_id()  # another writer's numbers are its own
    assert all(p.append_requests(docs[:1], [1], writer=(other, 1))) and p.writer_mark(other) == 1
    assert 0 < p.client.pttl(p.prefix + "writer:" + writer) <= 30 * 24 * 3600 * 1000
    p.forget_writer(writer)
    assert p.writer_mark(writer) == 0
    with pytest.raises(ValueError):
        p.append_requests(docs[:1], [1], writer=("bad key!", 1))
    assert p.request_count() == 6
    assert p.store_id() == p.store_id() == RedisPersistence(redis_server.url, "w").store_id()
    assert RedisPersistence(redis_server.url, "other").store_id() != p.store_id()

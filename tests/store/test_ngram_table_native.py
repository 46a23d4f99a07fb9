"""Tests of the native LRU n-gram table: parity with the pure-Python reference, argument errors, memory."""

from __future__ import annotations

import array
import os
import pickle
import subprocess
import sys
import textwrap

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from store.ngram_table import LRUNGramTable, PyLRUNGramTable

lru = pytest.importorskip("store._lru")
LRUTable = lru.LRUTable


def contents(table) -> list:
    return list(table.items())


def pair(ll: int, fl: int, lc: int, fc: int) -> tuple:
    return LRUTable(ll, fl, lc, fc), PyLRUNGramTable(ll, fl, lc, fc)


def same(native, ref) -> None:
    assert contents(native) == contents(ref)
    assert len(native) == len(ref) and native.followers == ref.followers
    native.check_invariants()


def test_native_type_is_in_use() -> None:
    expected = PyLRUNGramTable if os.environ.get("DRAFTER_PURE_PYTHON", "") not in ("", "0") else LRUTable
    assert LRUNGramTable is expected


# -- parity with the reference over random operations -------------------------------------------------


def ops_strategy(ll: int, fl: int) -> st.SearchStrategy:
    tok = st.integers(0, 4)
    insert = st.tuples(st.just("insert"), st.lists(tok, min_size=ll, max_size=ll),
                       st.lists(st.integers(0, 3), min_size=fl, max_size=fl))
    query = st.tuples(st.just("query"), st.lists(tok, min_size=ll, max_size=ll),
                      st.sampled_from([None, -1, 0, 1, 2, 5]))
    update = st.tuples(st.just("update"), st.lists(st.integers(0, 3), max_size=14), st.integers(-2, 16),
                       st.sampled_from(["list", "tuple", "int32", "int64", "uint16", "strided"]))
    contains = st.tuples(st.just("contains"), st.lists(tok, min_size=ll, max_size=ll))
    reload = st.tuples(st.just("reload"))
    return st.lists(st.one_of(insert, query, update, contains, reload), max_size=60)


def as_kind(tokens: list[int], kind: str):
    if kind == "list":
        return tokens
    if kind == "tuple":
        return tuple(tokens)
    if kind == "strided":
        return np.repeat(np.array(tokens, dtype=np.int64), 2)[::2]
    return np.array(tokens, dtype=kind)


@settings(max_examples=300, deadline=None)
@given(data=st.data(), ll=st.integers(1, 3), fl=st.integers(1, 3), lc=st.integers(1, 5), fc=st.integers(1, 4))
def test_native_agrees_with_the_reference(data, ll: int, fl: int, lc: int, fc: int) -> None:
    native, ref = pair(ll, fl, lc, fc)
    for op in data.draw(ops_strategy(ll, fl)):
        if op[0] == "insert":
            assert native.insert(op[1], op[2]) is ref.insert(op[1], op[2]) is None
        elif op[0] == "query":
            assert native.query(op[1], op[2]) == ref.query(op[1], op[2])
            assert native.query(op[1], limit=op[2]) == ref.query(op[1], limit=op[2])
        elif op[0] == "update":
            tokens = as_kind(op[1], op[3])
            assert native.update(tokens, op[2]) == ref.update(tokens, new_from=op[2])
        elif op[0] == "contains":
            assert (tuple(op[1]) in native) == (tuple(op[1]) in ref)
            assert (np.array(op[1]) in native) == (tuple(op[1]) in ref)
        else:
            snapshot = contents(ref)
            native.load(snapshot)
            ref.load(snapshot)
        same(native, ref)


@settings(max_examples=100, deadline=None)
@given(tokens=st.lists(st.integers(0, 9), max_size=300), ll=st.integers(1, 8), fl=st.integers(1, 8),
       lc=st.integers(1, 40), fc=st.integers(1, 6), step=st.integers(1, 7))
def test_incremental_updates_agree_with_the_reference(tokens: list[int], ll: int, fl: int, lc: int, fc: int,
                                                      step: int) -> None:
    native, ref = pair(ll, fl, lc, fc)
    seen = 0
    for stop in list(range(step, len(tokens), step)) + [len(tokens)]:
        assert native.update(np.array(tokens[:stop], dtype=np.int32), seen) == ref.update(tokens[:stop], seen)
        seen = stop
    same(native, ref)


@settings(max_examples=50, deadline=None)
@given(tokens=st.lists(st.integers(0, 3000), min_size=1, max_size=3000))
def test_many_leaders_agree_with_the_reference(tokens: list[int]) -> None:
    """Enough leaders to grow and shrink the hash table's probe runs through evictions."""
    native, ref = pair(1, 2, 97, 3)
    assert native.update(tokens) == ref.update(tokens)
    for t in tokens[::7]:
        assert native.query([t], 2) == ref.query([t], 2)
    same(native, ref)


@settings(max_examples=30, deadline=None)
@given(followers=st.lists(st.integers(0, 40), min_size=1, max_size=400), fc=st.integers(4, 24))
def test_a_full_leaders_followers_slide_and_compact_as_the_reference_drops_them(followers: list[int],
                                                                                fc: int) -> None:
    """One leader far past its follower capacity: the least recent followers leave, known ones move up, as in the
    reference (the native records slide along a larger allocation and are moved back now and then)."""
    native, ref = pair(1, 1, 4, fc)
    for k, f in enumerate(followers):
        native.insert([7], [f])
        ref.insert([7], [f])
        if k % 37 == 0:
            assert native.query([7], fc) == ref.query([7], fc)
    native.check_invariants()
    same(native, ref)


def test_default_sizes_and_long_tokens() -> None:
    t = LRUTable()
    assert (t.leader_len, t.follower_len, t.leader_capacity, t.follower_capacity) == (1, 3, 1 << 20, 128)
    big = 2**31 - 1
    t.insert([big], [0, big, 7])
    assert t.query((big,)) == [((0, big, 7), 1)]
    t8 = LRUTable(8, 8, 4, 4)
    t8.insert(range(8), range(8, 16))
    assert t8.query(list(range(8))) == [(tuple(range(8, 16)), 1)]


def test_sequence_kinds_are_read_alike() -> None:
    t = LRUTable(leader_len=2, follower_len=1, leader_capacity=8, follower_capacity=8)
    for kind in (np.int8, np.uint8, np.int16, np.uint32, np.int64, np.uint64):
        t.insert(np.array([1, 2], dtype=kind), np.array([3], dtype=kind))
    t.insert(array.array("i", [1, 2]), bytes([3]))
    t.insert([np.int64(1), np.int32(2)], (True + 2,))
    assert t.query(np.array([1, 2], dtype=np.uint16)) == [((3,), 8)]
    assert t.query(np.array([2, 9, 1])[::-2]) == [((3,), 8)]  # a strided, reversed view
    assert t.update(range(5), new_from=3) == 2 and t.query(memoryview(array.array("q", [3, 4]))) == []
    assert t.query((2, 3)) == [((4,), 1)]


# -- errors change nothing ----------------------------------------------------------------------------


@pytest.mark.parametrize("bad", [-1, 2**31, 2**63, 2**80, -(2**80)])
def test_out_of_range_ids_raise_and_change_nothing(bad: int) -> None:
    t = LRUTable(leader_len=1, follower_len=2, leader_capacity=2, follower_capacity=2)
    t.update([1, 2, 3, 4, 5])
    before = contents(t)
    for call in (lambda: t.insert([bad], [1, 2]), lambda: t.insert([1], [2, bad]),
                 lambda: t.update([1, 2, 3, bad]), lambda: t.update([bad, 2, 3, 4], new_from=2),
                 lambda: t.load([((1,), [((2, bad), 1)])])):
        with pytest.raises((ValueError, OverflowError)):
            call()
        assert contents(t) == before
    if -(2**63) <= bad < 2**63:
        with pytest.raises(ValueError):
            t.update(np.array([1, 2, 3, bad], dtype=np.uint64 if bad >= 0 else np.int64))
        assert contents(t) == before
    assert t.query([bad]) == [] and [bad] not in t  # an impossible leader is simply unknown
    assert contents(t) == before
    t.update([bad, 6, 7, 8], new_from=3)  # ids before the window are not read, as in the reference
    assert contents(t) == [((3,), [((4, 5), 1)]), ((6,), [((7, 8), 1)])]


def test_wrong_lengths_and_types_raise_and_change_nothing() -> None:
    t = LRUTable(leader_len=2, follower_len=2, leader_capacity=4, follower_capacity=4)
    t.insert([1, 2], [3, 4])
    before = contents(t)
    for lead, fol in (([1], [3, 4]), ([1, 2, 3], [3, 4]), ([1, 2], [3]), ([1, 2], np.arange(3)), ([], [])):
        with pytest.raises(ValueError):
            t.insert(lead, fol)
    for lead, fol in (([1, 2.0], [3, 4]), ([1, 2], ["a", 4]), (5, [3, 4]), ([1, 2], None)):
        with pytest.raises(TypeError):
            t.insert(lead, fol)
    for call in (lambda: t.update([1, 2, 3, 4.5]), lambda: t.update(iter([1, 2, 3, 4])), lambda: t.insert([1, 2]),
                 lambda: t.query(), lambda: t.query([1, 2], 3, 4), lambda: t.query([1, 2], lim=3),
                 lambda: t.query([1, 2], limit=1.5)):
        with pytest.raises(TypeError):
            call()
    assert contents(t) == before
    assert t.query([1]) == [] and t.query([1, 2, 3]) == [] and [1] not in t
    assert contents(t) == before


@pytest.mark.parametrize("kwargs", [{"leader_len": 9}, {"follower_len": 9}, {"leader_len": 0},
                                    {"follower_capacity": -1}, {"leader_capacity": 0}])
def test_bad_sizes_raise(kwargs: dict) -> None:
    with pytest.raises(ValueError):
        LRUTable(**kwargs)


def test_broken_snapshot_leaves_the_table_as_it_was() -> None:
    t = LRUTable(leader_len=1, follower_len=1, leader_capacity=2, follower_capacity=2)
    t.update([1, 2, 3, 4])
    before = contents(t)
    for broken in ([((1,), [((2,), 1)]), ((3,), [((4,), 1)]), ((5,), [((6,), 1)])],
                   [((1,), [((2,), 1), ((3,), 1), ((4,), 1)])],
                   [((1, 2), [((3,), 1)])], [((1,), [((3, 4), 1)])], [((1,), [((3,), 0)])], [((1,), [])]):
        with pytest.raises(AssertionError):
            t.load(broken)
        assert contents(t) == before
    with pytest.raises(TypeError):
        t.load([((1,), [((2,), 1)]), 7])
    assert contents(t) == before


def test_load_keeps_first_places_and_last_values_like_the_reference() -> None:
    snapshot = [([1], [([2], 1), ([3], 4), ([2], 5)]), ([7], [([8], 1)]), ([1], [([4], 2), ([4], 3)])]
    native, ref = pair(1, 1, 4, 4)
    native.load(snapshot)
    ref.load(snapshot)
    same(native, ref)
    assert contents(native) == [((1,), [((4,), 3)]), ((7,), [((8,), 1)])]


def test_changing_the_table_while_iterating_raises() -> None:
    t = LRUTable(leader_len=1, follower_len=1, leader_capacity=4, follower_capacity=4)
    t.update([1, 2, 3, 4])
    it = t.items()
    assert next(it) == ((1,), [((2,), 1)])
    t.query([1])
    with pytest.raises(RuntimeError):
        next(it)
    it = t.items()
    next(it)
    t.query([9])  # unknown leader: nothing changes
    t.query([1])  # already the most recent: nothing changes
    assert list(it) == [((3,), [((4,), 1)]), ((1,), [((2,), 1)])]


def test_pickle_round_trip() -> None:
    t = LRUTable(leader_len=2, follower_len=1, leader_capacity=5, follower_capacity=2)
    t.update([5, 1, 2, 1, 2, 3, 1, 2, 4, 7, 7])
    u = pickle.loads(pickle.dumps(t))
    assert type(u) is LRUTable and contents(u) == contents(t)
    assert (u.leader_len, u.follower_len, u.leader_capacity, u.follower_capacity) == (2, 1, 5, 2)


# -- memory ------------------------------------------------------------------------------------------


def rss_growth_in_a_fresh_interpreter(body: str) -> int:
    """Bytes of resident memory that ``body`` leaves behind when run again after a first warm-up run.

    ``body`` defines ``setup()`` (run once) and ``churn()`` (run once to warm up, then 3 times while
    measured). It runs in a child interpreter so that no thread left over from other tests allocates
    while it is measured; what ``churn`` leaks shows up there alone.
    """
    script = textwrap.dedent(body) + textwrap.dedent("""
        import gc, os
        def rss():
            with open("/proc/self/statm") as f:
                return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
        setup()
        churn()
        gc.collect()
        base = rss()
        for _ in range(3):
            churn()
        gc.collect()
        print(rss() - base)
    """)
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    return int(done.stdout.split()[-1])


@pytest.mark.skipif(not os.path.exists("/proc/self/statm"), reason="needs /proc")
def test_memory_stays_flat_under_eviction() -> None:
    grown = rss_growth_in_a_fresh_interpreter("""
        import numpy as np
        from store._lru import LRUTable

        def setup():
            global t, chunks
            rng = np.random.default_rng(0)
            t = LRUTable(leader_len=1, follower_len=3, leader_capacity=1000, follower_capacity=16)
            chunks = [rng.integers(0, 5000, 250_000, dtype=np.int32) for _ in range(8)]

        def churn():
            for chunk in chunks:  # 1e6 inserts, almost all of them evicting
                t.update(chunk)
            for i in range(20_000):  # and through the Python-facing insert
                t.insert((i,), (i, i + 1, i + 2))
            t.check_invariants()
            assert len(t) == 1000 and t.followers <= 1000 * 16
            assert t.__sizeof__() < 1000 * (64 + 16 + 16 * 20) + 4096  # nodes, slots, follower records
    """)
    assert grown < 4 << 20


@pytest.mark.skipif(not os.path.exists("/proc/self/statm"), reason="needs /proc")
def test_dropped_tables_free_everything() -> None:
    # One such table holds about 7 MB: twelve leaked ones would pass the bound many times over.
    grown = rss_growth_in_a_fresh_interpreter("""
        import numpy as np
        from store._lru import LRUTable

        def setup():
            global tokens
            tokens = np.random.default_rng(1).integers(0, 20_000, 200_000, dtype=np.int32)

        def churn():
            for _ in range(4):
                t = LRUTable(leader_len=2, follower_len=2, leader_capacity=50_000, follower_capacity=8)
                t.update(tokens)
                list(t.items())
                del t
    """)
    assert grown < 4 << 20


@pytest.mark.parametrize("ll, fl", [(1, 3), (2, 2), (3, 1)])
def test_arrays_encode_as_items_do(ll: int, fl: int) -> None:
    """A snapshot read in one native call (arrays) encodes exactly as the items it stands for."""
    from store.table_codec import encode_items, encode_table

    rng = np.random.default_rng(ll)
    native, ref = pair(ll, fl, 50, 6)
    assert encode_table(native, 100)[0] == encode_items(native.items(), 100)[0]  # empty: the items path
    tokens = rng.integers(0, 30, 4000)
    native.update(tokens)
    ref.update(tokens.tolist())
    native.query(tuple(int(t) for t in tokens[:ll]))
    ref.query(tuple(int(t) for t in tokens[:ll]))
    for table in (native, ref):
        header, arrays = encode_table(table, 100)
        want_header, want = encode_items(ref.items(), 100)
        assert header == want_header
        assert sorted(arrays) == sorted(want)
        for name, arr in want.items():
            assert arrays[name].dtype == arr.dtype and arrays[name].tolist() == arr.tolist(), name
    with pytest.raises(ValueError):
        encode_table(native, 20)

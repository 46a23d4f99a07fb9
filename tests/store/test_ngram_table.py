"""Tests of the Cacheback n-gram tables: LRU rules by hand and against a naive model, frozen tables against a
Counter."""

from __future__ import annotations

from collections import Counter

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from store.corpus_counts import build_frozen_table
from store.ngram_table import LRUNGramTable


def contents(table: LRUNGramTable) -> list[tuple[tuple[int, ...], list[tuple[tuple[int, ...], int]]]]:
    return [(lead, followers) for lead, followers in table.items()]


def leaders(table: LRUNGramTable) -> list[tuple[int, ...]]:
    return [lead for lead, _ in table.items()]


# -- LRU table: leaders ---------------------------------------------------------------------------------


def small() -> LRUNGramTable:
    return LRUNGramTable(leader_len=1, follower_len=2, leader_capacity=2, follower_capacity=2)


def test_least_recent_leader_is_evicted() -> None:
    t = small()
    t.insert([1], [2, 3])
    t.insert([4], [5, 6])
    t.insert([7], [8, 9])  # evicts 1
    assert leaders(t) == [(4,), (7,)]
    assert (1,) not in t and (4,) in t and len(t) == 2
    assert t.query([1]) == []


def test_querying_a_leader_refreshes_it() -> None:
    t = small()
    t.insert([1], [2, 3])
    t.insert([4], [5, 6])
    assert t.query([1]) == [((2, 3), 1)]  # 1 becomes the most recent leader
    t.insert([7], [8, 9])  # evicts 4
    assert leaders(t) == [(1,), (7,)]


def test_inserting_under_a_leader_refreshes_it() -> None:
    t = small()
    t.insert([1], [2, 3])
    t.insert([4], [5, 6])
    t.insert([1], [2, 4])  # 1 becomes the most recent leader
    t.insert([7], [8, 9])  # evicts 4
    assert leaders(t) == [(1,), (7,)]
    assert t.query([1]) == [((2, 4), 1), ((2, 3), 1)]


def test_querying_an_unknown_leader_changes_nothing() -> None:
    t = small()
    t.insert([1], [2, 3])
    t.insert([4], [5, 6])
    assert t.query([9]) == [] and t.query([9], limit=3) == []
    assert contents(t) == [((1,), [((2, 3), 1)]), ((4,), [((5, 6), 1)])]


def test_evicted_leader_loses_all_its_followers() -> None:
    t = small()
    t.insert([1], [2, 3])
    t.insert([1], [2, 4])
    t.insert([1], [2, 4])
    t.insert([4], [5, 6])
    t.insert([7], [8, 9])  # evicts 1 with both followers
    assert (1,) not in t and t.followers == 2
    t.insert([1], [2, 3])  # evicts 4; 1 comes back with only the new follower
    assert t.query([1]) == [((2, 3), 1)]
    assert leaders(t) == [(7,), (1,)]


def test_leader_capacity_one() -> None:
    t = LRUNGramTable(leader_len=1, follower_len=1, leader_capacity=1, follower_capacity=1)
    t.insert([1], [2])
    t.insert([3], [4])
    assert contents(t) == [((3,), [((4,), 1)])]
    t.check_invariants()


# -- LRU table: followers -------------------------------------------------------------------------------


def test_follower_order_changes_only_on_insertion() -> None:
    t = LRUNGramTable(leader_len=1, follower_len=1, leader_capacity=4, follower_capacity=3)
    t.insert([0], [10])
    t.insert([0], [11])
    t.insert([0], [12])
    expected = [((12,), 1), ((11,), 1), ((10,), 1)]  # most recent first
    assert t.query([0]) == expected
    assert t.query([0]) == expected  # querying does not reorder followers
    assert t.query([0], limit=2) == expected[:2]
    assert t.query([0], limit=1) == expected[:1]
    t.insert([0], [10])  # re-inserting moves it to most recent and counts it
    assert t.query([0]) == [((10,), 2), ((12,), 1), ((11,), 1)]
    t.insert([0], [13])  # FC exceeded: the least recent follower (11) is dropped
    assert t.query([0]) == [((13,), 1), ((10,), 2), ((12,), 1)]
    t.insert([0], [11])  # 11 comes back with a fresh count; 12 is dropped
    assert t.query([0]) == [((11,), 1), ((13,), 1), ((10,), 2)]
    assert t.followers == 3
    t.check_invariants()


def test_frequent_follower_is_still_evicted_by_recency() -> None:
    t = LRUNGramTable(leader_len=1, follower_len=1, leader_capacity=1, follower_capacity=2)
    for _ in range(5):
        t.insert([0], [1])
    t.insert([0], [2])
    t.insert([0], [3])  # 1 is the least recent, however often it was inserted
    assert t.query([0]) == [((3,), 1), ((2,), 1)]


def test_leader_and_follower_as_arrays() -> None:
    t = LRUNGramTable(leader_len=2, follower_len=2, leader_capacity=4, follower_capacity=4)
    t.insert(np.array([1, 2], dtype=np.int32), np.array([3, 4], dtype=np.int64))
    t.insert((1, 2), [3, 4])
    assert t.query(np.array([1, 2])) == [((3, 4), 2)]
    assert len(t) == 1


# -- LRU table: update ----------------------------------------------------------------------------------


@pytest.mark.parametrize("new_from, expected", [
    # tokens 10 11 12 13 14 (indices 0..4); a pair covers 3 tokens and "ends" at its last one
    (0, [((10,), (11, 12)), ((11,), (12, 13)), ((12,), (13, 14))]),
    (2, [((10,), (11, 12)), ((11,), (12, 13)), ((12,), (13, 14))]),
    (3, [((11,), (12, 13)), ((12,), (13, 14))]),
    (4, [((12,), (13, 14))]),
    (5, []),
    (9, []),
])
def test_update_inserts_the_pairs_that_end_at_or_after_new_from(
        new_from: int, expected: list[tuple[tuple[int, ...], tuple[int, ...]]]) -> None:
    t = LRUNGramTable(leader_len=1, follower_len=2, leader_capacity=16, follower_capacity=16)
    assert t.update([10, 11, 12, 13, 14], new_from) == len(expected)
    assert contents(t) == [(lead, [(fol, 1)]) for lead, fol in expected]  # inserted in order: last is most recent


def test_update_with_longer_leaders_and_an_array() -> None:
    t = LRUNGramTable(leader_len=2, follower_len=1, leader_capacity=16, follower_capacity=16)
    tokens = np.array([1, 2, 3, 4, 1, 2, 5], dtype=np.int32)
    assert t.update(tokens[:4]) == 2  # (1, 2) -> 3, (2, 3) -> 4
    assert t.update(tokens, new_from=4) == 3  # pairs ending at 4, 5, 6: (3, 4) -> 1, (4, 1) -> 2, (1, 2) -> 5
    assert contents(t) == [
        ((2, 3), [((4,), 1)]),
        ((3, 4), [((1,), 1)]),
        ((4, 1), [((2,), 1)]),
        ((1, 2), [((3,), 1), ((5,), 1)]),
    ]
    assert t.query([1, 2]) == [((5,), 1), ((3,), 1)]


def test_update_with_a_short_sequence() -> None:
    t = LRUNGramTable(leader_len=1, follower_len=3)
    assert t.update([1, 2, 3]) == 0 and t.update([]) == 0
    assert len(t) == 0
    assert t.update([1, 2, 3, 4]) == 1
    assert t.query([1]) == [((2, 3, 4), 1)]


def test_incremental_updates_equal_one_update() -> None:
    seq = [3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5, 8, 9, 7, 9]
    whole = LRUNGramTable(leader_len=1, follower_len=3, leader_capacity=5, follower_capacity=2)
    whole.update(seq)
    steps = LRUNGramTable(leader_len=1, follower_len=3, leader_capacity=5, follower_capacity=2)
    seen = 0
    for stop in (2, 3, 7, 8, 12, 15):
        steps.update(seq[:stop], new_from=seen)
        seen = stop
    assert contents(steps) == contents(whole)


# -- LRU table: validation and defaults -----------------------------------------------------------------


def test_wrong_lengths_raise_and_change_nothing() -> None:
    t = LRUNGramTable(leader_len=1, follower_len=2, leader_capacity=4, follower_capacity=4)
    t.insert([1], [2, 3])
    for lead, fol in (([1, 2], [2, 3]), ([], [2, 3]), ([1], [2]), ([1], [2, 3, 4])):
        with pytest.raises(ValueError):
            t.insert(lead, fol)
    assert contents(t) == [((1,), [((2, 3), 1)])]


@pytest.mark.parametrize("name", ["leader_len", "follower_len", "leader_capacity", "follower_capacity"])
@pytest.mark.parametrize("value", [0, -1])
def test_sizes_below_one_raise(name: str, value: int) -> None:
    with pytest.raises(ValueError):
        LRUNGramTable(**{name: value})


def test_defaults_are_the_cacheback_settings() -> None:
    t = LRUNGramTable()
    assert (t.leader_len, t.follower_len, t.leader_capacity, t.follower_capacity) == (1, 3, 1 << 20, 128)
    t.update(list(range(300)) * 2)
    assert t.query([0]) == [((1, 2, 3), 2)]
    t.check_invariants()


# -- LRU table: against a naive model ---------------------------------------------------------------------


class NaiveLRU:
    """Lists ordered least recent first: [[leader, [[follower, count], ...]], ...]."""

    def __init__(self, lc: int, fc: int) -> None:
        self.lc, self.fc = lc, fc
        self.rows: list[list] = []

    def _find(self, lead: tuple[int, ...]) -> int:
        return next((i for i, row in enumerate(self.rows) if row[0] == lead), -1)

    def insert(self, lead: tuple[int, ...], fol: tuple[int, ...]) -> None:
        i = self._find(lead)
        if i < 0:
            self.rows.append([lead, []])
            if len(self.rows) > self.lc:
                self.rows.pop(0)
        else:
            self.rows.append(self.rows.pop(i))
        followers = self.rows[-1][1]
        j = next((j for j, f in enumerate(followers) if f[0] == fol), -1)
        count = followers.pop(j)[1] if j >= 0 else 0
        followers.append([fol, count + 1])
        if len(followers) > self.fc:
            followers.pop(0)

    def query(self, lead: tuple[int, ...]) -> list[tuple[tuple[int, ...], int]]:
        i = self._find(lead)
        if i < 0:
            return []
        self.rows.append(self.rows.pop(i))
        return [(f, c) for f, c in reversed(self.rows[-1][1])]

    def items(self) -> list:
        return [(lead, [(f, c) for f, c in followers]) for lead, followers in self.rows]


@settings(max_examples=150, deadline=None)
@given(
    lc=st.integers(1, 4),
    fc=st.integers(1, 3),
    ops=st.lists(st.tuples(st.booleans(), st.integers(0, 5), st.integers(0, 3), st.integers(0, 2)), max_size=120),
)
def test_lru_table_agrees_with_a_naive_model(lc: int, fc: int, ops: list[tuple[bool, int, int, int]]) -> None:
    t = LRUNGramTable(leader_len=1, follower_len=2, leader_capacity=lc, follower_capacity=fc)
    naive = NaiveLRU(lc, fc)
    for is_query, lead, a, b in ops:
        if is_query:
            assert t.query([lead]) == naive.query((lead,))
        else:
            t.insert([lead], [a, b])
            naive.insert((lead,), (a, b))
        assert contents(t) == naive.items()
        t.check_invariants()
        assert len(t) <= lc and all(len(f) <= fc for _, f in t.items())


@settings(max_examples=100, deadline=None)
@given(
    lc=st.integers(1, 6),
    fc=st.integers(1, 4),
    tokens=st.lists(st.integers(0, 7), max_size=200),
)
def test_memory_stays_bounded(lc: int, fc: int, tokens: list[int]) -> None:
    t = LRUNGramTable(leader_len=2, follower_len=2, leader_capacity=lc, follower_capacity=fc)
    t.update(tokens)
    t.check_invariants()
    assert len(t) <= lc and t.followers <= lc * fc


# -- LRU table: snapshots ---------------------------------------------------------------------------------


def test_items_load_round_trip_preserves_recency() -> None:
    t = LRUNGramTable(leader_len=1, follower_len=1, leader_capacity=3, follower_capacity=2)
    t.update([1, 2, 1, 3, 4, 1, 2, 5, 2])
    snapshot = [(lead, list(followers)) for lead, followers in t.items()]
    u = LRUNGramTable(leader_len=1, follower_len=1, leader_capacity=3, follower_capacity=2)
    u.insert([9], [9])  # replaced by load
    u.load(snapshot)
    assert contents(u) == contents(t) == snapshot
    for table in (t, u):  # the same next evictions
        table.insert([7], [1])
        table.insert([1], [8])
    assert contents(u) == contents(t)
    assert u.query([1]) == t.query([1])


@settings(max_examples=100, deadline=None)
@given(tokens=st.lists(st.integers(0, 5), max_size=80))
def test_items_load_round_trip_property(tokens: list[int]) -> None:
    t = LRUNGramTable(leader_len=1, follower_len=2, leader_capacity=3, follower_capacity=2)
    t.update(tokens)
    u = LRUNGramTable(leader_len=1, follower_len=2, leader_capacity=3, follower_capacity=2)
    u.load([(list(lead), [(list(f), c) for f, c in followers]) for lead, followers in t.items()])
    assert contents(u) == contents(t)
    u.update(tokens[::-1])
    t.update(tokens[::-1])
    assert contents(u) == contents(t)


def test_load_rejects_broken_snapshots() -> None:
    t = LRUNGramTable(leader_len=1, follower_len=1, leader_capacity=1, follower_capacity=1)
    for broken in ([((1,), [((2,), 1)]), ((3,), [((4,), 1)])],  # too many leaders
                   [((1,), [((2,), 1), ((3,), 1)])],  # too many followers
                   [((1, 2), [((3,), 1)])],  # wrong leader length
                   [((1,), [])]):  # a leader without followers
        with pytest.raises(AssertionError):
            t.load(broken)


# -- frozen table ---------------------------------------------------------------------------------------


def naive_frozen(sequences: list[list[int]], ll: int, fl: int, lc: int,
                 fc: int) -> list[tuple[tuple[int, ...], list[tuple[tuple[int, ...], int]]]]:
    """Most frequent leaders (ties: smaller tuple first), each with its most frequent followers (same ties)."""
    pairs: Counter[tuple[tuple[int, ...], tuple[int, ...]]] = Counter()
    for seq in sequences:
        for i in range(len(seq) - ll - fl + 1):
            pairs[tuple(seq[i:i + ll]), tuple(seq[i + ll:i + ll + fl])] += 1
    totals: Counter[tuple[int, ...]] = Counter()
    for (lead, _), n in pairs.items():
        totals[lead] += n
    ranked = sorted(totals, key=lambda lead: (-totals[lead], lead))[:lc]
    return [(lead, sorted(((f, n) for (l2, f), n in pairs.items() if l2 == lead), key=lambda x: (-x[1], x[0]))[:fc])
            for lead in ranked]


def test_frozen_table_on_a_hand_counted_corpus() -> None:
    corpus = [[1, 2, 3, 1, 2, 4, 1, 2, 3], [2, 3, 1, 2, 3], [5]]
    # pairs (LL=1, FL=2): 1->(2,3) x3, 1->(2,4) x1, 2->(3,1) x2, 2->(4,1) x1, 3->(1,2) x2, 4->(1,2) x1;
    # leader totals: 1: 4, 2: 3, 3: 2, 4: 1
    table = build_frozen_table(corpus, leader_len=1, follower_len=2, leader_capacity=2, follower_capacity=1)
    assert list(table.items()) == [((1,), [((2, 3), 3)]), ((2,), [((3, 1), 2)])]
    assert table.query([1]) == [((2, 3), 3)]
    assert table.query([3]) == [] and len(table) == 2
    full = build_frozen_table(corpus, leader_len=1, follower_len=2, leader_capacity=10, follower_capacity=10)
    assert list(full.items()) == [
        ((1,), [((2, 3), 3), ((2, 4), 1)]),
        ((2,), [((3, 1), 2), ((4, 1), 1)]),
        ((3,), [((1, 2), 2)]),
        ((4,), [((1, 2), 1)]),
    ]
    assert full.query([1], limit=1) == [((2, 3), 3)]
    full.check_invariants(leader_capacity=10, follower_capacity=10)


def test_frozen_table_ties_go_to_the_smaller_tuple() -> None:
    table = build_frozen_table([[9, 1, 8, 2, 7, 3]], leader_len=1, follower_len=1, leader_capacity=3)
    assert list(table.items()) == [((1,), [((8,), 1)]), ((2,), [((7,), 1)]), ((7,), [((3,), 1)])]


def test_frozen_table_from_nothing() -> None:
    for corpus in ([], [[1, 2, 3]], [np.array([], dtype=np.int32)]):
        table = build_frozen_table(corpus)
        assert len(table) == 0 and table.query([1]) == [] and list(table.items()) == []
        table.check_invariants()


@settings(max_examples=150, deadline=None)
@given(
    corpus=st.lists(st.lists(st.integers(0, 4), max_size=25), max_size=6),
    ll=st.integers(1, 2),
    fl=st.integers(1, 3),
    lc=st.integers(1, 6),
    fc=st.integers(1, 4),
    as_arrays=st.booleans(),
)
def test_frozen_table_agrees_with_a_counter(corpus: list[list[int]], ll: int, fl: int, lc: int, fc: int,
                                            as_arrays: bool) -> None:
    sequences = [np.array(s, dtype=np.int32) for s in corpus] if as_arrays else corpus
    table = build_frozen_table(sequences, leader_len=ll, follower_len=fl, leader_capacity=lc,
                                   follower_capacity=fc)
    expected = naive_frozen(corpus, ll, fl, lc, fc)
    assert list(table.items()) == expected
    assert len(table) == len(expected)
    for lead, followers in expected:
        assert table.query(lead) == followers
        assert table.query(list(lead), limit=1) == followers[:1]
    table.check_invariants(leader_capacity=lc, follower_capacity=fc)

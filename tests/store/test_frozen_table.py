"""The CSR frozen table against dict-built entries: queries, limits, the memo, validation, .npz files."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import store.frozen_table as frozen_table
from store.frozen_table import FrozenNGramTable, load_npz, save_npz

ENTRIES = {
    (7,): [((1, 2, 3), 9), ((4, 5, 6), 2)],
    (2,): [((7, 7, 7), 5)],
    (40,): [((1, 1, 1), 3), ((2, 2, 2), 3), ((3, 3, 3), 1)],
}


def as_arrays(entries, ll, fl):
    leaders = np.array([t for lead in entries for t in lead], dtype=np.int64).reshape(-1, ll)
    fols = [f for found in entries.values() for f in found]
    return dict(leaders=leaders, fanout=np.array([len(v) for v in entries.values()]),
                followers=np.array([t for f, _ in fols for t in f]).reshape(-1, fl),
                counts=np.array([c for _, c in fols]))


def test_from_arrays_answers_like_the_entries():
    table = FrozenNGramTable.from_arrays(1, 3, **as_arrays(ENTRIES, 1, 3))
    table.check_invariants(leader_capacity=3, follower_capacity=3)
    assert len(table) == 3 and table.followers == 6 and table.max_token == 40
    assert list(table.items()) == list(ENTRIES.items())
    for lead, fols in ENTRIES.items():
        for limit in (None, 1, 2, 10):
            assert table.query(lead, limit) == fols[:limit]
            assert table.query(list(lead), limit) == fols[:limit]
    for unknown in ((0,), (3,), (41,), (10 ** 9,), (-1,), (7, 1)):
        assert table.query(unknown) == []
    assert FrozenNGramTable(1, 3, ENTRIES).arrays()["followers"].tolist() == table.arrays()["followers"].tolist()


def test_followers_are_put_most_frequent_first_keeping_ties_in_order():
    arrays = as_arrays({(1,): [((5,), 1), ((6,), 4), ((7,), 1), ((8,), 4)], (2,): [((9,), 2)]}, 1, 1)
    table = FrozenNGramTable.from_arrays(1, 1, **arrays)
    assert table.query((1,)) == [((6,), 4), ((8,), 4), ((5,), 1), ((7,), 1)]
    table.check_invariants()


def test_two_token_leaders_use_the_sorted_key_index():
    entries = {(5, 1): [((2,), 3)], (1, 5): [((3,), 2)], (1, 2): [((4,), 1), ((5,), 1)]}
    table = FrozenNGramTable.from_arrays(2, 1, **as_arrays(entries, 2, 1))
    table.check_invariants()
    for lead, fols in entries.items():
        assert table.query(lead) == fols
    assert table.query((5, 2)) == [] and table.query((1,)) == [] and table.query((1 << 31, 0)) == []


def test_long_follower_lists_and_many_leaders_past_the_memo(monkeypatch):
    monkeypatch.setattr(frozen_table, "_MEMO_LEADERS", 4)
    monkeypatch.setattr(frozen_table, "_MEMO_FOLLOWERS", 2)
    monkeypatch.setattr(frozen_table, "_MEMO_MAX_FOLLOWERS", 4)
    entries = {(lead,): [((lead, j), 100 - j) for j in range(lead % 7 + 1)] for lead in range(30)}
    table = FrozenNGramTable.from_arrays(1, 2, **as_arrays(entries, 1, 2))
    for limits in ((1, 2, None, 6), (3, 1, 4, 2, 6, None)):  # within the memo, past it, then widening it
        for lead, fols in entries.items():
            for limit in limits:
                assert table.query(lead, limit) == fols[:limit]
        assert len(table._memo[1]) <= 4
    assert table._memo[0] == 4 and all(len(found) <= 4 for found in table._memo[1].values())
    assert table.query((99,), 2) == [] and table.query((99,)) == []


@pytest.mark.parametrize("change, message", [
    (dict(fanout=[2, 1, 2]), "adds up"),
    (dict(fanout=[2, 1]), "entries for 3 leaders"),
    (dict(fanout=[3, 0, 3]), "at least one follower"),
    (dict(counts=[9, 2, 5, -1, 3, 1]), "non-negative"),
    (dict(leaders=[[7], [2], [7]]), "distinct"),
    (dict(leaders=[[7], [2], [-4]]), "outside"),
    (dict(followers=np.arange(17)), "whole"),
    (dict(counts=[1.5] * 6), "integers"),
])
def test_arrays_that_do_not_form_a_table_are_refused(change, message):
    arrays = {**as_arrays(ENTRIES, 1, 3), **{k: np.asarray(v) for k, v in change.items()}}
    with pytest.raises(ValueError, match=message):
        FrozenNGramTable.from_arrays(1, 3, **arrays)


def test_npz_round_trip(tmp_path):
    table = FrozenNGramTable.from_arrays(1, 3, **as_arrays(ENTRIES, 1, 3))
    save_npz(tmp_path / "t.npz", table, "three hand-made leaders")
    loaded, source = load_npz(tmp_path / "t.npz")
    assert source == "three hand-made leaders" and list(loaded.items()) == list(table.items())
    np.savez(tmp_path / "other.npz", x=np.arange(3))
    with pytest.raises(ValueError, match="not a frozen table"):
        load_npz(tmp_path / "other.npz")


@settings(max_examples=60, deadline=None)
@given(st.dictionaries(st.tuples(st.integers(0, 50)),
                       st.lists(st.tuples(st.tuples(st.integers(0, 9), st.integers(0, 9)), st.integers(0, 5)),
                                min_size=1, max_size=6),
                       max_size=12),
       st.integers(1, 8))
def test_any_entries_query_like_a_dict(entries, limit):
    entries = {lead: sorted(fols, key=lambda f: -f[1]) for lead, fols in entries.items()}
    table = FrozenNGramTable.from_arrays(1, 2, **as_arrays(entries, 1, 2)) if entries else FrozenNGramTable(1, 2)
    table.check_invariants()
    for lead in range(52):
        assert table.query((lead,), limit) == entries.get((lead,), [])[:limit]

"""Tests of the token store: hand-built lookups in every index state, and property tests against a naive store."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from store.ring_buffer import SEPARATOR
from store.token_store import Continuations, TokenStore

BIG = 1 << 20
"""A token this large leaves room for only 3 tokens a key, so longer matches go through the ring buffer."""


class NaiveStore:
    """Every token ever written in one list (index = absolute position); the last ``capacity`` are held."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.flat: list[int] = []

    def append(self, doc: list[int]) -> None:
        keep = self.capacity - 1
        self.flat += (doc[len(doc) - keep:] if len(doc) > keep else list(doc)) + [SEPARATOR]

    @property
    def oldest(self) -> int:
        return max(0, len(self.flat) - self.capacity)

    def ends(self, context: list[int], length: int) -> list[int]:
        """Absolute positions where the last ``length`` context tokens end, inside held tokens only."""
        pattern = context[-length:]
        return [p for p in range(self.oldest + length - 1, len(self.flat))
                if self.flat[p - length + 1:p + 1] == pattern]

    def lookup(self, context: list[int], max_match: int, max_occurrences: int,
               depth: int) -> tuple[int, list[int], list[list[int]]]:
        ctx = context[-max_match:]
        counts: list[int] = []
        ends: list[int] = []
        for length in range(1, len(ctx) + 1):
            found = self.ends(ctx, length)
            if not found:
                break
            counts.append(len(found))
            ends = found
        rows = []
        for p in sorted(ends, reverse=True)[:max_occurrences]:
            row = []
            for q in range(p + 1, p + 1 + depth):
                if q >= len(self.flat) or self.flat[q] == SEPARATOR:
                    break
                row.append(self.flat[q])
            rows.append(row + [-1] * (depth - len(row)))
        return len(counts), counts, rows


def answer(found: Continuations) -> tuple[int, list[int], list[list[int]]]:
    assert found.counts.dtype == np.int64 and found.rows.dtype == np.int32
    assert found.counts.shape == (found.match_len,)
    assert found.occurrences == (int(found.counts[-1]) if found.match_len else 0)
    return found.match_len, found.counts.tolist(), found.rows.tolist()


# -- hand-built lookups ---------------------------------------------------------------------------------

DOCS = [[1, 2, 3, 4, 5], [1, 2, 3, 9, 9], [7, 2, 3, 4, 6]]  # absolute positions 0..4, 6..10, 12..16


def all_scanned(store: TokenStore, docs: list[list[int]]) -> None:
    for doc in docs:
        store.append(doc)


def main_only(store: TokenStore, docs: list[list[int]]) -> None:
    all_scanned(store, docs)
    assert store.rebuild("main") == "main"


def main_delta_tail(store: TokenStore, docs: list[list[int]]) -> None:
    store.append(docs[0])
    store.rebuild("main")
    store.append(docs[1])
    assert store.rebuild("delta") == "delta"
    all_scanned(store, docs[2:])


def delta_only(store: TokenStore, docs: list[list[int]]) -> None:
    all_scanned(store, docs)
    store.rebuild("delta")


STATES = [all_scanned, main_only, main_delta_tail, delta_only]
Build = Callable[[TokenStore, list[list[int]]], None]


@pytest.mark.parametrize("build", STATES)
@pytest.mark.parametrize("context, kwargs, expected", [
    ([8, 2, 3], {}, (2, [3, 3], [[4, 6, -1], [9, 9, -1], [4, 5, -1]])),
    ([2, 3, 4], {}, (3, [2, 2, 2], [[6, -1, -1], [5, -1, -1]])),
    ([2, 3, 4], {"max_occurrences": 1}, (3, [2, 2, 2], [[6, -1, -1]])),
    ([8, 2, 3], {"max_occurrences": 2}, (2, [3, 3], [[4, 6, -1], [9, 9, -1]])),
    ([1, 2, 3, 4], {"max_match": 2}, (2, [2, 2], [[6, -1, -1], [5, -1, -1]])),
    ([1, 2], {"depth": 5}, (2, [3, 2], [[3, 9, 9, -1, -1], [3, 4, 5, -1, -1]])),
    ([9, 9, 9], {}, (2, [2, 1], [[-1, -1, -1]])),
    ([5, 1], {}, (1, [2], [[2, 3, 9], [2, 3, 4]])),  # [5, 1] would cross a separator
    ([6, 7], {}, (1, [1], [[2, 3, 4]])),
    ([8], {}, (0, [], [])),
    ([2, 3, 1000], {}, (0, [], [])),  # a token larger than any indexed one
    ([1000, 2, 3], {}, (2, [3, 3], [[4, 6, -1], [9, 9, -1], [4, 5, -1]])),
    ([2**40, 7, 2], {}, (2, [3, 1], [[3, 4, 6]])),
    ([2**31 - 1, 2, 3, 4], {}, (3, [2, 2, 2], [[6, -1, -1], [5, -1, -1]])),
])
def test_lookup_on_hand_built_documents(build: Build, context: list[int], kwargs: dict[str, int],
                                        expected: tuple[int, list[int], list[list[int]]]) -> None:
    store = TokenStore(capacity=64)
    build(store, DOCS)
    store.check_invariants()
    found = store.lookup(context, **{"max_match": 8, "max_occurrences": 8, "depth": 3, **kwargs})
    m, counts, rows = expected
    if m == 0:
        assert found.match_len == 0 and found.counts.size == 0 and found.rows.size == 0
    else:
        assert answer(found) == expected


@pytest.mark.parametrize("build", STATES)
def test_lookup_accepts_lists_and_arrays_and_uses_only_the_last_max_match_tokens(build: Build) -> None:
    store = TokenStore(capacity=64)
    build(store, DOCS)
    expected = (3, [2, 2, 2], [[6, -1], [5, -1]])
    assert answer(store.lookup([1, 2, 3, 4], max_match=3, depth=2)) == expected
    assert answer(store.lookup(np.array([1, 2, 3, 4], dtype=np.int32), max_match=3, depth=2)) == expected
    assert answer(store.lookup((9, 2, 3, 4), max_match=3, depth=2)) == expected


def test_lookup_with_default_arguments() -> None:
    store = TokenStore()
    store.append(list(range(40)))
    assert store.rebuild() is None  # 41 unindexed tokens are below the default tail
    for _ in range(2):
        found = store.lookup(list(range(40)))  # max_match 32: only tokens 8..39 are matched
        assert answer(found) == (32, [1] * 32, [[-1] * 16])  # depth 16
        assert answer(store.lookup([5, 6])) == (2, [1, 1], [list(range(7, 23))])
        store.rebuild("main")
    for k in range(40):
        store.append([1, 100 + k])
    found = store.lookup([1])  # 41 occurrences: max_occurrences 32 keeps the most recent
    assert found.counts.tolist() == [41]
    assert found.rows.tolist() == [[100 + k] + [-1] * 15 for k in range(39, 7, -1)]


def test_empty_store_and_unseen_context() -> None:
    store = TokenStore(capacity=16)
    for ctx in ([1, 2, 3], [], [0]):
        found = store.lookup(ctx)
        assert found.match_len == 0 and found.occurrences == 0 and found.counts.size == 0 and len(found.rows) == 0
    assert store.rebuild("main") == "main"
    assert store.lookup([1]).match_len == 0
    store.append([4, 5])
    assert store.lookup([]).match_len == 0
    for build in ("main", "delta"):
        store.rebuild(build)
        found = store.lookup([6, 7])
        assert found.match_len == 0 and len(found.rows) == 0
        store.check_invariants()


def test_rebuild_kinds() -> None:
    store = TokenStore(capacity=64, tail_tokens=4, delta_fraction=1.0)
    assert store.rebuild() is None  # nothing due on an empty store
    store.append([1, 2, 3, 4])
    assert store.rebuild_due() == "main" and store.rebuild() == "main"
    assert (store.indexed_end, store.unindexed) == (5, 0)
    store.append([5])
    assert store.unindexed == 2 and store.rebuild_due() is None
    store.append([6])
    assert store.rebuild_due() == "delta" and store.rebuild() == "delta"
    assert (store.indexed_end, store.unindexed) == (9, 0)
    store.append([7, 8, 9])
    with pytest.raises(ValueError):
        store.rebuild("bogus")
    stats = store.stats()
    assert stats["tokens"] == 13 and stats["documents"] == 4
    assert stats["indexed_tokens"] == 9 and stats["unindexed_tokens"] == 4
    assert stats["ring_bytes"] == 64 * 4 and stats["index_bytes"] > 0
    assert store.rebuild_due() == "delta" and store.rebuild() == "delta"  # the scanned tail first
    assert store.rebuild_due() == "main"  # then: the delta (8) exceeds the main index (5)
    store.check_invariants()


def test_wraparound_scanned_match_never_uses_overwritten_tokens() -> None:
    store = TokenStore(capacity=12)
    store.append([1, 2, 3, 4])  # positions 0..4
    store.append([5, 6, 7, 8, 9])  # positions 5..10; oldest becomes 0
    store.append([2, 3])  # positions 11..13; oldest becomes 2: held [3, 4, -1, 5, 6, 7, 8, 9, -1, 2, 3, -1]
    assert store.ring.oldest == 2
    assert answer(store.lookup([1, 2, 3], depth=2)) == (2, [2, 1], [[-1, -1]])  # [2, 3] at 1..2 is gone
    assert answer(store.lookup([3, 4], depth=2)) == (2, [1, 1], [[-1, -1]])
    assert answer(store.lookup([3], depth=2)) == (1, [2], [[-1, -1], [4, -1]])
    store.rebuild("main")  # the index is built on the partly overwritten first document
    assert answer(store.lookup([1, 2, 3], depth=2)) == (2, [2, 1], [[-1, -1]])
    assert answer(store.lookup([3], depth=2)) == (1, [2], [[-1, -1], [4, -1]])


# -- indexed tokens overwritten after the index was built -------------------------------------------------


def test_lookup_ignores_a_longer_match_in_overwritten_indexed_tokens() -> None:
    store = TokenStore(capacity=20)
    store.append([1, 2, 3, 4, 5])  # positions 0..5
    store.append([7, 3, 4, 9])  # positions 6..10
    store.rebuild("main")
    store.append([8] * 12)  # positions 11..23; oldest 4: held [5, -1, 7, 3, 4, 9, -1, 8 x 12, -1]
    found = store.lookup([2, 3, 4], depth=3)
    # [2, 3, 4] is gone with positions 0..3; [3, 4] still occurs at 7..8, followed by 9
    assert (found.match_len, found.rows.tolist()) == (2, [[9, -1, -1]])


def test_lookup_keeps_a_shorter_held_match_when_the_key_match_was_overwritten() -> None:
    store = TokenStore(capacity=20)
    store.append([BIG])  # positions 0..1; 3 tokens a key
    store.append([1, 2, 3, 4, 5])  # positions 2..7
    store.rebuild("main")
    store.append([8] * 15)  # positions 8..23; oldest 4: held [3, 4, 5, -1, 8 x 15, -1]
    found = store.lookup([1, 2, 3, 4], depth=3)
    # [2, 3, 4] lost position 3; [3, 4] still occurs at 4..5, followed by 5
    assert (found.match_len, found.rows.tolist()) == (2, [[5, -1, -1]])


def test_lookup_with_overwritten_key_match_and_a_tail_match() -> None:
    store = TokenStore(capacity=20)
    store.append([BIG])  # positions 0..1; 3 tokens a key
    store.append([1, 2, 3, 4, 5])  # positions 2..7
    store.rebuild("main")
    store.append([8] * 14 + [4])  # positions 8..23; oldest 4: held [3, 4, 5, -1, 8 x 14, 4, -1]
    found = store.lookup([1, 2, 3, 4], depth=3)
    assert (found.match_len, found.rows.tolist()) == (2, [[5, -1, -1]])


def test_rebuild_delta_after_the_main_index_was_overwritten_keeps_invariants() -> None:
    store = TokenStore(capacity=10)
    store.append([1, 2, 3])  # positions 0..3
    store.rebuild("main")
    store.append([4, 5, 6, 7, 8])  # positions 4..9
    store.append([9, 1, 2, 3])  # positions 10..14; oldest 5: the main index is wholly overwritten
    store.rebuild("delta")
    store.check_invariants()
    found = store.lookup([1, 2], depth=2)
    assert (found.match_len, found.rows.tolist()) == (2, [[3, -1]])


# -- property tests against the naive store -------------------------------------------------------------


@st.composite
def scenarios(draw: st.DrawFn, wrap_after_index: bool) -> dict:
    symbols = list(range(draw(st.integers(2, 6))))
    if draw(st.booleans()):
        symbols.append(BIG)
    docs = draw(st.lists(st.lists(st.sampled_from(symbols), max_size=14), min_size=1, max_size=14))
    state = draw(st.sampled_from(["scan", "main", "delta", "main_delta_tail"]))
    total = sum(len(d) + 1 for d in docs)
    if state == "main_delta_tail":
        a = draw(st.integers(0, len(docs)))
        b = draw(st.integers(a, len(docs)))
        if wrap_after_index:
            capacity = draw(st.integers(4, max(4, total)))
        else:  # whatever the indexes hold is never overwritten
            capacity = draw(st.integers(max(4, total), total + 8))
    else:
        a = b = len(docs)  # an index, if any, is built after the last append
        capacity = draw(st.integers(4, total + 8))
    held = NaiveStore(capacity)
    for doc in docs:
        held.append(doc)
    tokens = [t for t in held.flat[held.oldest:] if t >= 0]
    if tokens and draw(st.integers(0, 3)):
        i = draw(st.integers(0, len(tokens) - 1))
        prefix = draw(st.lists(st.sampled_from(symbols), max_size=3))
        context = prefix + tokens[max(0, i - draw(st.integers(0, 12))):i + 1]
    else:
        context = draw(st.lists(st.sampled_from(symbols + [len(symbols) + 2]), min_size=1, max_size=12))
    return {
        "docs": docs, "state": state, "a": a, "b": b, "capacity": capacity, "context": context,
        "max_match": draw(st.integers(1, 12)),
        "max_occurrences": draw(st.one_of(st.integers(1, 4), st.just(1000))),
        "depth": draw(st.integers(1, 6)),
    }


def build_store(case: dict) -> tuple[TokenStore, NaiveStore]:
    store = TokenStore(capacity=case["capacity"], max_candidates=1 << 20, max_examined=1 << 20)
    naive = NaiveStore(case["capacity"])
    docs = case["docs"]
    for i in range(len(docs) + 1):
        if case["state"] == "main_delta_tail" and i == case["a"]:
            assert store.rebuild("main") == "main"
        if case["state"] == "main_delta_tail" and i == case["b"]:
            assert store.rebuild("delta") in ("delta", "main")  # "main" when no main index is held
        if i < len(docs):
            store.append(docs[i])
            naive.append(docs[i])
    if case["state"] in ("main", "delta"):
        store.rebuild(case["state"])
    return store, naive


def check(case: dict, exact_counts: bool) -> None:
    store, naive = build_store(case)
    assert store.ring.read(store.ring.oldest, store.ring.end).tolist() == naive.flat[naive.oldest:]
    args = (case["max_match"], case["max_occurrences"], case["depth"])
    found = store.lookup(case["context"], *args)
    m, counts, rows = naive.lookup(case["context"], *args)
    assert found.match_len == m
    assert found.rows.tolist() == rows  # most recent first
    if exact_counts:
        assert found.counts.tolist() == counts
    else:
        assert found.counts.shape == (m,)
    if m:
        assert found.rows.shape == (len(rows), case["depth"])


@settings(max_examples=300, deadline=None)
@given(case=scenarios(wrap_after_index=False))
def test_lookup_agrees_with_a_naive_store(case: dict) -> None:
    """All four index states; wraparound (partly overwritten documents included) before any index is built."""
    check(case, exact_counts=True)
    store, _ = build_store(case)
    store.check_invariants()


@settings(max_examples=200, deadline=None)
@given(case=scenarios(wrap_after_index=True))
def test_lookup_agrees_with_a_naive_store_when_indexed_tokens_are_overwritten(case: dict) -> None:
    """Main + delta + tail with a small ring: appends after a rebuild overwrite what an index saw.

    Counts from an index over overwritten tokens are documented as approximate, so only the match length and
    the continuations are compared.
    """
    check(case, exact_counts=False)


@settings(max_examples=100, deadline=None)
@given(
    docs=st.lists(st.lists(st.integers(0, 2), max_size=10), min_size=1, max_size=10),
    context=st.lists(st.integers(0, 2), min_size=1, max_size=6),
)
def test_counts_cover_every_length_and_occurrences_match_rows(docs: list[list[int]], context: list[int]) -> None:
    store = TokenStore(capacity=256)
    naive = NaiveStore(256)
    for doc in docs:
        store.append(doc)
        naive.append(doc)
    for _ in range(2):
        found = store.lookup(context, max_match=6, max_occurrences=1000, depth=2)
        m, counts, rows = naive.lookup(context, 6, 1000, 2)
        assert answer(found) == (m, counts, rows)
        assert found.occurrences == len(rows)
        assert all(a >= b for a, b in zip(counts, counts[1:], strict=False))
        store.rebuild("main")


def test_full_ring_rebuilds_the_small_index_until_much_of_the_main_one_is_overwritten():
    store = TokenStore(capacity=1000, tail_tokens=10, delta_fraction=0.25)
    for _ in range(100):
        store.append(list(range(9)))  # 10 slots each with the separator
    assert store.rebuild() == "main"
    store.append(list(range(19)))  # 20 new slots overwrite the 20 oldest
    assert store.rebuild_due() == "delta"
    assert store.rebuild() == "delta"
    for _ in range(12):  # 120 + 20 new, as many overwritten: 280 > 0.25 * 1000
        store.append(list(range(9)))
    assert store.rebuild_due() == "delta"  # the scanned tail is indexed first...
    assert store.rebuild() == "delta"
    assert store.rebuild_due() == "main"  # ...then the main index, while lookups stay cheap
    assert store.rebuild() == "main"
    assert store.rebuild_due() is None
    store.check_invariants()


def split_and_one_index(docs: list[np.ndarray], main_docs: int, **kwargs: int) -> tuple[TokenStore, TokenStore]:
    """Two stores of ``docs``: one with a main index over the first ``main_docs`` and a delta over the rest (as a
    store restored from an index file may be), one with a single index over everything."""
    split, one = TokenStore(**kwargs), TokenStore(**kwargs)
    for i, doc in enumerate(docs):
        split.append(doc)
        one.append(doc)
        if i == main_docs - 1:
            split.rebuild("main")
    split.rebuild("delta")
    one.rebuild("main")
    return split, one


def test_a_main_and_a_delta_index_find_what_one_index_over_the_same_tokens_finds() -> None:
    """A store restarted from an index file (a main and a delta index) drafts as one rebuilt over everything: with
    thousands of occurrences of a context, the most recent ones are picked from all of them, not from a sample
    that depends on how the tokens are split between the indexes."""
    rng = np.random.default_rng(7)
    docs = [np.concatenate([[5, 6, 7], rng.integers(10, 60, 6), rng.integers(100, 2000, 20)]).astype(np.int32)
            for _ in range(6000)]
    split, one = split_and_one_index(docs, 4000, capacity=1 << 20)
    assert split.stats()["indexed_tokens"] == one.stats()["indexed_tokens"] == len(one.ring)  # all, separators too
    for context in ([5, 6, 7], [6, 7], [1, 5, 6, 7, 12], [7]):
        a, b = split.lookup(context), one.lookup(context)
        assert a.match_len == b.match_len > 0
        np.testing.assert_array_equal(a.counts, b.counts)
        np.testing.assert_array_equal(a.rows, b.rows)


@pytest.mark.parametrize("max_candidates, max_examined", [(8, 16), (1, 1), (4096, 65536)])
def test_split_and_one_index_agree_where_keys_and_matches_have_more_occurrences_than_are_read(
        max_candidates: int, max_examined: int) -> None:
    """Near-copies of one document give keys far more occurrences than ``max_candidates`` and longest matches far
    more than ``max_examined``: a match is still extended over all of them and the most recent are picked from all
    of them, so a main and a delta index (a store restored from an index file) look up exactly as one rebuilt index,
    and as the numpy reference does."""
    rng = np.random.default_rng(11)
    base = rng.integers(0, 40, 300)
    docs = []
    for _ in range(500):
        doc = base.copy()
        doc[rng.integers(0, 300, 6)] = rng.integers(0, 40, 6)
        docs.append(doc.astype(np.int32))
    split, one = split_and_one_index(docs, 350, capacity=1 << 18, max_candidates=max_candidates,
                                     max_examined=max_examined)
    longest = []
    for _ in range(150):
        doc = docs[rng.integers(0, len(docs))]
        end = int(rng.integers(1, 300))
        context = np.concatenate([rng.integers(0, 40, int(rng.integers(0, 3))), doc[max(0, end - 40):end]])
        a, b = split.lookup(context, max_match=32), one.lookup(context, max_match=32)
        for got in (a, b, split.lookup_numpy(context, max_match=32)):
            assert got.match_len == b.match_len
            np.testing.assert_array_equal(got.counts, b.counts)
            np.testing.assert_array_equal(got.rows, b.rows)
        longest.append(int(b.counts[-1]) if b.match_len else 0)
    assert max(longest) > 16  # the longest matches do have more occurrences than are read one by one

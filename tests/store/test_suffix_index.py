"""Tests of the reversed suffix index: hand-built snapshots, and a property test against a naive scan."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from store.ring_buffer import SEPARATOR, RingBuffer
from store.suffix_index import SuffixIndex, key_layout

BIG = 1 << 20
"""A token this large leaves room for only 3 tokens a key, so longer matches go through the ring buffer."""


def rev(context: list[int]) -> np.ndarray:
    return np.array(context[::-1], dtype=np.int64)


def naive_match(flat: list[int], oldest: int, lo: int, hi: int, context: list[int],
                max_match: int) -> tuple[int, list[int], list[int]]:
    """Longest m with an occurrence of the last m context tokens ending in [lo, hi) and starting at or after
    ``oldest``; counts for every length 1..m; the sorted ends of the length-m occurrences."""
    counts: list[int] = []
    ends: list[int] = []
    for length in range(1, min(max_match, len(context)) + 1):
        found = [p for p in range(lo, hi)
                 if p - length + 1 >= max(oldest, 0) and flat[p - length + 1:p + 1] == context[-length:]]
        if not found:
            break
        counts.append(len(found))
        ends = found
    return len(counts), counts, ends


def result(found: tuple[int, np.ndarray, np.ndarray]) -> tuple[int, list[int], list[int]]:
    m, counts, ends = found
    assert counts.dtype == np.int64 and ends.dtype == np.int64
    return m, counts.tolist(), sorted(ends.tolist())


# three documents at absolute positions 0..17, a separator after each
DOCS = [1, 2, 3, 4, 5, -1, 1, 2, 3, 9, 9, -1, 7, 2, 3, 4, 6, -1]


@pytest.mark.parametrize("context, max_match, expected", [
    ([8, 2, 3], 8, (2, [3, 3], [2, 8, 14])),
    ([2, 3, 4], 8, (3, [2, 2, 2], [3, 15])),
    ([2, 3, 4], 1, (1, [2], [3, 15])),
    ([1, 2, 3, 4, 5], 8, (5, [1, 1, 1, 1, 1], [4])),
    ([9], 8, (1, [2], [9, 10])),
    ([9, 9, 9], 8, (2, [2, 1], [10])),
    ([5, 1], 8, (1, [2], [0, 6])),  # [5, 1] would cross the separator at 5
    ([10, 3], 8, (1, [3], [2, 8, 14])),  # 10 fits the key bits but never occurs
    ([3, 100], 8, (0, [], [])),  # 100 does not fit the key bits
    ([100, 3], 8, (1, [3], [2, 8, 14])),
    ([2**40, 7, 2], 8, (2, [3, 1], [13])),
    ([8], 8, (0, [], [])),
])
def test_match_on_hand_built_documents(context: list[int], max_match: int,
                                       expected: tuple[int, list[int], list[int]]) -> None:
    snapshot = np.array(DOCS, dtype=np.int32)
    index = SuffixIndex(snapshot.copy(), 0)
    assert (index.start, index.end, len(index)) == (0, 18, 18)
    assert result(index.match(rev(context), snapshot, 0, max_match)) == expected


def test_match_at_absolute_positions_past_the_capacity() -> None:
    # the same documents at absolute positions 100..117 of an 18-slot ring
    ring = np.zeros(18, dtype=np.int32)
    for i, tok in enumerate(DOCS):
        ring[(100 + i) % 18] = tok
    index = SuffixIndex(np.array(DOCS, dtype=np.int32), 100)
    assert result(index.match(rev([8, 2, 3]), ring, 100, 8)) == (2, [3, 3], [102, 108, 114])
    assert result(index.match(rev([1, 2, 3, 4, 5]), ring, 100, 8)) == (5, [1, 1, 1, 1, 1], [104])


def test_match_longer_than_a_key_reads_the_ring() -> None:
    docs = [BIG, -1, 1, 2, 3, 4, 5, -1, 6, 2, 3, 4, 5, -1]
    snapshot = np.array(docs, dtype=np.int32)
    index = SuffixIndex(snapshot.copy(), 0)
    assert index.tokens_per_key == 3
    assert result(index.match(rev([1, 2, 3, 4, 5]), snapshot, 0, 8)) == (5, [2, 2, 2, 2, 1], [6])
    assert result(index.match(rev([0, 2, 3, 4, 5]), snapshot, 0, 8)) == (4, [2, 2, 2, 2], [6, 12])
    assert result(index.match(rev([1, 2, 3, 4, 5]), snapshot, 0, 4)) == (4, [2, 2, 2, 2], [6, 12])
    assert result(index.match(rev([BIG, 2, 3, 4]), snapshot, 0, 8)) == (3, [2, 2, 2], [5, 11])
    # position 2 (token 1) no longer held: the five-token match is gone
    assert result(index.match(rev([1, 2, 3, 4, 5]), snapshot, 3, 8)) == (4, [2, 2, 2, 2], [6, 12])


def test_empty_index_and_empty_context() -> None:
    empty = SuffixIndex(np.zeros(0, dtype=np.int32), 5)
    assert (len(empty), empty.start, empty.end) == (0, 5, 5)
    assert result(empty.match(rev([1]), np.zeros(4, dtype=np.int32), 0, 4)) == (0, [], [])
    index = SuffixIndex(np.array(DOCS, dtype=np.int32), 0)
    assert result(index.match(rev([]), np.array(DOCS, dtype=np.int32), 0, 4)) == (0, [], [])


def test_separators_only() -> None:
    snapshot = np.array([-1, -1, -1], dtype=np.int32)
    index = SuffixIndex(snapshot.copy(), 0)
    assert result(index.match(rev([0]), snapshot, 0, 4)) == (0, [], [])


def test_key_layout() -> None:
    assert key_layout(0) == (1, 64)
    assert key_layout(1) == (2, 32)
    assert key_layout(2) == (2, 32)
    assert key_layout(3) == (3, 21)
    assert key_layout(BIG) == (21, 3)
    assert key_layout(2**31 - 2) == (31, 2)
    assert key_layout(2**31 - 1) == (32, 2)


def test_match_after_overwrite_reports_only_held_occurrences() -> None:
    """The longest match must be found among tokens the ring still holds, not among overwritten ones."""
    ring = RingBuffer(18)
    for doc in ([1, 2, 3, 4, 5], [1, 2, 3, 9, 9], [7, 2, 3, 4, 6]):
        ring.append(doc)
    index = SuffixIndex(*ring.snapshot())
    ring.append([8] * 6)  # positions 0..6 overwritten: held 7.. = [2, 3, 9, 9, -1, 7, 2, 3, 4, 6, -1, 8 x 6, -1]
    m, _, ends = index.match(rev([1, 2, 3]), ring.view(), ring.oldest, 8)
    # [1, 2, 3] only occurred at 0..2 and 6..8, both partly overwritten; [2, 3] still ends at 8 and 14
    assert (m, sorted(ends.tolist())) == (2, [8, 14])


@st.composite
def ring_and_context(draw: st.DrawFn) -> tuple[RingBuffer, list[int], list[int], int]:
    symbols = list(range(draw(st.integers(2, 6))))
    if draw(st.booleans()):
        symbols.append(BIG)
    capacity = draw(st.integers(4, 60))
    docs = draw(st.lists(st.lists(st.sampled_from(symbols), max_size=16), min_size=1, max_size=12))
    ring = RingBuffer(capacity)
    flat: list[int] = []
    for doc in docs:
        ring.append(doc)
        flat += (doc[len(doc) - (capacity - 1):] if len(doc) > capacity - 1 else doc) + [SEPARATOR]
    tokens = [t for t in flat[ring.oldest:] if t >= 0]
    if tokens and draw(st.booleans()):
        i = draw(st.integers(0, len(tokens) - 1))
        context = draw(st.lists(st.sampled_from(symbols), max_size=4)) + tokens[max(0, i - 10):i + 1]
    else:
        context = draw(st.lists(st.sampled_from(symbols + [len(symbols) + 3]), min_size=1, max_size=10))
    return ring, flat, context, draw(st.integers(1, 12))


@settings(max_examples=200, deadline=None)
@given(case=ring_and_context(), data=st.data())
def test_match_agrees_with_a_naive_scan(case: tuple[RingBuffer, list[int], list[int], int],
                                        data: st.DataObject) -> None:
    ring, flat, context, max_match = case
    tokens, start = ring.snapshot()
    # index either everything held, or only what follows a document boundary (as the delta index does)
    bounds = [start] + [p + 1 for p in range(start, ring.end) if flat[p] == SEPARATOR]
    cut = data.draw(st.sampled_from(bounds))
    index = SuffixIndex(tokens[cut - start:].copy(), cut)
    expected = naive_match(flat, ring.oldest, cut, ring.end, context, max_match)
    assert result(index.match(rev(context), ring.view(), ring.oldest, max_match)) == expected

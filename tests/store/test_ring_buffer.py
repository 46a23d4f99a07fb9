"""Tests of the circular token buffer: absolute positions, separators, wraparound and rejected input."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from store import ring_buffer
from store.ring_buffer import SEPARATOR, RingBuffer


def held(ring: RingBuffer) -> list[int]:
    return ring.read(ring.oldest, ring.end).tolist()


def test_capacity_below_two_is_rejected() -> None:
    for capacity in (-1, 0, 1):
        with pytest.raises(ValueError):
            RingBuffer(capacity)
    RingBuffer(2).check_invariants()


def test_empty_buffer() -> None:
    ring = RingBuffer(8)
    assert (ring.oldest, ring.end, len(ring), ring.documents) == (0, 0, 0, 0)
    assert ring.read(0, 0).tolist() == []
    tokens, start = ring.snapshot()
    assert tokens.tolist() == [] and start == 0
    assert ring.nbytes == 8 * 4
    ring.check_invariants()


def test_append_returns_absolute_positions_and_writes_a_separator_after_each_document() -> None:
    ring = RingBuffer(10)
    assert ring.append([1, 2, 3]) == (0, 3)  # slots 0..2, separator at 3
    assert ring.append([4, 5]) == (4, 6)  # slots 4..5, separator at 6
    assert (ring.oldest, ring.end, len(ring), ring.documents) == (0, 7, 7, 2)
    assert held(ring) == [1, 2, 3, SEPARATOR, 4, 5, SEPARATOR]
    assert ring.read(1, 5).tolist() == [2, 3, -1, 4]
    assert ring.read(4, 4).tolist() == []
    ring.check_invariants()


def test_empty_document_is_a_lone_separator() -> None:
    ring = RingBuffer(6)
    assert ring.append([7]) == (0, 1)
    assert ring.append([]) == (2, 2)
    assert held(ring) == [7, -1, -1]
    assert ring.documents == 2
    ring.check_invariants()


def test_wraparound_overwrites_the_oldest_tokens() -> None:
    ring = RingBuffer(10)
    ring.append([1, 2, 3])  # positions 0..3
    ring.append([4, 5])  # positions 4..6
    assert ring.append([6, 7, 8]) == (7, 10)  # separator at absolute 10, slot 0
    assert (ring.oldest, ring.end, len(ring)) == (1, 11, 10)
    assert held(ring) == [2, 3, -1, 4, 5, -1, 6, 7, 8, -1]
    assert ring.view().tolist() == [-1, 2, 3, -1, 4, 5, -1, 6, 7, 8]  # slot of position p is p % 10
    assert ring.read(8, 11).tolist() == [7, 8, -1]  # a read across the wrap
    for start, stop in ((0, 1), (0, 11), (1, 12), (5, 3), (11, 12)):
        with pytest.raises(IndexError):
            ring.read(start, stop)
    assert ring.append([9, 9, 9, 9]) == (11, 15)  # overwrites 2, 3, -1, 4 and 5
    assert (ring.oldest, ring.end, len(ring)) == (6, 16, 10)
    assert held(ring) == [-1, 6, 7, 8, -1, 9, 9, 9, 9, -1]
    with pytest.raises(IndexError):
        ring.read(5, 7)
    ring.check_invariants()


def test_document_longer_than_capacity_keeps_its_last_capacity_minus_one_tokens() -> None:
    ring = RingBuffer(5)
    ring.append([1])
    assert ring.append(list(range(10, 20))) == (2, 6)
    assert (ring.oldest, ring.end, len(ring)) == (2, 7, 5)
    assert held(ring) == [16, 17, 18, 19, -1]
    assert ring.append(np.arange(100, 105)) == (7, 11)  # exactly capacity - 1 + 1 tokens too many
    assert held(ring) == [101, 102, 103, 104, -1]
    assert ring.append(np.arange(200, 204)) == (12, 16)  # exactly capacity - 1 tokens: kept whole
    assert held(ring) == [200, 201, 202, 203, -1]
    ring.check_invariants()


def test_capacity_two_holds_one_token_documents() -> None:
    ring = RingBuffer(2)
    assert ring.append([5, 6, 7]) == (0, 1)
    assert held(ring) == [7, -1]
    assert ring.append([]) == (2, 2)
    assert held(ring) == [-1, -1]
    ring.check_invariants()


@pytest.mark.parametrize("bad", [[1, -2, 3], [-1], np.array([4, -7], dtype=np.int64)])
def test_negative_ids_are_rejected_and_nothing_changes(bad: object) -> None:
    ring = RingBuffer(6)
    ring.append([1, 2, 3, 4])  # the next document would wrap
    before = (ring.oldest, ring.end, len(ring), ring.documents, ring.view().tolist())
    with pytest.raises(ValueError):
        ring.append(bad)  # type: ignore[arg-type]
    assert (ring.oldest, ring.end, len(ring), ring.documents, ring.view().tolist()) == before
    ring.check_invariants()


@pytest.mark.parametrize("bad", [[2**32 + 5], np.array([2**32 + 5], dtype=np.int64), np.array([2**31], dtype=np.int64)])
def test_ids_that_do_not_fit_int32_are_rejected_and_nothing_changes(bad: object) -> None:
    ring = RingBuffer(6)
    ring.append([1, 2])
    before = (ring.end, ring.documents, ring.view().tolist())
    with pytest.raises((ValueError, OverflowError)):
        ring.append(bad)  # type: ignore[arg-type]
    assert (ring.end, ring.documents, ring.view().tolist()) == before


def test_snapshot_is_a_writable_copy_of_the_held_range() -> None:
    ring = RingBuffer(7)
    ring.append([1, 2, 3])
    ring.append([4, 5, 6])  # wraps: oldest 1
    tokens, start = ring.snapshot()
    assert start == ring.oldest == 1
    assert tokens.tolist() == held(ring) == [2, 3, -1, 4, 5, 6, -1]
    assert tokens.dtype == np.int32
    tokens[:] = 0
    assert held(ring) == [2, 3, -1, 4, 5, 6, -1]



def test_a_large_range_is_copied_in_chunks_with_the_same_result(monkeypatch) -> None:
    rng = np.random.default_rng(0)
    docs = [rng.integers(0, 100, int(rng.integers(1, 30))).tolist() for _ in range(40)]
    small, chunked = RingBuffer(257), RingBuffer(257)
    for doc in docs:  # wraps several times
        small.append(doc)
        chunked.append(doc)
    expected = [small.read(small.oldest + a, small.oldest + b).tolist() for a, b in ((0, 257), (3, 250), (100, 101))]
    monkeypatch.setattr(ring_buffer, "COPY_CHUNK", 16)
    got = [chunked.read(chunked.oldest + a, chunked.oldest + b) for a, b in ((0, 257), (3, 250), (100, 101))]
    assert [g.tolist() for g in got] == expected and all(g.dtype == np.int32 for g in got)
    assert chunked.snapshot()[0].tolist() == expected[0]

def test_view_is_read_only() -> None:
    ring = RingBuffer(4)
    ring.append([1])
    with pytest.raises(ValueError):
        ring.view()[0] = 9


@settings(max_examples=200, deadline=None)
@given(
    capacity=st.integers(2, 24),
    docs=st.lists(st.lists(st.integers(0, 50), max_size=30), min_size=1, max_size=20),
    data=st.data(),
)
def test_matches_a_list_of_every_token_ever_written(capacity: int, docs: list[list[int]], data: st.DataObject) -> None:
    ring = RingBuffer(capacity)
    flat: list[int] = []  # every token ever written; index = absolute position
    for n, doc in enumerate(docs, start=1):
        kept = doc[len(doc) - (capacity - 1):] if len(doc) > capacity - 1 else doc
        start = len(flat)
        assert ring.append(doc) == (start, start + len(kept))
        flat += kept + [SEPARATOR]
        oldest = max(0, len(flat) - capacity)
        assert (ring.oldest, ring.end, len(ring), ring.documents) == (oldest, len(flat), len(flat) - oldest, n)
        assert held(ring) == flat[oldest:]
        tokens, snap_start = ring.snapshot()
        assert (tokens.tolist(), snap_start) == (flat[oldest:], oldest)
        a = data.draw(st.integers(oldest, len(flat)))
        b = data.draw(st.integers(a, len(flat)))
        assert ring.read(a, b).tolist() == flat[a:b]
        if oldest:
            with pytest.raises(IndexError):
                ring.read(oldest - 1, b)
        with pytest.raises(IndexError):
            ring.read(a, len(flat) + 1)
        view = ring.view()
        assert all(view[p % capacity] == flat[p] for p in range(oldest, len(flat)))
        ring.check_invariants()

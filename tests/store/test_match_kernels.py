"""Tests of the match kernels on hand-built ring slots with the expected answers beside them."""

from __future__ import annotations

import numpy as np

from store.match_kernels import continuations, extend_matches, pack_pattern, scan_matches


def rev(context: list[int]) -> np.ndarray:
    return np.array(context[::-1], dtype=np.int64)


def test_pack_pattern_bounds_nest() -> None:
    # 2 bits a token, 4 tokens a key; tokens are stored as token + 1.
    lows, highs = pack_pattern(np.array([1, 0]), bits=2, tokens_per_key=4)
    assert lows.dtype == highs.dtype == np.uint64
    assert lows.tolist() == [0b10_00_00_00, 0b10_01_00_00]
    assert highs.tolist() == [0b10_11_11_11, 0b10_01_11_11]


def test_pack_pattern_full_key_width() -> None:
    lows, highs = pack_pattern(np.array([2, 2]), bits=32, tokens_per_key=2)
    assert lows.tolist() == [3 << 32, (3 << 32) | 3]
    assert highs.tolist() == [(4 << 32) - 1, (3 << 32) | 3]


# absolute positions 0..11 in a 12-slot ring that has not wrapped
RING = np.array([1, 2, 3, 4, -1, 2, 3, 5, -1, 9, 3, -1], dtype=np.int32)


def test_scan_matches_counts_every_length_and_keeps_the_longest() -> None:
    m, counts, ends = scan_matches(RING, 0, 12, rev([7, 2, 3]), 3, 0)
    assert (m, counts.tolist(), sorted(ends.tolist())) == (2, [3, 2], [2, 6])


def test_scan_matches_respects_range_and_oldest() -> None:
    m, counts, ends = scan_matches(RING, 5, 12, rev([2, 3]), 2, 0)
    assert (m, counts.tolist(), ends.tolist()) == (2, [2, 1], [6])
    m, counts, ends = scan_matches(RING, 0, 12, rev([2, 3]), 2, 6)  # positions 0..5 no longer held
    assert (m, counts.tolist(), sorted(ends.tolist())) == (1, [2], [6, 10])


def test_scan_matches_never_crosses_a_separator() -> None:
    m, counts, ends = scan_matches(RING, 0, 12, rev([4, 2]), 2, 0)
    assert (m, counts.tolist(), sorted(ends.tolist())) == (1, [2], [1, 5])


def test_scan_matches_empty_inputs() -> None:
    for args in ((RING, 3, 3, rev([2]), 1, 0), (RING, 0, 12, rev([]), 1, 0), (RING, 0, 12, rev([2]), 0, 0)):
        m, counts, ends = scan_matches(*args)
        assert (m, counts.size, ends.size) == (0, 0, 0)


def test_scan_matches_across_the_wrap() -> None:
    # capacity 6 holding absolute positions 4..9: slot p % 6
    ring = np.zeros(6, dtype=np.int32)
    for p, tok in zip(range(4, 10), [7, 8, -1, 7, 8, -1], strict=True):
        ring[p % 6] = tok
    m, counts, ends = scan_matches(ring, 4, 10, rev([7, 8]), 2, 4)
    assert (m, counts.tolist(), sorted(ends.tolist())) == (2, [2, 2], [5, 8])


def test_extend_matches_counts_only_survivors() -> None:
    # ends of "3" at 2 and 6; extend to [2, 3] then [1, 2, 3]
    m, more, ends = extend_matches(RING, np.array([2, 6, 10]), rev([1, 2, 3]), 1, 3, 0)
    assert (m, more.tolist(), ends.tolist()) == (3, [2, 1], [2])


def test_extend_matches_drops_candidates_that_start_before_oldest() -> None:
    m, more, ends = extend_matches(RING, np.array([2, 6]), rev([2, 3]), 2, 2, 2)
    assert (m, more.tolist(), ends.tolist()) == (2, [], [6])
    m, more, ends = extend_matches(RING, np.array([2, 6]), rev([1, 2, 3]), 1, 3, 1)
    assert (m, more.tolist(), ends.tolist()) == (2, [2], [2, 6])


def test_extend_matches_longer_than_one_chunk() -> None:
    ring = np.array(list(range(20)) + [-1], dtype=np.int32)
    m, more, ends = extend_matches(ring, np.array([19]), rev(list(range(20))), 1, 20, 0)
    assert (m, more.tolist(), ends.tolist()) == (20, [1] * 19, [19])


def test_continuations_stop_at_separator_and_at_end() -> None:
    rows = continuations(RING, np.array([0, 5, 10]), 4, 11)
    assert rows.dtype == np.int32
    assert rows.tolist() == [[1, 2, 3, 4], [2, 3, 5, -1], [3, -1, -1, -1]]
    assert continuations(RING, np.array([9]), 2, 10).tolist() == [[9, -1]]  # position 10 not written yet


def test_continuations_across_the_wrap() -> None:
    ring = np.array([3, 4, -1, 9, 1, 2], dtype=np.int32)  # slot p % 6: absolute 10..14 hold 1, 2, 3, 4, -1
    assert continuations(ring, np.array([10]), 3, 15).tolist() == [[1, 2, 3]]
    assert continuations(ring, np.array([11]), 4, 15).tolist() == [[2, 3, 4, -1]]
    assert continuations(ring, np.zeros(0, dtype=np.int64), 3, 15).shape == (0, 3)

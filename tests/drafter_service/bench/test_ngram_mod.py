"""Tests of the llama.cpp ngram-mod peer: its hashed next-token table and its chains."""

from __future__ import annotations

import numpy as np
import pytest

from drafter_service.bench.ngram_mod import LCG_MULTIPLIER, NGramModDrafter, NGramModTable
from drafter_service.bench.protocol import ReplayDrafter


def _reference_slot(tokens: list[int], size: int) -> int:
    """llama.cpp's idx(): res = res * 6364136223846793005 + token in 64-bit unsigned arithmetic, modulo size."""
    res = 0
    for tok in tokens:
        res = (res * LCG_MULTIPLIER + tok) % 2**64
    return res % size


def test_slots_follow_the_lcg_hash() -> None:
    rng = np.random.default_rng(0)
    table = NGramModTable(n=5, size=1009)
    for _ in range(50):
        window = rng.integers(0, 50000, 6).tolist()
        table.add(window)
        assert table.entries[_reference_slot(window[:5], 1009)] == window[5]
        assert table.get(window) == window[5]


def test_rolling_hash_equals_rehashing() -> None:
    rng = np.random.default_rng(1)
    table = NGramModTable(n=24, size=4 * 1024 * 1024)
    seq = rng.integers(0, 50000, 60).tolist()
    h = table.hash(seq)
    for i in range(1, 36):
        h = table.roll(h, seq[i - 1], seq[i + 23])
        assert h == table.hash(seq[i:i + 24])


def test_bulk_insertion_matches_one_by_one_with_collisions() -> None:
    rng = np.random.default_rng(2)
    tokens = rng.integers(0, 30, 400)
    bulk = NGramModTable(n=3, size=37)  # far fewer slots than windows: many overwrites
    bulk.add_windows(tokens, 5, 390)
    single = NGramModTable(n=3, size=37)
    for i in range(5, 390):
        single.add(tokens[i:i + 4].tolist())
    np.testing.assert_array_equal(bulk.entries, single.entries)
    assert bulk.used == single.used == int(np.count_nonzero(single.entries != NGramModTable.EMPTY))


def test_a_slot_keeps_the_last_token_written() -> None:
    table = NGramModTable(n=3, size=1024)
    assert table.get([1, 2, 3]) == NGramModTable.EMPTY
    table.add([1, 2, 3, 7])
    assert table.get([1, 2, 3]) == 7 and table.used == 1
    table.add([1, 2, 3, 9])
    assert table.get([1, 2, 3]) == 9 and table.used == 1
    table.reset()
    assert table.get([1, 2, 3]) == NGramModTable.EMPTY and table.used == 0


def test_drafter_is_a_replay_drafter_and_starts_empty() -> None:
    drafter = NGramModDrafter()
    assert isinstance(drafter, ReplayDrafter) and drafter.name == "ngram-mod"
    drafter.start("a", list(range(100)))  # no n-gram repeats
    assert len(drafter.propose("a", 8)) == 0
    drafter.start("b", [1, 2])  # shorter than n
    assert len(drafter.propose_chain("b", 8)) == 0
    with pytest.raises(KeyError):
        drafter.propose("missing", 8)


def test_a_later_request_follows_an_earlier_prompt() -> None:
    drafter = NGramModDrafter(n_match=3, n_min=0)
    drafter.start("first", list(range(1, 11)))
    drafter.end("first")
    drafter.start("second", [20, 4, 5, 6])
    tree = drafter.propose("second", 8)
    tree.check_invariants(max_nodes=8)
    assert list(tree.token_ids) == [7, 8, 9, 10]  # the chain stops at the empty slot after "8 9 10"
    assert list(tree.parents) == [-1, 0, 1, 2]
    assert list(tree.probs) == pytest.approx([0.9, 0.81, 0.729, 0.6561])
    assert list(drafter.propose("second", 2).token_ids) == [7, 8]
    assert list(drafter.propose_chain("second", 3).token_ids) == [7, 8, 9]


def test_drafts_shorter_than_n_min_are_dropped() -> None:
    drafter = NGramModDrafter(n_match=3)  # n_min 48, capped by the budget
    drafter.start("first", list(range(1, 11)))
    drafter.start("second", [20, 4, 5, 6])
    assert len(drafter.propose("second", 8)) == 0  # 4 tokens < min(48, 8)
    assert list(drafter.propose("second", 4).token_ids) == [7, 8, 9, 10]
    short = NGramModDrafter(n_match=3, n_min=5, n_max=4)  # n_min above n_max: a full-length chain is kept
    short.start("first", list(range(1, 11)))
    short.start("second", [20, 4, 5, 6])
    assert list(short.propose("second", 8).token_ids) == [7, 8, 9, 10]


def test_generated_tokens_are_stored_in_chunks() -> None:
    drafter = NGramModDrafter(n_match=3, n_min=0)
    output = list(range(200, 240))
    drafter.start("writer", [1])
    drafter.extend("writer", output[:20])
    drafter.propose("writer", 4)  # 20 pending tokens: not yet stored
    drafter.start("reader", [9, 200, 201, 202])
    assert len(drafter.propose("reader", 4)) == 0
    drafter.extend("writer", output[20:])
    drafter.propose("writer", 4)  # 40 pending: stored up to the last token but n
    assert list(drafter.propose("reader", 4).token_ids) == [203, 204, 205, 206]


def test_an_over_full_table_is_emptied_when_a_request_starts() -> None:
    drafter = NGramModDrafter(n_match=2, n_min=0, size=16)
    drafter.start("small", [1, 2, 3])  # 1 slot used of 16
    assert drafter.table.used == 1
    drafter.start("big", list(range(10, 30)))  # 18 more bigrams: over a quarter of the slots
    assert drafter.table.used == 0


def test_three_poorly_accepted_drafts_in_a_row_empty_the_table() -> None:
    drafter = NGramModDrafter(n_match=2, n_min=0, insert_chunk=10_000)
    drafter.start("cycle", [1, 2, 3] * 4)
    drafter.start("q", [0, 1, 2])

    def verify(appended: list[int]) -> None:
        assert list(drafter.propose("q", 8).token_ids) == [3, 1, 2, 3, 1, 2, 3, 1]
        drafter.extend("q", appended)

    verify([3, 3, 1, 2])  # 1 of 8 accepted
    verify([3, 3, 1, 2])
    verify([3, 1, 2, 3, 1, 9, 1, 2])  # 5 of 8 breaks the streak
    verify([3, 3, 1, 2])
    verify([3, 3, 1, 2])
    assert drafter.table.used > 0
    verify([3, 3, 1, 2])  # third in a row
    assert drafter.table.used == 0
    assert len(drafter.propose("q", 8)) == 0


def test_drafts_stay_chains_within_budget() -> None:
    rng = np.random.default_rng(4)
    drafter = NGramModDrafter(n_match=2, n_min=0, low_acceptance_reset=False)
    for r in range(20):
        rid = f"r{r}"
        drafter.start(rid, rng.integers(0, 5, int(rng.integers(0, 40))).tolist())
        assert len(drafter.propose(rid, 0)) == 0
        for _ in range(10):
            budget = int(rng.integers(1, 80))
            tree = drafter.propose(rid, budget)
            tree.check_invariants(max_nodes=min(budget, 64))
            assert list(tree.parents) == list(range(-1, len(tree) - 1))
            drafter.extend(rid, rng.integers(0, 5, int(rng.integers(1, 6))).tolist())
        drafter.end(rid)


def test_settings_are_checked() -> None:
    with pytest.raises(ValueError):
        NGramModDrafter(n_match=0)
    with pytest.raises(ValueError):
        NGramModDrafter(decay=0.0)
    with pytest.raises(ValueError):
        NGramModTable(n=3, size=0)

"""Prompt lookup over a request's own context."""

from __future__ import annotations

import numpy as np

from engine_client.context_ngrams import BULK, MAX_INDEXED_TOKENS, ContextNgrams


def indexed(tokens):
    ngrams = ContextNgrams()
    ngrams.extend(tokens)
    return ngrams


def test_the_longest_match_wins_and_among_equals_the_latest():
    ctx = [1, 2, 3, 10, 11, 9, 2, 3, 20, 21, 1, 2, 3]
    assert indexed(ctx).chain(ctx, 3) == ([10, 11, 9], 3)  # the earlier (1, 2, 3), not the later (2, 3)
    ngrams = indexed([5, 2, 3, 30, 31, 3, 7, 2, 3, 40, 41, 1, 2, 3])
    assert ngrams.chain([1, 2, 3], 2) == ([40, 41], 2)  # no earlier (1, 2, 3): the latest (2, 3)
    assert ngrams.chain([8, 3], 2) == ([40, 41], 1)  # no (8, 3): the latest 3
    assert ngrams.chain([31], 3) == ([3, 7, 2], 1)


def test_the_context_is_never_its_own_match_and_unknown_ends_give_nothing():
    ngrams = indexed([4, 5, 6, 7])
    assert ngrams.chain([4, 5, 6, 7], 4) == ([], 0)
    assert ngrams.chain([6, 7, 8], 4) == ([], 0) and ngrams.chain([], 4) == ([], 0)
    assert ngrams.chain([4, 5], 0) == ([], 0)
    assert ngrams.chain([9, 4, 5], 4) == ([6, 7], 2)  # a chain stops where the context does


def test_tokens_arrive_in_pieces_and_the_index_stops_at_its_bound():
    tokens = list(range(50)) * 2
    whole, pieces = indexed(tokens), ContextNgrams()
    for i in range(0, 100, 7):
        pieces.extend(tokens[i:i + 7])
    assert pieces.tokens == whole.tokens and pieces.chain([48, 49], 3) == whole.chain([48, 49], 3) == ([0, 1, 2], 2)
    big = indexed([1, 2] + [0] * MAX_INDEXED_TOKENS + [1, 2, 7])
    assert len(big.tokens) == MAX_INDEXED_TOKENS and big.chain([1, 2], 1) == ([0], 2)  # past the bound: unindexed


def test_a_prompt_indexed_at_once_looks_up_as_one_indexed_token_by_token():
    rng = np.random.default_rng(3)
    for size in (BULK, 500, MAX_INDEXED_TOKENS + 40):
        tokens = rng.integers(0, 40, size).tolist()
        at_once = indexed(tokens)
        one_by_one = ContextNgrams()
        for tok in tokens:
            one_by_one.extend([tok])
        assert at_once.tokens == one_by_one.tokens
        for end in rng.integers(1, size, 50).tolist():
            last = tokens[max(end - 3, 0):end]
            assert at_once.chain(last, 4) == one_by_one.chain(last, 4)
        assert at_once._trigrams == one_by_one._trigrams and at_once._unigrams == one_by_one._unigrams
    wide = indexed([5, 1 << 22, 6] * BULK)  # an id that does not pack: indexed token by token
    assert wide.chain([5, 1 << 22], 1) == ([6], 2)

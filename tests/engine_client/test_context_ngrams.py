"""Prompt lookup over a request's own context."""

from __future__ import annotations

from engine_client.context_ngrams import MAX_INDEXED_TOKENS, ContextNgrams


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

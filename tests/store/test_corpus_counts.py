"""Streaming n-gram counts against a naive Counter: packed and byte keys, merges, pieces, pruning."""

from collections import Counter

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from store.corpus_counts import GramCodec, NGramCounter, build_frozen_table


def naive_counts(docs, span):
    return Counter(tuple(d[i:i + span]) for d in docs for i in range(len(d) - span + 1))


def naive_select(docs, ll, fl, lc, fc):
    """(leader, [(follower, count), ...]) best first; ties to the smaller tuple."""
    grams = naive_counts(docs, ll + fl)
    by_leader: dict = {}
    for gram, count in grams.items():
        by_leader.setdefault(gram[:ll], []).append((gram[ll:], count))
    totals = {lead: sum(c for _, c in fols) for lead, fols in by_leader.items()}
    leaders = sorted(totals, key=lambda lead: (-totals[lead], lead))[:lc]
    return [(lead, sorted(by_leader[lead], key=lambda fc_: (-fc_[1], fc_[0]))[:fc]) for lead in leaders]


def counted(docs, ll, fl, vocab, **kw):
    counter = NGramCounter(ll, fl, vocab, **kw)
    for doc in docs:
        counter.add(np.asarray(doc, dtype=np.int64))
    counter.check_invariants()
    return counter


def test_hand_counted_corpus():
    docs = [[1, 2, 3, 1, 2, 3, 1], [1, 2, 9]]
    # 1-token leaders, 2-token followers: (1,2,3) x2, (2,3,1) x2, (3,1,2) x1, (1,2,9) x1
    counter = counted(docs, 1, 2, 10, chunk_grams=2)
    grams, counts = counter.counts()
    assert grams.tolist() == [[1, 2, 3], [1, 2, 9], [2, 3, 1], [3, 1, 2]] and counts.tolist() == [2, 1, 2, 1]
    assert (counter.documents, counter.tokens, counter.grams, counter.distinct) == (2, 10, 6, 4)
    arrays = counter.select(leader_capacity=2, follower_capacity=1)
    # leader 1 totals 3, leader 2 totals 2, leader 3 totals 1
    assert arrays["leaders"].tolist() == [[1], [2]] and arrays["fanout"].tolist() == [1, 1]
    assert arrays["followers"].tolist() == [[2, 3], [3, 1]] and arrays["counts"].tolist() == [2, 2]


def test_ties_go_to_the_smaller_leader_and_follower():
    counter = counted([[5, 1, 4, 2, 3, 1, 2]], 1, 1, 8)
    table = counter.table(leader_capacity=3, follower_capacity=1)
    # pairs 5>1 1>4 4>2 2>3 3>1 1>2 once each: leader 1 totals 2, the others 1 (ties: 2 and 3 first)
    assert list(table.items()) == [((1,), [((2,), 1)]), ((2,), [((3,), 1)]), ((3,), [((1,), 1)])]


def test_grams_never_cross_documents_but_pieces_join():
    whole = [3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5]
    pieces = NGramCounter(1, 3, 10)
    pieces.add(np.array(whole[:2]))
    pieces.add(np.array(whole[2:3]), continues=True)
    pieces.add(np.array(whole[3:]), continues=True)
    split = NGramCounter(1, 3, 10)
    split.add(np.array(whole[:5]))
    split.add(np.array(whole[5:]))
    one = counted([whole], 1, 3, 10)
    assert pieces.counts()[0].tolist() == one.counts()[0].tolist() and pieces.documents == 1
    assert split.grams == one.grams - 3 and split.documents == 2


def test_byte_keys_when_ids_do_not_fit_in_64_bits():
    codec = GramCodec(4, 1 << 20)
    assert not codec.packed and codec.dtype.itemsize == 16
    rng = np.random.default_rng(1)
    docs = [rng.choice([7, 1 << 19, (1 << 20) - 1, 0], size=40).tolist() for _ in range(5)]
    counter = counted(docs, 1, 3, 1 << 20, chunk_grams=16)
    grams, counts = counter.counts()
    expected = sorted(naive_counts(docs, 4).items())
    assert [tuple(g) for g in grams.tolist()] == [g for g, _ in expected]
    assert counts.tolist() == [c for _, c in expected]
    assert list(counter.table(3, 2).items()) == naive_select(docs, 1, 3, 3, 2)


def test_ids_outside_the_vocabulary_are_refused_and_nothing_is_counted():
    counter = NGramCounter(1, 3, 10)
    counter.add(np.array([1, 2, 3, 4]))
    for bad in ([1, 2, 10, 3], [1, -1, 2, 3], np.array([1.0, 2.0, 3.0, 4.0])):
        with pytest.raises(ValueError):
            counter.add(np.array(bad))
    assert (counter.documents, counter.tokens, counter.distinct) == (1, 4, 1)


def test_pruning_drops_the_rarest_and_reports_it():
    # 0 1 2 3 repeated: 4 frequent grams; then 12 grams seen once
    docs = [[0, 1, 2, 3] * 10, list(range(4, 19))]
    counter = counted(docs, 1, 3, 32, max_distinct=6, chunk_grams=8)
    grams, counts = counter.counts()
    assert counter.distinct <= 6 and counter.pruned_grams > 0
    assert counter.pruned_occurrences + int(counts.sum()) == counter.grams
    truth = naive_counts(docs, 4)
    assert {tuple(g) for g in grams.tolist()} >= {(0, 1, 2, 3), (1, 2, 3, 0), (2, 3, 0, 1), (3, 0, 1, 2)}
    assert all(c <= truth[tuple(g)] for g, c in zip(grams.tolist(), counts.tolist(), strict=True))
    assert counter.table(2, 4).query((0,)) == [((1, 2, 3), 10)]


def test_nothing_counted_gives_an_empty_table():
    counter = counted([[1, 2], []], 1, 3, 10)
    table = counter.table(4, 4)
    assert len(table) == 0 and table.query((1,)) == [] and counter.documents == 2
    table.check_invariants()


corpora = st.lists(st.lists(st.integers(0, 6), max_size=30), max_size=6)


@settings(max_examples=80, deadline=None)
@given(docs=corpora, ll=st.integers(1, 2), fl=st.integers(1, 3), lc=st.integers(1, 6), fc=st.integers(1, 5),
       chunk=st.integers(1, 40), wide=st.booleans())
def test_counter_agrees_with_a_naive_counter(docs, ll, fl, lc, fc, chunk, wide):
    vocab = (1 << 30) if wide else 7  # wide ids: byte keys for every span > 2
    scale = (1 << 30) // 7 if wide else 1
    docs = [[t * scale for t in d] for d in docs]
    counter = counted(docs, ll, fl, vocab, chunk_grams=chunk)
    grams, counts = counter.counts()
    expected = sorted(naive_counts(docs, ll + fl).items())
    assert [tuple(g) for g in grams.tolist()] == [g for g, _ in expected]
    assert counts.tolist() == [c for _, c in expected]
    table = counter.table(lc, fc)
    table.check_invariants(lc, fc)
    assert list(table.items()) == naive_select(docs, ll, fl, lc, fc)
    assert list(build_frozen_table(docs, ll, fl, lc, fc).items()) == list(table.items())


@settings(max_examples=40, deadline=None)
@given(docs=corpora, bound=st.integers(1, 12), chunk=st.integers(1, 20))
def test_pruned_counts_never_exceed_the_truth(docs, bound, chunk):
    counter = counted(docs, 1, 2, 7, max_distinct=bound, chunk_grams=chunk)
    grams, counts = counter.counts()
    truth = naive_counts(docs, 3)
    assert counter.distinct <= bound
    assert all(0 < c <= truth[tuple(g)] for g, c in zip(grams.tolist(), counts.tolist(), strict=True))
    assert counter.pruned_occurrences + int(counts.sum()) == counter.grams
    if counter.pruned_grams == 0:
        assert dict(zip(map(tuple, grams.tolist()), counts.tolist(), strict=True)) == dict(truth)

"""The tree builder: hand-built cases, invariants, and the native builder against the Python reference."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from drafter_service.core import tree_builder
from drafter_service.core.acceptance import CONTESTED_BASE, N_KEYS, AcceptanceModel, contested_key, rows_key
from drafter_service.core.tree_builder import BuildLimits, RowsSource, TableSource, build_tree, score_draft
from store.corpus_counts import build_frozen_table
from store.ngram_table import LRUNGramTable

needs_native = pytest.mark.skipif(tree_builder._native is None, reason="native tree builder not built")


def rows(*seqs, width=6):
    out = np.full((len(seqs), width), -1, dtype=np.int32)
    for i, s in enumerate(seqs):
        out[i, :len(s)] = s
    return out


@pytest.mark.parametrize("native", [False, True])
def test_agreeing_rows_make_one_likely_chain(native):
    if native and tree_builder._native is None:
        pytest.skip("native tree builder not built")
    src = RowsSource(1, 4, rows([5, 6, 7], [5, 6, 7], [5, 6, 8]))
    tree, _ = build_tree([1, 2], [src], [], AcceptanceModel(), BuildLimits(8, 8, 0.0), native=native)
    tree.check_invariants(max_nodes=8)
    # root -> 5 -> 6 -> {7 (2 of 3 occurrences), 8 (1 of 3)}
    assert tree.token_ids[:2] == (5, 6) and tree.parents[:2] == (-1, 0)
    kids = tree.children()
    assert set(kids[1]) == {7, 8}
    assert tree.probs[kids[1][7]] > tree.probs[kids[1][8]]


@pytest.mark.parametrize("native", [False, True])
def test_table_followers_are_chained_and_requeried(native):
    if native and tree_builder._native is None:
        pytest.skip("native tree builder not built")
    table = build_frozen_table([[1, 2, 3, 4, 5, 6, 7]], follower_len=3)
    tree, _ = build_tree([1], [], [TableSource(3, table, 8)], AcceptanceModel(), BuildLimits(8, 8, 0.0),
                         native=native)
    # leader 1 -> (2, 3, 4); at 4 the table is queried again: 4 -> (5, 6, 7)
    assert tree.path(len(tree) - 1) == [2, 3, 4, 5, 6, 7]


@pytest.mark.parametrize("native", [False, True])
def test_a_child_another_source_disagrees_with_has_contested_keys(native):
    if native and tree_builder._native is None:
        pytest.skip("native tree builder not built")
    session = RowsSource(0, 3, rows([5, 6]))
    store = RowsSource(1, 3, rows([9, 6], [5, 6]))
    tree, (offsets, keys, _) = build_tree([1], [session, store], [], AcceptanceModel(), BuildLimits(8, 8, 0.0),
                                          native=native)
    root = {tree.token_ids[i]: i for i in range(len(tree)) if tree.parents[i] == -1}
    # 5: session and store agree (the agreement key is last); 9: the store alone, beside the session's 5
    agreed = list(keys[offsets[root[5]]:offsets[root[5] + 1]])
    assert agreed[:2] == [rows_key(0, 3, 1.0, 1), rows_key(1, 3, 0.5, 2)]
    assert list(keys[offsets[root[9]]:offsets[root[9] + 1]]) == [contested_key(rows_key(1, 3, 0.5, 2))]
    assert all(k < CONTESTED_BASE for k in agreed[:2]) and contested_key(0) < N_KEYS


def test_nothing_known_gives_an_empty_tree():
    tree, evidence = build_tree([3], [], [TableSource(2, LRUNGramTable(), 8)], AcceptanceModel(),
                                BuildLimits(8, 8, 0.0))
    assert len(tree) == 0 and evidence[0] == (0,)


def test_score_draft_records_tested_children_only():
    model = AcceptanceModel()
    src = RowsSource(1, 4, rows([5, 6, 7], [9, 9, 9]))
    tree, evidence = build_tree([1], [src], [], model, BuildLimits(8, 8, 0.0), native=False)
    assert score_draft(tree, evidence, [5, 6, 1], model) == 2
    stats = model.snapshot()
    # root children 5 (accepted) and 9 (rejected), 6 under 5 (accepted), 7 under 6 (rejected);
    # 9's children were never tested
    recorded = sum(t for _, t in stats.values()) - model.prior_strength * len(stats)
    assert recorded == pytest.approx(4)
    prior_mass = model.prior_strength * sum(evidence[2][list(evidence[1]).index(k)] for k in stats)
    assert sum(a for a, _ in stats.values()) - prior_mass == pytest.approx(2)  # 5 and 6 accepted


@st.composite
def scenarios(draw):
    vocab = draw(st.integers(2, 6))
    tok = st.integers(0, vocab - 1)
    sources = []
    for kind in (0, 1):
        if draw(st.booleans()):
            k, w = draw(st.integers(1, 8)), draw(st.integers(1, 6))
            arr = np.array(draw(st.lists(st.lists(st.integers(-1, vocab - 1), min_size=w, max_size=w),
                                         min_size=k, max_size=k)), dtype=np.int32)
            arr = np.where(np.minimum.accumulate(arr >= 0, axis=1), arr, -1).astype(np.int32)
            sources.append(RowsSource(kind, draw(st.integers(1, 20)), arr))
    history = draw(st.lists(tok, max_size=40))
    frozen_corpus = draw(st.lists(tok, max_size=40))
    model_state = draw(st.lists(st.tuples(st.integers(0, N_KEYS - 1), st.floats(0, 50), st.floats(1, 60)),
                                max_size=40))
    limits = BuildLimits(draw(st.integers(1, 40)), draw(st.integers(1, 8)), draw(st.sampled_from([0.0, 0.01, 0.2])),
                         draw(st.integers(1, 8)))
    context = draw(st.lists(tok, min_size=1, max_size=5))
    leader_len = draw(st.integers(1, 2))
    return sources, history, frozen_corpus, model_state, limits, context, leader_len


@needs_native
@settings(max_examples=300, deadline=None)
@given(scenarios())
def test_native_builder_equals_python_reference(scenario):
    sources, history, corpus, model_state, limits, context, leader_len = scenario
    model = AcceptanceModel()
    for key, acc, trials in model_state:
        model.accepted[key], model.trials[key] = min(acc, trials), trials
    results = []
    for native in (False, True):
        dynamic = LRUNGramTable(leader_len=leader_len, follower_len=2, leader_capacity=8, follower_capacity=4)
        dynamic.update(history)
        frozen = build_frozen_table([corpus], leader_len=leader_len, follower_len=3)
        tables = [TableSource(2, dynamic, 3), TableSource(3, frozen, 2)]
        tree, (offsets, keys, priors) = build_tree(context, sources, tables, model, limits, native=native)
        tree.check_invariants(max_nodes=limits.max_nodes, max_depth=limits.max_depth)
        results.append((tree, tree.sources, list(offsets), list(keys), list(priors), list(dynamic.items())))
    assert results[0] == results[1]


@needs_native
@settings(max_examples=200, deadline=None)
@given(scenarios(), st.lists(st.integers(0, 6), max_size=10))
def test_native_scoring_equals_python_reference(scenario, accepted):
    sources, history, corpus, model_state, limits, context, leader_len = scenario
    dynamic = LRUNGramTable(leader_len=leader_len, follower_len=2)
    dynamic.update(history)
    tree, evidence = build_tree(context, sources, [TableSource(2, dynamic, 3)], AcceptanceModel(), limits)
    models = [AcceptanceModel(horizon=30), AcceptanceModel(horizon=30)]
    for model in models:
        for key, acc, trials in model_state:
            model.accepted[key], model.trials[key] = min(acc, trials), trials
    confirmed = [score_draft(tree, evidence, accepted, m, native=native)
                 for m, native in zip(models, (False, True), strict=True)]
    assert confirmed[0] == confirmed[1]
    assert list(models[0].accepted) == pytest.approx(list(models[1].accepted))
    assert list(models[0].trials) == pytest.approx(list(models[1].trials))

"""CARD's candidate cache against brute-force enumeration with a tiny random model (float32)."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from drafter_service.model.card_cache import CandidateCache  # noqa: E402

CONTEXT = [3, 17, 5, 9, 22, 5]



def next_probs(model, tokens: list[int], subset: torch.Tensor | None = None) -> torch.Tensor:
    """The model's next-token distribution after ``tokens``, by a full forward pass without a cache.

    Returns (V,) probabilities, or with ``subset`` (v,) probabilities renormalised over those token ids.
    """
    with torch.inference_mode():
        logits = model(input_ids=torch.tensor([tokens])).logits[0, -1]
    if subset is not None:
        logits = logits[subset]
    return logits.float().softmax(-1)


def brute_force(model, context: list[int], width: int, top_k: int, layers: int,
                subset: torch.Tensor | None = None) -> dict[tuple[int, ...], float]:
    """Every node CARD's construction keeps, as path -> path probability, enumerated sequence by sequence."""
    primary: list[tuple[tuple[int, ...], float]] = [((), 1.0)]
    kept: dict[tuple[int, ...], float] = {}
    for _ in range(layers):
        pool = []
        for seq, cum in primary:
            probs, toks = torch.topk(next_probs(model, context + list(seq), subset), top_k)
            if subset is not None:
                toks = subset[toks]
            pool += [(seq + (int(t),), cum * float(p)) for p, t in zip(probs, toks, strict=True)]
        pool.sort(key=lambda c: -c[1])
        primary = pool[:width]
        kept.update(primary)
    return kept


def paths(cache: CandidateCache) -> dict[tuple[int, ...], float]:
    """Every node of the cache as path -> path probability."""
    nodes = cache.tree()
    out: dict[tuple[int, ...], float] = {}
    seqs: list[tuple[int, ...]] = []
    for node in nodes:
        seq = (seqs[node.parent] if node.parent >= 0 else ()) + (node.token,)
        seqs.append(seq)
        out[seq] = node.path_prob
    return out


def assert_same(got: dict[tuple[int, ...], float], want: dict[tuple[int, ...], float]) -> None:
    assert set(got) == set(want)
    for seq, p in want.items():
        assert got[seq] == pytest.approx(p, rel=1e-4, abs=1e-7), seq


def grow(cache: CandidateCache, layers: int) -> None:
    for _ in range(layers):
        assert cache.grow() > 0
    cache.check_invariants()


@pytest.mark.parametrize("width,top_k,layers", [(4, 2, 3), (6, 3, 4), (3, 5, 5)])
def test_construction_matches_brute_force(model, width, top_k, layers):
    cache = CandidateCache(model, CONTEXT, width=width, top_k=top_k, layers_ahead=layers)
    grow(cache, layers)
    assert cache.grow() == 0  # the lookahead is reached: the worker waits for a correction
    assert_same(paths(cache), brute_force(model, CONTEXT, width, top_k, layers))


def test_a_vocabulary_subset_drafts_only_its_tokens(model):
    subset = torch.arange(1, 40, 3)  # (13,) token ids
    head = (model.get_output_embeddings().weight[subset].detach(), subset)
    cache = CandidateCache(model, CONTEXT, width=5, top_k=3, layers_ahead=3, head=head)
    grow(cache, 3)
    got = paths(cache)
    assert all(tok in subset.tolist() for seq in got for tok in seq)
    assert_same(got, brute_force(model, CONTEXT, 5, 3, 3, subset))


def test_query_budget_takes_the_most_likely_nodes_of_every_layer_as_a_tree(model):
    cache = CandidateCache(model, CONTEXT, width=6, top_k=3, layers_ahead=4)
    grow(cache, 4)
    every = paths(cache)  # the newest layer (children not chosen yet) included
    assert max(map(len, every)) == 4
    best = sorted(every.values(), reverse=True)[:7]
    nodes = cache.query(7)
    assert sorted((n.path_prob for n in nodes), reverse=True) == pytest.approx(best)
    for i, n in enumerate(nodes):
        assert n.parent < i
        if n.parent >= 0:
            assert n.path_prob <= nodes[n.parent].path_prob
            assert n.path_prob == pytest.approx(nodes[n.parent].path_prob * n.prob, rel=1e-5)


def test_correction_keeps_exactly_the_surviving_subtree(model):
    cache = CandidateCache(model, CONTEXT, width=6, top_k=3, layers_ahead=4)
    grow(cache, 3)
    before = paths(cache)
    verified = max((s for s in before if len(s) == 2), key=before.get)
    cache.correct(list(verified))
    cache.check_invariants()
    survivors = {s[2:]: p / before[verified] for s, p in before.items() if len(s) > 2 and s[:2] == verified}
    assert survivors
    # plus the new root's top-k candidates that an earlier layer's global sort had left out
    probs, toks = torch.topk(next_probs(model, CONTEXT + list(verified)), 3)
    restored = {(int(t),): float(p) for p, t in zip(probs, toks, strict=True) if (int(t),) not in survivors}
    assert_same(paths(cache), {**survivors, **restored})


def test_growth_after_correction_uses_the_verified_context(model):
    cache = CandidateCache(model, CONTEXT, width=5, top_k=3, layers_ahead=4)
    grow(cache, 2)
    before = paths(cache)
    verified = max((s for s in before if len(s) == 1), key=before.get)
    cache.correct(list(verified))
    grow(cache, 3)  # the surviving nodes' KV entries are reused, pruned ones are dropped
    context = CONTEXT + list(verified)
    for seq, p in paths(cache).items():
        want = 1.0
        for i, tok in enumerate(seq):
            want *= float(next_probs(model, context + list(seq[:i]))[tok])
        assert p == pytest.approx(want, rel=1e-4), seq


def test_leaving_the_tree_restarts_from_the_verified_tokens(model):
    cache = CandidateCache(model, CONTEXT, width=4, top_k=2, layers_ahead=3)
    grow(cache, 3)
    first = max((s for s in paths(cache) if len(s) == 1), key=paths(cache).get)
    off_tree = next(t for t in range(40) if (first[0], t) not in paths(cache))
    cache.correct([first[0], off_tree, 7])
    assert cache.query(100) == []  # nothing below the new root yet
    grow(cache, 3)
    assert_same(paths(cache), brute_force(model, CONTEXT + [first[0], off_tree, 7], 4, 2, 3))


def test_correction_before_the_first_prefill_keeps_every_token(model):
    cache = CandidateCache(model, CONTEXT, width=4, top_k=2, layers_ahead=2)
    cache.correct([11, 12])
    cache.correct([13])
    grow(cache, 2)
    assert_same(paths(cache), brute_force(model, CONTEXT + [11, 12, 13], 4, 2, 2))


def test_without_correction_the_cache_is_only_walked(model):
    cache = CandidateCache(model, CONTEXT, width=4, top_k=2, layers_ahead=1, max_nodes=64, correction=False)
    grow(cache, 4)  # no lookahead limit without correction
    before = paths(cache)
    first = max((s for s in before if len(s) == 1), key=before.get)
    cache.correct(list(first))
    assert_same(paths(cache), {s[1:]: p / before[first] for s, p in before.items() if len(s) > 1 and s[0] == first[0]})
    off_tree = next(t for t in range(40) if first + (t,) not in before)
    cache.correct([off_tree])
    assert cache.query(100) == []
    cache.grow()
    assert cache.query(100) == []  # the draft model never learns where the target went

"""Tests of the benchmark's peer drafters (prompt lookup, Arctic suffix decoding)."""

from __future__ import annotations

import numpy as np
import pytest

from drafter_service.api.tree import accept_greedy
from drafter_service.bench.peers import (
    ArcticSuffixDrafter,
    PromptLookupDrafter,
    arctic_available,
    prompt_lookup,
    suffix_draft_to_tree,
)
from drafter_service.bench.protocol import ChainDrafter, ReplayDrafter

needs_arctic = pytest.mark.skipif(not arctic_available(), reason="arctic-inference is not installed")


def _naive_prompt_lookup(tokens: list[int], max_ngram: int, min_ngram: int, k: int) -> list[int]:
    """transformers' loop, literally: longest n first, first window left to right with a continuation."""
    length = len(tokens)
    for n in range(min(max_ngram, length - 1), min_ngram - 1, -1):
        for idx in range(length - n + 1):
            if tokens[idx : idx + n] == tokens[length - n :] and idx + n < length:
                return tokens[idx + n : min(idx + n + k, length)]
    return []


@pytest.mark.parametrize(
    ("tokens", "max_ngram", "min_ngram", "k", "expected"),
    [
        # last 3-gram (1, 2, 3) occurred at 0 -> [4, 5]; the 1-gram 3 at index 6 would give 9.
        ([1, 2, 3, 4, 5, 7, 3, 9, 1, 2, 3], 3, 1, 2, [4, 5]),
        # the longest n-gram wins even when a shorter one matches further left.
        ([3, 8, 0, 2, 3, 6, 2, 3], 3, 1, 3, [6, 2, 3]),
        # only the 1-gram matches: first occurrence left to right.
        ([5, 1, 5, 2, 6, 5], 3, 1, 10, [1, 5, 2, 6, 5]),
        # min_ngram=2 rules the 1-gram out.
        ([5, 1, 5, 2, 6, 5], 3, 2, 10, []),
        # the continuation stops at the end of the sequence.
        ([7, 7], 3, 1, 10, [7]),
        # no earlier occurrence of the last token.
        ([1, 2, 3, 4], 3, 1, 10, []),
        ([4], 3, 1, 10, []),
        ([], 3, 1, 10, []),
    ],
)
def test_prompt_lookup_hand_built(tokens, max_ngram, min_ngram, k, expected) -> None:
    arr = np.asarray(tokens, dtype=np.int32)
    assert prompt_lookup(arr, max_ngram, min_ngram, k).tolist() == expected
    assert _naive_prompt_lookup(tokens, max_ngram, min_ngram, k) == expected


def test_prompt_lookup_matches_naive_on_random_sequences() -> None:
    rng = np.random.default_rng(0)
    for _ in range(2000):
        tokens = rng.integers(0, int(rng.integers(1, 5)), int(rng.integers(0, 25))).astype(np.int32)
        max_ngram = int(rng.integers(1, 5))
        min_ngram = int(rng.integers(1, max_ngram + 1))
        k = int(rng.integers(1, 8))
        got = prompt_lookup(tokens, max_ngram, min_ngram, k).tolist()
        assert got == _naive_prompt_lookup(tokens.tolist(), max_ngram, min_ngram, k)


def test_prompt_lookup_drafter_lifecycle_and_budget() -> None:
    drafter = PromptLookupDrafter(max_ngram=3, min_ngram=1, num_pred_tokens=10)
    assert isinstance(drafter, ReplayDrafter)
    drafter.start("a", [10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22, 23])
    assert len(drafter.propose("a", 8)) == 0  # 23 never occurred before
    drafter.extend("a", [10, 11])  # suffix (10, 11) occurred at the start
    tree = drafter.propose("a", 4)
    tree.check_invariants(max_nodes=4)
    assert list(tree.token_ids) == [12, 13, 14, 15]  # the max_nodes budget wins over num_pred_tokens
    assert list(tree.parents) == [-1, 0, 1, 2]
    full = drafter.propose("a", 100)
    assert list(full.token_ids) == list(range(12, 22))  # num_pred_tokens
    assert len(drafter.propose("a", 0)) == 0
    drafter.end("a")
    # nothing survives the request
    drafter.start("b", [10, 11])
    assert len(drafter.propose("b", 8)) == 0
    with pytest.raises(KeyError):
        drafter.propose("a", 8)


def test_suffix_draft_conversion_repairs_trees() -> None:
    # child listed before its parent, duplicate root children, a prob above 1 and one above its parent.
    tree = suffix_draft_to_tree(
        token_ids=[7, 5, 5, 8, 9], parents=[1, -1, -1, 2, 0], probs=[0.9, 1.5, 0.4, 0.3, 0.95], max_nodes=10)
    tree.check_invariants(max_nodes=10)
    assert tree.path(len(tree) - 1)[0] == 5
    assert sorted(tuple(tree.path(i)) for i in range(len(tree))) == [(5,), (5, 7), (5, 7, 9), (5, 8)]
    small = suffix_draft_to_tree([1, 2, 3], [-1, 0, 1], [0.5, 0.5, 0.5], max_nodes=2)
    small.check_invariants(max_nodes=2)
    assert list(small.token_ids) == [1, 2]
    assert len(suffix_draft_to_tree([], [], [], max_nodes=4)) == 0


@needs_arctic
def test_arctic_learns_across_requests() -> None:
    drafter = ArcticSuffixDrafter()
    assert drafter.name == "arctic" and isinstance(drafter, ReplayDrafter)
    assert ArcticSuffixDrafter(max_spec_factor=4.0).name == "arctic-f4"
    prompt = [100, 101, 102, 103]
    output = [7, 8, 9, 10, 11, 12, 13, 14, 15, 16] * 3
    drafter.start("first", prompt)
    drafter.extend("first", output)
    drafter.end("first")

    drafter.start("second", prompt)
    drafter.extend("second", output[:4])  # a few tokens of context let the global tree match
    tree = drafter.propose("second", 6)
    tree.check_invariants(max_nodes=6)
    n_accepted, _ = accept_greedy(tree, output[4:])
    assert n_accepted >= 4, tree
    drafter.end("second")
    # reusing a request id keeps earlier responses
    drafter.start("first", prompt)
    drafter.extend("first", output[:4])
    assert len(drafter.propose("first", 6)) > 0
    drafter.end("first")


@needs_arctic
@pytest.mark.parametrize("factor", [1.0, 4.0])
def test_arctic_trees_are_valid(factor: float) -> None:
    rng = np.random.default_rng(1)
    drafter = ArcticSuffixDrafter(max_spec_factor=factor)
    for r in range(20):
        prompt = rng.integers(0, 50, 20).tolist()
        drafter.start(f"r{r}", prompt)
        assert len(drafter.propose(f"r{r}", 0)) == 0
        for _ in range(15):
            budget = int(rng.integers(1, 40))
            drafter.propose(f"r{r}", budget).check_invariants(max_nodes=budget)
            drafter.extend(f"r{r}", rng.integers(0, 8, int(rng.integers(1, 4))).tolist())
        drafter.end(f"r{r}")
    drafter.start("empty", [])
    assert len(drafter.propose("empty", 8)) == 0
    drafter.end("empty")


@needs_arctic
@pytest.mark.parametrize("factor", [1.0, 4.0])
def test_arctic_chains_are_vllms_suffix_drafts(factor: float) -> None:
    """``vllm_suffix`` chains equal what vLLM 0.32's suffix proposer gets from the package with its defaults."""
    from arctic_inference.suffix_decoding import SuffixDecodingCache

    depth, k = 24, 6  # vLLM's suffix_decoding_max_tree_depth default; num_speculative_tokens
    cache = SuffixDecodingCache(max_tree_depth=depth, max_cached_requests=10000)
    drafter = ArcticSuffixDrafter.vllm_suffix(max_spec_factor=factor)
    assert isinstance(drafter, ChainDrafter)
    rng = np.random.default_rng(2)
    answer = rng.integers(0, 30, 60)
    chains = 0
    for r in range(6):
        prompt = rng.integers(0, 30, 10)
        out = answer.copy()
        out[rng.integers(0, out.size, 4)] = rng.integers(0, 30, 4)
        seq = prompt.astype(np.int32)
        cache.start_request(f"r{r}", seq)
        drafter.start(f"r{r}", seq.tolist())
        pos = 0
        while pos < out.size:
            step = out[pos:pos + int(rng.integers(1, 4))].astype(np.int32)
            seq = np.concatenate([seq, step])
            pos += step.size
            cache.add_active_response(f"r{r}", step.tolist())
            drafter.extend(f"r{r}", step.tolist())
            # vLLM's SuffixDecodingProposer.propose: the last max_tree_depth tokens, its own defaults otherwise
            theirs = cache.speculate(f"r{r}", seq[-depth:], max_spec_tokens=k, max_spec_factor=factor,
                                     min_token_prob=0.1)
            mine = drafter.propose_chain(f"r{r}", k)
            mine.check_invariants(max_nodes=k)
            assert list(mine.token_ids) == list(theirs.token_ids)
            assert mine.parents == tuple(range(-1, len(mine) - 1))
            chains += len(mine) > 0
        cache.stop_request(f"r{r}")
        drafter.end(f"r{r}")
    assert chains > 0

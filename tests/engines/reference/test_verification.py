"""Verification on hand-made logits, with the expected accepted path written beside each case."""

from __future__ import annotations

import pytest
import torch
from transformers.generation.logits_process import TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper

from engines.reference.verification import (
    acceptance_probability,
    child_lists,
    greedy_verify,
    process_logits,
    residual,
    sample_verify,
)

V = 10


def rows(*best: int, v: int = V) -> torch.Tensor:
    """(len(best), v) logits whose row i has its maximum at best[i]."""
    out = torch.zeros(len(best), v)
    for i, b in enumerate(best):
        out[i, b] = 5.0
    return out


#        root
#       /    \
#   n0:3      n1:5
#   /   \
# n2:7  n3:2
#        |
#       n4:1
TOKENS = [3, 5, 7, 2, 1]
PARENTS = [-1, -1, 0, 0, 3]


def test_child_lists_keep_tree_order():
    assert child_lists(PARENTS) == {-1: [0, 1], 0: [2, 3], 3: [4]}


def test_greedy_follows_the_argmax_down_to_a_leaf_then_adds_the_bonus():
    # rows:      root n0 n1 n2 n3 n4
    logits = rows(3, 2, 0, 0, 1, 9)
    # root→3 is n0, n0→2 is n3, n3→1 is n4, n4→9: bonus 9
    assert greedy_verify(logits, TOKENS, PARENTS) == ([0, 3, 4], 9)


def test_greedy_stops_at_the_first_mismatch():
    logits = rows(5, 0, 4, 0, 0, 0)
    # root→5 is n1, n1→4 has no child: bonus 4
    assert greedy_verify(logits, TOKENS, PARENTS) == ([1], 4)
    logits = rows(3, 7, 0, 6, 0, 0)
    # root→3 is n0, n0→7 is n2, n2→6 with n2 a leaf: bonus 6
    assert greedy_verify(logits, TOKENS, PARENTS) == ([0, 2], 6)


def test_greedy_accepts_nothing_when_the_root_disagrees():
    assert greedy_verify(rows(8, 3, 3, 3, 3, 3), TOKENS, PARENTS) == ([], 8)


def test_greedy_on_an_empty_tree_is_the_argmax():
    assert greedy_verify(rows(4), [], []) == ([], 4)


def test_greedy_takes_the_first_of_duplicate_siblings():
    # two children with token 6; the target says 6 then 2: the first copy (n0) is taken, its row says 2 → bonus
    assert greedy_verify(rows(6, 2, 1), [6, 6], [-1, -1]) == ([0], 2)


def test_row_count_must_match_the_tree():
    with pytest.raises(ValueError):
        greedy_verify(rows(1, 2), TOKENS, PARENTS)
    with pytest.raises(ValueError):
        sample_verify(rows(1, 2), TOKENS, PARENTS)


def test_acceptance_probability():
    assert acceptance_probability(0.3, None) == 0.3  # one-hot: p(x)
    assert acceptance_probability(0.3, 0.6) == pytest.approx(0.5)  # p(x)/q(x)
    assert acceptance_probability(0.6, 0.3) == 1.0  # capped at 1
    with pytest.raises(ValueError):
        acceptance_probability(0.3, 0.0)


def test_residual_of_a_one_hot_rejection_zeroes_the_token():
    p = torch.tensor([0.5, 0.3, 0.2])
    torch.testing.assert_close(residual(p, 0, None), torch.tensor([0.0, 0.6, 0.4]))
    torch.testing.assert_close(p, torch.tensor([0.5, 0.3, 0.2]))  # input untouched


def test_residual_of_a_sampled_rejection_is_the_normalised_positive_part():
    p = torch.tensor([0.5, 0.3, 0.2])
    q = torch.tensor([0.2, 0.6, 0.2])
    # max(p - q, 0) = [0.3, 0, 0]
    torch.testing.assert_close(residual(p, 1, q), torch.tensor([1.0, 0.0, 0.0]))
    q = torch.tensor([0.1, 0.1, 0.8])
    # max(p - q, 0) = [0.4, 0.2, 0] → [2/3, 1/3, 0]
    torch.testing.assert_close(residual(p, 2, q), torch.tensor([2 / 3, 1 / 3, 0.0]))


@pytest.mark.parametrize("temperature,top_k,top_p", [(1.0, 0, 1.0), (0.7, 0, 1.0), (1.3, 3, 1.0), (1.0, 0, 0.8),
                                                     (0.6, 5, 0.9), (1.0, 1, 1.0), (2.0, 0, 0.05)])
def test_processing_matches_transformers_warpers(temperature, top_k, top_p):
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(4, 50, generator=gen) * 3
    want = TemperatureLogitsWarper(temperature)(None, logits.clone())
    if top_k:
        want = TopKLogitsWarper(top_k)(None, want)
    if top_p < 1.0:
        want = TopPLogitsWarper(top_p)(None, want)
    torch.testing.assert_close(process_logits(logits, temperature, top_k, top_p), want.softmax(-1))
    if top_k:
        assert int((process_logits(logits, temperature, top_k, top_p) > 0).sum(-1).max()) <= top_k


def test_sampling_accepts_what_the_target_is_sure_of_and_rejects_what_it_rules_out():
    sure = rows(3, 2, 0, 0, 1, 9) * 20  # each row a point mass at the greedy answer
    gen = torch.Generator().manual_seed(0)
    for _ in range(20):
        assert sample_verify(sure, TOKENS, PARENTS, generator=gen) == ([0, 3, 4], 9)
    # top_k=1 turns any row into a point mass: same answer at any temperature
    assert sample_verify(rows(3, 2, 0, 0, 1, 9), TOKENS, PARENTS, temperature=5.0, top_k=1,
                         generator=gen) == ([0, 3, 4], 9)
    # a target that rules out both root children: nothing accepted, bonus is the sure token
    assert sample_verify(rows(8, 0, 0, 0, 0, 0) * 20, TOKENS, PARENTS, generator=gen) == ([], 8)


def test_sampling_never_returns_a_token_rejected_one_hot_at_the_same_node():
    # root row: an even split between tokens 3 and 5; the single child (token 3) is accepted half the time, and
    # when it is rejected, 3 is gone from the residual, so the bonus must be 5.
    logits = torch.full((2, V), -1e9)
    logits[0, 3] = logits[0, 5] = 0.0
    logits[1, 0] = 0.0
    gen = torch.Generator().manual_seed(1)
    outcomes = [sample_verify(logits, [3], [-1], generator=gen) for _ in range(200)]
    assert {v.bonus for v in outcomes if not v.accepted} == {5}
    assert 60 < sum(1 for v in outcomes if v.accepted) < 140


def test_sampling_is_reproducible_with_a_seeded_generator():
    logits = torch.randn(6, V, generator=torch.Generator().manual_seed(3))
    a = [sample_verify(logits, TOKENS, PARENTS, generator=torch.Generator().manual_seed(s)) for s in range(30)]
    b = [sample_verify(logits, TOKENS, PARENTS, generator=torch.Generator().manual_seed(s)) for s in range(30)]
    assert a == b
    assert len({(tuple(v.accepted), v.bonus) for v in a}) > 3


def test_draft_distributions_must_cover_every_node():
    with pytest.raises(ValueError):
        sample_verify(rows(1, 2), [1], [-1], draft_probs=[None, None])

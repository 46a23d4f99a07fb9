"""DraftTree helpers: invariants, greedy acceptance, subtrees."""

import pytest

from drafter_service.api.tree import DraftTree, accept_greedy, best_chain, chain, merge_trees

# root -> 5 -> 6 -> 7 ; root -> 8 -> 9 ; 5 -> 4
TREE = DraftTree((5, 8, 6, 9, 7, 4), (-1, -1, 0, 1, 2, 0), (0.9, 0.5, 0.8, 0.4, 0.7, 0.1), 3.4)


def test_valid_tree_passes_invariants():
    TREE.check_invariants(max_nodes=6, max_depth=3)
    assert TREE.depth == 3


@pytest.mark.parametrize("tree, message", [
    (DraftTree((1, 2), (-1, 1), (0.5, 0.4), 0.9), "parent"),
    (DraftTree((1, 1), (-1, -1), (0.5, 0.4), 0.9), "duplicate"),
    (DraftTree((1,), (-1,), (0.0,), 0.0), "probability"),
    (DraftTree((1, 2), (-1, 0), (0.5, 0.6), 1.1), "more likely"),
    (DraftTree((1,), (-1,), (0.5,), 0.7), "score"),
])
def test_broken_trees_fail_invariants(tree, message):
    with pytest.raises(AssertionError, match=message):
        tree.check_invariants()


def test_budget_and_depth_limits_are_checked():
    with pytest.raises(AssertionError, match="budget"):
        TREE.check_invariants(max_nodes=5)
    with pytest.raises(AssertionError, match="depth"):
        TREE.check_invariants(max_depth=2)


@pytest.mark.parametrize("continuation, expected", [
    ([5, 6, 7, 1], (3, 4)),   # whole first branch
    ([5, 4, 9], (2, 5)),      # side branch
    ([8, 9], (2, 3)),
    ([5, 9], (1, 0)),         # partly right
    ([3], (0, -1)),           # wrong
    ([], (0, -1)),
])
def test_accept_greedy_takes_longest_matching_path(continuation, expected):
    assert accept_greedy(TREE, continuation) == expected


def test_subtree_reroots_below_a_node():
    sub = TREE.subtree(0)  # below token 5: 6 -> 7 and 4
    assert sub.token_ids == (6, 7, 4)
    assert sub.parents == (-1, 0, -1)
    assert sub.probs[0] == pytest.approx(0.8 / 0.9)
    sub.check_invariants()


def test_chain_and_path():
    c = chain([3, 4, 5], [0.9, 0.8, 0.7])
    c.check_invariants()
    assert c.path(2) == [3, 4, 5]
    assert TREE.path(4) == [5, 6, 7]


def test_prefix_keeps_the_first_nodes_as_a_tree():
    p = TREE.prefix(4)  # 5, 8, 6 (under 5), 9 (under 8)
    assert p.token_ids == (5, 8, 6, 9) and p.parents == (-1, -1, 0, 1)
    assert p.score == pytest.approx(0.9 + 0.5 + 0.8 + 0.4)
    p.check_invariants()
    assert TREE.prefix(10) is TREE and len(TREE.prefix(0)) == 0


def test_merge_unites_paths_and_keeps_the_larger_conditional_estimate():
    a = DraftTree((5, 6, 7), (-1, 0, -1), (0.8, 0.5, 0.1), 1.4, ("store",) * 3)
    b = DraftTree((5, 9, 6), (-1, 0, 0), (0.9, 0.6, 0.2), 1.7, ("model",) * 3)
    merged = merge_trees(a, b, 10)
    merged.check_invariants(max_nodes=10)
    paths = {tuple(merged.path(i)): (merged.probs[i], merged.sources[i]) for i in range(len(merged))}
    # (5,) is "model"'s 0.9; under it, "store"'s 6 keeps its conditional 0.5 / 0.8 (larger than "model"'s 0.2 / 0.9)
    assert paths == {(5,): (0.9, "model"), (5, 6): (pytest.approx(0.9 * 0.5 / 0.8), "store"),
                     (5, 9): (pytest.approx(0.6), "model"), (7,): (0.1, "store")}
    assert list(merged.probs) == sorted(merged.probs, reverse=True)  # best first: every prefix is the best tree


def test_merge_rates_a_continuation_by_the_merged_estimate_of_its_parent():
    # The model-free tree is sure of 1 but knows nothing below it; the model doubts 1 but is sure of what follows.
    store = chain([1], [0.9], "store")
    model = chain([1, 2, 3], [0.3, 0.27, 0.243], "model")
    merged = merge_trees(store, model, 10)
    merged.check_invariants(max_nodes=10)
    assert [tuple(merged.path(i)) for i in range(3)] == [(1,), (1, 2), (1, 2, 3)]
    assert merged.probs == pytest.approx((0.9, 0.81, 0.729))  # 0.9, then the model's conditionals of 0.9 each
    assert merged.sources == ("store", "model", "model")
    # Worth verifying at a minimum of 0.5, which the model's own path estimates (0.27, 0.243) are not.
    assert best_chain(merged, 3, min_prob=0.5) == [1, 2, 3]


def test_merge_cuts_to_the_budget_best_first():
    a = chain([1, 2, 3, 4], [0.9, 0.8, 0.3, 0.2], "session")
    b = DraftTree((1, 7, 8), (-1, 0, 1), (0.9, 0.7, 0.6), 2.2, ("model",) * 3)
    merged = merge_trees(a, b, 4)
    merged.check_invariants(max_nodes=4)
    assert [tuple(merged.path(i)) for i in range(4)] == [(1,), (1, 2), (1, 7), (1, 7, 8)]
    assert merge_trees(a, DraftTree(), 3) == a.prefix(3)
    assert merge_trees(DraftTree(), b, 2) == b.prefix(2)

"""PackedTrees: following tokens down many trees and cutting the chain below, against hand-made answers and a naive
walk over DraftTree."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st
from tree_strategies import trees

from drafter_service.api.tree import DraftTree
from engine_client.packed_trees import PackedTrees

# tree 0: root -> 5 (0.9) -> 6 (0.8) -> 7 (0.4); root -> 9 (0.5) -> 10 (0.45); 6 -> 8 (0.3)
FIRST = DraftTree((5, 9, 6, 10, 7, 8), (-1, -1, 0, 1, 2, 2), (0.9, 0.5, 0.8, 0.45, 0.4, 0.3))
# tree 1: root -> 5 (0.6) -> 1 (0.2)
SECOND = DraftTree((5, 1), (-1, 0), (0.6, 0.2))


def test_each_tree_is_followed_from_its_own_root():
    packed = PackedTrees.from_trees([FIRST, DraftTree(), SECOND], width=8)
    assert packed.trees == 3
    assert packed.descend(0, []) == 0  # no tokens: stay at the root
    assert packed.chain(packed.descend(0, [5, 6]), 8)[0] == [7]  # below 6: 7 (0.4) before 8 (0.3)
    assert packed.descend(0, [5, 9]) == -1  # 9 is not below 5
    assert packed.descend(1, [5]) == -1  # the empty tree has no children
    assert packed.chain(packed.descend(2, [5, 1]), 8) == ([], [])  # the leaf 1
    assert packed.descend(2, [9]) == -1  # 9 is in the first tree only


def test_the_chain_takes_the_likeliest_child_with_estimates_given_its_start():
    packed = PackedTrees.from_trees([FIRST, SECOND], width=8)
    assert packed.chain(0, 8) == ([5, 6, 7], [0.9, 0.8, 0.4])
    assert packed.chain(0, 2) == ([5, 6], [0.9, 0.8])
    five = packed.descend(0, [5])
    tokens, probs = packed.chain(five, 8)
    assert tokens == [6, 7]
    assert probs == [0.8 / 0.9, 0.4 / 0.9]  # the path through 5 was confirmed: estimates given it
    cut = PackedTrees.from_trees([FIRST, SECOND], width=8, min_prob=0.5)
    assert cut.chain(cut.descend(0, [5]), 8)[0] == [6]  # 7 at 0.44 given 5 is under the minimum
    assert PackedTrees.from_trees([FIRST], width=2).chain(0, 8)[0] == [5, 6]  # no longer than the width
    assert packed.chain(packed.descend(0, [9, 10]), 8) == ([], [])  # a leaf
    assert packed.chain(1, 8) == ([5, 1], [0.6, 0.2])


def naive_chain(tree: DraftTree, path: list[int], max_len: int) -> list[int] | None:
    children = tree.children()
    node = -1
    for tok in path:
        if tok not in children.get(node, {}):
            return None
        node = children[node][tok]
    chain: list[int] = []
    while len(chain) < max_len and children.get(node):
        best = max(children[node].values(), key=lambda c: (tree.probs[c], -c))
        chain.append(tree.token_ids[best])
        node = best
    return chain


@settings(max_examples=150, deadline=None)
@given(st.lists(trees(), min_size=1, max_size=4), st.data())
def test_descend_and_chain_match_a_walk_over_each_tree_and_chain_after_is_both(forest, data):
    packed = PackedTrees.from_trees(forest, width=5)
    for t, tree in enumerate(forest):
        path = data.draw(st.lists(st.integers(0, 6), max_size=3))
        max_len = data.draw(st.integers(0, 5))
        expected = naive_chain(tree, path, max_len)
        code = packed.descend(t, path)
        if expected is None:
            assert code == -1
        else:
            assert code >= 0
            assert packed.chain(code, max_len)[0] == expected
        before = data.draw(st.lists(st.integers(0, 6), max_size=2))  # tokens before the path: not followed
        assert packed.chain_after(t, before + path, len(before), max_len) == (
            packed.chain(code, max_len) if code >= 0 else ([], []))

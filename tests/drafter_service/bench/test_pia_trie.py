"""Tests of the PIA lookahead / SGLang NGRAM peer: its shared branch trie and its drafts."""

from __future__ import annotations

import numpy as np
import pytest

from drafter_service.api.tree import accept_greedy
from drafter_service.bench.pia_trie import LookaheadTrie, PiaLookaheadDrafter
from drafter_service.bench.protocol import ReplayDrafter


def _serve(drafter: PiaLookaheadDrafter, rid: str, prompt: list[int], output: list[int]) -> None:
    """One finished request: its prompt, its whole output, its end."""
    drafter.start(rid, prompt)
    drafter.extend(rid, output)
    drafter.end(rid)


def _paths(trie: LookaheadTrie) -> dict[tuple[int, ...], int]:
    """Every root path of the trie with its node's count."""
    out: dict[tuple[int, ...], int] = {}
    stack = [((), trie.root)]
    while stack:
        path, node = stack.pop()
        for tok, child in (node.children or {}).items():
            out[path + (tok,)] = child.count
            stack.append((path + (tok,), child))
    return out


def _naive_windows(tokens: list[int], branch_length: int) -> dict[tuple[int, ...], int]:
    """Counts of every prefix of every window of up to branch_length tokens."""
    out: dict[tuple[int, ...], int] = {}
    for i in range(len(tokens)):
        for j in range(i + 1, min(len(tokens), i + branch_length) + 1):
            out[tuple(tokens[i:j])] = out.get(tuple(tokens[i:j]), 0) + 1
    return out


def test_trie_counts_each_window_once_however_tokens_arrive() -> None:
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, 4, 40).tolist()
    whole = LookaheadTrie(5)
    whole.insert([], tokens)
    pieces = LookaheadTrie(5)
    cursors: list = []
    cut = 0
    while cut < len(tokens):
        step = int(rng.integers(1, 6))
        cursors = pieces.insert(cursors, tokens[cut:cut + step])
        cut += step
    expected = _naive_windows(tokens, 5)
    assert _paths(whole) == expected
    assert _paths(pieces) == expected
    assert whole.size == pieces.size == len(expected)


def test_trie_remove_takes_back_exactly_one_sequence() -> None:
    trie = LookaheadTrie(4)
    kept = [1, 2, 3, 1, 2, 4]
    trie.insert([], kept)
    gone = [2, 3, 1, 2, 9, 9]
    trie.insert([], gone)
    trie.remove(gone)
    assert _paths(trie) == _naive_windows(kept, 4)
    assert trie.size == len(_naive_windows(kept, 4))
    trie.remove(kept)
    assert trie.size == 0 and not trie.root.children


def test_drafter_is_a_replay_drafter_and_starts_empty() -> None:
    drafter = PiaLookaheadDrafter()
    assert isinstance(drafter, ReplayDrafter) and drafter.name == "pia"
    drafter.start("a", [1, 2, 3])  # no token repeats: no branch continues the context
    assert len(drafter.propose("a", 8)) == 0
    assert len(drafter.propose_chain("a", 8)) == 0
    drafter.start("b", [])
    assert len(drafter.propose("b", 8)) == 0
    with pytest.raises(KeyError):
        drafter.propose("missing", 8)
    with pytest.raises(ValueError):
        drafter.start("a", [4])


def test_a_later_request_drafts_an_earlier_output() -> None:
    drafter = PiaLookaheadDrafter()
    _serve(drafter, "first", [100, 101], [5, 6, 7, 8, 9, 10])
    drafter.start("second", [50, 5, 6])
    tree = drafter.propose("second", 8)
    tree.check_invariants(max_nodes=8)
    assert accept_greedy(tree, [7, 8, 9, 10])[0] == 4
    assert list(drafter.propose_chain("second", 3).token_ids) == [7, 8, 9]


def test_prompt_branches_serve_their_request_then_leave() -> None:
    drafter = PiaLookaheadDrafter()
    drafter.start("a", [5, 6, 7, 8, 5, 6])
    assert accept_greedy(drafter.propose("a", 4), [7, 8])[0] == 2  # the request's own prompt repeats
    drafter.end("a")
    assert drafter.trie.size == 0  # no output: nothing stays
    drafter.start("b", [9, 5, 6])
    assert len(drafter.propose("b", 4)) == 0


def test_overlapping_requests_keep_each_others_prompt_branches() -> None:
    drafter = PiaLookaheadDrafter()
    drafter.start("a", [5, 6, 7, 5, 6])
    drafter.start("b", [5, 6, 7, 5, 6])
    drafter.end("a")
    assert list(drafter.propose_chain("b", 1).token_ids) == [7]
    drafter.end("b")
    assert drafter.trie.size == 0


def test_multi_branch_tree_orders_siblings_by_count() -> None:
    drafter = PiaLookaheadDrafter()
    for i, out in enumerate(([1, 2, 3], [1, 2, 3], [1, 2, 4])):
        _serve(drafter, f"r{i}", [90 + i], out)
    drafter.start("q", [0, 1, 2])
    tree = drafter.propose("q", 8)
    tree.check_invariants(max_nodes=8)
    assert list(tree.token_ids) == [3, 4] and list(tree.parents) == [-1, -1]
    assert tree.probs[0] == pytest.approx(2 / 3) and tree.probs[1] == pytest.approx(1 / 3)
    assert list(drafter.propose("q", 1).token_ids) == [3]


def test_longest_match_comes_first() -> None:
    drafter = PiaLookaheadDrafter()
    _serve(drafter, "r0", [90], [7, 1, 2, 3])
    _serve(drafter, "r1", [91], [8, 1, 2, 4])
    _serve(drafter, "r2", [92], [8, 1, 2, 4])
    drafter.start("q", [7, 1, 2])  # after "1 2", 4 is the more frequent; after "7 1 2" only 3 followed
    tree = drafter.propose("q", 8)
    assert tree.token_ids[0] == 3 and tree.parents[0] == -1
    assert set(tree.token_ids) == {3, 4}  # the shorter match adds its sibling
    assert list(drafter.propose_chain("q", 4).token_ids) == [3]


def test_chain_is_the_branch_with_the_largest_expected_length() -> None:
    drafter = PiaLookaheadDrafter()
    _serve(drafter, "r0", [90], [7, 1, 2, 3])
    for i in range(3):
        _serve(drafter, f"s{i}", [91 + i], [8, 1, 2, 4, 5, 6, 9])
    drafter.start("q", [7, 1, 2])
    # "7 1 2" -> [3] expects 1 token; "1 2" -> [4, 5, 6] expects 3 * 0.75
    assert list(drafter.propose_chain("q", 1).token_ids) == [3]
    line = drafter.propose_chain("q", 3)
    assert list(line.token_ids) == [4, 5, 6]
    assert list(line.probs) == pytest.approx([0.75, 0.75, 0.75])
    assert drafter.propose("q", 8).token_ids[0] == 3  # the tree still starts from the longest match


def test_bfs_mode_takes_recent_children_first() -> None:
    recency = PiaLookaheadDrafter(match_type="BFS")
    frequency = PiaLookaheadDrafter()
    for drafter in (recency, frequency):
        for i, out in enumerate(([1, 2, 3], [1, 2, 3], [1, 2, 4])):
            _serve(drafter, f"r{i}", [90 + i], out)
        drafter.start("q", [0, 1, 2])
    assert recency.propose("q", 8).token_ids[0] == 4
    assert frequency.propose("q", 8).token_ids[0] == 3


@pytest.mark.parametrize("match_type", ["PROB", "BFS"])
def test_trees_and_chains_stay_valid_and_within_budget(match_type: str) -> None:
    rng = np.random.default_rng(3)
    drafter = PiaLookaheadDrafter(branch_length=6, max_match_window=3, match_type=match_type)  # type: ignore[arg-type]
    for r in range(30):
        rid = f"r{r}"
        drafter.start(rid, rng.integers(0, 6, int(rng.integers(0, 30))).tolist())
        assert len(drafter.propose(rid, 0)) == 0 and len(drafter.propose_chain(rid, 0)) == 0
        for _ in range(12):
            budget = int(rng.integers(1, 20))
            tree = drafter.propose(rid, budget)
            tree.check_invariants(max_nodes=budget, max_depth=5)
            line = drafter.propose_chain(rid, budget)
            line.check_invariants(max_nodes=budget)
            assert list(line.parents) == list(range(-1, len(line) - 1))
            drafter.extend(rid, rng.integers(0, 6, int(rng.integers(1, 5))).tolist())
        drafter.end(rid)


def test_capacity_evicts_the_least_recently_used_branches() -> None:
    drafter = PiaLookaheadDrafter(branch_length=4, max_match_window=2, capacity=50, evict_to=0.5)
    outputs = [[1000 * i + j for j in range(10)] for i in range(1, 6)]  # 34 nodes each, no token shared
    for i, out in enumerate(outputs):
        _serve(drafter, f"r{i}", [], out)
        assert drafter.trie.size <= 50
    drafter.start("recent", outputs[-1][7:9])  # the last output's last branches are the most recent
    assert list(drafter.propose("recent", 4).token_ids) == [outputs[-1][9]]
    drafter.start("old", outputs[0][:2])
    assert len(drafter.propose("old", 4)) == 0


def test_settings_are_checked() -> None:
    with pytest.raises(ValueError):
        PiaLookaheadDrafter(branch_length=12, max_match_window=12)
    with pytest.raises(ValueError):
        PiaLookaheadDrafter(min_match_window=3, max_match_window=2)
    with pytest.raises(ValueError):
        PiaLookaheadDrafter(min_bfs_breadth=4, max_bfs_breadth=2)
    with pytest.raises(ValueError):
        PiaLookaheadDrafter(match_type="DFS")  # type: ignore[arg-type]

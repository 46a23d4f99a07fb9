"""The draft tree every drafter returns: flat arrays of tokens, parent links and acceptance estimates."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

TokenIds = Sequence[int] | np.ndarray
"""Token ids as callers pass them: a sequence of ints or a (n,) integer array."""

@dataclass(frozen=True)
class DraftTree:
    """A tree of draft tokens rooted at the last token of the sequence.

    Attributes:
        token_ids: (n,) token of each node.
        parents: (n,) index of each node's parent, or -1 when the parent is the last context token;
            ``parents[i] < i``.
        probs: (n,) estimated probability that each node is accepted (its whole path matches the
            target), in (0, 1]; a child's estimate never exceeds its parent's.
        score: expected number of accepted draft tokens (the sum of ``probs``).
        sources: (n,) short name of the source that proposed each node (for statistics only).
    """

    token_ids: tuple[int, ...] = ()
    parents: tuple[int, ...] = ()
    probs: tuple[float, ...] = ()
    score: float = 0.0
    sources: tuple[str, ...] = field(default=(), compare=False)

    def __len__(self) -> int:
        return len(self.token_ids)

    @property
    def depth(self) -> int:
        """Length of the longest root-to-leaf path."""
        depths: list[int] = []
        for p in self.parents:
            depths.append(1 if p < 0 else depths[p] + 1)
        return max(depths, default=0)

    def children(self) -> dict[int, dict[int, int]]:
        """Map parent index (-1 for the root) to {token: child index}."""
        out: dict[int, dict[int, int]] = {}
        for i, (tok, p) in enumerate(zip(self.token_ids, self.parents, strict=True)):
            out.setdefault(p, {})[tok] = i
        return out

    def path(self, node: int) -> list[int]:
        """Tokens from the root down to ``node`` inclusive."""
        toks: list[int] = []
        while node >= 0:
            toks.append(self.token_ids[node])
            node = self.parents[node]
        return toks[::-1]

    def subtree(self, node: int) -> DraftTree:
        """The part of the tree strictly below ``node``, re-rooted there (probabilities rescaled)."""
        keep: dict[int, int] = {node: -1}
        toks: list[int] = []
        parents: list[int] = []
        probs: list[float] = []
        srcs: list[str] = []
        base = self.probs[node] if node >= 0 else 1.0
        for i in range(node + 1, len(self.token_ids)):
            p = self.parents[i]
            if p in keep:
                keep[i] = len(toks)
                toks.append(self.token_ids[i])
                parents.append(keep[p])
                probs.append(min(1.0, self.probs[i] / base) if base > 0 else self.probs[i])
                if self.sources:
                    srcs.append(self.sources[i])
        return DraftTree(tuple(toks), tuple(parents), tuple(probs), float(sum(probs)), tuple(srcs))

    def prefix(self, n: int) -> DraftTree:
        """The first ``n`` nodes: still a tree, since every parent comes before its children."""
        if n >= len(self.token_ids):
            return self
        probs = self.probs[:n]
        return DraftTree(self.token_ids[:n], self.parents[:n], probs, float(sum(probs)), self.sources[:n])

    def check_invariants(self, max_nodes: int | None = None, max_depth: int | None = None) -> None:
        """Raise AssertionError when the tree is malformed.

        Checks: equal lengths, ``-1 <= parents[i] < i``, no two siblings with the same token,
        probabilities in (0, 1] and non-increasing along every path, score equal to their sum,
        and the optional node and depth budgets.
        """
        n = len(self.token_ids)
        assert len(self.parents) == n and len(self.probs) == n, "array lengths differ"
        assert not self.sources or len(self.sources) == n, "sources length differs"
        seen: set[tuple[int, int]] = set()
        for i, (tok, p) in enumerate(zip(self.token_ids, self.parents, strict=True)):
            assert -1 <= p < i, f"node {i} has parent {p}"
            assert tok >= 0, f"node {i} has negative token {tok}"
            assert (p, tok) not in seen, f"duplicate sibling token {tok} under {p}"
            seen.add((p, tok))
            assert 0.0 < self.probs[i] <= 1.0, f"node {i} has probability {self.probs[i]}"
            if p >= 0:
                assert self.probs[i] <= self.probs[p] + 1e-9, f"node {i} more likely than its parent"
        assert abs(self.score - sum(self.probs)) <= 1e-6 * max(1, n), "score is not the sum of probs"
        if max_nodes is not None:
            assert n <= max_nodes, f"{n} nodes exceed the budget {max_nodes}"
        if max_depth is not None:
            assert self.depth <= max_depth, f"depth {self.depth} exceeds {max_depth}"


EMPTY_TREE = DraftTree()


def accept_greedy(tree: DraftTree, continuation: Sequence[int]) -> tuple[int, int]:
    """Greedy verification against a known continuation.

    Args:
        tree: the draft.
        continuation: the tokens the target produces next.

    Returns:
        (number of accepted draft tokens, index of the last accepted node or -1).
    """
    kids = tree.children()
    node = -1
    n = 0
    while n < len(continuation):
        nxt = kids.get(node, {}).get(continuation[n])
        if nxt is None:
            break
        node = nxt
        n += 1
    return n, node


def chain(tokens: Sequence[int], probs: Sequence[float] | None = None, source: str = "") -> DraftTree:
    """A single-branch tree (each token the child of the previous one)."""
    n = len(tokens)
    ps = tuple(probs) if probs is not None else (1.0,) * n
    return DraftTree(tuple(int(t) for t in tokens), tuple(range(-1, n - 1)), ps, float(sum(ps)),
                     (source,) * n if source else ())


def merge_trees(first: DraftTree, second: DraftTree, budget: int) -> DraftTree:
    """The union of two trees over the same root, cut to the ``budget`` most likely nodes.

    Each tree's estimates are read as conditional ones (a node's estimate over its parent's): a path proposed by
    both keeps the larger conditional at every node, and every node's estimate is its parent's merged estimate
    times its conditional. So a continuation one tree proposes below a node the other rates higher is rated as
    likely as that node makes it (its source stays its own tree's). Nodes come best first, so every ``prefix`` of
    the result is the best tree of its size.

    Args:
        first, second: trees rooted at the same sequence end.
        budget: most nodes in the result.
    """
    if not len(second) or budget <= 0:
        return first.prefix(max(0, budget))
    if not len(first):
        return second.prefix(budget)
    toks: list[int] = []
    parents: list[int] = []
    conds: list[float] = []  # the larger conditional estimate of the node over its parent
    depth: list[int] = []
    srcs: list[str] = []
    index: dict[tuple[int, int], int] = {}
    for tree in (first, second):
        local: list[int] = []  # this tree's node -> merged node
        for i, (tok, p) in enumerate(zip(tree.token_ids, tree.parents, strict=True)):
            parent = local[p] if p >= 0 else -1
            cond = min(1.0, tree.probs[i] / tree.probs[p]) if p >= 0 else tree.probs[i]
            key = (parent, tok)
            j = index.get(key)
            src = tree.sources[i] if tree.sources else ""
            if j is None:
                j = index[key] = len(toks)
                toks.append(tok)
                parents.append(parent)
                conds.append(cond)
                depth.append(depth[parent] + 1 if parent >= 0 else 1)
                srcs.append(src)
            elif cond > conds[j]:
                conds[j] = cond
                srcs[j] = src
            local.append(j)
    probs: list[float] = []  # parents come before their children
    for j, parent in enumerate(parents):
        probs.append(conds[j] * probs[parent] if parent >= 0 else conds[j])
    order = sorted(range(len(toks)), key=lambda j: (-probs[j], depth[j]))[:budget]
    new = {-1: -1}
    out_t: list[int] = []
    out_p: list[int] = []
    out_pr: list[float] = []
    out_s: list[str] = []
    for j in order:
        if parents[j] not in new:
            continue  # only when a child ties its parent and sorts first: never happens after the depth key
        new[j] = len(out_t)
        out_t.append(toks[j])
        out_p.append(new[parents[j]])
        out_pr.append(probs[j])
        out_s.append(srcs[j])
    return DraftTree(tuple(out_t), tuple(out_p), tuple(out_pr), float(sum(out_pr)),
                     tuple(out_s) if any(out_s) else ())


def best_chain(tree: DraftTree, max_len: int, min_prob: float = 0.0) -> list[int]:
    """The tree's path that an engine verifying one chain per request should take, as tokens from the root.

    Each node's estimate is the probability that its whole path is accepted, so a path of nodes ``n1..nL`` is
    expected to yield ``sum(probs)`` accepted tokens. A token is worth verifying when its estimate is at least
    ``min_prob`` (what one more verified token costs, in accepted tokens); the chain returned maximises
    ``sum(probs[n] - min_prob)`` over paths of at most ``max_len`` nodes, and is empty when no path gains.

    Args:
        tree: the draft.
        max_len: most tokens in the chain (the engine's speculative length); <= 0 gives [].
        min_prob: the acceptance estimate one more token must reach to be worth its verification.
    """
    return [tree.token_ids[i] for i in best_chain_nodes(tree, max_len, min_prob)]


def best_chain_nodes(tree: DraftTree, max_len: int, min_prob: float = 0.0) -> list[int]:
    """``best_chain`` as node indices, from the root's child down (their ``probs`` are the chain's estimates)."""
    n = len(tree)
    if n == 0 or max_len <= 0:
        return []
    gain = [0.0] * n
    depth = [0] * n
    best, best_gain = -1, 0.0
    for i, (parent, prob) in enumerate(zip(tree.parents, tree.probs, strict=True)):
        d = depth[parent] + 1 if parent >= 0 else 1
        depth[i] = d
        if d > max_len:
            gain[i] = float("-inf")
            continue
        gain[i] = (gain[parent] if parent >= 0 else 0.0) + prob - min_prob
        if gain[i] > best_gain:
            best, best_gain = i, gain[i]
    nodes: list[int] = []
    while best >= 0:
        nodes.append(best)
        best = tree.parents[best]
    return nodes[::-1]

"""Many draft trees indexed for pre-speculation: follow tokens down a tree, then read the chain (or the subtree)
below, in a few dictionary and list lookups per request.

Pre-speculation looks up every running request's next chain in the tree drafted for an earlier step: it follows
the tokens the engine appended since (the accepted draft tokens and the target's own token) down that tree, then
takes the most likely chain below. The index is built on the sender's thread when a reply lands (numpy over every
node at once), so that the engine's thread does only the lookups.

Nodes are named by codes: tree ``t``'s root (the last token of its context) is code ``t``, flat node ``g`` is code
``trees + g``. An edge is keyed ``parent code << 32 | token``.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from drafter_service.api.tree import EMPTY_TREE, DraftTree
from engine_client.step_batch import PackedBatch

__all__ = ["PackedTrees"]


class PackedTrees:
    """Draft trees indexed by code (see the module docstring), with every code's likeliest child.

    Attributes:
        trees: how many trees (codes ``0 .. trees - 1`` are their roots).
        edges: ``parent code << 32 | token`` -> child code.
        best: per code, the code of its child with the largest estimate (-1: a leaf).
        token: per code, its token (-1 for a root).
        prob: per code, its estimate (1.0 for a root).
        width, min_prob: chains stop after ``width`` tokens, and before a token estimated under ``min_prob``
            given the code they start from (subtrees leave out such nodes, at any depth).
        parent: (n,) int64, the code of each flat node's parent (for ``subtree``).
        offsets: (trees + 1,) int64, tree ``t`` is flat nodes ``offsets[t] .. offsets[t + 1] - 1``.
    """

    __slots__ = ("trees", "edges", "best", "token", "prob", "width", "min_prob", "parent", "offsets")

    def __init__(self, token_ids: Sequence[int] | np.ndarray, parents: Sequence[int] | np.ndarray,
                 probs: Sequence[float] | np.ndarray, offsets: Sequence[int] | np.ndarray, width: int,
                 min_prob: float = 0.0) -> None:
        """Index trees given as flat arrays: tree ``t`` is nodes ``offsets[t] .. offsets[t + 1] - 1``, its parents
        local to it (-1 for its root), as a DraftBatch reply carries them; chains are cut to ``width`` tokens."""
        offsets = np.asarray(offsets, np.int64)
        trees = max(len(offsets) - 1, 0)
        tokens = np.asarray(token_ids, np.int64)
        local = np.asarray(parents, np.int64)
        node_prob = np.asarray(probs, np.float64)
        n = len(tokens)
        tree_of = np.repeat(np.arange(trees, dtype=np.int64), np.diff(offsets)) if trees else np.zeros(0, np.int64)
        parent = np.where(local < 0, tree_of, trees + offsets[:-1][tree_of] + local) if n else tree_of
        # per parent, its likeliest child (the first in node order among equals): a group maximum, not a sort
        top = np.full(trees + n, -np.inf)
        np.maximum.at(top, parent, node_prob)
        likeliest = np.flatnonzero(node_prob == top[parent])
        first = np.full(trees + n, n, np.int64)
        np.minimum.at(first, parent[likeliest], likeliest)
        best = np.where(first < n, trees + first, -1)
        self.trees, self.width, self.min_prob = trees, width, min_prob
        self.edges: dict[int, int] = dict(zip(((parent << 32) | tokens).tolist(), range(trees, trees + n),
                                              strict=True))
        # chains are walked on demand (``chain``): the engine's thread asks for one per row, while cutting every
        # code's chain here would make Python objects for every node on the sender's thread
        self.best: list[int] = best.tolist()
        self.token: list[int] = [-1] * trees + tokens.tolist()
        self.prob: list[float] = [1.0] * trees + node_prob.tolist()
        self.parent: np.ndarray = parent  # (n,) int64 parent codes; kept as it is, read by ``subtree`` only
        self.offsets: np.ndarray = offsets  # (trees + 1,) int64

    @classmethod
    def of_batch(cls, batch: PackedBatch, width: int, min_prob: float = 0.0) -> PackedTrees:
        """Index the trees of a step (``DrafterClient.draft_batch_packed``)."""
        return cls(batch.token_ids, batch.parents, batch.probs, batch.offsets, width, min_prob)

    @classmethod
    def from_trees(cls, trees: Sequence[DraftTree], width: int, min_prob: float = 0.0) -> PackedTrees:
        """Index DraftTrees."""
        return cls.of_batch(PackedBatch.of_trees(trees), width, min_prob)

    def codes_below(self, root: int) -> range:
        """The codes of the nodes of the tree whose root is code ``root`` (the root's own code not included)."""
        return range(self.trees + int(self.offsets[root]), self.trees + int(self.offsets[root + 1]))

    def descend(self, code: int, path: Sequence[int]) -> int:
        """The code reached by following ``path`` down from ``code``; -1 where the path leaves the tree."""
        edges = self.edges
        for tok in path:
            code = edges.get((code << 32) | tok, -1)
            if code < 0:
                return -1
        return code

    def chain(self, code: int, max_len: int) -> tuple[list[int], list[float]]:
        """The chain below ``code`` (at each node its likeliest child), at most ``max_len`` tokens (and ``width``):
        (tokens, estimates given ``code``)."""
        best, prob, min_prob = self.best, self.prob, self.min_prob
        base = prob[code]
        if base <= 0.0:
            base = 1.0
        tokens: list[int] = []
        estimates: list[float] = []
        for _ in range(min(max_len, self.width)):
            code = best[code]
            if code < 0:
                break
            p = prob[code] / base
            if p > 1.0:
                p = 1.0
            if p < min_prob or p <= 0.0:
                break
            tokens.append(self.token[code])
            estimates.append(p)
        return tokens, estimates

    def chain_after(self, code: int, path: Sequence[int], start: int, max_len: int) -> tuple[list[int], list[float]]:
        """``chain`` below the code reached by following ``path[start:]`` down from ``code`` (``descend``), in one
        call: what pre-speculation asks for every row; ([], []) where the path leaves the tree."""
        edges = self.edges
        for i in range(start, len(path)):
            code = edges.get((code << 32) | path[i], -1)
            if code < 0:
                return [], []
        return self.chain(code, max_len)

    def subtree(self, code: int, max_nodes: int) -> DraftTree:
        """The part of ``code``'s tree strictly below it, re-rooted there (``DraftTree.subtree``), cut to its first
        ``max_nodes`` nodes in the tree's order (best first as the service drafts it, so the cut is the best tree
        of its size, as ``DraftTree.prefix``). Estimates are given ``code`` (each over ``code``'s, at most 1); a
        node estimated under ``min_prob`` (or at 0) is left out with everything below it. Empty for a leaf."""
        if max_nodes <= 0 or code < 0 or self.best[code] < 0:
            return EMPTY_TREE
        trees = self.trees
        if code < trees:  # a root: its whole tree
            start, end = int(self.offsets[code]), int(self.offsets[code + 1])
        else:  # its descendants come after it, before the end of its tree
            flat = code - trees
            start, end = flat + 1, int(self.offsets[int(np.searchsorted(self.offsets, flat, "right"))])
        token, prob, min_prob = self.token, self.prob, self.min_prob
        base = prob[code]
        if base <= 0.0:
            base = 1.0
        keep = {code: -1}  # code -> its index in the subtree (-1: the new root)
        tokens: list[int] = []
        parents: list[int] = []
        probs: list[float] = []
        for c, parent in enumerate(self.parent[start:end].tolist(), trees + start):
            at = keep.get(parent)
            if at is None:
                continue
            p = prob[c] / base
            if p > 1.0:
                p = 1.0
            if p < min_prob or p <= 0.0:
                continue
            keep[c] = len(tokens)
            tokens.append(token[c])
            parents.append(at)
            probs.append(p)
            if len(tokens) == max_nodes:
                break
        return DraftTree(tuple(tokens), tuple(parents), tuple(probs), float(sum(probs)))

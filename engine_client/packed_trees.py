"""Many draft trees indexed for pre-speculation: follow tokens down a tree, then read the chain below, in a few
dictionary and list lookups per request.

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

from drafter_service.api.tree import DraftTree

__all__ = ["PackedTrees"]


class PackedTrees:
    """Draft trees indexed by code (see the module docstring).

    Attributes:
        trees: how many trees (codes ``0 .. trees - 1`` are their roots).
        edges: ``parent code << 32 | token`` -> child code.
        best_child: per code, its child with the largest estimate (-1 at a leaf).
        token: per code, its token (-1 for a root).
        prob: per code, its path estimate (1.0 for a root).
    """

    __slots__ = ("trees", "edges", "best_child", "token", "prob")

    def __init__(self, token_ids: np.ndarray, parents: np.ndarray, probs: np.ndarray,
                 offsets: Sequence[int] | np.ndarray) -> None:
        """Index trees given as flat arrays: tree ``t`` is nodes ``offsets[t] .. offsets[t + 1] - 1``, its parents
        local to it (-1 for its root), as a DraftBatch reply carries them."""
        offsets = np.asarray(offsets, np.int64)
        trees = max(len(offsets) - 1, 0)
        tokens = np.asarray(token_ids, np.int64)
        local = np.asarray(parents, np.int64)
        n = len(tokens)
        tree_of = np.repeat(np.arange(trees, dtype=np.int64), np.diff(offsets)) if trees else np.zeros(0, np.int64)
        parent = np.where(local < 0, tree_of, trees + offsets[:-1][tree_of] + local) if n else tree_of
        code_prob = np.concatenate([np.ones(trees), np.asarray(probs, np.float64)])
        best = np.full(trees + n, -1, np.int64)
        if n:
            by_parent = np.lexsort((-code_prob[trees:], parent))  # per parent, the likeliest child first
            first = np.ones(n, bool)
            first[1:] = parent[by_parent[1:]] != parent[by_parent[:-1]]
            best[parent[by_parent[first]]] = trees + by_parent[first]
        self.trees = trees
        self.edges: dict[int, int] = dict(zip(((parent << 32) | tokens).tolist(), range(trees, trees + n),
                                              strict=True))
        self.best_child: list[int] = best.tolist()
        self.token: list[int] = [-1] * trees + tokens.tolist()
        self.prob: list[float] = code_prob.tolist()

    @classmethod
    def from_trees(cls, trees: Sequence[DraftTree]) -> PackedTrees:
        """Index DraftTrees."""
        offsets = np.zeros(len(trees) + 1, np.int64)
        np.cumsum([len(t) for t in trees], out=offsets[1:])
        total = int(offsets[-1])
        tokens = np.fromiter((x for t in trees for x in t.token_ids), np.int64, total)
        parents = np.fromiter((x for t in trees for x in t.parents), np.int64, total)
        probs = np.fromiter((x for t in trees for x in t.probs), np.float64, total)
        return cls(tokens, parents, probs, offsets)

    def descend(self, code: int, path: Sequence[int]) -> int:
        """The code reached by following ``path`` down from ``code``; -1 where the path leaves the tree."""
        edges = self.edges
        for tok in path:
            code = edges.get((code << 32) | tok, -1)
            if code < 0:
                return -1
        return code

    def chain(self, code: int, max_len: int, min_prob: float = 0.0) -> tuple[list[int], list[float]]:
        """The most likely chain below ``code`` (at each node the child with the largest estimate), at most
        ``max_len`` tokens, ending before a token whose estimate given ``code`` is under ``min_prob``.

        Returns:
            (tokens, estimates given ``code``).
        """
        best, token, prob = self.best_child, self.token, self.prob
        base = prob[code] if prob[code] > 0 else 1.0
        tokens: list[int] = []
        estimates: list[float] = []
        while len(tokens) < max_len:
            code = best[code]
            if code < 0:
                break
            p = min(prob[code] / base, 1.0)
            if p < min_prob or p <= 0.0:
                break
            tokens.append(token[code])
            estimates.append(p)
        return tokens, estimates

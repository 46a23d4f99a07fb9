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
    """Draft trees indexed by code (see the module docstring), with every code's chain cut in advance.

    Attributes:
        trees: how many trees (codes ``0 .. trees - 1`` are their roots).
        edges: ``parent code << 32 | token`` -> child code.
        chain_tokens, chain_probs: per code, the most likely chain below it (at each node the child with the
            largest estimate), at most ``width`` tokens, each token's estimate given the code, ending before an
            estimate under ``min_prob``; padded past ``chain_len``.
        chain_len: per code, the length of its chain.
    """

    __slots__ = ("trees", "edges", "chain_tokens", "chain_probs", "chain_len")

    def __init__(self, token_ids: np.ndarray, parents: np.ndarray, probs: np.ndarray,
                 offsets: Sequence[int] | np.ndarray, width: int, min_prob: float = 0.0) -> None:
        """Index trees given as flat arrays: tree ``t`` is nodes ``offsets[t] .. offsets[t + 1] - 1``, its parents
        local to it (-1 for its root), as a DraftBatch reply carries them; chains are cut to ``width`` tokens."""
        offsets = np.asarray(offsets, np.int64)
        trees = max(len(offsets) - 1, 0)
        tokens = np.asarray(token_ids, np.int64)
        local = np.asarray(parents, np.int64)
        n = len(tokens)
        tree_of = np.repeat(np.arange(trees, dtype=np.int64), np.diff(offsets)) if trees else np.zeros(0, np.int64)
        parent = np.where(local < 0, tree_of, trees + offsets[:-1][tree_of] + local) if n else tree_of
        code_prob = np.concatenate([np.ones(trees), np.asarray(probs, np.float64)])
        code_token = np.concatenate([np.full(trees, -1, np.int64), tokens])
        best = np.full(trees + n, -1, np.int64)
        if n:
            by_parent = np.lexsort((-code_prob[trees:], parent))  # per parent, the likeliest child first
            first = np.ones(n, bool)
            first[1:] = parent[by_parent[1:]] != parent[by_parent[:-1]]
            best[parent[by_parent[first]]] = trees + by_parent[first]
        self.trees = trees
        self.edges: dict[int, int] = dict(zip(((parent << 32) | tokens).tolist(), range(trees, trees + n),
                                              strict=True))
        # every code's chain at once, one column per depth: done once here, off the engine's thread
        codes = trees + n
        chain_tokens = np.full((codes, width), -1, np.int64)
        chain_probs = np.zeros((codes, width))
        length = np.zeros(codes, np.int64)
        base = np.where(code_prob > 0, code_prob, 1.0)
        cur = np.arange(codes)
        alive = np.ones(codes, bool)
        for j in range(width):
            nxt = best[cur]
            p = np.minimum(code_prob[nxt] / base, 1.0)
            alive &= (nxt >= 0) & (p >= min_prob) & (p > 0)
            if not alive.any():
                break
            chain_tokens[alive, j] = code_token[nxt[alive]]
            chain_probs[alive, j] = p[alive]
            length += alive
            cur = np.where(alive, nxt, 0)
        self.chain_tokens: list[list[int]] = chain_tokens.tolist()
        self.chain_probs: list[list[float]] = chain_probs.tolist()
        self.chain_len: list[int] = length.tolist()

    @classmethod
    def from_trees(cls, trees: Sequence[DraftTree], width: int, min_prob: float = 0.0) -> PackedTrees:
        """Index DraftTrees."""
        offsets = np.zeros(len(trees) + 1, np.int64)
        np.cumsum([len(t) for t in trees], out=offsets[1:])
        total = int(offsets[-1])
        tokens = np.fromiter((x for t in trees for x in t.token_ids), np.int64, total)
        parents = np.fromiter((x for t in trees for x in t.parents), np.int64, total)
        probs = np.fromiter((x for t in trees for x in t.probs), np.float64, total)
        return cls(tokens, parents, probs, offsets, width, min_prob)

    def descend(self, code: int, path: Sequence[int]) -> int:
        """The code reached by following ``path`` down from ``code``; -1 where the path leaves the tree."""
        edges = self.edges
        for tok in path:
            code = edges.get((code << 32) | tok, -1)
            if code < 0:
                return -1
        return code

    def chain(self, code: int, max_len: int) -> tuple[list[int], list[float]]:
        """The chain below ``code``, at most ``max_len`` tokens (and ``width``): (tokens, estimates given
        ``code``)."""
        n = min(self.chain_len[code], max_len)
        return self.chain_tokens[code][:n], self.chain_probs[code][:n]

"""PIA lookahead decoding as a replay peer: one n-gram trie shared by all requests, drafted best first by count.

PIA's lookahead cache (Zhao et al. 2023, "Lookahead: An Inference Acceleration Framework for Large Language Model
with Lossless Generation Accuracy") is the ancestor of SGLang's NGRAM speculator. Every position of a sequence starts a
*branch*, the window of the next ``branch_length`` tokens, inserted into a trie whose nodes count how many branches
passed through them. Drafting matches the longest suffix of the context (at most ``max_match_window`` tokens, then
shorter ones) as a path from the root and expands the matched nodes' subtrees into a draft tree.
"""

from __future__ import annotations

import heapq
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Literal

import numpy as np

from drafter_service.api.tree import EMPTY_TREE, DraftTree, chain

__all__ = ["LookaheadTrie", "PiaLookaheadDrafter"]


class _Node:
    """A trie node: the branches that passed through it (``count``) and the clock of the last one (``stamp``)."""

    __slots__ = ("children", "count", "stamp")

    def __init__(self, stamp: int) -> None:
        self.children: dict[int, _Node] | None = None
        self.count = 0
        self.stamp = stamp


#: An open branch: the node its tokens so far lead to, or None once the branch fell out of the trie.
_Cursor = _Node | None


class LookaheadTrie:
    """Branches of up to ``branch_length`` tokens with counts, in one trie.

    A sequence is fed token by token: each token extends every branch still open (those started at most
    ``branch_length - 1`` tokens earlier) and opens a new one at the root, so each window is counted once, however
    the tokens arrive. Node counts never grow down a path (a branch through a node passed its parent).

    Attributes:
        branch_length: longest branch (and depth of the trie).
        size: nodes in the trie, the root excluded.
    """

    def __init__(self, branch_length: int) -> None:
        if branch_length < 1:
            raise ValueError(f"branch_length must be >= 1, got {branch_length}")
        self.branch_length = branch_length
        self.root = _Node(0)
        self.size = 0
        self._clock = 0

    def insert(self, cursors: list[_Cursor], tokens: Iterable[int]) -> list[_Cursor]:
        """Feed ``tokens`` after the branches ``cursors`` (oldest first; [] for a new sequence).

        Returns:
            The branches still open afterwards, to pass with the sequence's next tokens.
        """
        keep = self.branch_length - 1
        root = self.root
        for tok in tokens:
            self._clock += 1
            clock = self._clock
            advanced: list[_Cursor] = []
            for node in (*cursors, root):
                if node is None:
                    advanced.append(None)
                    continue
                kids = node.children
                if kids is None:
                    kids = node.children = {}
                child = kids.get(tok)
                if child is None:
                    child = kids[tok] = _Node(clock)
                    self.size += 1
                child.count += 1
                child.stamp = clock
                advanced.append(child)
            cursors = advanced[-keep:] if keep else []
        return cursors

    def remove(self, tokens: Sequence[int]) -> None:
        """Take back the branches that :meth:`insert` counted for ``tokens`` fed as one sequence.

        A node whose count drops to zero leaves the trie with its subtree (no remaining branch passes there).
        """
        keep = self.branch_length - 1
        cursors: list[_Cursor] = []
        for tok in tokens:
            advanced: list[_Cursor] = []
            for node in (*cursors, self.root):
                if node is None or not node.children:
                    advanced.append(None)
                    continue
                child = node.children.get(tok)
                if child is not None:
                    child.count -= 1
                    if child.count <= 0:
                        del node.children[tok]
                        self.size -= _subtree_size(child)
                        child = None
                advanced.append(child)
            cursors = advanced[-keep:] if keep else []

    def match(self, context: Sequence[int], min_window: int, max_window: int) -> list[tuple[_Node, int]]:
        """Nodes reached by the context's last w tokens, w from ``max_window`` down to ``min_window``.

        Returns:
            (node, w) for each suffix found in the trie whose node has children, longest first.
        """
        out: list[tuple[_Node, int]] = []
        length = len(context)
        for w in range(min(length, max_window), min_window - 1, -1):
            node: _Node | None = self.root
            for tok in context[length - w:]:
                kids = node.children if node is not None else None
                node = kids.get(tok) if kids else None
                if node is None:
                    break
            if node is not None and node.children:
                out.append((node, w))
        return out

    def evict(self, target: int) -> int:
        """Drop the least recently used nodes, with their subtrees, until at most ``target`` remain.

        A node's recency is the last time a branch reached it; nodes older than a threshold go, so a few younger
        descendants may go with them.

        Returns:
            Nodes removed.
        """
        if self.size <= target:
            return 0
        stamps = np.fromiter(_stamps(self.root), dtype=np.int64)  # (size,) int64
        drop = min(len(stamps), self.size - max(0, target))
        threshold = int(np.partition(stamps, drop - 1)[drop - 1])  # every node at or below it goes
        before = self.size
        stack = [self.root]
        while stack:
            node = stack.pop()
            if not node.children:
                continue
            for tok, child in list(node.children.items()):
                if child.stamp <= threshold:
                    del node.children[tok]
                    self.size -= _subtree_size(child)
                else:
                    stack.append(child)
        return before - self.size


def _subtree_size(node: _Node) -> int:
    """Nodes in the subtree rooted at ``node``, itself included."""
    n = 0
    stack = [node]
    while stack:
        cur = stack.pop()
        n += 1
        if cur.children:
            stack.extend(cur.children.values())
    return n


def _stamps(root: _Node) -> Iterable[int]:
    """Stamps of every node below ``root``."""
    stack = [root]
    while stack:
        node = stack.pop()
        if node.children:
            for child in node.children.values():
                yield child.stamp
                stack.append(child)


@dataclass
class _Request:
    prompt: list[int]
    context: list[int]  # the sequence's last max_match_window tokens
    cursors: list[_Cursor] = field(default_factory=list)  # the output's open branches


class PiaLookaheadDrafter:
    """PIA lookahead / SGLang NGRAM drafting from one trie shared by every request.

    Feeding (PIA's schedule): a request's prompt branches go into the trie when it starts and are taken back when it
    ends (PIA resets a request's input frequencies at its end); its output branches go in as the tokens arrive (each
    window counted once, as PIA's ``stream_put`` counts it, without waiting for the window to fill) and stay for
    later requests. Branches start in the prompt or in the output, never across the boundary, as in PIA.

    Drafting (SGLang's ``NGRAM`` with ``match_type="PROB"``): the suffixes of the context of ``max_match_window``
    down to ``min_match_window`` tokens are looked up; from each matched node in turn, longest first, nodes are
    taken best first by probability until the budget is full, a child's probability being its count's share among
    its parent's ``max_bfs_breadth`` most frequent children times the parent's. Nodes reached again from a shorter
    match are merged. ``match_type="BFS"`` is SGLang's default instead: breadth first, the most recently seen
    children first, ``min_bfs_breadth..max_bfs_breadth`` of them (wider for shorter matches, narrower deeper).
    Node probabilities are the count shares along the path in both modes.

    Capacity: when a request ends with more than ``capacity`` nodes in the trie, and no other request is open (or
    the trie holds twice that), the least recently used nodes are evicted down to ``capacity * evict_to``.

    Defaults are SGLang's (``speculative_ngram_*``): branch_length 18, match windows 1..12, BFS breadth 1..10; except
    the match type (frequency, where SGLang defaults to recency) and the capacity, 2,000,000 nodes instead of
    10,000,000 (a node costs about 270 bytes here).
    """

    def __init__(self, branch_length: int = 18, min_match_window: int = 1, max_match_window: int = 12,
                 min_bfs_breadth: int = 1, max_bfs_breadth: int = 10, match_type: Literal["PROB", "BFS"] = "PROB",
                 capacity: int = 2_000_000, evict_to: float = 0.75, name: str = "pia") -> None:
        """Create the drafter with an empty trie.

        Args:
            branch_length: longest branch inserted (trie depth); a match of w tokens leaves branch_length - w to draft.
            min_match_window: shortest context suffix matched.
            max_match_window: longest context suffix matched.
            min_bfs_breadth: children expanded per node in BFS mode for the longest match (PROB mode: unused).
            max_bfs_breadth: most children considered per node (PROB: top-k by count; BFS: for the shortest match).
            match_type: "PROB" (best first by count share) or "BFS" (breadth first by recency).
            capacity: most trie nodes kept between requests.
            evict_to: share of ``capacity`` left after an eviction.
            name: label in benchmark reports.

        Raises:
            ValueError: on inconsistent sizes (SGLang's checks) or an unknown match type.
        """
        if not (branch_length > 1 and 0 < min_match_window <= max_match_window < branch_length):
            raise ValueError(f"need 0 < min_match_window <= max_match_window < branch_length, got "
                             f"{min_match_window=}, {max_match_window=}, {branch_length=}")
        if not 0 < min_bfs_breadth <= max_bfs_breadth:
            raise ValueError(f"need 0 < min_bfs_breadth <= max_bfs_breadth, got {min_bfs_breadth=}, {max_bfs_breadth=}")
        if match_type not in ("PROB", "BFS"):
            raise ValueError(f"match_type must be 'PROB' or 'BFS', got {match_type!r}")
        if capacity < 1 or not 0.0 <= evict_to <= 1.0:
            raise ValueError(f"need capacity >= 1 and 0 <= evict_to <= 1, got {capacity=}, {evict_to=}")
        self.name = name
        self.min_match_window = min_match_window
        self.max_match_window = max_match_window
        self.min_bfs_breadth = min_bfs_breadth
        self.max_bfs_breadth = max_bfs_breadth
        self.match_type = match_type
        self.capacity = capacity
        self.evict_to = evict_to
        self.trie = LookaheadTrie(branch_length)
        self._requests: dict[str, _Request] = {}

    def start(self, request_id: str, prompt: Sequence[int]) -> None:
        """Open a request: its prompt's branches join the trie until it ends."""
        if request_id in self._requests:
            raise ValueError(f"request {request_id!r} is already active")
        toks = [int(t) for t in prompt]
        self.trie.insert([], toks)
        self._requests[request_id] = _Request(toks, toks[-self.max_match_window:])

    def extend(self, request_id: str, tokens: Sequence[int]) -> None:
        """Append output tokens: their branches join the trie."""
        req = self._request(request_id)
        toks = [int(t) for t in tokens]
        req.cursors = self.trie.insert(req.cursors, toks)
        req.context = (req.context + toks)[-self.max_match_window:]

    def propose(self, request_id: str, max_nodes: int) -> DraftTree:
        """A draft tree of at most ``max_nodes`` nodes, or the empty tree when no suffix matches."""
        req = self._request(request_id)
        if max_nodes <= 0:
            return EMPTY_TREE
        anchors = self.trie.match(req.context, self.min_match_window, self.max_match_window)
        if not anchors:
            return EMPTY_TREE
        builder = _TreeBuilder(max_nodes)
        if self.match_type == "PROB":
            self._best_first(anchors, builder)
        else:
            self._breadth_first(anchors, builder)
        return builder.tree(self.name)

    def propose_chain(self, request_id: str, k: int) -> DraftTree:
        """The best single branch, at most ``k`` tokens, by the trie's own estimates.

        From each matched node, the most frequent child is followed step by step (PIA's ``get_one_branch``); of
        these branches, the one with the largest expected accepted length (sum of its count-share probabilities)
        is returned, the longer match on ties.
        """
        req = self._request(request_id)
        if k <= 0:
            return EMPTY_TREE
        best: tuple[list[int], list[float]] = ([], [])
        best_score = 0.0
        for node, _ in self.trie.match(req.context, self.min_match_window, self.max_match_window):
            toks: list[int] = []
            probs: list[float] = []
            prob = 1.0
            kids = node.children
            while kids and len(toks) < k:
                tok, child = max(kids.items(), key=lambda kv: kv[1].count)
                prob *= child.count / sum(c.count for c in kids.values())
                toks.append(tok)
                probs.append(prob)
                kids = child.children
            if sum(probs) > best_score:
                best, best_score = (toks, probs), sum(probs)
        return chain(best[0], best[1], self.name) if best[0] else EMPTY_TREE

    def end(self, request_id: str) -> None:
        """Close the request: its prompt's branches leave the trie, its output's stay; evict when over capacity."""
        req = self._requests.pop(request_id, None)
        if req is None:
            return
        self.trie.remove(req.prompt)
        if self.trie.size > self.capacity and (not self._requests or self.trie.size > 2 * self.capacity):
            self.trie.evict(int(self.capacity * self.evict_to))

    def _best_first(self, anchors: list[tuple[_Node, int]], builder: _TreeBuilder) -> None:
        """SGLang's buildFrequency: best first by count share among the top ``max_bfs_breadth`` children."""
        heap: list[tuple[float, int, int, int, _Node]] = []  # (-prob, order, parent index, token, trie node)
        order = 0

        def push_children(parent: int, node: _Node, base: float) -> None:
            nonlocal order
            if not node.children:
                return
            top = heapq.nlargest(self.max_bfs_breadth, node.children.items(), key=lambda kv: kv[1].count)
            total = sum(child.count for _, child in top)
            for tok, child in top:
                heapq.heappush(heap, (-base * child.count / total, order, parent, tok, child))
                order += 1

        for anchor, _ in anchors:
            if builder.full():
                break
            heap.clear()
            push_children(-1, anchor, 1.0)
            while heap and not builder.full():
                neg, _, parent, tok, child = heapq.heappop(heap)
                pos = builder.add(parent, tok, -neg)
                push_children(pos, child, builder.probs[pos])

    def _breadth_first(self, anchors: list[tuple[_Node, int]], builder: _TreeBuilder) -> None:
        """SGLang's buildRecency: breadth first, most recent children first, breadth shrinking with match and depth."""
        span = self.max_match_window - self.min_match_window + 1
        scale = (self.max_bfs_breadth - self.min_bfs_breadth) / span
        for anchor, w in anchors:
            queue: list[tuple[int, float, _Node, float]] = [
                (-1, (self.max_match_window - w) * scale + self.min_bfs_breadth, anchor, 1.0)]
            head = 0
            while head < len(queue) and not builder.full():
                parent, breadth, node, base = queue[head]
                head += 1
                if not node.children:
                    continue
                total = sum(child.count for child in node.children.values())
                recent = heapq.nlargest(max(1, int(breadth)), node.children.items(), key=lambda kv: kv[1].stamp)
                for tok, child in recent:
                    if builder.full():
                        break
                    pos = builder.add(parent, tok, base * child.count / total)
                    queue.append((pos, breadth - scale, child, builder.probs[pos]))

    def _request(self, request_id: str) -> _Request:
        try:
            return self._requests[request_id]
        except KeyError:
            raise KeyError(f"request {request_id!r} is not active") from None


class _TreeBuilder:
    """A draft tree grown node by node; a (parent, token) pair seen again maps to its first node."""

    def __init__(self, max_nodes: int) -> None:
        self.max_nodes = max_nodes
        self.tokens: list[int] = []
        self.parents: list[int] = []
        self.probs: list[float] = []
        self._index: dict[tuple[int, int], int] = {}

    def full(self) -> bool:
        return len(self.tokens) >= self.max_nodes

    def add(self, parent: int, token: int, prob: float) -> int:
        """Index of the node for ``token`` under ``parent``, created (probability capped by the parent's) if new."""
        key = (parent, token)
        pos = self._index.get(key)
        if pos is None:
            pos = self._index[key] = len(self.tokens)
            self.tokens.append(token)
            self.parents.append(parent)
            self.probs.append(min(prob, self.probs[parent] if parent >= 0 else 1.0))
        return pos

    def tree(self, source: str) -> DraftTree:
        if not self.tokens:
            return EMPTY_TREE
        return DraftTree(tuple(self.tokens), tuple(self.parents), tuple(self.probs), float(sum(self.probs)),
                         (source,) * len(self.tokens))

"""One engine step for many sessions: what a DraftBatch call opens, drafts and ends, item by item."""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from drafter_service.api.tree import EMPTY_TREE, DraftTree, TokenIds

BatchStart = tuple[str, str, TokenIds, int, bool]
"""(namespace, session id, prompt, max_nodes, fixed_budget) of a session to open, as StartSession takes them."""
BatchStep = tuple[str, TokenIds, int, bool]
"""(session id, accepted, max_nodes, report_only) of one session's step, as Draft takes them."""
BatchEnd = tuple[str, TokenIds]
"""(session id, accepted) of a session to end, as EndSession takes them."""


@dataclass(frozen=True)
class PackedSteps:
    """Steps that came packed (a DraftBatchRequest's ``packed_*`` fields): session ``sessions[i]``'s accepted
    tokens are ``tokens[offsets[i]:offsets[i + 1]]``, with budget ``budgets[i]`` (0: the batch's) and report flag
    ``report[i]``."""

    sessions: Sequence[str]
    tokens: np.ndarray  # (total,) int32
    offsets: list[int]
    budgets: list[int]
    report: list[bool]

    def steps(self) -> list[BatchStep]:
        """The same steps one by one (their tokens views of ``tokens``)."""
        flat = self.tokens
        return list(zip(self.sessions, [flat[lo:hi] for lo, hi in itertools.pairwise(self.offsets)], self.budgets,
                        self.report, strict=True))


SOURCE_CODES = {"session": 1, "store": 2, "dynamic": 3, "frozen": 4, "model": 5, "repeat": 6}
"""The number of each source name in the API's Source enum (0 for a node without one)."""
SOURCE_NAMES = {code: name for name, code in SOURCE_CODES.items()}

Nodes = tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]
"""Nodes of trees packed one after another: token ids (int32), parents (int32, relative to each tree's first
node), probabilities (float64) and sources (uint8, ``SOURCE_CODES``)."""


@dataclass
class BatchOutcome:
    """What a batch did: a tree per step (packed one after another), the tokens stored per end, and the items
    that failed.

    Step i's tree is nodes ``tree_offsets[i]`` to ``tree_offsets[i + 1] - 1`` of ``nodes()``. A failed item leaves
    the others alone: its error (the exception the call alone would have raised) is kept with its index, a failed
    step's tree is empty and a failed end stored nothing.
    """

    tree_offsets: list[int] = field(default_factory=lambda: [0])
    confirmed: list[int] = field(default_factory=list)
    stored: list[int] = field(default_factory=list)
    start_errors: list[tuple[int, Exception]] = field(default_factory=list)
    step_errors: list[tuple[int, Exception]] = field(default_factory=list)
    end_errors: list[tuple[int, Exception]] = field(default_factory=list)
    parts: list[Nodes] = field(default_factory=list)

    def add_tree(self, tree: DraftTree, confirmed: int) -> None:
        """Append the next step's tree and what its tokens confirmed."""
        if len(tree):
            self.parts.append((np.array(tree.token_ids, np.int32), np.array(tree.parents, np.int32),
                               np.array(tree.probs, np.float64),
                               np.array([SOURCE_CODES.get(s, 0) for s in tree.sources or ("",) * len(tree)],
                                        np.uint8)))
        self.tree_offsets.append(self.tree_offsets[-1] + len(tree))
        self.confirmed.append(confirmed)

    def add_trees(self, offsets: Sequence[int], nodes: Nodes, confirmed: Sequence[int]) -> None:
        """Append the trees of several steps: tree i is nodes ``offsets[i]`` to ``offsets[i + 1] - 1`` of ``nodes``
        (``offsets[0]`` is 0)."""
        base = self.tree_offsets[-1]
        self.tree_offsets.extend([base + o for o in offsets[1:]] if base else offsets[1:])
        if offsets[-1]:
            self.parts.append(nodes)
        self.confirmed.extend(confirmed)

    def nodes(self) -> Nodes:
        """Every step's nodes, one tree after another."""
        if len(self.parts) == 1:
            return self.parts[0]
        if not self.parts:
            return (np.zeros(0, np.int32), np.zeros(0, np.int32), np.zeros(0, np.float64), np.zeros(0, np.uint8))
        return tuple(np.concatenate(column) for column in zip(*self.parts, strict=True))  # type: ignore[return-value]

    @property
    def trees(self) -> list[DraftTree]:
        """Every step's tree as a DraftTree."""
        token_ids, parents, probs, sources = (column.tolist() for column in self.nodes())
        out = []
        for lo, hi in itertools.pairwise(self.tree_offsets):
            p = tuple(probs[lo:hi])
            out.append(DraftTree(tuple(token_ids[lo:hi]), tuple(parents[lo:hi]), p, float(sum(p)),
                                 tuple(SOURCE_NAMES.get(s, "") for s in sources[lo:hi])) if hi > lo
                       else EMPTY_TREE)
        return out

"""One engine step for many sessions: what a DraftBatch call opens, drafts and ends, item by item."""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field

from drafter_service.api.tree import EMPTY_TREE, DraftTree, TokenIds

BatchStart = tuple[str, str, TokenIds, int]
"""(namespace, session id, prompt, max_nodes) of a session to open, as StartSession takes them."""
BatchStep = tuple[str, TokenIds, int, bool]
"""(session id, accepted, max_nodes, report_only) of one session's step, as Draft takes them."""
BatchEnd = tuple[str, TokenIds]
"""(session id, accepted) of a session to end, as EndSession takes them."""
SOURCE_CODES = {"session": 1, "store": 2, "dynamic": 3, "frozen": 4, "model": 5, "repeat": 6}
"""The number of each source name in the API's Source enum (0 for a node without one)."""
SOURCE_NAMES = {code: name for name, code in SOURCE_CODES.items()}


@dataclass
class BatchOutcome:
    """What a batch did: a tree per step (packed one after another), the tokens stored per end, and the items
    that failed.

    Step i's tree is nodes ``tree_offsets[i]`` to ``tree_offsets[i + 1] - 1`` of ``token_ids``, ``parents``
    (relative to the tree's first node), ``probs`` and ``sources`` (``SOURCE_CODES``). A failed item leaves the
    others alone: its error (the exception the call alone would have raised) is kept with its index, a failed
    step's tree is empty and a failed end stored nothing.
    """

    tree_offsets: list[int] = field(default_factory=lambda: [0])
    token_ids: list[int] = field(default_factory=list)
    parents: list[int] = field(default_factory=list)
    probs: list[float] = field(default_factory=list)
    sources: list[int] = field(default_factory=list)
    confirmed: list[int] = field(default_factory=list)
    stored: list[int] = field(default_factory=list)
    start_errors: list[tuple[int, Exception]] = field(default_factory=list)
    step_errors: list[tuple[int, Exception]] = field(default_factory=list)
    end_errors: list[tuple[int, Exception]] = field(default_factory=list)

    def add_tree(self, tree: DraftTree, confirmed: int) -> None:
        """Append the next step's tree and what its tokens confirmed."""
        self.token_ids.extend(tree.token_ids)
        self.parents.extend(tree.parents)
        self.probs.extend(tree.probs)
        self.sources.extend(SOURCE_CODES.get(s, 0) for s in tree.sources or ("",) * len(tree))
        self.tree_offsets.append(len(self.token_ids))
        self.confirmed.append(confirmed)

    @property
    def trees(self) -> list[DraftTree]:
        """Every step's tree as a DraftTree."""
        out = []
        for lo, hi in itertools.pairwise(self.tree_offsets):
            probs = tuple(self.probs[lo:hi])
            out.append(DraftTree(tuple(self.token_ids[lo:hi]), tuple(self.parents[lo:hi]), probs, float(sum(probs)),
                                 tuple(SOURCE_NAMES.get(s, "") for s in self.sources[lo:hi])) if hi > lo
                       else EMPTY_TREE)
        return out

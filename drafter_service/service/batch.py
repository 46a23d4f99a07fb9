"""One engine step for many sessions: what a DraftBatch call opens, drafts and ends, item by item."""

from __future__ import annotations

from dataclasses import dataclass, field

from drafter_service.api.tree import DraftTree, TokenIds

BatchStart = tuple[str, str, TokenIds, int]
"""(namespace, session id, prompt, max_nodes) of a session to open, as StartSession takes them."""
BatchStep = tuple[str, TokenIds, int, bool]
"""(session id, accepted, max_nodes, report_only) of one session's step, as Draft takes them."""
BatchEnd = tuple[str, TokenIds]
"""(session id, accepted) of a session to end, as EndSession takes them."""


@dataclass
class BatchOutcome:
    """What a batch did: a tree per step, the tokens stored per end, and the items that failed.

    A failed item leaves the others alone: its error (the exception the call alone would have raised) is kept
    with its index, a failed step's tree is empty and a failed end stored nothing.
    """

    trees: list[DraftTree] = field(default_factory=list)
    confirmed: list[int] = field(default_factory=list)
    stored: list[int] = field(default_factory=list)
    start_errors: list[tuple[int, Exception]] = field(default_factory=list)
    step_errors: list[tuple[int, Exception]] = field(default_factory=list)
    end_errors: list[tuple[int, Exception]] = field(default_factory=list)

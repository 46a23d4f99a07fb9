"""The interface every drafter replayed by the benchmark implements."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol, runtime_checkable

from drafter_service.api.tree import DraftTree

__all__ = ["ReplayDrafter"]


@runtime_checkable
class ReplayDrafter(Protocol):
    """A drafter driven request by request through the replay of completed requests.

    Lifecycle per request: ``start`` once with the prompt, then alternately ``propose`` (draft for
    the current sequence) and ``extend`` (the tokens the target actually appended: the accepted
    draft tokens plus its own next token), and finally ``end``. Several requests may be open at once.

    Attributes:
        name: short label used in benchmark reports.
    """

    name: str

    def start(self, request_id: str, prompt: Sequence[int]) -> None:
        """A request begins with its prompt."""
        ...

    def extend(self, request_id: str, tokens: Sequence[int]) -> None:
        """Tokens appended to the sequence (accepted draft + target's token)."""
        ...

    def propose(self, request_id: str, max_nodes: int) -> DraftTree:
        """Draft for the current sequence, at most ``max_nodes`` nodes; an empty tree means no draft."""
        ...

    def end(self, request_id: str) -> None:
        """The request is done (the drafter may learn from prompt + everything extended)."""
        ...

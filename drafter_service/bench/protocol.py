"""The interface every drafter replayed by the benchmark implements, and its optional chain extension."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol, runtime_checkable

from drafter_service.api.tree import DraftTree

__all__ = ["ChainDrafter", "ReplayDrafter"]


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


@runtime_checkable
class ChainDrafter(Protocol):
    """Optional extension of ``ReplayDrafter``: how the drafter makes its one chain per step in chain mode.

    In chain mode (an engine that verifies a single path per request, as vLLM does) the replay calls
    ``propose_chain`` instead of ``propose`` when the drafter has it; otherwise the chain is the best path of
    a ``propose`` tree (see ``drafter_service.bench.replay.propose_chain``).
    """

    def propose_chain(self, request_id: str, k: int) -> DraftTree:
        """One path of at most ``k`` tokens for the current sequence (parents ``-1, 0, 1, ...``); empty: no draft."""
        ...

"""What an engine asks for drafts: a small protocol that the drafter client and engines' own sources implement."""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from typing import Protocol, runtime_checkable

from drafter_service.api.tree import EMPTY_TREE, DraftTree

__all__ = ["DraftSource", "NoDrafts", "DraftTree", "EMPTY_TREE"]


@runtime_checkable
class DraftSource(Protocol):
    """Session lifecycle of a drafter as an engine sees it.

    A source never raises for its own trouble (a service that is down, a deadline passed): it returns
    ``EMPTY_TREE`` and the engine decodes that step without a draft.
    """

    def start(self, prompt: Sequence[int], max_nodes: int = 0) -> str:
        """Open a session for a request whose prompt is ``prompt``; returns the session id."""
        ...

    def draft(self, session: str, accepted: Sequence[int], max_nodes: int = 0,
              step_seconds: float = 0.0, plain_step_seconds: float = 0.0,
              verify_cost: Sequence[tuple[float, float]] = (), estimate_exponent: float = 0.0) -> DraftTree:
        """The next tree for a session.

        Args:
            session: the id ``start`` returned.
            accepted: tokens appended to the sequence since the previous call (accepted draft tokens plus the
                target's own token); empty on the first call.
            max_nodes: most nodes the engine will verify (0: the session's default).
            step_seconds: how long the verification step that produced ``accepted`` took (0: unknown).
            plain_step_seconds: how long a plain decode step (one token, no draft) takes on the engine now
                (0: unknown); with ``step_seconds`` it lets the service estimate the speedup.
            verify_cost: the engine's step time against draft nodes, as ``(nodes, seconds)`` points by size
                (``StepCostCurve.points``); given, the source may leave out nodes not worth verifying.
            estimate_exponent: the engine's calibration of the tree's estimates (``p ** exponent`` is the
                acceptance it sees; 0: none), used with ``verify_cost``.
        """
        ...

    def end(self, session: str, accepted: Sequence[int]) -> None:
        """Close a session with the tokens appended since the last ``draft``; the request is then complete."""
        ...


class NoDrafts:
    """A source that never drafts: the engine's plain decoding through the same code path."""

    def __init__(self) -> None:
        self._ids = itertools.count()

    def start(self, prompt: Sequence[int], max_nodes: int = 0) -> str:
        return f"plain-{next(self._ids)}"

    def draft(self, session: str, accepted: Sequence[int], max_nodes: int = 0,
              step_seconds: float = 0.0, plain_step_seconds: float = 0.0,
              verify_cost: Sequence[tuple[float, float]] = (), estimate_exponent: float = 0.0) -> DraftTree:
        return EMPTY_TREE

    def end(self, session: str, accepted: Sequence[int]) -> None:
        return None

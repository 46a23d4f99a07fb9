"""What the drafting core needs of an optional draft model (the CARD cache in ``model`` provides it)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

import numpy as np

from drafter_service.api.tree import DraftTree
from drafter_service.core.config import CardSettings


class ModelSession(Protocol):
    """A draft model's candidate cache for one request."""

    def query(self, budget: int) -> DraftTree:
        """The cache's best paths within ``budget`` nodes (an empty tree when it has none)."""
        ...

    def correct(self, accepted: Sequence[int] | np.ndarray) -> bool | None:
        """Prune the cache to what ``accepted`` verified; whether its top path guessed the next token (None: no
        guess)."""
        ...

    def settle(self, timeout: float = 60.0) -> None:
        """Wait until the model has caught up with the last correction (for reproducible benchmarks)."""
        ...


class ModelDrafts(Protocol):
    """A namespace's draft model: opens a cache per session and keeps the model's statistics."""

    settings: CardSettings
    steps: int
    hits: int

    @property
    def open_sessions(self) -> int:
        """Sessions with a live cache."""
        ...

    def open(self, prompt: Sequence[int] | np.ndarray, name: str = "card") -> ModelSession | None:
        """Start a cache for a request (None when the model cannot draft for it)."""
        ...

    def close(self, session: Any) -> None:
        """Stop a session's cache."""
        ...

    def set_running(self, running: bool) -> None:
        """Let the model's workers grow their caches (True) or pause them (False)."""
        ...

    def record_step(self, hit: bool) -> None:
        """Count one verification step the model's top path was scored on."""
        ...

    def set_frequencies(self, tokens: Any) -> None:
        """Let the model's vocabulary follow the most frequent of ``tokens``."""
        ...

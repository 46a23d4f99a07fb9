"""A namespace's durable request log as the spool and the log follower see it: persistence, order and position."""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from typing import Protocol

import numpy as np

from store.persistence import RedisPersistence

LoggedDocs = Sequence[tuple[np.ndarray, str | None]]
"""(document, request id or None) per request: (n,) int32 prompt + output tokens."""


class Follower(Protocol):
    """What follows the shared log on this replica (``log_follower.LogFollower``)."""

    replica_id: str

    def before_own(self, ids: Sequence[str | None], docs: LoggedDocs) -> None:
        """Store what other replicas logged before this replica's own requests ``ids`` (write lock held)."""
        ...

    def stats(self) -> dict[str, object]:
        """Figures for the metrics."""
        ...


class DurableLog:
    """The narrow view of a namespace that writing and following its request log need.

    ``write_lock`` keeps the durable log and the in-memory store in the same order: whoever appends to one holds it
    until the other has the same requests. ``position`` is the stream id of the newest logged request the store
    holds (and every one before it); ``event_position`` the newest frozen-table event seen.

    Args:
        name: the namespace's name (for messages).
        persistence: its Redis persistence (None: memory only; then there is nothing to spool or follow).
        store: puts a logged request into memory: ``store(document, prompt length or None)``.
        sync_frozen: reloads frozen tables changed by other replicas; returns their names.
    """

    def __init__(self, name: str, persistence: RedisPersistence | None,
                 store: Callable[[np.ndarray, int | None], None], sync_frozen: Callable[[], list[str]]) -> None:
        self.name = name
        self.persistence = persistence
        self.write_lock = threading.Lock()
        self.position = "0-0"
        self.event_position = "0-0"
        self.follower: Follower | None = None  # set when this replica follows the shared log
        self.writer_id = ""  # the writer id this process's appends carry (set by its spool); "" when none
        self._store = store
        self._sync_frozen = sync_frozen

    def store(self, document: np.ndarray, prompt_len: int | None) -> None:
        """Put a request read from the log into memory (write lock held)."""
        self._store(document, prompt_len)

    def sync_frozen(self) -> list[str]:
        """Reload the frozen tables other replicas changed; returns their names."""
        return self._sync_frozen()

    def logged(self, ids: Sequence[str | None], docs: LoggedDocs) -> None:
        """Move the position past own requests just appended with stream ids ``ids`` (write lock held)."""
        if self.follower is not None:  # what other replicas logged just before goes into the store first
            self.follower.before_own(ids, docs)
        else:
            self.position = next((i for i in reversed(ids) if i is not None), self.position)

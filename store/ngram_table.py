"""Cacheback n-gram tables: leader tokens -> recent follower n-grams, with LRU eviction; frozen ones re-exported."""

from __future__ import annotations

import logging
import os
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING

from store.frozen_table import FrozenNGramTable  # noqa: F401  (re-exported: frozen tables live there)

logger = logging.getLogger(__name__)

Follower = tuple[int, ...]


class PyLRUNGramTable:
    """The dynamic table: at most ``leader_capacity`` leaders, each with at most ``follower_capacity`` followers.

    The pure-Python reference for the native ``store._lru.LRUTable``; ``LRUNGramTable`` is whichever is in use.

    Rules (Cacheback): inserting or querying a leader makes it the most recent leader; inserting a follower
    makes it the most recent follower of its leader; querying does not change followers' order. When full,
    the least recent leader (with all its followers) or the least recent follower of a leader is evicted.
    Each follower also counts how often it was inserted, which the drafter reads as a frequency.
    """

    def __init__(self, leader_len: int = 1, follower_len: int = 3, leader_capacity: int = 1 << 20,
                 follower_capacity: int = 128) -> None:
        """Create an empty table.

        Args:
            leader_len: LL, tokens in a leader.
            follower_len: FL, tokens in a follower.
            leader_capacity: LC, most leaders held.
            follower_capacity: FC, most followers held per leader.
        """
        for name, value in (("leader_len", leader_len), ("follower_len", follower_len),
                            ("leader_capacity", leader_capacity), ("follower_capacity", follower_capacity)):
            if value < 1:
                raise ValueError(f"{name} must be at least 1, got {value}")
        self.leader_len = int(leader_len)
        self.follower_len = int(follower_len)
        self.leader_capacity = int(leader_capacity)
        self.follower_capacity = int(follower_capacity)
        # leader -> (follower -> insertions), both ordered least recent first
        self._leaders: OrderedDict[Follower, OrderedDict[Follower, int]] = OrderedDict()

    def __len__(self) -> int:
        return len(self._leaders)

    def __contains__(self, leader: Follower) -> bool:
        return tuple(leader) in self._leaders

    def insert(self, leader: Sequence[int], follower: Sequence[int]) -> None:
        """Record that ``follower`` came right after ``leader``."""
        lead, fol = tuple(leader), tuple(follower)
        if len(lead) != self.leader_len or len(fol) != self.follower_len:
            raise ValueError(f"expected a {self.leader_len}-token leader and {self.follower_len}-token follower")
        self._insert(lead, fol)

    def _insert(self, lead: Follower, fol: Follower) -> None:
        followers = self._leaders.get(lead)
        if followers is None:
            followers = OrderedDict()
            self._leaders[lead] = followers
            if len(self._leaders) > self.leader_capacity:
                self._leaders.popitem(last=False)
        else:
            self._leaders.move_to_end(lead)
        count = followers.pop(fol, 0)
        followers[fol] = count + 1
        if len(followers) > self.follower_capacity:
            followers.popitem(last=False)

    def query(self, leader: Sequence[int], limit: int | None = None) -> list[tuple[Follower, int]]:
        """Followers of ``leader``, most recently inserted first, with their insertion counts.

        Refreshes the leader's recency. An unknown leader gives an empty list.
        """
        lead = tuple(leader)
        followers = self._leaders.get(lead)
        if followers is None:
            return []
        self._leaders.move_to_end(lead)
        out: list[tuple[Follower, int]] = []
        for item in reversed(followers.items()):
            out.append(item)
            if limit is not None and len(out) >= limit:
                break
        return out

    def update(self, tokens: Sequence[int], new_from: int = 0) -> int:
        """Slide a window over ``tokens`` and insert every leader-follower pair that ends at or after ``new_from``.

        Args:
            tokens: the sequence (only its last ``new tokens + LL + FL`` matter).
            new_from: index of the first token not seen by an earlier update of this sequence.

        Returns:
            Number of pairs inserted.
        """
        span = self.leader_len + self.follower_len
        first = max(0, new_from - span + 1)
        seq = [int(t) for t in tokens[first:]]
        ll = self.leader_len
        n = 0
        for i in range(0, len(seq) - span + 1):
            self._insert(tuple(seq[i:i + ll]), tuple(seq[i + ll:i + span]))
            n += 1
        return n

    def items(self) -> Iterable[tuple[Follower, list[tuple[Follower, int]]]]:
        """Leaders least recent first, each with its followers least recent first (for snapshots)."""
        for lead, followers in self._leaders.items():
            yield lead, list(followers.items())

    def load(self, items: Iterable[tuple[Sequence[int], Iterable[tuple[Sequence[int], int]]]]) -> None:
        """Replace the contents with ``items`` as produced by ``items()`` (order is recency)."""
        self._leaders.clear()
        for lead, followers in items:
            od: OrderedDict[Follower, int] = OrderedDict((tuple(f), int(c)) for f, c in followers)
            self._leaders[tuple(lead)] = od
        self.check_invariants()

    @property
    def followers(self) -> int:
        """Followers held over all leaders."""
        return sum(len(f) for f in self._leaders.values())

    def check_invariants(self) -> None:
        """Raise AssertionError when a capacity or a shape rule is broken."""
        assert len(self._leaders) <= self.leader_capacity, "too many leaders"
        for lead, followers in self._leaders.items():
            assert len(lead) == self.leader_len, f"leader {lead} has the wrong length"
            assert 1 <= len(followers) <= self.follower_capacity, f"leader {lead} holds {len(followers)} followers"
            for fol, count in followers.items():
                assert len(fol) == self.follower_len and count >= 1, f"bad follower {fol} of {lead}"


try:
    from store._lru import LRUTable as _LRUTable

    NativeLRUTable: type[_LRUTable] | None = _LRUTable
except ImportError:  # not built
    NativeLRUTable = None
    logger.debug("store._lru is not built; the dynamic table is pure Python")

if TYPE_CHECKING or NativeLRUTable is None or os.environ.get("DRAFTER_PURE_PYTHON", "") not in ("", "0"):
    LRUNGramTable = PyLRUNGramTable
else:
    LRUNGramTable = NativeLRUTable
"""The dynamic table in use: the native ``store._lru.LRUTable`` (same API and results, leaders and followers of
at most 8 tokens, token ids in [0, 2**31)), or ``PyLRUNGramTable`` when it is not built or
``DRAFTER_PURE_PYTHON=1``."""

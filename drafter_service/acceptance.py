"""Online estimates of how often a proposed draft token is accepted, per source and evidence bucket."""

from __future__ import annotations

import threading
from typing import Hashable, Iterable

Key = Hashable

_MATCH_BUCKETS = (0, 1, 2, 3, 4, 5, 5, 6, 6, 7, 7, 7, 7, 8, 8, 8, 8)  # match length -> bucket (9 above 16)
_COUNT_BUCKETS = (0, 1, 2, 3, 3, 4, 4, 4, 4)  # occurrences -> bucket (5 above 8)


def match_bucket(match_len: int) -> int:
    """Bucket of a match length: exact up to 5, then coarser."""
    return _MATCH_BUCKETS[match_len] if match_len < len(_MATCH_BUCKETS) else 9


def count_bucket(count: int) -> int:
    """Bucket of an occurrence count: 1, 2, 3-4, 5-8, more."""
    return _COUNT_BUCKETS[count] if count < len(_COUNT_BUCKETS) else 5


def share_bucket(share: float) -> int:
    """Bucket of a child's share of its parent's occurrences: quarters, with 1.0 on its own."""
    return 4 if share >= 1.0 else int(share * 4)


class AcceptanceModel:
    """Beta-Bernoulli estimate of P(node accepted | parent accepted) for every evidence key.

    A key describes why a node was proposed (its source and a few bucketed features); the estimate starts
    at a prior given by the source and moves towards the observed acceptance rate as verification
    outcomes arrive. Counts are halved past ``horizon`` trials so the estimate follows the workload.
    Thread-safe for concurrent sessions.
    """

    def __init__(self, prior_strength: float = 4.0, horizon: int = 20000) -> None:
        """Create a model with no observations.

        Args:
            prior_strength: pseudo-trials given to a key's prior.
            horizon: trials per key after which its counts are halved.
        """
        self.prior_strength = float(prior_strength)
        self.horizon = int(horizon)
        self._stats: dict[Key, list[float]] = {}  # key -> [accepted, trials]
        self._cache: dict[Key, float] = {}
        self._lock = threading.Lock()

    def estimate(self, key: Key, prior: float) -> float:
        """Current estimate for ``key``; ``prior`` is used until it has observations."""
        est = self._cache.get(key)
        return prior if est is None else est

    def record(self, outcomes: Iterable[tuple[Key, float, bool]]) -> None:
        """Add verification outcomes: (key, prior used for it, accepted?)."""
        with self._lock:
            for key, prior, accepted in outcomes:
                st = self._stats.get(key)
                if st is None:
                    st = self._stats[key] = [prior * self.prior_strength, self.prior_strength]
                st[0] += 1.0 if accepted else 0.0
                st[1] += 1.0
                if st[1] > self.horizon:
                    st[0] *= 0.5
                    st[1] *= 0.5
                self._cache[key] = min(1.0, max(1e-4, st[0] / st[1]))

    def snapshot(self) -> dict[Key, tuple[float, float]]:
        """Copy of the observations, for persistence and statistics."""
        with self._lock:
            return {k: (v[0], v[1]) for k, v in self._stats.items()}

    def load(self, stats: dict[Key, tuple[float, float]]) -> None:
        """Replace the observations with ``stats`` as produced by ``snapshot``."""
        with self._lock:
            self._stats = {k: [float(a), float(t)] for k, (a, t) in stats.items() if t > 0}
            self._cache = {k: min(1.0, max(1e-4, a / t)) for k, (a, t) in self._stats.items()}

    def __len__(self) -> int:
        return len(self._stats)

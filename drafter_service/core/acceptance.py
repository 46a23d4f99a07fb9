"""Online estimates of how often a proposed draft token is accepted, per source and evidence bucket."""

from __future__ import annotations

import array
import threading
from collections.abc import Iterable

# Evidence keys are small integers laid out in five blocks (shared with the native tree builder):
#   rows      (kind 0 session / 1 store) x match bucket x share bucket x count bucket
#   follower  (kind 2 dynamic / 3 frozen) x position in the follower (1, 2+)
#   fresh     (kind 2 / 3) x rank bucket x count bucket
#   agree     source-kind mask x bucket of the best single estimate
#   contested the rows, follower and fresh keys again, for a child beside which another source kind proposes
#             a different token (``contested_key``)
N_MATCH, N_SHARE, N_COUNT, N_RANK, N_AGREE = 10, 5, 6, 4, 11
ROWS_BASE = 0
FOLLOWER_BASE = ROWS_BASE + 2 * N_MATCH * N_SHARE * N_COUNT
FRESH_BASE = FOLLOWER_BASE + 2 * 2
AGREE_BASE = FRESH_BASE + 2 * N_RANK * N_COUNT
CONTESTED_BASE = AGREE_BASE + 16 * N_AGREE
N_KEYS = CONTESTED_BASE + AGREE_BASE

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


def rows_key(kind: int, match_len: int, share: float, count: int) -> int:
    """Key of a suffix-match child: which source, how long a match, what share, out of how many."""
    return ROWS_BASE + ((kind * N_MATCH + match_bucket(match_len)) * N_SHARE + share_bucket(share)) * N_COUNT \
        + count_bucket(count)


def follower_key(kind: int, position: int) -> int:
    """Key of a table child that continues a follower already in progress (position >= 1)."""
    return FOLLOWER_BASE + (kind - 2) * 2 + min(position, 2) - 1


def fresh_key(kind: int, rank: int, count: int) -> int:
    """Key of a table child that starts a follower: its rank in the query and its insertion count."""
    return FRESH_BASE + ((kind - 2) * N_RANK + min(rank, N_RANK - 1)) * N_COUNT + count_bucket(count)


def contested_key(key: int) -> int:
    """The contested variant of a rows, follower or fresh key: the same evidence for a child beside which another
    source kind proposes a different token (a source's estimate is lower where another source disagrees)."""
    return CONTESTED_BASE + key


def agree_key(kinds: int, best: float) -> int:
    """Key of a child proposed by several sources (bit mask of kinds) whose best estimate is ``best``."""
    return AGREE_BASE + kinds * N_AGREE + int(best * (N_AGREE - 1))


class AcceptanceModel:
    """Beta-Bernoulli estimate of P(node accepted | parent accepted) for every evidence key.

    A key describes why a node was proposed; its estimate starts at the prior given with it and moves
    towards the observed acceptance rate as verification outcomes arrive. Counts are halved past
    ``horizon`` trials so the estimate follows the workload. Thread-safe for concurrent sessions.
    """

    def __init__(self, prior_strength: float = 4.0, horizon: int = 20000) -> None:
        """Create a model with no observations.

        Args:
            prior_strength: pseudo-trials given to a key's prior at its first observation.
            horizon: trials per key after which its counts are halved.
        """
        self.prior_strength = float(prior_strength)
        self.horizon = int(horizon)
        self.accepted = array.array("d", bytes(8 * N_KEYS))  # (N_KEYS,) float64 accepted pseudo-counts
        self.trials = array.array("d", bytes(8 * N_KEYS))  # (N_KEYS,) float64 trial pseudo-counts
        self.lock = threading.Lock()

    def estimate(self, key: int, prior: float) -> float:
        """Current estimate for ``key``; ``prior`` until it has observations."""
        t = self.trials[key]
        if t == 0.0:
            return prior
        return min(1.0, max(1e-4, self.accepted[key] / t))

    def record(self, outcomes: Iterable[tuple[int, float, bool]]) -> None:
        """Add verification outcomes: (key, prior used for it, accepted?)."""
        acc, trials, strength = self.accepted, self.trials, self.prior_strength
        with self.lock:
            for key, prior, accepted in outcomes:
                if trials[key] == 0.0:
                    acc[key] = prior * strength
                    trials[key] = strength
                acc[key] += 1.0 if accepted else 0.0
                trials[key] += 1.0
                if trials[key] > self.horizon:
                    acc[key] *= 0.5
                    trials[key] *= 0.5

    def snapshot(self) -> dict[int, tuple[float, float]]:
        """The observed keys with (accepted, trials), for persistence and statistics."""
        with self.lock:
            return {k: (self.accepted[k], self.trials[k]) for k in range(N_KEYS) if self.trials[k] > 0}

    def load(self, stats: dict[int, tuple[float, float]]) -> None:
        """Replace the observations with ``stats`` as produced by ``snapshot``."""
        with self.lock:
            for k in range(N_KEYS):
                self.accepted[k], self.trials[k] = stats.get(k, (0.0, 0.0))

    def __len__(self) -> int:
        return sum(1 for t in self.trials if t > 0)

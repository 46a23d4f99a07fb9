"""Exponential backoff between attempts to reach something that is away: the policy, and a clock that follows it."""

from __future__ import annotations

import random
import time
from collections.abc import Callable
from dataclasses import dataclass


@dataclass(frozen=True)
class ExponentialBackoff:
    """How long to wait after consecutive failures: ``base_s * factor ** attempt``, at most ``cap_s``, with jitter.

    With ``jitter`` j, each wait is drawn uniformly from ``[(1 - j) * d, d]`` where d is the capped exponential
    delay: 0 waits exactly d, 1 is "full jitter" (anywhere in ``[0, d]``), 0.5 "equal jitter". Jitter only ever
    shortens a wait, so ``cap_s`` bounds every wait.

    Attributes:
        base_s: the first wait, in seconds.
        cap_s: the longest wait, in seconds.
        factor: how much longer each wait is than the one before (1 for a constant wait).
        jitter: the share of each wait that is random, in ``[0, 1]``.
    """

    base_s: float
    cap_s: float
    factor: float = 2.0
    jitter: float = 0.0

    def __post_init__(self) -> None:
        if not 0 < self.base_s <= self.cap_s:
            raise ValueError(f"need 0 < base_s <= cap_s, got {self.base_s}, {self.cap_s}")
        if self.factor < 1:
            raise ValueError(f"need factor >= 1, got {self.factor}")
        if not 0 <= self.jitter <= 1:
            raise ValueError(f"need 0 <= jitter <= 1, got {self.jitter}")

    def nominal(self, attempt: int) -> float:
        """The wait before retry ``attempt`` without jitter: ``min(cap_s, base_s * factor ** attempt)``.

        Args:
            attempt: how many waits came before this one since the last success (0 for the first).
        """
        if attempt < 0:
            raise ValueError(f"need attempt >= 0, got {attempt}")
        try:
            return min(self.cap_s, self.base_s * self.factor ** attempt)
        except OverflowError:
            return self.cap_s

    def delay(self, attempt: int, rng: random.Random | None = None) -> float:
        """The wait before retry ``attempt``, jittered (``rng``: the random source, the ``random`` module's if None).

        Args:
            attempt: how many waits came before this one since the last success (0 for the first).
            rng: where the jitter is drawn from; pass a seeded ``random.Random`` for repeatable waits.
        """
        d = self.nominal(attempt)
        if self.jitter:
            d *= (rng or random).uniform(1.0 - self.jitter, 1.0)
        return d


class BackoffClock:
    """Counts consecutive failures and says when the next attempt is due, following an ExponentialBackoff.

    Callers that sleep use the wait ``failure`` returns; callers that must not block ask ``ready`` instead and skip
    the attempt until then. Not thread-safe: callers sharing one across threads hold their own lock.
    """

    def __init__(self, policy: ExponentialBackoff, clock: Callable[[], float] = time.monotonic,
                 rng: random.Random | None = None) -> None:
        """Start with no failures (``clock``: seconds, monotonic; ``rng``: where the jitter is drawn from)."""
        self.policy = policy
        self._clock, self._rng = clock, rng
        self._failures = 0
        self._wait = 0.0
        self._ready_at = 0.0

    @property
    def failures(self) -> int:
        """Failures since the last success."""
        return self._failures

    @property
    def last_wait(self) -> float:
        """The wait the last failure asked for, in seconds (0 after a success)."""
        return self._wait

    @property
    def ready_at(self) -> float:
        """When the next attempt may be made, on the clock (0 after a success)."""
        return self._ready_at

    def ready(self) -> bool:
        """Whether an attempt may be made now."""
        return self._clock() >= self._ready_at

    def failure(self) -> float:
        """An attempt failed: return the wait before the next one, and make ``ready`` false until it has passed."""
        self._wait = self.policy.delay(self._failures, self._rng)
        self._failures += 1
        self._ready_at = self._clock() + self._wait
        return self._wait

    def reset(self) -> None:
        """An attempt succeeded: the next failure waits ``base_s`` again, and an attempt may be made at once."""
        self._failures, self._wait, self._ready_at = 0, 0.0, 0.0

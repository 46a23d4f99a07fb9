"""The verify budget's learning, off the engine's critical path.

A batched step learns two things for the budget: which of the last chains' tokens were accepted (the calibration)
and how long the previous step took (the cost curve). Folding them in, and refitting the calibration's exponent,
costs more than choosing the cut itself. ``DeferredLearning`` gathers them during a step and hands them over when the
step is done, as work for a background thread (pre-speculation's sender, which the step wakes anyway) to do while the
engine runs its forward pass. The next step first applies whatever that thread has not got to, so every step chooses
with exactly the lessons of the steps before it, however the threads were scheduled (the choices do not depend on
timing).
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from functools import partial
from typing import Any, TypeVar

from drafter_service.api.verify_budget import VerifyBudget

__all__ = ["DeferredLearning"]

T = TypeVar("T")

#: A lesson: a method of the budget's calibration or curve, and its arguments.
Lesson = tuple[Callable[..., None], tuple[Any, ...]]

#: The cuts the next step may ask for: () -> (chains' estimates, most tokens per chain, base tokens), or None.
Upcoming = Callable[[], tuple[list[list[float]], int, int] | None]


class DeferredLearning:
    """A ``VerifyBudget`` whose lessons are applied between steps, by whichever thread runs the work ``hand_over``
    returns.

    The engine's thread calls ``outcomes`` and ``step_time`` during a step, ``hand_over`` when the step is done, and
    ``catch_up`` before it chooses the next cut with ``budget``.
    """

    def __init__(self, budget: VerifyBudget) -> None:
        self.budget = budget
        self._gathered: list[Lesson] = []  # this step's lessons (the engine's thread only)
        self._handed: list[Lesson] = []  # handed over, not applied yet (under the lock)
        self._lock = threading.Lock()
        # hand-overs so far, and the last one whose work was done while no later one had come (set last, under the
        # lock): equal, no work is left to run and a choice needs no lock (works run in order, on one thread)
        self._hand_overs = 0
        self._settled = 0

    def outcomes(self, chains: list[tuple[list[float], int]]) -> None:
        """Teach the calibration: per verified chain, its tokens' estimates and how many of its leading tokens were
        accepted (clipped to the chain)."""
        self._gathered.append((self._observe_chains, (chains,)))

    def step_time(self, tokens: int, seconds: float) -> None:
        """Teach the cost curve: a step of ``tokens`` query tokens took ``seconds``."""
        self._gathered.append((self.budget.curve.observe, (tokens, seconds)))

    def hand_over(self, upcoming: Upcoming | None = None) -> Callable[[], None] | None:
        """The step is done: returns the work that applies its lessons, for a background thread (None: nothing was
        learnt and nothing is upcoming). Work not done by the next ``catch_up`` is done there.

        Args:
            upcoming: called by that work once the lessons are in: ``(chains, limit, base tokens)`` of the cuts the
                next step may ask for (``VerifyBudget.prepare``), or None.
        """
        if not self._gathered and upcoming is None:
            return None
        gathered, self._gathered = self._gathered, []
        with self._lock:
            self._handed += gathered
            self._hand_overs += 1
            return partial(self._learn, self._hand_overs, upcoming)

    def catch_up(self) -> None:
        """Apply what was handed over and not applied yet (before choosing, on the engine's thread). Taking the lock
        also waits for a background thread to finish what it is computing, so the choice reads settled state."""
        if self._settled == self._hand_overs:  # that thread did all there was, and is done with the budget
            return
        with self._lock:
            self._apply()

    def read(self, what: Callable[[VerifyBudget], T]) -> T:
        """``what(budget)`` while no lesson is being applied (for another thread reading the budget's state)."""
        with self._lock:
            return what(self.budget)

    def _observe_chains(self, chains: list[tuple[list[float], int]]) -> None:
        estimates: list[float] = []
        accepted: list[bool] = []
        for probs, n in chains:
            n = min(max(n, 0), len(probs))
            estimates += probs
            accepted += [True] * n + [False] * (len(probs) - n)
        self.budget.calibration.observe(estimates, accepted)

    def _apply(self) -> None:
        handed, self._handed = self._handed, []
        for learn, args in handed:
            learn(*args)

    def _learn(self, hand_over: int, upcoming: Upcoming | None) -> None:
        with self._lock:
            self._apply()
            # what the next choice reads, computed now rather than on the engine's thread
            ahead = upcoming() if upcoming is not None else None
            self.budget.prepare(*(ahead or ()))
            if hand_over == self._hand_overs:
                self._settled = hand_over

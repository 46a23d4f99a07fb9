"""The verify budget's learning, off the engine's critical path.

A batched step learns two things for the budget: which of the last chains' tokens were accepted (the calibration)
and how long the previous step took (the cost curve). Folding them in, and refitting the calibration's exponent,
costs more than choosing the cut itself. ``DeferredLearning`` gathers them during a step and hands them, when the
step is done, to a background thread that applies them while the engine runs its forward pass. The next step first
applies whatever the thread has not got to, so every step chooses with exactly the lessons of the steps before it,
however the threads were scheduled (the choices do not depend on timing).
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable
from typing import Any, TypeVar

from drafter_service.api.verify_budget import VerifyBudget

__all__ = ["DeferredLearning"]

T = TypeVar("T")

#: A lesson: a method of the budget's calibration or curve, and its arguments.
Lesson = tuple[Callable[..., None], tuple[Any, ...]]


class DeferredLearning:
    """A ``VerifyBudget`` whose lessons are applied by a background thread between steps.

    The engine's thread calls ``outcomes`` and ``step_time`` during a step, ``hand_over`` when the step is done, and
    ``catch_up`` before it chooses the next cut with ``budget``.
    """

    def __init__(self, budget: VerifyBudget) -> None:
        self.budget = budget
        self._gathered: list[Lesson] = []  # this step's lessons (the engine's thread only)
        self._handed: list[Lesson] = []  # handed over, not applied yet (under the lock)
        self._lock = threading.Lock()
        self._wake: queue.SimpleQueue[bool] = queue.SimpleQueue()  # True: lessons were handed over; False: stop
        self._thread: threading.Thread | None = None

    def outcomes(self, estimates: list[float], accepted: list[bool]) -> None:
        """Teach the calibration: each verified chain token's estimate and whether it was accepted."""
        self._gathered.append((self.budget.calibration.observe, (estimates, accepted)))

    def step_time(self, tokens: int, seconds: float) -> None:
        """Teach the cost curve: a step of ``tokens`` query tokens took ``seconds``."""
        self._gathered.append((self.budget.curve.observe, (tokens, seconds)))

    def hand_over(self) -> None:
        """The step is done: the background thread may apply its lessons now."""
        if not self._gathered:
            return
        gathered, self._gathered = self._gathered, []
        with self._lock:
            self._handed += gathered
        self._wake.put(True)  # a plain lock and a C queue: the cheapest hand-over on the engine's thread
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="drafter-budget", daemon=True)
            self._thread.start()

    def catch_up(self) -> None:
        """Apply what was handed over and not applied yet (before choosing, on the engine's thread). Taking the lock
        also waits for the background thread to finish what it is computing, so the choice reads settled state."""
        with self._lock:
            self._apply()

    def read(self, what: Callable[[VerifyBudget], T]) -> T:
        """``what(budget)`` while no lesson is being applied (for another thread reading the budget's state)."""
        with self._lock:
            return what(self.budget)

    def close(self) -> None:
        """Stop the background thread once it has applied what was handed over."""
        self._wake.put(False)

    def _apply(self) -> None:
        handed, self._handed = self._handed, []
        for learn, args in handed:
            learn(*args)

    def _run(self) -> None:
        while self._wake.get():
            with self._lock:
                self._apply()
                # what the next choice reads, computed now rather than on the engine's thread
                self.budget.prepare()

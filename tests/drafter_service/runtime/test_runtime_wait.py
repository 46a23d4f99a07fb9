"""`Runtime.wait`, where `drafter serve`'s main thread waits for a signal, holds no lock a signal handler needs."""

from __future__ import annotations

import threading

from drafter_service.runtime.runtime import Runtime
from drafter_service.service.config import ServiceConfig


class RecordingLock:
    """A lock that records which threads acquired it."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.takers: list[str] = []

    def acquire(self, blocking: bool = True, timeout: float = -1) -> bool:
        got = self._lock.acquire(blocking, timeout)
        if got:
            self.takers.append(threading.current_thread().name)
        return got

    def release(self) -> None:
        self._lock.release()

    def locked(self) -> bool:
        return self._lock.locked()

    __enter__ = acquire

    def __exit__(self, *exc: object) -> None:
        self.release()


def test_wait_never_takes_the_lock_that_stop_in_a_signal_handler_takes():
    # The SIGTERM handler runs on the main thread, between two of its bytecodes, and calls stop(), which sets the
    # stopped flag under its lock; a main thread that held that lock then (Event.wait does, for a moment after each
    # timeout) deadlocked `drafter serve` at shut-down. The main thread must not take it while it waits.
    runtime = Runtime(ServiceConfig())
    lock = RecordingLock()
    runtime._stopped._cond = threading.Condition(lock)  # type: ignore[attr-defined]
    stopper = threading.Timer(0.8, runtime.stop)
    stopper.name = "stopper"
    stopper.start()
    runtime.wait()  # returns once stop() has run in the other thread
    stopper.join()
    assert runtime._stopped.is_set()
    assert threading.main_thread().name not in lock.takers and "stopper" in lock.takers

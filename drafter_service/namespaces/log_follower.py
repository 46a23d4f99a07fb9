"""Scale-out: a replica follows its namespace's shared request log and frozen-table events into its own store."""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
from collections.abc import Sequence

import numpy as np

from drafter_service.api.backoff import BackoffClock, ExponentialBackoff
from drafter_service.namespaces.durable_log import DurableLog
from store.persistence import RedisPersistence
from store.request_log import RequestRecord

logger = logging.getLogger(__name__)

BLOCK_MS = 1000
"""How long one blocking read waits for news (it returns as soon as an entry arrives)."""
BATCH = 1000
"""Most log entries read per call."""
BACKOFF = ExponentialBackoff(base_s=0.05, cap_s=5.0)
"""Waits between reconnection attempts while Redis cannot be reached (doubling from 50 ms up to 5 s)."""
RESET_CHECK_S = 5.0
"""How often an idle follower checks that the log did not go back (a Redis that lost its data)."""
MAX_OWN = 1 << 16
"""Most own appends remembered out of order (only when reading the entries before them failed)."""


def default_replica_id() -> str:
    """This replica's default name: host name and process id."""
    return f"{socket.gethostname()}-{os.getpid()}"


def log_end(stream_id: str) -> int:
    """The ring slot count a request log id records ("<end>-0" -> end)."""
    return int(stream_id.partition("-")[0])


class LogFollower:
    """Keeps one namespace's store in step with the request log that every replica on the Redis appends to.

    The log's ``position`` is the stream id of the newest entry its store holds, with every entry
    before it held too. Entries are applied in log order by two paths that share the namespace's write lock:

    - this thread, which waits on the log (XREAD BLOCK) and applies every entry after the position;
    - the namespace's own appends (``before_own``): once an append returns its stream ids, the entries other
      replicas logged just before them (known from the ids, which count ring slots) are read and applied
      first, so every replica's ring buffer holds the requests in the same order as the log.

    An own entry is therefore never applied twice: the position passes it when it is stored. When the read
    before an own append fails, the own entries are stored at once and remembered, and this thread skips them.
    A gap in the log (entries trimmed before this replica read them, after a long outage) is logged and
    skipped. Frozen-table events make the namespace's tables match the stored ones again.

    Attributes:
        replica_id: this replica's name (logs and metrics).
        applied: entries from other replicas applied since the start.
        skipped_slots: ring slots of entries trimmed from the log before this replica could read them.
        connected: False while Redis cannot be reached.
    """

    def __init__(self, log: DurableLog, replica_id: str = "", block_ms: int = BLOCK_MS, batch: int = BATCH) -> None:
        if log.persistence is None:
            raise ValueError(f"namespace {log.name!r} has no persistence: there is no shared log to follow")
        self.log = log
        self.persistence: RedisPersistence = log.persistence
        self.replica_id = replica_id or default_replica_id()
        self.block_ms = int(block_ms)
        self.batch = int(batch)
        self.applied = 0
        self.skipped_slots = 0
        self.frozen_syncs = 0
        self.connected = True
        self._own: set[str] = set()  # own entries stored before the ones logged ahead of them
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._last_reset_check = time.monotonic()

    # -- lifecycle ------------------------------------------------------------------------------------

    def attach(self) -> LogFollower:
        """Take the namespace's own appends (they now keep log order) without starting the thread (``poll``
        then steps by hand)."""
        self.log.follower = self
        return self

    def start(self) -> LogFollower:
        """Attach to the namespace and start following."""
        self.attach()
        self._thread = threading.Thread(target=self._run, name=f"follow-{self.log.name}", daemon=True)
        self._thread.start()
        logger.info("replica %s follows namespace %s from %s", self.replica_id, self.log.name, self.log.position)
        return self

    def stop(self, wait: bool = True) -> None:
        """Stop following: the thread applies nothing after this returns. Safe to call twice.

        With ``wait`` the thread is also joined (a blocking read in progress ends within ``block_ms``);
        without, it ends on its own once that read returns.
        """
        self._stop.set()
        with self.log.write_lock:  # an apply in progress finishes first; later ones see the flag
            pass
        if wait and self._thread is not None:
            self._thread.join(self.block_ms / 1000 + 2.0)

    def stats(self) -> dict[str, object]:
        """Figures for metrics: replica, position, entries applied, slots lost to trimming, connection."""
        return {"replica": self.replica_id, "log_position": self.log.position, "applied": self.applied,
                "skipped_slots": self.skipped_slots, "frozen_syncs": self.frozen_syncs,
                "connected": self.connected}

    # -- the own append path (caller holds the namespace's write lock) ---------------------------------

    def before_own(self, ids: Sequence[str | None], docs: Sequence[tuple[np.ndarray, str | None]]) -> None:
        """Apply what other replicas logged before this replica's just-appended ``docs``, then pass them.

        Called with the namespace's write lock held, after the append and before the documents enter the
        store; ``ids`` are the append's stream ids (None for duplicates left out).
        """
        own = [(sid, doc) for sid, (doc, _) in zip(ids, docs, strict=True) if sid is not None]
        if not own:
            return
        ns = self.log
        before = log_end(own[0][0]) - int(own[0][1].size) - 1  # the log's end just before this append
        position = log_end(ns.position)
        if before > position:
            try:
                self._apply(self.persistence.read_requests_range(ns.position, f"{before}-0"))
            except Exception as exc:  # stored out of order instead; the thread skips them later
                logger.warning("namespace %s: could not read the %d log slots before an own append (%s); "
                               "storing it first", ns.name, before - position, exc)
                self._remember(sid for sid, _ in own)
                return
        elif before < position:
            logger.error("namespace %s: the request log went back from %s to %d (did Redis lose data?); "
                         "following from the new end", ns.name, ns.position, before)
        ns.position = own[-1][0]

    def _remember(self, ids: Sequence[str] | object) -> None:
        if len(self._own) > MAX_OWN:
            logger.error("namespace %s: %d own entries wait out of order; forgetting them (they may be stored "
                         "twice)", self.log.name, len(self._own))
            self._own.clear()
        self._own.update(ids)  # type: ignore[arg-type]

    # -- applying -------------------------------------------------------------------------------------

    def _apply(self, records: Sequence[RequestRecord]) -> int:
        """Store the entries after the position, in log order (caller holds the write lock); returns how many."""
        ns = self.log
        position = log_end(ns.position)
        stored = 0
        for rec in records:
            end = log_end(rec.stream_id)
            if end <= position:  # already held: an own append or an earlier read passed it
                continue
            if rec.stream_id in self._own:
                self._own.discard(rec.stream_id)
            elif rec.writer is not None and rec.writer == ns.writer_id:
                pass  # own, though its append failed (a lost reply, a timeout): the spool put it in memory
            else:
                start = end - int(rec.tokens.size) - 1
                if start > position:
                    self.skipped_slots += start - position
                    logger.warning("namespace %s: %d ring slots of the request log were trimmed before replica %s "
                                   "read them; following from %s", ns.name, start - position, self.replica_id,
                                   rec.stream_id)
                ns.store(rec.tokens, rec.prompt_len)
                stored += 1
            position = end
            ns.position = rec.stream_id
        self.applied += stored
        return stored

    def poll(self, block_ms: int = 0) -> int:
        """Read and apply what is new once (the thread's step; also for tests). Returns entries applied.

        Raises:
            PersistenceUnavailable: Redis cannot be reached.
        """
        ns = self.log
        records, events = self.persistence.read_changes(ns.position, ns.event_position, block_ms, self.batch)
        stored = 0
        if records:
            with ns.write_lock:
                if self._stop.is_set():
                    return 0
                stored = self._apply(records)
        if events and not self._stop.is_set():
            self.sync_frozen()
            ns.event_position = events[-1][0]
        if not records and not events:
            self._check_reset()
        return stored

    def sync_frozen(self) -> None:
        """Load, replace or drop frozen tables so the namespace drafts from what Redis holds."""
        changed = self.log.sync_frozen()
        self.frozen_syncs += 1
        if changed:
            logger.info("namespace %s: frozen tables changed by another replica: %s", self.log.name, changed)

    def _check_reset(self) -> None:
        """When idle, now and then: notice a log whose end went back (Redis lost data) and follow its new end."""
        now = time.monotonic()
        if now - self._last_reset_check < RESET_CHECK_S:
            return
        self._last_reset_check = now
        ns = self.log
        with ns.write_lock:  # read under the lock: an own append between the read and the check is no loss
            last = self.persistence.last_id()
            if log_end(last) < log_end(ns.position):
                logger.error("namespace %s: the request log ends at %s, before this replica's %s (did Redis lose "
                             "data?); following from there", ns.name, last, ns.position)
                ns.position = last

    def _run(self) -> None:
        backoff = BackoffClock(BACKOFF)
        while not self._stop.is_set():
            try:
                self.poll(self.block_ms)
            except Exception as exc:  # Redis away (or a bad entry): retried with backoff, serving goes on
                if self._stop.is_set():
                    return
                if self.connected:
                    logger.warning("namespace %s: following the request log failed (%s); retrying", self.log.name,
                                   exc)
                self.connected = False
                self._stop.wait(backoff.failure())
                continue
            if not self.connected:
                logger.info("namespace %s: following the request log again from %s", self.log.name,
                            self.log.position)
                self.connected = True
                backoff.reset()
                try:  # events may have been missed while away (or Redis lost them)
                    self.sync_frozen()
                except Exception:
                    logger.exception("namespace %s: frozen table sync failed", self.log.name)

"""A namespace's durable log: Redis when it answers, a local fsynced spool while it does not, drained in order."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np

from drafter_service.api.errors import Unavailable
from drafter_service.namespaces.durable_log import DurableLog
from store.persistence import RedisPersistence
from store.request_log import Duplicates, duplicate_keys
from store.spool import HEADER_BYTES, Spool, SpoolBusy, SpoolCorrupt, SpoolError, SpoolFull, SpoolRecord, new_id

logger = logging.getLogger(__name__)

BATCH = 256
"""Most spooled requests moved to Redis per append call (and per hold of the namespace's write lock)."""
SUFFIX = ".spool"


class SpoolingLog:
    """Appends a namespace's completed requests to Redis, or to a local spool while Redis cannot take them.

    Every append carries this writer's sequence numbers, so Redis can tell a request it already holds from
    one it never saw (``RedisPersistence.append_requests``' writer mark). When an append fails (connection
    refused, timeout, fsync or replicas not confirmed, fewer replicas online than it needs; each within the
    persistence's short write timeout) the requests go to a spool file, fsynced before they are acknowledged,
    with the sequence numbers of that attempt: if it did reach Redis after all, the drain leaves them out. From
    then on every request goes to the spool, behind the ones already there, without asking Redis, until
    ``drain`` (the persistence health thread, woken by ``on_hold``) has moved them all to Redis in order; only
    then do appends go to Redis again, so the log keeps the order of the ring buffer. A full spool refuses with
    UNAVAILABLE and changes nothing.

    The spool file (``<folder>/<namespace>/<created ns>-<writer id>.spool``) is made at the first request it
    holds and locked while this process lives. At start, ``adopt_orphans`` drains the files of processes that
    died (their locks are free) into Redis before the namespace is restored, so nothing acknowledged is lost
    when the service crashes during an outage. A file made for another Redis data set (its store id differs)
    is left alone with a warning.

    ``append`` and the drain's batches run under the namespace's write lock; the rest is read-only.

    Attributes:
        writer_id: this process's writer name in Redis.
        store_id: the namespace's data set in Redis, written into spool files.
        redis_ok: False since an append or drain failed, until one succeeds again.
        on_hold: called (under the write lock; it must not block) when an append Redis could not take goes to
            the spool, so that whoever drains it starts trying at once.
    """

    def __init__(self, log: DurableLog, folder: Path | str, max_bytes: int) -> None:
        """Attach to a namespace with persistence (its Redis must answer: the store id is read now)."""
        if log.persistence is None:
            raise ValueError(f"namespace {log.name!r} has no persistence to spool for")
        self.log = log
        self.persistence: RedisPersistence = log.persistence
        self.folder = Path(folder) / log.name
        self.max_bytes = int(max_bytes)
        self.writer_id = new_id()
        log.writer_id = self.writer_id  # the log follower leaves this process's own entries to it
        self.store_id = self.persistence.store_id()
        self.redis_ok = True
        self.on_hold: Callable[[], None] | None = None
        self._seq = 0  # the last sequence number given
        self._spool: Spool | None = None  # made at the first request held
        self._drained = HEADER_BYTES  # offset of the first spooled record Redis does not hold yet
        self._drained_count = 0
        self._held_keys: set[bytes] = set()  # duplicate keys of the requests held (skip_duplicates while away)

    # -- state ------------------------------------------------------------------------------------------

    @property
    def held(self) -> int:
        """Acknowledged requests in the spool that Redis does not hold yet."""
        return self._spool.count - self._drained_count if self._spool is not None else 0

    @property
    def holding(self) -> bool:
        """Whether requests wait in the spool (appends then go behind them, not to Redis)."""
        return self.held > 0

    def stats(self) -> dict[str, int]:
        """``spooled_requests`` and ``spooled_bytes`` waiting for Redis (metrics and /healthz)."""
        held_bytes = self._spool.size - self._drained if self._spool is not None and self.holding else 0
        return {"spooled_requests": self.held, "spooled_bytes": held_bytes}

    # -- appends (caller holds the namespace's write lock) ---------------------------------------------------

    def append(self, docs: list[tuple[np.ndarray, str | None]], prompt_lens: list[int],
               skip_duplicates: Duplicates | bool = False) -> tuple[list[str | None], bool]:
        """Append to Redis, or to the spool when Redis cannot take them or requests already wait there.

        Returns:
            (ids, spooled): stream ids from Redis (None for each duplicate left out) and False; or placeholder
            ids ("spool-<seq>", None for a duplicate of a request held) and True when they went to the spool.

        Raises:
            Unavailable: neither Redis nor the spool could keep them (nothing was acknowledged or kept).
        """
        first = self._seq + 1
        self._seq += len(docs)
        if not self.holding:
            try:
                ids = self.persistence.append_requests(docs, prompt_lens, skip_duplicates,
                                                          writer=(self.writer_id, first))
                self.redis_ok = True
                return ids, False
            except ValueError:
                raise
            except Exception as exc:
                if self.redis_ok:
                    logger.warning("namespace %s: Redis cannot take requests (%s); holding them in the spool "
                                   "under %s until it can", self.log.name, exc, self.folder)
                self.redis_ok = False
                cause: Exception = exc
                if self.on_hold is not None:
                    self.on_hold()
        else:
            cause = Unavailable("requests wait in the spool")
        return self._hold(docs, prompt_lens, skip_duplicates, first, cause), True

    def _hold(self, docs: list[tuple[np.ndarray, str | None]], prompt_lens: list[int],
              skip_duplicates: Duplicates | bool, first: int, cause: Exception) -> list[str | None]:
        if self.max_bytes <= 0:
            raise Unavailable(f"could not store the request durably: {cause}") from cause
        rule = Duplicates.of(skip_duplicates)
        ids: list[str | None] = []
        records: list[SpoolRecord] = []
        keys: set[bytes] = set()
        for i, ((tokens, request_id), plen) in enumerate(zip(docs, prompt_lens, strict=True)):
            blob = np.asarray(tokens, dtype="<i4").tobytes()
            id_key, hash_key = duplicate_keys(blob, plen, request_id)
            mine = {k for k in (id_key, hash_key) if k}
            if rule.skips(id_key, hash_key, self._held_keys | keys):
                ids.append(None)
                continue
            keys |= mine
            records.append(SpoolRecord(first + i, np.asarray(tokens, dtype=np.int32), plen, request_id, rule))
            ids.append(f"spool-{first + i}")
        if not records:
            return ids
        try:
            if self._spool is None:
                path = self.folder / f"{time.time_ns():020d}-{self.writer_id}{SUFFIX}"
                self._spool = Spool.create(path, self.writer_id, self.store_id, self.max_bytes)
                logger.info("namespace %s: spool %s made", self.log.name, path)
            self._spool.append(records)
        except SpoolFull as exc:
            logger.error("namespace %s: %s; refusing", self.log.name, exc)
            raise Unavailable(f"Redis cannot take the request ({cause}) and the local spool is full: {exc}") \
                from exc
        except (OSError, SpoolError) as exc:
            logger.error("namespace %s: cannot write the spool (%s); refusing", self.log.name, exc)
            raise Unavailable(f"Redis cannot take the request ({cause}) and the local spool failed: {exc}") \
                from exc
        self._held_keys |= keys
        return ids

    # -- moving held requests to Redis ---------------------------------------------------------------------

    def drain(self) -> int:
        """Move every held request to Redis, oldest first, then empty the spool (background job).

        Each batch is appended under the namespace's write lock, with the requests' sequence numbers, so a
        batch retried after a lost reply stores nothing twice; new requests keep going behind them until the
        spool is empty.

        Returns:
            Requests moved (0 when none wait or Redis does not answer).

        Raises:
            PersistenceError: Redis failed part way (what was moved stays moved; the rest is retried).
        """
        if not self.holding:
            return 0
        if not self.persistence.ping():
            self.redis_ok = False
            return 0
        moved = 0
        t0 = time.perf_counter()
        while True:
            with self.log.write_lock:
                spool = self._spool
                assert spool is not None  # holding
                records, end = spool.read(self._drained, BATCH)
                if not records:
                    spool.truncate()
                    self._drained, self._drained_count = HEADER_BYTES, 0
                    self._held_keys.clear()
                    self.redis_ok = True
                    logger.info("namespace %s: %d spooled requests moved to Redis in %.2f s; appending directly "
                                "again", self.log.name, moved, time.perf_counter() - t0)
                    return moved
                try:
                    self._send(self.writer_id, records, own=True)
                except Exception:
                    self.redis_ok = False
                    raise
                self._drained = end
                self._drained_count += len(records)
                moved += len(records)

    def _send(self, writer_id: str, records: Sequence[SpoolRecord], own: bool) -> None:
        """Append runs of records with consecutive sequence numbers and one duplicate policy each."""
        p = self.persistence
        i = 0
        while i < len(records):
            j = i + 1
            while j < len(records) and records[j].seq == records[j - 1].seq + 1 and \
                    records[j].skip_duplicates == records[i].skip_duplicates:
                j += 1
            run = records[i:j]
            docs = [(r.tokens, r.request_id) for r in run]
            ids = p.append_requests(docs, [r.prompt_len for r in run], run[0].skip_duplicates,
                                    writer=(writer_id, run[0].seq))
            if own:  # already in the store: the log position passes them
                self.log.logged(ids, docs)
            i = j

    # -- start and stop ------------------------------------------------------------------------------------

    def adopt_orphans(self) -> int:
        """Move the requests held in spool files of dead processes to Redis, then delete those files.

        Called at start, before the namespace is restored from Redis. Files locked by a live process, or made
        for another Redis data set, are left alone; one with corrupt records keeps them as ``*.corrupt`` after
        its readable records are moved.

        Returns:
            Requests moved.
        """
        if not self.folder.is_dir():
            return 0
        moved = 0
        for path in sorted(self.folder.glob(f"*{SUFFIX}")):
            try:
                spool = Spool.open(path)
            except SpoolBusy:
                logger.info("namespace %s: spool %s belongs to a live process; left alone", self.log.name, path)
                continue
            except (SpoolCorrupt, OSError) as exc:
                logger.error("namespace %s: spool %s cannot be read (%s); kept as %s", self.log.name, path, exc,
                             path.with_suffix(".corrupt"))
                path.rename(path.with_suffix(".corrupt"))
                continue
            try:
                moved += self._adopt(spool)
            finally:
                spool.close()
        return moved

    def _adopt(self, spool: Spool) -> int:
        if spool.store_id != self.store_id:
            logger.warning("namespace %s: spool %s holds %d requests for another Redis data set (store %s, "
                           "this one is %s); left alone", self.log.name, spool.path, spool.count, spool.store_id,
                           self.store_id)
            return 0
        offset, moved, corrupt = HEADER_BYTES, 0, bool(spool.unreadable)
        while True:
            try:
                records, offset = spool.read(offset, BATCH)
            except SpoolCorrupt as exc:
                logger.error("namespace %s: %s", self.log.name, exc)
                corrupt = True
                break
            if not records:
                break
            self._send(spool.writer_id, records, own=False)
            moved += len(records)
        if corrupt:
            keep = spool.path.with_suffix(".corrupt")
            logger.error("namespace %s: spool %s: %d readable requests moved to Redis; its unreadable bytes are "
                         "kept in %s", self.log.name, spool.path, moved, keep)
            spool.path.rename(keep)
        else:
            self.persistence.forget_writer(spool.writer_id)
            spool.close(remove=True)
        logger.info("namespace %s: %d requests of a stopped process's spool %s moved to Redis", self.log.name,
                    moved, spool.path.name)
        return moved

    def close(self) -> None:
        """Drain what Redis will take, then delete the spool when it is empty (else keep it for the next start)."""
        try:
            self.drain()
        except Exception as exc:
            logger.warning("namespace %s: final drain failed: %s", self.log.name, exc)
        if self.holding:
            assert self._spool is not None
            logger.warning("namespace %s: %d acknowledged requests stay in %s; the next start moves them to Redis",
                           self.log.name, self.held, self._spool.path)
            self._spool.close()
            return
        if self._spool is not None:
            self._spool.close(remove=True)
        try:
            self.persistence.forget_writer(self.writer_id)
        except Exception:  # the mark expires on its own
            pass

    def check_invariants(self) -> None:
        """Assert the spool's own invariants and that the drained part lies within it."""
        if self._spool is None:
            assert self._drained == HEADER_BYTES and self._drained_count == 0
            return
        self._spool.check_invariants()
        assert HEADER_BYTES <= self._drained <= self._spool.size
        assert 0 <= self._drained_count <= self._spool.count

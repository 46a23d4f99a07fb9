"""A namespace's index file: saved in the background after each main index rebuild, used at start if it still fits.

The file (``store.index_file``) holds the ring buffer's tokens, the main suffix index and the repeated-prompt cache
as they were at one position of the request log. At start the namespace maps it, checks it against Redis, and
then only the requests logged after that position are read and stored, instead of every request and a rebuild of
the main index. A file that is missing, corrupt, or made for another namespace, vocabulary, capacity or Redis data
set, or whose position the log no longer holds, is reported with a warning and the namespace is rebuilt from the
log as without one.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from drafter_service.core.drafter import Drafter
from drafter_service.namespaces.durable_log import DurableLog
from store.index_file import (
    ChecksumAhead,
    IndexFile,
    IndexFileError,
    IndexFileHeader,
    read_index_file,
    store_arrays,
    write_index_file,
)
from store.persistence import RedisPersistence
from store.ring_buffer import SEPARATOR

logger = logging.getLogger(__name__)

SUFFIX = ".index"
"""File name of a namespace's index file: ``<namespace>.index`` in the index folder."""


REWRITE_SHARE = 16
"""After a delta rebuild the file is written again once the indexes reach this share (1/16) of the tokens the file
holds beyond it (at least ``tail_tokens``); after a main rebuild, always."""
DUTY = 10
"""Writes are at least this many times the last write's duration apart (the file is written at most a tenth of
the time, however fast requests arrive); a due write waits for the next job run after that."""


@dataclass(frozen=True)
class Written:
    """The last index file written: the position it covers, its size and what writing it took."""

    stream_id: str
    tokens: int
    nbytes: int
    seconds: float


class IndexFiles:
    """Writes and reads one namespace's index file.

    Args:
        path: the file.
        name: the namespace.
        drafter: its core (store, repeated-prompt cache, configuration).
        log: its durable log (the write lock, the position).
        persistence: its Redis persistence.
        holding: whether its spool holds requests the log does not have yet (no file is written then).
        checked: the file's checksum, computed ahead in the background (``load`` then skips its own pass).
    """

    def __init__(self, path: Path, name: str, drafter: Drafter, log: DurableLog, persistence: RedisPersistence,
                 holding: Callable[[], bool] = lambda: False, checked: ChecksumAhead | None = None) -> None:
        self.path = Path(path)
        self.checked = checked
        self.name = name
        self.drafter = drafter
        self.log = log
        self.persistence = persistence
        self.holding = holding
        self.due = False  # an index was built since the file was written that it should hold
        self.written: Written | None = None
        self.covered_end = 0  # ring position one past what the file's indexes cover (0: no file)
        self._next_write = 0.0  # monotonic time before which a due write waits (DUTY)
        self._store_id = ""
        self._lock = threading.Lock()  # one write at a time

    # -- writing ------------------------------------------------------------------------------------------

    def rebuilt(self, kind: str) -> None:
        """Note an index rebuild: a main index makes the file due; a delta index once it has grown by
        ``REWRITE_SHARE`` of what the file holds."""
        store = self.drafter.store
        held = max(0, self.covered_end - store.ring.oldest)
        if kind == "main" or store.indexed_end - self.covered_end >= max(store.tail_tokens, held // REWRITE_SHARE):
            self.due = True

    def save(self, behind: bool = False) -> Written | None:
        """Write the file when it is due (``rebuilt``) and the last write is ``DUTY`` times its duration ago, or
        with ``behind`` whenever the indexes cover more than it does (at shut-down).

        Runs in a background job: the tokens and the cache are copied under the namespace's write lock (so they
        match the log position), then written with the indexes without any lock.

        Returns:
            What was written, or None (nothing due, requests spooled, no main index yet).
        """
        if behind:
            if self.drafter.store.indexed_end <= self.covered_end:
                return None
        elif not self.due or time.monotonic() < self._next_write:
            return None
        with self._lock:
            t0 = time.perf_counter()
            with self.log.write_lock:
                if self.holding():
                    return None  # memory holds requests the log does not: written once they are in
                saved = self.drafter.store.saved()
                if saved is None:
                    return None
                position = self.log.position
                repeats = self.drafter.repeats.saved()
                self.due = False  # a main rebuild finishing while this one writes makes it due again
            cfg = self.drafter.config
            try:  # Redis may be away (the store id) or the disk full: written at a later run then
                header = IndexFileHeader.of(saved, self.name, cfg.vocab_size, cfg.capacity, self.store_id(), position)
                nbytes = write_index_file(self.path, header, {**store_arrays(saved), **repeats})
            except Exception:
                self.due = True
                raise
            seconds = time.perf_counter() - t0
            self._next_write = time.monotonic() + DUTY * seconds
            self.written = Written(position, int(saved.tokens.size), nbytes, seconds)
            self.covered_end = saved.indexed_end
            logger.info("namespace %s: index file %s written in %.2f s: %d tokens, %d of them indexed, up to "
                        "request %s, %.1f MB", self.name, self.path, seconds, saved.tokens.size,
                        saved.indexed_end - max(saved.start, saved.index.start), position, nbytes / 1e6)
            return self.written

    def store_id(self) -> str:
        """The Redis data set of the namespace's log (read once)."""
        if not self._store_id:
            self._store_id = self.persistence.store_id()
        return self._store_id

    # -- reading ------------------------------------------------------------------------------------------

    def load(self) -> IndexFile | None:
        """The file when it can be used for this namespace and its Redis log now; None with a warning otherwise.

        Checked: the checksum and format, the namespace, vocabulary size and capacity, the Redis data set, and that
        the log still holds the request the file ends with (not trimmed past it, nor lost by Redis), with the same
        tokens.
        """
        if not self.path.exists():
            if self.persistence.last_id() == "0-0":  # a new namespace: nothing to index
                logger.info("namespace %s: no index file at %s (nothing stored yet)", self.name, self.path)
            else:
                logger.warning("namespace %s: no index file at %s; rebuilding the index from the log", self.name,
                               self.path)
            return None
        t0 = time.perf_counter()
        cfg = self.drafter.config
        try:
            found = read_index_file(self.path, self.name, cfg.vocab_size, cfg.capacity, self.checked)
            self._check_log(found)
        except IndexFileError as exc:
            logger.warning("namespace %s: index file not used (%s); rebuilding the index from the log", self.name,
                           exc)
            return None
        logger.info("namespace %s: index file %s read and verified in %.2f s (%.1f MB, up to request %s)", self.name,
                    self.path, time.perf_counter() - t0, found.nbytes / 1e6, found.header.stream_id)
        return found

    def restore(self, found: IndexFile) -> None:
        """Give the (empty) core the file's store and repeated-prompt cache; the file then covers ``log.position``.

        Raises:
            IndexFileError: arrays that do not fit the store (nothing is changed then).
        """
        d = self.drafter
        saved = found.saved_store()
        try:
            d.store.restore(saved)
        except ValueError as exc:
            raise IndexFileError(str(exc)) from None
        self.covered_end = saved.indexed_end
        if d.config.use_repeat and "repeat_digests" in found.arrays:
            try:
                d.repeats.load(found.arrays)
            except (KeyError, ValueError) as exc:
                logger.warning("namespace %s: the index file's repeated-prompt cache not used: %s", self.name, exc)
        d.refresh_draft_vocabulary()
        self.log.position = found.header.stream_id

    def _check_log(self, found: IndexFile) -> None:
        h = found.header
        if h.store_id != self.store_id():
            raise IndexFileError(f"it was made for Redis data set {h.store_id!r}; this log is {self.store_id()!r}")
        last = self.persistence.last_id()
        if _position(h.stream_id) > _position(last):
            raise IndexFileError(f"it covers the log up to {h.stream_id} but the log ends at {last} (Redis lost data)")
        if h.stream_id == "0-0":
            return
        record = self.persistence.request_at(h.stream_id)
        if record is None:
            raise IndexFileError(f"the log no longer holds request {h.stream_id}, the last one it covers (trimmed)")
        if not _ends_with(found.arrays["tokens"], record.tokens):
            raise IndexFileError(f"its last request differs from request {h.stream_id} of the log")


def _position(stream_id: str) -> tuple[int, int]:
    a, _, b = stream_id.partition("-")
    return int(a), int(b or 0)


def _ends_with(tokens: np.ndarray, doc: np.ndarray) -> bool:
    """Whether the ring's tokens end with ``doc`` and its separator (as much of it as they hold)."""
    held = tokens.size - 1
    k = min(int(doc.size), held)
    if held < 0 or int(tokens[-1]) != SEPARATOR:
        return False
    if not np.array_equal(tokens[held - k:held], doc[doc.size - k:]):
        return False
    return k < doc.size or held == k or int(tokens[held - k - 1]) == SEPARATOR

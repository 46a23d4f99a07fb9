"""A local append-only journal of completed requests, fsynced per append, that holds them while Redis cannot."""

from __future__ import annotations

import fcntl
import logging
import os
import struct
import threading
import uuid
import zlib
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from store.request_log import Duplicates

logger = logging.getLogger(__name__)

__all__ = ["MAGIC", "HEADER_BYTES", "Spool", "SpoolBusy", "SpoolCorrupt", "SpoolError", "SpoolFull", "SpoolRecord",
           "new_id", "record_bytes"]

MAGIC = b"DRSPOOL\x01"
"""First bytes of every spool file (the last one is the format version)."""
_HEADER = struct.Struct("<8s16s16sI")  # magic, writer id, store id, crc32 of the bytes before it
HEADER_BYTES = _HEADER.size
_FRAME = struct.Struct("<II")  # payload length, crc32 of (length, payload)
_HEAD = struct.Struct("<QBqH")  # seq, flags, prompt length (-1: unknown), request id length in bytes
_SKIP, _HAS_ID, _SKIP_SAME_ID = 1, 2, 4
MAX_PAYLOAD = 1 << 31
"""Largest record payload; a frame declaring more is garbage."""


class SpoolError(RuntimeError):
    """A spool file cannot be used as asked."""


class SpoolFull(SpoolError):
    """The records would take the spool beyond its bound; nothing was written."""


class SpoolBusy(SpoolError):
    """Another live process holds the spool file's lock."""


class SpoolCorrupt(SpoolError):
    """A bad header, or a record that fails its checksum with more bytes after it (not a torn last write)."""


@dataclass(frozen=True)
class SpoolRecord:
    """One acknowledged request held in a spool.

    Attributes:
        seq: the writer's sequence number of the request (increasing through a file).
        tokens: (n,) int32 prompt + output.
        prompt_len: how many of ``tokens`` are the prompt (None: not recorded).
        request_id: the id it was sent with (None: none).
        skip_duplicates: the duplicate rule it was sent with (which stored requests leave it out).
    """

    seq: int
    tokens: np.ndarray
    prompt_len: int | None
    request_id: str | None
    skip_duplicates: Duplicates


def record_bytes(record: SpoolRecord) -> bytes:
    """The framed bytes of a record: length, checksum, then seq, flags, prompt length, request id and tokens."""
    rid = (record.request_id or "").encode()
    rule = Duplicates.of(record.skip_duplicates)
    flags = {Duplicates.KEEP: 0, Duplicates.SKIP: _SKIP, Duplicates.SKIP_SAME_ID: _SKIP_SAME_ID}[rule] | \
        (_HAS_ID if record.request_id is not None else 0)
    plen = -1 if record.prompt_len is None else int(record.prompt_len)
    payload = _HEAD.pack(int(record.seq), flags, plen, len(rid)) + rid + \
        np.ascontiguousarray(record.tokens, dtype="<i4").tobytes()
    length = struct.pack("<I", len(payload))
    return length + struct.pack("<I", zlib.crc32(payload, zlib.crc32(length))) + payload


def _parse(payload: bytes) -> SpoolRecord:
    seq, flags, plen, rid_len = _HEAD.unpack_from(payload)
    start = _HEAD.size + rid_len
    if start > len(payload) or (len(payload) - start) % 4:
        raise SpoolCorrupt("a record's request id or tokens do not fit its length")
    rid = payload[_HEAD.size:start].decode() if flags & _HAS_ID else None
    tokens = np.frombuffer(payload, dtype="<i4", offset=start).astype(np.int32)
    rule = Duplicates.SKIP if flags & _SKIP else Duplicates.SKIP_SAME_ID if flags & _SKIP_SAME_ID else Duplicates.KEEP
    return SpoolRecord(seq, tokens, None if plen < 0 else plen, rid, rule)


class Spool:
    """One writer's journal file: a header, then framed records, each fsynced before ``append`` returns.

    The owner holds an exclusive ``flock`` on the file for as long as it is open, so a file nobody holds
    belongs to a process that died and may be adopted (``Spool.open``). A write cut short by a crash leaves
    a torn last record, which its length or checksum exposes: it is dropped when the file is opened (it was
    never acknowledged). A record that fails its checksum with more bytes after it is corruption, not a torn
    write: ``read`` raises ``SpoolCorrupt`` after the records before it.

    Thread-safe: appends, reads and truncation take the spool's lock.

    Attributes:
        path: the file.
        writer_id: 32 hex digits naming the writer (its high-water mark in Redis is kept under this name).
        store_id: 32 hex digits naming the Redis data set the records belong to.
        max_bytes: bound on the file size (header included); 0 for none.
        size: bytes of the file that hold whole records (and the header).
        count: records held.
        unreadable: bytes after ``size`` that are not whole records and not a torn last write (corruption
            found by ``open``; never appended to, never dropped).
    """

    def __init__(self, path: Path, fd: int, writer_id: str, store_id: str, max_bytes: int, size: int,
                 count: int) -> None:
        self.path = path
        self._fd = fd
        self.writer_id = writer_id
        self.store_id = store_id
        self.max_bytes = int(max_bytes)
        self.size = size
        self.count = count
        self.unreadable = 0
        self._lock = threading.Lock()

    # -- opening ----------------------------------------------------------------------------------------

    @classmethod
    def create(cls, path: Path | str, writer_id: str, store_id: str, max_bytes: int = 0) -> Spool:
        """Create a new, empty spool file (it must not exist), lock it and make it durable with its folder.

        Raises:
            FileExistsError: the file exists.
            ValueError: the ids are not 32 hex digits, or ``max_bytes`` is below the header size.
        """
        if max_bytes and max_bytes < HEADER_BYTES:
            raise ValueError(f"max_bytes must be 0 or at least {HEADER_BYTES}, got {max_bytes}")
        header = _header(writer_id, store_id)
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            os.pwrite(fd, header, 0)
            os.fsync(fd)
            _fsync_dir(path.parent)
        except BaseException:
            os.close(fd)
            path.unlink(missing_ok=True)
            raise
        return cls(path, fd, writer_id, store_id, max_bytes, HEADER_BYTES, 0)

    @classmethod
    def open(cls, path: Path | str, max_bytes: int = 0) -> Spool:
        """Open and lock an existing spool file, dropping a torn last record.

        Raises:
            SpoolBusy: a live process holds it.
            SpoolCorrupt: its header is bad.
            OSError: it cannot be opened.
        """
        path = Path(path)
        fd = os.open(path, os.O_RDWR)
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                raise SpoolBusy(f"spool {path} is held by a live process") from None
            raw = os.pread(fd, HEADER_BYTES, 0)
            if len(raw) < HEADER_BYTES:
                raise SpoolCorrupt(f"spool {path} is shorter than its header ({len(raw)} bytes)")
            magic, writer, store, crc = _HEADER.unpack(raw)
            if magic != MAGIC or zlib.crc32(raw[:-4]) != crc:
                raise SpoolCorrupt(f"spool {path} has a bad header")
            spool = cls(path, fd, writer.hex(), store.hex(), max_bytes, HEADER_BYTES, 0)
            spool._recover()
        except BaseException:
            os.close(fd)
            raise
        return spool

    def _recover(self) -> None:
        """Find the end of the whole records; drop a torn last record (only when nothing follows it)."""
        end = os.fstat(self._fd).st_size
        offset, count = HEADER_BYTES, 0
        while offset < end:
            frame = self._frame_at(offset, end)
            if frame is None:
                break
            offset, count = frame[0], count + 1
        if offset < end:
            tail_torn = self._is_torn_tail(offset, end)
            if not tail_torn:
                self.size, self.count, self.unreadable = offset, count, end - offset
                logger.error("spool %s: the record at offset %d fails its checksum and %d bytes follow it; "
                             "%d records before it are readable", self.path, offset, end - offset, count)
                return
            logger.warning("spool %s: dropping a torn last record (%d bytes at offset %d; never acknowledged)",
                           self.path, end - offset, offset)
            os.ftruncate(self._fd, offset)
            os.fsync(self._fd)
        self.size, self.count = offset, count

    def _frame_at(self, offset: int, end: int) -> tuple[int, bytes] | None:
        """(offset after it, payload) of the valid record at ``offset``, or None when it is not one."""
        head = os.pread(self._fd, _FRAME.size, offset)
        if len(head) < _FRAME.size:
            return None
        length, crc = _FRAME.unpack(head)
        if length > MAX_PAYLOAD or offset + _FRAME.size + length > end:
            return None
        payload = os.pread(self._fd, length, offset + _FRAME.size)
        if len(payload) < length or zlib.crc32(payload, zlib.crc32(head[:4])) != crc:
            return None
        return offset + _FRAME.size + length, payload

    def _is_torn_tail(self, offset: int, end: int) -> bool:
        """Whether the bad bytes from ``offset`` are one record cut short or never completed (nothing after it)."""
        head = os.pread(self._fd, _FRAME.size, offset)
        if len(head) < _FRAME.size:
            return True
        length = _FRAME.unpack(head)[0]
        return offset + _FRAME.size + length >= end

    # -- records ----------------------------------------------------------------------------------------

    def append(self, records: Sequence[SpoolRecord]) -> int:
        """Append ``records`` and fsync them; all or nothing.

        Returns:
            Bytes written.

        Raises:
            SpoolFull: they would take the file beyond ``max_bytes`` (nothing written).
            OSError: the write or fsync failed (the file is cut back to what it held before).
        """
        blob = b"".join(record_bytes(r) for r in records)
        with self._lock:
            self._check_open()
            if self.unreadable:
                raise SpoolCorrupt(f"spool {self.path} holds corrupt bytes; it is not appended to")
            if self.max_bytes and self.size + len(blob) > self.max_bytes:
                raise SpoolFull(f"the spool holds {self.size} bytes; {len(records)} more requests "
                                f"({len(blob)} bytes) would pass its bound of {self.max_bytes} bytes")
            try:
                written = os.pwrite(self._fd, blob, self.size)
                if written != len(blob):
                    raise OSError(f"short write to {self.path}: {written} of {len(blob)} bytes")
                os.fdatasync(self._fd)
            except BaseException:
                try:
                    os.ftruncate(self._fd, self.size)
                except OSError:
                    logger.exception("spool %s: could not cut back a failed write", self.path)
                raise
            self.size += len(blob)
            self.count += len(records)
        return len(blob)

    def read(self, offset: int = HEADER_BYTES, limit: int = 0) -> tuple[list[SpoolRecord], int]:
        """The records from byte ``offset`` (a record boundary) on, oldest first, and the offset after them.

        Args:
            offset: where to start (``HEADER_BYTES``: the first record).
            limit: most records returned (0: all).

        Raises:
            SpoolCorrupt: a record in the range fails its checksum; the message says how many came before.
        """
        with self._lock:
            self._check_open()
            end = self.size
            out: list[SpoolRecord] = []
            while offset < end and (not limit or len(out) < limit):
                frame = self._frame_at(offset, end)
                if frame is None:
                    raise SpoolCorrupt(f"spool {self.path}: the record at offset {offset} fails its checksum "
                                       f"({len(out)} records read before it)")
                offset, payload = frame
                out.append(_parse(payload))
            return out, offset

    def truncate(self) -> None:
        """Drop every record (the header stays) and make that durable."""
        with self._lock:
            self._check_open()
            os.ftruncate(self._fd, HEADER_BYTES)
            os.fsync(self._fd)
            self.size, self.count, self.unreadable = HEADER_BYTES, 0, 0

    def close(self, remove: bool = False) -> None:
        """Release the lock and close the file; with ``remove`` delete it first. Safe to call twice."""
        with self._lock:
            if self._fd < 0:
                return
            if remove:
                try:  # only when the path still names this file (an adopter may have replaced nothing else)
                    if os.stat(self.path).st_ino == os.fstat(self._fd).st_ino:
                        self.path.unlink()
                        _fsync_dir(self.path.parent)
                except FileNotFoundError:
                    pass
            os.close(self._fd)
            self._fd = -1

    @property
    def closed(self) -> bool:
        """Whether ``close`` was called."""
        return self._fd < 0

    def _check_open(self) -> None:
        if self._fd < 0:
            raise SpoolError(f"spool {self.path} is closed")

    def check_invariants(self) -> None:
        """Assert that the file holds the header and exactly ``count`` whole records up to ``size``."""
        with self._lock:
            self._check_open()
            raw = os.pread(self._fd, HEADER_BYTES, 0)
            magic, writer, store, crc = _HEADER.unpack(raw)
            assert magic == MAGIC and zlib.crc32(raw[:-4]) == crc, "bad header"
            assert writer.hex() == self.writer_id and store.hex() == self.store_id, "header ids changed"
            offset, count, last_seq = HEADER_BYTES, 0, -1
            while offset < self.size:
                frame = self._frame_at(offset, self.size)
                assert frame is not None, f"bad record at offset {offset}"
                offset, payload = frame
                seq = _parse(payload).seq
                assert seq > last_seq, f"sequence numbers go back at offset {offset}"
                last_seq, count = seq, count + 1
            assert offset == self.size and count == self.count, (offset, self.size, count, self.count)
            assert os.fstat(self._fd).st_size == self.size + self.unreadable, "unaccounted bytes"
            assert not self.max_bytes or self.size <= self.max_bytes, "bound passed"

    def __repr__(self) -> str:
        return f"Spool({str(self.path)!r}, {self.count} records, {self.size} bytes)"


def new_id() -> str:
    """A fresh 32-hex-digit id (writers and stores)."""
    return uuid.uuid4().hex


def _header(writer_id: str, store_id: str) -> bytes:
    try:
        writer, store = bytes.fromhex(writer_id), bytes.fromhex(store_id)
    except ValueError:
        raise ValueError(f"writer and store ids must be 32 hex digits, got {writer_id!r}, {store_id!r}") from None
    if len(writer) != 16 or len(store) != 16:
        raise ValueError(f"writer and store ids must be 32 hex digits, got {writer_id!r}, {store_id!r}")
    body = _HEADER.pack(MAGIC, writer, store, 0)[:-4]
    return body + struct.pack("<I", zlib.crc32(body))


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)

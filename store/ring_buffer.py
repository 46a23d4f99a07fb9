"""A contiguous circular int32 token buffer holding completed requests as separated documents."""

from __future__ import annotations

import logging
import threading
from collections.abc import Sequence

import numpy as np

logger = logging.getLogger(__name__)

SEPARATOR = -1
"""Written after every document so that no match spans two requests."""

COPY_CHUNK = 1 << 20
"""Tokens copied per numpy call when a large range is read: a copy holds the interpreter lock, and a copy of tens
of millions of tokens (the whole ring, for an index rebuild or an index file) would stall every draft call for
tens of milliseconds; between chunks the lock can pass to them."""


def copy_chunked(dst: np.ndarray, src: np.ndarray) -> None:
    """``dst[:] = src`` a ``COPY_CHUNK`` at a time (equal sizes), so that no one step holds the interpreter lock
    long."""
    for lo in range(0, int(src.size), COPY_CHUNK):
        dst[lo:lo + COPY_CHUNK] = src[lo:lo + COPY_CHUNK]


class RingBuffer:
    """Circular buffer of token ids addressed by absolute positions.

    Every token ever written has an absolute position (0, 1, 2, ...); the buffer keeps the most recent
    ``capacity`` of them. Each document is followed by one ``SEPARATOR``. An index built on an older
    snapshot checks ``oldest`` to know which of its positions still hold the tokens it saw.

    Appends take a lock; readers never block and only ever read positions below ``end``, which is
    published after the tokens are written.
    """

    def __init__(self, capacity: int) -> None:
        """Create an empty buffer.

        Args:
            capacity: number of token slots (separators included); at least 2.
        """
        if capacity < 2:
            raise ValueError(f"ring buffer capacity must be at least 2, got {capacity}")
        self.capacity = int(capacity)
        self._data = np.full(self.capacity, SEPARATOR, dtype=np.int32)  # (capacity,) token ids
        self._end = 0  # absolute position one past the last written slot
        self._documents = 0
        self._lock = threading.Lock()

    @property
    def end(self) -> int:
        """Absolute position one past the newest token."""
        return self._end

    @property
    def oldest(self) -> int:
        """Absolute position of the oldest token still held."""
        return max(0, self._end - self.capacity)

    @property
    def documents(self) -> int:
        """Number of documents ever appended."""
        return self._documents

    def __len__(self) -> int:
        return self._end - self.oldest

    @property
    def nbytes(self) -> int:
        """Memory held by the token array."""
        return int(self._data.nbytes)

    def append(self, tokens: Sequence[int] | np.ndarray) -> tuple[int, int]:
        """Append one document and its separator, overwriting the oldest tokens when full.

        A document longer than ``capacity - 1`` keeps only its last ``capacity - 1`` tokens.

        Args:
            tokens: non-negative token ids.

        Returns:
            (absolute start, absolute end) of the document's tokens, separator excluded.
        """
        try:
            wide = np.asarray(tokens, dtype=np.int64).ravel()
        except OverflowError as exc:
            raise ValueError("token ids must fit in int32") from exc
        if wide.size and (int(wide.min()) < 0 or int(wide.max()) > np.iinfo(np.int32).max):
            raise ValueError("token ids must be in [0, 2**31)")
        doc = wide.astype(np.int32)
        if doc.size > self.capacity - 1:
            doc = doc[doc.size - (self.capacity - 1):]
        with self._lock:
            start = self._end
            self._write(start, doc)
            self._write(start + doc.size, np.array([SEPARATOR], dtype=np.int32))
            self._end = start + doc.size + 1
            self._documents += 1
        return start, start + doc.size

    def _write(self, start: int, doc: np.ndarray) -> None:
        pos = start % self.capacity
        first = min(doc.size, self.capacity - pos)
        self._data[pos:pos + first] = doc[:first]
        if first < doc.size:
            self._data[:doc.size - first] = doc[first:]

    def read(self, start: int, stop: int) -> np.ndarray:
        """Copy of the tokens at absolute positions [start, stop) (separators included).

        Raises:
            IndexError: when part of the range was overwritten or not written yet.
        """
        if start < self.oldest or stop > self._end or start > stop:
            raise IndexError(f"range [{start}, {stop}) outside the held range [{self.oldest}, {self._end})")
        pos = start % self.capacity
        n = stop - start
        if n <= COPY_CHUNK:
            if pos + n <= self.capacity:
                return self._data[pos:pos + n].copy()
            return np.concatenate([self._data[pos:], self._data[:n - (self.capacity - pos)]])
        out = np.empty(n, dtype=self._data.dtype)
        first = min(n, self.capacity - pos)
        copy_chunked(out[:first], self._data[pos:pos + first])
        copy_chunked(out[first:], self._data[:n - first])
        return out

    def view(self) -> np.ndarray:
        """The raw slot array (read-only view); slot of absolute position p is ``p % capacity``."""
        v = self._data.view()
        v.flags.writeable = False
        return v

    def snapshot(self) -> tuple[np.ndarray, int]:
        """A writable copy of everything held, oldest first, and the absolute position of its first slot."""
        with self._lock:
            start, stop = self.oldest, self._end
            return self.read(start, stop), start

    def saved(self) -> tuple[np.ndarray, int, int]:
        """``snapshot`` and the number of documents ever appended, taken together: (tokens, start, documents)."""
        with self._lock:
            start, stop = self.oldest, self._end
            return self.read(start, stop), start, self._documents

    def load(self, tokens: np.ndarray, start: int, documents: int) -> None:
        """Replace the contents with ``tokens`` held at absolute positions [start, start + n), as ``saved`` gave them.

        Args:
            tokens: (n,) int32 tokens and separators, oldest first, ending with a separator (or empty).
            start: absolute position of ``tokens[0]``; positions keep their slots (``p % capacity``), so an index
                built over them before still finds them.
            documents: documents ever appended up to the end of ``tokens``.

        Raises:
            ValueError: more tokens than the capacity, a start other than the oldest position a ring ending at
                ``start + n`` holds (0, or ``start + n - capacity``), or a last slot that is not a separator.
        """
        n = int(tokens.size)
        end = int(start) + n
        if n > self.capacity or int(start) != max(0, end - self.capacity):
            raise ValueError(f"cannot hold {n} tokens from position {start} in a ring of {self.capacity}")
        if n and int(tokens[-1]) != SEPARATOR:
            raise ValueError("the saved tokens do not end with a separator")
        with self._lock:
            self._data.fill(SEPARATOR)
            self._write(int(start), np.asarray(tokens, dtype=np.int32))
            self._end = end
            self._documents = int(documents)

    def check_invariants(self) -> None:
        """Raise AssertionError when the buffer's bookkeeping is inconsistent."""
        assert 0 <= self.oldest <= self._end
        assert len(self) <= self.capacity
        if self._end:
            assert self._data[(self._end - 1) % self.capacity] == SEPARATOR, "last slot is not a separator"
        held = self.read(self.oldest, self._end)
        assert int(held.min(initial=0)) >= SEPARATOR, "token below the separator value"

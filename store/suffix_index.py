"""Suffix array over a reversed snapshot of the ring buffer: every earlier occurrence of a context's end."""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING

import numpy as np
import pydivsufsort

from store import match_kernels
from store.match_kernels import extend_matches, pack_pattern

if TYPE_CHECKING:
    from store._kernels import Index

logger = logging.getLogger(__name__)


def key_layout(max_token: int) -> tuple[int, int]:
    """Bits per token and tokens per uint64 key for ids up to ``max_token`` (0 is kept for separators)."""
    bits = max(1, int(max_token + 1).bit_length())
    return bits, max(1, 64 // bits)


def build_arrays(snapshot: np.ndarray) -> tuple[np.ndarray, np.ndarray, int, int]:
    """Suffix array and packed keys of a snapshot, reversed.

    Args:
        snapshot: (n,) int32 tokens, separators -1.

    Returns:
        (sa (n,) int32 reversed-suffix starts in sorted order, keys (n,) uint64 sorted, bits, tokens per key).
    """
    n = int(snapshot.size)
    bits, per_key = key_layout(int(snapshot.max(initial=0)))
    rev = np.ascontiguousarray(snapshot[::-1], dtype=np.int32)
    sa = pydivsufsort.divsufsort(rev).astype(np.int32, copy=False) if n else np.zeros(0, dtype=np.int32)
    return sa, _pack_keys(rev, sa, bits, per_key), bits, per_key


def _pack_keys(rev: np.ndarray, sa: np.ndarray, bits: int, per_key: int) -> np.ndarray:
    """(n,) uint64: the first ``per_key`` tokens of each reversed suffix, token + 1, zero from a separator on.

    Natively one pass without the interpreter lock (it runs in the index builder's process, beside the serving
    one: at 30M tokens it costs 0.5 s of CPU where the numpy one costs 3.7 s).
    """
    compiled = match_kernels.compiled
    if compiled is not None:
        keys = compiled.pack_keys(rev, sa, bits, per_key)
        if keys is not NotImplemented:
            return keys
    return pack_keys_numpy(rev, sa, bits, per_key)


def pack_keys_numpy(rev: np.ndarray, sa: np.ndarray, bits: int, per_key: int) -> np.ndarray:
    """The numpy reference of ``_pack_keys``: every position's key packed in text order (sequential passes), then
    gathered in suffix-array order."""
    n = rev.size
    padded = np.full(n + per_key, -1, dtype=np.int64)  # past the end reads as a separator
    padded[:n] = rev
    packed = np.zeros(n, dtype=np.uint64)
    alive = np.ones(n, dtype=bool)
    step = np.uint64(bits)
    for j in range(per_key):
        tok = padded[j:j + n]
        alive &= tok >= 0
        packed <<= step
        packed |= np.where(alive, tok + 1, 0).astype(np.uint64)
    del padded, alive
    return np.take(packed, sa)


class SuffixIndex:
    """Immutable suffix index over the tokens at absolute positions [start, end) of a ring buffer.

    The snapshot is indexed in reverse, so the suffixes that begin with the reversed context are exactly
    the places where the context ended before, and the ranges for longer matches nest inside the ranges
    for shorter ones: one descent finds the longest match. The first ``tokens_per_key`` tokens of every
    reversed suffix are packed into one uint64 (big-endian, token + 1, 0 for a separator and everything
    after it), so the first levels are found by ``np.searchsorted``; longer patterns are narrowed by
    reading the live ring buffer.
    """

    def __init__(self, snapshot: np.ndarray, start: int,
                 arrays: tuple[np.ndarray, np.ndarray, int, int] | None = None) -> None:
        """Build the index (or wrap arrays built elsewhere by ``build_arrays``).

        Args:
            snapshot: (n,) int32 writable tokens at absolute positions [start, start + n), separators -1.
            start: absolute position of ``snapshot[0]``.
            arrays: (sa, keys, bits, tokens_per_key) as ``build_arrays`` returns them for this snapshot.
        """
        t0 = time.perf_counter()
        self.start = int(start)
        self.end = self.start + int(snapshot.size)
        self._sa, self._keys, self.bits, self.tokens_per_key = arrays or build_arrays(snapshot)
        self.native_index = self._native_index()  # store._kernels.Index over _keys and _sa, or None
        self.build_seconds = time.perf_counter() - t0
        logger.debug("suffix index over %d tokens built in %.3f s", len(self), self.build_seconds)

    @classmethod
    def from_arrays(cls, start: int, sa: np.ndarray, keys: np.ndarray, bits: int, tokens_per_key: int) -> SuffixIndex:
        """An index over [start, start + len(sa)) from arrays ``build_arrays`` made for it earlier (e.g. read-only
        views of a memory-mapped index file); nothing is copied or built.

        Raises:
            ValueError: arrays of other lengths, dtypes or layout.
        """
        if sa.ndim != 1 or keys.ndim != 1 or sa.size != keys.size or sa.dtype != np.int32 or keys.dtype != np.uint64:
            raise ValueError(f"suffix array {sa.dtype}{sa.shape} and keys {keys.dtype}{keys.shape} are no index")
        if not 1 <= bits <= 32 or not 1 <= tokens_per_key or bits * tokens_per_key > 64:
            raise ValueError(f"unsupported key layout: {bits} bits, {tokens_per_key} tokens per key")
        index = cls.__new__(cls)
        index.start = int(start)
        index.end = index.start + int(sa.size)
        index._sa, index._keys, index.bits, index.tokens_per_key = sa, keys, int(bits), int(tokens_per_key)
        index.native_index = index._native_index()
        index.build_seconds = 0.0
        return index

    @property
    def arrays(self) -> tuple[np.ndarray, np.ndarray, int, int]:
        """(sa, keys, bits, tokens per key) as ``build_arrays`` returns them (the index's own, not copies)."""
        return self._sa, self._keys, self.bits, self.tokens_per_key

    def _native_index(self) -> Index | None:
        if match_kernels.compiled is None:
            return None
        try:
            return match_kernels.compiled.Index(self._keys, self._sa, self.start, self.end, self.bits,
                                                self.tokens_per_key)
        except (TypeError, ValueError) as exc:
            logger.warning("suffix index left to numpy matching: %s", exc)
            return None

    def __getstate__(self) -> dict:
        state = self.__dict__.copy()
        state["native_index"] = None  # a handle over this process's arrays: rebuilt on unpickling
        return state

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self.native_index = self._native_index()

    def __len__(self) -> int:
        return self.end - self.start

    @property
    def nbytes(self) -> int:
        """Memory held by the index: the suffix array, the keys and the native handle's small bucket table."""
        native = self.native_index.nbytes if self.native_index is not None else 0
        return int(self._sa.nbytes + self._keys.nbytes) + native

    def forward_position(self, sa_slice: np.ndarray) -> np.ndarray:
        """Absolute positions of the context's last token for suffix-array entries (int64)."""
        return self.end - 1 - sa_slice.astype(np.int64)

    def match(self, context_rev: np.ndarray, ring_data: np.ndarray, oldest: int, max_match: int,
              max_candidates: int = 4096) -> tuple[int, np.ndarray, np.ndarray]:
        """Find the longest suffix of the context that occurred in the indexed range.

        Args:
            context_rev: (c,) int64 the context reversed (last token first), c >= 1.
            ring_data: (capacity,) int32 the ring buffer's slots, read for matches longer than a key.
            oldest: absolute position of the oldest token still in the ring buffer.
            max_match: longest match length considered.
            max_candidates: occurrences of a full key extended one by one for longer matches. More are
                narrowed exactly (a binary search per token over the suffix array, reading the ring buffer)
                until at most this many are left; only on an index the ring has partly overwritten (stale),
                where that order cannot be read back, is an evenly spaced sample extended instead, and counts
                past the key length become estimates.

        Returns:
            (m, counts, ends): the longest match length m (0 if none), counts[i] = occurrences of the last
            i + 1 tokens for i < m (once the ring has overwritten part of the indexed range, these
            still count the overwritten occurrences), and the int64 absolute positions of
            the last matched token of every occurrence of length m still held in the buffer.
        """
        native = match_kernels.native
        if native is not None and self.native_index is not None:
            found = native.index_match(self.native_index, context_rev, ring_data, oldest, max_match,
                                       max_candidates)
            if found is not NotImplemented:
                return found
        return self.match_numpy(context_rev, ring_data, oldest, max_match, max_candidates)

    def match_numpy(self, context_rev: np.ndarray, ring_data: np.ndarray, oldest: int, max_match: int,
                    max_candidates: int = 4096) -> tuple[int, np.ndarray, np.ndarray]:
        """The numpy reference of ``match`` (same arguments and results)."""
        if not len(self) or context_rev.size == 0:
            return 0, np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.int64)
        limit = min(int(max_match), int(context_rev.size))
        k = min(self.tokens_per_key, limit)
        if int(context_rev[:k].max()) + 1 >= (1 << self.bits):
            k = int(np.argmax(context_rev[:k] + 1 >= (1 << self.bits)))  # token unseen by this index
            if k == 0:
                return 0, np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.int64)
        lows, highs = pack_pattern(context_rev[:k], self.bits, self.tokens_per_key)
        lo = np.searchsorted(self._keys, lows, side="left")
        hi = np.searchsorted(self._keys, highs, side="right")
        counts = (hi - lo).astype(np.int64)  # non-increasing: the ranges nest
        m = int(np.count_nonzero(counts))
        if m == 0:
            return 0, np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.int64)
        counts = counts[:m]
        if m == k and limit > k:
            ends = self.forward_position(self._sa[lo[m - 1]:hi[m - 1]])
            if ends.size > max_candidates and self.start < oldest:
                ends = ends[::-(-ends.size // max_candidates)]
            longer, more, ends = extend_matches(ring_data, ends, context_rev, m, limit, oldest)
            if longer:
                return longer, np.concatenate([counts, more]), ends
        # Positions below ``oldest`` were overwritten after the build: the longest match still held
        # may be shorter than the longest match the index saw.
        stale = self.start < oldest
        for held in range(m, 0, -1):
            ends = self.forward_position(self._sa[lo[held - 1]:hi[held - 1]])
            if stale:
                ends = ends[ends - (held - 1) >= oldest]
            if ends.size:
                return held, counts[:held], ends
        return 0, np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.int64)

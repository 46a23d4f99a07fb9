"""The global token store: ring buffer plus suffix indexes, searched together for a context's continuations."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from store import match_kernels
from store.match_kernels import TAIL_WINDOW, continuations, scan_matches
from store.ring_buffer import RingBuffer
from store.suffix_index import SuffixIndex

if TYPE_CHECKING:
    from store._kernels import Index

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Continuations:
    """What followed the earlier occurrences of a context's longest matching end.

    Attributes:
        match_len: tokens matched (0: nothing found).
        counts: (match_len,) int64 occurrences of the last 1, 2, ..., match_len context tokens (once the
            ring has wrapped, indexed occurrences that were overwritten may still be counted).
        rows: (k, depth) int32 the tokens after each examined occurrence, most recent first, -1 past
            the end of its document.
    """

    match_len: int
    counts: np.ndarray
    rows: np.ndarray

    @property
    def occurrences(self) -> int:
        """Occurrences of the longest match (before sampling)."""
        return int(self.counts[-1]) if self.match_len else 0


EMPTY = Continuations(0, np.zeros(0, dtype=np.int64), np.zeros((0, 0), dtype=np.int32))


@dataclass(frozen=True)
class SavedStore:
    """What an index file keeps of a store: the ring's tokens and the suffix indexes, as they were together.

    Attributes:
        tokens: (n,) int32 every token and separator the ring held, oldest first.
        start: absolute position of ``tokens[0]`` (the ring's oldest then).
        documents: documents ever appended up to the end of ``tokens``.
        index: the main suffix index; it ends at or before the end of ``tokens`` and may start before ``start``
            where the ring had overwritten part of it.
        delta: the delta index after it (None: none); the tokens after both are left to be indexed again.
    """

    tokens: np.ndarray
    start: int
    documents: int
    index: SuffixIndex
    delta: SuffixIndex | None = None

    @property
    def end(self) -> int:
        """Absolute position one past the last token."""
        return self.start + int(self.tokens.size)

    @property
    def indexed_end(self) -> int:
        """Absolute position one past the last indexed token."""
        return (self.delta or self.index).end

    def check_invariants(self) -> None:
        """Raise AssertionError when the indexes do not fit the tokens."""
        assert self.tokens.ndim == 1 and self.tokens.dtype == np.int32
        assert self.start <= self.index.end <= self.end, "the main index ends outside the saved tokens"
        if self.delta is not None:
            assert self.delta.start == self.index.end, "the delta index does not start where the main one ends"
            assert self.delta.end <= self.end, "the delta index ends outside the saved tokens"
        assert not self.tokens.size or int(self.tokens[-1]) == -1, "the saved tokens do not end with a separator"


@dataclass(frozen=True)
class _Indexes:
    main: SuffixIndex | None
    delta: SuffixIndex | None
    native: tuple[Index | None, ...] | None = field(init=False, default=None, repr=False, compare=False)

    def __post_init__(self) -> None:
        # (delta, main) handles for the C kernels; None when an index has none (numpy lookups then)
        handles = tuple(i.native_index if i is not None else None for i in (self.delta, self.main))
        usable = all(i is None or i.native_index is not None for i in (self.delta, self.main))
        object.__setattr__(self, "native", handles if usable else None)

    @property
    def end(self) -> int:
        for idx in (self.delta, self.main):
            if idx is not None:
                return idx.end
        return 0


class TokenStore:
    """Ring buffer of completed requests with a two-level suffix index and a scanned tail.

    The main index covers most of the buffer and is rebuilt rarely; the delta index covers what arrived
    since, and is rebuilt often because it is small; the tokens after the delta are scanned (the native lookups
    keep occurrence lists of them instead, brought up to date on each lookup: ``_kernels.Tail``). All
    three are searched on every lookup, so a request ingested a moment ago already helps. Rebuilds run
    wherever the caller runs ``rebuild`` (a background job) and are swapped in atomically.

    A lookup searches only the newest ``tail_window`` unindexed tokens: when indexing lags far behind (a large
    ingest), the tokens between the indexes' end and that window are not drafted from until the rebuild that
    ``rebuild_due`` asks for covers them, and no lookup ever scans or indexes more than the window.
    """

    def __init__(self, capacity: int = 32 * 1024 * 1024, tail_tokens: int = 8192,
                 delta_fraction: float = 0.25, max_candidates: int = 4096, max_examined: int = 16384,
                 tail_window: int = TAIL_WINDOW) -> None:
        """Create an empty store.

        Args:
            capacity: ring buffer size in tokens.
            tail_tokens: unindexed tokens tolerated before the delta index is rebuilt.
            delta_fraction: the main index is rebuilt when what it misses (tokens after it) plus what it
                still lists but the ring overwrote exceeds this share of it.
            max_candidates: occurrences of a key an index extends one by one for a longer match; more are first
                narrowed exactly by binary search (see ``SuffixIndex.match``).
            max_examined: occurrences of the longest match an index reads one by one to pick the most recent;
                of more, the most recent are found through the index's block minima. The pick is the same either
                way (the most recent of all occurrences, whatever the split between the main and the delta
                index: a store restored from an index file drafts as one rebuilt); this only trades reads.
            tail_window: most unindexed tokens (the newest) a lookup searches.
        """
        if tail_window < 1:
            raise ValueError(f"tail_window must be at least 1, got {tail_window}")
        self.ring = RingBuffer(capacity)
        self.tail_tokens = int(tail_tokens)
        self.tail_window = int(tail_window)
        self.delta_fraction = float(delta_fraction)
        self.max_candidates = int(max_candidates)
        self.max_examined = int(max_examined)
        self._indexes = _Indexes(None, None)
        self._rebuild_lock = threading.Lock()
        self.builder: Callable[[np.ndarray], tuple] | None = None  # e.g. IndexWorker.build_arrays
        # where tokens and token pairs occur after the indexes, brought up to date by the native lookups
        self._tail = match_kernels.compiled.Tail(self.tail_window) if match_kernels.compiled is not None else None

    def _index(self, tokens: np.ndarray, start: int) -> SuffixIndex:
        arrays = self.builder(tokens) if self.builder is not None else None
        return SuffixIndex(tokens, start, arrays)

    # -- writing ---------------------------------------------------------------------------------------

    def append(self, tokens: Sequence[int] | np.ndarray) -> tuple[int, int]:
        """Append one completed request (prompt + output) as a document; see ``RingBuffer.append``."""
        return self.ring.append(tokens)

    # -- indexing --------------------------------------------------------------------------------------

    @property
    def indexed_end(self) -> int:
        """Absolute position one past the last indexed token."""
        return max(self._indexes.end, self.ring.oldest)

    @property
    def unindexed(self) -> int:
        """Tokens after the last index (lookups search the newest ``tail_window`` of them)."""
        return self.ring.end - self.indexed_end

    @property
    def searched_from(self) -> int:
        """Absolute position of the oldest unindexed token lookups search (the tail window's start)."""
        return max(self.indexed_end, self.ring.end - self.tail_window)

    def rebuild_due(self) -> str | None:
        """Which rebuild is worth running now: "main", "delta" or None.

        The scanned tail is brought back under ``tail_tokens`` first (a delta build is quick: it covers only
        what arrived since the main index); the main index is rebuilt once the tail is small, when what it
        misses plus what the ring overwrote exceeds ``delta_fraction`` of it.
        """
        idx = self._indexes
        if idx.main is None:
            return "main" if self.unindexed >= self.tail_tokens else None
        if self.unindexed >= self.tail_tokens:
            return "delta"
        main_len = len(idx.main)
        missed = (len(idx.delta) if idx.delta is not None else 0) + self.unindexed
        overwritten = max(0, self.ring.oldest - idx.main.start)
        return "main" if missed + overwritten > self.delta_fraction * main_len else None

    def rebuild(self, kind: str | None = None) -> str | None:
        """Rebuild an index (the due one when ``kind`` is None) and swap it in.

        A "delta" rebuild when no part of the main index is still held rebuilds the main index instead.

        Returns:
            The kind rebuilt, or None when nothing was due.
        """
        with self._rebuild_lock:
            kind = kind or self.rebuild_due()
            if kind is None:
                return None
            if kind not in ("main", "delta"):
                raise ValueError(f"unknown rebuild kind {kind!r}")
            main = self._indexes.main
            end = self.ring.end
            if kind == "delta" and main is not None and main.end > self.ring.oldest:
                # only what arrived after the main index is copied and indexed
                self._indexes = _Indexes(main, self._index(self.ring.read(main.end, end), main.end))
                return "delta"
            tokens, start = self.ring.snapshot()  # also a "delta" when none of the main index is held
            self._indexes = _Indexes(self._index(tokens, start) if tokens.size else None, None)
            return "main"

    # -- saving and loading ----------------------------------------------------------------------------

    def saved(self) -> SavedStore | None:
        """The ring's tokens and the suffix indexes as they are now (a copy of the tokens; the indexes are shared,
        they are immutable), for an index file; None while there is no main index or the ring overwrote all of it."""
        idx = self._indexes  # read first: an index swapped in later may cover tokens the copy lacks
        if idx.main is None:
            return None
        tokens, start, documents = self.ring.saved()
        if idx.main.end <= start:
            return None
        return SavedStore(tokens, start, documents, idx.main, idx.delta)

    def restore(self, saved: SavedStore) -> None:
        """Replace everything held with a saved state: the ring's tokens at their positions and the indexes.

        Tokens after the indexes are unindexed (the newest ``tail_window`` of them are searched at once; the
        rebuild ``rebuild_due`` then asks for indexes the rest).

        Raises:
            ValueError: a state that does not fit this store (capacity) or whose indexes do not fit its tokens.
        """
        try:
            saved.check_invariants()
        except AssertionError as exc:
            raise ValueError(f"a saved store whose indexes do not fit its tokens: {exc}") from None
        with self._rebuild_lock:
            self.ring.load(saved.tokens, saved.start, saved.documents)
            self._indexes = _Indexes(saved.index, saved.delta)
            if self._tail is not None:
                self._tail = type(self._tail)(self.tail_window)

    # -- reading ---------------------------------------------------------------------------------------

    def lookup(self, context: Sequence[int] | np.ndarray, max_match: int = 32, max_occurrences: int = 32,
               depth: int = 16) -> Continuations:
        """What followed earlier occurrences of the longest suffix of ``context``.

        Args:
            context: the sequence so far (at least its last ``max_match`` tokens).
            max_match: longest match length considered.
            max_occurrences: most recent occurrences whose continuations are returned.
            depth: continuation tokens read per occurrence.
        """
        native = match_kernels.native
        if native is not None:
            ring, handles = self.ring, self._indexes.native
            if handles is not None:  # the raw slots: ring.view() would cost a new array per call
                found = native.store_lookup(context, ring._data, ring.oldest, ring.end, handles[0], handles[1],
                                            max_match, max_occurrences, depth, self.max_candidates,
                                            self.max_examined, self._tail)
                if found is None:
                    return EMPTY
                if found is not NotImplemented:
                    return Continuations(*found)
        return self.lookup_numpy(context, max_match, max_occurrences, depth)

    def native_lookup_args(self) -> tuple[Callable[..., Any], tuple] | None:
        """(native lookup, its store arguments) for callers that look up many contexts in one go, or None when
        the native kernels or index are missing. The lookup takes ``(context, *args[:5], max_match,
        max_occurrences, depth, *args[5:])`` as ``lookup`` passes them."""
        native = match_kernels.native
        handles = self._indexes.native
        if native is None or handles is None:
            return None
        ring = self.ring
        return native.store_lookup, (ring._data, ring.oldest, ring.end, handles[0], handles[1], self.max_candidates,
                                     self.max_examined, self._tail)

    def lookup_numpy(self, context: Sequence[int] | np.ndarray, max_match: int = 32, max_occurrences: int = 32,
                     depth: int = 16) -> Continuations:
        """The numpy reference of ``lookup`` (same arguments and results)."""
        ctx = np.asarray(context[-max_match:] if len(context) > max_match else context, dtype=np.int64)
        if ctx.size == 0:
            return EMPTY
        ctx_rev = ctx[::-1]
        ring = self.ring
        data = ring.view()
        oldest, stop = ring.oldest, ring.end
        idx = self._indexes
        found = [scan_matches(data, max(idx.end, oldest, stop - self.tail_window), stop, ctx_rev, ctx.size, oldest)]
        for seg in (idx.delta, idx.main):
            if seg is not None:
                found.append(seg.match(ctx_rev, data, oldest, ctx.size, self.max_candidates))
        m = max(f[0] for f in found)
        if m == 0:
            return EMPTY
        counts = np.zeros(m, dtype=np.int64)
        ends_all = []
        for fm, fc, fe in found:
            counts[:fm] += fc
            if fm == m:
                ends_all.append(fe)
        ends = np.concatenate(ends_all) if len(ends_all) > 1 else ends_all[0]
        if ends.size > max_occurrences:
            ends = ends[np.argpartition(-ends, max_occurrences - 1)[:max_occurrences]]
        ends = np.sort(ends)[::-1]
        rows = continuations(data, ends + 1, depth, stop)
        return Continuations(m, counts, rows)

    def stats(self) -> dict[str, int]:
        """Sizes for monitoring: tokens held, documents, indexed and unindexed tokens, bytes."""
        idx = self._indexes
        index_bytes = sum(s.nbytes for s in (idx.main, idx.delta) if s is not None)
        return {
            "tokens": len(self.ring),
            "documents": self.ring.documents,
            "indexed_tokens": sum(len(s) for s in (idx.main, idx.delta) if s is not None),
            "unindexed_tokens": self.unindexed,
            "ring_bytes": self.ring.nbytes,
            "index_bytes": index_bytes + (self._tail.nbytes if self._tail is not None else 0),
        }

    def check_invariants(self) -> None:
        """Raise AssertionError when the buffer or the index bookkeeping is inconsistent."""
        self.ring.check_invariants()
        idx = self._indexes
        if idx.main is not None and idx.delta is not None:
            assert idx.delta.start == idx.main.end, "delta index does not start where the main one ends"
        assert self._indexes.end <= self.ring.end, "index beyond the buffer's end"

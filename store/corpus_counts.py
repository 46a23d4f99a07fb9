"""Streaming leader-follower n-gram counts over a corpus in bounded memory, and the frozen table they select."""

from __future__ import annotations

import logging
from collections.abc import Iterable, Sequence

import numpy as np

from store.frozen_table import FrozenNGramTable

logger = logging.getLogger(__name__)


class GramCodec:
    """Packs n-grams of token ids into sortable keys: one uint64 when the ids fit, else big-endian bytes.

    Either way, sorting the keys sorts the grams lexicographically, and equal grams have equal keys.
    """

    def __init__(self, span: int, vocab_size: int) -> None:
        """Keys for ``span``-token grams of ids in [0, vocab_size)."""
        if span < 1 or vocab_size < 1:
            raise ValueError(f"span and vocab_size must be at least 1, got {span}, {vocab_size}")
        self.span = int(span)
        self.bits = max(1, (int(vocab_size) - 1).bit_length())
        self.packed = self.bits * self.span <= 64
        self.dtype = np.dtype(np.uint64) if self.packed else np.dtype(f"V{4 * self.span}")

    def windows(self, tokens: np.ndarray) -> np.ndarray:
        """Keys of every ``span``-token window of ``tokens`` ((n,) ints), in order: (n - span + 1,)."""
        n = tokens.size - self.span + 1
        if n <= 0:
            return np.zeros(0, dtype=self.dtype)
        if self.packed:
            keys = tokens[:n].astype(np.uint64)
            for j in range(1, self.span):
                keys <<= np.uint64(self.bits)
                keys |= tokens[j:j + n].astype(np.uint64)
            return keys
        rows = np.lib.stride_tricks.sliding_window_view(tokens, self.span)
        return np.ascontiguousarray(rows, dtype=">u4").view(self.dtype).ravel()

    def prefix(self, keys: np.ndarray, n: int) -> np.ndarray:
        """Keys of the first ``n`` tokens of every key: (k,), equal exactly where those tokens are."""
        if self.packed:
            return keys >> np.uint64(self.bits * (self.span - n))
        head = keys.view(np.uint8).reshape(-1, self.dtype.itemsize)[:, :4 * n]
        return np.ascontiguousarray(head).view(f"V{4 * n}").ravel()

    def column(self, keys: np.ndarray, j: int) -> np.ndarray:
        """Token j of every key: (n,) int64."""
        if self.packed:
            shift = np.uint64(self.bits * (self.span - 1 - j))
            return ((keys >> shift) & np.uint64((1 << self.bits) - 1)).astype(np.int64)
        return keys.view(">u4").reshape(-1, self.span)[:, j].astype(np.int64)

    def unpack(self, keys: np.ndarray) -> np.ndarray:
        """The grams of ``keys``: (n, span) int32."""
        out = np.empty((keys.size, self.span), dtype=np.int32)
        for j in range(self.span):
            out[:, j] = self.column(keys, j)
        return out


class NGramCounter:
    """Counts (leader, follower) grams of documents fed one at a time, in bounded memory.

    Windows are packed into keys and buffered; every ``chunk_grams`` windows they are counted with
    ``np.unique`` and merged into the running sorted (keys, counts). When more than ``max_distinct``
    grams are held, the rarest are dropped (every gram counted at most as often as the one that makes
    room) and the drop is recorded in ``pruned_grams`` and ``pruned_occurrences``.
    """

    def __init__(self, leader_len: int, follower_len: int, vocab_size: int, max_distinct: int | None = None,
                 chunk_grams: int = 1 << 22) -> None:
        """Start empty.

        Args:
            leader_len: LL, tokens per leader.
            follower_len: FL, tokens per follower.
            vocab_size: every token id must be in [0, vocab_size).
            max_distinct: most distinct grams held at once (None: no bound).
            chunk_grams: windows buffered before they are counted and merged.
        """
        if leader_len < 1 or follower_len < 1:
            raise ValueError(f"leader_len and follower_len must be at least 1, got {leader_len}, {follower_len}")
        if max_distinct is not None and max_distinct < 1:
            raise ValueError(f"max_distinct must be at least 1, got {max_distinct}")
        self.leader_len, self.follower_len = int(leader_len), int(follower_len)
        self.vocab_size = int(vocab_size)
        self.codec = GramCodec(self.leader_len + self.follower_len, self.vocab_size)
        self.max_distinct = max_distinct
        self.chunk_grams = int(chunk_grams)
        self._keys = np.zeros(0, dtype=self.codec.dtype)  # (D,) distinct gram keys, sorted
        self._counts = np.zeros(0, dtype=np.int64)  # (D,) occurrences of each
        self._pending: list[np.ndarray] = []  # windows not merged yet, (k,) keys each
        self._pending_size = 0
        self._tail = np.zeros(0, dtype=np.int64)  # last span - 1 tokens of a document that may continue
        self.documents = 0
        self.tokens = 0
        self.grams = 0
        self.pruned_grams = 0
        self.pruned_occurrences = 0

    def add(self, tokens: np.ndarray, continues: bool = False) -> None:
        """Count the grams of one document ((n,) token ids).

        Args:
            tokens: the document, or its next piece when ``continues``.
            continues: ``tokens`` goes on from the previous call's document, so grams may span the seam.

        Raises:
            ValueError: on ids outside [0, vocab_size) (nothing of this call is counted).
        """
        arr = np.asarray(tokens).ravel()
        if arr.size and (arr.dtype.kind not in "iu" or int(arr.min()) < 0 or int(arr.max()) >= self.vocab_size):
            raise ValueError(f"token ids must be integers in [0, {self.vocab_size})")
        arr = arr.astype(np.int64)
        self.tokens += arr.size
        if continues:
            arr = np.concatenate([self._tail, arr])
        else:
            self.documents += 1
        self._tail = arr[max(0, arr.size - self.codec.span + 1):]
        keys = self.codec.windows(arr)
        if keys.size:
            self._pending.append(keys)
            self._pending_size += keys.size
            self.grams += keys.size
            if self._pending_size >= self.chunk_grams:
                self.flush()

    def flush(self) -> None:
        """Count the buffered windows and merge them into the running counts."""
        if not self._pending:
            return
        keys, counts = np.unique(np.concatenate(self._pending), return_counts=True)
        self._pending, self._pending_size = [], 0
        self._merge(keys, counts.astype(np.int64))
        if self.max_distinct is not None and self._keys.size > self.max_distinct:
            self._prune(self.max_distinct)

    def _merge(self, keys: np.ndarray, counts: np.ndarray) -> None:
        """Add sorted distinct ``keys`` with ``counts`` to the running sorted distinct keys."""
        run = self._keys
        at = np.searchsorted(run, keys)
        hit = at < run.size
        hit[hit] = run[at[hit]] == keys[hit]
        self._counts[at[hit]] += counts[hit]
        new = ~hit
        n_new = int(new.sum())
        if n_new:
            pos = at[new] + np.arange(n_new)  # where each new key lands in the merged order
            old = np.ones(run.size + n_new, dtype=bool)
            old[pos] = False
            merged_keys = np.empty(run.size + n_new, dtype=run.dtype)
            merged_keys[pos], merged_keys[old] = keys[new], run
            merged_counts = np.empty(run.size + n_new, dtype=np.int64)
            merged_counts[pos], merged_counts[old] = counts[new], self._counts
            self._keys, self._counts = merged_keys, merged_counts

    def _prune(self, keep: int) -> None:
        """Drop every gram counted at most as often as the (D - keep)-th rarest, so at most ``keep`` remain."""
        counts = self._counts
        threshold = np.partition(counts, counts.size - keep - 1)[counts.size - keep - 1]
        kept = counts > threshold
        dropped = int(counts.size - kept.sum())
        self.pruned_grams += dropped
        self.pruned_occurrences += int(counts[~kept].sum())
        self._keys, self._counts = self._keys[kept], counts[kept]
        logger.info("pruned %d grams counted at most %d times (%d remain)", dropped, threshold, self._keys.size)

    @property
    def distinct(self) -> int:
        """Distinct grams held (after merging what is buffered)."""
        self.flush()
        return int(self._keys.size)

    def counts(self) -> tuple[np.ndarray, np.ndarray]:
        """Every held gram and its count: (D, LL + FL) int32 in lexicographic order, (D,) int64."""
        self.flush()
        return self.codec.unpack(self._keys), self._counts.copy()

    def select(self, leader_capacity: int, follower_capacity: int) -> dict[str, np.ndarray]:
        """The most frequent leaders and their most frequent followers, as CSR arrays.

        Leaders rank by their total count over all their followers, ties to the smaller leader; followers
        by count, ties to the smaller follower (exactly as ``build_frozen_table``).

        Returns:
            leaders (L, LL) int32 most frequent first, fanout (L,) int32, followers (F, FL) int32 most
            frequent first per leader, counts (F,) int64.
        """
        if leader_capacity < 1 or follower_capacity < 1:
            raise ValueError("leader_capacity and follower_capacity must be at least 1")
        self.flush()
        keys, counts, ll = self._keys, self._counts, self.leader_len
        if keys.size == 0:
            return {"leaders": np.zeros((0, ll), np.int32), "fanout": np.zeros(0, np.int32),
                    "followers": np.zeros((0, self.follower_len), np.int32), "counts": np.zeros(0, np.int64)}
        lead = self.codec.prefix(keys, ll)  # (D,) equal exactly where the leaders are
        change = np.empty(keys.size, dtype=bool)  # (D,) first gram of each leader
        change[0] = True
        change[1:] = lead[1:] != lead[:-1]
        del lead
        starts = np.flatnonzero(change)  # (G,) first gram of each leader group
        totals = np.add.reduceat(counts, starts)  # (G,) occurrences of each leader
        chosen = np.lexsort((np.arange(starts.size), -totals))[:leader_capacity]  # (L,) groups, best first
        rank = np.full(starts.size, -1, dtype=np.int32)
        rank[chosen] = np.arange(chosen.size)
        group = np.cumsum(change, dtype=np.int64)
        group -= 1
        gram_rank = rank[group]  # (D,) rank of each gram's leader, -1 when not chosen
        del group, change
        idx = np.flatnonzero(gram_rank >= 0)  # ascending: gram order breaks the ties below
        top = int(counts.max())
        if chosen.size * (top + 1) < 1 << 62:  # one stable sort of a composite key
            idx = idx[np.argsort(gram_rank[idx].astype(np.int64) * (top + 1) + (top - counts[idx]), kind="stable")]
        else:
            idx = idx[np.lexsort((idx, -counts[idx], gram_rank[idx]))]  # by leader rank, count desc, gram order
        r = gram_rank[idx]
        pos = np.arange(idx.size) - np.searchsorted(r, r)  # place of each follower among its leader's
        idx, r = idx[pos < follower_capacity], r[pos < follower_capacity]
        grams = self.codec.unpack(keys[idx])
        first = np.flatnonzero(np.r_[True, r[1:] != r[:-1]])
        return {"leaders": np.ascontiguousarray(grams[first, :ll]),
                "fanout": np.diff(np.r_[first, r.size]).astype(np.int32),
                "followers": np.ascontiguousarray(grams[:, ll:]), "counts": counts[idx]}

    def table(self, leader_capacity: int, follower_capacity: int) -> FrozenNGramTable:
        """``select``'s arrays as a FrozenNGramTable."""
        arrays = self.select(leader_capacity, follower_capacity)
        return FrozenNGramTable.from_arrays(self.leader_len, self.follower_len, **arrays)

    def check_invariants(self) -> None:
        """Raise AssertionError when the running counts are not sorted, distinct and positive, or over bound."""
        keys, counts = self._keys, self._counts
        assert keys.shape == counts.shape and keys.dtype == self.codec.dtype
        if keys.size > 1:
            order = np.argsort(keys, kind="stable")
            assert (order == np.arange(keys.size)).all(), "keys not sorted"
            assert not bool((keys[1:] == keys[:-1]).any()), "keys not distinct"
        assert counts.size == 0 or int(counts.min()) >= 1
        assert self.max_distinct is None or keys.size <= self.max_distinct
        held = int(counts.sum()) + self._pending_size + self.pruned_occurrences
        assert held == self.grams, "occurrences held and pruned do not add up to those counted"


def build_frozen_table(sequences: Iterable[Sequence[int] | np.ndarray], leader_len: int = 1, follower_len: int = 3,
                       leader_capacity: int = 1 << 20, follower_capacity: int = 128) -> FrozenNGramTable:
    """Count every leader-follower pair in ``sequences`` and keep the most frequent ones.

    Leaders are ranked by how often they occur as leaders of a full pair; ties go to the smaller
    token tuple, and followers likewise, so the result does not depend on input order.
    """
    docs = [np.asarray(seq, dtype=np.int64).ravel() for seq in sequences]
    vocab = max((int(d.max()) + 1 for d in docs if d.size), default=1)
    counter = NGramCounter(leader_len, follower_len, vocab_size=vocab)
    for doc in docs:
        counter.add(doc)
    return counter.table(leader_capacity, follower_capacity)

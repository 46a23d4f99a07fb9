"""Vectorised kernels that find and extend matches of a context's end in the ring buffer."""

from __future__ import annotations

import logging
import os
from types import ModuleType

import numpy as np

logger = logging.getLogger(__name__)

CHUNK = 8
"""Tokens compared per vectorised step when extending matches."""

TAIL_WINDOW = 1 << 17
"""Most unindexed tokens a store lookup searches: the newest ones after the suffix indexes (``_kernels.TAIL_WINDOW``
is the same bound). Tokens between the indexes' end and this window are not drafted from until a rebuild indexes
them, so a lookup takes bounded time however far indexing lags behind an ingest."""

try:
    from store import _kernels

    _compiled: ModuleType | None = _kernels
except ImportError:  # the extension is optional: numpy below is the reference and the fallback
    _compiled = None
    logger.debug("store._kernels is not built; lookups use numpy")

compiled: ModuleType | None = _compiled
"""The C extension ``store._kernels`` when it was built and imports, whether or not it is in use."""

native: ModuleType | None = None if os.environ.get("DRAFTER_PURE_PYTHON", "") not in ("", "0") else _compiled
"""The extension when lookups use it; None when they run on numpy (``DRAFTER_PURE_PYTHON=1``, or not built).

The native entry points return ``NotImplemented`` for arguments they do not handle, and the callers then
run the numpy code, so both paths always give the same results.
"""


def use_native(enabled: bool) -> bool:
    """Route lookups to the C extension (when built) or to numpy; returns whether native was in use."""
    global native
    before = native is not None
    native = _compiled if enabled else None
    return before


def pack_pattern(prefix_rev: np.ndarray, bits: int, tokens_per_key: int) -> tuple[np.ndarray, np.ndarray]:
    """Key bounds of the suffixes that begin with the first 1, 2, ..., k tokens of a reversed pattern.

    Returns:
        (lows, highs): (k,) uint64 each; suffixes beginning with the first i + 1 tokens have keys in
        [lows[i], highs[i]] (inclusive).
    """
    lows: list[int] = []
    highs: list[int] = []
    value = 0
    for i, tok in enumerate(prefix_rev.tolist()):
        value = (value << bits) | (tok + 1)
        shift = bits * (tokens_per_key - i - 1)
        lows.append(value << shift)
        highs.append(((value + 1) << shift) - 1)
    return np.array(lows, dtype=np.uint64), np.array(highs, dtype=np.uint64)


def extend_matches(ring_data: np.ndarray, ends: np.ndarray, context_rev: np.ndarray, matched: int,
                   limit: int, oldest: int) -> tuple[int, np.ndarray, np.ndarray]:
    """Extend candidate matches backwards through the ring buffer and keep the longest.

    Args:
        ring_data: (capacity,) int32 ring slots; absolute position p lives in slot p % capacity.
        ends: (c,) int64 absolute positions where the last ``matched`` context tokens end.
        context_rev: (>= limit,) int64 the context reversed.
        matched: tokens already known to match at every candidate.
        limit: longest match considered.
        oldest: oldest absolute position still held; earlier positions never match.

    Returns:
        (m, counts, ends): the longest match m, counts[i] = candidates matching at least matched + i + 1
        tokens for i < m - matched, and the candidates that match m tokens.
    """
    if native is not None:
        found = native.extend_matches(ring_data, ends, context_rev, matched, limit, oldest)
        if found is not NotImplemented:
            return found
    return extend_matches_numpy(ring_data, ends, context_rev, matched, limit, oldest)


def extend_matches_numpy(ring_data: np.ndarray, ends: np.ndarray, context_rev: np.ndarray, matched: int,
                         limit: int, oldest: int) -> tuple[int, np.ndarray, np.ndarray]:
    """The numpy reference of ``extend_matches``."""
    cap = ring_data.size
    ends = ends[ends - (matched - 1) >= oldest]
    more: list[int] = []
    m = matched if ends.size else 0
    while ends.size and m < limit:
        width = min(CHUNK, limit - m)
        offs = np.arange(m, m + width, dtype=np.int64)
        pos = ends[:, None] - offs[None, :]  # (c, width) absolute positions compared
        toks = ring_data[pos % cap]
        eq = (toks == context_rev[m:m + width][None, :]) & (pos >= oldest)
        run = np.where(eq.all(axis=1), width, np.argmin(eq, axis=1))  # (c,) tokens matched this step
        best = int(run.max())
        if best == 0:
            break
        more.extend(np.count_nonzero(run[:, None] > np.arange(best)[None, :], axis=0).tolist())
        ends = ends[run == best]
        m += best
        if best < width:
            break
    return m, np.array(more, dtype=np.int64), ends


def scan_matches(ring_data: np.ndarray, start: int, stop: int, context_rev: np.ndarray, limit: int,
                 oldest: int) -> tuple[int, np.ndarray, np.ndarray]:
    """Longest match of the context's end among the unindexed positions [start, stop), by a plain scan.

    Returns the same triple as ``extend_matches`` with counts starting at one token.
    """
    if native is not None:
        found = native.scan_matches(ring_data, start, stop, context_rev, limit, oldest)
        if found is not NotImplemented:
            return found
    return scan_matches_numpy(ring_data, start, stop, context_rev, limit, oldest)


def scan_matches_numpy(ring_data: np.ndarray, start: int, stop: int, context_rev: np.ndarray, limit: int,
                       oldest: int) -> tuple[int, np.ndarray, np.ndarray]:
    """The numpy reference of ``scan_matches``."""
    if stop <= start or context_rev.size == 0 or limit <= 0:
        return 0, np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.int64)
    cap = ring_data.size
    lo, hi = start % cap, (stop - 1) % cap + 1
    first = int(context_rev[0])
    if lo < hi:
        ends = np.flatnonzero(ring_data[lo:hi] == first).astype(np.int64) + start
    else:
        head = np.flatnonzero(ring_data[lo:] == first).astype(np.int64) + start
        wrapped = np.flatnonzero(ring_data[:hi] == first).astype(np.int64) + start + (cap - lo)
        ends = np.concatenate([head, wrapped])
    ends = ends[ends >= oldest]
    if not ends.size:
        return 0, np.zeros(0, dtype=np.int64), ends
    first_count = ends.size
    m, more, ends = extend_matches_numpy(ring_data, ends, context_rev, 1, limit, oldest)
    return m, np.concatenate([np.array([first_count], dtype=np.int64), more]), ends


def continuations(ring_data: np.ndarray, starts: np.ndarray, depth: int, stop: int) -> np.ndarray:
    """Tokens that followed each occurrence, cut at the first separator or at ``stop``.

    Args:
        ring_data: (capacity,) int32 ring slots.
        starts: (k,) int64 absolute positions of the first continuation token.
        depth: tokens read per occurrence.
        stop: absolute position one past the newest token.

    Returns:
        (k, depth) int32, -1 after a separator or past ``stop``.
    """
    if native is not None:
        rows = native.continuations(ring_data, starts, depth, stop)
        if rows is not NotImplemented:
            return rows
    return continuations_numpy(ring_data, starts, depth, stop)


def continuations_numpy(ring_data: np.ndarray, starts: np.ndarray, depth: int, stop: int) -> np.ndarray:
    """The numpy reference of ``continuations``."""
    pos = starts[:, None] + np.arange(depth, dtype=np.int64)[None, :]
    rows = ring_data[pos % ring_data.size]
    rows = np.where(pos < stop, rows, -1)
    cut = np.minimum.accumulate(rows >= 0, axis=1)
    return np.where(cut, rows, -1).astype(np.int32, copy=False)

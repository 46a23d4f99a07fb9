"""The bounded tail: a lookup searches only the newest ``tail_window`` unindexed tokens, whatever lags behind."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator

import numpy as np
import pytest

from store import match_kernels
from store.token_store import Continuations, TokenStore

MARK = list(range(900, 912))
"""Tokens no filler holds: a context of them matches only where the marker was stored."""


@contextlib.contextmanager
def path(native: bool) -> Iterator[None]:
    before = match_kernels.use_native(native)
    try:
        yield
    finally:
        match_kernels.use_native(before)


PATHS = [False] + ([True] if match_kernels.compiled is not None else [])


def same(a: Continuations, b: Continuations) -> bool:
    return a.match_len == b.match_len and a.counts.tolist() == b.counts.tolist() and a.rows.tolist() == b.rows.tolist()


def filler(rng: np.random.Generator, tokens: int) -> list[np.ndarray]:
    return [rng.integers(0, 50, 300) for _ in range(tokens // 301)]


@pytest.mark.parametrize("native", PATHS)
def test_tokens_between_the_index_and_the_window_are_drafted_from_once_a_rebuild_covers_them(native: bool) -> None:
    rng = np.random.default_rng(0)
    store = TokenStore(capacity=1 << 16, tail_tokens=1 << 30, tail_window=600)
    for doc in filler(rng, 3000):
        store.append(doc)
    store.rebuild("main")
    store.append(MARK)  # first after the index...
    for doc in filler(rng, 2000):  # ... then pushed out of the window
        store.append(doc)
    assert store.unindexed > store.tail_window and store.searched_from > store.indexed_end
    with path(native):
        assert store.lookup(MARK[:6], 8, 4, 4).match_len == 0
        store.append(MARK)  # a second copy inside the window is found at once
        found = store.lookup(MARK[:6], 8, 4, 4)
        assert found.match_len == 6 and found.counts[-1] == 1 and found.rows.tolist() == [MARK[6:10]]
        assert store.rebuild("delta") == "delta"  # the rebuild covers both
        found = store.lookup(MARK[:6], 8, 4, 4)
        assert found.match_len == 6 and found.counts[-1] == 2 and found.rows.tolist() == [MARK[6:10]] * 2


@pytest.mark.skipif(match_kernels.compiled is None, reason="store._kernels is not built")
def test_native_and_numpy_agree_for_every_window() -> None:
    rng = np.random.default_rng(1)
    for window in (1, 7, 64, 500, 5000):
        store = TokenStore(capacity=4000, tail_tokens=1 << 30, tail_window=window)
        for i in range(60):
            store.append(rng.integers(0, 6, int(rng.integers(1, 90))))
            if i in (20, 40):
                store.rebuild("main" if i == 20 else "delta")
        held = store.ring.read(store.ring.oldest, store.ring.end)
        for _ in range(40):
            cut = int(rng.integers(1, held.size))
            ctx = held[max(0, cut - int(rng.integers(1, 10))):cut]
            ctx = ctx[ctx >= 0]
            if not ctx.size:
                continue
            with path(True):
                got = store.lookup(ctx, 8, 5, 4)
            with path(False):
                want = store.lookup(ctx, 8, 5, 4)
            assert same(got, want), (window, ctx)


@pytest.mark.parametrize("native", PATHS)
def test_a_lookup_after_a_large_unindexed_append_takes_bounded_work(native: bool) -> None:
    """Millions of tokens behind the index: the first lookup searches the window only, in milliseconds (it used to
    index every one of them first, seconds holding the GIL)."""
    rng = np.random.default_rng(2)
    store = TokenStore(capacity=1 << 23, tail_tokens=1 << 30)
    for doc in filler(rng, 100_000):
        store.append(doc)
    store.rebuild("main")
    store.append(MARK)
    big = rng.integers(0, 50, 4_000_000)
    for i in range(0, big.size, 2000):
        store.append(big[i:i + 2000])
    assert store.unindexed > 30 * store.tail_window
    ctx = store.ring.read(store.ring.end - 20, store.ring.end - 1)
    with path(native):
        t0 = time.perf_counter()
        found = store.lookup(ctx, 16, 8, 8)
        seconds = time.perf_counter() - t0
        assert found.match_len >= 8
        assert store.lookup(MARK[:6], 8, 4, 4).match_len == 0  # outside the window: not searched
    assert seconds < 0.25, f"a lookup took {seconds:.3f} s"
    if native:
        tail = store._tail
        assert tail is not None and tail.end - tail.start <= match_kernels.TAIL_WINDOW


@pytest.mark.skipif(match_kernels.compiled is None, reason="store._kernels is not built")
def test_the_native_bound_is_the_reference_bound() -> None:
    kernels = match_kernels.compiled
    assert kernels is not None and kernels.TAIL_WINDOW == match_kernels.TAIL_WINDOW
    assert kernels.Tail().window == match_kernels.TAIL_WINDOW and kernels.Tail(5).window == 5
    assert TokenStore(capacity=100, tail_window=7)._tail.window == 7  # type: ignore[union-attr]
    with pytest.raises(ValueError):
        kernels.Tail(0)
    with pytest.raises(ValueError):
        TokenStore(capacity=100, tail_window=0)

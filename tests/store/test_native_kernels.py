"""Parity of the C kernels (store._kernels) with their numpy reference, over random stores in every state."""

from __future__ import annotations

import contextlib
import gc
import os
import pickle
import subprocess
import sys
from collections.abc import Iterator

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from drafter_service.core.acceptance import AcceptanceModel
from drafter_service.core.session import BudgetPolicy, DraftSession
from store import match_kernels, suffix_index
from store.match_kernels import continuations, extend_matches, scan_matches
from store.token_store import Continuations, TokenStore

if match_kernels.compiled is None:
    pytest.skip("store._kernels is not built", allow_module_level=True)

KERNELS = match_kernels.compiled
WIDE = (None, 1 << 18, 1 << 20, (1 << 31) - 1)
"""Token ids that widen the key layout (> 12 bits: bucket table instead of a first-token table), 3 or 2 tokens a key."""

FAST = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def _simd_available(name: str) -> bool:
    before = KERNELS.simd()
    try:
        KERNELS.simd(name)
    except ValueError:
        return False
    finally:
        KERNELS.simd(before)
    return True


SIMD = [name for name in ("avx2", "sse2", "scalar") if _simd_available(name)]
"""Instruction sets this machine runs for filtering overwritten suffix-array entries (scalar always)."""


@pytest.fixture(autouse=True)
def native_on() -> Iterator[None]:
    """These tests compare both paths whatever DRAFTER_PURE_PYTHON says."""
    before = match_kernels.use_native(True)
    yield
    match_kernels.use_native(before)


@contextlib.contextmanager
def numpy_only() -> Iterator[None]:
    """Run the numpy reference inside the block."""
    before = match_kernels.use_native(False)
    try:
        yield
    finally:
        match_kernels.use_native(before)


@contextlib.contextmanager
def simd(name: str) -> Iterator[None]:
    """Filter overwritten suffix-array entries with this instruction set inside the block."""
    before = KERNELS.simd()
    KERNELS.simd(name)
    try:
        yield
    finally:
        KERNELS.simd(before)


def assert_same(got: Continuations, want: Continuations) -> None:
    assert got.match_len == want.match_len
    assert got.counts.dtype == want.counts.dtype == np.int64
    assert got.counts.tolist() == want.counts.tolist()
    assert got.rows.dtype == want.rows.dtype == np.int32
    assert got.rows.shape == want.rows.shape
    assert got.rows.tolist() == want.rows.tolist()


def assert_same_triple(got: tuple, want: tuple) -> None:
    assert got[0] == want[0]
    for g, w in zip(got[1:], want[1:], strict=True):
        assert g.dtype == w.dtype == np.int64
        assert g.tolist() == w.tolist()


@st.composite
def stores(draw: st.DrawFn, max_docs: int = 24, max_capacity: int = 160) -> tuple[TokenStore, list[int]]:
    """A store filled with random documents, rebuilt at random points, and the alphabet it used."""
    vocab = draw(st.integers(1, 5))
    wide = draw(st.sampled_from(WIDE))
    alphabet = list(range(vocab)) + ([wide] if wide is not None else [])
    store = TokenStore(capacity=draw(st.integers(4, max_capacity)), tail_tokens=draw(st.integers(1, 40)),
                       max_candidates=draw(st.integers(1, 6)), max_examined=draw(st.integers(1, 8)),
                       tail_window=draw(st.sampled_from([match_kernels.TAIL_WINDOW, 1, 3, 10, 30])))
    docs = draw(st.lists(st.lists(st.sampled_from(alphabet), max_size=24), max_size=max_docs))
    for doc in docs:
        store.append(doc)
        kind = draw(st.sampled_from([None, None, "due", "main", "delta"]))
        if kind is not None:
            store.rebuild(None if kind == "due" else kind)
    store.check_invariants()
    return store, alphabet


@st.composite
def contexts(draw: st.DrawFn, store: TokenStore, alphabet: list[int]) -> np.ndarray:
    """A context that often ends like something stored (long matches), else random; may hold unseen ids."""
    unseen = max(alphabet) + 1 if max(alphabet) < (1 << 31) - 1 else min(alphabet) + 5
    tail = draw(st.lists(st.sampled_from(alphabet + [unseen]), max_size=4))
    held = store.ring.read(store.ring.oldest, store.ring.end)
    held = held[held >= 0]
    if held.size and draw(st.booleans()):
        cut = draw(st.integers(0, held.size))
        start = draw(st.integers(0, cut))
        tail = held[start:cut].tolist() + (tail if draw(st.booleans()) else [])
    else:
        tail = draw(st.lists(st.sampled_from(alphabet), max_size=20)) + tail
    dtype = draw(st.sampled_from([np.int32, np.int64]))
    return np.array(tail, dtype=dtype)


@FAST
@given(data=st.data())
def test_store_lookup_equals_numpy_reference(data: st.DataObject) -> None:
    store, alphabet = data.draw(stores())
    for _ in range(6):
        ctx = data.draw(contexts(store, alphabet))
        max_match = data.draw(st.integers(1, 14))
        max_occurrences = data.draw(st.integers(1, 6))
        depth = data.draw(st.integers(0, 6))
        got = store.lookup(ctx, max_match, max_occurrences, depth)
        with numpy_only():
            want = store.lookup(ctx, max_match, max_occurrences, depth)
        assert_same(got, want)
        ring, handles = store.ring, store._indexes.native
        raw = KERNELS.store_lookup(ctx, ring._data, ring.oldest, ring.end, handles[0], handles[1], max_match,
                                   max_occurrences, depth, store.max_candidates, store.max_examined)
        assert raw is not NotImplemented  # the native path answered, no fallback


@FAST
@given(data=st.data())
def test_index_match_equals_numpy_reference_for_any_oldest(data: st.DataObject) -> None:
    store, alphabet = data.draw(stores())
    indexes = [i for i in (store._indexes.main, store._indexes.delta) if i is not None]
    ring = store.ring
    for _ in range(8):
        if not indexes:
            break
        idx = data.draw(st.sampled_from(indexes))
        ctx_rev = data.draw(contexts(store, alphabet))[::-1].astype(np.int64)
        oldest = ring.oldest + data.draw(st.integers(0, ring.capacity))  # pretend more was overwritten
        max_match = data.draw(st.integers(1, 14))
        max_candidates = data.draw(st.integers(1, 6))
        with simd(data.draw(st.sampled_from(SIMD))):
            got = idx.match(ctx_rev, ring.view(), oldest, max_match, max_candidates)
        with numpy_only():
            want = idx.match_numpy(ctx_rev, ring.view(), oldest, max_match, max_candidates)
        assert_same_triple(got, want)


@st.composite
def rings(draw: st.DrawFn) -> np.ndarray:
    cap = draw(st.integers(1, 40))
    return np.array(draw(st.lists(st.integers(-1, 3), min_size=cap, max_size=cap)), dtype=np.int32)


@FAST
@given(data=st.data())
def test_scan_and_extend_equal_numpy_reference_with_wraparound(data: st.DataObject) -> None:
    ring = data.draw(rings())
    cap = ring.size
    start = data.draw(st.integers(-5, 3 * cap))
    stop = start + data.draw(st.integers(-2, cap))
    oldest = data.draw(st.integers(start - 3, stop + 1))
    limit = data.draw(st.integers(0, 12))
    ctx = np.array(data.draw(st.lists(st.integers(-1, 4), min_size=limit, max_size=limit + 3)), dtype=np.int64)
    got = scan_matches(ring, start, stop, ctx, limit, oldest)
    with numpy_only():
        want = scan_matches(ring, start, stop, ctx, limit, oldest)
    assert_same_triple(got, want)

    ends = np.array(data.draw(st.lists(st.integers(oldest - 3, stop + 2), max_size=12)), dtype=np.int64)
    matched = data.draw(st.integers(0, 3))
    got = extend_matches(ring, ends, ctx, matched, max(limit, matched), oldest)
    with numpy_only():
        want = extend_matches(ring, ends, ctx, matched, max(limit, matched), oldest)
    assert_same_triple(got, want)
    assert KERNELS.extend_matches(ring, ends, ctx, matched, max(limit, matched), oldest) is not NotImplemented


@FAST
@given(data=st.data())
def test_continuations_equal_numpy_reference(data: st.DataObject) -> None:
    ring = data.draw(rings())
    starts = np.array(data.draw(st.lists(st.integers(-3, 3 * ring.size), max_size=8)), dtype=np.int64)
    depth = data.draw(st.integers(-1, 8))
    stop = data.draw(st.integers(-1, 3 * ring.size))
    got = continuations(ring, starts, depth, stop)
    with numpy_only():
        want = continuations(ring, starts, depth, stop)
    assert got.dtype == want.dtype == np.int32 and got.shape == want.shape
    assert got.tolist() == want.tolist()


def _keys_by_definition(rev: np.ndarray, sa: np.ndarray, bits: int, per_key: int) -> list[int]:
    keys = []
    for p in sa.tolist():
        key, alive = 0, True
        for j in range(per_key):
            tok = int(rev[p + j]) if p + j < rev.size else -1
            alive = alive and tok >= 0
            key = (key << bits) | (tok + 1 if alive else 0)
        keys.append(key)
    return keys


@FAST
@given(tokens=st.lists(st.integers(-1, 6), min_size=1, max_size=40),
       layout=st.sampled_from([(3, 1), (3, 21), (4, 16), (16, 4), (32, 2)]))
def test_packed_keys_equal_numpy_reference_and_their_definition(tokens: list[int], layout: tuple[int, int]) -> None:
    rev = np.array(tokens, dtype=np.int32)
    sa = np.array(sorted(range(len(tokens)), key=lambda p: tokens[p:]), dtype=np.int32)  # any order will do
    bits, per_key = layout
    got = KERNELS.pack_keys(rev, sa, bits, per_key)
    assert got is not NotImplemented and got.dtype == np.uint64
    assert got.tolist() == suffix_index.pack_keys_numpy(rev, sa, bits, per_key).tolist()
    assert got.tolist() == _keys_by_definition(rev, sa, bits, per_key)


@FAST
@given(prompt=st.lists(st.integers(0, 3), max_size=30), steps=st.lists(st.lists(st.integers(0, 3), max_size=5),
                                                                          max_size=8),
       wide=st.sampled_from(WIDE), max_match=st.integers(-1, 12), max_occurrences=st.integers(1, 6),
       depth=st.integers(0, 6))
def test_session_lookup_equals_numpy_reference(prompt: list[int], steps: list[list[int]], wide: int | None,
                                               max_match: int, max_occurrences: int, depth: int) -> None:
    if wide is not None:
        prompt = [wide if t == 3 else t for t in prompt]
    sess = DraftSession("s", np.array(prompt, dtype=np.int32), 32, AcceptanceModel(), BudgetPolicy())
    for step in [[]] + steps:
        sess.append(np.array(step, dtype=np.int32))
        got = sess.lookup(max_match, max_occurrences, depth)
        with numpy_only():
            want = sess.lookup(max_match, max_occurrences, depth)
        assert_same(got, want)


def _fill(store: TokenStore, rng: np.random.Generator, docs: int, vocab: int) -> None:
    for _ in range(docs):
        base = rng.integers(0, vocab, int(rng.integers(0, 60)))
        store.append(np.concatenate([base, base[: int(rng.integers(0, base.size + 1))]]))  # repeats inside


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_larger_stores_in_every_index_state(seed: int) -> None:
    """Thousands of tokens: long ranges of overwritten entries, wide searches, sampling caps."""
    rng = np.random.default_rng(seed)
    vocab = (2, 3, 1 << 19)[seed]
    store = TokenStore(capacity=3000, tail_tokens=400, max_candidates=(4096, 7, 50)[seed],
                       max_examined=(1024, 5, 40)[seed])
    _fill(store, rng, 120, min(vocab, 3) if seed < 2 else 3)
    store.rebuild("main")
    for phase in range(4):
        _fill(store, rng, 15, 3)  # wraps: the main index becomes stale
        if phase == 2:
            store.rebuild("delta")
        held = store.ring.read(store.ring.oldest, store.ring.end)
        for _ in range(40):
            cut = int(rng.integers(1, held.size))
            ctx = held[max(0, cut - int(rng.integers(1, 40))):cut]
            ctx = ctx[ctx >= 0] if rng.random() < 0.8 else rng.integers(0, 3, 12)
            args = (int(rng.integers(1, 40)), int(rng.integers(1, 40)), int(rng.integers(0, 20)))
            got = store.lookup(ctx, *args)
            with numpy_only():
                want = store.lookup(ctx, *args)
            assert_same(got, want)


@pytest.mark.parametrize("isa", SIMD)
@pytest.mark.parametrize("wide", [None, 5000, 1 << 20])
def test_wrapped_main_index_skips_overwritten_entries_like_numpy(wide: int | None, isa: str) -> None:
    """Long key-level ranges partly overwritten, sampled with small and large caps (first-token table,
    bucket table over wide ids), with every instruction set."""
    with simd(isa):
        _check_wrapped_main_index(wide)


def _check_wrapped_main_index(wide: int | None) -> None:
    rng = np.random.default_rng(7)
    alphabet = np.array([0, 1, 2] + ([wide] if wide is not None else []))
    store = TokenStore(capacity=6000, tail_tokens=1 << 20)
    while store.ring.end < 12000:
        base = alphabet[rng.integers(0, alphabet.size, int(rng.integers(1, 50)))]
        store.append(np.concatenate([base, base[: int(rng.integers(0, base.size + 1))]]))
    store.rebuild("main")
    main = store._indexes.main
    assert main.native_index is not None
    for step in range(5):
        for _ in range(4 if step else 0):  # overwrite more of the main index, never rebuilding it
            store.append(alphabet[rng.integers(0, alphabet.size, int(rng.integers(100, 400)))])
        assert step == 0 or store.ring.oldest > main.start
        held = store.ring.read(store.ring.oldest, store.ring.end)
        ring = store.ring.view()
        for trial in range(30):
            cut = int(rng.integers(1, held.size))
            ctx = held[max(0, cut - int(rng.integers(1, 12))):cut]
            ctx = ctx[ctx >= 0]
            if ctx.size == 0:
                continue
            store.max_candidates = (1, 5, 4096)[trial % 3]
            store.max_examined = (1, 3, 1024, 2)[trial % 4]
            args = (int(rng.integers(1, 16)), int(rng.integers(1, 40)), int(rng.integers(0, 8)))
            got = store.lookup(ctx, *args)
            with numpy_only():
                want = store.lookup(ctx, *args)
            assert_same(got, want)
            ctx_rev = ctx[::-1].astype(np.int64)
            for oldest in (store.ring.oldest, main.start + int(rng.integers(0, len(main) + 1))):
                got_t = main.match(ctx_rev, ring, oldest, args[0], store.max_candidates)
                with numpy_only():
                    want_t = main.match_numpy(ctx_rev, ring, oldest, args[0], store.max_candidates)
                assert_same_triple(got_t, want_t)


@pytest.mark.parametrize("max_token", [2, 4095, 49151, (1 << 31) - 1])
def test_index_holds_little_per_token_beyond_its_two_arrays(max_token: int) -> None:
    """4-byte suffix array + 8-byte keys per token, a bucket table of at most 2**12 + 1 uint32 and the suffix
    array's block minima (a 63rd of its size)."""
    rng = np.random.default_rng(1)
    tokens = rng.integers(0, 3, 20000).astype(np.int32)
    tokens[::7] = max_token
    tokens[::97] = -1
    idx = suffix_index.SuffixIndex(tokens, 0)
    handle = idx.native_index
    assert handle is not None
    table = (1 << min(idx.bits, 12)) + 1
    n = len(idx)
    minima, below = 0, n
    for _ in range(3):  # levels of blocks of 64 entries (or blocks), while at least two blocks fill
        if below < 128:
            break
        below = -(-below // 64)
        minima += 4 * below
    assert table * 4 <= 16388
    assert handle.nbytes == table * 4 + minima
    assert idx.nbytes == 12 * n + handle.nbytes
    assert (4 + 12) * 10_000_000 + 16388 + 4 * 10_000_000 / 63 < 16.07 * 10_000_000  # 16.07 bytes a token at 10M


def test_empty_store_unseen_tokens_and_unusual_arguments_agree() -> None:
    store = TokenStore(capacity=64, tail_tokens=4)
    cases = [([], 8, 4, 4), ([1, 2], 8, 4, 4)]
    for ctx, *args in cases:
        assert store.lookup(np.array(ctx, dtype=np.int64), *args).match_len == 0
    store.append([5, 6, 7, 5, 6, 8])
    store.rebuild("main")
    store.append([5, 6, 9])
    cases = [
        ([5, 6], 8, 4, 4),
        ([99, 5, 6], 8, 4, 4),  # a token the index never saw, before a known end
        ([5, 99], 8, 4, 4),  # the last token never seen
        ([5, 6], 8, 4, -2),  # negative depth reads no tokens
        ([5, 6], 0, 4, 4),  # the numpy path's slicing rules for odd budgets
        ([5, 6], -1, 4, 4),
        ([5, 6], 8, 0, 4),
        ([-1, 5, 6], 8, 4, 4),  # separators in a context
        ([5, 6, (1 << 40)], 8, 4, 4),
    ]
    for ctx, *args in cases:
        for context in (ctx, np.array(ctx, dtype=np.int64)):
            got = store.lookup(context, *args)
            with numpy_only():
                want = store.lookup(context, *args)
            assert_same(got, want)


def test_native_entry_points_decline_what_they_do_not_handle() -> None:
    ring = np.zeros(8, dtype=np.int32)
    assert KERNELS.scan_matches(ring.astype(np.int64), 0, 4, np.zeros(2, np.int64), 2, 0) is NotImplemented
    assert KERNELS.scan_matches(ring, 0, 4, [0, 0], 2, 0) is NotImplemented
    assert KERNELS.continuations(ring, np.zeros(2, np.float64), 3, 4) is NotImplemented
    assert KERNELS.pack_keys(ring, np.arange(1, 9, dtype=np.int32), 4, 16) is NotImplemented  # a position past the end
    assert KERNELS.pack_keys(ring, np.array([0, 1], np.int32), 4, 16) is NotImplemented  # shorter than the tokens
    assert KERNELS.pack_keys(ring, np.zeros(8, np.int64), 4, 16) is NotImplemented
    assert KERNELS.pack_keys(ring, np.zeros(8, np.int32), 8, 16) is NotImplemented  # 128 bits a key
    assert KERNELS.store_lookup([1, 2], ring, 0, 0, None, None, 8, 4, 4, 16, 16) is NotImplemented
    assert KERNELS.store_lookup(np.array([-1]), ring, 0, 0, None, None, 8, 4, 4, 16, 16) is NotImplemented
    assert KERNELS.store_lookup(np.array([1]), ring, 0, 0, None, None, 8, 4, 4, 16, 16) is None
    with pytest.raises(TypeError):
        KERNELS.Index(np.zeros(3, np.int64), np.zeros(3, np.int32), 0, 3, 4, 16)
    with pytest.raises(ValueError):
        KERNELS.Index(np.zeros(3, np.uint64), np.zeros(2, np.int32), 0, 3, 4, 16)
    with pytest.raises(ValueError):  # unsorted keys
        KERNELS.Index(np.array([3, 1, 2], np.uint64), np.zeros(3, np.int32), 0, 3, 4, 16)
    with pytest.raises(ValueError):  # a key wider than 2 tokens of 4 bits
        KERNELS.Index(np.array([1, 1 << 8], np.uint64), np.zeros(2, np.int32), 0, 2, 4, 2)


def test_simd_choice_defaults_to_the_fastest_and_rejects_what_is_missing() -> None:
    assert KERNELS.simd() == SIMD[0]
    assert "scalar" in SIMD
    with pytest.raises(ValueError):
        KERNELS.simd("neon")
    with pytest.raises(TypeError):
        KERNELS.simd(3)
    assert KERNELS.simd(None) == SIMD[0]


def test_use_native_switches_paths_and_the_environment_forces_numpy() -> None:
    assert match_kernels.use_native(False) is True
    assert match_kernels.native is None
    assert match_kernels.use_native(True) is False
    assert match_kernels.native is KERNELS
    env = dict(os.environ, DRAFTER_PURE_PYTHON="1")
    out = subprocess.run([sys.executable, "-c", "import store.match_kernels as m; print(m.native is None, "
                          "m.compiled is not None)"], env=env, capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["True", "True"]


def test_index_handle_keeps_its_arrays_alive_and_reports_its_memory() -> None:
    store = TokenStore(capacity=256, tail_tokens=4)
    for i in range(20):
        store.append([i % 3, 1, 2, i % 5])
    store.rebuild("main")
    main = store._indexes.main
    handle = main.native_index
    assert handle is not None and handle.nbytes > 0
    assert main.nbytes == main._sa.nbytes + main._keys.nbytes + handle.nbytes
    ring = store.ring.view().copy()
    ctx_rev = np.array([2, 1, 0], dtype=np.int64)
    with numpy_only():
        want = main.match_numpy(ctx_rev, ring, 0, 8)
    copy = pickle.loads(pickle.dumps(main))
    assert copy.native_index is not None and copy.native_index is not handle
    assert_same_triple(copy.match(ctx_rev, ring, 0, 8), want)
    del main, store, copy
    gc.collect()
    assert_same_triple(KERNELS.index_match(handle, ctx_rev, ring, 0, 8, 4096), want)


def _scanned(store: TokenStore, ctx: np.ndarray, max_match: int, max_occurrences: int, depth: int):
    """The native lookup scanning the unindexed tail (no Tail given)."""
    ring, handles = store.ring, store._indexes.native
    return KERNELS.store_lookup(ctx, ring._data, ring.oldest, ring.end, handles[0], handles[1], max_match,
                                max_occurrences, depth, store.max_candidates, store.max_examined, None)


def _lookup_as_scanned(store: TokenStore, rng: np.random.Generator, held: np.ndarray, longest: int) -> None:
    """Look up a random context of up to ``longest`` - 1 tokens of ``held`` with random arguments: the answer
    (through the store's Tail) is the scan's and numpy's."""
    cut = int(rng.integers(1, held.size))
    ctx = held[max(0, cut - int(rng.integers(1, longest))):cut]
    ctx = ctx[ctx >= 0]
    if not ctx.size:
        return
    args = (int(rng.integers(1, 12)), int(rng.integers(1, 40)), int(rng.integers(0, 8)))
    got = store.lookup(ctx, *args)
    scanned = _scanned(store, ctx, *args)
    assert scanned is not NotImplemented
    assert_same(got, Continuations(*scanned) if scanned is not None else Continuations(0, np.zeros(0, np.int64),
                                                                                     np.zeros((0, 0), np.int32)))
    with numpy_only():
        assert_same(got, store.lookup(ctx, *args))


def _eager_tail(store: TokenStore) -> KERNELS.Tail:
    """Give ``store`` a Tail whose lookups bring its lists up to date whenever that adds at most TAIL_LISTS tokens
    (``add_cost`` 0), whatever the scans would cost: the lists answer every lookup they can."""
    store._tail = KERNELS.Tail(store.tail_window, add_cost=0)
    return store._tail


@pytest.mark.parametrize("seed", [0, 1])
def test_tail_lists_answer_as_the_scan_as_tokens_arrive(seed: int) -> None:
    """A lookup between every append: the Tail catches up on what arrived, starts over after rebuilds and
    wraps, and answers exactly as scanning the tail and as numpy."""
    rng = np.random.default_rng(seed)
    store = TokenStore(capacity=(900, 5000)[seed], tail_tokens=1 << 30, max_examined=(1024, 6)[seed])
    tail = _eager_tail(store)
    _fill(store, rng, 10, 3)
    store.rebuild("main")
    for step in range(300):
        _fill(store, rng, 1, (3, 5)[seed])
        if step % 70 == 69:
            store.rebuild("delta" if step % 140 == 69 else "main")
        _lookup_as_scanned(store, rng, store.ring.read(store.ring.oldest, store.ring.end), 12)
    assert tail.start <= max(store.indexed_end, store.ring.oldest) and tail.end == store.ring.end


def test_tail_lists_drop_stale_positions() -> None:
    """After rebuilds swallow what the lists cover, the positions now indexed leave the lists instead of piling up."""
    rng = np.random.default_rng(3)
    store = TokenStore(capacity=1 << 19, tail_tokens=1 << 30)
    tail = _eager_tail(store)
    _fill(store, rng, 20, 4)
    store.rebuild("main")
    covered = []
    for _ in range(12):  # each round: a tail the lists answer for, then a delta rebuild that indexes it
        while store.unindexed < KERNELS.TAIL_LISTS - 1000:
            store.append(rng.integers(0, 50, 900))
        ctx = store.ring.read(store.ring.end - 6, store.ring.end - 1)
        got = store.lookup(ctx, 8, 8, 4)
        with numpy_only():
            assert_same(got, store.lookup(ctx, 8, 8, 4))
        assert tail.end == store.ring.end and tail.start <= store.indexed_end
        covered.append(tail.end - tail.start)
        store.rebuild("delta")
    assert max(covered) <= KERNELS.TAIL_LISTS + 65536 + 1000  # stale positions are bounded
    assert covered[-1] < max(covered)  # ... and dropped


@pytest.mark.parametrize("seed", [0, 1])
def test_tail_lists_kept_up_to_date_answer_for_a_long_tail(seed: int) -> None:
    """Many sessions' lookups while requests keep arriving: the lists, brought up to date a little at a time, keep
    answering as the tail grows past what they would index at once, through delta rebuilds that move its start
    and a ring that wraps, with the scan's and numpy's answers."""
    rng = np.random.default_rng(seed)
    store = TokenStore(capacity=(1 << 18, 1 << 20)[seed], tail_tokens=1 << 30)
    _fill(store, rng, 20, 4)
    store.rebuild("main")
    tail = store._tail
    assert tail is not None

    def arrive_while_building(tokens: np.ndarray) -> None:
        """Requests stored and looked up while a rebuild indexes the ones before: the lists cover more than it."""
        store.append(rng.integers(0, (6, 40)[seed], 2000))
        store.lookup(store.ring.read(store.ring.end - 4, store.ring.end - 1), 4, 4, 2)  # before the separator
        # None: the index is built in this process

    answered = 0
    for step in range(120):
        store.append(rng.integers(0, (6, 40)[seed], int(rng.integers(500, 3000))))
        for _ in range(16):  # enough lookups a step that bringing the lists up to date pays
            _lookup_as_scanned(store, rng, store.ring.read(max(store.ring.oldest, store.ring.end - 4000),
                                                           store.ring.end), 10)
        if store.unindexed > KERNELS.TAIL_LISTS:
            assert tail.end == store.ring.end  # the lists answered, not a scan
            answered += 1
        if step % 30 == 29:  # indexes what the lists cover: they drop it at the next lookup
            store.builder = arrive_while_building
            store.rebuild("delta")
            store.builder = None
    assert answered > 40
    assert tail.end - tail.start <= 2 * KERNELS.TAIL_WINDOW + 65536 + 3000  # stale positions are bounded


def test_lookups_scan_until_the_scans_cost_as_much_as_bringing_the_lists_up_to_date() -> None:
    """Each lookup either scans the tail or brings the lists up to date and searches them: the lists once the
    scans since they last answered, this one's included, cost ``add_cost`` tokens a token they add."""
    rng = np.random.default_rng(5)
    store = TokenStore(capacity=1 << 16, tail_tokens=1 << 30)
    tail = store._tail
    assert tail is not None and tail.add_cost == KERNELS.TAIL_ADD_COST == 64
    _fill(store, rng, 20, 4)
    store.rebuild("main")
    store.append(rng.integers(0, 8, 999))  # a tail of 1,000 tokens with the separator
    ctx = store.ring.read(store.ring.end - 5, store.ring.end - 1)
    for lookup in range(1, 65):  # the lists must start over: they add all 1,000 tokens, 64 scans' worth
        got = store.lookup(ctx, 8, 8, 4)
        with numpy_only():
            assert_same(got, store.lookup(ctx, 8, 8, 4))
        assert (tail.end == store.ring.end) == (lookup == 64)
    store.append(rng.integers(0, 8, 99))  # 100 tokens more: 6,400 tokens of scans, the 1,100-token tail
    for lookup in range(1, 7):            # scanned 6 times
        store.lookup(ctx, 8, 8, 4)
        assert (tail.end == store.ring.end) == (lookup == 6)
    while store.ring.end - tail.end <= KERNELS.TAIL_LISTS:
        store.append(rng.integers(0, 8, 999))
    for _ in range(200):  # more arrived than the lists add at once: always scanned
        store.lookup(ctx, 8, 8, 4)
    assert tail.end < store.ring.end


def test_a_tail_longer_than_the_lists_take_is_scanned_with_the_same_answers() -> None:
    rng = np.random.default_rng(4)
    store = TokenStore(capacity=1 << 19, tail_tokens=1 << 30)
    _fill(store, rng, 20, 4)
    store.rebuild("main")
    while store.unindexed <= KERNELS.TAIL_LISTS:
        store.append(rng.integers(0, 50, 900))
    tail = store._tail
    assert tail is not None
    for _ in range(20):
        held = store.ring.read(store.ring.oldest, store.ring.end)
        cut = int(rng.integers(2, held.size))
        ctx = held[max(0, cut - 6):cut]
        ctx = ctx[ctx >= 0]
        if not ctx.size:
            continue
        got = store.lookup(ctx, 8, 8, 4)
        with numpy_only():
            assert_same(got, store.lookup(ctx, 8, 8, 4))
    assert tail.end == tail.start == 0  # scanned: the lists were never brought up to date

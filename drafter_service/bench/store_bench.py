"""`drafter bench store`: the core alone at scale: fill, index, index file, draft latency, lookups under load."""

from __future__ import annotations

import argparse
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np
from tqdm import tqdm

from drafter_service.bench.machine import machine
from drafter_service.bench.replay import CoreDrafter, replay
from drafter_service.core.config import DrafterConfig
from drafter_service.datasets.loaders import Request, load_dataset
from store.index_file import IndexFileHeader, read_index_file, store_arrays, write_index_file
from store.index_worker import IndexWorker
from store.token_store import TokenStore


def add_store_bench(bench: argparse._SubParsersAction) -> None:
    """Register ``bench store``."""
    st = bench.add_parser("store", help="index size, rebuild time, index file and draft latency with a large store")
    st.add_argument("--tokens", type=int, default=10_000_000, help="tokens to fill the store with")
    st.add_argument("--requests", type=int, default=200, help="held-out requests whose drafts are timed")
    st.add_argument("--budget", type=int, default=32)
    st.add_argument("--ingest-tokens", type=int, default=None,
                    help="tokens appended at once, unindexed, for the lookups during and after a large ingest "
                    "(default: a third of --tokens)")
    st.add_argument("--index-dir", default=None, help="folder for the index file (default: a temporary folder)")
    st.set_defaults(func=run_store)


def _pct(ms: Sequence[float]) -> str:
    a = np.asarray(ms)
    return (f"p50 {np.percentile(a, 50):.3f} ms  p99 {np.percentile(a, 99):.3f} ms  max {a.max():.2f} ms  "
            f"({a.size:,} lookups)")


def _contexts(held_out: Sequence[Request], n: int = 2000, seed: int = 0) -> list[np.ndarray]:
    """Draft contexts as a session has them: a held-out prompt and part of its output."""
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        req = held_out[int(rng.integers(len(held_out)))]
        doc = np.concatenate([req.prompt, req.output]).astype(np.int32)
        cut = int(rng.integers(min(len(req.prompt) + 1, doc.size), doc.size + 1))
        out.append(doc[max(0, cut - 64):cut])
    return out


PACE_S = 0.0005
"""Pause between two timed lookups: a steady draft rate that leaves CPU time to the index worker, which runs at
idle priority as in the service."""


def _lookups_while(store: TokenStore, contexts: list[np.ndarray], busy: Callable[[], bool],
                   at_least: int = 0) -> list[float]:
    """Lookup latencies (ms) while ``busy()`` holds (and at least ``at_least`` of them), as a draft makes them."""
    out: list[float] = []
    i = 0
    while busy() or len(out) < at_least:
        ctx = contexts[i % len(contexts)]
        i += 1
        t0 = time.perf_counter()
        store.lookup(ctx, 32, 32, 16)
        out.append((time.perf_counter() - t0) * 1e3)
        time.sleep(PACE_S)
    return out


def run_store(args: argparse.Namespace) -> int:
    """Fill a store with ShareGPT requests (repeated) up to ``--tokens``, rebuild, write and read the index file,
    time drafts, then lookups during a main rebuild in the index worker and during and after a large ingest."""
    print(f"Machine: {machine()}")
    requests = load_dataset("sharegpt", 3000)
    held_out, fill = requests[-args.requests:], requests[:-args.requests]
    ingest = args.ingest_tokens if args.ingest_tokens is not None else args.tokens // 3
    core = CoreDrafter(DrafterConfig(capacity=max(args.tokens + ingest + (1 << 20), 1 << 20)))
    drafter = core.core
    store = drafter.store
    t0 = time.perf_counter()
    i = 0
    with tqdm(total=args.tokens, desc="filling", unit="tok", unit_scale=True, file=sys.stderr) as bar:
        while store.ring.end < args.tokens:
            req = fill[i % len(fill)]
            before = store.ring.end
            drafter.ingest(req.prompt, req.output)
            bar.update(store.ring.end - before)
            i += 1
    fill_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    store.rebuild("main")
    rebuild_s = time.perf_counter() - t0
    stats = store.stats()
    # the ring is sized here for the ingest below too: its bytes are counted for the tokens it holds (4 each)
    per_token = (4 * stats["tokens"] + stats["index_bytes"]) / max(1, stats["tokens"])
    print(f"tokens stored: {stats['tokens']:,}  documents: {stats['documents']:,}  (filled in {fill_s:.1f} s, "
          f"{stats['tokens'] / fill_s / 1e6:.2f} M tokens/s)")
    print(f"main index rebuild: {rebuild_s:.2f} s")
    print(f"ring buffer + index in memory: {per_token:.2f} bytes per stored token (a ring sized to them)")
    _index_file(args, drafter.config.vocab_size, store, drafter.repeats.saved())
    result = replay(core, held_out, args.budget, "sharegpt-held-out")
    print(f"drafts timed: {result.steps:,}  budget {args.budget}  MAT {result.mat:.3f}")
    print(f"draft latency (correction + proposal): p50 {result.p50_us:.1f} µs  p99 {result.p99_us:.1f} µs  "
          f"mean {np.mean(result.latencies_ns) / 1e3:.1f} µs")
    contexts = _contexts(held_out)
    _lookups_under_load(store, contexts, fill, ingest)
    return 0


def _index_file(args: argparse.Namespace, vocab: int, store: TokenStore, repeats: dict[str, np.ndarray]) -> None:
    """Write the index file, read and verify it, restore a store from it, and check that both answer alike."""
    with tempfile.TemporaryDirectory(prefix="drafter-index-") as tmp:
        path = Path(args.index_dir or tmp) / "default.index"
        t0 = time.perf_counter()
        saved = store.saved()
        assert saved is not None
        _, _, bits, per_key = saved.index.arrays
        header = IndexFileHeader("default", vocab, store.ring.capacity, "", "0-0", saved.start, saved.documents,
                                 saved.index.start, bits, per_key)
        nbytes = write_index_file(path, header, {**store_arrays(saved), **repeats})
        write_s = time.perf_counter() - t0
        del saved
        t0 = time.perf_counter()
        found = read_index_file(path, "default", vocab, store.ring.capacity)
        read_s = time.perf_counter() - t0
        copy = TokenStore(store.ring.capacity, store.tail_tokens)
        t0 = time.perf_counter()
        copy.restore(found.saved_store())
        restore_s = time.perf_counter() - t0
        tokens = len(store.ring)
        print(f"index file: {nbytes / 1e6:,.1f} MB ({nbytes / tokens:.2f} bytes per stored token, "
              f"{found.arrays['repeat_tokens'].nbytes / 1e6:.1f} MB of it the repeated-prompt cache); written in "
              f"{write_s:.2f} s, read and verified (CRC-32) in {read_s:.2f} s ({nbytes / 1e9 / read_s:.2f} GB/s), "
              f"store restored from it in {restore_s:.2f} s")
        held = store.ring.read(store.ring.oldest, store.ring.end)
        rng = np.random.default_rng(5)
        same = 0
        for _ in range(200):
            cut = int(rng.integers(2, held.size))
            ctx = held[max(0, cut - 32):cut]
            a, b = store.lookup(ctx), copy.lookup(ctx)
            same += a.match_len == b.match_len and np.array_equal(a.counts, b.counts) and np.array_equal(a.rows, b.rows)
        print(f"lookups of the restored store equal the original's: {same} of 200")
        del copy, found


def _lookups_under_load(store: TokenStore, contexts: list[np.ndarray], fill: Sequence[Request], ingest: int) -> None:
    """Lookup latency during a main rebuild in the index worker, then during and right after a large ingest."""
    worker = IndexWorker()
    store.builder = worker.build_arrays
    try:
        idle = _lookups_while(store, contexts, lambda: False, at_least=2000)
        done = threading.Event()
        took: list[float] = []

        def rebuild() -> None:
            t0 = time.perf_counter()
            store.rebuild("main")
            took.append(time.perf_counter() - t0)
            done.set()

        threading.Thread(target=rebuild, name="rebuild", daemon=True).start()
        during = _lookups_while(store, contexts, lambda: not done.is_set())
        print(f"store lookups idle:                        {_pct(idle)}")
        print(f"  during a main rebuild in the index worker ({took[0]:.2f} s): {_pct(during)}")
        docs = [np.concatenate([r.prompt, r.output]).astype(np.int32) for r in fill]
        appended = threading.Event()

        def append() -> None:
            k = 0
            while store.ring.end - store.indexed_end < ingest:
                store.append(docs[k % len(docs)])
                k += 1
            appended.set()

        t0 = time.perf_counter()
        threading.Thread(target=append, name="ingest", daemon=True).start()
        while_ingesting = _lookups_while(store, contexts, lambda: not appended.is_set())
        ingest_s = time.perf_counter() - t0
        deadline = time.perf_counter() + 2.0
        after = _lookups_while(store, contexts, lambda: time.perf_counter() < deadline)
        first = ", ".join(f"{ms:.2f}" for ms in after[:3])
        print(f"  during an ingest of {store.unindexed:,} unindexed tokens ({ingest_s:.1f} s, no rebuild): "
              f"{_pct(while_ingesting)}")
        print(f"  right after it (2 s, window of {store.tail_window:,} tokens searched; the first three: {first} ms): "
              f"{_pct(after)}")
    finally:
        store.builder = None
        worker.close()

"""The Draft prober of `drafter bench serve` (a process of its own, timing every call against a real service), and
its look at what an index file covers."""

import os
import time
from pathlib import Path

import numpy as np

from drafter_service.bench.restart_bench import FileCoverage, Prober, index_file_coverage
from drafter_service.core.config import DrafterConfig
from drafter_service.datasets.request_files import Request
from drafter_service.rpc.server import create_server
from drafter_service.service.config import ServiceConfig
from store.index_file import IndexFileHeader, store_arrays, write_index_file
from store.token_store import TokenStore

VOCAB = 1000


def test_the_prober_times_draft_calls_from_its_own_process_until_stopped():
    server, port = create_server(ServiceConfig(drafter=DrafterConfig(capacity=1 << 16), default_vocab_size=VOCAB),
                                 "127.0.0.1:0")
    try:
        rng = np.random.default_rng(2)
        held = [Request(f"h{i}", rng.integers(0, VOCAB, 10, dtype=np.int32), rng.integers(0, VOCAB, 40,
                                                                                          dtype=np.int32))
                for i in range(2)]
        prober = Prober(f"127.0.0.1:{port}", held, budget=8).start()
        assert prober._process.pid is not None and prober._process.pid != os.getpid()
        began = time.monotonic()
        time.sleep(0.5)
        ended = time.monotonic()
        times = prober.stop()
        assert not prober._process.is_alive()
        assert len(times.between(began, ended)) > 10  # every call timed, on the parent's clock
        assert len(times.ms) == len(times.started) and all(0 < m < 5000 for m in times.ms)
    finally:
        server.stop(0)


def test_the_index_file_coverage_counts_the_requests_and_the_tokens_its_indexes_miss(tmp_path: Path):
    assert index_file_coverage(tmp_path) == FileCoverage()  # no file yet
    store = TokenStore(capacity=1 << 12)
    for i in range(5):
        store.append(np.arange(10, dtype=np.int32) + i)
    store.rebuild("main")
    for i in range(3):  # stored after the index: 3 documents of 7 tokens and their separators
        store.append(np.arange(7, dtype=np.int32) + i)
    saved = store.saved()
    assert saved is not None
    (tmp_path / "index").mkdir()
    write_index_file(tmp_path / "index" / "default.index", IndexFileHeader.of(saved, "default", VOCAB, 1 << 12),
                     store_arrays(saved))
    held = index_file_coverage(tmp_path)
    assert (held.documents, held.tokens_end, held.unindexed) == (8, 5 * 11 + 3 * 8, 3 * 8)

"""Suffix index builds in a child process give exactly the in-process result."""

import numpy as np
import pytest

from store.index_worker import IndexWorker
from store.suffix_index import build_arrays
from store.token_store import TokenStore


@pytest.fixture
def worker():
    w = IndexWorker()
    yield w
    w.close()


def test_child_process_builds_the_same_arrays(worker):
    rng = np.random.default_rng(0)
    for n in (1, 7, 5000):
        snap = rng.integers(0, 9, n).astype(np.int32)
        snap[::13] = -1
        got, want = worker.build_arrays(snap), build_arrays(snap)
        assert np.array_equal(got[0], want[0]) and np.array_equal(got[1], want[1]) and got[2:] == want[2:]


def test_store_with_a_child_builder_answers_like_one_without(worker):
    rng = np.random.default_rng(1)
    stores = [TokenStore(capacity=5000, tail_tokens=16), TokenStore(capacity=5000, tail_tokens=16)]
    stores[1].builder = worker.build_arrays
    for _ in range(60):
        doc = rng.integers(0, 6, 40)
        for s in stores:
            s.append(doc)
            s.rebuild()
        ctx = rng.integers(0, 6, 8)
        a, b = (s.lookup(ctx, 8, 8, 6) for s in stores)
        assert a.match_len == b.match_len and np.array_equal(a.counts, b.counts) and np.array_equal(a.rows, b.rows)


def test_a_dead_child_is_replaced_or_the_build_happens_here(worker):
    snap = np.arange(100, dtype=np.int32) % 7
    worker.build_arrays(snap)
    worker._proc.kill()
    worker._proc.wait()
    got = worker.build_arrays(snap)  # the dead child fails this call; the result is built in-process
    assert np.array_equal(got[0], build_arrays(snap)[0])
    assert np.array_equal(worker.build_arrays(snap)[0], build_arrays(snap)[0])  # a new child serves again

"""A namespace restored from its index file drafts as one restored from the whole log, against a real Redis."""

from __future__ import annotations

import dataclasses
import logging
import shutil
from pathlib import Path

import numpy as np
import pytest

from drafter_service.core.config import DrafterConfig
from drafter_service.namespaces import index_files
from drafter_service.namespaces.index_files import IndexFiles
from drafter_service.namespaces.log_follower import LogFollower
from drafter_service.namespaces.namespace import Namespace
from drafter_service.namespaces.spooling import SpoolingLog
from store.index_file import read_index_file, write_index_file
from store.persistence import PersistenceError, RedisPersistence

VOCAB = 60
CAPACITY = 40_000


def namespace(url: str, folder: Path, name: str = "default", capacity: int = CAPACITY) -> Namespace:
    """A namespace as the service makes it: Redis persistence and its index file in ``folder``."""
    persistence = RedisPersistence(url, name, vocab_size=VOCAB)
    ns = Namespace(name, DrafterConfig(vocab_size=VOCAB, capacity=capacity, tail_tokens=64), persistence)
    ns.index_files = IndexFiles(folder / f"{name}.index", name, ns.drafter, ns.log, persistence)
    return ns


def requests(seed: int, n: int) -> list[tuple[list[int], list[int], str]]:
    """Requests over a small vocabulary (long, frequent matches); every fifth repeats an earlier prompt."""
    rng = np.random.default_rng(seed)
    out: list[tuple[list[int], list[int], str]] = []
    for i in range(n):
        prompt = out[i - 3][0] if i % 5 == 4 else rng.integers(0, VOCAB, int(rng.integers(4, 30))).tolist()
        out.append((prompt, rng.integers(0, VOCAB, int(rng.integers(10, 120))).tolist(), f"{seed}-{i}"))
    return out


def probes(reqs: list[tuple[list[int], list[int], str]]) -> list[list[int]]:
    """Contexts that continue stored requests (store and repeat sources), and fresh ones."""
    rng = np.random.default_rng(99)
    out = [p + o[:k] for p, o, _ in reqs[::7] for k in (0, 3)]
    return out + [rng.integers(0, VOCAB, 12).tolist() for _ in range(10)]


def drafts(ns: Namespace, contexts: list[list[int]]) -> list[tuple]:
    """Trees for sessions started at ``contexts`` (their prompts teach the dynamic table: once per namespace)."""
    out = []
    for i, ctx in enumerate(contexts):
        tree = ns.drafter.draft(ns.drafter.start(f"probe-{i}", ctx), 24)
        out.append((tree.token_ids, tree.parents, tree.probs))
    return out


def fill(url: str, folder: Path, snapshot_after: bool) -> tuple[Namespace, list]:
    """A namespace given requests, its index file written, then more requests (the file does not cover them)."""
    ns = namespace(url, folder)
    ns.restore()
    before, after = requests(1, 250), requests(2, 80)
    ns.ingest(before)
    assert ns.rebuild("main") == "main" and ns.index_files is not None and ns.index_files.due
    if not snapshot_after:
        ns.snapshot()
    written = ns.index_files.save()
    assert written is not None and not ns.index_files.due
    ns.ingest(after)
    if snapshot_after:  # the table snapshot covers requests the file does not
        ns.snapshot()
    return ns, before + after


def restored(url: str, folder: Path) -> Namespace:
    ns = namespace(url, folder)
    ns.restore()
    ns.drafter.check_invariants()
    return ns


def assert_same_namespace(got: Namespace, want: Namespace, contexts: list[list[int]]) -> None:
    a, b = got.drafter, want.drafter
    assert (a.store.ring.documents, len(a.store.ring)) == (b.store.ring.documents, len(b.store.ring))
    assert np.array_equal(a.store.ring.read(a.store.ring.oldest, a.store.ring.end),
                          b.store.ring.read(b.store.ring.oldest, b.store.ring.end))
    assert got.log.position == want.log.position
    ra, rb = a.repeats.saved(), b.repeats.saved()
    assert sorted(zip(ra["repeat_digests"].tobytes(), ra["repeat_lengths"].tolist(), strict=False)) == \
        sorted(zip(rb["repeat_digests"].tobytes(), rb["repeat_lengths"].tolist(), strict=False))
    assert drafts(got, contexts) == drafts(want, contexts)


@pytest.mark.parametrize("snapshot_after", [False, True])
def test_a_restart_from_the_file_drafts_as_a_full_rebuild(redis_server, tmp_path: Path, caplog, snapshot_after: bool):
    ns, reqs = fill(redis_server.url, tmp_path / "index", snapshot_after)
    contexts = probes(reqs)
    expected = drafts(ns, contexts)  # the live namespace: main index, delta or tail, repeat cache
    assert sum(len(tree) > 4 for tree, _, _ in expected) > len(expected) // 2
    with caplog.at_level(logging.INFO, logger="drafter_service.namespaces.index_files"):
        from_file = restored(redis_server.url, tmp_path / "index")
    assert "read and verified" in caplog.text
    assert from_file.drafter.store.unindexed > 0  # the requests after the file are not indexed yet...
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="drafter_service.namespaces.index_files"):
        full = restored(redis_server.url, tmp_path / "none")  # no file there: every request, one main index
    assert full.drafter.store.unindexed == 0
    assert [r.levelname for r in caplog.records if "no index file at" in r.getMessage()] == ["WARNING"]
    assert_same_namespace(from_file, full, contexts)
    assert drafts(restored(redis_server.url, tmp_path / "index"), contexts) == expected
    rebuilt = restored(redis_server.url, tmp_path / "index")
    assert rebuilt.rebuild() is not None and rebuilt.drafter.store.unindexed == 0  # ... until the background rebuild
    assert drafts(rebuilt, contexts) == expected


def _flip(path: Path) -> None:
    raw = bytearray(path.read_bytes())
    raw[len(raw) // 2] ^= 1
    path.write_bytes(bytes(raw))


def _truncate(path: Path) -> None:
    with open(path, "r+b") as f:
        f.truncate(path.stat().st_size - 100)


def _relabel(path: Path, **changes: object) -> None:
    found = read_index_file(path, "default", VOCAB, CAPACITY)
    header, arrays = dataclasses.replace(found.header, **changes), {k: np.array(v) for k, v in found.arrays.items()}
    del found
    write_index_file(path, header, arrays)


DAMAGE = {
    "flipped byte": (_flip, "fails its checksum"),
    "truncated": (_truncate, "cut short"),
    "another namespace": (lambda p: _relabel(p, namespace="other"), "made for namespace 'other'"),
    "another vocabulary": (lambda p: _relabel(p, vocab_size=VOCAB + 1), "made for vocabulary size"),
    "another capacity": (lambda p: _relabel(p, capacity=CAPACITY * 2), "made for ring capacity"),
    "another Redis data set": (lambda p: _relabel(p, store_id="0" * 32), "made for Redis data set"),
}


@pytest.mark.parametrize("damage", sorted(DAMAGE))
def test_a_damaged_or_foreign_file_is_reported_and_the_index_rebuilt(redis_server, tmp_path: Path, caplog,
                                                                      damage: str):
    ns, reqs = fill(redis_server.url, tmp_path / "index", False)
    spoil, reason = DAMAGE[damage]
    spoil(tmp_path / "index" / "default.index")
    with caplog.at_level(logging.WARNING):
        got = restored(redis_server.url, tmp_path / "index")
    assert reason in caplog.text and "rebuilding the index from the log" in caplog.text
    assert got.drafter.store.unindexed == 0 and got.index_files is not None and got.index_files.due
    assert_same_namespace(got, restored(redis_server.url, tmp_path / "none"), probes(reqs))
    got.save_index()  # the background job writes a good file again
    caplog.clear()
    with caplog.at_level(logging.INFO):
        restored(redis_server.url, tmp_path / "index")
    assert "read and verified" in caplog.text


def test_a_log_position_redis_no_longer_holds_is_reported_and_the_index_rebuilt(redis_server, tmp_path: Path,
                                                                               caplog):
    ns, reqs = fill(redis_server.url, tmp_path / "index", False)
    p = ns.persistence
    assert p is not None and ns.index_files is not None and ns.index_files.written is not None
    covered = ns.index_files.written.stream_id
    shutil.copy(tmp_path / "index" / "default.index", tmp_path / "copy.index")
    p.client.xdel(p.stream_key, covered)  # trimmed past it (or lost)
    with caplog.at_level(logging.WARNING):
        got = restored(redis_server.url, tmp_path / "index")
    assert f"no longer holds request {covered}" in caplog.text
    assert_same_namespace(got, restored(redis_server.url, tmp_path / "none"), probes(reqs))
    caplog.clear()
    p.client.hset(p.meta_key, "end", 10)  # a Redis that lost data: its log ends before the file's position
    shutil.copy(tmp_path / "copy.index", tmp_path / "index" / "default.index")
    with caplog.at_level(logging.WARNING):
        restored(redis_server.url, tmp_path / "index")
    assert "but the log ends at 10-0 (Redis lost data)" in caplog.text


def test_no_file_is_written_while_the_spool_holds_requests(redis_server, tmp_path: Path, caplog):
    ns = namespace(redis_server.url, tmp_path)
    with caplog.at_level(logging.INFO, logger="drafter_service.namespaces.index_files"):
        ns.restore()  # a new namespace: no file and nothing stored is no warning
    assert [r.levelname for r in caplog.records] == ["INFO"] and "nothing stored yet" in caplog.text
    ns.ingest(requests(3, 20))
    ns.rebuild("main")
    files = ns.index_files
    assert files is not None
    files.holding = lambda: True
    assert files.save() is None and files.due and not files.path.exists()
    files.holding = lambda: False
    assert files.save() is not None and not files.due and files.path.exists()
    assert files.save() is None  # nothing new


def test_the_file_follows_delta_rebuilds_by_share_and_a_stop_writes_whatever_is_indexed(redis_server, tmp_path: Path,
                                                                                        monkeypatch):
    monkeypatch.setattr(index_files, "DUTY", 0)
    ns = namespace(redis_server.url, tmp_path)
    ns.restore()
    files = ns.index_files
    assert files is not None
    ns.ingest(requests(1, 200))
    assert ns.rebuild("main") == "main" and files.save() is not None
    assert files.covered_end == ns.drafter.store.indexed_end
    ns.ingest(requests(2, 4))
    assert ns.rebuild("delta") == "delta" and not files.due  # grew by less than a sixteenth
    ns.ingest(requests(3, 40))
    assert ns.rebuild("delta") == "delta" and files.due
    assert files.save() is not None and files.covered_end == ns.drafter.store.indexed_end
    ns.ingest(requests(4, 3))
    assert ns.rebuild("delta") == "delta" and files.save() is None
    assert files.save(behind=True) is not None and files.covered_end == ns.drafter.store.indexed_end
    assert files.save(behind=True) is None
    found = read_index_file(files.path, "default", VOCAB, CAPACITY)
    assert found.saved_store().indexed_end == files.covered_end and found.header.stream_id == ns.log.position
    monkeypatch.setattr(index_files, "DUTY", 1e9)  # the last write was moments ago: a due one waits...
    assert ns.rebuild("main") == "main" and files.save() is not None  # (the last one ran with DUTY 0)
    assert ns.rebuild("main") == "main" and files.save() is None and files.due
    assert files.save(behind=True) is None  # ... and one at shut-down finds the indexes covered already


def test_a_failed_write_is_retried_at_the_next_run(redis_server, tmp_path: Path, monkeypatch):
    ns = namespace(redis_server.url, tmp_path)
    ns.ingest(requests(5, 20))
    ns.rebuild("main")
    files = ns.index_files
    assert files is not None

    def away() -> str:
        raise ConnectionError("Redis is away")

    monkeypatch.setattr(files, "store_id", away)
    with pytest.raises(ConnectionError):
        files.save()
    assert files.due and not files.path.exists()
    monkeypatch.undo()
    assert files.save() is not None and files.path.exists() and not files.due



@pytest.mark.parametrize("following", [False, True])
def test_a_request_redis_took_before_its_reply_was_lost_is_stored_once(redis_server, tmp_path: Path, monkeypatch,
                                                                        following: bool):
    """An append that reached Redis but answered with an error (a timeout, acknowledgements not confirmed) goes to the
    spool; the log follower knows it for this process's own (its entry names the writer), and the drain's retry learns
    where Redis put it, so neither the follower (it would take the request for another replica's and store it again)
    nor an index file written afterwards holds it twice."""
    ns = namespace(redis_server.url, tmp_path)
    ns.restore()
    follower = LogFollower(ns.log).attach() if following else None
    ns.spool = SpoolingLog(ns.log, tmp_path / "spool", 1 << 20)
    ns.ingest(requests(6, 30))
    p = ns.persistence
    assert p is not None
    append = p.append_requests

    def lost_reply(*args, **kwargs):
        append(*args, **kwargs)
        raise PersistenceError("the reply did not come in time")

    monkeypatch.setattr(p, "append_requests", lost_reply)
    ns.ingest(requests(7, 3))
    monkeypatch.setattr(p, "append_requests", append)
    if follower is not None:  # the follower reads them from the log before the spool drains: they are not another's
        assert follower.poll() == 0 and ns.drafter.store.ring.documents == 33
    assert ns.spool.held == 3 and ns.spool.drain() == 3 and not ns.spool.holding
    assert ns.log.position == p.last_id()
    ns.ingest(requests(8, 2))
    if follower is not None:
        follower.poll()
    logged = sum(1 for _ in p.iter_request_records())
    assert ns.drafter.store.ring.documents == logged == 35
    assert ns.rebuild("main") == "main" and ns.index_files is not None and ns.index_files.save() is not None
    again = restored(redis_server.url, tmp_path)
    assert again.drafter.store.ring.documents == logged

"""Index files: a store written and mapped back answers as before; damaged or foreign files are refused."""

from __future__ import annotations

import dataclasses
import os
import struct
from pathlib import Path

import numpy as np
import pytest

from store import index_file
from store.index_file import (
    ChecksumAhead,
    IndexFileError,
    IndexFileHeader,
    read_index_file,
    store_arrays,
    write_index_file,
)
from store.ring_buffer import RingBuffer
from store.token_store import TokenStore

CAPACITY = 6000


def filled(seed: int = 0, capacity: int = CAPACITY, docs: int = 150) -> TokenStore:
    """A store whose ring has wrapped, a main index partly overwritten, a delta and unindexed tokens after it."""
    rng = np.random.default_rng(seed)
    store = TokenStore(capacity=capacity, tail_tokens=1 << 30)
    for i in range(docs):
        store.append(rng.integers(0, 40, int(rng.integers(5, 90))))
        if i == docs // 2:
            store.rebuild("main")
        if i == docs - 20:
            store.rebuild("delta")
    return store


def header_for(store: TokenStore, namespace: str = "ns", vocab: int = 40) -> IndexFileHeader:
    saved = store.saved()
    assert saved is not None
    return IndexFileHeader.of(saved, namespace, vocab, store.ring.capacity, "set-1", "1234-0")


def write(store: TokenStore, path: Path, **extra: np.ndarray) -> int:
    saved = store.saved()
    assert saved is not None
    return write_index_file(path, header_for(store), {**store_arrays(saved), **extra})


def assert_same_lookups(a: TokenStore, b: TokenStore, seed: int = 1) -> None:
    rng = np.random.default_rng(seed)
    held = a.ring.read(a.ring.oldest, a.ring.end)
    assert np.array_equal(held, b.ring.read(b.ring.oldest, b.ring.end))
    for _ in range(150):
        cut = int(rng.integers(1, held.size))
        ctx = held[max(0, cut - int(rng.integers(1, 12))):cut]
        ctx = ctx[ctx >= 0]
        if ctx.size:
            x, y = a.lookup(ctx, 10, 6, 5), b.lookup(ctx, 10, 6, 5)
            assert (x.match_len, x.counts.tolist(), x.rows.tolist()) == (y.match_len, y.counts.tolist(),
                                                                       y.rows.tolist())


def test_a_store_written_and_mapped_back_answers_as_before(tmp_path: Path) -> None:
    store = filled()
    assert store.ring.oldest > store._indexes.main.start  # type: ignore[union-attr]  # part of it overwritten
    extra = np.arange(10, dtype=np.int64)
    nbytes = write(store, tmp_path / "ns.index", extra=extra)
    assert nbytes == (tmp_path / "ns.index").stat().st_size
    assert [p.name for p in tmp_path.iterdir()] == ["ns.index"]  # the temporary file was renamed
    found = read_index_file(tmp_path / "ns.index", "ns", 40, CAPACITY)
    found.check_invariants()
    assert found.header == header_for(store) and found.nbytes == nbytes
    assert np.array_equal(found.arrays["extra"], extra)
    assert isinstance(found.arrays["sa"], np.memmap) and not found.arrays["sa"].flags.writeable
    copy = TokenStore(capacity=CAPACITY, tail_tokens=1 << 30)
    copy.restore(found.saved_store())
    copy.check_invariants()
    assert (copy.ring.oldest, copy.ring.end, copy.ring.documents) == (store.ring.oldest, store.ring.end,
                                                                       store.ring.documents)
    assert copy.indexed_end == store.indexed_end < store.ring.end  # main and delta; the rest is indexed again
    assert copy._indexes.delta is not None and copy._indexes.delta.start == store._indexes.main.end  # type: ignore
    assert_same_lookups(store, copy)
    assert copy.rebuild_due() is not None and copy.rebuild("delta") == "delta"
    assert_same_lookups(store, copy, seed=2)
    store.append([1, 2, 3])
    copy.append([1, 2, 3])
    assert_same_lookups(store, copy, seed=3)


def test_a_store_with_a_main_index_only_round_trips(tmp_path: Path) -> None:
    store = filled(3)
    store.rebuild("main")
    write(store, tmp_path / "ns.index")
    found = read_index_file(tmp_path / "ns.index", "ns", 40, CAPACITY)
    assert found.header.delta_bits == 0 and "delta_sa" not in found.arrays
    copy = TokenStore(capacity=CAPACITY, tail_tokens=1 << 30)
    copy.restore(found.saved_store())
    assert copy._indexes.delta is None and copy.indexed_end == store.indexed_end == store.ring.end
    assert_same_lookups(store, copy)


def test_a_new_file_replaces_the_old_one_whole(tmp_path: Path) -> None:
    path = tmp_path / "ns.index"
    write(filled(0), path)
    second = filled(5)
    write(second, path)
    found = read_index_file(path, "ns", 40, CAPACITY)
    assert np.array_equal(found.arrays["tokens"], second.ring.read(second.ring.oldest, second.ring.end))


@pytest.mark.parametrize("where", ["magic", "header", "tokens", "keys", "padding", "trailer"])
def test_a_flipped_byte_anywhere_fails_the_checksum(tmp_path: Path, where: str) -> None:
    path = tmp_path / "ns.index"
    size = write(filled(), path)
    found = read_index_file(path, "ns", 40, CAPACITY)
    keys_at = found.arrays["keys"].offset  # type: ignore[attr-defined]  # a memmap's offset in the file
    at = {"magic": 0, "header": 40, "tokens": found.arrays["tokens"].offset + 17,  # type: ignore[attr-defined]
          "keys": keys_at + found.arrays["keys"].nbytes - 1, "padding": 4000, "trailer": size - 9}[where]
    del found
    raw = bytearray(path.read_bytes())
    raw[at] ^= 0x10
    path.write_bytes(bytes(raw))
    with pytest.raises(IndexFileError, match="not an index file|checksum|corrupt header"):
        read_index_file(path, "ns", 40, CAPACITY)


def test_a_checksum_computed_ahead_is_used_once_for_the_file_it_checked(tmp_path: Path,
                                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    passes: list[int] = []
    checksum_ok = index_file._checksum_ok
    monkeypatch.setattr(index_file, "_checksum_ok", lambda mapped, end: passes.append(end) or checksum_ok(mapped, end))
    path = tmp_path / "ns.index"
    write(filled(), path)
    ahead = ChecksumAhead(path).start()
    found = read_index_file(path, "ns", 40, CAPACITY, ahead)
    assert len(passes) == 1  # the pass ahead; reading did not checksum again
    assert np.array_equal(found.arrays["tokens"], read_index_file(path, "ns", 40, CAPACITY).arrays["tokens"])
    assert len(passes) == 2
    del found


@pytest.mark.parametrize("change", ["replaced", "flipped in place"])
def test_a_file_changed_after_its_checksum_was_computed_ahead_is_checked_again(tmp_path: Path, change: str) -> None:
    path = tmp_path / "ns.index"
    write(filled(), path)
    ahead = ChecksumAhead(path).start()
    assert ahead.passed(index_file._identity(path))  # type: ignore[arg-type]
    raw = bytearray(path.read_bytes())
    raw[5000] ^= 0x10
    if change == "replaced":  # a new file under the name (as files are written: another inode)
        path.unlink()
        path.write_bytes(bytes(raw))
    else:
        with open(path, "r+b") as f:
            f.seek(5000)
            f.write(bytes(raw[5000:5001]))
        st = path.stat()
        os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000))  # a later write, whatever the clock's grain
    with pytest.raises(IndexFileError, match="checksum"):
        read_index_file(path, "ns", 40, CAPACITY, ahead)


def test_a_corrupt_file_checked_ahead_is_refused_as_without(tmp_path: Path) -> None:
    path = tmp_path / "ns.index"
    write(filled(), path)
    raw = bytearray(path.read_bytes())
    raw[5000] ^= 0x10
    path.write_bytes(bytes(raw))
    ahead = ChecksumAhead(path).start()
    with pytest.raises(IndexFileError, match="checksum"):
        read_index_file(path, "ns", 40, CAPACITY, ahead)
    missing = ChecksumAhead(tmp_path / "none.index").start()
    with pytest.raises(IndexFileError, match="cannot read"):
        read_index_file(tmp_path / "none.index", "ns", 40, CAPACITY, missing)


@pytest.mark.parametrize("keep", [0, 10, 5000, -1])
def test_a_truncated_file_is_refused(tmp_path: Path, keep: int) -> None:
    path = tmp_path / "ns.index"
    size = write(filled(), path)
    with open(path, "r+b") as f:
        f.truncate(size + keep if keep < 0 else keep)
    with pytest.raises(IndexFileError, match="cut short|not an index file"):
        read_index_file(path, "ns", 40, CAPACITY)


def test_a_file_for_another_namespace_vocabulary_or_capacity_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "ns.index"
    write(filled(), path)
    for args, what in ((("other", 40, CAPACITY), "namespace"), (("ns", 41, CAPACITY), "vocabulary size"),
                       (("ns", 40, CAPACITY + 1), "ring capacity")):
        with pytest.raises(IndexFileError, match=what):
            read_index_file(path, *args)
    with pytest.raises(IndexFileError, match="cannot read"):
        read_index_file(tmp_path / "missing.index", "ns", 40, CAPACITY)


def test_another_format_version_is_refused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "ns.index"
    monkeypatch.setattr(index_file, "FORMAT_VERSION", 99)
    write(filled(), path)
    monkeypatch.undo()
    with pytest.raises(IndexFileError, match="format 99"):
        read_index_file(path, "ns", 40, CAPACITY)
    assert struct.unpack_from("<I", path.read_bytes(), 8) == (99,)


def test_a_header_that_does_not_fit_its_arrays_is_refused(tmp_path: Path) -> None:
    store = filled()
    saved = store.saved()
    assert saved is not None
    path = tmp_path / "ns.index"
    wrong = dataclasses.replace(header_for(store), index_start=saved.end)  # an index past the tokens
    write_index_file(path, wrong, store_arrays(saved))
    with pytest.raises(IndexFileError, match="do not form a store"):
        read_index_file(path, "ns", 40, CAPACITY)


def test_a_failed_write_leaves_the_old_file_and_no_temporary(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "ns.index"
    write(filled(0), path)
    before = path.read_bytes()

    def fail(fd: int) -> None:
        raise OSError("disk full")

    monkeypatch.setattr(os, "fsync", fail)
    with pytest.raises(OSError, match="disk full"):
        write(filled(5), path)
    assert path.read_bytes() == before and [p.name for p in tmp_path.iterdir()] == ["ns.index"]


def test_a_ring_loads_only_what_it_could_have_held() -> None:
    ring = RingBuffer(10)
    with pytest.raises(ValueError):
        ring.load(np.array([1, 2, -1] * 4, np.int32), 0, 4)  # more than the capacity
    with pytest.raises(ValueError):
        ring.load(np.array([1, 2, -1], np.int32), 5, 1)  # an unwrapped ring starts at 0
    with pytest.raises(ValueError):
        ring.load(np.array([1, 2], np.int32), 0, 1)  # no separator at the end
    ring.load(np.array([7, -1, 1, 2, -1, 3, 4, 5, 6, -1], np.int32), 13, 9)
    ring.check_invariants()
    assert (ring.oldest, ring.end, ring.documents) == (13, 23, 9)
    assert ring.read(15, 23).tolist() == [1, 2, -1, 3, 4, 5, 6, -1]

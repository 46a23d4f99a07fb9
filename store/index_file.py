"""A store's index file: the ring buffer's tokens and the main suffix index on disk, memory-mapped back at start.

Layout (little-endian), every array at a 4096-byte boundary:

    "DRFTINDX" | u32 format | u32 header length | header (UTF-8 JSON) | arrays ... | trailer

The header names the namespace, vocabulary size and ring capacity the file was made for, the Redis data set and
the stream id of the last request it covers, the ring positions of its tokens, the main index's start and key
layout, and every array's name, dtype, shape and offset. The trailer ("DRFTEND", the length it follows and a
CRC-32 of everything before it) is written last, so a file cut short or changed anywhere reads as corrupt. Files
are written under a temporary name, fsynced, and renamed over the old one, so a reader sees a whole file or the
one before it.
"""

from __future__ import annotations

import json
import logging
import os
import struct
import threading
import time
import zlib
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path

import numpy as np

from store.suffix_index import SuffixIndex
from store.token_store import SavedStore

logger = logging.getLogger(__name__)

FORMAT_VERSION = 1
"""Layout version of the files this module writes; files of any other version are not read."""
MAGIC = b"DRFTINDX"
ALIGN = 4096
"""Arrays start at multiples of this (page) size, so each maps in place."""
CHUNK = 16 << 20
"""Bytes written or checksummed per call (zlib.crc32 runs without the GIL on each)."""
_PREFIX = struct.Struct("<8sII")  # magic, format, header length
_TRAILER = struct.Struct("<8sQI4x")  # b"DRFTEND\0", bytes before the trailer, CRC-32 of them
_TRAILER_MAGIC = b"DRFTEND\0"
STORE_ARRAYS = ("tokens", "sa", "keys")
"""Arrays every file holds: the ring's tokens (int32), the main index's suffix array (int32) and keys (uint64)."""


class IndexFileError(Exception):
    """An index file that cannot be used: missing, unreadable, cut short, corrupt, or made for another store."""


@dataclass(frozen=True)
class IndexFileHeader:
    """What an index file says about itself (all of it is covered by the checksum).

    Attributes:
        namespace: the namespace it was written for.
        vocab_size: that namespace's vocabulary size.
        capacity: the ring buffer's capacity in tokens.
        store_id: the Redis data set of the namespace's request log ("" without one).
        stream_id: stream id of the last request the tokens hold ("0-0": none).
        ring_start: absolute position of the first token.
        documents: documents the ring had been given up to the last token.
        index_start: absolute position where the main index starts (its end follows from its length).
        bits: bits per token in the main index's keys.
        tokens_per_key: tokens per key of the main index.
        delta_bits: the same for the delta index, which starts where the main one ends (0: no delta index).
        delta_tokens_per_key: tokens per key of the delta index (0: none).
        created: when it was written (seconds since the epoch).
    """

    namespace: str
    vocab_size: int
    capacity: int
    store_id: str
    stream_id: str
    ring_start: int
    documents: int
    index_start: int
    bits: int
    tokens_per_key: int
    delta_bits: int = 0
    delta_tokens_per_key: int = 0
    created: float = field(default=0.0, compare=False)

    @classmethod
    def of(cls, saved: SavedStore, namespace: str, vocab_size: int, capacity: int, store_id: str = "",
           stream_id: str = "0-0") -> IndexFileHeader:
        """The header of a file holding ``saved`` (see the attributes for the other arguments)."""
        _, _, bits, per_key = saved.index.arrays
        _, _, delta_bits, delta_per_key = saved.delta.arrays if saved.delta is not None else (None, None, 0, 0)
        return cls(namespace, vocab_size, capacity, store_id, stream_id, saved.start, saved.documents,
                   saved.index.start, bits, per_key, delta_bits, delta_per_key)


@dataclass(frozen=True)
class IndexFile:
    """A file read back and verified: its header and its arrays (read-only views of the memory-mapped file).

    Attributes:
        header: the header.
        arrays: name -> array: "tokens" (n,) int32, "sa" (m,) int32, "keys" (m,) uint64 and any extras written.
        nbytes: the file's size.
    """

    header: IndexFileHeader
    arrays: Mapping[str, np.ndarray]
    nbytes: int

    def saved_store(self) -> SavedStore:
        """The store state it holds, for ``TokenStore.restore`` (the index over the mapped arrays, no copies).

        Raises:
            IndexFileError: arrays that do not form an index over the tokens.
        """
        h, a = self.header, self.arrays
        try:
            index = SuffixIndex.from_arrays(h.index_start, a["sa"], a["keys"], h.bits, h.tokens_per_key)
            delta = SuffixIndex.from_arrays(index.end, a["delta_sa"], a["delta_keys"], h.delta_bits,
                                            h.delta_tokens_per_key) if h.delta_bits else None
            saved = SavedStore(a["tokens"], h.ring_start, h.documents, index, delta)
            saved.check_invariants()
            assert saved.start == max(0, saved.end - h.capacity), "tokens a ring of this capacity cannot hold"
        except (KeyError, ValueError, AssertionError) as exc:
            raise IndexFileError(f"its arrays do not form a store: {exc}") from None
        return saved

    def check_invariants(self) -> None:
        """Raise AssertionError when the arrays disagree with the header."""
        self.saved_store()
        assert self.arrays["sa"].size == self.arrays["keys"].size


def store_arrays(saved: SavedStore) -> dict[str, np.ndarray]:
    """The arrays of a store state as a file holds them (no copies): "tokens", "sa" and "keys" of the main index,
    and "delta_sa" and "delta_keys" when there is a delta index."""
    sa, keys, _, _ = saved.index.arrays
    arrays = {"tokens": saved.tokens, "sa": sa, "keys": keys}
    if saved.delta is not None:
        arrays["delta_sa"], arrays["delta_keys"], _, _ = saved.delta.arrays
    return arrays


def _align(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


def _layout(header: IndexFileHeader, arrays: Mapping[str, np.ndarray]) -> tuple[bytes, list[tuple[str, int]], int]:
    """(header block, (name, offset) per array, bytes before the trailer)."""
    block = ALIGN
    while True:
        offsets: list[tuple[str, int]] = []
        offset = block
        for name, arr in arrays.items():
            offsets.append((name, offset))
            offset = _align(offset + arr.nbytes)
        entries = [{"name": name, "dtype": arrays[name].dtype.str, "shape": list(arrays[name].shape), "offset": at}
                   for name, at in offsets]
        doc = {**asdict(header), "format": FORMAT_VERSION, "arrays": entries, "data_end": offset}
        text = json.dumps(doc, sort_keys=True).encode()
        if _PREFIX.size + len(text) <= block:
            return text, offsets, offset
        block = _align(_PREFIX.size + len(text))


def write_index_file(path: Path | str, header: IndexFileHeader, arrays: Mapping[str, np.ndarray]) -> int:
    """Write an index file atomically: a temporary file beside ``path``, fsynced, then renamed over it.

    Writes and checksums run in chunks that release the GIL, so a writer thread leaves serving threads alone.

    Args:
        path: the file.
        header: its header (``created`` is set to now; ``IndexFileHeader.of`` makes one).
        arrays: name -> array, "tokens", "sa" and "keys" first (``store_arrays``), then any extras.

    Returns:
        The file's size in bytes.
    """
    path = Path(path)
    missing = [n for n in STORE_ARRAYS if n not in arrays]
    if missing:
        raise ValueError(f"an index file needs arrays {missing}")
    arrays = {name: np.ascontiguousarray(arr) for name, arr in arrays.items()}
    header = IndexFileHeader(**{**asdict(header), "created": time.time()})
    text, offsets, data_end = _layout(header, arrays)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    crc = 0
    try:
        with open(tmp, "wb") as f:
            def put(data: memoryview | bytes) -> None:
                nonlocal crc
                for i in range(0, len(data), CHUNK):
                    part = data[i:i + CHUNK]
                    crc = zlib.crc32(part, crc)
                    f.write(part)

            put(_PREFIX.pack(MAGIC, FORMAT_VERSION, len(text)) + text)
            for name, offset in offsets:
                put(bytes(offset - f.tell()))
                put(memoryview(arrays[name].reshape(-1).view(np.uint8).data))
            put(bytes(data_end - f.tell()))
            f.write(_TRAILER.pack(_TRAILER_MAGIC, data_end, crc))
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    _fsync_dir(path.parent)
    return data_end + _TRAILER.size


def _fsync_dir(folder: Path) -> None:
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def read_index_file(path: Path | str, namespace: str, vocab_size: int, capacity: int,
                    checked: ChecksumAhead | None = None) -> IndexFile:
    """Map an index file, verify its checksum and check that it was made for this namespace and store.

    The checksum reads the whole file once (CRC-32 in chunks, without the GIL), which also brings it into the page
    cache; the arrays returned are read-only views of the mapping. With ``checked``, a checksum already computed in
    the background, that pass is skipped when it passed on this very file (same inode, size and modification time).

    Raises:
        IndexFileError: a missing or unreadable file, another format, a file cut short or failing its checksum, or
            one made for another namespace, vocabulary size or capacity (the message says which).
    """
    path = Path(path)
    identity = _identity(path)
    size, doc, data_end = _frame(path)
    mapped = np.memmap(path, dtype=np.uint8, mode="r")
    passed = checked is not None and identity is not None and checked.passed(identity) and \
        _identity(path) == identity
    if not passed and not _checksum_ok(mapped, data_end):
        raise IndexFileError(f"{path} fails its checksum (corrupt)")
    try:
        names = {f.name for f in fields(IndexFileHeader)}
        header = IndexFileHeader(**{k: v for k, v in doc.items() if k in names})
        arrays = {e["name"]: _view(mapped, e, data_end) for e in doc["arrays"]}
    except (ValueError, KeyError, TypeError) as exc:
        raise IndexFileError(f"{path} has a header that does not describe its arrays: {exc}") from None
    for what, got, want in (("namespace", header.namespace, namespace), ("vocabulary size", header.vocab_size,
                                                                         vocab_size),
                            ("ring capacity", header.capacity, capacity)):
        if got != want:
            raise IndexFileError(f"{path} was made for {what} {got!r}, not {want!r}")
    loaded = IndexFile(header, arrays, size)
    loaded.saved_store()  # arrays that form a store
    return loaded


class ChecksumAhead:
    """An index file's checksum computed in a thread of its own, started early (at start-up, while Redis loads
    its data), so that ``read_index_file`` need not compute it on the way to serving.

    Args:
        path: the file.
    """

    def __init__(self, path: Path | str) -> None:
        self.path = Path(path)
        self._passed: tuple[int, int, int, int] | None = None  # identity of the file whose checksum passed
        self._thread = threading.Thread(target=self._run, name="index-file-checksum", daemon=True)

    def start(self) -> ChecksumAhead:
        """Start computing; returns self."""
        self._thread.start()
        return self

    def _run(self) -> None:
        try:
            before = _identity(self.path)
            _, _, data_end = _frame(self.path)
            if _checksum_ok(np.memmap(self.path, dtype=np.uint8, mode="r"), data_end) and \
                    _identity(self.path) == before:
                self._passed = before
        except (IndexFileError, OSError, ValueError):
            pass  # read_index_file checks the file again and says what is wrong with it

    def passed(self, identity: tuple[int, int, int, int]) -> bool:
        """Whether the checksum passed on the file with this identity (waits for the computation to end)."""
        self._thread.join()
        return self._passed == identity


def _identity(path: Path) -> tuple[int, int, int, int] | None:
    """(device, inode, size, modification time) of a file, None when it cannot be read: files are replaced by a
    rename, never rewritten in place, so this names one file's contents."""
    try:
        st = os.stat(path)
    except OSError:
        return None
    return st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns


def _frame(path: Path) -> tuple[int, dict, int]:
    """(size, header, bytes before the trailer) of an index file, its prefix and size checked.

    Raises:
        IndexFileError: a missing or unreadable file, another format, a corrupt header, a size the header denies.
    """
    try:
        size = path.stat().st_size
        with open(path, "rb") as f:
            prefix = f.read(_PREFIX.size)
            if len(prefix) < _PREFIX.size:
                raise IndexFileError(f"{path} is cut short ({size} bytes)")
            magic, version, length = _PREFIX.unpack(prefix)
            if magic != MAGIC:
                raise IndexFileError(f"{path} is not an index file")
            if version != FORMAT_VERSION:
                raise IndexFileError(f"{path} has format {version}; this version reads format {FORMAT_VERSION}")
            text = f.read(length)
    except OSError as exc:
        raise IndexFileError(f"cannot read {path}: {exc}") from None
    try:
        doc = json.loads(text)
        data_end = int(doc["data_end"])
    except (ValueError, KeyError, TypeError):
        raise IndexFileError(f"{path} has a corrupt header") from None
    if size != data_end + _TRAILER.size:
        raise IndexFileError(f"{path} is cut short or overlong: {size} bytes, its header says "
                             f"{data_end + _TRAILER.size}")
    return size, doc, data_end


def _checksum_ok(mapped: np.memmap, data_end: int) -> bool:
    """Whether the trailer after ``data_end`` holds that length and the CRC-32 of the bytes before it."""
    magic_end, covered, stored_crc = _TRAILER.unpack(bytes(mapped[data_end:]))
    crc = 0
    for i in range(0, data_end, CHUNK):
        crc = zlib.crc32(mapped[i:min(i + CHUNK, data_end)].data, crc)
    return magic_end == _TRAILER_MAGIC and covered == data_end and crc == stored_crc


def _view(mapped: np.memmap, entry: dict, data_end: int) -> np.ndarray:
    dtype = np.dtype(entry["dtype"])
    shape = tuple(int(d) for d in entry["shape"])
    offset = int(entry["offset"])
    nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
    if offset < 0 or offset + nbytes > data_end or offset % dtype.itemsize:
        raise ValueError(f"array {entry['name']!r} lies outside the data")
    return mapped[offset:offset + nbytes].view(dtype).reshape(shape)

"""Checkpoints of cache warming: how far each log file has been acknowledged, in small JSON files."""

from __future__ import annotations

import hashlib
import json
import logging
import os
from dataclasses import asdict, dataclass
from pathlib import Path

logger = logging.getLogger(__name__)

HEAD_BYTES = 4096
"""Bytes at the start of a file whose hash tells the same file (grown) from another one at the same path."""

_VERSION = 1


@dataclass(frozen=True)
class Checkpoint:
    """How far one file has been warmed into one target.

    Attributes:
        path: the file's absolute path.
        target: where it was sent (service address and namespace).
        offset: bytes from the start whose lines are all acknowledged (or reported malformed).
        line: lines before ``offset``.
        head_len: bytes hashed into ``head_hash`` (the first min(offset, HEAD_BYTES)).
        head_hash: BLAKE2b of those bytes, hex.
        size: the file's size when the checkpoint was written.
        mtime_ns: its modification time then.
    """

    path: str
    target: str
    offset: int
    line: int
    head_len: int
    head_hash: str
    size: int
    mtime_ns: int


def head_hash(path: Path, length: int) -> str:
    """BLAKE2b (hex) of the first ``length`` bytes of ``path``."""
    with open(path, "rb") as f:
        return hashlib.blake2b(f.read(length), digest_size=16).hexdigest()


class CheckpointStore:
    """One JSON file per (target, log file) in ``folder``, each replaced atomically (write, fsync, rename).

    The target names where the requests went (a service address and namespace), so warming the same file into
    another service or namespace starts from its beginning.
    """

    def __init__(self, folder: str | Path, target: str) -> None:
        self.folder = Path(folder)
        self.target = target

    def _file(self, path: Path) -> Path:
        key = hashlib.blake2b(f"{self.target}\0{path}".encode(), digest_size=10).hexdigest()
        return self.folder / f"{path.name[:60]}.{key}.json"

    def load(self, path: str | Path) -> Checkpoint | None:
        """The checkpoint of ``path`` when it still describes the file there, else None.

        A checkpoint is dropped (None, so warming starts over; duplicates are skipped) when the file is now
        shorter than its offset or starts with other bytes: it was replaced or rewritten.
        """
        path = Path(path).resolve()
        file = self._file(path)
        try:
            data = json.loads(file.read_text(encoding="utf-8"))
            cp = Checkpoint(**{k: data[k] for k in Checkpoint.__dataclass_fields__})
        except FileNotFoundError:
            return None
        except (OSError, ValueError, KeyError, TypeError) as exc:
            logger.warning("unreadable warm checkpoint %s (%s): starting %s over", file, exc, path)
            return None
        try:
            size = path.stat().st_size
        except FileNotFoundError:
            return None
        if cp.path != str(path) or cp.target != self.target:
            return None
        if size < cp.offset or head_hash(path, cp.head_len) != cp.head_hash:
            logger.info("%s was replaced since its checkpoint: warming it from the start", path)
            return None
        return cp

    def save(self, path: str | Path, offset: int, line: int, previous: Checkpoint | None = None) -> Checkpoint:
        """Record that ``path`` is done up to byte ``offset`` (``line`` lines); returns the new checkpoint."""
        path = Path(path).resolve()
        st = path.stat()
        head_len = min(offset, HEAD_BYTES)
        if previous is not None and previous.head_len == head_len:
            digest = previous.head_hash
        else:
            digest = head_hash(path, head_len)
        cp = Checkpoint(str(path), self.target, int(offset), int(line), head_len, digest, st.st_size, st.st_mtime_ns)
        self.folder.mkdir(parents=True, exist_ok=True)
        file = self._file(path)
        temp = file.with_suffix(f".tmp{os.getpid()}")
        with open(temp, "w", encoding="utf-8") as f:
            json.dump({"version": _VERSION, **asdict(cp)}, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(temp, file)
        return cp

    def clear(self, path: str | Path) -> None:
        """Forget the checkpoint of ``path`` (``--restart``)."""
        self._file(Path(path).resolve()).unlink(missing_ok=True)


def unchanged(cp: Checkpoint | None, path: Path) -> bool:
    """Whether ``path`` was fully warmed at ``cp`` and has not changed since (no need to open it)."""
    if cp is None:
        return False
    try:
        st = path.stat()
    except FileNotFoundError:
        return True
    return cp.offset == cp.size == st.st_size and cp.mtime_ns == st.st_mtime_ns

"""Suffix index builds in a child process, so a rebuild never competes for the serving process's GIL."""

from __future__ import annotations

import itertools
import logging
import mmap
import os
import subprocess
import sys
import threading
from multiprocessing import resource_tracker
from multiprocessing.shared_memory import SharedMemory
from pathlib import Path

import numpy as np

from store.ring_buffer import copy_chunked
from store.suffix_index import build_arrays

logger = logging.getLogger(__name__)


SEGMENT_PREFIX = "drafter-ix-"
"""Shared memory of index builds is named ``drafter-ix-<service pid>-<what>``, so that segments a killed service
(or its builder, finishing after it) left behind are found and removed by the next one (``sweep_orphans``)."""
_INPUTS = itertools.count(1)  # numbers the input segments of this process (of all its IndexWorkers)


def segment_name(owner: int, what: str) -> str:
    """Name of a segment of the service whose pid is ``owner``: ``what`` makes it unique among them."""
    return f"{SEGMENT_PREFIX}{owner}-{what}"


def sweep_orphans(folder: Path = Path("/dev/shm")) -> int:
    """Remove the build segments of services that no longer run (killed between making a segment and unlinking
    it: a SIGKILL during a rebuild); returns how many bytes were freed. Segments of running services are kept."""
    freed = 0
    for path in folder.glob(f"{SEGMENT_PREFIX}*") if folder.is_dir() else ():
        try:
            owner = int(path.name[len(SEGMENT_PREFIX):].split("-", 1)[0])
        except ValueError:
            continue
        if owner == os.getpid() or _running(owner):
            continue
        try:
            size = path.stat().st_size
            path.unlink()
        except OSError:
            continue
        freed += size
    return freed


def _running(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    return True


def _serve() -> None:
    """Child loop on stdin/stdout: a line "SHM_NAME N" names a snapshot in shared memory; the reply line is
    "ok OUT_NAME BITS PER_KEY" (suffix array then keys in new shared memory) or "error MESSAGE"."""
    try:  # a rebuild only takes CPU time the serving process leaves idle
        os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
    except (AttributeError, OSError):
        os.nice(19)
    owner = os.getppid()
    for k, line in enumerate(sys.stdin):
        try:
            name, n_text = line.split()
            n = int(n_text)
            shm = SharedMemory(name=name)
            # the parent owns and unlinks it (SharedMemory._name, untyped: the name the tracker registered)
            resource_tracker.unregister(shm._name, "shared_memory")  # type: ignore[attr-defined]
            snapshot = np.ndarray((n,), dtype=np.int32, buffer=shm.buf)  # read in place: the build reverses a copy
            sa, keys, bits, per_key = build_arrays(snapshot)
            del snapshot  # the segment cannot close while an array views it
            shm.close()
            if os.getppid() != owner:
                return  # the service is gone: nobody would take (and unlink) the result
            out = SharedMemory(name=segment_name(owner, f"out{os.getpid()}-{k}"), create=True, size=max(1, n * 12))
            # handed over: the parent unlinks it
            resource_tracker.unregister(out._name, "shared_memory")  # type: ignore[attr-defined]
            np.ndarray((n,), dtype=np.int32, buffer=out.buf)[:] = sa
            np.ndarray((n,), dtype=np.uint64, buffer=out.buf, offset=n * 4)[:] = keys
            out.close()
            try:
                print(f"ok {out.name} {bits} {per_key}", flush=True)
            except BrokenPipeError:  # the service died while this build ran
                out.unlink()
                return
        except Exception as exc:  # reported to the parent, which then builds in-process
            print(f"error {exc!r}".replace("\n", " "), flush=True)


def _adopt(name: str, size: int) -> mmap.mmap | bytes:
    """Map the child's result and unlink its name: the arrays then view it without a copy made while holding
    the GIL, and the memory is freed with the last array. Falls back to a copy where /dev/shm is not used."""
    path = f"/dev/shm/{name.lstrip('/')}"
    if os.path.exists(path):
        fd = os.open(path, os.O_RDWR)
        try:
            mem = mmap.mmap(fd, size)
        finally:
            os.close(fd)
            os.unlink(path)
        return mem
    shm = SharedMemory(name=name)
    try:
        assert shm.buf is not None  # None only once closed
        return bytes(shm.buf[:size])
    finally:
        shm.close()
        shm.unlink()


CODE_ROOT = str(Path(__file__).resolve().parent.parent)
"""The folder that holds this ``store`` package: the worker imports its code from there."""

# ``python -m store.index_worker`` (or ``-c``) puts the working directory first on sys.path, so a service started in
# another checkout's folder would run that checkout's worker. The worker's first path entry is this package's own
# folder instead, wherever the service was started.
_WORKER_MAIN = "import sys; sys.path[0] = sys.argv[1]; from store.index_worker import _serve; _serve()"


def worker_command() -> list[str]:
    """The command line of the builder process: this interpreter running this installation's ``store``."""
    return [sys.executable, "-c", _WORKER_MAIN, CODE_ROOT]


class IndexWorker:
    """A long-lived child process (a fresh interpreter: the parent runs gRPC threads) that builds indexes."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._proc: subprocess.Popen | None = None
        freed = sweep_orphans()
        if freed:
            logger.warning("removed %.1f MB of shared memory that index builds of stopped services left behind",
                           freed / 1e6)

    def _ensure(self) -> subprocess.Popen:
        if self._proc is None or self._proc.poll() is not None:
            self._proc = subprocess.Popen(worker_command(), stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                                          bufsize=1)
        return self._proc

    def build_arrays(self, snapshot: np.ndarray) -> tuple[np.ndarray, np.ndarray, int, int]:
        """Same result as ``suffix_index.build_arrays``, computed in the child process.

        Falls back to building here when the child fails.
        """
        n = int(snapshot.size)
        if n == 0:
            return build_arrays(snapshot)
        with self._lock:
            shm = SharedMemory(name=segment_name(os.getpid(), f"in{next(_INPUTS)}"), create=True, size=n * 4)
            try:
                copy_chunked(np.ndarray((n,), dtype=np.int32, buffer=shm.buf), snapshot)
                proc = self._ensure()
                assert proc.stdin is not None and proc.stdout is not None
                proc.stdin.write(f"{shm.name} {n}\n")
                proc.stdin.flush()
                reply = proc.stdout.readline().split()
            except (OSError, ValueError) as exc:
                reply = ["error", repr(exc)]
            finally:
                shm.close()
                shm.unlink()
        if len(reply) != 4 or reply[0] != "ok":
            logger.warning("index builder process failed (%s); building in-process", " ".join(reply) or "no reply")
            self.close()
            return build_arrays(snapshot)
        mem = _adopt(reply[1], n * 12)
        sa = np.frombuffer(mem, dtype=np.int32, count=n)
        keys = np.frombuffer(mem, dtype=np.uint64, count=n, offset=n * 4)
        return sa, keys, int(reply[2]), int(reply[3])

    def close(self) -> None:
        """Stop the child process."""
        proc, self._proc = self._proc, None
        if proc is not None and proc.poll() is None:
            if proc.stdin is not None:
                proc.stdin.close()
            try:
                proc.wait(5)
            except subprocess.TimeoutExpired:
                proc.kill()


if __name__ == "__main__":
    _serve()

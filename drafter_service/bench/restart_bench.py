"""Parts of `drafter bench serve` around a large ingest and a restart: Draft latency during and right after the
ingest, the index and its file, bytes per stored token, and restarts after SIGKILL with and without the index file."""

from __future__ import annotations

import json
import multiprocessing
import os
import re
import shutil
import signal
import struct
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from multiprocessing.synchronize import Event
from pathlib import Path
from typing import Protocol

import grpc
import numpy as np

from drafter_service.api.drafter.v1 import drafter_pb2 as pb
from drafter_service.api.drafter.v1 import drafter_pb2_grpc as pb_grpc
from drafter_service.datasets.loaders import Request
from store.match_kernels import TAIL_WINDOW

SLOW_MS = 100.0
"""A Draft slower than this is counted apart."""
MARKER = np.random.default_rng(7).integers(1000, 40000, 400).tolist()
"""The first request stored: random tokens no other request holds, so only the store can draft them back."""


class Service(Protocol):
    """The parts of ``serve_bench.ServiceProcess`` used here."""

    data_dir: Path
    address: str
    proc: subprocess.Popen | None

    def start(self) -> float: ...


@dataclass
class Latencies:
    """Draft round trips (ms) of a prober, each with the time it started."""

    started: list[float] = field(default_factory=list)
    ms: list[float] = field(default_factory=list)

    def between(self, t0: float, t1: float) -> list[float]:
        return [m for s, m in zip(self.started, self.ms, strict=True) if t0 <= s < t1]

    def first_after(self, t0: float) -> float | None:
        return next((m for s, m in zip(self.started, self.ms, strict=True) if s >= t0), None)


def figures(ms: list[float]) -> str:
    """p50/p99/max of round trips and how many exceeded ``SLOW_MS``."""
    if not ms:
        return "no calls"
    a = np.asarray(ms)
    return (f"p50 {np.percentile(a, 50):.1f} ms  p99 {np.percentile(a, 99):.1f} ms  max {a.max():.1f} ms  "
            f"({a.size:,} calls, {int((a > SLOW_MS).sum())} over {SLOW_MS:.0f} ms)")


class Prober:
    """Replays held-out requests through unary Draft calls (3 recorded tokens accepted per call) and times every
    call, until stopped; it stores nothing.

    It runs in a process of its own, as an engine does: a thread beside the bench's load generator would time its
    own wait for the interpreter lock that the load generator's message building holds, not the service.
    """

    def __init__(self, address: str, held: list[Request], budget: int, pause_s: float = 0.002) -> None:
        self.times = Latencies()
        context = multiprocessing.get_context("spawn")
        self._stop = context.Event()
        self._ready = context.Event()
        self._results, sender = context.Pipe(duplex=False)
        self._process = context.Process(target=_probe, name="prober", daemon=True, args=(
            address, held, budget, pause_s, self._stop, self._ready, sender))

    def start(self, timeout: float = 60.0) -> Prober:
        """Start probing; returns once the first call is under way."""
        self._process.start()
        if not self._ready.wait(timeout):
            self._process.kill()
            raise RuntimeError(f"the prober did not start within {timeout:.0f} s")
        return self

    def stop(self) -> Latencies:
        """Stop probing; returns every call's start time and round trip."""
        self._stop.set()
        if self._results.poll(120):
            self.times = Latencies(*self._results.recv())
        self._process.join(10)
        return self.times


def _probe(address: str, held: list[Request], budget: int, pause_s: float, stop: Event, ready: Event,
           results: Connection) -> None:
    """The prober process: Draft calls until ``stop``, then (start times, round trips in ms) into ``results``.
    ``time.monotonic`` is the system's monotonic clock, so the times compare with the parent's."""
    times = Latencies()
    with grpc.insecure_channel(address) as channel:
        stub = pb_grpc.DrafterStub(channel)
        k = 0
        while not stop.is_set():
            req = held[k % len(held)]
            sid = f"probe-{k}"
            k += 1
            stub.StartSession(pb.StartSessionRequest(session_id=sid, prompt=req.prompt.tolist(), max_nodes=budget))
            ready.set()
            out, pos = req.output.tolist(), 0
            accepted: list[int] = []
            while pos < len(out) and not stop.is_set():
                t0 = time.monotonic()
                stub.Draft(pb.DraftRequest(session_id=sid, accepted=accepted), timeout=600)
                times.started.append(t0)
                times.ms.append((time.monotonic() - t0) * 1e3)
                accepted, pos = out[pos:pos + 3], pos + 3
                time.sleep(pause_s)  # the session stays open: ending it would store the request
    results.send((times.started, times.ms))


def store_marker(stub: pb_grpc.DrafterStub) -> None:
    """Store ``MARKER`` as a request (prompt: its first 50 tokens)."""
    stub.Ingest(pb.IngestRequest(requests=[pb.Sequence(prompt=MARKER[:50], output=MARKER[50:])]))


def marker_drafted(stub: pb_grpc.DrafterStub, session_id: str) -> bool:
    """Whether a session at ``MARKER[:120]`` (no stored prompt: no repeat) gets at least 8 of the marker's next
    tokens on one branch, some of them from the store."""
    stub.StartSession(pb.StartSessionRequest(session_id=session_id, prompt=MARKER[:120], max_nodes=32))
    reply = stub.Draft(pb.DraftRequest(session_id=session_id))
    node, depth = -1, 0
    for want in MARKER[120:160]:
        node = next((i for i, (t, p) in enumerate(zip(reply.token_ids, reply.parents, strict=True))
                     if p == node and t == want), -2)
        if node == -2:
            break
        depth += 1
    return depth >= 8 and pb.SOURCE_STORE in reply.sources


def log_seconds(text: str, pattern: str) -> float | None:
    """The last number of seconds a log line matching ``pattern`` (a regex with one group) reports."""
    found = re.findall(pattern, text)
    return float(found[-1]) if found else None


def folder_bytes(folder: Path) -> int:
    """Bytes of every file under ``folder``."""
    return sum(p.stat().st_size for p in folder.rglob("*") if p.is_file()) if folder.exists() else 0


@dataclass(frozen=True)
class FileCoverage:
    """What the default namespace's index file holds, by its header: requests, and the ring positions one past its
    tokens and one past what its indexes cover."""

    documents: int = 0
    tokens_end: int = 0
    indexed_end: int = 0

    @property
    def unindexed(self) -> int:
        """Tokens the file holds that its indexes do not cover (a restart from it indexes them first)."""
        return max(0, self.tokens_end - self.indexed_end)


def index_file_coverage(data_dir: Path) -> FileCoverage:
    """The default namespace's index file's coverage, by its header (no checksum: a quick look while the service may
    be writing a new one); all zero when there is none yet."""
    path = data_dir / "index" / "default.index"
    try:
        with open(path, "rb") as f:
            _, _, length = struct.unpack("<8sII", f.read(16))
            doc = json.loads(f.read(length))
        shapes = {a["name"]: int(a["shape"][0]) for a in doc["arrays"]}
        return FileCoverage(int(doc["documents"]), int(doc["ring_start"]) + shapes["tokens"],
                            int(doc["index_start"]) + shapes["sa"] + shapes.get("delta_sa", 0))
    except (OSError, ValueError, KeyError, IndexError, TypeError, struct.error):
        return FileCoverage()


def redis_children(pid: int) -> list[int]:
    """Process ids of the embedded valkey-server processes that ``pid`` started."""
    out = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            children = (task / "children").read_text().split()
        except OSError:  # the thread ended since the folder was listed
            continue
        for child in children:
            try:
                if Path(f"/proc/{child}/comm").read_text().strip() == "valkey-server":
                    out.append(int(child))
            except OSError:
                pass
    return out


def kill_with_redis(svc: Service) -> None:
    """SIGKILL the service and its embedded Redis together, and wait until both are gone."""
    proc = svc.proc
    assert proc is not None
    redis = redis_children(proc.pid)
    for pid in [*redis, proc.pid]:
        os.kill(pid, signal.SIGKILL)
    proc.wait(60)
    svc.proc = None
    deadline = time.monotonic() + 30
    while any(Path(f"/proc/{pid}").exists() for pid in redis) and time.monotonic() < deadline:
        time.sleep(0.05)


@dataclass
class Restart:
    """One restart after SIGKILL: seconds to SERVING, to the first draft from the first request stored and until
    lookups search every stored token, and what the logs say the parts took."""

    serving_s: float
    drafted_s: float
    searched_s: float  # every stored token searched by lookups (at most TAIL_WINDOW of them not yet indexed)
    redis_load_s: float | None
    restore_s: float | None
    index_read_s: float | None
    drafts: list[tuple]

    def line(self) -> str:
        parts = [f"Redis loaded its data in {self.redis_load_s:.1f} s" if self.redis_load_s is not None else "",
                 f"namespaces restored in {self.restore_s:.1f} s" if self.restore_s is not None else "",
                 f"index file read and verified in {self.index_read_s:.2f} s" if self.index_read_s is not None
                 else ""]
        return (f"SERVING in {self.serving_s:.1f} s, a draft from the first request stored at {self.drafted_s:.1f} s,"
                f" every stored token searched at {self.searched_s:.1f} s ({'; '.join(p for p in parts if p)})")


def restart(svc: Service, with_file: bool, probe: Callable[[pb_grpc.DrafterStub, str], list[tuple]]) -> Restart:
    """SIGKILL the service and its Redis, drop the index file unless ``with_file``, start again on the same data
    dir, and time it; ``probe`` drafts for comparing restarts."""
    kill_with_redis(svc)
    if not with_file:
        shutil.rmtree(svc.data_dir / "index", ignore_errors=True)
    serve_log, redis_log = svc.data_dir / "serve.log", svc.data_dir / "valkey.log"
    redis_mark = redis_log.stat().st_size if redis_log.exists() else 0
    t0 = time.monotonic()
    serving = svc.start()
    tag = "with" if with_file else "without"
    with grpc.insecure_channel(svc.address) as channel:
        stub = pb_grpc.DrafterStub(channel)
        k = 0
        while not marker_drafted(stub, f"marker-{tag}-{k}"):
            k += 1
            if time.monotonic() - t0 > 300:
                raise TimeoutError("no draft from the first request stored within 300 s of the restart")
            time.sleep(0.05)
        drafted = time.monotonic() - t0
        # tokens stored after the indexes are searched only as far as the newest TAIL_WINDOW of them until indexed
        while stub.GetStats(pb.GetStatsRequest()).unindexed_tokens > TAIL_WINDOW:
            if time.monotonic() - t0 > 900:
                raise TimeoutError("the stored tokens were not indexed within 900 s of the restart")
            time.sleep(0.1)
        searched = time.monotonic() - t0
        drafts = probe(stub, tag)
    said = serve_log.read_text(errors="replace")
    loaded = redis_log.read_text(errors="replace")[redis_mark:] if redis_log.exists() else ""
    return Restart(serving, drafted, searched,
                   log_seconds(loaded, r"DB loaded from append only file: ([\d.]+) seconds"),
                   log_seconds(said, r"restored \{.*\} in ([\d.]+) s"),
                   log_seconds(said, r"read and verified in ([\d.]+) s") if with_file else None, drafts)


def wait_for(what: str, ready: Callable[[], bool], timeout: float) -> float:
    """Seconds until ``ready()`` (polled every half second)."""
    t0 = time.monotonic()
    while not ready():
        if time.monotonic() - t0 > timeout:
            raise TimeoutError(f"{what}: not within {timeout:.0f} s")
        time.sleep(0.5)
    return time.monotonic() - t0

"""`drafter serve` SIGKILLed with its embedded Redis restarts from its index file, and drafts as before.

The service is started from a folder that holds another checkout's ``store`` package whose index worker would
fail: the worker must run the installed code all the same.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import grpc
import numpy as np
from serving import free_port, wait_serving

from drafter_service.api.drafter.v1 import drafter_pb2 as pb
from drafter_service.api.drafter.v1 import drafter_pb2_grpc as pb_grpc
from drafter_service.core.config import DrafterConfig
from drafter_service.runtime.runtime import Runtime
from drafter_service.service.config import ServiceConfig
from store import index_file
from store.index_file import IndexFileError, read_index_file

DRAFTER = str(Path(sys.executable).parent / "drafter")
VOCAB, CAPACITY = 1000, 200_000


def other_checkout(folder: Path) -> Path:
    """A folder holding a ``store`` package whose index worker leaves a mark and fails."""
    (folder / "store").mkdir(parents=True)
    (folder / "store" / "__init__.py").write_text("")
    (folder / "store" / "index_worker.py").write_text(
        "import pathlib\npathlib.Path('FAKE_WORKER_RAN').write_text('x')\nraise SystemExit('the wrong worker')\n")
    return folder


class Service:
    def __init__(self, data: Path, cwd: Path, log: Path) -> None:
        self.port = free_port()
        self.address = f"127.0.0.1:{self.port}"
        env = {**os.environ, "DRAFTER_VOCAB_SIZE": str(VOCAB), "DRAFTER_CAPACITY": str(CAPACITY),
               "DRAFTER_HTTP_ADDRESS": ""}
        with open(log, "ab") as out:
            self.proc = subprocess.Popen(
                [DRAFTER, "--log-level", "INFO", "serve", "--address", self.address, "--data-dir", str(data),
                 "--rebuild-interval", "0.2", "--snapshot-interval", "3600"],
                cwd=cwd, env=env, stdout=out, stderr=subprocess.STDOUT)
        wait_serving(self.address, timeout=60, proc=self.proc)

    def kill_with_redis(self) -> None:
        """SIGKILL the service and its embedded valkey-server together (a crash of the machine's processes)."""
        redis = [pid for pid in _children(self.proc.pid) if _name(pid) == "valkey-server"]
        assert redis, "no embedded valkey-server found"
        for pid in [*redis, self.proc.pid]:
            os.kill(pid, signal.SIGKILL)
        self.proc.wait(10)
        deadline = time.monotonic() + 10
        while any(Path(f"/proc/{pid}").exists() and _name(pid) == "valkey-server" for pid in redis):
            assert time.monotonic() < deadline
            time.sleep(0.05)


def _children(pid: int) -> list[int]:
    out = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        out += [int(c) for c in (task / "children").read_text().split()]
    return out


def _name(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/comm").read_text().strip()
    except OSError:
        return ""


def drafts(address: str, tag: str, probes: list[list[int]]) -> list[tuple]:
    with grpc.insecure_channel(address) as channel:
        stub = pb_grpc.DrafterStub(channel)
        out = []
        for i, prompt in enumerate(probes):
            stub.StartSession(pb.StartSessionRequest(session_id=f"{tag}-{i}", prompt=prompt))
            reply = stub.Draft(pb.DraftRequest(session_id=f"{tag}-{i}", max_nodes=32))
            out.append((list(reply.token_ids), list(reply.parents), list(reply.probs)))
        return out


def ingest(address: str, reqs: list[tuple[list[int], list[int]]]) -> None:
    with grpc.insecure_channel(address) as channel:
        stub = pb_grpc.DrafterStub(channel)
        for i in range(0, len(reqs), 50):
            stub.Ingest(pb.IngestRequest(requests=[pb.Sequence(prompt=p, output=o) for p, o in reqs[i:i + 50]]))


def stored(address: str) -> tuple[int, int]:
    with grpc.insecure_channel(address) as channel:
        s = pb_grpc.DrafterStub(channel).GetStats(pb.GetStatsRequest())
        return s.stored_requests, s.stored_tokens


def wait_for_file(path: Path, documents: int, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while True:
        try:
            if read_index_file(path, "default", VOCAB, CAPACITY).header.documents >= documents:
                return
        except IndexFileError:
            pass
        assert time.monotonic() < deadline, f"no index file covering {documents} requests at {path}"
        time.sleep(0.1)


def test_a_restart_after_sigkill_reads_the_index_file_and_a_corrupt_one_is_rebuilt(tmp_path):
    rng = np.random.default_rng(0)
    reqs = [(rng.integers(0, 40, 10).tolist(), rng.integers(0, 40, 60).tolist()) for _ in range(400)]
    probes = [reqs[i][0] + reqs[i][1][:5] for i in (3, 50, 299, 310, 399)] + [reqs[7][0]]
    cwd, data, log = other_checkout(tmp_path / "other-checkout"), tmp_path / "data", tmp_path / "serve.log"
    index = data / "index" / "default.index"
    svc = Service(data, cwd, log)
    try:
        ingest(svc.address, reqs[:300])
        wait_for_file(index, 300)
        ingest(svc.address, reqs[300:])  # logged after the file
        before = stored(svc.address)
        expected = drafts(svc.address, "a", probes)
    finally:
        svc.kill_with_redis()
    assert before == (400, sum(len(p) + len(o) + 1 for p, o in reqs))
    assert sum(len(d[0]) > 0 for d in expected) >= 5
    for round_, damage in enumerate(("none", "flipped byte")):
        if damage == "flipped byte":
            raw = bytearray(index.read_bytes())
            raw[len(raw) // 3] ^= 4
            index.write_bytes(bytes(raw))
        mark = log.stat().st_size
        svc = Service(data, cwd, log)
        try:
            assert stored(svc.address) == before
            assert drafts(svc.address, f"r{round_}", probes) == expected
        finally:
            svc.kill_with_redis()
        said = log.read_bytes()[mark:].decode(errors="replace")
        if damage == "none":
            assert "index file" in said and "read and verified" in said, said[-3000:]
        else:
            assert "fails its checksum" in said and "rebuilding the index from the log" in said, said[-3000:]
    text = log.read_text(errors="replace")
    assert "index builder process failed" not in text and not (cwd / "FAKE_WORKER_RAN").exists()


def test_a_runtime_checks_its_index_file_ahead_once_and_restores_from_it(redis_server, tmp_path: Path, monkeypatch):
    cfg = ServiceConfig(address="127.0.0.1:0", redis_url=redis_server.url, http_address="", data_dir=str(tmp_path),
                        default_vocab_size=VOCAB, drafter=DrafterConfig(capacity=CAPACITY), rebuild_in_subprocess=False,
                        rebuild_interval_s=3600, snapshot_interval_s=3600, metrics_interval_s=3600)
    first = Runtime(cfg).start()
    try:
        ns = first.service.namespace("")
        ns.ingest([([1, 2, 3], list(range(10, 60)), "r1"), ([4, 5], list(range(60, 90)), "r2")])
        ns.rebuild("main")
    finally:
        first.stop()  # writes the index file
    path = tmp_path / "index" / "default.index"
    assert path.is_file()
    passes: list[str] = []
    checksum_ok = index_file._checksum_ok
    monkeypatch.setattr(index_file, "_checksum_ok",
                        lambda mapped, end: passes.append(threading.current_thread().name) or checksum_ok(mapped, end))
    second = Runtime(cfg).start()
    try:
        files = second.service.namespace("").index_files
        assert files is not None and files.checked is not None and files.checked.path == path
        assert passes == ["index-file-checksum"]  # once, in its own thread, not again on the way to serving
        assert second.service.namespace("").drafter.store.ring.documents == 2
        assert second.service.namespace("").index_files.covered_end > 0  # type: ignore[union-attr]
    finally:
        second.stop()

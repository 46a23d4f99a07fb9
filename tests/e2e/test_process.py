"""The service as a real process: `drafter serve` and `make run`, restarts after SIGKILL, graceful SIGTERM."""

import os
import signal
import subprocess
import sys
from pathlib import Path

import grpc
import numpy as np
from serving import free_port, wait_serving

from drafter_service.api.drafter.v1 import drafter_pb2 as pb
from drafter_service.api.drafter.v1 import drafter_pb2_grpc as pb_grpc

ROOT = Path(__file__).resolve().parents[2]
DRAFTER = str(Path(sys.executable).parent / "drafter")


def start(data_dir: Path, port: int, *extra: str) -> subprocess.Popen:
    env = {**os.environ, "DRAFTER_VOCAB_SIZE": "1000", "DRAFTER_CAPACITY": "200000",
           "DRAFTER_HTTP_ADDRESS": "127.0.0.1:0"}
    proc = subprocess.Popen([DRAFTER, "serve", "--address", f"127.0.0.1:{port}", "--data-dir", str(data_dir),
                             "--snapshot-interval", "3600", *extra], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    wait_serving(f"127.0.0.1:{port}")
    return proc


def draft_for(stub, session_id, prompt):
    stub.StartSession(pb.StartSessionRequest(session_id=session_id, prompt=prompt))
    reply = stub.Draft(pb.DraftRequest(session_id=session_id, max_nodes=32))
    return list(reply.token_ids), list(reply.parents), list(reply.probs)


def test_every_acknowledged_request_survives_sigkill_and_drafts_are_identical(tmp_path):
    port = free_port()
    address = f"127.0.0.1:{port}"
    rng = np.random.default_rng(0)
    reqs = [(rng.integers(0, 40, 10).tolist(), rng.integers(0, 40, 60).tolist()) for _ in range(300)]
    proc = start(tmp_path / "data", port)
    try:
        with grpc.insecure_channel(address) as channel:
            stub = pb_grpc.DrafterStub(channel)
            for i in range(0, len(reqs), 50):
                stub.Ingest(pb.IngestRequest(requests=[pb.Sequence(prompt=p, output=o) for p, o in reqs[i:i + 50]]))
            stub.StartSession(pb.StartSessionRequest(session_id="done", prompt=reqs[0][0]))
            stub.EndSession(pb.EndSessionRequest(session_id="done", accepted=reqs[0][1][:20]))
            before = stub.GetStats(pb.GetStatsRequest())
            probes = [reqs[i][0] + reqs[i][1][:5] for i in (3, 50, 299)]
            drafts = [draft_for(stub, f"probe{i}", p) for i, p in enumerate(probes)]
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait(10)
    proc = start(tmp_path / "data", port)
    try:
        with grpc.insecure_channel(address) as channel:
            stub = pb_grpc.DrafterStub(channel)
            after = stub.GetStats(pb.GetStatsRequest())
            assert after.stored_requests == before.stored_requests == 301
            assert after.stored_tokens == before.stored_tokens
            assert [draft_for(stub, f"probe{i}", p) for i, p in enumerate(probes)] == drafts
            assert all(d[0] for d in drafts)
    finally:
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=30)
    assert proc.returncode == 0, out


def test_sigterm_saves_the_dynamic_table(tmp_path):
    port = free_port()
    proc = start(tmp_path / "data", port)
    with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
        stub = pb_grpc.DrafterStub(channel)
        stub.Ingest(pb.IngestRequest(requests=[pb.Sequence(prompt=[1, 2, 3], output=[4, 5, 6])]))
        leaders = stub.GetStats(pb.GetStatsRequest()).dynamic_leaders
    proc.send_signal(signal.SIGTERM)
    proc.communicate(timeout=30)
    assert proc.returncode == 0
    from store.embedded_redis import EmbeddedRedis
    from store.persistence import RedisPersistence
    with EmbeddedRedis(tmp_path / "data") as redis_server:
        items, header = RedisPersistence(redis_server.url, "default").load_table_snapshot()
    assert len(items) == leaders == 3  # leaders 1, 2, 3 have full followers


def test_make_run_starts_a_service_that_answers_health_checks(tmp_path):
    port = free_port()
    env = {**os.environ, "DRAFTER_ADDRESS": f"127.0.0.1:{port}", "DRAFTER_DATA_DIR": str(tmp_path / "data"),
           "DRAFTER_CAPACITY": "100000", "DRAFTER_HTTP_ADDRESS": "127.0.0.1:0"}
    proc = subprocess.Popen(["make", "--no-print-directory", "run"], cwd=ROOT, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        wait_serving(f"127.0.0.1:{port}", timeout=300)
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        out, _ = proc.communicate(timeout=60)
    assert "drafter serving on port" in out and "dashboard and /metrics on http://127.0.0.1:" in out

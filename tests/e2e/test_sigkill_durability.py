"""`drafter serve` SIGKILLed at random moments, during Redis outages too: nothing acknowledged is ever lost.

The kill count is DRAFTER_KILL_CYCLES (default 50); the figures are printed (run with -s to see them).
"""

import os
import random
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import grpc
import numpy as np
from grpc_health.v1 import health_pb2, health_pb2_grpc
from serving import free_port

from drafter_service.api.drafter.v1 import drafter_pb2 as pb
from drafter_service.api.drafter.v1 import drafter_pb2_grpc as pb_grpc
from engine_client.admin import list_frozen_tables, put_frozen_table
from store.frozen_table import FrozenNGramTable
from store.persistence import RedisPersistence

DRAFTER = str(Path(sys.executable).parent / "drafter")
KILLS = int(os.environ.get("DRAFTER_KILL_CYCLES", "50"))
VOCAB = 1000
LEADER = 999  # no request holds it: only the frozen table knows what follows
TABLE = FrozenNGramTable(1, 3, {(LEADER,): [((997, 998, 996), 50)]})


class Service:
    """One `drafter serve` process against the test's Redis."""

    def __init__(self, redis_url: str, data: Path, log: Path) -> None:
        self.address = f"127.0.0.1:{free_port()}"
        env = {**os.environ, "DRAFTER_VOCAB_SIZE": str(VOCAB), "DRAFTER_CAPACITY": str(1 << 22)}
        with open(log, "ab") as out:
            self.proc = subprocess.Popen(
                [DRAFTER, "serve", "--address", self.address, "--redis-url", redis_url, "--data-dir", str(data),
                 "--http-address", "", "--rebuild-in-subprocess", "0", "--rebuild-interval", "0.2",
                 "--snapshot-interval", "0.3", "--spool-drain-interval", "0.1", "--workers", "8"],
                env=env, stdout=out, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 60
        with grpc.insecure_channel(self.address) as channel:
            stub = health_pb2_grpc.HealthStub(channel)
            while True:
                assert self.proc.poll() is None, f"drafter serve exited with {self.proc.returncode}; see {log}"
                try:
                    if stub.Check(health_pb2.HealthCheckRequest(service="drafter.v1.Drafter"), timeout=1).status \
                            == health_pb2.HealthCheckResponse.SERVING:
                        break
                except grpc.RpcError:
                    pass
                assert time.monotonic() < deadline, f"no service at {self.address}; see {log}"
                time.sleep(0.03)

    def kill(self) -> None:
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(10)


class Clients:
    """Two threads sending unique requests (Ingest calls, and sessions ended with EndSession) until stopped."""

    def __init__(self, address: str, cycle: int, rng: np.random.Generator, sent: dict, acked: set,
                 redis_down: threading.Event) -> None:
        self.channel = grpc.insecure_channel(address)
        self.stub = pb_grpc.DrafterStub(self.channel)
        self.cycle, self.rng, self.sent, self.acked, self.redis_down = cycle, rng, sent, acked, redis_down
        self.acked_while_down = 0
        self.stop = threading.Event()
        self.lock = threading.Lock()
        self.threads = [threading.Thread(target=self._ingests), threading.Thread(target=self._sessions)]
        for t in self.threads:
            t.start()

    def _request(self, rid: str) -> tuple[list[int], list[int]]:
        with self.lock:
            prompt = self.rng.integers(0, 990, 8).tolist()
            output = self.rng.integers(0, 990, int(self.rng.integers(4, 40))).tolist()
            self.sent[rid] = (prompt, output)
        return prompt, output

    def _ack(self, *rids: str) -> None:
        with self.lock:
            self.acked.update(rids)
            if self.redis_down.is_set():
                self.acked_while_down += len(rids)

    def _ingests(self) -> None:
        k = 0
        while not self.stop.is_set():
            rids = [f"i{self.cycle}-{k}-{j}" for j in range(int(self.rng.integers(1, 4)))]
            k += 1
            seqs = [pb.Sequence(prompt=p, output=o, request_id=r) for r, (p, o) in
                    ((r, self._request(r)) for r in rids)]
            try:
                reply = self.stub.Ingest(pb.IngestRequest(requests=seqs), timeout=10)
            except grpc.RpcError:
                time.sleep(0.01)
                continue
            assert reply.ingested == len(rids), reply
            self._ack(*rids)

    def _sessions(self) -> None:
        k = 0
        while not self.stop.is_set():
            sid = f"s{self.cycle}-{k}"
            k += 1
            prompt, output = self._request(sid)
            try:
                self.stub.StartSession(pb.StartSessionRequest(session_id=sid, prompt=prompt), timeout=10)
                self.stub.Draft(pb.DraftRequest(session_id=sid, accepted=output[:3], max_nodes=8), timeout=10)
                self.stub.EndSession(pb.EndSessionRequest(session_id=sid, accepted=output[3:]), timeout=10)
            except grpc.RpcError:
                time.sleep(0.01)
                continue
            self._ack(sid)

    def close(self) -> None:
        self.stop.set()
        for t in self.threads:
            t.join(30)
        self.channel.close()


def restart_redis(server, kill: bool) -> None:
    server.requested_port = server.port  # same address: a live service reconnects
    if kill:
        server.kill()
    else:
        server.start()


def test_sigkill_at_random_moments_loses_nothing_acknowledged(redis_server, tmp_path):
    rng = np.random.default_rng(20240601)
    pace = random.Random(7)
    data, log = tmp_path / "data", tmp_path / "serve.log"
    sent: dict[str, tuple[list[int], list[int]]] = {}
    acked: set[str] = set()
    redis_down = threading.Event()
    outage_kills = acked_while_down = 0
    service = Service(redis_server.url, data, log)
    put_frozen_table(service.address, "kill-table", TABLE, source="test")
    t0 = time.monotonic()
    for cycle in range(KILLS):
        clients = Clients(service.address, cycle, rng, sent, acked, redis_down)
        kind = cycle % 10
        if kind in (4, 9):  # Redis goes away; the service is killed while requests wait in its spool
            time.sleep(pace.uniform(0.05, 0.15))
            restart_redis(redis_server, kill=True)
            redis_down.set()
            time.sleep(pace.uniform(0.15, 0.4))
            service.kill()
            outage_kills += 1
            redis_down.clear()
            restart_redis(redis_server, kill=False)
        elif kind == 7:  # Redis goes away and comes back; the kill lands before, during or after the drain
            time.sleep(pace.uniform(0.05, 0.15))
            restart_redis(redis_server, kill=True)
            redis_down.set()
            time.sleep(pace.uniform(0.15, 0.3))
            redis_down.clear()
            restart_redis(redis_server, kill=False)
            time.sleep(pace.uniform(0.0, 0.4))
            service.kill()
            outage_kills += 1
        else:
            time.sleep(pace.uniform(0.02, 0.35))
            service.kill()
        clients.close()
        acked_while_down += clients.acked_while_down
        service = Service(redis_server.url, data, log)  # a stopped process's spool is moved to Redis first
    elapsed = time.monotonic() - t0

    assert acked_while_down > 0 or KILLS < 10  # the spool path was taken, not only refused
    try:
        stored: dict[str, list] = {}
        for rec in RedisPersistence(redis_server.url, "default").iter_request_records():
            stored.setdefault(rec.request_id, []).append(rec)
        assert not (acked - set(stored)), f"{len(acked - set(stored))} acknowledged requests lost"
        for rid, recs in stored.items():
            assert len(recs) == 1, f"{rid} stored {len(recs)} times"
            prompt, output = sent[rid]  # every stored request is one that was sent, whole
            assert recs[0].tokens.tolist() == prompt + output and recs[0].prompt_len == len(prompt), rid
        with grpc.insecure_channel(service.address) as channel:
            stub = pb_grpc.DrafterStub(channel)
            stats = stub.GetStats(pb.GetStatsRequest())
            assert stats.stored_requests == len(stored) and stats.persistence_healthy
            assert stats.dynamic_leaders > 0 and "kill-table" in stats.frozen_tables
            for i, rid in enumerate(sorted(acked, key=lambda r: (len(sent[r][1]), r))[-20:]):
                prompt, output = sent[rid]  # long acknowledged requests: drafts continue them
                stub.StartSession(pb.StartSessionRequest(session_id=f"probe{i}", prompt=prompt + output[:5]))
                reply = stub.Draft(pb.DraftRequest(session_id=f"probe{i}", max_nodes=16))
                assert output[5] in {t for t, p in zip(reply.token_ids, reply.parents, strict=True) if p == -1}, rid
            stub.StartSession(pb.StartSessionRequest(session_id="frozen", prompt=[LEADER]))
            reply = stub.Draft(pb.DraftRequest(session_id="frozen", max_nodes=4))
            assert list(reply.token_ids[:3]) == [997, 998, 996]
        assert [t["name"] for t in list_frozen_tables(service.address)] == ["kill-table"]
        assert RedisPersistence(redis_server.url, "default").load_table_snapshot() is not None
        assert not list(data.rglob("*.corrupt"))
        leftover = [p for p in (data / "spool" / "default").glob("*.spool")]
        assert len(leftover) <= 1  # at most the live process's own
    finally:
        service.kill()
    print(f"\n{KILLS} SIGKILLs ({outage_kills} during Redis outages) in {elapsed:.0f} s: {len(acked)} requests "
          f"acknowledged ({acked_while_down} while Redis was down), {len(stored)} stored, 0 lost, 0 duplicated, "
          f"0 partial")

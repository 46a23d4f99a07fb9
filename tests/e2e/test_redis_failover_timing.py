"""How soon a service writes to a promoted Redis primary, and how it stores requests while too few replicas are
online: real `valkey-server` data nodes and sentinels, a real `drafter serve` under a steady load over gRPC.

The measured figures are printed (run with -s to see them); docs/durability.md quotes them.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

import grpc
import numpy as np
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from prometheus_client.parser import text_string_to_metric_families
from redis_topologies import MASTER, REPLICATION_ARGS, SentinelSet, plain, wait_until
from serving import free_port, wait_serving

from drafter_service.api.drafter.v1 import drafter_pb2 as pb
from drafter_service.api.drafter.v1 import drafter_pb2_grpc as pb_grpc
from drafter_service.core.config import DrafterConfig
from drafter_service.runtime.runtime import Runtime
from drafter_service.service.config import ServiceConfig
from store.embedded_redis import EmbeddedRedis
from store.request_log import record_from_entry

DRAFTER = str(Path(sys.executable).parent / "drafter")
VOCAB = 1000
META = "drafter:v1:{default}:meta"  # its "end" grows with every append
SWITCH_BOUND_S = 6.0  # first write on the promoted primary after the switch (the goal is 2 s; headroom for load)
RPC_BOUND_S = 1.5  # the longest EndSession or Ingest may take (the service waits on Redis 1 s at most)


class Load:
    """Two threads storing unique requests over gRPC (Ingest calls; sessions ended with EndSession), each call
    timed; every acknowledged request is kept."""

    def __init__(self, address: str) -> None:
        self.channel = grpc.insecure_channel(address)
        self.stub = pb_grpc.DrafterStub(self.channel)
        self.acked: dict[str, list[int]] = {}  # request id -> prompt + output
        self.calls: list[tuple[float, float]] = []  # (start, seconds) of each EndSession and Ingest
        self.failures: list[str] = []
        self.stop = threading.Event()
        self.threads = [threading.Thread(target=self._run, args=(kind,), daemon=True) for kind in ("i", "s")]
        for thread in self.threads:
            thread.start()

    def _run(self, kind: str) -> None:
        rng = np.random.default_rng(ord(kind))
        i = 0
        while not self.stop.is_set():
            rid, i = f"{kind}{i}", i + 1
            prompt, output = rng.integers(0, VOCAB, 8).tolist(), rng.integers(0, VOCAB, 24).tolist()
            try:
                if kind == "s":
                    self.stub.StartSession(pb.StartSessionRequest(session_id=rid, prompt=prompt), timeout=10)
                t0 = time.monotonic()
                if kind == "s":
                    self.stub.EndSession(pb.EndSessionRequest(session_id=rid, accepted=output), timeout=10)
                else:
                    self.stub.Ingest(pb.IngestRequest(requests=[pb.Sequence(prompt=prompt, output=output,
                                                                            request_id=rid)]), timeout=10)
                self.calls.append((t0, time.monotonic() - t0))
                self.acked[rid] = prompt + output
            except grpc.RpcError as exc:
                self.failures.append(f"{rid}: {exc.code()} {exc.details()}")
            time.sleep(0.005)

    def close(self) -> None:
        self.stop.set()
        for thread in self.threads:
            thread.join(15)
        self.channel.close()


class FailoverClock:
    """Polls every sentinel and the replicas: when one sentinel first names a promoted replica (the switch), and
    when the service's first append reaches it (its log's end grows)."""

    def __init__(self, sentinels: SentinelSet) -> None:
        self.set = sentinels
        self.old = (sentinels.primary.host, sentinels.primary.port)
        self.switched_at: float | None = None
        self.promoted: EmbeddedRedis | None = None
        self.first_write_at: float | None = None

    def run(self, timeout: float) -> None:
        """Poll (every 10 ms) until both moments are seen or ``timeout`` passes."""
        clients = [plain(s) for s in self.set.sentinels]
        deadline = time.monotonic() + timeout
        end_then = None
        while time.monotonic() < deadline and self.first_write_at is None:
            now = time.monotonic()
            if self.promoted is None:
                for client in clients:
                    try:
                        host, port = client.execute_command("SENTINEL", "GET-MASTER-ADDR-BY-NAME", MASTER)
                    except Exception:
                        continue
                    if (host.decode(), int(port)) != self.old:
                        self.switched_at = now
                        self.promoted = next(r for r in self.set.replicas if r.port == int(port))
                        end_then = int(plain(self.promoted).hget(META, "end") or 0)
                        break
            else:
                if int(plain(self.promoted).hget(META, "end") or 0) > end_then:
                    self.first_write_at = now
            time.sleep(0.01)


def logged(server: EmbeddedRedis) -> dict[str, list[list[int]]]:
    """Request id -> the tokens of each entry of the default namespace's log on that server (a replica too)."""
    out: dict[str, list[list[int]]] = {}
    for sid, fields in plain(server).xrange("drafter:v1:{default}:requests"):
        rec = record_from_entry(sid, fields)
        out.setdefault(str(rec.request_id), []).append(rec.tokens.tolist())
    return out


def start_service(url: str, tmp: Path, *extra: str) -> tuple[subprocess.Popen, str]:
    address = f"127.0.0.1:{free_port()}"
    log = open(tmp / "drafter.log", "ab")  # noqa: SIM115 - closed with the process
    proc = subprocess.Popen(
        [DRAFTER, "serve", "--address", address, "--redis-url", url, "--data-dir", str(tmp / "data"),
         "--vocab-size", str(VOCAB), "--capacity", str(1 << 20), "--rebuild-in-subprocess", "0",
         "--snapshot-interval", "3600", "--metrics-interval", "3600", "--workers", "8", *extra],
        env={**os.environ, "PYTHONUNBUFFERED": "1"}, stdout=log, stderr=subprocess.STDOUT)
    log.close()
    wait_serving(address, timeout=60, proc=proc)
    return proc, address


@pytest.mark.timeout(120)
def test_the_service_writes_to_a_promoted_primary_within_seconds_of_the_switch_and_loses_nothing(tmp_path):
    sentinels = SentinelSet(tmp_path / "redis", replicas=2)
    proc = None
    try:
        proc, address = start_service(sentinels.url, tmp_path, "--http-address", "", "--redis-replica-acks", "1")
        load = Load(address)
        try:
            time.sleep(3.0)
            wait_until(lambda: len(load.acked) >= 100, 30, "requests stored before the kill")
            clock = FailoverClock(sentinels)
            killed = time.monotonic()
            sentinels.primary.kill()
            clock.run(timeout=40)
            time.sleep(1.0)  # the load goes on through the new primary
        finally:
            load.close()
        assert clock.switched_at is not None and clock.promoted is not None, "the sentinels promoted no replica"
        assert clock.first_write_at is not None, f"no write reached {clock.promoted.url}; see {tmp_path}/drafter.log"
        after_switch, after_kill = clock.first_write_at - clock.switched_at, clock.first_write_at - killed
        slowest = max(seconds for _, seconds in load.calls)
        spooled = [seconds for start, seconds in load.calls if killed <= start <= clock.first_write_at]
        print(f"\nfailover: switch {clock.switched_at - killed:.2f} s after the kill; first write on the promoted "
              f"primary {after_switch:.2f} s after the switch ({after_kill:.2f} s after the kill); "
              f"{len(load.acked)} requests acknowledged, {len(spooled)} of them between the kill and that write; "
              f"slowest EndSession/Ingest {slowest:.3f} s (median {np.median(spooled) * 1e3:.1f} ms in between)")
        assert load.failures == []
        assert after_switch <= SWITCH_BOUND_S
        assert slowest <= RPC_BOUND_S

        with grpc.insecure_channel(address) as channel:  # what waited in the spool reaches the new primary too
            stub = pb_grpc.DrafterStub(channel)
            wait_until(lambda: stub.GetStats(pb.GetStatsRequest(), timeout=5).spooled_requests == 0, 30,
                       "the spool to drain")
        stored = logged(clock.promoted)
        assert stored == {rid: [doc] for rid, doc in load.acked.items()}  # each exactly once, byte for byte
    finally:
        if proc is not None:
            proc.kill()
            proc.wait(10)
        sentinels.stop()


def http(port: int, path: str) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=10) as reply:
        return reply.read().decode()


def metrics(port: int) -> dict[str, float]:
    return {s.name: s.value for family in text_string_to_metric_families(http(port, "/metrics"))
            for s in family.samples if s.labels.get("namespace") == "default"}


@pytest.mark.timeout(90)
def test_with_fewer_replicas_than_acks_requests_spool_at_once_health_says_why_and_a_new_replica_drains_them(
        tmp_path):
    with EmbeddedRedis(tmp_path / "primary", extra_args=REPLICATION_ARGS) as primary:
        runtime = Runtime(ServiceConfig(
            address="127.0.0.1:0", redis_url=primary.url, redis_replica_acks=1, http_address="127.0.0.1:0",
            default_vocab_size=VOCAB, drafter=DrafterConfig(capacity=1 << 16), rebuild_in_subprocess=False,
            snapshot_interval_s=3600, metrics_interval_s=3600, data_dir=str(tmp_path / "data"),
            spool_dir=str(tmp_path / "spool"))).start()
        channel = grpc.insecure_channel(f"127.0.0.1:{runtime.port}")
        stub = pb_grpc.DrafterStub(channel)
        replica = None
        try:
            rng = np.random.default_rng(3)
            docs = {f"r{i}": (rng.integers(0, VOCAB, 8).tolist(), rng.integers(0, VOCAB, 24).tolist())
                    for i in range(30)}
            durations = []
            for i, (rid, (prompt, output)) in enumerate(docs.items()):
                t0 = time.monotonic()
                if i % 2:
                    stub.Ingest(pb.IngestRequest(requests=[pb.Sequence(prompt=prompt, output=output,
                                                                       request_id=rid)]))
                else:
                    stub.StartSession(pb.StartSessionRequest(session_id=rid, prompt=prompt))
                    stub.EndSession(pb.EndSessionRequest(session_id=rid, accepted=output))
                durations.append(time.monotonic() - t0)
            print(f"\nwith no replica online: 30 requests stored in the spool, slowest call {max(durations):.3f} s")
            assert max(durations) < 1.0  # no wait for acknowledgements that cannot come

            stats = stub.GetStats(pb.GetStatsRequest())
            assert (stats.persistence_healthy, stats.spooled_requests, stats.redis_replicas_connected,
                    stats.redis_replica_acks) == (False, 30, 0, 1)
            assert "0 replicas online" in stats.persistence_detail
            assert "at least 2 replicas" in stats.persistence_detail
            report = json.loads(http(runtime.http_port, "/healthz"))
            assert report["status"] == "degraded" and report["spooled_requests"] == {"default": 30}
            assert report["redis_replicas_connected"] == {"default": 0} and report["redis_replica_acks"] == \
                {"default": 1} and "0 replicas online" in report["persistence_detail"]["default"]
            m = metrics(runtime.http_port)
            assert (m["drafter_persistence_healthy"], m["drafter_spooled_requests"],
                    m["drafter_redis_replicas_connected"], m["drafter_redis_replica_acks"]) == (0, 30, 0, 1)
            with grpc.insecure_channel(f"127.0.0.1:{runtime.port}") as ch:
                status = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(
                    service="drafter.v1.Drafter/persistence")).status
            assert status == health_pb2.HealthCheckResponse.NOT_SERVING
            assert plain(primary).xlen("drafter:v1:{default}:requests") == 0  # nothing unconfirmed was written

            started = time.monotonic()
            replica = SentinelSet.replica_of(primary, tmp_path / "replica")
            wait_until(lambda: stub.GetStats(pb.GetStatsRequest()).spooled_requests == 0, 20, "the spool to drain",
                       interval=0.01)
            print(f"a replica started: the spool drained {time.monotonic() - started:.2f} s later (its start and "
                  "sync included)")
            wait_until(lambda: stub.GetStats(pb.GetStatsRequest()).persistence_healthy, 10, "health to be ok")
            assert stub.GetStats(pb.GetStatsRequest()).redis_replicas_connected == 1
            assert json.loads(http(runtime.http_port, "/healthz"))["status"] == "ok"
            stub.Ingest(pb.IngestRequest(requests=[pb.Sequence(prompt=[1, 2], output=[3, 4], request_id="after")]))
            assert stub.GetStats(pb.GetStatsRequest()).spooled_requests == 0  # straight to Redis again
            expected = {**{rid: [p + o] for rid, (p, o) in docs.items()}, "after": [[1, 2, 3, 4]]}
            for server in (primary, replica):  # each once, in both, in the order they were acknowledged
                wait_until(lambda s=server: logged(s) == expected, 10, f"{server.url} to hold every request")
                assert list(logged(server)) == list(expected)
        finally:
            channel.close()
            runtime.stop(grace=0)
            if replica is not None:
                replica.stop()

"""Redis outages under a running service: drafts from memory, ingests spooled and drained, degraded health."""

import argparse
import json
import time
import urllib.request

import grpc
import numpy as np
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from drafter_service.api.drafter.v1 import drafter_pb2 as pb
from drafter_service.api.drafter.v1 import drafter_pb2_grpc as pb_grpc
from drafter_service.cli.serve import add_serve_commands, config_from_args
from drafter_service.core.config import DrafterConfig
from drafter_service.namespaces.namespace import Namespace
from drafter_service.namespaces.spooling import SpoolingLog
from drafter_service.runtime.runtime import Runtime
from drafter_service.runtime.spools import spool_folder
from drafter_service.service.config import ServiceConfig
from store.persistence import PersistenceUnavailable, RedisPersistence
from store.spool import Spool, SpoolRecord, new_id

VOCAB = 1000
SERVING, NOT_SERVING = health_pb2.HealthCheckResponse.SERVING, health_pb2.HealthCheckResponse.NOT_SERVING
rng = np.random.default_rng(7)
REQS = {f"r{i}": (rng.integers(0, 900, 8).tolist(), rng.integers(0, 900, 40).tolist()) for i in range(40)}


def start(redis_url, spool_dir, **kw):
    """A service whose data folder (its index files) is ``spool_dir`` + "-data", kept across its restarts."""
    kw.setdefault("data_dir", f"{spool_dir}-data")
    cfg = ServiceConfig(address="127.0.0.1:0", redis_url=redis_url, http_address="127.0.0.1:0",
                        default_vocab_size=VOCAB, drafter=DrafterConfig(capacity=1 << 16), rebuild_in_subprocess=False,
                        rebuild_interval_s=0.1, snapshot_interval_s=3600, metrics_interval_s=3600,
                        spool_dir=str(spool_dir), spool_drain_interval_s=0.1, **kw)
    return Runtime(cfg).start()


def ingest(stub, *rids, skip=False):
    reply = stub.Ingest(pb.IngestRequest(skip_duplicates=skip, requests=[
        pb.Sequence(prompt=REQS[r][0], output=REQS[r][1], request_id=r) for r in rids]))
    return reply.ingested, reply.skipped


def next_tokens(stub, sid, rid, known=4):
    """The tokens the draft tree offers right after the request's prompt and first ``known`` output tokens."""
    prompt, output = REQS[rid]
    stub.StartSession(pb.StartSessionRequest(session_id=sid, prompt=prompt + output[:known]))
    reply = stub.Draft(pb.DraftRequest(session_id=sid, max_nodes=16))
    return {t for t, p in zip(reply.token_ids, reply.parents, strict=True) if p == -1}, output[known]


def health(address, service):
    with grpc.insecure_channel(address) as channel:
        return health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=service)).status


def wait_for(fn, timeout=10.0):
    deadline = time.monotonic() + timeout
    while not fn():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)


def http(runtime, path):
    with urllib.request.urlopen(f"http://127.0.0.1:{runtime.http_port}{path}", timeout=10) as reply:
        return reply.read().decode()


def logged(url):
    """Request id -> [(tokens, prompt length)] of every entry in the default namespace's Redis stream."""
    out = {}
    for rec in RedisPersistence(url, "default").iter_request_records():
        out.setdefault(rec.request_id, []).append((rec.tokens.tolist(), rec.prompt_len))
    return out


def restart_same_port(server):
    server.requested_port = server.port  # the service's client reconnects to the same address
    server.start()


def test_redis_restarted_under_the_service_spools_then_drains_every_acknowledged_request(redis_server, tmp_path):
    runtime = start(redis_server.url, tmp_path / "spool")
    address = f"127.0.0.1:{runtime.port}"
    channel = grpc.insecure_channel(address)
    stub = pb_grpc.DrafterStub(channel)
    try:
        assert ingest(stub, "r0", "r1", "r2") == (3, 0)
        stub.StartSession(pb.StartSessionRequest(session_id="s1", prompt=REQS["r30"][0]))
        redis_server.kill()  # a crash: what it acknowledged is in its append-only file

        tokens, expected = next_tokens(stub, "d0", "r1")  # drafts come from memory
        assert expected in tokens
        acked = [r for r in ("r3", "r4", "r5", "r6") if ingest(stub, r) == (1, 0)]
        assert acked == ["r3", "r4", "r5", "r6"]  # acknowledged through the spool
        assert ingest(stub, "r7", "r8") == (2, 0)
        assert stub.EndSession(pb.EndSessionRequest(session_id="s1", accepted=REQS["r30"][1])).stored_tokens == 48
        assert ingest(stub, "r3", "r9", skip=True) == (1, 1)  # r3 is held in the spool already
        assert ingest(stub, "r0", skip=True) == (1, 0)  # Redis holds r0: found out when the spool drains
        tokens, expected = next_tokens(stub, "d1", "r7")  # spooled requests are drafted from at once
        assert expected in tokens

        wait_for(lambda: health(address, "drafter.v1.Drafter/persistence") == NOT_SERVING)
        assert health(address, "drafter.v1.Drafter") == SERVING
        stats = stub.GetStats(pb.GetStatsRequest())
        assert stats.persistence_healthy is False and stats.stored_requests == 3 + 4 + 2 + 1 + 1 + 1
        assert stats.spooled_requests == 9 and "9 acknowledged requests wait" in stats.persistence_detail
        report = json.loads(http(runtime, "/healthz"))
        assert report.pop("persistence_detail")["default"].startswith("Redis does not answer")
        assert report == {"status": "degraded", "persistence_healthy": {"default": False},
                          "spooled_requests": {"default": 9}, "redis_replicas_connected": {"default": 0},
                          "redis_replica_acks": {"default": 0}}
        assert 'drafter_spooled_requests{namespace="default"} 9.0' in http(runtime, "/metrics")
        (spool_file,) = (tmp_path / "spool" / "default").glob("*.spool")
        assert spool_file.stat().st_size > 9 * 40 * 4
        runtime.service.namespaces["default"].spool.check_invariants()

        restart_same_port(redis_server)
        wait_for(lambda: health(address, "drafter.v1.Drafter/persistence") == SERVING)
        log = logged(redis_server.url)
        for rid in ("r0", "r1", "r2", "r3", "r4", "r5", "r6", "r7", "r8", "r9"):
            assert log[rid] == [(REQS[rid][0] + REQS[rid][1], 8)], rid  # each exactly once, byte for byte
        assert log["s1"] == [(REQS["r30"][0] + REQS["r30"][1], 8)]
        assert len(log) == 11
        assert stub.GetStats(pb.GetStatsRequest()).persistence_healthy is True
        assert json.loads(http(runtime, "/healthz"))["status"] == "ok"
        assert spool_file.stat().st_size < 100  # drained: the header alone is left
        assert ingest(stub, "r10") == (1, 0) and len(logged(redis_server.url)) == 12  # straight to Redis again
    finally:
        channel.close()
        runtime.stop(grace=0)
    assert not list((tmp_path / "spool" / "default").glob("*.spool"))  # an empty spool is removed at stop
    again = start(redis_server.url, tmp_path / "spool")
    try:
        assert again.service.namespaces["default"].stats().stored_requests == 12
    finally:
        again.stop(grace=0)


def test_a_full_spool_refuses_with_unavailable_and_keeps_nothing_of_the_refused(redis_server, tmp_path):
    runtime = start(redis_server.url, tmp_path / "spool", spool_max_bytes=4096)
    channel = grpc.insecure_channel(f"127.0.0.1:{runtime.port}")
    stub = pb_grpc.DrafterStub(channel)
    try:
        ingest(stub, "r0")
        redis_server.stop()
        acked, refused = [], None
        for i in range(1, 40):
            try:
                ingest(stub, f"r{i}")
                acked.append(f"r{i}")
            except grpc.RpcError as exc:
                assert exc.code() == grpc.StatusCode.UNAVAILABLE and "spool is full" in exc.details()
                refused = f"r{i}"
                break
        assert refused is not None and 10 <= len(acked) <= 25  # about 230 bytes each in 4096
        with pytest.raises(grpc.RpcError) as err:  # a session's end is refused the same way, and stays open
            stub.StartSession(pb.StartSessionRequest(session_id="s", prompt=REQS["r39"][0]))
            stub.EndSession(pb.EndSessionRequest(session_id="s", accepted=REQS["r39"][1]))
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE
        assert stub.GetStats(pb.GetStatsRequest()).active_sessions == 1
        stats = stub.GetStats(pb.GetStatsRequest())
        assert stats.stored_requests == 1 + len(acked)  # the refused one is not in memory
        ns = runtime.service.namespaces["default"]
        assert ns.spool.held == len(acked)
        ns.spool.check_invariants()

        restart_same_port(redis_server)
        wait_for(lambda: not ns.spool.holding)
        log = logged(redis_server.url)
        assert sorted(log) == sorted(["r0"] + acked) and refused not in log
    finally:
        channel.close()
        runtime.stop(grace=0)


class LosingReplies(RedisPersistence):
    """A real Redis client whose next ``lose`` appends reach Redis but whose replies are lost on the way back."""

    lose = 0

    def append_requests(self, *args, **kwargs):
        ids = super().append_requests(*args, **kwargs)
        if self.lose:
            self.lose -= 1
            raise PersistenceUnavailable("Redis failed to append requests: Connection reset by peer")
        return ids


def test_lost_replies_of_appends_and_drains_store_nothing_twice(redis_server, tmp_path):
    p = LosingReplies(redis_server.url, "default", vocab_size=VOCAB)
    ns = Namespace.create("default", DrafterConfig(capacity=1 << 16), VOCAB, p)
    ns.spool = SpoolingLog(ns.log, tmp_path, 1 << 20)
    seq = lambda *rids: [(REQS[r][0], REQS[r][1], r) for r in rids]  # noqa: E731
    p.lose = 1
    assert ns.ingest(seq("r0", "r1")) == (2, 96, 0)  # the reply was lost: held in the spool as well
    assert ns.spool.held == 2 and len(logged(redis_server.url)) == 2
    assert ns.ingest(seq("r2")) == (1, 48, 0)  # behind them, in order
    p.lose = 1
    with pytest.raises(PersistenceUnavailable):  # the drain's batch reached Redis, its reply did not
        ns.spool.drain()
    assert ns.spool.held == 3
    assert ns.spool.drain() == 3 and not ns.spool.holding
    log = logged(redis_server.url)
    assert {rid: len(v) for rid, v in log.items()} == {"r0": 1, "r1": 1, "r2": 1}
    assert ns.drafter.store.stats()["documents"] == 3
    ns.spool.check_invariants()
    ns.spool.close()
    assert p.writer_mark(ns.spool.writer_id) == 0  # forgotten once nothing can be retried


def test_spools_of_stopped_processes_are_adopted_and_others_left_alone(redis_server, tmp_path):
    p = RedisPersistence(redis_server.url, "default", vocab_size=VOCAB)
    folder = tmp_path / "default"

    def spool_with(name, store_id, rids, first=1):
        s = Spool.create(folder / name, new_id(), store_id)
        s.append([SpoolRecord(first + i, np.array(REQS[r][0] + REQS[r][1], dtype=np.int32), 8, r, False)
                  for i, r in enumerate(rids)])
        return s

    dead = spool_with("1-dead.spool", p.store_id(), ["r0", "r1"])
    p.append_requests([(np.array(REQS["r0"][0] + REQS["r0"][1]), "r0")], [8], writer=(dead.writer_id, 1))
    dead.close()  # its process died after r0 reached Redis, before the spool was emptied
    alive = spool_with("2-alive.spool", p.store_id(), ["r2"])  # held by a live process
    spool_with("3-foreign.spool", new_id(), ["r3"]).close()  # made for another Redis data set
    runtime = start(redis_server.url, tmp_path)
    try:
        log = logged(redis_server.url)
        assert {rid: len(v) for rid, v in log.items()} == {"r0": 1, "r1": 1}
        assert runtime.service.namespaces["default"].stats().stored_requests == 2
        assert sorted(f.name for f in folder.iterdir()) == ["2-alive.spool", "3-foreign.spool"]
        assert p.writer_mark(dead.writer_id) == 0
    finally:
        alive.close()
        runtime.stop(grace=0)


def test_spool_settings_are_validated_and_read_from_flags_and_environment(monkeypatch, tmp_path):
    for bad in (-1, 100):
        with pytest.raises(ValueError, match="spool_max_bytes"):
            ServiceConfig(spool_max_bytes=bad)
    with pytest.raises(ValueError, match="spool_drain_interval_s"):
        ServiceConfig(spool_drain_interval_s=0)
    monkeypatch.setenv("DRAFTER_SPOOL_MAX_BYTES", "8192")
    parser = argparse.ArgumentParser()
    add_serve_commands(parser.add_subparsers())
    cfg = config_from_args(parser.parse_args(["serve", "--data-dir", str(tmp_path), "--spool-drain-interval", "0.5"]))
    assert (cfg.spool_max_bytes, cfg.spool_drain_interval_s, cfg.spool_dir) == (8192, 0.5, "")
    assert spool_folder(cfg) == tmp_path / "spool"
    cfg = config_from_args(parser.parse_args(["serve", "--spool-dir", str(tmp_path / "s"), "--spool-max-bytes", "0"]))
    assert spool_folder(cfg) == tmp_path / "s" and cfg.spool_max_bytes == 0

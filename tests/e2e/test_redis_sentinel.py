"""Redis Sentinel under a running service: the primary SIGKILLed during load, its replica promoted, nothing lost.

A primary, one replica and three sentinels run as real ``valkey-server`` processes; the service is given
``--redis-url redis+sentinel://...`` and ``--redis-replica-acks 1`` on its command line.
"""

from __future__ import annotations

import argparse
import threading
import time

import grpc
import numpy as np
import pytest
from redis_topologies import SentinelSet, wait_until

from drafter_service.api.drafter.v1 import drafter_pb2 as pb
from drafter_service.api.drafter.v1 import drafter_pb2_grpc as pb_grpc
from drafter_service.cli.serve import add_serve_commands, config_from_args
from drafter_service.runtime.runtime import Runtime
from drafter_service.service.config import ServiceConfig
from store.persistence import RedisPersistence

VOCAB = 1000
CALL_TIMEOUT_S = 10  # an append caught by the kill falls back to the spool within --redis-write-timeout (1 s)


def serve(argv: list[str]) -> Runtime:
    """The service `drafter serve ARGV` would run, in this process."""
    parser = argparse.ArgumentParser()
    add_serve_commands(parser.add_subparsers())
    return Runtime(config_from_args(parser.parse_args(["serve", *argv]))).start()


class Load:
    """One thread storing unique requests (Ingest calls and sessions ended with EndSession, in turn), one drafting
    on sessions opened over the last stored request and ended after three drafts; every call is counted, every
    acknowledged request kept."""

    def __init__(self, address: str) -> None:
        self.channel = grpc.insecure_channel(address)
        self.stub = pb_grpc.DrafterStub(self.channel)
        self.rng = np.random.default_rng(11)
        self.acked: dict[str, tuple[list[int], int]] = {}  # request id -> (prompt + output, prompt length)
        self.last: tuple[list[int], int] | None = None
        self.store_failures: list[str] = []
        self.drafts: list[float] = []  # when each Draft call returned
        self.draft_failures: list[str] = []
        self.stop = threading.Event()
        self.threads = [threading.Thread(target=self._store, daemon=True),
                        threading.Thread(target=self._draft, daemon=True)]
        for thread in self.threads:
            thread.start()

    def _store(self) -> None:
        i = 0
        while not self.stop.is_set():
            prompt, output = self.rng.integers(0, VOCAB, 8).tolist(), self.rng.integers(0, VOCAB, 40).tolist()
            rid = f"r{i}"
            try:
                if i % 2:
                    self.stub.Ingest(pb.IngestRequest(requests=[pb.Sequence(prompt=prompt, output=output,
                                                                            request_id=rid)]), timeout=CALL_TIMEOUT_S)
                else:
                    self.stub.StartSession(pb.StartSessionRequest(session_id=rid, prompt=prompt), timeout=5)
                    self.stub.Draft(pb.DraftRequest(session_id=rid, accepted=output[:3], max_nodes=8), timeout=5)
                    self.stub.EndSession(pb.EndSessionRequest(session_id=rid, accepted=output[3:]),
                                         timeout=CALL_TIMEOUT_S)
            except grpc.RpcError as exc:
                self.store_failures.append(f"{rid}: {exc.code()} {exc.details()}")
            else:
                self.acked[rid] = self.last = (prompt + output, len(prompt))
            i += 1
            time.sleep(0.01)

    def _draft(self) -> None:
        j = 0
        while not self.stop.is_set():
            if self.last is not None:
                doc, plen = self.last
                sid = f"d{j}"
                try:
                    self.stub.StartSession(pb.StartSessionRequest(session_id=sid, prompt=doc[:plen + 4]), timeout=5)
                    for _ in range(3):
                        self.stub.Draft(pb.DraftRequest(session_id=sid, max_nodes=16), timeout=5)
                        self.drafts.append(time.monotonic())
                except grpc.RpcError as exc:
                    self.draft_failures.append(f"{sid}: {exc.code()} {exc.details()}")
                else:
                    try:  # the session is stored too: the prompt it was opened with
                        self.stub.EndSession(pb.EndSessionRequest(session_id=sid), timeout=CALL_TIMEOUT_S)
                    except grpc.RpcError as exc:
                        self.store_failures.append(f"{sid}: {exc.code()} {exc.details()}")
                    else:
                        self.acked[sid] = (doc[:plen + 4], plen + 4)
                j += 1
            time.sleep(0.01)

    def drafts_between(self, start: float, end: float) -> int:
        return sum(start <= t <= end for t in list(self.drafts))

    def close(self) -> None:
        self.stop.set()
        for thread in self.threads:
            thread.join(CALL_TIMEOUT_S + 5)
        self.channel.close()


def root_tokens(address: str, session_id: str, context: list[int]) -> set[int]:
    """The tokens a fresh session over ``context`` is offered first."""
    with grpc.insecure_channel(address) as channel:
        stub = pb_grpc.DrafterStub(channel)
        stub.StartSession(pb.StartSessionRequest(session_id=session_id, prompt=context))
        reply = stub.Draft(pb.DraftRequest(session_id=session_id, max_nodes=16))
    return {t for t, p in zip(reply.token_ids, reply.parents, strict=True) if p == -1}


@pytest.mark.timeout(180)
def test_a_sigkilled_primary_fails_over_under_load_and_every_acknowledged_request_is_stored_once(sentinels,
                                                                                                  tmp_path):
    old = sentinels.primary
    runtime = serve(["--redis-url", sentinels.url, "--redis-replica-acks", "1", "--address", "127.0.0.1:0",
                     "--http-address", "", "--vocab-size", str(VOCAB), "--capacity", str(1 << 18),
                     "--rebuild-in-subprocess", "0", "--rebuild-interval", "0.2", "--snapshot-interval", "3600",
                     "--metrics-interval", "3600", "--data-dir", str(tmp_path / "data"),
                     "--spool-dir", str(tmp_path / "spool"),
                     "--spool-drain-interval", "0.1", "--workers", "8"])
    address = f"127.0.0.1:{runtime.port}"
    try:
        assert runtime.config.redis_replica_acks == 1
        ns = runtime.service.namespaces["default"]
        persistence, spool = ns.persistence, ns.spool
        assert persistence is not None and spool is not None
        load = Load(address)
        try:
            wait_until(lambda: len(load.acked) >= 30, 30, "requests stored before the kill")
            assert persistence.info()["server"] == f"{old.host}:{old.port}"

            killed = time.monotonic()
            old.kill()
            wait_until(lambda: sentinels.master_address()[1] != old.port, 30, "the sentinels to promote the replica")
            promoted = sentinels.replica
            assert promoted is not None and sentinels.master_address() == (promoted.host, promoted.port)
            wait_until(lambda: spool.held > 0, 30, "requests held in the spool")  # the new primary has no replica
            acked_at_failover = len(load.acked)
            time.sleep(1.0)
            assert len(load.acked) > acked_at_failover  # acknowledged all along, through the spool

            # The old primary comes back with its data as a replica of the new one (as an operator, or its
            # supervisor, restarts it); from then on appends are confirmed by a replica again.
            sentinels.primary = promoted
            sentinels.replica = SentinelSet.replica_of(promoted, old.data_dir, port=old.port)
            wait_until(lambda: spool.held == 0 and ns.persistence_ok(), 30, "the spool to drain into the new primary")
            recovered = time.monotonic()
            acked_at_recovery = len(load.acked)
            wait_until(lambda: len(load.acked) > acked_at_recovery + 20, 30, "requests stored after the recovery")
        finally:
            load.close()
        assert load.store_failures == [] and load.draft_failures == []
        assert load.drafts_between(killed, recovered) > 10  # drafts were served while Redis failed over
        wait_until(lambda: spool.held == 0, 30, "the last requests out of the spool")
        assert persistence.info()["server"] == f"{promoted.host}:{promoted.port}" and ns.persistence_ok()

        new_primary = RedisPersistence(f"redis://{promoted.host}:{promoted.port}/0", "default", durable=False)
        stored: dict[str, list[tuple[list[int], int | None]]] = {}
        for rec in new_primary.iter_request_records():
            stored.setdefault(str(rec.request_id), []).append((rec.tokens.tolist(), rec.prompt_len))
        assert len(load.acked) > 100
        assert stored == {rid: [doc] for rid, doc in load.acked.items()}  # each one exactly once, byte for byte

        ingested = sorted((r for r in load.acked if r.startswith("r") and int(r[1:]) % 2), key=lambda r: int(r[1:]))
        doc, plen = load.acked[ingested[len(ingested) // 2]]  # an Ingest call's request, from the middle of the run
        assert doc[plen + 4] in root_tokens(address, "after", doc[:plen + 4])
    finally:
        runtime.stop(grace=0)


def test_replica_acks_need_an_external_redis_and_a_sentinel_url_is_checked_at_start():
    with pytest.raises(ValueError, match="redis_url"):
        ServiceConfig(redis_replica_acks=1)
    with pytest.raises(ValueError, match="at least 0"):
        ServiceConfig(redis_url="redis://h:1/0", redis_replica_acks=-1)
    with pytest.raises(ValueError, match="names the master"):
        ServiceConfig(redis_url="redis+sentinel://h:26379")
    assert ServiceConfig(redis_url="redis+sentinel://a:1,b:2/m", redis_replica_acks=1).following

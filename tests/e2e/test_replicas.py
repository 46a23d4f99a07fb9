"""Several replicas on one Redis: requests, sessions and frozen tables written on one show up in the others."""

import json
import os
import signal
import subprocess
import tempfile
import threading
import time
from pathlib import Path

import grpc
import numpy as np
import pytest

from drafter_service.api.drafter.v1 import drafter_pb2 as pb
from drafter_service.api.drafter.v1 import drafter_pb2_grpc as pb_grpc
from drafter_service.core.config import DrafterConfig
from drafter_service.namespaces.log_follower import LogFollower
from drafter_service.runtime.runtime import Runtime
from drafter_service.service.config import ServiceConfig
from drafter_service.web.metrics import exposition, metrics_registry
from engine_client.admin import put_frozen_table, remove_frozen_table
from store.embedded_redis import EmbeddedRedis
from store.frozen_table import FrozenNGramTable
from tests.e2e.test_process import DRAFTER, free_port, wait_serving

VOCAB = 1000
DELAY_S = 2.0  # the bound asserted on propagation between replicas


# -- helpers --------------------------------------------------------------------------------------------


_FOLDERS: list[Path] = []
"""The running test's temporary folder (``replica_folders``), under which each replica gets its data folder."""


@pytest.fixture(autouse=True)
def replica_folders(tmp_path: Path):
    """Replicas' data folders go under the test's ``tmp_path``, which pytest cleans up."""
    _FOLDERS[:] = [tmp_path]
    yield
    _FOLDERS.clear()


def start_runtime(redis_url: str, **overrides) -> Runtime:
    """A replica in this process, with a data folder of its own (as on a machine of its own)."""
    overrides.setdefault("data_dir", tempfile.mkdtemp(prefix="replica-", dir=_FOLDERS[0]))
    cfg = ServiceConfig(address="127.0.0.1:0", redis_url=redis_url, http_address="", default_vocab_size=VOCAB,
                        drafter=DrafterConfig(capacity=1 << 18), rebuild_in_subprocess=False,
                        rebuild_interval_s=3600, snapshot_interval_s=3600, metrics_interval_s=3600,
                        **overrides)
    return Runtime(cfg).start()


def has_chain(reply, tokens) -> bool:
    """Whether the draft holds ``tokens`` as a path from the root."""
    parent = -1
    for token in tokens:
        nxt = [i for i, (t, p) in enumerate(zip(reply.token_ids, reply.parents, strict=True))
               if t == token and p == parent]
        if not nxt:
            return False
        parent = nxt[0]
    return True


def seconds_until_drafted(stub, session_id, continuation, timeout=DELAY_S + 3.0) -> float:
    """Poll Draft on an open session until its tree holds ``continuation``; seconds it took (inf: never)."""
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < timeout:
        if has_chain(stub.Draft(pb.DraftRequest(session_id=session_id, max_nodes=16), timeout=5), continuation):
            return time.perf_counter() - t0
        time.sleep(0.002)
    return float("inf")


def request(rng, n_prompt=6, n_output=12):
    """A request whose prompt and output are random tokens (no other request shares its 6-token prompt)."""
    return rng.integers(0, VOCAB, n_prompt).tolist(), rng.integers(0, VOCAB, n_output).tolist()


def ring_contents(runtime: Runtime) -> np.ndarray:
    ring = runtime.service.namespaces["default"].drafter.store.ring
    return ring.read(ring.oldest, ring.end)


def wait_for(predicate, timeout=10.0, what="condition"):
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.01)


# -- in-process replicas --------------------------------------------------------------------------------


def test_concurrent_writers_on_two_replicas_leave_identical_buffers_in_log_order(redis_server):
    a = start_runtime(redis_server.url, follow_log="on", replica_id="a")
    b = start_runtime(redis_server.url, follow_log="on", replica_id="b")
    try:
        rng = np.random.default_rng(1)
        batches = [[request(rng, 4, int(rng.integers(1, 30))) for _ in range(int(rng.integers(1, 4)))]
                   for _ in range(240)]
        errors = []

        def write(runtime, part):
            try:
                for batch in part:
                    runtime.service.ingest("default", [(p, o, "") for p, o in batch], skip_duplicates=True)
            except Exception as exc:  # reported below
                errors.append(exc)

        threads = [threading.Thread(target=write, args=(rt, batches[i::4]))
                   for i, rt in enumerate((a, b, a, b))]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert not errors
        total = sum(len(batch) for batch in batches)
        last = a.service.namespaces["default"].persistence.last_id()
        for rt in (a, b):
            wait_for(lambda rt=rt: rt.service.namespaces["default"].log.position == last, what="the follower")
        assert ring_contents(a).tolist() == ring_contents(b).tolist()  # same requests, same (log) order
        logged = [rec.tokens.tolist() for rec in a.service.namespaces["default"].persistence.iter_request_records()]
        assert len(logged) == total
        assert ring_contents(a).tolist() == [t for doc in logged for t in (*doc, -1)]
        for rt in (a, b):
            ns = rt.service.namespaces["default"]
            assert ns.stats().stored_requests == total
            ns.drafter.check_invariants()
        # each replica applied exactly the other's requests
        assert a.followers[0].applied + b.followers[0].applied == total
    finally:
        a.stop(grace=0)
        b.stop(grace=0)


def test_an_own_append_whose_predecessors_cannot_be_read_is_stored_once(redis_server, monkeypatch):
    a = start_runtime(redis_server.url, follow_log="on")
    b = start_runtime(redis_server.url, follow_log="on")
    try:
        a.followers[0].stop()
        ns = a.service.namespaces["default"]
        follower = LogFollower(ns.log).attach()  # its steps are taken by hand below
        rng = np.random.default_rng(2)
        (p1, o1), (p2, o2) = request(rng), request(rng)
        b.service.ingest("default", [(p1, o1, "")])  # logged first, not yet in a
        calls = []

        def unreachable(*args):
            calls.append(args)
            raise ConnectionError("Redis went away")

        monkeypatch.setattr(ns.persistence, "read_requests_range", unreachable)
        a.service.ingest("default", [(p2, o2, "")])  # stored at once, ahead of b's
        monkeypatch.undo()
        assert calls and ns.stats().stored_requests == 1
        assert follower.poll() == 1  # b's request; a's own is passed, not stored again
        assert ns.stats().stored_requests == 2
        assert ns.log.position == ns.persistence.last_id()
        assert not follower._own
        ns.drafter.check_invariants()
    finally:
        a.stop(grace=0)
        b.stop(grace=0)


def test_an_own_append_while_the_follower_checks_the_log_end_is_not_taken_for_lost_data(redis_server,
                                                                                      monkeypatch):
    a = start_runtime(redis_server.url, follow_log="on")
    try:
        a.followers[0].stop()
        ns = a.service.namespaces["default"]
        follower = LogFollower(ns.log).attach()
        rng = np.random.default_rng(4)
        a.service.ingest("default", [(*request(rng), "")])
        real_last_id = ns.persistence.last_id
        late = request(rng)

        def an_append_lands_meanwhile() -> str:  # the log's end, read just before another thread's own append
            end = real_last_id()
            writer = threading.Thread(target=a.service.ingest, args=("default", [(*late, "")]))
            writer.start()
            writer.join(1.0)  # done at once, unless the check holds the write lock
            return end

        monkeypatch.setattr(ns.persistence, "last_id", an_append_lands_meanwhile)
        follower._last_reset_check = time.monotonic() - 60  # the idle check is due
        assert follower.poll() == 0
        monkeypatch.undo()
        wait_for(lambda: ns.stats().stored_requests == 2, what="the second request stored")
        assert ns.log.position == ns.persistence.last_id()  # not moved back behind its own append
        assert follower.poll() == 0  # nor stored again
        assert ns.stats().stored_requests == 2 == ns.persistence.request_count()
        ns.drafter.check_invariants()
    finally:
        a.stop(grace=0)


def test_a_follower_behind_a_trimmed_log_skips_the_gap_and_keeps_the_newest(redis_server):
    a = start_runtime(redis_server.url, follow_log="on")
    b = start_runtime(redis_server.url, follow_log="on")
    try:
        a.followers[0].stop()
        follower = LogFollower(a.service.namespaces["default"].log).attach()
        rng = np.random.default_rng(3)
        reqs = [request(rng) for _ in range(50)]
        b.service.ingest("default", [(p, o, "") for p, o in reqs])
        p = b.service.namespaces["default"].persistence
        assert p.trim_requests(10 * 19) == 40  # 18 tokens + a separator each: the newest 10 stay
        assert follower.poll() == 10
        assert follower.skipped_slots == 40 * 19
        ns = a.service.namespaces["default"]
        assert ns.log.position == p.last_id()
        assert ring_contents(a).tolist() == [t for q, o in reqs[40:] for t in (*q, *o, -1)]
        ns.drafter.check_invariants()
    finally:
        a.stop(grace=0)
        b.stop(grace=0)


def test_snapshots_from_several_replicas_restore_and_a_replica_without_following_stays_alone(redis_server):
    a = start_runtime(redis_server.url, follow_log="on")
    alone = start_runtime(redis_server.url, follow_log="off")
    try:
        assert a.followers and not alone.followers
        rng = np.random.default_rng(4)
        alone.service.ingest("default", [(p, o, "") for p, o in (request(rng) for _ in range(5))])
        a.service.ingest("default", [(p, o, "") for p, o in (request(rng) for _ in range(5))])
        wait_for(lambda: a.service.stats("default").stored_requests == 10, what="a to follow")
        assert alone.service.stats("default").stored_requests == 5  # not following: only its own
        a.service.snapshot()  # last writer wins: both are valid snapshots of the shared log
        header = a.service.namespaces["default"].persistence.table_info()
        assert header["last_request_id"] == a.service.namespaces["default"].log.position
    finally:
        a.stop(grace=0)
        alone.stop(grace=0)
    c = start_runtime(redis_server.url)  # an external Redis: following is on by default
    try:
        assert c.followers and c.service.stats("default").stored_requests == 10
        c.service.namespaces["default"].drafter.check_invariants()
    finally:
        c.stop(grace=0)


def test_frozen_tables_put_replaced_and_removed_on_one_replica_follow_on_the_other(redis_server):
    a = start_runtime(redis_server.url, follow_log="on")
    b = start_runtime(redis_server.url, follow_log="on")
    channel = grpc.insecure_channel(f"127.0.0.1:{b.port}")
    try:
        stub = pb_grpc.DrafterStub(channel)
        stub.StartSession(pb.StartSessionRequest(session_id="s", prompt=[900]))
        table = FrozenNGramTable(1, 3, {(900,): [((901, 902, 903), 5)]})
        put_frozen_table(f"127.0.0.1:{a.port}", "chat", table, source="one")
        assert seconds_until_drafted(stub, "s", [901, 902, 903]) < DELAY_S
        assert b.service.list_frozen("default")[0]["source"] == "one"
        put_frozen_table(f"127.0.0.1:{a.port}", "chat", FrozenNGramTable(1, 3, {(900,): [((950, 951, 952), 5)]}),
                         source="two")
        assert seconds_until_drafted(stub, "s", [950, 951, 952]) < DELAY_S
        assert remove_frozen_table(f"127.0.0.1:{a.port}", "chat")
        wait_for(lambda: not b.service.list_frozen("default"), timeout=DELAY_S, what="the removal")
        assert not has_chain(stub.Draft(pb.DraftRequest(session_id="s", max_nodes=16)), [950])
    finally:
        channel.close()
        a.stop(grace=0)
        b.stop(grace=0)


def test_metrics_name_the_replica_and_count_what_it_followed(redis_server):
    a = start_runtime(redis_server.url, follow_log="on", replica_id="replica-a")
    b = start_runtime(redis_server.url, follow_log="on", replica_id="replica-b")
    try:
        rng = np.random.default_rng(7)
        b.service.ingest("default", [(p, o, "") for p, o in (request(rng) for _ in range(3))])
        wait_for(lambda: a.followers[0].applied == 3, what="a to follow")
        text = exposition(metrics_registry(a.service)).decode()
        assert 'drafter_replica_info{replica="replica-a"} 1.0' in text
        assert 'drafter_follower_applied_requests_total{namespace="default"} 3.0' in text
        assert 'drafter_follower_connected{namespace="default"} 1.0' in text
        assert a.rollup.roll()[0]["replica"] == "replica-a"
    finally:
        a.stop(grace=0)
        b.stop(grace=0)


def test_the_replicas_bench_reports_every_delivery(tmp_path):
    out = tmp_path / "replicas.json"
    done = subprocess.run([DRAFTER, "bench", "replicas", "--replicas", "2", "--ingests", "6", "--json", str(out)],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    figures = json.loads(out.read_text())
    assert figures["deliveries"] == 6 and figures["missing"] == 0 and figures["stored_requests"] == [6, 6]
    assert 0 < figures["from_send_p50_ms"] < 1e3 * DELAY_S
    assert "propagation delay" in done.stdout


def test_follow_log_and_replica_id_are_validated():
    assert ServiceConfig(redis_url="redis://x:1/0").following
    assert not ServiceConfig().following and ServiceConfig(follow_log="on").following
    assert not ServiceConfig(redis_url="redis://x:1/0", follow_log="off").following
    with pytest.raises(ValueError, match="follow_log"):
        ServiceConfig(follow_log="yes")
    with pytest.raises(ValueError, match="replica_id"):
        ServiceConfig(replica_id="two words")


# -- replicas as processes --------------------------------------------------------------------------------


class Replica:
    """A `drafter serve` process on a free port with ``--redis-url``."""

    def __init__(self, redis_url: str, name: str, data_dir: Path) -> None:
        self.port = free_port()
        self.address = f"127.0.0.1:{self.port}"
        env = {**os.environ, "DRAFTER_VOCAB_SIZE": str(VOCAB), "DRAFTER_CAPACITY": "200000"}
        self.proc = subprocess.Popen([DRAFTER, "serve", "--redis-url", redis_url, "--address", self.address,
                                      "--data-dir", str(data_dir), "--http-address", "", "--replica-id", name,
                                      "--snapshot-interval", "3600"],
                                     env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        self.channel = grpc.insecure_channel(self.address)
        self.stub = pb_grpc.DrafterStub(self.channel)

    def ready(self) -> "Replica":
        wait_serving(self.address)
        return self

    def stop(self) -> str:
        self.channel.close()
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        out, _ = self.proc.communicate(timeout=30)
        return out


@pytest.fixture
def replicas(redis_server, tmp_path):
    started: list[Replica] = []

    def launch(n: int) -> list[Replica]:
        names = [f"r{len(started) + i}" for i in range(n)]
        new = [Replica(redis_server.url, name, tmp_path / name) for name in names]
        started.extend(new)
        return [r.ready() for r in new]

    yield launch
    for r in started:
        r.stop()


def test_ingests_sessions_and_tables_acknowledged_by_one_replica_reach_the_others(replicas):
    a, b, c = replicas(3)
    rng = np.random.default_rng(5)
    delays = []
    for i in range(6):
        writer = (a, b, c)[i % 3]
        readers = [r for r in (a, b, c) if r is not writer]
        prompt, output = request(rng)
        for r in readers:
            r.stub.StartSession(pb.StartSessionRequest(session_id=f"in{i}", prompt=prompt))
            assert not has_chain(r.stub.Draft(pb.DraftRequest(session_id=f"in{i}", max_nodes=16)), output[:3])
        writer.stub.Ingest(pb.IngestRequest(requests=[pb.Sequence(prompt=prompt, output=output)]))
        delays += [seconds_until_drafted(r.stub, f"in{i}", output[:3]) for r in readers]
    # a session ended on b: its whole request reaches a and c
    prompt, output = request(rng)
    for r in (a, c):
        r.stub.StartSession(pb.StartSessionRequest(session_id="ended", prompt=prompt))
    b.stub.StartSession(pb.StartSessionRequest(session_id="mine", prompt=prompt))
    b.stub.EndSession(pb.EndSessionRequest(session_id="mine", accepted=output))
    delays += [seconds_until_drafted(r.stub, "ended", output[:3]) for r in (a, c)]
    assert max(delays) < DELAY_S, delays
    counts = [r.stub.GetStats(pb.GetStatsRequest()).stored_requests for r in (a, b, c)]
    assert counts == [7, 7, 7]
    # a frozen table put on a is used by b and c
    table = FrozenNGramTable(1, 3, {(990,): [((991, 992, 993), 9)]})
    for r in (b, c):
        r.stub.StartSession(pb.StartSessionRequest(session_id="frozen", prompt=[990]))
    put_frozen_table(a.address, "shared", table)
    assert max(seconds_until_drafted(r.stub, "frozen", [991, 992, 993]) for r in (b, c)) < DELAY_S
    print(f"propagation between replica processes: median {1e3 * float(np.median(delays)):.1f} ms, "
          f"max {1e3 * max(delays):.1f} ms over {len(delays)}")


def test_a_late_replica_catches_up_and_replicas_ride_out_a_redis_restart(replicas, redis_server):
    a, b = replicas(2)
    rng = np.random.default_rng(6)
    before = [request(rng) for _ in range(20)]
    a.stub.Ingest(pb.IngestRequest(requests=[pb.Sequence(prompt=p, output=o) for p, o in before]))
    prompt, output = request(rng)
    b.stub.StartSession(pb.StartSessionRequest(session_id="across", prompt=prompt))
    wait_for(lambda: b.stub.GetStats(pb.GetStatsRequest()).stored_requests == 20, what="b to follow")

    port, data_dir = redis_server.port, redis_server.data_dir
    redis_server.kill()  # Redis drops under both replicas
    try:
        reply = b.stub.Draft(pb.DraftRequest(session_id="across", max_nodes=16), timeout=5)  # drafts go on
        assert not has_chain(reply, output[:3])
        try:  # refused (UNAVAILABLE), or acknowledged only when it is kept until Redis is back
            a.stub.Ingest(pb.IngestRequest(requests=[pb.Sequence(prompt=prompt, output=output)]), timeout=30)
            acknowledged = True
        except grpc.RpcError as exc:
            assert exc.code() == grpc.StatusCode.UNAVAILABLE, exc
            acknowledged = False
        time.sleep(1.0)  # the followers are retrying meanwhile
    finally:
        back = EmbeddedRedis(data_dir, port=port).start()
    try:
        deadline = time.monotonic() + 30
        while not acknowledged:  # the first call after the restart may still find a stale connection
            try:
                a.stub.Ingest(pb.IngestRequest(requests=[pb.Sequence(prompt=prompt, output=output)]), timeout=30)
                acknowledged = True
            except grpc.RpcError as exc:
                if exc.code() != grpc.StatusCode.UNAVAILABLE or time.monotonic() > deadline:
                    raise
                time.sleep(0.2)
        assert seconds_until_drafted(b.stub, "across", output[:3], timeout=15) < 15
        (c,) = replicas(1)  # started late: restores the log, then follows it
        c.stub.StartSession(pb.StartSessionRequest(session_id="late", prompt=prompt))
        assert has_chain(c.stub.Draft(pb.DraftRequest(session_id="late", max_nodes=16)), output[:3])
        assert [r.stub.GetStats(pb.GetStatsRequest()).stored_requests for r in (a, b, c)] == [21, 21, 21]
        p2, o2 = request(rng)
        a.stub.StartSession(pb.StartSessionRequest(session_id="to-c", prompt=p2))
        c.stub.Ingest(pb.IngestRequest(requests=[pb.Sequence(prompt=p2, output=o2)]))
        assert seconds_until_drafted(a.stub, "to-c", o2[:3]) < DELAY_S
    finally:
        for r in (a, b):
            r.stop()
        back.stop()

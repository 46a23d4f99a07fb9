"""DrafterClient against a real service: an in-process gRPC server, and `drafter serve` killed and restarted."""

import logging
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import grpc
import numpy as np
import pytest
from serving import free_port, wait_serving

from drafter_service.api.drafter.v1 import drafter_pb2 as pb
from drafter_service.api.drafter.v1 import drafter_pb2_grpc as pb_grpc
from drafter_service.api.tree import EMPTY_TREE, DraftTree, accept_greedy
from drafter_service.core.config import DrafterConfig
from drafter_service.rpc.server import create_server
from drafter_service.service.config import ServiceConfig
from engine_client import DrafterClient, DrafterRequestError, DrafterUnavailable, DraftSource

ROOT = Path(__file__).resolve().parents[2]
VOCAB = 1000
CONFIG = ServiceConfig(drafter=DrafterConfig(capacity=1 << 16, tail_tokens=64), default_vocab_size=VOCAB,
                       max_request_tokens=5000, max_nodes_limit=64)


def serve(port: int = 0):
    server, port = create_server(CONFIG, f"127.0.0.1:{port}")
    return server, f"127.0.0.1:{port}"


@pytest.fixture
def address():
    server, addr = serve()
    yield addr
    server.stop(0)


def raw_stub(addr):
    return pb_grpc.DrafterStub(grpc.insecure_channel(addr))


def corpus(seed=0, n=20, vocab=30):
    rng = np.random.default_rng(seed)
    return [(rng.integers(0, vocab, 12).tolist(), rng.integers(0, vocab, 60).tolist()) for _ in range(n)]


def chain_request(seed=1, n=300):
    seq = np.random.default_rng(seed).permutation(VOCAB)[:n].tolist()  # no repeats: the store drafts a chain
    return seq[:20], seq[20:]


def generate(client, prompt, output, max_nodes=0):
    """A greedy generation loop: the target 'produces' ``output``; returns the trees the engine got."""
    sid = client.start(prompt)
    trees, accepted, pos = [], [], 0
    while pos < len(output):
        tree = client.draft(sid, accepted, max_nodes)
        tree.check_invariants(max_nodes=max_nodes or client._book.max_nodes)
        trees.append(tree)
        n, _ = accept_greedy(tree, output[pos:])
        accepted = output[pos:pos + n + 1]
        pos += len(accepted)
    client.end(sid, accepted)
    return trees


def mirror(stub, sid, prompt, output, max_nodes, factor, min_nodes):
    """What the client must do, by hand on the raw stub: ask for a deeper tree, serve subtrees of the latest one,
    and on a served step ask for the new context's tree (the next step's latest tree).

    Returns:
        (the trees the engine gets, tokens EndSession stored).
    """
    stub.StartSession(pb.StartSessionRequest(session_id=sid, prompt=prompt))
    trees, full, accepted, pos = [], EMPTY_TREE, [], 0
    while pos < len(output):
        kids, node = full.children(), -1
        for t in accepted:
            node = kids.get(node, {}).get(t)
            if node is None:
                break
        r = stub.Draft(pb.DraftRequest(session_id=sid, accepted=accepted, max_nodes=max_nodes * factor))
        fresh = DraftTree(tuple(r.token_ids), tuple(r.parents), tuple(r.probs), sum(r.probs))
        if factor > 1 and accepted and node is not None and node >= 0 and \
                len(full.subtree(node)) >= (min_nodes or max_nodes):
            served = full.subtree(node)  # the engine's draft; the fresh tree is for the next step
        else:
            served = fresh
        full = fresh
        trees.append(served.prefix(max_nodes))
        n, _ = accept_greedy(trees[-1], output[pos:])
        accepted = output[pos:pos + n + 1]
        pos += len(accepted)
    return trees, stub.EndSession(pb.EndSessionRequest(session_id=sid, accepted=accepted)).stored_tokens


def test_every_method_works_and_the_client_is_a_draft_source(address):
    with DrafterClient(address, max_nodes=8) as client:
        assert isinstance(client, DraftSource)
        reqs = corpus()
        assert client.ingest(reqs[:-1]) == 19 and client.ingest([(*reqs[-1], "r19")]) == 1
        before = client.stats()
        assert before["stored_requests"] == 20 and before["vocab_size"] == VOCAB
        prompt, output = reqs[3]
        trees = generate(client, prompt, output, max_nodes=8)
        assert len(trees) < len(output) and any(len(t) for t in trees)
        after = client.stats()
        assert after["stored_tokens"] - before["stored_tokens"] == len(prompt) + len(output) + 1
        local = client.stats_local()
        # every step asked the service for a tree: waited for (fetched) or for the next step (served from an earlier
        # tree, its new context's tree fetched meanwhile)
        assert after["active_sessions"] == 0 and after["drafts"] == local.fetched_steps + local.reused_steps
        assert local.steps == len(trees) == local.fetched_steps + local.reused_steps and local.empty_steps == 0
        assert local.as_dict()["reuse_share"] == local.reuse_share


@pytest.mark.parametrize("factor, min_nodes", [(1, 0), (4, 1), (4, 0)])
def test_drafts_equal_the_raw_stubs_for_the_same_calls(factor, min_nodes):
    """Two identical services: the client drives one, the test does by hand what the client must do on the other."""
    (s1, ours), (s2, theirs) = serve(), serve()
    try:
        reqs = corpus(seed=2)
        for addr in (ours, theirs):
            raw_stub(addr).Ingest(pb.IngestRequest(requests=[pb.Sequence(prompt=p, output=o) for p, o in reqs]))
        for i in (5, 6):
            prompt, output = reqs[i]
            expected, stored = mirror(raw_stub(theirs), f"m{i}", prompt, output, 8, factor, min_nodes)
            assert stored == len(prompt) + len(output)
            with DrafterClient(ours, max_nodes=8, reuse=factor > 1, reuse_factor=factor,
                               min_reuse_nodes=min_nodes) as client:
                trees = generate(client, prompt, output)
                local = client.stats_local()
            assert [(t.token_ids, t.parents) for t in trees] == [(t.token_ids, t.parents) for t in expected]
            for t, e in zip(trees, expected, strict=True):
                assert t.probs == pytest.approx(e.probs, rel=1e-6)
            assert (local.reused_steps > 0) == (factor > 1)
        a, b = raw_stub(ours).GetStats(pb.GetStatsRequest()), raw_stub(theirs).GetStats(pb.GetStatsRequest())
        for key in ("drafts", "reused_steps", "stored_tokens", "drafted_tokens", "confirmed_tokens"):
            assert getattr(a, key) == getattr(b, key), key
    finally:
        s1.stop(0)
        s2.stop(0)


def wait_for(predicate, timeout=5.0):
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "condition not met in time"
        time.sleep(0.01)


def test_served_steps_wait_for_no_round_trip_and_fetch_the_next_tree_meanwhile(address):
    prompt, output = chain_request()
    stub = raw_stub(address)
    stub.Ingest(pb.IngestRequest(requests=[pb.Sequence(prompt=prompt, output=output)] * 2))
    stats = lambda: stub.GetStats(pb.GetStatsRequest())  # noqa: E731
    with DrafterClient(address, max_nodes=4, reuse_factor=4) as client:
        sid = client.start(prompt)
        assert client.draft(sid, []).token_ids == tuple(output[:4])  # the service drafted a 16-node chain
        drafts = stats().drafts
        # 4 draft tokens accepted + the target's token output[4], itself node 4 of the whole chain; each served step
        # asks for the tree of its new context and reads the answer at the next step
        for step, lo in enumerate([5, 10], 1):
            tree = client.draft(sid, output[lo - 5:lo], step_seconds=0.001)
            assert tree.token_ids == tuple(output[lo:lo + 4]) and tree.parents == (-1, 0, 1, 2)
            tree.check_invariants()
            local = client.stats_local()
            assert local.reused_steps == step and local.fetched_steps == 1
            wait_for(lambda step=step: stats().drafts == drafts + step)  # not waited for: it arrives soon
        # 7 tokens on: past the first tree, but inside the one fetched for output[:10]
        tree = client.draft(sid, output[10:17])
        assert tree.token_ids == tuple(output[17:21])
        assert client.stats_local().reused_steps == 3 and client.stats_local().fetched_steps == 1
        assert client.stats_local().mean_reuse_us > 0
        before = stats().stored_tokens
        client.end(sid, output[17:19])  # the service's session holds every token sent with the prefetches
        assert stats().stored_tokens - before == len(prompt) + 19 + 1  # prompt + everything accepted + separator
        assert stats().drafts == drafts + 3 and stats().reused_steps == 0  # no report-only step


def test_callers_mistakes_raise_and_change_nothing(address):
    with pytest.raises(DrafterRequestError, match="nope"):
        DrafterClient(address, namespace="nope")
    with DrafterClient(address, max_nodes=4) as client:
        with pytest.raises(DrafterRequestError, match="1000"):
            client.start([1, 1000])
        sid = client.start([1, 2, 3])
        with pytest.raises(DrafterRequestError) as err:
            client.draft("ghost", [1])
        assert err.value.code == "NOT_FOUND"
        for kwargs in ({"accepted": [-1]}, {"accepted": [VOCAB]}, {"accepted": [4], "max_nodes": -1},
                       {"accepted": [4], "step_seconds": -1.0}):
            with pytest.raises(DrafterRequestError):
                client.draft(sid, **kwargs)
        with pytest.raises(DrafterRequestError) as err:  # only the service knows this limit: refused on the stream
            client.draft(sid, [7] * 5001)
        assert err.value.code == "INVALID_ARGUMENT" and "limit" in str(err.value)
        client.draft(sid, [4])  # the session goes on, on a new stream
        with pytest.raises(DrafterRequestError):
            client.end(sid, [VOCAB + 5])
        before = client.stats()["stored_tokens"]
        client.end(sid, [5])
        assert client.stats()["stored_tokens"] - before == 6  # 1 2 3 4 5 and a separator
        assert client.stats_local().empty_steps == 0 and client.stats_local().steps == 1
        with pytest.raises(DrafterRequestError, match="limit"):
            client.ingest([([1], [2]), ([1] * 5001, [2])])
        assert client.buffered == 0 and client.stats()["stored_tokens"] - before == 6
        client.reset_stats_local()
        assert client.stats_local().steps == 0


def test_a_budget_above_the_services_limit_is_learnt_not_raised(address, caplog):
    raw_stub(address).Ingest(pb.IngestRequest(requests=[pb.Sequence(prompt=p, output=o) for p, o in corpus()]))
    with DrafterClient(address, max_nodes=32, reuse_factor=4) as client, caplog.at_level(logging.WARNING):
        sid = client.start(corpus()[0][0])
        assert len(client.draft(sid, [])) > 0
        assert client._book.limit == 64 and "limits trees to 64" in caplog.text
        assert len(client.draft(sid, [1], max_nodes=100)) <= 64


def test_engine_threads_share_one_client(address):
    reqs = corpus(seed=3, n=12)
    with DrafterClient(address, max_nodes=8) as client:
        client.ingest(reqs[4:])
        results, errors = {}, []

        def run(i):
            try:
                results[i] = generate(client, *reqs[i])
            except Exception as exc:  # pragma: no cover - reported below
                errors.append(exc)
        threads = [threading.Thread(target=run, args=(i,)) for i in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(30)
        assert not errors and len(results) == 4
        stats = client.stats()
        assert stats["stored_requests"] == 12 and stats["active_sessions"] == 0
        assert client.stats_local().steps == sum(len(r) for r in results.values())
        assert stats["drafts"] == client.stats_local().fetched_steps


def test_service_down_then_up_buffers_ended_requests_and_opens_sessions_late(caplog):
    port = free_port()
    addr = f"127.0.0.1:{port}"
    reqs = corpus(seed=4, n=4)
    with caplog.at_level(logging.WARNING), DrafterClient(
            addr, max_nodes=8, connect_timeout=0.2, timeout=0.5, initial_backoff=0.05, max_backoff=0.2,
            max_buffered=2) as client:
        t0 = time.monotonic()
        assert client.ingest([([1, 2], [3])]) == 0 and client.buffered == 1
        for prompt, output in reqs[:3]:
            assert all(len(t) == 0 for t in generate(client, prompt, output))
        assert time.monotonic() - t0 < 2.0
        late = client.start(reqs[3][0])
        client.draft(late, [])
        client.draft(late, reqs[3][1][:1])
        local = client.stats_local()
        assert (local.buffered_requests, local.dropped_requests, client.buffered) == (4, 2, 2)
        server, _ = serve(port)
        try:
            stub = raw_stub(addr)
            # after the backoff, a draft opens the session on the service with every token it has so far
            wait_for(lambda: client.draft(late, []) is not None and
                     stub.GetStats(pb.GetStatsRequest()).active_sessions == 1)
            assert client.buffered == 2  # drafting does not flush: start and end do
            client.end(late, reqs[3][1][1:5])
            stats = client.stats()
            assert stats["stored_requests"] == 3 and client.buffered == 0
            assert stats["stored_tokens"] == sum(len(p) + len(o) + 1 for p, o in reqs[1:3]) + 12 + 5 + 1
        finally:
            server.stop(0)
    warnings = [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert any("dropped" in r.getMessage() for r in warnings)
    assert sum("unavailable" in r.getMessage() for r in warnings) == 1  # one warning per outage
    assert all(r.exc_info is None for r in warnings)
    with pytest.raises(DrafterUnavailable):
        DrafterClient(addr, connect_timeout=0, call_timeout=0.2).stats()


DRAFTER = str(Path(sys.executable).parent / "drafter")


def start_serve(data_dir: Path, port: int, *extra: str) -> subprocess.Popen:
    env = {**os.environ, "DRAFTER_VOCAB_SIZE": str(VOCAB), "DRAFTER_CAPACITY": "200000",
           "DRAFTER_HTTP_ADDRESS": "127.0.0.1:0"}
    proc = subprocess.Popen([DRAFTER, "serve", "--address", f"127.0.0.1:{port}", "--data-dir", str(data_dir),
                             "--snapshot-interval", "3600", *extra],
                            env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    wait_serving(f"127.0.0.1:{port}")
    return proc


def test_sessions_survive_a_killed_and_restarted_service_and_stalls_hit_the_deadline(tmp_path):
    port = free_port()
    addr = f"127.0.0.1:{port}"
    prompt, output = chain_request(seed=5)
    other = corpus(seed=6, n=2)
    proc = start_serve(tmp_path / "data", port)
    try:
        client = DrafterClient(addr, max_nodes=4, reuse_factor=4, timeout=0.3, initial_backoff=0.05,
                               max_backoff=0.3)
        client.ingest([(prompt, output)])
        sid = client.start(prompt)
        assert client.draft(sid, []).token_ids == tuple(output[:4])
        assert len(client.draft(sid, output[:5])) == 4  # reused
        # a stalled service: the draft gives up at the deadline, nothing raises
        proc.send_signal(signal.SIGSTOP)
        try:
            t0 = time.monotonic()
            # past any tree fetched so far (at most 16 nodes from token 5): a round trip that stalls
            assert client.draft(sid, output[5:30]) == EMPTY_TREE
            assert time.monotonic() - t0 < 0.3 + 0.5
        finally:
            proc.send_signal(signal.SIGCONT)
        # killed: drafts come back empty at once and whole requests complete without the service
        proc.send_signal(signal.SIGKILL)
        proc.wait(10)
        t0 = time.monotonic()
        for i in range(30, 40):
            client.draft(sid, [output[i]])
        for p, o in other:
            assert all(len(t) == 0 for t in generate(client, p, o))
        assert time.monotonic() - t0 < 0.3 * 4 + 1.0
        assert client.buffered == 2
        proc = start_serve(tmp_path / "data", port)
        # back: after the backoff the lost session is reopened with every token and drafts resume
        tree = EMPTY_TREE
        deadline = time.monotonic() + 10
        while not len(tree):
            assert time.monotonic() < deadline, "drafts did not resume"
            time.sleep(0.05)
            tree = client.draft(sid, [])
        assert tree.token_ids == tuple(output[40:44]) and client.stats_local().reopened_sessions == 1
        client.end(sid, output[40:45])
        stats = client.stats()
        # restored: the ingested request; then the two buffered ones and the reopened session, all in full
        assert stats["stored_requests"] == 4 and stats["active_sessions"] == 0
        assert stats["stored_tokens"] == (len(prompt) + len(output) + 1) + sum(len(p) + len(o) + 1 for p, o in other) \
            + len(prompt) + 45 + 1
        client.close()
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait(10)


def test_importing_the_clients_does_not_import_torch():
    code = ("import engine_client, engine_client.client, engine_client.async_client, sys; "
            "assert 'torch' not in sys.modules, 'torch imported'")
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT)


def wait_until(condition, seconds: float) -> None:
    deadline = time.monotonic() + seconds
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)


@pytest.mark.parametrize("in_batch", [False, True], ids=["EndSession", "DraftBatch-ends"])
def test_a_request_whose_end_answer_was_lost_is_stored_once(tmp_path, redis_server, in_batch):
    """EndSession (or a DraftBatch's ends) waits on a stopped Redis past the client's deadline and lands after; the
    resend adds nothing."""
    port = free_port()
    prompt, output = chain_request(seed=9)
    twin_prompt, twin_output = chain_request(seed=10)
    proc = start_serve(tmp_path / "data", port, "--redis-url", redis_server.url)
    try:
        client = DrafterClient(f"127.0.0.1:{port}", max_nodes=4, timeout=0.3, call_timeout=0.3,
                               initial_backoff=0.05, max_backoff=0.3)
        stub = raw_stub(f"127.0.0.1:{port}")
        sid = client.start(prompt)
        client.draft(sid, output[:10])
        twin = client.start(twin_prompt)  # ends while the service is away: stored by the resend alone
        os.kill(redis_server.pid, signal.SIGSTOP)
        try:
            if in_batch:  # one call ends both
                client.draft_batch_packed([], ends=[(sid, output[10:]), (twin, twin_output)])
            else:
                client.end(sid, output[10:])  # the service holds it until Redis confirms: the answer comes too late
                client.end(twin, twin_output)
            assert client.buffered == 2
            time.sleep(0.3)
        finally:
            os.kill(redis_server.pid, signal.SIGCONT)
        wait_until(lambda: stub.GetStats(pb.GetStatsRequest()).stored_requests >= 1, 10)  # the late call landed
        wait_until(lambda: (client.flush(), client.buffered)[1] == 0, 10)
        stats = client.stats()
        assert stats["stored_requests"] == 2, "the request whose EndSession landed late was stored twice"
        assert stats["stored_tokens"] == len(prompt) + len(output) + 1 + len(twin_prompt) + len(twin_output) + 1
        assert client.stats_local().flushed_requests == 2
        client.close()
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait(10)

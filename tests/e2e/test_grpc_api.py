"""The gRPC API over a real channel: every RPC, errors and their status codes, namespaces."""

import grpc
import numpy as np
import pytest

from drafter_service.api.drafter.v1 import drafter_pb2 as pb
from drafter_service.api.drafter.v1 import drafter_pb2_grpc as pb_grpc
from drafter_service.api.tree import accept_greedy
from drafter_service.core.config import DrafterConfig
from drafter_service.core.drafter import Drafter
from drafter_service.rpc.server import create_server
from drafter_service.service.config import NamespaceSpec, ServiceConfig

VOCAB = 1000


@pytest.fixture
def running():
    cfg = ServiceConfig(drafter=DrafterConfig(capacity=1 << 16, tail_tokens=64), default_vocab_size=VOCAB,
                        namespaces=(NamespaceSpec("other", 500),), max_request_tokens=5000, max_nodes_limit=64,
                        max_ingest_requests=30)
    server, port = create_server(cfg, "127.0.0.1:0")
    channel = grpc.insecure_channel(f"127.0.0.1:{port}")
    stub = pb_grpc.DrafterStub(channel)
    stub.raw_channel = channel
    yield server, stub, cfg
    channel.close()
    server.stop(0)


def corpus(seed=0, n=20):
    rng = np.random.default_rng(seed)
    return [(rng.integers(0, 30, 12).tolist(), rng.integers(0, 30, 40).tolist()) for _ in range(n)]


def test_every_rpc_and_drafts_equal_the_in_process_core(running):
    server, stub, cfg = running
    reqs = corpus()
    stub.Ingest(pb.IngestRequest(requests=[pb.Sequence(prompt=p, output=o, request_id=f"r{i}")
                                           for i, (p, o) in enumerate(reqs)]))
    local = Drafter(DrafterConfig(capacity=1 << 16, tail_tokens=64, vocab_size=VOCAB))
    for p, o in reqs:
        local.ingest(p, o)
    prompt, output = reqs[3][0], reqs[3][1]
    assert stub.StartSession(pb.StartSessionRequest(session_id="s", prompt=prompt)).namespace == "default"
    local.start("s", prompt)
    pos, steps = 0, 0
    accepted: list[int] = []
    while pos < len(output):
        resp = stub.Draft(pb.DraftRequest(session_id="s", accepted=accepted, max_nodes=16))
        if accepted:
            local.extend("s", accepted)
        tree = local.propose("s", 16)
        assert list(resp.token_ids) == list(tree.token_ids)
        assert list(resp.parents) == list(tree.parents)
        assert list(resp.probs) == pytest.approx(list(tree.probs), rel=1e-6)
        n, _ = accept_greedy(tree, output[pos:])
        accepted = output[pos:pos + n + 1]
        pos += len(accepted)
        steps += 1
    assert steps < len(output)  # the stored copy of this very request is drafted back
    ended = stub.EndSession(pb.EndSessionRequest(session_id="s", accepted=accepted))
    assert ended.stored_tokens == len(prompt) + len(output)
    stats = stub.GetStats(pb.GetStatsRequest())
    assert stats.stored_requests == len(reqs) + 1
    assert stats.stored_tokens == sum(len(p) + len(o) + 1 for p, o in reqs) + len(prompt) + len(output) + 1
    assert stats.drafts == steps and stats.active_sessions == 0


def test_draft_stream_answers_each_request_in_order(running):
    _, stub, _ = running
    stub.Ingest(pb.IngestRequest(requests=[pb.Sequence(prompt=[1, 2, 3], output=[4, 5, 6, 7, 8])]))
    stub.StartSession(pb.StartSessionRequest(session_id="s", prompt=[9, 2, 3]))
    replies = list(stub.DraftStream(iter([pb.DraftRequest(session_id="s"),
                                          pb.DraftRequest(session_id="s", accepted=[4, 5]),
                                          pb.DraftRequest(session_id="s", accepted=[6])])))
    assert [r.token_ids[0] for r in replies] == [4, 6, 7]
    assert [r.confirmed for r in replies] == [0, 2, 1]  # the first draft was 4 5 6 7 8


def test_report_only_records_tokens_and_step_times_without_drafting(running):
    _, stub, _ = running
    stub.Ingest(pb.IngestRequest(requests=[pb.Sequence(prompt=[1, 2, 3], output=[4, 5, 6, 7, 8])]))
    stub.StartSession(pb.StartSessionRequest(session_id="s", prompt=[9, 2, 3]))
    replies = list(stub.DraftStream(iter([
        pb.DraftRequest(session_id="s"),
        pb.DraftRequest(session_id="s", accepted=[4, 5], report_only=True, step_seconds=0.002),
        pb.DraftRequest(session_id="s", accepted=[6], step_seconds=0.004)])))
    assert len(replies[1].token_ids) == 0 and replies[1].confirmed == 2
    assert replies[2].token_ids[0] == 7  # the reported tokens are part of the session
    stats = stub.GetStats(pb.GetStatsRequest())
    assert stats.reused_steps == 1 and stats.reported_steps == 2 and stats.drafts == 2
    assert stats.mean_step_ms == pytest.approx(3.0, rel=1e-4)
    with pytest.raises(grpc.RpcError) as err:
        stub.Draft(pb.DraftRequest(session_id="s", accepted=[8], step_seconds=-1.0))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "step_seconds" in err.value.details()


def store_state(stub, namespace=""):
    s = stub.GetStats(pb.GetStatsRequest(namespace=namespace))
    return s.stored_tokens, s.stored_requests, s.dynamic_leaders, s.active_sessions


@pytest.mark.parametrize("call, code, words", [
    (lambda s: s.Ingest(pb.IngestRequest(requests=[pb.Sequence(prompt=[1], output=[-4])])),
     grpc.StatusCode.INVALID_ARGUMENT, "-4"),
    (lambda s: s.Ingest(pb.IngestRequest(requests=[pb.Sequence(prompt=[1], output=[2]),
                                                   pb.Sequence(prompt=[1000], output=[2])])),
     grpc.StatusCode.INVALID_ARGUMENT, "request 1"),
    (lambda s: s.Ingest(pb.IngestRequest(requests=[])), grpc.StatusCode.INVALID_ARGUMENT, "no requests"),
    (lambda s: s.Ingest(pb.IngestRequest(requests=[pb.Sequence()])), grpc.StatusCode.INVALID_ARGUMENT, "no tokens"),
    (lambda s: s.Ingest(pb.IngestRequest(requests=[pb.Sequence(prompt=[1])] * 31)),
     grpc.StatusCode.INVALID_ARGUMENT, "limit"),
    (lambda s: s.Ingest(pb.IngestRequest(requests=[pb.Sequence(prompt=[1] * 5001)])),
     grpc.StatusCode.INVALID_ARGUMENT, "limit"),
    (lambda s: s.Ingest(pb.IngestRequest(namespace="nope", requests=[pb.Sequence(prompt=[1])])),
     grpc.StatusCode.NOT_FOUND, "nope"),
    (lambda s: s.Ingest(pb.IngestRequest(namespace="bad name!", requests=[pb.Sequence(prompt=[1])])),
     grpc.StatusCode.INVALID_ARGUMENT, "name"),
    (lambda s: s.StartSession(pb.StartSessionRequest(session_id="", prompt=[1])),
     grpc.StatusCode.INVALID_ARGUMENT, "session_id"),
    (lambda s: s.StartSession(pb.StartSessionRequest(session_id="x", prompt=[1], max_nodes=100000)),
     grpc.StatusCode.INVALID_ARGUMENT, "max_nodes"),
    (lambda s: s.StartSession(pb.StartSessionRequest(session_id="x", prompt=[1], max_nodes=-1)),
     grpc.StatusCode.INVALID_ARGUMENT, "max_nodes"),
    (lambda s: s.StartSession(pb.StartSessionRequest(session_id="x", namespace="other", prompt=[600])),
     grpc.StatusCode.INVALID_ARGUMENT, "500"),
    (lambda s: s.Draft(pb.DraftRequest(session_id="ghost")), grpc.StatusCode.NOT_FOUND, "ghost"),
    (lambda s: s.EndSession(pb.EndSessionRequest(session_id="ghost")), grpc.StatusCode.NOT_FOUND, "ghost"),
    (lambda s: s.GetStats(pb.GetStatsRequest(namespace="nope")), grpc.StatusCode.NOT_FOUND, "nope"),
])
def test_bad_input_gets_a_clear_status_and_changes_nothing(running, call, code, words):
    _, stub, _ = running
    stub.Ingest(pb.IngestRequest(requests=[pb.Sequence(prompt=[1, 2], output=[3, 4])]))
    before = store_state(stub), store_state(stub, "other")
    with pytest.raises(grpc.RpcError) as err:
        call(stub)
    assert err.value.code() == code
    assert words in err.value.details()
    assert (store_state(stub), store_state(stub, "other")) == before


def test_session_errors_leave_the_session_as_it_was(running):
    _, stub, _ = running
    stub.StartSession(pb.StartSessionRequest(session_id="s", prompt=[1, 2, 3]))
    with pytest.raises(grpc.RpcError) as err:
        stub.StartSession(pb.StartSessionRequest(session_id="s", prompt=[1]))
    assert err.value.code() == grpc.StatusCode.ALREADY_EXISTS
    with pytest.raises(grpc.RpcError) as err:
        stub.StartSession(pb.StartSessionRequest(session_id="s", namespace="other", prompt=[1]))
    assert err.value.code() == grpc.StatusCode.ALREADY_EXISTS
    for bad in ([5000], [-1]):
        with pytest.raises(grpc.RpcError) as err:
            stub.Draft(pb.DraftRequest(session_id="s", accepted=bad))
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        with pytest.raises(grpc.RpcError) as err:
            stub.EndSession(pb.EndSessionRequest(session_id="s", accepted=bad))
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    with pytest.raises(grpc.RpcError) as err:
        stub.Draft(pb.DraftRequest(session_id="s", max_nodes=65))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert stub.EndSession(pb.EndSessionRequest(session_id="s", accepted=[4])).stored_tokens == 4


def test_garbage_bytes_are_refused_with_invalid_argument(running):
    _, stub, _ = running
    raw = stub.raw_channel
    before = store_state(stub)
    for method in ("Draft", "Ingest", "StartSession"):
        call = raw.unary_unary(f"/drafter.v1.Drafter/{method}")
        with pytest.raises(grpc.RpcError) as err:
            call(b"\xff\xfe garbage \x00\x01")
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "malformed request" in err.value.details()
    stream = raw.stream_stream("/drafter.v1.Drafter/DraftStream")
    with pytest.raises(grpc.RpcError) as err:
        list(stream(iter([b"\xff\xfe"])))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert store_state(stub) == before


def test_two_namespaces_never_see_each_others_tokens(running):
    _, stub, _ = running
    stub.Ingest(pb.IngestRequest(namespace="other", requests=[pb.Sequence(prompt=[1, 2, 3], output=[4, 5, 6, 7])]))
    stub.StartSession(pb.StartSessionRequest(session_id="d", prompt=[1, 2, 3]))
    assert list(stub.Draft(pb.DraftRequest(session_id="d")).token_ids) == []
    stub.StartSession(pb.StartSessionRequest(session_id="o", namespace="other", prompt=[1, 2, 3]))
    assert list(stub.Draft(pb.DraftRequest(session_id="o")).token_ids)[:4] == [4, 5, 6, 7]
    assert stub.GetStats(pb.GetStatsRequest()).stored_tokens == 0

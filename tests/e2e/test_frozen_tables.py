"""Frozen tables over a real gRPC channel with real Redis: put, list, draft, replace, remove, restart, refusals."""

import grpc
import numpy as np
import pytest

from drafter_service.api.drafter.v1 import drafter_pb2 as pb
from drafter_service.api.drafter.v1 import drafter_pb2_grpc as pb_grpc
from drafter_service.api.frozen_wire import frozen_table_chunks
from drafter_service.core.config import DrafterConfig
from drafter_service.runtime.runtime import Runtime
from drafter_service.service.config import NamespaceSpec, ServiceConfig
from engine_client.admin import list_frozen_tables, put_frozen_table, remove_frozen_table
from store.corpus_counts import build_frozen_table
from store.frozen_table import FrozenNGramTable

VOCAB = 1000
LEADER = 900  # a token no request holds: only the frozen table knows what follows it
TABLE = FrozenNGramTable(1, 3, {(LEADER,): [((901, 902, 903), 50), ((904, 905, 906), 10)],
                                (903,): [((907, 908, 909), 40)]})
OTHER = FrozenNGramTable(1, 3, {(LEADER,): [((950, 951, 952), 7)]})


def start(redis_url, data_dir):
    cfg = ServiceConfig(address="127.0.0.1:0", redis_url=redis_url, http_address="", default_vocab_size=VOCAB,
                        data_dir=str(data_dir),
                        namespaces=(NamespaceSpec("small", 100),), drafter=DrafterConfig(capacity=1 << 16),
                        rebuild_in_subprocess=False, rebuild_interval_s=3600, snapshot_interval_s=3600,
                        metrics_interval_s=3600)
    runtime = Runtime(cfg).start()
    return runtime, f"127.0.0.1:{runtime.port}"


@pytest.fixture
def service(redis_server, tmp_path):
    runtime, address = start(redis_server.url, tmp_path / "data")
    channel = grpc.insecure_channel(address)
    yield address, pb_grpc.DrafterStub(channel), runtime
    channel.close()
    runtime.stop(grace=0)


def draft(stub, session_id, prompt=(LEADER,)):
    stub.StartSession(pb.StartSessionRequest(session_id=session_id, prompt=list(prompt)))
    reply = stub.Draft(pb.DraftRequest(session_id=session_id, max_nodes=16))
    stub.EndSession(pb.EndSessionRequest(session_id=session_id))
    return [(t, p, s) for t, p, s in zip(reply.token_ids, reply.parents, reply.sources, strict=False)]


def frozen_path(nodes):
    """Tokens of the frozen nodes that hang from the root in a chain (the first follower's path)."""
    path, parent = [], -1
    for i, (token, p, source) in enumerate(nodes):
        if p == parent and source == pb.SOURCE_FROZEN:
            path.append(token)
            parent = i
    return path


def test_put_list_draft_replace_remove(service):
    address, stub, _ = service
    assert draft(stub, "before") == []
    info = put_frozen_table(address, "chat", TABLE, source="hand-made")
    assert (info["name"], info["leaders"], info["followers"], info["leader_len"], info["follower_len"],
            info["source"]) == ("chat", 2, 3, 1, 3, "hand-made")
    assert [t["name"] for t in list_frozen_tables(address)] == ["chat"]
    assert stub.GetStats(pb.GetStatsRequest()).frozen_tables == ["chat"]
    nodes = draft(stub, "with-table")
    assert {s for _, _, s in nodes} == {pb.SOURCE_FROZEN}
    assert frozen_path(nodes)[:6] == [901, 902, 903, 907, 908, 909]  # re-queried at the end of the follower
    put_frozen_table(address, "chat", OTHER, source="replaced")
    assert frozen_path(draft(stub, "replaced"))[:3] == [950, 951, 952]
    assert [(t["name"], t["source"], t["leaders"]) for t in list_frozen_tables(address)] == [("chat", "replaced", 1)]
    assert remove_frozen_table(address, "chat") is True
    assert draft(stub, "after") == [] and list_frozen_tables(address) == []
    assert remove_frozen_table(address, "chat") is False


def test_a_big_table_in_many_chunks_survives_a_restart(redis_server, tmp_path):
    rng = np.random.default_rng(0)
    table = build_frozen_table([rng.integers(0, VOCAB, 3000) for _ in range(4)], 1, 3, 400, 16)
    assert len(list(frozen_table_chunks(table, "big", chunk_bytes=2000))) > 10
    runtime, address = start(redis_server.url, tmp_path / "first")
    try:
        put_frozen_table(address, "big", table, chunk_bytes=2000)
        put_frozen_table(address, "chat", TABLE)
    finally:
        runtime.stop(grace=0)
    runtime, address = start(redis_server.url, tmp_path / "second")
    try:
        served = runtime.service.namespace("default").drafter.frozen
        assert sorted(served) == ["big", "chat"] and list(served["big"].items()) == list(table.items())
        assert [t["name"] for t in list_frozen_tables(address)] == ["big", "chat"]
        with grpc.insecure_channel(address) as channel:
            assert frozen_path(draft(pb_grpc.DrafterStub(channel), "restored"))[:3] == [901, 902, 903]
    finally:
        runtime.stop(grace=0)


def chunk(**fields):
    base = dict(name="bad", leader_len=1, follower_len=3, leaders=[5], fanout=[1], followers=[1, 2, 3], counts=[4])
    return pb.FrozenTableChunk(**{**base, **fields})


BAD_STREAMS = {
    "bad name": [chunk(name="no spaces")],
    "empty name": [chunk(name="")],
    "wrong follower_len": [chunk(follower_len=2, followers=[1, 2])],
    "wrong leader_len": [chunk(leader_len=2, leaders=[5, 6])],
    "no lengths": [chunk(leader_len=0)],
    "id outside the vocabulary": [chunk(followers=[1, 2, VOCAB])],
    "negative id": [chunk(leaders=[-5])],
    "fanout beyond the followers": [chunk(fanout=[2])],
    "leader ids not whole leaders": [chunk(leaders=[5, 6])],
    "negative count": [chunk(counts=[-1])],
    "namespace on a later chunk": [chunk(), pb.FrozenTableChunk(namespace="default", leaders=[6], fanout=[1],
                                                                followers=[1, 2, 3], counts=[1])],
    "name on a later chunk": [chunk(), pb.FrozenTableChunk(name="bad", leaders=[6], fanout=[1],
                                                           followers=[1, 2, 3], counts=[1])],
    "a leader twice": [chunk(), pb.FrozenTableChunk(leaders=[5], fanout=[1], followers=[1, 2, 3], counts=[1])],
    "no leaders": [chunk(leaders=[], fanout=[], followers=[], counts=[])],
    "empty stream": [],
    "id outside the namespace": [chunk(namespace="small", followers=[1, 2, 100])],
}


def test_bad_uploads_are_refused_and_change_nothing(service):
    address, stub, _ = service
    put_frozen_table(address, "bad", TABLE)
    for case, stream in BAD_STREAMS.items():
        with pytest.raises(grpc.RpcError) as err:
            stub.PutFrozenTable(iter(stream), timeout=10)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT, (case, err.value.details())
        assert [(t["name"], t["leaders"]) for t in list_frozen_tables(address)] == [("bad", 2)], case
        assert frozen_path(draft(stub, case.replace(" ", "-")))[:3] == [901, 902, 903], case
    assert list_frozen_tables(address, "small") == []


def test_unknown_namespaces_and_bad_names(service):
    address, stub, _ = service
    for call in (lambda: put_frozen_table(address, "t", TABLE, namespace="nowhere"),
                 lambda: list_frozen_tables(address, "nowhere"), lambda: remove_frozen_table(address, "t", "nowhere")):
        with pytest.raises(grpc.RpcError) as err:
            call()
        assert err.value.code() == grpc.StatusCode.NOT_FOUND
    with pytest.raises(grpc.RpcError) as err:
        remove_frozen_table(address, "bad/name")
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    small = FrozenNGramTable(1, 3, {(5,): [((6, 7, 8), 1)]})
    assert put_frozen_table(address, "t", small, namespace="small")["leaders"] == 1
    assert [t["name"] for t in list_frozen_tables(address, "small")] == ["t"] and list_frozen_tables(address) == []

"""DraftBatch over a real channel: one call per engine step opens, drafts and ends sessions like single calls."""

from __future__ import annotations

import grpc
import numpy as np
import pytest

from drafter_service.api.drafter.v1 import drafter_pb2 as pb
from drafter_service.api.drafter.v1 import drafter_pb2_grpc as pb_grpc
from drafter_service.api.tree import accept_greedy
from drafter_service.core.config import DrafterConfig
from drafter_service.rpc.server import create_server
from drafter_service.service.config import ServiceConfig
from engine_client.draft_reuse import tree_of, trees_of_batch

VOCAB = 200


def config() -> ServiceConfig:
    return ServiceConfig(drafter=DrafterConfig(capacity=1 << 16, tail_tokens=64), default_vocab_size=VOCAB,
                         max_request_tokens=5000, max_nodes_limit=64, max_sessions=16)


def serve():
    server, port = create_server(config(), "127.0.0.1:0")
    channel = grpc.insecure_channel(f"127.0.0.1:{port}")
    return server, channel, pb_grpc.DrafterStub(channel)


@pytest.fixture
def stub():
    server, channel, stub = serve()
    yield stub
    channel.close()
    server.stop(0)


@pytest.fixture
def two_stubs():
    """Two identical services: one is driven by batches, the other by single calls."""
    made = [serve(), serve()]
    yield made[0][2], made[1][2]
    for server, channel, _ in made:
        channel.close()
        server.stop(0)


def workload(seed: int, n: int) -> list[tuple[list[int], list[int]]]:
    """Requests that repeat each other's phrases, so drafts have something to find."""
    rng = np.random.default_rng(seed)
    phrases = [rng.integers(0, 40, 6).tolist() for _ in range(5)]
    return [([int(t) for t in rng.integers(0, 40, 5)], [int(t) for k in rng.integers(0, 5, 8) for t in phrases[k]])
            for _ in range(n)]


def test_a_batch_step_drafts_exactly_what_single_calls_draft_after_every_steps_tokens(two_stubs):
    batched, single = two_stubs
    history = [pb.Sequence(prompt=p, output=o) for p, o in workload(1, 12)]
    for s in (batched, single):
        s.Ingest(pb.IngestRequest(requests=history))
    requests = workload(2, 8)
    sids = [f"r{i}" for i in range(len(requests))]
    pos = [0] * len(requests)
    pending: list[list[int]] = [[] for _ in requests]
    starts = [pb.StartSessionRequest(session_id=sid, prompt=p) for sid, (p, _) in zip(sids, requests, strict=True)]
    live, rounds, confirmed = list(range(len(requests))), 0, 0
    while live:
        rounds += 1
        finished = [i for i in live if pos[i] >= len(requests[i][1])]
        drafting = [i for i in live if i not in finished]
        steps = [pb.BatchStep(session_id=sids[i], accepted=pending[i]) for i in drafting]
        ends = [pb.EndSessionRequest(session_id=sids[i], accepted=pending[i]) for i in finished]
        reply = batched.DraftBatch(pb.DraftBatchRequest(start=starts, steps=steps, end=ends, max_nodes=16))
        assert not reply.start_errors and not reply.step_errors and not reply.end_errors
        for s in starts:  # the same calls one by one, in the batch's order: starts, steps, ends
            single.StartSession(s)
        trees = trees_of_batch(reply)
        assert len(trees) == len(reply.confirmed) == len(drafting)
        # every step's tokens first, then each session's tree: what the batch does
        recorded = [single.Draft(pb.DraftRequest(session_id=sids[i], accepted=pending[i], report_only=True))
                    for i in drafting]
        for tree, k, i, told in zip(trees, reply.confirmed, drafting, recorded, strict=True):
            alone = single.Draft(pb.DraftRequest(session_id=sids[i], max_nodes=16))
            assert tree == tree_of(alone) and k == told.confirmed
            confirmed += k
        for stored, end in zip(reply.stored_tokens, ends, strict=True):
            assert stored == single.EndSession(end).stored_tokens > 0
        for tree, i in zip(trees, drafting, strict=True):  # the engine keeps what the target agrees with
            n, _ = accept_greedy(tree, requests[i][1][pos[i]:])
            pending[i] = requests[i][1][pos[i]:pos[i] + n + 1]
            pos[i] += len(pending[i])
        starts, live = [], drafting
    a, b = batched.GetStats(pb.GetStatsRequest()), single.GetStats(pb.GetStatsRequest())
    assert (a.stored_requests, a.stored_tokens, a.drafts, a.confirmed_tokens) == \
        (b.stored_requests, b.stored_tokens, b.drafts, b.confirmed_tokens)
    assert a.stored_requests == 20 and a.active_sessions == 0
    assert confirmed > 0 and rounds < sum(len(o) for _, o in requests) / len(requests)  # drafts were accepted


def test_each_item_fails_alone_with_the_code_it_would_get_alone(stub):
    stub.StartSession(pb.StartSessionRequest(session_id="a", prompt=[1, 2, 3]))
    reply = stub.DraftBatch(pb.DraftBatchRequest(
        start=[pb.StartSessionRequest(session_id="a", prompt=[1]),  # in use
               pb.StartSessionRequest(session_id="b", prompt=[1, 2]),
               pb.StartSessionRequest(session_id="c", prompt=[VOCAB])],  # not a token of the namespace
        steps=[pb.BatchStep(session_id="nobody", accepted=[1]),
               pb.BatchStep(session_id="a", accepted=[4, 5]),
               pb.BatchStep(session_id="b", accepted=[-1]),
               pb.BatchStep(session_id="b", accepted=[3])],
        end=[pb.EndSessionRequest(session_id="a", accepted=[6]), pb.EndSessionRequest(session_id="zz")]))
    assert [(e.index, e.code) for e in reply.start_errors] == [
        (0, grpc.StatusCode.ALREADY_EXISTS.value[0]), (2, grpc.StatusCode.INVALID_ARGUMENT.value[0])]
    assert all(e.message for e in [*reply.start_errors, *reply.step_errors, *reply.end_errors])
    assert [(e.index, e.code) for e in reply.step_errors] == [
        (0, grpc.StatusCode.NOT_FOUND.value[0]), (2, grpc.StatusCode.INVALID_ARGUMENT.value[0])]
    assert list(reply.tree_offsets)[:1] == [0] and len(reply.tree_offsets) == 5
    assert [(e.index, e.code) for e in reply.end_errors] == [(1, grpc.StatusCode.NOT_FOUND.value[0])]
    assert list(reply.stored_tokens) == [3 + 2 + 1, 0]  # a: prompt, the step's 4 5, the end's 6
    stats = stub.GetStats(pb.GetStatsRequest())
    assert (stats.active_sessions, stats.stored_requests) == (1, 1)  # b lives on; the refused items did nothing
    assert stub.EndSession(pb.EndSessionRequest(session_id="b")).stored_tokens == 3  # 1 2, then 3: not the -1


def test_a_malformed_batch_is_refused_whole_and_changes_nothing(stub):
    too_many = [pb.StartSessionRequest(session_id=f"s{i}", prompt=[1]) for i in range(17)]
    for request in (pb.DraftBatchRequest(start=too_many),
                    pb.DraftBatchRequest(start=too_many[:1], max_nodes=65),
                    pb.DraftBatchRequest(start=too_many[:1], step_seconds=-1.0)):
        with pytest.raises(grpc.RpcError) as err:
            stub.DraftBatch(request)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert stub.GetStats(pb.GetStatsRequest()).active_sessions == 0


def test_the_stream_answers_each_batch_in_order_like_the_unary_call(two_stubs):
    streamed, unary = two_stubs
    batches = [pb.DraftBatchRequest(start=[pb.StartSessionRequest(session_id=f"s{i}", prompt=[1, 2, 3, 1, 2])
                                           for i in range(3)]),
               pb.DraftBatchRequest(steps=[pb.BatchStep(session_id=f"s{i}", accepted=[3, 1]) for i in range(3)],
                                    max_nodes=8),
               pb.DraftBatchRequest(end=[pb.EndSessionRequest(session_id=f"s{i}", accepted=[2])
                                         for i in range(3)])]
    replies = list(streamed.DraftBatchStream(iter(batches)))
    assert replies == [unary.DraftBatch(b) for b in batches]
    assert [len(t) > 0 for t in trees_of_batch(replies[1])] == [True] * 3  # "3 1" was followed by "2" in the prompt
    assert list(replies[2].stored_tokens) == [8, 8, 8]


def packed(steps: list[tuple[str, list[int], int, bool]]) -> dict:
    """The packed request fields of ``steps`` (session id, accepted, max_nodes, report_only)."""
    return {"packed_sessions": [s for s, *_ in steps],
            "packed_tokens": np.array([t for _, a, _, _ in steps for t in a], "<i4").tobytes(),
            "packed_counts": [len(a) for _, a, _, _ in steps], "packed_max_nodes": [b for *_, b, _ in steps],
            "packed_report_only": [r for *_, r in steps]}


def test_packed_steps_come_after_the_others_and_draft_as_they_would(two_stubs):
    as_messages, as_packed = two_stubs
    for s in (as_messages, as_packed):
        s.DraftBatch(pb.DraftBatchRequest(start=[pb.StartSessionRequest(session_id=f"s{i}", prompt=[1, 2, 3, 1, 2])
                                                 for i in range(4)]))
    steps = [("s0", [3, 1], 8, False), ("s1", [3], 0, False), ("nobody", [1], 0, False), ("s2", [VOCAB], 0, False),
             ("s3", [3, 1], 0, True)]
    want = as_messages.DraftBatch(pb.DraftBatchRequest(
        steps=[pb.BatchStep(session_id=s, accepted=a, max_nodes=b, report_only=r) for s, a, b, r in steps]))
    got = as_packed.DraftBatch(pb.DraftBatchRequest(steps=[pb.BatchStep(session_id=steps[0][0], accepted=steps[0][1],
                                                                        max_nodes=8)], **packed(steps[1:])))
    assert got == want
    assert [e.index for e in got.step_errors] == [2, 3] and len(trees_of_batch(got)[0]) > 0


def test_packed_steps_alone_draft_as_the_same_steps_as_messages(two_stubs):
    """Packed steps alone go through one run without a step object each, unless something in them asks for more:
    the same replies either way."""
    as_messages, as_packed = two_stubs
    for s in (as_messages, as_packed):
        s.DraftBatch(pb.DraftBatchRequest(start=[pb.StartSessionRequest(session_id=f"s{i}", prompt=[1, 2, 3, 1, 2])
                                                 for i in range(4)]))
    batches = [[("s0", [3, 1], 8, False), ("s1", [3], 0, False), ("s2", [1, 2], 0, False), ("s3", [3], 0, True)],
               [("s0", [2], 0, False), ("nobody", [1], 0, False), ("s1", [1, 2], 4, False)],  # an unknown session
               [("s2", [3], 0, False), ("s2", [1], 0, False)],  # one session twice
               [("s3", [1, 2], 99, False)],  # a budget over the limit
               [("s0", [3], 0, False), ("s1", [1], 0, False)]]
    for steps in batches:
        want = as_messages.DraftBatch(pb.DraftBatchRequest(
            steps=[pb.BatchStep(session_id=s, accepted=a, max_nodes=b, report_only=r) for s, a, b, r in steps]))
        got = as_packed.DraftBatch(pb.DraftBatchRequest(**packed(steps)))
        assert got == want, steps
    assert sum(len(t) for t in trees_of_batch(got)) > 0


def test_packed_steps_that_do_not_add_up_are_refused_whole(stub):
    stub.StartSession(pb.StartSessionRequest(session_id="a", prompt=[1, 2, 3]))
    good = packed([("a", [4, 5], 0, False)])
    for bad in ({"packed_counts": [3]}, {"packed_counts": [1, 1]}, {"packed_max_nodes": [0, 0]},
                {"packed_tokens": good["packed_tokens"] + b"\0"}, {"packed_counts": [-1]}):
        with pytest.raises(grpc.RpcError) as err:
            stub.DraftBatch(pb.DraftBatchRequest(**{**good, **bad}))
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert stub.EndSession(pb.EndSessionRequest(session_id="a")).stored_tokens == 3  # nothing was appended

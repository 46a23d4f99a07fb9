"""Back-pressure over a real channel: streams beyond --max-streams, calls beyond --max-concurrent-rpcs, refused."""

import queue
import time

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from drafter_service.api.drafter.v1 import drafter_pb2 as pb
from drafter_service.api.drafter.v1 import drafter_pb2_grpc as pb_grpc
from drafter_service.api.errors import ResourceExhausted
from drafter_service.core.config import DrafterConfig
from drafter_service.rpc.backpressure import StreamLimit
from drafter_service.rpc.server import create_server
from drafter_service.service.config import ServiceConfig


class OpenStream:
    """A DraftStream kept open by the test: one request in, one answer out, until closed."""

    def __init__(self, stub: pb_grpc.DrafterStub, session_id: str) -> None:
        self.session_id = session_id
        self.outbox: queue.SimpleQueue = queue.SimpleQueue()
        self.call = stub.DraftStream(iter(self.outbox.get, None), timeout=30)

    def draft(self) -> pb.DraftResponse:
        self.outbox.put(pb.DraftRequest(session_id=self.session_id))
        return next(self.call)

    def finish(self) -> None:
        self.outbox.put(None)
        assert list(self.call) == []


@pytest.fixture
def small(request):
    """A service with 4 threads, at most 2 open streams and ``request.param`` calls at once (3 when not given)."""
    cfg = ServiceConfig(drafter=DrafterConfig(capacity=1 << 12), default_vocab_size=100, workers=4, max_streams=2,
                        max_concurrent_rpcs=getattr(request, "param", 3))
    server, port = create_server(cfg, "127.0.0.1:0")
    channel = grpc.insecure_channel(f"127.0.0.1:{port}")
    stub = pb_grpc.DrafterStub(channel)
    for i in range(4):
        stub.StartSession(pb.StartSessionRequest(session_id=f"s{i}", prompt=[1, 2, 3]), timeout=5)
    yield stub, channel
    channel.close()
    server.stop(0)


def refused(fn) -> str:
    with pytest.raises(grpc.RpcError) as info:
        fn()
    assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, info.value
    return info.value.details()


def eventually_opens(stub: pb_grpc.DrafterStub, session_id: str) -> OpenStream:
    """A new stream, once the server has counted a closed one out (it does so as the call ends)."""
    deadline = time.monotonic() + 5
    while True:
        stream = OpenStream(stub, session_id)
        try:
            stream.draft()
            return stream
        except grpc.RpcError as exc:
            if exc.code() != grpc.StatusCode.RESOURCE_EXHAUSTED or time.monotonic() > deadline:
                raise
            time.sleep(0.05)


@pytest.mark.parametrize("small", [6], indirect=True)  # room for a refused call the server still counts a moment
def test_streams_beyond_the_limit_are_refused_while_unary_calls_still_answer(small):
    stub, channel = small
    first, second = OpenStream(stub, "s0"), OpenStream(stub, "s1")
    first.draft(), second.draft()
    assert "--max-streams" in refused(OpenStream(stub, "s2").draft)
    refused(lambda: stub.PutFrozenTable(iter([pb.FrozenTableChunk(name="t", leader_len=1, follower_len=3)]),
                                        timeout=5))
    refused(lambda: next(health_pb2_grpc.HealthStub(channel).Watch(health_pb2.HealthCheckRequest(), timeout=5)))
    t0 = time.monotonic()
    assert stub.GetStats(pb.GetStatsRequest(), timeout=5).active_sessions == 4  # threads are left for unary calls
    assert health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=5).status == 1
    assert time.monotonic() - t0 < 2
    first.finish()  # a stream the client ends normally frees its place
    third = eventually_opens(stub, "s2")
    second.call.cancel()  # and so does one the client cancels
    fourth = eventually_opens(stub, "s3")
    assert "--max-streams" in refused(OpenStream(stub, "s0").draft)
    third.finish(), fourth.finish()


@pytest.mark.parametrize("small", [2], indirect=True)
def test_calls_beyond_max_concurrent_rpcs_are_refused_at_once_not_queued(small):
    stub, _ = small
    first, second = OpenStream(stub, "s0"), OpenStream(stub, "s1")
    first.draft(), second.draft()
    t0 = time.monotonic()
    refused(lambda: stub.GetStats(pb.GetStatsRequest(), timeout=10))  # 2 calls are in progress, the most allowed
    assert time.monotonic() - t0 < 5
    first.finish()
    deadline = time.monotonic() + 5
    while True:
        try:
            assert stub.GetStats(pb.GetStatsRequest(), timeout=5).active_sessions == 4
            break
        except grpc.RpcError as exc:
            assert exc.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and time.monotonic() < deadline
            time.sleep(0.05)
    second.finish()


def test_stream_limit_counts_and_releases_once():
    limit = StreamLimit(2)
    a, b = limit.acquire(), limit.acquire()
    with pytest.raises(ResourceExhausted, match="2 streams are open"):
        limit.acquire()
    a(), a()  # a second release of the same stream changes nothing
    assert limit.open == 1 and limit.refused == 1 and limit.peak == 2
    c = limit.acquire()
    b(), c()
    assert limit.open == 0


@pytest.mark.parametrize("kwargs, message", [
    ({"workers": 4, "max_streams": 4}, "must be below workers"),
    ({"workers": 1}, "workers must be at least 2"),
    ({"max_streams": -1}, "max_streams must be at least 1"),
    ({"max_concurrent_rpcs": -3}, "max_concurrent_rpcs must be at least 1"),
])
def test_bad_limits_are_refused(kwargs, message):
    with pytest.raises(ValueError, match=message):
        ServiceConfig(**kwargs)


def test_defaults_leave_a_quarter_of_the_threads_to_unary_calls():
    cfg = ServiceConfig()
    assert (cfg.workers, cfg.max_streams, cfg.max_concurrent_rpcs) == (128, 96, 1024)
    assert ServiceConfig(workers=8).max_streams == 6


def test_serve_flags_and_their_environment_variables_set_the_limits(monkeypatch):
    from drafter_service.cli.main import build_parser
    from drafter_service.cli.serve import config_from_args

    monkeypatch.setenv("DRAFTER_MAX_CONCURRENT_RPCS", "40")
    args = build_parser().parse_args(["serve", "--workers", "8", "--max-streams", "5", "--max-request-tokens", "99",
                                      "--max-nodes-limit", "7", "--max-ingest-requests", "3"])
    cfg = config_from_args(args)
    assert (cfg.workers, cfg.max_streams, cfg.max_concurrent_rpcs) == (8, 5, 40)
    assert (cfg.max_request_tokens, cfg.max_nodes_limit, cfg.max_ingest_requests) == (99, 7, 3)
    with pytest.raises(ValueError, match="must be below workers"):
        config_from_args(build_parser().parse_args(["serve", "--workers", "8", "--max-streams", "8"]))

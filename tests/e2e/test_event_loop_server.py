"""Where the server runs each call: drafting on its event loop, anything that may wait in its thread pool, so that a
call stuck storing a request never holds up drafts."""

import threading
from concurrent import futures

import grpc
import pytest

from drafter_service.api.drafter.v1 import drafter_pb2 as pb
from drafter_service.api.drafter.v1 import drafter_pb2_grpc as pb_grpc
from drafter_service.core.config import DrafterConfig
from drafter_service.rpc.server import create_server
from drafter_service.service.config import ServiceConfig
from drafter_service.service.service import DrafterService


class RecordingService(DrafterService):
    """A memory-only service that notes the thread of each draft, and whose storing calls can be held."""

    def __init__(self, config: ServiceConfig) -> None:
        super().__init__(config)
        self.draft_threads: set[str] = set()
        self.store_threads: set[str] = set()
        self.hold = threading.Event()
        self.held = threading.Event()
        self.hold.set()

    def draft(self, *args, **kwargs):
        self.draft_threads.add(threading.current_thread().name)
        return super().draft(*args, **kwargs)

    def _wait_for_release(self) -> None:
        self.store_threads.add(threading.current_thread().name)
        self.held.set()
        assert self.hold.wait(10)

    def end_session(self, *args, **kwargs):
        self._wait_for_release()
        return super().end_session(*args, **kwargs)

    def ingest(self, *args, **kwargs):
        self._wait_for_release()
        return super().ingest(*args, **kwargs)


@pytest.fixture
def served():
    cfg = ServiceConfig(drafter=DrafterConfig(capacity=1 << 14), default_vocab_size=100, workers=4)
    service = RecordingService(cfg)
    server, port = create_server(cfg, "127.0.0.1:0", service)
    channel = grpc.insecure_channel(f"127.0.0.1:{port}")
    stub = pb_grpc.DrafterStub(channel)
    for i in range(3):
        stub.StartSession(pb.StartSessionRequest(session_id=f"s{i}", prompt=[1, 2, 3, 1, 2]), timeout=5)
    yield service, stub
    service.hold.set()
    channel.close()
    server.stop(0).wait(10)


def test_drafting_calls_run_on_the_event_loop_and_storing_calls_in_the_pool(served):
    service, stub = served
    stub.Draft(pb.DraftRequest(session_id="s0", accepted=[3]), timeout=5)
    replies = stub.DraftStream(iter([pb.DraftRequest(session_id="s1", accepted=[3])]), timeout=5)
    assert len(list(replies)) == 1
    stub.DraftBatch(pb.DraftBatchRequest(steps=[pb.BatchStep(session_id="s2", accepted=[3])]), timeout=5)
    stub.EndSession(pb.EndSessionRequest(session_id="s0", accepted=[1]), timeout=5)
    stub.Ingest(pb.IngestRequest(requests=[pb.Sequence(prompt=[5, 6], output=[7, 8])]), timeout=5)
    assert service.draft_threads == {"grpc-loop"}
    assert service.store_threads and all(name.startswith("grpc_") for name in service.store_threads)


@pytest.mark.parametrize("storing", ["EndSession", "DraftBatch ending a session", "Ingest"])
def test_a_call_stuck_storing_a_request_holds_up_no_draft(served, storing):
    service, stub = served
    service.hold.clear()
    with futures.ThreadPoolExecutor(1) as pool:
        if storing == "EndSession":
            stuck = pool.submit(stub.EndSession, pb.EndSessionRequest(session_id="s0", accepted=[1]), timeout=10)
        elif storing == "Ingest":
            stuck = pool.submit(stub.Ingest, pb.IngestRequest(
                requests=[pb.Sequence(prompt=[5, 6], output=[7, 8])]), timeout=10)
        else:
            stuck = pool.submit(stub.DraftBatch, pb.DraftBatchRequest(
                end=[pb.EndSessionRequest(session_id="s0", accepted=[1])]), timeout=10)
        assert service.held.wait(5)
        reply = stub.Draft(pb.DraftRequest(session_id="s1", accepted=[3]), timeout=2)
        batch = stub.DraftBatch(pb.DraftBatchRequest(steps=[pb.BatchStep(session_id="s2", accepted=[3])]),
                                timeout=2)
        assert not stuck.done()  # both answered while the storing call still waits
        service.hold.set()
        stuck.result()
    assert list(reply.token_ids) and not batch.step_errors


def test_a_pool_call_is_parsed_in_the_pool_not_on_the_loop(served, monkeypatch):
    """A large Ingest takes milliseconds to parse: the loop hands its bytes on, the serving thread parses them."""
    service, stub = served
    parsed_on: list[str] = []
    parse = pb.IngestRequest.FromString

    def noting(data: bytes) -> pb.IngestRequest:
        parsed_on.append(threading.current_thread().name)
        return parse(data)

    monkeypatch.setattr(pb.IngestRequest, "FromString", noting)
    cfg = ServiceConfig(drafter=DrafterConfig(capacity=1 << 14), default_vocab_size=100, workers=4)
    server, port = create_server(cfg, "127.0.0.1:0", service)  # a server built now takes the noting parser
    with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
        reply = pb_grpc.DrafterStub(channel).Ingest(pb.IngestRequest(requests=[pb.Sequence(prompt=[1, 2], output=[3])]),
                                                    timeout=5)
    server.stop(0).wait(10)
    assert reply.ingested == 1
    assert len(parsed_on) == 1 and parsed_on[0] != "grpc-loop" and parsed_on[0] in service.store_threads

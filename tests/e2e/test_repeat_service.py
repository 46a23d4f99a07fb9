"""Repeated prompts over a real gRPC channel with real Redis: sessions and Ingest feed the cache, a restart keeps it."""

from pathlib import Path

import grpc
import pytest

from drafter_service.api.drafter.v1 import drafter_pb2 as pb
from drafter_service.api.drafter.v1 import drafter_pb2_grpc as pb_grpc
from drafter_service.core.config import DrafterConfig
from drafter_service.runtime.runtime import Runtime
from drafter_service.service.config import ServiceConfig

PROMPT = [11, 12, 13, 14]
OUTPUT = [500 + i for i in range(40)]  # tokens no other request holds


def start(redis_url: str, data_dir: Path) -> tuple[Runtime, pb_grpc.DrafterStub, grpc.Channel]:
    """A service on ``redis_url`` keeping its index files in ``data_dir`` (a new folder: what a restart knows comes
    from the request log)."""
    cfg = ServiceConfig(address="127.0.0.1:0", redis_url=redis_url, http_address="", default_vocab_size=1000,
                        data_dir=str(data_dir),
                        drafter=DrafterConfig(capacity=1 << 16), rebuild_in_subprocess=False,
                        rebuild_interval_s=3600, snapshot_interval_s=3600, metrics_interval_s=3600)
    runtime = Runtime(cfg).start()
    channel = grpc.insecure_channel(f"127.0.0.1:{runtime.port}")
    return runtime, pb_grpc.DrafterStub(channel), channel


@pytest.fixture
def redis_url(redis_server):
    return redis_server.url


def repeat_branch(stub: pb_grpc.DrafterStub, session_id: str, prompt: list[int], max_nodes: int = 16) -> list[int]:
    """Open a session and return the tokens of its first draft's repeat nodes, in order."""
    stub.StartSession(pb.StartSessionRequest(session_id=session_id, prompt=prompt))
    reply = stub.Draft(pb.DraftRequest(session_id=session_id, max_nodes=max_nodes))
    return [t for t, s in zip(reply.token_ids, reply.sources, strict=False) if s == pb.SOURCE_REPEAT]


def test_a_finished_session_is_offered_to_the_next_request_with_its_prompt_even_after_a_restart(redis_url,
                                                                                                  tmp_path):
    runtime, stub, channel = start(redis_url, tmp_path / "first")
    try:
        assert repeat_branch(stub, "first", PROMPT) == []
        stub.EndSession(pb.EndSessionRequest(session_id="first", accepted=OUTPUT))
        assert repeat_branch(stub, "second", PROMPT) == OUTPUT[:16]
        assert repeat_branch(stub, "other", PROMPT[:-1]) == []  # only the whole prompt counts
        assert stub.GetStats(pb.GetStatsRequest()).repeat_hits == 1
    finally:
        channel.close()
        runtime.stop(grace=0)
    runtime, stub, channel = start(redis_url, tmp_path / "second")  # the cache comes back from the request log
    try:
        assert repeat_branch(stub, "after", PROMPT) == OUTPUT[:16]
    finally:
        channel.close()
        runtime.stop(grace=0)


def test_an_ingested_request_feeds_the_cache_and_the_branch_follows_the_output(redis_url, tmp_path):
    runtime, stub, channel = start(redis_url, tmp_path / "data")
    try:
        stub.Ingest(pb.IngestRequest(requests=[pb.Sequence(prompt=PROMPT, output=OUTPUT, request_id="r1")]))
        assert repeat_branch(stub, "s", PROMPT, max_nodes=8) == OUTPUT[:8]
        # the engine accepted all 8 and added its own token, which matches the stored output too
        reply = stub.Draft(pb.DraftRequest(session_id="s", accepted=OUTPUT[:9], max_nodes=8))
        assert reply.confirmed == 8
        repeated = [t for t, s in zip(reply.token_ids, reply.sources, strict=False) if s == pb.SOURCE_REPEAT]
        assert repeated == OUTPUT[9:17]
        stats = stub.GetStats(pb.GetStatsRequest())
        assert stats.confirmed_by_source["repeat"] == 8
    finally:
        channel.close()
        runtime.stop(grace=0)

"""Step times through both clients to a real gRPC server: what the service's speedup estimate is made of."""

import asyncio
import math

import grpc
import pytest

from drafter_service.api.drafter.v1 import drafter_pb2 as pb
from drafter_service.api.drafter.v1 import drafter_pb2_grpc as pb_grpc
from drafter_service.core.config import DrafterConfig
from drafter_service.rpc.server import create_server
from drafter_service.service.config import ServiceConfig
from engine_client import AsyncDrafterClient, DrafterClient, DrafterRequestError

CONFIG = ServiceConfig(drafter=DrafterConfig(capacity=1 << 12), default_vocab_size=100)


@pytest.fixture
def address():
    server, port = create_server(CONFIG, "127.0.0.1:0")
    yield f"127.0.0.1:{port}"
    server.stop(0)


def stats(address):
    with grpc.insecure_channel(address) as channel:
        return pb_grpc.DrafterStub(channel).GetStats(pb.GetStatsRequest())


def test_the_sync_client_sends_both_step_times(address):
    with DrafterClient(address, reuse=False) as client:
        sid = client.start([1, 2, 3])
        client.draft(sid, [])
        client.draft(sid, [4, 5], step_seconds=0.5, plain_step_seconds=0.125)  # 2 tokens in .5 s; plain 8/s
        client.draft(sid, [6], step_seconds=0.25)  # no plain time: not part of the estimate
        for bad in (-1.0, math.nan, 3601.0):
            with pytest.raises(DrafterRequestError, match="plain_step_seconds"):
                client.draft(sid, [7], plain_step_seconds=bad)
    s = stats(address)
    assert s.reported_steps == 2 and s.speedup_steps == 1
    assert s.estimated_speedup == pytest.approx(2 / 0.5 * 0.125)  # 4 tokens/s over 8 tokens/s: 0.5


def test_the_asyncio_client_sends_both_step_times(address):
    async def run():
        async with AsyncDrafterClient(address, reuse=False) as client:
            sid = await client.start([1, 2, 3])
            await client.draft(sid, [])
            await client.draft(sid, [4, 5, 6], step_seconds=0.25, plain_step_seconds=0.125)
            with pytest.raises(DrafterRequestError, match="plain_step_seconds"):
                await client.draft(sid, [7], plain_step_seconds=-0.5)

    asyncio.run(run())
    s = stats(address)
    assert s.speedup_steps == 1 and s.estimated_speedup == pytest.approx(3 / 0.25 * 0.125)  # 1.5


def test_the_service_refuses_bad_plain_step_times_over_the_wire(address):
    with grpc.insecure_channel(address) as channel:
        stub = pb_grpc.DrafterStub(channel)
        stub.StartSession(pb.StartSessionRequest(session_id="s", prompt=[1, 2]))
        for bad in (-1.0, math.nan, 1e9):
            with pytest.raises(grpc.RpcError) as err:
                stub.Draft(pb.DraftRequest(session_id="s", accepted=[3], plain_step_seconds=bad))
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert "plain_step_seconds" in err.value.details()
        assert stub.GetStats(pb.GetStatsRequest()).drafts == 0  # a refused request changes nothing

"""AsyncDrafterClient against a real in-process gRPC server: the API, reuse, mistakes, and a service restart."""

import asyncio
import time

import grpc
import numpy as np
import pytest
from serving import free_port

from drafter_service.api.drafter.v1 import drafter_pb2 as pb
from drafter_service.api.drafter.v1 import drafter_pb2_grpc as pb_grpc
from drafter_service.api.tree import EMPTY_TREE, accept_greedy
from drafter_service.core.config import DrafterConfig
from drafter_service.rpc.server import create_server
from drafter_service.service.config import ServiceConfig
from engine_client import AsyncDrafterClient, DrafterClient, DrafterRequestError

VOCAB = 1000
CONFIG = ServiceConfig(drafter=DrafterConfig(capacity=1 << 16, tail_tokens=64), default_vocab_size=VOCAB,
                       max_request_tokens=5000, max_nodes_limit=64)


def serve(port: int = 0):
    server, port = create_server(CONFIG, f"127.0.0.1:{port}")
    return server, f"127.0.0.1:{port}"


def stats(addr):
    with grpc.insecure_channel(addr) as channel:
        return pb_grpc.DrafterStub(channel).GetStats(pb.GetStatsRequest())


def corpus(seed=0, n=20, vocab=30):
    rng = np.random.default_rng(seed)
    return [(rng.integers(0, vocab, 12).tolist(), rng.integers(0, vocab, 60).tolist()) for _ in range(n)]


async def generate(client, prompt, output):
    sid = await client.start(prompt)
    trees, accepted, pos = [], [], 0
    while pos < len(output):
        tree = await client.draft(sid, accepted)
        tree.check_invariants(max_nodes=client._book.max_nodes)
        trees.append(tree)
        n, _ = accept_greedy(tree, output[pos:])
        accepted = output[pos:pos + n + 1]
        pos += len(accepted)
    await client.end(sid, accepted)
    return trees


@pytest.fixture
def address():
    server, addr = serve()
    yield addr
    server.stop(0)


def test_every_method_and_reuse_without_round_trips(address):
    seq = np.random.default_rng(1).permutation(VOCAB)[:200].tolist()
    prompt, output = seq[:20], seq[20:]

    async def main():
        async with AsyncDrafterClient(address, max_nodes=4, reuse_factor=4) as client:
            assert await client.ingest([(prompt, output), (*corpus()[0], "c0")]) == 2
            sid = await client.start(prompt)
            assert (await client.draft(sid, [])).token_ids == tuple(output[:4])
            drafts = (await client.stats())["drafts"]
            tree = await client.draft(sid, output[:5], step_seconds=0.002)  # node 4 of a 16-node chain
            assert tree.token_ids == tuple(output[5:9]) and client.stats_local().reused_steps == 1
            tree = await client.draft(sid, output[5:10])
            assert tree.token_ids == tuple(output[10:14]) and client.stats_local().reused_steps == 2
            tree = await client.draft(sid, output[10:17])  # inside the tree fetched for output[:10]
            assert tree.token_ids == tuple(output[17:21])
            before = await client.stats()
            await client.end(sid, output[17:19])  # the prefetches are read before EndSession
            after = await client.stats()
            assert after["drafts"] == drafts + 3 and after["reused_steps"] == 0  # no report-only step
            assert after["stored_tokens"] - before["stored_tokens"] == len(prompt) + 19 + 1
            local = client.stats_local()
            assert (local.steps, local.reused_steps, local.fetched_steps) == (4, 3, 1)
            assert local.mean_reuse_us > 0 and local.mean_round_trip_us > 0
    asyncio.run(main())


def test_async_drafts_equal_sync_drafts_for_the_same_calls():
    reqs = corpus(seed=2)
    (s1, a1), (s2, a2) = serve(), serve()

    async def run_async():
        async with AsyncDrafterClient(a1, max_nodes=8) as client:
            await client.ingest(reqs)
            return [await generate(client, p, o) for p, o in reqs[:2]]
    try:
        got = asyncio.run(run_async())
        with DrafterClient(a2, max_nodes=8) as client:
            client.ingest(reqs)
            want = []
            for p, o in reqs[:2]:
                sid, trees, accepted, pos = client.start(p), [], [], 0
                while pos < len(o):
                    trees.append(client.draft(sid, accepted))
                    n, _ = accept_greedy(trees[-1], o[pos:])
                    accepted = o[pos:pos + n + 1]
                    pos += len(accepted)
                client.end(sid, accepted)
                want.append(trees)
        assert got == want and any(len(t) for trees in got for t in trees)
        a, b = stats(a1), stats(a2)
        assert (a.drafts, a.stored_tokens) == (b.drafts, b.stored_tokens)
    finally:
        s1.stop(0)
        s2.stop(0)


def test_sessions_drafted_concurrently_and_mistakes_raise(address):
    reqs = corpus(seed=3, n=10)

    async def main():
        with pytest.raises(DrafterRequestError, match="nope"):
            async with AsyncDrafterClient(address, namespace="nope"):
                pass
        async with AsyncDrafterClient(address, max_nodes=8) as client:
            await client.ingest(reqs[3:])
            results = await asyncio.gather(*(generate(client, p, o) for p, o in reqs[:3]))
            sid = await client.start([1, 2, 3])
            with pytest.raises(DrafterRequestError):
                await client.draft(sid, [VOCAB])
            with pytest.raises(DrafterRequestError) as err:  # refused by the service on the stream
                await client.draft(sid, [7] * 5001)
            assert err.value.code == "INVALID_ARGUMENT"
            with pytest.raises(DrafterRequestError):
                await client.draft("ghost", [])
            await client.draft(sid, [4])
            await client.end(sid, [5])
            return results, client.stats_local()
    results, local = asyncio.run(main())
    s = stats(address)
    assert s.stored_requests == 7 + 3 + 1 and s.active_sessions == 0
    assert s.stored_tokens == sum(len(p) + len(o) + 1 for p, o in reqs) + 6
    assert local.steps == sum(len(r) for r in results) + 1 and s.drafts == local.fetched_steps


def test_a_restarted_service_gets_its_sessions_back_and_outages_return_empty_trees():
    port = free_port()
    server, addr = serve(port)
    prompt, output = corpus(seed=4, n=1)[0]

    async def main():
        nonlocal server
        client = AsyncDrafterClient(addr, max_nodes=8, timeout=0.3, initial_backoff=0.05, max_backoff=0.2,
                                    reuse=False)  # with reuse, subtrees of the last tree are served offline too
        sid = await client.start(prompt)
        await client.draft(sid, [])
        server.stop(0).wait()  # every session is lost with it (stop returns before the server has stopped)
        t0 = time.monotonic()
        for t in output[:20]:
            assert await client.draft(sid, [t]) == EMPTY_TREE
        done = await client.start(output[:5])
        await client.end(done, output[5:10])  # kept until the service is back
        assert time.monotonic() - t0 < 2.0 and client.buffered == 1
        server, _ = serve(port)
        deadline = time.monotonic() + 5
        while stats(addr).active_sessions == 0:  # after the backoff the session is reopened with every token
            assert time.monotonic() < deadline
            await asyncio.sleep(0.05)
            await client.draft(sid, [])
        await client.end(sid, output[20:25])
        local = client.stats_local()
        await client.close()
        return local
    try:
        local = asyncio.run(main())
        s = stats(addr)
        assert local.reopened_sessions == 1 and local.outages == 1 and local.flushed_requests == 1
        assert s.stored_requests == 2 and s.stored_tokens == len(prompt) + 25 + 1 + 10 + 1
    finally:
        server.stop(0)

"""DrafterClient.draft_batch against a real service: one DraftBatch round trip per engine step for every session."""

from __future__ import annotations

import asyncio
import time

import numpy as np
import pytest
from serving import free_port

from drafter_service.api.tree import DraftTree, accept_greedy
from drafter_service.core.config import DrafterConfig
from drafter_service.rpc.server import create_server
from drafter_service.service.config import ServiceConfig
from engine_client import AsyncDrafterClient, DrafterClient, DrafterRequestError, DrafterUnavailable, step_batch
from engine_client.client_common import ClientStats

VOCAB = 300
CONFIG = ServiceConfig(drafter=DrafterConfig(capacity=1 << 16, tail_tokens=64), default_vocab_size=VOCAB,
                       max_request_tokens=5000, max_nodes_limit=64)


def serve(port: int = 0):
    server, port = create_server(CONFIG, f"127.0.0.1:{port}")
    return server, f"127.0.0.1:{port}"


@pytest.fixture
def two_addresses():
    made = [serve(), serve()]
    yield made[0][1], made[1][1]
    for server, _ in made:
        server.stop(0)


def workload(seed: int, n: int) -> list[tuple[list[int], list[int]]]:
    rng = np.random.default_rng(seed)
    phrases = [rng.integers(0, 50, 7).tolist() for _ in range(6)]
    return [([int(t) for t in rng.integers(0, 50, 6)], [int(t) for k in rng.integers(0, 6, 6) for t in phrases[k]])
            for _ in range(n)]


def packed_trees(client: DrafterClient, items, max_nodes: int, ends=()) -> list[DraftTree]:
    """``draft_batch_packed``'s trees as DraftTrees (without the sources, which it does not carry)."""
    batch = client.draft_batch_packed(items, max_nodes, ends=ends)
    assert len(batch.offsets) == len(items) + 1
    return [batch.tree(k) for k in range(len(items))]


def run_engine(client: DrafterClient, requests, batched: bool, max_nodes: int = 8, packed: bool = False,
               ends_in_batch: bool = False, ends_beside: bool = False) -> list[list]:
    """Generate every request at once, one engine step at a time; returns the trees of each step. With
    ``ends_in_batch`` the requests that finished end in the next step's call (``draft_batch_packed``'s ``ends``);
    with ``ends_beside`` in a call of their own sent just before it (``end_batch_async``), settled after it."""
    sids = [client.start(p) for p, _ in requests]
    pos, pending, steps = [0] * len(requests), [[] for _ in requests], []
    live = list(range(len(requests)))
    finished: list[tuple[str, list[int]]] = []
    while live:
        items = [(sids[i], pending[i]) for i in live]
        if ends_beside:
            settle = client.end_batch_async(finished)
            trees, finished = packed_trees(client, items, max_nodes), []
            settle()
        elif packed or ends_in_batch:
            trees, finished = packed_trees(client, items, max_nodes, finished), []
        elif batched:
            trees = client.draft_batch(items, max_nodes)
        else:  # what a batch does: every session's tokens recorded first, then each one drafted
            for s, a in items:
                client.draft(s, a, max_nodes)
            trees = [client.draft(s, [], max_nodes) for s, _ in items]
        steps.append(trees)
        for tree, i in zip(trees, live, strict=True):
            tree.check_invariants(max_nodes=max_nodes)
            output = requests[i][1]
            n, _ = accept_greedy(tree, output[pos[i]:])
            pending[i] = output[pos[i]:pos[i] + n + 1]
            pos[i] += len(pending[i])
        for i in [i for i in live if pos[i] >= len(requests[i][1])]:
            if ends_in_batch or ends_beside:
                finished.append((sids[i], pending[i]))
            else:
                client.end(sids[i], pending[i])
        live = [i for i in live if pos[i] < len(requests[i][1])]
    if finished:
        client.draft_batch_packed([], ends=finished)  # a call with ends alone
    return steps


def side_by_side(addresses, runs: list[dict]) -> list[tuple[list[list], ClientStats]]:
    """Each run (``run_engine``'s keyword arguments) on its own service after the same history: the trees of each
    step and the client's own figures."""
    history, requests = workload(1, 10), workload(2, 6)
    out = []
    for addr, kwargs in zip(addresses, runs, strict=True):
        with DrafterClient(addr, reuse=False) as client:
            client.ingest(history)
            steps = run_engine(client, requests, **kwargs)
            stats = client.stats()
            assert stats["stored_requests"] == 16 and stats["active_sessions"] == 0
            out.append((steps, client.stats_local()))
    return out


def test_a_batch_gives_every_session_the_tree_draft_gives_it_after_every_sessions_tokens(two_addresses):
    (batched, _), (single, _) = side_by_side(two_addresses, [{"batched": True}, {"batched": False}])
    assert batched == single
    assert sum(len(t) for step in batched for t in step) > 0


def test_a_packed_batch_holds_the_trees_a_batch_gives(two_addresses, monkeypatch):
    """``draft_batch_packed`` takes the reply's arrays as they came (never through tree objects while the service
    answers every session): the same trees, step after step."""
    def no_trees(trees):
        raise AssertionError("a whole reply went through tree objects")

    monkeypatch.setattr(step_batch.PackedBatch, "of_trees", staticmethod(no_trees))
    results = side_by_side(two_addresses, [{"batched": True}, {"batched": True, "packed": True}])
    for steps, figures in results:
        assert figures.fetched_steps == sum(len(step) for step in steps) and figures.fetched_nodes > 0
    assert results[0][0] == results[1][0] and any(len(tree) for step in results[0][0] for tree in step)


def test_with_reuse_the_service_still_stores_every_token(two_addresses):
    requests = workload(3, 5)
    with DrafterClient(two_addresses[0], reuse=True) as client:
        client.ingest(requests)  # the same requests again: drafts are long chains, and their subtrees get reused
        before = client.stats()["stored_tokens"]
        steps = run_engine(client, requests, batched=True)
        local = client.stats_local()
        assert local.reused_steps > 0 and local.fetched_steps > 0  # reports rode along with fetches
        assert client.stats()["stored_tokens"] - before == sum(len(p) + len(o) + 1 for p, o in requests)
    assert len(steps) < max(len(o) for _, o in requests)


@pytest.mark.parametrize("beside", [False, True])
def test_finished_requests_end_in_the_next_steps_call_and_are_stored_whole(two_addresses, monkeypatch, beside):
    """In the step's DraftBatch (``ends``), or in a DraftBatch of their own beside it (``end_batch_async``)."""
    requests = workload(4, 6)
    with DrafterClient(two_addresses[0], reuse=False) as client:
        client.ingest(workload(1, 10))

        def no_end_session(*args, **kwargs):
            raise AssertionError("an EndSession call: the ends go in the DraftBatch calls")

        monkeypatch.setattr(client._stub, "EndSession", no_end_session)
        before = client.stats()
        steps = run_engine(client, requests, batched=True, ends_in_batch=not beside, ends_beside=beside)
        after = client.stats()
        assert any(len(tree) for step in steps for tree in step)
        assert after["stored_requests"] - before["stored_requests"] == len(requests)
        assert after["stored_tokens"] - before["stored_tokens"] == sum(len(p) + len(o) + 1 for p, o in requests)
        assert after["active_sessions"] == 0 and client.buffered == 0


def test_ends_beside_the_step_store_each_request_once_even_one_the_service_never_held(two_addresses):
    with DrafterClient(two_addresses[0]) as client:
        a, b = client.start([1, 2, 3]), client.start([4, 5], open_now=False)  # b: never opened on the service
        client.draft_batch_packed([(a, [7])])
        for ends in ([("nobody", [2])], [(b, [VOCAB])], [(a, [1]), (a, [2])]):
            with pytest.raises(DrafterRequestError):
                client.end_batch_async(ends)
        settle = client.end_batch_async([(a, [8]), (b, [9])])
        settle()
        stats = client.stats()
        # each request once with its separator (b by Ingest), nothing of the refused calls
        assert stats["stored_tokens"] == (3 + 2 + 1) + (2 + 1 + 1) and stats["active_sessions"] == 0


def test_an_end_in_a_batch_that_is_wrong_raises_before_anything_is_recorded(two_addresses):
    with DrafterClient(two_addresses[0]) as client:
        a, b = client.start([1, 2, 3]), client.start([4, 5])
        for items, ends in (([(a, [1])], [(a, [2])]), ([(a, [1])], [("nobody", [2])]), ([(a, [1])], [(b, [VOCAB])]),
                            ([], [(b, [1]), (b, [2])])):
            with pytest.raises(DrafterRequestError):
                client.draft_batch_packed(items, ends=ends)
        client.draft_batch_packed([(a, [7])], ends=[(b, [8])])
        client.draft_batch_packed([], ends=[(a, [])])
        assert client.stats()["stored_tokens"] == (3 + 1 + 1) + (2 + 1 + 1)  # each request once, 7 and 8 once


def test_callers_mistakes_raise_before_anything_is_recorded(two_addresses):
    with DrafterClient(two_addresses[0]) as client:
        a, b = client.start([1, 2, 3]), client.start([4, 5])
        for items in ([(a, [1]), ("nobody", [2])], [(a, [1]), (b, [VOCAB])], [(a, [1]), (a, [2])]):
            with pytest.raises(DrafterRequestError):
                client.draft_batch(items)
        client.draft_batch([(a, [7]), (b, [8])])
        client.end(a, [])
        client.end(b, [])
        assert client.stats()["stored_tokens"] == (3 + 1 + 1) + (2 + 1 + 1)  # each request once, 7 and 8 once


def test_the_service_away_gives_empty_trees_at_once_then_sessions_reopen_with_their_tokens():
    port = free_port()
    addr = f"127.0.0.1:{port}"
    requests = workload(4, 3)
    with DrafterClient(addr, max_nodes=8, connect_timeout=0.2, timeout=0.5, initial_backoff=0.05,
                       max_backoff=0.2) as client:
        sids = [client.start(p) for p, _ in requests]
        t0 = time.monotonic()
        for k in range(3):
            trees = client.draft_batch([(s, o[k:k + 1]) for s, (_, o) in zip(sids, requests, strict=True)])
            assert [len(t) for t in trees] == [0, 0, 0]
        assert time.monotonic() - t0 < 1.0
        server, _ = serve(port)
        try:
            live = 0
            deadline = time.monotonic() + 10
            while live < 3 and time.monotonic() < deadline:  # after the backoff, the sessions are reopened
                client.draft_batch([(s, []) for s in sids])
                try:
                    live = client.stats()["active_sessions"]
                except DrafterUnavailable:  # the channel is still reconnecting
                    time.sleep(0.05)
            assert live == 3
            for s, (_, o) in zip(sids, requests, strict=True):
                client.end(s, o[3:5])
            stats = client.stats()
            assert stats["stored_requests"] == 3
            assert stats["stored_tokens"] == sum(len(p) + 5 + 1 for p, _ in requests)  # every token, once
        finally:
            server.stop(0)


def test_the_asyncio_client_batches_like_the_sync_one(two_addresses):
    history, requests = workload(1, 10), workload(5, 4)

    async def run_async(addr: str) -> list[list]:
        async with AsyncDrafterClient(addr, reuse=False) as client:
            await client.ingest(history)
            sids = [await client.start(p) for p, _ in requests]
            pos, pending, steps = [0] * len(requests), [[] for _ in requests], []
            live = list(range(len(requests)))
            while live:
                trees = await client.draft_batch([(sids[i], pending[i]) for i in live], 8)
                steps.append(trees)
                for tree, i in zip(trees, live, strict=True):
                    n, _ = accept_greedy(tree, requests[i][1][pos[i]:])
                    pending[i] = requests[i][1][pos[i]:pos[i] + n + 1]
                    pos[i] += len(pending[i])
                for i in [i for i in live if pos[i] >= len(requests[i][1])]:
                    await client.end(sids[i], pending[i])
                live = [i for i in live if pos[i] < len(requests[i][1])]
            assert (await client.stats())["stored_requests"] == 14
            return steps

    got = asyncio.run(run_async(two_addresses[0]))
    with DrafterClient(two_addresses[1], reuse=False) as client:
        client.ingest(history)
        assert got == run_engine(client, requests, batched=True)
    assert sum(len(t) for step in got for t in step) > 0


def test_a_fixed_budget_keeps_trees_whole_where_the_adaptive_budget_shrinks_them():
    server, address = serve()
    try:
        rng = np.random.default_rng(7)
        head = [1, 2, 3, 4, 5, 6]
        stored = [(head, [int(t) for t in rng.integers(10, 250, 40)]) for _ in range(40)]  # 40 ways on from head
        sizes = {}
        for fixed in (False, True):
            with DrafterClient(address, reuse=False, max_nodes=32, fixed_budget=fixed) as client:
                client.ingest(stored)
                single, batched = client.start([99, *head]), client.start([98, *head])  # not a stored prompt
                for step in range(12):  # every draft rejected: a token never seen, then the head again
                    again = [] if step == 0 else [260 + step, *head]
                    tree_single = client.draft(single, again, 24)
                    tree_batched = client.draft_batch([(batched, again)], 24)[0]
                sizes[fixed] = (len(tree_single), len(tree_batched))
        assert sizes[True] == (24, 24)  # the budget asked for, on the single and the batched path
        assert max(sizes[False]) <= 12  # shrunk after eleven drafts that confirmed nothing
    finally:
        server.stop(0)

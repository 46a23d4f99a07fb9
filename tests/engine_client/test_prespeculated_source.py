"""PreSpeculatedSource against a real service over a real channel: trees cut from the one drafted a step ahead
without waiting, a service that is down, and each request stored once and whole."""

from __future__ import annotations

import time

import numpy as np
import pytest
from serving import free_port

from drafter_service.api.tree import EMPTY_TREE, DraftTree, accept_greedy
from drafter_service.core.config import DrafterConfig
from drafter_service.rpc.server import create_server
from drafter_service.service.config import ServiceConfig
from engine_client import DrafterClient, DrafterRequestError, DraftSource, PreSpeculatedSource

VOCAB = 300
CONFIG = ServiceConfig(drafter=DrafterConfig(capacity=1 << 16), default_vocab_size=VOCAB)
DOC = [(13 * i) % 97 + 3 for i in range(80)]  # no token twice: prompt lookup over a request's own context finds none


@pytest.fixture
def service():
    server, port = create_server(CONFIG, "127.0.0.1:0")
    address = f"127.0.0.1:{port}"
    with DrafterClient(address) as client:
        client.ingest([(DOC[:8], DOC[8:], "doc")])
    yield server, address
    server.stop(0)


def generate(source: PreSpeculatedSource, prompt: list[int], output: list[int], budget: int,
             forward: float = 0.0) -> tuple[list[DraftTree], list[float]]:
    """A greedy engine whose target produces ``output``: each step verifies the source's tree; its forward pass
    (the prefill too) lasts until the step's tokens were sent and the answer landed, or ``forward`` seconds when
    given. Returns the trees and how long each ``draft`` took."""
    def forward_pass() -> None:
        if forward:
            time.sleep(forward)
        else:
            assert source.drain()

    sid = source.start(prompt, budget)
    forward_pass()
    trees, took, accepted, pos = [], [], [], 0
    while pos < len(output):
        t0 = time.perf_counter()
        tree = source.draft(sid, accepted)
        took.append(time.perf_counter() - t0)
        tree.check_invariants(max_nodes=budget)
        trees.append(tree)
        forward_pass()
        n, _ = accept_greedy(tree, output[pos:])
        accepted = output[pos:pos + n + 1]
        pos += len(accepted)
    source.end(sid, accepted)
    return trees, took


def wait_until(check, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.02)


def test_a_stored_continuation_is_drafted_from_the_tree_one_step_ahead_without_waiting(service):
    _, address = service
    with PreSpeculatedSource(address, max_nodes=32) as source:
        assert isinstance(source, DraftSource)
        trees, _ = generate(source, DOC[:10], DOC[10:60], budget=8)
        fig = source.figures
        # every step, the first included (the prompt's tree was drafted during the prefill), is a hit
        assert (fig.hits, fig.misses, fig.waits) == (len(trees), 0, 0)
        assert accept_greedy(trees[0], DOC[10:])[0] == 8  # the prompt's tree: the stored continuation
        assert all(len(tree) for tree in trees)  # below each outcome, the rest of the tree drafted a step ahead
        assert len(trees) <= 10  # of 50 tokens: most steps accept most of their tree
        local = source.stats_local()
        assert local["hits"] == len(trees) and local["answers"] >= len(trees) and local["round_trip_seconds"] > 0


def test_a_finished_request_is_stored_once_and_whole_and_later_drafts_come_from_it(service):
    _, address = service
    seq = np.random.default_rng(3).permutation(VOCAB)[:60].tolist()  # never seen: little to draft
    prompt, output = seq[:12], seq[12:]
    with DrafterClient(address) as client:
        before = client.stats()
        with PreSpeculatedSource(address, max_nodes=32) as source:
            generate(source, prompt, output, budget=8)
            assert source.drain()
        after = client.stats()
        assert after["stored_requests"] - before["stored_requests"] == 1
        assert after["stored_tokens"] - before["stored_tokens"] == len(prompt) + len(output) + 1  # and a separator
        with PreSpeculatedSource(address, max_nodes=32) as source:  # the same prompt again: its output is drafted
            trees, _ = generate(source, prompt, output, budget=8)
            assert accept_greedy(trees[0], output)[0] == 8 and len(trees) <= len(output) / 9 + 1
        assert client.stats()["stored_requests"] - before["stored_requests"] == 2


def test_a_service_that_is_down_gives_empty_trees_at_once_and_the_request_is_stored_once_it_is_back():
    port = free_port()
    address = f"127.0.0.1:{port}"
    source = PreSpeculatedSource(address, max_nodes=32, timeout=0.05, connect_timeout=0)
    try:
        # an engine step of 5 ms: waiting for an answer would pay, were the service there
        trees, took = generate(source, DOC[:10], DOC[10:40], budget=8, forward=0.005)
        assert trees == [EMPTY_TREE] * 30  # one token per step, each the target's own
        assert max(took) < 0.05 + 0.05 and sum(took) < 0.5, took
        assert source.figures.waits == source.figures.late  # the rule waited, and the failed call ended the wait
        server, _ = create_server(CONFIG, address)
        try:
            time.sleep(0.6)  # the client's backoff (at most 0.5 s) lets it try again
            source.close()  # the request ended while the service was away is sent now
            with DrafterClient(address) as client:
                wait_until(lambda: client.stats()["stored_requests"] == 1)
                assert client.stats()["stored_tokens"] == 10 + 30 + 1
        finally:
            server.stop(0)
    finally:
        source.close()


def test_callers_mistakes_raise_and_leave_the_session_open(service):
    _, address = service
    with PreSpeculatedSource(address, max_nodes=16) as source:
        with pytest.raises(DrafterRequestError):
            source.start([1, VOCAB])
        sid = source.start([1, 2, 3])
        with pytest.raises(DrafterRequestError) as err:
            source.draft("ghost", [4])
        assert err.value.code == "NOT_FOUND"
        for kwargs in ({"accepted": [-1]}, {"accepted": [VOCAB]}, {"accepted": [4], "max_nodes": -1}):
            with pytest.raises(DrafterRequestError):
                source.draft(sid, **kwargs)
        with pytest.raises(DrafterRequestError):
            source.end(sid, [VOCAB + 5])
        source.draft(sid, [4])
        source.end(sid, [5])
        with pytest.raises(DrafterRequestError):
            source.end(sid, [])  # ended already
        assert source.drain()
    with DrafterClient(address) as client:
        assert client.stats()["stored_requests"] == 2  # the document and 1 2 3 4 5

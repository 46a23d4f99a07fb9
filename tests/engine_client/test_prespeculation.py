"""PreSpeculator against a real service over a real channel: chains cut from the tree drafted one step ahead, the
wait rule on a miss, and the breaker while the service is stopped."""

from __future__ import annotations

import os
import signal
import time

import pytest

from drafter_service.bench.serve_bench import ServiceProcess
from drafter_service.core.config import DrafterConfig
from drafter_service.rpc.server import create_server
from drafter_service.service.config import ServiceConfig
from engine_client import DrafterClient
from engine_client.prespeculation import PreSpeculator

VOCAB = 300
K = 4
DOC = [(13 * i) % 97 + 3 for i in range(80)]


@pytest.fixture
def service():
    server, port = create_server(ServiceConfig(drafter=DrafterConfig(capacity=1 << 16), default_vocab_size=VOCAB),
                                 "127.0.0.1:0")
    address = f"127.0.0.1:{port}"
    with DrafterClient(address) as client:
        client.ingest([(DOC[:8], DOC[8:], "doc")])
    yield server, address
    server.stop(0)


class Clock:
    """Seconds that move only when the test says: each engine step takes ``step`` seconds."""

    def __init__(self, step: float) -> None:
        self.now, self.step = 100.0, step

    def __call__(self) -> float:
        return self.now


def landed(req, timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while req.landed[1] is None:
        assert time.monotonic() < deadline, "no tree landed"
        time.sleep(0.01)


def speculator(address: str, clock: Clock | None = None, **kw) -> PreSpeculator:
    client = DrafterClient(address, timeout=kw.pop("timeout", 1.0), reuse=False, max_nodes=32)
    return PreSpeculator(client, K, 32, timeout=client.timeout, clock=clock or time.perf_counter, **kw)


def test_a_hit_is_cut_from_the_tree_drafted_one_step_ahead_without_the_network(service):
    server, address = service
    spec = speculator(address)
    req = spec.open(DOC[:10])
    first, _ = spec.step([req], [[DOC[10]]], [K])
    assert first == [[]]  # no tree yet, and no step time to judge a wait by: no draft this step
    spec.release()
    landed(req)
    server.stop(0).wait()  # from here on nothing can come from the network
    # the engine verified nothing and appended its own next token: the chain below it in the landed tree
    chains, probs = spec.step([req], [[DOC[11]]], [K])
    assert chains == [DOC[12:12 + K]]
    assert all(0 < p <= 1 for p in probs[0])
    assert (spec.figures.hits, spec.figures.waits) == (1, 0)


def test_the_outcome_is_followed_through_accepted_tokens_and_the_bonus(service):
    _, address = service
    spec = speculator(address)
    req = spec.open(DOC[:10])
    spec.step([req], [[DOC[10]]], [K])
    spec.release()
    landed(req)
    spec.step([req], [[DOC[11]]], [K])  # proposes DOC[12:16]
    spec.release()
    deadline = time.monotonic() + 5
    while req.landed[0] != 12:
        assert time.monotonic() < deadline
        time.sleep(0.01)
    # two of the four accepted, then the target's own token: 3 tokens to follow down the tree for 12 tokens
    chains, _ = spec.step([req], [DOC[12:15]], [K])
    assert chains == [DOC[15:15 + K]]
    assert spec.figures.hits == 2


def test_a_miss_waits_for_its_own_answer_when_the_engine_step_is_long(service):
    _, address = service
    clock = Clock(step=1.0)  # a slow engine: a round trip is worth waiting for
    spec = speculator(address, clock)
    warm, jumper = spec.open(DOC[:20]), spec.open(DOC[:30])
    spec.step([warm, jumper], [[DOC[20]], [DOC[30]]], [K, K])  # the first step: the step time is not known yet
    spec.release()
    landed(jumper)
    clock.now += clock.step
    # the same batch a step later: jumper appends a token its tree does not hold below its context
    chains, _ = spec.step([warm, jumper], [[DOC[21]], [DOC[40]]], [K, K])
    spec.release()
    assert chains[1] == DOC[41:41 + K]  # waited for, drafted for this very context
    assert spec.figures.waits == 1 and spec.figures.late == 0


def test_without_prespeculation_every_step_waits_for_its_fresh_tree(service):
    _, address = service
    spec = speculator(address, prespeculate=False)
    req = spec.open(DOC[:10])
    chains, _ = spec.step([req], [[DOC[10]]], [K])
    spec.release()
    assert chains == [DOC[11:11 + K]]
    assert (spec.figures.waits, spec.figures.hits) == (1, 0)


def test_a_stopped_service_never_stalls_a_step_past_the_first_wait_and_drafts_resume(tmp_path):
    svc = ServiceProcess(tmp_path / "svc", 1 << 16)
    svc.start()
    try:
        with DrafterClient(svc.address) as client:
            client.ingest([(DOC[:8], DOC[8:], "doc")])
        clock = Clock(step=1.0)  # waiting would pay: only the breaker keeps the steps short
        spec = speculator(svc.address, clock, timeout=0.2)
        reqs = [spec.open(DOC[:10 + i]) for i in range(3)]
        pos = [11 + i for i in range(3)]

        def step() -> tuple[list[list[int]], float]:
            clock.now += clock.step
            t0 = time.perf_counter()
            chains, _ = spec.step(reqs, [[DOC[p % len(DOC)]] for p in pos], [K] * 3)
            took = time.perf_counter() - t0
            spec.release()
            for i in range(len(pos)):
                pos[i] += 1
            return chains, took

        for _ in range(3):
            step()
            time.sleep(0.05)
        os.kill(svc.proc.pid, signal.SIGSTOP)
        try:
            finished = spec.open(DOC[:5])  # a request that completes while the service is stopped
            spec.step([finished], [DOC[5:9]], [0])
            spec.close(finished)
            times = []
            t_end = time.monotonic() + 3.0
            while time.monotonic() < t_end:
                times.append(step()[1])
                time.sleep(0.02)
        finally:
            os.kill(svc.proc.pid, signal.SIGCONT)
        # one wait ran into the timeout and opened the breaker; no other step waited for the stopped service
        assert max(times) < 0.3
        assert sorted(times)[-2] < 0.05, sorted(times)[-5:]
        assert spec.figures.late >= 1
        resumed_at, hits = time.monotonic(), spec.figures.hits
        while spec.figures.hits == hits:  # a chain cut from a tree the service drafted after SIGCONT (the contexts
            step()  # wrapped round DOC, so prompt lookup drafts some rows throughout)
            assert time.monotonic() - resumed_at < 6.0, "drafts did not resume"  # the client's backoff: <= 5 s
            time.sleep(0.02)
        with DrafterClient(svc.address) as client:
            deadline = time.monotonic() + 10
            while client.stats()["stored_requests"] < 2:  # the document and the request ended during the stop
                assert time.monotonic() < deadline, "the request ended during the stop was not stored"
                time.sleep(0.1)
        spec.close_all()
    finally:
        svc.stop()


def test_a_missed_row_whose_own_context_repeats_gets_a_chain_by_prompt_lookup_without_the_network(service):
    server, address = service
    server.stop(0).wait()  # no tree ever lands
    spec = speculator(address)
    req = spec.open([201, 202, 203, 204, 205, 206, 207, 201])
    assert spec.step([req], [[202]], [K])[0] == [[]]  # the sender indexes the prompt once the step is released
    spec.release()
    assert spec.drain()
    chains, probs = spec.step([req], [[203]], [K])  # its context now ends as its prompt began
    assert chains == [[204, 205, 206, 207]] and len(probs[0]) == K
    assert (spec.figures.hits, spec.figures.misses, spec.figures.looked_up, spec.figures.waits) == (0, 2, 1, 0)

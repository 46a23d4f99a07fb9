"""PreSpeculator against a real service over a real channel: chains (and subtrees) cut from the tree drafted one step
ahead, the wait rule on a miss, and the breaker while the service is stopped; subtree extraction on hand-built
trees."""

from __future__ import annotations

import os
import signal
import threading
import time

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tree_strategies import trees

from drafter_service.api.tree import EMPTY_TREE, DraftTree, accept_greedy
from drafter_service.bench.serve_bench import ServiceProcess
from drafter_service.core.config import DrafterConfig
from drafter_service.rpc.server import create_server
from drafter_service.service.config import ServiceConfig
from engine_client import DrafterClient
from engine_client.packed_trees import PackedTrees
from engine_client.prespeculation import LOOKUP_FIRST, PreSpeculator, lookup_estimates
from engine_client.step_batch import PackedBatch

VOCAB = 300
K = 4
DOC = [(13 * i) % 97 + 3 for i in range(80)]
UNSEEN = 250  # a token in no document


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


def test_the_estimates_ahead_hold_the_chain_the_next_step_cuts_and_every_lookups(service):
    _, address = service
    spec = speculator(address)
    req = spec.open(DOC[:10])
    assert spec.upcoming_estimates(req, K) == [lookup_estimates(m, n) for m in LOOKUP_FIRST for n in range(1, K + 1)]
    spec.step([req], [[DOC[10]]], [K])
    spec.release()
    landed(req)
    ahead = spec.upcoming_estimates(req, K)
    for accepted in range(3):  # whichever outcome comes next, its chain's estimates are among them
        code = req.landed[1].descend(req.landed[2], DOC[11:12 + accepted])
        assert req.landed[1].chain(code, K)[1] in ahead
    _, probs = spec.step([req], [[DOC[11]]], [K])
    assert probs[0] in ahead
    assert spec.upcoming_estimates(req, 0) == []


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

        def step(token: int | None = None) -> tuple[list[list[int]], float]:
            """One engine step; each row appends ``token`` if given (no tree or lookup drafts after it), else the
            next token of DOC."""
            clock.now += clock.step
            t0 = time.perf_counter()
            new = [[DOC[p % len(DOC)] if token is None else token] for p in pos]
            chains, _ = spec.step(reqs, new, [K] * 3)
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
            # every row appends a token never seen: no landed tree and no prompt lookup drafts for it, so the
            # rule waits this step (trees cut while the service is stopped would decay the accepted-per-chain
            # figure, which never accepts here, until no wait paid)
            times = [step(UNSEEN)[1]]
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


# root -> 5 (0.9) -> 6 (0.8) -> 7 (0.4); root -> 9 (0.5) -> 10 (0.45); 6 -> 8 (0.3)
FIRST = DraftTree((5, 9, 6, 10, 7, 8), (-1, -1, 0, 1, 2, 2), (0.9, 0.5, 0.8, 0.45, 0.4, 0.3), 3.35)
# root -> 5 (0.6) -> 1 (0.2)
SECOND = DraftTree((5, 1), (-1, 0), (0.6, 0.2), 0.8)


def tree(tokens: tuple[int, ...], parents: tuple[int, ...], probs: tuple[float, ...]) -> DraftTree:
    return DraftTree(tokens, parents, probs, float(sum(probs)))


def test_the_subtree_below_a_code_is_re_rooted_there_in_tree_order_with_estimates_given_it():
    packed = PackedTrees.from_trees([FIRST, DraftTree(), SECOND], width=2)  # chains' width does not cut subtrees
    assert packed.subtree(0, 8) == FIRST  # the root: the whole tree
    assert packed.subtree(0, 3) == tree((5, 9, 6), (-1, -1, 0), (0.9, 0.5, 0.8))  # its first three nodes
    five = packed.descend(0, [5])
    assert packed.subtree(five, 8) == tree((6, 7, 8), (-1, 0, 0), (0.8 / 0.9, 0.4 / 0.9, 0.3 / 0.9))
    assert packed.subtree(five, 2) == tree((6, 7), (-1, 0), (0.8 / 0.9, 0.4 / 0.9))
    assert packed.subtree(packed.descend(0, [5, 6]), 8) == tree((7, 8), (-1, -1), (0.4 / 0.8, 0.3 / 0.8))
    assert packed.subtree(packed.descend(0, [9]), 8) == tree((10,), (-1,), (0.9,))
    assert packed.subtree(packed.descend(0, [9, 10]), 8) == EMPTY_TREE  # a leaf
    assert packed.subtree(1, 8) == EMPTY_TREE  # the empty tree
    assert packed.subtree(2, 8) == SECOND  # the third tree, after the empty one
    assert packed.subtree(packed.descend(2, [5]), 8) == tree((1,), (-1,), (0.2 / 0.6,))
    assert packed.subtree(0, 0) == EMPTY_TREE
    cut = PackedTrees.from_trees([FIRST], width=8, min_prob=0.5)  # under 0.5 given the code: left out, and below
    assert cut.subtree(cut.descend(0, [5]), 8) == tree((6,), (-1,), (0.8 / 0.9,))
    assert cut.subtree(0, 8) == tree((5, 9, 6), (-1, -1, 0), (0.9, 0.5, 0.8))


@settings(max_examples=150, deadline=None)
@given(st.lists(trees(), min_size=1, max_size=4), st.data())
def test_the_subtree_is_draft_trees_subtree_cut_to_a_prefix(forest, data):
    packed = PackedTrees.from_trees(forest, width=3)
    for t, whole in enumerate(forest):
        node = data.draw(st.integers(-1, len(whole) - 1))
        max_nodes = data.draw(st.integers(0, 13))
        expected = whole.subtree(node).prefix(max_nodes)
        code = packed.descend(t, whole.path(node)) if node >= 0 else t
        got = packed.subtree(code, max_nodes)
        assert (got.token_ids, got.parents) == (expected.token_ids, expected.parents)
        assert got.probs == pytest.approx(expected.probs)
        got.check_invariants(max_nodes=max_nodes)


def test_step_trees_cuts_the_subtree_below_the_outcome_from_the_tree_drafted_one_step_ahead(service):
    server, address = service
    spec = speculator(address)
    req = spec.open(DOC[:10], draft=True)  # the prompt's own tree is asked for at once
    spec.release()
    landed(req)
    first = spec.step_trees([req], [[]], [8])[0]  # the first step appends nothing: the prompt's tree
    first.check_invariants(max_nodes=8)
    assert accept_greedy(first, DOC[10:])[0] >= 4
    spec.release()
    server.stop(0).wait()  # from here on nothing can come from the network
    # the engine accepted three nodes, then its own token: the subtree below those four tokens
    below = spec.step_trees([req], [DOC[10:14]], [8])[0]
    below.check_invariants(max_nodes=8)
    assert accept_greedy(below, DOC[14:])[0] >= 4
    assert all(0 < p <= 1 for p in below.probs) and max(below.probs) > 0.5  # given the outcome, not the root
    assert (spec.figures.hits, spec.figures.misses, spec.figures.waits) == (2, 0, 0)
    spec.close_all()


def test_step_trees_falls_back_to_the_earlier_tree_and_a_row_without_a_budget_gets_none(service):
    server, address = service
    server.stop(0).wait()
    spec = speculator(address)
    req = spec.open([1, 2, 3])
    spec.step_trees([req], [[4]], [8])  # the request now holds 4 tokens
    # as landed: the tree before (for 3 tokens) holds the outcome 4 -> 5; the latest (for 4 tokens) does not hold 5
    req.earlier = (3, PackedTrees.from_trees([tree((4, 5, 6, 7), (-1, 0, 1, 1), (0.8, 0.4, 0.2, 0.1))], 8), 0)
    req.landed = (4, PackedTrees.from_trees([tree((9,), (-1,), (0.5,))], 8), 0)
    trees_, = spec.step_trees([req], [[5]], [8])
    assert trees_ == tree((6, 7), (-1, -1), (0.2 / 0.4, 0.1 / 0.4))
    assert spec.step_trees([req], [[6]], [0]) == [EMPTY_TREE]
    spec.close_all()


def test_the_first_empty_step_waits_for_the_prompts_tree_when_the_engine_step_is_long(service):
    _, address = service
    clock = Clock(step=1.0)  # a slow engine: a round trip is worth waiting for
    spec = speculator(address, clock)
    warm = spec.open(DOC[:20])
    for i in range(2):  # an earlier request measures the engine's step
        spec.step_trees([warm], [[DOC[20 + i]]], [8])
        spec.release()
        clock.now += clock.step
    assert spec.figures.step_seconds == 1.0
    waits = spec.figures.waits
    req = spec.open(DOC[:30], draft=True)  # not released: its tree is not on the way yet
    got = spec.step_trees([req], [[]], [8])[0]  # nothing landed, no repeat to look up: wait for the open's answer
    spec.release()
    assert accept_greedy(got, DOC[30:])[0] >= 4
    assert (spec.figures.waits - waits, spec.figures.late) == (1, 0)
    spec.close_all()


class HeldClient:
    """A client whose DraftBatch answers only when the test lets it (``answer``); each answer is one chain."""

    available, buffered = True, 0

    def __init__(self) -> None:
        self.answer = threading.Event()
        self.calls = 0

    def start(self, prompt, open_now: bool = True) -> str:
        return "s"

    def draft_batch_packed(self, items, max_nodes: int = 0):
        self.calls += 1
        assert self.answer.wait(5)
        self.answer.clear()
        return PackedBatch.of_trees([tree((7, 8), (-1, 0), (0.9, 0.8))] * len(items))

    def flush(self) -> None:
        pass


def test_an_answer_that_comes_back_while_the_engine_steps_lands_once_the_step_ended():
    """The sender starts no work of its own while the engine's thread is inside its step (between ``step`` and
    ``release``): it would take turns with it on the interpreter lock."""
    client = HeldClient()
    spec = PreSpeculator(client, K, 32)  # type: ignore[arg-type]
    req = spec.open([1, 2, 3])
    spec.step([req], [[4]], [K])
    spec.release()
    deadline = time.monotonic() + 5
    while not client.calls:  # the step's call is out
        assert time.monotonic() < deadline
        time.sleep(0.001)
    spec.step([req], [[5]], [K])  # the engine's next step begins: the answer comes back now
    client.answer.set()
    time.sleep(0.1)
    assert req.landed[1] is None  # not landed while the engine's thread is inside its step
    spec.release()
    landed(req)
    assert req.landed[0] == 4
    client.answer.set()  # the second step's call
    spec.close_all()


def test_work_released_with_a_step_runs_on_the_sender_after_that_steps_call(service):
    """A tracker hands its learning to the sender with the step (one thread woken per step): it runs on the
    sender's thread once the step's trees landed, never during the engine's step."""
    _, address = service
    spec = speculator(address)
    req = spec.open(DOC[:10])
    spec.step([req], [[DOC[10]]], [K])
    ran: list[tuple[str, bool]] = []
    done = threading.Event()

    def chore() -> None:
        ran.append((threading.current_thread().name, req.landed[1] is not None))
        done.set()

    spec.release(chore)
    assert done.wait(5.0)
    assert ran == [("drafter-sender", True)]
    spec.close_all()

"""Client-side reuse and session bookkeeping: tiny hand-built trees with the answer beside them, and a property test."""

import logging

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from drafter_service.api.drafter.v1 import drafter_pb2 as pb
from drafter_service.api.tree import EMPTY_TREE, DraftTree
from engine_client.client_common import (
    Backoff,
    ClientStats,
    DrafterRequestError,
    IngestBuffer,
    check_token_lists,
    check_tokens,
)
from engine_client.draft_reuse import SessionBook, descend, reusable_subtree, settle_all, tree_of

# root -> 5 -> 6 -> 7 ; root -> 8 -> 9 ; 5 -> 4 ; 7 -> 3
TREE = DraftTree((5, 8, 6, 9, 7, 4, 3), (-1, -1, 0, 1, 2, 0, 4), (0.9, 0.5, 0.8, 0.4, 0.6, 0.1, 0.3), 3.6)


@pytest.mark.parametrize("path, node", [
    ([], -1), ([5], 0), ([5, 6], 2), ([5, 6, 7], 4), ([5, 6, 7, 3], 6), ([5, 4], 5), ([8, 9], 3),
    ([6], None), ([5, 9], None), ([5, 6, 7, 3, 1], None), ([8, 9, 1], None),
])
def test_descend_follows_a_path_from_the_root(path, node):
    assert descend(TREE, path) == node


def test_reusable_subtree_is_the_part_below_the_accepted_path():
    sub = reusable_subtree(TREE, [5, 6])
    assert sub.token_ids == (7, 3) and sub.parents == (-1, 0)
    assert sub.probs == pytest.approx((0.6 / 0.8, 0.3 / 0.8))  # conditioned on the path
    sub.check_invariants()
    assert reusable_subtree(TREE, [5]).token_ids == (6, 7, 4, 3)  # the original order is kept


@pytest.mark.parametrize("path, min_nodes", [
    ([], 1),            # nothing accepted: a fresh draft
    ([5, 6, 7, 3], 1),  # a leaf: nothing hangs below
    ([8, 9], 1),
    ([5, 2], 1),        # the bonus token is not in the tree
    ([5, 6], 3),        # only 2 nodes below, 3 wanted
])
def test_no_reuse_when_the_path_leaves_the_tree_or_too_little_hangs_below(path, min_nodes):
    assert reusable_subtree(TREE, path, min_nodes) is None
    assert reusable_subtree(EMPTY_TREE, [5]) is None


@st.composite
def trees(draw):
    n = draw(st.integers(1, 25))
    toks, parents, seen = [], [], set()
    for _ in range(n):
        p = draw(st.integers(-1, len(toks) - 1))
        t = draw(st.integers(0, 4))
        if (p, t) not in seen:
            seen.add((p, t))
            parents.append(p)
            toks.append(t)
    probs = []
    for p in parents:
        probs.append((probs[p] if p >= 0 else 1.0) * 0.9)
    return DraftTree(tuple(toks), tuple(parents), tuple(probs), sum(probs))


@settings(max_examples=200, deadline=None)
@given(trees(), st.lists(st.integers(0, 4), max_size=6))
def test_reuse_matches_a_naive_walk(tree, path):
    kids = tree.children()
    node = -1
    for t in path:
        node = kids.get(node, {}).get(t)
        if node is None:
            break
    assert descend(tree, path) == node
    sub = reusable_subtree(tree, path)
    if node is None or node < 0 or node not in kids:
        assert sub is None
    else:
        assert sub == tree.subtree(node) and len(sub) > 0
        sub.check_invariants()
        # every node below is the path extended: its root path in sub plus `path` is a path of the tree
        for i in range(len(sub)):
            assert descend(tree, list(path) + sub.path(i)) is not None


def test_tree_of_a_response_recomputes_the_score_and_names_sources():
    resp = pb.DraftResponse(token_ids=[4, 5], parents=[-1, 0], probs=[0.5, 0.25], score=9.0,
                            sources=[pb.SOURCE_STORE, pb.SOURCE_SESSION])
    tree = tree_of(resp)
    assert tree == DraftTree((4, 5), (-1, 0), (0.5, 0.25), 0.75)
    assert tree.sources == ("store", "session")


def test_token_checks_raise_request_errors():
    assert check_tokens((1, 2), 10, "x") == [1, 2]
    with pytest.raises(DrafterRequestError, match="-1"):
        check_tokens([3, -1], None, "accepted")
    with pytest.raises(DrafterRequestError, match="10"):
        check_tokens([10], 10, "accepted")
    with pytest.raises(DrafterRequestError, match="integer"):
        check_tokens(["a"], None, "prompt")


def test_a_batch_of_token_lists_is_checked_as_each_list_alone():
    assert check_token_lists([(1, 2), [], np.array([3])], 10, "x") == [[1, 2], [], [3]]
    assert check_token_lists([], 10, "x") == []
    for lists, match in (([[1], [3, -1]], "-1"), ([[], [2, 10], [11]], "id 10,"), ([[1], ["a"]], "integer")):
        with pytest.raises(DrafterRequestError, match=match):
            check_token_lists(lists, 10, "accepted")


def opened_session(book, prompt=(1, 2, 3)):
    state = book.open(list(prompt))
    req, n, reopened = book.start_request(state, "")
    assert (req.session_id, list(req.prompt), n, reopened) == (state.local_id, list(prompt), len(prompt), False)
    book.opened(state, n, reopened)
    return state


def test_sent_acked_and_failures_decide_what_is_sent_again():
    book = SessionBook(max_nodes=4, reuse_factor=2)
    s = opened_session(book)
    book.record(s, [4, 5])
    req, e1 = book.draft_request(s, 0, False, 0.0)
    assert list(req.accepted) == [4, 5] and req.max_nodes == 8 and (s.sent, s.acked) == (5, 3)
    book.answered(e1, pb.DraftResponse())
    assert s.acked == 5 and not s.pending
    # a refusal on the stream: the culprit was not applied, nor was anything after it
    book.record(s, [6])
    _, e2 = book.draft_request(s, 0, True, 0.0)
    book.record(s, [7])
    _, e3 = book.draft_request(s, 0, False, 0.0)
    settle_all(book, [e2, e3], "INVALID_ARGUMENT", "bad")
    assert e2.outcome() == "invalid" and e3.outcome() == "retry"
    assert (s.sent, s.acked) == (5, 5) and book.can_report(s)
    req, _ = book.draft_request(s, 0, False, 0.0)
    assert list(req.accepted) == [6, 7]  # sent again
    # a broken connection: maybe applied, so the session is reopened under a fresh id with every token
    settle_all(book, list(s.pending), "UNAVAILABLE", "gone")
    assert s.uncertain and book.needs_open(s)
    req, n, reopened = book.start_request(s, "ns")
    assert req.session_id == f"{s.local_id}~1" and list(req.prompt) == [1, 2, 3, 4, 5, 6, 7] and reopened
    book.opened(s, n, reopened)
    # a lost session (service restart) keeps its id
    _, e4 = book.draft_request(s, 0, False, 0.0)
    settle_all(book, [e4], "NOT_FOUND", "unknown session")
    assert e4.outcome() == "reopen" and book.needs_open(s)
    req, _, _ = book.start_request(s, "")
    assert req.session_id == f"{s.local_id}~1"
    assert book.snapshot().reopened_sessions == 1


def test_answers_for_an_abandoned_remote_session_change_nothing():
    book = SessionBook()
    s = opened_session(book)
    book.record(s, [9])
    _, old = book.draft_request(s, 0, True, 0.0)
    book.failed(old, "DEADLINE_EXCEEDED")
    book.opened(s, *book.start_request(s, "")[1:])
    book.answered(old, pb.DraftResponse())  # settled already: ignored
    assert (s.sent, s.acked, s.generation) == (4, 4, 1)


def test_refused_budget_teaches_the_limit_and_errors_take_tokens_back():
    book = SessionBook(max_nodes=32, reuse_factor=4)
    s = opened_session(book)
    book.record(s, [4])
    _, e = book.draft_request(s, 0, False, 0.0)
    assert e.max_nodes == 128
    book.failed(e, "INVALID_ARGUMENT", "max_nodes must be in [0, 64], got 128", culprit=True, definite=True)
    assert book.action(e, 1) == "retry" and book.limit == 64 and book.budget(s, 0) == (32, 64)
    book.record(s, [5])
    _, e = book.draft_request(s, 0, False, 0.0)
    book.failed(e, "INVALID_ARGUMENT", "accepted holds token id 5000", culprit=True, definite=True)
    with pytest.raises(DrafterRequestError, match="5000") as err:
        book.action(e, 1)
    assert err.value.code == "INVALID_ARGUMENT" and s.tokens == [1, 2, 3, 4]


def test_reuse_counts_steps_and_acceptance_by_kind():
    book = SessionBook(max_nodes=2, reuse_factor=4)
    s = opened_session(book)
    s.full, s.full_base = TREE, len(s.tokens)  # the tree drafted for the session's context so far
    book.record(s, [5])
    sub = book.try_reuse(s, 0)
    assert sub == TREE.subtree(0).prefix(2) and s.full == TREE.subtree(0) and s.full_base == len(s.tokens)
    book.record(s, [6, 7, 1])
    assert book.try_reuse(s, 0) is None  # 1 is off the tree
    stats = book.snapshot()
    assert (stats.steps, stats.reused_steps, stats.scored_after_reuse, stats.accepted_after_reuse) == (1, 1, 1, 2)
    assert SessionBook(reuse=False).try_reuse(s, 0) is None


def test_a_prefetched_tree_is_the_next_steps_tree_once_answered():
    book = SessionBook(max_nodes=2, reuse_factor=4)
    s = opened_session(book)
    s.full, s.full_base = TREE, len(s.tokens)
    book.record(s, [5])
    assert book.try_reuse(s, 0) == TREE.subtree(0).prefix(2)
    _, entry = book.prefetch_request(s, 0, 0.0)  # the tree for the context ending in 5
    assert book.waiting_prefetch(s) is entry and entry.max_nodes == 8
    book.record(s, [9])
    assert book.try_reuse(s, 0) is None  # 9 is not below 5 in the old tree, and the answer has not come
    fresh = DraftTree((9, 4, 3), (-1, 0, 1), (0.9, 0.5, 0.4))
    book.answered(entry, fresh)
    assert book.waiting_prefetch(s) is None
    assert book.try_reuse(s, 0) == fresh.subtree(0).prefix(2)  # followed down the prefetched tree's 9


@pytest.mark.parametrize("min_reuse_nodes, max_nodes, reused", [
    (0, 4, True),    # 4 nodes below [5]: a whole budget of 4
    (0, 5, False),   # fewer than the step's budget: a fresh draft is better
    (1, 5, True),
    (5, 2, False),
])
def test_by_default_only_a_subtree_filling_the_budget_is_reused(min_reuse_nodes, max_nodes, reused):
    book = SessionBook(max_nodes=8, min_reuse_nodes=min_reuse_nodes)
    s = opened_session(book)
    s.full, s.full_base = TREE, len(s.tokens)
    book.record(s, [5])
    assert (book.try_reuse(s, max_nodes) is not None) == reused


def test_ingest_buffer_drops_the_oldest_with_a_warning(caplog):
    stats = ClientStats()
    buf = IngestBuffer(stats, capacity=2)
    with caplog.at_level(logging.WARNING):
        buf.add([pb.Sequence(request_id=str(i)) for i in range(3)])
    assert [s.request_id for s in buf.take(5)] == ["1", "2"] and stats.dropped_requests == 1
    assert "dropped" in caplog.text
    buf.add([pb.Sequence(request_id="a")])
    buf.add([pb.Sequence(request_id="b")], front=True)
    assert [s.request_id for s in buf.take(1)] == ["b"] and stats.buffered_requests == 4


def test_backoff_doubles_up_to_its_maximum_and_warns_once_per_outage(caplog):
    b = Backoff("x:1", initial=0.01, maximum=0.04)
    with caplog.at_level(logging.WARNING):
        for _ in range(4):
            b.failure("down")
        assert not b.ready() and 0.8 * 0.04 <= b.clock.last_wait <= 0.04 and b.down and b.clock.failures == 4
        b.success()
    assert b.ready() and not b.down and b.outages == 1
    messages = [r.getMessage() for r in caplog.records]
    assert len(messages) == 2 and "x:1 unavailable (down)" in messages[0] and "reachable again" in messages[1]
    assert all(r.exc_info is None for r in caplog.records)

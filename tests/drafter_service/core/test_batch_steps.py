"""The batched native step: the same trees, confirmations and learning as single calls correcting every session
and then drafting for each."""

import numpy as np
import pytest

from drafter_service.api.tree import accept_greedy
from drafter_service.core.config import DrafterConfig
from drafter_service.core.drafter import Drafter
from drafter_service.core.tree_builder import native_module
from store import match_kernels

pytestmark = pytest.mark.skipif(native_module() is None, reason="the native tree builder is not built")


def corpus(seed: int, n: int) -> list[tuple[list[int], list[int]]]:
    rng = np.random.default_rng(seed)
    phrases = [rng.integers(0, 60, 7).tolist() for _ in range(8)]
    return [(rng.integers(0, 60, 6).tolist(), [t for k in rng.integers(0, 8, 10) for t in phrases[k]])
            for _ in range(n)]


def make(rebuild: bool, **kw) -> Drafter:
    d = Drafter(DrafterConfig(vocab_size=100, capacity=1 << 15, tail_tokens=128, **kw))
    for prompt, output in corpus(0, 30):
        d.ingest(prompt, output)
    if rebuild:
        d.rebuild()
    return d


def tree_tuple(tree) -> tuple:
    return tree.token_ids, tree.parents, tree.probs, tree.sources


@pytest.fixture(params=["native", "numpy"])
def lookups(request):
    """The store and session lookups the batch makes: straight through the kernels' C API, or through the numpy
    reference the Python layer passes (the batch's fallback)."""
    before = match_kernels.use_native(request.param == "native")
    yield request.param
    match_kernels.use_native(before)


@pytest.mark.parametrize("rebuild", [False, True])
@pytest.mark.parametrize("adaptive", [False, True])
def test_batched_steps_draft_what_single_calls_draft(rebuild, adaptive, lookups):
    single, batched = make(rebuild, adaptive_budget=adaptive), make(rebuild, adaptive_budget=adaptive)
    requests = corpus(1, 9)
    for d in (single, batched):
        for i, (prompt, _) in enumerate(requests):
            d.start(f"s{i}", prompt)
    pos = [0] * len(requests)
    accepted: list[list[int]] = [[] for _ in requests]
    for step in range(12):
        budgets = [(0, 8, 16, 24)[(i + step) % 4] for i in range(len(requests))]
        report = [(i * 7 + step) % 5 == 4 for i in range(len(requests))]
        expected_confirmed = []  # every session corrected first, then each drafted: what the batch does
        for i in range(len(requests)):
            ids = np.array(accepted[i], dtype=np.int32)
            expected_confirmed.append(single.correct(single.session(f"s{i}"), ids).tokens if ids.size else 0)
        expected = [tree_tuple(single.draft(single.session(f"s{i}"), budgets[i])) if not report[i] else
                    ((), (), (), ()) for i in range(len(requests))]
        sessions = [batched.session(f"s{i}") for i in range(len(requests))]
        assert all(batched.batchable(s) for s in sessions)
        flat = np.array([t for a in accepted for t in a], dtype=np.int32)
        offsets = [0, *np.cumsum([len(a) for a in accepted]).tolist()]
        limits = [b or s.max_nodes for b, s in zip(budgets, sessions, strict=True)]
        out = batched.draft_steps(sessions, flat, offsets, limits, report)
        got = []
        for i in range(len(requests)):
            lo, hi = out.offsets[i], out.offsets[i + 1]
            names = tuple(("session", "store", "dynamic", "frozen")[k] for k in out.kinds[lo:hi])
            got.append((tuple(out.token_ids[lo:hi]), tuple(out.parents[lo:hi]), tuple(out.probs[lo:hi]), names))
        for i in range(len(requests)):
            assert got[i] == expected[i], (step, i, report[i], len(accepted[i]))
        assert out.confirmed == expected_confirmed
        for i, (_, output) in enumerate(requests):  # greedy acceptance of each tree against the real output
            ids, parents = got[i][0], got[i][1]
            kids: dict[int, dict[int, int]] = {}
            for j, (tok, par) in enumerate(zip(ids, parents, strict=True)):
                kids.setdefault(par, {})[tok] = j
            node, n = -1, 0
            while pos[i] + n < len(output) and output[pos[i] + n] in kids.get(node, {}):
                node = kids[node][output[pos[i] + n]]
                n += 1
            accepted[i] = output[pos[i]:pos[i] + n + 1]
            pos[i] = (pos[i] + len(accepted[i])) % len(output)
    for i in range(len(requests)):
        a, b = single.session(f"s{i}"), batched.session(f"s{i}")
        assert (a.tokens.tolist(), a.steps, a.drafted, a.accepted) == (b.tokens.tolist(), b.steps, b.drafted,
                                                                         b.accepted)
        assert a.budget() == b.budget()
    assert list(single.model.accepted) == list(batched.model.accepted)
    assert list(single.model.trials) == list(batched.model.trials)
    assert list(single.dynamic.items()) == list(batched.dynamic.items())  # leaders in the same recency order too


def test_a_single_call_scores_a_draft_the_batch_left_packed():
    single, batched = make(True), make(True)
    prompt, output = corpus(2, 1)[0]
    for d in (single, batched):
        d.start("s", prompt)
    tree = single.draft(single.session("s"), 16)
    sess = batched.session("s")
    out = batched.draft_steps([sess], np.zeros(0, dtype=np.int32), [0, 0], [16], [False])
    assert tuple(out.token_ids) == tree.token_ids
    n, _ = accept_greedy(tree, output)
    ids = np.array(output[:n + 1], dtype=np.int32)
    assert single.correct(single.session("s"), ids) == batched.correct(sess, ids)
    assert list(single.model.trials) == list(batched.model.trials)
    assert (sess.steps, sess.drafted, sess.accepted) == (1, len(tree), n)


def test_the_batch_scores_a_draft_a_single_call_left():
    single, batched = make(True), make(True)
    prompt, output = corpus(3, 1)[0]
    for d in (single, batched):
        d.start("s", prompt)
        d.draft(d.session("s"), 16)  # both drafted by the single path
    n, _ = accept_greedy(single.session("s")._last_tree, output)
    ids = np.array(output[:n + 1], dtype=np.int32)
    confirmed = single.correct(single.session("s"), ids).tokens
    expected = single.draft(single.session("s"), 16)
    sess = batched.session("s")
    assert batched.batchable(sess)
    out = batched.draft_steps([sess], ids, [0, ids.size], [16], [False])
    assert (tuple(out.token_ids), tuple(out.probs), out.confirmed) == (expected.token_ids, expected.probs,
                                                                        [confirmed])
    assert list(single.model.trials) == list(batched.model.trials)


def test_a_step_drafted_on_several_threads_gives_what_one_thread_and_single_calls_give():
    sessions_n = 48  # 8 a thread or more: the step takes 3 threads
    single = make(True)
    threaded = {n: make(True, batch_threads=n) for n in (1, 3)}
    requests = corpus(4, sessions_n)
    for d in (single, *threaded.values()):
        for i, (prompt, _) in enumerate(requests):
            d.start(f"s{i}", prompt)
    runs = native_module().threads()[1]
    accepted: list[list[int]] = [[] for _ in requests]
    pos = [0] * sessions_n
    for _ in range(6):
        for i in range(sessions_n):
            single.correct(single.session(f"s{i}"), np.array(accepted[i], dtype=np.int32))
        expected = [tree_tuple(single.draft(single.session(f"s{i}"), 16))[:3] for i in range(sessions_n)]
        flat = np.array([t for a in accepted for t in a], dtype=np.int32)
        offsets = [0, *np.cumsum([len(a) for a in accepted]).tolist()]
        for n, d in threaded.items():
            sessions = [d.session(f"s{i}") for i in range(sessions_n)]
            out = d.draft_steps(sessions, flat, offsets, [16] * sessions_n, [False] * sessions_n)
            got = [(tuple(out.token_ids[lo:hi]), tuple(out.parents[lo:hi]), tuple(out.probs[lo:hi]))
                   for lo, hi in zip(out.offsets, out.offsets[1:], strict=False)]
            assert got == expected, n
        for i, (_, output) in enumerate(requests):
            n_acc, _ = accept_greedy(single.session(f"s{i}")._last_tree, output[pos[i]:])
            accepted[i] = output[pos[i]:pos[i] + n_acc + 1]
            pos[i] = (pos[i] + len(accepted[i])) % len(output)
    started, shared = native_module().threads()
    assert started >= 2 and shared == runs + 6  # every step of 3 threads drafted on them
    for d in threaded.values():
        assert list(d.dynamic.items()) == list(single.dynamic.items())
        assert list(d.model.trials) == list(single.model.trials)


@pytest.mark.skipif(match_kernels.compiled is None, reason="the store kernels are not built")
def test_a_step_of_many_sessions_brings_lists_far_behind_up_to_date_and_drafts_as_single_calls():
    """A tail past TAIL_LISTS that the lists never covered (requests stored faster than indexing): a lone lookup
    keeps scanning it, a step whose lookups together would scan more than adding it costs brings the lists up to
    date at once; the trees are the same either way."""
    kernels = match_kernels.compiled
    sessions_n = 96
    tail_n = kernels.TAIL_LISTS + 4000  # add_cost 64: 64 lookups' scans of it cost as much as adding it
    rng = np.random.default_rng(7)
    drafters = [Drafter(DrafterConfig(vocab_size=100, capacity=1 << 17, tail_tokens=1 << 30)) for _ in range(2)]
    requests = corpus(5, sessions_n)
    for d in drafters:
        for prompt, output in corpus(0, 30):
            d.ingest(prompt, output)
        d.rebuild()
    stored = 0
    while stored < tail_n:
        prompt, output = corpus(int(rng.integers(10, 1000)), 1)[0]
        for d in drafters:
            d.ingest(prompt, output)
        stored += len(prompt) + len(output) + 1
    batched, single = drafters
    tail = batched.store._tail
    assert batched.store.unindexed > kernels.TAIL_LISTS and tail.end < batched.store.ring.end
    for d in drafters:
        for i, (prompt, _) in enumerate(requests):
            d.start(f"s{i}", prompt)
    expected = [tree_tuple(single.draft(single.session(f"s{i}"), 16))[:3] for i in range(sessions_n)]
    assert single.store._tail.end < single.store.ring.end  # each lone lookup scanned
    sessions = [batched.session(f"s{i}") for i in range(sessions_n)]
    out = batched.draft_steps(sessions, np.zeros(0, np.int32), [0] * (sessions_n + 1), [16] * sessions_n,
                              [False] * sessions_n)
    assert tail.end == batched.store.ring.end  # brought up to date once, before the step's lookups
    got = [(tuple(out.token_ids[lo:hi]), tuple(out.parents[lo:hi]), tuple(out.probs[lo:hi]))
           for lo, hi in zip(out.offsets, out.offsets[1:], strict=False)]
    assert got == expected

"""The drafting core: sources, budgets, corrections, errors; small hand-built cases with expected drafts."""

import numpy as np
import pytest

from drafter_service.api.errors import AlreadyExists, InvalidArgument, NotFound
from drafter_service.api.tree import accept_greedy
from drafter_service.core.config import DrafterConfig
from drafter_service.core.drafter import Drafter
from store.corpus_counts import build_frozen_table


def make(**kw) -> Drafter:
    return Drafter(DrafterConfig(vocab_size=1000, capacity=4096, tail_tokens=64, **kw))


def best_path(tree) -> list[int]:
    """Follow the most likely child from the root."""
    kids = tree.children()
    node, path = -1, []
    while kids.get(node):
        node = max(kids[node].values(), key=lambda i: tree.probs[i])
        path.append(tree.token_ids[node])
    return path


def test_empty_store_and_unseen_context_give_empty_tree():
    d = make()
    d.start("s", [7])
    assert len(d.propose("s")) == 0
    d.ingest([1, 2, 3], [4, 5])
    d.start("t", [999])  # token never seen anywhere
    assert len(d.propose("t")) == 0


def test_prompt_lookup_drafts_what_followed_the_same_tokens_in_the_prompt():
    d = make(use_store=False, use_dynamic=False)
    d.start("s", [1, 2, 3, 4, 5, 6, 9, 1, 2, 3])
    tree = d.propose("s")
    tree.check_invariants(max_nodes=32)
    assert best_path(tree)[:4] == [4, 5, 6, 9]  # the prompt went on 4 5 6 9 after "1 2 3"


def test_store_drafts_the_continuation_of_an_earlier_request():
    d = make(use_session=False, use_dynamic=False)
    d.ingest([10, 11, 12], [13, 14, 15, 16])
    d.start("s", [50, 11, 12])
    tree = d.propose("s")
    assert best_path(tree) == [13, 14, 15, 16]  # stops at the end of the stored request
    d.rebuild()  # same answer once the request is indexed instead of scanned
    d.start("t", [50, 11, 12])
    assert best_path(d.propose("t")) == [13, 14, 15, 16]


def test_store_prefers_the_more_frequent_continuation():
    d = make(use_session=False, use_dynamic=False, use_repeat=False)  # the repeat cache offers the latest output
    for out in ([5, 6], [5, 6], [5, 7]):
        d.ingest([1, 2], out)
    d.start("s", [1, 2])
    tree = d.propose("s")
    kids = tree.children()
    five = kids[-1][5]
    assert tree.probs[kids[five][6]] > tree.probs[kids[five][7]]


def test_dynamic_table_learns_from_the_prompt_and_accepted_tokens():
    d = make(use_session=False, use_store=False)
    d.start("s", [3, 4, 5, 6])
    d.extend("s", [3])  # sequence now ends with 3; the table saw 3 -> (4, 5, 6)
    assert best_path(d.propose("s"))[:3] == [4, 5, 6]
    assert d.dynamic.query((3,))[0] == ((4, 5, 6), 1)


def test_frozen_table_is_used_when_nothing_else_knows():
    d = make(use_session=False, use_store=False, use_dynamic=False)
    d.add_frozen("corpus", build_frozen_table([[8, 1, 2, 3, 8, 1, 2, 3]]))
    d.start("s", [8])
    assert best_path(d.propose("s"))[:3] == [1, 2, 3]


def test_budget_depth_and_invariants_hold_for_every_budget():
    d = make(adaptive_budget=False, max_depth=5)
    rng = np.random.default_rng(0)
    for _ in range(20):
        d.ingest(rng.integers(0, 6, 30), rng.integers(0, 6, 30))
    d.start("s", rng.integers(0, 6, 20))
    for budget in (1, 2, 8, 32):
        tree = d.propose("s", budget)
        tree.check_invariants(max_nodes=budget, max_depth=5)
        assert len(tree) == budget  # plenty of candidates in a 6-token vocabulary
    assert len(d.propose("s", 0)) == d.config.max_nodes  # 0 means the session's default


def test_adaptive_budget_shrinks_after_rejections_and_grows_after_acceptances():
    d = make(min_nodes=4, max_nodes=32)
    sess = d.start("s", [1, 2, 3])
    for _ in range(20):  # every draft rejected
        sess.remember(*_chain_tree([8, 8]))
        d.extend("s", [9])
    assert sess.budget() == 4
    for _ in range(20):  # four draft tokens accepted each step
        sess.remember(*_chain_tree([7, 7, 7, 7]))
        d.extend("s", [7, 7, 7, 7, 7])
    assert sess.budget() == 32


def _chain_tree(tokens):
    from drafter_service.api.tree import chain
    tree = chain(tokens, [0.5] * len(tokens))
    return tree, (list(range(len(tokens) + 1)), list(range(len(tokens))), [0.5] * len(tokens))


def test_correction_records_which_nodes_were_accepted():
    d = make()
    sess = d.start("s", [1, 2, 3])
    sess.remember(*_chain_tree([4, 5, 6]))
    assert d.extend("s", [4, 5, 9]) == 2  # 4 and 5 confirmed, 6 rejected (9 came instead)
    stats = d.model.snapshot()
    assert stats[0] == pytest.approx((0.5 * d.model.prior_strength + 1, d.model.prior_strength + 1))
    assert stats[2] == pytest.approx((0.5 * d.model.prior_strength, d.model.prior_strength + 1))  # rejected
    assert sess.tokens.tolist() == [1, 2, 3, 4, 5, 9]


def test_end_ingests_prompt_and_output_into_the_store():
    d = make()
    d.start("s", [1, 2, 3])
    d.extend("s", [4, 5])
    d.end("s", [6])
    assert d.store.ring.read(0, 6).tolist() == [1, 2, 3, 4, 5, 6]
    with pytest.raises(NotFound):
        d.propose("s")


def test_bad_input_is_refused_and_changes_nothing():
    d = make()
    d.ingest([1, 2], [3])
    before = (d.store.ring.end, len(d.dynamic))
    with pytest.raises(InvalidArgument, match="1000"):
        d.ingest([1, 2], [1000])
    with pytest.raises(InvalidArgument, match="-1"):
        d.start("s", [-1])
    with pytest.raises(InvalidArgument):
        d.ingest([], [])
    assert (d.store.ring.end, len(d.dynamic)) == before
    assert "s" not in d.sessions
    d.start("s", [1])
    with pytest.raises(AlreadyExists):
        d.start("s", [1])
    with pytest.raises(InvalidArgument):
        d.extend("s", [5000])
    assert d.session("s").tokens.tolist() == [1]
    with pytest.raises(InvalidArgument):
        d.propose("s", -1)
    with pytest.raises(NotFound):
        d.extend("nope", [1])
    d.check_invariants()


def test_repeated_request_is_drafted_whole():
    d = make(adaptive_budget=False)
    prompt, output = list(range(100, 120)), list(range(200, 260))
    d.ingest(prompt, output)
    d.start("s", prompt)
    steps, pos = 0, 0
    while pos < len(output):
        tree = d.propose("s", 32)
        n, _ = accept_greedy(tree, output[pos:])
        adv = min(n + 1, len(output) - pos)
        d.extend("s", output[pos:pos + adv])
        pos += adv
        steps += 1
    assert steps <= 3  # 60 tokens at up to 24 deep + 1 per step

"""The exact-match cache of repeated prompts: the cache itself, and drafts of a request whose prompt was seen."""

import numpy as np
import pytest

from drafter_service.api.tree import accept_greedy
from drafter_service.core.config import DrafterConfig
from drafter_service.core.drafter import Drafter
from drafter_service.core.repeat_cache import RepeatCache


def arr(*ids: int) -> np.ndarray:
    return np.array(ids, dtype=np.int32)


def make(**kw) -> Drafter:
    return Drafter(DrafterConfig(vocab_size=1000, capacity=1 << 14, tail_tokens=64, **kw))


# -- the cache ------------------------------------------------------------------------------------------------

def test_lookup_finds_only_the_exact_prompt():
    c = RepeatCache()
    c.remember(arr(1, 2, 3), arr(4, 5))
    assert c.lookup(arr(1, 2, 3)).tolist() == [4, 5]
    assert c.lookup(arr(1, 2)) is None
    assert c.lookup(arr(1, 2, 3, 4)) is None
    assert c.lookup(arr(3, 2, 1)) is None
    assert c.hits == 1
    c.check_invariants()


def test_a_later_output_replaces_the_earlier_one():
    c = RepeatCache()
    c.remember(arr(1, 2), arr(3, 4, 5))
    c.remember(arr(1, 2), arr(6))
    assert c.lookup(arr(1, 2)).tolist() == [6]
    assert c.tokens == 1 and len(c) == 1
    c.check_invariants()


def test_least_recently_used_prompts_are_evicted_to_stay_within_the_token_budget():
    c = RepeatCache(max_tokens=5)
    c.remember(arr(1), arr(10, 11))
    c.remember(arr(2), arr(20, 21))
    assert c.lookup(arr(1)) is not None  # 1 is now the most recent
    c.remember(arr(3), arr(30, 31))  # 6 tokens: the least recent (2) goes
    assert c.lookup(arr(2)) is None
    assert c.lookup(arr(1)).tolist() == [10, 11] and c.lookup(arr(3)).tolist() == [30, 31]
    assert c.tokens == 4
    c.check_invariants()


def test_outputs_are_cut_to_max_output_and_empty_requests_are_ignored():
    c = RepeatCache(max_output=3)
    c.remember(arr(1), arr(5, 6, 7, 8))
    c.remember(arr(), arr(5))
    c.remember(arr(2), arr())
    assert c.lookup(arr(1)).tolist() == [5, 6, 7]
    assert len(c) == 1


def test_branch_probabilities_follow_the_learnt_continuation_rate():
    c = RepeatCache()
    assert c.continue_prob == pytest.approx(0.9)  # the Beta(9, 1) prior
    c.record(accepted=10, rejected=False)
    assert c.continue_prob == pytest.approx(19 / 20)
    c.record(accepted=0, rejected=True)
    assert c.continue_prob == pytest.approx(19 / 21)
    q = 19 / 21
    tree = c.branch(arr(4, 5, 6, 7), 1, 2)
    assert tree.token_ids == (5, 6) and tree.parents == (-1, 0)
    assert tree.probs == pytest.approx((q, q * q)) and tree.sources == ("repeat", "repeat")
    assert len(c.branch(arr(4, 5), 2, 8)) == 0


# -- drafting -------------------------------------------------------------------------------------------------

def test_a_repeated_prompt_gets_the_stored_output_as_its_first_branch():
    d = make()
    prompt = list(range(100, 120))
    output = list(range(500, 560))
    d.add_document(np.array(prompt + output, dtype=np.int32), prompt_len=len(prompt))
    d.start("s", prompt)
    tree = d.propose("s", 16)
    tree.check_invariants(max_nodes=16)
    assert [tree.token_ids[i] for i in range(16) if tree.sources[i] == "repeat"] == output[:16]
    assert tree.children()[-1][output[0]] == 0  # the first node is the branch's
    assert d.repeats.hits == 1


def test_a_greedy_replay_of_a_repeated_request_takes_one_step_per_budget():
    d = make()
    prompt = [7, 8, 9]
    output = [int(t) for t in np.random.default_rng(0).integers(0, 1000, 200)]
    d.add_document(np.array(prompt + output, dtype=np.int32), prompt_len=len(prompt))
    d.start("s", prompt)
    budget, pos, steps = 16, 0, 0
    while pos < len(output):
        tree = d.propose("s", budget)
        n_acc, _ = accept_greedy(tree, output[pos:])
        take = output[pos:pos + n_acc + 1]  # accepted draft tokens plus the target's own
        assert d.extend("s", take) == n_acc
        pos += len(take)
        steps += 1
    assert steps == -(-len(output) // (budget + 1))  # every step takes a full budget plus the bonus token
    d.check_invariants()


def test_the_branch_is_dropped_once_the_output_leaves_the_stored_one():
    d = make(use_session=False, use_store=False, use_dynamic=False)
    d.add_document(arr(1, 2, 3, 40, 41, 42, 43, 44), prompt_len=3)
    d.start("s", [1, 2, 3])
    assert d.propose("s", 4).token_ids == (40, 41, 42, 43)
    d.extend("s", [40, 99])  # one draft token accepted, then the target chose 99
    assert d.repeats.continue_prob == pytest.approx((9 + 1) / (10 + 2))
    assert len(d.propose("s", 4)) == 0
    d.extend("s", [42])  # it does not come back, even when a later token happens to match
    assert len(d.propose("s", 4)) == 0


def test_a_finished_session_is_remembered_for_the_next_request_with_its_prompt():
    d = make()
    d.start("a", [5, 6, 7])
    d.propose("a")
    d.extend("a", [8, 9])
    d.end("a", [10])
    d.start("b", [5, 6, 7])
    assert d.propose("b", 3).token_ids[:3] == (8, 9, 10)
    assert d.propose("b", 3).sources[:3] == ("repeat",) * 3


def test_repeat_can_be_switched_off():
    d = make(use_repeat=False, use_session=False, use_store=False, use_dynamic=False)
    d.add_document(arr(1, 2, 3, 40, 41), prompt_len=3)
    d.start("s", [1, 2, 3])
    assert len(d.propose("s")) == 0
    assert len(d.repeats) == 0


def test_saved_entries_load_back_in_order_and_within_the_bounds():
    cache = RepeatCache(max_tokens=100, max_output=8)
    for i in range(12):
        cache.remember(arr(i, i + 1), np.arange(i % 5 + 1, dtype=np.int32) + 10 * i)
    cache.lookup(arr(3, 4))  # a hit: the least recently used order changes
    saved = cache.saved()
    assert saved["repeat_digests"].shape == (len(cache), 16) and saved["repeat_tokens"].size == cache.tokens
    copy = RepeatCache(max_tokens=100, max_output=8)
    assert copy.load(saved) == len(cache)
    copy.check_invariants()
    assert [k.tobytes() for k in copy.saved()["repeat_digests"]] == [k.tobytes() for k in saved["repeat_digests"]]
    for i in range(12):
        got, want = copy.lookup(arr(i, i + 1)), cache.lookup(arr(i, i + 1))
        assert (got is None and want is None) or (got is not None and want is not None and got.tolist() ==
                                                  want.tolist() and not got.flags.writeable)
    small = RepeatCache(max_tokens=6, max_output=2)
    small.load(saved)  # cut as remember cuts: outputs to max_output, the oldest dropped to max_tokens
    small.check_invariants()
    assert small.tokens <= 6 and small.lookup(arr(3, 4)) is not None  # the most recently used survives
    with pytest.raises(ValueError):
        copy.load({**saved, "repeat_lengths": saved["repeat_lengths"] + 1})
    empty = RepeatCache()
    assert empty.load(empty.saved()) == 0

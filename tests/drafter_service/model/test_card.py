"""One session's draft-model cache on its worker thread: calibration, cache hits, vocabulary, shutdown."""

from __future__ import annotations

import time

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from drafter_service.core.config import CardSettings  # noqa: E402
from drafter_service.model.card import DraftModelDrafts, ProbabilityCalibration  # noqa: E402

PROMPT = [3, 17, 5, 9, 22, 5]



def settled(session, timeout: float = 10.0):
    session.settle(timeout)
    assert not session.cache.wants_growth()
    return session


def test_calibration_follows_the_outcomes():
    cal = ProbabilityCalibration(prior=4.0)
    assert cal.rate(0.95) == pytest.approx(0.95)
    cal.record([(0.95, False)] * 96)
    assert cal.rate(0.95) == pytest.approx(0.95 * 4 / 100)
    assert cal.rate(0.05) == pytest.approx(0.05)  # other buckets untouched


def test_calibration_keeps_the_order_of_probabilities_within_a_bucket():
    cal = ProbabilityCalibration(prior=4.0)
    cal.record([(0.15, True)] * 30 + [(0.15, False)] * 70 + [(0.25, True)] * 40 + [(0.25, False)] * 60)
    assert cal.rate(0.15) == pytest.approx((4 * 0.15 + 30) / 104)  # a midpoint: its bucket's own rate
    assert cal.rate(0.12) < cal.rate(0.15) < cal.rate(0.19) < cal.rate(0.25)
    assert cal.rate(0.20) == pytest.approx((cal.rate(0.15) + cal.rate(0.25)) / 2)


def test_a_step_through_the_cache_is_a_hit_and_a_step_beside_it_is_not(model):
    drafts = DraftModelDrafts(model, CardSettings(width=6, top_k=3, layers_ahead=3))
    session = settled(drafts.open(PROMPT))
    try:
        assert session.correct([7]) is None  # nothing was served yet
        tree = settled(session).query(8)
        tree.check_invariants(max_nodes=8)
        assert set(tree.sources) == {"model"}
        path = tree.path(max(range(len(tree)), key=lambda i: (len(tree.path(i)), tree.probs[i])))
        assert session.correct(path + [0]) is True  # every accepted draft token lay in the cache
        tree = settled(session).query(8)
        wrong = next(t for t in range(40) if t not in {tree.token_ids[i] for i in range(len(tree))
                                                         if tree.parents[i] < 0})
        assert session.correct([wrong]) is False
    finally:
        drafts.close(session)
    assert not session.alive and drafts.open_sessions == 0


def test_a_step_that_accepted_nothing_still_teaches_the_calibration(model):
    drafts = DraftModelDrafts(model, CardSettings(width=6, top_k=3, layers_ahead=3))
    session = settled(drafts.open(PROMPT))
    try:
        tree = session.query(8)
        roots = {tree.token_ids[i] for i in range(len(tree)) if tree.parents[i] < 0}
        wrong = next(t for t in range(40) if t not in roots)
        before = [session.calibration.rate((b + 0.5) / 10) for b in range(10)]
        assert session.correct([wrong]) is False  # nothing accepted, and no served token was the true one
        after = [session.calibration.rate((b + 0.5) / 10) for b in range(10)]
        assert all(a <= b for a, b in zip(after, before, strict=True)) and after != before
    finally:
        drafts.close(session)


def test_vocabulary_follows_the_frequencies(model):
    drafts = DraftModelDrafts(model, CardSettings(width=6, top_k=2, layers_ahead=2, vocab=5))
    drafts.set_frequencies(np.array([11, 11, 11, 12, 12, 13, 14, 15, 15, 16] * 10))
    session = settled(drafts.open(PROMPT))
    try:
        tree = session.query(50)
        assert len(tree) and set(tree.token_ids) <= {11, 12, 13, 14, 15}
    finally:
        drafts.close(session)


def test_vocabulary_stays_whole_until_enough_tokens_were_seen(model):
    trees = []
    for vocab in (0, 5):
        drafts = DraftModelDrafts(model, CardSettings(width=6, top_k=2, layers_ahead=2, vocab=vocab))
        drafts.set_frequencies(np.array([11, 11, 12, 13] * 10))  # 3 distinct tokens: too few to choose 5 from
        session = settled(drafts.open(PROMPT))
        try:
            trees.append(session.query(50))
        finally:
            drafts.close(session)
    assert len(trees[0]) and trees[1] == trees[0]  # the same drafts as over the whole vocabulary


def test_closing_stops_the_worker_promptly(model):
    drafts = DraftModelDrafts(model, CardSettings(width=4, top_k=2, layers_ahead=500, max_nodes=100_000))
    session = drafts.open(PROMPT)
    time.sleep(0.05)  # mid-growth
    t0 = time.monotonic()
    drafts.close(session)
    assert not session.alive and time.monotonic() - t0 < 2.0


@pytest.mark.parametrize(("own", "device", "expected"), [
    (0, "cpu", (1, 1, 8192)),  # may share every CPU with an engine: one thread, SCHED_IDLE, a small head
    (3, "cpu", (3, 0, 8192)),  # confined to 3 CPUs of its own: a thread per CPU at normal priority
    (0, "cuda", (0, 0, 0)),  # on a GPU: torch's threads, whole vocabulary
])
def test_automatic_settings_follow_the_machine(monkeypatch, own, device, expected):
    import drafter_service.model.card as card_module
    from drafter_service.core.config import DraftModelSpec

    monkeypatch.setattr(card_module, "own_cpus", lambda: own)
    spec = card_module.for_this_machine(DraftModelSpec("default", "somewhere", device=device))
    assert (spec.threads, spec.card.idle_priority, spec.card.vocab) == expected
    chosen = card_module.for_this_machine(DraftModelSpec("default", "somewhere", device=device, threads=2,
                                                         card=CardSettings(idle_priority=0, vocab=100)))
    assert (chosen.threads, chosen.card.idle_priority, chosen.card.vocab) == (2, 0, 100)  # what is set stays

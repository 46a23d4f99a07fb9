"""Packed DraftBatch steps: one run without a step object per session, or the general path when they need it."""

from __future__ import annotations

import numpy as np
import pytest

from drafter_service.core.config import DrafterConfig
from drafter_service.service.batch import PackedSteps
from drafter_service.service.config import ServiceConfig
from drafter_service.service.service import DrafterService


def service_with_sessions(n: int) -> DrafterService:
    service = DrafterService(ServiceConfig(drafter=DrafterConfig(capacity=1 << 14), default_vocab_size=64))
    service.ingest("", [([1, 2, 3], [4, 5, 6, 1, 2, 3, 4], "")])
    for i in range(n):
        service.start_session("", f"s{i}", [7, 1, 2, 3])  # no stored prompt like it: no repeat to follow
    return service


def packed(steps: list[tuple[str, list[int]]]) -> PackedSteps:
    counts = [len(a) for _, a in steps]
    return PackedSteps([s for s, _ in steps], np.array([t for _, a in steps for t in a], np.int32),
                       [0, *np.cumsum(counts).tolist()], [0] * len(steps), [False] * len(steps))


def test_packed_steps_of_live_batchable_sessions_take_one_run_and_not_the_general_path(monkeypatch):
    service = service_with_sessions(3)
    monkeypatch.setattr(service, "_batch_steps", lambda *a, **k: pytest.fail("took the general path"))
    out = service.draft_batch([], [], [], max_nodes=8, accepted_bounds=(1, 4),
                              packed=packed([("s0", [4]), ("s1", [4, 5]), ("s2", [])]))
    assert not out.step_errors and len(out.tree_offsets) == 4 and out.tree_offsets[-1] > 0


@pytest.mark.parametrize("steps", [[("s0", [4]), ("nobody", [4])], [("s1", [4]), ("s1", [5])]])
def test_packed_steps_that_need_more_take_the_general_path_with_nothing_done_before(monkeypatch, steps):
    service = service_with_sessions(2)
    taken = []
    general = service._batch_steps
    monkeypatch.setattr(service, "_batch_steps", lambda *a, **k: taken.append(1) or general(*a, **k))
    out = service.draft_batch([], [], [], max_nodes=8, accepted_bounds=(4, 5), packed=packed(steps))
    assert taken == [1] and len(out.tree_offsets) == 3
    assert [len(service.sessions.get(service.auth.caller((), ""), f"s{i}")[1]) for i in range(2)] == \
        [4 + sum(len(a) for s, a in steps if s == f"s{i}") for i in range(2)]  # each step applied once


def test_a_session_the_core_cannot_batch_among_packed_steps_is_drafted_alone_in_its_place(monkeypatch):
    """s1 has the prompt of a stored request, so it follows that request's output (no batched step for it): the
    packed run drafts it alone and places its tree between the others, as the general path does."""
    fast, general = service_with_sessions(3), service_with_sessions(3)
    for service in (fast, general):
        service.start_session("", "repeat", [1, 2, 3])
    steps = [("s0", [4]), ("repeat", [4, 5]), ("s1", [4]), ("s2", [])]
    monkeypatch.setattr(fast, "_batch_steps", lambda *a, **k: pytest.fail("took the general path"))
    got = fast.draft_batch([], [], [], max_nodes=8, accepted_bounds=(4, 5), packed=packed(steps))
    want = general.draft_batch([], packed(steps).steps(), [], max_nodes=8, accepted_bounds=(4, 5))
    assert (got.tree_offsets, got.confirmed) == (want.tree_offsets, want.confirmed)
    assert all(np.array_equal(a, b) for a, b in zip(got.nodes(), want.nodes(), strict=True))
    assert want.tree_offsets[2] > want.tree_offsets[1]  # the repeated output was offered

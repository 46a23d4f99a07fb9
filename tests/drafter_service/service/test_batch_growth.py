"""A DraftBatch that names one session twice: each step's growth counts against ``max_request_tokens``."""

from __future__ import annotations

import numpy as np

from drafter_service.api.errors import InvalidArgument
from drafter_service.core.config import DrafterConfig
from drafter_service.service.config import ServiceConfig
from drafter_service.service.service import DrafterService


def test_one_session_twice_in_a_batch_cannot_grow_past_the_request_limit_and_still_ends():
    service = DrafterService(ServiceConfig(drafter=DrafterConfig(capacity=1 << 14), default_vocab_size=64,
                                           max_request_tokens=10))
    service.start_session("", "s", [1, 2, 3])
    steps = [("s", np.array([4] * 6, np.int32), 8, False), ("s", np.array([5] * 6, np.int32), 8, False)]
    out = service.draft_batch([], steps, [], accepted_bounds=(4, 5))
    assert [i for i, _ in out.step_errors] == [1]  # 6 then 12 output tokens: the second is over the limit of 10
    assert isinstance(out.step_errors[0][1], InvalidArgument)
    assert service.end_session("s", []) == 3 + 6  # the session held what was accepted, and ends

"""The in-process batched steps of ``drafter bench batch --core``: greedy replay, turnover and what is stored."""

from __future__ import annotations

import numpy as np

from drafter_service.bench.batch_bench import _core_block, _time_paths
from drafter_service.core.config import DrafterConfig
from drafter_service.core.drafter import Drafter
from drafter_service.datasets.request_files import Request


def test_core_steps_replay_each_output_and_store_every_finished_request_whole() -> None:
    rng = np.random.default_rng(0)
    pool = [Request(f"r{i}", rng.integers(0, 50, 30).astype(np.int32), rng.integers(0, 50, 12).astype(np.int32))
            for i in range(12)]
    drafter = Drafter(DrafterConfig(vocab_size=64, capacity=1 << 14))
    slots = [[drafter.start(f"s{k}", pool[k].prompt), pool[k].output.tolist(), 0, np.zeros(0, np.int32)]
             for k in range(3)]
    times, used = _core_block(drafter, slots, budget=8, steps=20, pool=pool, next_request=3)
    assert len(times) == 20 and all(t > 0 for t in times)
    # each step accepts at least the target's own token: a 12-token output ends within 12 steps, so 20 steps
    # finish at least the first 3 requests and the ones that replaced them started
    assert used >= 6 and drafter.store.ring.documents >= 3
    held = drafter.store.ring.read(drafter.store.ring.oldest, drafter.store.ring.end)
    docs = [d[d >= 0] for d in np.split(held, np.flatnonzero(held < 0))]  # documents end with a separator
    docs = [d for d in docs if d.size]
    wanted = {tuple(np.concatenate([r.prompt, r.output]).tolist()) for r in pool}
    assert docs and all(tuple(d.tolist()) in wanted for d in docs)  # stored as prompt + the whole output
    assert len(drafter.sessions) == 3  # every finished session was replaced


class _RecordingEngine:
    """Stands for an Engine: records when its client drafts and when it advances."""

    def __init__(self, name: str, log: list[str]) -> None:
        self.name, self.log = name, log
        self.client = self

    def items(self) -> list[tuple[str, list[int]]]:
        return [("s", [])]

    def draft_batch(self, items, budget):
        self.log.append(self.name)
        return []

    def advance(self, trees) -> None:
        self.log.append(f"{self.name} advanced")


def test_batched_paths_step_in_turn_each_first_in_its_turn_and_each_timed_every_step() -> None:
    log: list[str] = []
    engines = [("batch", _RecordingEngine("a", log)), ("batch", _RecordingEngine("b", log)),
               ("batch", _RecordingEngine("c", log))]
    times = _time_paths(engines, budget=4, steps=3)  # type: ignore[arg-type]
    assert [len(t) for t in times] == [3, 3, 3]  # two warm-up steps are not timed
    drafts = [e for e in log if not e.endswith("advanced")]
    assert drafts == ["a", "b", "c", "b", "c", "a", "c", "a", "b", "a", "b", "c", "b", "c", "a"]
    assert all(log[i + 1] == f"{log[i]} advanced" for i in range(0, len(log), 2))  # each step accepted at once

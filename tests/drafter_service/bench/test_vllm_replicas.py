"""Tests of ``drafter bench vllm --replicas``'s dealing and summing (no vLLM needed)."""

from __future__ import annotations

import argparse

import pytest

from drafter_service.bench.vllm_bench import MethodRun, format_runs
from drafter_service.bench.vllm_engine import COUNTERS
from drafter_service.bench.vllm_process import Generation
from drafter_service.bench.vllm_replicas import EngineGroup, combine, cpu_binds, deal, sum_figures, undeal


@pytest.mark.parametrize("n", [1, 2, 3, 7])
@pytest.mark.parametrize("total", [0, 1, 5, 16])
def test_deal_sends_item_i_to_hand_i_mod_n_and_undeal_restores_the_order(total: int, n: int) -> None:
    items = list(range(total))
    hands = deal(items, n)
    assert len(hands) == n
    for h, hand in enumerate(hands):
        assert hand == [i for i in items if i % n == h]
    assert undeal(hands) == items


def test_deal_needs_a_hand() -> None:
    with pytest.raises(ValueError):
        deal([1, 2], 0)


def _gen(outputs: list[list[int]], seconds: float, **counters: float) -> Generation:
    full = dict.fromkeys(COUNTERS, 0.0)
    full.update({f"vllm:{k}": v for k, v in counters.items()})
    return Generation(outputs, seconds, full)


def test_combine_joins_outputs_in_prompt_order_sums_counters_and_takes_the_slowest() -> None:
    a = _gen([[10], [12]], 2.0, generation_tokens=30, spec_decode_num_accepted_tokens=10)
    b = _gen([[11], [13]], 3.0, generation_tokens=20, spec_decode_num_accepted_tokens=4)
    g = combine([a, b])
    assert g.outputs == [[10], [11], [12], [13]]
    assert g.seconds == 3.0
    assert g.counters["vllm:generation_tokens"] == 50
    assert g.counters["vllm:spec_decode_num_accepted_tokens"] == 14


def test_summed_deltas_give_tokens_per_step_over_both_engines() -> None:
    """Cumulative counters summed before and after: their difference is the sum of each engine's difference."""
    before = combine([_gen([], 0, generation_tokens=100, spec_decode_num_accepted_tokens=40),
                      _gen([], 0, generation_tokens=80, spec_decode_num_accepted_tokens=20)])
    after = combine([_gen([], 0, generation_tokens=200, spec_decode_num_accepted_tokens=90),  # +100, +50
                     _gen([], 0, generation_tokens=180, spec_decode_num_accepted_tokens=50)])  # +100, +30
    generated = after.counters["vllm:generation_tokens"] - before.counters["vllm:generation_tokens"]
    accepted = after.counters["vllm:spec_decode_num_accepted_tokens"] - before.counters[
        "vllm:spec_decode_num_accepted_tokens"]
    run = MethodRun("drafter", "w", int(generated), 0, 0, int(accepted), 1.0, True, None, replicas=2)
    assert run.tokens_per_step == pytest.approx(200 / (200 - 80))


def test_sum_figures_adds_numbers_key_by_key() -> None:
    assert sum_figures([{"steps": 3, "seconds": 0.5}, {"steps": 2, "sync_waits": 1}, {}]) == {
        "steps": 5, "seconds": 0.5, "sync_waits": 1}


def test_cpu_binds_split_the_cpus_among_engines() -> None:
    assert cpu_binds(1, [0, 1]) == [None]
    assert cpu_binds(2, [0, 1]) == ["0", "1"]
    assert cpu_binds(2, [0, 1, 2]) == ["0,1", "2"]
    assert cpu_binds(3, [0, 1]) == [None, None, None]


class _FakeEngine:
    """Stands in for ``VllmEngineProcess``: echoes each prompt's first token, counts generated tokens."""

    def __init__(self, tag: int) -> None:
        self.tag, self.total, self.seen = tag, 0.0, []

    def generate(self, prompts: list[list[int]], max_tokens: int) -> Generation:
        self.seen += [p[0] for p in prompts]
        self.total += max_tokens * len(prompts)
        return _gen([[p[0], self.tag] for p in prompts], 1.0, generation_tokens=self.total)

    def close(self) -> None:
        pass


def test_engine_group_deals_prompts_and_keeps_an_idle_engines_counters() -> None:
    group = EngineGroup.__new__(EngineGroup)
    group.engines = [_FakeEngine(0), _FakeEngine(1)]  # type: ignore[list-item]
    group._last = [dict.fromkeys(COUNTERS, 0.0) for _ in group.engines]
    g = group.generate([[5], [6], [7]], 4)
    assert g.outputs == [[5, 0], [6, 1], [7, 0]]
    assert [e.seen for e in group.engines] == [[5, 7], [6]]  # type: ignore[attr-defined]
    assert g.counters["vllm:generation_tokens"] == 12
    g = group.generate([[8]], 4)  # engine 1 is dealt nothing and keeps its 4 tokens
    assert g.outputs == [[8, 0]]
    assert g.counters["vllm:generation_tokens"] == 12 + 4


def test_format_runs_has_a_replicas_column_and_no_verdict_without_reference() -> None:
    args = argparse.Namespace(k=8, requests=2, warm=2, max_tokens=16, replicas=2)
    runs = [MethodRun("suffix", "w", 100, 10, 40, 20, 1.0, None, None, replicas=2),
            MethodRun("drafter", "w", 100, 10, 40, 50, 1.0, True, 1.0, replicas=2)]
    table = format_runs(runs, args)
    assert "| method | replicas |" in table
    assert "| suffix | 2 |" in table and table.splitlines()[-2].endswith("| - |")
    assert "| drafter | 2 |" in table and "| 1.60x |" in table and table.splitlines()[-1].endswith("| yes |")
    assert "dealt round robin to 2 engines" in table

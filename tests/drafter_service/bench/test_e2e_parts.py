"""Parts of `drafter bench e2e`: the step-cost probe, the dtype choice, random-token prompts, fixed budgets."""

import argparse

import numpy as np
import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from drafter_service.bench.e2e import fixed_budgets, method_order, settling_prompts
from drafter_service.bench.e2e_prompts import RANDOM_PROMPT_TOKENS, RANDOM_TOKEN_IDS, load_prompts
from drafter_service.bench.step_costs import fastest_dtype, format_curve, measure_step_curve


def tiny(dtype=torch.float32):
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512)
    return LlamaForCausalLM(config).to(dtype).eval()


def test_step_curve_times_every_size_and_leaves_the_model_usable():
    model = tiny()
    curve = measure_step_curve(model, (0, 1, 4, 16), context=32, repeats=2)
    assert list(curve) == [0, 1, 4, 16] and all(t > 0 for t in curve.values())
    line = format_curve(curve)
    assert line.startswith("t(n): 0: ") and "16: " in line


def test_fastest_dtype_is_the_one_with_the_quickest_plain_step(monkeypatch):
    made = []

    def load(dtype):
        made.append(dtype)
        return tiny(dtype)

    best, times = fastest_dtype(load)
    assert made == [torch.bfloat16, torch.float32] and set(times) == set(made)
    assert times[best] == min(times.values())


def test_random_prompts_are_reproducible_and_skip_like_the_others():
    first = load_prompts("random", 3)
    again = load_prompts("random", 2, skip=1)
    assert [p.prompt_id for p in again] == [p.prompt_id for p in first[1:]]
    assert all(np.array_equal(a.token_ids, b.token_ids) for a, b in zip(again, first[1:], strict=True))
    for p in first:
        assert p.token_ids.dtype == np.int32 and p.token_ids.size == RANDOM_PROMPT_TOKENS
        assert RANDOM_TOKEN_IDS[0] <= p.token_ids.min() and p.token_ids.max() < RANDOM_TOKEN_IDS[1]
    assert not np.array_equal(first[0].token_ids, first[1].token_ids)


def test_fixed_budgets_parse_and_run_after_drafter():
    assert fixed_budgets(argparse.Namespace(fixed_budgets="8,0, 2,8")) == [0, 2, 8]
    assert fixed_budgets(argparse.Namespace(fixed_budgets="")) == []
    for bad in ("4,x", "-1"):
        with pytest.raises(SystemExit):
            fixed_budgets(argparse.Namespace(fixed_budgets=bad))
    order = sorted(["fixed-16", "hf", "fixed-2", "drafter", "greedy"], key=method_order)
    assert order == ["greedy", "drafter", "fixed-2", "fixed-16", "hf"]


def test_engines_settle_on_the_last_warm_requests():
    warm = load_prompts("random", 5)
    assert [p.prompt_id for p in settling_prompts(warm, 2)] == [p.prompt_id for p in warm[-2:]]
    assert settling_prompts(warm, 0) == []
    assert len(settling_prompts(warm, 9)) == 5
    with pytest.raises(SystemExit, match="--engine-warm"):
        settling_prompts(warm, -1)

"""Tests of the chat prompts built from GSM8K and HumanEval questions."""

from __future__ import annotations

import pytest

from drafter_service.bench import e2e_prompts
from drafter_service.datasets.prompts import MAX_QUESTION_TOKENS, load_prompts
from drafter_service.datasets.target_model import chat_prompt
from drafter_service.datasets.tokenizer import load_smollm2_tokenizer


def test_prompts_are_chat_formatted_in_source_order() -> None:
    prompts = load_prompts("gsm8k", 5)
    assert [p.prompt_id for p in prompts] == [f"gsm8k-{i:04d}" for i in range(5)]
    tok = load_smollm2_tokenizer()
    head, tail = chat_prompt("QUESTION").split("QUESTION")
    for p in prompts:
        text = tok.decode(p.token_ids.tolist(), skip_special_tokens=False)
        assert text.startswith(head) and text.endswith(tail)
    assert [p.prompt_id for p in load_prompts("gsm8k", 2, skip=3)] == [p.prompt_id for p in prompts[3:]]
    assert load_prompts("gsm8k", 0) == []


def test_question_length_cap() -> None:
    full = load_prompts("humaneval", None, max_question_tokens=None)
    capped = load_prompts("humaneval", None)
    assert [p.prompt_id for p in full] == [f"HumanEval/{i}" for i in range(len(full))]
    kept = {p.prompt_id for p in capped}
    assert [p.prompt_id for p in capped] == [p.prompt_id for p in full if p.prompt_id in kept]
    # a prompt is its question's tokens inside the template's (the question starts and ends at token boundaries)
    template = len(load_smollm2_tokenizer().encode(chat_prompt("")).ids)
    dropped = [p for p in full if p.prompt_id not in kept]
    assert dropped and all(len(p.token_ids) - template > MAX_QUESTION_TOKENS for p in dropped)
    assert all(len(p.token_ids) - template <= MAX_QUESTION_TOKENS for p in capped)
    with pytest.raises(ValueError, match="unknown workload"):
        load_prompts("nope", 1)


def test_e2e_prompts_keeps_its_names() -> None:
    assert set(e2e_prompts.E2E_DATASETS) == {"gsm8k", "humaneval", "sharegpt", "random", "smollm2-multiturn"}
    assert [p.token_ids.tolist() for p in e2e_prompts.load_prompts("humaneval", 2)] == [
        p.token_ids.tolist() for p in load_prompts("humaneval", 2)]
    assert [p.prompt_id for p in e2e_prompts.load_prompts("humaneval", 2)] == ["HumanEval/0", "HumanEval/1"]

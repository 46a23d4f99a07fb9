"""Prompts for the end-to-end benchmark: GSM8K, HumanEval and ShareGPT questions in SmolLM2's chat format.

They are built in :mod:`drafter_service.datasets.prompts`; this module keeps the benchmark's names for them.
"""

from __future__ import annotations

from drafter_service.datasets.prompts import MAX_QUESTION_TOKENS, PROMPT_SETS, Prompt, load_prompts

__all__ = ["E2E_DATASETS", "MAX_QUESTION_TOKENS", "Prompt", "load_prompts"]

#: Workloads :func:`load_prompts` knows.
E2E_DATASETS = PROMPT_SETS

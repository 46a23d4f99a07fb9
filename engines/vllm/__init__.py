"""drafter inside vLLM: the proposer vLLM loads as ``engines.vllm.DrafterProposer`` (imports neither vLLM nor torch)."""

from __future__ import annotations

from engines.vllm.proposer import (
    FIXED_MIN_PROB,
    SUPPORTED_VLLM,
    DrafterProposer,
    ProposerSettings,
    check_vllm,
    drafting_rank,
    stop_tokens,
)
from engines.vllm.request_tracker import RequestTracker

__all__ = ["DrafterProposer", "ProposerSettings", "RequestTracker", "FIXED_MIN_PROB", "SUPPORTED_VLLM", "check_vllm",
           "drafting_rank", "stop_tokens"]

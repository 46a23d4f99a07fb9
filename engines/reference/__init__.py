"""The reference engine: a transformers causal LM that verifies draft trees in one forward pass (torch).

``ReferenceEngine`` decodes one request at a time; its tree attention, KV-cache upkeep and verification are
modules of their own, so other engines can take them one by one.
"""

from __future__ import annotations

from engines.reference.engine import GenerationResult, ReferenceEngine, StepStats, default_device, greedy_reference

__all__ = ["ReferenceEngine", "GenerationResult", "StepStats", "default_device", "greedy_reference"]

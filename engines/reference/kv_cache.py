"""Passing a KV cache to a transformers model and getting it back, across the releases that renamed the argument."""

from __future__ import annotations

import functools
import inspect
from typing import Any

__all__ = ["with_cache", "returned_cache"]


@functools.cache
def _cache_argument(forward: Any) -> str:
    parameters = inspect.signature(forward).parameters
    return "cache" if "cache" in parameters else "past_key_values"


def with_cache(model: Any, cache: Any) -> dict[str, Any]:
    """The keyword argument that passes ``cache`` to ``model``'s forward: ``cache`` in the transformers releases
    that renamed it, ``past_key_values`` in earlier ones (vLLM's environment pins one of those)."""
    return {_cache_argument(type(model).forward): cache}


def returned_cache(output: Any) -> Any:
    """The cache a forward pass returned (``output.cache``, or ``output.past_key_values`` before the rename)."""
    cache = getattr(output, "cache", None)
    return cache if cache is not None else output.past_key_values

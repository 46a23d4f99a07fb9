"""KV cache upkeep for tree steps: a transformers DynamicCache that keeps only prefix + root + accepted path."""

from __future__ import annotations

import functools
import inspect
import logging
from collections.abc import Sequence
from itertools import pairwise
from typing import Any

import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer, DynamicSlidingWindowLayer

logger = logging.getLogger(__name__)

__all__ = ["new_cache", "cache_length", "trim_to_windows", "keep_block_entries", "check_invariants", "with_cache",
           "returned_cache"]


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


def new_cache(config: Any) -> DynamicCache:
    """An empty cache laid out for ``config`` (one full or sliding-window layer per decoder layer).

    Sliding-window layers are switched to *past recording*: without it, ``DynamicSlidingWindowLayer.update`` keeps
    only the last ``sliding_window - 1`` keys of prefix + the whole tree block, dropping prefix keys in favour of
    draft nodes that may be rejected, and ``crop`` then refuses to roll back. With it, they keep everything until
    ``crop`` trims them back to the window.

    Args:
        config: the model's transformers config.

    Returns:
        a ``DynamicCache`` to pass as ``cache``.
    """
    cache = DynamicCache(config=config)
    cache.activate_past_recording()
    return cache


def cache_length(cache: DynamicCache) -> int:
    """Tokens the cache has processed (its sequence length, the next query's position)."""
    return int(cache.get_seq_length())


def trim_to_windows(cache: DynamicCache) -> None:
    """Trim sliding-window layers (which record their past) back to their last ``sliding_window - 1`` tokens."""
    cache.crop(0)


def _check_layer(layer: Any) -> DynamicLayer:
    """``layer`` when it is a layer these functions handle; raises otherwise."""
    if not isinstance(layer, DynamicLayer):
        raise TypeError(f"unsupported cache layer {type(layer).__name__}; expected a DynamicLayer")
    if isinstance(layer, DynamicSlidingWindowLayer) and not getattr(layer, "record_past", False):
        raise ValueError("sliding-window cache layers must record their past (build the cache with new_cache)")
    return layer


def _tensors(layer: DynamicLayer) -> tuple[torch.Tensor, torch.Tensor]:
    """The keys and values of an initialised layer."""
    keys, values = layer.keys, layer.values
    assert keys is not None and values is not None, "an initialised cache layer holds keys and values"
    return keys, values


@torch.inference_mode()
def keep_block_entries(cache: DynamicCache, block_len: int, keep: Sequence[int]) -> None:
    """After a forward pass over a block of ``block_len`` tokens, keep only the block entries in ``keep``.

    The kept entries are moved to the front of the block (contiguous, in order), then the rest is cropped with
    ``DynamicCache.crop``, which in transformers 5.x takes the *negative* number of tokens to remove. Sliding-window
    layers are trimmed back to their window by the same call.

    Args:
        cache: the cache the forward pass appended the block to (from ``new_cache``).
        block_len: tokens in the block (root + tree nodes).
        keep: (a,) strictly increasing indices into the block, e.g. ``[0] + [node + 1 for node in path]``.

    Raises:
        ValueError: when ``keep`` is not strictly increasing within ``[0, block_len)``.
    """
    keep = list(keep)
    if any(b <= a for a, b in pairwise(keep)) or (keep and not 0 <= keep[0] <= keep[-1] < block_len):
        raise ValueError(f"keep {keep} must be strictly increasing indices in [0, {block_len})")
    a = len(keep)
    moved = keep != list(range(a))
    index: torch.Tensor | None = None  # (a,) int64
    for raw in cache.layers:
        layer = _check_layer(raw)
        if not moved or not layer.is_initialized:
            continue
        keys, values = _tensors(layer)
        stored = keys.shape[-2]
        if stored < block_len:
            raise ValueError(f"cache layer holds {stored} tokens, fewer than the block of {block_len}")
        start = stored - block_len
        if index is None or index.device != keys.device:
            index = torch.tensor(keep, dtype=torch.long, device=keys.device)
        # keys/values: (batch, kv_heads, seq, head_dim); gather copies before the overlapping write.
        keys[:, :, start:start + a] = keys[:, :, start + index]
        values[:, :, start:start + a] = values[:, :, start + index]
    cache.crop(-(block_len - a))


def check_invariants(cache: DynamicCache, prefix_len: int) -> None:
    """Raise AssertionError unless every layer holds exactly what ``prefix_len`` processed tokens call for.

    Full layers hold ``prefix_len`` keys and values; sliding-window layers hold the last
    ``min(prefix_len, sliding_window - 1)`` and count ``prefix_len`` tokens seen.
    """
    for i, raw in enumerate(cache.layers):
        layer = _check_layer(raw)
        if not layer.is_initialized:
            assert prefix_len == 0, f"layer {i} is empty after {prefix_len} tokens"
            continue
        keys, values = _tensors(layer)
        stored = keys.shape[-2]
        assert values.shape[-2] == stored, f"layer {i} keys and values differ in length"
        if isinstance(layer, DynamicSlidingWindowLayer):
            want = min(prefix_len, layer.sliding_window - 1)
            assert layer.cumulative_length == prefix_len, f"layer {i} counts {layer.cumulative_length} tokens"
        else:
            want = prefix_len
        assert stored == want, f"layer {i} holds {stored} tokens, expected {want}"

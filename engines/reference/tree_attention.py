"""Draft tree → position ids and attention masks for one forward pass over root + tree, built on the device.

Block entry 0 is the root (the last token of the sequence), block entry ``i + 1`` is draft node ``i``. Everything
here is tensor code without Python loops over nodes or host reads, so a step's inputs can be built inside a captured
CUDA graph from the parents alone: the reachability of the block (who may attend to whom), each entry's depth (its
position), and one additive mask per kind of attention layer over the cache slots.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

logger = logging.getLogger(__name__)

__all__ = [
    "PAD_PARENT",
    "check_parents",
    "block_reach",
    "causal_reach",
    "block_depths",
    "block_mask",
    "model_layer_types",
    "attention_windows",
    "model_masks",
]

# Layer kinds whose cache keeps every past token and whose mask is the plain tree mask.
_FULL = "full_attention"
# Layer kinds that see only keys within ``sliding_window`` positions of the query.
_SLIDING = "sliding_attention"

#: Parent of a padding node (a tree padded to a fixed size): it sees only itself and nothing sees it.
PAD_PARENT = -2


def check_parents(parents: Sequence[int]) -> None:
    """Raise ValueError unless every node's parent is -1 (the root) or an earlier node."""
    p = np.asarray(parents, dtype=np.int64)
    bad = np.flatnonzero((p < -1) | (p >= np.arange(len(p))))
    if len(bad):
        i = int(bad[0])
        raise ValueError(f"node {i} has parent {int(p[i])}; parents must satisfy -1 <= parents[i] < i")


def block_reach(parents: torch.Tensor) -> torch.Tensor:
    """Which block entries each block entry may attend to: itself and its ancestors.

    The closure of the parent relation by repeated squaring (``ceil(log2(n + 1))`` small matrix products), so the
    cost does not depend on the tree's shape and nothing is read back to the host.

    Args:
        parents: (n,) int64 parent of each node: -1 for a child of the root, an earlier node's index, or
            ``PAD_PARENT`` for a padding node.

    Returns:
        (n+1, n+1) bool; ``[q, k]`` is True when entry ``k`` is ``q`` or an ancestor of ``q``.
    """
    q = parents.shape[0] + 1
    reach = torch.eye(q, dtype=torch.float32, device=parents.device)  # (q, q) float32
    if q > 1:
        rows = torch.arange(1, q, device=parents.device)
        cols = (parents + 1).clamp(min=0)
        reach.index_put_((rows, cols), (parents >= -1).to(torch.float32))  # one entry per row: a plain scatter
        for _ in range(math.ceil(math.log2(q))):  # paths of up to 2**k edges after k squarings
            reach = (reach @ reach).clamp_(max=1.0)
    return reach > 0.5


def causal_reach(q: int, device: torch.device | str | None = None) -> torch.Tensor:
    """(q, q) bool: a plain sequence, each entry attending to itself and every entry before it (a prefill)."""
    return torch.ones(q, q, dtype=torch.bool, device=device).tril_()


def block_depths(reach: torch.Tensor) -> torch.Tensor:
    """(q,) int64 depth of each block entry below the root (0 for the root and for padding nodes)."""
    return reach.sum(dim=-1) - 1


def block_mask(reach: torch.Tensor, depths: torch.Tensor, prefix: torch.Tensor, kv_len: int, dtype: torch.dtype,
               window: int | None = None) -> torch.Tensor:
    """Additive attention mask of the block's queries over cache slots ``0 .. kv_len - 1``.

    Slots below ``prefix`` hold the sequence so far, slot ``s`` holding position ``s``; the block's entries are
    written to slots ``prefix .. prefix + q - 1`` in block order. Every query sees every earlier slot and, inside the
    block, only what ``reach`` allows; nothing sees slots past the block.

    Args:
        reach: (q, q) bool from ``block_reach`` or ``causal_reach``.
        depths: (q,) int64 from ``block_depths`` (a query's position is ``prefix + depth``).
        prefix: () or (1,) int64 tensor: slots holding the sequence before the block.
        kv_len: cache slots the forward attends over (static for a captured graph).
        dtype: the model's activation dtype.
        window: when set, a key at position ``k`` is visible from a query at position ``p`` only when
            ``p - k < window`` (transformers' sliding-window convention).

    Returns:
        (1, 1, q, kv_len) of ``dtype``: 0 where attention is allowed, ``finfo(dtype).min`` elsewhere.
    """
    q = reach.shape[0]
    prefix = prefix.reshape(())
    slots = torch.arange(kv_len, device=reach.device)  # (kv_len,) int64
    rel = slots - prefix  # each slot's block entry, where it is one
    in_block = (rel >= 0) & (rel < q)
    entry = rel.clamp(0, q - 1)
    allowed = (slots < prefix)[None, :] | (reach.index_select(1, entry) & in_block[None, :])  # (q, kv_len) bool
    if window is not None:
        q_pos = prefix + depths  # (q,)
        k_pos = torch.where(in_block, prefix + depths.index_select(0, entry), slots)  # (kv_len,)
        allowed &= (q_pos[:, None] - k_pos[None, :]) < window
    zero = torch.zeros((), dtype=dtype, device=reach.device)
    low = torch.full((), torch.finfo(dtype).min, dtype=dtype, device=reach.device)
    return torch.where(allowed, zero, low)[None, None]


def model_layer_types(config: Any) -> list[str]:
    """Attention kind of every decoder layer of a transformers config (``full_attention``/``sliding_attention``).

    Args:
        config: a transformers ``PreTrainedConfig`` (a multimodal one is reduced to its text decoder).

    Returns:
        one entry per layer.
    """
    if hasattr(config, "get_text_config"):
        config = config.get_text_config(decoder=True)
    types = getattr(config, "layer_types", None)
    if types is None:
        kind = _SLIDING if getattr(config, "sliding_window", None) is not None else _FULL
        types = [kind] * int(config.num_hidden_layers)
    return list(types)


def attention_windows(config: Any) -> dict[str, int | None]:
    """The kinds of attention layer a model has, each with its window (None: full attention).

    Raises:
        NotImplementedError: for layer kinds other than full and sliding-window attention.
    """
    if hasattr(config, "get_text_config"):
        config = config.get_text_config(decoder=True)
    kinds = set(model_layer_types(config))
    unknown = kinds - {_FULL, _SLIDING}
    if unknown:
        raise NotImplementedError(f"tree attention for layer types {sorted(unknown)} is not supported")
    return {kind: (int(config.sliding_window) if kind == _SLIDING else None) for kind in sorted(kinds)}


def model_masks(windows: dict[str, int | None], reach: torch.Tensor, depths: torch.Tensor, prefix: torch.Tensor,
                kv_len: int, dtype: torch.dtype) -> torch.Tensor | dict[str, torch.Tensor]:
    """The ``attention_mask`` argument of a transformers model's forward over the block.

    Models with one kind of layer (Llama, SmolLM2, Qwen2 without sliding) take one 4D tensor, used as it is (a 4D
    mask skips transformers' own mask creation); models mixing full and sliding-window layers (Gemma-3) take a dict
    keyed by layer kind.

    Args:
        windows: from ``attention_windows``.
        reach, depths, prefix, kv_len, dtype: as in ``block_mask``.
    """
    masks = {kind: block_mask(reach, depths, prefix, kv_len, dtype, window) for kind, window in windows.items()}
    return next(iter(masks.values())) if len(masks) == 1 else masks

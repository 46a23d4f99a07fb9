"""Draft tree → position ids and 4D additive attention masks for one forward pass over root + tree."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

import torch

logger = logging.getLogger(__name__)

__all__ = [
    "tree_depths",
    "ancestor_matrix",
    "tree_positions",
    "tree_mask",
    "model_layer_types",
    "model_tree_mask",
]

# Layer kinds whose cache keeps every past token and whose mask is the plain tree mask.
_FULL = "full_attention"
# Layer kinds whose cache keeps only the last ``sliding_window - 1`` tokens and whose mask adds the window.
_SLIDING = "sliding_attention"


def tree_depths(parents: Sequence[int]) -> list[int]:
    """Depth of every draft node below the root.

    Args:
        parents: (n,) parent of each node, -1 for a child of the root; ``parents[i] < i``.

    Returns:
        (n,) depths: 1 for a child of the root, parent's depth + 1 otherwise (the root itself has depth 0).

    Raises:
        ValueError: when a parent index is not in ``[-1, i)``.
    """
    depths: list[int] = []
    for i, p in enumerate(parents):
        if not -1 <= p < i:
            raise ValueError(f"node {i} has parent {p}; parents must satisfy -1 <= parents[i] < i")
        depths.append(1 if p < 0 else depths[p] + 1)
    return depths


def ancestor_matrix(parents: Sequence[int], device: torch.device | str | None = None) -> torch.Tensor:
    """Which block entries each block entry may attend to (itself and its ancestors).

    Block index 0 is the root (the last token of the sequence), block index ``i + 1`` is draft node ``i``.

    Args:
        parents: (n,) parent of each node, -1 for a child of the root; ``parents[i] < i``.
        device: where to put the result.

    Returns:
        (n+1, n+1) bool; ``[q, k]`` is True when ``k`` is ``q`` or an ancestor of ``q``.
    """
    q = len(parents) + 1
    rows: list[list[bool]] = [[True] + [False] * (q - 1)]
    for i, p in enumerate(parents):
        if not -1 <= p < i:
            raise ValueError(f"node {i} has parent {p}; parents must satisfy -1 <= parents[i] < i")
        row = rows[p + 1].copy()
        row[i + 1] = True
        rows.append(row)
    return torch.tensor(rows, dtype=torch.bool, device=device)  # (n+1, n+1) bool


def tree_positions(parents: Sequence[int], prefix_len: int,
                   device: torch.device | str | None = None) -> torch.Tensor:
    """Position ids of root + nodes: ``prefix_len + depth``.

    Args:
        parents: (n,) parent of each node, -1 for a child of the root.
        prefix_len: tokens already in the KV cache (the root's position).
        device: where to put the result.

    Returns:
        (1, n+1) int64 position ids.
    """
    return torch.tensor([[prefix_len] + [prefix_len + d for d in tree_depths(parents)]],
                        dtype=torch.long, device=device)  # (1, n+1) int64


def tree_mask(parents: Sequence[int], prefix_len: int, dtype: torch.dtype = torch.float32,
              device: torch.device | str | None = None, *, past_len: int | None = None,
              sliding_window: int | None = None) -> torch.Tensor:
    """Additive attention mask for root + tree queries over cached keys + the block's own keys.

    Every query sees every cached key (within ``sliding_window`` of its position when one is given) and, inside the
    block, only itself and its ancestors.

    Args:
        parents: (n,) parent of each node, -1 for a child of the root.
        prefix_len: tokens already processed (the position of the root).
        dtype: floating dtype of the mask (the model's activation dtype).
        device: where to put the mask.
        past_len: cached keys in front of the block, holding positions ``prefix_len - past_len .. prefix_len - 1``
            (defaults to ``prefix_len``; a sliding-window cache keeps fewer).
        sliding_window: when set, a key at position ``k`` is visible from a query at position ``q`` only when
            ``q - k < sliding_window`` (transformers' convention).

    Returns:
        (1, 1, n+1, past_len + n+1) of ``dtype``: 0 where attention is allowed, ``finfo(dtype).min`` elsewhere.
    """
    past = prefix_len if past_len is None else past_len
    if not 0 <= past <= prefix_len:
        raise ValueError(f"past_len {past} must lie in [0, prefix_len={prefix_len}]")
    q = len(parents) + 1
    allowed = torch.ones(q, past + q, dtype=torch.bool, device=device)  # (n+1, past+n+1) bool
    allowed[:, past:] = ancestor_matrix(parents, device=device)
    if sliding_window is not None:
        q_pos = tree_positions(parents, prefix_len, device=device)[0]  # (n+1,) int64
        k_pos = torch.cat([torch.arange(prefix_len - past, prefix_len, device=device), q_pos])  # (past+n+1,)
        allowed &= (q_pos[:, None] - k_pos[None, :]) < sliding_window
    mask = torch.zeros(1, 1, q, past + q, dtype=dtype, device=device)  # (1, 1, n+1, past+n+1)
    return mask.masked_fill_(~allowed, torch.finfo(dtype).min)


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


def model_tree_mask(config: Any, parents: Sequence[int], prefix_len: int, dtype: torch.dtype,
                    device: torch.device | str | None = None) -> torch.Tensor | dict[str, torch.Tensor]:
    """The ``attention_mask`` argument for a transformers model's forward over root + tree.

    Models with a single kind of layer (Llama, SmolLM2, Qwen2 without sliding) take one 4D tensor, used as-is by
    ``masking_utils`` (a 4D mask skips transformers' own mask creation). Models mixing full and sliding-window layers
    (Gemma-3) take a dict keyed by layer type, since their sliding layers see a shorter key range: the
    ``DynamicSlidingWindowLayer`` cache holds at most ``sliding_window - 1`` past tokens.

    Args:
        config: the model's config.
        parents: (n,) parent of each node, -1 for a child of the root.
        prefix_len: tokens already in the KV cache.
        dtype: the model's activation dtype.
        device: where the model runs.

    Returns:
        a (1, 1, n+1, kv_len) mask, or ``{layer_type: mask}`` when layer kinds differ.

    Raises:
        NotImplementedError: for layer kinds other than full and sliding-window attention.
    """
    if hasattr(config, "get_text_config"):
        config = config.get_text_config(decoder=True)
    kinds = set(model_layer_types(config))
    unknown = kinds - {_FULL, _SLIDING}
    if unknown:
        raise NotImplementedError(f"tree attention for layer types {sorted(unknown)} is not supported")
    masks: dict[str, torch.Tensor] = {}
    if _FULL in kinds:
        masks[_FULL] = tree_mask(parents, prefix_len, dtype, device)
    if _SLIDING in kinds:
        window = int(config.sliding_window)
        masks[_SLIDING] = tree_mask(parents, prefix_len, dtype, device,
                                    past_len=min(prefix_len, window - 1), sliding_window=window)
    if len(masks) == 1:
        return next(iter(masks.values()))
    return masks

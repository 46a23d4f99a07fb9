"""A preallocated KV cache of one sequence: every layer's keys and values in one tensor, written at given slots.

Slot ``s`` holds the token at position ``s`` of the sequence; a step writes its block (root + tree nodes) at the slots
after the sequence, and keeping the accepted path afterwards moves those entries down in one gather and one scatter
over all layers at once. Nothing is reallocated between steps, so a forward over it can be captured as a CUDA graph.
Sliding-window layers keep every slot too: their window is enforced by the mask alone.
"""

from __future__ import annotations

import logging
from typing import Any

import torch
from transformers.cache_utils import Cache, CacheLayerMixin

logger = logging.getLogger(__name__)

__all__ = ["StaticTreeCache", "kv_shape"]

#: Slots are allocated in multiples of this (attention kernels prefer aligned key lengths).
SLOT_ALIGN = 64


def kv_shape(config: Any) -> tuple[int, int, int]:
    """(layers, key-value heads, head size) of a transformers decoder config."""
    if hasattr(config, "get_text_config"):
        config = config.get_text_config(decoder=True)
    heads = int(config.num_attention_heads)
    kv_heads = int(getattr(config, "num_key_value_heads", None) or heads)
    head_dim = getattr(config, "head_dim", None) or int(config.hidden_size) // heads
    return int(config.num_hidden_layers), kv_heads, int(head_dim)


class _SlotLayer(CacheLayerMixin):
    """One decoder layer's view of the shared tensor: writes go to the cache's current slots."""

    is_compileable = True
    is_sliding = False

    def __init__(self, owner: StaticTreeCache, index: int) -> None:
        super().__init__()
        self.owner, self.index = owner, index
        self.k, self.v = owner.kv[0, index], owner.kv[1, index]  # (1, kv_heads, slots, head_dim) views
        self.keys, self.values = self.k, self.v  # what transformers reads of a layer
        self.is_initialized = True

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        """Nothing to do: the slots are allocated up front."""

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any,
               **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
        owner = self.owner
        if key_states.shape[1:2] + key_states.shape[3:] != self.k.shape[1:2] + self.k.shape[3:]:
            raise ValueError(f"layer {self.index} produced keys of shape {tuple(key_states.shape)}; the cache holds "
                             f"{tuple(self.k.shape)} per layer (one head size and head count for all layers)")
        self.k.index_copy_(2, owner.slots, key_states)
        self.v.index_copy_(2, owner.slots, value_states)
        return self.k[:, :, :owner.kv_len], self.v[:, :, :owner.kv_len]

    def get_mask_sizes(self, query_length: Any) -> tuple[int, int]:
        return self.owner.kv_len, 0

    def get_seq_length(self) -> int:
        return self.owner.length

    def get_max_length(self) -> int:
        return self.owner.capacity


class StaticTreeCache(Cache):
    """KV cache of one sequence in ``capacity`` preallocated slots, plus one scratch slot.

    Before each forward the engine sets ``slots`` ((q,) int64 on the device: where the forward's q keys go) and
    ``kv_len`` (how many slots the forward attends over; the mask hides the ones past the sequence and block).
    ``length`` is the number of tokens the cache holds, kept by the engine.

    Args:
        config: the model's transformers config.
        capacity: most tokens the sequence may hold (rounded up so that capacity + 1 is a multiple of 64).
        dtype: the model's activation dtype.
        device: where the model runs.
    """

    def __init__(self, config: Any, capacity: int, dtype: torch.dtype, device: torch.device | str) -> None:
        if capacity < 1:
            raise ValueError(f"capacity must be >= 1, got {capacity}")
        layers, kv_heads, head_dim = kv_shape(config)
        total = -(-(capacity + 1) // SLOT_ALIGN) * SLOT_ALIGN
        self.capacity = total - 1
        self.scratch = total - 1  # a slot nothing attends to: padding of fixed-size moves lands here
        self.kv = torch.zeros((2, layers, 1, kv_heads, total, head_dim), dtype=dtype, device=device)
        self.slots = torch.zeros(0, dtype=torch.long, device=device)  # (q,) int64
        self.kv_len = total
        self.length = 0
        self._slot_layers = [_SlotLayer(self, i) for i in range(layers)]
        super().__init__(layers=list(self._slot_layers))

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args: Any,
               **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
        """Write a layer's new keys and values at ``slots``; returns the layer's first ``kv_len`` slots."""
        return self._slot_layers[layer_idx].update(key_states, value_states)

    def get_seq_length(self, layer_idx: int = 0) -> int:
        """Tokens the cache holds."""
        return self.length

    def get_mask_sizes(self, *args: Any, **kwargs: Any) -> tuple[int, int]:
        """Key length and offset an attention mask must have."""
        return self.kv_len, 0

    @property
    def is_compileable(self) -> bool:
        return True

    def move(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        """Copy the entries at slots ``src`` to slots ``dst`` in every layer: one gather, one scatter.

        Args:
            src: (a,) int64 slots to read (all read before any is written).
            dst: (a,) int64 slots to write; fixed-size padding may send several entries to ``scratch``.
        """
        self.kv.index_copy_(4, dst, self.kv.index_select(4, src))

    def check_invariants(self) -> None:
        """Raise AssertionError unless the bookkeeping fits the slots."""
        assert 0 <= self.length <= self.capacity, f"{self.length} tokens in {self.capacity} slots"
        assert self.kv_len <= self.kv.shape[4], f"kv_len {self.kv_len} past {self.kv.shape[4]} slots"
        assert all(layer.k.data_ptr() == self.kv[0, i].data_ptr() and layer.v.data_ptr() == self.kv[1, i].data_ptr()
                   for i, layer in enumerate(self._slot_layers)), "every layer views the shared tensor"

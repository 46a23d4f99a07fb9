"""One decoding step's forward over the static cache: eager, or replayed from CUDA graphs captured per tree size.

A step is: keep the previous step's accepted entries (a move inside the cache), then one forward over the root and
the draft nodes with their mask and positions built on the device from the parents, then the argmax of every row.
Its inputs travel in one host-to-device copy and its verdict (the argmaxes) in one read back: one round trip per
step. On CUDA the whole step, plain steps included, is captured once per padded tree size (``BUCKETS``) and replayed;
elsewhere it runs eagerly at the tree's exact size, attending only over the slots in use.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from engines.reference.kv_cache import with_cache
from engines.reference.static_cache import StaticTreeCache
from engines.reference.tree_attention import (
    PAD_PARENT,
    attention_windows,
    block_depths,
    block_reach,
    causal_reach,
    model_masks,
)

logger = logging.getLogger(__name__)

__all__ = ["BUCKETS", "StepOutput", "StepRunner", "buckets_for"]

#: Draft sizes a captured step is padded to (0: the plain step); a budget larger than the last adds itself.
BUCKETS = (0, 4, 8, 16, 32, 64)


def buckets_for(max_nodes: int) -> tuple[int, ...]:
    """The padded sizes of an engine verifying at most ``max_nodes`` nodes: ``BUCKETS`` below it, then itself."""
    return tuple(b for b in BUCKETS if b < max_nodes) + (max_nodes,)


@dataclass(frozen=True)
class StepOutput:
    """What a step's forward left on the device (a captured graph's outputs are overwritten by its next replay).

    Attributes:
        logits: (q, V) the target's logits for [root, node 0, ..., padding].
        target: (q,) int64 the argmax of each row.
    """

    logits: torch.Tensor
    target: torch.Tensor


class StepRunner:
    """Runs a model's steps over a ``StaticTreeCache``, capturing them as CUDA graphs where it can.

    Args:
        model: a transformers causal LM on its device, in eval mode.
        capacity: most tokens a sequence may hold (prompt, output and one step's tree).
        max_nodes: most draft nodes a step verifies.
        graphs: capture CUDA graphs (None: on a CUDA device). Without them every step runs eagerly at its size.
        padded: run each step at its bucket's size over every slot, as a captured step does (None: when capturing);
            eagerly, this is the captured computation step for step, for checking it where there is no GPU.
    """

    def __init__(self, model: Any, capacity: int, max_nodes: int, graphs: bool | None = None,
                 padded: bool | None = None) -> None:
        param = next(model.parameters())
        self.model, self.device, self.dtype = model, param.device, param.dtype
        self.max_nodes = max_nodes
        self.windows = attention_windows(model.config)
        self.cache = StaticTreeCache(model.config, capacity, self.dtype, self.device)
        self.graphs = self.device.type == "cuda" if graphs is None else graphs
        if self.graphs and self.device.type != "cuda":
            raise ValueError(f"CUDA graphs need a CUDA device; the model is on {self.device}")
        self.padded = self.graphs if padded is None else padded or self.graphs
        c = max_nodes
        # One int64 buffer for a step's inputs: ids (c+1) | parents (c) | prefix (1) | move from (c) | move to (c).
        self._layout = [int(x) for x in np.cumsum([0, c + 1, c, 1, c, c])]
        pinned = self.device.type == "cuda"
        self._dev = torch.zeros(int(self._layout[-1]), dtype=torch.long, device=self.device)
        self._host = self._dev if not pinned else torch.zeros_like(self._dev, device="cpu").pin_memory()
        self._np = self._host.numpy()
        parts = (self._dev[a:b] for a, b in zip(self._layout[:-1], self._layout[1:], strict=True))
        self._ids, self._parents, self._prefix, self._src, self._dst = parts
        self._arange = torch.arange(c + 1, device=self.device)
        self._captured: dict[int, tuple[torch.cuda.CUDAGraph, StepOutput]] = {}
        if self.graphs:
            self._capture_all()

    @property
    def buckets(self) -> tuple[int, ...] | None:
        """The padded sizes steps run at (None: each step at its own size)."""
        return buckets_for(self.max_nodes) if self.padded else None

    def bucket(self, nodes: int) -> int:
        """The size a step of ``nodes`` draft nodes runs at (the smallest bucket that holds it)."""
        if not 0 <= nodes <= self.max_nodes:
            raise ValueError(f"a step verifies 0 to {self.max_nodes} nodes, got {nodes}")
        if not self.padded:
            return nodes
        return next(b for b in buckets_for(self.max_nodes) if b >= nodes)

    # -- the engine's calls --------------------------------------------------------------------------------------

    def prefill(self, tokens: Sequence[int]) -> None:
        """Run the sequence's first tokens through the model into an empty cache (eagerly, at their length)."""
        cache = self.cache
        m = len(tokens)
        if m > cache.capacity:
            raise ValueError(f"{m} tokens do not fit the cache's {cache.capacity} slots")
        cache.length = 0
        if not m:
            return
        ids = torch.tensor([list(tokens)], dtype=torch.long, device=self.device)  # (1, m) int64
        reach = causal_reach(m, self.device)
        depths = block_depths(reach)
        zero = torch.zeros((), dtype=torch.long, device=self.device)
        cache.slots, cache.kv_len = depths, m
        masks = model_masks(self.windows, reach, depths, zero, m, self.dtype)
        self.model(input_ids=ids, attention_mask=masks, position_ids=depths[None], **with_cache(self.model, cache),
                   use_cache=True, logits_to_keep=1)
        cache.length = m

    def step(self, root: int, tokens: Sequence[int], parents: Sequence[int], keep: Sequence[int] = ()) -> StepOutput:
        """Keep the previous step's accepted entries, then run root + tree over the cache.

        Args:
            root: the last token of the sequence (not in the cache yet).
            tokens: (n,) draft tokens, n <= ``max_nodes``.
            parents: (n,) their parents (-1: the root), each before its child.
            keep: the previous step's accepted nodes (indices into its tree, increasing); their entries are moved
                next to the previous root. ``cache.length`` must already count them.

        Returns:
            the step's logits and argmaxes, rows [root, node 0, ..., node n-1, padding].
        """
        size = self.load(root, tokens, parents, keep)
        cache, a = self.cache, len(keep)
        if self.graphs:
            graph, out = self._captured[size]
            graph.replay()
            return out
        if self.padded:
            return self._forward(size, self.max_nodes, cache.kv.shape[4])
        moves = a if list(keep) != list(range(a)) else 0  # entries already in place need no move
        return self._forward(size, moves, cache.length + size + 1)

    # -- the step itself -----------------------------------------------------------------------------------------

    def _forward(self, size: int, moves: int, kv_len: int) -> StepOutput:
        """The step's device work; every tensor it reads is a fixed buffer, so it can be captured as it is."""
        self.upkeep(moves)
        masks, positions = self.inputs(size, kv_len)
        return self.verdict(self.forward(size, masks, positions))

    # The phases of a step, public so that a profile can time them one by one (``drafter bench steps``).

    def upkeep(self, moves: int) -> None:
        """Move the first ``moves`` loaded entries (the previous step's accepted path) into place."""
        if moves:
            self.cache.move(self._src[:moves], self._dst[:moves])

    def inputs(self, size: int, kv_len: int) -> tuple[torch.Tensor | dict[str, torch.Tensor], torch.Tensor]:
        """The loaded tree's masks over ``kv_len`` slots and its (1, size+1) positions; sets the cache's slots."""
        q = size + 1
        reach = block_reach(self._parents[:size])
        depths = block_depths(reach)
        self.cache.slots = self._prefix + self._arange[:q]
        self.cache.kv_len = kv_len
        masks = model_masks(self.windows, reach, depths, self._prefix, kv_len, self.dtype)
        return masks, (self._prefix + depths)[None]

    def forward(self, size: int, masks: torch.Tensor | dict[str, torch.Tensor], positions: torch.Tensor
                ) -> torch.Tensor:
        """The model over the loaded root and ``size`` nodes; returns (size+1, V) logits."""
        out = self.model(input_ids=self._ids[:size + 1][None], attention_mask=masks, position_ids=positions,
                         **with_cache(self.model, self.cache), use_cache=True)
        return out.logits[0]

    @staticmethod
    def verdict(logits: torch.Tensor) -> StepOutput:
        """The logits with each row's argmax."""
        # max().indices picks the first maximum like argmax, and is ~4x faster than argmax on bfloat16 CPU tensors
        return StepOutput(logits, logits.max(dim=-1).indices)

    def load(self, root: int, tokens: Sequence[int], parents: Sequence[int], keep: Sequence[int] = ()) -> int:
        """Put a step's inputs on the device (one copy); returns the size the step runs at."""
        cache = self.cache
        n, a = len(tokens), len(keep)
        size = self.bucket(n)
        prefix = cache.length
        if prefix + size + 1 > cache.capacity:
            raise ValueError(f"a step of {size} nodes after {prefix} tokens does not fit {cache.capacity} slots")
        lay, buf = self._layout, self._np
        buf[lay[0]] = root
        buf[lay[0] + 1:lay[0] + 1 + n] = tokens
        buf[lay[0] + 1 + n:lay[1]] = 0
        buf[lay[1]:lay[1] + n] = parents
        buf[lay[1] + n:lay[2]] = PAD_PARENT
        buf[lay[2]] = prefix
        base = prefix - a  # the previous root's slot + 1 is base: its nodes sat at base + i
        buf[lay[3]:lay[3] + a] = np.asarray(keep, dtype=np.int64) + base
        buf[lay[4]:lay[4] + a] = np.arange(base, prefix)
        buf[lay[3] + a:lay[4]] = cache.scratch  # padding moves: scratch onto itself
        buf[lay[4] + a:lay[5]] = cache.scratch
        if self._host is not self._dev:
            self._dev.copy_(self._host, non_blocking=True)
        return size

    def _capture_all(self) -> None:
        """Capture every bucket's step, largest first, sharing one memory pool; eager steps if capture fails."""
        cache = self.cache
        kv_len = cache.kv.shape[4]
        self._np[:] = 0
        self._np[self._layout[3]:] = cache.scratch  # moves of scratch onto itself: captures change no real slot
        self._dev.copy_(self._host)
        pool = None
        try:
            for size in sorted(buckets_for(self.max_nodes), reverse=True):
                stream = torch.cuda.Stream(device=self.device)
                stream.wait_stream(torch.cuda.current_stream(self.device))
                with torch.cuda.stream(stream):
                    for _ in range(2):  # kernels chosen and workspaces allocated outside the capture
                        self._forward(size, self.max_nodes, kv_len)
                torch.cuda.current_stream(self.device).wait_stream(stream)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool):
                    out = self._forward(size, self.max_nodes, kv_len)
                pool = graph.pool()
                self._captured[size] = (graph, out)
        except Exception:  # a model whose forward cannot be captured still decodes, eagerly
            logger.warning("capturing the steps as CUDA graphs failed; steps run eagerly", exc_info=True)
            self._captured.clear()
            self.graphs = self.padded = False
        torch.cuda.synchronize(self.device)
        cache.length = 0


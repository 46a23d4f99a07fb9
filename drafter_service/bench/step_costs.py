"""What one verification step costs on this machine: t(n) for n draft nodes, and which dtype decodes fastest."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch

from engines.reference.kv_cache import keep_block_entries, new_cache, with_cache
from engines.reference.tree_attention import model_tree_mask, tree_positions

__all__ = ["SIZES", "fastest_dtype", "format_curve", "measure_step_curve"]

#: Draft sizes whose step time ``drafter bench e2e`` prints (the fixed budgets it can compare with).
SIZES = (0, 1, 2, 4, 8, 16, 32, 64)


def measure_step_curve(model: Any, sizes: Sequence[int] = SIZES, context: int = 256,
                       repeats: int = 3) -> dict[int, float]:
    """Median seconds of a forward pass over root + a chain of ``n`` draft nodes on a ``context``-token cache.

    Args:
        model: a transformers causal LM (on its device, in the dtype measured).
        sizes: draft node counts.
        context: tokens in the KV cache before the step.
        repeats: passes timed per size (after one untimed warm-up pass).

    Returns:
        {n: seconds}.
    """
    device = next(model.parameters()).device
    dtype = next(model.parameters()).dtype
    vocab = int(model.config.vocab_size)
    gen = torch.Generator().manual_seed(0)
    prefix = torch.randint(0, vocab, (1, context), generator=gen).to(device)  # (1, context) int64
    out: dict[int, float] = {}
    with torch.inference_mode():
        cache = new_cache(model.config)
        model(input_ids=prefix, **with_cache(model, cache), use_cache=True, logits_to_keep=1)
        for _ in range(3):  # first-call costs (allocator, kernels) out of the way
            model(input_ids=prefix[:, :1], **with_cache(model, cache), use_cache=True)
            keep_block_entries(cache, 1, [])
        for n in sizes:
            parents = list(range(-1, n - 1))
            ids = torch.randint(0, vocab, (1, n + 1), generator=gen).to(device)  # (1, n+1) int64
            mask = model_tree_mask(model.config, parents, context, dtype, device) if n else None
            positions = tree_positions(parents, context, device) if n else None
            times = []
            for i in range(repeats + 1):
                t0 = time.perf_counter()
                model(input_ids=ids, attention_mask=mask, position_ids=positions, **with_cache(model, cache),
                      use_cache=True)
                if i:
                    times.append(time.perf_counter() - t0)
                keep_block_entries(cache, n + 1, [])  # back to the context alone
            out[n] = statistics.median(times)
    return out


def format_curve(curve: dict[int, float]) -> str:
    """One line: t(n) in ms and as a multiple of a plain step."""
    base = curve.get(0) or 1.0
    return "t(n): " + ", ".join(f"{n}: {1e3 * t:.1f} ms ({t / base:.2f}x)" for n, t in curve.items())


def fastest_dtype(load: Callable[[torch.dtype], Any], candidates: Sequence[torch.dtype] = (torch.bfloat16,
                                                                                            torch.float32)
                  ) -> tuple[torch.dtype, dict[torch.dtype, float]]:
    """The dtype whose plain decode step (one token on a 256-token cache) is fastest, and each one's time.

    Args:
        load: builds the model in a dtype.
        candidates: dtypes tried.
    """
    times = {}
    for dtype in candidates:
        model = load(dtype)
        times[dtype] = measure_step_curve(model, (0,), repeats=8)[0]
        del model
    return min(times, key=lambda d: times[d]), times

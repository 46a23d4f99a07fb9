"""What one verification step costs on this machine: t(n) for n draft nodes, and which dtype decodes fastest."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch

from engines.reference.step_runner import StepRunner

__all__ = ["SIZES", "fastest_dtype", "format_curve", "measure_step_curve"]

#: Draft sizes whose step time ``drafter bench e2e`` prints (the fixed budgets it can compare with).
SIZES = (0, 1, 2, 4, 8, 16, 32, 64)


def measure_step_curve(model: Any, sizes: Sequence[int] = SIZES, context: int = 256, repeats: int = 3,
                       graphs: bool | None = None) -> dict[int, float]:
    """Median seconds of the reference engine's step over root + a chain of ``n`` draft nodes on a ``context``-token
    cache: its inputs loaded, the forward pass, the argmaxes read back (as ``StepRunner`` runs it).

    Args:
        model: a transformers causal LM (on its device, in the dtype measured).
        sizes: draft node counts.
        context: tokens in the KV cache before the step.
        repeats: steps timed per size (after one untimed warm-up step).
        graphs: CUDA graphs as the engine would use them (None: on a CUDA device).

    Returns:
        {n: seconds}.
    """
    vocab = int(model.config.vocab_size)
    gen = torch.Generator().manual_seed(0)
    prefix = torch.randint(0, vocab, (context,), generator=gen).tolist()
    largest = max(max(sizes), 1)
    out: dict[int, float] = {}
    with torch.inference_mode():
        runner = StepRunner(model, context + largest + 1, largest, graphs)
        runner.prefill(prefix)
        for _ in range(3):  # first-call costs (allocator, kernels) out of the way
            runner.step(prefix[0], [], []).target.tolist()
        for n in sizes:
            parents = list(range(-1, n - 1))
            ids = torch.randint(0, vocab, (n + 1,), generator=gen).tolist()
            times = []
            for i in range(repeats + 1):
                t0 = time.perf_counter()
                runner.step(ids[0], ids[1:], parents).target[:n + 1].tolist()  # the step's one read
                if i:
                    times.append(time.perf_counter() - t0)
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

"""What the machine's processors compute natively: the precision a model should run in depends on it."""

from __future__ import annotations

import functools
import os
import platform
from pathlib import Path

__all__ = ["BFLOAT16_CPU_FLAGS", "cpu_model_and_flags", "native_bfloat16", "own_cpus"]

#: CPU flags (``/proc/cpuinfo``) of instructions that compute bfloat16 matrix products natively. Without one,
#: torch converts every product to float32 and back, which costs many times float32's own time when compute bound
#: (training, long prompts, wide trees); a one-token decode step is memory bound and may still gain from it.
BFLOAT16_CPU_FLAGS = frozenset({"avx512_bf16", "amx_bf16"})


@functools.cache
def cpu_model_and_flags() -> tuple[str, frozenset[str]]:
    """The CPU's model name and feature flags (empty where ``/proc/cpuinfo`` cannot be read)."""
    model, flags = platform.processor() or "unknown CPU", frozenset[str]()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            if key.strip() == "model name":
                model = value.strip()
            elif key.strip() == "flags":
                flags = frozenset(value.split())
    except OSError:
        pass
    return model, flags


def native_bfloat16(device: str = "cpu", cpu_flags: frozenset[str] | None = None) -> bool:
    """Whether ``device`` computes bfloat16 matrix products natively.

    Args:
        device: "cpu", "cuda" or "cuda:N" (anything else: False).
        cpu_flags: the CPU's flags (default: this machine's).
    """
    if device == "cpu":
        flags = cpu_model_and_flags()[1] if cpu_flags is None else cpu_flags
        return bool(flags & BFLOAT16_CPU_FLAGS)
    if device.startswith("cuda"):
        import torch

        return bool(torch.cuda.is_available() and torch.cuda.is_bf16_supported())
    return False


def own_cpus() -> int:
    """How many CPUs this process was given to itself: 0 when it may run on every CPU of the machine (so whatever
    else runs there, an engine included, shares them), else the size of the set it was confined to (``taskset``,
    a cgroup cpuset), which the operator chose for it."""
    try:
        mine = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return 0
    return mine if mine < (os.cpu_count() or mine) else 0

"""What machine a benchmark ran on: every figure is reported with it."""

from __future__ import annotations

import os

from drafter_service.model.hardware import cpu_model_and_flags

__all__ = ["machine"]


def machine() -> str:
    """CPU model, core count and the vector extensions the figures depend on."""
    model, flags = cpu_model_and_flags()
    vector = [f for f in ("avx2", "avx512f", "avx512_bf16", "amx_bf16") if f in flags]
    return f"{model} ({os.cpu_count()} cores; {', '.join(vector) or 'no AVX2'})"

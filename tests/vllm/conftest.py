"""Real vLLM engines, in vLLM's own venv (``make vllm``): without that venv these tests are skipped, unless
DRAFTER_REQUIRE_VLLM=1 (``make test`` sets it) makes them fail."""

from __future__ import annotations

import os

from drafter_service.bench.vllm_process import vllm_python

if not vllm_python().exists():
    if os.environ.get("DRAFTER_REQUIRE_VLLM") == "1":
        raise RuntimeError(f"{vllm_python()} is missing: run `make vllm`")
    collect_ignore_glob = ["test_*.py"]  # skipped: vLLM's venv is missing (make vllm)

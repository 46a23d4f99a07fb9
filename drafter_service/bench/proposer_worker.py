"""The proposers of ``drafter bench proposer`` in vLLM's venv, driven by JSON lines.

Run as ``python -m drafter_service.bench.proposer_worker --requests FILE --warm N --max-model-len L``: the first
N requests of FILE warm the stateful proposers, the rest are held back and replayed. Each stdin line is a command,
each answer one stdout line starting with ``@@result ``:

- ``{"op": "run", "method": "drafter"|"drafter-sync"|"suffix"|"ngram", "batch": B, "k": K, "steps": S,
  "warmup": W, "step_ms": T, "env": {...}}`` -> the run's summary (``ReplayRun.summary``) and, for drafter, the
  proposer's figures over the timed steps. ``env`` is set before the proposer is built (DRAFTER_ADDRESS ...).
- ``{"op": "quit"}``.

Every proposer is vLLM's own class (or drafter's ``DrafterProposer``) on a real ``InputBatch``, called as vLLM
0.32's ``GPUModelRunner.propose_draft_token_ids`` calls it. Only this module imports vLLM.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import traceback
from collections.abc import Sequence
from types import SimpleNamespace
from typing import Any

import numpy as np

from drafter_service.bench.proposer_replay import FIGURES, BenchRunner, StepLoop, close_proposer, proposer_figures
from drafter_service.bench.vllm_engine import RESULT, speculative_config
from drafter_service.datasets.request_files import Request, read_requests

#: Vocabulary of the service's namespace (``ServiceProcess``) and of SmolLM2, whose tokens the data sets hold.
VOCAB_SIZE = 49152

#: Environment variables a run may set: cleared before each run so that one run's settings never leak into the next.
DRAFTER_VARIABLES = ("DRAFTER_ADDRESS", "DRAFTER_COST_AWARE", "DRAFTER_PRESPECULATE", "DRAFTER_TIMEOUT")


def _answer(payload: dict[str, Any]) -> None:
    sys.stdout.write(RESULT + json.dumps(payload) + "\n")
    sys.stdout.flush()


def vllm_config(method: str, k: int, batch: int, max_model_len: int) -> SimpleNamespace:
    """The parts of ``VllmConfig`` the proposers read, with vLLM's own ``SpeculativeConfig`` for ngram and suffix
    (its defaults: suffix tree depth 24, spec factor 1.0, min token prob 0.1; ngram as ``bench vllm`` runs it)."""
    from vllm.config import SpeculativeConfig

    if method in ("ngram", "suffix"):
        spec: Any = SpeculativeConfig(**(speculative_config(method, k) or {}))
    else:
        spec = SimpleNamespace(num_speculative_tokens=k, method="custom_class")
    return SimpleNamespace(speculative_config=spec,
                           model_config=SimpleNamespace(max_model_len=max_model_len, get_vocab_size=lambda: VOCAB_SIZE),
                           scheduler_config=SimpleNamespace(max_num_seqs=batch),
                           parallel_config=SimpleNamespace(tensor_parallel_size=1))


def input_batch(batch: int, max_model_len: int, k: int) -> Any:
    """vLLM's persistent batch for ``batch`` rows on the CPU (the rows the model runner keeps)."""
    import torch
    from vllm.v1.worker.gpu_input_batch import InputBatch

    return InputBatch(max_num_reqs=batch, max_model_len=max_model_len,
                      max_num_batched_tokens=max(8192, batch * (k + 1)), device=torch.device("cpu"),
                      vocab_size=VOCAB_SIZE, block_sizes=[16], max_num_blocks_per_req=[math.ceil(max_model_len / 16)],
                      num_spec_tokens=k)


def cached_state(req_id: str, prompt: Sequence[int], max_tokens: int) -> Any:
    """vLLM's ``CachedRequestState`` of a new greedy request."""
    from vllm.sampling_params import SamplingParams
    from vllm.v1.worker.gpu_input_batch import CachedRequestState

    return CachedRequestState(req_id=req_id, prompt_token_ids=list(prompt), mm_features=[],
                              sampling_params=SamplingParams(temperature=0.0, max_tokens=max_tokens),
                              generator=None, block_ids=([],), num_computed_tokens=0, output_token_ids=[])


def build_proposer(method: str, config: SimpleNamespace, warm: Sequence[Request]) -> tuple[Any, str]:
    """The proposer of ``method`` and how the runner calls it; suffix's cache warmed with ``warm``.

    suffix sees each warm request as vLLM's ``SuffixDecodingProposer`` sees a request it served: started with its
    prompt, its output added, stopped (the output stays in the global cache).
    """
    if method == "ngram":
        from vllm.v1.spec_decode.ngram_proposer import NgramProposer

        return NgramProposer(config), "ngram"
    if method == "suffix":
        from vllm.v1.spec_decode.suffix_decoding import SuffixDecodingProposer

        proposer = SuffixDecodingProposer(config)
        cache = proposer.suffix_cache
        for i, req in enumerate(warm):
            req_id = f"warm-{i}"
            cache.start_request(req_id, np.array(req.prompt, dtype=np.int32))
            cache.add_active_response(req_id, req.output.tolist())
            cache.stop_request(req_id)
        return proposer, "suffix"
    from engines.vllm import DrafterProposer

    return DrafterProposer(config), "custom_class"


def run(command: dict[str, Any], warm: Sequence[Request], held: Sequence[Request],
        max_model_len: int) -> dict[str, Any]:
    """One method at one batch size: build, replay ``warmup`` + ``steps`` engine steps, summarise."""
    method, batch, k = str(command["method"]), int(command["batch"]), int(command["k"])
    for name in DRAFTER_VARIABLES:
        os.environ.pop(name, None)
    os.environ.update({str(n): str(v) for n, v in command.get("env", {}).items()})
    config = vllm_config(method, k, batch, max_model_len)
    proposer, kind = build_proposer(method, config, warm)
    runner = BenchRunner(proposer, kind, input_batch(batch, max_model_len, k), k)
    runner.load_model()
    if kind == "custom_class" and getattr(proposer, "_tracker", None) is None:
        close_proposer(proposer)
        return {"error": f"DrafterProposer did not connect to {os.environ.get('DRAFTER_ADDRESS')}"}
    loop = StepLoop(runner, held, batch, cached_state, float(command["step_ms"]))
    try:
        for _ in range(int(command["warmup"])):
            loop.step(None)
        before = proposer_figures(proposer)
        replay = loop.run(int(command["steps"]))
        after = proposer_figures(proposer)
    finally:
        close_proposer(proposer)
    out = {"method": method, "batch": batch, **replay.summary()}
    if kind == "custom_class":
        out["figures"] = {name: after[name] - before[name] for name in FIGURES}
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", required=True, help="request JSONL: the warm requests, then the held-back ones")
    parser.add_argument("--warm", type=int, required=True, help="leading requests of the file that warm")
    parser.add_argument("--max-model-len", type=int, required=True)
    args = parser.parse_args(argv)
    requests = list(read_requests(args.requests))
    warm, held = requests[:args.warm], requests[args.warm:]
    import torch

    torch.set_num_threads(1)  # the engine's own bookkeeping, untimed: leave the cores to the proposers
    import vllm.v1.spec_decode.ngram_proposer  # noqa: F401  (loaded before the ready answer: runs time no imports)

    _answer({"ready": True, "warm": len(warm), "held": len(held)})
    for line in sys.stdin:
        if not line.strip():
            continue
        command = json.loads(line)
        if command.get("op") == "quit":
            break
        try:
            if command.get("op") != "run":
                raise ValueError(f"unknown op {command.get('op')!r}")
            _answer(run(command, warm, held, args.max_model_len))
        except Exception as exc:
            traceback.print_exc()
            _answer({"error": f"{type(exc).__name__}: {exc}"})
    _answer({"bye": True})


if __name__ == "__main__":
    main()

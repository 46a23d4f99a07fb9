"""A vLLM engine in its own process (vLLM's venv), driven by JSON lines: ``drafter bench vllm`` and its tests use it.

Run as ``python -m drafter_service.bench.vllm_engine --model DIR --method none|ngram|suffix|drafter --k K``. Each
line on stdin is a command; each answer is one stdout line starting with ``@@result `` (vLLM's own logging goes
to the same streams and is skipped by the reader):

- ``{"op": "generate", "prompts": [[ids...], ...], "max_tokens": N}`` -> ``{"outputs": [[ids...], ...],
  "seconds": s, "counters": {...}}``: greedy outputs in prompt order; the counters are vLLM's, cumulative.
  ``max_tokens`` may also be a list, one per prompt; ``"ignore_eos": true`` generates past the end token.
- ``{"op": "quit"}``: shut the engine down.

Only this module imports vLLM; it runs inside vLLM's venv (``make vllm``).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from typing import Any

RESULT = "@@result "
"""Prefix of the driver's answer lines."""

#: vLLM's counters the benchmark and the tests read (cumulative over the engine's life).
COUNTERS = ("vllm:spec_decode_num_drafts", "vllm:spec_decode_num_draft_tokens", "vllm:spec_decode_num_accepted_tokens",
            "vllm:generation_tokens", "vllm:prompt_tokens")


def speculative_config(method: str, k: int) -> dict[str, Any] | None:
    """vLLM's ``speculative_config`` for one method at speculative length ``k`` (None: no speculation)."""
    if method == "none":
        return None
    if method == "ngram":
        return {"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_min": 2, "prompt_lookup_max": 5}
    if method == "suffix":
        return {"method": "suffix", "num_speculative_tokens": k}
    if method == "drafter":
        return {"method": "custom_class", "model": "engines.vllm.DrafterProposer", "num_speculative_tokens": k}
    raise ValueError(f"unknown method {method!r}: none, ngram, suffix or drafter")


def _counters(llm: Any) -> dict[str, float]:
    out = dict.fromkeys(COUNTERS, 0.0)
    for metric in llm.get_metrics():
        if metric.name in out and hasattr(metric, "value"):
            out[metric.name] += float(metric.value)
    return out


def _answer(payload: dict[str, Any]) -> None:
    sys.stdout.write(RESULT + json.dumps(payload) + "\n")
    sys.stdout.flush()


def serve(args: argparse.Namespace) -> None:
    """Build the engine, then answer commands until ``quit`` or the end of stdin."""
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    t0 = time.perf_counter()
    # one process: the engine core and its model runner in this one (no IPC; vLLM imported once, not three times)
    layout = {"distributed_executor_backend": "uni"} if args.one_process else {}
    llm = LLM(model=args.model, skip_tokenizer_init=True, dtype=args.dtype, enforce_eager=True,
              max_model_len=args.max_model_len, speculative_config=speculative_config(args.method, args.k),
              disable_log_stats=False, seed=0, max_num_seqs=args.max_num_seqs, **layout)
    _answer({"ready": True, "seconds": time.perf_counter() - t0})
    for line in sys.stdin:
        if not line.strip():
            continue
        command = json.loads(line)
        if command.get("op") == "quit":
            break
        if command.get("op") != "generate":
            _answer({"error": f"unknown op {command.get('op')!r}"})
            continue
        limits = command["max_tokens"]
        if not isinstance(limits, list):
            limits = [limits] * len(command["prompts"])
        params = [SamplingParams(temperature=0.0, max_tokens=int(n), detokenize=False,
                                 ignore_eos=bool(command.get("ignore_eos", False))) for n in limits]
        prompts = [TokensPrompt(prompt_token_ids=[int(t) for t in p]) for p in command["prompts"]]
        t1 = time.perf_counter()
        results = llm.generate(prompts, params, use_tqdm=False)
        seconds = time.perf_counter() - t1
        if args.one_process:
            # the step that tells the model runner which requests finished (vLLM's engine core process runs it on
            # its own; here nothing would until the next generate): the proposer ends them once it has run
            llm.llm_engine.step()
        _answer({"outputs": [list(r.outputs[0].token_ids) for r in results], "seconds": seconds,
                 "counters": _counters(llm)})
    _answer({"bye": True})


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True, help="folder of the target model (transformers format)")
    parser.add_argument("--method", default="none", choices=("none", "ngram", "suffix", "drafter"))
    parser.add_argument("--k", type=int, default=4, help="speculative tokens per step")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--max-model-len", type=int, default=2048)
    parser.add_argument("--max-num-seqs", type=int, default=64)
    parser.add_argument("--one-process", action="store_true",
                        help="run vLLM's engine core and model runner in this process (vLLM's default spawns two "
                             "more processes: slower to start, as deployed)")
    args = parser.parse_args(argv)
    if args.one_process:
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
    os.environ.setdefault("VLLM_USE_V2_MODEL_RUNNER", "0")  # custom_class runs on the V1 runner: all methods alike
    serve(args)


if __name__ == "__main__":
    main()

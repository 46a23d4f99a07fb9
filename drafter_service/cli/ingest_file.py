"""Send a JSONL file of completed requests to a running service (the `drafter ingest` command's work)."""

from __future__ import annotations

from drafter_service.ingest.warm import Warmer
from drafter_service.ingest.warm_sinks import GrpcSink
from engine_client.security import ClientSecurity


def ingest_file(address: str, path: str, namespace: str = "", batch: int = 256, progress: bool = False,
                timeout: float = 60.0, security: ClientSecurity | None = None) -> tuple[int, int, int]:
    """Send the completed requests of a JSONL file in batches; malformed lines are reported and skipped.

    ``drafter warm`` without checkpoints or duplicate skipping: every valid line is stored, as engines'
    Ingest calls are.

    Args:
        batch: requests per Ingest call.
        progress: show a progress bar.
        security: TLS and bearer token (None: plaintext without a token), as for every helper here.

    Returns:
        (requests ingested, tokens ingested, malformed lines).
    """
    sink = GrpcSink(address, namespace, skip_duplicates=False, timeout=timeout, security=security)
    try:
        done = Warmer(sink, batch_tokens=1 << 22, batch_requests=batch, progress=progress).warm_file(path)
    finally:
        sink.close()
    return done.requests, done.tokens, done.malformed

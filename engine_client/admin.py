"""Operator calls to a running service: ingest request logs, read statistics, manage frozen tables."""

from __future__ import annotations

import logging
from typing import Callable, Iterator

from drafter_service.api.drafter.v1 import drafter_pb2 as pb
from drafter_service.api.drafter.v1 import drafter_pb2_grpc as pb_grpc
from engine_client.security import PLAINTEXT, ClientSecurity

logger = logging.getLogger(__name__)


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
    from drafter_service.warm import Warmer
    from drafter_service.warm_sinks import GrpcSink

    sink = GrpcSink(address, namespace, skip_duplicates=False, timeout=timeout, security=security)
    try:
        done = Warmer(sink, batch_tokens=1 << 22, batch_requests=batch, progress=progress).warm_file(path)
    finally:
        sink.close()
    return done.requests, done.tokens, done.malformed


def stats(address: str, namespace: str = "", timeout: float = 10.0, security: ClientSecurity | None = None) -> dict:
    """GetStats of a namespace as a plain dictionary."""
    with (security or PLAINTEXT).channel(address) as channel:
        reply = pb_grpc.DrafterStub(channel).GetStats(pb.GetStatsRequest(namespace=namespace), timeout=timeout)
    return {f.name: list(getattr(reply, f.name)) if f.is_repeated else getattr(reply, f.name)
            for f in reply.DESCRIPTOR.fields}


def frozen_table_chunks(table: object, name: str, namespace: str = "", source: str = "",
                        chunk_bytes: int = 4 << 20) -> Iterator[pb.FrozenTableChunk]:
    """A frozen table as PutFrozenTable chunks of whole leaders, about ``chunk_bytes`` serialized each.

    Args:
        table: anything with ``leader_len``, ``follower_len`` and ``arrays()`` (leaders (L, LL), fanout (L,),
            followers (F, FL), counts (F,)), such as ``store.frozen_table.FrozenNGramTable``.
        name: the table's name in the service.
        namespace: its namespace ("" for default).
        source: a description of its corpus.
        chunk_bytes: target size of one chunk (a leader's followers are never split).
    """
    import numpy as np

    arrays = table.arrays()  # type: ignore[attr-defined]
    ll, fl = int(table.leader_len), int(table.follower_len)  # type: ignore[attr-defined]
    fanout = np.asarray(arrays["fanout"], dtype=np.int64)
    offsets = np.concatenate([[0], np.cumsum(fanout)])  # (L + 1,) first follower of each leader
    leaders, followers = arrays["leaders"].reshape(-1), arrays["followers"].reshape(-1)

    def varint_bytes(values: np.ndarray) -> np.ndarray:  # protobuf's packed size of each non-negative value
        v = np.asarray(values).astype(np.uint64)
        return 1 + sum((v >> np.uint64(7 * k) > 0).astype(np.int64) for k in range(1, 10))

    size = varint_bytes(followers).reshape(-1, fl).sum(axis=1) + varint_bytes(arrays["counts"])  # (F,)
    held = np.concatenate([[0], np.cumsum(size)])[offsets]  # (L + 1,) follower bytes before each leader
    sent = np.concatenate([[0], np.cumsum(varint_bytes(leaders).reshape(-1, ll).sum(axis=1) + varint_bytes(fanout))])
    ends = held + sent  # (L + 1,) bytes of every leader before each one
    start = 0
    while True:  # an empty table still sends its first chunk (the service refuses it)
        stop = int(np.searchsorted(ends, ends[start] + chunk_bytes, side="right")) - 1
        stop = min(fanout.size, max(stop, start + 1))
        f0, f1 = int(offsets[start]), int(offsets[stop])
        chunk = pb.FrozenTableChunk(leaders=leaders[start * ll:stop * ll].tolist(),
                                    fanout=fanout[start:stop].tolist(), followers=followers[f0 * fl:f1 * fl].tolist(),
                                    counts=arrays["counts"][f0:f1].tolist())
        if start == 0:
            chunk.namespace, chunk.name, chunk.source = namespace, name, source
            chunk.leader_len, chunk.follower_len = ll, fl
        yield chunk
        start = stop
        if start >= fanout.size:
            return


def put_frozen_table(address: str, name: str, table: object, namespace: str = "", source: str = "",
                     chunk_bytes: int = 4 << 20, progress: Callable[[int], object] | None = None,
                     timeout: float = 600.0, security: ClientSecurity | None = None) -> dict:
    """Send a frozen table to a running service, which stores it durably and drafts from it at once.

    Args:
        address: the service's host:port.
        name: the table's name (a table of that name is replaced).
        table: see ``frozen_table_chunks``.
        namespace: its namespace ("" for default).
        source: a description of its corpus.
        chunk_bytes: target size of one message.
        progress: called with the leaders of each chunk sent.
        timeout: seconds for the whole upload.

    Returns:
        The stored table's FrozenTableInfo as a dictionary.
    """
    def chunks() -> Iterator[pb.FrozenTableChunk]:
        for chunk in frozen_table_chunks(table, name, namespace, source, chunk_bytes):
            yield chunk
            if progress is not None:
                progress(len(chunk.fanout))

    with (security or PLAINTEXT).channel(address) as channel:
        reply = pb_grpc.DrafterStub(channel).PutFrozenTable(chunks(), timeout=timeout)
    return _info(reply)


def list_frozen_tables(address: str, namespace: str = "", timeout: float = 10.0,
                       security: ClientSecurity | None = None) -> list[dict]:
    """The frozen tables of a namespace, by name, as dictionaries of FrozenTableInfo fields."""
    with (security or PLAINTEXT).channel(address) as channel:
        reply = pb_grpc.DrafterStub(channel).ListFrozenTables(pb.ListFrozenTablesRequest(namespace=namespace),
                                                              timeout=timeout)
    return [_info(t) for t in reply.tables]


def remove_frozen_table(address: str, name: str, namespace: str = "", timeout: float = 30.0,
                        security: ClientSecurity | None = None) -> bool:
    """Delete a frozen table from a running service; False when it had none of that name."""
    with (security or PLAINTEXT).channel(address) as channel:
        reply = pb_grpc.DrafterStub(channel).RemoveFrozenTable(
            pb.RemoveFrozenTableRequest(namespace=namespace, name=name), timeout=timeout)
    return bool(reply.removed)


def _info(message: pb.FrozenTableInfo) -> dict:
    return {f.name: getattr(message, f.name) for f in message.DESCRIPTOR.fields}

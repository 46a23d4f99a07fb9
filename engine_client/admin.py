"""Operator calls to a running service: read statistics, manage frozen tables."""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator

from drafter_service.api.drafter.v1 import drafter_pb2 as pb
from drafter_service.api.drafter.v1 import drafter_pb2_grpc as pb_grpc
from drafter_service.api.frozen_wire import frozen_table_chunks
from engine_client.security import PLAINTEXT, ClientSecurity

logger = logging.getLogger(__name__)


def stats(address: str, namespace: str = "", timeout: float = 10.0, security: ClientSecurity | None = None) -> dict:
    """GetStats of a namespace as a plain dictionary."""
    with (security or PLAINTEXT).channel(address) as channel:
        reply = pb_grpc.DrafterStub(channel).GetStats(pb.GetStatsRequest(namespace=namespace), timeout=timeout)
    return {f.name: list(getattr(reply, f.name)) if f.is_repeated else getattr(reply, f.name)
            for f in reply.DESCRIPTOR.fields}


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

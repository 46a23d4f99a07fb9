"""The frozen-table wire format: a table as PutFrozenTable chunks of whole leaders, and back."""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import numpy as np

from drafter_service.api.drafter.v1 import drafter_pb2 as pb
from drafter_service.api.errors import InvalidArgument
from store.frozen_table import FrozenNGramTable


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
    arrays = table.arrays()  # type: ignore[attr-defined]
    ll, fl = int(table.leader_len), int(table.follower_len)  # type: ignore[attr-defined]
    fanout = np.asarray(arrays["fanout"], dtype=np.int64)
    offsets = np.concatenate([[0], np.cumsum(fanout)])  # (L + 1,) first follower of each leader
    leaders, followers = arrays["leaders"].reshape(-1), arrays["followers"].reshape(-1)

    def varint_bytes(values: np.ndarray) -> np.ndarray:  # protobuf's packed size of each non-negative value
        v = np.asarray(values).astype(np.uint64)
        size = np.ones(v.shape, dtype=np.int64)
        for k in range(1, 10):
            size += v >> np.uint64(7 * k) > 0
        return size

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


def table_from_chunks(chunks: Iterable[pb.FrozenTableChunk]) -> tuple[str, str, str, FrozenNGramTable]:
    """Assemble a PutFrozenTable stream: the first chunk names the table, every chunk holds whole leaders.

    Returns:
        (namespace, name, source, table).

    Raises:
        InvalidArgument: an empty stream, naming fields on a later chunk, arrays whose sizes do not fit
            the n-gram lengths and fanouts, or arrays that do not form a table.
    """
    parts: dict[str, list[np.ndarray]] = {"leaders": [], "fanout": [], "followers": [], "counts": []}
    first = None
    for i, chunk in enumerate(chunks):
        if first is None:
            first = chunk
            if first.leader_len < 1 or first.follower_len < 1:
                raise InvalidArgument("the first chunk must give leader_len and follower_len (at least 1)")
        elif chunk.namespace or chunk.name or chunk.source or chunk.leader_len or chunk.follower_len:
            raise InvalidArgument(f"chunk {i}: namespace, name, source and n-gram lengths belong to the first "
                                  "chunk only")
        leaders = np.array(chunk.leaders, dtype=np.int32)  # (l * LL,) token ids
        fanout = np.array(chunk.fanout, dtype=np.int32)  # (l,)
        followers = np.array(chunk.followers, dtype=np.int32)  # (f * FL,) token ids
        counts = np.array(chunk.counts, dtype=np.int64)  # (f,)
        if leaders.size != fanout.size * first.leader_len:
            raise InvalidArgument(f"chunk {i}: {leaders.size} leader ids for {fanout.size} leaders of "
                                  f"{first.leader_len} tokens")
        total = int(fanout.sum(dtype=np.int64))
        if counts.size != total or followers.size != total * first.follower_len:
            raise InvalidArgument(f"chunk {i}: fanout adds up to {total} followers but it holds {counts.size} "
                                  f"counts and {followers.size} follower ids ({first.follower_len} per follower)")
        chunk_arrays: tuple[np.ndarray, ...] = (leaders, fanout, followers, counts)
        for name, arr in zip(parts, chunk_arrays, strict=True):
            parts[name].append(arr)
    if first is None:
        raise InvalidArgument("empty stream: no table chunks")
    arrays = {name: np.concatenate(arrs) for name, arrs in parts.items()}
    try:
        table = FrozenNGramTable.from_arrays(first.leader_len, first.follower_len, **arrays)
    except ValueError as exc:
        raise InvalidArgument(f"frozen table {first.name!r}: {exc}") from None
    return first.namespace, first.name, first.source, table

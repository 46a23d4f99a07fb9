"""Snapshots in Redis: chunked array blobs behind atomic renames, for n-gram tables and acceptance statistics."""

from __future__ import annotations

import json
import logging
import time
import uuid
from collections.abc import Callable
from typing import cast

import numpy as np
import redis

from store.frozen_table import FrozenNGramTable
from store.redis_common import FORMAT_VERSION, PersistenceError, validate_name
from store.redis_common import redis_errors as _redis_errors
from store.redis_connect import RedisClient, RedisPipeline
from store.table_codec import Items, decode_items, encode_items

logger = logging.getLogger(__name__)

_CHUNK_BYTES = 64 << 20  # largest blob stored in one hash field
_TEMP_TTL_S = 3600  # a snapshot abandoned half-written expires on its own
_EVENTS_KEPT = 1000  # events kept for replicas that follow the namespace (about; trimmed approximately)


class SnapshotStore:
    """The snapshot part of ``RedisPersistence`` (which sets ``client``, ``prefix``, ``namespace``,
    ``vocab_size``, ``table_key``, ``model_key`` and ``frozen_set_key``)."""

    client: RedisClient
    prefix: str
    namespace: str
    vocab_size: int | None
    table_key: str
    model_key: str
    frozen_set_key: str
    events_key: str

    # -- blobs -----------------------------------------------------------------------------------------------

    def _write_blobs(self, key: str, header: dict, arrays: dict[str, np.ndarray],
                     extra: Callable[[RedisPipeline], object] | None = None) -> None:
        """Write ``arrays`` (chunked) and ``header`` to a temporary key, then rename it onto ``key``.

        ``extra`` adds commands to the transaction that renames, so they take effect together.
        """
        temp = f"{key}:tmp:{uuid.uuid4().hex}"
        header = dict(header, arrays={})
        with _redis_errors(f"write {key}"):
            try:
                pipe = self.client.pipeline(transaction=False)
                for name, arr in arrays.items():
                    data = np.ascontiguousarray(arr).astype(arr.dtype.newbyteorder("<"), copy=False)
                    raw = memoryview(data.tobytes())
                    chunks = max(1, -(-len(raw) // _CHUNK_BYTES))
                    header["arrays"][name] = [data.dtype.str, list(data.shape), chunks]
                    for c in range(chunks):
                        pipe.hset(temp, f"{name}.{c}", raw[c * _CHUNK_BYTES:(c + 1) * _CHUNK_BYTES].tobytes())
                        pipe.expire(temp, _TEMP_TTL_S)
                pipe.hset(temp, "header", json.dumps(header))
                pipe.execute()
                tx = self.client.pipeline(transaction=True)
                tx.execute_command("RENAME", temp, key)  # a cluster pipeline refuses .rename(); one slot here
                tx.persist(key)
                if extra is not None:
                    extra(tx)
                tx.execute()
            except BaseException:
                self._discard(temp)
                raise

    def _discard(self, temp: str) -> None:
        try:
            self.client.delete(temp)
        except redis.RedisError:  # it expires on its own
            logger.warning("could not delete the abandoned snapshot key %s", temp)

    def _read_blobs(self, key: str) -> tuple[dict, dict[str, np.ndarray]] | None:
        with _redis_errors(f"read {key}"):
            fields = cast("dict[bytes, bytes]", self.client.hgetall(key))  # see redis_common.StreamEntry
        if not fields:
            return None
        try:
            header = json.loads(fields[b"header"])
            if header.get("format") != FORMAT_VERSION:
                raise PersistenceError(f"{key} has format {header.get('format')!r}; expected {FORMAT_VERSION}")
            arrays = {}
            for name, (dtype, shape, chunks) in header["arrays"].items():
                raw = b"".join(fields[f"{name}.{c}".encode()] for c in range(chunks))
                native = np.dtype(dtype).newbyteorder("=")
                arrays[name] = np.frombuffer(raw, dtype=dtype).astype(native).reshape(shape)
        except (KeyError, ValueError, TypeError) as exc:
            raise PersistenceError(f"{key} is not a readable snapshot: {exc!r}") from exc
        return header, arrays

    # -- n-gram tables ---------------------------------------------------------------------------------------

    def save_table(self, items: Items, last_request_id: str | None = None) -> dict:
        """Replace the dynamic table snapshot atomically.

        Args:
            items: what ``LRUNGramTable.items()`` yields: leaders least recent first, each with its
                (follower, count) pairs least recent first.
            last_request_id: optional stream id of the newest request the table has learnt from.

        Returns:
            The snapshot's header (sizes, lengths, time).
        """
        return self.save_encoded_table(*encode_items(items, self.vocab_limit), last_request_id)

    @property
    def vocab_limit(self) -> int:
        """Token ids a saved table may hold are below this."""
        return self.vocab_size if self.vocab_size is not None else 1 << 31

    def save_encoded_table(self, header: dict, arrays: dict[str, np.ndarray],
                           last_request_id: str | None = None) -> dict:
        """``save_table`` for a table already encoded (``table_codec.encode_table`` or ``encode_items``)."""
        header = {**header, "format": FORMAT_VERSION, "kind": "table", "saved_at": time.time(),
                  "last_request_id": last_request_id}
        self._write_blobs(self.table_key, header, arrays)
        return header

    def load_table(self) -> list[tuple[tuple[int, ...], list[tuple[tuple[int, ...], int]]]]:
        """The dynamic table snapshot in ``items()`` order, ready for ``load``; [] when none was saved."""
        found = self.load_table_snapshot()
        return [] if found is None else found[0]

    def load_table_snapshot(self) -> tuple[list, dict] | None:
        """The dynamic table snapshot's items and header (with ``last_request_id``) read in one step, or None."""
        found = self._read_blobs(self.table_key)
        return None if found is None else (decode_items(found[1]), found[0])

    def table_info(self) -> dict | None:
        """Header of the dynamic table snapshot (sizes, saved_at, last_request_id), or None."""
        with _redis_errors("read the table header"):
            raw = self.client.hget(self.table_key, "header")
        return None if raw is None else json.loads(raw)

    def _frozen_key(self, name: str) -> str:
        return f"{self.prefix}frozen:{validate_name(name, 'frozen table name')}"

    def save_frozen(self, name: str, entries: Items | dict) -> None:
        """Store (or replace) a frozen table: leader -> [(follower, count), ...] in the table's order."""
        key = self._frozen_key(name)
        header, arrays = encode_items(entries.items() if isinstance(entries, dict) else entries,
                                      self.vocab_size if self.vocab_size is not None else 1 << 31)
        header.update(format=FORMAT_VERSION, kind="frozen", name=name, saved_at=time.time())
        self._write_blobs(key, header, arrays, extra=lambda tx: self._frozen_changed(tx, name, "put"))

    def load_frozen(self, name: str) -> dict[tuple[int, ...], list[tuple[tuple[int, ...], int]]]:
        """The entries of frozen table ``name``, in their stored order.

        Raises:
            KeyError: no frozen table of that name.
        """
        found = self._read_blobs(self._frozen_key(name))
        if found is None:
            raise KeyError(f"no frozen table {name!r} in namespace {self.namespace!r}")
        return dict(decode_items(found[1]))

    def list_frozen(self) -> list[str]:
        """Names of the stored frozen tables, sorted."""
        with _redis_errors("list frozen tables"):
            return sorted(n.decode() for n in cast("set[bytes]", self.client.smembers(self.frozen_set_key)))

    def delete_frozen(self, name: str) -> bool:
        """Delete frozen table ``name``; False when there was none."""
        key = self._frozen_key(name)
        with _redis_errors(f"delete {key}"):
            tx = self.client.pipeline(transaction=True)
            tx.delete(key)
            self._frozen_changed(tx, name, "remove")
            return bool(tx.execute()[0])

    def _frozen_changed(self, tx: RedisPipeline, name: str, op: str) -> None:
        """Add to ``tx``: the table's entry in the set of names, and the event that tells other replicas."""
        if op == "put":
            tx.sadd(self.frozen_set_key, name)
        else:
            tx.srem(self.frozen_set_key, name)
        tx.xadd(self.events_key, {"k": "frozen", "n": name, "o": op}, maxlen=_EVENTS_KEPT, approximate=True)

    def frozen_header(self, name: str) -> dict | None:
        """Header of stored frozen table ``name`` (name, source, saved_at, sizes), or None when there is none."""
        with _redis_errors("read a frozen table header"):
            raw = self.client.hget(self._frozen_key(name), "header")
        if raw is None:
            return None
        header = json.loads(raw)
        header.pop("arrays", None)
        header.setdefault("source", "")
        return header

    def save_frozen_table(self, name: str, table: FrozenNGramTable, source: str = "") -> dict:
        """Store (or replace) a frozen table from its arrays, atomically; returns its header.

        Args:
            name: the table's name (``[A-Za-z0-9_.-]{1,64}``).
            table: the table.
            source: a description of the corpus it was built from.

        Returns:
            name, source, saved_at (Unix time), leader_len, follower_len, leaders, followers.

        Raises:
            ValueError: a bad name, or token ids outside the namespace's vocabulary (nothing is written).
        """
        key = self._frozen_key(name)
        limit = self.vocab_size if self.vocab_size is not None else 1 << 31
        if table.max_token >= limit:
            raise ValueError(f"frozen table {name!r} holds token id {table.max_token} outside [0, {limit})")
        header = {"format": FORMAT_VERSION, "kind": "frozen", "name": name, "source": str(source),
                  "saved_at": time.time(), "leader_len": table.leader_len, "follower_len": table.follower_len,
                  "leaders": len(table), "followers": table.followers}
        self._write_blobs(key, header, table.arrays(), extra=lambda tx: self._frozen_changed(tx, name, "put"))
        return header

    def load_frozen_table(self, name: str) -> tuple[FrozenNGramTable, dict]:
        """Frozen table ``name`` straight from its stored arrays (``save_frozen`` ones too), with its header.

        Raises:
            KeyError: no frozen table of that name.
            PersistenceError: the stored arrays do not form a table.
        """
        key = self._frozen_key(name)
        found = self._read_blobs(key)
        if found is None:
            raise KeyError(f"no frozen table {name!r} in namespace {self.namespace!r}")
        header, arrays = found
        try:
            table = FrozenNGramTable.from_arrays(int(header["leader_len"]), int(header["follower_len"]),
                                                 arrays["leaders"], arrays["fanout"], arrays["followers"],
                                                 arrays["counts"])
        except (KeyError, ValueError) as exc:
            raise PersistenceError(f"{key} is not a readable frozen table: {exc}") from exc
        header = {k: v for k, v in header.items() if k != "arrays"}
        header.setdefault("source", "")
        return table, header

    # -- acceptance statistics -------------------------------------------------------------------------------

    def save_model(self, stats: dict[int, tuple[float, float]]) -> None:
        """Replace the acceptance statistics (``AcceptanceModel.snapshot()``: key -> (accepted, trials))."""
        keys = np.array(sorted(stats), dtype=np.int64)  # (K,) evidence keys
        values = np.array([stats[k] for k in keys.tolist()], dtype=np.float64).reshape(len(keys), 2)  # (K, 2)
        self._write_blobs(self.model_key, {"format": FORMAT_VERSION, "kind": "model", "saved_at": time.time()},
                          {"keys": keys, "values": values})

    def load_model(self) -> dict[int, tuple[float, float]]:
        """The saved acceptance statistics ({} when none)."""
        found = self._read_blobs(self.model_key)
        if found is None:
            return {}
        arrays = found[1]
        return {k: (a, t) for k, (a, t) in zip(arrays["keys"].tolist(), arrays["values"].tolist(), strict=True)}

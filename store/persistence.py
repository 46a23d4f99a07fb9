"""Durable state of one namespace in Redis: the request log, table snapshots and acceptance statistics."""

from __future__ import annotations

import json
import logging
import re
import time
import uuid
from contextlib import contextmanager
from typing import Callable, Iterator, Sequence

import numpy as np
import redis

from store.table_codec import Items, decode_items, encode_items

logger = logging.getLogger(__name__)

FORMAT_VERSION = 1
"""Layout version of every key below; part of each key name and recorded per namespace."""

NAME_PATTERN = re.compile(r"[A-Za-z0-9_.-]{1,64}")
"""Namespaces and frozen-table names."""

_FORMATS_KEY = "drafter:formats"  # unversioned hash: namespace -> layout version that owns it
_CHUNK_BYTES = 64 << 20  # largest blob stored in one hash field
_TEMP_TTL_S = 3600  # a snapshot abandoned half-written expires on its own

# Append a batch of requests. Each stream id is "<end>-0" where <end> counts every slot a ring buffer
# gives the requests so far (tokens plus one separator each), so ids increase and say where each request
# ends; KEYS: stream, meta; ARGV: (tokens, has id "0"/"1", id) per request.
_APPEND_LUA = """
local pos = tonumber(redis.call('HGET', KEYS[2], 'end') or '0')
local ids = {}
for i = 1, #ARGV, 3 do
  pos = pos + string.len(ARGV[i]) / 4 + 1
  local id = string.format('%d-0', pos)
  if ARGV[i + 1] == '1' then
    redis.call('XADD', KEYS[1], id, 't', ARGV[i], 'r', ARGV[i + 2])
  else
    redis.call('XADD', KEYS[1], id, 't', ARGV[i])
  end
  ids[#ids + 1] = id
end
redis.call('HSET', KEYS[2], 'end', string.format('%d', pos))
return ids
"""

# Drop every request that ends at or before slot end - keep; KEYS: stream, meta; ARGV: keep.
_TRIM_LUA = """
local min_end = tonumber(redis.call('HGET', KEYS[2], 'end') or '0') - tonumber(ARGV[1]) + 1
if min_end <= 1 then return 0 end
return redis.call('XTRIM', KEYS[1], 'MINID', string.format('%d-0', min_end))
"""


class PersistenceError(RuntimeError):
    """Stored data cannot be used as asked (other layout version or vocabulary) or a write is not durable."""


class PersistenceUnavailable(PersistenceError):
    """The Redis server cannot be reached or failed the command."""


def validate_name(name: str, what: str = "name") -> str:
    """Return ``name`` when it matches ``[A-Za-z0-9_.-]{1,64}``; raise ValueError otherwise."""
    if not isinstance(name, str) or not NAME_PATTERN.fullmatch(name):
        raise ValueError(f"{what} must match [A-Za-z0-9_.-]{{1,64}}, got {name!r}")
    return name


@contextmanager
def _redis_errors(action: str) -> Iterator[None]:
    try:
        yield
    except redis.RedisError as exc:
        raise PersistenceUnavailable(f"Redis failed to {action}: {exc}") from exc


class RedisPersistence:
    """Everything one namespace keeps in Redis, under keys ``drafter:v1:{<namespace>}:...``.

    The braces make every key of a namespace hash to one cluster slot, so the scripts and transactions
    below work on a cluster too. Keys:
        meta       hash: format, vocab_size, end (ring slots given to all requests ever appended)
        requests   stream of completed requests: t = little-endian int32 tokens, r = request id (optional)
        table      hash of blobs: the dynamic n-gram table snapshot
        frozen:<name>, frozen   hashes of blobs per frozen table; set of their names
        model      hash of blobs: acceptance statistics
    Snapshots are written under a temporary key and renamed, so readers see the old or the new one whole.
    Token ids are validated before anything is written, so a rejected call changes nothing.
    """

    def __init__(self, client_or_url: "redis.Redis | str", namespace: str, vocab_size: int | None = None,
                 durable: bool = True, fsync_timeout_ms: int = 5000) -> None:
        """Connect and check (or record) the namespace's layout version and vocabulary size.

        Args:
            client_or_url: a ``redis.Redis`` client without ``decode_responses``, or a ``redis://`` URL.
            namespace: the token space; validated like names.
            vocab_size: token ids must be below it; recorded at first use and checked after (None: neither).
            durable: require the server to fsync its append-only file before an append returns.
            fsync_timeout_ms: how long an append waits for that fsync.

        Raises:
            PersistenceError: stored data of another layout version or vocabulary size, or ``durable``
                with a server whose append-only file is disabled.
            PersistenceUnavailable: the server cannot be reached.
        """
        self.namespace = validate_name(namespace, "namespace")
        if isinstance(client_or_url, str):
            self.client = redis.Redis.from_url(client_or_url, decode_responses=False, socket_connect_timeout=5,
                                               socket_timeout=60, health_check_interval=30)
        else:
            self.client = client_or_url
            if self.client.get_connection_kwargs().get("decode_responses"):
                raise ValueError("the Redis client must not decode responses (binary token blobs)")
        self.vocab_size = None if vocab_size is None else int(vocab_size)
        self.durable = bool(durable)
        self.fsync_timeout_ms = int(fsync_timeout_ms)
        prefix = f"drafter:v{FORMAT_VERSION}:{{{namespace}}}:"
        self.prefix = prefix
        self.meta_key, self.stream_key = prefix + "meta", prefix + "requests"
        self.table_key, self.model_key = prefix + "table", prefix + "model"
        self.frozen_set_key = prefix + "frozen"
        self._append = self.client.register_script(_APPEND_LUA)
        self._trim = self.client.register_script(_TRIM_LUA)
        with _redis_errors("open the namespace"):
            self._check_format()
            self._wait_aof = self._check_durability() if self.durable else False

    # -- layout checks -------------------------------------------------------------------------------------

    def _check_format(self) -> None:
        owner = self.client.hget(_FORMATS_KEY, self.namespace)
        if owner is not None and owner != str(FORMAT_VERSION).encode():
            raise PersistenceError(f"namespace {self.namespace!r} is stored in layout version {owner.decode()}; "
                                   f"this version reads layout {FORMAT_VERSION} only")
        pipe = self.client.pipeline(transaction=True)
        pipe.hsetnx(self.meta_key, "format", FORMAT_VERSION)
        if self.vocab_size is not None:
            pipe.hsetnx(self.meta_key, "vocab_size", self.vocab_size)
        pipe.hsetnx(_FORMATS_KEY, self.namespace, FORMAT_VERSION)
        pipe.execute()
        meta = self.client.hgetall(self.meta_key)
        if meta.get(b"format") != str(FORMAT_VERSION).encode():
            raise PersistenceError(f"namespace {self.namespace!r} has format {meta.get(b'format')!r} in "
                                   f"{self.meta_key}; expected {FORMAT_VERSION}")
        stored = meta.get(b"vocab_size")
        if self.vocab_size is not None and stored is not None and int(stored) != self.vocab_size:
            raise PersistenceError(f"namespace {self.namespace!r} was stored with vocab_size {int(stored)}, "
                                   f"not {self.vocab_size}: its tokens belong to another tokenizer")
        if self.vocab_size is None and stored is not None:
            self.vocab_size = int(stored)

    def _check_durability(self) -> bool:
        """Whether appends can wait for the fsync with WAITAOF; raise if the server does not persist."""
        info = self.client.info("persistence")
        if not int(info.get("aof_enabled", 0)):
            raise PersistenceError("the Redis server has appendonly disabled, so acknowledged requests would "
                                   "not survive its restart; enable appendonly or open with durable=False")
        try:
            self.client.execute_command("WAITAOF", 0, 0, 0)
        except redis.ResponseError:
            logger.warning("the Redis server has no WAITAOF (Redis < 7.2); appends rely on its appendfsync")
            return False
        return True

    # -- request log -----------------------------------------------------------------------------------------

    def _tokens(self, tokens: np.ndarray | Sequence[int]) -> bytes:
        arr = np.asarray(tokens)
        if arr.ndim != 1 or (arr.size and arr.dtype.kind not in "iu"):
            raise ValueError(f"a request must be a 1-D integer array, got shape {arr.shape} dtype {arr.dtype}")
        if arr.size:
            lo, hi = int(arr.min()), int(arr.max())
            limit = self.vocab_size if self.vocab_size is not None else 1 << 31
            if lo < 0 or hi >= limit:
                raise ValueError(f"token ids must be in [0, {limit}), got {lo if lo < 0 else hi}")
        return arr.astype("<i4", copy=False).tobytes()

    def append_requests(self, docs: Sequence[tuple[np.ndarray, str | None]]) -> list[str]:
        """Append completed requests to the log in one atomic step and return once they are durable.

        Args:
            docs: (tokens (n,) int array of prompt + output, request id or None) per request.

        Returns:
            The requests' stream ids, in order.

        Raises:
            ValueError: a request is not a 1-D array of valid token ids (nothing is written).
            PersistenceError: the server did not confirm the fsync in time.
        """
        args: list[bytes | str] = []
        for tokens, request_id in docs:
            args += [self._tokens(tokens), "0" if request_id is None else "1", request_id or ""]
        if not args:
            return []
        with _redis_errors("append requests"):
            replies = self._append_and_wait(args)
        if self._wait_aof and int(replies[1][0]) < 1:
            raise PersistenceError(f"the server did not fsync {len(docs)} appended requests within "
                                   f"{self.fsync_timeout_ms} ms; they may be lost on a crash")
        return [i.decode() for i in replies[0]]

    def _append_and_wait(self, args: list) -> list:
        """Run the append script and WAITAOF in one round trip (loading the script first if the server lost it)."""
        for attempt in range(2):
            pipe = self.client.pipeline(transaction=False)
            pipe.evalsha(self._append.sha, 2, self.stream_key, self.meta_key, *args)
            if self._wait_aof:
                pipe.execute_command("WAITAOF", 1, 0, self.fsync_timeout_ms)
            replies = pipe.execute(raise_on_error=False)
            if attempt == 0 and isinstance(replies[0], redis.exceptions.NoScriptError):
                self.client.script_load(_APPEND_LUA)  # nothing was written
                continue
            for reply in replies:
                if isinstance(reply, Exception):
                    raise reply
            return replies
        raise AssertionError("unreachable")

    def iter_requests(self, after: str = "0-0", batch: int = 1000) -> Iterator[tuple[str, np.ndarray, str | None]]:
        """Stream the logged requests after stream id ``after``, oldest first.

        Yields:
            (stream id, (n,) int32 tokens, request id or None).
        """
        cursor = after
        while True:
            with _redis_errors("read requests"):
                entries = self.client.xrange(self.stream_key, f"({cursor}", "+", count=batch)
            for sid, fields in entries:
                rid = fields.get(b"r")
                yield (sid.decode(), np.frombuffer(fields[b"t"], dtype="<i4").astype(np.int32),
                       None if rid is None else rid.decode())
            if len(entries) < batch:
                return
            cursor = entries[-1][0].decode()

    def request_count(self) -> int:
        """Requests held in the log."""
        with _redis_errors("count requests"):
            return int(self.client.xlen(self.stream_key))

    def last_id(self) -> str:
        """Stream id of the newest request ever appended ("0-0" when none), trimmed or not."""
        with _redis_errors("read the log position"):
            end = self.client.hget(self.meta_key, "end")
        return f"{int(end)}-0" if end else "0-0"

    def trim_requests(self, keep_tokens: int) -> int:
        """Drop the requests a ring buffer of ``keep_tokens`` slots would have overwritten entirely.

        Each request takes its token count plus one separator slot. A request is kept when any of its
        slots is among the newest ``keep_tokens``, so replaying the log into a ring of that capacity gives
        the same contents as before (the oldest kept request may be partly overwritten there too).

        Returns:
            Requests removed.
        """
        if keep_tokens < 0:
            raise ValueError(f"keep_tokens must be non-negative, got {keep_tokens}")
        with _redis_errors("trim requests"):
            return int(self._trim(keys=[self.stream_key, self.meta_key], args=[int(keep_tokens)]))

    # -- blobs -----------------------------------------------------------------------------------------------

    def _write_blobs(self, key: str, header: dict, arrays: dict[str, np.ndarray],
                     extra: Callable[["redis.client.Pipeline"], object] | None = None) -> None:
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
                tx.rename(temp, key)
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
            fields = self.client.hgetall(key)
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
        header, arrays = encode_items(items, self.vocab_size if self.vocab_size is not None else 1 << 31)
        header.update(format=FORMAT_VERSION, kind="table", saved_at=time.time(), last_request_id=last_request_id)
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

    def save_frozen(self, name: str, entries: "Items | dict") -> None:
        """Store (or replace) a frozen table: leader -> [(follower, count), ...] in the table's order."""
        key = self._frozen_key(name)
        header, arrays = encode_items(entries.items() if isinstance(entries, dict) else entries,
                                      self.vocab_size if self.vocab_size is not None else 1 << 31)
        header.update(format=FORMAT_VERSION, kind="frozen", name=name, saved_at=time.time())
        self._write_blobs(key, header, arrays, extra=lambda tx: tx.sadd(self.frozen_set_key, name))

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
            return sorted(n.decode() for n in self.client.smembers(self.frozen_set_key))

    def delete_frozen(self, name: str) -> bool:
        """Delete frozen table ``name``; False when there was none."""
        key = self._frozen_key(name)
        with _redis_errors(f"delete {key}"):
            tx = self.client.pipeline(transaction=True)
            tx.delete(key)
            tx.srem(self.frozen_set_key, name)
            return bool(tx.execute()[0])

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
        return {k: (a, t) for k, (a, t) in zip(arrays["keys"].tolist(), arrays["values"].tolist())}

    # -- health ----------------------------------------------------------------------------------------------

    def ping(self) -> bool:
        """True when the server answers."""
        try:
            return bool(self.client.ping())
        except redis.RedisError:
            return False

    def info(self) -> dict:
        """Server facts for statistics: version, memory, append-only file state, requests held."""
        with _redis_errors("read server info"):
            info = self.client.info()
            count = self.client.xlen(self.stream_key)
        keys = ("redis_version", "valkey_version", "used_memory", "used_memory_human", "aof_enabled",
                "aof_last_write_status", "aof_last_bgrewrite_status", "aof_rewrite_in_progress",
                "aof_current_size", "aof_base_size")
        out = {k: info[k] for k in keys if k in info}
        out.update(namespace=self.namespace, requests=int(count), last_id=self.last_id())
        return out

    def drop(self) -> int:
        """Delete every key of this namespace (and its layout record); returns the keys deleted."""
        with _redis_errors("drop the namespace"):
            keys = list(self.client.scan_iter(match=self.prefix + "*", count=1000))
            deleted = int(self.client.delete(*keys)) if keys else 0
            self.client.hdel(_FORMATS_KEY, self.namespace)
        return deleted

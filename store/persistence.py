"""Durable state of one namespace in Redis: the request log, table snapshots and acceptance statistics."""

from __future__ import annotations

import logging
import uuid
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING, cast

import numpy as np

from store.metric_log import METRICS_HISTORY, MetricLog
from store.redis_common import (
    FORMAT_VERSION,
    NAME_PATTERN,
    PersistenceError,
    PersistenceUnavailable,
    StreamEntry,
    validate_name,
)
from store.redis_common import redis_errors as _redis_errors
from store.redis_connect import RedisClient, connect, node_client, server_name
from store.request_log import (
    APPEND_LUA,
    SEEN_SUFFIX,
    WRITER_SUFFIX,
    WRITER_TTL_MS,
    Duplicates,
    RequestRecord,
    duplicate_keys,
    record_from_entry,
)
from store.server_acks import ServerAcks, wait_budget_ms
from store.snapshots import SnapshotStore

if TYPE_CHECKING:
    from redis.typing import KeyT, StreamIdT

__all__ = ["FORMAT_VERSION", "METRICS_HISTORY", "NAME_PATTERN", "PersistenceError", "PersistenceUnavailable",
           "RedisPersistence", "RequestRecord", "validate_name"]

logger = logging.getLogger(__name__)

_FORMATS_KEY = "drafter:formats"  # unversioned hash: namespace -> layout version that owns it

# Drop every request that ends at or before slot end - keep; KEYS: stream, meta; ARGV: keep.
_TRIM_LUA = """
local min_end = tonumber(redis.call('HGET', KEYS[2], 'end') or '0') - tonumber(ARGV[1]) + 1
if min_end <= 1 then return 0 end
return redis.call('XTRIM', KEYS[1], 'MINID', string.format('%d-0', min_end))
"""



class RedisPersistence(SnapshotStore, MetricLog, ServerAcks):
    """Everything one namespace keeps in Redis, under keys ``drafter:v1:{<namespace>}:...``.

    The braces make every key of a namespace hash to one cluster slot, so the scripts and transactions
    below work on a Redis Cluster too (all but ``drafter:formats``, a key of its own written apart); what is
    asked of a server rather than of a key (INFO, WAITAOF, PING) goes to the node that holds that slot. Keys:
        meta       hash: format, vocab_size, end (ring slots given to all requests ever appended), store_id
        requests   stream of completed requests: t = little-endian int32 tokens, r = request id (optional),
                   p = prompt length (optional)
        seen       set of the duplicate keys of every request ever appended (see ``append_requests``)
        writer:<id>   a writer's high-water mark: the sequence number of the last request it appended (see
                   ``append_requests``); expires 30 days after its last append
        table      hash of blobs: the dynamic n-gram table snapshot
        frozen:<name>, frozen   hashes of blobs per frozen table; set of their names
        model      hash of blobs: acceptance statistics
        metrics    stream of metric points (p = JSON object), ids "<time ms>-<seq>", trimmed to about
                   ``metrics_history`` entries
        events     stream of changes other replicas must pick up (k = "frozen", n = table name, o = "put" or
                   "remove"), written in the transaction that makes the change; about the last 1000 kept
    Snapshots are written under a temporary key and renamed, so readers see the old or the new one whole.
    Token ids are validated before anything is written, so a rejected call changes nothing.
    """

    def __init__(self, client_or_url: RedisClient | str, namespace: str, vocab_size: int | None = None,
                 durable: bool = True, fsync_timeout_ms: int | None = None,
                 metrics_history: int = METRICS_HISTORY, replica_acks: int = 0, write_timeout_s: float = 1.0) -> None:
        """Connect and check (or record) the namespace's layout version and vocabulary size.

        Args:
            client_or_url: a ``redis.Redis`` or ``RedisCluster`` client without ``decode_responses``, or a URL
                of one server, a Sentinel-managed primary or a cluster (``store.redis_connect.URL_FORMS``).
            namespace: the token space; validated like names.
            vocab_size: token ids must be below it; recorded at first use and checked after (None: neither).
            durable: require the server to fsync its append-only file before an append returns.
            fsync_timeout_ms: how long an append waits for that fsync (and as long again for the replicas); None:
                ``wait_budget_ms(write_timeout_s, replica_acks)``, so that both waits fit in ``write_timeout_s``.
            metrics_history: metric points kept (approximately: trimmed a little above it).
            replica_acks: replicas that must have received an append before it returns (WAIT), so that it
                survives a failover to one of them; ``ping`` is False, and appends fail at once, while fewer
                are online.
            write_timeout_s: with a URL, the longest an append, a health check or a read made under a namespace's
                write lock waits for a reply (they use a client of their own, ``quick_client``, with this socket
                timeout); other commands (restore, snapshots, blocking reads) keep the usual long timeouts.

        Raises:
            ValueError: a URL of no accepted form, or a client that decodes responses.
            PersistenceError: stored data of another layout version or vocabulary size, or ``durable``
                with a server whose append-only file is disabled.
            PersistenceUnavailable: the server cannot be reached.
        """
        self.namespace = validate_name(namespace, "namespace")
        if replica_acks < 0:
            raise ValueError(f"replica_acks must be at least 0, got {replica_acks}")
        self.client: RedisClient
        self.quick_client: RedisClient
        if isinstance(client_or_url, str):
            with _redis_errors("connect"):  # a cluster client reads the slot table now
                self.client = connect(client_or_url)
                self.quick_client = connect(client_or_url, timeout_s=write_timeout_s)
        else:
            self.client = self.quick_client = client_or_url
            if self.client.get_connection_kwargs().get("decode_responses"):
                raise ValueError("the Redis client must not decode responses (binary token blobs)")
        self.vocab_size = None if vocab_size is None else int(vocab_size)
        self.durable = bool(durable)
        self.replica_acks = int(replica_acks)
        self.fsync_timeout_ms = int(fsync_timeout_ms) if fsync_timeout_ms is not None else \
            wait_budget_ms(write_timeout_s, self.replica_acks)
        self._init_server_state()
        if metrics_history < 1:
            raise ValueError(f"metrics_history must be at least 1, got {metrics_history}")
        self.metrics_history = int(metrics_history)
        prefix = f"drafter:v{FORMAT_VERSION}:{{{namespace}}}:"
        self.prefix = prefix
        self.meta_key, self.stream_key = prefix + "meta", prefix + "requests"
        self.table_key, self.model_key = prefix + "table", prefix + "model"
        self.frozen_set_key = prefix + "frozen"
        self.metrics_key = prefix + "metrics"
        self.events_key = prefix + "events"
        self.seen_key = prefix + SEEN_SUFFIX
        self._append = self.client.register_script(APPEND_LUA)
        self._trim = self.client.register_script(_TRIM_LUA)
        with _redis_errors("open the namespace"):
            self._check_format()
            self._wait_aof = self._check_durability() if self.durable else False

    # -- layout checks -------------------------------------------------------------------------------------

    def _check_format(self) -> None:
        owner = cast("bytes | None", self.client.hget(_FORMATS_KEY, self.namespace))
        if owner is not None and owner != str(FORMAT_VERSION).encode():
            raise PersistenceError(f"namespace {self.namespace!r} is stored in layout version {owner.decode()}; "
                                   f"this version reads layout {FORMAT_VERSION} only")
        pipe = self.client.pipeline(transaction=True)
        pipe.hsetnx(self.meta_key, "format", FORMAT_VERSION)
        if self.vocab_size is not None:
            pipe.hsetnx(self.meta_key, "vocab_size", self.vocab_size)
        pipe.execute()
        self.client.hsetnx(_FORMATS_KEY, self.namespace, FORMAT_VERSION)  # another cluster slot: not in the MULTI
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

    def append_requests(self, docs: Sequence[tuple[np.ndarray, str | None]],
                        prompt_lens: Sequence[int | None] | None = None,
                        skip_duplicates: Duplicates | bool = False,
                        writer: tuple[str, int] | None = None) -> list[str | None]:
        """Append completed requests to the log in one atomic step and return once they are durable.

        Duplicates are found in the same step: a request is one when its request id (if not empty) or its
        content (a 16-byte BLAKE2b digest of its prompt length and tokens) is in the namespace's ``seen`` set,
        which holds both keys of every request ever appended, by sessions and ingests alike (duplicates
        inside ``docs`` included), so a request is recognised however long ago it was stored. Unlike the log,
        the set is never trimmed: it costs 40 to 70 bytes per request ever stored without an id and about
        twice that with one (valkey 9.1 with 20-character ids: 37 and 75 bytes per request by MEMORY USAGE,
        70 bytes per id-less request by used_memory), about 0.5 to 1.5 GB after 10 million requests.

        Args:
            docs: (tokens (n,) int array of prompt + output, request id or None) per request.
            prompt_lens: how many tokens of each request are its prompt (None: not recorded).
            skip_duplicates: leave duplicates out instead of appending them again (True: by id or content;
                ``Duplicates.SKIP_SAME_ID``: by id only).
            writer: (writer id, sequence number of the first request; the others follow it by one): requests
                at or below the writer's high-water mark (``writer_mark``) are left out as already appended,
                so an append retried after a lost reply stores nothing twice (the retry of the writer's last
                append answers the ids that append gave them); the mark is then raised.

        Returns:
            The requests' stream ids, in order; None for each duplicate left out, and for each request an
            earlier append of the writer stored (other than its last one, whose ids are answered again).

        Raises:
            ValueError: a request is not a 1-D array of valid token ids, or a prompt length is outside
                [0, n] (nothing is written).
            PersistenceError: the server did not confirm the fsync in time.
        """
        if prompt_lens is not None and len(prompt_lens) != len(docs):
            raise ValueError(f"{len(prompt_lens)} prompt lengths for {len(docs)} requests")
        mode = str(int(Duplicates.of(skip_duplicates)))
        keys = [self.stream_key, self.meta_key, self.seen_key]
        if writer is not None:
            keys.append(self._writer_key(writer[0]))  # (checks the id's form)
            mode += f":{int(writer[1])}:{WRITER_TTL_MS}:{writer[0]}"
        args: list[bytes | str] = [mode]
        for i, (tokens, request_id) in enumerate(docs):
            blob = self._tokens(tokens)
            given = None if prompt_lens is None else prompt_lens[i]
            plen = None if given is None else int(given)
            if plen is not None and not 0 <= plen <= len(blob) // 4:
                raise ValueError(f"request {i}: prompt length {plen} outside [0, {len(blob) // 4}]")
            id_key, hash_key = duplicate_keys(blob, plen, request_id)
            args += [blob, "0" if request_id is None else "1", request_id or "", "" if plen is None else str(plen),
                     id_key, hash_key]
        if not docs:
            return []
        with _redis_errors("append requests"):
            replies = self._append_and_wait(keys, args)
        self._check_acks(replies[1:], len(docs))
        return [i.decode() or None for i in replies[0]]

    def iter_requests(self, after: str = "0-0", batch: int = 1000) -> Iterator[tuple[str, np.ndarray, str | None]]:
        """Stream the logged requests after stream id ``after``, oldest first.

        Yields:
            (stream id, (n,) int32 tokens, request id or None).
        """
        cursor = after
        while True:
            with _redis_errors("read requests"):
                entries = cast("list[StreamEntry]", self.client.xrange(self.stream_key, f"({cursor}", "+", count=batch))
            for sid, fields in entries:
                rid = fields.get(b"r")
                yield (sid.decode(), np.frombuffer(fields[b"t"], dtype="<i4").astype(np.int32),
                       None if rid is None else rid.decode())
            if len(entries) < batch:
                return
            cursor = entries[-1][0].decode()

    def iter_request_records(self, after: str = "0-0", batch: int = 1000) -> Iterator[RequestRecord]:
        """Stream the logged requests after stream id ``after``, oldest first, with their prompt lengths."""
        cursor = after
        while True:
            with _redis_errors("read requests"):
                entries = cast("list[StreamEntry]", self.client.xrange(self.stream_key, f"({cursor}", "+", count=batch))
            for sid, fields in entries:
                yield record_from_entry(sid, fields)
            if len(entries) < batch:
                return
            cursor = entries[-1][0].decode()

    def read_changes(self, after: str, events_after: str | None = None, block_ms: int = 0,
                     count: int = 1000) -> tuple[list[RequestRecord], list[tuple[str, dict[str, str]]]]:
        """The requests logged after stream id ``after`` and the events after ``events_after``, oldest first.

        One XREAD over both streams (they share the namespace's cluster slot), so a replica that follows the
        log waits for either with one blocking call.

        Args:
            after: stream id of the last request already read ("0-0": from the oldest held).
            events_after: id of the last event already read (None: events are not read).
            block_ms: wait up to this long for something new (0: answer at once).
            count: most entries returned per stream.

        Returns:
            (requests, events as (event id, {field: value})); both empty when nothing arrived in time.

        Raises:
            PersistenceUnavailable: the server cannot be reached.
        """
        streams: dict[KeyT, StreamIdT] = {self.stream_key: after}
        if events_after is not None:
            streams[self.events_key] = events_after
        with _redis_errors("read the request log"):
            reply = cast("dict[bytes, list[StreamEntry]] | list[tuple[bytes, list[StreamEntry]]] | None",
                         self.client.xread(streams, count=count, block=int(block_ms) if block_ms > 0 else None))
        records: list[RequestRecord] = []
        events: list[tuple[str, dict[str, str]]] = []
        for key, entries in (reply.items() if isinstance(reply, dict) else reply or ()):
            if (key.decode() if isinstance(key, bytes) else key) == self.stream_key:
                records.extend(record_from_entry(sid, fields) for sid, fields in entries)
            else:
                events.extend((sid.decode(), {k.decode(): v.decode() for k, v in fields.items()})
                              for sid, fields in entries)
        return records, events

    def read_requests_after(self, after: str, block_ms: int = 0, count: int = 1000) -> list[RequestRecord]:
        """Up to ``count`` requests logged after stream id ``after``, oldest first, waiting up to ``block_ms``
        for one when there is none yet (0: answer at once); see ``read_changes``."""
        return self.read_changes(after, None, block_ms, count)[0]

    def read_requests_range(self, after: str, until: str) -> list[RequestRecord]:
        """Every request logged after stream id ``after`` and up to ``until`` (inclusive), oldest first (read with
        the short timeout of ``quick_client``: this runs under the namespace's write lock)."""
        with _redis_errors("read requests"):
            entries = cast("list[StreamEntry]", self.quick_client.xrange(self.stream_key, f"({after}", until))
        return [record_from_entry(sid, fields) for sid, fields in entries]

    def request_at(self, stream_id: str) -> RequestRecord | None:
        """The logged request with this stream id, or None when the log does not hold it (trimmed, or never)."""
        with _redis_errors("read a request"):
            entries = cast("list[StreamEntry]", self.client.xrange(self.stream_key, stream_id, stream_id, count=1))
        return record_from_entry(*entries[0]) if entries else None

    def last_event_id(self) -> str:
        """Id of the newest event ("0-0" when none)."""
        with _redis_errors("read the event position"):
            newest = cast("list[StreamEntry]", self.client.xrevrange(self.events_key, "+", "-", count=1))
        return newest[0][0].decode() if newest else "0-0"

    def _writer_key(self, writer_id: str) -> str:
        if not writer_id or not all(c in "0123456789abcdef" for c in writer_id) or len(writer_id) > 64:
            raise ValueError(f"a writer id must be 1 to 64 lowercase hex digits, got {writer_id!r}")
        return self.prefix + WRITER_SUFFIX + writer_id

    def writer_mark(self, writer_id: str) -> int:
        """The highest sequence number ``append_requests`` has seen from a writer (0: none, or expired)."""
        with _redis_errors("read a writer's mark"):
            held = self.client.get(self._writer_key(writer_id)) or b"0"  # "<mark>" or "<mark>:<first>:<ids>"
            return int((held.decode() if isinstance(held, bytes) else str(held)).split(":", 1)[0])

    def forget_writer(self, writer_id: str) -> None:
        """Delete a writer's high-water mark (once nothing it wrote can be retried)."""
        with _redis_errors("delete a writer's mark"):
            self.client.delete(self._writer_key(writer_id))

    def store_id(self) -> str:
        """32 hex digits naming this namespace's data set, made at first use and kept in its meta hash."""
        with _redis_errors("read the store id"):
            pipe = self.client.pipeline(transaction=True)
            pipe.hsetnx(self.meta_key, "store_id", uuid.uuid4().hex)
            pipe.hget(self.meta_key, "store_id")
            return pipe.execute()[1].decode()

    def request_count(self) -> int:
        """Requests held in the log."""
        with _redis_errors("count requests"):
            return int(self.client.xlen(self.stream_key))

    def last_id(self) -> str:
        """Stream id of the newest request ever appended ("0-0" when none), trimmed or not (short timeout)."""
        with _redis_errors("read the log position"):
            end = self.quick_client.hget(self.meta_key, "end")
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

    # -- health ----------------------------------------------------------------------------------------------

    def info(self) -> dict:
        """Facts of the server that holds the namespace, for statistics: its address, version, memory,
        append-only file state, connected replicas; and the requests held."""
        with _redis_errors("read server info"):
            info = node_client(self.client, self.meta_key).info()
            count = self.client.xlen(self.stream_key)
        keys = ("redis_version", "valkey_version", "used_memory", "used_memory_human", "aof_enabled",
                "aof_last_write_status", "aof_last_bgrewrite_status", "aof_rewrite_in_progress",
                "aof_current_size", "aof_base_size", "connected_slaves")
        out = {k: info[k] for k in keys if k in info}
        out.update(server=server_name(self.client, self.meta_key), namespace=self.namespace, requests=int(count),
                   last_id=self.last_id())
        return out

    def drop(self) -> int:
        """Delete every key of this namespace (and its layout record); returns the keys deleted."""
        with _redis_errors("drop the namespace"):
            keys = list(self.client.scan_iter(match=self.prefix + "*", count=1000))
            deleted = int(self.client.delete(*keys)) if keys else 0
            self.client.hdel(_FORMATS_KEY, self.namespace)
        return deleted

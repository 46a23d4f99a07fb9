"""The request log's entry format: records, duplicate keys and the atomic append-with-deduplication script."""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence
from dataclasses import dataclass
from enum import IntEnum

import numpy as np

SEEN_SUFFIX = "seen"
"""Key suffix (after a namespace's prefix) of the set of duplicate keys of every request ever appended."""
WRITER_SUFFIX = "writer:"
"""Key prefix (after a namespace's prefix, before the writer id) of a writer's high-water mark."""
WRITER_TTL_MS = 30 * 24 * 3600 * 1000
"""How long a writer's high-water mark outlives its last append (it matters until its spool is drained)."""


class Duplicates(IntEnum):
    """Which already stored requests an append leaves out (``bool`` arguments mean KEEP and SKIP)."""

    KEEP = 0
    """Append every request."""
    SKIP = 1
    """Leave out a request whose id (when it has one) or content is stored."""
    SKIP_SAME_ID = 2
    """Leave out a request whose id is stored; content is not compared (a retry after a lost answer)."""

    @classmethod
    def of(cls, rule: Duplicates | bool) -> Duplicates:
        """The rule for a ``skip_duplicates`` argument given as a rule or a bool."""
        return cls(int(rule))

    def skips(self, id_key: bytes, hash_key: bytes, known: set[bytes] | frozenset[bytes]) -> bool:
        """Whether a request with these duplicate keys is left out when ``known`` holds the stored keys."""
        if self is Duplicates.KEEP:
            return False
        return bool(id_key and id_key in known) or (self is Duplicates.SKIP and hash_key in known)

# Append a batch of requests. Each stream id is "<end>-0" where <end> counts every slot a ring buffer gives
# the requests so far (tokens plus one separator each), so ids increase and say where each request ends.
# A request is a duplicate when its id key or its content key is in the seen set; with skip "1" duplicates
# are not appended (their reply is ""), with skip "2" only requests whose id key is in the set (Duplicates).
# Every appended request adds its keys to the set, so duplicates inside one batch are found too.
# With a writer ("<skip>:<first seq>:<ttl ms>:<writer id>" in ARGV[1] and its key as KEYS[4]) the requests are numbered
# <first seq>, <first seq> + 1, ... by that writer; those at or below the writer's high-water mark were appended
# by an earlier attempt whose reply was lost, and are left out, so a retried append never stores a request twice.
# The writer's key holds "<mark>:<first seq>:<id>,<id>,...," : the mark and the stream ids its last append that
# stored anything gave (a lost reply is always the last append's: a writer sends nothing else until it is
# retried), so a retry of that append answers the same ids (the writer then knows where they are in the log);
# a request left out from an earlier append answers "". The key is kept for <ttl ms>. Each entry a writer appends
# names it (field "w"), so the writer's own log follower can tell its requests from other replicas'.
# KEYS: stream, meta, seen[, writer]; ARGV: skip "0"/"1"/"2" (or the writer form), then per request: tokens,
# has id "0"/"1", id, prompt length ("" when unknown), id key ("" when none), content key.
APPEND_LUA = """
local rule = string.sub(ARGV[1], 1, 1)
local skip = rule ~= '0'
local first, ttl, writer = string.match(ARGV[1], '^.:(%d+):(%d+):(%x+)$')
local done, last_first, last_ids = 0, 0, {}
if first then
  first = tonumber(first)
  local held = redis.call('GET', KEYS[4]) or '0'
  local mark, lf, list = string.match(held, '^(%d+):(%d+):(.*)$')
  if mark then
    done, last_first = tonumber(mark), tonumber(lf)
    for x in string.gmatch(list, '([^,]*),') do last_ids[#last_ids + 1] = x end
  else
    done = tonumber(held)
  end
end
local stored = false
local pos = tonumber(redis.call('HGET', KEYS[2], 'end') or '0')
local ids = {}
for i = 2, #ARGV, 6 do
  local id_key, hash_key = ARGV[i + 4], ARGV[i + 5]
  local seq = first and first + (i - 2) / 6
  local seen = first ~= nil and seq <= done
  if seen then
    ids[#ids + 1] = last_ids[seq - last_first + 1] or ''
  elseif skip then
    seen = (id_key ~= '' and redis.call('SISMEMBER', KEYS[3], id_key) == 1) or
           (rule == '1' and redis.call('SISMEMBER', KEYS[3], hash_key) == 1)
    if seen then ids[#ids + 1] = '' end
  end
  if not seen then
    stored = true
    pos = pos + string.len(ARGV[i]) / 4 + 1
    local id = string.format('%d-0', pos)
    local fields = {'t', ARGV[i]}
    if ARGV[i + 1] == '1' then
      fields[#fields + 1] = 'r'
      fields[#fields + 1] = ARGV[i + 2]
    end
    if ARGV[i + 3] ~= '' then
      fields[#fields + 1] = 'p'
      fields[#fields + 1] = ARGV[i + 3]
    end
    if writer then
      fields[#fields + 1] = 'w'
      fields[#fields + 1] = writer
    end
    redis.call('XADD', KEYS[1], id, unpack(fields))
    if id_key ~= '' then
      redis.call('SADD', KEYS[3], id_key, hash_key)
    else
      redis.call('SADD', KEYS[3], hash_key)
    end
    ids[#ids + 1] = id
  end
end
redis.call('HSET', KEYS[2], 'end', string.format('%d', pos))
if first then
  done = math.max(done, first + (#ARGV - 1) / 6 - 1)
  if stored then
    redis.call('SET', KEYS[4], string.format('%d:%d:', done, first) .. table.concat(ids, ',') .. ',', 'PX', ttl)
  else
    redis.call('PEXPIRE', KEYS[4], ttl)
  end
end
return ids
"""

_PROMPT_LEN = struct.Struct("<q")


@dataclass(frozen=True)
class RequestRecord:
    """One logged request.

    Attributes:
        stream_id: its stream id, "<end>-0".
        tokens: (n,) int32 prompt + output.
        request_id: the id it was stored with, or None.
        prompt_len: how many of ``tokens`` are the prompt, or None for entries written without it.
        writer: the id of the writer that appended it (a service's spooling log), or None.
    """

    stream_id: str
    tokens: np.ndarray
    request_id: str | None
    prompt_len: int | None
    writer: str | None = None


def content_digest(blob: bytes, prompt_len: int | None) -> bytes:
    """16-byte BLAKE2b digest of a request's prompt length (-1 when unknown) and little-endian int32 tokens."""
    h = hashlib.blake2b(_PROMPT_LEN.pack(-1 if prompt_len is None else int(prompt_len)), digest_size=16)
    h.update(blob)
    return h.digest()


def duplicate_keys(blob: bytes, prompt_len: int | None, request_id: str | None) -> tuple[bytes, bytes]:
    """The seen-set members of a request: (b"i:<id>" or b"" when it has no id, b"h:<digest>")."""
    id_key = b"i:" + request_id.encode() if request_id else b""
    return id_key, b"h:" + content_digest(blob, prompt_len)


def record_from_entry(stream_id: bytes, fields: dict[bytes, bytes]) -> RequestRecord:
    """The record of a stream entry as XRANGE returns it."""
    rid, plen, writer = fields.get(b"r"), fields.get(b"p"), fields.get(b"w")
    return RequestRecord(stream_id.decode(), np.frombuffer(fields[b"t"], dtype="<i4").astype(np.int32),
                         None if rid is None else rid.decode(), None if plen is None else int(plen),
                         None if writer is None else writer.decode())


class SeenKeys:
    """The duplicate check of the append script for a namespace kept in memory only (no Redis).

    Holds both keys of every request appended, as the ``seen`` set does; not thread-safe (callers hold
    their write lock).
    """

    def __init__(self) -> None:
        self._keys: set[bytes] = set()
        self._end = 0  # ring slots given so far, for stream-like ids

    def append(self, docs: Sequence[tuple[np.ndarray, str | None]], prompt_lens: Sequence[int | None],
               skip_duplicates: Duplicates | bool = False) -> list[str | None]:
        """Record ``docs``; returns an id per request, None for each duplicate left out."""
        rule = Duplicates.of(skip_duplicates)
        out: list[str | None] = []
        for (tokens, request_id), plen in zip(docs, prompt_lens, strict=True):
            id_key, hash_key = duplicate_keys(np.asarray(tokens, dtype="<i4").tobytes(), plen, request_id)
            if rule.skips(id_key, hash_key, self._keys):
                out.append(None)
                continue
            self._keys.update((id_key, hash_key) if id_key else (hash_key,))
            self._end += len(tokens) + 1
            out.append(f"{self._end}-0")
        return out

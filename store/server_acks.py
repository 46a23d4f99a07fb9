"""What a namespace's appends wait for, on the server that holds it: fsync, replicas, and whether it answers."""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass

import redis
from redis.commands.core import Script
from redis.exceptions import RedisClusterException

from store.redis_common import PersistenceError
from store.redis_connect import RedisClient, node_client, refresh_slots, server_name
from store.request_log import APPEND_LUA

logger = logging.getLogger(__name__)

REPLICA_COUNT_MAX_AGE_S = 1.0
"""How long an append trusts the last count of the primary's replicas (``ServerAcks.server_state``)."""


def wait_budget_ms(timeout_s: float, replica_acks: int) -> int:
    """How long each wait of an append (WAITAOF, and WAIT with ``replica_acks``) may take on the server, so that
    both together stay within 80% of ``timeout_s``."""
    return max(1, int(800 * timeout_s / (2 if replica_acks else 1)))


@dataclass(frozen=True)
class ServerState:
    """What the last check of the server that holds a namespace found.

    Attributes:
        reachable: it answered.
        replicas: its replicas online (connected and in sync, so they can acknowledge appends); 0 when it did
            not answer.
        replica_acks: the replicas each append waits for.
        error: why it did not answer ("" when it did).
        checked_at: when (``time.monotonic()``; 0: never checked).
    """

    reachable: bool
    replicas: int
    replica_acks: int
    error: str = ""
    checked_at: float = 0.0

    @property
    def ok(self) -> bool:
        """It answers, with enough replicas to acknowledge appends."""
        return self.reachable and self.replicas >= self.replica_acks

    def problem(self) -> str:
        """Why appends cannot go to the server now ("" when they can)."""
        if not self.reachable:
            return f"Redis does not answer ({self.error or 'not checked yet'})"
        if self.replicas < self.replica_acks:
            return (f"the Redis primary has {self.replicas} replicas online and each append needs "
                    f"{self.replica_acks} (replica acks); run at least {self.replica_acks + 1} replicas so that "
                    "one can be lost")
        return ""


class ServerAcks:
    """The server-facing part of ``RedisPersistence`` (which sets ``quick_client``, ``meta_key``, ``stream_key``,
    ``replica_acks``, ``fsync_timeout_ms``, ``_wait_aof`` and ``_append``, and calls ``_init_server_state``).

    An append returns once the server has fsynced it (WAITAOF, with ``durable``) and ``replica_acks`` replicas
    have received it (WAIT): a replica that has it can take over from a primary that dies. (WAITAOF could also
    wait for the replicas' fsyncs, but a replica reports those at its once-a-second acknowledgement often enough
    to add up to a second to one append in ten.) On a cluster, every command here goes to the node that holds
    the namespace's slot: INFO and PING describe that node, and an append runs on one connection with the waits
    that follow it, since they count only that connection's writes.

    Everything here runs on ``quick_client``, whose replies and connections are bounded by a short timeout, and
    every wait on the server by ``fsync_timeout_ms``, so an append or a check fails fast when the server cannot
    take it. While fewer replicas are online than ``replica_acks`` (as counted at most
    ``REPLICA_COUNT_MAX_AGE_S`` ago), an append fails at once instead of waiting for acknowledgements that
    cannot come.
    """

    quick_client: RedisClient
    meta_key: str
    stream_key: str
    replica_acks: int
    fsync_timeout_ms: int
    _wait_aof: bool
    _append: Script

    def _init_server_state(self) -> None:
        self._state = ServerState(reachable=False, replicas=0, replica_acks=self.replica_acks)
        self._state_lock = threading.Lock()

    def _check_durability(self) -> bool:
        """Whether appends can wait for the fsync with WAITAOF; raise if the server does not persist."""
        server = node_client(self.quick_client, self.meta_key)
        info = server.info("persistence")
        if not int(info.get("aof_enabled", 0)):
            raise PersistenceError("the Redis server has appendonly disabled, so acknowledged requests would "
                                   "not survive its restart; enable appendonly or open with durable=False")
        try:
            server.execute_command("WAITAOF", 0, 0, 0)
        except redis.ResponseError:
            logger.warning("the Redis server has no WAITAOF (Redis < 7.2); appends rely on its appendfsync")
            return False
        return True

    def _append_and_wait(self, keys: list[str], args: list) -> list:
        """Run the append script, WAITAOF and WAIT (each when asked for) in one round trip on one connection to
        the server that holds the namespace (loading the script first if that server lost it; on a cluster,
        reading the slot table again when the slot has moved).

        Raises:
            PersistenceError: fewer replicas online than ``replica_acks`` (nothing was sent).
            redis.RedisError: the server did not take it.
        """
        if self.replica_acks:
            state = self.server_state(REPLICA_COUNT_MAX_AGE_S)
            if state.reachable and state.replicas < self.replica_acks:
                raise PersistenceError(state.problem())
        loaded = moved = False
        while True:
            server = node_client(self.quick_client, self.stream_key)
            pipe = server.pipeline(transaction=False)
            pipe.evalsha(self._append.sha, len(keys), *keys, *args)
            if self._wait_aof:
                pipe.execute_command("WAITAOF", 1, 0, self.fsync_timeout_ms)
            if self.replica_acks:
                pipe.execute_command("WAIT", self.replica_acks, self.fsync_timeout_ms)
            try:
                replies = pipe.execute(raise_on_error=False)
            except (redis.ConnectionError, redis.TimeoutError):
                refresh_slots(self.quick_client)  # a cluster node that stopped answering may have a successor
                raise
            if not loaded and isinstance(replies[0], redis.exceptions.NoScriptError):
                server.script_load(APPEND_LUA)  # nothing was written
                loaded = True
                continue
            if not moved and isinstance(replies[0], redis.exceptions.MovedError):
                refresh_slots(self.quick_client)  # nothing was written; the slot is served elsewhere now
                moved = True
                continue
            for reply in replies:
                if isinstance(reply, Exception):
                    raise reply
            return replies

    def _check_acks(self, replies: list, count: int) -> None:
        """Raise PersistenceError unless the replies of WAITAOF and WAIT (those sent) confirm an append."""
        if self._wait_aof and int(replies[0][0]) < 1:
            raise PersistenceError(f"the server did not fsync {count} appended requests within "
                                   f"{self.fsync_timeout_ms} ms; they may be lost on a crash")
        if self.replica_acks and int(replies[-1]) < self.replica_acks:
            raise PersistenceError(f"{int(replies[-1])} of the {self.replica_acks} replicas required received {count} "
                                   f"appended requests within {self.fsync_timeout_ms} ms; they may be lost on a "
                                   "failover")

    # -- health ----------------------------------------------------------------------------------------------

    def check_server(self) -> ServerState:
        """Ask the server that holds the namespace now: does it answer, how many replicas are online.

        One round trip (PING, INFO replication, and whether it holds the append script, which is loaded when it
        does not: a promoted replica has none, and the first append there would otherwise wait twice). The result
        is kept for ``server_state``.
        """
        try:
            server = node_client(self.quick_client, self.meta_key)
            pipe = server.pipeline(transaction=False)
            pipe.ping()
            pipe.info("replication")
            pipe.script_exists(self._append.sha)
            _, info, (has_script, *_) = pipe.execute()
            if not has_script:
                server.script_load(APPEND_LUA)
            state = ServerState(True, online_replicas(info), self.replica_acks, checked_at=time.monotonic())
        except (redis.RedisError, RedisClusterException) as exc:
            refresh_slots(self.quick_client)
            state = ServerState(False, 0, self.replica_acks, error=str(exc) or type(exc).__name__,
                                checked_at=time.monotonic())
        with self._state_lock:
            before, self._state = self._state, state
        first = not before.checked_at
        if state.reachable and not state.ok and (first or before.ok or not before.reachable):
            logger.warning("Redis %s: %s; appends go to the spool until enough are online",
                           server_name(self.quick_client, self.meta_key), state.problem())
        elif state.ok and not first and before.reachable and not before.ok:
            logger.info("Redis %s: %d replicas online again (%d needed)",
                        server_name(self.quick_client, self.meta_key), state.replicas, self.replica_acks)
        return state

    def server_state(self, max_age_s: float | None = None) -> ServerState:
        """The last ``check_server`` result, checked again first when older than ``max_age_s`` (None: never)."""
        with self._state_lock:
            state = self._state
        if max_age_s is not None and time.monotonic() - state.checked_at > max_age_s:
            return self.check_server()
        return state

    def ping(self) -> bool:
        """True when the server that holds the namespace answers, with ``replica_acks`` replicas online (checked
        now)."""
        return self.check_server().ok


def online_replicas(info: dict) -> int:
    """Replicas in state "online" in an INFO replication reply (those in a full resync cannot acknowledge)."""
    count = 0
    for key, value in info.items():
        if str(key).startswith("slave") and str(key)[5:].isdigit() and isinstance(value, dict):
            count += value.get("state") == "online"
    return count

"""What a namespace's appends wait for, on the server that holds it: fsync, replicas, and whether it answers."""

from __future__ import annotations

import logging

import redis
from redis.commands.core import Script
from redis.exceptions import RedisClusterException

from store.redis_common import PersistenceError
from store.redis_connect import RedisClient, node_client, refresh_slots
from store.request_log import APPEND_LUA

logger = logging.getLogger(__name__)


class ServerAcks:
    """The server-facing part of ``RedisPersistence`` (which sets ``client``, ``meta_key``, ``stream_key``,
    ``replica_acks``, ``fsync_timeout_ms``, ``_wait_aof`` and ``_append``).

    An append returns once the server has fsynced it (WAITAOF, with ``durable``) and ``replica_acks`` replicas
    have received it (WAIT): a replica that has it can take over from a primary that dies. (WAITAOF could also
    wait for the replicas' fsyncs, but a replica reports those at its once-a-second acknowledgement often enough
    to add up to a second to one append in ten.) On a cluster, every command here goes to the node that holds
    the namespace's slot: INFO and PING describe that node, and an append runs on one connection with the waits
    that follow it, since they count only that connection's writes.
    """

    client: RedisClient
    meta_key: str
    stream_key: str
    replica_acks: int
    fsync_timeout_ms: int
    _wait_aof: bool
    _append: Script

    def _check_durability(self) -> bool:
        """Whether appends can wait for the fsync with WAITAOF; raise if the server does not persist."""
        server = node_client(self.client, self.meta_key)
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
        reading the slot table again when the slot has moved)."""
        loaded = moved = False
        while True:
            server = node_client(self.client, self.stream_key)
            pipe = server.pipeline(transaction=False)
            pipe.evalsha(self._append.sha, len(keys), *keys, *args)
            if self._wait_aof:
                pipe.execute_command("WAITAOF", 1, 0, self.fsync_timeout_ms)
            if self.replica_acks:
                pipe.execute_command("WAIT", self.replica_acks, self.fsync_timeout_ms)
            try:
                replies = pipe.execute(raise_on_error=False)
            except (redis.ConnectionError, redis.TimeoutError):
                refresh_slots(self.client)  # a cluster node that stopped answering may have a successor
                raise
            if not loaded and isinstance(replies[0], redis.exceptions.NoScriptError):
                server.script_load(APPEND_LUA)  # nothing was written
                loaded = True
                continue
            if not moved and isinstance(replies[0], redis.exceptions.MovedError):
                refresh_slots(self.client)  # nothing was written; the slot is served elsewhere now
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

    def ping(self) -> bool:
        """True when the server that holds the namespace answers, with ``replica_acks`` replicas connected."""
        try:
            server = node_client(self.client, self.meta_key)
            if not server.ping():
                return False
            if self.replica_acks:
                return int(server.info("replication").get("connected_slaves", 0)) >= self.replica_acks
            return True
        except (redis.RedisError, RedisClusterException):
            refresh_slots(self.client)
            return False

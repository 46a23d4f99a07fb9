"""Real Redis deployments for tests: a three-node Redis Cluster, and a primary with replicas and three sentinels.

Every server is a ``valkey-server`` child process (``store.embedded_redis``), so it dies with the test process
even when that is killed; ``stop()`` ends them all at the end of a test.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

import redis

from store.embedded_redis import EmbeddedRedis, free_port, server_binary

SLOTS = 16384
MASTER = "drafter-primary"
REPLICATION_ARGS = ("--repl-diskless-sync-delay", "0")  # a replica's full sync starts at once, not after 5 s


def wait_until(condition: Callable[[], object], timeout: float, what: str, interval: float = 0.1) -> None:
    """Poll ``condition`` until it is true (exceptions count as false); AssertionError naming ``what`` on timeout."""
    deadline = time.monotonic() + timeout
    last: object = None
    while True:
        try:
            if condition():
                return
        except Exception as exc:  # a server still starting
            last = exc
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what} (last error: {last!r})")
        time.sleep(interval)


def plain(server: EmbeddedRedis) -> redis.Redis:
    """A client of that one server (no cluster routing, no Sentinel)."""
    return redis.Redis(host=server.host, port=server.port, socket_timeout=10)


class ClusterNodeServer(EmbeddedRedis):
    """A ``valkey-server`` with cluster mode on, its cluster bus on a port of its own (not port + 10000)."""

    def __init__(self, data_dir: Path, node_timeout_ms: int = 2000) -> None:
        self.bus_port = free_port()
        super().__init__(data_dir, extra_args=(
            "--cluster-enabled", "yes", "--cluster-config-file", "nodes.conf",
            "--cluster-node-timeout", str(node_timeout_ms), "--cluster-port", str(self.bus_port)))


class Cluster:
    """Three primaries that share the 16384 slots in three ranges, joined with CLUSTER MEET."""

    def __init__(self, root: Path, nodes: int = 3) -> None:
        self.servers: list[EmbeddedRedis] = []
        try:
            for i in range(nodes):
                self.servers.append(ClusterNodeServer(root / f"node{i}").start())
            bounds = [SLOTS * i // nodes for i in range(nodes + 1)]
            for server, lo, hi in zip(self.servers, bounds, bounds[1:], strict=False):
                plain(server).execute_command("CLUSTER", "ADDSLOTSRANGE", lo, hi - 1)
            first = plain(self.servers[0])
            for server in self.servers[1:]:
                assert isinstance(server, ClusterNodeServer)
                first.execute_command("CLUSTER", "MEET", server.host, server.port, server.bus_port)
            for server in self.servers:
                wait_until(lambda s=server: self._ready(s, nodes), 30, f"cluster state ok on {server.url}")
        except BaseException:
            self.stop()
            raise

    @staticmethod
    def _ready(server: EmbeddedRedis, nodes: int) -> bool:
        info = plain(server).execute_command("CLUSTER", "INFO")
        return b"cluster_state:ok" in info and f"cluster_known_nodes:{nodes}\r".encode() in info

    @property
    def url(self) -> str:
        """``redis+cluster://`` with every node as a startup node."""
        return "redis+cluster://" + ",".join(f"{s.host}:{s.port}" for s in self.servers)

    def owner(self, slot: int) -> EmbeddedRedis:
        """The server whose range holds ``slot``."""
        return self.servers[slot * len(self.servers) // SLOTS]

    def stop(self) -> None:
        """Stop every node (SIGTERM, SIGKILL after a while)."""
        for server in self.servers:
            server.stop(timeout=5)


class SentinelServer(EmbeddedRedis):
    """``valkey-server <conf> --sentinel`` watching one primary, with short failure detection for tests."""

    def __init__(self, data_dir: Path, primary: EmbeddedRedis, quorum: int = 2, down_after_ms: int = 1000,
                 failover_timeout_ms: int = 4000) -> None:
        super().__init__(data_dir)
        self.primary, self.quorum = primary, quorum
        self.down_after_ms, self.failover_timeout_ms = down_after_ms, failover_timeout_ms

    def _command(self, port: int) -> list[str]:
        conf = self.data_dir / "sentinel.conf"  # the sentinel rewrites it as it learns the topology
        conf.write_text("\n".join([
            f"port {port}", f"bind {self.host}", "protected-mode no", "daemonize no", f"dir {self.data_dir}",
            f"logfile {self.log_path}",
            f"sentinel monitor {MASTER} {self.primary.host} {self.primary.port} {self.quorum}",
            f"sentinel down-after-milliseconds {MASTER} {self.down_after_ms}",
            f"sentinel failover-timeout {MASTER} {self.failover_timeout_ms}",
            f"sentinel parallel-syncs {MASTER} 1", ""]))
        return [str(server_binary()), str(conf), "--sentinel"]


class SentinelSet:
    """A primary, ``replicas`` replicas of it (one by default) and three sentinels (quorum 2) on this machine.

    Every data node runs append-only with ``appendfsync always``, as ``EmbeddedRedis`` does. ``replica`` is the
    first replica (None when there is none); ``replicas`` all of them.
    """

    def __init__(self, root: Path, replicas: int = 1, down_after_ms: int = 1000) -> None:
        self.root = root
        self.sentinels: list[EmbeddedRedis] = []
        self.primary = EmbeddedRedis(root / "a", extra_args=REPLICATION_ARGS)
        self.replicas: list[EmbeddedRedis] = []
        try:
            self.primary.start()
            for i in range(replicas):
                self.replicas.append(self.replica_of(self.primary, root / "bcdefgh"[i]))
            for i in range(3):
                self.sentinels.append(SentinelServer(root / f"sentinel{i}", self.primary,
                                                     down_after_ms=down_after_ms).start())
            for sentinel in self.sentinels:  # each one has found the replicas and the other two sentinels
                wait_until(lambda s=sentinel: self._sentinel_sees_all(s, replicas), 30,
                           f"sentinel {sentinel.url} to see the set")
        except BaseException:
            self.stop()
            raise

    @property
    def replica(self) -> EmbeddedRedis | None:
        """The first replica (None without one)."""
        return self.replicas[0] if self.replicas else None

    @replica.setter
    def replica(self, server: EmbeddedRedis | None) -> None:
        self.replicas[:1] = [] if server is None else [server]

    @staticmethod
    def replica_of(primary: EmbeddedRedis, data_dir: Path, port: int = 0) -> EmbeddedRedis:
        """Start a server replicating ``primary`` and wait until its link is up."""
        replica = EmbeddedRedis(data_dir, port=port,
                                extra_args=("--replicaof", primary.host, str(primary.port), *REPLICATION_ARGS)).start()
        wait_until(lambda: plain(replica).info("replication").get("master_link_status") == "up", 30,
                   f"{replica.url} to replicate {primary.url}")
        return replica

    @staticmethod
    def _sentinel_sees_all(sentinel: EmbeddedRedis, replicas: int) -> bool:
        state = plain(sentinel).execute_command("SENTINEL", "MASTER", MASTER)
        fields = dict(zip(state[::2], state[1::2], strict=True)) if isinstance(state, list) else state
        return int(fields[b"num-slaves"]) >= replicas and int(fields[b"num-other-sentinels"]) >= 2

    @property
    def url(self) -> str:
        """``redis+sentinel://`` with the three sentinels and the master name."""
        return "redis+sentinel://" + ",".join(f"{s.host}:{s.port}" for s in self.sentinels) + f"/{MASTER}/0"

    def master_address(self) -> tuple[str, int]:
        """Where the sentinels say the primary is now."""
        host, port = plain(self.sentinels[0]).execute_command("SENTINEL", "GET-MASTER-ADDR-BY-NAME", MASTER)
        return host.decode(), int(port)

    def stop(self) -> None:
        """Stop every server and sentinel this set started (SIGTERM, SIGKILL after a while)."""
        for server in [*self.sentinels, *self.replicas, self.primary]:
            server.stop(timeout=5)

"""Redis persistence on a real three-node Redis Cluster: every operation, one slot per namespace, a moved slot."""

from __future__ import annotations

import numpy as np
import pytest
from redis.cluster import ClusterNode, RedisCluster
from redis_topologies import Cluster, plain

from store.frozen_table import FrozenNGramTable
from store.persistence import RedisPersistence

VOCAB = 1000


def keys_by_node(cluster: Cluster, pattern: str) -> dict[int, list[bytes]]:
    """The keys matching ``pattern`` on each node (by node index), none empty."""
    found = {i: sorted(plain(s).scan_iter(match=pattern)) for i, s in enumerate(cluster.servers)}
    return {i: keys for i, keys in found.items() if keys}


def move_slot(cluster: Cluster, slot: int, to: int) -> None:
    """Reshard ``slot`` with its keys onto node ``to`` (what `valkey-cli --cluster reshard` does)."""
    src, dst = cluster.owner(slot), cluster.servers[to]
    src_id, dst_id = (plain(s).execute_command("CLUSTER", "MYID").decode() for s in (src, dst))
    plain(dst).execute_command("CLUSTER", "SETSLOT", slot, "IMPORTING", src_id)
    plain(src).execute_command("CLUSTER", "SETSLOT", slot, "MIGRATING", dst_id)
    keys = plain(src).execute_command("CLUSTER", "GETKEYSINSLOT", slot, 10000)
    plain(src).execute_command("MIGRATE", dst.host, dst.port, "", 0, 5000, "KEYS", *keys)
    for server in cluster.servers:
        plain(server).execute_command("CLUSTER", "SETSLOT", slot, "NODE", dst_id)


def test_every_operation_works_on_a_cluster_and_a_namespace_stays_on_one_node(cluster):
    p = RedisPersistence(cluster.url, "alpha", vocab_size=VOCAB)
    assert isinstance(p.client, RedisCluster)
    docs = [(np.array([1, 2, 3]), "a"), (np.array([4, 5]), None)]
    assert p.append_requests(docs, [1, 1], writer=("ab", 1)) == ["4-0", "7-0"]
    assert p.append_requests(docs[:1], [1], writer=("ab", 1)) == ["4-0"]  # a retried append: already there
    assert p.append_requests(docs[:1], [1], skip_duplicates=True) == [None]
    assert p.writer_mark("ab") == 2 and p.request_count() == 2 and p.last_id() == "7-0"
    assert [(sid, t.tolist(), rid) for sid, t, rid in p.iter_requests()] == [("4-0", [1, 2, 3], "a"),
                                                                            ("7-0", [4, 5], None)]
    records, events = p.read_changes("4-0", "0-0", block_ms=50)
    assert [r.stream_id for r in records] == ["7-0"] and events == []
    assert len(p.store_id()) == 32 and p.store_id() == p.store_id()

    p.save_table([((1,), [((2, 3, 4), 5)])], "7-0")
    assert p.load_table() == [((1,), [((2, 3, 4), 5)])]
    p.save_model({3: (1.0, 2.0)})
    assert p.load_model() == {3: (1.0, 2.0)}
    p.save_frozen_table("f", FrozenNGramTable(1, 3, {(9,): [((7, 8, 6), 5)]}), "corpus")
    assert p.list_frozen() == ["f"] and p.frozen_header("f")["source"] == "corpus"
    assert p.last_event_id() != "0-0"
    assert p.append_metric_point({"t": 1000, "x": 1}) == 1000 and p.read_metric_points() == [{"t": 1000, "x": 1}]
    assert p.trim_requests(3) == 1 and p.request_count() == 1

    slot = p.client.keyslot(p.meta_key)
    assert list(keys_by_node(cluster, "drafter:v1:{alpha}:*")) == [cluster.servers.index(cluster.owner(slot))]
    assert p.ping()
    info = p.info()  # the facts of the node that holds the namespace, not of a random one
    owner = cluster.owner(slot)
    assert info["server"] == f"{owner.host}:{owner.port}" and info["aof_enabled"] == 1 and info["requests"] == 1

    assert p.delete_frozen("f") and p.list_frozen() == []
    assert p.drop() > 0 and keys_by_node(cluster, "drafter:v1:{alpha}:*") == {}

    decoding = RedisCluster(startup_nodes=[ClusterNode(owner.host, owner.port)], decode_responses=True)
    try:
        with pytest.raises(ValueError, match="must not decode"):
            RedisPersistence(decoding, "x")
    finally:
        decoding.close()


def test_an_append_follows_its_slot_to_another_node(cluster):
    p = RedisPersistence(cluster.url, "beta", vocab_size=VOCAB)
    assert p.append_requests([(np.array([5, 6]), "x")], [1]) == ["3-0"]
    slot = p.client.keyslot(p.stream_key)
    before = cluster.servers.index(cluster.owner(slot))
    to = (before + 1) % 3
    move_slot(cluster, slot, to)
    assert p.client.get_node_from_key(p.stream_key).port == cluster.servers[before].port  # a stale slot table
    assert list(keys_by_node(cluster, "drafter:v1:{beta}:*")) == [to]
    # The client still routes the slot to the old node: the append gets MOVED (nothing written there), reads the
    # slot table again and runs on the new node, whose script cache does not hold the script yet.
    assert p.append_requests([(np.array([7]), "y")], [1], writer=("cd", 1)) == ["5-0"]
    assert [rid for _, _, rid in p.iter_requests()] == ["x", "y"]
    assert p.info()["server"] == f"{cluster.servers[to].host}:{cluster.servers[to].port}"
    assert p.ping()
    again = RedisPersistence(cluster.url, "beta", vocab_size=VOCAB)  # a new client finds it at once
    assert again.request_count() == 2 and again.writer_mark("cd") == 1

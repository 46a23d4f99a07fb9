"""The service on a real three-node Redis Cluster: two namespaces on two nodes, and a second service that loads
from the cluster and drafts the same trees.

The first service runs in this process, the second as a `drafter serve --redis-url redis+cluster://...` process.
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import grpc
import numpy as np
import pytest
from redis.cluster import RedisCluster
from redis_topologies import plain
from serving import free_port, wait_serving

from drafter_service.api.drafter.v1 import drafter_pb2 as pb
from drafter_service.api.drafter.v1 import drafter_pb2_grpc as pb_grpc
from drafter_service.cli.serve import add_serve_commands, config_from_args
from drafter_service.runtime.runtime import Runtime
from engine_client.admin import put_frozen_table
from store.frozen_table import FrozenNGramTable
from store.redis_connect import connect

DRAFTER = str(Path(sys.executable).parent / "drafter")
VOCAB = 1000
NAMESPACES = {"default": 0, "code": 100}  # name -> first token id of its requests (each its own token range)
LEADER = 999  # in no request: only the frozen table knows what follows it
FROZEN = FrozenNGramTable(1, 3, {(LEADER,): [((997, 998, 996), 50)]})


def flags(url: str, address: str, data_dir: Path) -> list[str]:
    """`drafter serve` flags both services share (the drafts then depend on the stored requests alone), each with a
    data folder of its own (index files, spool) under the test's temporary folder."""
    return ["--redis-url", url, "--address", address, "--data-dir", str(data_dir), "--http-address", "",
            "--vocab-size", str(VOCAB), "--namespaces", "code=1000", "--capacity", "200000",
            "--rebuild-in-subprocess", "0", "--rebuild-interval", "0.2", "--snapshot-interval", "3600",
            "--metrics-interval", "3600"]


def serve_here(argv: list[str]) -> Runtime:
    parser = argparse.ArgumentParser()
    add_serve_commands(parser.add_subparsers())
    return Runtime(config_from_args(parser.parse_args(["serve", *argv]))).start()


def draft_for(stub, namespace: str, session_id: str, context: list[int]):
    stub.StartSession(pb.StartSessionRequest(namespace=namespace, session_id=session_id, prompt=context), timeout=10)
    reply = stub.Draft(pb.DraftRequest(session_id=session_id, max_nodes=32), timeout=10)
    return list(reply.token_ids), list(reply.parents), [round(p, 6) for p in reply.probs]


def roots(tree) -> set[int]:
    return {t for t, p in zip(tree[0], tree[1], strict=True) if p == -1}


@pytest.mark.timeout(180)
def test_two_namespaces_on_two_nodes_and_a_second_service_drafts_the_same_trees(cluster, tmp_path):
    client = connect(cluster.url)
    assert isinstance(client, RedisCluster)
    slots = {ns: client.keyslot(f"drafter:v1:{{{ns}}}:meta") for ns in NAMESPACES}
    assert slots == {ns: int(plain(cluster.servers[0]).execute_command("CLUSTER", "KEYSLOT", ns)) for ns in NAMESPACES}
    owners = {ns: cluster.servers.index(cluster.owner(slot)) for ns, slot in slots.items()}
    assert owners["default"] != owners["code"]

    rng = np.random.default_rng(3)
    reqs = {ns: [((first + rng.integers(0, 40, 10)).tolist(), (first + rng.integers(0, 40, 60)).tolist())
                 for _ in range(120)] for ns, first in NAMESPACES.items()}
    first = serve_here(flags(cluster.url, "127.0.0.1:0", tmp_path / "first"))
    a_address = f"127.0.0.1:{first.port}"
    second: subprocess.Popen | None = None
    try:
        with grpc.insecure_channel(a_address) as channel:
            stub = pb_grpc.DrafterStub(channel)
            for ns, items in reqs.items():
                for i in range(0, len(items), 40):
                    reply = stub.Ingest(pb.IngestRequest(namespace=ns, requests=[
                        pb.Sequence(prompt=p, output=o, request_id=f"{ns}-{i + j}")
                        for j, (p, o) in enumerate(items[i:i + 40])]), timeout=30)
                    assert reply.ingested == len(items[i:i + 40])
                prompt, output = items[0]
                stub.StartSession(pb.StartSessionRequest(namespace=ns, session_id=f"{ns}-done", prompt=prompt))
                assert stub.EndSession(pb.EndSessionRequest(session_id=f"{ns}-done", accepted=output[:20])) \
                    .stored_tokens == 30
            assert put_frozen_table(a_address, "tail", FROZEN, namespace="code", source="test")["leaders"] == 1

            for ns in NAMESPACES:  # every key of a namespace is on the node of its slot, and nowhere else
                on = [i for i, s in enumerate(cluster.servers) if list(plain(s).scan_iter(f"drafter:v1:{{{ns}}}:*"))]
                assert on == [owners[ns]], ns
            probes = {ns: [items[i][0] + items[i][1][:5] for i in (3, 60, 119)] + [[LEADER]]
                      for ns, items in reqs.items()}
            drafts = {ns: [draft_for(stub, ns, f"{ns}-probe{i}", c) for i, c in enumerate(contexts)]
                      for ns, contexts in probes.items()}
            for ns, items in reqs.items():
                for i, tree in zip((3, 60, 119), drafts[ns], strict=False):
                    assert items[i][1][5] in roots(tree), (ns, i)
            assert roots(drafts["code"][3]) == {997} and drafts["default"][3][0] == []  # the frozen table's namespace

        b_address = f"127.0.0.1:{free_port()}"
        with open(tmp_path / "second.log", "wb") as log:
            second = subprocess.Popen([DRAFTER, "serve", *flags(cluster.url, b_address, tmp_path / "second"),
                                       "--replica-id", "second"],
                                      env=dict(os.environ), stdout=log, stderr=subprocess.STDOUT)
        wait_serving(b_address, timeout=90, proc=second)
        with grpc.insecure_channel(b_address) as channel:
            stub = pb_grpc.DrafterStub(channel)
            for ns, contexts in probes.items():
                stats = stub.GetStats(pb.GetStatsRequest(namespace=ns))
                assert stats.stored_requests == 121, ns
                assert [draft_for(stub, ns, f"{ns}-probe{i}", c) for i, c in enumerate(contexts)] == drafts[ns], ns

            # What the first service stores from now on reaches the second through the cluster (it follows the log).
            fresh = ([500, 501, 502, 503], [504, 505, 506, 507, 508, 509])
            with grpc.insecure_channel(a_address) as a_channel:
                pb_grpc.DrafterStub(a_channel).Ingest(pb.IngestRequest(namespace="code", requests=[
                    pb.Sequence(prompt=fresh[0], output=fresh[1], request_id="fresh")]), timeout=30)
            deadline = time.monotonic() + 15
            while 505 not in roots(draft_for(stub, "code", f"fresh{time.monotonic_ns()}", fresh[0] + [504])):
                assert time.monotonic() < deadline, "the second service never drafted the new request"
                time.sleep(0.1)
    finally:
        if second is not None:
            second.send_signal(signal.SIGTERM)
            try:
                second.wait(30)
            except subprocess.TimeoutExpired:
                second.kill()
                second.wait(10)
        first.stop(grace=0)
        client.close()
    assert second.returncode == 0, (tmp_path / "second.log").read_text()[-3000:]

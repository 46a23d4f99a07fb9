"""`drafter bench replicas`: how soon a request acknowledged by one replica shows up in the others' drafts."""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack
from pathlib import Path

import grpc
import numpy as np

from drafter_service.api.drafter.v1 import drafter_pb2 as pb
from drafter_service.api.drafter.v1 import drafter_pb2_grpc as pb_grpc
from drafter_service.bench.serve_bench import _free_port, _wait_serving
from store.embedded_redis import EmbeddedRedis

NAMESPACE = "bench-replicas"
"""The namespace the bench writes (dropped at the end, so a given Redis keeps nothing of it)."""
VOCAB = 50000
PROMPT_TOKENS, OUTPUT_TOKENS, CHECKED = 8, 16, 3


def add_replicas_bench(bench: argparse._SubParsersAction) -> None:
    """Register ``bench replicas``."""
    sp = bench.add_parser("replicas", help="propagation delay between replicas that share one Redis")
    sp.add_argument("--replicas", type=int, default=3, help="`drafter serve` processes started")
    sp.add_argument("--ingests", type=int, default=500, help="requests ingested, round-robin over the replicas")
    sp.add_argument("--redis-url", default="", help="an existing Redis (default: an embedded one, started here)")
    sp.add_argument("--poll-ms", type=float, default=1.0, help="pause between rounds of Draft polls")
    sp.add_argument("--timeout", type=float, default=10.0, help="seconds a replica may take before the request "
                    "counts as missing there")
    sp.add_argument("--seed", type=int, default=0)
    sp.add_argument("--json", help="also write the figures as JSON to this file")
    sp.set_defaults(func=run_replicas_bench)


def has_chain(reply: pb.DraftResponse, tokens: list[int]) -> bool:
    """Whether the draft holds ``tokens`` as a path from its root."""
    parent = -1
    for token in tokens:
        for i, (t, p) in enumerate(zip(reply.token_ids, reply.parents, strict=True)):
            if t == token and p == parent:
                parent = i
                break
        else:
            return False
    return True


class Replica:
    """One `drafter serve --redis-url` process (following the log) and a channel to it."""

    def __init__(self, redis_url: str, index: int, log_dir: Path) -> None:
        self.address = f"127.0.0.1:{_free_port()}"
        self.name = f"bench-{index}"
        with open(log_dir / f"{self.name}.log", "wb") as log:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "drafter_service.cli.main", "--log-level", "INFO", "serve", "--redis-url",
                 redis_url, "--address", self.address, "--http-address", "", "--replica-id", self.name,
                 "--follow-log", "on", "--namespaces", f"{NAMESPACE}={VOCAB}", "--capacity", str(1 << 22),
                 "--snapshot-interval", "3600", "--metrics-interval", "3600"],
                env={**os.environ, "DRAFTER_VOCAB_SIZE": str(VOCAB)}, stdout=subprocess.DEVNULL, stderr=log)
        self.channel = grpc.insecure_channel(self.address)
        self.stub = pb_grpc.DrafterStub(self.channel)

    def rss_mib(self) -> float:
        """Resident memory of the process, in MiB (nan where /proc is not available)."""
        try:
            for line in Path(f"/proc/{self.proc.pid}/status").read_text().splitlines():
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) / 1024
        except OSError:
            pass
        return float("nan")

    def stop(self) -> None:
        self.channel.close()
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def _poll(replica: Replica, sid: str, tokens: list[int], poll_s: float, deadline: float) -> float:
    """Draft on the session until the tree holds ``tokens``; the time the reply that did arrived (inf: never)."""
    while True:
        reply = replica.stub.Draft(pb.DraftRequest(session_id=sid, max_nodes=8), timeout=10)
        now = time.perf_counter()
        if has_chain(reply, tokens):
            return now
        if now > deadline:
            return float("inf")
        if poll_s > 0:
            time.sleep(poll_s)


def measure(replicas: list[Replica], ingests: int, poll_s: float, timeout: float,
            seed: int) -> tuple[list[float], list[float], list[float], int]:
    """Ingest round-robin; per request and other replica, when a draft there first held it.

    Before each ingest every other replica opens a session on the request's prompt (random tokens no other
    request shares), whose draft does not hold the output yet, and a thread per replica polls Draft on it
    from just before the Ingest is sent until the tree holds the output.

    Returns:
        (seconds from the acknowledgement to the first reply holding the request, per delivery: negative when
        that reply came before the acknowledgement reached the client; seconds from sending the Ingest to
        that reply; acknowledgement latencies; deliveries that timed out).
    """
    rng = np.random.default_rng(seed)
    from_ack: list[float] = []
    from_send: list[float] = []
    acks: list[float] = []
    missing = 0
    with ThreadPoolExecutor(max_workers=len(replicas) - 1, thread_name_prefix="poll") as pool:
        for i in range(ingests):
            writer = replicas[i % len(replicas)]
            readers = [r for r in replicas if r is not writer]
            prompt = rng.integers(0, VOCAB, PROMPT_TOKENS).tolist()
            output = rng.integers(0, VOCAB, OUTPUT_TOKENS).tolist()
            sid = f"probe-{seed}-{i}"
            for r in readers:
                r.stub.StartSession(pb.StartSessionRequest(namespace=NAMESPACE, session_id=sid, prompt=prompt,
                                                           max_nodes=8), timeout=10)
                if has_chain(r.stub.Draft(pb.DraftRequest(session_id=sid, max_nodes=8), timeout=10),
                             output[:CHECKED]):
                    raise RuntimeError("a draft holds the output before it was ingested: the probe is not unique")
            t0 = time.perf_counter()
            polls = [pool.submit(_poll, r, sid, output[:CHECKED], poll_s, t0 + timeout) for r in readers]
            writer.stub.Ingest(pb.IngestRequest(namespace=NAMESPACE, requests=[
                pb.Sequence(prompt=prompt, output=output)]), timeout=30)
            t_ack = time.perf_counter()
            acks.append(t_ack - t0)
            for f in polls:
                t_hit = f.result()
                if t_hit == float("inf"):
                    missing += 1
                else:
                    from_ack.append(t_hit - t_ack)
                    from_send.append(t_hit - t0)
    return from_ack, from_send, acks, missing


def _ms(xs: list[float], q: float) -> float:
    return 1e3 * float(np.percentile(xs, q)) if xs else float("nan")


def run_replicas_bench(args: argparse.Namespace) -> int:
    """Start the replicas (and Redis), measure, print p50/p99/max propagation delay, clean up."""
    if args.replicas < 2 or args.ingests < 1:
        raise SystemExit("--replicas must be at least 2 and --ingests at least 1")
    with ExitStack() as stack:
        tmp = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="drafter-replicas-")))
        url = args.redis_url
        if not url:
            url = stack.enter_context(EmbeddedRedis(tmp / "redis")).url
        replicas = [Replica(url, i, tmp) for i in range(args.replicas)]
        stack.callback(_drop_namespace, url)
        for r in replicas:
            stack.callback(r.stop)
        t0 = time.perf_counter()
        for r in replicas:
            try:
                _wait_serving(r.address, 120, r.proc)
            except (RuntimeError, TimeoutError) as exc:
                tail = (tmp / f"{r.name}.log").read_text(errors="replace")[-2000:]
                raise SystemExit(f"replica {r.name} did not start: {exc}\n{tail}") from None
        print(f"{args.replicas} replicas serving on one Redis ({url}) after {time.perf_counter() - t0:.1f} s",
              flush=True)
        t0 = time.perf_counter()
        delays, from_send, acks, missing = measure(replicas, args.ingests, args.poll_ms / 1e3, args.timeout, args.seed)
        wall = time.perf_counter() - t0
        stored = [r.stub.GetStats(pb.GetStatsRequest(namespace=NAMESPACE)).stored_requests for r in replicas]
        rss = [round(r.rss_mib(), 1) for r in replicas]
    figures = {"replicas": args.replicas, "ingests": args.ingests, "deliveries": len(delays), "missing": missing,
               "seen_before_ack": sum(d < 0 for d in delays),
               "from_send_p50_ms": _ms(from_send, 50), "from_send_p99_ms": _ms(from_send, 99),
               "delay_p50_ms": _ms(delays, 50), "delay_p99_ms": _ms(delays, 99),
               "delay_max_ms": 1e3 * max(delays) if delays else float("nan"),
               "ack_p50_ms": _ms(acks, 50), "ack_p99_ms": _ms(acks, 99), "stored_requests": stored, "rss_mib": rss,
               "seconds": wall, "poll_ms": args.poll_ms, "cpus": os.cpu_count(),
               "load_avg_1m": os.getloadavg()[0]}
    print(f"propagation delay (ack on the writing replica -> first draft holding the request on another), "
          f"{len(delays)} deliveries of {args.ingests} ingests: p50 {figures['delay_p50_ms']:.2f} ms, "
          f"p99 {figures['delay_p99_ms']:.2f} ms, max {figures['delay_max_ms']:.2f} ms; missing {missing}; "
          f"{figures['seen_before_ack']} seen before the acknowledgement reached the client")
    print(f"from sending the Ingest to the first draft holding it elsewhere: p50 {figures['from_send_p50_ms']:.2f} "
          f"ms, p99 {figures['from_send_p99_ms']:.2f} ms")
    print(f"ingest acknowledgement: p50 {figures['ack_p50_ms']:.2f} ms, p99 {figures['ack_p99_ms']:.2f} ms; "
          f"stored requests per replica {stored}; RSS per replica {rss} MiB; {wall:.1f} s; "
          f"load average {figures['load_avg_1m']:.2f} on {figures['cpus']} CPUs")
    if args.json:
        Path(args.json).write_text(json.dumps(figures, indent=1))
    return 0 if not missing and len(set(stored)) == 1 else 1


def _drop_namespace(url: str) -> None:
    """Remove what the bench wrote (its own namespace only)."""
    from store.persistence import RedisPersistence

    try:
        RedisPersistence(url, NAMESPACE, durable=False).drop()
    except Exception as exc:  # the Redis may be gone already (the embedded one stops first)
        print(f"note: could not drop namespace {NAMESPACE}: {exc}", file=sys.stderr)

"""`drafter bench serve`: a load generator against a real service process over loopback."""

from __future__ import annotations

import argparse
import asyncio
import os
import queue
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

import grpc
import numpy as np
from grpc_health.v1 import health_pb2, health_pb2_grpc

from drafter_service.api.drafter.v1 import drafter_pb2 as pb
from drafter_service.api.drafter.v1 import drafter_pb2_grpc as pb_grpc
from drafter_service.api.tree import DraftTree, accept_greedy
from drafter_service.bench.machine import machine
from drafter_service.bench.restart_bench import (
    Prober,
    figures,
    folder_bytes,
    index_file_coverage,
    log_seconds,
    restart,
    store_marker,
    wait_for,
)
from drafter_service.datasets.loaders import Request, load_dataset


def add_serve_bench(bench: argparse._SubParsersAction) -> None:
    """Register ``bench serve``."""
    sp = bench.add_parser("serve", help="latency and throughput of a real service process over loopback")
    sp.add_argument("--tokens", type=int, default=10_000_000, help="tokens stored before measuring")
    sp.add_argument("--streams", type=int, default=16, help="concurrent DraftStream clients in the throughput run")
    sp.add_argument("--seconds", type=float, default=10.0, help="length of the throughput run")
    sp.add_argument("--budget", type=int, default=32, help="tree budget")
    sp.add_argument("--after-seconds", type=float, default=30.0,
                    help="how long Draft calls are timed after the large ingest ends")
    sp.add_argument("--work-dir", default=None,
                    help="folder for the service's data dir (Redis, index file): default the system's temporary one")
    sp.set_defaults(func=run_serve_bench)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_serving(address: str, timeout: float, proc: subprocess.Popen | None = None) -> float:
    t0 = time.monotonic()
    with grpc.insecure_channel(address) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        while time.monotonic() - t0 < timeout:
            if proc is not None and proc.poll() is not None:
                raise RuntimeError(f"the service at {address} exited with status {proc.returncode}")
            try:
                if stub.Check(health_pb2.HealthCheckRequest(), timeout=1).status == \
                        health_pb2.HealthCheckResponse.SERVING:
                    return time.monotonic() - t0
            except grpc.RpcError:
                time.sleep(0.05)
    raise TimeoutError(f"service at {address} not serving after {timeout} s")


class ServiceProcess:
    """``drafter serve`` in a child process with its own embedded Redis."""

    def __init__(self, data_dir: Path, capacity: int, extra_args: Sequence[str] = (),
                 cpus: set[int] | None = None) -> None:
        self.data_dir, self.capacity = data_dir, capacity
        self.cpus = cpus or None  # confine the service to these CPUs (None: wherever this process may run)
        self.extra_args = list(extra_args)
        self.port = _free_port()
        self.address = f"127.0.0.1:{self.port}"
        self.proc: subprocess.Popen | None = None

    def start(self) -> float:
        """Start and return the seconds until it answers health checks as SERVING."""
        script = Path(sys.executable).parent / "drafter"  # absent where the project is on PYTHONPATH, not installed
        exe = [str(script)] if script.is_file() else [sys.executable, "-m", "drafter_service.cli.entry"]
        env = {**os.environ, "DRAFTER_VOCAB_SIZE": "49152", "DRAFTER_CAPACITY": str(self.capacity),
               "DRAFTER_HTTP_ADDRESS": ""}  # no dashboard: the bench measures gRPC, beside any running service
        t0 = time.monotonic()
        self.data_dir.mkdir(parents=True, exist_ok=True)
        with open(self.data_dir / "serve.log", "ab") as log:
            self.proc = subprocess.Popen([*exe, "--log-level", "INFO", "serve", "--address", self.address,
                                          "--data-dir", str(self.data_dir), *self.extra_args], env=env,
                                         stdout=subprocess.DEVNULL, stderr=log,
                                         preexec_fn=self._confine if self.cpus else None)
        try:
            _wait_serving(self.address, 1800, self.proc)  # a full rebuild of 100M+ tokens takes minutes here
        except RuntimeError as exc:
            raise RuntimeError(f"{exc}: {(self.data_dir / 'serve.log').read_text()[-2000:]}") from None
        return time.monotonic() - t0

    def _confine(self) -> None:
        """In the child before it runs: every thread the service starts inherits these CPUs."""
        assert self.cpus is not None
        os.sched_setaffinity(0, self.cpus)

    def stop(self, sig: int = signal.SIGTERM) -> None:
        if self.proc is not None:
            self.proc.send_signal(sig)
            self.proc.wait(120)
            self.proc = None


def _steps(req: Request, budget: int, draft: Callable[[list[int]], pb.DraftResponse]) -> Iterator[float]:
    """Replay one request through ``draft`` with greedy acceptance; yields each call's latency in µs."""
    out = req.output.tolist()
    pos = 0
    accepted: list[int] = []
    while pos < len(out):
        t0 = time.perf_counter_ns()
        reply = draft(accepted)
        yield (time.perf_counter_ns() - t0) / 1e3
        tree = DraftTree(tuple(reply.token_ids), tuple(reply.parents), tuple(reply.probs), reply.score)
        n, _ = accept_greedy(tree, out[pos:])
        accepted = out[pos:pos + n + 1]
        pos += len(accepted)


def _session(stub: pb_grpc.DrafterStub, sid: str, req: Request, budget: int, stream: bool,
             sink: list[float]) -> None:
    """Replay one request in a session (unary Draft calls or one DraftStream), appending latencies to ``sink``."""
    stub.StartSession(pb.StartSessionRequest(session_id=sid, prompt=req.prompt.tolist(), max_nodes=budget))
    if stream:
        outbox: queue.SimpleQueue = queue.SimpleQueue()
        replies = stub.DraftStream(iter(outbox.get, None))

        def draft(accepted: list[int]) -> pb.DraftResponse:
            outbox.put(pb.DraftRequest(session_id=sid, accepted=accepted))
            return next(replies)
    else:
        def draft(accepted: list[int]) -> pb.DraftResponse:
            return stub.Draft(pb.DraftRequest(session_id=sid, accepted=accepted))
    sink.extend(_steps(req, budget, draft))
    if stream:
        outbox.put(None)
        for _ in replies:
            pass
    stub.EndSession(pb.EndSessionRequest(session_id=sid))


def _pct(xs: list[float]) -> str:
    return f"p50 {np.percentile(xs, 50):.0f} µs  p99 {np.percentile(xs, 99):.0f} µs  ({len(xs)} calls)"


def run_serve_bench(args: argparse.Namespace) -> int:
    """Fill a service with ShareGPT requests, timing drafts during and after the ingest, then measure latency,
    throughput, rebuild impact, footprint and restarts after SIGKILL with and without the index file."""
    if args.work_dir:  # a folder that is not there yet is made (one that cannot be is a clear error)
        try:
            Path(args.work_dir).mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise SystemExit(f"--work-dir {args.work_dir}: {exc.strerror or exc}") from None
    print(f"Machine: {machine()}")
    requests = load_dataset("sharegpt", 3000)
    held, fill = requests[-300:], requests[:-300]
    with tempfile.TemporaryDirectory(prefix="drafter-bench-", dir=args.work_dir) as tmp:
        # room for the fill, the 30% more that causes rebuilds and the sessions the measurements store (a few million
        # tokens whatever --tokens says): the first request stored stays held to the end
        svc = ServiceProcess(Path(tmp) / "data", capacity=int(args.tokens * 1.4) + (4 << 20))
        svc.start()
        try:
            _measure(svc, args, held, fill)
        finally:
            svc.stop()
    return 0


def _fill(stub: pb_grpc.DrafterStub, fill: list[Request], tokens: int, start: int = 0) -> int:
    stored, i = 0, start
    while stored < tokens:
        batch = [fill[(i + k) % len(fill)] for k in range(200)]
        i += 200
        reply = stub.Ingest(pb.IngestRequest(requests=[pb.Sequence(prompt=r.prompt.tolist(), output=r.output.tolist())
                                                       for r in batch]), timeout=120)
        stored += reply.tokens
    return i


def _quiet(stub: pb_grpc.DrafterStub) -> bool:
    """No rebuild for 5 s (the job checks every second) and nothing left to index."""
    s = stub.GetStats(pb.GetStatsRequest())
    return s.unindexed_tokens <= 8192 and s.index_age_seconds >= 5.0


def _wait_indexed(stub: pb_grpc.DrafterStub, timeout: float = 300) -> None:
    t0 = time.monotonic()
    while not _quiet(stub):
        if time.monotonic() - t0 > timeout:
            raise TimeoutError("index not rebuilt")
        time.sleep(0.5)


def _echo_floor(reqs: list[Request], budget: int) -> tuple[list[float], list[float]]:
    """Round trips to ``echo_server`` (no drafting at all) with the same client code."""
    address = f"127.0.0.1:{_free_port()}"
    proc = subprocess.Popen([sys.executable, "-m", "drafter_service.bench.echo_server", address],
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    try:
        assert proc.stdout is not None  # stdout=PIPE
        proc.stdout.readline()
        unary: list[float] = []
        streamed: list[float] = []
        with grpc.insecure_channel(address) as channel:
            stub = pb_grpc.DrafterStub(channel)
            for i, req in enumerate(reqs):
                _session(stub, f"u{i}", req, budget, False, unary)
                _session(stub, f"s{i}", req, budget, True, streamed)
        return unary, streamed
    finally:
        proc.terminate()
        proc.wait(30)


async def _throughput(address: str, held: list[Request], streams: int, seconds: float, budget: int
                      ) -> tuple[int, float]:
    """``streams`` sessions at a time, each on its own DraftStream, advancing 3 recorded tokens per draft
    (about the accepted length of real drafts) so the client spends little CPU; returns (drafts, seconds)."""
    counts: list[int] = []
    async with grpc.aio.insecure_channel(address) as channel:
        stub = pb_grpc.DrafterStub(channel)
        t0 = time.monotonic()
        stop_at = t0 + seconds

        async def worker(w: int) -> None:
            n = k = 0
            while time.monotonic() < stop_at:
                req = held[(w * 7 + k) % len(held)]
                sid = f"t{w}-{k}"
                k += 1
                await stub.StartSession(pb.StartSessionRequest(session_id=sid, prompt=req.prompt.tolist(),
                                                               max_nodes=budget))
                call = stub.DraftStream()
                out, pos = req.output.tolist(), 0
                accepted: list[int] = []
                while pos < len(out) and time.monotonic() < stop_at:
                    await call.write(pb.DraftRequest(session_id=sid, accepted=accepted))
                    await call.read()
                    n += 1
                    accepted, pos = out[pos:pos + 3], pos + 3
                await call.done_writing()
                while await call.read() != grpc.aio.EOF:
                    pass
                await stub.EndSession(pb.EndSessionRequest(session_id=sid))
            counts.append(n)

        await asyncio.gather(*(worker(w) for w in range(streams)))
        return sum(counts), time.monotonic() - t0


MAIN_BUILT = r"main index over \d+ tokens built in ([\d.]+) s"
"""The service's log line of a main index build (``Namespace.rebuild``)."""
FILE_WRITTEN = r"index file .* written in ([\d.]+) s"
"""The service's log line of an index file written (``IndexFiles.save``)."""


def _measure(svc: ServiceProcess, args: argparse.Namespace, held: list[Request], fill: list[Request]) -> None:
    channel = grpc.insecure_channel(svc.address)
    stub = pb_grpc.DrafterStub(channel)
    store_marker(stub)  # the first request stored: restarts must draft it back
    prober = Prober(svc.address, held[100:300], args.budget).start()
    t0 = time.monotonic()
    cursor = _fill(stub, fill, args.tokens)
    ingested = time.monotonic()
    time.sleep(args.after_seconds)
    probes = prober.stop()
    stats = stub.GetStats(pb.GetStatsRequest())
    took = ingested - t0
    print(f"ingest of {stats.stored_tokens:,} tokens in {stats.stored_requests:,} requests: {took:.1f} s "
          f"({stats.stored_tokens / took / 1e6:.2f} M tokens/s), Draft calls of another client meanwhile and after:")
    print(f"  during the ingest:            {figures(probes.between(t0, ingested))}")
    first = probes.first_after(ingested)
    print(f"  right after it ({args.after_seconds:.0f} s):       "
          f"{figures(probes.between(ingested, ingested + args.after_seconds))}; the first call: "
          f"{first if first is not None else float('nan'):.1f} ms")
    indexed, covered = _index_current(svc, stub, 1200)
    said = (svc.data_dir / "serve.log").read_text(errors="replace")
    built = log_seconds(said, MAIN_BUILT) or float("nan")
    written = log_seconds(said, FILE_WRITTEN) or float("nan")
    print(f"indexed {indexed - ingested:.0f} s after the ingest ended ({covered}): last main index build "
          f"{built:.1f} s, last index file write {written:.1f} s")
    stats = stub.GetStats(pb.GetStatsRequest())
    index_bytes = folder_bytes(svc.data_dir / "index")
    redis_bytes = folder_bytes(svc.data_dir / "appendonlydir")
    indexes = stats.memory_bytes - 4 * svc.capacity  # the ring takes 4 bytes a slot, held or not
    print(f"bytes per stored token: memory {(4 * stats.stored_tokens + indexes) / stats.stored_tokens:.2f} (ring "
          f"buffer sized to them and indexes; this ring has {svc.capacity:,} slots), disk "
          f"{index_bytes / stats.stored_tokens:.2f} (index file) + {redis_bytes / stats.stored_tokens:.2f} "
          f"(Redis append-only files)")

    unary: list[float] = []
    streamed: list[float] = []
    for i in range(20):  # different requests for each, so neither drafts the other's stored copy
        _session(stub, f"u{i}", held[2 * i], args.budget, False, unary)
        _session(stub, f"s{i}", held[2 * i + 1], args.budget, True, streamed)
    print(f"unary Draft round trip:       {_pct(unary)}")
    print(f"DraftStream round trip:       {_pct(streamed)}")
    echo_unary, echo_stream = _echo_floor(held[:20], args.budget)
    print("  transport alone (a server that does no work), same client:")
    print(f"  unary:                      {_pct(echo_unary)}")
    print(f"  stream:                     {_pct(echo_stream)}")

    drafts, elapsed = asyncio.run(_throughput(svc.address, held, args.streams, args.seconds, args.budget))
    print(f"{args.streams} concurrent streams: {drafts / elapsed:,.0f} drafts/s over {elapsed:.1f} s")

    idle: list[float] = []
    for i, req in enumerate(held[40:100]):
        _session(stub, f"i{i}", req, args.budget, True, idle)  # idle baseline for the rebuild comparison
    _fill(stub, fill, int(stats.stored_tokens * 0.3), cursor)  # enough new tokens for a delta, then a main rebuild
    during: list[float] = []
    deadline = time.monotonic() + 30  # the delta and the main rebuild it causes take about 10 s at 10M tokens
    k = 0
    while time.monotonic() < deadline:
        _session(stub, f"r{k}", held[100 + k % 200], args.budget, True, during)
        k += 1
    print(f"idle:                         {_pct(idle)}")
    ratio = np.percentile(during, 99) / np.percentile(idle, 99)
    print(f"during background rebuilds:   {_pct(during)}  max {max(during) / 1e3:.1f} ms  ratio p99 {ratio:.2f}")
    _, covered = _index_current(svc, stub, 1200)
    stats = stub.GetStats(pb.GetStatsRequest())
    channel.close()

    def probe(stub: pb_grpc.DrafterStub, tag: str) -> list[tuple]:
        out = []
        for i, req in enumerate(held[:20]):
            sid = f"p-{tag}-{i}"
            prompt = req.prompt.tolist() + req.output[:5].tolist()
            stub.StartSession(pb.StartSessionRequest(session_id=sid, prompt=prompt))
            reply = stub.Draft(pb.DraftRequest(session_id=sid, max_nodes=args.budget))
            out.append((tuple(reply.token_ids), tuple(reply.parents), tuple(reply.probs), tuple(reply.sources)))
        return out

    print(f"restart after SIGKILL of the service and its Redis, {stats.stored_tokens:,} tokens "
          f"({stats.stored_requests:,} requests) stored, {covered}:")
    svc.extra_args += ["--snapshot-interval", "3600"]  # no table snapshot of the probes between the two restarts
    with_file = restart(svc, True, probe)
    print(f"  with the index file:        {with_file.line()}")
    without = restart(svc, False, probe)
    print(f"  without it (full rebuild):  {without.line()}")
    pairs = list(zip(with_file.drafts, without.drafts, strict=True))
    same = sum(a == b for a, b in pairs)
    same_trees = sum(a[:2] == b[:2] for a, b in pairs)  # token ids and parents: probabilities aside
    print(f"  drafts of {len(pairs)} probe sessions equal after both restarts: {same} of {len(pairs)} "
          f"(the same tokens and shape: {same_trees})")
    differ = [i for i, (a, b) in enumerate(pairs) if a != b]
    for i in differ[:3]:
        print(f"    probe {i} differs: with the file {_tree_head(pairs[i][0])}; rebuilt {_tree_head(pairs[i][1])}")


def _tree_head(tree: tuple) -> str:
    """A probe's tree in brief: its size, first tokens, first probabilities and the sources of its first nodes."""
    tokens, _, probs, sources = tree
    names = [pb.Source.Name(s).removeprefix("SOURCE_").lower() for s in sources[:8]]
    return f"{len(tokens)} nodes, tokens {list(tokens[:8])}, probs {[round(p, 3) for p in probs[:4]]}, sources {names}"


def _index_current(svc: ServiceProcess, stub: pb_grpc.DrafterStub, timeout: float) -> tuple[float, str]:
    """Wait until nothing is left to index, then until the index file holds every stored request, all of them
    indexed, or has not changed for 60 s (after a delta rebuild it is written again only once the indexes outgrow it
    by a sixteenth, and at most a tenth of the time); returns the time and what the file holds."""
    wait_for("indexing", lambda: _quiet(stub), timeout)
    stored = stub.GetStats(pb.GetStatsRequest()).stored_requests
    path = svc.data_dir / "index" / "default.index"
    seen: list[float] = []

    def settled() -> bool:
        held = index_file_coverage(svc.data_dir)
        if held.documents >= stored and held.unindexed == 0:
            return True
        mtime = path.stat().st_mtime if path.exists() else 0.0
        seen.append(mtime)
        return len(seen) > 120 and seen[-121] == mtime
    wait_for("index file", settled, timeout)
    held = index_file_coverage(svc.data_dir)
    return time.monotonic(), (f"the index file holds {held.documents:,} of {stored:,} requests, "
                              f"{held.unindexed:,} of its tokens not indexed")

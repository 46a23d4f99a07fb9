"""`drafter bench soak`: many concurrent sessions and a stream of ingests against a real service for a while."""

from __future__ import annotations

import argparse
import asyncio
import collections
import json
import os
import shlex
import tempfile
import threading
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

import grpc
import numpy as np

from drafter_service.api.drafter.v1 import drafter_pb2 as pb
from drafter_service.api.drafter.v1 import drafter_pb2_grpc as pb_grpc
from drafter_service.bench.serve_bench import ServiceProcess, _fill, _wait_indexed
from drafter_service.datasets.loaders import Request, load_dataset

CALL_TIMEOUT_S = 30.0
"""Deadline of every call and of every stream answer: a call that takes longer counts as an error (a hang)."""

MIB = 1 << 20


def add_soak_bench(bench: argparse._SubParsersAction) -> None:
    """Register ``bench soak``."""
    sp = bench.add_parser("soak", help="concurrent sessions and ingests against a real service: errors, latency, "
                          "memory over time")
    sp.add_argument("--sessions", type=int, default=64, help="concurrent sessions, each on its own DraftStream")
    sp.add_argument("--seconds", type=float, default=60.0, help="length of the measured run")
    sp.add_argument("--warmup", type=float, default=20.0, help="seconds of the same load before measuring")
    sp.add_argument("--budget", type=int, default=32, help="tree budget of every draft")
    sp.add_argument("--capacity", type=int, default=2_000_000, help="ring buffer tokens of the service")
    sp.add_argument("--fill-tokens", type=int, default=3_000_000, help="tokens ingested before the run (above "
                    "--capacity, so the ring buffer has wrapped and memory is at its steady state)")
    sp.add_argument("--ingest-batch", type=int, default=16, help="requests per Ingest call of the ingest stream")
    sp.add_argument("--ingest-interval", type=float, default=0.05, help="pause between Ingest calls, seconds")
    sp.add_argument("--serve-args", default="", help="more `drafter serve` flags, e.g. '--max-streams 48'")
    sp.add_argument("--json", help="also write the result as JSON to this file")
    sp.set_defaults(func=run_soak)


def rss_bytes(pid: int) -> tuple[int, int]:
    """(resident set size now, its peak) of process ``pid``, from /proc/<pid>/status (VmRSS, VmHWM)."""
    found = {}
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            key, _, value = line.partition(":")
            if key in ("VmRSS", "VmHWM"):
                found[key] = int(value.split()[0]) * 1024
    return found.get("VmRSS", 0), found.get("VmHWM", 0)


def cpu_seconds(pid: int) -> float:
    """User plus system CPU seconds process ``pid`` has used (/proc/<pid>/stat)."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rpartition(")")[2].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


@dataclass
class SoakResult:
    """What a soak run saw. Latencies in microseconds, memory in bytes, rates over the measured window."""

    sessions: int
    seconds: float
    drafts: int = 0
    sessions_done: int = 0
    ingest_calls: int = 0
    ingested_requests: int = 0
    errors: dict[str, int] = field(default_factory=dict)
    draft_p50_us: float = 0.0
    draft_p99_us: float = 0.0
    draft_max_us: float = 0.0
    ingest_p99_us: float = 0.0
    stats_p99_us: float = 0.0
    rss_start: int = 0
    rss_mid: int = 0
    rss_end: int = 0
    rss_peak: int = 0
    rss_samples: list[tuple[float, int]] = field(default_factory=list)
    server_cpu_s: float = 0.0
    client_cpu_s: float = 0.0
    server_draft_p99_us: float = 0.0

    @property
    def drafts_per_s(self) -> float:
        return self.drafts / self.seconds if self.seconds else 0.0

    @property
    def second_half_growth(self) -> int:
        """RSS at the end minus RSS half-way through the measured run (each a median over a tenth of it)."""
        return self.rss_end - self.rss_mid

    def lines(self) -> list[str]:
        """A human-readable summary."""
        errs = ", ".join(f"{k} {v}" for k, v in sorted(self.errors.items())) or "none"
        return [f"{self.sessions} sessions for {self.seconds:.0f} s: {self.drafts:,} drafts "
                f"({self.drafts_per_s:,.0f}/s), {self.sessions_done:,} sessions completed, {self.ingest_calls:,} "
                f"Ingest calls ({self.ingested_requests:,} requests)",
                f"errors: {errs}",
                f"draft round trip (client side): p50 {self.draft_p50_us / 1e3:.1f} ms  p99 "
                f"{self.draft_p99_us / 1e3:.1f} ms  max {self.draft_max_us / 1e3:.1f} ms; service-side p99 "
                f"{self.server_draft_p99_us / 1e3:.2f} ms",
                f"Ingest p99 {self.ingest_p99_us / 1e3:.1f} ms; GetStats beside the streams p99 "
                f"{self.stats_p99_us / 1e3:.1f} ms",
                f"service RSS (medians of the first, middle and last tenth): start {self.rss_start / MIB:.0f} MiB, "
                f"half-way {self.rss_mid / MIB:.0f} MiB, end {self.rss_end / MIB:.0f} MiB, peak "
                f"{self.rss_peak / MIB:.0f} MiB; second-half growth {self.second_half_growth / MIB:+.1f} MiB",
                f"CPU: service {self.server_cpu_s:.0f} s, load generator {self.client_cpu_s:.0f} s "
                f"({os.cpu_count()} cores)"]

    def as_dict(self) -> dict:
        """The result as a JSON-ready dictionary."""
        return {**asdict(self), "drafts_per_s": self.drafts_per_s, "second_half_growth": self.second_half_growth}


def _greedy_accepted(reply: pb.DraftResponse, out: list[int], pos: int) -> int:
    """Draft tokens of ``reply`` that the recorded output confirms from ``pos`` (longest matching path)."""
    node, depth = -1, 0
    for i, (tok, parent) in enumerate(zip(reply.token_ids, reply.parents, strict=True)):
        if pos + depth >= len(out):
            break
        if parent == node and tok == out[pos + depth]:  # parents precede children: one pass finds the path
            node, depth = i, depth + 1
    return depth


class _Load:
    """The running load: session workers, an ingest stream, a GetStats probe and an RSS sampler."""

    def __init__(self, address: str, pid: int, held: Sequence[Request], feed: Sequence[Request], sessions: int,
                 budget: int, ingest_batch: int, ingest_interval: float) -> None:
        self.address, self.pid = address, pid
        self.held, self.feed = held, feed
        self.sessions, self.budget = sessions, budget
        self.ingest_batch, self.ingest_interval = ingest_batch, ingest_interval
        self.errors: collections.Counter = collections.Counter()
        self.drafts: list[tuple[float, float]] = []  # (time, latency µs)
        self.ingests: list[tuple[float, float, int]] = []  # (time, latency µs, requests)
        self.stats_calls: list[tuple[float, float]] = []
        self.ended: list[float] = []  # times sessions were completed
        self.rss: list[tuple[float, int, float, float]] = []  # (time, RSS, service CPU s, load generator CPU s)
        self.stop_at = 0.0

    def _error(self, exc: BaseException) -> None:
        if isinstance(exc, grpc.aio.AioRpcError):
            self.errors[exc.code().name] += 1
        elif isinstance(exc, asyncio.TimeoutError):
            self.errors["HANG"] += 1
        else:
            self.errors[type(exc).__name__] += 1

    async def _session(self, stub: pb_grpc.DrafterStub, sid: str, req: Request) -> None:
        await stub.StartSession(pb.StartSessionRequest(session_id=sid, prompt=req.prompt.tolist(),
                                                       max_nodes=self.budget), timeout=CALL_TIMEOUT_S)
        call = stub.DraftStream(timeout=max(CALL_TIMEOUT_S, self.stop_at - time.monotonic() + CALL_TIMEOUT_S))
        out, pos = req.output.tolist(), 0
        accepted: list[int] = []
        try:
            while pos < len(out) and time.monotonic() < self.stop_at:
                t0 = time.perf_counter_ns()
                await call.write(pb.DraftRequest(session_id=sid, accepted=accepted))
                reply = await asyncio.wait_for(call.read(), CALL_TIMEOUT_S)
                self.drafts.append((time.monotonic(), (time.perf_counter_ns() - t0) / 1e3))
                if reply is grpc.aio.EOF:
                    raise RuntimeError("the draft stream ended early")
                n = _greedy_accepted(reply, out, pos)
                accepted = out[pos:pos + n + 1]  # the confirmed draft tokens and the target's own next token
                pos += len(accepted)
            await call.done_writing()
            while await asyncio.wait_for(call.read(), CALL_TIMEOUT_S) is not grpc.aio.EOF:
                pass
        except BaseException:
            call.cancel()
            raise
        await stub.EndSession(pb.EndSessionRequest(session_id=sid, accepted=accepted), timeout=CALL_TIMEOUT_S)
        self.ended.append(time.monotonic())

    async def _worker(self, stub: pb_grpc.DrafterStub, w: int) -> None:
        k = 0
        while time.monotonic() < self.stop_at:
            req = self.held[(w * 7919 + k) % len(self.held)]
            sid = f"soak-{w}-{k}"
            k += 1
            try:
                await self._session(stub, sid, req)
            except Exception as exc:
                self._error(exc)
                try:  # leave no session open behind a failure
                    await stub.EndSession(pb.EndSessionRequest(session_id=sid), timeout=CALL_TIMEOUT_S)
                except grpc.aio.AioRpcError:
                    pass

    async def _ingest(self, stub: pb_grpc.DrafterStub) -> None:
        i = 0
        while time.monotonic() < self.stop_at:
            batch = [self.feed[(i + j) % len(self.feed)] for j in range(self.ingest_batch)]
            i += self.ingest_batch
            t0 = time.perf_counter_ns()
            try:
                await stub.Ingest(pb.IngestRequest(requests=[pb.Sequence(prompt=r.prompt.tolist(),
                                                                         output=r.output.tolist()) for r in batch]),
                                  timeout=CALL_TIMEOUT_S)
                self.ingests.append((time.monotonic(), (time.perf_counter_ns() - t0) / 1e3, len(batch)))
            except Exception as exc:
                self._error(exc)
            await asyncio.sleep(self.ingest_interval)

    async def _probe(self, stub: pb_grpc.DrafterStub) -> None:
        while time.monotonic() < self.stop_at:
            t0 = time.perf_counter_ns()
            try:
                await stub.GetStats(pb.GetStatsRequest(), timeout=CALL_TIMEOUT_S)
                self.stats_calls.append((time.monotonic(), (time.perf_counter_ns() - t0) / 1e3))
            except Exception as exc:
                self._error(exc)
            await asyncio.sleep(0.5)

    def _sample_rss(self, done: threading.Event) -> None:
        while not done.is_set():
            self.rss.append((time.monotonic(), rss_bytes(self.pid)[0], cpu_seconds(self.pid), time.process_time()))
            done.wait(0.25)

    async def run(self, seconds: float) -> None:
        """Run everything for ``seconds``; the RSS sampler runs on a thread, beside the event loop."""
        self.stop_at = time.monotonic() + seconds
        done = threading.Event()
        sampler = threading.Thread(target=self._sample_rss, args=(done,), name="soak-rss", daemon=True)
        sampler.start()
        try:
            async with grpc.aio.insecure_channel(self.address) as channel:
                stub = pb_grpc.DrafterStub(channel)
                await asyncio.gather(*(self._worker(stub, w) for w in range(self.sessions)), self._ingest(stub),
                                     self._probe(stub))
        finally:
            done.set()
            sampler.join()


def _pct(xs: Sequence[float], q: float) -> float:
    return float(np.percentile(xs, q)) if len(xs) else 0.0


def soak(address: str, pid: int, held: Sequence[Request], feed: Sequence[Request], sessions: int = 64,
         seconds: float = 60.0, warmup: float = 20.0, budget: int = 32, ingest_batch: int = 16,
         ingest_interval: float = 0.05) -> SoakResult:
    """Run the load against the service at ``address`` (process ``pid``) for ``warmup + seconds``.

    Errors count over the whole run; rates, latencies and memory over the last ``seconds`` only.

    Args:
        address: host:port of the service.
        pid: its process id, for RSS and CPU time.
        held: requests the sessions replay (prompt, then the recorded output as the accepted tokens).
        feed: requests the ingest stream sends.
        sessions: concurrent sessions, each on its own DraftStream.
        seconds, warmup: measured and unmeasured seconds of load.
        budget: tree budget of every draft.
        ingest_batch, ingest_interval: requests per Ingest call and the pause between calls.
    """
    load = _Load(address, pid, held, feed, sessions, budget, ingest_batch, ingest_interval)
    t_start = time.monotonic() + warmup
    asyncio.run(load.run(warmup + seconds))
    t_end = time.monotonic()
    window = [lat for t, lat in load.drafts if t >= t_start]
    samples = [s for s in load.rss if s[0] >= t_start] or load.rss[-1:]
    rss = [(t, b) for t, b, _, _ in samples]

    def level(a: float, b: float) -> int:  # median RSS over [a, b] of the window: index swaps make it a sawtooth
        part = [x for t, x in rss if t_start + a * (t_end - t_start) <= t <= t_start + b * (t_end - t_start)]
        return int(np.median(part or [rss[-1][1]]))
    res = SoakResult(sessions, t_end - t_start, drafts=len(window),
                     sessions_done=sum(t >= t_start for t in load.ended),
                     ingest_calls=sum(t >= t_start for t, _, _ in load.ingests),
                     ingested_requests=sum(n for t, _, n in load.ingests if t >= t_start),
                     errors=dict(load.errors), draft_p50_us=_pct(window, 50), draft_p99_us=_pct(window, 99),
                     draft_max_us=max(window, default=0.0),
                     ingest_p99_us=_pct([lat for t, lat, _ in load.ingests if t >= t_start], 99),
                     stats_p99_us=_pct([lat for t, lat in load.stats_calls if t >= t_start], 99),
                     rss_start=level(0.0, 0.1), rss_mid=level(0.45, 0.55), rss_end=level(0.9, 1.0),
                     rss_peak=max(b for _, b in rss),
                     rss_samples=[(round(t - t_start, 2), b) for t, b in rss],
                     server_cpu_s=samples[-1][2] - samples[0][2], client_cpu_s=samples[-1][3] - samples[0][3])
    with grpc.insecure_channel(address) as channel:
        res.server_draft_p99_us = pb_grpc.DrafterStub(channel).GetStats(pb.GetStatsRequest(),
                                                                       timeout=CALL_TIMEOUT_S).draft_latency_p99_us
    return res


def run_soak(args: argparse.Namespace) -> int:
    """Start a service, fill it past its capacity, then soak it; exits 1 on any error."""
    for name in ("sessions", "budget", "capacity", "ingest_batch"):
        if getattr(args, name) < 1:
            raise SystemExit(f"--{name.replace('_', '-')} must be at least 1")
    if args.seconds <= 0 or args.warmup < 0 or args.ingest_interval < 0:
        raise SystemExit("--seconds must be positive, --warmup and --ingest-interval not negative")
    requests = load_dataset("sharegpt", 3000)
    held, feed = requests[-300:], requests[:-300]
    with tempfile.TemporaryDirectory(prefix="drafter-soak-") as tmp:
        svc = ServiceProcess(Path(tmp) / "data", capacity=args.capacity, extra_args=shlex.split(args.serve_args))
        ready = svc.start()
        try:
            with grpc.insecure_channel(svc.address) as channel:
                stub = pb_grpc.DrafterStub(channel)
                _fill(stub, feed, args.fill_tokens)
                _wait_indexed(stub)
                stats = stub.GetStats(pb.GetStatsRequest())
            print(f"service ready in {ready:.1f} s; {stats.stored_tokens:,} tokens stored "
                  f"({stats.stored_requests:,} requests) after ingesting {args.fill_tokens:,}", flush=True)
            assert svc.proc is not None  # started
            result = soak(svc.address, svc.proc.pid, held, feed, args.sessions, args.seconds, args.warmup,
                          args.budget, args.ingest_batch, args.ingest_interval)
        finally:
            svc.stop()
            log = (Path(tmp) / "data" / "serve.log").read_text(errors="replace")
    if result.errors:
        print("the service's log ends with:\n" + log[-4000:])
    print("\n".join(result.lines()))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result.as_dict(), f, indent=1)
    return 1 if result.errors else 0

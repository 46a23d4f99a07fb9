"""``drafter bench batch``: what drafting costs an engine per step with B requests in flight, batched or not."""

from __future__ import annotations

import argparse
import tempfile
import threading
import time
from collections.abc import Sequence
from pathlib import Path

import grpc
import numpy as np

from drafter_service.api.drafter.v1 import drafter_pb2 as pb
from drafter_service.api.drafter.v1 import drafter_pb2_grpc as pb_grpc
from drafter_service.api.tree import DraftTree, accept_greedy
from drafter_service.bench.serve_bench import ServiceProcess, _fill, _wait_indexed
from drafter_service.core.config import DrafterConfig
from drafter_service.core.drafter import Drafter
from drafter_service.datasets.loaders import Request, load_dataset
from engine_client import DrafterClient
from store.index_worker import IndexWorker


def add_batch_bench(bench: argparse._SubParsersAction) -> None:
    """Register ``bench batch``."""
    bp = bench.add_parser("batch", help="drafting cost per engine step with B requests in flight: one DraftBatch "
                          "call per step against one Draft per request, on a real service process")
    bp.add_argument("--tokens", type=int, default=10_000_000, help="tokens stored before measuring")
    bp.add_argument("--batch", type=int, action="append", help="requests in flight (repeatable; default 1, 8, "
                    "32, 128, 256)")
    bp.add_argument("--budget", type=int, action="append", help="tree budget (repeatable; default 16 and 32)")
    bp.add_argument("--steps", type=int, default=30, help="engine steps timed per configuration and path (the "
                    "batched paths, DraftBatch through the client, packed and bare, step in turn, one engine each)")
    bp.add_argument("--reuse", type=int, default=0, help="1: let the client reuse subtrees (fewer round trips)")
    bp.add_argument("--wire", type=int, default=1, help="1: also time DraftBatch as a bare load generator sends it "
                    "(packed steps, replies read whole with numpy): what the service answers, without the client")
    bp.add_argument("--engines", type=int, default=0, help="N > 0: a last column with N bare load generators "
                    "stepping at once against the service (one service, many engines: drafts/s of them all over "
                    "their whole steps, their own work between calls included)")
    bp.add_argument("--sustain", type=float, default=0.0, help="S > 0: after the rows, a bare load generator keeps "
                    "B sessions stepping for S seconds at each batch size (the first budget), every finished request "
                    "stored as in the rows: the store turns over, the ring fills and wraps, rebuilds keep running; "
                    "medians per 100 steps and of them all")
    bp.add_argument("--core", type=float, default=0.0, help="S > 0: instead of a service, time the batched step "
                    "inside this process for S seconds at each batch size (the first budget): one native "
                    "Drafter.draft_steps per step, no gRPC, the same turnover (finished requests stored, the index "
                    "rebuilt every second by the index worker): what the service's drafting itself costs")
    bp.set_defaults(func=run_batch_bench)


FILL = 2000
"""ShareGPT requests stored (cycled) until the service holds ``--tokens``."""
HELD = 4000
"""Held-out requests the engines replay, each once while they last (enough for the default rows)."""
SUSTAINED = 40000
"""Held-out requests of their own for the ``--sustain`` runs (about 1.3 finish per step at B = 128)."""


class Engine:
    """B requests in flight, each replaying a held-out request's output with greedy acceptance."""

    def __init__(self, client: DrafterClient, pool: list[Request], batch: int, offset: int, stride: int = 1) -> None:
        self.client, self.pool, self.next, self.stride = client, pool, offset, stride  # requests offset, + stride..
        self.slots = [self._open() for _ in range(batch)]

    def _open(self) -> list:
        req = self.pool[self.next % len(self.pool)]
        self.next += self.stride
        return [self.client.start(req.prompt.tolist()), req.output.tolist(), 0, []]

    def items(self) -> list[tuple[str, list[int]]]:
        return [(slot[0], slot[3]) for slot in self.slots]

    def advance(self, trees: list[DraftTree]) -> None:
        """Accept what each tree gets right plus the target's own token; finished requests make room for new ones."""
        for k, (slot, tree) in enumerate(zip(self.slots, trees, strict=True)):
            sid, out, pos, _ = slot
            n, _ = accept_greedy(tree, out[pos:])
            slot[3] = out[pos:pos + n + 1]
            slot[2] = pos + len(slot[3])
            if slot[2] >= len(out):
                self.client.end(sid, slot[3])
                self.slots[k] = self._open()

    def close(self) -> None:
        for sid, _, _, accepted in self.slots:
            self.client.end(sid, accepted)


def _greedy_accepted(tokens: list[int], parents: list[int], lo: int, hi: int, output: list[int], pos: int) -> int:
    """Draft tokens greedy verification accepts from a packed tree (nodes ``lo`` to ``hi - 1`` of ``tokens`` and
    ``parents``, parents relative to ``lo``, each before its children): its branch along ``output[pos:]``."""
    node, n = -1, 0
    for i in range(lo, hi):
        if pos + n < len(output) and parents[i] == node and tokens[i] == output[pos + n]:
            node, n = i - lo, n + 1
    return n


class WireEngine:
    """B requests in flight as a bare load generator keeps them: one packed DraftBatch per step, straight on the
    stub, the reply read whole with ``numpy.frombuffer`` (no tree object per session); sessions start and end
    with their own calls outside the timed step."""

    def __init__(self, stub: pb_grpc.DrafterStub, pool: list[Request], batch: int, offset: int, stride: int = 1,
                 ) -> None:
        self.stub, self.pool, self.next, self.stride = stub, pool, offset, stride  # requests offset, + stride, ...
        self.slots = [self._open() for _ in range(batch)]

    def _open(self) -> list:
        req = self.pool[self.next % len(self.pool)]
        self.next += self.stride
        sid = f"wire-{self.next}"
        self.stub.StartSession(pb.StartSessionRequest(session_id=sid, prompt=req.prompt.tolist()))
        return [sid, req.output.tolist(), 0, []]

    def step(self, budget: int) -> tuple[list[int], np.ndarray, np.ndarray]:
        """One DraftBatch for every session: (tree offsets, token ids, parents) of the reply."""
        accepted = [slot[3] for slot in self.slots]
        reply = self.stub.DraftBatch(pb.DraftBatchRequest(
            max_nodes=budget, packed_sessions=[slot[0] for slot in self.slots],
            packed_tokens=np.fromiter((t for a in accepted for t in a), "<i4").tobytes(),
            packed_counts=[len(a) for a in accepted]), timeout=30.0)
        if len(reply.step_errors):
            raise RuntimeError(f"DraftBatch step failed: {reply.step_errors[0].message}")
        return list(reply.tree_offsets), np.frombuffer(reply.token_ids, "<i4"), np.frombuffer(reply.parents, "<i4")

    def advance(self, answer: tuple[list[int], np.ndarray, np.ndarray]) -> None:
        """Greedy acceptance of each tree (as ``Engine.advance``), read from the packed reply."""
        offsets, token_ids, parents = answer
        tokens, links = token_ids.tolist(), parents.tolist()
        for k, slot in enumerate(self.slots):
            sid, out, pos, _ = slot
            n = _greedy_accepted(tokens, links, offsets[k], offsets[k + 1], out, pos)
            slot[3] = out[pos:pos + n + 1]
            slot[2] = pos + len(slot[3])
            if slot[2] >= len(out):
                self.stub.EndSession(pb.EndSessionRequest(session_id=sid, accepted=slot[3]))
                self.slots[k] = self._open()

    def close(self) -> None:
        for sid, _, _, accepted in self.slots:
            self.stub.EndSession(pb.EndSessionRequest(session_id=sid, accepted=accepted))


def _engines_rate(engines: list[WireEngine], budget: int, steps: int) -> float:
    """Drafts per second the service answers to several bare load generators stepping at once, each in its own
    thread (one service, many engines): every tree of ``steps`` steps each over the wall time of them all."""
    start = threading.Barrier(len(engines) + 1)

    def run(engine: WireEngine) -> None:
        start.wait()
        for _ in range(steps):
            engine.advance(engine.step(budget))

    threads = [threading.Thread(target=run, args=(e,), daemon=True) for e in engines]
    for t in threads:
        t.start()
    start.wait()
    t0 = time.perf_counter()
    for t in threads:
        t.join()
    return sum(len(e.slots) for e in engines) * steps / (time.perf_counter() - t0)


def _step_ms(engine: Engine | WireEngine, path: str, budget: int) -> float:
    """One engine step on ``path``: the milliseconds of its drafting (every request's draft), then the acceptance.
    Paths: "single" (one Draft per request), "batch" (``draft_batch``), "packed" (``draft_batch_packed``), "wire"
    (the bare load generator, ``WireEngine``)."""
    if isinstance(engine, WireEngine):
        t0 = time.perf_counter()
        answer = engine.step(budget)
        ms = (time.perf_counter() - t0) * 1e3
        engine.advance(answer)
        return ms
    items = engine.items()
    t0 = time.perf_counter()
    packed = None
    if path == "batch":
        trees = engine.client.draft_batch(items, budget)
    elif path == "packed":
        packed = engine.client.draft_batch_packed(items, budget)
    else:
        trees = [engine.client.draft(sid, accepted, budget) for sid, accepted in items]
    ms = (time.perf_counter() - t0) * 1e3
    if packed is not None:  # trees for the acceptance, outside the time
        trees = [packed.tree(k) for k in range(len(items))]
    engine.advance(trees)
    return ms


def _time_paths(engines: Sequence[tuple[str, Engine | WireEngine]], budget: int, steps: int) -> list[list[float]]:
    """Milliseconds per step of each (path, engine), ``steps`` of them after two to warm up. The engines step in
    turn, one step each (the first one first, then the second first, ...), so that the paths share whatever the
    service is doing meanwhile (rebuilds, stored requests) and compare like with like."""
    times: list[list[float]] = [[] for _ in engines]
    for i in range(steps + 2):
        for j in range(len(engines)):
            k = (i + j) % len(engines)
            path, engine = engines[k]
            ms = _step_ms(engine, path, budget)
            if i >= 2:
                times[k].append(ms)
    return times


def _sustain(stub: pb_grpc.DrafterStub, pool: list[Request], batch: int, budget: int, seconds: float) -> int:
    """Bare steps of ``batch`` sessions for ``seconds`` (whole blocks of 100), each block's median printed with the
    store's size; returns the requests of ``pool`` used."""
    engine = WireEngine(stub, pool, batch, offset=0)
    blocks: list[float] = []
    t_end = time.monotonic() + seconds
    print(f"sustained, B = {batch}, budget {budget}: ms per bare DraftBatch, median of each 100 steps", flush=True)
    while time.monotonic() < t_end and engine.next < len(pool):
        blocks.append(float(np.median(_time_paths([("wire", engine)], budget, 100)[0])))
        stats = stub.GetStats(pb.GetStatsRequest())
        print(f"  block {len(blocks)}: {blocks[-1]:.2f} ms ({batch / blocks[-1] * 1e3:,.0f} drafts/s); "
              f"{stats.stored_tokens:,} tokens stored, {stats.unindexed_tokens:,} not indexed yet", flush=True)
    engine.close()
    if engine.next >= len(pool):
        print(f"  (stopped early: the {len(pool):,} held-out requests are used up)")
    if blocks:
        mid = float(np.median(blocks))
        print(f"  median of the {len(blocks)} blocks: {mid:.2f} ms, {batch / mid * 1e3:,.0f} drafts/s", flush=True)
    return engine.next


def _core_block(drafter: Drafter, slots: list[list], budget: int, steps: int, pool: list[Request],
                next_request: int) -> tuple[list[float], int]:
    """``steps`` batched steps of the sessions in ``slots`` ([session, output, position, accepted]), each timed
    alone; greedy acceptance, a finished request stored and replaced by ``pool[next_request]`` (then the next)."""
    times = []
    limits, report = [budget] * len(slots), [False] * len(slots)
    for _ in range(steps):
        accepted = np.concatenate([slot[3] for slot in slots]).astype(np.int32)
        offsets = np.cumsum([0] + [len(slot[3]) for slot in slots]).tolist()
        t0 = time.perf_counter()
        out = drafter.draft_steps([slot[0] for slot in slots], accepted, offsets, limits, report)
        times.append((time.perf_counter() - t0) * 1e3)
        tokens, links = out.token_ids.tolist(), out.parents.tolist()
        for k, slot in enumerate(slots):
            sess, output, pos, _ = slot
            n = _greedy_accepted(tokens, links, out.offsets[k], out.offsets[k + 1], output, pos)
            slot[3] = np.asarray(output[pos:pos + n + 1], np.int32)
            slot[2] = pos + len(slot[3])
            if slot[2] >= len(output):
                drafter.finish(sess, slot[3], document=np.concatenate([sess.tokens, slot[3]]))
                req = pool[next_request % len(pool)]
                next_request += 1
                slots[k] = [drafter.start(f"core-{next_request}", req.prompt), req.output.tolist(), 0,
                            np.zeros(0, np.int32)]
    return times, next_request


def run_core_bench(args: argparse.Namespace, fill: list[Request], pool: list[Request], batches: list[int],
                   budget: int) -> int:
    """``--core``: the batched steps of a drafter in this process, filled as the service is, for the given time."""
    drafter = Drafter(DrafterConfig(vocab_size=49152, capacity=int(args.tokens * 1.3) + 1024))
    worker = IndexWorker()
    drafter.store.builder = worker.build_arrays
    stop = threading.Event()
    try:
        stored, i = 0, 0
        while stored < args.tokens:
            req = fill[i % len(fill)]
            i += 1
            drafter.ingest(req.prompt, req.output)
            stored += len(req.prompt) + len(req.output)
        while drafter.rebuild():
            pass
        print(f"stored {drafter.store.stats()['tokens']:,} tokens; this process's batched steps (no service), "
              f"budget {budget}, ms per step, median of each 100 steps", flush=True)

        def rebuild_every_second() -> None:  # the service's rebuild job
            while not stop.wait(1.0):
                while not stop.is_set() and drafter.rebuild():
                    pass

        threading.Thread(target=rebuild_every_second, name="rebuild", daemon=True).start()
        used = 0
        for b in batches:
            slots = []
            for _ in range(b):
                req = pool[used % len(pool)]
                used += 1
                slots.append([drafter.start(f"core-{used}", req.prompt), req.output.tolist(), 0,
                              np.zeros(0, np.int32)])
            blocks: list[float] = []
            t_end = time.monotonic() + args.core
            while time.monotonic() < t_end and used < len(pool):
                times, used = _core_block(drafter, slots, budget, 100, pool, used)
                blocks.append(float(np.median(times)))
                s = drafter.store.stats()
                print(f"  B = {b}, block {len(blocks)}: {blocks[-1]:.2f} ms ({b / blocks[-1] * 1e3:,.0f} drafts/s); "
                      f"{s['tokens']:,} tokens stored, {s['unindexed_tokens']:,} not indexed yet", flush=True)
            for sess, _, _, accepted in slots:
                drafter.finish(sess, accepted)
            if blocks:
                mid = float(np.median(blocks))
                print(f"  B = {b}: median of the {len(blocks)} blocks {mid:.2f} ms, {b / mid * 1e3:,.0f} drafts/s",
                      flush=True)
    finally:
        stop.set()
        worker.close()
    return 0


def run_batch_bench(args: argparse.Namespace) -> int:
    """Fill a service process, then time engine steps at each batch size and budget: one Draft per request, then
    the batched paths side by side (their engines stepping in turn)."""
    batches, budgets = args.batch or [1, 8, 32, 128, 256], args.budget or [16, 32]
    extra = SUSTAINED if args.sustain > 0 or args.core > 0 else 0
    requests = load_dataset("sharegpt", FILL + HELD + extra)
    fill, held, sustained = requests[:FILL], requests[FILL:FILL + HELD], requests[FILL + HELD:]
    if args.core > 0:
        return run_core_bench(args, fill, sustained, batches, budgets[0])
    with tempfile.TemporaryDirectory(prefix="drafter-bench-") as tmp:
        svc = ServiceProcess(Path(tmp) / "data", capacity=int(args.tokens * 1.3) + 1024)
        svc.start()
        try:
            with grpc.insecure_channel(svc.address) as channel:
                stub = pb_grpc.DrafterStub(channel)
                _fill(stub, fill, args.tokens)
                _wait_indexed(stub)
                stats = stub.GetStats(pb.GetStatsRequest())
            print(f"stored {stats.stored_tokens:,} tokens in {stats.stored_requests:,} requests; "
                  f"{args.steps} engine steps per row, medians; client reuse {'on' if args.reuse else 'off'}")
            wire = " DraftBatch, bare: ms/step | drafts/s |" if args.wire else ""
            many = f" {args.engines} bare engines: drafts/s |" if args.engines else ""
            print(f"| B | budget | per-request Draft: ms/step | DraftBatch: ms/step | speedup | DraftBatch drafts/s |"
                  f" DraftBatch packed: ms/step | drafts/s |{wire}{many}")
            print("|---|---|---|---|---|---|---|---|" + ("---|---|" if args.wire else "") +
                  ("---|" if args.engines else ""))
            with DrafterClient(svc.address, timeout=30.0, reuse=bool(args.reuse)) as client, \
                    grpc.insecure_channel(svc.address) as channel:
                stub = pb_grpc.DrafterStub(channel)
                cursor = 0  # every engine replays requests no earlier engine stored (else the repeat cache answers)
                for budget in budgets:
                    for b in batches:
                        alone = Engine(client, held, b, offset=cursor)  # by itself: its step takes B round trips
                        medians = [float(np.median(_time_paths([("single", alone)], budget, args.steps)[0]))]
                        alone.close()
                        paths = ("batch", "packed", "wire")[:3 if args.wire else 2]
                        engines: list[tuple[str, Engine | WireEngine]] = [
                            (path, WireEngine(stub, held, b, offset=alone.next + k, stride=len(paths))
                             if path == "wire" else Engine(client, held, b, offset=alone.next + k, stride=len(paths)))
                            for k, path in enumerate(paths)]
                        medians += [float(np.median(t)) for t in _time_paths(engines, budget, args.steps)]
                        for _, engine in engines:
                            engine.close()
                        if max(engine.next for _, engine in engines) > len(held) >= cursor:
                            print(f"(requests replayed from here on: the {len(held)} held-out ones are used up)")
                        cursor = max(engine.next for _, engine in engines)
                        rate = ""
                        if args.engines:
                            fleet = [WireEngine(stub, held, b, offset=cursor + k, stride=args.engines)
                                     for k in range(args.engines)]
                            rate = f" {_engines_rate(fleet, budget, args.steps):,.0f} |"
                            for engine in fleet:
                                engine.close()
                            cursor = max(engine.next for engine in fleet)
                        single, batch, packed = medians[:3]
                        bare = f" {medians[3]:.2f} | {b / medians[3] * 1e3:,.0f} |" if args.wire else ""
                        print(f"| {b} | {budget} | {single:.2f} | {batch:.2f} | {single / batch:.1f}× | "
                              f"{b / batch * 1e3:,.0f} | {packed:.2f} | {b / packed * 1e3:,.0f} |{bare}{rate}",
                              flush=True)
                if args.sustain > 0:
                    for b in batches:
                        used = _sustain(stub, sustained, b, budgets[0], args.sustain)
                        sustained = sustained[used:]
        finally:
            svc.stop()
    return 0

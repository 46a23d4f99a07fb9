"""``drafter bench batch``: what drafting costs an engine per step with B requests in flight, batched or not."""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import grpc
import numpy as np

from drafter_service.api.drafter.v1 import drafter_pb2 as pb
from drafter_service.api.drafter.v1 import drafter_pb2_grpc as pb_grpc
from drafter_service.api.tree import DraftTree, accept_greedy
from drafter_service.bench.serve_bench import ServiceProcess, _fill, _wait_indexed
from drafter_service.datasets.loaders import Request, load_dataset
from engine_client import DrafterClient


def add_batch_bench(bench: argparse._SubParsersAction) -> None:
    """Register ``bench batch``."""
    bp = bench.add_parser("batch", help="drafting cost per engine step with B requests in flight: one DraftBatch "
                          "call per step against one Draft per request, on a real service process")
    bp.add_argument("--tokens", type=int, default=10_000_000, help="tokens stored before measuring")
    bp.add_argument("--batch", type=int, action="append", help="requests in flight (repeatable; default 1, 8, "
                    "32, 128, 256)")
    bp.add_argument("--budget", type=int, action="append", help="tree budget (repeatable; default 16 and 32)")
    bp.add_argument("--steps", type=int, default=30, help="engine steps timed per configuration and path")
    bp.add_argument("--reuse", type=int, default=0, help="1: let the client reuse subtrees (fewer round trips)")
    bp.set_defaults(func=run_batch_bench)


FILL = 2000
"""ShareGPT requests stored (cycled) until the service holds ``--tokens``."""
HELD = 4000
"""Held-out requests the engines replay, each once while they last (enough for the default rows)."""


class Engine:
    """B requests in flight, each replaying a held-out request's output with greedy acceptance."""

    def __init__(self, client: DrafterClient, pool: list[Request], batch: int, offset: int) -> None:
        self.client, self.pool, self.next = client, pool, offset
        self.slots = [self._open() for _ in range(batch)]

    def _open(self) -> list:
        req = self.pool[self.next % len(self.pool)]
        self.next += 1
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


def _time_steps(engine: Engine, batched: bool, budget: int, steps: int) -> list[float]:
    """Milliseconds of drafting per engine step (every request's draft), ``steps`` of them after two to warm up."""
    times = []
    for i in range(steps + 2):
        items = engine.items()
        t0 = time.perf_counter()
        if batched:
            trees = engine.client.draft_batch(items, budget)
        else:
            trees = [engine.client.draft(sid, accepted, budget) for sid, accepted in items]
        if i >= 2:
            times.append((time.perf_counter() - t0) * 1e3)
        engine.advance(trees)
    return times


def run_batch_bench(args: argparse.Namespace) -> int:
    """Fill a service process, then time engine steps at each batch size and budget, both paths side by side."""
    batches, budgets = args.batch or [1, 8, 32, 128, 256], args.budget or [16, 32]
    requests = load_dataset("sharegpt", FILL + HELD)
    held, fill = requests[-HELD:], requests[:-HELD]
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
            print("| B | budget | per-request Draft: ms/step | DraftBatch: ms/step | speedup | DraftBatch drafts/s |")
            print("|---|---|---|---|---|---|")
            with DrafterClient(svc.address, timeout=30.0, reuse=bool(args.reuse)) as client:
                cursor = 0  # every engine replays requests no earlier engine stored (else the repeat cache answers)
                for budget in budgets:
                    for b in batches:
                        medians = []
                        for batched in (False, True):
                            engine = Engine(client, held, b, offset=cursor)
                            medians.append(float(np.median(_time_steps(engine, batched, budget, args.steps))))
                            engine.close()
                            if engine.next > len(held) >= cursor:
                                print(f"(requests replayed from here on: the {len(held)} held-out ones are used up)")
                            cursor = engine.next
                        single, batch = medians
                        print(f"| {b} | {budget} | {single:.2f} | {batch:.2f} | {single / batch:.1f}× | "
                              f"{b / batch * 1e3:,.0f} |", flush=True)
        finally:
            svc.stop()
    return 0

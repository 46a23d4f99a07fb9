"""``drafter bench proposer``: drafter's vLLM proposer against vLLM's ``suffix`` and ``ngram`` on the same rows.

Each method replays the same held-back requests with B requests running, stepped as vLLM 0.32's model runner steps
them (``proposer_replay``), with vLLM's own proposers and ``InputBatch`` in a worker in vLLM's venv
(``proposer_worker``). drafter talks to a real ``drafter serve`` process started fresh for each run; it and suffix's
cache are warmed with the same earlier requests of the workload. Between two ``propose`` calls the engine's forward
pass is a sleep, during which drafter's asynchronous answers land as they would on a GPU.
"""

from __future__ import annotations

import argparse
import json
import queue
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any, TextIO

import grpc

from drafter_service.api.drafter.v1 import drafter_pb2 as pb
from drafter_service.api.drafter.v1 import drafter_pb2_grpc as pb_grpc
from drafter_service.bench.machine import machine
from drafter_service.bench.serve_bench import ServiceProcess, _wait_indexed
from drafter_service.bench.vllm_engine import RESULT
from drafter_service.bench.vllm_process import vllm_python
from drafter_service.datasets.loaders import DATASET_NAMES, Request, load_dataset, write_requests

__all__ = ["METHODS", "ProposerWorker", "add_proposer_bench", "format_results", "run_proposer_bench"]

METHODS = ("drafter", "drafter-sync", "suffix", "ngram")
DEFAULT_BATCHES = (1, 16, 64, 256)

#: Proposer settings of the drafter methods: with pre-speculation (as shipped) and synchronous (every step waits
#: for its DraftBatch answer).
DRAFTER_ENV = {"drafter": {"DRAFTER_PRESPECULATE": "1"}, "drafter-sync": {"DRAFTER_PRESPECULATE": "0"}}


def add_proposer_bench(bench: argparse._SubParsersAction) -> None:
    """Register ``bench proposer``."""
    p = bench.add_parser("proposer", help="time inside propose and tokens per step of drafter's vLLM proposer "
                         "(with pre-speculation and synchronous), vLLM's suffix and ngram, driven as vLLM's model "
                         "runner drives them on the same held-back requests")
    p.add_argument("--dataset", default="sharegpt", choices=DATASET_NAMES, help="workload (default sharegpt)")
    p.add_argument("--batch", type=int, action="append", help="requests running at once (repeatable; default "
                   f"{', '.join(map(str, DEFAULT_BATCHES))})")
    p.add_argument("--k", type=int, default=8, help="speculative tokens per step")
    p.add_argument("--warm", type=int, default=1000, help="earlier requests of the workload that warm drafter's "
                   "service and suffix's cache (never replayed)")
    p.add_argument("--requests", type=int, default=1000, help="held-back requests after the warm ones; each run "
                   "replays them in order, each once")
    p.add_argument("--steps", type=int, default=200, help="engine steps timed per method and B")
    p.add_argument("--warmup-steps", type=int, default=5, help="engine steps run before the timed ones")
    p.add_argument("--step-ms", type=float, default=20.0, help="the engine's forward pass between two propose calls "
                   "(a GPU decode step), simulated by sleeping")
    p.add_argument("--methods", default=",".join(METHODS), help=f"comma-separated among {', '.join(METHODS)}")
    p.add_argument("--cost-aware", action="store_true", help="let drafter cut its chains by the measured step cost "
                   "(off by default so that acceptance compares)")
    p.add_argument("--drafter-timeout", type=float, help="DRAFTER_TIMEOUT of the drafter methods: seconds a step "
                   "may wait for the service (default: the proposer's own)")
    p.add_argument("--json", help="also write the results as JSON to this file")
    p.add_argument("--worker-log", help="append the worker's own output (vLLM's logging) to this file")
    p.set_defaults(func=run_proposer_bench)


class ProposerWorker:
    """``proposer_worker`` in vLLM's venv, driven over stdin/stdout."""

    def __init__(self, requests_file: Path, warm: int, max_model_len: int, log: TextIO | None = None,
                 start_timeout: float = 900.0) -> None:
        exe = vllm_python()
        if not exe.exists():
            raise SystemExit(f"{exe} not found: run `make vllm` (and `make vllm-peers` for suffix)")
        cmd = [str(exe), "-m", "drafter_service.bench.proposer_worker", "--requests", str(requests_file),
               "--warm", str(warm), "--max-model-len", str(max_model_len)]
        self.log = log
        self.proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                     text=True, bufsize=1)
        self._answers: queue.Queue[dict[str, Any] | None] = queue.Queue()
        self._tail: list[str] = []
        threading.Thread(target=self._read, daemon=True).start()
        self.ready = self._next(start_timeout)

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            if line.startswith(RESULT):
                self._answers.put(json.loads(line[len(RESULT):]))
                continue
            self._tail = [*self._tail[-40:], line]
            if self.log is not None:
                self.log.write(line)
        self._answers.put(None)

    def _next(self, timeout: float) -> dict[str, Any]:
        try:
            answer = self._answers.get(timeout=timeout)
        except queue.Empty:
            self.close()
            raise TimeoutError(f"the proposer worker gave no answer within {timeout:.0f} s") from None
        if answer is None:
            raise RuntimeError(f"the proposer worker exited with {self.proc.wait()}:\n{''.join(self._tail)}")
        return answer

    def run(self, command: dict[str, Any], timeout: float = 3600.0) -> dict[str, Any]:
        """One ``run`` command's answer (``{"error": ...}`` when the run failed)."""
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps({"op": "run", **command}) + "\n")
        self.proc.stdin.flush()
        return self._next(timeout)

    def close(self, timeout: float = 30.0) -> None:
        if self.proc.poll() is None:
            try:
                assert self.proc.stdin is not None
                self.proc.stdin.write(json.dumps({"op": "quit"}) + "\n")
                self.proc.stdin.close()
                self.proc.wait(timeout)
            except (OSError, subprocess.TimeoutExpired):
                self.proc.kill()
                self.proc.wait()


def warm_service(address: str, warm: Sequence[Request], chunk: int = 100, wait_indexed: bool = True) -> None:
    """Ingest the warm requests into a service and (``wait_indexed``) wait until its index holds them."""
    with grpc.insecure_channel(address) as channel:
        stub = pb_grpc.DrafterStub(channel)
        for i in range(0, len(warm), chunk):
            seqs = [pb.Sequence(prompt=r.prompt.tolist(), output=r.output.tolist(), request_id=r.request_id)
                    for r in warm[i:i + chunk]]
            stub.Ingest(pb.IngestRequest(requests=seqs), timeout=300)
        if wait_indexed:
            _wait_indexed(stub)


def _progress(line: str) -> None:
    print(f"bench proposer: {line}", file=sys.stderr, flush=True)


def _methods(spec: str) -> list[str]:
    methods = [m.strip() for m in spec.split(",") if m.strip()]
    unknown = [m for m in methods if m not in METHODS]
    if unknown or not methods:
        raise SystemExit(f"unknown methods {unknown}: choose among {', '.join(METHODS)}")
    return methods


def _workload(args: argparse.Namespace) -> tuple[list[Request], list[Request]]:
    """The warm requests and the held-back ones that follow them."""
    if args.warm < 0 or args.requests < 1:
        raise SystemExit("--warm must be >= 0 and --requests >= 1")
    reqs = load_dataset(args.dataset, args.warm + args.requests)
    if len(reqs) <= args.warm:
        raise SystemExit(f"{args.dataset} has {len(reqs)} requests: fewer than --warm {args.warm} plus one held back")
    return reqs[:args.warm], reqs[args.warm:]


def run_one(worker: ProposerWorker, method: str, batch: int, args: argparse.Namespace, warm: Sequence[Request],
            workdir: Path) -> dict[str, Any] | None:
    """One method at one B; drafter's methods on a fresh service warmed with ``warm``. None when it failed."""
    command: dict[str, Any] = {"method": method, "batch": batch, "k": args.k, "steps": args.steps,
                               "warmup": args.warmup_steps, "step_ms": args.step_ms, "env": {}}
    service = None
    if method in DRAFTER_ENV:
        tokens = sum(r.prompt.size + r.output.size for r in warm)
        service = ServiceProcess(workdir / f"service-{method}-{batch}", max(1 << 22, 4 * tokens))
        try:
            service.start()
        except (RuntimeError, TimeoutError) as exc:
            _progress(f"{method} B={batch} left out: the service did not start: {exc}")
            return None
        command["env"] = {"DRAFTER_ADDRESS": service.address, "DRAFTER_COST_AWARE": "1" if args.cost_aware else "0",
                          **DRAFTER_ENV[method]}
        if args.drafter_timeout is not None:
            command["env"]["DRAFTER_TIMEOUT"] = str(args.drafter_timeout)
    try:
        if service is not None:
            warm_service(service.address, warm)
        t0 = time.perf_counter()
        result = worker.run(command)
    finally:
        if service is not None:
            service.stop()
    if "error" in result:
        _progress(f"{method} B={batch} failed, left out: {result['error']}")
        return None
    _progress(f"{method} B={batch}: p50 {result['p50_ms']:.2f} ms, {result['tokens_per_step']:.3f} tokens/step "
              f"({time.perf_counter() - t0:.0f} s)")
    return result


def _ratio(value: float, base: float | None) -> str:
    return f"{value / base:.2f}×" if base else "-"


def format_results(results: Sequence[dict[str, Any]], header: str) -> str:
    """A markdown table, one row per method and B, each compared with suffix (time inside ``propose`` and tokens
    per step) and, for drafter, with the synchronous run (tokens per step)."""
    by = {(r["method"], r["batch"]): r for r in results}
    lines = [header, "", "| B | method | steps | propose p50 ms | p50 vs suffix | p99 ms | mean ms | tokens/step | "
             "vs suffix | vs drafter-sync | drafted rows | pre-spec hit rate | by prompt lookup | sync waits/step | "
             "sender CPU ms/step |", "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in results:
        tps = r["tokens_per_step"]
        suffix, sync = by.get(("suffix", r["batch"])), by.get(("drafter-sync", r["batch"]))
        other = suffix is not None and r["method"] != "suffix"
        vs_suffix = _ratio(tps, suffix["tokens_per_step"]) if suffix and other else "-"
        p50_vs = _ratio(r["p50_ms"], suffix["p50_ms"]) if suffix and other else "-"
        vs_sync = _ratio(tps, sync["tokens_per_step"]) if sync and r["method"] == "drafter" else "-"
        figures = r.get("figures")
        hit = sync_waits = looked_up = sender = "-"
        if figures is not None:
            tried = figures.get("prespec_hits", 0) + figures.get("prespec_misses", 0)
            hit = f"{figures.get('prespec_hits', 0) / tried:.1%}" if tried else "-"
            looked_up = f"{figures.get('looked_up', 0) / tried:.1%}" if tried else "-"
            steps = figures.get("steps", 0)
            sync_waits = f"{figures.get('sync_waits', 0) / steps:.2f}" if steps else "-"
            sender = f"{figures.get('sender_cpu_ms', 0) / steps:.3f}" if steps and r["method"] != "suffix" else "-"
        drafted = f"{r['drafted'] / r['rows']:.1%}" if r["rows"] else "-"
        mark = " (requests ran out)" if r.get("exhausted") else ""
        lines.append(f"| {r['batch']} | {r['method']} | {r['steps']}{mark} | {r['p50_ms']:.3f} | {p50_vs} | "
                     f"{r['p99_ms']:.3f} | {r['mean_ms']:.3f} | {tps:.3f} | {vs_suffix} | {vs_sync} | {drafted} | "
                     f"{hit} | {looked_up} | {sync_waits} | {sender} |")
    return "\n".join(lines)


def run_proposer_bench(args: argparse.Namespace) -> int:
    """Every method at every B on the same held-back requests; print the table (and write JSON)."""
    methods = _methods(args.methods)
    batches = args.batch or list(DEFAULT_BATCHES)
    if any(b < 1 for b in batches) or args.k < 1 or args.steps < 1 or args.warmup_steps < 0 or args.step_ms < 0:
        raise SystemExit("--batch, --k and --steps must be >= 1, --warmup-steps and --step-ms >= 0")
    if args.drafter_timeout is not None and args.drafter_timeout <= 0:
        raise SystemExit("--drafter-timeout must be > 0")
    warm, held = _workload(args)
    max_model_len = max(r.prompt.size + r.output.size for r in [*warm, *held]) + args.k + 1
    max_model_len = -(-max_model_len // 16) * 16
    header = (f"{args.dataset}: {len(warm)} warm requests, {len(held)} held back; k={args.k}; {args.steps} timed "
              f"steps after {args.warmup_steps}; forward pass {args.step_ms:g} ms; drafter's cost-aware cut "
              f"{'on' if args.cost_aware else 'off'}"
              f"{f'; DRAFTER_TIMEOUT={args.drafter_timeout:g}' if args.drafter_timeout is not None else ''}; "
              f"machine: {machine()}")
    log = open(args.worker_log, "a") if args.worker_log else None  # noqa: SIM115 (closed below)
    results: list[dict[str, Any]] = []
    try:
        with tempfile.TemporaryDirectory(prefix="drafter-bench-proposer-") as tmp:
            workdir = Path(tmp)
            write_requests(workdir / "requests.jsonl", [*warm, *held])
            _progress(f"starting the worker in {vllm_python()} (importing vLLM takes a while)")
            worker = ProposerWorker(workdir / "requests.jsonl", len(warm), max_model_len, log)
            try:
                for batch in batches:
                    for method in methods:
                        result = run_one(worker, method, batch, args, warm, workdir)
                        if result is not None:
                            results.append(result)
            finally:
                worker.close()
    finally:
        if log is not None:
            log.close()
    print(format_results(results, header))
    if args.json:
        Path(args.json).write_text(json.dumps({"machine": machine(), "header": header, "args": {
            k: v for k, v in vars(args).items() if k != "func"}, "runs": results}, indent=1))
    return 0

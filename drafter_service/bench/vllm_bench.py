"""``drafter bench vllm``: vLLM without speculation, with its ``ngram`` and ``suffix`` speculators, and with drafter.

Each method gets its own vLLM engine (in vLLM's venv, see ``make vllm``) and the same treatment per workload: the
workload's earlier prompts are generated first (unmeasured: drafter stores them, suffix decoding caches them),
then the held-back prompts are generated in one batch and measured from vLLM's own counters. With ``--replicas N``
each method runs N engines at once that take alternate prompts (``vllm_replicas``): suffix's engines each keep their
own cache, drafter's proposers all point at one service; the counters are summed over the engines.
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TextIO

from drafter_service.bench.e2e import DEFAULT_DRAFT, draft_folder_of
from drafter_service.bench.e2e_prompts import E2E_DATASETS, MULTITURN_SETS, load_prompts
from drafter_service.bench.machine import machine
from drafter_service.bench.serve_bench import ServiceProcess
from drafter_service.bench.vllm_process import Generation, vllm_python, wait_for
from drafter_service.bench.vllm_replicas import EngineGroup, sum_figures
from drafter_service.datasets.target_model import smollm2_checkpoint
from engine_client import DrafterClient

METHODS = ("none", "ngram", "suffix", "drafter", "drafter-sync", "drafter-fixed", "drafter-card", "drafter-card-fixed")
DEFAULT_METHODS = ("none", "ngram", "suffix", "drafter", "drafter-sync")

#: Proposer settings of each drafter method: ``drafter`` as shipped (pre-speculation, chains cut by the engine's
#: measured step costs), ``drafter-sync`` without pre-speculation (every step waits for its DraftBatch answer,
#: DRAFTER_PRESPECULATE=0), ``drafter-fixed`` with the fixed minimum estimate instead of step costs
#: (DRAFTER_COST_AWARE=0).
DRAFTER_ENV = {"drafter": {}, "drafter-sync": {"DRAFTER_PRESPECULATE": "0"},
               "drafter-fixed": {"DRAFTER_COST_AWARE": "0"}, "drafter-card": {},
               "drafter-card-fixed": {"DRAFTER_COST_AWARE": "0"}}
#: Methods whose service has the draft model (``--draft-model``), with the flags each adds to the service's defaults:
#: ``drafter-card`` as shipped; ``drafter-card-fixed`` compares acceptance alone (the proposer's cost cut off, the
#: model at normal priority and its nodes served while they raise acceptance, whatever they cost).
CARD_METHODS = {"drafter-card": (), "drafter-card-fixed": ("--card-gate", "acceptance", "--card-idle", "0")}


def add_vllm_bench(bench: argparse._SubParsersAction) -> None:
    """Register ``bench vllm``."""
    p = bench.add_parser("vllm", help="acceptance and speed inside vLLM: no speculation, ngram, suffix and drafter "
                         "(drafter-sync: without pre-speculation; drafter-fixed: its chains cut by a fixed minimum "
                         "estimate, not by step costs) on the same held-back prompts after the same warm-up")
    p.add_argument("--dataset", action="append", choices=E2E_DATASETS,
                   help="workload (repeatable; default gsm8k, humaneval and sharegpt)")
    p.add_argument("--warm", type=int, default=24, help="earlier prompts of each workload generated first")
    p.add_argument("--requests", type=int, default=16, help="held-back prompts measured per workload (one batch)")
    p.add_argument("--max-tokens", type=int, default=192, help="tokens generated per prompt")
    p.add_argument("--k", type=int, default=4, help="speculative tokens per step (every method)")
    p.add_argument("--methods", default=",".join(DEFAULT_METHODS), help=f"comma-separated among {', '.join(METHODS)}")
    p.add_argument("--replicas", type=int, default=1, help="vLLM engines per method, run at once, prompt i to engine "
                   "i mod N (warm-up and held-back alike); drafter's engines share one service, suffix's keep a "
                   "cache each; counters summed over the engines")
    p.add_argument("--json", help="also write the results as JSON to this file")
    p.add_argument("--engine-log", help="append the engines' own output to this file (default: discarded)")
    p.add_argument("--draft-model", default="", help="draft model folder of the drafter-card methods (default: "
                   f"<cache>/{DEFAULT_DRAFT})")
    p.add_argument("--card-args", default="", help="more `drafter serve` flags for the drafter-card methods' "
                   "service, e.g. '--card-gate acceptance --card-idle 0' (default: the service's defaults)")
    p.set_defaults(func=run_vllm_bench)


@dataclass
class MethodRun:
    """One method on one workload's held-back prompts."""

    method: str
    dataset: str
    generated: int
    drafts: int
    draft_tokens: int
    accepted: int
    seconds: float
    identical: bool | None  # outputs equal vLLM's without speculation (None: `none` not run)
    proposer_ms: float | None  # drafter's time inside propose per engine step
    outputs: list[list[int]] = field(default_factory=list, repr=False)
    prespec_hit_rate: float | None = None  # drafter: rows drafted from the pre-speculated tree / rows with a context
    sync_waits: float | None = None  # drafter: share of the engine steps that waited for the service
    replicas: int = 1  # engines that shared the prompts (round robin)

    @property
    def tokens_per_step(self) -> float:
        """Tokens per verification step over all steps: generated / (generated - accepted)."""
        return self.generated / max(1, self.generated - self.accepted)

    @property
    def tokens_per_s(self) -> float:
        return self.generated / self.seconds if self.seconds else 0.0


def _delta(after: Generation, before: Generation, name: str) -> int:
    return round(after.counters[name] - before.counters[name])


def _proposer_figures(paths: list[Path]) -> dict[str, float]:
    """The proposers' stats files (one per engine) summed; a file not written yet counts as empty."""
    figures = []
    for path in paths:
        try:
            figures.append(dict(json.loads(path.read_text())))
        except (OSError, ValueError):
            pass
    return sum_figures(figures)


def run_method(method: str, args: argparse.Namespace, model: str, prompts: dict[str, tuple[list, list]],
               reference: dict[str, list[list[int]]] | None, workdir: Path, log: TextIO | None) -> list[MethodRun]:
    """Warm and measure one method on every workload, with ``args.replicas`` engines (and, for drafter, one fresh
    service they all use)."""
    service = None
    env: dict[str, str] = {}
    replicas = int(getattr(args, "replicas", 1))
    stats_files = [workdir / f"{method}.{i}.proposer.json" for i in range(replicas)]
    if method in DRAFTER_ENV:
        extra = ["--draft-model", str(draft_folder_of(args)), *CARD_METHODS[method], *shlex.split(args.card_args)] if (
            method in CARD_METHODS) else []
        service = ServiceProcess(workdir / f"service-{method}", 1 << 24, extra)
        service.start()
        env = {"DRAFTER_ADDRESS": service.address, **DRAFTER_ENV[method]}
    runs: list[MethodRun] = []
    try:
        engine_method = "drafter" if method in DRAFTER_ENV else method
        own_env = [{"DRAFTER_PROPOSER_STATS": str(f)} for f in stats_files] if service is not None else None
        with EngineGroup(model, engine_method, args.k, replicas, env, own_env, log) as engine:
            _progress(f"{method}: {replicas} engine(s) ready in {engine.startup_seconds:.0f} s")
            for dataset, (warm, held) in prompts.items():
                t0 = time.perf_counter()
                stored = _stored(service.address) if service is not None else 0
                warmed = engine.generate(warm, args.max_tokens)
                if service is not None:  # the engines end (store) their finished requests within a fraction of a second
                    expected = stored + len(warm)
                    wait_for(lambda s=service, n=expected: _stored(s.address) >= n, 60, "warm requests stored")
                before = _proposer_figures(stats_files)
                measured = engine.generate(held, args.max_tokens)
                if service is not None:
                    time.sleep(0.5)  # the proposer rewrites its figures every 0.2 s
                after = _proposer_figures(stats_files)
                steps = after.get("steps", 0) - before.get("steps", 0)
                proposer_ms = (1e3 * (after.get("seconds", 0.0) - before.get("seconds", 0.0)) / steps
                               if steps else None)
                hits, misses, waits = (after.get(name, 0) - before.get(name, 0)
                                       for name in ("prespec_hits", "prespec_misses", "sync_waits"))
                run = MethodRun(method, dataset, _delta(measured, warmed, "vllm:generation_tokens"),
                                _delta(measured, warmed, "vllm:spec_decode_num_drafts"),
                                _delta(measured, warmed, "vllm:spec_decode_num_draft_tokens"),
                                _delta(measured, warmed, "vllm:spec_decode_num_accepted_tokens"), measured.seconds,
                                _same(method, measured.outputs, reference, dataset), proposer_ms,
                                measured.outputs, hits / (hits + misses) if hits + misses else None,
                                waits / steps if service is not None and steps else None, replicas)
                runs.append(run)
                _progress(f"{method} on {dataset}: {run.tokens_per_step:.2f} tokens/step, {run.tokens_per_s:.1f} "
                          f"tokens/s ({time.perf_counter() - t0:.0f} s with the warm-up)")
                if service is not None and method in CARD_METHODS:
                    with DrafterClient(service.address) as client:
                        s = client.stats()
                    _progress(f"{method}: draft model gate {s.get('draft_model_verdict')}, "
                              f"{s.get('draft_model_ratio', 0.0):.2f}x estimated, nodes "
                              f"{'served' if s.get('draft_model_served') else 'not served'}; model steps "
                              f"{s.get('draft_model_steps', 0)}, hits {s.get('draft_model_hits', 0)}")
    finally:
        if service is not None:
            service.stop()
    return runs


def _same(method: str, outputs: list[list[int]], reference: dict[str, list[list[int]]] | None,
          dataset: str) -> bool | None:
    """Whether ``outputs`` equal the ``none`` method's on ``dataset`` prompt by prompt (``none`` itself: yes; None
    when ``none`` was not run, so there is nothing to compare with)."""
    if method == "none":
        return True
    return None if reference is None else outputs == reference[dataset]


def _progress(line: str) -> None:
    print(f"bench vllm: {line}", file=sys.stderr, flush=True)


def _stored(address: str) -> int:
    with DrafterClient(address) as client:
        return int(client.stats()["stored_requests"])


def format_runs(runs: list[MethodRun], args: argparse.Namespace) -> str:
    """A markdown table per workload, with each method's tokens per step against suffix and ngram."""
    replicas = int(getattr(args, "replicas", 1))
    dealt = f" dealt round robin to {replicas} engines at once" if replicas > 1 else ""
    lines = [f"k={args.k}, {args.requests} held-back prompts per workload in one batch after {args.warm} warm-up "
             f"prompts{dealt}, {args.max_tokens} tokens each; machine: {machine()}", ""]
    for dataset in dict.fromkeys(r.dataset for r in runs):
        rows = [r for r in runs if r.dataset == dataset]
        by = {r.method: r for r in rows}
        lines += [f"**{dataset}**", "",
                  "| method | replicas | drafts | draft tokens | accepted | tokens/step | vs suffix | vs ngram | "
                  "tokens/s | proposer ms/step | pre-spec hit rate | sync waits/step | same output |",
                  "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
        for r in rows:
            vs = [f"{r.tokens_per_step / by[m].tokens_per_step:.2f}x" if m in by else "-" for m in ("suffix", "ngram")]
            ms = f"{r.proposer_ms:.2f}" if r.proposer_ms is not None else "-"
            hit = f"{r.prespec_hit_rate:.1%}" if r.prespec_hit_rate is not None else "-"
            waits = f"{r.sync_waits:.2f}" if r.sync_waits is not None else "-"
            same = "-" if r.identical is None else "yes" if r.identical else "NO"
            lines.append(f"| {r.method} | {r.replicas} | {r.drafts} | {r.draft_tokens} | {r.accepted} | "
                         f"{r.tokens_per_step:.3f} | {vs[0]} | {vs[1]} | {r.tokens_per_s:.1f} | {ms} | {hit} | "
                         f"{waits} | {same} |")
        lines.append("")
    return "\n".join(lines)


def run_vllm_bench(args: argparse.Namespace) -> int:
    methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    unknown = [m for m in methods if m not in METHODS]
    if unknown or not methods:
        raise SystemExit(f"unknown methods {unknown}: choose among {', '.join(METHODS)}")
    if args.replicas < 1:
        raise SystemExit(f"--replicas must be at least 1, got {args.replicas}")
    if not vllm_python().exists():
        raise SystemExit(f"{vllm_python()} not found: run `make vllm` (and `make vllm-peers` for suffix)")
    if "none" in methods:  # the reference runs first
        methods = ["none"] + [m for m in methods if m != "none"]
    model = str(smollm2_checkpoint())
    prompts = {d: ([p.token_ids.tolist() for p in load_prompts(d, args.warm)],
                   [p.token_ids.tolist() for p in load_prompts(d, args.requests, skip=args.warm)])
               for d in args.dataset or [d for d in E2E_DATASETS if d != "random" and d not in MULTITURN_SETS]}
    log = open(args.engine_log, "a") if args.engine_log else None  # noqa: SIM115 (closed below)
    runs: list[MethodRun] = []
    reference: dict[str, list[list[int]]] | None = None
    try:
        with tempfile.TemporaryDirectory(prefix="drafter-bench-vllm-") as tmp:
            for method in methods:
                method_runs = run_method(method, args, model, prompts, reference, Path(tmp), log)
                if method == "none":
                    reference = {r.dataset: r.outputs for r in method_runs}
                runs += method_runs
    finally:
        if log is not None:
            log.close()
    print(format_runs(runs, args))
    if args.json:
        rows = [{**{k: v for k, v in vars(r).items() if k != "outputs"}, "tokens_per_step": r.tokens_per_step,
                 "tokens_per_s": r.tokens_per_s} for r in runs]
        Path(args.json).write_text(json.dumps({"machine": machine(), "runs": rows}, indent=1))
    return 0

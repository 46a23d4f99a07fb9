"""`drafter bench e2e`: real generation with SmolLM2-135M-Instruct, plain and with drafter, beside transformers."""

from __future__ import annotations

import argparse
import json
import logging
import os
import statistics
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
from tqdm import tqdm

from drafter_service.bench.doc_blocks import DocBlockError, add_doc_flag, parse_targets, write_doc_blocks
from drafter_service.bench.e2e_prompts import E2E_DATASETS, Prompt, load_prompts
from drafter_service.bench.machine import machine
from drafter_service.bench.serve_bench import ServiceProcess
from drafter_service.core.config import GATES
from drafter_service.datasets.cache import atomic_output, cache_dir
from drafter_service.datasets.tokenizer import load_smollm2_tokenizer

if TYPE_CHECKING:
    from transformers import PreTrainedModel

    from engine_client.client import DrafterClient

logger = logging.getLogger(__name__)

#: SmolLM2's end of turn (``<|im_end|>``): generation stops after it.
EOS = 2

#: Methods in the order they run for each prompt (interleaved, so machine noise hits all alike).
METHODS = ("greedy", "drafter", "drafter-repeat", "card", "card-nocorr", "card-only", "hf", "hf-pld", "hf-assist")

#: Methods drafted by a service of their own, with the flags that service runs with.
SERVICE_METHODS = {"drafter": (), "card": ("card",), "card-nocorr": ("card", "--card-correction", "0"),
                   "card-only": ("card", "--sources", "none")}

#: Methods that need the draft model.
MODEL_METHODS = ("card", "card-nocorr", "card-only", "hf-assist")

#: Where ``drafter distill-draft`` puts the draft model the benchmark uses by default.
DEFAULT_DRAFT = "drafts/smollm2-4l"

DEFAULT_METHODS = ("greedy", "drafter", "hf", "hf-pld")


def add_e2e_bench(bench: argparse._SubParsersAction) -> None:
    """Register ``drafter bench e2e``."""
    p = bench.add_parser("e2e", help="end-to-end generation speed with SmolLM2-135M-Instruct")
    p.add_argument("--dataset", action="append", choices=E2E_DATASETS, help="workload (repeatable; default gsm8k)")
    p.add_argument("--warm", type=int, default=40, help="earlier requests of the workload that warm the service")
    p.add_argument("--requests", type=int, default=12, help="measured requests per workload")
    p.add_argument("--engine-warm", type=int, default=2,
                   help="last warm requests each adaptive engine generates, untimed, before measuring: its verify "
                   "budget then starts from what it learned, as in an engine that has been serving")
    p.add_argument("--max-new-tokens", type=int, default=192)
    p.add_argument("--max-nodes", type=int, default=64, help="most draft nodes verified per step")
    p.add_argument("--fixed-budget", action="store_true",
                   help="always verify --max-nodes nodes (default: the prefix with the best expected tokens/s)")
    p.add_argument("--fixed-budgets", default="",
                   help="also run drafter at each of these fixed budgets (comma-separated node counts, e.g. "
                   "0,1,2,4,8,16,32,64), each with a service of its own, as methods fixed-N")
    p.add_argument("--show", action="store_true", help="print each measured answer as drafter generated it")
    p.add_argument("--dtype", choices=("auto", "bfloat16", "float32"), default="auto",
                   help="auto: whichever decodes a plain step faster on this machine")
    p.add_argument("--threads", type=int, default=2, help="torch threads")
    p.add_argument("--methods", default=",".join(DEFAULT_METHODS),
                   help=f"comma-separated subset of {','.join(METHODS)} (card*: drafter with the draft model, "
                   "with CARD's correction, without it, and without model-free sources; hf-assist: transformers' "
                   "assisted generation with the same draft model; drafter-repeat: the same prompt again on "
                   "drafter's service right after drafter, a repeated request)")
    p.add_argument("--draft-model", default="", help=f"draft model folder (default: <cache>/{DEFAULT_DRAFT})")
    p.add_argument("--draft-threads", type=int, help="torch threads of the service's draft model (default: the "
                   "service's choice for the machine)")
    p.add_argument("--card-width", type=int, help="K of the draft model's cache (default: the service's)")
    p.add_argument("--card-top-k", type=int, help="k of the draft model's cache (default: the service's)")
    p.add_argument("--card-layers", type=int, help="layers grown ahead of the verified prefix (default: the "
                   "service's)")
    p.add_argument("--card-vocab", type=int, help="draft over this many of the most frequent tokens (default: the "
                   "service's choice for the device)")
    p.add_argument("--card-nice", type=int, help="CPU niceness of the service's draft model threads")
    p.add_argument("--card-idle", type=int, choices=(-1, 0, 1), help="SCHED_IDLE for the draft model's threads "
                   "(default: the service's choice for the machine)")
    p.add_argument("--card-gate", choices=GATES, help="when the draft model's nodes are served (default: the "
                   "service's)")
    p.add_argument("--engine-cpus", default="", help="CPUs the engine runs on, e.g. 0 or 0-3 (default: all)")
    p.add_argument("--service-cpus", default="", help="CPUs the services run on, e.g. 1 or 4-7 (default: all); "
                   "with --engine-cpus, disjoint sets give the draft model compute of its own")
    p.add_argument("--address", default="", help="use this running service instead of starting one")
    p.add_argument("--json", default="", help="also write the per-request results here")
    add_doc_flag(p)
    p.set_defaults(func=run_e2e_bench)


@dataclass
class Run:
    """One method on one prompt."""

    method: str
    prompt_id: str
    tokens: list[int]
    seconds: float
    steps: int = 0
    draft_seconds: float = 0.0  # time spent asking for drafts (client side)

    @property
    def tokens_per_s(self) -> float:
        return len(self.tokens) / self.seconds if self.seconds else 0.0


@dataclass
class WorkloadResult:
    """Every run of one workload, plus the client's reuse figures."""

    dataset: str
    runs: list[Run] = field(default_factory=list)
    reuse: dict[str, float] = field(default_factory=dict)
    cache_hits: dict[str, float] = field(default_factory=dict)  # method -> draft model cache hit rate
    gates: dict[str, str] = field(default_factory=dict)  # method -> the draft model gate's verdict at the end

    def of(self, method: str) -> list[Run]:
        return [r for r in self.runs if r.method == method]


def _hf_generate(model: Any, prompt: np.ndarray, max_new: int, **kwargs: object) -> tuple[list[int], float]:
    """Greedy generation with transformers' own ``generate`` (``model``: a ``*ForCausalLM``; Any because
    ``PreTrainedModel`` lacks ``generate`` and ``GenerationMixin.generate`` is typed for its decorator)."""
    import torch

    ids = torch.as_tensor(prompt, dtype=torch.long, device=model.device)[None]
    t0 = time.perf_counter()
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new, do_sample=False,
                         eos_token_id=EOS, pad_token_id=EOS, **kwargs)
    seconds = time.perf_counter() - t0
    return out[0, ids.shape[1]:].tolist(), seconds


def _warm(dataset: str, prompts: list[Prompt], engine_run: Callable[[np.ndarray], list[int]],
          client: DrafterClient,
          key: str) -> None:
    """Teach the service the workload: earlier requests generated by the same model.

    The first time, the requests are generated through the engine with drafting on (each completed request
    is ingested by its session's end) and cached; later runs ingest the cached outputs.
    """
    path = cache_dir() / f"e2e-warm-{dataset}-{key}-{len(prompts)}.jsonl"
    if path.is_file():
        rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
        client.ingest([(r["prompt"], r["output"], r["id"]) for r in rows])
        logger.info("warmed %s from %s (%d requests)", dataset, path.name, len(rows))
        return
    rows = []
    for p in tqdm(prompts, desc=f"{dataset}: warming", unit="req"):
        rows.append({"id": p.prompt_id, "prompt": p.token_ids.tolist(), "output": engine_run(p.token_ids)})
    with atomic_output(path) as tmp:
        tmp.write_text("".join(json.dumps(r) + "\n" for r in rows))


def fixed_budgets(args: argparse.Namespace) -> list[int]:
    """The node counts of ``--fixed-budgets``."""
    try:
        out = [int(x) for x in args.fixed_budgets.split(",") if x.strip()]
    except ValueError:
        raise SystemExit(f"--fixed-budgets takes comma-separated node counts, got {args.fixed_budgets!r}") from None
    if any(n < 0 for n in out):
        raise SystemExit("--fixed-budgets: node counts must be >= 0")
    return sorted(set(out))


def settling_prompts(warm: Sequence[Prompt], count: int) -> list[Prompt]:
    """The warm requests an adaptive engine generates before measuring (the last ``count``; none for 0)."""
    if count < 0:
        raise SystemExit(f"--engine-warm must be >= 0, got {count}")
    return list(warm[len(warm) - min(count, len(warm)):])


def method_order(method: str) -> tuple[int, int]:
    """Where a method runs among a prompt's methods (fixed-N after drafter's, by N)."""
    if method.startswith("fixed-"):
        return METHODS.index("drafter-repeat"), int(method[6:])
    return METHODS.index(method), -1


def run_workload(dataset: str, args: argparse.Namespace, model: PreTrainedModel, addresses: dict[str, str],
                 draft: PreTrainedModel | None = None) -> WorkloadResult:
    """Warm each method's service with a workload, then run every method on its measured prompts.

    Args:
        addresses: service address of each method drafted by a service.
        draft: the draft model, for ``hf-assist``.
    """
    from engine_client.admin import stats
    from engine_client.client import DrafterClient
    from engine_client.draft_source import NoDrafts
    from engines.reference.engine import ReferenceEngine

    methods = sorted([m.strip() for m in args.methods.split(",") if m.strip()]
                     + [f"fixed-{n}" for n in fixed_budgets(args)], key=method_order)
    warm = load_prompts(dataset, args.warm)
    measured = load_prompts(dataset, args.requests, skip=args.warm)
    result = WorkloadResult(dataset)
    clients = {m: DrafterClient(addr, max_nodes=args.max_nodes) for m, addr in addresses.items()}
    try:
        plain = ReferenceEngine(model, NoDrafts(), max_nodes=args.max_nodes)
        engines = {m: ReferenceEngine(model, c, max_nodes=int(m[6:]) if m.startswith("fixed-") else args.max_nodes,
                                      adaptive=not (args.fixed_budget or m.startswith("fixed-")))
                   for m, c in clients.items()}

        def engine_run(engine: ReferenceEngine, prompt: np.ndarray) -> Run:
            t0 = time.perf_counter()  # prefill included, as in transformers' generate
            out = engine.generate(prompt.tolist(), args.max_new_tokens, eos_token_id=EOS)
            return Run("", "", list(out.tokens), time.perf_counter() - t0, len(out.steps),
                       sum(s.draft_seconds for s in out.steps))

        for m, client in clients.items():
            def generated(prompt: np.ndarray, engine: ReferenceEngine = engines[m]) -> list[int]:
                return engine_run(engine, prompt).tokens

            _warm(dataset, warm, generated, client, f"{args.dtype}-{args.max_new_tokens}")
        engine_run(plain, measured[0].token_ids[:32])  # first-call costs (allocator, kernels) out of the way
        for engine in engines.values():
            for p in settling_prompts(warm, args.engine_warm if engine.adaptive else 0):
                engine_run(engine, p.token_ids)
        for client in clients.values():
            client.reset_stats_local()
        before = {m: stats(addr) for m, addr in addresses.items()}
        for p in tqdm(measured, desc=f"{dataset}: measuring", unit="req"):
            for method in methods:
                if method == "greedy":
                    run = engine_run(plain, p.token_ids)
                elif method in engines:
                    run = engine_run(engines[method], p.token_ids)
                elif method == "drafter-repeat":  # drafter's service has just stored this prompt's answer
                    run = engine_run(engines["drafter"], p.token_ids)
                else:
                    kwargs: dict[str, object] = {}
                    if method == "hf-pld":
                        kwargs = {"prompt_lookup_num_tokens": 10}
                    elif method == "hf-assist":
                        kwargs = {"assistant_model": draft}
                    toks, secs = _hf_generate(model, p.token_ids, args.max_new_tokens, **kwargs)
                    run = Run("", "", toks, secs)
                run.method, run.prompt_id = method, p.prompt_id
                result.runs.append(run)
                if args.show and method == "drafter":
                    tqdm.write(f"--- {p.prompt_id}: {run.tokens_per_s:.1f} tokens/s, {run.steps} steps\n"
                               + load_smollm2_tokenizer().decode(run.tokens))
        if "drafter" in clients:
            result.reuse = {k: v for k, v in clients["drafter"].stats_local().as_dict().items()
                            if isinstance(v, (int, float))}
        for m, addr in addresses.items():
            after = stats(addr)
            steps = after["draft_model_steps"] - before[m]["draft_model_steps"]
            if steps:
                result.cache_hits[m] = (after["draft_model_hits"] - before[m]["draft_model_hits"]) / steps
            if after.get("draft_model_verdict"):
                result.gates[m] = (f"{after['draft_model_verdict']}, {after['draft_model_ratio']:.2f}x estimated, "
                                   f"nodes {'served' if after.get('draft_model_served') else 'not served'} at the end")
    finally:
        for client in clients.values():
            client.close()
    return result


def format_headline(results: Sequence[WorkloadResult], args: argparse.Namespace) -> str:
    """The README's table: per workload, greedy's and drafter's tokens per second, drafter's MAT, and drafter against
    greedy and against prompt lookup (medians of per-request ratios)."""
    lines = [f"SmolLM2-135M-Instruct, {args.dtype}, greedy, {args.threads} torch threads, {args.max_new_tokens} new "
             f"tokens, {args.requests} held-back requests per workload after {args.warm} warm-up requests.", "",
             "| workload | greedy tok/s | drafter tok/s (MAT) | drafter vs greedy | drafter vs prompt lookup |",
             "|---|---|---|---|---|"]
    for res in results:
        greedy, drafter, pld = res.of("greedy"), res.of("drafter"), res.of("hf-pld")
        if not greedy or not drafter:
            continue
        rate = sum(len(r.tokens) for r in drafter) / sum(r.seconds for r in drafter)
        mat = sum(len(r.tokens) for r in drafter) / max(1, sum(r.steps for r in drafter))
        base = sum(len(r.tokens) for r in greedy) / sum(r.seconds for r in greedy)
        vs_pld = f"{_median_ratio(drafter, pld):.2f}×" if pld else "-"
        lines.append(f"| {res.dataset} | {base:.1f} | {rate:.1f} ({mat:.2f}) | {_median_ratio(drafter, greedy):.2f}× "
                     f"| {vs_pld} |")
    return "\n".join(lines)


def _median_ratio(a: Sequence[Run], b: Sequence[Run]) -> float:
    return statistics.median(x.tokens_per_s / y.tokens_per_s for x, y in zip(a, b, strict=True) if y.tokens_per_s)


def format_result(res: WorkloadResult) -> str:
    """A table: tokens/s, MAT and speedups of each method on one workload."""
    lines = [f"{res.dataset}: {len({r.prompt_id for r in res.runs})} requests",
             f"  {'method':<11} {'tok/s (all)':>11} {'tok/s p50':>10} {'MAT':>6} {'vs greedy':>10} {'vs hf-pld':>10}"
             f" {'vs assist':>10}"]
    base, pld, assist = res.of("greedy"), res.of("hf-pld"), res.of("hf-assist")
    ordered = sorted({r.method for r in res.runs}, key=method_order)
    for method in ordered:
        runs = res.of(method)
        if not runs:
            continue
        total = sum(len(r.tokens) for r in runs) / sum(r.seconds for r in runs)
        p50 = statistics.median(r.tokens_per_s for r in runs)
        mat = f"{sum(len(r.tokens) for r in runs) / sum(r.steps for r in runs):.2f}" if runs[0].steps else "-"
        vs_g = f"{_median_ratio(runs, base):.2f}x" if base else "-"
        vs_p = f"{_median_ratio(runs, pld):.2f}x" if pld else "-"
        vs_a = f"{_median_ratio(runs, assist):.2f}x" if assist else "-"
        lines.append(f"  {method:<11} {total:>11.1f} {p50:>10.1f} {mat:>6} {vs_g:>10} {vs_p:>10} {vs_a:>10}")
    for method, rate in res.cache_hits.items():
        lines.append(f"  {method}: draft model cache hit rate {100 * rate:.1f}% of steps with its drafts")
    for method, verdict in res.gates.items():
        lines.append(f"  {method}: draft model gate: {verdict}")
    free = res.of("drafter")
    for method in (m for m in ordered if m in MODEL_METHODS and m != "hf-assist"):
        if free and res.of(method):
            lines.append(f"  {method} vs drafter (model-free): {_median_ratio(res.of(method), free):.2f}x "
                         "(median of per-prompt ratios)")
    fixed = [m for m in ordered if m.startswith("fixed-")]
    if fixed and res.of("drafter") and base:
        best = max(fixed, key=lambda m: _median_ratio(res.of(m), base))
        lines.append(f"  best fixed budget: {best} ({_median_ratio(res.of(best), base):.2f}x greedy); drafter vs it: "
                     f"{_median_ratio(res.of('drafter'), res.of(best)):.2f}x (median of per-prompt ratios)")
    for method in (m for m in ordered if m in SERVICE_METHODS and m != "drafter" and base):
        same = sum(a.tokens == b.tokens for a, b in zip(base, res.of(method), strict=True))
        lines.append(f"  {method} output equal to greedy: {same}/{len(base)} requests")
    if base and res.of("drafter"):
        same = sum(a.tokens == b.tokens for a, b in zip(base, res.of("drafter"), strict=True))
        d = res.of("drafter")
        share = sum(r.draft_seconds for r in d) / sum(r.seconds for r in d)
        lines.append(f"  drafter output equal to greedy: {same}/{len(base)} requests; time asking for drafts: "
                     f"{100 * share:.2f}% of generation")
    if res.reuse:
        r = res.reuse
        lines.append(f"  draft reuse: {r['reused_steps']:.0f} of {r['steps']:.0f} steps "
                     f"({100 * r['reuse_share']:.1f}%) served from an earlier tree in {r['mean_reuse_us']:.0f} µs "
                     f"instead of a {r['mean_round_trip_us']:.0f} µs round trip; {r['saved_ms']:.1f} ms saved")
    return "\n".join(lines)


def draft_folder_of(args: argparse.Namespace) -> Path:
    """The draft model folder a benchmark uses: ``--draft-model``, or where distill-draft puts the default one."""
    folder = Path(args.draft_model) if args.draft_model else cache_dir() / DEFAULT_DRAFT
    if not (folder / "config.json").is_file():
        raise SystemExit(f"no draft model at {folder}: train one with `drafter distill-draft --out {folder}` "
                         "or pass --draft-model")
    return folder


#: ``drafter bench e2e`` flags passed on to each service with a draft model, when given.
CARD_FLAGS = {"draft_threads": "--draft-threads", "card_width": "--card-width", "card_top_k": "--card-top-k",
              "card_layers": "--card-layers", "card_vocab": "--card-vocab", "card_nice": "--card-nice",
              "card_idle": "--card-idle", "card_gate": "--card-gate"}


def _service_args(kind: tuple[str, ...], args: argparse.Namespace, draft: Path | None) -> list[str]:
    if not kind:
        return []
    given = [x for attr, flag in CARD_FLAGS.items() if getattr(args, attr) is not None
             for x in (flag, str(getattr(args, attr)))]
    return ["--draft-model", str(draft), "--draft-dtype", args.dtype, *given, *kind[1:]]


def parse_cpus(text: str, flag: str) -> set[int]:
    """CPU numbers of a list like ``0,2-3`` (empty: none)."""
    cpus: set[int] = set()
    try:
        for part in (p.strip() for p in text.split(",") if p.strip()):
            first, _, last = part.partition("-")
            cpus.update(range(int(first), int(last or first) + 1))
    except ValueError:
        raise SystemExit(f"{flag} takes CPU numbers such as 0,2-3, got {text!r}") from None
    allowed = os.sched_getaffinity(0)
    if cpus - allowed:
        raise SystemExit(f"{flag}: CPUs {sorted(cpus - allowed)} are not available to this process "
                         f"({sorted(allowed)} are)")
    return cpus


def run_e2e_bench(args: argparse.Namespace) -> int:
    """Entry point of ``drafter bench e2e``."""
    import torch

    from drafter_service.bench.step_costs import fastest_dtype, format_curve, measure_step_curve
    from drafter_service.datasets.target_model import load_smollm2

    methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    unknown = set(methods) - set(METHODS)
    if unknown:
        raise SystemExit(f"unknown methods {sorted(unknown)}; choose among {', '.join(METHODS)}")
    if "drafter-repeat" in methods and "drafter" not in methods:
        raise SystemExit("drafter-repeat repeats drafter's requests: list drafter too")
    fixed_budgets(args)  # a bad list fails before the model loads
    try:
        parse_targets(args.write_doc)
    except DocBlockError as exc:
        raise SystemExit(str(exc)) from None
    settling_prompts([], args.engine_warm)
    engine_cpus, service_cpus = parse_cpus(args.engine_cpus, "--engine-cpus"), parse_cpus(args.service_cpus,
                                                                                          "--service-cpus")
    if engine_cpus:  # before torch starts its threads, which inherit it
        os.sched_setaffinity(0, engine_cpus)
    torch.set_num_threads(args.threads)
    print(f"machine: {machine()}", flush=True)
    if args.dtype == "auto":
        dtype, plain = fastest_dtype(load_smollm2)
        args.dtype = "bfloat16" if dtype == torch.bfloat16 else "float32"
        print("plain decode step: " + ", ".join(f"{str(d).removeprefix('torch.')} {1e3 * t:.1f} ms"
                                                 for d, t in plain.items()) + f"; using {args.dtype}", flush=True)
    dtype = torch.bfloat16 if args.dtype == "bfloat16" else torch.float32
    model = load_smollm2(dtype)
    print(f"{args.dtype} {format_curve(measure_step_curve(model))} (256-token cache, median of 3)", flush=True)
    device = str(model.device)
    draft_folder = draft_folder_of(args) if set(methods) & set(MODEL_METHODS) else None
    draft = None
    if "hf-assist" in methods:
        from drafter_service.model.draft_model import load_draft_model

        assert draft_folder is not None  # hf-assist is one of MODEL_METHODS

        draft = load_draft_model(draft_folder, model.config.vocab_size, dtype=dtype, device=device)
    if engine_cpus or service_cpus:
        print(f"engine on CPUs {sorted(engine_cpus) or 'all'}, services on CPUs {sorted(service_cpus) or 'all'}")
    print(f"SmolLM2-135M-Instruct, {args.dtype}, {device}, {torch.get_num_threads()} threads, "
          f"max_new_tokens={args.max_new_tokens}, max_nodes={args.max_nodes}"
          + (f", draft model {draft_folder}" if draft_folder else ""), flush=True)
    served = [m for m in methods if m in SERVICE_METHODS] + [f"fixed-{n}" for n in fixed_budgets(args)]
    results = []
    for dataset in args.dataset or ["gsm8k"]:
        with tempfile.TemporaryDirectory(prefix="drafter-e2e-") as tmp:
            services: list[ServiceProcess] = []
            addresses: dict[str, str] = {}
            try:
                for method in served:
                    if args.address and method == "drafter":
                        addresses[method] = args.address
                        continue
                    # a fresh service per workload: what it knows comes from that workload only
                    service = ServiceProcess(Path(tmp) / method, capacity=1 << 22,
                                             extra_args=_service_args(SERVICE_METHODS.get(method, ()), args,
                                                                      draft_folder), cpus=service_cpus)
                    services.append(service)
                    service.start()
                    addresses[method] = service.address
                res = run_workload(dataset, args, model, addresses, draft)
            finally:
                for service in services:
                    service.stop()
        results.append(res)
        print(format_result(res), flush=True)
    if args.write_doc:
        write_doc_blocks(args.write_doc, format_headline(results, args))
    if args.json:
        Path(args.json).write_text(json.dumps([{"dataset": r.dataset, "machine": machine(), "dtype": args.dtype,
                                                "reuse": r.reuse, "cache_hits": r.cache_hits,
                                                "runs": [asdict(x) for x in r.runs]} for r in results]))
    return 0

"""`drafter bench e2e`: real generation with SmolLM2-135M-Instruct, plain and with drafter, beside transformers."""

from __future__ import annotations

import argparse
import json
import logging
import os
import re
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
from tqdm import tqdm

from drafter_service.bench.doc_blocks import DocBlockError, add_doc_flag, parse_targets, write_doc_blocks
from drafter_service.bench.e2e_prompts import E2E_DATASETS, Prompt, load_prompts
from drafter_service.bench.e2e_report import (
    METHODS,
    MODEL_METHODS,
    SERVICE_METHODS,
    Run,
    WorkloadResult,
    format_headline,
    format_result,
    method_order,
    result_json,
)
from drafter_service.bench.machine import machine, use_device
from drafter_service.bench.serve_bench import ServiceProcess
from drafter_service.core.config import GATES
from drafter_service.datasets.cache import atomic_output, cache_dir
from drafter_service.datasets.tokenizer import load_smollm2_tokenizer

if TYPE_CHECKING:
    from transformers import PreTrainedModel

    from engine_client.client import DrafterClient
    from engines.reference.engine import StepStats

logger = logging.getLogger(__name__)

#: SmolLM2's end of turn (``<|im_end|>``): generation stops after it.
EOS = 2

#: drafter-pre's figures that count (the others are running means).
PRESPECULATION_COUNTS = ("hits", "misses", "waits", "late", "looked_up", "answers", "sender_cpu_seconds")

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
    p.add_argument("--device", default="auto",
                   help="where the target model, the draft model of hf-assist and card's services, and the engines "
                   "run: auto (CUDA when torch sees a GPU, else the CPU), cpu, cuda or cuda:N")
    p.add_argument("--dtype", choices=("auto", "bfloat16", "float32"), default="auto",
                   help="auto: whichever decodes a plain step faster on the device (float32 for exactness)")
    p.add_argument("--threads", type=int, default=2, help="torch threads")
    p.add_argument("--methods", default=",".join(DEFAULT_METHODS),
                   help=f"comma-separated subset of {','.join(METHODS)} (greedy: the reference engine without "
                   "drafts; drafter-pre: drafter's trees pre-speculated a step ahead on a background thread "
                   "(PreSpeculatedSource), drafter: the synchronous client (DrafterClient); card*: drafter with "
                   "the draft model, with CARD's correction, without it, and without "
                   "model-free sources; hf: transformers' greedy generate; hf-static: the same with a static cache, "
                   "compiled on CUDA as generate compiles it; hf-pld: prompt lookup; hf-assist: transformers' "
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


def _hf_generate(model: Any, prompt: np.ndarray, max_new: int, **kwargs: object) -> tuple[list[int], float]:
    """Greedy generation with transformers' own ``generate`` (``model``: a ``*ForCausalLM``; Any because
    ``PreTrainedModel`` lacks ``generate`` and ``GenerationMixin.generate`` is typed for its decorator). The time
    ends once the tokens are back on the host (on CUDA, after the device has finished)."""
    import torch

    ids = torch.as_tensor(prompt, dtype=torch.long, device=model.device)[None]
    t0 = time.perf_counter()
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new, do_sample=False,
                         eos_token_id=EOS, pad_token_id=EOS, **kwargs)
    tokens = out[0, ids.shape[1]:].tolist()
    return tokens, time.perf_counter() - t0


class HfStatic:
    """transformers' greedy ``generate`` with a static cache (``cache_implementation="static"``), its forward compiled
    on CUDA as ``generate`` compiles it (``torch.compile`` with transformers' default ``CompileConfig``: inductor,
    "reduce-overhead"). Where compiling is not possible (the CPU: ``generate`` compiles on accelerators only; or it
    raises) it runs with the static cache alone, and ``mode`` says so.

    Args:
        model: a transformers ``*ForCausalLM`` on its device.
        compiled: try compiling (default: on a CUDA device).
    """

    def __init__(self, model: Any, compiled: bool | None = None) -> None:
        self.model = model
        self.compiled = model.device.type == "cuda" if compiled is None else compiled
        self.max_cache_len = 0
        self.mode = ("compiled as generate compiles it (torch.compile, inductor, reduce-overhead)" if self.compiled
                     else f"static cache alone: not compiled on {model.device.type} (transformers' generate "
                     "compiles its forward on accelerators only)")

    def kwargs(self) -> dict[str, object]:
        """``generate``'s arguments: the static cache sized for every measured request (one size, so one compiled
        graph), and compiling on or off."""
        from transformers import CompileConfig

        out: dict[str, object] = {"cache_implementation": "static"}
        if self.max_cache_len:
            out["max_cache_len"] = self.max_cache_len
        if self.compiled:
            out["compile_config"] = CompileConfig()
        else:
            out["disable_compile"] = True
        return out

    def prepare(self, prompts: Sequence[np.ndarray], max_new: int) -> None:
        """Size the cache for the longest of ``prompts`` plus ``max_new`` tokens and generate twice, untimed (the
        compilation, then the graphs recorded), so that measured calls only replay."""
        self.max_cache_len = max(self.max_cache_len, max(len(p) for p in prompts) + max_new)
        longest = max(prompts, key=len)
        for _ in range(2):
            self.generate(longest, min(max_new, 16))
        if self.compiled and getattr(self.model, "_compiled_call", None) is None:
            self.compiled = False
            self.mode = "static cache alone: generate did not compile its forward on this model and device"
            logger.warning("hf-static: %s", self.mode)

    def generate(self, prompt: np.ndarray, max_new: int) -> tuple[list[int], float]:
        """One greedy generation: its tokens and seconds (a failed compiled call falls back to the static cache
        alone, for this call and every later one)."""
        try:
            return _hf_generate(self.model, prompt, max_new, **self.kwargs())
        except Exception as exc:  # inductor needs a compiler toolchain, triton, ...: not every machine has them
            if not self.compiled:
                raise
            self.compiled = False
            self.mode = f"static cache alone: compiling failed ({type(exc).__name__}: {str(exc)[:200]})"
            logger.warning("hf-static: %s", self.mode, exc_info=True)
            return _hf_generate(self.model, prompt, max_new, **self.kwargs())


def resolve_device(text: str) -> str:
    """The device of ``--device``: auto (CUDA when torch sees a GPU, else the CPU), cpu, cuda or cuda:N.

    Raises:
        SystemExit: the text is none of these, or it names a CUDA device torch cannot use (checked before anything
            loads).
    """
    import torch

    text = text.strip().lower()
    if not re.fullmatch(r"auto|cpu|cuda(:\d+)?", text):
        raise SystemExit(f"--device takes auto, cpu, cuda or cuda:N, got {text!r}")
    if text == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if text == "cpu":
        return text
    if not torch.cuda.is_available():
        why = ("this torch was built without CUDA" if torch.version.cuda is None
               else f"torch (CUDA {torch.version.cuda}) sees no GPU: check the driver and CUDA_VISIBLE_DEVICES")
        raise SystemExit(f"--device {text}: {why} (torch {torch.__version__}); use --device cpu or auto")
    index = int(text.partition(":")[2] or 0)
    if index >= torch.cuda.device_count():
        raise SystemExit(f"--device {text}: torch sees {torch.cuda.device_count()} CUDA device(s), "
                         f"cuda:0 to cuda:{torch.cuda.device_count() - 1}")
    return text


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


def run_of(tokens: Sequence[int], seconds: float, steps: Sequence[StepStats]) -> Run:
    """A ``Run`` (method and prompt left blank) of an engine's generation, with its steps' sums."""
    return Run("", "", list(tokens), seconds, len(steps), sum(s.draft_seconds for s in steps),
               sum(s.forward_seconds for s in steps), sum(s.check_seconds for s in steps),
               sum(s.drafted for s in steps), sum(s.padded for s in steps))


def warm_key(args: argparse.Namespace) -> str:
    """What the cached warm-up generations depend on: dtype, length and (beyond the CPU) the device's kind."""
    kind = args.device.partition(":")[0]
    return f"{args.dtype}-{args.max_new_tokens}" + ("" if kind == "cpu" else f"-{kind}")


def _hf_method(method: str, model: Any, prompt: np.ndarray, max_new: int, draft: PreTrainedModel | None,
               hf_static: HfStatic | None) -> tuple[list[int], float]:
    """One generation by one of transformers' methods: its tokens and seconds."""
    if method == "hf-static":
        assert hf_static is not None
        return hf_static.generate(prompt, max_new)
    kwargs: dict[str, object] = {}
    if method == "hf-pld":
        kwargs = {"prompt_lookup_num_tokens": 10}
    elif method == "hf-assist":
        kwargs = {"assistant_model": draft}
    return _hf_generate(model, prompt, max_new, **kwargs)


def run_workload(dataset: str, args: argparse.Namespace, model: PreTrainedModel, addresses: dict[str, str],
                 draft: PreTrainedModel | None = None) -> WorkloadResult:
    """Warm each method's service with a workload, then run every method on its measured prompts.

    Args:
        addresses: service address of each method drafted by a service.
        draft: the draft model, for ``hf-assist``.
    """
    from engine_client.admin import stats
    from engine_client.client import DrafterClient
    from engine_client.draft_source import DraftSource, NoDrafts
    from engine_client.prespeculated_source import PreSpeculatedSource
    from engines.reference.engine import ReferenceEngine

    methods = sorted([m.strip() for m in args.methods.split(",") if m.strip()]
                     + [f"fixed-{n}" for n in fixed_budgets(args)], key=method_order)
    warm = load_prompts(dataset, args.warm)
    measured = load_prompts(dataset, args.requests, skip=args.warm)
    result = WorkloadResult(dataset)
    device = args.device
    clients = {m: DrafterClient(addr, max_nodes=args.max_nodes) for m, addr in addresses.items()}
    # drafter-pre: trees pre-speculated a step ahead on a background thread (its own client, on the same service)
    pre = (PreSpeculatedSource(addresses["drafter-pre"], max_nodes=min(4 * args.max_nodes, 1024))
           if "drafter-pre" in addresses else None)
    sources: dict[str, DraftSource] = {m: pre if m == "drafter-pre" and pre is not None else c
                                       for m, c in clients.items()}
    try:
        plain = ReferenceEngine(model, NoDrafts(), max_nodes=args.max_nodes, device=device)
        engines = {m: ReferenceEngine(model, c, max_nodes=int(m[6:]) if m.startswith("fixed-") else args.max_nodes,
                                      device=device, adaptive=not (args.fixed_budget or m.startswith("fixed-")))
                   for m, c in sources.items()}

        def engine_run(engine: ReferenceEngine, prompt: np.ndarray) -> Run:
            t0 = time.perf_counter()  # prefill included, as in transformers' generate
            out = engine.generate(prompt.tolist(), args.max_new_tokens, eos_token_id=EOS)
            return run_of(out.tokens, time.perf_counter() - t0, out.steps)

        for m, client in clients.items():
            def generated(prompt: np.ndarray, engine: ReferenceEngine = engines[m]) -> list[int]:
                return engine_run(engine, prompt).tokens

            _warm(dataset, warm, generated, client, warm_key(args))
        engine_run(plain, measured[0].token_ids[:32])  # first-call costs (allocator, kernels) out of the way
        for engine in engines.values():
            for p in settling_prompts(warm, args.engine_warm if engine.adaptive else 0):
                engine_run(engine, p.token_ids)
        longest = max(p.token_ids.size for p in measured) + args.max_new_tokens
        for engine in (plain, *engines.values()):  # cache and CUDA graphs made before measuring, untimed
            engine.runner(longest)
        hf_static = HfStatic(model) if "hf-static" in methods else None
        if hf_static is not None:
            hf_static.prepare([p.token_ids for p in measured], args.max_new_tokens)
        for method in (m for m in methods if m.startswith("hf") and m != "hf-static"):  # first calls, untimed
            _hf_method(method, model, measured[0].token_ids[:32], 8, draft, hf_static)
        for client in clients.values():
            client.reset_stats_local()
        pre_before = pre.stats_local() if pre is not None else {}
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
                    run = Run("", "", *_hf_method(method, model, p.token_ids, args.max_new_tokens, draft, hf_static))
                run.method, run.prompt_id = method, p.prompt_id
                result.runs.append(run)
                if args.show and method == "drafter":
                    tqdm.write(f"--- {p.prompt_id}: {run.tokens_per_s:.1f} tokens/s, {run.steps} steps\n"
                               + load_smollm2_tokenizer().decode(run.tokens))
        if "drafter" in clients:
            result.reuse = {k: v for k, v in clients["drafter"].stats_local().as_dict().items()
                            if isinstance(v, (int, float))}
        if pre is not None:  # counts over the measured requests; running means as they ended
            result.prespeculation = {k: v - pre_before[k] if k in PRESPECULATION_COUNTS else v
                                     for k, v in pre.stats_local().items()}
        for m, addr in addresses.items():
            after = stats(addr)
            steps = after["draft_model_steps"] - before[m]["draft_model_steps"]
            if steps:
                result.cache_hits[m] = (after["draft_model_hits"] - before[m]["draft_model_hits"]) / steps
            if after.get("draft_model_verdict"):
                result.gates[m] = (f"{after['draft_model_verdict']}, {after['draft_model_ratio']:.2f}x estimated, "
                                   f"nodes {'served' if after.get('draft_model_served') else 'not served'} at the end")
        if hf_static is not None:
            result.hf_static = hf_static.mode
    finally:
        if pre is not None:
            pre.close()
        for client in clients.values():
            client.close()
    return result


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
    return ["--draft-model", str(draft), "--draft-dtype", args.dtype, "--draft-device", args.device, *given,
            *kind[1:]]


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
    device = args.device = resolve_device(args.device)  # a device torch cannot use fails before anything loads
    use_device(device)  # the machine line, here and in the tables written into the docs, names it
    torch.set_num_threads(args.threads)
    print(f"machine: {machine()}", flush=True)
    if args.dtype == "auto":
        dtype, plain = fastest_dtype(lambda d: load_smollm2(d, device))
        args.dtype = "bfloat16" if dtype == torch.bfloat16 else "float32"
        print(f"plain decode step on {device}: " + ", ".join(f"{str(d).removeprefix('torch.')} {1e3 * t:.1f} ms"
                                                            for d, t in plain.items()) + f"; using {args.dtype}",
              flush=True)
    dtype = torch.bfloat16 if args.dtype == "bfloat16" else torch.float32
    if dtype == torch.float32:  # exactness: full float32 products (no TF32 on CUDA, whatever the environment says)
        torch.set_float32_matmul_precision("highest")
    model = load_smollm2(dtype, device)
    print(f"{args.dtype} {format_curve(measure_step_curve(model))} (256-token cache, median of 3)", flush=True)
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
        Path(args.json).write_text(json.dumps([result_json(r, machine=machine(), device=device, dtype=args.dtype)
                                               for r in results]))
    return 0

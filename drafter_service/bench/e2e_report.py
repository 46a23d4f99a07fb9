"""What `drafter bench e2e` measures and how it reports it: the methods, one run per method and prompt, the tables,
the per-step breakdown of the engine's methods and their exactness against greedy."""

from __future__ import annotations

import argparse
import logging
import statistics
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

logger = logging.getLogger(__name__)

#: Methods in the order they run for each prompt (interleaved, so machine noise hits all alike).
METHODS = ("greedy", "drafter", "drafter-pre", "drafter-repeat", "card", "card-nocorr", "card-only", "hf", "hf-static",
           "hf-pld", "hf-assist")

#: Methods drafted by a service of their own, with the flags that service runs with.
SERVICE_METHODS = {"drafter": (), "drafter-pre": (), "card": ("card",),
                   "card-nocorr": ("card", "--card-correction", "0"), "card-only": ("card", "--sources", "none")}

#: Methods that need the draft model.
MODEL_METHODS = ("card", "card-nocorr", "card-only", "hf-assist")

#: transformers' plain greedy generation, each of which may be the faster on a machine.
HF_GREEDY = ("hf", "hf-static")

#: Baselines every method is compared with where they ran: (method, column title).
BASELINES = (("greedy", "vs greedy"), ("hf", "vs hf"), ("hf-static", "vs hf-static"), ("hf-pld", "vs hf-pld"),
             ("hf-assist", "vs assist"))


def method_order(method: str) -> tuple[int, int]:
    """Where a method runs among a prompt's methods (fixed-N after drafter's, by N)."""
    if method.startswith("fixed-"):
        return METHODS.index("drafter-repeat"), int(method[6:])
    return METHODS.index(method), -1


def is_engine_method(method: str) -> bool:
    """Whether a method generates with the reference engine (and so has steps to break down)."""
    return method in ("greedy", "drafter-repeat") or method in SERVICE_METHODS or method.startswith("fixed-")


@dataclass
class Run:
    """One method on one prompt.

    The step sums are over the engine's steps after the prefill (zero for transformers' methods); ``seconds`` is the
    whole generation, prefill included.
    """

    method: str
    prompt_id: str
    tokens: list[int]
    seconds: float
    steps: int = 0
    draft_seconds: float = 0.0  # time spent asking for drafts (client side)
    forward_seconds: float = 0.0  # inputs to the device, the forward pass, the argmaxes read back
    check_seconds: float = 0.0  # finding the accepted path and the step's bookkeeping
    drafted_nodes: int = 0  # draft nodes verified, summed over steps
    padded_nodes: int = 0  # the sizes the steps ran at (drafted nodes padded to a captured size), summed

    @property
    def tokens_per_s(self) -> float:
        return len(self.tokens) / self.seconds if self.seconds else 0.0


@dataclass
class WorkloadResult:
    """Every run of one workload, plus the client's reuse figures."""

    dataset: str
    runs: list[Run] = field(default_factory=list)
    reuse: dict[str, float] = field(default_factory=dict)
    prespeculation: dict[str, float] = field(default_factory=dict)  # drafter-pre's PreSpeculatedSource figures
    cache_hits: dict[str, float] = field(default_factory=dict)  # method -> draft model cache hit rate
    gates: dict[str, str] = field(default_factory=dict)  # method -> the draft model gate's verdict at the end
    hf_static: str = ""  # how hf-static ran: compiled, or the static cache alone and why

    def of(self, method: str) -> list[Run]:
        return [r for r in self.runs if r.method == method]

    def methods(self) -> list[str]:
        """The methods that ran, in their running order."""
        return sorted({r.method for r in self.runs}, key=method_order)


def tokens_per_s(runs: Sequence[Run]) -> float:
    """Tokens per second over all of ``runs``."""
    seconds = sum(r.seconds for r in runs)
    return sum(len(r.tokens) for r in runs) / seconds if seconds else 0.0


def median_ratio(a: Sequence[Run], b: Sequence[Run]) -> float:
    """Median over prompts of ``a``'s tokens/s over ``b``'s (runs of two methods on the same prompts, in order)."""
    return statistics.median(x.tokens_per_s / y.tokens_per_s for x, y in zip(a, b, strict=True) if y.tokens_per_s)


def fastest_hf(res: WorkloadResult) -> str | None:
    """transformers' fastest greedy on this workload: whichever of hf and hf-static ran more tokens/s over all its
    requests (None: neither ran)."""
    ran = [m for m in HF_GREEDY if res.of(m)]
    return max(ran, key=lambda m: tokens_per_s(res.of(m))) if ran else None


def breakdown(runs: Sequence[Run]) -> dict[str, float]:
    """Means per engine step of ``runs``: draft wait, forward and check in seconds, drafted and padded nodes."""
    steps = sum(r.steps for r in runs)
    if not steps:
        return {}
    return {"steps": float(steps), "draft_seconds": sum(r.draft_seconds for r in runs) / steps,
            "forward_seconds": sum(r.forward_seconds for r in runs) / steps,
            "check_seconds": sum(r.check_seconds for r in runs) / steps,
            "drafted": sum(r.drafted_nodes for r in runs) / steps, "padded": sum(r.padded_nodes for r in runs) / steps}


def format_breakdown(res: WorkloadResult) -> list[str]:
    """A few lines: per engine method, the mean step's draft wait, forward, verification and bookkeeping, and the
    nodes drafted and the size the step ran at."""
    rows = [(m, breakdown(res.of(m))) for m in res.methods() if is_engine_method(m)]
    rows = [(m, b) for m, b in rows if b]
    if not rows:
        return []
    lines = [f"  {'per step':<14} {'steps':>7} {'draft ms':>9} {'forward ms':>11} {'check ms':>9} {'drafted':>8} "
             f"{'padded':>7}"]
    for m, b in rows:
        ms = {k: 1e3 * b[k] for k in ("draft_seconds", "forward_seconds", "check_seconds")}
        lines.append(f"  {m:<14} {b['steps']:>7.0f} {ms['draft_seconds']:>9.2f} {ms['forward_seconds']:>11.2f} "
                     f"{ms['check_seconds']:>9.2f} {b['drafted']:>8.1f} {b['padded']:>7.1f}")
    lines.append("  (means per step after the prefill: draft = wait for the draft source; forward = inputs in, "
                 "forward, argmaxes back; check = accepted path, bookkeeping; padded = size run at)")
    return lines


def format_headline(results: Sequence[WorkloadResult], args: argparse.Namespace) -> str:
    """The README's table: per workload, greedy's and drafter's tokens per second, drafter's MAT, and drafter against
    greedy and against prompt lookup (medians of per-request ratios); with ``drafter-pre`` or fixed budgets in the
    run, also pre-speculated drafter against greedy, and the best fixed budget against greedy and drafter against it."""
    where = "" if getattr(args, "device", "cpu") == "cpu" else f" on {args.device}"
    pre = any(res.of("drafter-pre") for res in results)
    fixed = any(m.startswith("fixed-") for res in results for m in res.methods())
    head = ["workload", "greedy tok/s", "drafter tok/s (MAT)", "drafter vs greedy"]
    head += ["drafter-pre vs greedy"] * pre + ["best fixed vs greedy", "drafter vs best fixed"] * fixed
    head += ["drafter vs prompt lookup"]
    lines = [f"SmolLM2-135M-Instruct{where}, {args.dtype}, greedy, {args.threads} torch threads, {args.max_new_tokens} "
             f"new tokens, {args.requests} held-back requests per workload after {args.warm} warm-up requests.", "",
             "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for res in results:
        greedy, drafter, pld = res.of("greedy"), res.of("drafter"), res.of("hf-pld")
        if not greedy or not drafter:
            continue
        mat = sum(len(r.tokens) for r in drafter) / max(1, sum(r.steps for r in drafter))
        cells = [res.dataset, f"{tokens_per_s(greedy):.1f}", f"{tokens_per_s(drafter):.1f} ({mat:.2f})",
                 f"{median_ratio(drafter, greedy):.2f}×"]
        if pre:
            cells.append(f"{median_ratio(res.of('drafter-pre'), greedy):.2f}×" if res.of("drafter-pre") else "-")
        if fixed:
            budgets = [m for m in res.methods() if m.startswith("fixed-")]
            top = max(budgets, key=lambda m: median_ratio(res.of(m), greedy)) if budgets else None
            cells += [f"{top} {median_ratio(res.of(top), greedy):.2f}×", f"{median_ratio(drafter, res.of(top)):.2f}×"] \
                if top else ["-", "-"]
        cells.append(f"{median_ratio(drafter, pld):.2f}×" if pld else "-")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _equal(a: Sequence[Run], b: Sequence[Run]) -> int:
    return sum(x.tokens == y.tokens for x, y in zip(a, b, strict=True))


def format_result(res: WorkloadResult) -> str:
    """A table: tokens/s, MAT and speedups of each method on one workload, then transformers' fastest greedy, the
    per-step breakdown and each method's output against greedy's."""
    base = res.of("greedy")
    columns = [(m, title) for m, title in BASELINES if m == "greedy" or res.of(m)]
    lines = [f"{res.dataset}: {len({r.prompt_id for r in res.runs})} requests",
             f"  {'method':<14} {'tok/s (all)':>11} {'tok/s p50':>10} {'MAT':>6}"
             + "".join(f" {title:>{max(10, len(title))}}" for _, title in columns)]
    ordered = res.methods()
    for method in ordered:
        runs = res.of(method)
        p50 = statistics.median(r.tokens_per_s for r in runs)
        mat = f"{sum(len(r.tokens) for r in runs) / sum(r.steps for r in runs):.2f}" if runs[0].steps else "-"
        cells = [f"{median_ratio(runs, res.of(m)):.2f}x" if res.of(m) else "-" for m, _ in columns]
        lines.append(f"  {method:<14} {tokens_per_s(runs):>11.1f} {p50:>10.1f} {mat:>6}"
                     + "".join(f" {c:>{max(10, len(t))}}" for c, (_, t) in zip(cells, columns, strict=True)))
    best = fastest_hf(res)
    if best:
        others = "; ".join(f"{m} {tokens_per_s(res.of(m)):.1f} tok/s" for m in HF_GREEDY if m != best and res.of(m))
        lines.append(f"  transformers' fastest greedy: {best}, {tokens_per_s(res.of(best)):.1f} tok/s"
                     + (f" ({others})" if others else ""))
    if res.hf_static:
        lines.append(f"  hf-static: {res.hf_static}")
    for method, rate in res.cache_hits.items():
        lines.append(f"  {method}: draft model cache hit rate {100 * rate:.1f}% of steps with its drafts")
    for method, verdict in res.gates.items():
        lines.append(f"  {method}: draft model gate: {verdict}")
    free = res.of("drafter")
    for method in (m for m in ordered if m in MODEL_METHODS and m != "hf-assist"):
        if free:
            lines.append(f"  {method} vs drafter (model-free): {median_ratio(res.of(method), free):.2f}x "
                         "(median of per-prompt ratios)")
    fixed = [m for m in ordered if m.startswith("fixed-")]
    if fixed and free and base:
        top = max(fixed, key=lambda m: median_ratio(res.of(m), base))
        lines.append(f"  best fixed budget: {top} ({median_ratio(res.of(top), base):.2f}x greedy); drafter vs it: "
                     f"{median_ratio(free, res.of(top)):.2f}x (median of per-prompt ratios)")
    lines += format_breakdown(res)
    for method in (m for m in ordered if m != "greedy" and base):
        line = f"  {method} output equal to greedy: {_equal(base, res.of(method))}/{len(base)} requests"
        if method == "drafter":
            share = sum(r.draft_seconds for r in free) / sum(r.seconds for r in free)
            line += f"; time asking for drafts: {100 * share:.2f}% of generation"
        lines.append(line)
    if res.prespeculation:
        f = res.prespeculation
        lines.append(f"  drafter-pre: {f['hits']:.0f} steps served from a tree drafted a step ahead, "
                     f"{f['misses']:.0f} misses ({f['looked_up']:.0f} given a prompt-lookup chain), {f['waits']:.0f} "
                     f"waits ({f['late']:.0f} late); round trip {1e3 * f['round_trip_seconds']:.2f} ms, background "
                     f"thread {f['sender_cpu_seconds']:.2f} s CPU")
    if res.reuse:
        r = res.reuse
        lines.append(f"  draft reuse: {r['reused_steps']:.0f} of {r['steps']:.0f} steps "
                     f"({100 * r['reuse_share']:.1f}%) served from an earlier tree in {r['mean_reuse_us']:.0f} µs "
                     f"instead of a {r['mean_round_trip_us']:.0f} µs round trip; {r['saved_ms']:.1f} ms saved")
    return "\n".join(lines)


def result_json(res: WorkloadResult, **extra: object) -> dict[str, Any]:
    """One workload for ``--json``: ``extra`` (machine, device, dtype), every run, the breakdown per engine method
    and transformers' fastest greedy."""
    return {"dataset": res.dataset, **extra, "reuse": res.reuse, "prespeculation": res.prespeculation,
            "cache_hits": res.cache_hits,
            "hf_static": res.hf_static, "fastest_hf": fastest_hf(res),
            "breakdown": {m: breakdown(res.of(m)) for m in res.methods() if is_engine_method(m)},
            "runs": [asdict(x) for x in res.runs]}

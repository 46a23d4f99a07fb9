"""`drafter bench steps`: where a reference-engine step's time goes, per tree size, dtype and device.

For each size it times the whole step as the engine runs it (CUDA graphs on a GPU, eager elsewhere) and, under
torch.profiler, each phase of the same step run eagerly: the inputs' copy to the device, the cache upkeep (keeping
the previous step's accepted path), the mask and positions, the forward pass, and the verdict (argmaxes read back,
the accepted path found). Host time is what the Python thread spends in a phase; device time is what the GPU's
kernels take (CUDA only). A step costs what the physics allows when it is close to its forward pass alone.
"""

from __future__ import annotations

import argparse
import logging
import statistics
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from drafter_service.bench.machine import machine

logger = logging.getLogger(__name__)

__all__ = ["PHASES", "StepProfile", "add_steps_bench", "format_profiles", "profile_steps"]

#: The phases of a step, in order (``StepRunner`` methods, and the host's part of the verdict).
PHASES = ("load", "cache upkeep", "mask and positions", "forward", "verdict")


@dataclass
class StepProfile:
    """One tree size's figures.

    Attributes:
        nodes: draft nodes (a chain) verified with the root.
        step_seconds: median whole step as the engine runs it.
        eager_seconds: median whole step run eagerly (the same as ``step_seconds`` without graphs).
        host: per phase, mean host seconds per step (the clock around it: launches on CUDA, all of it on a CPU).
        device: per phase, mean device seconds per step (CUDA kernels; empty without CUDA).
        reads: host reads of device data per step (``.item()``/``.tolist()`` and device-to-host copies; CUDA).
    """

    nodes: int
    step_seconds: float
    eager_seconds: float
    host: dict[str, float] = field(default_factory=dict)
    device: dict[str, float] = field(default_factory=dict)
    reads: float = 0.0


def add_steps_bench(bench: argparse._SubParsersAction) -> None:
    """Register ``drafter bench steps``."""
    p = bench.add_parser("steps", help="where a reference-engine step's time goes (torch.profiler breakdown)")
    p.add_argument("--device", default="auto", help="auto (cuda when available), cpu, cuda or cuda:N")
    p.add_argument("--dtype", action="append", choices=("bfloat16", "float32"),
                   help="model dtype (repeatable; default both)")
    p.add_argument("--sizes", default="0,8,32,64", help="comma-separated draft sizes (a chain of that many nodes)")
    p.add_argument("--context", type=int, default=512, help="tokens in the cache before each step")
    p.add_argument("--repeats", type=int, default=20, help="steps timed per size")
    p.add_argument("--threads", type=int, default=2, help="torch threads (CPU)")
    p.add_argument("--no-graphs", action="store_true", help="run the engine's steps eagerly on CUDA too")
    p.set_defaults(func=run_steps_bench)


def _sizes(text: str) -> list[int]:
    try:
        sizes = sorted({int(x) for x in text.split(",") if x.strip()})
    except ValueError:
        raise SystemExit(f"--sizes takes comma-separated node counts, got {text!r}") from None
    if not sizes or sizes[0] < 0:
        raise SystemExit("--sizes: node counts must be >= 0")
    return sizes


def _timed_steps(runner: Any, prefix: Sequence[int], ids: Sequence[int], parents: Sequence[int],
                 repeats: int) -> float:
    """Median seconds of ``repeats`` whole steps (inputs loaded, run, argmaxes read), the cache left as it was."""
    n = len(parents)
    times = []
    for i in range(repeats + 2):
        t0 = time.perf_counter()
        runner.step(ids[0], ids[1:], parents).target[:n + 1].tolist()
        if i >= 2:  # two untimed steps: kernels chosen, memory allocated
            times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _phase_profile(runner: Any, ids: Sequence[int], parents: Sequence[int], repeats: int,
                   cuda: bool) -> tuple[dict[str, float], dict[str, float], float]:
    """Mean host and device seconds per phase of an eager step, and host reads per step.

    Host times come from the clock around each phase (on a CPU they hold the kernels too); on CUDA a second pass
    under torch.profiler gives each phase's kernel time and counts the reads of device data.
    """
    import torch
    from torch.profiler import ProfilerActivity, profile, record_function

    from engines.reference.verification import greedy_path

    n = len(parents)
    moved = list(range(1, min(n // 2, 8) + 1))  # an accepted path that is not already in place: upkeep moves it
    context = runner.cache.length
    host = dict.fromkeys(PHASES, 0.0)

    def one_step(clock: dict[str, float] | None) -> None:
        marks = [time.perf_counter()]
        with record_function("load"):
            size = runner.load(ids[0], ids[1:], parents, moved)
        marks.append(time.perf_counter())
        with record_function("cache upkeep"):
            runner.upkeep(len(moved))
        marks.append(time.perf_counter())
        with record_function("mask and positions"):
            masks, positions = runner.inputs(size, context + size + 1)
        marks.append(time.perf_counter())
        with record_function("forward"):
            logits = runner.forward(size, masks, positions)
        marks.append(time.perf_counter())
        with record_function("verdict"):
            target = runner.verdict(logits).target[:n + 1].tolist()
            greedy_path(target, ids[1:], parents)
        marks.append(time.perf_counter())
        if clock is not None:
            for phase, (a, b) in zip(PHASES, zip(marks, marks[1:], strict=False), strict=True):
                clock[phase] += (b - a) / repeats

    for _ in range(2):
        one_step(None)
    for _ in range(repeats):
        one_step(host)
    device: dict[str, float] = {}
    reads = 0
    if cuda:
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            for _ in range(repeats):
                one_step(None)
        torch.cuda.synchronize()
        for event in prof.key_averages():
            if event.key in PHASES:
                device[event.key] = getattr(event, "device_time_total", 0.0) / 1e6 / repeats
            elif event.key == "aten::_local_scalar_dense" or event.key.startswith("Memcpy DtoH"):
                reads += event.count
    return host, device, reads / repeats


def profile_steps(model: Any, sizes: Sequence[int], context: int, repeats: int,
                  graphs: bool | None = None) -> list[StepProfile]:
    """Time and profile reference-engine steps of each size over a ``context``-token cache.

    Args:
        model: a transformers causal LM on its device, in the dtype measured.
        sizes: draft node counts (each a chain).
        context: tokens in the cache before each step.
        repeats: steps timed (and profiled) per size.
        graphs: how the engine runs its steps (None: CUDA graphs on a CUDA device).
    """
    import torch

    from engines.reference.step_runner import StepRunner

    device = next(model.parameters()).device
    cuda = device.type == "cuda"
    vocab = int(model.config.vocab_size)
    gen = torch.Generator().manual_seed(0)
    prefix = torch.randint(0, vocab, (context,), generator=gen).tolist()
    largest = max(max(sizes), 1)
    out = []
    with torch.inference_mode():
        engine_runner = StepRunner(model, context + largest + 1, largest, graphs)
        engine_runner.prefill(prefix)
        eager = engine_runner if not engine_runner.graphs else StepRunner(model, context + largest + 1, largest,
                                                                          graphs=False)
        if eager is not engine_runner:
            eager.prefill(prefix)
        for n in sizes:
            parents = list(range(-1, n - 1))
            ids = torch.randint(0, vocab, (n + 1,), generator=gen).tolist()
            step = _timed_steps(engine_runner, prefix, ids, parents, repeats)
            eager_step = step if eager is engine_runner else _timed_steps(eager, prefix, ids, parents, repeats)
            host, dev, reads = _phase_profile(eager, ids, parents, repeats, cuda)
            out.append(StepProfile(n, step, eager_step, host, dev, reads))
    return out


def format_profiles(profiles: Sequence[StepProfile], title: str, graphs: bool) -> str:
    """A table: per size, the whole step (and as a multiple of the plain one) and each phase's host (and device)
    milliseconds."""
    cuda = any(p.device for p in profiles)
    base = profiles[0].step_seconds if profiles else 1.0
    head = "| nodes | step ms | × plain step | step ÷ its forward |" + ("" if not graphs else " eager step ms |")
    head += "".join(f" {ph} ms (host{' / device' if cuda else ''}) |" for ph in PHASES)
    head += " reads / step |" if cuda else ""
    lines = [title, "", head, "|" + "---|" * (head.count("|") - 1)]
    for p in profiles:
        fwd = p.device.get("forward") if cuda else p.host.get("forward")
        row = f"| {p.nodes} | {1e3 * p.step_seconds:.2f} | {p.step_seconds / base:.2f} | "
        row += f"{p.step_seconds / fwd:.2f} |" if fwd else "- |"
        if graphs:
            row += f" {1e3 * p.eager_seconds:.2f} |"
        for ph in PHASES:
            cell = f"{1e3 * p.host.get(ph, 0.0):.2f}"
            if cuda:
                cell += f" / {1e3 * p.device.get(ph, 0.0):.2f}"
            row += f" {cell} |"
        if cuda:
            row += f" {p.reads:.1f} |"
        lines.append(row)
    return "\n".join(lines)


def run_steps_bench(args: argparse.Namespace) -> int:
    """Entry point of ``drafter bench steps``."""
    import torch

    from drafter_service.datasets.target_model import load_smollm2

    sizes = _sizes(args.sizes)
    if args.context < 1 or args.repeats < 1:
        raise SystemExit("--context and --repeats must be >= 1")
    device = torch.device("cuda" if args.device == "auto" and torch.cuda.is_available() else
                          ("cpu" if args.device == "auto" else args.device))
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit(f"--device {args.device}: this torch sees no CUDA device")
    torch.set_num_threads(args.threads)
    graphs = False if args.no_graphs else None
    print(f"machine: {machine(str(device))}", flush=True)
    for name in args.dtype or ["bfloat16", "float32"]:
        dtype = torch.bfloat16 if name == "bfloat16" else torch.float32
        model = load_smollm2(dtype, device)
        profiles = profile_steps(model, sizes, args.context, args.repeats, graphs)
        captured = device.type == "cuda" and not args.no_graphs
        how = "CUDA graphs" if captured else "eager"
        title = (f"SmolLM2-135M-Instruct, {name}, {device}, steps {how}, {args.context}-token context, "
                 f"medians of {args.repeats} steps; phases profiled eagerly (means)")
        print(format_profiles(profiles, title, captured), flush=True)
        del model
    return 0

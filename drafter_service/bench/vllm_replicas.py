"""Several vLLM engine processes as one (``drafter bench vllm --replicas N``): prompts dealt round robin, answers
joined back in prompt order, vLLM's counters summed over the engines.

Prompt ``i`` goes to engine ``i % N``; the engines generate their shares at once, so they model concurrent replicas
of one deployment (for drafter, replicas whose proposers share one service and draft from each other's requests).
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import TextIO, TypeVar

from drafter_service.bench.vllm_engine import COUNTERS
from drafter_service.bench.vllm_process import Generation, VllmEngineProcess

T = TypeVar("T")

#: vLLM's CPU KV cache (GiB) of each engine when several run at once (one engine keeps ``vllm_engine``'s default).
REPLICA_KVCACHE_GIB = "1"


def deal(items: Sequence[T], n: int) -> list[list[T]]:
    """``items`` dealt round robin to ``n`` hands: item ``i`` to hand ``i % n``, in order within each hand."""
    if n < 1:
        raise ValueError(f"need at least one hand, got {n}")
    return [list(items[h::n]) for h in range(n)]


def undeal(hands: Sequence[Sequence[T]]) -> list[T]:
    """The inverse of ``deal``: the hands' items back in their original order."""
    n = len(hands)
    total = sum(len(h) for h in hands)
    return [hands[i % n][i // n] for i in range(total)]


def combine(generations: Sequence[Generation]) -> Generation:
    """One ``Generation`` of engines that generated dealt shares at once: outputs in prompt order (``undeal``),
    the slowest engine's seconds, and each counter summed over the engines (cumulative, as each engine's are)."""
    counters = {name: sum(g.counters.get(name, 0.0) for g in generations) for name in COUNTERS}
    return Generation(undeal([g.outputs for g in generations]), max((g.seconds for g in generations), default=0.0),
                      counters)


def sum_figures(figures: Sequence[Mapping[str, float]]) -> dict[str, float]:
    """The proposers' stats files summed key by key (steps, seconds, hits... each engine counts its own)."""
    out: dict[str, float] = {}
    for fig in figures:
        for key, value in fig.items():
            if isinstance(value, (int, float)) and not isinstance(value, bool):
                out[key] = out.get(key, 0) + value
    return out


def cpu_binds(n: int, cpus: Sequence[int] | None = None) -> list[str | None]:
    """vLLM's ``VLLM_CPU_OMP_THREADS_BIND`` for each of ``n`` engines: the allowed CPUs split into ``n`` contiguous
    groups, so engines running at once do not bind their threads to the same cores (vLLM's ``auto`` binds every
    engine alike). None for every engine when ``n`` is 1 or there are fewer CPUs than engines (vLLM's default)."""
    ids = sorted(os.sched_getaffinity(0)) if cpus is None else list(cpus)
    if n <= 1 or len(ids) < n:
        return [None] * n
    size, extra = divmod(len(ids), n)
    groups: list[str | None] = []
    start = 0
    for h in range(n):
        end = start + size + (1 if h < extra else 0)
        groups.append(",".join(map(str, ids[start:end])))
        start = end
    return groups


class EngineGroup:
    """``n`` vLLM engine processes of one method, generating like one engine (``generate``: dealt, joined, summed).

    Args:
        model, method, k, log: as ``VllmEngineProcess``.
        n: engines.
        env: extra environment of every engine.
        per_engine_env: extra environment of each engine (its own stats file, say); ``n`` mappings or None.
    """

    def __init__(self, model: str, method: str, k: int, n: int = 1, env: Mapping[str, str] | None = None,
                 per_engine_env: Sequence[Mapping[str, str]] | None = None, log: TextIO | None = None) -> None:
        own = list(per_engine_env) if per_engine_env is not None else [{}] * n
        if len(own) != n:
            raise ValueError(f"{len(own)} per-engine environments for {n} engines")
        self.engines: list[VllmEngineProcess] = []
        try:
            for i, bind in enumerate(cpu_binds(n)):
                extra = {} if n == 1 else {"VLLM_CPU_KVCACHE_SPACE": os.environ.get("VLLM_CPU_KVCACHE_SPACE",
                                                                                    REPLICA_KVCACHE_GIB)}
                if bind is not None and "VLLM_CPU_OMP_THREADS_BIND" not in os.environ:
                    extra["VLLM_CPU_OMP_THREADS_BIND"] = bind
                # one after the other: vLLM's CPU worker checks free memory at start-up
                self.engines.append(VllmEngineProcess(model, method, k, env={**(env or {}), **extra, **own[i]},
                                                      log=log))
        except BaseException:
            self.close()
            raise
        self.startup_seconds = sum(e.startup_seconds for e in self.engines)
        self._last = [dict.fromkeys(COUNTERS, 0.0) for _ in self.engines]

    def generate(self, prompts: Sequence[Sequence[int]], max_tokens: int) -> Generation:
        """Greedy outputs of ``prompts`` in their order, prompt ``i`` generated by engine ``i % n``, all engines at
        once; counters summed over the engines (an engine dealt nothing adds its last ones)."""
        hands = deal(prompts, len(self.engines))

        def run(i: int) -> Generation:
            if not hands[i]:
                return Generation([], 0.0, dict(self._last[i]))
            return self.engines[i].generate(hands[i], max_tokens)

        with ThreadPoolExecutor(len(self.engines)) as pool:
            generations = list(pool.map(run, range(len(self.engines))))
        self._last = [g.counters for g in generations]
        return combine(generations)

    def close(self) -> None:
        """Stop every engine."""
        for engine in self.engines:
            engine.close()

    def __enter__(self) -> EngineGroup:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

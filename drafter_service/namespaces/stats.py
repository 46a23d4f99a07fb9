"""A namespace's statistics: the counters drafts update, and the figures GetStats and the metrics report."""

from __future__ import annotations

import collections
import itertools
import threading
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from drafter_service.core.batch_steps import StepsOutcome
from drafter_service.core.tree_builder import SOURCE_NAMES


def estimated_speedup(steps: int, tokens: int, step_seconds: float, plain_seconds: float) -> float:
    """Decode rate with drafts over the plain decode rate, from engine-reported step times (0 when undefined).

    Over ``steps`` verification steps that reported both times: ``tokens`` emitted (every token each step
    appended: accepted draft tokens plus the target's own), ``step_seconds`` their summed verification times
    and ``plain_seconds`` the summed plain decode step times reported with them. The speedup is
    ``(tokens / step_seconds) / (1 / mean plain step) = tokens / step_seconds * plain_seconds / steps``.
    """
    if steps <= 0 or step_seconds <= 0.0:
        return 0.0
    return tokens / step_seconds * (plain_seconds / steps)


@dataclass
class DraftCounters:
    """Draft statistics of a namespace since the service started (cumulative; the rollup takes differences).

    ``drafted_by_source`` counts served nodes by the source that proposed them (their sum is ``drafted_tokens``,
    "unspecified" for nodes without a source name); ``confirmed_by_source`` counts the confirmed ones the same
    way (sum ``confirmed_tokens``). ``accepted_steps`` counts the Draft calls (report-only ones included) that
    carried accepted tokens and ``accepted_tokens`` sums their lengths: each is one verification step and the
    tokens it emitted, so their ratio is the mean accepted length, right even when the engine verified only part
    of a served tree or drafted from an earlier one. ``speedup_*`` sum the steps that reported both
    ``step_seconds`` and ``plain_step_seconds`` (see ``estimated_speedup``).
    """

    drafts: int = 0
    drafted_tokens: int = 0
    scored_steps: int = 0
    confirmed_tokens: int = 0
    reused_steps: int = 0
    reported_steps: int = 0
    step_seconds_total: float = 0.0
    accepted_steps: int = 0
    accepted_tokens: int = 0
    drafted_by_source: dict[str, int] = field(default_factory=dict)
    confirmed_by_source: dict[str, int] = field(default_factory=dict)
    speedup_steps: int = 0
    speedup_tokens: int = 0
    speedup_step_seconds: float = 0.0
    speedup_plain_seconds: float = 0.0
    latencies_ns: collections.deque = field(default_factory=lambda: collections.deque(maxlen=8192))
    lock: threading.Lock = field(default_factory=threading.Lock, repr=False, compare=False)

    def percentile_us(self, q: float) -> float:
        """Latency percentile of the recent drafts, in microseconds (0 when none)."""
        return float(np.percentile(np.fromiter(self.latencies_ns, dtype=np.int64), q)) / 1e3 \
            if self.latencies_ns else 0.0

    @staticmethod
    def count_sources(into: dict[str, int], sources: Sequence[str], n: int) -> None:
        """Add ``n`` nodes whose source names are ``sources`` (one per node; missing ones "unspecified")."""
        if n <= 0:
            return
        named = min(n, len(sources))
        for i in range(named):  # a plain loop: this runs for every draft
            name = sources[i] or "unspecified"
            into[name] = into.get(name, 0) + 1
        if n > named:
            into["unspecified"] = into.get("unspecified", 0) + n - named

    def record_step(self, tokens: int, step_seconds: float, plain_step_seconds: float) -> None:
        """Count a step that appended ``tokens`` and reported its verification and plain step times (0: not)."""
        if tokens:
            self.accepted_steps += 1
            self.accepted_tokens += tokens
        if step_seconds > 0:
            self.reported_steps += 1
            self.step_seconds_total += step_seconds
            if plain_step_seconds > 0 and tokens:
                self.speedup_steps += 1
                self.speedup_tokens += tokens
                self.speedup_step_seconds += step_seconds
                self.speedup_plain_seconds += plain_step_seconds

    def record_batch(self, offsets: Sequence[int], report: Sequence[bool], out: StepsOutcome, step_seconds: float,
                     plain_step_seconds: float) -> None:
        """Count a batched step at once, as ``record_step`` and the per-draft counts would count its sessions one
        by one (session i appended ``offsets[i + 1] - offsets[i]`` tokens; ``report`` marks the report-only ones)."""
        lengths = [hi - lo for lo, hi in itertools.pairwise(offsets)]
        appended = [k for k in lengths if k]
        drafted = [i for i, r in enumerate(report) if not r]
        with self.lock:
            self.accepted_steps += len(appended)
            self.accepted_tokens += sum(appended)
            if step_seconds > 0:
                self.reported_steps += len(lengths)
                self.step_seconds_total += step_seconds * len(lengths)
                if plain_step_seconds > 0 and appended:
                    self.speedup_steps += len(appended)
                    self.speedup_tokens += sum(appended)
                    self.speedup_step_seconds += step_seconds * len(appended)
                    self.speedup_plain_seconds += plain_step_seconds * len(appended)
            self.reused_steps += len(lengths) - len(drafted)
            self.drafts += len(drafted)
            self.drafted_tokens += out.offsets[-1]
            self.scored_steps += sum(1 for i in drafted if lengths[i])
            self.confirmed_tokens += sum(out.confirmed)
            self.latencies_ns.extend(out.latencies_ns[drafted].tolist() if len(drafted) < len(lengths)
                                     else out.latencies_ns.tolist())
            for into, counts in ((self.drafted_by_source, out.drafted_by_kind),
                                 (self.confirmed_by_source, out.confirmed_by_kind)):
                for name, n in zip(SOURCE_NAMES, counts, strict=True):
                    if n:
                        into[name] = into.get(name, 0) + n

    @property
    def mean_accepted_length(self) -> float:
        """Tokens emitted per verification step (accepted draft tokens plus the target's own); 0 before any."""
        return self.accepted_tokens / self.accepted_steps if self.accepted_steps else 0.0

    @property
    def estimated_speedup(self) -> float:
        """``estimated_speedup`` over every step since the start."""
        return estimated_speedup(self.speedup_steps, self.speedup_tokens, self.speedup_step_seconds,
                                 self.speedup_plain_seconds)

    def snapshot(self) -> dict[str, object]:
        """A copy of the cumulative counters (for the metrics rollup); latencies are not included."""
        return {"drafts": self.drafts, "drafted_tokens": self.drafted_tokens, "scored_steps": self.scored_steps,
                "confirmed_tokens": self.confirmed_tokens, "reused_steps": self.reused_steps,
                "reported_steps": self.reported_steps, "step_seconds_total": self.step_seconds_total,
                "accepted_steps": self.accepted_steps, "accepted_tokens": self.accepted_tokens,
                "drafted_by_source": dict(self.drafted_by_source),
                "confirmed_by_source": dict(self.confirmed_by_source), "speedup_steps": self.speedup_steps,
                "speedup_tokens": self.speedup_tokens, "speedup_step_seconds": self.speedup_step_seconds,
                "speedup_plain_seconds": self.speedup_plain_seconds}


@dataclass(frozen=True)
class NamespaceStats:
    """A namespace's figures at one moment, as GetStats returns them (one field per GetStatsResponse field).

    Sizes are of the in-memory store; counters are since the service started (see ``DraftCounters``).
    """

    namespace: str
    vocab_size: int
    stored_tokens: int
    stored_requests: int
    indexed_tokens: int
    unindexed_tokens: int
    memory_bytes: int
    index_age_seconds: float
    dynamic_leaders: int
    frozen_tables: list[str]
    active_sessions: int
    drafts: int
    drafted_tokens: int
    confirmed_tokens: int
    mean_accepted_length: float
    draft_latency_p50_us: float
    draft_latency_p99_us: float
    persistence_healthy: bool
    reported_steps: int
    mean_step_ms: float
    speedup_steps: int
    estimated_speedup: float
    drafted_by_source: dict[str, int]
    confirmed_by_source: dict[str, int]
    reused_steps: int
    repeat_hits: int
    draft_model_sessions: int
    draft_model_steps: int
    draft_model_hits: int
    draft_model_verdict: str = ""
    draft_model_served: bool = False
    draft_model_ratio: float = 0.0
    spooled_requests: int = 0
    redis_replicas_connected: int = 0
    redis_replica_acks: int = 0
    persistence_detail: str = ""

"""Metric history: a point per namespace per interval (counter deltas, derived rates, gauges), kept in Redis."""

from __future__ import annotations

import collections
import logging
import threading
import time
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING

import numpy as np

from drafter_service.namespaces.stats import estimated_speedup

if TYPE_CHECKING:
    from drafter_service.namespaces.namespace import Namespace
    from drafter_service.service.service import DrafterService

logger = logging.getLogger(__name__)

__all__ = ["MetricsRollup", "make_point", "merge_points", "downsample", "DELTA_KEYS", "SOURCE_KEYS"]

DELTA_KEYS = ("drafts", "drafted_tokens", "confirmed_tokens", "scored_steps", "reused_steps", "reported_steps",
              "accepted_steps", "accepted_tokens", "speedup_steps", "speedup_tokens", "speedup_step_seconds",
              "speedup_plain_seconds")
"""Cumulative counters (``DraftCounters.snapshot()``) whose change over the interval each point holds."""
SOURCE_KEYS = ("drafted_by_source", "confirmed_by_source")
"""Per-source counters, held as {source: change over the interval} (sources that did not change left out)."""
GAUGE_KEYS = (("stored_tokens", "stored_tokens"), ("stored_requests", "stored_requests"),
              ("memory_bytes", "memory_bytes"), ("index_age_seconds", "index_age_s"),
              ("active_sessions", "active_sessions"), ("persistence_healthy", "healthy"))
"""(``NamespaceStats`` field, point key) of the values taken as they are at the point's time."""


def _ratio(num: float, den: float) -> float | None:
    return num / den if den else None


def derive(point: dict) -> dict:
    """Fill a point's rates from its deltas (None where a rate has no steps to come from).

    drafts_per_s = drafts / interval_s; mat = accepted_tokens / accepted_steps; acceptance =
    confirmed_tokens / drafted_tokens, and per source in ``acceptance_by_source``; speedup =
    ``estimated_speedup`` over the interval's speedup steps.
    """
    point["drafts_per_s"] = point["drafts"] / point["interval_s"] if point["interval_s"] > 0 else 0.0
    point["mat"] = _ratio(point["accepted_tokens"], point["accepted_steps"])
    point["acceptance"] = _ratio(point["confirmed_tokens"], point["drafted_tokens"])
    confirmed = point["confirmed_by_source"]
    point["acceptance_by_source"] = {src: confirmed.get(src, 0) / n
                                     for src, n in sorted(point["drafted_by_source"].items()) if n > 0}
    point["speedup"] = estimated_speedup(point["speedup_steps"], point["speedup_tokens"],
                                         point["speedup_step_seconds"], point["speedup_plain_seconds"]) or None
    return point


def make_point(namespace: str, t_ms: int, interval_s: float, before: dict, after: dict,
               latencies_ns: Sequence[int], gauges: Mapping[str, object]) -> dict:
    """One metric point: what changed between two counter snapshots, the derived rates, and the gauges now.

    Args:
        namespace: whose point it is.
        t_ms: wall-clock time of the point, in ms since the epoch.
        interval_s: seconds between the two snapshots.
        before, after: ``DraftCounters.snapshot()`` at the start and end of the interval.
        latencies_ns: latencies of the drafts served in the interval (for p50 and p99; None when empty).
        gauges: the ``NamespaceStats`` fields of ``GAUGE_KEYS`` at the end of the interval.

    Returns:
        A JSON-serialisable dict (fields: t, namespace, interval_s, the ``DELTA_KEYS``, the ``SOURCE_KEYS``,
        drafts_per_s, mat, acceptance, acceptance_by_source, speedup, latency_p50_us, latency_p99_us, and the
        gauges stored_tokens, stored_requests, memory_bytes, index_age_s, active_sessions, healthy).
    """
    point: dict = {"t": int(t_ms), "namespace": namespace, "interval_s": float(interval_s)}
    for key in DELTA_KEYS:
        point[key] = after[key] - before[key]
    for key in SOURCE_KEYS:
        old, new = before[key], after[key]
        point[key] = {src: n - old.get(src, 0) for src, n in sorted(new.items()) if n != old.get(src, 0)}
    lat = np.asarray(latencies_ns, dtype=np.int64)  # (k,) ns
    point["latency_p50_us"] = float(np.percentile(lat, 50)) / 1e3 if lat.size else None
    point["latency_p99_us"] = float(np.percentile(lat, 99)) / 1e3 if lat.size else None
    for key, name in GAUGE_KEYS:
        value = gauges.get(key, 0)
        point[name] = bool(value) if name == "healthy" else value
    return derive(point)


def merge_points(points: Sequence[dict]) -> dict:
    """Consecutive points as one: deltas summed, rates derived again, gauges from the last point.

    Latency: p50 is the drafts-weighted mean of the parts' p50 and p99 the largest part's p99 (an upper bound;
    exact quantiles would need the raw latencies).
    """
    if len(points) == 1:
        return dict(points[0])
    last = points[-1]
    merged: dict = {"t": last["t"], "namespace": last.get("namespace", ""),
                    "interval_s": sum(p["interval_s"] for p in points)}
    for key in DELTA_KEYS:
        merged[key] = sum(p[key] for p in points)
    for key in SOURCE_KEYS:
        total: dict[str, int] = {}
        for p in points:
            for src, n in p[key].items():
                total[src] = total.get(src, 0) + n
        merged[key] = dict(sorted(total.items()))
    timed = [p for p in points if p.get("latency_p50_us") is not None]
    weight = sum(max(p["drafts"], 1) for p in timed)
    merged["latency_p50_us"] = (sum(p["latency_p50_us"] * max(p["drafts"], 1) for p in timed) / weight
                                if timed else None)
    merged["latency_p99_us"] = max((p["latency_p99_us"] for p in timed), default=None)
    for _, name in GAUGE_KEYS:
        merged[name] = last.get(name)
    merged["healthy"] = all(bool(p.get("healthy")) for p in points)
    return derive(merged)


def downsample(points: Sequence[dict], max_points: int) -> list[dict]:
    """At most ``max_points`` points: runs of consecutive points merged (``merge_points``), newest run last."""
    if max_points <= 0 or len(points) <= max_points:
        return list(points)
    size = -(-len(points) // max_points)
    first = len(points) % size or size  # the oldest run is the short one, so the newest runs stay whole
    runs = [points[:first]] + [points[i:i + size] for i in range(first, len(points), size)]
    return [merge_points(run) for run in runs]


class MetricsRollup:
    """Takes a point per namespace on every ``roll`` and appends it to the namespace's Redis stream.

    Points also stay in memory (the newest ``keep_in_memory`` per namespace), which serve the history for a
    namespace without persistence and while its Redis is away. A point Redis does not take is dropped from the
    durable history with a logged warning; serving is not affected, and the point records ``healthy: false``.
    """

    def __init__(self, service: DrafterService, keep_in_memory: int = 2048) -> None:
        self.service = service
        self.dropped = 0
        self._lock = threading.Lock()
        self._recent: dict[str, collections.deque] = {}
        self._last: dict[str, tuple[float, dict]] = {}
        for name, ns in service.namespaces.items():
            self._recent[name] = collections.deque(maxlen=keep_in_memory)
            self._last[name] = (time.monotonic(), _counters(ns)[0])

    def roll(self) -> list[dict]:
        """Take and store one point per namespace; returns them (the background job's body)."""
        with self._lock:  # one roll at a time: each interval is counted once
            return [self._roll_one(name, ns) for name, ns in self.service.namespaces.items()]

    def _roll_one(self, name: str, ns: Namespace) -> dict:
        stats = ns.stats()
        now = time.monotonic()
        after, latencies = _counters(ns)
        start, before = self._last[name]
        self._last[name] = (now, after)
        drafts = after["drafts"] - before["drafts"]
        point = make_point(name, int(time.time() * 1000), now - start, before, after,
                           latencies[-drafts:] if drafts > 0 else [],
                           {key: getattr(stats, key) for key, _ in GAUGE_KEYS})
        if ns.log.follower is not None:  # several replicas append to the same history: each point says whose it is
            point["replica"] = ns.log.follower.replica_id
        if ns.persistence is not None:
            try:
                point["t"] = ns.persistence.append_metric_point(point)
            except Exception as exc:  # the durable history misses this point; serving goes on
                self.dropped += 1
                point["healthy"] = False
                logger.warning("namespace %s: metric point dropped, Redis did not take it (%d dropped so far): %s",
                               name, self.dropped, exc)
        self._recent[name].append(point)
        return point

    def series(self, namespace: str, since_ms: int = 0, limit: int = 10000) -> list[dict]:
        """The newest ``limit`` points of a namespace after ``since_ms`` (exclusive), oldest first.

        From Redis when the namespace has it (so history from before a restart is included), else from memory.

        Raises:
            KeyError: unknown namespace.
        """
        ns = self.service.namespaces[namespace]
        if ns.persistence is not None:
            try:
                return ns.persistence.read_metric_points(since_ms, limit)
            except Exception as exc:
                logger.warning("namespace %s: metric history unreadable, serving the points in memory: %s",
                               namespace, exc)
        return [p for p in list(self._recent[namespace]) if p["t"] > since_ms][-limit:] if limit > 0 else []


def _counters(ns: Namespace) -> tuple[dict, list[int]]:
    """A consistent copy of a namespace's cumulative counters and its recent draft latencies (ns)."""
    c = ns.counters
    with c.lock:
        return c.snapshot(), list(c.latencies_ns)

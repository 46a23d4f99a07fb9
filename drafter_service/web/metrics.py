"""Prometheus export: a custom collector that turns every namespace's statistics into metric families."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from dataclasses import asdict
from typing import TYPE_CHECKING, Any

from prometheus_client import CollectorRegistry
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.exposition import CONTENT_TYPE_LATEST, generate_latest
from prometheus_client.registry import Collector

if TYPE_CHECKING:
    from drafter_service.service.service import DrafterService

logger = logging.getLogger(__name__)

__all__ = ["CONTENT_TYPE_LATEST", "DrafterCollector", "acceptance_rate", "exposition", "metrics_registry"]

_COUNTERS = (  # (stats key, metric name without _total, help)
    ("drafts", "drafter_drafts", "Draft trees served (report-only steps excluded)."),
    ("drafted_tokens", "drafter_drafted_tokens", "Draft tree nodes served."),
    ("confirmed_tokens", "drafter_confirmed_tokens", "Served draft nodes that the next accepted tokens confirmed."),
    ("reported_steps", "drafter_reported_steps", "Verification steps whose time the engine reported."),
    ("accepted_steps", "drafter_accepted_steps", "Verification steps reported with their accepted tokens."),
    ("accepted_tokens", "drafter_accepted_tokens", "Tokens those steps emitted (accepted drafts + the target's)."),
    ("reused_steps", "drafter_reused_steps", "Report-only steps (the engine drafted from an earlier tree)."),
    ("speedup_steps", "drafter_speedup_steps", "Steps that reported both their time and the plain decode time."),
    ("draft_model_steps", "drafter_draft_model_steps", "Verification steps of drafts holding draft-model nodes."),
    ("draft_model_hits", "drafter_draft_model_hits", "Draft-model steps whose accepted tokens all lay in its cache."),
)
_GAUGES = (  # (stats key, metric name, help)
    ("mean_accepted_length", "drafter_mean_accepted_length",
     "Tokens emitted per verification step: accepted draft tokens plus the target's own (MAT)."),
    ("estimated_speedup", "drafter_estimated_speedup",
     "Tokens per second with drafts over the plain decode rate, from engine-reported step times."),
    ("mean_step_ms", "drafter_mean_step_milliseconds", "Mean engine-reported verification step time."),
    ("stored_tokens", "drafter_store_tokens", "Tokens held in the ring buffer."),
    ("stored_requests", "drafter_store_requests", "Requests held in the ring buffer."),
    ("indexed_tokens", "drafter_store_indexed_tokens", "Tokens covered by the suffix indexes."),
    ("unindexed_tokens", "drafter_store_unindexed_tokens", "Tokens not indexed yet."),
    ("memory_bytes", "drafter_store_memory_bytes", "Bytes held by the ring buffer and its indexes."),
    ("index_age_seconds", "drafter_index_age_seconds", "Seconds since the suffix index was last rebuilt."),
    ("dynamic_leaders", "drafter_dynamic_leaders", "Leaders held by the dynamic n-gram table."),
    ("active_sessions", "drafter_active_sessions", "Live sessions."),
    ("draft_model_sessions", "drafter_draft_model_sessions", "Sessions whose draft-model cache is running."),
    ("draft_model_served", "drafter_draft_model_served", "1 while the draft model gate serves the model's nodes."),
    ("draft_model_ratio", "drafter_draft_model_ratio",
     "The gate's estimate of tokens per second with the draft model's nodes over without them."),
    ("spooled_requests", "drafter_spooled_requests", "Acknowledged requests held in the local spool until Redis "
     "takes them."),
    ("spooled_bytes", "drafter_spooled_bytes", "Bytes of the requests held in the local spool."),
    ("redis_replicas_connected", "drafter_redis_replicas_connected",
     "Replicas of the namespace's Redis primary online at the last check."),
    ("redis_replica_acks", "drafter_redis_replica_acks",
     "Replicas each stored request waits for (--redis-replica-acks); while fewer are online, requests spool."),
)


def acceptance_rate(stats: dict) -> float:
    """Confirmed over drafted tokens (0 when nothing was drafted)."""
    drafted = int(stats.get("drafted_tokens", 0))
    return int(stats.get("confirmed_tokens", 0)) / drafted if drafted else 0.0


class DrafterCollector(Collector):
    """Collects one sample per namespace (label ``namespace``) of each metric at scrape time.

    It only reads ``Namespace.stats()`` and the namespace's cumulative counters (``DraftCounters.snapshot()``):
    counting stays in the statistics layer, this is the export layer.
    A namespace whose statistics fail is skipped with a logged error; the others are still exported.
    """

    def __init__(self, service: DrafterService) -> None:
        self.service = service

    def describe(self) -> list[Metric]:
        """Nothing up front: the registry then does not collect at registration."""
        return []

    def collect(self) -> Iterator[Metric]:
        """Metric families over every namespace."""
        figures = []
        for name, ns in list(self.service.namespaces.items()):
            try:
                with ns.counters.lock:
                    counters = ns.counters.snapshot()
                spooled = ns.spool.stats() if ns.spool is not None else {}
                figures.append((name, {**counters, **asdict(ns.stats()), **spooled}))
            except Exception:
                logger.exception("namespace %s: statistics failed; left out of /metrics", name)
        yield from _families(figures)
        yield from _follower_families(self.service)


def _families(figures: list[tuple[str, dict]]) -> Iterator[Metric]:
    ns_label = ["namespace"]
    for key, name, doc in _COUNTERS:
        counter = CounterMetricFamily(name, doc, labels=ns_label)
        for ns, stats in figures:
            counter.add_metric([ns], float(stats.get(key, 0)))
        yield counter
    for key, name, doc in _GAUGES:
        gauge = GaugeMetricFamily(name, doc, labels=ns_label)
        for ns, stats in figures:
            gauge.add_metric([ns], float(stats.get(key, 0)))
        yield gauge
    rate = GaugeMetricFamily("drafter_acceptance_rate", "Confirmed over drafted tokens since the start.",
                             labels=ns_label)
    healthy = GaugeMetricFamily("drafter_persistence_healthy", "1 when the namespace's Redis answers and its spool "
                                "holds nothing, else 0.",
                                labels=ns_label)
    latency = GaugeMetricFamily("drafter_draft_latency_seconds", "Draft latency quantiles over recent drafts.",
                                labels=["namespace", "quantile"])
    drafted = CounterMetricFamily("drafter_source_drafted_tokens", "Draft nodes served, by the source that "
                                  "proposed them.", labels=["namespace", "source"])
    confirmed = CounterMetricFamily("drafter_source_confirmed_tokens", "Confirmed draft nodes, by the source "
                                    "that proposed them.", labels=["namespace", "source"])
    for ns, stats in figures:
        rate.add_metric([ns], acceptance_rate(stats))
        healthy.add_metric([ns], 1.0 if stats.get("persistence_healthy") else 0.0)
        latency.add_metric([ns, "0.5"], float(stats.get("draft_latency_p50_us", 0.0)) / 1e6)
        latency.add_metric([ns, "0.99"], float(stats.get("draft_latency_p99_us", 0.0)) / 1e6)
        for source, n in sorted(dict(stats.get("drafted_by_source") or {}).items()):
            drafted.add_metric([ns, source], float(n))
        for source, n in sorted(dict(stats.get("confirmed_by_source") or {}).items()):
            confirmed.add_metric([ns, source], float(n))
    yield from (rate, healthy, latency, drafted, confirmed)


def _follower_families(service: DrafterService) -> Iterator[Metric]:
    """Log following of a replica that shares its Redis with others (nothing when it does not follow)."""
    followers: list[tuple[str, dict[str, Any]]] = [(name, ns.log.follower.stats())
                                                   for name, ns in list(service.namespaces.items())
                                                   if ns.log.follower is not None]
    if not followers:
        return
    info = GaugeMetricFamily("drafter_replica_info", "This replica's id (value 1).", labels=["replica"])
    info.add_metric([str(followers[0][1]["replica"])], 1.0)
    applied = CounterMetricFamily("drafter_follower_applied_requests", "Requests other replicas logged that "
                                  "this replica applied to its store.", labels=["namespace"])
    skipped = CounterMetricFamily("drafter_follower_trimmed_slots", "Ring slots of the request log trimmed "
                                  "before this replica read them.", labels=["namespace"])
    connected = GaugeMetricFamily("drafter_follower_connected", "1 while the log follower reaches Redis.",
                                  labels=["namespace"])
    for name, stats in followers:
        applied.add_metric([name], float(stats["applied"]))
        skipped.add_metric([name], float(stats["skipped_slots"]))
        connected.add_metric([name], 1.0 if stats["connected"] else 0.0)
    yield from (info, applied, skipped, connected)


def metrics_registry(service: DrafterService) -> CollectorRegistry:
    """A registry of its own (not prometheus_client's global one) holding a ``DrafterCollector``."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(DrafterCollector(service))
    return registry


def exposition(registry: CollectorRegistry) -> bytes:
    """The registry in the Prometheus text exposition format (``CONTENT_TYPE_LATEST``)."""
    return generate_latest(registry)

"""Persistence health: drain spools into Redis as soon as it takes writes, report degraded in health checks."""

from __future__ import annotations

import logging
import threading
from typing import TYPE_CHECKING

from grpc_health.v1 import health, health_pb2

from drafter_service.rpc.server import PERSISTENCE_HEALTH

if TYPE_CHECKING:
    from drafter_service.service.service import DrafterService

logger = logging.getLogger(__name__)

_SERVING, _NOT_SERVING = health_pb2.HealthCheckResponse.SERVING, health_pb2.HealthCheckResponse.NOT_SERVING

RETRY_S = 0.2
"""Seconds between checks while persistence is degraded (Redis away, too few replicas, requests spooled)."""


class PersistenceHealth:
    """The persistence check, on a thread of its own: move spooled requests to Redis, then publish the health.

    It checks every ``interval_s`` seconds while persistence is healthy, every ``RETRY_S`` (at most
    ``interval_s``) while it is not, and at once when a spool starts holding requests (``SpoolingLog.on_hold``),
    so the spool drains within a fraction of a second of Redis taking writes again (a promoted primary, a
    replica back online). Each check asks every namespace's Redis afresh (``ServerAcks.check_server``); health
    reports, statistics and metrics read what it found instead of waiting on Redis.

    The gRPC health status of ``PERSISTENCE_HEALTH`` ("drafter.v1.Drafter/persistence") is SERVING when every
    namespace's Redis answers with enough replicas and no spool holds requests, NOT_SERVING otherwise;
    "drafter.v1.Drafter" itself stays SERVING, since drafts are served from memory either way.
    """

    def __init__(self, service: DrafterService, servicer: health.HealthServicer | None = None,
                 interval_s: float = 1.0) -> None:
        self.service = service
        self.servicer = servicer
        self.interval_s = float(interval_s)
        self.healthy = True
        self._failing: set[str] = set()
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        for ns in service.namespaces.values():
            if ns.spool is not None:
                ns.spool.on_hold = self.wake

    def start(self) -> PersistenceHealth:
        """Check now, then keep checking on a daemon thread until ``close``."""
        self._thread = threading.Thread(target=self._run, name="persistence-health", daemon=True)
        self._thread.start()
        return self

    def wake(self) -> None:
        """Check at once (a spool has just started holding requests); never blocks."""
        self._wake.set()

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                healthy = self.check()
            except Exception:  # retried at the next check
                logger.exception("persistence health check failed")
                healthy = False
            self._wake.wait(self.interval_s if healthy else min(self.interval_s, RETRY_S))
            self._wake.clear()

    def check(self) -> bool:
        """Drain every spool that holds requests (when Redis takes them), ask every namespace's Redis how it is,
        then update the status; returns it."""
        for name, ns in self.service.namespaces.items():
            if ns.spool is not None:
                try:
                    ns.spool.drain()
                    self._failing.discard(name)
                except Exception as exc:  # retried at the next check
                    if name not in self._failing:
                        logger.warning("namespace %s: moving spooled requests to Redis failed (%s); retrying", name,
                                       exc)
                    self._failing.add(name)
            if ns.persistence is not None:
                ns.persistence.check_server()
        statuses = {name: ns.persistence_status() for name, ns in self.service.namespaces.items()}
        healthy = all(status.healthy for status in statuses.values())
        if healthy != self.healthy:
            if healthy:
                logger.info("persistence healthy again")
            else:
                logger.warning("persistence degraded: drafts are served from memory, requests are spooled (%s)",
                               "; ".join(f"{name}: {s.detail}" for name, s in statuses.items() if not s.healthy))
        self.healthy = healthy
        if self.servicer is not None:
            self.servicer.set(PERSISTENCE_HEALTH, _SERVING if healthy else _NOT_SERVING)
        return healthy

    def close(self) -> None:
        """At shut-down: stop the thread, then a last drain; spools with nothing held are deleted (others wait for
        the next start)."""
        self._stop.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout=30)
        for ns in self.service.namespaces.values():
            if ns.spool is not None:
                ns.spool.close()

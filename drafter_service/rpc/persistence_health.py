"""Persistence health: drain spools into Redis, report degraded in gRPC health checks and /healthz."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from grpc_health.v1 import health, health_pb2

from drafter_service.rpc.server import PERSISTENCE_HEALTH

if TYPE_CHECKING:
    from drafter_service.service.service import DrafterService

logger = logging.getLogger(__name__)

_SERVING, _NOT_SERVING = health_pb2.HealthCheckResponse.SERVING, health_pb2.HealthCheckResponse.NOT_SERVING


class PersistenceHealth:
    """The background check: move spooled requests to Redis, then publish whether persistence is healthy.

    The gRPC health status of ``PERSISTENCE_HEALTH`` ("drafter.v1.Drafter/persistence") is SERVING when every
    namespace's Redis answers and no spool holds requests, NOT_SERVING otherwise; "drafter.v1.Drafter" itself
    stays SERVING, since drafts are served from memory either way.
    """

    def __init__(self, service: DrafterService, servicer: health.HealthServicer | None = None) -> None:
        self.service = service
        self.servicer = servicer
        self.healthy = True
        self._failing: set[str] = set()

    def check(self) -> bool:
        """Drain every spool that holds requests (when Redis answers), then update the status; returns it."""
        for name, ns in self.service.namespaces.items():
            if ns.spool is None:
                continue
            try:
                ns.spool.drain()
                self._failing.discard(name)
            except Exception as exc:  # retried at the next check
                if name not in self._failing:
                    logger.warning("namespace %s: moving spooled requests to Redis failed (%s); retrying", name,
                                   exc)
                self._failing.add(name)
        healthy = all(ns.persistence_ok() for ns in self.service.namespaces.values())
        if healthy != self.healthy:
            if healthy:
                logger.info("persistence healthy again")
            else:
                logger.warning("persistence degraded: drafts are served from memory, requests are spooled")
        self.healthy = healthy
        if self.servicer is not None:
            self.servicer.set(PERSISTENCE_HEALTH, _SERVING if healthy else _NOT_SERVING)
        return healthy

    def close(self) -> None:
        """At shut-down: a last drain, then spools with nothing held are deleted (others wait for the next start)."""
        for ns in self.service.namespaces.values():
            if ns.spool is not None:
                ns.spool.close()

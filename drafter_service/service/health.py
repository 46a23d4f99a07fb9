"""The health of a service as /healthz reports it: whether every namespace's persistence is healthy, and why not."""

from __future__ import annotations

from drafter_service.service.service import DrafterService


def health_report(service: DrafterService) -> dict[str, object]:
    """The body of /healthz (read from the last persistence check: it does not wait on Redis).

    ``status`` is "ok", or "degraded" while some namespace's Redis does not answer, has fewer replicas online than
    each stored request waits for, or holds acknowledged requests in its spool (drafts are still served from
    memory). Per namespace: ``persistence_healthy``, ``spooled_requests``, ``redis_replicas_connected``,
    ``redis_replica_acks`` and ``persistence_detail`` (why degraded; "" when healthy).
    """
    statuses = {name: ns.persistence_status() for name, ns in service.namespaces.items()}
    return {"status": "ok" if all(s.healthy for s in statuses.values()) else "degraded",
            "persistence_healthy": {name: s.healthy for name, s in statuses.items()},
            "spooled_requests": {name: s.spooled_requests for name, s in statuses.items()},
            "redis_replicas_connected": {name: s.replicas_connected for name, s in statuses.items()},
            "redis_replica_acks": {name: s.replica_acks for name, s in statuses.items()},
            "persistence_detail": {name: s.detail for name, s in statuses.items()}}

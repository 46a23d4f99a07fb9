"""The health of a service as /healthz reports it: whether every namespace's persistence is healthy."""

from __future__ import annotations

from drafter_service.service.service import DrafterService


def health_report(service: DrafterService) -> dict[str, object]:
    """The body of /healthz.

    ``status`` is "ok", or "degraded" while some namespace's Redis does not answer or holds acknowledged
    requests in its spool (drafts are still served from memory); ``persistence_healthy`` and
    ``spooled_requests`` are per namespace.
    """
    healthy = {name: ns.persistence_ok() for name, ns in service.namespaces.items()}
    spooled = {name: ns.spool.held if ns.spool is not None else 0 for name, ns in service.namespaces.items()}
    return {"status": "ok" if all(healthy.values()) else "degraded", "persistence_healthy": healthy,
            "spooled_requests": spooled}

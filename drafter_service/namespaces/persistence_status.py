"""A namespace's persistence as health reports, statistics and metrics show it, without waiting on Redis."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from drafter_service.namespaces.spooling import SpoolingLog
    from store.persistence import RedisPersistence

STATE_MAX_AGE_S = 3.0
"""How old the last check of Redis may be before a status asks Redis again (the service's health thread checks far
more often, so a status is read from memory)."""


@dataclass(frozen=True)
class PersistenceStatus:
    """Whether a namespace's completed requests go straight to Redis, and if not, why.

    Attributes:
        healthy: Redis answers with enough replicas online and no request waits in the spool.
        replicas_connected: replicas of the Redis primary online at the last check (0 when it did not answer).
        replica_acks: the replicas each append waits for (``--redis-replica-acks``).
        spooled_requests: acknowledged requests waiting in the local spool for Redis.
        detail: why it is not healthy ("" when it is).
    """

    healthy: bool
    replicas_connected: int
    replica_acks: int
    spooled_requests: int
    detail: str


HEALTHY = PersistenceStatus(True, 0, 0, 0, "")
"""The status of a namespace without persistence (memory only)."""


def persistence_status(persistence: RedisPersistence | None, spool: SpoolingLog | None,
                       max_age_s: float = STATE_MAX_AGE_S) -> PersistenceStatus:
    """The status from the last check of Redis (checked again, within the short write timeout, only when that is
    older than ``max_age_s``) and the spool's count."""
    if persistence is None:
        return HEALTHY
    state = persistence.server_state(max_age_s)
    held = spool.held if spool is not None else 0
    problems = [state.problem()] if not state.ok else []
    if held:
        problems.append(f"{held} acknowledged requests wait in the local spool for Redis")
    return PersistenceStatus(healthy=not problems, replicas_connected=state.replicas,
                             replica_acks=state.replica_acks, spooled_requests=held, detail="; ".join(problems))

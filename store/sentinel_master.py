"""Finding the primary that Redis Sentinel names, from the moment a failover promotes it.

redis-py's ``Sentinel.discover_master`` reads ``SENTINEL MASTERS`` and passes over a master that is down. During a
failover that is all it sees: a sentinel reports the promoted replica there only at ``+switch-master``, which the
sentinel that leads the failover reaches after it has reconfigured every other replica (a full resync of one of
them, or the failover timeout), and the others at its next hello message (every 2 s). Meanwhile the client finds no
master at all, although the leader already answers ``SENTINEL GET-MASTER-ADDR-BY-NAME`` with the promoted replica,
as the Sentinel client guidelines have clients ask. ``PromptSentinel`` asks both, so writes reach a promoted replica
as soon as the leader has seen it become a primary.

A connection re-resolves the primary whenever it connects, so after a connection error or a READONLY reply (which
redis-py's ``SentinelManagedConnection`` turns into a connection error, closing the connection) the next command
asks the sentinels again.
"""

from __future__ import annotations

import logging
from typing import Any

from redis.exceptions import ConnectionError, ResponseError, TimeoutError
from redis.sentinel import MasterNotFoundError, Sentinel

logger = logging.getLogger(__name__)


class PromptSentinel(Sentinel):
    """``redis.sentinel.Sentinel`` whose master discovery also follows a failover in progress.

    Each sentinel, in turn, is asked in one round trip for the address it gives clients (``GET-MASTER-ADDR-BY-NAME``)
    and for its view of the master (``SENTINEL MASTER``). An address other than the master's own is a replica this
    sentinel promoted in a failover it leads: it is taken at once. Otherwise the master is taken when this sentinel
    sees it up (redis-py's rule), and passed over when it is down, for the next sentinel to answer.
    """

    def discover_master(self, service_name: str) -> tuple[str, int]:
        """The (host, port) of the primary the sentinels call ``service_name`` now.

        Raises:
            MasterNotFoundError: no sentinel answered with a primary that is up (a ``ConnectionError``, so a
                command that needed a connection fails as if the primary did not answer).
        """
        errors: list[str] = []
        for i, sentinel in enumerate(self.sentinels):
            try:
                pipe = sentinel.pipeline(transaction=False)
                pipe.execute_command("SENTINEL GET-MASTER-ADDR-BY-NAME", service_name)
                pipe.execute_command("SENTINEL MASTER", service_name)
                given, state = pipe.execute()
            except (ConnectionError, TimeoutError, ResponseError) as exc:
                errors.append(f"{sentinel} - {type(exc).__name__}: {exc}")
                continue
            address = _promoted(given, state)
            if address is None and state and self.check_master_state(state, service_name):
                address = (str(state["ip"]), int(state["port"]))
            if address is None:
                continue
            if i:  # the sentinel that knew goes first next time
                self.sentinels[0], self.sentinels[i] = sentinel, self.sentinels[0]
            host = self._force_master_ip if self._force_master_ip is not None else address[0]
            return host, address[1]
        detail = f": {', '.join(errors)}" if errors else ""
        raise MasterNotFoundError(f"No master found for {service_name!r}{detail}")


def _promoted(given: Any, state: Any) -> tuple[str, int] | None:
    """The address a sentinel gives clients when it differs from its master's own (a replica it promoted)."""
    if not given or not state:
        return None
    host, port = given
    address = (host.decode() if isinstance(host, bytes) else str(host), int(port))
    if address == (str(state["ip"]), int(state["port"])):
        return None
    logger.debug("sentinel names %s:%d, promoted in a failover it leads", *address)
    return address

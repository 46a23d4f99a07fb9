"""Which namespace each live session belongs to, per caller scope, and the limits on how many sessions live."""

from __future__ import annotations

import collections
import logging
import threading
from collections.abc import Callable

from drafter_service.api.errors import AlreadyExists, NotFound, ResourceExhausted
from drafter_service.core.session import DraftSession
from drafter_service.namespaces.namespace import Namespace
from drafter_service.service.auth import Caller

logger = logging.getLogger(__name__)


def internal_id(scope: str, session_id: str) -> str:
    """The id a namespace's drafter knows a session by: the caller's id, plus its scope for token holders.

    Session ids hold no NUL (``SessionRoutes.open`` refuses them), so ids of different scopes never collide.
    """
    return f"{session_id}\x00{scope}" if scope else session_id


class SessionRoutes:
    """Live sessions keyed by (caller scope, session id).

    A caller sees only the sessions of its own scope: another tenant's session id is exactly as unknown as one
    that never existed (NOT_FOUND), and opening a session with an id another tenant uses succeeds.

    Args:
        max_sessions: most live sessions over all namespaces and callers.
        max_per_client: most live sessions of one client (``Caller.client``; 0 for no limit).
    """

    def __init__(self, max_sessions: int, max_per_client: int = 0) -> None:
        self.max_sessions = max_sessions
        self.max_per_client = max_per_client
        self._routes: dict[tuple[str, str], tuple[Namespace, DraftSession, str]] = {}  # -> (namespace, session, client)
        self._clients: collections.Counter[str] = collections.Counter()
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._routes)

    def client_sessions(self, client: str) -> int:
        """Live sessions opened by ``client``."""
        return self._clients.get(client, 0)

    def open(self, caller: Caller, session_id: str, ns: Namespace,
             start: Callable[[str], DraftSession]) -> DraftSession:
        """Open a session with ``start(internal id)`` under the lock, and record it; returns the session.

        Raises:
            ResourceExhausted: the service's or the client's session limit is reached.
            AlreadyExists: the caller's scope already has a live session of that id.
        """
        key = (caller.scope, session_id)
        with self._lock:
            if len(self._routes) >= self.max_sessions:
                raise ResourceExhausted(f"{self.max_sessions} sessions are live; end some first")
            if self.max_per_client and self._clients[caller.client] >= self.max_per_client:
                raise ResourceExhausted(f"this client has {self.max_per_client} live sessions, the most one client "
                                        "may hold; end some first")
            if key in self._routes:
                raise AlreadyExists(f"session {session_id!r} already exists")
            sess = start(internal_id(caller.scope, session_id))
            self._routes[key] = (ns, sess, caller.client)
            self._clients[caller.client] += 1
        return sess

    def get(self, caller: Caller, session_id: str) -> tuple[Namespace, DraftSession]:
        """(namespace, session) of one of the caller's live sessions: the only lookup a call makes.

        Raises:
            NotFound: no live session of that id in the caller's scope.
        """
        found = self._routes.get((caller.scope, session_id))
        if found is None:
            raise NotFound(f"unknown session {session_id!r}")
        return found[0], found[1]

    def close(self, caller: Caller, session_id: str) -> None:
        """Forget a session (no error when it is already gone)."""
        key = (caller.scope, session_id)
        with self._lock:
            found = self._routes.pop(key, None)
            if found is None:
                return
            client = found[2]
            self._clients[client] -= 1
            if self._clients[client] <= 0:
                del self._clients[client]

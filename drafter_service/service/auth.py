"""Tenants: who is calling (bearer token or peer address) and which namespaces that caller may use."""

from __future__ import annotations

import hashlib
import hmac
import logging
import secrets
from collections.abc import Iterable
from dataclasses import dataclass

from drafter_service.api.credentials import bearer_token, read_secret
from drafter_service.api.errors import PermissionDenied, Unauthenticated

logger = logging.getLogger(__name__)


def parse_namespace_tokens(text: str) -> tuple[tuple[str, str], ...]:
    """Parse ``NAMESPACE=TOKEN_OR_@FILE[,NAMESPACE=...]`` into (namespace, token) pairs; files are read now.

    Raises:
        ValueError: a malformed entry or an unreadable token file.
    """
    pairs = []
    for part in (p.strip() for p in text.split(",")):
        if not part:
            continue
        name, sep, value = part.partition("=")
        if not sep or not name.strip() or not value.strip():
            raise ValueError(f"bad namespace token entry for {name.strip()!r}: expected NAMESPACE=TOKEN or "
                             "NAMESPACE=@FILE")
        pairs.append((name.strip(), read_secret(value.strip(), f"token of namespace {name.strip()!r}")))
    return tuple(pairs)


def peer_host(peer: str) -> str:
    """A gRPC peer ("ipv4:10.0.0.1:5123", "ipv6:[::1]:5123", "unix:/path") without its port."""
    kind, _, rest = peer.partition(":")
    if kind in ("ipv4", "ipv6") and ":" in rest:
        return f"{kind}:{rest.rpartition(':')[0]}"
    return peer or "unknown"


@dataclass(frozen=True)
class Caller:
    """Who is calling, as far as authorization and limits go.

    Attributes:
        scope: the session scope of the credential ("" without a token): a session is visible only to callers
            of the scope that opened it, so tenants can neither see nor collide with each other's session ids.
        client: identity for per-client limits: the token's scope when one is presented, else the peer host.
        grants: namespaces the token grants; None grants every namespace (the admin token, in-process callers).
        authenticated: whether a valid token was presented.
    """

    scope: str = ""
    client: str = "local"
    grants: frozenset[str] | None = None
    authenticated: bool = False


TRUSTED = Caller(scope="", client="local", grants=None, authenticated=True)
"""In-process callers (the folder-watch job, tests): every namespace, the anonymous session scope."""


class Authorizer:
    """Namespace tokens and the admin token; answers whether a caller may use a namespace.

    Rules (only when some token is configured; otherwise every caller may use every declared namespace):
        * a namespace without a token is open to every caller whose credentials, if any, are valid;
        * a namespace with a token needs ``authorization: Bearer <token>`` with that token or the admin token;
        * an unknown namespace is answered exactly like a protected one the caller may not use, so nobody
          learns which namespaces exist: UNAUTHENTICATED without a (valid) token, PERMISSION_DENIED with one.
          Only the admin token gets NOT_FOUND for it.
    Tokens are compared in constant time (``hmac.compare_digest`` over SHA-256 digests).
    """

    def __init__(self, namespace_tokens: Iterable[tuple[str, str]] = (), admin_token: str = "") -> None:
        grants: dict[str, set[str]] = {}
        for name, token in namespace_tokens:
            grants.setdefault(token, set()).add(name)
        self.protected = frozenset(name for names in grants.values() for name in names)
        self._scope_key = secrets.token_bytes(32)  # scopes mean nothing outside this process
        self._keys: list[tuple[bytes, frozenset[str] | None, str]] = [
            (_digest(token), frozenset(names), self._scope(token)) for token, names in grants.items()]
        if admin_token:
            self._keys.append((_digest(admin_token), None, self._scope(admin_token)))

    @property
    def enabled(self) -> bool:
        """Whether any token is configured."""
        return bool(self._keys)

    def _scope(self, token: str) -> str:
        return "t" + hmac.new(self._scope_key, token.encode(), hashlib.sha256).hexdigest()[:32]

    def caller(self, metadata: Iterable[tuple[str, str | bytes]] | None, peer: str = "") -> Caller:
        """The caller of an RPC from its metadata and peer.

        Raises:
            Unauthenticated: (when tokens are configured) a malformed, repeated or unknown authorization value.
        """
        anonymous = Caller(scope="", client="peer:" + peer_host(peer), grants=frozenset(), authenticated=False)
        if not self.enabled:
            return anonymous
        values = [value for key, value in (metadata or ()) if key.lower() == "authorization"]
        if not values:
            return anonymous
        if len(values) > 1:
            raise Unauthenticated("more than one authorization value")
        found = self.identify(bearer_token(values[0]))
        if found is None:
            raise Unauthenticated("unknown bearer token")
        grants, scope = found
        return Caller(scope=scope, client=scope, grants=grants, authenticated=True)

    def identify(self, token: str) -> tuple[frozenset[str] | None, str] | None:
        """(granted namespaces or None for all, scope) of a token; None when it is not a configured token."""
        digest, match = _digest(token), None
        for key, grants, scope in self._keys:  # every key is compared, so timing tells nothing
            if hmac.compare_digest(key, digest) and match is None:
                match = (grants, scope)
        return match

    def check(self, caller: Caller, namespace: str, exists: bool) -> None:
        """Allow ``caller`` to use ``namespace`` or raise; the caller then looks it up (NOT_FOUND when unknown).

        Raises:
            Unauthenticated: the namespace is protected (or unknown) and the caller has no valid token.
            PermissionDenied: the namespace is protected (or unknown) and the caller's token does not grant it.
        """
        if not self.enabled or caller.grants is None:
            return
        if exists and (namespace not in self.protected or namespace in caller.grants):
            return
        if not caller.authenticated:
            raise Unauthenticated(f"namespace {namespace!r} needs 'authorization: Bearer <token>' with a token "
                                  "that grants it (or it does not exist)")
        raise PermissionDenied(f"this token does not grant namespace {namespace!r} (or it does not exist)")


class HttpAuth:
    """Who may read the HTTP dashboard, its JSON API and /metrics: holders of the HTTP or the admin token.

    Required when an HTTP token is configured or any namespace has a token (the pages show every namespace's
    statistics). /healthz stays open, without namespace details.
    """

    def __init__(self, http_token: str = "", admin_token: str = "", required: bool = False) -> None:
        self.required = bool(required or http_token)
        self._keys = [_digest(t) for t in (http_token, admin_token) if t]

    def allows(self, token: str | None) -> bool:
        """Whether a request presenting ``token`` (None: none) may read protected pages."""
        if not self.required:
            return True
        if not token:
            return False
        digest = _digest(token)
        return sum(hmac.compare_digest(key, digest) for key in self._keys) > 0


def _digest(token: str) -> bytes:
    return hashlib.sha256(token.encode("utf-8", "surrogateescape")).digest()

"""How a client reaches a protected service: TLS (root CA, client certificate) and a bearer token on every call."""

from __future__ import annotations

import collections
import logging
import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc

from drafter_service.api.credentials import read_secret

logger = logging.getLogger(__name__)

__all__ = ["ClientSecurity", "PLAINTEXT"]

_ENV = {"token": "DRAFTER_TOKEN", "root_ca": "DRAFTER_TLS_ROOT_CA", "client_cert": "DRAFTER_TLS_CLIENT_CERT",
        "client_key": "DRAFTER_TLS_CLIENT_KEY", "tls": "DRAFTER_TLS", "server_name": "DRAFTER_TLS_SERVER_NAME"}


@dataclass(frozen=True)
class ClientSecurity:
    """Transport security and credentials of a client's channel.

    Attributes:
        token: bearer token sent as ``authorization: Bearer <token>`` metadata on every call ("" for none).
            Over plaintext it travels in the clear: use TLS where the network is not trusted.
        root_ca: PEM file of the CA that signed the server's certificate ("" with ``tls``: the system's roots).
        client_cert: PEM file of this client's certificate (mutual TLS; needs ``client_key``).
        client_key: PEM file of its private key.
        tls: use TLS; implied by ``root_ca`` or ``client_cert``.
        server_name: the name the server's certificate is checked against when it is not the address's host.
    """

    token: str = field(default="", repr=False)
    root_ca: str = ""
    client_cert: str = ""
    client_key: str = ""
    tls: bool = False
    server_name: str = ""

    def __post_init__(self) -> None:
        if bool(self.client_cert) != bool(self.client_key):
            raise ValueError("client_cert and client_key go together: give both (or neither)")
        if self.token and (any(c.isspace() or not c.isprintable() for c in self.token) or not self.token.isascii()):
            raise ValueError("the token may hold only printable ASCII characters without spaces")
        if self.root_ca or self.client_cert:
            object.__setattr__(self, "tls", True)

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> ClientSecurity:
        """Settings from the environment, as the ``drafter`` commands read them.

        DRAFTER_TOKEN (a token or @FILE), DRAFTER_TLS_ROOT_CA, DRAFTER_TLS_CLIENT_CERT, DRAFTER_TLS_CLIENT_KEY,
        DRAFTER_TLS (1: TLS with the system's roots) and DRAFTER_TLS_SERVER_NAME.

        Raises:
            ValueError: an unreadable token file or inconsistent settings.
        """
        env = os.environ if environ is None else environ
        token = env.get(_ENV["token"], "")
        return cls(token=read_secret(token, _ENV["token"]) if token else "", root_ca=env.get(_ENV["root_ca"], ""),
                   client_cert=env.get(_ENV["client_cert"], ""), client_key=env.get(_ENV["client_key"], ""),
                   tls=env.get(_ENV["tls"], "").strip().lower() in ("1", "true", "yes", "on"),
                   server_name=env.get(_ENV["server_name"], ""))

    def metadata(self) -> tuple[tuple[str, str], ...]:
        """The metadata added to every call."""
        return (("authorization", f"Bearer {self.token}"),) if self.token else ()

    def credentials(self) -> grpc.ChannelCredentials:
        """TLS channel credentials (the files are read now).

        Raises:
            OSError: a file cannot be read.
        """
        return grpc.ssl_channel_credentials(root_certificates=_read(self.root_ca, "root CA"),
                                            private_key=_read(self.client_key, "client key"),
                                            certificate_chain=_read(self.client_cert, "client certificate"))

    def _options(self, options: Sequence[tuple[str, Any]]) -> list[tuple[str, Any]]:
        extra = [("grpc.ssl_target_name_override", self.server_name)] if self.tls and self.server_name else []
        return list(options) + extra

    def channel(self, address: str, options: Sequence[tuple[str, Any]] = ()) -> grpc.Channel:
        """A channel to ``address`` with this security: TLS when set, the token on every call."""
        opts = self._options(options)
        base = (grpc.secure_channel(address, self.credentials(), options=opts) if self.tls
                else grpc.insecure_channel(address, options=opts))
        return grpc.intercept_channel(base, _SyncMetadata(self.metadata())) if self.token else base

    def aio_channel(self, address: str, options: Sequence[tuple[str, Any]] = ()) -> grpc.aio.Channel:
        """The asyncio channel of ``channel`` (make it inside the running event loop)."""
        opts = self._options(options)
        interceptors = _aio_interceptors(self.metadata()) if self.token else None
        if self.tls:
            return grpc.aio.secure_channel(address, self.credentials(), options=opts, interceptors=interceptors)
        return grpc.aio.insecure_channel(address, options=opts, interceptors=interceptors)


PLAINTEXT = ClientSecurity()
"""No TLS, no token: what clients use unless told otherwise."""


def _read(path: str, what: str) -> bytes | None:
    if not path:
        return None
    try:
        return Path(path).expanduser().read_bytes()
    except OSError as exc:
        raise OSError(f"cannot read the {what} {path}: {exc.strerror or exc}") from None


class _Details(collections.namedtuple("_Details", ("method", "timeout", "metadata", "credentials",
                                                   "wait_for_ready", "compression")), grpc.ClientCallDetails):
    """Call details with the extra metadata."""


class _SyncMetadata(grpc.UnaryUnaryClientInterceptor, grpc.UnaryStreamClientInterceptor,
                    grpc.StreamUnaryClientInterceptor, grpc.StreamStreamClientInterceptor):
    """Adds fixed metadata to every call of a synchronous channel."""

    def __init__(self, metadata: tuple[tuple[str, str], ...]) -> None:
        self._metadata = metadata

    def _details(self, d: grpc.ClientCallDetails) -> _Details:
        return _Details(d.method, d.timeout, list(d.metadata or ()) + list(self._metadata), d.credentials,
                        getattr(d, "wait_for_ready", None), getattr(d, "compression", None))

    def intercept_unary_unary(self, continuation: Callable, details: grpc.ClientCallDetails, request: Any) -> Any:
        return continuation(self._details(details), request)

    def intercept_unary_stream(self, continuation: Callable, details: grpc.ClientCallDetails, request: Any) -> Any:
        return continuation(self._details(details), request)

    def intercept_stream_unary(self, continuation: Callable, details: grpc.ClientCallDetails, requests: Any) -> Any:
        return continuation(self._details(details), requests)

    def intercept_stream_stream(self, continuation: Callable, details: grpc.ClientCallDetails, requests: Any) -> Any:
        return continuation(self._details(details), requests)


def _aio_interceptors(metadata: tuple[tuple[str, str], ...]) -> list:
    """One interceptor per call kind (an asyncio channel files each under a single kind) adding ``metadata``."""
    def details(d: grpc.aio.ClientCallDetails) -> grpc.aio.ClientCallDetails:
        md = grpc.aio.Metadata(*(tuple(d.metadata) if d.metadata else ()), *metadata)
        return grpc.aio.ClientCallDetails(d.method, d.timeout, md, d.credentials, d.wait_for_ready)

    class UnaryUnary(grpc.aio.UnaryUnaryClientInterceptor):
        async def intercept_unary_unary(self, continuation: Callable, client_call_details: Any, request: Any) -> Any:
            return await continuation(details(client_call_details), request)

    class UnaryStream(grpc.aio.UnaryStreamClientInterceptor):
        async def intercept_unary_stream(self, continuation: Callable, client_call_details: Any, request: Any) -> Any:
            return await continuation(details(client_call_details), request)

    class StreamUnary(grpc.aio.StreamUnaryClientInterceptor):
        async def intercept_stream_unary(self, continuation: Callable, client_call_details: Any,
                                         request_iterator: Any) -> Any:
            return await continuation(details(client_call_details), request_iterator)

    class StreamStream(grpc.aio.StreamStreamClientInterceptor):
        async def intercept_stream_stream(self, continuation: Callable, client_call_details: Any,
                                          request_iterator: Any) -> Any:
            return await continuation(details(client_call_details), request_iterator)

    return [UnaryUnary(), UnaryStream(), StreamUnary(), StreamStream()]

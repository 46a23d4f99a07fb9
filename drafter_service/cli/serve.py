"""`drafter serve`, `drafter ingest` and `drafter stats`: every serve flag also reads a DRAFTER_* variable."""

from __future__ import annotations

import argparse
import gc
import json
import logging
import signal
import sys
import time
from dataclasses import replace

from drafter_service.cli.client_flags import add_client_flags, security_from_args
from drafter_service.cli.env_flags import env_flag
from drafter_service.core.config import DRAFT_MODEL, DRAFTING, SOURCES, CardSettings, DrafterConfig, DraftModelSpec
from drafter_service.core.settings import Setting, add_settings, settings_of, values_from_args
from drafter_service.service.config import JOBS, LIMITS, NETWORK, REPLICAS, STORAGE, TENANTS, WARMING, ServiceConfig

logger = logging.getLogger(__name__)

_DEFAULTS = ServiceConfig()
SWITCH_INTERVAL_S = 0.001
"""The interpreter's thread switch interval in a serving process (``sys.setswitchinterval``)."""
GROUP_ORDER = (NETWORK, STORAGE, REPLICAS, DRAFTING, LIMITS, TENANTS, JOBS, WARMING, DRAFT_MODEL)
"""The order of the settings groups in ``serve --help`` and docs/configuration.md."""


def serve_settings() -> tuple[Setting, ...]:
    """Every ``serve`` setting, in --help order: by group, then as declared."""
    declared = (settings_of(ServiceConfig) + settings_of(DrafterConfig) + (SOURCES,) + settings_of(DraftModelSpec)
                + settings_of(CardSettings))
    unknown = {s.group for s in declared} - set(GROUP_ORDER)
    if unknown:
        raise RuntimeError(f"settings groups {sorted(unknown)} are missing from GROUP_ORDER")
    return tuple(sorted(declared, key=lambda s: GROUP_ORDER.index(s.group)))


def add_serve_commands(sub: argparse._SubParsersAction) -> None:
    """Register ``serve``, ``ingest`` and ``stats``."""
    sp = sub.add_parser("serve", help="run the gRPC drafting service", description="Run the gRPC drafting "
                        "service. Every flag also reads a DRAFTER_* environment variable (see "
                        "docs/configuration.md).")
    add_settings(sp, serve_settings())
    sp.set_defaults(func=run_serve)

    ip = sub.add_parser("ingest", help="send completed requests from a JSONL file to a running service")
    ip.add_argument("file", help="JSONL lines with prompt and output token ids (request_id optional)")
    env_flag(ip, "--address", str, _DEFAULTS.address, "service address")
    ip.add_argument("--namespace", default="", help="target namespace (default: default)")
    ip.add_argument("--batch", type=int, default=256, help="requests per Ingest call")
    add_client_flags(ip)
    ip.set_defaults(func=run_ingest)

    st = sub.add_parser("stats", help="print a running service's statistics")
    env_flag(st, "--address", str, _DEFAULTS.address, "service address")
    st.add_argument("--namespace", default="", help="namespace (default: default)")
    add_client_flags(st)
    st.set_defaults(func=run_stats)


def config_from_args(args: argparse.Namespace) -> ServiceConfig:
    """The ServiceConfig described by ``serve``'s flags.

    Raises:
        ValueError: a flag's value or the configuration is invalid.
    """
    fields = values_from_args(settings_of(ServiceConfig), args)
    fields["drafter"] = DrafterConfig(**values_from_args(settings_of(DrafterConfig), args), **SOURCES.value(args))
    # --draft-model lists the models; the DraftModelSpec and CardSettings flags apply to each of them.
    card = CardSettings(**values_from_args(settings_of(CardSettings), args))
    per_model = values_from_args(settings_of(DraftModelSpec), args)
    fields["draft_models"] = tuple(replace(spec, card=card, **per_model) for spec in fields["draft_models"])
    return ServiceConfig(**fields)


def run_serve(args: argparse.Namespace) -> int:
    """Serve until SIGTERM or SIGINT; state is saved before exiting."""
    from drafter_service.runtime.runtime import Runtime

    try:
        config = config_from_args(args)
    except ValueError as exc:
        raise SystemExit(f"bad configuration: {exc}") from None
    runtime = Runtime(config)
    # A thread waiting for the interpreter lock asks the running one to drop it after the switch interval: with the
    # default 5 ms, a draft call that needs the lock a few times behind an ingest or an index swap waits 20 ms; 1 ms
    # keeps it to a few (the service's process is ours, so the setting is ours too).
    sys.setswitchinterval(SWITCH_INTERVAL_S)
    t0 = time.perf_counter()
    try:
        runtime.start()
    except Exception as exc:
        runtime.stop(grace=0)
        from drafter_service.ingest.text_tokenizer import TokenizerError
        from drafter_service.model.draft_model import DraftModelError

        if isinstance(exc, DraftModelError):
            raise SystemExit(f"bad draft model: {exc}") from None
        if isinstance(exc, TokenizerError):
            raise SystemExit(f"bad --warm-tokenizer: {exc}") from None
        if isinstance(exc, OSError):
            raise SystemExit(f"cannot start: {exc}") from None
        raise
    # What start made (modules, the restored namespaces) lives as long as the process: out of the collector's sight,
    # a full collection walks only what came after it (walking it all took 20-135 ms of the interpreter lock on a
    # 2-core machine, a stalled Draft each time; the service's process is ours, as above)
    gc.collect()
    gc.freeze()
    web = f"; dashboard and /metrics on {runtime.http.url}" if runtime.http is not None else ""
    print(f"drafter serving on port {runtime.port} ({', '.join(ns.name for ns in config.namespaces)}){web}; "
          f"ready in {time.perf_counter() - t0:.1f} s", flush=True)

    def shutdown(signum: int, frame: object) -> None:
        logger.info("signal %d: shutting down", signum)
        runtime.stop()

    signal.signal(signal.SIGTERM, shutdown)
    signal.signal(signal.SIGINT, shutdown)
    runtime.wait()
    runtime.stop()
    return 0


def run_ingest(args: argparse.Namespace) -> int:
    """Stream a JSONL file of completed requests to the service in batches, with a progress bar.

    ``drafter warm`` supersedes it (duplicates skipped, resumable, text and chat logs); this stores every line.
    """
    from drafter_service.cli.ingest_file import ingest_file
    from drafter_service.ingest.warm_sinks import WarmError

    try:
        n, tokens, bad = ingest_file(args.address, args.file, args.namespace, args.batch, progress=True,
                                     security=security_from_args(args))
    except WarmError as exc:
        raise SystemExit(str(exc)) from None
    print(f"ingested {n} requests ({tokens} tokens); {bad} malformed lines skipped")
    return 0 if n or not bad else 1


def run_stats(args: argparse.Namespace) -> int:
    """Print GetStats as JSON."""
    import grpc

    from engine_client.admin import stats

    try:
        reply = stats(args.address, args.namespace, security=security_from_args(args))
    except grpc.RpcError as exc:
        raise SystemExit(f"service at {args.address}: {exc.code().name}: {exc.details()}") from None
    print(json.dumps(reply, indent=1))
    return 0

"""`drafter serve`, `drafter ingest` and `drafter stats`: every serve flag also reads a DRAFTER_* variable."""

from __future__ import annotations

import argparse
import json
import logging
import signal
import time
from dataclasses import replace
from typing import Any

from drafter_service.cli.client_flags import add_client_flags, security_from_args
from drafter_service.cli.env_flags import env_flag
from drafter_service.core.config import CardSettings, DrafterConfig, DraftModelSpec
from drafter_service.service.config import NamespaceSpec, ServiceConfig

logger = logging.getLogger(__name__)

_DEFAULTS = ServiceConfig()
_CORE = DrafterConfig()
_CARD = CardSettings()
_SOURCES = {"session", "store", "dynamic", "frozen", "repeat"}


def add_serve_commands(sub: argparse._SubParsersAction) -> None:
    """Register ``serve``, ``ingest`` and ``stats``."""
    sp = sub.add_parser("serve", help="run the gRPC drafting service")
    env_flag(sp, "--address", str, _DEFAULTS.address, "gRPC listen address")
    env_flag(sp, "--data-dir", str, _DEFAULTS.data_dir, "data folder of the embedded Redis (without --redis-url)")
    env_flag(sp, "--redis-url", str, _DEFAULTS.redis_url, "use this Redis instead of the embedded one")
    env_flag(sp, "--namespaces", str, "", "extra namespaces as NAME=VOCAB_SIZE[,NAME=VOCAB_SIZE...]")
    env_flag(sp, "--vocab-size", int, _DEFAULTS.default_vocab_size, "vocabulary size of the default namespace")
    env_flag(sp, "--capacity", int, _CORE.capacity, "ring buffer size in tokens, per namespace")
    env_flag(sp, "--max-nodes", int, _CORE.max_nodes, "default tree budget")
    env_flag(sp, "--leader-capacity", int, _CORE.leader_capacity, "dynamic n-gram table: most leaders (LC)")
    env_flag(sp, "--follower-capacity", int, _CORE.follower_capacity, "dynamic n-gram table: followers per leader (FC)")
    env_flag(sp, "--rebuild-interval", float, _DEFAULTS.rebuild_interval_s, "seconds between index rebuild checks")
    env_flag(sp, "--rebuild-in-subprocess", int, int(_DEFAULTS.rebuild_in_subprocess), "1: build suffix indexes in a "
          "child process, so serving keeps the GIL; 0: in the serving process")
    env_flag(sp, "--snapshot-interval", float, _DEFAULTS.snapshot_interval_s, "seconds between table snapshots")
    env_flag(sp, "--max-message-bytes", int, _DEFAULTS.max_message_bytes, "gRPC message size limit")
    env_flag(sp, "--max-sessions", int, _DEFAULTS.max_sessions, "most live sessions")
    env_flag(sp, "--workers", int, _DEFAULTS.workers, "gRPC worker threads")
    env_flag(sp, "--max-streams", int, 0, "most streaming calls (DraftStream, PutFrozenTable, health "
          "Watch) open at once, below --workers (more are refused with RESOURCE_EXHAUSTED; 0: three quarters of "
          "--workers)")
    env_flag(sp, "--max-concurrent-rpcs", int, 0, "most calls in progress at once, above --max-streams (more are refused "
          "with RESOURCE_EXHAUSTED; 0: eight times --workers)")
    env_flag(sp, "--max-request-tokens", int, _DEFAULTS.max_request_tokens, "most tokens in one prompt, one accepted "
          "list, one ingested prompt or output, and one session's output in all")
    env_flag(sp, "--max-nodes-limit", int, _DEFAULTS.max_nodes_limit, "largest tree budget a client may ask for")
    env_flag(sp, "--max-ingest-requests", int, _DEFAULTS.max_ingest_requests, "most requests in one Ingest call")
    env_flag(sp, "--max-sessions-per-client", int, _DEFAULTS.max_sessions_per_client, "most live sessions of one "
          "client (its bearer token, else its address); more are refused with RESOURCE_EXHAUSTED (0: no limit)")
    env_flag(sp, "--namespace-tokens", str, "", "namespaces that need a bearer token, as NAMESPACE=TOKEN or "
          "NAMESPACE=@FILE (the token read from a file)[,...]")
    env_flag(sp, "--admin-token", str, "", "a token (or @FILE) that grants every namespace and the HTTP pages")
    env_flag(sp, "--http-token", str, "", "a token (or @FILE) for the dashboard, its API and /metrics (required, or "
          "--admin-token, when any namespace has a token)")
    env_flag(sp, "--tls-cert", str, "", "PEM certificate chain of the server: serve TLS (with --tls-key)")
    env_flag(sp, "--tls-key", str, "", "PEM private key of --tls-cert")
    env_flag(sp, "--tls-client-ca", str, "", "PEM CA that client certificates must be signed by: mutual TLS")
    env_flag(sp, "--http-address", str, _DEFAULTS.http_address, "dashboard, /metrics and JSON API listen address "
          "('' for none)")
    env_flag(sp, "--metrics-interval", float, _DEFAULTS.metrics_interval_s, "seconds between metric points kept "
          "in Redis")
    env_flag(sp, "--metrics-history", int, _DEFAULTS.metrics_history, "metric points kept per namespace")
    env_flag(sp, "--warm-dir", str, _DEFAULTS.warm_dir, "warm from new and grown request logs (*.jsonl) in this folder, "
          "as `drafter warm --watch` does ('' for none)")
    env_flag(sp, "--warm-tokenizer", str, _DEFAULTS.warm_tokenizer, "tokenizer.json (or its folder) for text and chat "
          "logs in --warm-dir")
    env_flag(sp, "--warm-interval", float, _DEFAULTS.warm_interval_s, "seconds between scans of --warm-dir")
    env_flag(sp, "--warm-namespace", str, _DEFAULTS.warm_namespace, "namespace --warm-dir is warmed into")
    env_flag(sp, "--replica-id", str, _DEFAULTS.replica_id, "this replica's name in logs and metrics ('': host "
          "name and process id)")
    env_flag(sp, "--follow-log", str, _DEFAULTS.follow_log, "on: follow the request logs and frozen-table changes "
          "other replicas write to the same Redis; off: only restore at start; auto: on with --redis-url")
    env_flag(sp, "--spool-dir", str, _DEFAULTS.spool_dir, "folder of the spool that holds acknowledged requests while "
          "Redis cannot take them ('': DATA_DIR/spool)")
    env_flag(sp, "--spool-max-bytes", int, _DEFAULTS.spool_max_bytes, "bound on each namespace's spool file; beyond it "
          "requests are refused with UNAVAILABLE (0: no spool)")
    env_flag(sp, "--spool-drain-interval", float, _DEFAULTS.spool_drain_interval_s, "seconds between attempts to move "
          "spooled requests to Redis (and persistence health checks)")
    env_flag(sp, "--sources", str, "session,store,dynamic,frozen,repeat", "model-free sources to draft from "
          "(comma-separated; 'none' for the draft model alone)")
    env_flag(sp, "--draft-model", str, "", "optional draft model(s) as [NAMESPACE=]PATH[,...] (CARD query-and-correct)")
    env_flag(sp, "--draft-device", str, "cpu", "device of the draft model: cpu, cuda or cuda:N")
    env_flag(sp, "--draft-dtype", str, "float32", "draft model dtype: float32, bfloat16 or float16")
    env_flag(sp, "--draft-threads", int, 0, "torch CPU threads for the draft model (0: torch's default)")
    env_flag(sp, "--card-width", int, _CARD.width, "K: sequences kept per draft-model cache layer")
    env_flag(sp, "--card-top-k", int, _CARD.top_k, "k: candidates taken from each sequence's distribution")
    env_flag(sp, "--card-layers", int, _CARD.layers_ahead, "layers the draft model grows ahead of the verified prefix")
    env_flag(sp, "--card-vocab", int, _CARD.vocab, "draft over this many of the most frequent tokens (0: all); the "
          "output head is most of a small draft model's cost")
    env_flag(sp, "--card-nice", int, _CARD.nice, "CPU niceness of the draft model's threads (0-19; Linux)")
    env_flag(sp, "--card-idle", int, int(_CARD.idle_priority), "1: run the draft model under SCHED_IDLE (only cycles "
          "nothing else wants)")
    env_flag(sp, "--card-max-sessions", int, _CARD.max_sessions, "most sessions with a draft-model cache at once")
    env_flag(sp, "--card-correction", int, int(_CARD.correction), "1: prune the cache to the verified prefix "
          "(CARD's correction); 0: ablation without it")
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
    """The ServiceConfig described by ``serve``'s flags."""
    specs = tuple(NamespaceSpec.parse(part) for part in args.namespaces.split(",") if part.strip())
    sources = {part.strip() for part in args.sources.split(",") if part.strip() and part.strip() != "none"}
    unknown = sources - _SOURCES
    if unknown:
        raise ValueError(f"unknown sources {sorted(unknown)}; choose among {sorted(_SOURCES)} or 'none'")
    core = replace(_CORE, capacity=args.capacity, max_nodes=args.max_nodes, leader_capacity=args.leader_capacity,
                   follower_capacity=args.follower_capacity,
                   **{f"use_{name}": name in sources for name in _SOURCES})
    card = CardSettings(width=args.card_width, top_k=args.card_top_k, layers_ahead=args.card_layers,
                        max_sessions=args.card_max_sessions, correction=bool(args.card_correction),
                        vocab=args.card_vocab, nice=args.card_nice, idle_priority=bool(args.card_idle))
    drafts = DraftModelSpec.parse_list(args.draft_model, device=args.draft_device, dtype=args.draft_dtype,
                                       threads=args.draft_threads, card=card)
    return ServiceConfig(address=args.address, data_dir=args.data_dir, redis_url=args.redis_url, namespaces=specs,
                         default_vocab_size=args.vocab_size, drafter=core, rebuild_interval_s=args.rebuild_interval,
                         rebuild_in_subprocess=bool(args.rebuild_in_subprocess),
                         snapshot_interval_s=args.snapshot_interval, max_message_bytes=args.max_message_bytes,
                         max_sessions=args.max_sessions, workers=args.workers, draft_models=drafts,
                         max_streams=args.max_streams, max_concurrent_rpcs=args.max_concurrent_rpcs,
                         max_request_tokens=args.max_request_tokens, max_nodes_limit=args.max_nodes_limit,
                         max_ingest_requests=args.max_ingest_requests,
                         http_address=args.http_address, metrics_interval_s=args.metrics_interval,
                         metrics_history=args.metrics_history, warm_dir=args.warm_dir,
                         warm_tokenizer=args.warm_tokenizer, warm_interval_s=args.warm_interval,
                         warm_namespace=args.warm_namespace, replica_id=args.replica_id,
                         spool_dir=args.spool_dir, spool_max_bytes=args.spool_max_bytes,
                         spool_drain_interval_s=args.spool_drain_interval,
                         follow_log=args.follow_log, **_tenant_settings(args))


def _tenant_settings(args: argparse.Namespace) -> dict[str, Any]:
    """ServiceConfig fields of the token, TLS and per-client flags (token files are read here)."""
    from drafter_service.api.credentials import read_secret
    from drafter_service.service.auth import parse_namespace_tokens

    return {"namespace_tokens": parse_namespace_tokens(args.namespace_tokens),
            "admin_token": read_secret(args.admin_token, "--admin-token") if args.admin_token else "",
            "http_token": read_secret(args.http_token, "--http-token") if args.http_token else "",
            "tls_cert": args.tls_cert, "tls_key": args.tls_key, "tls_client_ca": args.tls_client_ca,
            "max_sessions_per_client": args.max_sessions_per_client}


def run_serve(args: argparse.Namespace) -> int:
    """Serve until SIGTERM or SIGINT; state is saved before exiting."""
    from drafter_service.runtime.runtime import Runtime

    try:
        config = config_from_args(args)
    except ValueError as exc:
        raise SystemExit(f"bad configuration: {exc}") from None
    runtime = Runtime(config)
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

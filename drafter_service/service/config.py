"""Configuration of the whole service: addresses, storage, namespaces, limits and background jobs."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from drafter_service.api.credentials import check_token, read_secret
from drafter_service.api.names import DEFAULT_NAMESPACE, check_name
from drafter_service.core.config import DRAFT_MODEL, DRAFTING, DrafterConfig, DraftModelSpec
from drafter_service.core.settings import setting
from drafter_service.service.auth import parse_namespace_tokens
from store.redis_connect import parse_redis_url


@dataclass(frozen=True)
class NamespaceSpec:
    """A namespace (one tokenizer's token space) and its vocabulary size."""

    name: str
    vocab_size: int

    def __post_init__(self) -> None:
        check_name(self.name)
        if self.vocab_size < 1 or self.vocab_size > 1 << 31:
            raise ValueError(f"namespace {self.name!r}: vocab_size must be in [1, 2**31], got {self.vocab_size}")

    @classmethod
    def parse(cls, text: str) -> NamespaceSpec:
        """Parse ``NAME=VOCAB_SIZE``."""
        name, sep, size = text.partition("=")
        if not sep or not size.strip().isdigit():
            raise ValueError(f"bad namespace {text!r}: expected NAME=VOCAB_SIZE")
        return cls(name.strip(), int(size))


def parse_namespaces(text: str) -> tuple[NamespaceSpec, ...]:
    """Parse ``NAME=VOCAB_SIZE[,NAME=VOCAB_SIZE...]``.

    Raises:
        ValueError: a malformed entry.
    """
    return tuple(NamespaceSpec.parse(part) for part in text.split(",") if part.strip())


def _secret(flag: str) -> Callable[[str], str]:
    """Parses a token flag's value: the token, or the contents of the @FILE it names."""
    return lambda value: read_secret(value, flag) if value else ""


# Settings groups of ServiceConfig (beside DRAFTING and DRAFT_MODEL of drafter_service.core.config).
NETWORK = "network"
STORAGE = "storage"
REPLICAS = "replicas"
LIMITS = "limits"
TENANTS = "tenants and TLS"
JOBS = "background jobs"
WARMING = "warming from logs"


@dataclass(frozen=True)
class ServiceConfig:
    """Everything ``drafter serve`` is configured with (flags and environment variables fill it).

    Every field but ``drafter`` is a setting: declared with ``setting``, it is a ``drafter serve`` flag with a
    DRAFTER_* environment variable, and its help says what it means (``drafter serve --help``,
    docs/configuration.md).

    Attributes:
        drafter: sizes and policies of every namespace's core (its vocab_size is overridden per namespace).
    """

    address: str = field(default="127.0.0.1:50051", metadata=setting("--address", "gRPC listen address", NETWORK))
    data_dir: str = field(default="./drafter-data", metadata=setting(
        "--data-dir", "data folder of the embedded Redis (without --redis-url)", STORAGE))
    redis_url: str = field(default="", metadata=setting(
        "--redis-url", "use this Redis instead of the embedded one: redis://[:PASSWORD@]HOST:PORT[/DB] (rediss:// for "
        "TLS, unix://PATH); redis+sentinel://[:PASSWORD@]HOST:PORT[,HOST:PORT...]/MASTER[/DB] for the primary that "
        "these sentinels name MASTER, followed through failovers; redis+cluster://[:PASSWORD@]HOST:PORT[,HOST:PORT...] "
        "for a Redis Cluster (each namespace lives on the node of its hash slot)", STORAGE))
    redis_replica_acks: int = field(default=0, metadata=setting(
        "--redis-replica-acks", "replicas of the Redis primary that must have received each stored request (WAIT) "
        "before it is acknowledged, so that a failover to one of them (Sentinel, Cluster) loses none; while fewer "
        "are online, requests wait in the spool (0: the primary alone; needs --redis-url)", STORAGE))
    redis_write_timeout_s: float = field(default=1.0, metadata=setting(
        "--redis-write-timeout", "the longest a stored request waits on Redis (to connect, for the append, its fsync "
        "and its replicas together) before it goes to the spool and EndSession or Ingest answers", STORAGE))
    namespaces: tuple[NamespaceSpec, ...] = field(default=(), metadata=setting(
        "--namespaces", "extra namespaces as NAME=VOCAB_SIZE[,NAME=VOCAB_SIZE...] (the default namespace is added "
        "with --vocab-size when not listed)", DRAFTING, parse=parse_namespaces))
    default_vocab_size: int = field(default=262144, metadata=setting(
        "--vocab-size", "vocabulary size of the default namespace", DRAFTING))
    drafter: DrafterConfig = field(default_factory=DrafterConfig)
    rebuild_interval_s: float = field(default=1.0, metadata=setting(
        "--rebuild-interval", "seconds between index rebuild checks", JOBS))
    rebuild_in_subprocess: bool = field(default=True, metadata=setting(
        "--rebuild-in-subprocess", "1: build suffix indexes in a child process, so serving keeps the GIL; 0: in "
        "the serving process", JOBS))
    snapshot_interval_s: float = field(default=30.0, metadata=setting(
        "--snapshot-interval", "seconds between snapshots of the dynamic tables and acceptance statistics", JOBS))
    max_message_bytes: int = field(default=64 * 1024 * 1024, metadata=setting(
        "--max-message-bytes", "gRPC message size limit, both directions", LIMITS))
    max_request_tokens: int = field(default=1 << 20, metadata=setting(
        "--max-request-tokens", "most tokens in one prompt, one accepted list, one ingested prompt or output, and "
        "one session's output in all", LIMITS))
    max_ingest_requests: int = field(default=10000, metadata=setting(
        "--max-ingest-requests", "most requests in one Ingest call", LIMITS))
    max_nodes_limit: int = field(default=1024, metadata=setting(
        "--max-nodes-limit", "largest tree budget a client may ask for", LIMITS))
    max_sessions: int = field(default=100000, metadata=setting(
        "--max-sessions", "most live sessions over all namespaces", LIMITS))
    workers: int = field(default=128, metadata=setting(
        "--workers", "gRPC worker threads for the calls that may wait (an open upload or health Watch holds one)",
        NETWORK))
    max_streams: int = field(default=0, metadata=setting(
        "--max-streams", "most streaming calls (DraftStream, PutFrozenTable, health Watch) open at once, below "
        "--workers so unary calls always find a thread (more are refused with RESOURCE_EXHAUSTED; 0: three "
        "quarters of --workers)", LIMITS))
    max_concurrent_rpcs: int = field(default=0, metadata=setting(
        "--max-concurrent-rpcs", "most calls in progress at once, streams included, above --max-streams (more are "
        "refused with RESOURCE_EXHAUSTED instead of queueing; 0: eight times --workers)", LIMITS))
    draft_models: tuple[DraftModelSpec, ...] = field(default=(), metadata=setting(
        "--draft-model", "optional draft model(s) as [NAMESPACE=]PATH[,...], at most one per namespace (CARD "
        "query-and-correct; PATH from `drafter distill-draft` or any transformers causal-LM checkpoint)",
        DRAFT_MODEL, parse=DraftModelSpec.parse_list))
    http_address: str = field(default="127.0.0.1:8050", metadata=setting(
        "--http-address", "dashboard, /metrics and JSON API listen address ('host:0': a free port; '' for none)",
        NETWORK))
    metrics_interval_s: float = field(default=5.0, metadata=setting(
        "--metrics-interval", "seconds between metric points kept in Redis", JOBS))
    metrics_history: int = field(default=7 * 24 * 3600 // 5, metadata=setting(
        "--metrics-history", "metric points kept per namespace (the default is a week at 5 s)", JOBS))
    warm_dir: str = field(default="", metadata=setting(
        "--warm-dir", "warm from new and grown request logs (*.jsonl) in this folder, as `drafter warm --watch` "
        "does ('' for none)", WARMING))
    warm_tokenizer: str = field(default="", metadata=setting(
        "--warm-tokenizer", "tokenizer.json (or its folder) for text and chat logs in --warm-dir", WARMING))
    warm_interval_s: float = field(default=10.0, metadata=setting(
        "--warm-interval", "seconds between scans of --warm-dir", WARMING))
    warm_namespace: str = field(default=DEFAULT_NAMESPACE, metadata=setting(
        "--warm-namespace", "namespace --warm-dir is warmed into", WARMING))
    replica_id: str = field(default="", metadata=setting(
        "--replica-id", "this replica's name in logs and metrics ('': host name and process id)", REPLICAS))
    index_dir: str = field(default="", metadata=setting(
        "--index-dir", "folder of the index files, one per namespace: the ring buffer, its suffix indexes and the "
        "repeated-prompt cache, written in the background after index rebuilds and read at start, so that a restart "
        "reads and indexes only the requests logged after them ('': DATA_DIR/index)", STORAGE))
    spool_dir: str = field(default="", metadata=setting(
        "--spool-dir", "folder of the spool that holds acknowledged requests while Redis cannot take them, one file "
        "per namespace and process, made only when needed ('': DATA_DIR/spool)", STORAGE))
    spool_max_bytes: int = field(default=256 * 1024 * 1024, metadata=setting(
        "--spool-max-bytes", "bound on each namespace's spool file; beyond it requests are refused with "
        "UNAVAILABLE (0: no spool)", STORAGE))
    spool_drain_interval_s: float = field(default=1.0, metadata=setting(
        "--spool-drain-interval", "seconds between persistence health checks while Redis takes requests; while it "
        "does not, or requests wait in the spool, every 0.2 s at most, so the spool drains as soon as it does",
        STORAGE))
    follow_log: str = field(default="auto", metadata=setting(
        "--follow-log", "on: follow the request logs and frozen-table changes other replicas write to the same "
        "Redis; off: only restore at start; auto: on with --redis-url", REPLICAS))
    namespace_tokens: tuple[tuple[str, str], ...] = field(default=(), repr=False, metadata=setting(
        "--namespace-tokens", "namespaces that need a bearer token, as NAMESPACE=TOKEN or NAMESPACE=@FILE (the "
        "token read from a file)[,...]; a namespace listed needs its token (or the admin token) on every call that "
        "touches it", TENANTS, parse=parse_namespace_tokens))
    admin_token: str = field(default="", repr=False, metadata=setting(
        "--admin-token", "a token (or @FILE) that grants every namespace and the HTTP pages", TENANTS,
        parse=_secret("--admin-token")))
    http_token: str = field(default="", repr=False, metadata=setting(
        "--http-token", "a token (or @FILE) for the dashboard, its API and /metrics (required, or --admin-token, "
        "when any namespace has a token)", TENANTS, parse=_secret("--http-token")))
    tls_cert: str = field(default="", metadata=setting(
        "--tls-cert", "PEM certificate chain of the server: serve TLS (with --tls-key)", TENANTS))
    tls_key: str = field(default="", metadata=setting("--tls-key", "PEM private key of --tls-cert", TENANTS))
    tls_client_ca: str = field(default="", metadata=setting(
        "--tls-client-ca", "PEM CA that client certificates must be signed by: mutual TLS (needs --tls-cert; '': "
        "clients without certificates are accepted)", TENANTS))
    max_sessions_per_client: int = field(default=0, metadata=setting(
        "--max-sessions-per-client", "most live sessions of one client (its bearer token, else its address without "
        "the port); more are refused with RESOURCE_EXHAUSTED (0: no limit)", LIMITS))

    def __post_init__(self) -> None:
        names = [ns.name for ns in self.namespaces]
        if len(set(names)) != len(names):
            raise ValueError(f"namespace declared twice in {names}")
        if DEFAULT_NAMESPACE not in names:
            object.__setattr__(self, "namespaces",
                               (NamespaceSpec(DEFAULT_NAMESPACE, self.default_vocab_size),) + tuple(self.namespaces))
        drafted = [spec.namespace for spec in self.draft_models]
        if len(set(drafted)) != len(drafted):
            raise ValueError(f"more than one draft model for a namespace in {drafted}")
        for name in drafted:
            if self.namespace(name) is None:
                raise ValueError(f"draft model for undeclared namespace {name!r}")
        if self.warm_dir and self.namespace(self.warm_namespace) is None:
            raise ValueError(f"warm_namespace {self.warm_namespace!r} is not declared")
        for name in ("rebuild_interval_s", "snapshot_interval_s", "metrics_interval_s", "warm_interval_s",
                     "spool_drain_interval_s", "redis_write_timeout_s"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive")
        for name in ("max_message_bytes", "max_request_tokens", "max_ingest_requests", "max_nodes_limit",
                     "max_sessions", "workers", "metrics_history"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1")
        if self.workers < 2:
            raise ValueError("workers must be at least 2: streams hold threads and unary calls need one left")
        for name, auto in (("max_streams", self.workers - max(1, self.workers // 4)),
                           ("max_concurrent_rpcs", 8 * self.workers)):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be at least 1 (or 0 for the default)")
            if getattr(self, name) == 0:
                object.__setattr__(self, name, auto)
        if self.max_streams >= self.workers:
            raise ValueError(f"max_streams ({self.max_streams}) must be below workers ({self.workers}): every open "
                             "stream holds a worker thread, and unary calls need some left")

        if self.follow_log not in ("auto", "on", "off"):
            raise ValueError(f"follow_log must be auto, on or off, got {self.follow_log!r}")
        if len(self.replica_id) > 128 or any(not c.isprintable() or c.isspace() for c in self.replica_id):
            raise ValueError(f"replica_id must be at most 128 printable characters without spaces, "
                             f"got {self.replica_id!r}")

        if self.redis_url:
            parse_redis_url(self.redis_url)  # ValueError naming the accepted forms
        if self.redis_replica_acks < 0:
            raise ValueError(f"redis_replica_acks must be at least 0, got {self.redis_replica_acks}")
        if self.redis_replica_acks and not self.redis_url:
            raise ValueError("redis_replica_acks needs redis_url: the embedded Redis has no replicas")
        if self.spool_max_bytes < 0 or 0 < self.spool_max_bytes < 4096:
            raise ValueError(f"spool_max_bytes must be 0 (no spool) or at least 4096, got {self.spool_max_bytes}")

        if self.http_address:
            host, sep, port = self.http_address.rpartition(":")
            if not sep or not host or not port.isdigit() or int(port) > 65535:
                raise ValueError(f"http_address must be HOST:PORT (or empty), got {self.http_address!r}")
        self._check_tenants()

    def _check_tenants(self) -> None:
        """Validate tokens, TLS files and per-client limits (tokens are never echoed in errors)."""
        protected = [name for name, _ in self.namespace_tokens]
        if len(set(protected)) != len(protected):
            raise ValueError(f"a namespace has more than one token in {protected}")
        for name, token in self.namespace_tokens:
            if self.namespace(name) is None:
                raise ValueError(f"token for undeclared namespace {name!r}")
            check_token(token, f"token of namespace {name!r}")
        for what in ("admin_token", "http_token"):
            if getattr(self, what):
                check_token(getattr(self, what), what)
        if self.admin_token and any(token == self.admin_token for _, token in self.namespace_tokens):
            raise ValueError("admin_token must differ from every namespace token")
        if self.namespace_tokens and self.http_address and not (self.http_token or self.admin_token):
            raise ValueError("namespace tokens protect per-namespace statistics the dashboard and /metrics show: "
                             "set http_token or admin_token for them, or http_address '' for no HTTP")
        if bool(self.tls_cert) != bool(self.tls_key):
            raise ValueError("tls_cert and tls_key go together: set both (or neither)")
        if self.tls_client_ca and not self.tls_cert:
            raise ValueError("tls_client_ca (mutual TLS) needs tls_cert and tls_key")
        if self.max_sessions_per_client < 0:
            raise ValueError("max_sessions_per_client must be at least 0 (0: no limit)")

    @property
    def following(self) -> bool:
        """Whether every namespace follows the shared request log (``follow_log``, "auto" resolved)."""
        return self.follow_log == "on" or (self.follow_log == "auto" and bool(self.redis_url))

    def namespace(self, name: str) -> NamespaceSpec | None:
        """The declared namespace ``name`` (None when unknown)."""
        return next((ns for ns in self.namespaces if ns.name == name), None)

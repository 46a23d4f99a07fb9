"""Configuration of the whole service: addresses, storage, namespaces, limits and background jobs."""

from __future__ import annotations

from dataclasses import dataclass, field

from drafter_service.api.credentials import check_token
from drafter_service.api.names import DEFAULT_NAMESPACE, check_name
from drafter_service.core.config import DrafterConfig, DraftModelSpec


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
    def parse(cls, text: str) -> "NamespaceSpec":
        """Parse ``NAME=VOCAB_SIZE``."""
        name, sep, size = text.partition("=")
        if not sep or not size.strip().isdigit():
            raise ValueError(f"bad namespace {text!r}: expected NAME=VOCAB_SIZE")
        return cls(name.strip(), int(size))


@dataclass(frozen=True)
class ServiceConfig:
    """Everything ``drafter serve`` is configured with (flags and environment variables fill it).

    Attributes:
        address: gRPC listen address.
        data_dir: folder of the embedded Redis server's data (used when ``redis_url`` is empty).
        redis_url: an existing Redis to use instead of the embedded one.
        namespaces: declared namespaces; "default" is added with ``default_vocab_size`` when missing.
        default_vocab_size: vocabulary size of the default namespace.
        drafter: sizes and policies of every namespace's core (its vocab_size is overridden per namespace).
        rebuild_interval_s: how often the background job checks whether a suffix index rebuild is due.
        rebuild_in_subprocess: build suffix indexes in a child process, so serving threads keep the GIL.
        snapshot_interval_s: how often dynamic tables and acceptance statistics are saved.
        max_message_bytes: gRPC message size limit, both directions.
        max_request_tokens: most tokens in one prompt, one accepted list, one ingested request's prompt or output,
            and one session's output in all.
        max_ingest_requests: most requests in one Ingest call.
        max_nodes_limit: largest tree budget a client may ask for.
        max_sessions: most live sessions over all namespaces.
        workers: gRPC server threads.
        max_streams: most streaming calls open at once (DraftStream, PutFrozenTable, health Watch); each holds a
            worker thread for its whole life, so it must stay below ``workers`` and unary calls always find a
            thread. A stream beyond it is refused with RESOURCE_EXHAUSTED. 0: three quarters of ``workers``.
        max_concurrent_rpcs: most calls in progress at once, streams included (keep it above ``max_streams``);
            calls beyond it are refused with RESOURCE_EXHAUSTED instead of queueing, so at most
            ``max_concurrent_rpcs - workers`` calls wait for a thread. 0: eight times ``workers``.
        draft_models: optional draft models, at most one per namespace.
        http_address: where the dashboard, ``/metrics`` and the JSON API listen ("host:0" picks a free port;
            "" serves no HTTP).
        metrics_interval_s: seconds between metric points (the rollup into Redis).
        metrics_history: metric points kept per namespace in Redis (the default is a week at 5 s).
        warm_dir: a folder whose new and grown request logs are warmed into ``warm_namespace`` ("" for none).
        warm_tokenizer: that namespace's tokenizer (tokenizer.json or its folder) for text and chat logs.
        warm_interval_s: seconds between scans of ``warm_dir``.
        warm_namespace: the namespace ``warm_dir`` is warmed into.
        replica_id: this replica's name in logs and metrics ("": host name and process id).
        spool_dir: folder of the spool files that hold acknowledged requests while Redis cannot take them
            ("": ``<data_dir>/spool``); one file per namespace and process, made only when needed.
        spool_max_bytes: bound on each spool file; a request that would pass it is refused with UNAVAILABLE
            (0: no spool, every request Redis cannot take is refused).
        spool_drain_interval_s: seconds between checks that drain spooled requests into Redis once it answers
            (and update the persistence health).
        follow_log: "on": follow every namespace's shared request log (and frozen-table changes) written by
            other replicas on the same Redis into this replica's store; "off": only restore it at start;
            "auto": on with an external ``redis_url``, off with the embedded Redis (one replica only).
        namespace_tokens: (namespace, token) pairs: a namespace listed needs ``authorization: Bearer <token>``
            with its token (or the admin token) on every RPC that touches it; see ``drafter_service.service.auth``.
        admin_token: a token that grants every namespace and the HTTP pages ("" for none).
        http_token: a token for the dashboard, its JSON API and /metrics ("" for none). When any namespace has
            a token, HTTP needs this or the admin token.
        tls_cert, tls_key: PEM files of the server's certificate chain and private key; serve TLS when set.
        tls_client_ca: PEM file of the CA(s) client certificates must be signed by: mutual TLS (requires
            ``tls_cert``); "" accepts clients without certificates.
        max_sessions_per_client: most live sessions of one client (its bearer token when it sends one, else its
            peer address without the port); 0 for no limit.
    """

    address: str = "127.0.0.1:50051"
    data_dir: str = "./drafter-data"
    redis_url: str = ""
    namespaces: tuple[NamespaceSpec, ...] = ()
    default_vocab_size: int = 262144
    drafter: DrafterConfig = field(default_factory=DrafterConfig)
    rebuild_interval_s: float = 1.0
    rebuild_in_subprocess: bool = True
    snapshot_interval_s: float = 30.0
    max_message_bytes: int = 64 * 1024 * 1024
    max_request_tokens: int = 1 << 20
    max_ingest_requests: int = 10000
    max_nodes_limit: int = 1024
    max_sessions: int = 100000
    workers: int = 128
    max_streams: int = 0
    max_concurrent_rpcs: int = 0
    draft_models: tuple[DraftModelSpec, ...] = ()
    http_address: str = "127.0.0.1:8050"
    metrics_interval_s: float = 5.0
    metrics_history: int = 7 * 24 * 3600 // 5
    warm_dir: str = ""
    warm_tokenizer: str = ""
    warm_interval_s: float = 10.0
    warm_namespace: str = DEFAULT_NAMESPACE
    replica_id: str = ""
    spool_dir: str = ""
    spool_max_bytes: int = 256 * 1024 * 1024
    spool_drain_interval_s: float = 1.0
    follow_log: str = "auto"
    namespace_tokens: tuple[tuple[str, str], ...] = field(default=(), repr=False)
    admin_token: str = field(default="", repr=False)
    http_token: str = field(default="", repr=False)
    tls_cert: str = ""
    tls_key: str = ""
    tls_client_ca: str = ""
    max_sessions_per_client: int = 0

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
                     "spool_drain_interval_s"):
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

"""Configuration of the whole service: addresses, storage, namespaces, limits and background jobs."""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from drafter_service.config import CardSettings, DrafterConfig

NAME_RE = re.compile(r"^[A-Za-z0-9_.-]{1,64}$")
DEFAULT_NAMESPACE = "default"


def check_name(name: str, what: str = "namespace") -> str:
    """Return ``name`` when it is a valid namespace or table name, else raise ValueError."""
    if not NAME_RE.match(name or ""):
        raise ValueError(f"bad {what} name {name!r}: use 1-64 letters, digits, '_', '.', '-'")
    return name


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
class DraftModelSpec:
    """An optional draft model for one namespace.

    Attributes:
        namespace: the namespace it drafts for (its vocabulary must match the model's).
        path: folder of the model (from ``drafter distill-draft`` or any transformers causal-LM checkpoint).
        device: "cpu", "cuda" or "cuda:N".
        dtype: "float32", "bfloat16" or "float16".
        threads: torch CPU threads for the model (0 leaves torch's default).
        card: cache sizes and policies.
    """

    namespace: str
    path: str
    device: str = "cpu"
    dtype: str = "float32"
    threads: int = 0
    card: CardSettings = field(default_factory=CardSettings)

    def __post_init__(self) -> None:
        check_name(self.namespace)
        if not self.path:
            raise ValueError(f"namespace {self.namespace!r}: empty draft model path")
        if self.dtype not in ("float32", "bfloat16", "float16"):
            raise ValueError(f"draft model dtype must be float32, bfloat16 or float16, got {self.dtype!r}")
        if self.device != "cpu" and not self.device.startswith("cuda"):
            raise ValueError(f"draft model device must be cpu or cuda[:N], got {self.device!r}")
        if self.threads < 0:
            raise ValueError(f"draft model threads must be >= 0, got {self.threads}")

    @classmethod
    def parse_list(cls, text: str, **common: object) -> tuple["DraftModelSpec", ...]:
        """Parse ``[NAMESPACE=]PATH[,...]`` (no namespace means the default one)."""
        specs = []
        for part in (p.strip() for p in text.split(",")):
            if not part:
                continue
            name, sep, path = part.partition("=")
            if not sep:
                name, path = DEFAULT_NAMESPACE, part
            specs.append(cls(name.strip(), path.strip(), **common))  # type: ignore[arg-type]
        return tuple(specs)


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
        max_request_tokens: most tokens in one prompt, one accepted list or one ingested request.
        max_ingest_requests: most requests in one Ingest call.
        max_nodes_limit: largest tree budget a client may ask for.
        max_sessions: most live sessions over all namespaces.
        workers: gRPC server threads.
        draft_models: optional draft models, at most one per namespace.
        http_address: where the dashboard, ``/metrics`` and the JSON API listen ("host:0" picks a free port;
            "" serves no HTTP).
        metrics_interval_s: seconds between metric points (the rollup into Redis).
        metrics_history: metric points kept per namespace in Redis (the default is a week at 5 s).
        warm_dir: a folder whose new and grown request logs are warmed into ``warm_namespace`` ("" for none).
        warm_tokenizer: that namespace's tokenizer (tokenizer.json or its folder) for text and chat logs.
        warm_interval_s: seconds between scans of ``warm_dir``.
        warm_namespace: the namespace ``warm_dir`` is warmed into.
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
    workers: int = 64
    draft_models: tuple[DraftModelSpec, ...] = ()
    http_address: str = "127.0.0.1:8050"
    metrics_interval_s: float = 5.0
    metrics_history: int = 7 * 24 * 3600 // 5
    warm_dir: str = ""
    warm_tokenizer: str = ""
    warm_interval_s: float = 10.0
    warm_namespace: str = DEFAULT_NAMESPACE

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
        for name in ("rebuild_interval_s", "snapshot_interval_s", "metrics_interval_s", "warm_interval_s"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive")
        for name in ("max_message_bytes", "max_request_tokens", "max_ingest_requests", "max_nodes_limit",
                     "max_sessions", "workers", "metrics_history"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1")

        if self.http_address:
            host, sep, port = self.http_address.rpartition(":")
            if not sep or not host or not port.isdigit() or int(port) > 65535:
                raise ValueError(f"http_address must be HOST:PORT (or empty), got {self.http_address!r}")

    def namespace(self, name: str) -> NamespaceSpec | None:
        """The declared namespace ``name`` (None when unknown)."""
        return next((ns for ns in self.namespaces if ns.name == name), None)

"""Configuration of one namespace's drafting core."""

from __future__ import annotations

import os
from dataclasses import dataclass, field, fields

from drafter_service.api.names import DEFAULT_NAMESPACE, check_name
from drafter_service.core.settings import Setting, setting

DRAFTING = "drafting"
"""Settings group of the namespaces' drafting cores."""
DRAFT_MODEL = "draft model"
"""Settings group of the optional draft models."""
GATES = ("time", "acceptance", "off")
"""When a draft model's nodes are served (``CardSettings.gate``)."""
SOURCE_NAMES = ("session", "store", "dynamic", "frozen", "repeat")
"""The model-free sources a namespace drafts from (DrafterConfig's ``use_<name>`` fields)."""


MAX_BATCH_THREADS = 8
"""Most threads a batched step drafts on (``DrafterConfig.batch_threads``; the native pool holds up to 16)."""


@dataclass(frozen=True)
class DrafterConfig:
    """Sizes and policies of the store, the n-gram tables and the draft trees of one namespace.

    Fields declared with ``setting`` are ``drafter serve`` flags; their help says what they mean.

    Attributes:
        vocab_size: token ids must be in [0, vocab_size).
        tail_tokens: unindexed tokens tolerated before the small (delta) index is rebuilt.
        max_match: longest context suffix matched in the store and the session.
        max_occurrences: most recent occurrences whose continuations feed a tree, per source.
        leader_len, follower_len: Cacheback LL, FL (``leader_capacity`` and ``follower_capacity`` are LC, FC).
        table_branch: followers read per table query.
        branch: most children of one node.
        max_depth: deepest node of a tree.
        min_prob: nodes whose estimated acceptance is lower are not drafted.
        adaptive_budget: shrink a session's budget while its drafts are rarely accepted.
        batch_threads: threads a batched step drafts on (0: ``default_batch_threads()``).
        min_nodes: the smallest budget adaptation goes down to.
        use_session, use_store, use_dynamic, use_frozen: enable each source (for ablations; ``SOURCES`` sets them).
        use_repeat: offer the stored output of an earlier request with the same prompt (exact-match cache).
        repeat_cache_tokens: most output tokens the cache of repeated prompts holds.
    """

    vocab_size: int = 1 << 20
    capacity: int = field(default=32 * 1024 * 1024, metadata=setting(
        "--capacity", "ring buffer size in tokens, per namespace (16.1 bytes per token with its index)", DRAFTING))
    tail_tokens: int = 8192
    max_match: int = 32
    max_occurrences: int = 32
    leader_len: int = 1
    follower_len: int = 3
    leader_capacity: int = field(default=1 << 20, metadata=setting(
        "--leader-capacity", "dynamic n-gram table: most leaders (LC)", DRAFTING))
    follower_capacity: int = field(default=128, metadata=setting(
        "--follower-capacity", "dynamic n-gram table: followers per leader (FC)", DRAFTING))
    table_branch: int = 8
    branch: int = 8
    max_nodes: int = field(default=32, metadata=setting("--max-nodes", "default tree budget", DRAFTING))
    batch_threads: int = field(default=0, metadata=setting(
        "--batch-threads", "threads one DraftBatch step drafts its sessions on, 8 or more sessions a thread (0: one a "
        f"CPU the service may use, at most {MAX_BATCH_THREADS})", DRAFTING))
    max_depth: int = 24
    min_prob: float = 0.001
    adaptive_budget: bool = True
    min_nodes: int = 8
    use_session: bool = True
    use_store: bool = True
    use_dynamic: bool = True
    use_frozen: bool = True
    use_repeat: bool = True
    repeat_cache_tokens: int = 1 << 24

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if isinstance(value, bool):
                continue
            if f.name == "min_prob":
                if not 0.0 <= value < 1.0:
                    raise ValueError(f"min_prob must be in [0, 1), got {value}")
            elif f.name == "batch_threads":
                if not 0 <= value <= MAX_BATCH_THREADS:
                    raise ValueError(f"batch_threads must be in [0, {MAX_BATCH_THREADS}], got {value}")
            elif value < 1:
                raise ValueError(f"{f.name} must be at least 1, got {value}")
        if self.capacity < 2:
            raise ValueError(f"capacity must be at least 2, got {self.capacity}")
        if self.min_nodes > self.max_nodes:
            raise ValueError(f"min_nodes ({self.min_nodes}) exceeds max_nodes ({self.max_nodes})")


def sources_from_text(text: str) -> dict[str, bool]:
    """DrafterConfig's ``use_<source>`` fields from a comma-separated list of sources ("none": no source).

    Raises:
        ValueError: an unknown source.
    """
    sources = {part.strip() for part in text.split(",") if part.strip() and part.strip() != "none"}
    unknown = sources - set(SOURCE_NAMES)
    if unknown:
        raise ValueError(f"unknown sources {sorted(unknown)}; choose among {sorted(SOURCE_NAMES)} or 'none'")
    return {f"use_{name}": name in sources for name in SOURCE_NAMES}


# One flag for five fields, so it is declared beside them rather than on one.
SOURCES = Setting("--sources", "model-free sources to draft from (comma-separated; 'none' for the draft model alone)",
                  DRAFTING, default=",".join(SOURCE_NAMES), parse=sources_from_text, name="DrafterConfig.use_*")
"""The ``--sources`` setting: its value is DrafterConfig's ``use_<source>`` keywords."""


@dataclass(frozen=True)
class CardSettings:
    """How a namespace drafts with its optional draft model (CARD's candidate cache).

    Fields declared with ``setting`` are ``drafter serve`` flags; their help says what they mean.

    Attributes:
        max_nodes: most live nodes in one session's cache.
    """

    width: int = field(default=16, metadata=setting(
        "--card-width", "K: sequences kept per draft-model cache layer", DRAFT_MODEL))
    top_k: int = field(default=4, metadata=setting(
        "--card-top-k", "k: candidates taken from each sequence's distribution", DRAFT_MODEL))
    layers_ahead: int = field(default=6, metadata=setting(
        "--card-layers", "layers the draft model grows ahead of the verified prefix before waiting for the next "
        "correction (the paper's communication ratio)", DRAFT_MODEL))
    max_nodes: int = 1024
    correction: bool = field(default=True, metadata=setting(
        "--card-correction", "1: prune the cache to the verified prefix after every step (CARD's correction); 0: "
        "ablation without it", DRAFT_MODEL))
    max_sessions: int = field(default=8, metadata=setting(
        "--card-max-sessions", "most sessions with a draft-model cache at once; later sessions draft without the "
        "model", DRAFT_MODEL))
    vocab: int = field(default=-1, metadata=setting(
        "--card-vocab", "draft over this many of the most frequent tokens (counted over the namespace's store and "
        "the model's token_counts.npy when it has one; 0: all; -1: 8192 for a model on a CPU, all on a GPU); the "
        "output head is most of a small draft model's cost", DRAFT_MODEL))
    nice: int = field(default=0, metadata=setting(
        "--card-nice", "CPU niceness of the draft model's threads (0-19; Linux): on a CPU shared with the target, a "
        "higher value leaves the target more of it", DRAFT_MODEL))
    idle_priority: int = field(default=-1, metadata=setting(
        "--card-idle", "1: run the draft model's threads under SCHED_IDLE (only cycles nothing else wants); 0: "
        "normal priority; -1: SCHED_IDLE for a model on a CPU that the service does not have to itself (it may "
        "run on every CPU of the machine, as an engine beside it does)", DRAFT_MODEL))
    gate: str = field(default="time", metadata=setting(
        "--card-gate", "when the model's nodes are served: time (while they raise tokens per second, measured from "
        "acceptance and from the engine's step times with the model running and paused), acceptance (while they "
        "raise acceptance; the model never pauses), off (always)", DRAFT_MODEL))

    def __post_init__(self) -> None:
        if not 0 <= self.nice <= 19:
            raise ValueError(f"draft model nice must be in [0, 19], got {self.nice}")
        if self.vocab < -1:
            raise ValueError(f"draft model vocab must be >= 0 (or -1: by device), got {self.vocab}")
        if self.idle_priority not in (-1, 0, 1):
            raise ValueError(f"draft model idle priority must be 1, 0 or -1 (by machine), got {self.idle_priority}")
        if self.gate not in GATES:
            raise ValueError(f"draft model gate must be one of {', '.join(GATES)}, got {self.gate!r}")
        for name in ("width", "top_k", "layers_ahead", "max_nodes", "max_sessions"):
            if getattr(self, name) < 1:
                raise ValueError(f"draft model {name} must be at least 1, got {getattr(self, name)}")


@dataclass(frozen=True)
class DraftModelSpec:
    """An optional draft model for one namespace.

    Fields declared with ``setting`` are ``drafter serve`` flags (applied to every model listed); their help says
    what they mean.

    Attributes:
        namespace: the namespace it drafts for (its vocabulary must match the model's).
        path: folder of the model (from ``drafter distill-draft`` or any transformers causal-LM checkpoint).
        card: cache sizes and policies.
    """

    namespace: str
    path: str
    device: str = field(default="cpu", metadata=setting(
        "--draft-device", "device of the draft model: cpu, cuda or cuda:N", DRAFT_MODEL))
    dtype: str = field(default="float32", metadata=setting(
        "--draft-dtype", "draft model dtype: float32, bfloat16 or float16", DRAFT_MODEL))
    threads: int = field(default=0, metadata=setting(
        "--draft-threads", "torch CPU threads for the draft model (0: torch's default)", DRAFT_MODEL))
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
    def parse_list(cls, text: str, **common: object) -> tuple[DraftModelSpec, ...]:
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


def default_batch_threads() -> int:
    """Threads a batched step drafts on when ``batch_threads`` is 0: one for each CPU this process may run on, at
    most ``MAX_BATCH_THREADS``."""
    try:
        cpus = len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        cpus = os.cpu_count() or 1
    return max(1, min(MAX_BATCH_THREADS, cpus))

"""Configuration of one namespace's drafting core."""

from __future__ import annotations

from dataclasses import dataclass, field, fields

from drafter_service.api.names import DEFAULT_NAMESPACE, check_name


@dataclass(frozen=True)
class DrafterConfig:
    """Sizes and policies of the store, the n-gram tables and the draft trees of one namespace.

    Attributes:
        vocab_size: token ids must be in [0, vocab_size).
        capacity: ring buffer size in tokens.
        tail_tokens: unindexed tokens tolerated before the small (delta) index is rebuilt.
        max_match: longest context suffix matched in the store and the session.
        max_occurrences: most recent occurrences whose continuations feed a tree, per source.
        leader_len, follower_len, leader_capacity, follower_capacity: Cacheback LL, FL, LC, FC.
        table_branch: followers read per table query.
        branch: most children of one node.
        max_nodes: default tree budget.
        max_depth: deepest node of a tree.
        min_prob: nodes whose estimated acceptance is lower are not drafted.
        adaptive_budget: shrink a session's budget while its drafts are rarely accepted.
        min_nodes: the smallest budget adaptation goes down to.
        use_session, use_store, use_dynamic, use_frozen: enable each source (for ablations).
        use_repeat: offer the stored output of an earlier request with the same prompt (exact-match cache).
        repeat_cache_tokens: most output tokens the cache of repeated prompts holds.
    """

    vocab_size: int = 1 << 20
    capacity: int = 32 * 1024 * 1024
    tail_tokens: int = 8192
    max_match: int = 32
    max_occurrences: int = 32
    leader_len: int = 1
    follower_len: int = 3
    leader_capacity: int = 1 << 20
    follower_capacity: int = 128
    table_branch: int = 8
    branch: int = 8
    max_nodes: int = 32
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
            elif value < 1:
                raise ValueError(f"{f.name} must be at least 1, got {value}")
        if self.capacity < 2:
            raise ValueError(f"capacity must be at least 2, got {self.capacity}")
        if self.min_nodes > self.max_nodes:
            raise ValueError(f"min_nodes ({self.min_nodes}) exceeds max_nodes ({self.max_nodes})")


@dataclass(frozen=True)
class CardSettings:
    """How a namespace drafts with its optional draft model (CARD's candidate cache).

    Attributes:
        width: K, sequences kept per cache layer.
        top_k: k, candidates taken from each sequence's distribution.
        layers_ahead: most layers grown below the verified prefix before waiting for the next correction (the
            paper's communication ratio).
        max_nodes: most live nodes in one session's cache.
        correction: prune the cache to the verified prefix after every step (False only for ablations).
        max_sessions: most sessions with a cache at once; later sessions draft without the model.
        vocab: draft over the ``vocab`` most frequent tokens only (counted over the namespace's store and the
            model's ``token_counts.npy`` when it has one); 0 for the full vocabulary.
        nice: CPU niceness of each worker thread (Linux, 0-19): on a CPU shared with the target, a higher value
            leaves the target more of it and the draft model less.
        idle_priority: run each worker thread under SCHED_IDLE instead: the draft model only takes cycles the
            target leaves.
    """

    width: int = 16
    top_k: int = 4
    layers_ahead: int = 6
    max_nodes: int = 1024
    correction: bool = True
    max_sessions: int = 8
    vocab: int = 0
    nice: int = 0
    idle_priority: bool = False

    def __post_init__(self) -> None:
        if not 0 <= self.nice <= 19:
            raise ValueError(f"draft model nice must be in [0, 19], got {self.nice}")
        if self.vocab < 0:
            raise ValueError(f"draft model vocab must be >= 0, got {self.vocab}")
        for name in ("width", "top_k", "layers_ahead", "max_nodes", "max_sessions"):
            if getattr(self, name) < 1:
                raise ValueError(f"draft model {name} must be at least 1, got {getattr(self, name)}")


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

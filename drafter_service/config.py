"""Configuration of one namespace's drafting core."""

from __future__ import annotations

from dataclasses import dataclass, fields


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

"""One engine step of many sessions in one native call: every session corrected, then each one drafted."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np

import store.match_kernels as kernels
from drafter_service.core.acceptance import AcceptanceModel
from drafter_service.core.config import DrafterConfig, default_batch_threads
from drafter_service.core.session import FULL_BUDGET_EMA, BudgetPolicy, DraftSession, lookup_tokens
from drafter_service.core.tree_builder import native_module
from store.ngram_table import NativeLRUTable
from store.token_store import Continuations, TokenStore


class Drafting(Protocol):
    """What a batched step reads of a drafter (``Drafter`` has it all)."""

    config: DrafterConfig
    store: TokenStore
    dynamic: Any
    model: AcceptanceModel
    policy: BudgetPolicy

    @property
    def frozen(self) -> Mapping[str, Any]: ...


@dataclass
class StepsOutcome:
    """The trees of a batched step, packed one after another, and what each session's accepted tokens confirmed.

    Tree i is nodes ``offsets[i]`` to ``offsets[i + 1] - 1`` of ``token_ids`` (int32), ``parents`` (int32, relative
    to the tree's first node, -1 for a child of the root), ``probs`` (float64) and ``kinds`` (uint8 source kind:
    0 session, 1 store, 2 dynamic, 3 frozen; see ``tree_builder.SOURCE_NAMES``), every node's in one array.

    Attributes:
        latencies_ns: (sessions,) int64 time of each session's step.
        drafted_by_kind: nodes drafted per source kind.
        confirmed_by_kind: confirmed nodes of the scored drafts per source kind.
    """

    offsets: list[int]
    token_ids: np.ndarray
    parents: np.ndarray
    probs: np.ndarray
    kinds: np.ndarray
    confirmed: list[int]
    latencies_ns: np.ndarray
    drafted_by_kind: tuple[int, int, int, int]
    confirmed_by_kind: tuple[int, int, int, int]


_DEFAULT_THREADS = default_batch_threads()


def available(drafter: Drafting) -> bool:
    """Whether ``drafter`` can take batched steps: the native builder and, when it learns, the native table."""
    native = native_module()
    return native is not None and hasattr(native, "steps") and (
        not drafter.config.use_dynamic or (NativeLRUTable is not None and isinstance(drafter.dynamic, NativeLRUTable)))


def draft_steps(drafter: Drafting, sessions: Sequence[DraftSession], accepted: np.ndarray, offsets: list[int],
                limits: list[int], report: list[bool]) -> StepsOutcome:
    """Correct every session in order, then draft for each, exactly as ``Drafter.correct`` for all of them and then
    ``Drafter.draft`` for each would (the drafts see every session's accepted tokens in the tables; the drafting
    runs on up to ``config.batch_threads`` threads and gives the same trees on any number).

    The sessions must be ``batchable``, open, distinct, and ``available(drafter)`` must hold.

    Args:
        drafter: the sessions' drafter.
        sessions: the sessions of the step.
        accepted: (total,) int32 validated tokens of every session, one after another.
        offsets: session i's tokens are ``accepted[offsets[i]:offsets[i + 1]]``.
        limits: each session's budget before adapting (the step's ``max_nodes``, or else the session's).
        report: sessions whose tokens are only recorded (their trees are empty).
    """
    native = native_module()
    assert native is not None
    cfg = drafter.config
    store = drafter.store
    store_native = store.native_lookup_args() if cfg.use_store else None
    session_fn = kernels.native.session_lookup if kernels.native is not None else None

    def fallback(kind: int, tokens: np.ndarray) -> Continuations:  # where a native lookup declines its arguments
        if kind == 0:
            return lookup_tokens(tokens, tokens.size, cfg.max_match, cfg.max_occurrences, cfg.max_depth)
        return store.lookup(tokens, cfg.max_match, cfg.max_occurrences, cfg.max_depth)

    tables: list[tuple[int, object, int]] = []
    if cfg.use_dynamic:
        tables.append((2, drafter.dynamic, cfg.table_branch))
    if cfg.use_frozen:
        tables.extend((3, t, cfg.table_branch) for t in drafter.frozen.values())
    leader_len = max((t.leader_len for _, t, _ in tables), default=1)  # type: ignore[attr-defined]
    model, policy = drafter.model, drafter.policy
    settings = (int(cfg.use_session), session_fn, int(cfg.use_store), store_native[0] if store_native else None,
                store_native[1] if store_native else None, fallback, drafter.dynamic if cfg.use_dynamic else None,
                tables, cfg.leader_len, leader_len, model.accepted, model.trials, model.prior_strength,
                float(model.horizon), cfg.max_match, cfg.max_occurrences, cfg.max_depth, cfg.min_prob, cfg.branch,
                int(policy.adaptive), policy.min_nodes, cfg.batch_threads or _DEFAULT_THREADS, FULL_BUDGET_EMA)
    with model.lock:  # the sessions are read and updated in place (DraftSession.batch_state, stepped)
        (tree_offsets, token_ids, parents, probs, kinds, confirmed, latencies, drafted_by_kind,
         confirmed_by_kind) = native.steps(sessions if type(sessions) is list else list(sessions), accepted, offsets,
                                           limits, report, settings)
    return StepsOutcome(tree_offsets, np.frombuffer(token_ids, np.int32), np.frombuffer(parents, np.int32),
                        np.frombuffer(probs, np.float64), np.frombuffer(kinds, np.uint8), confirmed,
                        np.frombuffer(latencies, np.int64), drafted_by_kind, confirmed_by_kind)

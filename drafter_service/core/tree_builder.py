"""Best-first construction of one draft tree from every source's candidates."""

from __future__ import annotations

import heapq
import os
from collections.abc import Sequence
from dataclasses import dataclass
from types import ModuleType
from typing import Protocol

import numpy as np

from drafter_service.api.tree import EMPTY_TREE, DraftTree
from drafter_service.core.acceptance import (
    AcceptanceModel,
    agree_key,
    contested_key,
    follower_key,
    fresh_key,
    rows_key,
)

Evidence = tuple[Sequence[int], Sequence[int], Sequence[float]]
"""Why each node was proposed: (offsets (n + 1,), keys, priors); node i's evidence is
``keys[offsets[i]:offsets[i + 1]]`` with the priors used for them."""

_native: ModuleType | None
try:
    from drafter_service.core import _tree as _native
except ImportError:  # the extension is optional: the Python builder below is the reference
    _native = None
if os.environ.get("DRAFTER_PURE_PYTHON") == "1":
    _native = None

SOURCE_NAMES = ("session", "store", "dynamic", "frozen")
ROWS_KINDS = 2  # session, store


class FollowerTable(Protocol):
    """What the builder needs from an n-gram table (dynamic or frozen)."""

    leader_len: int

    def query(self, leader: Sequence[int], limit: int | None = None) -> list[tuple[tuple[int, ...], int]]: ...


@dataclass(frozen=True)
class RowsSource:
    """Continuations of a suffix match: ``rows[i]`` is what followed occurrence i (-1 padded).

    ``kind`` is 0 for the session's own tokens and 1 for the global store.
    """

    kind: int
    match_len: int
    rows: np.ndarray  # (k, depth) int32, -1 padded


@dataclass(frozen=True)
class TableSource:
    """An n-gram table queried at the root and wherever no follower is in progress.

    ``kind`` is 2 for the dynamic table and 3 for a frozen one.
    """

    kind: int
    table: FollowerTable
    branch: int


@dataclass(frozen=True)
class BuildLimits:
    """Bounds on one tree."""

    max_nodes: int
    max_depth: int
    min_prob: float
    branch: int = 8


def rows_prior(match_len: int, share: float, n: int) -> float:
    """Starting estimate for a suffix-match child before any outcome is observed."""
    return share * (match_len / (match_len + 1.0)) * (n / (n + 0.5))


_TABLE_PRIOR = {2: 0.3, 3: 0.15}
_FOLLOWER_PRIOR = 0.6


class _Child:
    """Evidence gathered for one candidate token under one node."""

    __slots__ = ("rows", "states", "rank", "count", "kinds")

    def __init__(self) -> None:
        self.rows: list[int] = []
        self.states: list[tuple[TableSource, tuple[int, ...], int]] = []
        self.rank = 99  # best recency/frequency rank among fresh followers
        self.count = 0  # insertions of those followers
        self.kinds = 0  # bit mask of source kinds


def build_tree(context: Sequence[int], rows_sources: Sequence[RowsSource], table_sources: Sequence[TableSource],
               model: AcceptanceModel, limits: BuildLimits, native: bool = True) -> tuple[DraftTree, Evidence]:
    """Grow the tree best-first: always add the candidate with the highest estimated acceptance.

    Every node gathers, for each possible next token, the evidence of all sources at once: the suffix
    matches (session and store) whose continuation goes on with it, the n-gram followers in progress
    through it, and fresh table followers (queried with the last ``leader_len`` tokens of context and
    path) where none of that table is in progress. The acceptance model turns that evidence into a
    conditional estimate; a node's estimate is its parent's times it.

    Args:
        context: the sequence so far (its last tokens lead the first table queries).
        rows_sources: suffix-match sources, at most one per kind.
        table_sources: n-gram tables, in priority order.
        model: conditional acceptance estimates.
        limits: node, depth, probability and branching bounds.
        native: use the compiled builder when it is available (same results).

    Returns:
        The tree and the evidence behind each node (for ``score_draft``).
    """
    leader_len = max((t.table.leader_len for t in table_sources), default=1)
    if native and _native is not None:
        by_kind = {src.kind: src for src in rows_sources}
        s0, s1 = by_kind.get(0), by_kind.get(1)
        out = _native.build(
            context[-leader_len:], None if s0 is None else s0.rows, 0 if s0 is None else s0.match_len,
            None if s1 is None else s1.rows, 0 if s1 is None else s1.match_len,
            [(t.kind, t.table, t.branch) for t in table_sources], leader_len, model.accepted, model.trials,
            limits.max_nodes, limits.max_depth, limits.min_prob, limits.branch)
        tokens, parents, probs, kinds, offsets, keys, priors = out
        if not tokens:
            return EMPTY_TREE, ((0,), (), ())
        names = tuple(map(SOURCE_NAMES.__getitem__, kinds))
        return DraftTree(tokens, parents, probs, float(sum(probs)), names), (offsets, keys, priors)
    return _build_python(context, rows_sources, table_sources, model, limits, leader_len)


def _build_python(context: Sequence[int], rows_sources: Sequence[RowsSource], table_sources: Sequence[TableSource],
                  model: AcceptanceModel, limits: BuildLimits, leader_len: int) -> tuple[DraftTree, Evidence]:
    rows: list[list[int]] = []
    row_kind: list[int] = []
    match_len = [0] * ROWS_KINDS
    for src in sorted(rows_sources, key=lambda s: s.kind):
        rows.extend(src.rows.tolist())
        row_kind.extend([src.kind] * len(src.rows))
        match_len[src.kind] = src.match_len
    depth_cap = max((len(r) for r in rows[:1] + rows[-1:]), default=0)
    estimate = model.estimate
    branch, min_prob = limits.branch, limits.min_prob
    heap: list[tuple] = []
    seq = 0
    tokens: list[int] = []
    parents: list[int] = []
    context_tail = [int(t) for t in context[-leader_len:]]

    def leader_at(node: int) -> tuple[int, ...] | None:
        path: list[int] = []
        while len(path) < leader_len and node >= 0:
            path.append(tokens[node])
            node = parents[node]
        need = leader_len - len(path)
        if need > len(context_tail):
            return None
        return tuple(context_tail[len(context_tail) - need:] + path[::-1]) if need else tuple(path[::-1])

    def expand(parent: int, pprob: float, depth: int, row_ids: list[int],
               states: list[tuple[TableSource, tuple[int, ...], int]]) -> None:
        nonlocal seq
        children: dict[int, _Child] = {}
        n = len(row_ids)
        if n and depth < depth_cap:
            for r in row_ids:
                row = rows[r]
                tok = row[depth] if depth < len(row) else -1
                if tok >= 0:
                    ch = children.get(tok)
                    if ch is None:
                        ch = children[tok] = _Child()
                    ch.rows.append(r)
                    ch.kinds |= 1 << row_kind[r]
        progressing = 0
        for src, fol, j in states:
            if j + 1 < len(fol):
                progressing |= 1 << src.kind
                tok = fol[j + 1]
                ch = children.get(tok)
                if ch is None:
                    ch = children[tok] = _Child()
                ch.states.append((src, fol, j + 1))
                ch.kinds |= 1 << src.kind
        leader = leader_at(parent) if table_sources else None
        if leader is not None:
            for src in table_sources:
                if progressing >> src.kind & 1:
                    continue
                for rank, (fol, count) in enumerate(src.table.query(leader, src.branch)):
                    tok = fol[0]
                    ch = children.get(tok)
                    if ch is None:
                        ch = children[tok] = _Child()
                    ch.states.append((src, fol, 0))
                    ch.kinds |= 1 << src.kind
                    if rank < ch.rank:
                        ch.rank, ch.count = rank, count
        if len(children) > branch:
            children = dict(sorted(children.items(), key=lambda kv: -len(kv[1].rows) - len(kv[1].states))[:branch])
        at_node = [0] * ROWS_KINDS
        for r in row_ids:
            at_node[row_kind[r]] += 1
        present = 0  # source kinds proposing any child here
        for ch in children.values():
            present |= ch.kinds
        for tok, ch in children.items():
            keys: list[int] = []
            priors: list[float] = []
            best = 0.0
            contested = bool(present & ~ch.kinds)  # another source kind proposes a different token here
            if ch.rows:
                here = [0] * ROWS_KINDS
                for r in ch.rows:
                    here[row_kind[r]] += 1
                for kind in range(ROWS_KINDS):
                    c = here[kind]
                    if c:
                        share = c / at_node[kind]
                        m = match_len[kind] + depth
                        key = rows_key(kind, m, share, at_node[kind])
                        key = contested_key(key) if contested else key
                        prior = rows_prior(m, share, at_node[kind])
                        keys.append(key)
                        priors.append(prior)
                        best = max(best, estimate(key, prior))
            if ch.states:
                src, fol, j = ch.states[0]
                if j > 0:
                    key = follower_key(src.kind, j)
                    prior = _FOLLOWER_PRIOR
                else:
                    key = fresh_key(src.kind, ch.rank, ch.count)
                    prior = _TABLE_PRIOR[src.kind] / (1.0 + ch.rank)
                if contested:
                    key = contested_key(key)
                keys.append(key)
                priors.append(prior)
                best = max(best, estimate(key, prior))
            if len(keys) > 1:
                key = agree_key(ch.kinds, best)
                keys.append(key)
                priors.append(best)
                best = estimate(key, best)
            p = pprob * best
            if p >= min_prob:
                seq += 1
                heapq.heappush(heap, (-p, seq, parent, tok, depth + 1, ch.rows, ch.states, keys, priors, ch.kinds))

    expand(-1, 1.0, 0, list(range(len(rows))), [])
    if not heap:
        return EMPTY_TREE, ((0,), (), ())
    probs: list[float] = []
    sources: list[str] = []
    offsets = [0]
    all_keys: list[int] = []
    all_priors: list[float] = []
    max_nodes, max_depth = limits.max_nodes, limits.max_depth
    pop = heapq.heappop
    while heap and len(tokens) < max_nodes:
        negp, _, parent, tok, depth, row_ids, states, keys, priors, kinds = pop(heap)
        node = len(tokens)
        tokens.append(tok)
        parents.append(parent)
        probs.append(-negp)
        sources.append(SOURCE_NAMES[(kinds & -kinds).bit_length() - 1])
        all_keys.extend(keys)
        all_priors.extend(priors)
        offsets.append(len(all_keys))
        if len(tokens) >= max_nodes:
            break
        if depth < max_depth:
            expand(node, -negp, depth, row_ids, states)
    tree = DraftTree(tuple(tokens), tuple(parents), tuple(probs), float(sum(probs)), tuple(sources))
    return tree, (offsets, all_keys, all_priors)


def score_packed(packed: bytes | bytearray, accepted: Sequence[int], model: AcceptanceModel,
                 ) -> tuple[int, int, list[int]]:
    """``score_draft`` for a draft the batched step left packed (see ``batch_steps``).

    Returns:
        (draft tokens ``accepted`` confirmed, nodes of the draft, source kind of each confirmed node).
    """
    assert _native is not None  # only the native batched step packs drafts
    with model.lock:
        return _native.score_packed(packed, accepted, model.accepted, model.trials, model.prior_strength,
                                    float(model.horizon))


def pack_draft(tree: DraftTree, evidence: Evidence) -> bytes:
    """A natively built tree and its evidence as one packed draft, which ``score_packed`` scores the same way."""
    assert _native is not None  # only the native batched step takes packed drafts
    offsets, keys, priors = evidence
    return _native.pack(tree.token_ids, tree.parents, [SOURCE_NAMES.index(s) for s in tree.sources], offsets, keys,
                        priors)


def native_module() -> ModuleType | None:
    """The compiled builder (None when it is not built or DRAFTER_PURE_PYTHON=1)."""
    return _native


def score_draft(tree: DraftTree, evidence: Evidence, accepted: Sequence[int], model: AcceptanceModel,
                native: bool = True) -> int:
    """Record how a draft fared and return how many of its tokens ``accepted`` confirmed.

    Every child of the root and of each confirmed node was tested against one token; each of its
    evidence keys is recorded as accepted or not.
    """
    if not len(tree) or not len(accepted):
        return 0
    offsets, keys, priors = evidence
    if native and _native is not None:
        with model.lock:
            return _native.score(tree.token_ids, tree.parents, offsets, keys, priors, accepted, model.accepted,
                                 model.trials, model.prior_strength, float(model.horizon))
    kids = tree.children()
    outcomes = []
    node, n_acc = -1, 0
    while n_acc < len(accepted):
        level = kids.get(node)
        if not level:
            break
        nxt = level.get(accepted[n_acc])
        for child in level.values():
            hit = child == nxt
            for e in range(offsets[child], offsets[child + 1]):
                outcomes.append((keys[e], priors[e], hit))
        if nxt is None:
            break
        node, n_acc = nxt, n_acc + 1
    model.record(outcomes)
    return n_acc

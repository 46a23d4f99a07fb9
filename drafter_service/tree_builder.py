"""Best-first construction of one draft tree from every source's candidates."""

from __future__ import annotations

import heapq
from dataclasses import dataclass
from typing import Any, Protocol, Sequence

from drafter_service.acceptance import AcceptanceModel, count_bucket, match_bucket, share_bucket
from drafter_service.tree import EMPTY_TREE, DraftTree

Evidence = tuple[Any, float]
"""(acceptance-model key, prior used) behind one proposed node."""

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
    rows: list[list[int]]


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
               model: AcceptanceModel, limits: BuildLimits) -> tuple[DraftTree, list[list[Evidence]]]:
    """Grow the tree best-first: always add the candidate with the highest estimated acceptance.

    Every node gathers, for each possible next token, the evidence of all sources at once: the suffix
    matches (session and store) whose continuation goes on with it, the n-gram followers in progress
    through it, and fresh table followers where none is in progress. The acceptance model turns that
    evidence into a conditional estimate; a node's estimate is its parent's times it.

    Args:
        context: the sequence so far (its last token leads the first table queries).
        rows_sources: suffix-match sources.
        table_sources: n-gram tables, in priority order.
        model: conditional acceptance estimates.
        limits: node, depth, probability and branching bounds.

    Returns:
        The tree and, per node, the evidence behind it (for ``AcceptanceModel.record``).
    """
    rows: list[list[int]] = []
    row_kind: list[int] = []
    match_len = [0] * ROWS_KINDS
    for src in rows_sources:
        rows.extend(src.rows)
        row_kind.extend([src.kind] * len(src.rows))
        match_len[src.kind] = src.match_len
    depth_cap = max((len(r) for r in rows[:1] + rows[-1:]), default=0)
    estimate = model.estimate
    branch, min_prob = limits.branch, limits.min_prob
    heap: list[tuple] = []
    seq = 0

    def expand(parent: int, pprob: float, depth: int, row_ids: list[int],
               states: list[tuple[TableSource, tuple[int, ...], int]], last: int) -> None:
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
        for state in states:
            src, fol, j = state
            if j + 1 < len(fol):
                progressing |= 1 << src.kind
                tok = fol[j + 1]
                ch = children.get(tok)
                if ch is None:
                    ch = children[tok] = _Child()
                ch.states.append((src, fol, j + 1))
                ch.kinds |= 1 << src.kind
        if last >= 0:
            for src in table_sources:
                if progressing >> src.kind & 1:
                    continue
                for rank, (fol, count) in enumerate(src.table.query((last,), src.branch)):
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
        if n:
            at_node = [0] * ROWS_KINDS
            for r in row_ids:
                at_node[row_kind[r]] += 1
        for tok, ch in children.items():
            evidence: list[Evidence] = []
            best = 0.0
            if ch.rows:
                here = [0] * ROWS_KINDS
                for r in ch.rows:
                    here[row_kind[r]] += 1
                for kind in range(ROWS_KINDS):
                    c = here[kind]
                    if c:
                        share = c / at_node[kind]
                        m = match_len[kind] + depth
                        key = (kind, match_bucket(m), share_bucket(share), count_bucket(at_node[kind]))
                        prior = rows_prior(m, share, at_node[kind])
                        evidence.append((key, prior))
                        best = max(best, estimate(key, prior))
            for src, fol, j in ch.states[:1] if ch.states else ():
                if j > 0:
                    key = (src.kind, "follower", j)
                    prior = _FOLLOWER_PRIOR
                else:
                    key = (src.kind, min(ch.rank, 3), count_bucket(ch.count))
                    prior = _TABLE_PRIOR.get(src.kind, 0.15) / (1.0 + ch.rank)
                evidence.append((key, prior))
                best = max(best, estimate(key, prior))
            if len(evidence) > 1:
                key = ("agree", ch.kinds, int(best * 10))
                evidence.append((key, best))
                best = estimate(key, best)
            p = pprob * best
            if p >= min_prob:
                seq += 1
                heapq.heappush(heap, (-p, seq, parent, tok, depth + 1, ch.rows, ch.states, evidence, ch.kinds))

    last = int(context[-1]) if len(context) else -1
    expand(-1, 1.0, 0, list(range(len(rows))), [], last if table_sources else -1)
    if not heap:
        return EMPTY_TREE, []

    tokens: list[int] = []
    parents: list[int] = []
    probs: list[float] = []
    sources: list[str] = []
    evidence: list[list[Evidence]] = []
    max_nodes, max_depth = limits.max_nodes, limits.max_depth
    pop = heapq.heappop
    while heap and len(tokens) < max_nodes:
        negp, _, parent, tok, depth, row_ids, states, ev, kinds = pop(heap)
        node = len(tokens)
        tokens.append(tok)
        parents.append(parent)
        probs.append(-negp)
        sources.append(SOURCE_NAMES[(kinds & -kinds).bit_length() - 1])
        evidence.append(ev)
        if depth < max_depth:
            expand(node, -negp, depth, row_ids, states, tok if table_sources else -1)
    return DraftTree(tuple(tokens), tuple(parents), tuple(probs), float(sum(probs)), tuple(sources)), evidence

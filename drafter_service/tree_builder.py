"""Best-first construction of one draft tree from every source's candidates."""

from __future__ import annotations

import heapq
from dataclasses import dataclass
from typing import Any, Protocol, Sequence

from drafter_service.acceptance import AcceptanceModel, count_bucket, match_bucket, share_bucket
from drafter_service.tree import EMPTY_TREE, DraftTree

Evidence = tuple[Any, float]
"""(acceptance-model key, prior used) behind one proposed node."""


class FollowerTable(Protocol):
    """What the builder needs from an n-gram table (dynamic or frozen)."""

    leader_len: int

    def query(self, leader: Sequence[int], limit: int | None = None) -> list[tuple[tuple[int, ...], int]]: ...


@dataclass(frozen=True)
class RowsSource:
    """Continuations of a suffix match: ``rows[i]`` is what followed occurrence i (-1 padded)."""

    name: str
    match_len: int
    rows: list[list[int]]


@dataclass(frozen=True)
class TableSource:
    """An n-gram table queried at the root and again at the end of every follower."""

    name: str
    table: FollowerTable
    branch: int
    prior_scale: float


@dataclass(frozen=True)
class BuildLimits:
    """Bounds on one tree."""

    max_nodes: int
    max_depth: int
    min_prob: float
    branch: int = 8


def _rows_prior(match_len: int, share: float, n: int) -> float:
    return share * (match_len / (match_len + 1.0)) * (n / (n + 0.5))


def build_tree(context: Sequence[int], rows_sources: Sequence[RowsSource], table_sources: Sequence[TableSource],
               model: AcceptanceModel, limits: BuildLimits) -> tuple[DraftTree, list[list[Evidence]]]:
    """Grow the tree best-first: always add the candidate with the highest estimated acceptance.

    A candidate's estimate is its parent's times the acceptance model's conditional estimate for the
    evidence that proposed it. When several sources propose the same token under the same parent they
    become one node that keeps the highest estimate and the children of all of them.

    Args:
        context: the sequence so far (its last tokens lead the table queries).
        rows_sources: suffix-match sources (session and global store).
        table_sources: n-gram tables, in priority order.
        model: conditional acceptance estimates.
        limits: node, depth, probability and branching bounds.

    Returns:
        The tree and, per node, the evidence behind it (for ``AcceptanceModel.record``).
    """
    heap: list[tuple] = []
    seq = 0
    estimate = model.estimate
    branch = limits.branch
    min_prob = limits.min_prob

    def push_rows(src: RowsSource, idxs: list[int], d: int, parent: int, pprob: float) -> None:
        nonlocal seq
        rows = src.rows
        if not rows or d >= len(rows[0]):
            return
        n = len(idxs)
        if n == 1:
            tok = rows[idxs[0]][d]
            groups = {tok: idxs} if tok >= 0 else {}
        else:
            groups = {}
            for i in idxs:
                tok = rows[i][d]
                if tok >= 0:
                    g = groups.get(tok)
                    if g is None:
                        groups[tok] = [i]
                    else:
                        g.append(i)
        if len(groups) > branch:
            groups = dict(sorted(groups.items(), key=lambda kv: -len(kv[1]))[:branch])
        m = src.match_len + d
        mb, cb = match_bucket(m), count_bucket(n)
        for tok, g in groups.items():
            share = len(g) / n
            key = (src.name, mb, share_bucket(share), cb)
            prior = _rows_prior(m, share, n)
            p = pprob * estimate(key, prior)
            if p >= min_prob:
                seq += 1
                heapq.heappush(heap, (-p, seq, parent, tok, d + 1, 0, (src, g), (key, prior)))

    def push_table(src: TableSource, follower: tuple | None, j: int, lead: tuple, depth: int, parent: int,
                   pprob: float) -> None:
        nonlocal seq
        if follower is not None and j + 1 < len(follower):
            tok = follower[j + 1]
            key = (src.name, j + 1, 0, 0)
            prior = 0.6
            p = pprob * estimate(key, prior)
            if p >= min_prob:
                seq += 1
                heapq.heappush(heap, (-p, seq, parent, tok, depth + 1, 1,
                             (src, follower, j + 1, (lead + (tok,))[-src.table.leader_len:]), (key, prior)))
            return
        if len(lead) < src.table.leader_len:
            return
        for rank, (fol, count) in enumerate(src.table.query(lead, limit=src.branch)):
            tok = fol[0]
            key = (src.name, 0, min(rank, 3), count_bucket(count))
            prior = src.prior_scale / (1.0 + rank)
            p = pprob * estimate(key, prior)
            if p >= min_prob:
                seq += 1
                heapq.heappush(heap, (-p, seq, parent, tok, depth + 1, 1,
                             (src, fol, 0, (lead + (tok,))[-src.table.leader_len:]), (key, prior)))

    for src in rows_sources:
        if src.rows:
            push_rows(src, list(range(len(src.rows))), 0, -1, 1.0)
    tail = tuple(int(t) for t in context[-max((s.table.leader_len for s in table_sources), default=0):])
    for src in table_sources:
        push_table(src, None, 0, tail[len(tail) - src.table.leader_len:], 0, -1, 1.0)
    if not heap:
        return EMPTY_TREE, []

    tokens: list[int] = []
    parents: list[int] = []
    probs: list[float] = []
    sources: list[str] = []
    evidence: list[list[Evidence]] = []
    index: dict[tuple[int, int], int] = {}
    max_nodes, max_depth = limits.max_nodes, limits.max_depth
    pop = heapq.heappop
    while heap:
        negp, _, parent, tok, depth, kind, payload, ev = pop(heap)
        node = index.get((parent, tok))
        if node is None:
            node = len(tokens)
            index[(parent, tok)] = node
            tokens.append(tok)
            parents.append(parent)
            probs.append(-negp)
            sources.append(payload[0].name)
            evidence.append([ev])
        else:
            evidence[node].append(ev)
        if len(tokens) >= max_nodes:
            break
        if depth < max_depth:
            if kind == 0:
                push_rows(payload[0], payload[1], depth, node, -negp)
            else:
                push_table(payload[0], payload[1], payload[2], payload[3], depth, node, -negp)
    return DraftTree(tuple(tokens), tuple(parents), tuple(probs), float(sum(probs)), tuple(sources)), evidence

"""CARD's candidate cache: a small draft model keeps extending a tree of likely continuations of one request.

Construction (CARD, section 2.2): the primary cache is the newest layer of at most ``width`` (K) sequences; one
forward pass of the draft model over all of them, with a mask that lets each attend to the context, its
ancestors and itself (not its peers), gives each one's next-token distribution; the ``top_k`` (k) best tokens of
each are scored by the parent's cumulative probability times their own, and a global sort keeps the best K as the
next layer. Every layer is kept, so the cache is a tree.

Correction (section 2.4): the tokens the target verified move the root down the tree; only the subtree below the
new root survives and growth continues from its frontier. When the target's tokens leave the tree, the cache
starts again from the verified context.

Threads: ``grow`` runs on one worker thread and owns the draft model's KV cache; ``correct``, ``query`` and
``wants_growth`` may be called from any thread. Tree fields are shared under ``_lock``; a forward pass runs
without it, so a correction that arrives meanwhile only makes part of its result obsolete.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from engines.reference.kv_cache import with_cache

if TYPE_CHECKING:
    import numpy as np

logger = logging.getLogger(__name__)

#: KV entry owner for a context token that has no tree node (prompt tokens, tokens the target chose itself).
_RAW = -1
#: KV entry owner for an entry that a correction made obsolete while it was computed.
_DEAD = -2


@dataclass(frozen=True)
class CachedNode:
    """One node of a query result.

    Attributes:
        token: the token id.
        parent: index of the parent in the result, -1 for a child of the root (the last verified token).
        path_prob: the draft model's probability of the path from the root to this node.
        prob: the draft model's probability of ``token`` after its parent (the conditional probability).
    """

    token: int
    parent: int
    path_prob: float
    prob: float


class CandidateCache:
    """The candidate tree of one request (see the module docstring).

    Args:
        model: a transformers causal LM with full attention layers (Llama-like), in eval mode.
        context: (m,) the request's tokens so far, m >= 1; the last one is the root.
        width: K, sequences kept per layer.
        top_k: k, candidates taken from each sequence's distribution.
        layers_ahead: most layers grown below the root before waiting for the next correction (with
            correction; without it, growth stops only at ``max_nodes``).
        max_nodes: most live nodes.
        correction: prune to the verified prefix on every ``correct`` (False: the ablation in which the target
            only walks the tree and the draft model never learns what was verified).
        head: optional ``(weight, token_ids)``: draft over these tokens only, with ``weight`` (v, hidden) the
            output embedding rows of ``token_ids`` (v,). The output head over a full vocabulary is most of a small
            draft model's cost; probabilities are renormalised over the subset.
    """

    def __init__(self, model: Any, context: Sequence[int], *, width: int = 16, top_k: int = 4,
                 layers_ahead: int = 6, max_nodes: int = 1024, correction: bool = True,
                 head: tuple[torch.Tensor, torch.Tensor] | None = None) -> None:
        if not context:
            raise ValueError("the context must hold at least one token")
        if width < 1 or top_k < 1 or layers_ahead < 1 or max_nodes < 1:
            raise ValueError("width, top_k, layers_ahead and max_nodes must be at least 1")
        self.model = model
        self.width = width
        self.top_k = top_k
        self.layers_ahead = layers_ahead
        self.max_nodes = max_nodes
        self.correction = correction
        self.device = next(model.parameters()).device
        self.dtype = next(model.parameters()).dtype
        self.head = head
        self._lock = threading.Lock()
        # Node fields, indexed by node id (ids are never reused within a cache).
        self._tok: list[int] = []
        self._par: list[int] = []  # parent id, -1 for a root
        self._pos: list[int] = []  # absolute position in the sequence
        self._cum: list[float] = []  # draft probability of the path from the node's first root
        self._cond: list[float] = []  # draft probability of the token after its parent
        self._done: list[bool] = []  # processed: its KV entry exists and its children were chosen
        self._kids: list[dict[int, int]] = []
        self._cands: dict[int, list[tuple[int, float]]] = {}  # processed node -> its top-k (token, prob)
        self._ctx: set[int] = set()  # nodes that are verified context
        self._alive: set[int] = set()  # nodes below (and including) the growth root
        self._pending: list[int] = []  # raw context tokens to prefill before the root
        self._root = -1  # growth root: the last verified token
        self._query_root = -1  # where queries start (differs from _root only without correction)
        self._lost = False  # without correction: the verified tokens left the tree
        # Worker-private: the draft model's KV cache and the owner of each of its entries.
        self._kv: Any = None
        self._owners: list[int] = []
        self._reset_root(list(context))

    # -- tree upkeep (callers hold _lock, except in __init__) ------------------------------------------

    def _add(self, token: int, parent: int, pos: int, cum: float, cond: float) -> int:
        nid = len(self._tok)
        self._tok.append(token)
        self._par.append(parent)
        self._pos.append(pos)
        self._cum.append(cum)
        self._cond.append(cond)
        self._done.append(False)
        self._kids.append({})
        if parent >= 0:
            self._kids[parent][token] = nid
        return nid

    def _reset_root(self, tokens: list[int], end_pos: int | None = None) -> None:
        """Start a fresh tree whose root is ``tokens[-1]``; the tokens before it are prefilled first."""
        pos = len(tokens) - 1 if end_pos is None else end_pos
        root = self._add(tokens[-1], -1, pos, 1.0, 1.0)
        self._pending = tokens[:-1]
        self._root = self._query_root = root
        self._ctx.add(root)
        self._alive = {root}
        self._cands = {}
        self._lost = False

    def _subtree(self, root: int) -> set[int]:
        out = {root}
        stack = [root]
        while stack:
            for child in self._kids[stack.pop()].values():
                out.add(child)
                stack.append(child)
        return out

    # -- correction -------------------------------------------------------------------------------------

    def correct(self, accepted: Sequence[int] | np.ndarray) -> None:
        """Move the root down along the tokens the target appended since the last call.

        Args:
            accepted: the accepted draft tokens and the target's own token.
        """
        if not len(accepted):
            return
        with self._lock:
            if not self.correction:
                self._walk_query_root(accepted)
                return
            root = self._root
            if not self._done[root]:
                # Still waiting for its prefill: queue the new tokens behind it.
                self._ctx.discard(root)
                self._reset_root(self._pending + [self._tok[root]] + [int(t) for t in accepted],
                                 self._pos[root] + len(accepted))
                return
            node = root
            path: list[int] = []
            for tok in accepted:
                child = self._kids[node].get(int(tok))
                if child is None:
                    break
                node = child
                path.append(child)
            self._ctx.update(path)
            rest = [int(t) for t in accepted[len(path):]]
            if not rest:
                self._root = self._query_root = node
                self._alive = self._subtree(node)
                self._cands = {n: c for n, c in self._cands.items() if n in self._alive}
                self._restore_candidates(node)
                return
            end_pos = self._pos[node] + len(rest)
            if not self._done[node]:
                # Unprocessed (children are only chosen for processed nodes): prefill its token again.
                self._ctx.discard(node)
                rest.insert(0, self._tok[node])
            self._reset_root(rest, end_pos)

    def _restore_candidates(self, node: int) -> None:
        """Give the new root back the top-k candidates that lost an earlier layer's global sort.

        They are its most likely continuations now, and without them a root whose children were all outranked
        would have nothing to grow from.
        """
        base = self._cum[node]
        for tok, p in self._cands.get(node, ()):
            if tok not in self._kids[node]:
                self._alive.add(self._add(tok, node, self._pos[node] + 1, base * p, p))

    def _walk_query_root(self, accepted: Sequence[int] | np.ndarray) -> None:
        node = self._query_root
        for tok in accepted:
            if self._lost:
                return
            child = self._kids[node].get(int(tok))
            if child is None:
                self._lost = True
                return
            node = child
        self._query_root = node

    # -- growth (worker thread) -------------------------------------------------------------------------

    def wants_growth(self) -> bool:
        """Whether ``grow`` has work: an unprocessed root, or a frontier within the lookahead and node budget."""
        with self._lock:
            return self._plan() is not None

    def _plan(self) -> tuple[str, list[int]] | None:
        root = self._root
        if not self._done[root]:
            return "prefill", [root]
        if len(self._alive) >= self.max_nodes:
            return None
        frontier = [n for n in self._alive if not self._done[n]]
        if not frontier:
            return None
        if self.correction:
            limit = self._pos[root] + self.layers_ahead
            frontier = [n for n in frontier if self._pos[n] < limit]
        frontier.sort(key=lambda n: -self._cum[n])
        return ("frontier", frontier[:self.width]) if frontier else None

    @torch.inference_mode()
    def grow(self) -> int:
        """Grow one layer (or prefill the verified context); returns the nodes added (0 when nothing to do)."""
        with self._lock:
            plan = self._plan()
            if plan is None:
                return 0
            kind, nodes = plan
            keep = [i for i, o in enumerate(self._owners)
                    if o == _RAW or (o >= 0 and (o in self._ctx or o in self._alive))]
            pending = list(self._pending)
            if kind == "prefill":
                tokens = pending + [self._tok[nodes[0]]]
                end = self._pos[nodes[0]]
                positions = list(range(end - len(tokens) + 1, end + 1))
                visible = None
            else:
                tokens = [self._tok[n] for n in nodes]
                positions = [self._pos[n] for n in nodes]
                visible = [self._ancestors(n) for n in nodes]
            owners_ok = set(self._ctx)
        self._compact(keep)
        past = len(self._owners)
        if visible is None:  # a prefill
            mask = self._causal_mask(past, len(tokens))
        else:
            mask = self._tree_mask(visible, owners_ok)
        logits = self._forward(tokens, positions, mask)  # (q, V)
        if kind == "prefill":
            logits = logits[-1:]
        probs, toks = torch.topk(logits.float().softmax(dim=-1), min(self.top_k, logits.shape[-1]), dim=-1)
        if self.head is not None:
            toks = self.head[1][toks]  # subset positions -> token ids
        return self._add_layer(kind, nodes, len(pending), probs.tolist(), toks.tolist())

    def _ancestors(self, nid: int) -> set[int]:
        out = set()
        p = self._par[nid]
        while p >= 0 and p not in self._ctx:
            out.add(p)
            p = self._par[p]
        return out

    def _add_layer(self, kind: str, nodes: list[int], prefilled: int, probs: list[list[float]],
                   toks: list[list[int]]) -> int:
        with self._lock:
            if kind == "prefill":
                if self._root != nodes[0]:
                    # A correction re-queued these tokens behind a new root: drop what this pass computed.
                    self._owners.extend([_DEAD] * (prefilled + 1))
                    return 0
                self._owners.extend([_RAW] * prefilled + nodes)
                self._pending = []
            else:
                self._owners.extend(nodes)
            candidates: list[tuple[float, int, int, float]] = []  # (path prob, parent, token, prob)
            for nid, row_p, row_t in zip(nodes, probs, toks, strict=True):
                self._done[nid] = True
                self._cands[nid] = list(zip(row_t, row_p, strict=True))
                if nid not in self._alive:
                    continue  # pruned by a correction during the pass
                if nid in self._ctx and nid != self._root:
                    continue  # verified since: its other children are already ruled out
                base = self._cum[nid]
                candidates.extend((base * p, nid, t, p) for p, t in zip(row_p, row_t, strict=True) if p > 0.0)
            candidates.sort(key=lambda c: -c[0])
            added = 0
            for cum, parent, tok, p in candidates[:self.width]:
                if tok in self._kids[parent]:
                    continue
                nid = self._add(tok, parent, self._pos[parent] + 1, cum, p)
                self._alive.add(nid)
                added += 1
            return added

    def _compact(self, keep: list[int]) -> None:
        """Drop KV entries of pruned nodes (worker thread only)."""
        if self._kv is None or len(keep) == len(self._owners):
            return
        index = torch.tensor(keep, dtype=torch.long, device=self.device)
        for layer in self._kv.layers:
            if getattr(layer, "is_initialized", True) and layer.keys is not None and layer.keys.numel():
                layer.keys = layer.keys.index_select(-2, index)
                layer.values = layer.values.index_select(-2, index)
        self._owners = [self._owners[i] for i in keep]

    def _causal_mask(self, past: int, q: int) -> torch.Tensor:
        allowed = torch.ones(q, past + q, dtype=torch.bool, device=self.device)
        allowed[:, past:] = torch.ones(q, q, dtype=torch.bool, device=self.device).tril()
        return self._additive(allowed)

    def _tree_mask(self, visible: list[set[int]], ctx: set[int]) -> torch.Tensor:
        """Each query sees context entries, its ancestors' entries and itself; never its peers."""
        q = len(visible)
        past = len(self._owners)
        is_ctx = torch.tensor([o == _RAW or o in ctx for o in self._owners], dtype=torch.bool, device=self.device)
        allowed = torch.zeros(q, past + q, dtype=torch.bool, device=self.device)
        allowed[:, :past] = is_ctx
        where = {o: i for i, o in enumerate(self._owners) if o >= 0}
        for row, anc in enumerate(visible):
            cols = [where[a] for a in anc if a in where]
            if cols:
                allowed[row, cols] = True
            allowed[row, past + row] = True
        return self._additive(allowed)

    def _additive(self, allowed: torch.Tensor) -> torch.Tensor:
        mask = torch.zeros(1, 1, *allowed.shape, dtype=self.dtype, device=self.device)
        return mask.masked_fill_(~allowed, torch.finfo(self.dtype).min)

    def _forward(self, tokens: list[int], positions: list[int], mask: torch.Tensor) -> torch.Tensor:
        if self._kv is None:
            from transformers import DynamicCache

            self._kv = DynamicCache(config=self.model.config)
        ids = torch.tensor([tokens], dtype=torch.long, device=self.device)
        pos = torch.tensor([positions], dtype=torch.long, device=self.device)
        if self.head is None:
            out = self.model(input_ids=ids, attention_mask=mask, position_ids=pos, **with_cache(self.model, self._kv),
                             use_cache=True)
            return out.logits[0]  # (q, V)
        out = self.model.get_decoder()(input_ids=ids, attention_mask=mask, position_ids=pos,
                                       **with_cache(self.model, self._kv), use_cache=True)
        return out.last_hidden_state[0] @ self.head[0].T  # (q, v)

    # -- queries ----------------------------------------------------------------------------------------

    def query(self, budget: int) -> list[CachedNode]:
        """The ``budget`` most likely nodes below the root, each after its parent.

        The newest layer is served too, though its children are not chosen yet: when the target accepts one of
        its nodes, the cache restarts from the verified tokens (a prefill of two), but the draft was a token
        longer. Picking by path probability keeps the result a tree: a node is never more likely than its parent.
        """
        if budget <= 0:
            return []
        with self._lock:
            return self._select(budget)

    def tree(self) -> list[CachedNode]:
        """Every live node below the root (all layers), each after its parent."""
        return self.query(len(self._tok))

    def _select(self, budget: int) -> list[CachedNode]:
        root = self._query_root
        if self._lost:
            return []
        base = self._cum[root]
        below = [n for n in self._subtree(root) if n != root]
        below.sort(key=lambda n: (-self._cum[n], self._pos[n]))
        chosen = below[:budget]
        chosen.sort(key=lambda n: (self._pos[n], -self._cum[n]))
        index = {root: -1}
        out: list[CachedNode] = []
        for n in chosen:
            parent = index.get(self._par[n])
            if parent is None:
                continue  # its parent fell outside the budget (ties only)
            index[n] = len(out)
            out.append(CachedNode(self._tok[n], parent, min(1.0, self._cum[n] / base), self._cond[n]))
        return out

    @property
    def size(self) -> int:
        """Live nodes below the root."""
        with self._lock:
            return len(self._alive) - 1

    def check_invariants(self) -> None:
        """Raise AssertionError when tree, KV bookkeeping or probabilities are inconsistent."""
        with self._lock:
            assert self._root in self._alive, "the root is not alive"
            for n in self._alive:
                p = self._par[n]
                if n != self._root:
                    assert p in self._alive, f"node {n} is alive but its parent {p} is not"
                    assert self._pos[n] == self._pos[p] + 1, f"node {n} is not one position below its parent"
                    assert self._cum[n] <= self._cum[p] + 1e-12, f"node {n} is more likely than its parent"
                for tok, child in self._kids[n].items():
                    assert self._tok[child] == tok and self._par[child] == n, f"child map of {n} is wrong"
            if self._kv is not None and self._owners:
                assert self._kv.get_seq_length() == len(self._owners), "KV length differs from its owners"

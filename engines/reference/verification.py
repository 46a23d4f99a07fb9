"""Lossless verification of a draft tree from the target's logits: greedy matching and tree rejection sampling."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import NamedTuple

import torch

logger = logging.getLogger(__name__)

__all__ = [
    "Verdict",
    "child_lists",
    "greedy_verify",
    "greedy_path",
    "process_logits",
    "acceptance_probability",
    "residual",
    "sample_verify",
]


class Verdict(NamedTuple):
    """Outcome of verifying one tree.

    Attributes:
        accepted: indices of the accepted draft nodes, root to leaf (each the child of the previous one).
        bonus: the target's own token after the accepted path (the next root).
    """

    accepted: list[int]
    bonus: int


def child_lists(parents: Sequence[int]) -> dict[int, list[int]]:
    """Map each node (-1 for the root) to its children's indices in tree order.

    Args:
        parents: (n,) parent of each node, -1 for a child of the root.
    """
    kids: dict[int, list[int]] = {}
    for i, p in enumerate(parents):
        kids.setdefault(p, []).append(i)
    return kids


def greedy_verify(logits: torch.Tensor, token_ids: Sequence[int], parents: Sequence[int]) -> Verdict:
    """Accept the longest tree path whose every token is the target's argmax after the path before it.

    Args:
        logits: (n+1, V) float target logits for [root, node 0, ..., node n-1].
        token_ids: (n,) token of each draft node.
        parents: (n,) parent of each node, -1 for a child of the root.

    Returns:
        the accepted path and the argmax at its last row (the bonus token).
    """
    if logits.shape[0] != len(token_ids) + 1:
        raise ValueError(f"{logits.shape[0]} logit rows for {len(token_ids)} nodes; expected one more")
    # max().indices picks the first maximum like argmax, and is ~4x faster than argmax on bfloat16 CPU tensors
    return greedy_path(logits.max(dim=-1).indices.tolist(), token_ids, parents)


def greedy_path(target: Sequence[int], token_ids: Sequence[int], parents: Sequence[int]) -> Verdict:
    """``greedy_verify`` from the argmaxes alone, already read back from the device.

    Args:
        target: (>= n+1,) the target's best token after the root and after each node (rows past n are ignored).
        token_ids: (n,) token of each draft node.
        parents: (n,) parent of each node, -1 for a child of the root.
    """
    # First child per (parent, token); a later duplicate sibling could never be reached.
    kids: dict[tuple[int, int], int] = {}
    for i, (tok, p) in enumerate(zip(token_ids, parents, strict=True)):
        kids.setdefault((p, tok), i)
    accepted: list[int] = []
    node = -1
    while True:
        nxt = kids.get((node, target[node + 1]))
        if nxt is None:
            return Verdict(accepted, int(target[node + 1]))
        accepted.append(nxt)
        node = nxt


def process_logits(logits: torch.Tensor, temperature: float = 1.0, top_k: int = 0,
                   top_p: float = 1.0) -> torch.Tensor:
    """The sampling distribution, as transformers' warpers build it: temperature, then top-k, then top-p.

    Args:
        logits: (..., V) float logits.
        temperature: > 0; logits are divided by it.
        top_k: keep the ``top_k`` largest logits (ties with the k-th kept); 0 keeps all.
        top_p: keep the smallest set of largest-probability tokens whose mass exceeds ``top_p`` (at least one);
            1.0 keeps all.

    Returns:
        (..., V) float32 probabilities summing to 1 over the last axis.
    """
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0 for sampling, got {temperature}")
    if not 0.0 < top_p <= 1.0:
        raise ValueError(f"top_p must lie in (0, 1], got {top_p}")
    if top_k < 0:
        raise ValueError(f"top_k must be >= 0, got {top_k}")
    scores = logits.float() / temperature  # (..., V) float32
    if 0 < top_k < scores.shape[-1]:
        kth = torch.topk(scores, top_k, dim=-1).values[..., -1:]  # (..., 1)
        scores = scores.masked_fill(scores < kth, float("-inf"))
    if top_p < 1.0:
        sorted_scores, order = torch.sort(scores, dim=-1, descending=False)  # (..., V)
        cumulative = sorted_scores.softmax(dim=-1).cumsum(dim=-1)  # (..., V)
        drop_sorted = cumulative <= (1.0 - top_p)
        drop_sorted[..., -1:] = False
        drop = drop_sorted.scatter(-1, order, drop_sorted)  # (..., V) bool
        scores = scores.masked_fill(drop, float("-inf"))
    return scores.softmax(dim=-1)


def acceptance_probability(p_x: float, q_x: float | None) -> float:
    """Probability to accept a proposed token ``x``.

    Args:
        p_x: the current (residual) target probability of ``x``.
        q_x: the probability of ``x`` under the distribution it was sampled from, or None for a deterministic
            (one-hot) proposal.

    Returns:
        ``p(x)`` for a one-hot proposal, ``min(1, p(x) / q(x))`` otherwise.
    """
    if q_x is None:
        return p_x
    if q_x <= 0.0:
        raise ValueError("a draft token has zero probability under the distribution it was sampled from")
    return min(1.0, p_x / q_x)


def residual(p: torch.Tensor, x: int, q: torch.Tensor | None) -> torch.Tensor:
    """The target distribution to use after rejecting ``x``.

    Args:
        p: (V,) float32 current target distribution.
        x: the rejected token.
        q: (V,) the distribution ``x`` was sampled from, or None for a one-hot proposal.

    Returns:
        (V,) float32 ``normalise(max(p - q, 0))``; for a one-hot proposal that is ``p`` with ``x`` zeroed and
        renormalised. A new tensor; ``p`` is left as it was.
    """
    if q is None:
        out = p.clone()
        out[x] = 0.0
    else:
        out = torch.clamp(p - q.to(device=p.device, dtype=p.dtype), min=0.0)
    total = out.sum()
    if float(total) <= 0.0:
        # Only reachable through rounding (rejection had probability ~0): nothing is left to correct.
        logger.debug("residual vanished after rejecting token %d; keeping the previous distribution", x)
        return p
    return out / total


def sample_verify(logits: torch.Tensor, token_ids: Sequence[int], parents: Sequence[int], *,
                  temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0,
                  generator: torch.Generator | None = None,
                  draft_probs: Sequence[torch.Tensor | None] | None = None) -> Verdict:
    """Multi-candidate rejection sampling down the tree (SpecInfer's multi-round rule): output is exactly the target's.

    At the current node (the root first), with ``p`` the target distribution of its row, its children are tried in
    order; child ``x`` is accepted with ``acceptance_probability``, and on rejection ``p`` becomes ``residual``. An
    accepted child becomes the current node with its own row's fresh ``p``; when every child is rejected (or there
    are none) the bonus token is sampled from what is left of ``p``. Each child must have been proposed independently
    of the others: deterministically (one-hot) or sampled from its ``draft_probs`` entry.

    Args:
        logits: (n+1, V) float target logits for [root, node 0, ..., node n-1].
        token_ids: (n,) token of each draft node.
        parents: (n,) parent of each node, -1 for a child of the root.
        temperature: > 0; see ``process_logits``.
        top_k: see ``process_logits``.
        top_p: see ``process_logits``.
        generator: random source (on the logits' device) for reproducible runs.
        draft_probs: (n,) per node, the (V,) distribution its token was sampled from, or None for one-hot nodes.

    Returns:
        the accepted path and the bonus token.
    """
    n = len(token_ids)
    if logits.shape[0] != n + 1:
        raise ValueError(f"{logits.shape[0]} logit rows for {n} nodes; expected one more")
    if draft_probs is not None and len(draft_probs) != n:
        raise ValueError(f"{len(draft_probs)} draft distributions for {n} nodes")
    kids = child_lists(parents)
    # One uniform per node: each node is tested at most once.
    uniforms: list[float] = torch.rand(n, generator=generator, device=logits.device).tolist()  # (n,)
    accepted: list[int] = []
    node = -1
    p = process_logits(logits[0], temperature, top_k, top_p)  # (V,) float32
    while True:
        nxt = -1
        for child in kids.get(node, ()):
            x = token_ids[child]
            q = draft_probs[child] if draft_probs is not None else None
            p_x = float(p[x])
            q_x = None if q is None else float(q[x])
            if uniforms[child] < acceptance_probability(p_x, q_x):
                nxt = child
                break
            p = residual(p, x, q)
        if nxt < 0:
            bonus = int(torch.multinomial(p, 1, generator=generator))
            return Verdict(accepted, bonus)
        accepted.append(nxt)
        node = nxt
        p = process_logits(logits[nxt + 1], temperature, top_k, top_p)

"""The retrieval oracle: the most a drafter that copies from what it has seen could get accepted per step.

At output position ``pos`` of a request, a retrieval drafter has seen the earlier requests (each its prompt
followed by its output), this request's prompt and the output so far, ``out[:pos]``. Whatever it drafts, the
tokens accepted form a prefix of ``out[pos:]``; if they are copied from what it has seen, that prefix occurs
there. The oracle drafts the longest such prefix (cut to the step's budget), so no drafter that proposes only
seen text gets more accepted at a step. And since that longest prefix shrinks by at most one per token advanced,
taking the most at every step also takes the fewest steps per request: the oracle's MAT bounds theirs over a whole
replay. Drafters that join separately seen pieces (chained n-grams) or draw on more than the replayed requests
(frozen tables, a warm corpus, a draft model) can exceed it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from drafter_service.api.tree import EMPTY_TREE, DraftTree, chain
from drafter_service.datasets.loaders import Request

__all__ = ["RetrievalOracle", "SeenPrefixes", "seen_prefix_lengths"]


def seen_prefix_lengths(requests: Sequence[Request], max_len: int) -> list[np.ndarray]:
    """The longest prefix of the rest of each output that a retrieval drafter has seen, at every output position.

    Request ``r`` at output position ``pos``: the largest ``l <= max_len`` such that ``output[pos:pos + l]``
    occurs in one of the texts ``prompt_i + output_i`` (``i < r``) or in ``prompt_r + output_r[:pos]``.

    All requests are laid end to end, each followed by a separator token of its own, into one text ``T``; what
    has been seen at a position ``t`` of ``T`` is then exactly ``T[:t]``, and no occurrence crosses a separator.
    For ``l = 1, 2, ...`` every l-gram of ``T`` gets a dense rank (from the rank of its first l-1 tokens and its
    last token, one sort per length); ``T[t:t+l]`` has been seen at ``t`` when its first occurrence ``j``
    ends by then (``j + l <= t``). Being seen at length l implies it at l-1, so the lengths stop at the first
    with no position seen. Time O(max_len * N log N) for N tokens in all, memory O(N).

    Args:
        requests: completed requests in the order a drafter serves them.
        max_len: longest prefix measured (the largest budget or chain length of interest), >= 1.

    Returns:
        One (len(output),) int32 array per request.

    Raises:
        ValueError: on ``max_len < 1`` or a negative token id.
    """
    if max_len < 1:
        raise ValueError(f"max_len must be >= 1, got {max_len}")
    if not requests:
        return []
    parts: list[np.ndarray] = []
    out_starts: list[int] = []
    at = 0
    for r, req in enumerate(requests):
        if (req.prompt.size and req.prompt.min() < 0) or (req.output.size and req.output.min() < 0):
            raise ValueError(f"request {req.request_id!r} holds a negative token id")
        parts += [req.prompt, req.output, np.array([-1 - r])]
        out_starts.append(at + req.prompt.size)
        at += req.prompt.size + req.output.size + 1
    text = np.concatenate(parts).astype(np.int64)  # (N,) int64, separators negative and distinct
    n = text.size
    symbols = np.unique(text, return_inverse=True)[1].astype(np.int64)  # (N,) dense token ranks
    alphabet = int(symbols.max()) + 1
    positions = np.arange(n)
    longest = np.zeros(n, dtype=np.int32)  # (N,) int32
    ranks = symbols  # ranks of the (l-1)-grams starting at each position
    for length in range(1, min(max_len, n) + 1):
        count = n - length + 1  # l-grams starting at 0 .. count-1
        keys = symbols if length == 1 else ranks[:count] * alphabet + symbols[length - 1:]
        _, first, ranks = np.unique(keys, return_index=True, return_inverse=True)
        seen = first[ranks] + length <= positions[:count]  # (count,) bool
        if not seen.any():
            break
        longest[:count][seen] = length
    return [longest[s:s + req.output.size].copy() for s, req in zip(out_starts, requests, strict=True)]


@dataclass(frozen=True)
class SeenPrefixes:
    """``seen_prefix_lengths`` of a schedule of requests, computed once for any number of oracle replays.

    Attributes:
        requests: the schedule, in the order a drafter serves it.
        lengths: (len(output),) int32 per request, capped at ``max_len``.
        max_len: the cap.
    """

    requests: tuple[Request, ...]
    lengths: tuple[np.ndarray, ...]
    max_len: int

    @classmethod
    def of(cls, requests: Sequence[Request], max_len: int) -> SeenPrefixes:
        """Compute the lengths of ``requests`` up to ``max_len`` (see ``seen_prefix_lengths``)."""
        return cls(tuple(requests), tuple(seen_prefix_lengths(requests, max_len)), max_len)


class RetrievalOracle:
    """A ``ReplayDrafter`` that knows the outputs and drafts the longest prefix of the rest that has been seen.

    It replays its schedule in order, from request ``skip`` on (the ones before are history it has seen): each
    ``start`` must bring the next request's prompt and each ``extend`` the next tokens of its output. Every
    draft is the chain ``output[pos:pos + min(budget, longest)]``, in tree mode (``propose``, a tree of b nodes
    holds a path of at most b) as in chain mode (``propose_chain``).
    """

    def __init__(self, seen: SeenPrefixes, skip: int = 0, name: str = "oracle") -> None:
        """Create the oracle at request ``skip`` of ``seen.requests``.

        Raises:
            ValueError: when ``skip`` is outside the schedule.
        """
        if not 0 <= skip <= len(seen.requests):
            raise ValueError(f"skip must be in [0, {len(seen.requests)}], got {skip}")
        self.name = name
        self.seen = seen
        self._next = skip
        self._open: dict[str, tuple[int, int]] = {}  # request -> (index in the schedule, output position)

    def start(self, request_id: str, prompt: Sequence[int]) -> None:
        """The next request of the schedule begins.

        Raises:
            ValueError: past the schedule's end, or a prompt other than the next request's.
        """
        if request_id in self._open:
            raise ValueError(f"request {request_id!r} is already active")
        if self._next >= len(self.seen.requests):
            raise ValueError("the oracle's schedule is over")
        if not np.array_equal(np.asarray(prompt), self.seen.requests[self._next].prompt):
            raise ValueError(f"request {request_id!r} is not the next request of the oracle's schedule")
        self._open[request_id] = (self._next, 0)
        self._next += 1

    def extend(self, request_id: str, tokens: Sequence[int]) -> None:
        """The output advances by ``tokens``.

        Raises:
            ValueError: when they are not the next tokens of the recorded output.
        """
        index, pos = self._open[request_id]
        out = self.seen.requests[index].output
        if not np.array_equal(np.asarray(tokens), out[pos:pos + len(tokens)]):
            raise ValueError(f"request {request_id!r} extended with tokens other than its recorded output")
        self._open[request_id] = (index, pos + len(tokens))

    def propose(self, request_id: str, max_nodes: int) -> DraftTree:
        """The longest seen prefix of the rest of the output, at most ``max_nodes`` tokens, as a chain.

        Raises:
            ValueError: when ``max_nodes`` exceeds the cap the lengths were computed with.
        """
        if max_nodes > self.seen.max_len:
            raise ValueError(f"budget {max_nodes} exceeds the oracle's cap {self.seen.max_len}")
        index, pos = self._open[request_id]
        out = self.seen.requests[index].output
        if pos >= out.size or max_nodes <= 0:
            return EMPTY_TREE
        n = min(max_nodes, int(self.seen.lengths[index][pos]))
        return chain(out[pos:pos + n].tolist(), source=self.name) if n else EMPTY_TREE

    def propose_chain(self, request_id: str, k: int) -> DraftTree:
        """Chain mode: the same draft, at most ``k`` tokens."""
        return self.propose(request_id, k)

    def end(self, request_id: str) -> None:
        """The request is done."""
        self._open.pop(request_id, None)

"""Published drafters the replay benchmark compares against: prompt lookup and Arctic suffix decoding."""

from __future__ import annotations

import importlib.util
import logging
from collections.abc import Sequence
from typing import Any

import numpy as np

from drafter_service.api.tree import EMPTY_TREE, DraftTree, chain

logger = logging.getLogger(__name__)

__all__ = ["ArcticSuffixDrafter", "PromptLookupDrafter", "arctic_available", "prompt_lookup"]

#: Smallest probability a converted node keeps (DraftTree wants probabilities in (0, 1]).
_MIN_PROB = 1e-6


class _TokenBuffer:
    """A growable int32 token sequence (amortised O(1) appends)."""

    def __init__(self, tokens: Sequence[int]) -> None:
        init = np.asarray(tokens, dtype=np.int32).reshape(-1)
        self._data = np.empty(max(64, 2 * len(init)), dtype=np.int32)  # (capacity,) int32
        self._data[: len(init)] = init
        self._len = len(init)

    def extend(self, tokens: Sequence[int]) -> None:
        new = np.asarray(tokens, dtype=np.int32).reshape(-1)
        need = self._len + len(new)
        if need > len(self._data):
            grown = np.empty(max(need, 2 * len(self._data)), dtype=np.int32)
            grown[: self._len] = self._data[: self._len]
            self._data = grown
        self._data[self._len : need] = new
        self._len = need

    def view(self) -> np.ndarray:
        """(n,) int32 view of the current tokens (valid until the next ``extend``)."""
        return self._data[: self._len]


def prompt_lookup(tokens: np.ndarray, max_ngram: int, min_ngram: int, num_pred_tokens: int) -> np.ndarray:
    """Prompt-lookup decoding's draft for a sequence (transformers' generate behaviour).

    For n from ``max_ngram`` down to ``min_ngram`` (and at most ``len(tokens) - 1``), take the first
    occurrence, scanning left to right, of the last n tokens earlier in the sequence, and return the
    tokens that followed it: at most ``num_pred_tokens``, fewer when the sequence ends first.

    Args:
        tokens: (L,) int32 prompt + generated tokens.
        max_ngram: longest suffix matched.
        min_ngram: shortest suffix matched.
        num_pred_tokens: most tokens proposed.

    Returns:
        (k,) int32 proposed tokens, k <= num_pred_tokens; empty when nothing matches.
    """
    length = len(tokens)
    if length < 2 or num_pred_tokens <= 0:
        return np.zeros(0, dtype=np.int32)
    # Ends e < L-1 of earlier occurrences of the last token, i.e. candidate 1-gram matches.
    ends = np.flatnonzero(tokens[: length - 1] == tokens[length - 1])  # (c,) int64, ascending
    if len(ends) == 0:
        return np.zeros(0, dtype=np.int32)
    # match[j]: how many trailing tokens agree (capped at max_ngram) for the occurrence ending at ends[j].
    match = np.ones(len(ends), dtype=np.int64)  # (c,) int64
    alive = np.ones(len(ends), dtype=bool)  # (c,) bool
    for k in range(1, min(max_ngram, length - 1)):
        ok = alive & (ends >= k)
        ok[ok] = tokens[ends[ok] - k] == tokens[length - 1 - k]
        match += ok
        alive = ok
    for n in range(min(max_ngram, length - 1), min_ngram - 1, -1):
        hits = np.flatnonzero(match >= n)
        if len(hits):
            start = int(ends[hits[0]]) + 1
            return tokens[start : min(start + num_pred_tokens, length)].astype(np.int32, copy=True)
    return np.zeros(0, dtype=np.int32)


class PromptLookupDrafter:
    """Prompt-lookup decoding: copy what followed an earlier occurrence of the sequence's suffix.

    Looks only at the request's own prompt and generated tokens; nothing is kept across requests.
    """

    def __init__(self, max_ngram: int = 3, min_ngram: int = 1, num_pred_tokens: int = 10,
                 name: str = "prompt-lookup") -> None:
        """Create the drafter.

        Args:
            max_ngram: longest suffix matched.
            min_ngram: shortest suffix matched.
            num_pred_tokens: most tokens proposed per draft (also bounded by ``max_nodes``).
            name: label in benchmark reports.

        Raises:
            ValueError: on non-positive sizes or ``min_ngram > max_ngram``.
        """
        if min_ngram < 1 or max_ngram < min_ngram or num_pred_tokens < 1:
            raise ValueError(f"need 1 <= min_ngram <= max_ngram and num_pred_tokens >= 1, got "
                             f"{min_ngram=}, {max_ngram=}, {num_pred_tokens=}")
        self.name = name
        self.max_ngram = max_ngram
        self.min_ngram = min_ngram
        self.num_pred_tokens = num_pred_tokens
        self._seqs: dict[str, _TokenBuffer] = {}

    def start(self, request_id: str, prompt: Sequence[int]) -> None:
        """Open a request with its prompt."""
        if request_id in self._seqs:
            raise ValueError(f"request {request_id!r} is already active")
        self._seqs[request_id] = _TokenBuffer(prompt)

    def extend(self, request_id: str, tokens: Sequence[int]) -> None:
        """Append tokens to the request's sequence."""
        self._seq(request_id).extend(tokens)

    def propose(self, request_id: str, max_nodes: int) -> DraftTree:
        """A chain of at most ``min(num_pred_tokens, max_nodes)`` tokens, or the empty tree."""
        budget = min(self.num_pred_tokens, max_nodes)
        if budget <= 0:
            return EMPTY_TREE
        draft = prompt_lookup(self._seq(request_id).view(), self.max_ngram, self.min_ngram, budget)
        return chain(draft.tolist(), source=self.name) if len(draft) else EMPTY_TREE

    def propose_chain(self, request_id: str, k: int) -> DraftTree:
        """Chain mode: the lookup's draft with ``num_pred_tokens = k``."""
        if k <= 0:
            return EMPTY_TREE
        draft = prompt_lookup(self._seq(request_id).view(), self.max_ngram, self.min_ngram, k)
        return chain(draft.tolist(), source=self.name) if len(draft) else EMPTY_TREE

    def end(self, request_id: str) -> None:
        """Forget the request."""
        self._seqs.pop(request_id, None)

    def _seq(self, request_id: str) -> _TokenBuffer:
        try:
            return self._seqs[request_id]
        except KeyError:
            raise KeyError(f"request {request_id!r} is not active") from None


def arctic_available() -> bool:
    """Whether ``arctic_inference.suffix_decoding`` can be imported (package arctic-inference)."""
    try:
        if importlib.util.find_spec("arctic_inference") is None:
            return False
        import arctic_inference.suffix_decoding  # noqa: F401
    except Exception:  # a missing or broken native extension counts as unavailable
        return False
    return True


def suffix_draft_to_tree(token_ids: Sequence[int], parents: Sequence[int], probs: Sequence[float],
                         max_nodes: int, source: str = "") -> DraftTree:
    """Turn a suffix-decoding draft into a valid DraftTree.

    Arctic's ``parents[i]`` is the index of node i's parent in the same arrays, -1 for children of
    the last context token (the DraftTree convention). The conversion still orders parents first,
    merges duplicate siblings (children move under the kept node), clamps probabilities into
    (0, 1], makes them non-increasing along paths, and keeps the first ``max_nodes`` nodes.

    Args:
        token_ids: (n,) draft tokens.
        parents: (n,) parent indices, -1 for the root.
        probs: (n,) estimated acceptance probabilities.
        max_nodes: node budget.
        source: name recorded for every node.

    Returns:
        The tree (empty when there is nothing to draft).
    """
    n = len(token_ids)
    kids: dict[int, list[int]] = {}
    for i, p in enumerate(parents):
        kids.setdefault(int(p) if 0 <= p < n and p != i else -1, []).append(i)
    toks: list[int] = []
    out_parents: list[int] = []
    out_probs: list[float] = []
    # Breadth first from the root: parents always precede their children.
    queue: list[tuple[int, int, float]] = [(-1, -1, 1.0)]  # (source node, new index, prob bound)
    head = 0
    while head < len(queue) and len(toks) < max_nodes:
        src, new, bound = queue[head]
        head += 1
        seen: dict[int, int] = {}
        for child in kids.get(src, []):
            tok = int(token_ids[child])
            if tok in seen:  # duplicate sibling: its subtree joins the kept node's
                kids.setdefault(queue[seen[tok]][0], []).extend(kids.get(child, []))
                continue
            if len(toks) >= max_nodes:
                break
            prob = min(bound, max(_MIN_PROB, min(1.0, float(probs[child]))))
            seen[tok] = len(queue)
            queue.append((child, len(toks), prob))
            toks.append(tok)
            out_parents.append(new)
            out_probs.append(prob)
    if not toks:
        return EMPTY_TREE
    return DraftTree(tuple(toks), tuple(out_parents), tuple(out_probs), float(sum(out_probs)),
                     (source,) * len(toks) if source else ())


#: vLLM's ``suffix`` speculative method (0.32): its SpeculativeConfig defaults for suffix decoding.
VLLM_SUFFIX_MAX_TREE_DEPTH = 24
VLLM_SUFFIX_MAX_CACHED_REQUESTS = 10000
VLLM_SUFFIX_MIN_TOKEN_PROB = 0.1


class ArcticSuffixDrafter:
    """Arctic Inference's suffix decoding (``SuffixDecodingCache``) in tree mode, or path mode for chains.

    Each request's prompt and response go into its local suffix tree; responses also go into the
    global tree shared by all requests and kept after they end (prompts are not), as in the package.
    Requests get fresh internal ids, so reusing a request id never evicts an earlier response.
    ``propose_chain`` speculates in path mode (``use_tree_spec=False``), as vLLM's ``suffix`` method does.
    """

    def __init__(self, max_spec_factor: float = 1.0, max_spec_offset: float = 0.0,
                 min_token_prob: float = 0.1, max_tree_depth: int = 64, max_cached_requests: int = -1,
                 use_tree_spec: bool = True, name: str | None = None) -> None:
        """Create the drafter (the defaults are the package's, except tree mode).

        Args:
            max_spec_factor: draft length limit per matched context token.
            max_spec_offset: draft length limit offset.
            min_token_prob: smallest estimated probability of a drafted token.
            max_tree_depth: depth of the suffix trees (and the longest context matched).
            max_cached_requests: responses kept in the global tree (-1: unlimited; FIFO eviction).
            use_tree_spec: draft a tree rather than a single path.
            name: label; ``"arctic"``, or ``"arctic-f4"`` for ``max_spec_factor=4``, by default.

        Raises:
            ImportError: when arctic-inference is not installed.
        """
        from arctic_inference.suffix_decoding import SuffixDecodingCache

        self.max_spec_factor = max_spec_factor
        self.max_spec_offset = max_spec_offset
        self.min_token_prob = min_token_prob
        self.max_tree_depth = max_tree_depth
        self.use_tree_spec = use_tree_spec
        self.name = name or ("arctic" if max_spec_factor == 1.0 else f"arctic-f{max_spec_factor:g}")
        self._cache: Any = SuffixDecodingCache(max_tree_depth=max_tree_depth,
                                               max_cached_requests=max_cached_requests)
        self._ids: dict[str, int] = {}
        self._contexts: dict[str, np.ndarray] = {}  # request -> (<= max_tree_depth,) int32 tail
        self._next_id = 0

    @classmethod
    def vllm_suffix(cls, max_spec_factor: float = 1.0, name: str | None = None) -> ArcticSuffixDrafter:
        """The drafter as vLLM's ``suffix`` method configures it by default (``suffix_decoding_*`` settings).

        Trees of depth 24, 10,000 cached responses, ``min_token_prob`` 0.1, no spec offset, path mode; vLLM's
        ``num_speculative_tokens`` is the ``k`` of ``propose_chain``.

        Args:
            max_spec_factor: ``suffix_decoding_max_spec_factor`` (vLLM's default 1).
            name: label, as in ``__init__``.
        """
        return cls(max_spec_factor=max_spec_factor, min_token_prob=VLLM_SUFFIX_MIN_TOKEN_PROB,
                   max_tree_depth=VLLM_SUFFIX_MAX_TREE_DEPTH, max_cached_requests=VLLM_SUFFIX_MAX_CACHED_REQUESTS,
                   use_tree_spec=False, name=name)

    def start(self, request_id: str, prompt: Sequence[int]) -> None:
        """Open a request: its prompt goes into a local suffix tree."""
        if request_id in self._ids:
            raise ValueError(f"request {request_id!r} is already active")
        internal = self._next_id
        self._next_id += 1
        arr = np.ascontiguousarray(prompt, dtype=np.int32).reshape(-1)  # (n,) int32
        self._cache.start_request(internal, arr)
        self._ids[request_id] = internal
        self._contexts[request_id] = arr[-self.max_tree_depth :].copy()

    def extend(self, request_id: str, tokens: Sequence[int]) -> None:
        """Append response tokens (local and global trees)."""
        arr = np.ascontiguousarray(tokens, dtype=np.int32).reshape(-1)  # (k,) int32
        self._cache.add_active_response(self._internal(request_id), arr)
        ctx = np.concatenate([self._contexts[request_id], arr])
        self._contexts[request_id] = ctx[-self.max_tree_depth :]

    def propose(self, request_id: str, max_nodes: int) -> DraftTree:
        """Speculate from the context tail with ``max_spec_tokens=max_nodes``."""
        return self._speculate(request_id, max_nodes, self.use_tree_spec)

    def propose_chain(self, request_id: str, k: int) -> DraftTree:
        """Chain mode: speculate one path (``use_tree_spec=False``) with ``max_spec_tokens=k``."""
        return self._speculate(request_id, k, False)

    def _speculate(self, request_id: str, max_nodes: int, tree: bool) -> DraftTree:
        internal = self._internal(request_id)
        if max_nodes <= 0 or len(self._contexts[request_id]) == 0:
            return EMPTY_TREE
        draft = self._cache.speculate(
            internal, self._contexts[request_id], max_spec_tokens=max_nodes,
            max_spec_factor=self.max_spec_factor, max_spec_offset=self.max_spec_offset,
            min_token_prob=self.min_token_prob, use_tree_spec=tree)
        return suffix_draft_to_tree(draft.token_ids, draft.parents, draft.probs, max_nodes, self.name)

    def end(self, request_id: str) -> None:
        """Close the request; its response stays in the global tree."""
        internal = self._ids.pop(request_id, None)
        self._contexts.pop(request_id, None)
        if internal is not None:
            self._cache.stop_request(internal)

    def _internal(self, request_id: str) -> int:
        try:
            return self._ids[request_id]
        except KeyError:
            raise KeyError(f"request {request_id!r} is not active") from None

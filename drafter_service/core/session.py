"""One request being generated: its tokens, its last draft, and the correction step after verification."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

import store.match_kernels as kernels
from drafter_service.api.tree import EMPTY_TREE, DraftTree, accept_greedy
from drafter_service.core.acceptance import AcceptanceModel
from drafter_service.core.model_drafts import ModelSession
from drafter_service.core.tree_builder import SOURCE_NAMES, Evidence, pack_draft, score_draft, score_packed
from store.token_store import EMPTY, Continuations


@dataclass(frozen=True)
class BudgetPolicy:
    """How many nodes a session's next draft may use.

    Attributes:
        adaptive: shrink the budget while recent drafts were rarely accepted (else always the full limit).
        min_nodes: the smallest adaptive budget (or the limit, when smaller).
    """

    adaptive: bool = True
    min_nodes: int = 4

    def budget(self, limit: int, ema_accepted: float) -> int:
        """The budget for a request allowing ``limit`` nodes whose drafts recently confirmed ``ema_accepted``."""
        if not self.adaptive:
            return limit
        wanted = round(self.min_nodes * (1.0 + 2.0 * ema_accepted))
        return max(min(self.min_nodes, limit), min(limit, wanted))


FULL_BUDGET_EMA = 1e9
"""What a session whose budget is fixed shows the batched step as its averaged accepted tokens: ``BudgetPolicy``
with any ``min_nodes`` >= 1 then wants more nodes than any limit."""


@dataclass(frozen=True)
class Confirmation:
    """What the tokens a step appended confirmed of the last draft served.

    Attributes:
        tokens: draft tokens confirmed (the accepted path's length inside the last tree).
        sources: the source name of each confirmed node ("" for a node without one).
    """

    tokens: int = 0
    sources: tuple[str, ...] = ()


NOTHING_CONFIRMED = Confirmation()


def path_sources(tree: DraftTree, tokens: Sequence[int], n: int) -> tuple[str, ...]:
    """Source names of the first ``n`` nodes on the path that ``tokens`` follows down from the root.

    One pass over the nodes (every parent comes before its children); "" for a node without a source name.
    """
    out: list[str] = []
    if n <= 0:
        return ()
    sources, node, want = tree.sources, -1, tokens[0]
    for i, (tok, parent) in enumerate(zip(tree.token_ids, tree.parents, strict=True)):
        if parent == node and tok == want:
            out.append(sources[i] if sources else "")
            if len(out) == n:
                break
            node, want = i, tokens[len(out)]
    return tuple(out)


def lookup_tokens(tokens: np.ndarray, n: int, max_match: int, max_occurrences: int, depth: int) -> Continuations:
    """The numpy reference of prompt lookup over ``tokens[:n]`` (see ``DraftSession.lookup``)."""
    if n < 2:
        return EMPTY
    ctx_rev = tokens[max(0, n - max_match):n][::-1].astype(np.int64)
    m, counts, ends = kernels.scan_matches(tokens, 0, n - 1, ctx_rev, ctx_rev.size, 0)
    if m == 0:
        return EMPTY
    if ends.size > max_occurrences:
        ends = ends[-max_occurrences:]
    ends = ends[::-1]
    return Continuations(m, counts, kernels.continuations(tokens, ends + 1, depth, n))


class DraftSession:
    """State of one request: prompt plus everything accepted so far, searched for prompt lookup.

    Created by ``Drafter.start``; ``extend`` appends what the target accepted and learns from how the last
    draft fared; ``propose`` drafts the next tree.

    The batched native step (``batch_steps.draft_steps``) takes a session in place: it calls ``batch_state`` and,
    when the buffer is short, ``reserve``; reads ``_tokens``, ``_len``, ``_last_packed``, ``_ema_accepted`` and
    ``policy.adaptive``; and writes back ``_len``, ``_last_packed``, ``_ema_accepted`` (for a fixed budget, the
    average ``_count`` keeps) and ``steps``, ``drafted``, ``accepted`` as ``_count`` counts a scored draft.
    """

    def __init__(self, session_id: str, prompt: np.ndarray, max_nodes: int, model: AcceptanceModel,
                 policy: BudgetPolicy) -> None:
        self.model = model  # the namespace's acceptance model, which scoring a draft teaches
        self.policy = policy
        self.session_id = session_id
        self.prompt_len = int(prompt.size)
        self._tokens = np.full(max(64, 2 * prompt.size), -1, dtype=np.int32)  # (capacity,) prompt + output
        self._tokens[:prompt.size] = prompt
        self._len = int(prompt.size)
        self.max_nodes = int(max_nodes)
        self._last_tree: DraftTree = EMPTY_TREE  # the model-free part of the last draft
        self._last_evidence: Evidence | None = None
        self._last_served: DraftTree | None = None  # the last draft as served, when it differs
        # the last draft and its evidence, packed, when the batch drafted it (a bytearray it rewrites step by step)
        self._last_packed: bytes | bytearray | None = None
        self.card: ModelSession | None = None  # the draft model's cache, when the namespace has one
        # The last draft with and without the model's nodes, while its worker ran (the model gate scores both).
        self.model_shadow: tuple[DraftTree, DraftTree, bool] | None = None  # (model-free, merged, model empty)
        self.stepped_at = 0.0  # monotonic time of the last step, for the model gate's step intervals
        self.stepped_phase = -1  # the model gate's phase at that step
        self.repeat: np.ndarray | None = None  # (m,) int32 stored output of the same prompt, while followed
        self.repeat_pos = 0  # output tokens so far, all equal to the start of ``repeat``
        self.repeat_offered = 0  # depth of the repeat branch in the last draft served
        self._ema_accepted = 1.0  # accepted draft tokens per step, exponentially averaged
        self.steps = 0
        self.drafted = 0
        self.accepted = 0
        self.closed = False  # set once the session has ended: nothing may extend it any more

    def __len__(self) -> int:
        return self._len

    @property
    def tokens(self) -> np.ndarray:
        """(n,) int32 the prompt and every token appended since (read-only view)."""
        v = self._tokens[:self._len]
        v.flags.writeable = False
        return v

    @property
    def output(self) -> np.ndarray:
        """(n - prompt_len,) int32 the tokens appended after the prompt."""
        return self._tokens[self.prompt_len:self._len].copy()

    def reserve(self, extra: int) -> np.ndarray:
        """The token buffer, grown when needed so that ``extra`` more tokens fit after the sequence."""
        need = self._len + extra
        if need > self._tokens.size:
            grown = np.full(max(need, 2 * self._tokens.size), -1, dtype=np.int32)
            grown[:self._len] = self._tokens[:self._len]
            self._tokens = grown
        return self._tokens

    def append(self, tokens: np.ndarray) -> None:
        """Append tokens to the sequence (no learning; ``extend`` is the verified path)."""
        need = self._len + tokens.size
        self.reserve(tokens.size)[self._len:need] = tokens
        self._len = need

    @property
    def batchable(self) -> bool:
        """Whether the batched native step can take this session: open, no draft model, no repeat branch, and a
        last draft served as it was built."""
        return not self.closed and self.card is None and self.repeat is None and self._last_served is None

    def batch_state(self) -> tuple[int, bytes | bytearray | None, float]:
        """(length, packed last draft, averaged accepted tokens): what the batched step reads.

        A last draft of the single path (a natively built tree) is packed first; the batch scores it the same way
        (the batched step calls this when ``_last_evidence`` is set).
        """
        if len(self._last_tree) and self._last_evidence is not None:
            self._last_packed = pack_draft(self._last_tree, self._last_evidence)
            self._last_tree, self._last_evidence = EMPTY_TREE, None
        # a fixed budget shows the batch an average so high that adapting it keeps the whole limit
        return self._len, self._last_packed, self._ema_accepted if self.policy.adaptive else FULL_BUDGET_EMA

    def extend(self, accepted: np.ndarray) -> Confirmation:
        """Correction step: learn which nodes of the last draft were accepted, then append ``accepted``.

        Args:
            accepted: (k,) int32 tokens appended to the sequence since the last call (accepted draft
                tokens and the target's own token).

        Returns:
            What of the last tree ``accepted`` confirmed.
        """
        confirmed = self._score_last_draft(accepted)
        self.append(accepted)
        return confirmed

    def _score_last_draft(self, accepted: np.ndarray) -> Confirmation:
        tree, evidence, served, packed = self._last_tree, self._last_evidence, self._last_served, self._last_packed
        self._last_tree, self._last_evidence, self._last_served, self._last_packed = EMPTY_TREE, None, None, None
        n_acc = 0
        toks = accepted.tolist()
        if packed is not None:  # drafted by the batched step: the tree and its evidence in one buffer
            n_acc, nodes, kinds = score_packed(packed, toks, self.model)
            self._count(nodes, n_acc)
            return Confirmation(n_acc, tuple(SOURCE_NAMES[k] for k in kinds)) if n_acc else NOTHING_CONFIRMED
        if len(tree) and evidence is not None:
            n_acc = score_draft(tree, evidence, toks, self.model)
        if served is not None and len(served):
            tree = served
            n_acc = accept_greedy(served, toks)[0]
        if not len(tree):
            return NOTHING_CONFIRMED
        self._count(len(tree), n_acc)
        return Confirmation(n_acc, path_sources(tree, toks, n_acc)) if n_acc else NOTHING_CONFIRMED

    def _count(self, nodes: int, n_acc: int) -> None:
        """A scored draft of ``nodes`` nodes confirmed ``n_acc`` of them."""
        if nodes:
            self.steps += 1
            self.drafted += nodes
            self.accepted += n_acc
            self._ema_accepted += 0.25 * (n_acc - self._ema_accepted)

    def budget(self, max_nodes: int = 0) -> int:
        """Node budget for the next draft: the request's, shrunk while recent drafts were rarely accepted."""
        return self.policy.budget(max_nodes or self.max_nodes, self._ema_accepted)

    def lookup(self, max_match: int, max_occurrences: int, depth: int) -> Continuations:
        """Prompt lookup: what followed earlier occurrences of the sequence's end inside this request."""
        native = kernels.native
        if native is not None:
            found = native.session_lookup(self._tokens, self._len, max_match, max_occurrences, depth)
            if found is None:
                return EMPTY
            if found is not NotImplemented:
                return Continuations(*found)
        return lookup_tokens(self._tokens, self._len, max_match, max_occurrences, depth)

    def remember(self, tree: DraftTree, evidence: Evidence, served: DraftTree | None = None) -> None:
        """Keep the draft just served so the next ``extend`` can score it.

        Args:
            tree: the model-free tree, scored against its evidence.
            evidence: why each of its nodes was proposed.
            served: the tree actually served when it differs (merged with the draft model's).
        """
        self._last_tree, self._last_evidence = tree, evidence
        self._last_served = served if served is not tree else None
        self._last_packed = None

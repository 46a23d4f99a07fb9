"""llama.cpp's ``ngram-mod`` speculative decoding as a replay peer: a hashed table of next tokens, shared by all.

llama.cpp (``common/ngram-mod.*``, ``--spec-type ngram-mod``, PR #19164) hashes every n-gram of the sequences it
serves with a 64-bit LCG (``h = h * 6364136223846793005 + token`` over the n tokens) into a fixed table whose entry
is the token that followed, the last writer winning. A draft repeatedly looks up the hash of the last n tokens,
drafted ones included, and stops at an empty entry.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from drafter_service.api.tree import EMPTY_TREE, DraftTree, chain

__all__ = ["NGramModDrafter", "NGramModTable"]

#: Multiplier of llama.cpp's n-gram hash.
LCG_MULTIPLIER = 6364136223846793005
_MASK64 = (1 << 64) - 1


class NGramModTable:
    """llama.cpp's ``common_ngram_mod``: ``size`` entries of next tokens indexed by the hash of ``n`` tokens.

    Attributes:
        n: tokens hashed per key.
        entries: (size,) int32 next token per slot, :attr:`EMPTY` where none was stored.
        used: slots holding a token.
    """

    EMPTY = -1

    def __init__(self, n: int, size: int) -> None:
        if n < 1 or size < 1:
            raise ValueError(f"need n >= 1 and size >= 1, got {n=}, {size=}")
        self.n = n
        self.entries = np.full(size, self.EMPTY, dtype=np.int32)
        self.used = 0
        self._drop = pow(LCG_MULTIPLIER, n - 1, 1 << 64)  # weight of the oldest token in the hash

    @property
    def size(self) -> int:
        return len(self.entries)

    def hash(self, tokens: Sequence[int]) -> int:
        """The 64-bit hash of the first ``n`` tokens."""
        h = 0
        for tok in tokens[: self.n]:
            h = (h * LCG_MULTIPLIER + int(tok)) & _MASK64
        return h

    def roll(self, h: int, dropped: int, added: int) -> int:
        """The hash of the window shifted by one token: ``dropped`` leaves at the front, ``added`` joins at the end."""
        return ((h - dropped * self._drop) * LCG_MULTIPLIER + added) & _MASK64

    def get(self, tokens: Sequence[int]) -> int:
        """The token stored after the first ``n`` tokens, or :attr:`EMPTY`."""
        return int(self.entries[self.hash(tokens) % self.size])

    def add(self, tokens: Sequence[int]) -> None:
        """Store ``tokens[n]`` after ``tokens[:n]``, overwriting the slot."""
        self.add_windows(np.asarray(tokens[: self.n + 1], dtype=np.int64), 0, 1)

    def add_windows(self, tokens: np.ndarray, start: int, stop: int) -> None:
        """Store, for every i in [start, stop), ``tokens[i + n]`` after ``tokens[i : i + n]``, in order of i.

        Args:
            tokens: (L,) integer sequence, L >= stop + n.
            start, stop: window starts.
        """
        m = stop - start
        if m <= 0:
            return
        toks = np.asarray(tokens[start : stop + self.n], dtype=np.int64).astype(np.uint64)  # (m + n,) uint64
        h = np.zeros(m, dtype=np.uint64)  # (m,) uint64; products wrap modulo 2**64 as in C
        mult = np.uint64(LCG_MULTIPLIER)
        for j in range(self.n):
            h = h * mult + toks[j : j + m]
        slots = (h % np.uint64(self.size)).astype(np.int64)  # (m,) int64
        values = toks[self.n :].astype(np.int32)  # (m,) int32
        # A slot written twice keeps the later window's token.
        slots_last, first = np.unique(slots[::-1], return_index=True)
        values_last = values[::-1][first]
        self.used += int(np.count_nonzero(self.entries[slots_last] == self.EMPTY))
        self.entries[slots_last] = values_last

    def draft(self, tokens: Sequence[int], max_tokens: int) -> list[int]:
        """Follow the table from the last ``n`` tokens: at most ``max_tokens``, stopping at an empty entry."""
        n = self.n
        if len(tokens) < n or max_tokens <= 0:
            return []
        window = [int(t) for t in tokens[len(tokens) - n :]]
        h = self.hash(window)
        out: list[int] = []
        while len(out) < max_tokens:
            tok = int(self.entries[h % self.size])
            if tok == self.EMPTY:
                break
            out.append(tok)
            window.append(tok)
            h = self.roll(h, window[len(out) - 1], tok)
        return out

    def reset(self) -> None:
        """Empty every slot."""
        self.entries.fill(self.EMPTY)
        self.used = 0


@dataclass
class _Request:
    tokens: list[int]  # prompt + output so far
    i_last: int = 0  # windows starting before this were added
    last_draft: list[int] = field(default_factory=list)
    low_streak: int = 0  # consecutive verifications that accepted under half the draft


class NGramModDrafter:
    """llama.cpp's ``ngram-mod`` drafter with one table shared by every request.

    Feeding, as llama.cpp's ``common_speculative_state_ngram_mod``: at a request's start every n-gram of its
    prompt is stored, then the table is emptied when more than ``occupancy_reset`` of its slots are used; when
    drafting, the n-grams of the tokens appended since are stored in chunks, once more than ``insert_chunk`` are
    pending (the sequence's last token, the one being drafted after, is not yet counted). After each verification,
    inferred from the tokens the next ``extend`` appends, a draft that had under half its tokens accepted three
    times in a row empties the table (and the request re-adds its whole sequence at its next draft).

    Drafting: the chain from the last ``n_match`` tokens, at most ``min(n_max, budget)`` tokens; a chain that stops
    short of ``min(n_min, n_max, budget)`` tokens is dropped, as llama.cpp drops drafts under ``n_min``. Node
    probabilities are a fixed ``decay ** depth`` (the table keeps no counts).

    Defaults are llama.cpp's: ``--spec-ngram-mod-n-match 24``, ``--spec-ngram-mod-n-min 48``,
    ``--spec-ngram-mod-n-max 64``, a table of 4 Mi slots (16 MiB), the 0.25 occupancy reset, the 32-token insertion
    chunk and the 3-round low-acceptance reset. With budgets under 48 the n_min rule keeps only full-length drafts.
    """

    def __init__(self, n_match: int = 24, n_min: int = 48, n_max: int = 64, size: int = 4 * 1024 * 1024,
                 occupancy_reset: float = 0.25, insert_chunk: int = 32, low_acceptance_reset: bool = True,
                 decay: float = 0.9, name: str = "ngram-mod") -> None:
        """Create the drafter with an empty table.

        Args:
            n_match: tokens hashed per key.
            n_min: shortest draft kept (capped by the budget and ``n_max``).
            n_max: longest draft (capped by the budget).
            size: table slots.
            occupancy_reset: used share of the table above which a request's start empties it (> 1: never).
            insert_chunk: pending tokens beyond which a draft first stores the new n-grams.
            low_acceptance_reset: empty the table after three drafts in a row accepted under half.
            decay: probability factor per draft position, in (0, 1].
            name: label in benchmark reports.

        Raises:
            ValueError: on out-of-range sizes.
        """
        if n_match < 1 or n_min < 0 or n_max < 1 or insert_chunk < 0 or not 0.0 < decay <= 1.0:
            raise ValueError(f"need n_match >= 1, n_min >= 0, n_max >= 1, insert_chunk >= 0, 0 < decay <= 1, got "
                             f"{n_match=}, {n_min=}, {n_max=}, {insert_chunk=}, {decay=}")
        self.name = name
        self.n_min = n_min
        self.n_max = n_max
        self.occupancy_reset = occupancy_reset
        self.insert_chunk = insert_chunk
        self.low_acceptance_reset = low_acceptance_reset
        self.decay = decay
        self.table = NGramModTable(n_match, size)
        self._requests: dict[str, _Request] = {}

    def start(self, request_id: str, prompt: Sequence[int]) -> None:
        """Open a request: store its prompt's n-grams (then empty an over-full table)."""
        if request_id in self._requests:
            raise ValueError(f"request {request_id!r} is already active")
        req = _Request([int(t) for t in prompt])
        self._requests[request_id] = req
        n = self.table.n
        if len(req.tokens) < n:
            return
        self.table.add_windows(np.asarray(req.tokens, dtype=np.int64), 0, len(req.tokens) - n)
        req.i_last = len(req.tokens) - n
        if self.table.used > self.occupancy_reset * self.table.size:
            self.table.reset()

    def extend(self, request_id: str, tokens: Sequence[int]) -> None:
        """Append tokens; the accepted part of the last draft feeds the low-acceptance rule."""
        req = self._request(request_id)
        toks = [int(t) for t in tokens]
        if req.last_draft:
            accepted = 0
            for drafted, tok in zip(req.last_draft, toks, strict=False):
                if drafted != tok:
                    break
                accepted += 1
            self._accept(req, accepted)
        req.last_draft = []
        req.tokens.extend(toks)

    def propose(self, request_id: str, max_nodes: int) -> DraftTree:
        """The draft chain within ``max_nodes`` nodes, or the empty tree."""
        return self.propose_chain(request_id, max_nodes)

    def propose_chain(self, request_id: str, k: int) -> DraftTree:
        """The draft chain of at most ``k`` tokens, or the empty tree."""
        req = self._request(request_id)
        req.last_draft = []
        limit = min(self.n_max, k)
        if limit <= 0:
            return EMPTY_TREE
        n = self.table.n
        cur_len = len(req.tokens) - 1  # llama.cpp's prompt_tgt: everything before the last token
        if cur_len < n:
            return EMPTY_TREE
        if req.i_last + self.insert_chunk < cur_len:
            self.table.add_windows(np.asarray(req.tokens, dtype=np.int64), req.i_last, cur_len - n)
            req.i_last = cur_len - n
        draft = self.table.draft(req.tokens, limit)
        if not draft or len(draft) < min(self.n_min, limit):
            return EMPTY_TREE
        req.last_draft = draft
        return chain(draft, [self.decay ** (i + 1) for i in range(len(draft))], self.name)

    def end(self, request_id: str) -> None:
        """Forget the request (its stored n-grams stay in the table)."""
        self._requests.pop(request_id, None)

    def _accept(self, req: _Request, accepted: int) -> None:
        if not self.low_acceptance_reset:
            return
        if accepted / len(req.last_draft) < 0.5:
            req.low_streak += 1
            if req.low_streak >= 3:
                self.table.reset()
                req.low_streak = 0
                req.i_last = 0
        else:
            req.low_streak = 0

    def _request(self, request_id: str) -> _Request:
        try:
            return self._requests[request_id]
        except KeyError:
            raise KeyError(f"request {request_id!r} is not active") from None

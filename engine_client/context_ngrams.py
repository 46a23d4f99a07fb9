"""Prompt lookup over one request's own context: a chain for a row whose pre-speculated tree held none, without the
network.

The n-grams of the context (prompt and output) map to where they last ended; the chain for the current context is
what followed the latest earlier occurrence of its last three tokens, else of its last two, else of its last one.
One thread fills the tables (``extend``) while another reads them (``chain``): a lookup may not see the newest
tokens yet, which only leaves out matches that end there.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

__all__ = ["ContextNgrams", "MAX_INDEXED_TOKENS"]

MAX_INDEXED_TOKENS = 16384
"""Tokens of a request indexed at most (about 200 bytes each); later tokens are still looked up, not indexed."""

_BITS = 21  # token ids below 2**21 pack into one int key per n-gram (larger ids only risk a wrong draft)

BULK = 64
"""A first piece at least this long (a prompt) is indexed with numpy at once."""


class ContextNgrams:
    """Where each token, bigram and trigram of a request's context last occurred."""

    __slots__ = ("tokens", "_unigrams", "_bigrams", "_trigrams")

    def __init__(self) -> None:
        self.tokens: list[int] = []
        # token, or packed (a, b), (a, b, c) -> index of the token after its latest occurrence
        self._unigrams: dict[int, int] = {}
        self._bigrams: dict[int, int] = {}
        self._trigrams: dict[int, int] = {}

    def extend(self, new: Sequence[int]) -> None:
        """Append tokens; the n-grams that end just before each one are indexed as it arrives, so the context's
        own last n-gram is never its own match."""
        if len(new) >= BULK and not len(self.tokens) and self._bulk(new):
            return
        toks, unigrams, bigrams, trigrams = self.tokens, self._unigrams, self._bigrams, self._trigrams
        for tok in new:
            i = len(toks)
            if i >= MAX_INDEXED_TOKENS:
                return
            if i >= 1:
                unigrams[toks[i - 1]] = i
            if i >= 2:
                pair = (toks[i - 2] << _BITS) | toks[i - 1]
                bigrams[pair] = i
                if i >= 3:
                    trigrams[(toks[i - 3] << 2 * _BITS) | pair] = i
            toks.append(int(tok))

    def _bulk(self, new: Sequence[int]) -> bool:
        """``extend`` of a first piece (a prompt) with numpy: every n-gram's key at once, the latest occurrence
        kept by a dictionary update in order; False (nothing done) when a token id does not pack."""
        toks = np.asarray(new, np.int64)[:MAX_INDEXED_TOKENS]
        if toks.size and not 0 <= int(toks.min()) <= int(toks.max()) < 1 << _BITS:
            return False
        after = np.arange(toks.size, dtype=np.int64)  # the token after the n-gram ending at i - 1 is i
        self._unigrams.update(zip(toks[:-1].tolist(), after[1:].tolist(), strict=True))
        pairs = (toks[:-2] << _BITS) | toks[1:-1]
        self._bigrams.update(zip(pairs.tolist(), after[2:].tolist(), strict=True))
        self._trigrams.update(zip(((toks[:-3] << 2 * _BITS) | pairs[1:]).tolist(), after[3:].tolist(),
                                  strict=True))
        self.tokens.extend(toks.tolist())
        return True

    def chain(self, last: Sequence[int], k: int) -> tuple[list[int], int]:
        """Up to ``k`` tokens that followed the latest earlier occurrence of ``last``'s final trigram, else bigram,
        else token, in the context, and the length of the match (3, 2 or 1); ([], 0) when none occurred."""
        if k <= 0 or not last:
            return [], 0
        at, n = None, 0
        if len(last) >= 2:
            pair = (last[-2] << _BITS) | last[-1]
            if len(last) >= 3:
                at, n = self._trigrams.get((last[-3] << 2 * _BITS) | pair), 3
            if at is None:
                at, n = self._bigrams.get(pair), 2
        if at is None:
            at, n = self._unigrams.get(last[-1]), 1
        if at is None:
            return [], 0
        return self.tokens[at:at + k], n

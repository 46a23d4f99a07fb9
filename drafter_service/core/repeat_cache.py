"""Exact-match cache of repeated prompts: the stored output of an earlier request with the very same prompt."""

from __future__ import annotations

import collections
import hashlib
import threading
from collections.abc import Mapping

import numpy as np

from drafter_service.api.tree import EMPTY_TREE, DraftTree, chain

SAVE_SLICE = 256
"""Outputs ``RepeatCache.saved`` copies per numpy call (an output holds up to a few thousand tokens)."""


def prompt_digest(prompt: np.ndarray) -> bytes:
    """16-byte digest of a prompt's int32 token ids."""
    return hashlib.blake2b(np.ascontiguousarray(prompt, dtype=np.int32).tobytes(), digest_size=16).digest()


class RepeatCache:
    """Outputs of completed requests keyed by a digest of their whole prompt, least recently used evicted first.

    When a new session's prompt was seen before in full, the output stored for it is offered as the first branch
    of every draft, for as long as the new output follows it. A greedy engine given the same prompt produces the
    same output, so such a request runs at about one verification step per budget's worth of tokens.

    How far a branch is followed is learnt online: ``continue_prob`` is the rate at which offered tokens were
    accepted given that the token before them was (a Beta(9, 1) prior), and node ``d`` of the branch (1-based)
    gets probability ``continue_prob ** d``.
    """

    def __init__(self, max_tokens: int = 1 << 24, max_output: int = 16384) -> None:
        """Hold at most ``max_tokens`` output tokens over all prompts, at most ``max_output`` per prompt."""
        if max_tokens < 0 or max_output < 1:
            raise ValueError(f"bad repeat cache sizes: max_tokens={max_tokens}, max_output={max_output}")
        self.max_tokens = int(max_tokens)
        self.max_output = int(max_output)
        self._outputs: collections.OrderedDict[bytes, np.ndarray] = collections.OrderedDict()  # digest -> (n,) int32
        self._tokens = 0
        self._lock = threading.Lock()
        self.hits = 0  # sessions whose prompt was found
        self._accepted = 9.0  # Beta prior on continuing: 9 accepted
        self._trials = 10.0  # ... out of 10

    def __len__(self) -> int:
        return len(self._outputs)

    @property
    def tokens(self) -> int:
        """Output tokens held."""
        return self._tokens

    def remember(self, prompt: np.ndarray, output: np.ndarray) -> None:
        """Store ``output`` (int32 ids) as the answer to ``prompt`` (replacing an earlier one)."""
        if self.max_tokens == 0 or prompt.size == 0 or output.size == 0:
            return
        out = np.array(output[:self.max_output], dtype=np.int32)
        out.flags.writeable = False
        key = prompt_digest(prompt)
        with self._lock:
            old = self._outputs.pop(key, None)
            if old is not None:
                self._tokens -= old.size
            self._outputs[key] = out
            self._tokens += out.size
            while self._tokens > self.max_tokens:
                _, dropped = self._outputs.popitem(last=False)
                self._tokens -= dropped.size

    def lookup(self, prompt: np.ndarray) -> np.ndarray | None:
        """The output stored for exactly this prompt (read-only int32), or None; counts a hit."""
        if not self._outputs or prompt.size == 0:
            return None
        key = prompt_digest(prompt)
        with self._lock:
            found = self._outputs.get(key)
            if found is not None:
                self._outputs.move_to_end(key)
                self.hits += 1
        return found

    def saved(self) -> dict[str, np.ndarray]:
        """The cache's entries as arrays, least recently used first, for an index file (``load`` reads them back).

        Returns:
            "repeat_digests" (k, 16) uint8 prompt digests, "repeat_lengths" (k,) int64 output lengths and
            "repeat_tokens" (sum of lengths,) int32 the outputs one after another.
        """
        with self._lock:
            entries = list(self._outputs.items())
        digests = np.frombuffer(b"".join(k for k, _ in entries), dtype=np.uint8).reshape(len(entries), 16)
        lengths = np.fromiter((v.size for _, v in entries), dtype=np.int64, count=len(entries))
        outputs = [v for _, v in entries]
        tokens = np.empty(int(lengths.sum()), dtype=np.int32)
        # a few hundred outputs a numpy call, straight into place: a copy of millions of tokens in one call (or two)
        # held the interpreter lock, and every draft waited, for about 100 ms
        ends = np.cumsum(lengths)
        for i in range(0, len(outputs), SAVE_SLICE):
            j = min(i + SAVE_SLICE, len(outputs))
            lo = int(ends[i - 1]) if i else 0
            if j > i:
                np.concatenate(outputs[i:j], out=tokens[lo:int(ends[j - 1])], casting="same_kind")
        return {"repeat_digests": digests, "repeat_lengths": lengths, "repeat_tokens": tokens}

    def load(self, arrays: Mapping[str, np.ndarray]) -> int:
        """Replace the entries with those ``saved`` gave (the hit counts and the learnt continuation rate stay).

        Entries beyond this cache's bounds are cut as ``remember`` cuts them; returns the entries held.

        Raises:
            ValueError: arrays that do not fit together.
        """
        digests, lengths, tokens = arrays["repeat_digests"], arrays["repeat_lengths"], arrays["repeat_tokens"]
        if digests.ndim != 2 or digests.shape[1:] != (16,) or lengths.shape != (len(digests),) or \
                int(lengths.sum()) != tokens.size or (lengths.size and int(lengths.min()) < 1):
            raise ValueError("repeated-prompt arrays that do not fit together")
        ends = np.cumsum(lengths)
        keys = digests.tobytes()
        with self._lock:
            self._outputs.clear()
            self._tokens = 0
            for i, (end, n) in enumerate(zip(ends.tolist(), lengths.tolist(), strict=True)):
                out = np.array(tokens[end - n:end][:self.max_output], dtype=np.int32)
                out.flags.writeable = False
                self._outputs[keys[16 * i:16 * i + 16]] = out
                self._tokens += out.size
            while self._tokens > self.max_tokens:
                _, dropped = self._outputs.popitem(last=False)
                self._tokens -= dropped.size
            return len(self._outputs)

    @property
    def continue_prob(self) -> float:
        """Estimated probability that an offered token is accepted given that the one before it was."""
        return min(self._accepted / self._trials, 0.999)

    def record(self, accepted: int, rejected: bool) -> None:
        """Learn from one verified branch: ``accepted`` tokens matched, then a mismatch when ``rejected``."""
        with self._lock:
            self._accepted += accepted
            self._trials += accepted + int(rejected)

    def branch(self, output: np.ndarray, start: int, budget: int) -> DraftTree:
        """The chain of ``output[start:start + budget]`` as a draft tree (empty when nothing is left)."""
        toks = output[start:start + budget].tolist()
        if not toks:
            return EMPTY_TREE
        q = self.continue_prob
        return chain(toks, [q ** (d + 1) for d in range(len(toks))], "repeat")

    def check_invariants(self) -> None:
        """Raise AssertionError when the token count or the size bounds are off."""
        assert self._tokens == sum(v.size for v in self._outputs.values())
        assert self._tokens <= self.max_tokens
        assert all(0 < v.size <= self.max_output for v in self._outputs.values())
        assert 0 < self._accepted <= self._trials

"""Cache-aware prefix routing, as fleet routers do it (vLLM's production stack, llm-d, SGLang's router).

A prompt is cut into blocks of ``BLOCK`` tokens, and each block is hashed together with everything before it (a chained
CRC-32, as vLLM's prefix cache hashes its KV blocks), so a hash stands for a whole prefix. The router remembers which
earlier prompt last had each prefix hash; a new request's match is its common prefix, in tokens, with the prompt behind
its deepest known hash, and it goes to the replica that served that prompt. A match counts only when it is at least
``MIN_MATCH`` tokens long and, once two prompts have been routed, reaches ``MIN_EXTRA`` tokens past the prefix every
prompt routed so far shares (a system line or chat template all requests start with says nothing about where a
request's cache is); without one the request goes to the least-loaded replica (the one that has served the fewest
requests, lowest index on ties).
"""

from __future__ import annotations

import zlib
from collections.abc import Sequence

import numpy as np

__all__ = ["BLOCK", "MIN_EXTRA", "MIN_MATCH", "PrefixRouter", "block_hashes"]

#: Tokens per hashed block (vLLM's default KV block size).
BLOCK = 16

#: The shortest shared prefix, in tokens, that routes a request to where it was served before.
MIN_MATCH = 32

#: Tokens past the prefix all prompts share that a match must reach.
MIN_EXTRA = 8


def block_hashes(prompt: Sequence[int] | np.ndarray, block: int = BLOCK) -> list[int]:
    """Chained CRC-32 hashes of the prompt's whole ``block``-token blocks (as little-endian int32): hash i stands
    for the first ``(i + 1) * block`` tokens, and is the same in every process and run."""
    tokens = np.asarray(prompt, dtype="<i4").reshape(-1)
    out: list[int] = []
    value = 0
    for start in range(0, tokens.size - block + 1, block):
        value = zlib.crc32(tokens[start:start + block].tobytes(), value)
        out.append(value)
    return out


def _common(a: np.ndarray, b: np.ndarray) -> int:
    """Length of the longest common prefix of two token arrays."""
    n = min(a.size, b.size)
    differ = np.flatnonzero(a[:n] != b[:n])
    return int(differ[0]) if differ.size else n


class PrefixRouter:
    """Routes requests one at a time to the replica that served the longest matching prompt prefix."""

    def __init__(self, replicas: int, block: int = BLOCK, min_match: int = MIN_MATCH,
                 min_extra: int = MIN_EXTRA) -> None:
        """Start with no prompt seen.

        Raises:
            ValueError: on ``replicas < 1`` or ``block < 1``.
        """
        if replicas < 1 or block < 1:
            raise ValueError(f"replicas and block must be >= 1, got {replicas} and {block}")
        self.block = block
        self.min_match = min_match
        self.min_extra = min_extra
        self.served = np.zeros(replicas, dtype=np.int64)
        self._owner: dict[int, int] = {}  # prefix hash -> the last prompt routed with it
        self._prompts: list[np.ndarray] = []
        self._replicas: list[int] = []  # where each prompt went
        self._shared = 0  # tokens every prompt routed so far starts with

    def match(self, prompt: Sequence[int] | np.ndarray) -> tuple[int, int]:
        """(tokens matched, replica): the common prefix with the prompt behind the deepest known prefix hash of
        ``prompt``, and where that prompt went; (0, -1) when not even its first block is known."""
        owner = -1
        for h in block_hashes(prompt, self.block):
            found = self._owner.get(h)
            if found is None:
                break
            owner = found
        if owner < 0:
            return 0, -1
        tokens = np.asarray(prompt, dtype=np.int64).reshape(-1)
        return _common(self._prompts[owner], tokens), self._replicas[owner]

    def shared(self) -> int:
        """Tokens every prompt routed so far starts with; 0 before the second (one prompt shows no set prefix, and
        the next turn of its conversation should still find it)."""
        return self._shared if len(self._prompts) >= 2 else 0

    def route(self, prompt: Sequence[int] | np.ndarray) -> int:
        """The replica for the next request, which is then counted as served there."""
        tokens = np.asarray(prompt, dtype=np.int64).reshape(-1)
        matched, replica = self.match(tokens)
        if matched < max(self.min_match, self.shared() + self.min_extra) or replica < 0:
            replica = int(np.argmin(self.served))
        self.served[replica] += 1
        for h in block_hashes(tokens, self.block):
            self._owner[h] = len(self._prompts)
        self._shared = _common(self._prompts[0][:self._shared], tokens) if self._prompts else int(tokens.size)
        self._prompts.append(tokens)
        self._replicas.append(replica)
        return replica

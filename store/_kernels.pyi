"""Type stubs for the C extension ``store._kernels`` (built from ``_kernels.c``).

Every lookup returns ``NotImplemented`` for arguments it does not handle; the callers then run the numpy reference.
"""

from types import NotImplementedType
from typing import final

import numpy as np

_Matches = tuple[int, np.ndarray, np.ndarray]

TAIL_WINDOW: int
"""Most unindexed tokens (the newest) a store lookup searches when no Tail is given."""
TAIL_LISTS: int
"""Most tokens a store lookup adds to a Tail's lists at once (more: it scans)."""
TAIL_ADD_COST: int
"""A Tail's ``add_cost`` by default."""

@final
class Index:
    """A suffix index's arrays held for native matching (keeps them alive)."""

    def __init__(self, keys: np.ndarray, sa: np.ndarray, start: int, end: int, bits: int,
                 tokens_per_key: int) -> None: ...
    @property
    def nbytes(self) -> int:
        """Memory held beyond the index's own arrays (the bucket table)."""

@final
class Tail:
    """Where each token and pair of tokens occurs in a store's unindexed tail, kept up to date by the store
    lookups given it once they would spend more scanning the tail than bringing the lists up to date (their
    answers are those of scanning it); they search only the newest ``window`` unindexed tokens."""

    def __init__(self, window: int = ..., add_cost: int = ...) -> None: ...
    @property
    def window(self) -> int:
        """Most unindexed tokens (the newest) a lookup given this Tail searches."""
    @property
    def add_cost(self) -> int:
        """Tokens scanned that cost as much as adding one to the lists (0: the lists whenever they can)."""
    @property
    def nbytes(self) -> int:
        """Memory held by the occurrence lists."""
    @property
    def start(self) -> int:
        """First position covered."""
    @property
    def end(self) -> int:
        """One past the last position covered."""

def simd(name: str | None = None, /) -> str: ...
def pack_keys(rev: np.ndarray, sa: np.ndarray, bits: int, tokens_per_key: int,
              /) -> np.ndarray | NotImplementedType: ...
def scan_matches(ring_data: np.ndarray, start: int, stop: int, context_rev: np.ndarray, limit: int, oldest: int,
                 /) -> _Matches | NotImplementedType: ...
def extend_matches(ring_data: np.ndarray, ends: np.ndarray, context_rev: np.ndarray, matched: int, limit: int,
                   oldest: int, /) -> _Matches | NotImplementedType: ...
def continuations(ring_data: np.ndarray, starts: np.ndarray, depth: int, stop: int,
                  /) -> np.ndarray | NotImplementedType: ...
def index_match(index: Index, context_rev: np.ndarray, ring_data: np.ndarray, oldest: int, max_match: int,
                max_candidates: int, /) -> _Matches | NotImplementedType: ...
def store_lookup(context: np.ndarray, ring_data: np.ndarray, oldest: int, stop: int, delta: Index | None,
                 main: Index | None, max_match: int, max_occurrences: int, depth: int, max_candidates: int,
                 max_examined: int, tail: Tail | None = None, /,
                 ) -> tuple[int, np.ndarray, np.ndarray] | None | NotImplementedType: ...
def session_lookup(tokens: np.ndarray, n: int, max_match: int, max_occurrences: int, depth: int,
                   /) -> tuple[int, np.ndarray, np.ndarray] | None | NotImplementedType: ...

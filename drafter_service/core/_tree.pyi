"""Type stubs for the C extension ``drafter_service.core._tree`` (built from ``_tree.c``): the native twin of
``tree_builder.build_tree`` and ``tree_builder.score_draft``, and the batched step of ``batch_steps``."""

from array import array
from collections.abc import Sequence
from typing import Any

import numpy as np

def build(context: Sequence[int], rows0: np.ndarray | None, match0: int, rows1: np.ndarray | None, match1: int,
          tables: Sequence[tuple[int, Any, int]], leader_len: int, accepted: array[float], trials: array[float],
          max_nodes: int, max_depth: int, min_prob: float, branch: int,
          ) -> tuple[tuple[int, ...], tuple[int, ...], tuple[float, ...], tuple[int, ...], tuple[int, ...],
                     tuple[int, ...], tuple[float, ...]]:
    """(tokens, parents, probs, source kinds, evidence offsets, evidence keys, evidence priors) of a tree."""
    ...

def score(token_ids: Sequence[int], parents: Sequence[int], offsets: Sequence[int], keys: Sequence[int],
          priors: Sequence[float], accepted: Sequence[int], model_accepted: array[float], model_trials: array[float],
          prior_strength: float, horizon: float) -> int:
    """Record a draft's verification outcome in the acceptance model; returns the draft tokens accepted."""
    ...

def pack(token_ids: Sequence[int], parents: Sequence[int], kinds: Sequence[int], offsets: Sequence[int],
         keys: Sequence[int], priors: Sequence[float]) -> bytes:
    """A packed draft (a tree with its source kinds and evidence in one buffer) that ``score_packed`` scores."""
    ...

def score_packed(packed: bytes | bytearray, accepted: Sequence[int], model_accepted: array[float],
                 model_trials: array[float], prior_strength: float, horizon: float) -> tuple[int, int, list[int]]:
    """``score`` over a packed draft: (draft tokens accepted, nodes, source kind of each accepted node)."""
    ...

def steps(sessions: list[Any], accepted: np.ndarray, offsets: list[int], limits: list[int], report: list[bool],
          settings: tuple[Any, ...],
          ) -> tuple[list[int], bytes, bytes, bytes, bytes, list[int], bytes, tuple[int, int, int, int],
                     tuple[int, int, int, int]]:
    """One engine step of many DraftSessions, read and updated in place: each scored and appended in order, then
    each drafted, on up to the settings' threads (see ``batch_steps``): (tree offsets, token ids, parents, probs,
    source kinds, confirmed, latencies in ns, nodes drafted per kind, nodes confirmed per kind). Every node's token
    id, parent and kind, and every latency, come packed in native byte order, as int32, int32, float64, uint8 and
    int64 arrays."""
    ...

def threads() -> tuple[int, int]:
    """(helper threads started, steps drafted on more than one thread) so far in this process."""
    ...

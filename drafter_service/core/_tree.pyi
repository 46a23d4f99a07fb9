"""Type stubs for the C extension ``drafter_service.core._tree`` (built from ``_tree.c``): the native twin of
``tree_builder.build_tree`` and ``tree_builder.score_draft``."""

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

"""How many draft nodes a step should verify: the prefix of the tree that maximises tokens per second."""

from __future__ import annotations

import logging
from collections.abc import Sequence

logger = logging.getLogger(__name__)

__all__ = ["StepCostModel", "best_prefix"]


class StepCostModel:
    """Verification time as a line in the number of draft nodes: ``t(n) = base + per_node * n``.

    Fitted by least squares over recent steps, with decaying weights so it follows the cache growing and the
    machine's load; until steps of different sizes have been seen, ``prior_ratio`` (t(32) / t(0)) sets the slope.
    """

    def __init__(self, prior_ratio: float = 1.5, decay: float = 0.98) -> None:
        self.prior_ratio = float(prior_ratio)
        self.decay = float(decay)
        self._w = self._sn = self._st = self._snn = self._snt = 0.0  # weighted sums of 1, n, t, n^2, n*t

    def observe(self, nodes: int, seconds: float) -> None:
        """Record one verification step of ``nodes`` draft nodes that took ``seconds``."""
        d = self.decay
        n = float(nodes)
        self._w = d * self._w + 1.0
        self._sn = d * self._sn + n
        self._st = d * self._st + seconds
        self._snn = d * self._snn + n * n
        self._snt = d * self._snt + n * seconds

    def line(self) -> tuple[float, float]:
        """(base seconds, seconds per node); (0, 0) before any step."""
        if self._w == 0.0:
            return 0.0, 0.0
        mean_n, mean_t = self._sn / self._w, self._st / self._w
        var_n = self._snn / self._w - mean_n * mean_n
        if var_n < 4.0:  # sizes barely varied: the prior's line through the mean
            slope = (self.prior_ratio - 1.0) / 32.0  # per node, as a share of the base
            per_node = mean_t / (1.0 + slope * mean_n) * slope
        else:
            per_node = (self._snt / self._w - mean_n * mean_t) / var_n
        per_node = max(per_node, 0.0)
        base = max(mean_t - per_node * mean_n, 1e-9)
        return base, per_node

    def plain_seconds(self) -> float:
        """Seconds of a plain decode step (one token, no draft node): ``t(0)``, the fitted line's base.

        0 until the steps seen pin it down: steps of varied sizes (a real fit), or steps averaging under one
        draft node (then t(0) is about their mean time). Before that the slope, and so t(0), would come
        mostly from ``prior_ratio``, which is a guess, not a measurement.
        """
        if self._w == 0.0:
            return 0.0
        mean_n = self._sn / self._w
        if self._snn / self._w - mean_n * mean_n < 4.0 and mean_n >= 1.0:
            return 0.0
        return self.line()[0]


def best_prefix(probs: Sequence[float], base: float, per_node: float, min_nodes: int = 0) -> int:
    """Nodes to keep so that (1 + expected accepted) / step time is highest.

    Args:
        probs: (n,) estimated probability that each node is accepted, in tree order (best first).
        base: seconds of a step without draft nodes.
        per_node: extra seconds per draft node.
        min_nodes: keep at least this many (when the tree has them).

    Returns:
        how many leading nodes to verify (``DraftTree.prefix`` keeps a valid tree).
    """
    if base <= 0.0:
        return len(probs)
    best_n = min(min_nodes, len(probs))
    expected = 1.0 + float(sum(probs[:best_n]))
    best_rate = expected / (base + per_node * best_n)
    for i in range(best_n + 1, len(probs) + 1):
        expected += float(probs[i - 1])
        rate = expected / (base + per_node * i)
        if rate > best_rate:
            best_n, best_rate = i, rate
    return best_n

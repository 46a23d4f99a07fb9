"""How many draft nodes a step should verify: the rule shared by the reference engine, the vLLM proposer and the
service.

A step that verifies ``n`` draft nodes takes ``t(n)`` seconds and emits ``1 + accepted`` tokens, so the budget that
pays best is the ``n`` maximising ``(1 + sum of the first n nodes' acceptance probabilities) / t(n)``, and ``n = 0``
(a plain step) wins whenever drafting does not pay. Three parts make that choice trustworthy on any machine:

- ``StepCostCurve`` learns ``t(n)`` online as measured points, not as a line: on a GPU it is flat for dozens of
  nodes, on a CPU without native bfloat16 each node costs a third of a plain step.
- ``AcceptanceCalibration`` maps the drafter's estimates to the acceptance rates actually seen, so an overconfident
  source cannot talk the engine into steps that lose.
- ``VerifyBudget`` combines them, explores cheaply (sizes grow by at most doubling past the largest one measured,
  and a one-node probe now and then keeps the calibration learning while drafting is off) and applies the rule to
  one tree (``choose``) or to a whole batch of chains (``choose_batch``).
"""

from __future__ import annotations

import bisect
import logging
import math
from collections.abc import Sequence

import numpy as np

logger = logging.getLogger(__name__)

__all__ = ["AcceptanceCalibration", "MAX_COST_POINTS", "StepCostCurve", "VerifyBudget", "best_prefix",
           "consistent_tree", "cost_points_error"]

#: Node counts whose step times the curve keeps apart (a step of n nodes falls in the last point <= n).
GRID = (0, 1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64, 96, 128, 192, 256, 384, 512, 768, 1024, 1536, 2048, 3072, 4096,
        6144, 8192)


#: A step counts for at most this many times its bucket's mean so far (once the bucket has seen ``CLIP_AFTER`` steps):
#: one slow step (a garbage collection, another process taking the cores) moves the estimate by a bounded amount and
#: cannot make a size look unaffordable for the next dozen steps, while a lasting change is still followed within a
#: few steps.
CLIP_FACTOR = 2.0
CLIP_AFTER = 3.0

#: What a plain step re-measured by ``VerifyBudget`` leaves of the plain size's earlier steps' weight.
REFRESH_KEEP = 0.25

#: Bounds of the calibration's power law: beyond them one workload's extremes would rule every estimate.
GAMMA_RANGE = (0.25, 4.0)

#: From this many chain tokens on, ``VerifyBudget.choose_batch`` ranks them with numpy; below, numpy's cost per call
#: is more than the Python loop's (on a 2-core AMD EPYC, AVX2: about equal at 40 tokens; 22 against 82 us at 8, 310
#: against 183 us at 128).
VECTOR_FROM = 40

#: Most points of a cost curve a Draft request may carry.
MAX_COST_POINTS = 64


def cost_points_error(nodes: Sequence[float], seconds: Sequence[float], exponent: float = 0.0) -> str:
    """Why a Draft request's cost curve (``cost_nodes``, ``cost_seconds``) or ``estimate_exponent`` is malformed;
    "" when they are fine. The client and the service both check with it, each raising its own error."""
    if not 0.0 <= exponent <= 100.0:  # also refuses NaN
        return f"estimate_exponent must be in [0, 100], got {exponent}"
    if len(nodes) > MAX_COST_POINTS:
        return f"at most {MAX_COST_POINTS} cost points, got {len(nodes)}"
    if len(nodes) != len(seconds):
        return f"{len(nodes)} cost_nodes but {len(seconds)} cost_seconds"
    for n, t in zip(nodes, seconds, strict=True):
        if not (0.0 <= n <= 1e6 and 0.0 < t <= 3600.0):  # also refuses NaN
            return f"a cost point needs nodes in [0, 1e6] and seconds in (0, 3600]; got ({n}, {t})"
    return ""


class StepCostCurve:
    """``t(n)``: seconds of a verification step with ``n`` draft nodes, learned from the steps an engine ran.

    Steps fall into buckets by size (``GRID``); each bucket keeps a decaying mean of its steps' sizes and times, so
    it follows the cache growing and the machine's load; a step slower than twice its bucket's mean counts as twice
    the mean (``CLIP_FACTOR``). ``seconds(n)`` interpolates between the buckets' points
    (kept non-decreasing); past the largest one it is flat (see ``seconds``).
    """

    def __init__(self, decay: float = 0.9) -> None:
        if not 0.0 < decay <= 1.0:
            raise ValueError(f"decay must be in (0, 1], got {decay}")
        self.decay = float(decay)
        self._w = [0.0] * len(GRID)  # per bucket: decayed weight, sum of sizes, sum of seconds
        self._sn = [0.0] * len(GRID)
        self._st = [0.0] * len(GRID)
        self._points: list[tuple[float, float]] | None = []
        self._sizes: list[float] = []  # the points' sizes, for bisecting
        self._run: tuple[int, list[float]] = (0, [])  # the last ``seconds_from`` (its first size, its times)
        self.changes = 0  # steps recorded or forgotten so far: what was computed from the curve holds while it stays

    @classmethod
    def from_points(cls, nodes: Sequence[float], seconds: Sequence[float]) -> StepCostCurve:
        """A curve through given ``(nodes, seconds)`` points, as an engine sends them with a Draft request.

        Raises:
            ValueError: the points are malformed (``cost_points_error``).
        """
        error = cost_points_error(nodes, seconds)
        if error:
            raise ValueError(error)
        curve = cls()
        for n, t in zip(nodes, seconds, strict=True):
            curve.observe(n, t)
        return curve

    def observe(self, nodes: float, seconds: float) -> None:
        """Record one verification step of ``nodes`` draft nodes that took ``seconds``."""
        if seconds <= 0.0 or nodes < 0:
            return
        i = bisect.bisect_right(GRID, nodes) - 1
        d = self.decay
        if self._w[i] >= CLIP_AFTER:
            seconds = min(float(seconds), CLIP_FACTOR * self._st[i] / self._w[i])
        self._w[i] = d * self._w[i] + 1.0
        self._sn[i] = d * self._sn[i] + float(nodes)
        self._st[i] = d * self._st[i] + float(seconds)
        self._changed()

    def forget(self, nodes: float, keep: float) -> None:
        """Weigh what the bucket of ``nodes`` has seen so far by ``keep`` (in [0, 1]): the next step there counts
        more."""
        i = bisect.bisect_right(GRID, nodes) - 1
        self._w[i] *= keep
        self._sn[i] *= keep
        self._st[i] *= keep
        self._changed()

    def _changed(self) -> None:
        """Drop what was computed from the buckets (the points, the last ``seconds_from``)."""
        self._points, self._run = None, (0, [])
        self.changes += 1

    def points(self) -> list[tuple[float, float]]:
        """The measured ``(mean nodes, mean seconds)`` of every bucket seen, by size, times made non-decreasing.

        Buckets whose times decrease with size are pooled (their weighted mean time, pool-adjacent-violators), so
        one slow outlier at a small size is outweighed by the steps around it instead of lifting every larger
        size to its time, which would make drafting look free.
        """
        if self._points is None:
            sizes: list[float] = []
            pools: list[tuple[float, float, int]] = []  # (weight, weighted seconds, buckets pooled)
            for w, sn, st in zip(self._w, self._sn, self._st, strict=True):
                if w > 0.0:
                    sizes.append(sn / w)
                    pool = (w, st, 1)
                    while pools and pools[-1][1] / pools[-1][0] > pool[1] / pool[0]:
                        pw, pst, pk = pools.pop()
                        pool = (pw + pool[0], pst + pool[1], pk + pool[2])
                    pools.append(pool)
            times = [st / w for w, st, k in pools for _ in range(k)]
            self._points, self._sizes = list(zip(sizes, times, strict=True)), sizes
        return self._points

    @property
    def measured(self) -> bool:
        """Whether any step has been seen."""
        return bool(self.points())

    def largest_measured(self) -> float:
        """The largest size (mean nodes of the top bucket) seen; -1 before any step."""
        pts = self.points()
        return pts[-1][0] if pts else -1.0

    def seconds(self, nodes: float) -> float:
        """Estimated seconds of a step with ``nodes`` draft nodes; 0 before any step.

        Past the largest size measured the estimate stays at that size's time: optimistic, so a larger size is
        tried when the drafts promise enough to pay for it even then, and its real time is measured once.
        """
        pts = self.points()
        if not pts:
            return 0.0
        if len(pts) == 1 or nodes >= pts[-1][0]:
            return pts[-1][1]
        i = max(1, bisect.bisect_left(self._sizes, nodes))  # below the smallest size: the first two points' line
        (n0, t0), (n1, t1) = pts[i - 1], pts[i]
        est = t0 + (t1 - t0) * (nodes - n0) / (n1 - n0) if n1 > n0 else t1
        return max(est, 0.5 * t0)

    def seconds_run(self, first: int, count: int) -> list[float]:
        """``[seconds(n) for n in range(first, first + count)]``, walking the points once instead of searching them
        for every size (the same values)."""
        pts = self.points()
        if not pts:
            return [0.0] * count
        last_n, last_t = pts[-1]
        out: list[float] = []
        nodes = first
        end = first + count
        if len(pts) > 1:
            sizes = self._sizes
            at = bisect.bisect_left(sizes, nodes)
            while nodes < end and nodes < last_n:
                while sizes[at] < nodes:  # bisect_left(sizes, nodes); nodes < the last size, so it stops there
                    at += 1
                i = max(1, at)
                (n0, t0), (n1, t1) = pts[i - 1], pts[i]
                est = t0 + (t1 - t0) * (nodes - n0) / (n1 - n0) if n1 > n0 else t1
                out.append(max(est, 0.5 * t0))
                nodes += 1
        out += [last_t] * (end - nodes)
        return out

    def seconds_from(self, first: int, count: int) -> list[float]:
        """``seconds_run(first, count)``, possibly longer: kept until the next step is recorded, so that a choice
        reads times another thread computed in advance (``VerifyBudget.prepare``)."""
        start, times = self._run
        if start != first:
            start, times = first, []
            self._run = (first, times)
        if len(times) < count:
            times += self.seconds_run(first + len(times), count - len(times))
        return times

    def seconds_array(self, first: int, count: int) -> np.ndarray:
        """``seconds_run(first, count)`` as a float64 array, computed for every size at once (the same values)."""
        pts = self.points()
        if not pts:
            return np.zeros(count)
        nodes = np.arange(first, first + count, dtype=np.float64)
        last_n, last_t = pts[-1]
        if len(pts) == 1:
            return np.full(count, last_t)
        sizes = np.asarray(self._sizes)
        times = np.asarray([t for _, t in pts])
        i = np.minimum(np.maximum(np.searchsorted(sizes, nodes, side="left"), 1), len(pts) - 1)
        n0, t0, n1, t1 = sizes[i - 1], times[i - 1], sizes[i], times[i]
        est = np.maximum(t0 + (t1 - t0) * (nodes - n0) / (n1 - n0), 0.5 * t0)  # sizes increase: n1 > n0
        est[nodes >= last_n] = last_t
        return est

    def plain_seconds(self) -> float:
        """``t(0)``: seconds of a plain decode step, estimated; 0 before any step."""
        return self.seconds(0)


def consistent_tree(values: Sequence[float], parents: Sequence[int]) -> list[float]:
    """Path acceptance probabilities made consistent with the tree: a node is accepted only if its parent is, and
    at most one of a node's children is, so siblings' values are scaled down to sum to at most their parent's.

    Calibrating each node on its own (``p ** gamma`` with gamma < 1 lifts every estimate) would otherwise count
    two siblings at 0.7 each as 1.4 expected tokens.

    Args:
        values: (n,) each node's probability, parents before children.
        parents: (n,) each node's parent (-1: the root).
    """
    sums: dict[int, float] = {}
    for v, parent in zip(values, parents, strict=True):
        sums[parent] = sums.get(parent, 0.0) + float(v)
    out: list[float] = []
    for v, parent in zip(values, parents, strict=True):
        above = out[parent] if parent >= 0 else 1.0
        out.append(float(v) * min(1.0, above / sums[parent]) if sums[parent] > 0 else 0.0)
    return out


def best_prefix(probs: Sequence[float], curve: StepCostCurve, min_nodes: int = 0, max_nodes: int | None = None,
                exponent: float = 1.0, parents: Sequence[int] | None = None) -> int:
    """Nodes to keep so that (1 + expected accepted) / step time is highest (0: a plain step pays best).

    Args:
        probs: (n,) probability that each node is accepted, in tree order (best first; a prefix is a valid tree).
        curve: the step's time against nodes verified; before any measurement every node is kept.
        min_nodes: keep at least this many (when the tree has them).
        max_nodes: consider at most this many.
        exponent: each probability is raised to it first (an engine's calibration of the estimates), then, given
            ``parents``, made consistent with the tree (``consistent_tree``).
        parents: the nodes' parents, parents before children.

    Returns:
        how many leading nodes to verify (``DraftTree.prefix`` keeps a valid tree).
    """
    limit = len(probs) if max_nodes is None else max(0, min(len(probs), max_nodes))
    if not curve.measured:
        return limit
    if exponent != 1.0:
        probs = [float(p) ** exponent for p in probs[:limit]]
        if parents is not None:
            probs = consistent_tree(probs, parents[:limit])
    best_n = min(min_nodes, limit)
    expected = 1.0 + float(sum(probs[:best_n]))
    best_rate = expected / curve.seconds(best_n)
    for i in range(best_n + 1, limit + 1):
        expected += float(probs[i - 1])
        rate = expected / curve.seconds(i)
        if rate > best_rate:
            best_n, best_rate = i, rate
    return best_n


class AcceptanceCalibration:
    """The acceptance rate actually seen for drafts estimated at each probability.

    Estimates fall into bins by ``-ln p`` (``bin_width`` wide); each bin keeps decaying counts of verified nodes
    and accepted ones. A power law ``p ** gamma`` fitted to all bins at once (the total it predicts for the nodes
    seen equals the total accepted) maps an estimate where its bin has little evidence, so a source that is over-
    or underconfident at the depths verified is corrected at the depths not verified yet; ``prior`` pseudo-nodes
    at that value weigh against the bin's own counts.

    The bins are numpy arrays and every method works on all its estimates at once: a vLLM engine step learns from
    and ranks hundreds of chain tokens on its critical path.
    """

    def __init__(self, bin_width: float = 0.1, bins: int = 48, prior: float = 4.0, decay: float = 0.995) -> None:
        if bin_width <= 0.0 or bins < 1 or prior <= 0.0 or not 0.0 < decay <= 1.0:
            raise ValueError(f"need bin_width > 0, bins >= 1, prior > 0, decay in (0, 1]; got {bin_width}, {bins}, "
                             f"{prior}, {decay}")
        self.bin_width, self.bins, self.prior, self.decay = float(bin_width), bins, float(prior), float(decay)
        self._seen = np.zeros(bins)
        self._accepted = np.zeros(bins)
        self._log_p = np.zeros(bins)  # decayed sum of ln(estimate) of the nodes seen in each bin
        self._gamma: float | None = 1.0
        self._last_gamma = 1.0  # the last fit, where the next one starts
        self._lists: tuple[list[float], list[float]] | None = None  # (seen, accepted) as lists, for ``ranked``
        self.changes = 0  # ``observe`` calls that recorded nodes: what was computed from the bins holds while it stays

    def _bins_of(self, p: np.ndarray) -> np.ndarray:
        """The bin of each estimate in ``p`` (already clipped to [0, 1]); 0 and below fall in the last bin."""
        x = np.log(np.fmax(p, 1e-300)) / -self.bin_width
        return np.fmin(x, self.bins - 1).astype(np.intp)  # 0 (and NaN) fall past the last bin's edge

    def observe(self, probs: Sequence[float], accepted: Sequence[bool]) -> None:
        """Record verified nodes: each one's estimate and whether the target accepted it."""
        if not len(probs):
            return
        p = np.asarray(probs, dtype=np.float64)
        if len(p) != len(accepted):
            raise ValueError(f"{len(p)} estimates but {len(accepted)} outcomes")
        b = self._bins_of(np.fmin(p, 1.0))
        d, n = self.decay, self.bins
        self._seen = self._seen * d + np.bincount(b, minlength=n)
        self._accepted = self._accepted * d + np.bincount(b, weights=np.asarray(accepted, dtype=np.float64),
                                                          minlength=n)
        self._log_p = self._log_p * d + np.bincount(b, weights=np.log(np.maximum(p, 1e-9)), minlength=n)
        self._gamma, self._lists = None, None
        self.changes += 1

    def settle(self) -> None:
        """Compute now what the next ``ranked`` would compute first (the exponent, the bins as lists): for a
        thread that learns while another chooses."""
        self._bin_lists()
        _ = self.gamma

    def _bin_lists(self) -> tuple[list[float], list[float]]:
        """The bins' (seen, accepted) counts as lists, kept until the next ``observe``."""
        if self._lists is None:
            self._lists = (self._seen.tolist(), self._accepted.tolist())
        return self._lists

    @property
    def gamma(self) -> float:
        """The exponent of the power law fitted to every bin (1: the estimates stand)."""
        if self._gamma is None:
            self._gamma = self._last_gamma = self._fit_gamma()
        return self._gamma

    def _fit_gamma(self) -> float:
        """The gamma in ``GAMMA_RANGE`` whose predicted acceptance ``sum(n * exp(gamma * mean ln p))`` over the bins
        equals the accepted count (a bound where none does).

        The prediction falls as gamma grows and is convex in it (every ln p <= 0), so Newton's method climbs to the
        root from below without overshooting, and a step from above lands below it: a few steps from the last fit,
        instead of bisecting.
        """
        seen = float(self._seen.sum())
        if seen < 8.0:
            return 1.0
        accepted = float(self._accepted.sum())
        used = self._seen > 1e-9
        ns = self._seen[used]
        ms = self._log_p[used] / ns
        lo, hi = GAMMA_RANGE
        gamma = min(max(self._last_gamma, lo), hi)
        for _ in range(100):
            terms = ns * np.exp(gamma * ms)
            excess = float(terms.sum()) - accepted
            slope = float(terms @ ms)
            if slope >= 0.0:  # every estimate at 1: the prediction does not move
                return hi if excess > 0.0 else lo
            step = -excess / slope
            if excess > 0.0:  # below the root
                if gamma >= hi:
                    return hi
                if step <= 1e-13 * gamma:
                    return gamma
                gamma = min(gamma + step, hi)
            elif gamma <= lo:
                return lo
            else:  # above the root (or on it): one step lands below it
                if -step <= 1e-13 * gamma:
                    return gamma
                gamma = max(gamma + step, lo)
        return gamma

    def _values(self, p: np.ndarray) -> np.ndarray:
        """Calibrated values of estimates ``p`` (any shape), each mapped on its own."""
        p = np.fmin(np.fmax(p, 0.0), 1.0)  # NaN: 0
        b = self._bins_of(p)
        return (self._accepted[b] + self.prior * p ** self.gamma) / (self._seen[b] + self.prior)

    def __call__(self, p: float) -> float:
        """The calibrated probability for estimate ``p``."""
        return float(self._values(np.asarray([float(p)]))[0])

    def calibrate(self, probs: Sequence[float]) -> list[float]:
        """Calibrated probabilities of a tree's nodes, each mapped on its own."""
        return self._values(np.asarray(probs, dtype=np.float64)).tolist() if len(probs) else []

    def calibrate_chain(self, probs: Sequence[float]) -> list[float]:
        """Calibrated probabilities of a chain's tokens, kept non-increasing along it (a token is accepted only
        after every token before it)."""
        if not len(probs):
            return []
        return np.minimum.accumulate(self._values(np.asarray(probs, dtype=np.float64))).tolist()

    def ranked(self, chains: Sequence[Sequence[float]], limit: int) -> list[tuple[float, int, int]]:
        """Every chain's first ``limit`` tokens, calibrated as ``calibrate_chain`` does, as ``(-value, chain,
        position)`` sorted: best first, then by chain and position (so a chain's tokens come in order). In Python:
        for a few dozen tokens it is faster than ``ranked_arrays``."""
        out: list[tuple[float, int, int]] = []
        for r, probs in enumerate(chains):
            out += [(-q, r, j) for j, q in enumerate(self.ranked_chain(probs, limit))]
        out.sort()
        return out

    def ranked_chain(self, probs: Sequence[float], limit: int) -> list[float]:
        """One chain's values as ``ranked`` gives them (its first ``limit`` tokens, in order)."""
        gamma, prior = self.gamma, self.prior
        seen, took = self._bin_lists()
        last, width, log = self.bins - 1, self.bin_width, math.log
        out: list[float] = []
        q_last = 2.0
        for p in probs[:max(limit, 0)]:
            p = min(max(float(p), 0.0), 1.0)
            b = last if p <= 0.0 else min(last, int(-log(p) / width))
            q = (took[b] + prior * p ** gamma) / (seen[b] + prior)
            if q > q_last:
                q = q_last
            out.append(q)
            q_last = q
        return out

    def ranked_arrays(self, chains: Sequence[Sequence[float]], limit: int) -> tuple[np.ndarray, np.ndarray]:
        """``ranked`` with numpy, for many tokens at once.

        Returns:
            ``(values, chain)``: the calibrated values best first, and the chain each belongs to.
        """
        lengths = np.fromiter((min(len(c), limit) for c in chains), dtype=np.intp, count=len(chains))
        width = int(lengths.max()) if len(chains) else 0
        grid = np.ones((len(chains), width))
        for r, (c, n) in enumerate(zip(chains, lengths.tolist(), strict=True)):
            if n:
                grid[r, :n] = c[:n]
        values = np.minimum.accumulate(self._values(grid), axis=1)
        taken = np.arange(width) < lengths[:, None]
        rows = np.nonzero(taken)[0]  # row-major: by chain, then position
        flat = values[taken]
        order = np.argsort(-flat, kind="stable")
        return flat[order], rows[order]


class VerifyBudget:
    """How many nodes each step verifies: the cost curve, the calibration and cheap exploration, in one place.

    Args:
        curve: step time against nodes (a new one learns from ``observe``).
        calibration: maps estimates to observed acceptance (a new one learns from ``observe``).
        probe_every: after this many steps in a row that verified nothing though a draft was offered, verify the
            draft's best node once, so the calibration keeps learning whether drafts became worth it; each probe
            that is not accepted doubles the wait (up to ``max_probe_every``), an accepted one resets it.
        growth: a step verifies at most ``growth`` times the largest size measured (plus 2), so the curve is
            explored from cheap sizes upwards instead of paying for an unmeasured huge step.
        min_nodes: verify at least this many nodes (0 lets drafting switch off).
        refresh_every: after this many drafted steps in a row, ``choose`` takes one plain step (with ``min_nodes``
            0), so the plain step's time is measured again: a first plain step measured cold (or under a load that
            has gone) would otherwise make every drafted step look cheap for good, since the plain size is never
            chosen again while drafting seems to pay.
    """

    def __init__(self, curve: StepCostCurve | None = None, calibration: AcceptanceCalibration | None = None,
                 probe_every: int = 16, growth: float = 2.0, min_nodes: int = 0, max_probe_every: int = 64,
                 refresh_every: int = 64) -> None:
        if probe_every < 1 or growth < 1.0 or min_nodes < 0 or max_probe_every < probe_every or refresh_every < 1:
            raise ValueError(f"need probe_every >= 1, growth >= 1, min_nodes >= 0, max_probe_every >= probe_every, "
                             f"refresh_every >= 1; got {probe_every}, {growth}, {min_nodes}, {max_probe_every}, "
                             f"{refresh_every}")
        self.curve = curve if curve is not None else StepCostCurve()
        self.calibration = calibration if calibration is not None else AcceptanceCalibration()
        self.probe_every, self.growth, self.min_nodes = probe_every, float(growth), min_nodes
        self.max_probe_every, self.refresh_every = max_probe_every, refresh_every
        self._drafted = 0  # steps in a row that verified nodes (``choose``)
        self._refreshing = False  # the last choice was a plain step to re-measure the plain step
        self._idle = 0  # steps in a row that verified nothing though a draft was offered
        self._wait = probe_every  # idle steps before the next probe
        self._probing = False  # the last choice was a probe
        self._off = False  # drafting does not pay: only probes ask for drafts
        self._last_base = -1  # the query tokens of the last ``choose_batch`` without drafts (-1: none yet)
        # choices of one chain made ahead (``prepare``): (the curve's and calibration's ``changes`` they were made
        # at, {(estimates, limit, base tokens): tokens to verify})
        self._ahead: tuple[tuple[int, int], dict[tuple[tuple[float, ...], int, int], int]] = ((-1, -1), {})

    def wants_draft(self) -> bool:
        """Whether the next step should ask for a draft at all: not while drafting is off between probes, so a
        machine where nothing pays does not also pay a draft request every step."""
        return not self._off or self._idle + 1 >= self._wait

    def skip(self) -> None:
        """Count a step taken without asking for a draft (``wants_draft`` said no)."""
        self._idle += 1

    def explore_limit(self) -> int:
        """The most nodes a step may verify now (sizes grow from the largest measured one)."""
        largest = self.curve.largest_measured()
        return 2 if largest < 0 else int(self.growth * largest) + 2

    def choose(self, probs: Sequence[float], limit: int | None = None, parents: Sequence[int] | None = None) -> int:
        """How many leading nodes of a best-first tree with estimates ``probs`` to verify.

        Args:
            probs: (n,) the drafter's acceptance estimates, in tree order.
            limit: verify at most this many (the engine's own cap).
            parents: (n,) the tree's parents; given, the calibrated values are made consistent with the tree
                (``consistent_tree``); without, the nodes are taken as one chain.
        """
        cap = min(len(probs), self.explore_limit() if limit is None else min(limit, self.explore_limit()))
        if not self.curve.measured:
            return min(cap, self.min_nodes)  # the first step measures t(0) (or the minimum asked for)
        values = (consistent_tree(self.calibration.calibrate(probs[:cap]), parents[:cap]) if parents is not None
                  else self.calibration.calibrate_chain(probs[:cap]))
        n = best_prefix(values, self.curve, self.min_nodes, cap)
        self._probing = False
        if n == 0 and (cap > 0 or self._off):  # an empty draft while drafting is off counts as idle too
            self._idle, self._off = self._idle + 1, True
            if self._idle >= self._wait and cap > 0:
                self._idle, self._probing = 0, True
                return 1
        elif n:
            self._idle, self._wait, self._off = 0, self.probe_every, False
            self._drafted += 1
            if self._drafted > self.refresh_every and self.min_nodes == 0:  # re-measure the plain step
                self._drafted, self._refreshing = 0, True
                return 0
        if n == 0:
            self._drafted = 0
        return n

    def choose_batch(self, chains: Sequence[Sequence[float]], limit: int, base_tokens: int | None = None) -> list[int]:
        """How many tokens of each request's chain one batched step verifies.

        The step's time is the curve at ``base_tokens`` plus the draft tokens; tokens are taken best first across
        requests (calibrated, each chain's estimates made non-increasing, so a request's tokens come in order)
        while the batch's expected tokens per second grows.

        Args:
            chains: per request, (k_i,) acceptance estimates of its chain's tokens in order.
            limit: most tokens per request.
            base_tokens: query tokens the step has without drafts (one per row; default: one per chain).

        Returns:
            per request, how many leading tokens to verify.
        """
        base = len(chains) if base_tokens is None else base_tokens
        if len(chains) == 1:  # first a choice made ahead (``prepare``), which only a measured curve makes
            n = self._made_ahead(chains[0], limit, base)
            if n is not None:
                self._last_base = base
                return [n]
        if not self.curve.measured:
            return [min(len(c), limit, self.min_nodes) for c in chains]
        self._last_base = base
        if len(chains) == 1:
            return [self._choose_one(chains[0], min(limit, self.explore_limit() - base), base)]
        cap = self.explore_limit() - base
        if sum(min(len(c), limit) for c in chains) >= VECTOR_FROM:
            return self._choose_many(chains, limit, base, cap)
        taken = [0] * len(chains)
        candidates = self.calibration.ranked(chains, limit)
        seconds = self.curve.seconds_from(base, 1 + max(0, min(cap, len(candidates))))  # [n]: base + n tokens
        expected, total = float(base), 0
        best_rate = expected / seconds[0]
        best_total = 0
        order: list[int] = []
        for neg_p, r, j in candidates:
            if total >= cap:
                break
            if j != taken[r]:  # a chain's tokens only in order
                continue
            taken[r] += 1
            order.append(r)
            expected -= neg_p
            total += 1
            rate = expected / seconds[total]
            if rate > best_rate:
                best_rate, best_total = rate, total
        out = [0] * len(chains)
        for r in order[:best_total]:
            out[r] += 1
        return out

    def _made_ahead(self, probs: Sequence[float], limit: int, base: int) -> int | None:
        """The choice ``prepare`` made ahead for one chain, while the budget has not learnt since (None: none)."""
        stamp, ahead = self._ahead
        if stamp[0] == self.curve.changes and stamp[1] == self.calibration.changes:
            return ahead.get((tuple(probs), limit, base))
        return None

    def _choose_one(self, probs: Sequence[float], limit: int, base: int) -> int:
        """``choose_batch`` of one chain (the same choice): its calibrated tokens come in order already."""
        values = self.calibration.ranked_chain(probs, limit)
        seconds = self.curve.seconds_from(base, 1 + len(values))  # [n]: base + n tokens
        expected = float(base)
        best_rate, best = expected / seconds[0], 0
        for n, q in enumerate(values, 1):
            expected += q
            rate = expected / seconds[n]
            if rate > best_rate:
                best_rate, best = rate, n
        return best

    def prepare(self, chains: Sequence[Sequence[float]] = (), limit: int = 0, base_tokens: int = 1) -> None:
        """Compute now what the next ``choose_batch`` of as many rows as the last one reads first (for a thread
        that learns while another chooses): the calibration's exponent and the step times it compares.

        With ``chains``, also choose now for each of them as ``choose_batch([chain], limit, base_tokens)`` would:
        such a call is then a lookup, until the budget learns again (a batch of one request, whose next chain is
        one of a few the drafts already hold).
        """
        self.calibration.settle()
        if self._last_base >= 0 and self.curve.measured:
            self.curve.seconds_from(self._last_base, 1 + max(0, min(VECTOR_FROM, self.explore_limit()
                                                                     - self._last_base)))
        if chains and self.curve.measured:
            cap = min(limit, self.explore_limit() - base_tokens)
            ahead = {(tuple(c), limit, base_tokens): self._choose_one(c, cap, base_tokens) for c in chains}
            self._ahead = ((self.curve.changes, self.calibration.changes), ahead)

    def _choose_many(self, chains: Sequence[Sequence[float]], limit: int, base: int, cap: int) -> list[int]:
        """``choose_batch`` for many tokens, with numpy (the same choices). Ranked best first with ties by chain
        and position, a chain's tokens already come in order."""
        values, chain = self.calibration.ranked_arrays(chains, limit)
        n = max(0, min(cap, len(values)))
        expected = np.cumsum(np.concatenate(([float(base)], values[:n])))[1:]  # summed in order, as one by one
        rates = expected / self.curve.seconds_array(base + 1, n)
        best = int(np.argmax(rates)) if n else 0
        best_total = best + 1 if n and rates[best] > base / self.curve.seconds(base) else 0
        return np.bincount(chain[:best_total], minlength=len(chains)).tolist()

    def observe(self, nodes: int, seconds: float, probs: Sequence[float] = (),
                accepted: Sequence[bool] = ()) -> None:
        """Record one verification step: ``nodes`` verified in ``seconds``; with ``probs`` and ``accepted`` (one
        per verified node: the drafter's estimate and whether it was accepted) the calibration learns too."""
        if self._refreshing and nodes == 0:  # a re-measured plain step outweighs the old ones, however stale
            self.curve.forget(0, REFRESH_KEEP)
        self._refreshing = False
        self.curve.observe(nodes, seconds)
        if len(probs):
            self.calibration.observe(probs, accepted)
        if self._probing:  # an accepted probe: drafts are asked for again, and the next probe comes sooner
            self._off = not any(accepted)
            self._wait = self.probe_every if any(accepted) else min(2 * self._wait, self.max_probe_every)
            self._probing = False

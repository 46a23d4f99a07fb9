"""Choosing how many draft nodes to verify: the learned cost curve, calibration, exploration, and the rule's
outcome on simulated machines (flat like a GPU, steep like a CPU without native bfloat16)."""

import math
import random

import numpy as np
import pytest

from drafter_service.api.verify_budget import (
    GAMMA_RANGE,
    AcceptanceCalibration,
    StepCostCurve,
    VerifyBudget,
    best_prefix,
    consistent_tree,
)


def piecewise(points):
    """t(n) through (nodes, seconds) points, linear between them and past the last."""
    def t(n):
        for (n0, t0), (n1, t1) in zip(points, points[1:], strict=False):
            if n <= n1:
                return t0 + (t1 - t0) * (n - n0) / (n1 - n0)
        (n0, t0), (n1, t1) = points[-2], points[-1]
        return t1 + (t1 - t0) * (n - n1) / (n1 - n0)
    return t


# Forward passes of SmolLM2-135M on a 256-token cache, 2 threads, by query tokens (1 + nodes), measured on a 2-core
# AVX2-only CPU: bfloat16 is emulated there, so every node costs about a third of a plain step.
CPU_BF16 = piecewise([(0, 0.087), (7, 0.276), (31, 0.962)])
CPU_F32 = piecewise([(0, 0.095), (7, 0.176), (31, 0.362)])
GPU_FLAT = piecewise([(0, 0.010), (64, 0.0105), (256, 0.014)])


def test_curve_interpolates_measured_points_and_extrapolates_the_last_slope():
    curve = StepCostCurve(decay=1.0)
    assert not curve.measured and curve.seconds(8) == 0.0
    for n in (0, 4, 8, 16):
        curve.observe(n, CPU_F32(n))
    assert curve.seconds(4) == pytest.approx(CPU_F32(4))
    assert curve.seconds(6) == pytest.approx((CPU_F32(4) + CPU_F32(8)) / 2)
    assert curve.seconds(32) == pytest.approx(CPU_F32(16))  # not measured: optimistic
    assert curve.plain_seconds() == pytest.approx(CPU_F32(0))


def test_curve_follows_new_times_and_stays_non_decreasing():
    curve = StepCostCurve(decay=0.5)
    for _ in range(20):
        curve.observe(0, 0.100)
        curve.observe(8, 0.200)
    for _ in range(20):
        curve.observe(0, 0.050)  # the machine got faster for plain steps
    assert curve.seconds(0) == pytest.approx(0.050, rel=1e-3)
    curve.observe(16, 0.150)  # noise below a smaller size's time: kept non-decreasing
    assert curve.seconds(16) >= curve.seconds(8)


def test_one_slow_step_moves_the_curve_a_bounded_amount_and_a_lasting_change_is_followed():
    curve = StepCostCurve(decay=0.9)
    for _ in range(20):
        curve.observe(4, 0.100)
    curve.observe(4, 5.0)  # a pause: counted as twice the mean
    assert curve.seconds(4) == pytest.approx(0.110, rel=0.02)
    for _ in range(40):
        curve.observe(4, 0.300)  # the machine got slower: followed
    assert curve.seconds(4) == pytest.approx(0.300, rel=0.02)
    fresh = StepCostCurve(decay=0.9)
    fresh.observe(8, 1.0)  # a bucket's first steps are taken as they come
    assert fresh.seconds(8) == pytest.approx(1.0)


def test_past_the_largest_measured_size_the_estimate_is_optimistic():
    curve = StepCostCurve()
    curve.observe(0, 0.1)
    assert curve.seconds(10) == pytest.approx(0.1)
    curve.observe(4, 0.3)
    assert curve.seconds(2) == pytest.approx(0.2) and curve.seconds(40) == pytest.approx(0.3)


def test_curve_from_points_round_trips_and_refuses_bad_points():
    curve = StepCostCurve(decay=1.0)
    for n in (0, 1, 3, 9, 40):
        curve.observe(n, CPU_BF16(n))
    again = StepCostCurve.from_points(*zip(*curve.points(), strict=True))
    assert [x for p in again.points() for x in p] == pytest.approx([x for p in curve.points() for x in p])
    with pytest.raises(ValueError):
        StepCostCurve.from_points([0, 1], [0.1])
    with pytest.raises(ValueError):
        StepCostCurve.from_points([0], [0.0])


@pytest.mark.parametrize("probs, t, expected", [
    ([0.9, 0.8, 0.7, 0.05, 0.01], lambda n: 1.0 + 0.1 * n, 3),   # (1 + 2.4) / 1.3 beats every other prefix
    ([0.9, 0.8, 0.7, 0.05, 0.01], lambda n: 1.0, 5),             # free nodes: keep them all
    ([0.01, 0.01], lambda n: 1.0 + 0.1 * n, 0),                  # not worth a node: a plain step
])
def test_best_prefix_maximises_expected_tokens_per_second(probs, t, expected):
    curve = StepCostCurve(decay=1.0)
    for n in range(8):
        curve.observe(n, t(n))
    assert best_prefix(probs, curve) == expected


def test_best_prefix_keeps_the_minimum_and_the_tree_before_any_measurement():
    curve = StepCostCurve()
    assert best_prefix([0.01, 0.01], curve) == 2
    for n in range(4):
        curve.observe(n, 1.0 + 0.5 * n)
    assert best_prefix([0.01, 0.01, 0.01], curve, min_nodes=2) == 2
    assert best_prefix([0.9, 0.9, 0.9], curve, max_nodes=1) <= 1


def test_calibration_learns_that_a_source_is_overconfident():
    cal = AcceptanceCalibration(prior=4.0, decay=1.0)
    assert cal(0.85) == pytest.approx(0.85)  # no evidence: the estimate stands
    rng = random.Random(0)
    for _ in range(400):
        cal.observe([0.85], [rng.random() < 0.3])
    assert cal(0.85) == pytest.approx(0.3, abs=0.06)
    assert cal(0.15) < 0.15  # other bins follow the power law fitted to the evidence
    assert cal.gamma > 1.0
    assert cal.calibrate_chain([0.85, 0.95]) == [cal(0.85), min(cal(0.95), cal(0.85))]


def test_the_first_step_is_plain_and_sizes_grow_from_there():
    budget = VerifyBudget()
    sure = [0.99] * 64
    assert budget.choose(sure) == 0  # measures t(0) first
    budget.observe(0, 0.1)
    assert budget.choose(sure) == 2  # the largest size seen is 0: at most 2 nodes
    budget.observe(2, 0.1)
    assert budget.choose(sure) == 6  # at most twice the largest seen, plus 2
    budget.observe(6, 0.1)
    assert budget.choose(sure, limit=10) == 10


def test_a_probe_node_now_and_then_while_drafting_does_not_pay():
    budget = VerifyBudget(probe_every=4, max_probe_every=8)
    for n in range(4):
        budget.observe(n, 0.1 * (1 + n))  # every node doubles the step: nothing at 0.3 pays
    choices = []
    for _ in range(24):
        choices.append(budget.choose([0.3, 0.2]))
        budget.observe(choices[-1], 0.1 * (1 + choices[-1]), [0.3][:choices[-1]], [False][:choices[-1]])
    # the 4th step in a row without a node is a probe; it failed, so the next comes at the 8th, and so on (the cap)
    assert [i for i, c in enumerate(choices) if c] == [3, 3 + 8, 3 + 16]


def test_no_draft_is_asked_for_between_probes_while_drafting_is_off():
    budget = VerifyBudget(probe_every=4, max_probe_every=4)
    for n in range(4):
        budget.observe(n, 0.1 * (1 + n))
    asked = []
    for step in range(12):
        if budget.wants_draft():
            asked.append(step)
            n = budget.choose([0.3])
            budget.observe(n, 0.1 * (1 + n), [0.3][:n], [False][:n])
        else:
            budget.skip()
    assert asked == [0, 3, 7, 11]  # the first idle step, then only the probes (every 4th step)


def test_batch_takes_each_chain_in_order_and_only_what_pays():
    steep = VerifyBudget()
    for n in range(0, 40, 4):
        steep.observe(n, CPU_BF16(n))
    chains = [[0.95, 0.9, 0.5, 0.1], [0.3, 0.2], [0.99, 0.98, 0.97, 0.96]]
    out = steep.choose_batch(chains, limit=4)
    assert all(0 <= k <= len(c) for k, c in zip(out, chains, strict=True))
    assert out[2] >= out[0] >= out[1] == 0  # the surest tokens first; a weak chain gets nothing
    flat = VerifyBudget()
    for n in range(0, 40, 4):
        flat.observe(n, GPU_FLAT(n))
    assert flat.choose_batch(chains, limit=3) == [3, 2, 3]  # nodes are free: every token up to the limit


# -- the rule on simulated machines ----------------------------------------------------------------------------


def simulate(t, true_q, est_q, choose, steps=1500, seed=0, depth=64):
    """Tokens per second of an engine whose drafts are chains of ``depth`` nodes, each accepted with probability
    ``true_q`` given its parent was, while the drafter estimates ``est_q``; ``choose(probs)`` gives the nodes to
    verify, and gets told (nodes, seconds, probs, accepted) after each step through ``choose.observe``."""
    rng = random.Random(seed)
    probs = [est_q ** (d + 1) for d in range(depth)]
    tokens = seconds = 0.0
    for _ in range(steps):
        n = choose(probs)
        accepted = 0
        while accepted < n and rng.random() < true_q:
            accepted += 1
        step = t(n) * rng.uniform(0.95, 1.05)
        tokens += 1 + accepted
        seconds += step
        observe = getattr(choose, "observe", None)
        if observe is not None:
            observe(n, step, probs[:n], [i < accepted for i in range(n)])
    return tokens / seconds


class Policy:
    def __init__(self):
        self.budget = VerifyBudget()

    def __call__(self, probs):
        return self.budget.choose(probs)

    def observe(self, n, step, probs, accepted):
        self.budget.observe(n, step, probs, accepted)


FIXED = (0, 1, 2, 4, 8, 16, 32, 64)


@pytest.mark.parametrize("machine", [CPU_BF16, CPU_F32, GPU_FLAT], ids=["cpu-bf16", "cpu-f32", "gpu-flat"])
@pytest.mark.parametrize("true_q, est_q", [
    (0.0, 0.0),    # nothing ever matches (random tokens) and the drafter knows
    (0.0, 0.8),    # nothing ever matches but the drafter is confident
    (0.8, 0.8),    # repetitive workload, honest estimates
    (0.5, 0.9),    # overconfident drafter
    (0.9, 0.6),    # underconfident drafter
])
def test_never_slower_than_plain_and_close_to_the_best_fixed_budget(machine, true_q, est_q):
    ours = simulate(machine, true_q, est_q, Policy())
    fixed = {n: simulate(machine, true_q, est_q, lambda probs, n=n: min(n, len(probs))) for n in FIXED}
    assert ours >= 0.97 * fixed[0]
    assert ours >= 0.95 * max(fixed.values())


def test_calibrated_trees_stay_consistent_siblings_share_their_parent():
    # root -> a (0.5) -> c (0.45), root -> b (0.45), a -> d (0.3): lifted by a power law, then made consistent
    parents = [-1, -1, 0, 0]
    lifted = [p ** 0.25 for p in (0.5, 0.45, 0.45, 0.3)]
    out = consistent_tree(lifted, parents)
    assert out[0] + out[1] == pytest.approx(1.0)  # two children of the root: at most one is accepted
    assert out[2] + out[3] <= out[0] + 1e-12 and out[2] / out[3] == pytest.approx(lifted[2] / lifted[3])
    assert consistent_tree([0.9, 0.8], [-1, 0]) == [0.9, 0.8]  # already consistent: unchanged


def test_one_slow_step_at_a_small_size_does_not_flatten_the_curve():
    curve = StepCostCurve(decay=0.9)
    for _ in range(30):
        for n in (16, 32, 64):
            curve.observe(n, 0.2 + 0.01 * n)
    curve.observe(1, 0.8)  # a step timed across an idle engine
    times = [t for _, t in curve.points()]
    assert times == sorted(times)
    assert curve.seconds(64) - curve.seconds(16) > 0.4  # the slope is still there
    assert curve.seconds(1) < 0.5


def test_the_fitted_gamma_is_the_root_of_the_calibration_equation_within_its_range():
    """Newton's method from the last fit finds the gamma whose predicted acceptance equals the accepted count (the
    bisection it replaced, to 1e-9), or the range's bound where none does."""
    rng = np.random.default_rng(5)
    for q in (0.2, 0.7, 1.0, 1.6, 3.0, 9.0):
        cal = AcceptanceCalibration()
        for _ in range(30):
            probs = rng.uniform(0.02, 1.0, 12)
            cal.observe(probs.tolist(), (rng.uniform(size=12) < probs ** q).tolist())
            means = [(n, lp / n) for n, lp in zip(cal._seen, cal._log_p, strict=True) if n > 1e-9]
            lo, hi = GAMMA_RANGE
            for _ in range(60):
                mid = math.sqrt(lo * hi)
                if sum(n * math.exp(mid * m) for n, m in means) > sum(cal._accepted):
                    lo = mid
                else:
                    hi = mid
            assert cal.gamma == pytest.approx(math.sqrt(lo * hi), rel=1e-9)


def test_a_run_of_step_times_is_the_curve_at_each_size():
    curve = StepCostCurve()
    assert curve.seconds_run(3, 4) == [0.0] * 4
    for n, t in ((0, 0.010), (4, 0.012), (16, 0.020), (64, 0.050)):
        curve.observe(n, t)
    for first, count in ((0, 80), (5, 3), (63, 4), (100, 2), (2, 0)):
        assert curve.seconds_run(first, count) == [curve.seconds(n) for n in range(first, first + count)]


#: How far the numpy path's calibrated values may lie from the Python loop's: numpy's vectorized ``power`` (AVX-512
#: builds) differs from the C library's ``pow`` by an ulp or so, which changes no choice (ties come from equal
#: estimates, which each path maps alike).
NUMPY_ULPS = 1e-14


def test_ranked_tokens_are_each_chain_calibrated_best_first():
    rng = np.random.default_rng(6)
    cal = AcceptanceCalibration()
    cal.observe(rng.uniform(0.05, 1.0, 40).tolist(), (rng.uniform(size=40) < 0.4).tolist())
    chains = [np.cumprod(rng.uniform(0.3, 1.0, k)).tolist() for k in (0, 3, 8, 8, 5)] + [[1.0, 1.0, 0.5]]
    expected = sorted((-q, r, j) for r, c in enumerate(chains) for j, q in enumerate(cal.calibrate_chain(c[:6])))
    got = cal.ranked(chains, 6)
    assert [(r, j) for _, r, j in got] == [(r, j) for _, r, j in expected]
    assert [q for q, _, _ in got] == pytest.approx([q for q, _, _ in expected], rel=NUMPY_ULPS, abs=0)


def random_budget(rng: random.Random, trial: int, sizes: int, steps: int, outcomes: int) -> VerifyBudget:
    """A budget that saw a few steps of sizes below ``sizes`` on a CPU-like or GPU-like curve (by ``trial``) and
    ``outcomes`` random outcomes."""
    budget = VerifyBudget()
    machine = (CPU_BF16, GPU_FLAT)[trial % 2]
    for n in rng.sample(range(0, sizes), rng.randrange(1, steps)):
        budget.observe(n, machine(n) * rng.uniform(0.9, 1.1))
    budget.calibration.observe([rng.random() for _ in range(outcomes)], [rng.random() < 0.5 for _ in range(outcomes)])
    return budget


def test_a_large_batch_is_ranked_and_cut_with_numpy_as_the_loop_does(monkeypatch):
    """``choose_batch`` takes numpy from ``VECTOR_FROM`` chain tokens on; both ways make the same choices, ties and
    caps included."""
    import drafter_service.api.verify_budget as vb
    rng = random.Random(8)
    for trial in range(60):
        budget = random_budget(rng, trial, 300, 12, 80)
        chains = [[rng.choice((0.0, 0.25, 0.5, 1.0, rng.random())) for _ in range(rng.randrange(0, 10))]
                  for _ in range(rng.randrange(0, 40))]
        limit, base = rng.randrange(1, 9), rng.choice((None, 1, 7, 40))
        monkeypatch.setattr(vb, "VECTOR_FROM", 10 ** 9)
        loop = budget.choose_batch(chains, limit, base)
        monkeypatch.setattr(vb, "VECTOR_FROM", 0)
        assert budget.choose_batch(chains, limit, base) == loop
        values, chain = budget.calibration.ranked_arrays(chains, limit)
        ranked = budget.calibration.ranked(chains, limit)
        assert chain.tolist() == [r for _, r, _ in ranked]
        assert values.tolist() == pytest.approx([-q for q, _, _ in ranked], rel=NUMPY_ULPS, abs=0)


def test_one_chain_is_cut_as_the_batch_loop_cuts_it():
    """A batch of one row (the engine's B = 1) takes a shorter way; its choices are the general loop's (the same
    chain beside an empty one), with the times prepared ahead or not."""
    rng = random.Random(9)
    for trial in range(80):
        budget = random_budget(rng, trial, 40, 8, 60)
        chain = [rng.choice((0.0, 0.25, 0.5, 1.0, rng.random())) for _ in range(rng.randrange(0, 10))]
        limit, base = rng.randrange(1, 9), rng.choice((None, 1, 3, 30))
        two_rows = budget.choose_batch([chain, []], limit, base if base is not None else 1)
        if trial % 3 == 0:
            budget.prepare()
        assert budget.choose_batch([chain], limit, base) == two_rows[:1]


def test_chains_chosen_ahead_are_chosen_as_then_and_not_after_the_budget_learns(monkeypatch):
    """``prepare(chains, ...)`` chooses for those chains ahead; a one-row ``choose_batch`` of one of them is then a
    lookup with the same answer, and once the curve or the calibration learns, it is chosen afresh."""
    rng = random.Random(12)
    for trial in range(40):
        budget = random_budget(rng, trial, 40, 8, 60)
        chains = [[rng.choice((0.0, 0.25, 0.5, 1.0, rng.random())) for _ in range(rng.randrange(1, 9))]
                  for _ in range(6)]
        limit, base = rng.randrange(1, 9), rng.choice((1, 3))
        budget.prepare(chains, limit, base)
        fresh = VerifyBudget(budget.curve, budget.calibration)
        for chain in chains:
            assert budget.choose_batch([list(chain)], limit, base) == fresh.choose_batch([chain], limit, base)
        chose: list[tuple] = []  # the calls that chose rather than looked up
        monkeypatch.setattr(budget, "_choose_one", lambda *args, calls=chose: calls.append(args) or 0)
        budget.choose_batch([chains[0]], limit, base)
        assert chose == []  # answered from the choices made ahead
        budget.choose_batch([chains[0]], limit + 1, base)  # another limit: not made ahead
        assert len(chose) == 1
        if trial % 2:
            budget.observe(rng.randrange(0, 40), 0.01)
        else:
            budget.calibration.observe([0.5], [True])
        budget.choose_batch([chains[0]], limit, base)
        assert len(chose) == 2
        monkeypatch.undo()


def test_times_prepared_ahead_are_the_curve_and_are_dropped_by_the_next_step():
    curve = StepCostCurve()
    for n, t in ((0, 0.010), (4, 0.012), (16, 0.020)):
        curve.observe(n, t)
    assert curve.seconds_from(3, 5) == curve.seconds_run(3, 5)
    assert curve.seconds_from(3, 9)[:9] == curve.seconds_run(3, 9)
    assert curve.seconds_from(1, 2) == curve.seconds_run(1, 2)
    curve.observe(2, 0.5)
    assert curve.seconds_from(1, 4)[:4] == curve.seconds_run(1, 4)


def test_the_step_times_of_many_sizes_at_once_are_the_curve_at_each_size():
    curve = StepCostCurve()
    assert curve.seconds_array(3, 4).tolist() == [0.0] * 4
    curve.observe(8, 0.02)
    assert curve.seconds_array(0, 3).tolist() == [0.02] * 3
    for n, t in ((0, 0.010), (4, 0.012), (16, 0.020), (64, 0.050)):
        curve.observe(n, t)
    for first, count in ((0, 80), (5, 3), (63, 4), (100, 2), (2, 0)):
        assert curve.seconds_array(first, count).tolist() == curve.seconds_run(first, count)


def simulate_cold_first_step(refresh_every: int, steps: int = 600) -> list[int]:
    """Nodes verified per step by an engine whose plain step takes 0.1 s and each node 0.05 s more (a CPU), whose
    drafts are estimated at 0.7 but accepted at 0.36, and whose first plain step ran cold (0.3 s)."""
    rng = random.Random(11)
    budget = VerifyBudget(refresh_every=refresh_every)
    chosen = []
    for step in range(steps):
        n = budget.choose([0.7] * 8)
        accepted = []
        for _ in range(n):
            accepted.append(bool(accepted[-1:] != [False] and rng.random() < 0.36))
        budget.observe(n, (0.1 + 0.05 * n) * (3.0 if step == 0 else 1.0), [0.7] * n, accepted)
        chosen.append(n)
    return chosen


def test_a_plain_step_measured_cold_is_measured_again_so_drafts_that_do_not_pay_stop():
    # with one node at 1.5x a plain step, a node pays only when accepted more than half the time
    never = simulate_cold_first_step(refresh_every=10 ** 9)
    assert sum(n > 0 for n in never[300:]) > 250  # the cold plain step makes every draft look cheap, for good
    refreshed = simulate_cold_first_step(refresh_every=64)
    assert sum(n > 0 for n in refreshed[300:]) < 60  # only the probes and their like remain


def test_where_drafts_pay_the_plain_step_is_re_measured_once_in_a_while_only():
    budget = VerifyBudget(refresh_every=64)
    chosen = []
    for _ in range(650):
        n = budget.choose([0.95] * 8)
        budget.observe(n, GPU_FLAT(n), [0.95] * n, [True] * n)
        chosen.append(n)
    plain = [i for i, n in enumerate(chosen) if n == 0]
    assert plain[0] == 0 and 8 <= len(plain) <= 12  # the first step, then one in every 65

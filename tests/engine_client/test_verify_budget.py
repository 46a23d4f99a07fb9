"""Choosing how many draft nodes to verify: the step-time fit and the best prefix."""

import pytest

from engine_client.verify_budget import StepCostModel, best_prefix


def test_fit_recovers_a_line_from_steps_of_varied_size():
    model = StepCostModel(decay=1.0)
    for n in [0, 8, 16, 32, 64, 4, 24]:
        model.observe(n, 0.050 + 0.001 * n)
    base, per_node = model.line()
    assert base == pytest.approx(0.050, rel=1e-6) and per_node == pytest.approx(0.001, rel=1e-6)


def test_without_variety_the_prior_slope_runs_through_the_mean():
    model = StepCostModel(prior_ratio=1.5)
    assert model.line() == (0.0, 0.0)
    for _ in range(5):
        model.observe(32, 0.075)  # t(32) = 1.5 * base  =>  base 0.05, 0.5 * base / 32 per node
    base, per_node = model.line()
    assert base == pytest.approx(0.050) and per_node == pytest.approx(0.025 / 32)


def test_plain_step_time_is_the_fitted_base_once_the_steps_pin_it_down():
    model = StepCostModel(decay=1.0)
    assert model.plain_seconds() == 0.0  # nothing seen
    for _ in range(3):
        model.observe(32, 0.075)
    assert model.plain_seconds() == 0.0  # one size only: t(0) would come from the prior
    for n in [0, 8, 16]:
        model.observe(n, 0.050 + 0.001 * n)
    # least squares over (32, .075) x3, (0, .050), (8, .058), (16, .066), by hand: t(0) = mean_t - slope * mean_n
    ns, ts = [32, 32, 32, 0, 8, 16], [0.075] * 3 + [0.050, 0.058, 0.066]
    mean_n, mean_t = sum(ns) / 6, sum(ts) / 6
    slope = ((sum(n * t for n, t in zip(ns, ts, strict=True)) / 6 - mean_n * mean_t)
             / (sum(n * n for n in ns) / 6 - mean_n ** 2))
    assert model.plain_seconds() == pytest.approx(mean_t - slope * mean_n, rel=1e-9)
    assert model.plain_seconds() == model.line()[0]
    plain = StepCostModel(decay=1.0)
    for t in (0.020, 0.022):
        plain.observe(0, t)  # plain steps only: their mean
    assert plain.plain_seconds() == pytest.approx(0.021)


@pytest.mark.parametrize("probs, base, per_node, expected", [
    ([0.9, 0.8, 0.7, 0.05, 0.01], 1.0, 0.1, 3),    # (1 + 2.4) / 1.3 beats every other prefix
    ([0.9, 0.8, 0.7, 0.05, 0.01], 1.0, 0.0, 5),    # free nodes: keep them all
    ([0.01, 0.01], 1.0, 0.1, 0),                   # not worth a node
    ([0.01, 0.01], 0.0, 0.0, 2),                   # no fit yet: keep the tree
])
def test_best_prefix_maximises_expected_tokens_per_second(probs, base, per_node, expected):
    assert best_prefix(probs, base, per_node) == expected


def test_best_prefix_keeps_the_minimum():
    assert best_prefix([0.01, 0.01, 0.01], 1.0, 0.5, min_nodes=2) == 2
    assert best_prefix([0.01], 1.0, 0.5, min_nodes=4) == 1

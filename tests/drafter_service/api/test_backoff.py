"""The backoff policy and its clock: delays, cap, jitter bounds, reset."""

from __future__ import annotations

import random

import pytest

from drafter_service.api.backoff import BackoffClock, ExponentialBackoff


class FakeClock:
    """A monotonic clock moved by hand."""

    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_delays_grow_by_the_factor_up_to_the_cap():
    policy = ExponentialBackoff(base_s=0.1, cap_s=1.0)
    assert [policy.delay(a) for a in range(6)] == pytest.approx([0.1, 0.2, 0.4, 0.8, 1.0, 1.0])
    assert [ExponentialBackoff(0.5, 30.0, factor=3).delay(a) for a in range(5)] == pytest.approx(
        [0.5, 1.5, 4.5, 13.5, 30.0])
    assert [ExponentialBackoff(0.2, 0.2, factor=1).delay(a) for a in range(3)] == [0.2, 0.2, 0.2]


def test_huge_attempts_stay_at_the_cap():
    policy = ExponentialBackoff(base_s=0.05, cap_s=5.0)
    assert policy.delay(10_000) == 5.0 and policy.nominal(1 << 40) == 5.0


def test_jitter_only_shortens_a_wait_within_its_share():
    policy = ExponentialBackoff(base_s=0.1, cap_s=5.0, jitter=0.2)
    rng = random.Random(7)
    for attempt in range(12):
        nominal = policy.nominal(attempt)
        waits = [policy.delay(attempt, rng) for _ in range(200)]
        assert all(0.8 * nominal <= w <= nominal for w in waits)
        assert max(waits) - min(waits) > 0.1 * nominal  # drawn, not constant
    full = ExponentialBackoff(base_s=1.0, cap_s=1.0, jitter=1.0)
    waits = [full.delay(0, rng) for _ in range(500)]
    assert all(0.0 <= w <= 1.0 for w in waits) and min(waits) < 0.1 and max(waits) > 0.9


def test_seeded_jitter_repeats():
    policy = ExponentialBackoff(base_s=0.1, cap_s=5.0, jitter=0.5)
    assert [policy.delay(a, random.Random(3)) for a in range(5)] == [policy.delay(a, random.Random(3))
                                                                     for a in range(5)]


@pytest.mark.parametrize("kwargs", [dict(base_s=0, cap_s=1), dict(base_s=2, cap_s=1), dict(base_s=-1, cap_s=1),
                                    dict(base_s=1, cap_s=2, factor=0.5), dict(base_s=1, cap_s=2, jitter=1.5),
                                    dict(base_s=1, cap_s=2, jitter=-0.1)])
def test_bad_policies_are_refused(kwargs):
    with pytest.raises(ValueError):
        ExponentialBackoff(**kwargs)


def test_negative_attempts_are_refused():
    with pytest.raises(ValueError):
        ExponentialBackoff(0.1, 1.0).delay(-1)


def test_policy_is_frozen_and_hashable():
    policy = ExponentialBackoff(0.1, 1.0)
    with pytest.raises(AttributeError):
        policy.base_s = 1.0  # type: ignore[misc]
    assert policy == ExponentialBackoff(0.1, 1.0) and len({policy, ExponentialBackoff(0.1, 1.0)}) == 1


def test_clock_counts_failures_and_says_when_the_next_attempt_is_due():
    now = FakeClock()
    clock = BackoffClock(ExponentialBackoff(base_s=0.1, cap_s=0.4), clock=now)
    assert clock.ready() and clock.failures == 0 and clock.last_wait == 0.0 and clock.ready_at == 0.0
    waits = [clock.failure() for _ in range(4)]
    assert waits == pytest.approx([0.1, 0.2, 0.4, 0.4]) and clock.failures == 4
    assert clock.last_wait == waits[-1] and clock.ready_at == pytest.approx(100.4)
    assert not clock.ready()
    now.now += 0.39
    assert not clock.ready()
    now.now += 0.02
    assert clock.ready()


def test_reset_starts_over_from_the_base():
    now = FakeClock()
    clock = BackoffClock(ExponentialBackoff(base_s=0.05, cap_s=5.0), clock=now)
    for _ in range(6):
        clock.failure()
    assert not clock.ready() and clock.last_wait == pytest.approx(1.6)
    clock.reset()
    assert clock.ready() and clock.failures == 0 and clock.last_wait == 0.0 and clock.ready_at == 0.0
    assert clock.failure() == pytest.approx(0.05)


def test_clock_jitter_stays_in_bounds():
    now = FakeClock()
    clock = BackoffClock(ExponentialBackoff(base_s=0.1, cap_s=5.0, jitter=0.2), clock=now, rng=random.Random(1))
    for attempt in range(10):
        wait = clock.failure()
        nominal = clock.policy.nominal(attempt)
        assert 0.8 * nominal <= wait <= nominal and clock.ready_at == pytest.approx(now.now + wait)

"""The model gate: the draft model's nodes are served only while acceptance and step times say they pay."""

from __future__ import annotations

import logging

import pytest

from drafter_service.core.model_gate import ModelGate


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def drive(gate: ModelGate, clock: Clock, seconds: float, model_tokens: int, free_tokens: int,
          running_ms: float, paused_ms: float) -> list[bool]:
    """Steps of one session as an engine would make them: each step's interval depends on whether the worker runs;
    returns the worker state at every step."""
    states = []
    end = clock.now + seconds
    last_phase = -1
    while clock.now < end:
        gate.tick()
        running, phase = gate.running, gate.phase_id
        if running:
            gate.record(model_tokens, free_tokens, model_empty=False)
        step = (running_ms if running else paused_ms) / 1e3
        clock.now += step
        if phase == last_phase:
            gate.record_interval(step, running, phase)
        last_phase = phase
        states.append(running)
    return states


def test_learning_serves_nothing_and_alternates_the_worker():
    clock = Clock()
    gate = ModelGate(clock=clock, min_steps=10_000)
    states = drive(gate, clock, 4.0, 3, 1, 20, 20)
    assert not gate.serving and gate.verdict == "learning"
    share = sum(states) / len(states)
    assert 0.4 < share < 0.6  # equal running and paused phases


def test_a_model_that_adds_acceptance_at_little_cost_is_served_and_mostly_runs():
    clock = Clock()
    changes: list[bool] = []
    gate = ModelGate(clock=clock, on_running=changes.append)
    drive(gate, clock, 6.0, 3, 1, 21, 20)
    assert gate.verdict == "pays" and gate.serving
    states = drive(gate, clock, 20.0, 3, 1, 21, 20)
    assert sum(states) / len(states) > 0.85
    assert changes and set(changes) == {True, False}  # the worker was told of every change
    assert gate.figures().ratio == pytest.approx(4 / 2 * 20 / 21, rel=0.02)


def test_a_model_that_slows_the_engine_more_than_it_adds_is_not_served_and_mostly_paused(caplog):
    clock = Clock()
    gate = ModelGate(clock=clock, name="ns")
    with caplog.at_level(logging.WARNING):
        drive(gate, clock, 6.0, 2, 1, 40, 20)  # 1.5x the tokens per step, 2x the step time
    assert gate.verdict == "does not pay" and not gate.serving
    assert "namespace ns: the draft model does not pay" in caplog.text
    assert "40.0 ms while it runs against 20.0 ms" in caplog.text
    states = drive(gate, clock, 120.0, 2, 1, 40, 20)
    assert sum(states) / len(states) < 0.1  # probes only, further apart as the verdict stands


def test_a_model_whose_nodes_lose_acceptance_is_not_served_even_when_free():
    clock = Clock()
    gate = ModelGate(clock=clock)
    drive(gate, clock, 6.0, 1, 2, 20, 20)
    assert gate.verdict == "does not pay" and not gate.serving


def test_the_verdict_follows_the_machine():
    clock = Clock()
    gate = ModelGate(clock=clock, memory=100)
    drive(gate, clock, 6.0, 2, 1, 40, 20)
    assert gate.verdict == "does not pay"
    drive(gate, clock, 300.0, 2, 1, 20, 20)  # the engine moved away: the model costs nothing now
    assert gate.verdict == "pays" and gate.serving


def test_without_time_the_worker_always_runs_and_acceptance_decides():
    clock = Clock()
    gate = ModelGate(count_time=False, clock=clock)
    states = drive(gate, clock, 6.0, 2, 1, 80, 20)
    assert all(states) and gate.serving
    gate = ModelGate(count_time=False, clock=clock)
    drive(gate, clock, 6.0, 1, 1, 20, 20)
    assert not gate.serving  # equal acceptance is not worth the compute


def test_intervals_spanning_a_phase_change_do_not_count():
    clock = Clock()
    gate = ModelGate(clock=clock)
    gate.record_interval(1.0, True, gate.phase_id + 1)
    assert gate.figures().running_interval_ms == 0


def test_no_acceptance_gain_is_a_verdict_without_waiting_for_step_times():
    clock = Clock()
    gate = ModelGate(clock=clock, min_steps=20)
    for _ in range(20):
        gate.record(1, 1, model_empty=True)
    clock.now += gate.phase  # one phase: no paused interval measured yet
    gate.tick()
    assert gate.verdict == "does not pay" and not gate.serving


def test_learning_ends_when_the_engine_asks_for_too_few_drafts():
    clock = Clock()
    gate = ModelGate(clock=clock, max_learning=30.0)
    while clock.now < 20.0:  # steps, but none drafted: nothing to score
        gate.tick()
        clock.now += 0.02
    assert gate.verdict == "learning"
    while clock.now < 31.0:
        gate.tick()
        clock.now += 0.02
    assert gate.verdict == "does not pay" and not gate.serving

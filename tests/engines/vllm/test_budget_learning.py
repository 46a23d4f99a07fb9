"""The verify budget's lessons applied in the background between steps, and by the step itself when the background
has not got to them."""

import threading

from drafter_service.api.verify_budget import VerifyBudget
from engines.vllm.budget_learning import DeferredLearning


def teach(learning: DeferredLearning, step: int) -> None:
    learning.outcomes([([0.9, 0.5, 0.2], 2 if step % 2 == 0 else 1)])
    learning.step_time(2 + step % 5, 0.01 * (1 + step % 5))


def state(budget: VerifyBudget) -> tuple:
    return budget.curve.points(), budget.calibration.gamma, budget.calibration._accepted.tolist()


def test_a_step_chooses_with_every_earlier_step_lesson_and_none_of_its_own():
    direct = VerifyBudget()
    learning = DeferredLearning(VerifyBudget())
    background: threading.Thread | None = None
    for step in range(40):
        learning.catch_up()  # the background thread may or may not have applied the last step's lessons
        assert state(learning.budget) == state(direct)
        teach(learning, step)
        assert state(learning.budget) == state(direct)  # this step's lessons wait for the step's end
        if background is not None:
            background.join()
        work = learning.hand_over()
        assert work is not None
        background = threading.Thread(target=work) if step % 3 else None  # some steps' work is never run there
        if background is not None:
            background.start()
        direct.calibration.observe([0.9, 0.5, 0.2], [True, step % 2 == 0, False])
        direct.curve.observe(2 + step % 5, 0.01 * (1 + step % 5))


def test_the_work_handed_over_applies_the_lessons_and_nothing_is_handed_without_one():
    learning = DeferredLearning(VerifyBudget())
    assert learning.hand_over() is None
    teach(learning, 0)
    work = learning.hand_over()
    assert work is not None and learning.read(lambda b: not b.curve.measured)
    work()
    assert learning.read(lambda b: b.curve.points()) == [(2.0, 0.01)]
    assert learning.read(lambda b: b.calibration._seen.sum()) == 3.0
    work()  # done twice (or by a catch_up first), nothing is applied twice
    assert learning.read(lambda b: b.calibration._seen.sum()) == 3.0


def test_upcoming_chains_handed_over_with_a_step_are_chosen_ahead_once_its_lessons_are_in():
    learning = DeferredLearning(VerifyBudget())
    chains = [[0.9, 0.8, 0.3], [0.5], [0.7, 0.7]]
    teach(learning, 0)
    learning.hand_over()()
    work = learning.hand_over(lambda: (chains, 4, 1))  # no lesson this step, but chains to choose ahead
    assert work is not None
    teach(learning, 1)  # the next step's lessons are not in yet: nothing is chosen ahead with them
    learning.catch_up()
    work()
    budget = learning.budget
    fresh = VerifyBudget(budget.curve, budget.calibration)
    stamp, ahead = budget._ahead
    assert stamp == (budget.curve.changes, budget.calibration.changes)
    assert {key[0]: n for key, n in ahead.items()} == {tuple(c): fresh.choose_batch([c], 4, 1)[0] for c in chains}
    assert learning.hand_over(lambda: None) is not None  # nothing upcoming after all: the work only learns


def catches_up_while_the_lock_is_held(learning: DeferredLearning) -> bool:
    """Whether ``catch_up`` returns while another thread holds the lock (it did not need it)."""
    with learning._lock:
        caught_up = threading.Thread(target=learning.catch_up, daemon=True)
        caught_up.start()
        caught_up.join(0.2)
        returned = not caught_up.is_alive()
    caught_up.join()
    return returned


def test_a_choice_takes_the_lock_only_while_work_handed_over_is_left_to_run():
    learning = DeferredLearning(VerifyBudget())
    teach(learning, 0)
    first = learning.hand_over()
    teach(learning, 1)
    second = learning.hand_over()
    assert first is not None and second is not None
    first()  # it applies both steps' lessons, but the second step's work is still to run and would prepare
    assert not catches_up_while_the_lock_is_held(learning)
    second()
    assert catches_up_while_the_lock_is_held(learning)
    teach(learning, 2)
    assert learning.hand_over() is not None  # handed over, its work not run: the lock again
    assert not catches_up_while_the_lock_is_held(learning)

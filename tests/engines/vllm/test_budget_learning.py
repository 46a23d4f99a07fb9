"""The verify budget's lessons applied in the background between steps, and by the step itself when the background
has not got to them."""

import time

from drafter_service.api.verify_budget import VerifyBudget
from engines.vllm.budget_learning import DeferredLearning


def teach(learning: DeferredLearning, step: int) -> None:
    learning.outcomes([0.9, 0.5, 0.2], [True, step % 2 == 0, False])
    learning.step_time(2 + step % 5, 0.01 * (1 + step % 5))


def state(budget: VerifyBudget) -> tuple:
    return budget.curve.points(), budget.calibration.gamma, budget.calibration._accepted.tolist()


def test_a_step_chooses_with_every_earlier_step_lesson_and_none_of_its_own():
    direct = VerifyBudget()
    learning = DeferredLearning(VerifyBudget())
    for step in range(40):
        learning.catch_up()  # the background thread may or may not have applied the last step's lessons
        assert state(learning.budget) == state(direct)
        teach(learning, step)
        assert state(learning.budget) == state(direct)  # this step's lessons wait for the step's end
        learning.hand_over()
        direct.calibration.observe([0.9, 0.5, 0.2], [True, step % 2 == 0, False])
        direct.curve.observe(2 + step % 5, 0.01 * (1 + step % 5))
    learning.close()


def test_the_background_applies_handed_lessons_between_steps():
    learning = DeferredLearning(VerifyBudget())
    teach(learning, 0)
    learning.hand_over()
    deadline = time.monotonic() + 5.0
    while learning.read(lambda b: not b.curve.measured) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert learning.read(lambda b: b.curve.points()) == [(2.0, 0.01)]
    assert learning.read(lambda b: b.calibration._seen.sum()) == 3.0
    learning.close()

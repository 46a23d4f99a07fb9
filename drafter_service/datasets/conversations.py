"""Multi-turn conversations for SmolLM2-135M-Instruct: a question, then follow-ups on its answers, and their order.

A conversation starts with a GSM8K or HumanEval question of :mod:`drafter_service.datasets.prompts` and goes on
with the follow-ups of :data:`FOLLOW_UPS`, which make the model restate and edit its earlier answers. Each turn
is one request whose prompt is the whole conversation so far in SmolLM2's chat template, the earlier answers
included as text (as a chat client resends them), so the next turn can only be built once the earlier turn's
answer is known. :func:`replay_order` interleaves the turns of concurrent users.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from drafter_service.datasets.prompts import load_questions
from drafter_service.datasets.target_model import conversation_prompt

if TYPE_CHECKING:
    from tokenizers import Tokenizer

__all__ = ["FOLLOW_UPS", "ORDER_SEED", "USERS", "Conversation", "load_conversations", "replay_order"]

#: The user's messages after the first question, per workload: check and restate, then a variant.
FOLLOW_UPS: dict[str, tuple[str, ...]] = {
    "gsm8k": ("Check each step of your answer and give the final answer again.",
              "Now solve the same problem with every number in it doubled."),
    "humaneval": ("Add type hints and a docstring to your function.",
                  "Write unit tests for it."),
}

#: Users in a conversation at any time in :func:`replay_order`.
USERS = 16

#: Seed of :func:`replay_order`'s choice of the next user.
ORDER_SEED = 0

#: SmolLM2's ``<|im_end|>``: a generated answer ends with it unless it ran to its token limit.
_IM_END = 2


@dataclass(frozen=True)
class Conversation:
    """One scripted conversation: what the user says, turn after turn.

    Attributes:
        conversation_id: the first question's prompt id (``gsm8k-0000``, ``HumanEval/0``).
        questions: the user's messages in order; turn ``t`` (from 0) answers ``questions[t]``.
    """

    conversation_id: str
    questions: tuple[str, ...]

    def request_id(self, turn: int) -> str:
        """The request id of turn ``turn`` (from 0): ``gsm8k-0000-t1`` for the first."""
        return f"{self.conversation_id}-t{turn + 1}"

    def prompt(self, tokenizer: Tokenizer, answers: Sequence[np.ndarray]) -> np.ndarray:
        """The prompt of the turn after ``answers``: the conversation so far, ending where the next answer starts.

        Args:
            tokenizer: SmolLM2's tokenizer (answers are decoded with it and the prompt encoded).
            answers: (m_i,) int32 the model's answers to the first turns, each ending with ``<|im_end|>``
                unless it ran to its token limit (the template closes it either way).

        Returns:
            (n,) int32 the prompt's token ids.

        Raises:
            ValueError: when every turn is already answered.
        """
        if len(answers) >= len(self.questions):
            raise ValueError(f"{self.conversation_id} has {len(self.questions)} turns, all answered")
        texts = [tokenizer.decode([int(t) for t in (a[:-1] if len(a) and a[-1] == _IM_END else a)],
                                  skip_special_tokens=False) for a in answers]
        text = conversation_prompt(self.questions[:len(answers) + 1], texts)
        return np.asarray(tokenizer.encode(text).ids, dtype=np.int32)


def load_conversations(per_workload: int) -> list[Conversation]:
    """The first ``per_workload`` questions of GSM8K and of HumanEval as conversations, the two alternating.

    Questions come in source order with no length cut (as the single-turn ``smollm2-*`` sets take them, so a
    conversation's first turn is the same request there), followed by the workload's :data:`FOLLOW_UPS`.

    Returns:
        ``gsm8k-0000``, ``HumanEval/0``, ``gsm8k-0001``, ``HumanEval/1``, ... (the rest of one workload last
        when the other runs out).
    """
    by_workload = [[Conversation(pid, (question, *FOLLOW_UPS[workload]))
                    for pid, question in load_questions(workload, per_workload, max_question_tokens=None)]
                   for workload in FOLLOW_UPS]
    return [c for row in itertools.zip_longest(*by_workload) for c in row if c is not None]


def replay_order(turns: Sequence[int], users: int = USERS, seed: int = ORDER_SEED) -> list[tuple[int, int]]:
    """The order concurrent users send the turns of the conversations in, as a replay should take them.

    ``users`` users each hold one conversation at a time, taking the conversations in their order as they
    free up; the next request comes from one of the users in a conversation, drawn uniformly at random (a
    closed system whose users think for exponentially distributed times). A conversation's turns come in
    order, so every prefix of the order holds the earlier turns of each of its requests.

    Args:
        turns: the number of turns of each conversation (each >= 1).
        users: concurrent users (>= 1).
        seed: seed of the draws (the order is the same on every run).

    Returns:
        ``(conversation index, turn from 0)`` of every turn, ``sum(turns)`` in all.

    Raises:
        ValueError: on a conversation with no turn or fewer than one user.
    """
    if users < 1 or any(n < 1 for n in turns):
        raise ValueError(f"need users >= 1 and turns >= 1, got {users} users and turns {list(turns)}")
    rng = np.random.default_rng(seed)
    waiting = iter(range(len(turns)))
    active = [[c, 0] for c in (next(waiting) for _ in range(min(users, len(turns))))]  # [conversation, next turn]
    order: list[tuple[int, int]] = []
    while active:
        slot = int(rng.integers(len(active)))
        conv, turn = active[slot]
        order.append((conv, turn))
        if turn + 1 < turns[conv]:
            active[slot][1] = turn + 1
        elif (following := next(waiting, None)) is not None:
            active[slot] = [following, 0]
        else:
            active.pop(slot)
    return order

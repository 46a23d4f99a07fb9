"""Tests of the multi-turn set: prompts holding the earlier turns, the replay order, turn-by-turn generation, cache.

No model runs: a fake ``greedy_batch`` answers each prompt with a short text naming the prompt's length (some
answers stop at ``<|im_end|>``, others run to the token limit without it), so each turn's prompt depends on the
turn before; conversations, templates, tokenization, ordering and caching are the real code.
"""

from __future__ import annotations

import pathlib
from collections.abc import Callable

import numpy as np
import pytest

from drafter_service.datasets import multiturn
from drafter_service.datasets.cache import cache_dir
from drafter_service.datasets.conversations import FOLLOW_UPS, load_conversations, replay_order
from drafter_service.datasets.loaders import DATASET_NAMES, DEFAULT_LIMITS, load_dataset, read_requests, write_requests
from drafter_service.datasets.prompts import load_prompts
from drafter_service.datasets.request_files import Request
from drafter_service.datasets.target_model import chat_prompt, conversation_prompt
from drafter_service.datasets.tokenizer import load_smollm2_tokenizer

IM_END = 2
PER_WORKLOAD = 3
TOTAL = 2 * PER_WORKLOAD * 3


def _text(ids: np.ndarray) -> str:
    return load_smollm2_tokenizer().decode([int(t) for t in ids], skip_special_tokens=False)


def _fake_answer(prompt: np.ndarray, max_new_tokens: int) -> np.ndarray:
    """A short answer naming the prompt's length; prompts of even length get one cut at the limit (no end)."""
    ids = load_smollm2_tokenizer().encode(f" Answer to {len(prompt)} tokens: 4 + 4 = 8.\n").ids
    if len(prompt) % 2:
        return np.asarray([*ids[:max_new_tokens - 1], IM_END], dtype=np.int32)
    return np.asarray((ids * 4)[:max_new_tokens], dtype=np.int32)


class FakeGenerator:
    """Stands in for ``greedy_batch``; ``batches`` records the prompts of each call."""

    def __init__(self) -> None:
        self.batches: list[list[np.ndarray]] = []

    def __call__(self, _model: object, prompts: list[np.ndarray], max_new_tokens: int, eos: int = IM_END,
                 on_step: Callable[[], None] | None = None) -> list[np.ndarray]:
        assert eos == IM_END
        self.batches.append(list(prompts))
        if on_step:
            on_step()
        return [_fake_answer(p, max_new_tokens) for p in prompts]

    @property
    def generated(self) -> int:
        return sum(len(b) for b in self.batches)


def _refuse(*_args: object, **_kwargs: object) -> list[np.ndarray]:
    raise AssertionError("generated although the cache holds every request asked for")


@pytest.fixture(autouse=True)
def fake(monkeypatch: pytest.MonkeyPatch, tmp_path: pathlib.Path) -> FakeGenerator:
    """Each test: an empty cache folder, 3 conversations per workload, batches of 2, answers of at most 24 tokens."""
    monkeypatch.setenv("DRAFTER_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(multiturn, "CONVERSATIONS_PER_WORKLOAD", PER_WORKLOAD)
    monkeypatch.setattr(multiturn, "BATCH_SIZE", 2)
    monkeypatch.setattr(multiturn, "MAX_NEW_TOKENS", 24)
    monkeypatch.setattr(multiturn, "_load_model", lambda: None)
    generator = FakeGenerator()
    monkeypatch.setattr(multiturn, "greedy_batch", generator)
    return generator


def _turn(prompt: np.ndarray) -> int:
    """The turn (from 1) a prompt asks for: the user messages it holds."""
    return _text(prompt).count("<|im_start|>user\n")


def test_prompts_hold_the_earlier_turns_in_the_chat_template(fake: FakeGenerator) -> None:
    reqs = load_dataset("smollm2-multiturn")
    assert "smollm2-multiturn" in DATASET_NAMES and DEFAULT_LIMITS["smollm2-multiturn"] is None
    assert len(reqs) == TOTAL == fake.generated
    by_id = {r.request_id: r for r in reqs}
    conversations = load_conversations(PER_WORKLOAD)
    assert [c.conversation_id for c in conversations] == ["gsm8k-0000", "HumanEval/0", "gsm8k-0001", "HumanEval/1",
                                                          "gsm8k-0002", "HumanEval/2"]
    singles = {p.prompt_id: p for w in ("gsm8k", "humaneval")
               for p in load_prompts(w, PER_WORKLOAD, max_question_tokens=None)}
    for conv in conversations:
        turns = [by_id[conv.request_id(t)] for t in range(3)]
        assert [r.request_id for r in turns] == [f"{conv.conversation_id}-t{t}" for t in (1, 2, 3)]
        workload = "gsm8k" if conv.conversation_id.startswith("gsm8k") else "humaneval"
        assert conv.questions[1:] == FOLLOW_UPS[workload]
        # turn 1 is the single-turn sets' request; later turns resend every earlier answer as text
        assert np.array_equal(turns[0].prompt, singles[conv.conversation_id].token_ids)
        assert _text(turns[0].prompt) == chat_prompt(conv.questions[0])
        answers: list[str] = []
        for t, req in enumerate(turns):
            assert _text(req.prompt) == conversation_prompt(conv.questions[:t + 1], answers)
            assert np.array_equal(req.output, _fake_answer(req.prompt, 24))
            answers.append(_text(req.output).removesuffix("<|im_end|>"))
        for before, after in zip(turns, turns[1:], strict=False):
            closed = _text(before.output) if before.output[-1] == IM_END else _text(before.output) + "<|im_end|>"
            assert _text(after.prompt).startswith(_text(before.prompt) + closed + "\n<|im_start|>user\n")
    assert any(r.output[-1] != IM_END for r in reqs) and any(r.output[-1] == IM_END for r in reqs)


def test_generation_goes_turn_by_turn_in_batches(fake: FakeGenerator) -> None:
    load_dataset("smollm2-multiturn")
    turns = [{_turn(p) for p in batch} for batch in fake.batches]
    assert all(len(t) == 1 for t in turns)  # one turn per batch
    assert [t.pop() for t in turns] == [1, 1, 1, 2, 2, 2, 3, 3, 3]
    assert all(len(b) == 2 for b in fake.batches)
    for batch in fake.batches[:3]:  # within a turn, batches of similar lengths
        assert len(batch[0]) <= len(batch[1])


def test_requests_come_in_the_interleaved_replay_order() -> None:
    order = replay_order([3] * 10, users=4, seed=0)
    assert sorted(order) == [(c, t) for c in range(10) for t in range(3)]
    assert order == replay_order([3] * 10, users=4, seed=0) != replay_order([3] * 10, users=4, seed=1)
    for i, (conv, turn) in enumerate(order):  # every prefix holds the earlier turns of its requests
        assert (conv, turn - 1) in order[:i] or turn == 0
    started = [conv for conv, turn in order if turn == 0]
    assert sorted(started[:4]) == [0, 1, 2, 3]  # the first users' conversations, in any order
    assert started[4:] == list(range(4, 10))  # then the others in their order, as users free up
    for i in range(len(order)):  # never more than 4 conversations open at once
        seen = order[:i + 1]
        open_ = {c for c, _ in seen} - {c for c, t in seen if t == 2}
        assert len(open_) <= 4
    assert order.index((0, 1)) < order.index((9, 0))  # turns of different users interleave
    assert replay_order([2, 1], users=1) == [(0, 0), (0, 1), (1, 0)]  # one user: one conversation after another
    with pytest.raises(ValueError):
        replay_order([3, 0])


def test_loaded_set_follows_the_replay_order_and_limits_take_its_prefix(fake: FakeGenerator) -> None:
    conversations = load_conversations(PER_WORKLOAD)
    order = replay_order([3] * len(conversations))
    ids = [conversations[c].request_id(t) for c, t in order]
    first = load_dataset("smollm2-multiturn", limit=7)
    assert [r.request_id for r in first] == ids[:7]
    assert fake.generated == 7  # only the turns the prefix holds
    assert [r.request_id for r in load_dataset("smollm2-multiturn")] == ids
    assert load_dataset("smollm2-multiturn", limit=0) == []
    with pytest.raises(ValueError, match="limit"):
        load_dataset("smollm2-multiturn", limit=-1)
    with pytest.raises(ValueError, match="unknown data set"):
        multiturn.load_multiturn("smollm2-nope", None)


def test_cached_file_is_read_back_without_generating(fake: FakeGenerator, monkeypatch: pytest.MonkeyPatch) -> None:
    reqs = load_dataset("smollm2-multiturn")
    files = list(cache_dir().glob("outputs-smollm2-multiturn-*.jsonl"))
    assert len(files) == 1 and [r.request_id for r in read_requests(files[0])] == [r.request_id for r in reqs]
    monkeypatch.setattr(multiturn, "greedy_batch", _refuse)
    monkeypatch.setattr(multiturn, "_load_model", _refuse)
    for limit in (None, 5):
        again = load_dataset("smollm2-multiturn", limit)
        assert [r.request_id for r in again] == [r.request_id for r in reqs[:limit]]
        assert all(np.array_equal(a.prompt, b.prompt) and np.array_equal(a.output, b.output)
                   for a, b in zip(again, reqs, strict=False))


def test_partial_cache_is_extended(fake: FakeGenerator) -> None:
    first = load_dataset("smollm2-multiturn", limit=8)
    path = next(cache_dir().glob("outputs-smollm2-multiturn-*.jsonl"))
    assert len(list(read_requests(path))) == 8
    fake.batches.clear()
    everything = load_dataset("smollm2-multiturn")
    assert fake.generated == TOTAL - 8  # only the turns the cache did not hold
    assert all(np.array_equal(a.output, b.output) for a, b in zip(first, everything, strict=False))
    assert len(list(read_requests(path))) == TOTAL


def test_a_changed_answer_regenerates_the_turns_after_it(fake: FakeGenerator) -> None:
    reqs = load_dataset("smollm2-multiturn")
    path = next(cache_dir().glob("outputs-smollm2-multiturn-*.jsonl"))
    new_answer = np.asarray([*load_smollm2_tokenizer().encode("Edited answer.").ids, IM_END], dtype=np.int32)
    edited = [Request(r.request_id, r.prompt, new_answer) if r.request_id == "HumanEval/1-t1" else r for r in reqs]
    write_requests(path, edited)
    fake.batches.clear()
    again = {r.request_id: r for r in load_dataset("smollm2-multiturn")}
    assert fake.generated == 2  # turns 2 and 3 of that conversation: their prompts held the old answer
    assert np.array_equal(again["HumanEval/1-t1"].output, new_answer)
    assert "<|im_start|>assistant\nEdited answer.<|im_end|>" in _text(again["HumanEval/1-t2"].prompt)

    path.write_text('{"request_id": "gsm8k-0000-t1", "prompt": [1, 2\n')  # malformed: generated again
    fake.batches.clear()
    assert len(load_dataset("smollm2-multiturn")) == TOTAL and fake.generated == TOTAL


def test_conversation_prompt_of_one_turn_is_the_chat_prompt() -> None:
    assert conversation_prompt(["Hi?"], []) == chat_prompt("Hi?")
    assert conversation_prompt(["Hi?", "And?"], ["Hello."]).endswith(
        "<|im_start|>user\nHi?<|im_end|>\n<|im_start|>assistant\nHello.<|im_end|>\n"
        "<|im_start|>user\nAnd?<|im_end|>\n<|im_start|>assistant\n")
    for questions, answers in ((["a", "b"], []), ([], []), (["a"], ["x"])):
        with pytest.raises(ValueError, match="answers"):
            conversation_prompt(questions, answers)


def test_module_command_generates_what_is_missing_or_everything_with_fresh(
        fake: FakeGenerator, capsys: pytest.CaptureFixture[str]) -> None:
    multiturn.main(["--limit", "4"])
    assert fake.generated == 4 and "smollm2-multiturn: 4 requests" in capsys.readouterr().out
    multiturn.main(["--limit", "4"])
    assert fake.generated == 4  # all cached
    multiturn.main(["--fresh"])
    assert fake.generated == 4 + TOTAL
    assert f"smollm2-multiturn: {TOTAL} requests" in capsys.readouterr().out


def test_end_to_end_benches_take_the_recorded_prompts(fake: FakeGenerator) -> None:
    from drafter_service.bench import e2e_prompts

    reqs = load_dataset("smollm2-multiturn", limit=9)
    prompts = e2e_prompts.load_prompts("smollm2-multiturn", 4, skip=5)
    assert [p.prompt_id for p in prompts] == [r.request_id for r in reqs[5:9]]
    assert all(np.array_equal(p.token_ids, r.prompt) for p, r in zip(prompts, reqs[5:9], strict=True))

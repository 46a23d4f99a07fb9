"""Tests of the data sets of SmolLM2's own greedy answers: generation, stop at EOS, order, ids and the cache.

A tiny randomly initialised Llama stands in for SmolLM2 (only the model factory is replaced); prompts, batching,
generation and caching are the real code.
"""

from __future__ import annotations

import pathlib
from collections.abc import Iterator

import numpy as np
import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from drafter_service.datasets import model_outputs
from drafter_service.datasets.loaders import load_dataset, read_requests, write_requests
from drafter_service.datasets.prompts import load_prompts
from engines.reference.kv_cache import returned_cache, with_cache

EOS = model_outputs.EOS
MAX_NEW = 12


def _reference_greedy(model: LlamaForCausalLM, prompt: np.ndarray, max_new: int) -> list[int]:
    """Greedy decoding of one prompt, one token at a time with the KV cache (no padding, no ``generate``)."""
    ids = torch.as_tensor(prompt, dtype=torch.long)[None]
    out: list[int] = []
    past = None
    with torch.inference_mode():
        for _ in range(max_new):
            res = model(input_ids=ids, **with_cache(model, past), use_cache=True)
            past = returned_cache(res)
            token = int(res.logits[0, -1].argmax())
            out.append(token)
            if token == EOS:
                break
            ids = torch.tensor([[token]])
    return out


@pytest.fixture(scope="module")
def tiny_model() -> LlamaForCausalLM:
    """A 2-layer Llama over SmolLM2's vocabulary that says EOS where its plain self would first say some token.

    The token is the middle token of the first GSM8K prompt's answer, so answers end at different lengths
    and others run to the token limit.
    """
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=49152, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
                         tie_word_embeddings=False, bos_token_id=1, eos_token_id=EOS, pad_token_id=EOS)
    model = LlamaForCausalLM(config).eval()
    first = load_prompts("gsm8k", 1)[0].token_ids
    stop_token = _reference_greedy(model, first, MAX_NEW)[MAX_NEW // 2]
    with torch.no_grad():  # EOS's logit: just above the stop token's, which is positive where it is the argmax
        model.lm_head.weight[EOS] = 1.01 * model.lm_head.weight[stop_token]
    return model


@pytest.fixture(autouse=True)
def _small_runs(monkeypatch: pytest.MonkeyPatch, tmp_path: pathlib.Path) -> None:
    """Each test: an empty cache folder; short answers; several batches per chunk and several chunks."""
    monkeypatch.setenv("DRAFTER_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(model_outputs, "MAX_NEW_TOKENS", MAX_NEW)
    monkeypatch.setattr(model_outputs, "BATCH_SIZE", 2)
    monkeypatch.setattr(model_outputs, "CHUNK_SIZE", 4)


@pytest.fixture
def prefill_rows(tiny_model: LlamaForCausalLM, monkeypatch: pytest.MonkeyPatch) -> Iterator[list[int]]:
    """Serve ``tiny_model`` as the generating model; the list collects the batch size of each prefill pass."""
    rows: list[int] = []

    def count(_module: torch.nn.Module, _args: tuple, kwargs: dict) -> None:
        ids = kwargs.get("input_ids")
        if ids is not None and ids.shape[1] > 1:
            rows.append(int(ids.shape[0]))

    handle = tiny_model.register_forward_pre_hook(count, with_kwargs=True)
    monkeypatch.setattr(model_outputs, "load_generating_model", lambda: tiny_model)
    yield rows
    handle.remove()


def _no_model() -> LlamaForCausalLM:
    raise AssertionError("the model was loaded although the cache holds the requests")


def test_answers_are_greedy_in_source_order_and_stop_at_eos(tiny_model: LlamaForCausalLM,
                                                            prefill_rows: list[int]) -> None:
    prompts = load_prompts("gsm8k", 7, max_question_tokens=None)
    reqs = load_dataset("smollm2-gsm8k", limit=7)
    assert sum(prefill_rows) == 7 and max(prefill_rows) <= model_outputs.BATCH_SIZE
    assert [r.request_id for r in reqs] == [p.prompt_id for p in prompts]
    assert reqs[0].request_id == "gsm8k-0000" and reqs[6].request_id == "gsm8k-0006"
    for req, prompt in zip(reqs, prompts, strict=True):
        assert req.prompt.dtype == np.int32 and np.array_equal(req.prompt, prompt.token_ids)
        assert req.output.tolist() == _reference_greedy(tiny_model, prompt.token_ids, MAX_NEW)
        assert EOS not in req.output[:-1].tolist()  # nothing is kept after the end of the answer
    assert any(r.output[-1] == EOS and len(r.output) < MAX_NEW for r in reqs)  # stopped at EOS
    assert any(len(r.output) == MAX_NEW and r.output[-1] != EOS for r in reqs)  # ran to the token limit


def test_cache_serves_smaller_loads_and_larger_loads_generate_only_the_rest(
        prefill_rows: list[int], monkeypatch: pytest.MonkeyPatch) -> None:
    first = load_dataset("smollm2-gsm8k", limit=5)
    assert sum(prefill_rows) == 5
    files = list(model_outputs.cache_dir().glob("outputs-smollm2-gsm8k-*.jsonl"))
    assert len(files) == 1 and len(list(read_requests(files[0]))) == 5

    with monkeypatch.context() as m:
        m.setattr(model_outputs, "load_generating_model", _no_model)
        small = load_dataset("smollm2-gsm8k", limit=3)
    assert [r.request_id for r in small] == [r.request_id for r in first[:3]]
    assert all(np.array_equal(a.output, b.output) for a, b in zip(small, first, strict=False))

    prefill_rows.clear()
    larger = load_dataset("smollm2-gsm8k", limit=9)
    assert sum(prefill_rows) == 4  # only requests 5..8 were generated
    assert [r.request_id for r in larger] == [p.prompt_id for p in load_prompts("gsm8k", 9)]
    assert all(np.array_equal(a.output, b.output) for a, b in zip(larger, first, strict=False))
    assert len(list(read_requests(files[0]))) == 9
    assert list(model_outputs.cache_dir().glob("outputs-smollm2-gsm8k-*.jsonl")) == files


def test_stale_or_malformed_cache_is_generated_again(prefill_rows: list[int]) -> None:
    reqs = load_dataset("smollm2-gsm8k", limit=4)
    path = next(model_outputs.cache_dir().glob("outputs-smollm2-gsm8k-*.jsonl"))
    stale = list(reqs)
    stale[2] = type(stale[2])(stale[2].request_id, stale[2].prompt[:-1], stale[2].output)  # another prompt
    write_requests(path, stale)
    prefill_rows.clear()
    again = load_dataset("smollm2-gsm8k", limit=5)
    assert sum(prefill_rows) == 3  # from the stale request on
    assert all(np.array_equal(a.prompt, b.prompt) and np.array_equal(a.output, b.output)
               for a, b in zip(again, reqs, strict=False))

    path.write_text('{"request_id": "gsm8k-0000", "prompt": [1, 2\n')
    prefill_rows.clear()
    assert [r.request_id for r in load_dataset("smollm2-gsm8k", limit=2)] == ["gsm8k-0000", "gsm8k-0001"]
    assert sum(prefill_rows) == 2


def test_humaneval_answers_keep_every_problem(prefill_rows: list[int]) -> None:
    prompts = load_prompts("humaneval", None, max_question_tokens=None)
    assert [p.prompt_id for p in prompts] == [f"HumanEval/{i}" for i in range(len(prompts))]
    reqs = load_dataset("smollm2-humaneval", limit=3)
    assert [r.request_id for r in reqs] == ["HumanEval/0", "HumanEval/1", "HumanEval/2"]
    assert all(np.array_equal(r.prompt, p.token_ids) for r, p in zip(reqs, prompts, strict=False))
    assert sum(prefill_rows) == 3


def test_limit_zero_and_bad_arguments(prefill_rows: list[int]) -> None:
    assert load_dataset("smollm2-gsm8k", limit=0) == []
    assert prefill_rows == []
    with pytest.raises(ValueError, match="limit"):
        load_dataset("smollm2-humaneval", limit=-1)
    with pytest.raises(ValueError, match="unknown data set"):
        model_outputs.load_model_outputs("smollm2-nope", 1)

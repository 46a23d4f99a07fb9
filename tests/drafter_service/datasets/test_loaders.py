"""Tests of the benchmark's tokenizer, request JSONL files and data set loaders."""

from __future__ import annotations

import io
import pathlib
from collections.abc import Iterator

import numpy as np
import pytest

from drafter_service.datasets import loaders as datasets
from drafter_service.datasets.loaders import Request, iter_json_array, load_dataset, read_requests, write_requests
from drafter_service.datasets.tokenizer import load_smollm2_tokenizer

IM_START, IM_END = 1, 2


@pytest.fixture(scope="module", autouse=True)
def _fresh_cache(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """Every test module run starts from an empty cache folder (builds and caches are exercised)."""
    mp = pytest.MonkeyPatch()
    mp.setenv("DRAFTER_CACHE_DIR", str(tmp_path_factory.mktemp("drafter-cache")))
    yield
    mp.undo()


@pytest.mark.parametrize(
    "text",
    [
        "Hello world!",
        "def fib(n: int) -> int:\n    return n if n < 2 else fib(n - 1) + fib(n - 2)\n",
        "Unicode: café naïve Zürich — 東京 🚀",
        "Numbers 3.14159, 1,000,000 and   2024-05-17\n\n\n",
        "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n",
    ],
)
def test_tokenizer_round_trips(text: str) -> None:
    tok = load_smollm2_tokenizer()
    assert tok.decode(tok.encode(text).ids, skip_special_tokens=False) == text


def test_tokenizer_special_tokens_and_known_ids() -> None:
    tok = load_smollm2_tokenizer()
    assert tok.get_vocab_size() == 49152
    assert tok.encode("<|im_start|>").ids == [IM_START]
    assert tok.encode("<|im_end|>").ids == [IM_END]
    assert tok.encode("<|endoftext|>").ids == [0]
    assert tok.encode("Hello world!").ids == [19556, 905, 17]  # 'Hello', 'Ġworld', '!'
    assert tok.encode("x  12").tokens == ["x", "ĠĠ", "1", "2"]  # digits split off one by one
    assert tok.encode("<|im_start|>user").ids[0] == IM_START


def test_request_jsonl_round_trip(tmp_path: pathlib.Path) -> None:
    reqs = [Request("a", np.array([1, 2, 3]), np.array([4, 5])),
            Request("b \"quoted\" ü", np.array([49151], dtype=np.int64), np.zeros(0))]
    path = tmp_path / "reqs.jsonl"
    assert write_requests(path, reqs) == 2
    back = list(read_requests(path))
    assert [r.request_id for r in back] == [r.request_id for r in reqs]
    for got, want in zip(back, reqs, strict=True):
        assert got.prompt.dtype == np.int32 and got.output.dtype == np.int32
        assert np.array_equal(got.prompt, want.prompt) and np.array_equal(got.output, want.output)
    with pytest.raises(ValueError):
        back[0].prompt[0] = 9  # read-only arrays


@pytest.mark.parametrize(
    "bad_line",
    [
        '{"request_id": "x", "prompt": [1, 2], "output": [3',  # truncated JSON
        '{"request_id": "x", "prompt": [1, 2]}',  # missing output
        '{"request_id": 7, "prompt": [1], "output": [2]}',  # id not a string
        '{"request_id": "x", "prompt": [1.5], "output": [2]}',  # not integer
        '{"request_id": "x", "prompt": [-1], "output": [2]}',  # negative id
        '[1, 2, 3]',  # not an object
    ],
)
def test_malformed_line_names_its_number(tmp_path: pathlib.Path, bad_line: str) -> None:
    path = tmp_path / "bad.jsonl"
    path.write_text('{"request_id": "ok", "prompt": [1], "output": [2]}\n\n' + bad_line + "\n")
    with pytest.raises(ValueError, match=r"line 3\b"):
        list(read_requests(path))


def test_iter_json_array_stops_at_truncated_tail() -> None:
    text = '[\n {"a": 1, "s": "x, y"},\n {"a": 2},\n {"a": 3, "s": "unterminated'
    assert list(iter_json_array(io.StringIO(text), chunk_chars=5)) == [{"a": 1, "s": "x, y"}, {"a": 2}]
    assert list(iter_json_array(io.StringIO('[{"a": 1}, {"a": 2}]'), chunk_chars=3)) == [{"a": 1}, {"a": 2}]
    with pytest.raises(ValueError):
        list(iter_json_array(io.StringIO('{"a": 1}')))


def test_mtbench_requests() -> None:
    reqs = load_dataset("mtbench")
    assert len(reqs) == 160
    assert reqs[0].request_id == "mtbench-81-1" and reqs[1].request_id == "mtbench-81-2"
    for r in reqs:
        assert r.prompt.dtype == np.int32 and r.output.dtype == np.int32
        assert len(r.prompt) > 0 and len(r.output) > 0
    tok = load_smollm2_tokenizer()
    assert tok.decode(reqs[0].prompt.tolist()).startswith("A chat between a curious user")
    assert tok.decode(reqs[0].prompt.tolist()).endswith(" ASSISTANT:")
    for first, second in zip(reqs[0::2], reqs[1::2], strict=True):
        turn1 = first.prompt.tolist() + first.output.tolist()
        assert second.prompt[: len(turn1)].tolist() == turn1  # the turn-1 answer tokens reappear unchanged
    # the second load comes from the cache file and is identical
    again = load_dataset("mtbench", limit=3)
    assert [r.request_id for r in again] == [r.request_id for r in reqs[:3]]
    assert all(np.array_equal(a.output, b.output) for a, b in zip(again, reqs, strict=False))


def test_sharegpt_requests_small_limit() -> None:
    reqs = load_dataset("sharegpt", limit=8)
    assert len(reqs) == 8
    header = load_smollm2_tokenizer().encode("<|im_start|>assistant\n").ids
    for r in reqs:
        assert r.prompt[-len(header):].tolist() == header
        assert r.output[-1] == IM_END and len(r.output) > 1
        assert len(r.prompt) <= datasets.MAX_PROMPT_TOKENS
    # a turn's prompt holds the previous answer of the same conversation
    assert reqs[0].request_id.rsplit("-", 1)[0] == reqs[1].request_id.rsplit("-", 1)[0]
    prev = reqs[0].output.tolist()
    assert any(reqs[1].prompt[i : i + len(prev)].tolist() == prev for i in range(len(reqs[1].prompt)))
    # a smaller load reads the prefix of the cached larger one
    small = load_dataset("sharegpt", limit=3)
    assert [r.request_id for r in small] == [r.request_id for r in reqs[:3]]
    assert not any(datasets.cache_dir().glob("requests-sharegpt-3.*"))


def test_humaneval_requests() -> None:
    reqs = load_dataset("humaneval")
    assert len(reqs) == 164
    assert reqs[0].request_id == "HumanEval/0" and reqs[-1].request_id == "HumanEval/163"
    assert all(len(r.prompt) > 0 and len(r.output) > 0 for r in reqs)


def test_load_dataset_rejects_bad_arguments() -> None:
    with pytest.raises(ValueError, match="unknown data set"):
        load_dataset("nope")
    with pytest.raises(ValueError):
        load_dataset("mtbench", limit=-1)

"""Corpus readers (text, folders, JSONL text/chat/token ids, malformed lines) and the threaded table build."""

import json

import numpy as np
import pytest
from tokenizers import Tokenizer, models, pre_tokenizers

from drafter_service.ingest.corpus_build import build_corpus_table, in_background
from drafter_service.ingest.corpus_reader import CorpusOptions, CorpusReader, documents_of
from drafter_service.ingest.text_tokenizer import TextTokenizer
from store.corpus_counts import build_frozen_table

WORDS = ["[UNK]", "the", "cat", "sat", "on", "mat", "a", "dog", "ran", "to", "it", "é"]


def tiny_tokenizer(path):
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(WORDS)}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.save(str(path))
    return TextTokenizer.load(path)


def texts(obj, **options):
    return documents_of(obj, CorpusOptions(**options))


def test_fields_found_by_themselves_or_named():
    assert texts({"text": "a b"}) == ["a b"]
    assert texts({"prompt": "question", "completion": "answer"}) == ["answer"]
    assert texts({"instruction": "i", "output": "o"}) == ["o"] and texts({"response": "r"}) == ["r"]
    assert texts({"text": "t", "other": "x"}, field="other") == ["x"]
    chat = {"messages": [{"role": "system", "content": "s"}, {"role": "user", "content": "q"},
                         {"role": "assistant", "content": [{"type": "text", "text": "an"}, {"type": "text",
                                                                                            "text": "swer"}]}]}
    assert texts(chat) == ["s", "q", "answer"]
    assert texts(chat, roles=frozenset({"assistant"})) == ["answer"]
    share = {"conversations": [{"from": "human", "value": "q"}, {"from": "gpt", "value": "a"},
                               {"from": "gpt", "value": "  "}]}
    assert texts(share, roles=frozenset({"assistant"})) == ["a"] and texts(share, roles=frozenset({"gpt"})) == ["a"]
    assert texts(share, roles=frozenset({"user"})) == ["q"]
    ids = texts({"prompt": [1, 2], "output": [3]})
    assert len(ids) == 1 and ids[0].tolist() == [1, 2, 3] and ids[0].dtype == np.int32
    assert texts({"prompt": [1, 2], "output": [3]}, field="output")[0].tolist() == [3]


@pytest.mark.parametrize("obj, message", [
    ([1, 2], "JSON object"), ({"title": "x"}, "no text"), ({"text": 3}, "no text"),
    ({"messages": "hi"}, "list"), ({"messages": ["hi"]}, "object"), ({"output": [1, -2]}, "token ids"),
    ({"output": [1, 5000]}, r"\[0, 1000\)"),
])
def test_malformed_records(obj, message):
    with pytest.raises(ValueError, match=message):
        texts(obj, vocab_size=1000)
    with pytest.raises(ValueError, match="no field"):
        texts({"text": "x"}, field="body")


def test_folders_text_pieces_and_jsonl_problems(tmp_path):
    (tmp_path / "sub").mkdir()
    (tmp_path / ".hidden").mkdir()
    story = "the cat sat on the mat\n" * 5 + "é" * 40 + " a dog ran\nto it"
    (tmp_path / "sub" / "story.txt").write_text(story, encoding="utf-8")
    (tmp_path / ".hidden" / "skip.txt").write_text("the the the")
    (tmp_path / "blob.bin").write_bytes(b"\0\1\2" * 10)
    lines = [json.dumps({"text": "a cat"}), "{not json", "", json.dumps({"title": "no text"}),
             json.dumps({"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a dog"}]})]
    (tmp_path / "chat.jsonl").write_text("\n".join(lines) + "\n")
    reader = CorpusReader([tmp_path], CorpusOptions(piece_bytes=7, batch_chars=20, roles=frozenset({"assistant"})))
    assert [p.name for p in reader.files] == ["blob.bin", "chat.jsonl", "story.txt"]
    batches = list(reader.batches())
    docs = [d for b in batches for d in b.documents]
    assert sum(b.nbytes for b in batches) == reader.total_bytes and len(batches) > 3
    assert [d.text for d in docs[:2]] == ["a cat", "a dog"]
    pieces = docs[2:]
    assert not pieces[0].continues and all(p.continues for p in pieces[1:])
    assert "".join(p.text for p in pieces) == story and all(len(p.text.encode()) <= 14 for p in pieces)
    assert [(path.split("/")[-1], line) for path, line, _ in reader.problems] == [
        ("blob.bin", 0), ("chat.jsonl", 2), ("chat.jsonl", 4)]


def test_build_counts_each_document_apart_and_equals_the_table_build(tmp_path):
    tok = tiny_tokenizer(tmp_path / "tokenizer.json")
    docs = ["the cat sat on the mat", "a dog ran to the cat", "the cat sat on a dog"] * 3
    (tmp_path / "c.jsonl").write_text("".join(json.dumps({"text": d}) + "\n" for d in docs) + "{bad\n")
    (tmp_path / "ids.jsonl").write_text(json.dumps({"prompt": [1, 2], "output": [3, 4, 5]}) + "\n")
    table, report = build_corpus_table([tmp_path / "c.jsonl", tmp_path / "ids.jsonl"], vocab_size=tok.vocab_size,
                                       encode=tok.encode_batch, leader_capacity=5, follower_capacity=2,
                                       options=CorpusOptions(batch_chars=30))
    expected = build_frozen_table(tok.encode_batch(docs) + [np.array([1, 2, 3, 4, 5])], 1, 3, 5, 2)
    assert list(table.items()) == list(expected.items())
    assert (report.documents, report.tokens, report.skipped, report.pruned_grams) == (10, 59, 1, 0)
    assert "c.jsonl:10" in report.problems[0] and report.leaders == len(table)
    with pytest.raises(ValueError, match="tokenizer"):
        build_corpus_table([tmp_path / "c.jsonl"], vocab_size=20)


def test_background_errors_reach_the_consumer():
    def items():
        yield 1
        raise RuntimeError("boom")

    got = []
    with pytest.raises(RuntimeError, match="boom"):
        for item in in_background(items()):
            got.append(item)
    assert got == [1]

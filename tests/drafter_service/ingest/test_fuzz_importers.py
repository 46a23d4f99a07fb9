"""Hostile input to the importers: request-log lines (`drafter warm`), corpus files (`drafter import-corpus`) and the
corpus gram counter, on arbitrary bytes, lines and JSON. Nothing raises but the documented errors, every malformed
line is reported, and the counts add up.

``DRAFTER_FUZZ_EXAMPLES`` sets the examples per test (default 25); the cases run are printed.
"""

from __future__ import annotations

import collections
import json
import os
import pathlib
import tempfile

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer, models, pre_tokenizers

from drafter_service.core.config import DrafterConfig
from drafter_service.ingest.corpus_build import build_corpus_table
from drafter_service.ingest.corpus_reader import CorpusOptions, CorpusReader, documents_of
from drafter_service.ingest.log_reader import CHAT, TEXT, TOKENS, LogRequest, MalformedLine, parse_line
from drafter_service.ingest.text_tokenizer import TextTokenizer
from drafter_service.ingest.warm import Warmer
from drafter_service.ingest.warm_sinks import ServiceSink
from drafter_service.service.config import ServiceConfig
from drafter_service.service.service import DrafterService
from store.corpus_counts import NGramCounter

EXAMPLES = int(os.environ.get("DRAFTER_FUZZ_EXAMPLES", "25"))
FUZZ = settings(max_examples=EXAMPLES * 4, deadline=None, database=None, suppress_health_check=list(HealthCheck))
WORDS = ["[UNK]", "<s>", "<|im_start|>", "<|im_end|>", "user", "assistant", "system", "hello", "world", "hi"]
TEMPLATE = ("{{ bos_token }}{% for m in messages %}{% if m['role'] == 'tool' %}{{ raise_exception('no tools') }}"
            "{% endif %}<|im_start|>{{ m['role'] }} {{ m['content'] }}<|im_end|>{% endfor %}"
            "{% if add_generation_prompt %}<|im_start|>assistant {% endif %}")
VOCAB = 16  # token-id lines above it are out of the namespace's vocabulary
MAX_TOKENS = 40  # the service's max_request_tokens

# -- strategies -------------------------------------------------------------------------------------------------

KEYS = st.sampled_from(["prompt", "output", "messages", "request", "body", "response", "completion", "choices",
                        "message", "content", "role", "text", "type", "id", "request_id", "custom_id",
                        "conversations", "from", "value"])
TEXTS = st.sampled_from(["hello world", "hi", "", " ", "user", "assistant", "tool", "ünï ☃"]) | st.text(max_size=30)
SCALARS = (st.none() | st.booleans() | st.integers(-3, 20) | st.integers() | st.floats() | TEXTS)
JSON = st.recursive(SCALARS, lambda inner: st.lists(inner, max_size=5)
                    | st.dictionaries(KEYS | st.text(max_size=8), inner, max_size=5), max_leaves=25)
ROLES = st.sampled_from(["user", "assistant", "system", "tool", "human", "gpt", ""]) | st.integers()
MESSAGES = st.lists(st.fixed_dictionaries({"role": ROLES}, optional={"content": TEXTS | st.none() | st.lists(
    st.fixed_dictionaries({"type": st.sampled_from(["text", "image"])}, optional={"text": TEXTS}), max_size=3)}),
    max_size=4)
IDS = st.lists(st.integers(0, VOCAB - 1), max_size=12) | st.lists(st.integers(-2, VOCAB + 2) | st.integers(),
                                                                  max_size=12) \
    | st.builds(lambda n: [1] * n, st.integers(MAX_TOKENS - 1, MAX_TOKENS + 3))
RECORDS = (st.fixed_dictionaries({}, optional={"prompt": IDS | TEXTS, "output": IDS | TEXTS,
                                               "request_id": TEXTS | st.integers()})
           | st.fixed_dictionaries({"messages": MESSAGES}, optional={"response": TEXTS | JSON, "completion": TEXTS})
           | st.fixed_dictionaries({"request": st.fixed_dictionaries({"body": st.fixed_dictionaries(
               {"messages": MESSAGES})})}, optional={"response": st.fixed_dictionaries({"body": st.fixed_dictionaries(
                   {"choices": st.lists(st.fixed_dictionaries({"message": st.fixed_dictionaries(
                       {"content": TEXTS})}), max_size=2)})})})
           | st.fixed_dictionaries({"text": TEXTS}) | st.fixed_dictionaries({"conversations": MESSAGES})
           | JSON)
LINES = (RECORDS.map(lambda obj: json.dumps(obj).encode())  # json.dumps writes NaN and Infinity: not JSON
         | st.binary(max_size=60) | st.builds(lambda n: b"[" * n + b"]" * n, st.integers(500, 5000))
         | st.sampled_from([b"", b"   ", b"\r", b"\xef\xbb\xbf{}", b"\xff\xfe", b"{\"prompt\": [1, 2"]))
LOG = st.lists(LINES.map(lambda line: line.replace(b"\n", b" ")), max_size=25)


# -- fixtures ---------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory) -> TextTokenizer:
    """A word-level tokenizer of the words above, with a chat template that refuses the role 'tool'."""
    folder = tmp_path_factory.mktemp("tok")
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(WORDS)}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.add_special_tokens(["<s>", "<|im_start|>", "<|im_end|>"])
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({"chat_template": TEMPLATE, "bos_token": "<s>"}))
    return TextTokenizer.load(folder)


@pytest.fixture
def cases(request, capsys):
    """A counter of the test's cases (key "cases") and what they held; printed at the end."""
    counter: collections.Counter = collections.Counter()
    yield counter
    with capsys.disabled():
        cases = counter.pop("cases", 0)
        print(f"\n{request.node.name}: {cases} cases {dict(sorted(counter.items()))}")


# -- request logs -----------------------------------------------------------------------------------------------


@FUZZ
@given(raw=LINES)
def test_any_log_line_is_a_request_a_blank_or_reported_malformed(raw, cases):
    cases["cases"] += 1
    cases["lines"] += 1
    try:
        req = parse_line(raw, 7)
    except MalformedLine as exc:
        assert str(exc)
        cases["malformed"] += 1
        return
    if req is None:
        assert not raw.strip()
        return
    assert isinstance(req, LogRequest) and req.line_no == 7 and isinstance(req.request_id, str)
    if req.kind == TOKENS:
        assert isinstance(req.prompt, list) and isinstance(req.output, list)
    elif req.kind == TEXT:
        assert isinstance(req.prompt, str) and isinstance(req.output, str)
    else:
        assert req.kind == CHAT and req.prompt is None and isinstance(req.output, str) and req.messages
        assert all(isinstance(m["role"], str) and isinstance(m["content"], str) for m in req.messages)
    assert req.size_hint() >= 0
    cases[req.kind] += 1


@FUZZ
@given(lines=LOG)
def test_warming_any_log_stores_exactly_what_it_counts(lines, tokenizer, cases):
    cases["cases"] += 1
    cfg = ServiceConfig(drafter=DrafterConfig(capacity=1 << 16), default_vocab_size=VOCAB,
                        max_request_tokens=MAX_TOKENS)
    service = DrafterService(cfg)
    with tempfile.TemporaryDirectory() as tmp:
        log = pathlib.Path(tmp) / "log.jsonl"
        log.write_bytes(b"\n".join(lines))
        stats = Warmer(ServiceSink(service), tokenizer, batch_tokens=64, progress=False).warm_file(log)
    cases["logs"] += 1
    cases["lines"] += len(lines)
    requests = sum(1 for line in lines if line.strip())
    assert stats.requests + stats.skipped + stats.malformed == requests
    assert stats.bytes_read == log_size(lines) and len(stats.malformed_lines) == min(stats.malformed, 20)
    store = service.namespaces["default"].drafter.store
    assert store.stats()["documents"] == stats.requests
    assert store.stats()["tokens"] == stats.tokens + stats.requests  # one separator after each request
    service.namespaces["default"].drafter.check_invariants()


def log_size(lines: list[bytes]) -> int:
    return sum(map(len, lines)) + max(0, len(lines) - 1)


# -- corpus files -----------------------------------------------------------------------------------------------


@FUZZ
@given(obj=RECORDS, field=st.none() | KEYS, roles=st.none() | st.just(frozenset({"assistant"})))
def test_any_corpus_record_gives_documents_or_a_value_error(obj, field, roles, cases):
    cases["cases"] += 1
    cases["records"] += 1
    try:
        docs = documents_of(obj, CorpusOptions(field=field, roles=roles, vocab_size=VOCAB))
    except ValueError:
        cases["refused"] += 1
        return
    for doc in docs:
        if isinstance(doc, str):
            assert doc
        else:
            assert doc.dtype == np.int32 and doc.size and int(doc.min()) >= 0 and int(doc.max()) < VOCAB


@FUZZ
@given(lines=LOG, text=st.binary(max_size=300) | st.text(max_size=300).map(str.encode), piece=st.integers(1, 64))
def test_any_corpus_file_is_read_or_reported_and_counted(lines, text, piece, tokenizer, cases):
    cases["cases"] += 1
    with tempfile.TemporaryDirectory() as tmp:
        jsonl, plain = pathlib.Path(tmp) / "a.jsonl", pathlib.Path(tmp) / "b.txt"
        jsonl.write_bytes(b"\n".join(lines))
        plain.write_bytes(text)
        options = CorpusOptions(vocab_size=VOCAB, piece_bytes=piece, batch_chars=50)
        reader = CorpusReader([tmp], options)
        batches = list(reader.batches())
        cases["files"] += 2
        cases["lines"] += len(lines)
        assert sum(b.nbytes for b in batches) == reader.total_bytes == log_size(lines) + len(text)
        bad = {line for f, line, _ in reader.problems if f == str(jsonl)}
        assert len(bad) == sum(1 for f, _, _ in reader.problems if f == str(jsonl))  # one report a line
        assert all(1 <= line <= len(lines) and lines[line - 1].strip() for line in bad)
        for i, line in enumerate(lines, 1):
            if line.strip() and i not in bad:  # every line not reported is a JSON record with its documents
                documents_of(json.loads(line), options)
        docs = [d for b in batches for d in b.documents]
        if b"\0" in text[:8192]:
            assert (str(plain), 0, "binary file (it holds NUL bytes)") in reader.problems
        elif text and _utf8(text):
            plain_docs = [d for d in docs if d.text is not None][-_pieces_of(docs):]
            assert "".join(d.text for d in plain_docs) == text.decode()  # cut between whole characters
        table, report = build_corpus_table([tmp], vocab_size=VOCAB, encode=tokenizer.encode_batch,
                                           options=options, leader_capacity=8, follower_capacity=4)
        table.check_invariants(8, 4)
        assert report.skipped == len(reader.problems) and report.bytes_read == reader.total_bytes


def _utf8(data: bytes) -> bool:
    try:
        data.decode()
        return True
    except UnicodeDecodeError:
        return False


def _pieces_of(docs: list) -> int:
    """How many documents at the end of ``docs`` are the pieces of the last text file (the first has no flag)."""
    n = 0
    for doc in reversed(docs):
        if doc.text is None:
            break
        n += 1
        if not doc.continues:
            break
    return n


# -- the corpus counter -----------------------------------------------------------------------------------------


@FUZZ
@given(docs=st.lists(st.tuples(st.lists(st.integers(0, 7), max_size=12) | st.lists(st.integers(), max_size=6),
                               st.booleans()), max_size=12),
       max_distinct=st.none() | st.integers(1, 20), chunk=st.integers(1, 16))
def test_the_counter_counts_every_window_of_any_documents(docs, max_distinct, chunk, cases):
    cases["cases"] += 1
    counter = NGramCounter(1, 2, 8, max_distinct=max_distinct, chunk_grams=chunk)
    naive: collections.Counter = collections.Counter()
    tail: list[int] = []
    for tokens, continues in docs:
        cases["documents"] += 1
        if any(not 0 <= t < 8 for t in tokens):
            before = (counter.tokens, counter.grams, counter.documents)
            with pytest.raises(ValueError, match="token ids"):
                counter.add(tokens, continues)
            assert (counter.tokens, counter.grams, counter.documents) == before  # nothing of it was counted
            continue
        seq = (tail if continues else []) + tokens
        naive.update(tuple(seq[i:i + 3]) for i in range(len(seq) - 2))
        tail = seq[-2:]
        counter.add(np.array(tokens, dtype=np.int64), continues)
        counter.check_invariants()
    assert counter.grams == sum(naive.values())
    if max_distinct is None:
        grams, counts = counter.counts()
        assert dict(zip(map(tuple, grams.tolist()), counts.tolist(), strict=True)) == dict(naive)

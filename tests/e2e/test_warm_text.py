"""Text and chat logs: line formats, chat templates (sandboxed Jinja), and `drafter warm --tokenizer` end to end
with a tiny word-level tokenizer whose ids are written beside each case."""

from __future__ import annotations

import json

import pytest
from tokenizers import Tokenizer, models, pre_tokenizers

from drafter_service.cli.main import main
from drafter_service.core.config import DrafterConfig
from drafter_service.ingest.log_reader import CHAT, TEXT, TOKENS, MalformedLine, parse_line
from drafter_service.ingest.text_tokenizer import TextTokenizer, TokenizerError
from drafter_service.rpc.server import create_server
from drafter_service.service.config import ServiceConfig
from drafter_service.service.service import DrafterService
from store.persistence import RedisPersistence

WORDS = ["[UNK]", "<s>", "<|im_start|>", "<|im_end|>", "user", "assistant", "system", "hello", "world", "how",
         "are", "you", "fine", "thanks", "be", "brief", "hi"]
ID = {w: i for i, w in enumerate(WORDS)}  # hello = 7, world = 8, ...
TEMPLATE = ("{{ bos_token }}{% for m in messages %}\n"
            "  {% if m['role'] == 'tool' %}{{ raise_exception('no tools here') }}{% endif %}\n"
            "<|im_start|>{{ m['role'] }} {{ m['content'] }}<|im_end|>\n"
            "{% endfor %}\n"
            "  {% if add_generation_prompt %}<|im_start|>assistant {% endif %}")


def ids(text: str) -> list[int]:
    return [ID[w] for w in text.split()]


@pytest.fixture
def tok_dir(tmp_path):
    tok = Tokenizer(models.WordLevel(ID, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.add_special_tokens(["<s>", "<|im_start|>", "<|im_end|>"])
    folder = tmp_path / "tok"
    folder.mkdir()
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({"chat_template": TEMPLATE, "bos_token": "<s>",
                                                              "eos_token": {"content": "<|im_end|>"}}))
    return folder


@pytest.fixture
def address(redis_server):
    cfg = ServiceConfig(drafter=DrafterConfig(capacity=1 << 16), default_vocab_size=len(WORDS))
    service = DrafterService(cfg, lambda name, vocab: RedisPersistence(redis_server.url, name, vocab_size=vocab))
    server, port = create_server(cfg, "127.0.0.1:0", service)
    yield f"127.0.0.1:{port}"
    server.stop(0)


def stored(url: str) -> list[tuple[list[int], int | None, str | None]]:
    return [(r.tokens.tolist(), r.prompt_len, r.request_id)
            for r in RedisPersistence(url, "default").iter_request_records()]


def test_render_chat_like_transformers(tok_dir):
    tok = TextTokenizer.load(tok_dir)
    msgs = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hello"}]
    text = tok.render_chat(msgs)  # trim_blocks and lstrip_blocks drop the template's own newlines and indents
    assert text == "<s><|im_start|>system be brief<|im_end|>\n<|im_start|>user hello<|im_end|>\n<|im_start|>assistant "
    assert tok.render_chat(msgs, add_generation_prompt=False).endswith("hello<|im_end|>\n")
    with pytest.raises(TokenizerError, match="no tools here"):
        tok.render_chat([{"role": "tool", "content": "x"}])
    with pytest.raises(TokenizerError, match="sandbox|unsafe|access"):
        tok.with_chat_template("{{ messages.__class__.__mro__ }}").render_chat(msgs)
    with pytest.raises(TokenizerError, match="compile"):
        tok.with_chat_template("{% for %}").render_chat(msgs)
    bare = tok_dir.parent / "bare.json"  # no tokenizer_config.json beside it
    bare.write_bytes((tok_dir / "tokenizer.json").read_bytes())
    plain = TextTokenizer.load(bare)
    assert plain.chat_template is None
    with pytest.raises(TokenizerError, match="--chat-template"):
        plain.render_chat(msgs)
    assert plain.with_chat_template("{{ messages | length }} {{ messages[0] | tojson }}").render_chat(msgs) == \
        '2 {"role": "system", "content": "be brief"}'


@pytest.mark.parametrize("obj, kind, prompt, output, messages, rid", [
    ({"prompt": [1], "output": [2, 3], "request_id": "a"}, TOKENS, [1], [2, 3], None, "a"),
    ({"output": [2], "id": 7}, TOKENS, [], [2], None, "7"),
    ({"prompt": "hi", "completion": "hello"}, TEXT, "hi", "hello", None, ""),
    ({"prompt": "hi", "response": "hello", "request_id": True}, TEXT, "hi", "hello", None, ""),
    ({"messages": [{"role": "user", "content": "hi"}], "response": "hello"}, CHAT, None, "hello",
     [{"role": "user", "content": "hi"}], ""),
    ({"messages": [{"role": "user", "content": [{"type": "text", "text": "h"}, {"type": "text", "text": "i"}]},
                   {"role": "assistant", "content": "hello"}], "custom_id": "c"}, CHAT, None, "hello",
     [{"role": "user", "content": "hi"}], "c"),
    ({"messages": [{"role": "user", "content": "hi"}], "choices": [{"message": {"content": "yo"}}]}, CHAT, None,
     "yo", [{"role": "user", "content": "hi"}], ""),
    ({"custom_id": "b1", "request": {"body": {"messages": [{"role": "user", "content": "hi"}]}},
      "response": {"body": {"choices": [{"message": {"role": "assistant", "content": "yo"}}]}}}, CHAT, None, "yo",
     [{"role": "user", "content": "hi"}], "b1"),
])
def test_line_formats(obj, kind, prompt, output, messages, rid):
    req = parse_line(json.dumps(obj).encode(), 3)
    assert (req.line_no, req.kind, req.prompt, req.output, req.messages, req.request_id) == \
        (3, kind, prompt, output, messages, rid)


@pytest.mark.parametrize("raw, reason", [
    (b"{", "not valid JSON"), (b"\xff\n", "not valid JSON"), (b"3", "JSON object"),
    (b'{"prompt": [1], "output": "x"}', "lists of integers"),
    (b'{"messages": "hi", "response": "x"}', "must be a list"),
    (b'{"messages": [{"content": "hi"}], "response": "x"}', "message 0"),
    (b'{"messages": [{"role": "user", "content": 5}], "response": "x"}', "content must be text"),
    (b'{"messages": [{"role": "user", "content": "hi"}]}', "without an answer"),
    (b'{"messages": [{"role": "assistant", "content": "hi"}]}', "no messages before"),
    (b'{"text": "hello"}', "no request found"),
])
def test_malformed_line_reasons(raw, reason):
    with pytest.raises(MalformedLine, match=reason):
        parse_line(raw, 1)
    assert parse_line(b"  \n", 1) is None


def test_text_and_chat_logs_are_tokenized_with_the_namespace_tokenizer(address, redis_server, tok_dir, tmp_path,
                                                                        capsys):
    log = tmp_path / "chat.jsonl"
    log.write_text("\n".join(json.dumps(o) for o in [
        {"request_id": "t1", "prompt": "how are you", "completion": "fine thanks"},
        {"request_id": "c1", "messages": [{"role": "user", "content": "hello world"}], "response": "hi"},
        {"request_id": "c2", "messages": [{"role": "system", "content": "be brief"},
                                          {"role": "user", "content": "hi"},
                                          {"role": "assistant", "content": "hello"}]},
        {"request_id": "c3", "messages": [{"role": "tool", "content": "x"}], "response": "hi"},
        {"request_id": "t2", "prompt": "how are you", "completion": "hello zebra"},  # unknown word: [UNK] = 0
    ]) + "\n")
    assert main(["warm", str(log), "--address", address, "--tokenizer", str(tok_dir), "--no-progress",
                 "--state-dir", str(tmp_path / "state")]) == 0
    out = capsys.readouterr().out
    assert "warmed 4 requests" in out and "1 malformed lines skipped" in out and "chat.jsonl:4: " in out
    c1 = ids("<s> <|im_start|> user hello world <|im_end|> <|im_start|> assistant")
    c2 = ids("<s> <|im_start|> system be brief <|im_end|> <|im_start|> user hi <|im_end|> <|im_start|> assistant")
    assert stored(redis_server.url) == [
        (ids("how are you fine thanks"), 3, "t1"),
        (c1 + ids("hi"), len(c1), "c1"),
        (c2 + ids("hello"), len(c2), "c2"),
        (ids("how are you hello") + [0], 3, "t2"),
    ]


def test_chat_template_file_override_and_setup_errors_stop_before_any_checkpoint(address, redis_server, tok_dir,
                                                                                 tmp_path, capsys):
    log = tmp_path / "chat.jsonl"
    log.write_text(json.dumps({"messages": [{"role": "user", "content": "hi"}], "response": "hello"}) + "\n")
    state = tmp_path / "state"
    bare = tmp_path / "bare.json"  # no tokenizer_config.json beside it: no chat template
    bare.write_bytes((tok_dir / "tokenizer.json").read_bytes())
    assert main(["warm", str(log), "--address", address, "--tokenizer", str(bare), "--state-dir", str(state)]) == 1
    assert "has no chat template" in capsys.readouterr().err
    assert main(["warm", str(log), "--address", address, "--state-dir", str(state)]) == 1
    assert "--tokenizer" in capsys.readouterr().err
    assert not list(state.glob("*.json")) and stored(redis_server.url) == []  # nothing skipped for good
    template = tmp_path / "t.jinja"
    template.write_text("{% for m in messages %}{{ m.content }} {% endfor %}")
    assert main(["warm", str(log), "--address", address, "--tokenizer", str(bare), "--chat-template", str(template),
                 "--state-dir", str(state), "--no-progress"]) == 0
    assert stored(redis_server.url) == [(ids("hi hello"), 1, None)]
    with pytest.raises(SystemExit, match="bad tokenizer"):
        main(["warm", str(log), "--address", address, "--tokenizer", str(tmp_path / "missing")])
    with pytest.raises(SystemExit, match="no such file"):
        main(["warm", str(tmp_path / "nope.jsonl"), "--address", address])
    with pytest.raises(SystemExit, match="no usable drafter service at 127.0.0.1:1: UNAVAILABLE"):
        main(["warm", str(log), "--address", "127.0.0.1:1", "--state-dir", str(state)])
    with pytest.raises(SystemExit, match="NOT_FOUND"):
        main(["warm", str(log), "--address", address, "--namespace", "nope", "--state-dir", str(state)])

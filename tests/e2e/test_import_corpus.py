"""`drafter import-corpus` as a process and `drafter frozen`, against a real `drafter serve` process."""

import json
import signal
import subprocess

import grpc
import numpy as np
from test_process import DRAFTER, free_port, start  # the `drafter serve` process helpers
from tokenizers import Tokenizer, models, pre_tokenizers

from drafter_service.api.drafter.v1 import drafter_pb2 as pb
from drafter_service.api.drafter.v1 import drafter_pb2_grpc as pb_grpc
from drafter_service.cli.main import main
from store.frozen_table import load_npz

WORDS = ["[UNK]", "the", "cat", "sat", "on", "mat", "a", "dog", "ran", "to", "it", "and"]
STORY = "the cat sat on the mat and the dog ran to it\n"


def run(*args, check=True):
    done = subprocess.run([DRAFTER, *args], capture_output=True, text=True, timeout=60)
    assert not check or done.returncode == 0, done.stderr
    return done


def cli(capsys, *args):
    """Exit status and output of a `drafter` command run in this process."""
    try:
        status = main(list(args))
    except SystemExit as exc:
        status = exc.code
    captured = capsys.readouterr()
    return status, captured.out + captured.err


def test_import_corpus_list_draft_remove(tmp_path, capsys):
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(WORDS)}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.save(str(tmp_path / "tokenizer.json"))
    corpus = tmp_path / "corpus"
    (corpus / "books").mkdir(parents=True)
    (corpus / "books" / "story.txt").write_text(STORY * 20)
    chats = [{"conversations": [{"from": "human", "value": "the dog"}, {"from": "gpt", "value": STORY}]}] * 3
    (corpus / "chats.jsonl").write_text("".join(json.dumps(c) + "\n" for c in chats) + "{oops\n")
    port = free_port()
    address = f"127.0.0.1:{port}"
    proc = start(tmp_path / "data", port)
    try:
        done = run("import-corpus", str(corpus), "--name", "stories", "--tokenizer", str(tmp_path / "tokenizer.json"),
                   "--address", address, "--roles", "assistant", "--output", str(tmp_path / "t.npz"))
        out = done.stdout
        assert "4 documents, 276 tokens" in out and "pruned 0 rare grams" in out, out
        assert "skipped 1 malformed lines or files" in out and "chats.jsonl:4" in out, out
        assert "stored frozen table 'stories'" in out and "10 leaders, 12 followers" in out, out
        saved, source = load_npz(tmp_path / "t.npz")
        assert len(saved) == 10 and "corpus" in source and "276 tokens" in source
        status, out = cli(capsys, "frozen", "list", "--address", address, "--json")
        listed = json.loads(out)
        assert [(t["name"], t["leaders"], t["followers"]) for t in listed] == [("stories", 10, 12)]
        with grpc.insecure_channel(address) as channel:
            stub = pb_grpc.DrafterStub(channel)
            stub.StartSession(pb.StartSessionRequest(session_id="s", prompt=[WORDS.index("sat")]))
            reply = stub.Draft(pb.DraftRequest(session_id="s", max_nodes=8))
            assert pb.SOURCE_FROZEN in reply.sources
            assert list(reply.token_ids[:3]) == [WORDS.index(w) for w in ("on", "the", "mat")]
        assert cli(capsys, "frozen", "remove", "stories", "--address", address)[0] == 0
        assert cli(capsys, "frozen", "remove", "stories", "--address", address) == (1, "no frozen table 'stories'\n")
        assert "no frozen tables" in cli(capsys, "frozen", "list", "--address", address)[1]
        status, out = cli(capsys, "import-corpus", str(corpus), "--name", "x", "--tokenizer",
                          str(tmp_path / "tokenizer.json"), "--address", address, "--namespace", "nowhere")
        assert status != 0 and "NOT_FOUND" in str(status)
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(30)


def test_token_id_corpus_needs_no_tokenizer_or_service(tmp_path, capsys):
    rng = np.random.default_rng(0)
    lines = [json.dumps({"prompt": rng.integers(0, 50, 5).tolist(), "output": rng.integers(0, 50, 30).tolist()})
             for _ in range(20)]
    (tmp_path / "ids.jsonl").write_text("\n".join(lines) + "\n")
    status, out = cli(capsys, "import-corpus", str(tmp_path / "ids.jsonl"), "--name", "ids", "--no-upload",
                      "--output", str(tmp_path / "ids.npz"), "--leader-capacity", "7", "--follower-capacity", "2")
    assert status == 0 and "20 documents, 700 tokens" in out
    table, _ = load_npz(tmp_path / "ids.npz")
    assert len(table) == 7 and table.followers <= 14
    table.check_invariants(7, 2)

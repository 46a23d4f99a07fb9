"""`drafter distill-draft` and draft-model loading, with a tiny random Llama as the target."""

from __future__ import annotations

import argparse
import json
import signal

import numpy as np
import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from drafter_service.datasets.loaders import Request, load_dataset, write_requests
from drafter_service.model.distill import CHECKPOINT, DistillConfig, add_distill_command, distill, find_checkpoint
from drafter_service.model.distill_data import DistillError, load_sources, read_token_file, split_requests
from drafter_service.model.draft_model import (
    DRAFT_META,
    TOKEN_COUNTS,
    DraftMeta,
    DraftModelError,
    build_draft_from_target,
    choose_layers,
    load_draft_model,
)
from drafter_service.model.hardware import native_bfloat16
from store.embedded_redis import EmbeddedRedis
from store.persistence import RedisPersistence

VOCAB = 128


@pytest.fixture(scope="module")
def target_dir(tmp_path_factory):
    """A tiny random 4-layer Llama (vocab 128, hidden 32) saved as a checkpoint folder."""
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=4,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                         tie_word_embeddings=True)
    model = LlamaForCausalLM(config)
    folder = tmp_path_factory.mktemp("target")
    model.save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    """A repetitive request file: a few phrases in varying order, 40 requests."""
    rng = np.random.default_rng(0)
    phrases = [rng.integers(0, VOCAB, 8) for _ in range(4)]
    reqs = [Request(f"r{i}", np.concatenate([phrases[j] for j in rng.integers(0, 4, 3)]),
                    np.concatenate([phrases[j] for j in rng.integers(0, 4, 5)])) for i in range(40)]
    path = tmp_path_factory.mktemp("data") / "reqs.jsonl"
    write_requests(path, reqs)
    return path


def _run(argv: list[str]) -> int:
    parser = argparse.ArgumentParser()
    add_distill_command(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(["distill-draft", *argv])
    return args.func(args)


def _config(target_dir, out, **kw) -> DistillConfig:
    base = dict(target=str(target_dir), out=str(out), num_layers=2, seq_len=16, batch=4, lr=1e-2, warmup=0,
                schedule="constant", steps=30, eval_requests=6, checkpoint_every=10, target_dtype="float32",
                threads=1)
    return DistillConfig(**{**base, **kw})


def _sources(corpus):
    return [("reqs", read_token_file(corpus))]


def test_choose_layers_spreads_first_and_last():
    assert choose_layers(30, 4) == [0, 10, 19, 29]
    assert choose_layers(30, 1) == [0]
    assert choose_layers(4, 2, "first") == [0, 1]
    with pytest.raises(DraftModelError, match="1 to 4 layers"):
        choose_layers(4, 5)


def test_built_draft_copies_the_targets_layers_and_shares_its_vocabulary(target_dir):
    target = LlamaForCausalLM.from_pretrained(target_dir)
    draft = build_draft_from_target(target, 2)
    assert draft.config.num_hidden_layers == 2 and target.config.num_hidden_layers == 4
    assert draft.lm_head.weight is draft.model.embed_tokens.weight  # tied as in the target
    assert torch.equal(draft.model.embed_tokens.weight, target.model.embed_tokens.weight)
    assert torch.equal(draft.model.layers[1].mlp.up_proj.weight, target.model.layers[3].mlp.up_proj.weight)
    ids = torch.tensor([[1, 2, 3, 4]])
    out = target.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=5, do_sample=False,
                          assistant_model=draft, pad_token_id=0)
    plain = target.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=5, do_sample=False,
                            pad_token_id=0)
    assert torch.equal(out, plain)  # works as transformers' assistant model, output unchanged


def test_training_raises_agreement_and_lowers_kl(target_dir, corpus, tmp_path):
    result = distill(_config(target_dir, tmp_path / "out"), _sources(corpus), progress=False)
    m = result.meta
    assert not result.interrupted and m.steps == 30 and m.tokens_seen > 0
    assert m.kl_after < 0.5 * m.kl_before
    assert m.agreement_after > m.agreement_before
    assert m.eval_tokens > 0 and m.draft_step_ms["float32"] > 0 and m.target_step_ms["bfloat16"] > 0
    model = load_draft_model(tmp_path / "out", vocab_size=VOCAB)
    assert model.config.num_hidden_layers == 2
    assert DraftMeta.read(tmp_path / "out") == m


def test_resume_continues_from_the_checkpoint_like_an_uninterrupted_run(target_dir, corpus, tmp_path):
    whole = distill(_config(target_dir, tmp_path / "whole", steps=20), _sources(corpus), progress=False)
    distill(_config(target_dir, tmp_path / "split", steps=10), _sources(corpus), progress=False)
    state = torch.load(find_checkpoint(tmp_path / "split") / "trainer.pt", weights_only=True)
    assert state["step"] == 10 and state["position"] == 40 and state["optimizer"]["state"]
    resumed = distill(_config(target_dir, tmp_path / "split", steps=20, resume=True), _sources(corpus),
                      progress=False)
    assert resumed.meta.steps == 20 and resumed.meta.agreement_before == whole.meta.agreement_before
    a = load_draft_model(tmp_path / "whole").state_dict()
    b = load_draft_model(tmp_path / "split").state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_sigterm_saves_a_checkpoint_and_resume_finishes(target_dir, corpus, tmp_path, monkeypatch):
    import drafter_service.model.distill as distill_module

    calls = []
    real = distill_module.distill_batch

    def batch_then_sigterm(*args, **kwargs):
        calls.append(1)
        if len(calls) == 3 + 1:  # one evaluation batch before training; SIGTERM during step 3
            signal.raise_signal(signal.SIGTERM)
        return real(*args, **kwargs)

    monkeypatch.setattr(distill_module, "distill_batch", batch_then_sigterm)
    out = tmp_path / "out"
    argv = ["--target", str(target_dir), "--out", str(out), "--tokens", str(corpus), "--layers", "1", "--steps", "6",
            "--seq-len", "16", "--batch", "2", "--eval-requests", "1", "--target-dtype", "float32"]
    assert _run(argv) == 130
    assert torch.load(find_checkpoint(out) / "trainer.pt", weights_only=True)["step"] == 3
    assert not (out / DRAFT_META).exists()
    monkeypatch.setattr(distill_module, "distill_batch", real)
    assert _run([*argv, "--resume"]) == 0
    assert DraftMeta.read(out).steps == 6


def test_resume_refuses_another_layer_count_and_a_missing_checkpoint(target_dir, corpus, tmp_path):
    distill(_config(target_dir, tmp_path / "out", steps=2), _sources(corpus), progress=False)
    with pytest.raises(ValueError, match="has 2 layers, not 3"):
        distill(_config(target_dir, tmp_path / "out", num_layers=3, resume=True), _sources(corpus))
    with pytest.raises(ValueError, match="already holds a checkpoint"):
        distill(_config(target_dir, tmp_path / "out"), _sources(corpus))
    with pytest.raises(ValueError, match="no checkpoint"):
        distill(_config(target_dir, tmp_path / "none", resume=True), _sources(corpus))


def test_init_starts_from_an_earlier_draft_and_records_it(target_dir, corpus, tmp_path):
    first = distill(_config(target_dir, tmp_path / "first", steps=10), _sources(corpus), progress=False).meta
    same = distill(_config(target_dir, tmp_path / "same", steps=0, init=str(tmp_path / "first")), _sources(corpus),
                   progress=False).meta
    assert same.agreement_before == first.agreement_after and same.kl_before == pytest.approx(first.kl_after)
    assert same.initial_draft == str(tmp_path / "first") and same.source_layers == first.source_layers
    a = load_draft_model(tmp_path / "first").state_dict()
    b = load_draft_model(tmp_path / "same").state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)
    first_counts = np.load(tmp_path / "first" / TOKEN_COUNTS)  # the draft has learnt from both runs' data
    assert first_counts.sum() > 0
    assert np.array_equal(np.load(tmp_path / "same" / TOKEN_COUNTS), 2 * first_counts)
    more = distill(_config(target_dir, tmp_path / "more", steps=10, init=str(tmp_path / "first")), _sources(corpus),
                   progress=False).meta
    assert more.kl_after < more.kl_before == pytest.approx(first.kl_after)


def test_init_refuses_another_layer_count_and_a_missing_draft(target_dir, corpus, tmp_path):
    distill(_config(target_dir, tmp_path / "first", steps=2), _sources(corpus), progress=False)
    with pytest.raises(ValueError, match="has 2 layers, not 3; pass --layers 2"):
        distill(_config(target_dir, tmp_path / "out", num_layers=3, init=str(tmp_path / "first")), _sources(corpus))
    with pytest.raises(ValueError, match="--init: no draft model"):
        distill(_config(target_dir, tmp_path / "out", init=str(tmp_path / "none")), _sources(corpus))
    assert find_checkpoint(tmp_path / "out") is None


def test_cli_trains_from_tokens_and_warm_files(target_dir, corpus, tmp_path, capsys):
    warm = tmp_path / "e2e-warm.jsonl"  # the e2e benchmark's warm-up format
    warm.write_text("".join(json.dumps({"id": f"w{i}", "prompt": [1, 2, 3], "output": [4, 5, 6, 7] * 5}) + "\n"
                            for i in range(5)))
    out = tmp_path / "out"
    assert _run(["--target", str(target_dir), "--out", str(out), "--tokens", str(corpus), "--tokens", str(warm),
                 "--layers", "1", "--steps", "3", "--seq-len", "16", "--batch", "2", "--eval-requests", "4",
                 "--target-dtype", "float32"]) == 0
    text = capsys.readouterr().out
    assert "top-1 agreement" in text and "decoding step" in text and "e2e-warm" in text
    assert (out / DRAFT_META).is_file() and (out / CHECKPOINT).is_dir()
    counts = np.load(out / TOKEN_COUNTS)  # the training data's token frequencies, for the service's --card-vocab
    assert counts.shape == (VOCAB,) and counts[4] > 0 and counts[5] > 0


def _store_requests(url: str, corpus) -> int:
    requests = read_token_file(corpus)
    RedisPersistence(url, "ns", vocab_size=VOCAB).append_requests([(r, None) for r in requests])
    return len(requests)


def test_cli_reads_a_namespace_from_redis_and_from_a_data_dir(target_dir, corpus, tmp_path, redis_server):
    _store_requests(redis_server.url, corpus)
    common = ["--target", str(target_dir), "--layers", "1", "--steps", "2", "--seq-len", "16", "--batch", "2",
              "--eval-requests", "2", "--target-dtype", "float32", "--namespace", "ns"]
    assert _run([*common, "--out", str(tmp_path / "a"), "--redis-url", redis_server.url]) == 0
    assert DraftMeta.read(tmp_path / "a").tokens_seen > 0
    with EmbeddedRedis(tmp_path / "data") as server:  # the folder `drafter serve --data-dir` keeps
        _store_requests(server.url, corpus)
    assert _run([*common, "--out", str(tmp_path / "b"), "--data-dir", str(tmp_path / "data")]) == 0
    assert DraftMeta.read(tmp_path / "b").tokens_seen > 0


def test_cli_rejects_out_of_range_token_ids(target_dir, tmp_path):
    path = tmp_path / "bad.jsonl"
    write_requests(path, [Request("ok", [1, 2], [3]), Request("bad", [1, 2], [VOCAB + 5])])
    with pytest.raises(SystemExit, match=rf"bad: request 1 holds token id {VOCAB + 5}.*\[0, {VOCAB}\)"):
        _run(["--target", str(target_dir), "--out", str(tmp_path / "out"), "--tokens", str(path), "--steps", "1"])


def test_cli_needs_a_data_source_and_a_budget(target_dir, tmp_path):
    with pytest.raises(SystemExit, match="no training data"):
        _run(["--target", str(target_dir), "--out", str(tmp_path), "--steps", "1"])
    with pytest.raises(SystemExit, match="--steps and/or --minutes"):
        _run(["--target", str(target_dir), "--out", str(tmp_path), "--dataset", "mtbench"])


def test_skip_leaves_a_data_sets_first_requests_out():
    first = load_dataset("mtbench", 6)
    [(name, seqs)] = load_sources(datasets=["mtbench"], limit=2, skip=4)
    assert name == "mtbench"
    assert [s.tolist() for s in seqs] == [np.concatenate([r.prompt, r.output]).tolist() for r in first[4:6]]
    with pytest.raises(DistillError, match="no requests after skipping"):
        load_sources(datasets=["mtbench"], limit=2, skip=10**6)
    with pytest.raises(DistillError, match="--skip must be >= 0"):
        load_sources(datasets=["mtbench"], skip=-1)


def test_held_out_requests_come_from_every_source_in_turn():
    sources = [("a", [np.arange(5, dtype=np.int32)] * 10), ("b", [np.arange(3, dtype=np.int32)] * 2)]
    train, held = split_requests(sources, 4, seed=0)
    assert [(n, len(s)) for n, s in held] == [("a", 3), ("b", 1)]
    assert [(n, len(s)) for n, s in train] == [("a", 7), ("b", 1)]


def test_load_draft_model_refuses_a_vocabulary_mismatch_and_a_missing_folder(target_dir, tmp_path):
    with pytest.raises(DraftModelError, match=rf"predicts {VOCAB} tokens but namespace 'ns' has vocab_size 1000"):
        load_draft_model(target_dir, vocab_size=1000, namespace="ns")
    with pytest.raises(DraftModelError, match="no draft model at"):
        load_draft_model(tmp_path / "missing")
    (tmp_path / "broken").mkdir()
    (tmp_path / "broken" / "config.json").write_text("{not json")
    with pytest.raises(DraftModelError, match="cannot load"):
        load_draft_model(tmp_path / "broken")
    assert load_draft_model(target_dir, vocab_size=VOCAB).config.num_hidden_layers == 4  # plain checkpoint


def test_bfloat16_is_chosen_only_where_the_device_computes_it_natively(target_dir, tmp_path):
    auto = _config(target_dir, tmp_path / "out", target_dtype="auto")
    assert auto.autocast is None
    emulated, native = auto.resolved(native=False), auto.resolved(native=True)
    assert (emulated.target_dtype, emulated.autocast) == ("float32", False)
    assert (native.target_dtype, native.autocast) == ("bfloat16", True)
    chosen = _config(target_dir, tmp_path / "out", target_dtype="bfloat16", autocast=False)
    assert chosen.resolved(native=False) == chosen  # what was asked for stands
    assert native_bfloat16("cpu", frozenset({"avx2", "avx512f"})) is False
    assert native_bfloat16("cpu", frozenset({"avx2", "avx512_bf16"})) is True
    assert native_bfloat16("cpu", frozenset({"amx_bf16"})) is True
    assert native_bfloat16("mps") is False


def test_cli_defaults_leave_precision_to_the_device(target_dir, tmp_path):
    parser = argparse.ArgumentParser()
    add_distill_command(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(["distill-draft", "--target", str(target_dir), "--out", str(tmp_path / "o"),
                              "--steps", "1", "--tokens", "x.jsonl"])
    assert (args.target_dtype, args.autocast) == ("auto", None)
    with pytest.raises(ValueError, match="target_dtype"):
        _config(target_dir, tmp_path / "out", target_dtype="float16")

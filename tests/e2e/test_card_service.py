"""A namespace with a draft model, end to end: real gRPC server, real channel, reference engine in float32."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import time

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from drafter_service.core.config import (  # noqa: E402
    CardSettings,
    DrafterConfig,
    DraftModelSpec,  # noqa: E402
)
from drafter_service.core.model_gate import ModelGate  # noqa: E402
from drafter_service.model.draft_model import DraftModelError  # noqa: E402
from drafter_service.model.hardware import own_cpus  # noqa: E402
from drafter_service.rpc.server import create_server  # noqa: E402
from drafter_service.service.config import ServiceConfig  # noqa: E402
from drafter_service.service.service import DrafterService  # noqa: E402
from engine_client.admin import stats  # noqa: E402
from engine_client.client import DrafterClient  # noqa: E402
from engines.reference.engine import ReferenceEngine, greedy_reference  # noqa: E402

VOCAB = 96
PROMPT = [5, 17, 33, 2, 71, 8, 40, 12]


def tiny_llama(seed: int) -> transformers.LlamaForCausalLM:
    torch.manual_seed(seed)
    config = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=48, intermediate_size=96, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512)
    return transformers.LlamaForCausalLM(config).float().eval()


@pytest.fixture(scope="module")
def target_folder(tmp_path_factory):
    """A tiny target saved as a checkpoint: the draft model below is the target itself (drafts are often right)."""
    folder = tmp_path_factory.mktemp("target")
    tiny_llama(1).save_pretrained(folder)
    return folder


def service_config(folder, vocab: int = VOCAB, **card: object) -> ServiceConfig:
    settings = CardSettings(**{"width": 8, "top_k": 3, "layers_ahead": 6, "gate": "off", "idle_priority": 0, **card})
    return ServiceConfig(drafter=DrafterConfig(capacity=1 << 14), default_vocab_size=vocab,
                         draft_models=(DraftModelSpec("default", str(folder), card=settings),))


def slow_down(model: torch.nn.Module, seconds: float) -> None:
    """Make every forward pass take ``seconds`` longer, like a target much larger than its draft model."""
    model.register_forward_pre_hook(lambda module, args: time.sleep(seconds))


@pytest.mark.parametrize("correction", [True, False])
def test_card_drafts_keep_greedy_output_exact(target_folder, correction):
    model = transformers.LlamaForCausalLM.from_pretrained(target_folder, dtype=torch.float32).eval()
    truth = greedy_reference(model, PROMPT, 80)
    slow_down(model, 0.03)
    service = DrafterService(service_config(target_folder, correction=correction))
    server, port = create_server(service.config, "127.0.0.1:0", service)
    try:
        with DrafterClient(f"127.0.0.1:{port}", max_nodes=24) as client:
            out = ReferenceEngine(model, client, max_nodes=24).generate(PROMPT, 80)
        figures = stats(f"127.0.0.1:{port}")
    finally:
        server.stop(0)
        service.close()
    assert out.tokens == truth
    accepted = sum(s.accepted for s in out.steps)
    assert figures["draft_model_steps"] > 0
    if correction:
        # the draft model is the target: most accepted tokens came from its cache
        assert figures["draft_model_hits"] > 0 and accepted > 40


def test_the_worker_stops_with_its_session(target_folder):
    service = DrafterService(service_config(target_folder, max_sessions=1))
    try:
        ns = service.start_session("", "a", PROMPT)
        drafts = ns.drafter.draft_model
        card = ns.drafter.session("a").card
        assert card is not None and card.alive
        service.start_session("", "b", PROMPT)  # over max_sessions: drafts without the model
        assert ns.drafter.session("b").card is None
        deadline = time.monotonic() + 10
        while card.cache.size == 0 and time.monotonic() < deadline:
            time.sleep(0.01)
        tree, _ = service.draft("a", [], 16)
        assert "model" in tree.sources
        service.end_session("a", [3])
        assert not card.alive and drafts.open_sessions == 0
    finally:
        service.close()


def test_a_draft_model_with_another_vocabulary_is_refused(target_folder):
    with pytest.raises(DraftModelError, match=rf"predicts {VOCAB} tokens .* vocab_size 1000"):
        DrafterService(service_config(target_folder, vocab=1000))


def test_serve_refuses_a_mismatched_draft_model_with_a_clear_error(target_folder, tmp_path):
    proc = subprocess.run([sys.executable, "-m", "drafter_service.cli.main", "serve", "--address", "127.0.0.1:0",
                           "--data-dir", str(tmp_path / "data"), "--vocab-size", "1000",
                           "--draft-model", str(target_folder)], capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0
    assert "bad draft model" in proc.stderr and "vocab_size 1000" in proc.stderr


def test_on_a_cpu_it_may_share_the_worker_takes_only_idle_cycles(target_folder):
    service = DrafterService(ServiceConfig(drafter=DrafterConfig(capacity=1 << 14), default_vocab_size=VOCAB,
                                           draft_models=(DraftModelSpec("default", str(target_folder)),)))
    try:
        ns = service.start_session("", "a", PROMPT)
        card = ns.drafter.session("a").card
        assert card is not None and card.alive
        deadline = time.monotonic() + 10
        while card.cache.size == 0 and time.monotonic() < deadline:  # the worker has set its own scheduling
            time.sleep(0.01)
        policy = os.sched_getscheduler(card._thread.native_id)
        # this process may run on every CPU unless the machine confined it (then the CPUs are taken as its own)
        assert policy == (os.SCHED_IDLE if own_cpus() == 0 else os.SCHED_OTHER)
        service.end_session("a", [3])
    finally:
        service.close()


def test_a_draft_model_that_cannot_keep_up_is_reported_and_not_served(target_folder, caplog):
    model = transformers.LlamaForCausalLM.from_pretrained(target_folder, dtype=torch.float32).eval()
    truth = greedy_reference(model, PROMPT, 300)
    service = DrafterService(service_config(target_folder, gate="time"))  # the default gate, weighing step times
    drafter = service.namespace("").drafter
    assert drafter.draft_model is not None and drafter.model_gate is not None
    # the default gate's rule on a shorter schedule: a verdict within this short generation
    drafter.model_gate = ModelGate(min_steps=16, phase=0.1, on_running=drafter.draft_model.set_running)
    slow_down(drafter.draft_model.model, 0.25)  # the worker rarely has anything to add
    # the target's steps slowed too: the generation spans several of the gate's phases on a fast machine (its 60
    # steps once took 0.27 s, two phases, and a slow first phase left the verdict unmade)
    slow_down(model, 0.01)
    server, port = create_server(service.config, "127.0.0.1:0", service)
    try:
        with caplog.at_level(logging.WARNING), DrafterClient(f"127.0.0.1:{port}", max_nodes=24) as client:
            out = ReferenceEngine(model, client, max_nodes=24).generate(PROMPT, 300)
        gate = drafter.model_gate
    finally:
        server.stop(0)
        service.close()
    assert out.tokens == truth
    assert gate is not None and gate.verdict == "does not pay" and not gate.serving
    assert "the draft model does not pay on this machine" in caplog.text
    assert "it could not keep up" in caplog.text

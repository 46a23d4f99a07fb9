"""The reference engine drafting through PreSpeculatedSource from a real service: greedy output equals plain greedy
token for token (float32, a tiny random Llama), with pre-speculated trees accepted, and with the service away."""

from __future__ import annotations

import pytest
import torch
from serving import free_port
from transformers import LlamaConfig, LlamaForCausalLM

from drafter_service.core.config import DrafterConfig
from drafter_service.rpc.server import create_server
from drafter_service.service.config import ServiceConfig
from engine_client import DrafterClient, PreSpeculatedSource
from engines.reference.engine import ReferenceEngine, greedy_reference

VOCAB = 100
PROMPT = [5, 17, 42, 8, 99, 3, 61]
OTHER = [7, 7, 31, 64, 2]  # a prompt the service never saw
MAX_NEW = 24

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/engines/reference/conftest.py


@pytest.fixture(scope="module")
def model_and_truth() -> tuple[LlamaForCausalLM, list[int]]:
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                      initializer_range=0.2, attn_implementation="sdpa")
    model = LlamaForCausalLM(cfg).eval()  # float32
    return model, greedy_reference(model, PROMPT, MAX_NEW)


class LongPrefill(PreSpeculatedSource):
    """The source as an engine whose prefill outlasts a round trip sees it: the prompt's tree has landed by the
    first step."""

    def start(self, prompt, max_nodes=0):
        session = super().start(prompt, max_nodes)
        assert self.drain()
        return session


@pytest.fixture
def address():
    server, port = create_server(ServiceConfig(drafter=DrafterConfig(capacity=1 << 16), default_vocab_size=VOCAB),
                                 "127.0.0.1:0")
    yield f"127.0.0.1:{port}"
    server.stop(0)


@pytest.mark.parametrize("adaptive", [False, True])
@pytest.mark.parametrize("padded", [False, True])
def test_generation_with_prespeculated_trees_equals_plain_greedy(model_and_truth, address, padded, adaptive):
    model, truth = model_and_truth
    with DrafterClient(address) as client:  # a copy wrong at every 5th token, then the answer: wrong and right nodes
        corrupted = [(t + 1) % VOCAB if i % 5 == 2 else t for i, t in enumerate(truth)]
        client.ingest([(PROMPT, corrupted, "b"), (PROMPT, truth, "a")])
    with LongPrefill(address, max_nodes=32) as source:
        engine = ReferenceEngine(model, source, max_nodes=8, device="cpu", padded=padded, adaptive=adaptive)
        out = engine.generate(PROMPT, MAX_NEW)
        assert out.tokens == truth
        assert source.figures.hits >= 1  # the first step's tree at least
        if not adaptive:  # (the adaptive budget verifies no draft at first, while it measures the plain step)
            assert out.steps[0].accepted >= 4  # the check above covered accepted drafts
        assert engine.generate(OTHER, MAX_NEW).tokens == greedy_reference(model, OTHER, MAX_NEW)
        assert source.drain()
    with DrafterClient(address) as client:
        assert client.stats()["stored_requests"] == 2 + 2  # each generation stored once


def test_a_service_that_is_away_leaves_the_output_exact(model_and_truth):
    model, truth = model_and_truth
    with PreSpeculatedSource(f"127.0.0.1:{free_port()}", max_nodes=32, timeout=0.05, connect_timeout=0) as source:
        out = ReferenceEngine(model, source, max_nodes=8, device="cpu").generate(PROMPT, MAX_NEW)
    assert out.tokens == truth
    assert source.figures.answers == 0

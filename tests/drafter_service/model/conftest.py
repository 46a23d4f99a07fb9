"""Fixtures shared by the draft-model tests."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="module")
def model():
    """A tiny random Llama (vocabulary 40) in float32: the draft model of the CARD cache tests."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=40, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
    return transformers.LlamaForCausalLM(config).float().eval()

"""A deliberately bad draft model (random weights) never lowers acceptance below the model-free drafter's."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from drafter_service.bench.replay import CoreDrafter, replay  # noqa: E402
from drafter_service.core.config import CardSettings  # noqa: E402
from drafter_service.datasets.loaders import Request  # noqa: E402
from drafter_service.model.card import DraftModelDrafts  # noqa: E402


def _requests(count: int = 12) -> list[Request]:
    """Variants of one answer (a few tokens changed) in the model's vocabulary of 40: the model-free sources draft
    long branches from the earlier requests, which a random model's nodes can only displace."""
    rng = np.random.default_rng(3)
    half = rng.integers(0, 36, 40)
    base = np.concatenate([half, half])
    out = []
    for i in range(count):
        answer = base.copy()
        changed = rng.integers(0, base.size, 5)
        answer[changed] = rng.integers(0, 36, changed.size)
        out.append(Request(f"r{i}", np.concatenate([[38, 39], rng.integers(0, 36, 10)]), answer))
    return out


def confidently_wrong_model():
    """A random Llama whose output head is scaled up: it proposes random tokens with high probabilities."""
    torch.manual_seed(7)
    config = transformers.LlamaConfig(vocab_size=40, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
    model = transformers.LlamaForCausalLM(config).float().eval()
    with torch.no_grad():
        model.lm_head.weight.mul_(30.0)
    return model


def _with_model(model, gate: str) -> CoreDrafter:
    settings = CardSettings(width=8, top_k=3, layers_ahead=4, max_sessions=1, gate=gate)
    return CoreDrafter(name=f"card-{gate}", draft_model=DraftModelDrafts(model, settings))


def test_a_random_draft_model_never_lowers_acceptance_below_the_model_free_drafters():
    reqs = _requests()
    model = confidently_wrong_model()
    free = replay(CoreDrafter(), reqs, budget=16)
    gated_drafter = _with_model(model, "acceptance")
    gated = replay(gated_drafter, reqs, budget=16)
    ungated = replay(_with_model(model, "off"), reqs, budget=16)
    print(f"\nMAT: model-free {free.mat:.3f}, random model gated {gated.mat:.3f}, ungated {ungated.mat:.3f}")
    assert free.mat > 2.0  # the model-free sources do draft here
    assert gated.mat >= free.mat
    gate = gated_drafter.core.model_gate
    assert gate is not None
    figures = gate.figures()
    assert figures.verdict == "does not pay" and not figures.serving
    assert figures.model_tokens < figures.free_tokens  # measured: its nodes only displace accepted ones

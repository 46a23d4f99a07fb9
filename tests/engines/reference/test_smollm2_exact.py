"""Real weights, float32: speculative greedy output equals plain greedy output token for token on SmolLM2-135M."""

from __future__ import annotations

import pytest
import torch

from drafter_service.api.tree import DraftTree, chain
from drafter_service.core.config import DrafterConfig
from drafter_service.datasets.target_model import chat_prompt, load_smollm2
from drafter_service.datasets.tokenizer import load_smollm2_tokenizer
from drafter_service.rpc.server import create_server
from drafter_service.service.config import ServiceConfig
from engine_client.client import DrafterClient
from engines.reference.engine import ReferenceEngine, greedy_reference

MAX_NEW = 40
QUESTION = "Tom has 3 boxes with 12 apples each. He gives away 7 apples. How many apples are left?"


@pytest.fixture(scope="module")
def smollm2():
    """SmolLM2-135M-Instruct in float32, a chat prompt, and its plain greedy continuation."""
    torch.set_num_threads(2)
    model = load_smollm2(torch.float32, "cpu")
    prompt = load_smollm2_tokenizer().encode(chat_prompt(QUESTION)).ids
    return model, prompt, greedy_reference(model, prompt, MAX_NEW + 12)


class Scripted:
    """Drafts a tree of a fixed shape from the true continuation: ``shape(truth_ahead) -> DraftTree``."""

    def __init__(self, truth, shape):
        self.truth, self.shape, self.pos = truth, shape, 0

    def start(self, prompt, max_nodes=0):
        return "s"

    def draft(self, session, accepted, max_nodes=0, step_seconds=0.0, plain_step_seconds=0.0, verify_cost=(),
              estimate_exponent=0.0):
        self.pos += len(accepted)
        return self.shape(self.truth[self.pos:])

    def end(self, session, accepted):
        pass


def _partly_right(ahead):
    """Right for 3 tokens, then wrong; a wrong sibling at the root and a right side branch under node 0."""
    if len(ahead) < 5:
        return chain(ahead)
    bad = [(t + 1) % 49152 for t in ahead]
    toks = (bad[0], ahead[0], ahead[1], ahead[2], bad[3], bad[1])
    parents = (-1, -1, 1, 2, 3, 1)
    return DraftTree(toks, parents, (0.5,) * 6, 3.0)


def _deep(ahead):
    """Three 12-deep branches: one right, two that go wrong at depths 2 and 6."""
    if len(ahead) < 12:
        return chain(ahead)
    branches = [list(ahead[:12]), list(ahead[:2]) + [(ahead[2] + 5) % 49152] + list(ahead[3:12]),
                list(ahead[:6]) + [(ahead[6] + 9) % 49152] + list(ahead[7:12])]
    toks, parents, index = [], [], {}
    for branch in branches:
        parent = -1
        for depth, tok in enumerate(branch):
            key = tuple(branch[:depth + 1])
            if key not in index:
                index[key] = len(toks)
                toks.append(tok)
                parents.append(parent)
            parent = index[key]
    return DraftTree(tuple(toks), tuple(parents), (0.5,) * len(toks), 0.5 * len(toks))


SHAPES = {
    "right": lambda ahead: chain(ahead[:8]),
    "wrong": lambda ahead: chain([(t + 3) % 49152 for t in ahead[:8]]),
    "partly-right": _partly_right,
    "deep": _deep,
}


@pytest.mark.parametrize("shape", SHAPES)
def test_speculative_greedy_equals_plain_greedy(smollm2, shape):
    model, prompt, truth = smollm2
    out = ReferenceEngine(model, Scripted(truth, SHAPES[shape]), max_nodes=64).generate(prompt, MAX_NEW)
    assert out.tokens == truth[:MAX_NEW]
    accepted = sum(s.accepted for s in out.steps)
    assert (accepted == 0) if shape == "wrong" else (accepted >= MAX_NEW // 2)


def test_drafts_from_a_real_service_keep_the_output_exact(smollm2):
    model, prompt, truth = smollm2
    cfg = ServiceConfig(drafter=DrafterConfig(capacity=1 << 16), default_vocab_size=49152)
    server, port = create_server(cfg, "127.0.0.1:0")
    try:
        with DrafterClient(f"127.0.0.1:{port}", max_nodes=16) as client:
            # the service has seen this answer and a corrupted copy of it: right and wrong branches
            corrupted = [(t + 1) % 49152 if i % 7 == 3 else t for i, t in enumerate(truth)]
            client.ingest([(prompt, truth[:MAX_NEW], "a"), (prompt, corrupted[:MAX_NEW], "b")])
            out = ReferenceEngine(model, client, max_nodes=16).generate(prompt, MAX_NEW)
    finally:
        server.stop(0)
    assert out.tokens == truth[:MAX_NEW]
    assert len(out.steps) < MAX_NEW // 2  # drafts were accepted, so the check above covered them

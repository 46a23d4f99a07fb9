"""The reference engine: speculative greedy output equals plain greedy output token for token, whatever the drafts."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from transformers import Gemma3ForCausalLM, Gemma3TextConfig, LlamaConfig, LlamaForCausalLM

from drafter_service.api.tree import EMPTY_TREE, DraftTree, chain
from drafter_service.api.verify_budget import StepCostCurve, VerifyBudget
from engine_client.draft_source import DraftSource, NoDrafts
from engines.reference.engine import GenerationResult, ReferenceEngine, default_device, greedy_reference

VOCAB = 100
PROMPT = [5, 17, 42, 8, 99, 3, 61]  # longer than the Gemma sliding window below
MAX_NEW = 24
REPO = Path(__file__).resolve().parents[3]


pytestmark = pytest.mark.usefixtures("one_thread")  # tests/engine_client/conftest.py


def tiny_llama(attn: str = "sdpa") -> LlamaForCausalLM:
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                      initializer_range=0.2, attn_implementation=attn)
    return LlamaForCausalLM(cfg).eval()


def tiny_gemma(attn: str = "eager") -> Gemma3ForCausalLM:
    torch.manual_seed(0)
    cfg = Gemma3TextConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
                           num_attention_heads=4, num_key_value_heads=2, head_dim=16, query_pre_attn_scalar=16,
                           sliding_window=4, max_position_embeddings=256, initializer_range=0.2,
                           tie_word_embeddings=False,
                           layer_types=["sliding_attention", "full_attention", "sliding_attention"],
                           attn_implementation=attn)
    return Gemma3ForCausalLM(cfg).eval()


MODELS = {"llama-sdpa": lambda: tiny_llama("sdpa"), "llama-eager": lambda: tiny_llama("eager"),
          "gemma-window4": lambda: tiny_gemma("eager"), "gemma-window4-sdpa": lambda: tiny_gemma("sdpa")}
_cache: dict[str, tuple[torch.nn.Module, list[int]]] = {}


def model_and_truth(kind: str) -> tuple[torch.nn.Module, list[int]]:
    """A tiny model and its plain greedy continuation of PROMPT (with lookahead for deep drafts)."""
    if kind not in _cache:
        model = MODELS[kind]()
        _cache[kind] = (model, greedy_reference(model, PROMPT, MAX_NEW + 40))
    return _cache[kind]


def wrong(tok: int, k: int = 1) -> int:
    return (tok + k) % VOCAB


class OracleSource:
    """A test draft source that knows the true greedy continuation and drafts a tree of a scripted shape from it."""

    def __init__(self, truth: list[int], shape: Callable[[list[int]], DraftTree]) -> None:
        self.truth = truth
        self.shape = shape
        self.pos = 0
        self.calls: list[tuple[list[int], int, float]] = []
        self.ended: list[int] | None = None
        self.trees: list[DraftTree] = []
        self.plain: list[float] = []

    def start(self, prompt, max_nodes=0):
        assert list(prompt) == PROMPT
        self.pos, self.calls, self.ended, self.trees, self.plain = 0, [], None, [], []
        return "oracle"

    def draft(self, session, accepted, max_nodes=0, step_seconds=0.0, plain_step_seconds=0.0, verify_cost=(),
              estimate_exponent=0.0):
        assert session == "oracle"
        self.calls.append((list(accepted), max_nodes, step_seconds))
        self.plain.append(plain_step_seconds)
        self.pos += len(accepted)
        tree = self.shape(self.truth[self.pos:])
        tree.check_invariants()
        self.trees.append(tree)
        return tree

    def end(self, session, accepted):
        self.ended = list(accepted)


def deep_tree(up: list[int]) -> DraftTree:
    """The right path 12 deep (60 nodes), with two wrong siblings before the right child at every level, each with the
    right *next* token below it (a trap for verification that ignores parents); accepted nodes lie scattered."""
    toks: list[int] = []
    parents: list[int] = []

    def add(tok: int, parent: int) -> int:
        toks.append(tok)
        parents.append(parent)
        return len(toks) - 1

    node = -1
    for d in range(12):
        for k in (1, 2):
            w = add(wrong(up[d], k), node)
            add(up[d + 1], w)
        node = add(up[d], node)
    return DraftTree(tuple(toks), tuple(parents), tuple(1.0 for _ in toks), float(len(toks)))


def bushy_tree(up: list[int]) -> DraftTree:
    """60 nodes breadth first, two children per node: the right token and a wrong one below right nodes, two wrong
    ones elsewhere. Levels 1-3 take nodes 0-13, so a cut to 10 nodes still holds the right path three deep."""
    toks: list[int] = []
    parents: list[int] = []
    depth: list[int] = []
    right: list[bool] = []
    frontier = [-1]
    while len(toks) < 60:
        nxt = []
        for p in frontier:
            d = 0 if p < 0 else depth[p]
            on_path = p < 0 or right[p]
            for k in (0, 1):
                if len(toks) == 60:
                    break
                ok = on_path and k == 0
                toks.append(up[d] if ok else wrong(up[d], k + 1))
                parents.append(p)
                depth.append(d + 1)
                right.append(ok)
                nxt.append(len(toks) - 1)
        frontier = nxt
    return DraftTree(tuple(toks), tuple(parents), (1.0,) * 60, 60.0)


SHAPES: dict[str, tuple[Callable[[list[int]], DraftTree], Callable[[GenerationResult], bool]]] = {
    # name: (tree from the upcoming true tokens, what the step statistics must show)
    "all right": (lambda up: chain(up[:5]), lambda r: all(s.accepted == 5 for s in r.steps)),
    "all wrong": (lambda up: chain([wrong(t) for t in up[:5]]), lambda r: all(s.accepted == 0 for s in r.steps)),
    "partly right": (lambda up: chain(up[:2] + [wrong(up[2])] + up[3:6]),
                     lambda r: all(s.accepted == 2 for s in r.steps)),
    "deep and branchy": (deep_tree, lambda r: all(s.accepted == 12 for s in r.steps[:-1])),
    "empty": (lambda up: EMPTY_TREE, lambda r: all(s.drafted == 0 and s.accepted == 0 for s in r.steps)),
}


@pytest.mark.parametrize("kind", list(MODELS))
def test_no_drafts_equals_plain_greedy(kind):
    model, truth = model_and_truth(kind)
    result = ReferenceEngine(model, NoDrafts(), device="cpu").generate(PROMPT, MAX_NEW)
    assert result.tokens == truth[:MAX_NEW]
    assert len(result.steps) == MAX_NEW and all(s.drafted == 0 for s in result.steps)
    assert ReferenceEngine(model, device="cpu").generate(PROMPT, MAX_NEW).tokens == truth[:MAX_NEW]


@pytest.mark.parametrize("steps", ["exact", "padded"])
@pytest.mark.parametrize("shape", list(SHAPES))
@pytest.mark.parametrize("kind", list(MODELS))
def test_speculative_greedy_equals_plain_greedy(kind, shape, steps):
    """Exact steps run each tree at its size; padded ones run what the CUDA graphs capture (every tree padded to
    its bucket, attention over every cache slot, fixed-size moves), eagerly."""
    model, truth = model_and_truth(kind)
    make, stats_ok = SHAPES[shape]
    source = OracleSource(truth, make)
    engine = ReferenceEngine(model, source, max_nodes=64, device="cpu", padded=steps == "padded")
    result = engine.generate(PROMPT, MAX_NEW)
    assert result.tokens == truth[:MAX_NEW]
    assert [s.padded for s in result.steps] == [engine.runner(0).bucket(s.drafted) for s in result.steps]
    assert stats_ok(result), [(s.drafted, s.accepted) for s in result.steps]
    assert [s.drafted for s in result.steps] == [len(t) for t in source.trees]
    # the protocol: accepted tokens since the last call, then the final ones at end; together, the output
    assert source.calls[0][0] == []
    assert sum((c[0] for c in source.calls), []) + source.ended == result.tokens
    assert all(c[1] == 64 for c in source.calls)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a CUDA device")
@pytest.mark.parametrize("kind", ["llama-sdpa", "gemma-window4-sdpa"])
def test_steps_replayed_from_cuda_graphs_equal_plain_greedy(kind):
    model, _ = model_and_truth(kind)
    model = model.to("cuda")
    truth = greedy_reference(model, PROMPT, MAX_NEW + 40)
    for shape in ("all right", "partly right", "deep and branchy", "empty"):
        source = OracleSource(truth, SHAPES[shape][0])
        engine = ReferenceEngine(model, source, max_nodes=64)
        assert engine.runner(0).graphs
        assert engine.generate(PROMPT, MAX_NEW).tokens == truth[:MAX_NEW], shape
    model.to("cpu")


def test_a_padded_step_is_filled_with_more_of_the_tree():
    model, truth = model_and_truth("llama-sdpa")

    class OneNode(VerifyBudget):
        def choose(self, probs, limit=None, parents=None):
            return 1

    for padded, drafted in ((False, 1), (True, 4)):
        source = OracleSource(truth, lambda up: chain(up[:10]))
        engine = ReferenceEngine(model, source, max_nodes=64, device="cpu", adaptive=True, budget=OneNode(),
                                 padded=padded)
        result = engine.generate(PROMPT, MAX_NEW)
        assert result.tokens == truth[:MAX_NEW]
        assert {s.drafted for s in result.steps[:-1]} == {drafted}
        assert {s.accepted for s in result.steps[:-1]} == {drafted}


def test_a_tree_longer_than_max_nodes_is_cut_to_its_prefix():
    model, truth = model_and_truth("llama-sdpa")
    source = OracleSource(truth, bushy_tree)
    result = ReferenceEngine(model, source, max_nodes=10, device="cpu").generate(PROMPT, MAX_NEW)
    assert result.tokens == truth[:MAX_NEW]
    assert all(len(t) == 60 for t in source.trees)
    assert all(s.drafted == 10 for s in result.steps)
    assert all(s.accepted == 3 for s in result.steps)  # the right path's first three levels fit in 10 nodes


def test_output_is_cut_to_max_new_tokens_exactly():
    model, truth = model_and_truth("gemma-window4")
    source = OracleSource(truth, lambda up: chain(up[:8]))
    result = ReferenceEngine(model, source, device="cpu").generate(PROMPT, 10)
    assert result.tokens == truth[:10]
    assert [s.accepted for s in result.steps] == [8, 8]  # 9 + 9 tokens produced, the last 8 dropped
    assert source.ended == truth[9:10]


def test_generation_stops_after_eos():
    model, truth = model_and_truth("llama-sdpa")
    eos = truth[6]
    stop = truth.index(eos)
    source = OracleSource(truth, lambda up: chain(up[:4]))
    result = ReferenceEngine(model, source, device="cpu").generate(PROMPT, MAX_NEW, eos_token_id=[VOCAB + 1, eos])
    assert result.tokens == truth[: stop + 1]
    assert source.ended[-1] == eos
    result = ReferenceEngine(model, NoDrafts(), device="cpu").generate(PROMPT, MAX_NEW, eos_token_id=eos)
    assert result.tokens == truth[: stop + 1]


class AnyPromptOracle(OracleSource):
    """An oracle for any prompt, drafting a wrong root child, then the next three right tokens."""

    def __init__(self, truth: list[int]) -> None:
        super().__init__(truth, self._shape)

    @staticmethod
    def _shape(up: list[int]) -> DraftTree:
        if len(up) < 3:
            return EMPTY_TREE
        return DraftTree((wrong(up[0]), *up[:3]), (-1, -1, 1, 2), (1.0,) * 4, 4.0)

    def start(self, prompt, max_nodes=0):
        self.pos, self.calls, self.ended, self.trees, self.plain = 0, [], None, [], []
        return "oracle"


def test_single_token_prompt_and_zero_budget():
    model, _ = model_and_truth("gemma-window4")
    want = greedy_reference(model, [7], 12)
    engine = ReferenceEngine(model, AnyPromptOracle(want), device="cpu")
    result = engine.generate([7], 12)
    assert result.tokens == want
    assert sum(s.accepted for s in result.steps) >= 6
    assert engine.generate([7], 0).tokens == []
    with pytest.raises(ValueError):
        engine.generate([], 3)


def test_step_seconds_report_the_previous_verification():
    model, truth = model_and_truth("llama-sdpa")
    source = OracleSource(truth, lambda up: chain(up[:3]))
    result = ReferenceEngine(model, source, device="cpu").generate(PROMPT, MAX_NEW)
    secs = [c[2] for c in source.calls]
    assert secs[0] == 0.0
    assert all(s > 0 for s in secs[1:])
    for s, reported in zip(result.steps, secs[1:], strict=False):
        assert reported == pytest.approx(s.verify_seconds)
        assert s.seconds >= s.draft_seconds >= 0


def test_plain_step_seconds_report_the_cost_fit_at_each_call():
    model, truth = model_and_truth("llama-sdpa")
    source = OracleSource(truth, lambda up: chain(up[:len(up) % 7]))  # trees of 0 to 6 nodes
    engine = ReferenceEngine(model, source, device="cpu")
    given = []
    curve = engine.budget.curve
    plain_seconds = curve.plain_seconds

    def recorded():
        given.append(plain_seconds())
        return given[-1]

    curve.plain_seconds = recorded
    engine.generate(PROMPT, MAX_NEW)
    assert source.plain == given and given[0] == 0.0  # nothing measured before the first step
    assert any(p > 0 for p in given)


def wrong_chain(up: list[int]) -> DraftTree:
    """Eight confident nodes that are all wrong (the true next token plus one, and so on)."""
    return chain([(t + 1) % VOCAB for t in up[:8]], [0.9] * len(up[:8]))


def test_adaptive_engine_cuts_trees_itself_and_stops_verifying_confident_wrong_drafts():
    model, truth = model_and_truth("llama-sdpa")
    costs = []

    class Recording(OracleSource):
        def draft(self, session, accepted, max_nodes=0, step_seconds=0.0, plain_step_seconds=0.0, verify_cost=(),
                  estimate_exponent=0.0):
            costs.append(list(verify_cost))
            return super().draft(session, accepted, max_nodes, step_seconds, plain_step_seconds, verify_cost)

    class SteepCurve(StepCostCurve):
        """Step times as on a CPU where a node costs a whole plain step, whatever this machine's load."""

        def observe(self, nodes, seconds):
            super().observe(nodes, 0.1 * (1 + nodes))

    source = Recording(truth, wrong_chain)
    engine = ReferenceEngine(model, source, device="cpu", adaptive=True, budget=VerifyBudget(SteepCurve()))
    result = engine.generate(PROMPT, 40)
    assert result.tokens == truth[:40]
    assert costs and all(c == [] for c in costs)  # the whole tree is asked for; the engine cuts it
    assert result.steps[0].drafted == 0  # the first step is plain and measures t(0)
    assert all(s.accepted == 0 for s in result.steps)
    late = result.steps[len(result.steps) // 2:]
    assert sum(s.drafted for s in late) <= 2  # calibrated down: at most a probe node now and then
    assert engine.budget.calibration(0.9) < 0.5  # the estimate of 0.9 is calibrated well down
    # while drafting is off the engine does not ask every step; every token still reaches the source, in order
    assert len(source.calls) < len(result.steps) - 10
    assert [t for call in source.calls for t in call[0]] + source.ended == truth[:40]


def test_adaptive_engine_verifies_drafts_that_pay():
    model, truth = model_and_truth("llama-sdpa")
    engine = ReferenceEngine(model, OracleSource(truth, lambda up: chain(up[:8])), device="cpu", adaptive=True)
    result = engine.generate(PROMPT, MAX_NEW)
    assert result.tokens == truth[:MAX_NEW]
    assert len(result.steps) < MAX_NEW // 2  # right drafts are taken: several tokens per step


def test_protocol_and_device_defaults():
    assert isinstance(OracleSource([], chain), DraftSource)
    assert default_device() == torch.device("cuda" if torch.cuda.is_available() else "cpu")
    model, _ = model_and_truth("llama-sdpa")
    assert ReferenceEngine(model).device == default_device()


def test_importing_the_client_does_not_import_torch():
    code = ("import sys, engine_client, engine_client.draft_source; "
            "assert 'torch' not in sys.modules, 'torch was imported'")
    subprocess.run([sys.executable, "-c", code], cwd=REPO, check=True)


def test_while_drafting_is_off_the_engine_asks_only_at_each_probe():
    model, truth = model_and_truth("llama-sdpa")
    steps = [0]
    asked_at = []

    class Recording(OracleSource):
        def draft(self, session, accepted, max_nodes=0, step_seconds=0.0, plain_step_seconds=0.0, verify_cost=(),
                  estimate_exponent=0.0):
            asked_at.append(steps[0])
            return super().draft(session, accepted, max_nodes, step_seconds, plain_step_seconds, verify_cost)

    class SteepCurve(StepCostCurve):
        def observe(self, nodes, seconds):
            steps[0] += 1
            super().observe(nodes, 0.1 * (1 + nodes))

    budget = VerifyBudget(SteepCurve(), probe_every=4, max_probe_every=4)
    engine = ReferenceEngine(model, Recording(truth, wrong_chain), device="cpu", adaptive=True, budget=budget)
    assert engine.generate(PROMPT, 40).tokens == truth[:40]
    gaps = [b - a for a, b in zip(asked_at, asked_at[1:], strict=False)][-5:]
    assert gaps == [4] * 5  # a step taken without asking counts once towards the next probe

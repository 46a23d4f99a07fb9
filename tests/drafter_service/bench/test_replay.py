"""Tests of the replay's chain mode: one path of at most k tokens per step, made as each drafter makes it."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from types import SimpleNamespace

import numpy as np
import pytest

import engines.vllm.proposer as vllm_module
from drafter_service.api.tree import EMPTY_TREE, DraftTree, accept_greedy, best_chain, chain
from drafter_service.bench.peers import ArcticSuffixDrafter, PromptLookupDrafter, arctic_available
from drafter_service.bench.protocol import ChainDrafter, ReplayDrafter
from drafter_service.bench.replay import (
    CoreDrafter,
    Mode,
    chain_proposer,
    hindsight_name,
    path_tree,
    replay,
    replay_hindsight,
)
from drafter_service.core.drafter import Drafter
from drafter_service.datasets.loaders import Request
from engine_client.step_batch import PackedBatch
from engines.vllm import DrafterProposer, ProposerSettings


def _requests(seed: int = 0, count: int = 8) -> list[Request]:
    """Requests whose outputs are variants of one answer (a few tokens changed), so drafts are long and branch; the
    answer repeats its first half, so drafts from the request's own tokens are long too."""
    rng = np.random.default_rng(seed)
    half = rng.integers(0, 60, 45)
    base = np.concatenate([half, half])
    out = []
    for i in range(count):
        answer = base.copy()
        changed = rng.integers(0, base.size, 6)
        answer[changed] = rng.integers(0, 60, changed.size)
        out.append(Request(f"r{i}", np.concatenate([[70, 71], rng.integers(0, 60, 12)]), answer))
    return out


class TreeOnly:
    """A drafter without ``propose_chain`` that drafts wide, deep trees (every one of drafter's paths)."""

    name = "tree-only"

    def __init__(self) -> None:
        self.inner = CoreDrafter()

    def start(self, request_id: str, prompt: Sequence[int]) -> None:
        self.inner.start(request_id, prompt)

    def extend(self, request_id: str, tokens: Sequence[int]) -> None:
        self.inner.extend(request_id, tokens)

    def propose(self, request_id: str, max_nodes: int) -> DraftTree:
        return self.inner.propose(request_id, max_nodes)

    def end(self, request_id: str) -> None:
        self.inner.end(request_id)


class ChainSpy:
    """Forwards to a drafter and keeps every chain the replay gets from it in chain mode."""

    def __init__(self, inner: ReplayDrafter) -> None:
        self.inner, self.name = inner, inner.name
        self.make = chain_proposer(inner)
        self.chains: list[DraftTree] = []

    def start(self, request_id: str, prompt: Sequence[int]) -> None:
        self.inner.start(request_id, prompt)

    def extend(self, request_id: str, tokens: Sequence[int]) -> None:
        self.inner.extend(request_id, tokens)

    def propose(self, request_id: str, max_nodes: int) -> DraftTree:
        raise AssertionError("chain mode asked for a tree")

    def propose_chain(self, request_id: str, k: int) -> DraftTree:
        self.chains.append(self.make(request_id, k))
        return self.chains[-1]

    def end(self, request_id: str) -> None:
        self.inner.end(request_id)


def _drafters() -> list[ReplayDrafter]:
    out: list[ReplayDrafter] = [CoreDrafter(), PromptLookupDrafter(num_pred_tokens=2), TreeOnly()]
    if arctic_available():
        out += [ArcticSuffixDrafter.vllm_suffix(), ArcticSuffixDrafter.vllm_suffix(max_spec_factor=4.0)]
    return out


@pytest.mark.parametrize("k", [1, 3, 8])
def test_chain_mode_proposes_one_path_of_at_most_k_tokens(k: int) -> None:
    reqs = _requests()
    for drafter in _drafters():
        spy = ChainSpy(drafter)
        result = replay(spy, reqs, k, "set", mode="chain")
        assert result.mode == "chain" and result.label == f"chain {k}"
        assert len(spy.chains) == result.steps
        for tree in spy.chains:
            tree.check_invariants(max_nodes=k)
            assert tree.parents == tuple(range(-1, len(tree) - 1)), f"{drafter.name} drafted a tree"
        # the variants repeat long stretches: every drafter fills some chains to k (the cap is what binds)
        assert max(len(t) for t in spy.chains) == k, drafter.name
        assert result.nodes == sum(len(t) for t in spy.chains)


def test_prompt_lookup_chains_take_k_as_num_pred_tokens() -> None:
    drafter = PromptLookupDrafter(num_pred_tokens=2)
    drafter.start("a", list(range(20)) + [0, 1])
    assert isinstance(drafter, ChainDrafter)
    assert list(drafter.propose_chain("a", 7).token_ids) == list(range(2, 9))
    assert len(drafter.propose("a", 7)) == 2


def test_replay_refuses_a_tree_in_chain_mode() -> None:
    class Forked(TreeOnly):
        def propose_chain(self, request_id: str, k: int) -> DraftTree:
            return DraftTree((1, 2), (-1, -1), (0.5, 0.5), 1.0)

    with pytest.raises(AssertionError, match="not a chain"):
        replay(Forked(), _requests(count=1), 4, mode="chain")


def test_tree_only_drafters_get_the_best_path_of_a_proposer_sized_tree() -> None:
    a, b = TreeOnly(), TreeOnly()  # fed alike: one makes chains, the other shows its tree
    req = _requests()
    for drafter in (a, b):
        for r in req[:-1]:
            drafter.start(r.request_id, r.prompt.tolist())
            drafter.extend(r.request_id, r.output.tolist())
            drafter.end(r.request_id)
        drafter.start("last", req[-1].prompt.tolist())
        drafter.extend("last", req[-1].output[:5].tolist())
    for k in (2, 5, 12):
        tree = b.propose("last", max(32, 4 * k))
        got = chain_proposer(a)("last", k)
        assert list(got.token_ids) == best_chain(tree, k) and len(got) > 0
        assert got == path_tree(tree, best_chain(tree, k))  # the nodes keep their estimates


class CoreClient:
    """A stand-in for DrafterClient backed by drafter's core in process, as the service drafts for a session."""

    built: list[CoreClient] = []

    def __init__(self, address: str, namespace: str = "", *, max_nodes: int, **kwargs: object) -> None:
        self.core, self.max_nodes, self.vocab_size = Drafter(), max_nodes, None
        self.sessions = 0
        CoreClient.built.append(self)

    def start(self, prompt: Sequence[int], max_nodes: int = 0, open_now: bool = True) -> str:
        self.sessions += 1
        self.core.start(f"s{self.sessions}", prompt)
        return f"s{self.sessions}"

    def draft_batch(self, items: Sequence[tuple[str, Sequence[int]]], max_nodes: int = 0) -> list[DraftTree]:
        out = []
        for session, gained in items:
            if len(gained):
                self.core.extend(session, gained)
            out.append(self.core.propose(session, max_nodes or self.max_nodes))
        return out

    def draft_batch_packed(self, items: Sequence[tuple[str, Sequence[int]]], max_nodes: int = 0,
                           ends: Sequence[tuple[str, Sequence[int]]] = ()) -> PackedBatch:
        trees = PackedBatch.of_trees(self.draft_batch(items, max_nodes))
        for session, accepted in ends:  # last, as the service takes them
            self.end(session, accepted)
        return trees

    def end_batch_async(self, ends: Sequence[tuple[str, Sequence[int]]]) -> Callable[[], None]:
        def settle() -> None:  # once the step's trees were drafted, as the service answers them
            for session, accepted in ends:
                self.end(session, accepted)

        return settle

    def end(self, session: str, accepted: Sequence[int]) -> None:
        self.core.end(session, accepted)
        self.core.rebuild()

    available, buffered = True, 0

    def flush(self) -> None:
        pass


@pytest.mark.parametrize("k", [2, 4, 9])
def test_drafter_chains_are_the_vllm_proposers_chains(monkeypatch, k: int) -> None:
    """The vLLM proposer, over a service core, and CoreDrafter.propose_chain, fed alike, propose the same chains."""
    monkeypatch.setattr(vllm_module, "DrafterClient", CoreClient)
    monkeypatch.delenv("DRAFTER_MAX_NODES", raising=False)
    # The replay verifies for free, as a GPU at small batch does: the default proposer's chains before any cut by
    # step costs, which has no step times to learn from here.
    monkeypatch.setenv("DRAFTER_COST_AWARE", "0")
    monkeypatch.setenv("DRAFTER_CHAIN_MIN_PROB", str(ProposerSettings().chain_min_prob))
    monkeypatch.setenv("DRAFTER_PRESPECULATE", "0")  # every step's chain from the tree for its own context
    max_len = 4096
    config = SimpleNamespace(speculative_config=SimpleNamespace(num_speculative_tokens=k),
                             model_config=SimpleNamespace(max_model_len=max_len, get_vocab_size=lambda: 100))
    proposer = DrafterProposer(config)
    runner = SimpleNamespace(drafter=proposer, requests={},
                             input_batch=SimpleNamespace(req_ids=[], num_prompt_tokens=np.zeros(1, dtype=np.int64)))
    proposer._runner = runner
    proposer.load_model()
    ours = CoreDrafter()
    drafted = 0
    for req in _requests(seed=3):
        rid, out = req.request_id, req.output.tolist()
        tokens = np.zeros((1, max_len), dtype=np.int32)
        seq = req.prompt.tolist()
        runner.requests[rid] = SimpleNamespace(sampling_params=None)
        runner.input_batch.req_ids = [rid]
        runner.input_batch.num_prompt_tokens[0] = len(seq)
        ours.start(rid, seq)
        pos, gained = 0, [out[0]]  # vLLM drafts first after the prefill, with the first output token
        while pos < len(out):
            seq += gained
            pos += len(gained)
            tokens[0, :len(seq)] = seq
            theirs = proposer.propose([gained], np.array([len(seq)]), tokens)[0]
            ours.extend(rid, gained)
            mine = ours.propose_chain(rid, k)
            assert list(mine.token_ids) == theirs
            drafted += len(theirs)
            accepted, _ = accept_greedy(mine, out[pos:])
            gained = out[pos:pos + accepted + 1]
        ours.end(rid)
        del runner.requests[rid]
        runner.input_batch.req_ids = []
        proposer.propose([], np.zeros(0, dtype=np.int32), tokens)  # a step without rows ends the request
        assert proposer._tracker is not None and proposer._tracker.speculator.drain()  # ended as ``ours`` was
    assert drafted > 0
    assert CoreClient.built[-1].max_nodes == max(32, 4 * k)


class HalfKnowing:
    """Drafts the true continuation, but only over one half of each answer (the first or the second); else nothing."""

    def __init__(self, name: str, requests: Sequence[Request], first_half: bool) -> None:
        self.name = name
        self.outputs = {r.request_id: r.output.tolist() for r in requests}
        self.first_half = first_half
        self.pos: dict[str, int] = {}

    def start(self, request_id: str, prompt: Sequence[int]) -> None:
        self.pos[request_id] = 0

    def extend(self, request_id: str, tokens: Sequence[int]) -> None:
        out, pos = self.outputs[request_id], self.pos[request_id]
        assert list(tokens) == out[pos:pos + len(tokens)], "extended with tokens that are not the answer's next"
        self.pos[request_id] = pos + len(tokens)

    def propose(self, request_id: str, max_nodes: int) -> DraftTree:
        out, pos = self.outputs[request_id], self.pos[request_id]
        if (pos < len(out) // 2) != self.first_half:
            return EMPTY_TREE
        return chain(out[pos:pos + max_nodes])

    def end(self, request_id: str) -> None:
        assert self.pos.pop(request_id) == len(self.outputs[request_id]), "ended before the whole answer"


@pytest.mark.parametrize("mode", ["tree", "chain"])
def test_hindsight_takes_each_step_the_draft_that_got_most_accepted(mode: Mode) -> None:
    reqs = _requests(count=3)
    budget = 4
    first, second = (HalfKnowing(n, reqs, h) for n, h in (("first", True), ("second", False)))
    alone = [replay(HalfKnowing(d.name, reqs, d.first_half), reqs, budget, mode=mode) for d in (first, second)]
    both = replay_hindsight([first, second], reqs, budget, "set", mode=mode)
    assert both.drafter == hindsight_name(["first", "second"]) == "hindsight(first,second)"
    # one of the two knows every step's answer: each step accepts the whole budget (or the rest of the answer)
    assert both.emitted == sum(r.output.size for r in reqs)
    assert both.steps == sum(-(-r.output.size // (budget + 1)) for r in reqs)
    assert both.mat > max(r.mat for r in alone)
    assert all(r.output.size % (budget + 1) == 0 for r in reqs)  # so every step drafts and accepts the budget
    assert both.hits == both.steps and both.nodes == both.emitted - both.steps == budget * both.steps


def test_hindsight_refuses_an_empty_choice_and_a_tree_in_chain_mode() -> None:
    with pytest.raises(ValueError, match="at least one drafter"):
        replay_hindsight([], _requests(count=1), 4)

    class Forked(TreeOnly):
        def propose_chain(self, request_id: str, k: int) -> DraftTree:
            return DraftTree((1, 2), (-1, -1), (0.5, 0.5), 1.0)

    with pytest.raises(AssertionError, match="not a chain"):
        replay_hindsight([CoreDrafter(), Forked()], _requests(count=1), 4, mode="chain")

"""DrafterProposer against a real service over a real channel, driven the way vLLM 0.32's model runner drives it.

The runner here is a stand-in with the attributes the proposer reads (``input_batch.req_ids``,
``input_batch.num_prompt_tokens``, ``requests``); tests/vllm runs the proposer inside a real vLLM engine.
"""

from __future__ import annotations

import threading
import time
from types import SimpleNamespace

import numpy as np
import pytest

from drafter_service.api.tree import DraftTree, best_chain
from drafter_service.api.verify_budget import VerifyBudget
from drafter_service.core.config import DrafterConfig
from drafter_service.rpc.server import create_server
from drafter_service.service.config import ServiceConfig
from engine_client import DrafterClient
from engines.vllm import (
    FIXED_MIN_PROB,
    DrafterProposer,
    ProposerSettings,
    check_vllm,
    drafting_rank,
    stop_tokens,
)

VOCAB = 300
MAX_LEN = 256
K = 4


class Runner:
    """The parts of vLLM's model runner the proposer uses; rows are filled as vLLM's bookkeeping fills them."""

    def __init__(self, proposer: DrafterProposer, rows: int = 8) -> None:
        self.drafter = proposer
        self.input_batch = SimpleNamespace(req_ids=[], num_prompt_tokens=np.zeros(rows, dtype=np.int64))
        self.requests: dict[str, SimpleNamespace] = {}
        self.token_ids = np.full((rows, MAX_LEN), -7, dtype=np.int32)  # -7: stale garbage past each row's end
        self.num_tokens = np.zeros(rows, dtype=np.int32)

    def load_model(self) -> None:
        self.drafter.load_model(None)

    def place(self, req_ids: list[str], tokens: dict[str, list[int]], prompts: dict[str, int]) -> None:
        """Rows in ``req_ids`` order, each holding its request's tokens so far."""
        self.input_batch.req_ids = list(req_ids)
        self.token_ids[:] = -7
        for i, rid in enumerate(req_ids):
            self.token_ids[i, :len(tokens[rid])] = tokens[rid]
            self.num_tokens[i] = len(tokens[rid])
            self.input_batch.num_prompt_tokens[i] = prompts[rid]

    def step(self, sampled: list[list[int]]) -> list[list[int]]:
        return self.drafter.propose(sampled, self.num_tokens, self.token_ids, slot_mappings=None)


def vllm_config() -> SimpleNamespace:
    return SimpleNamespace(speculative_config=SimpleNamespace(num_speculative_tokens=K),
                           model_config=SimpleNamespace(max_model_len=MAX_LEN, get_vocab_size=lambda: VOCAB))


@pytest.fixture
def service(monkeypatch):
    server, port = create_server(ServiceConfig(drafter=DrafterConfig(capacity=1 << 16), default_vocab_size=VOCAB),
                                 "127.0.0.1:0")
    address = f"127.0.0.1:{port}"
    monkeypatch.setenv("DRAFTER_ADDRESS", address)
    monkeypatch.setenv("DRAFTER_TIMEOUT", "2")
    monkeypatch.setenv("DRAFTER_COST_AWARE", "0")  # whole chains: what these tests check (see the cost tests)
    # every step waits for its own answer: these tests check the drafts themselves (tests/engine_client/
    # test_prespeculation.py checks drafting one step ahead)
    monkeypatch.setenv("DRAFTER_PRESPECULATE", "0")
    yield server, address
    server.stop(0)


def proposer_with_runner(rows: int = 8) -> tuple[DrafterProposer, Runner]:
    proposer = DrafterProposer(vllm_config())
    runner = Runner(proposer, rows)
    runner.load_model()
    return proposer, runner


def stored_requests(address: str) -> int:
    with DrafterClient(address) as client:
        return int(client.stats()["stored_requests"])


def wait_stored(address: str, count: int, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while stored_requests(address) < count:
        assert time.monotonic() < deadline, f"fewer than {count} requests stored"
        time.sleep(0.1)


def generate(runner: Runner, requests: dict[str, tuple[list[int], list[int]]], order: list[list[str]]) -> list:
    """Replay requests (prompt, output) one token per step with rows in the given order per step; drafts per step.

    Each step's rows are the requests of ``order[step]``; a request's first step is its prefill (its first output
    token), later steps add one token each.
    """
    tokens = {rid: list(prompt) for rid, (prompt, _) in requests.items()}
    prompts = {rid: len(prompt) for rid, (prompt, _) in requests.items()}
    made = dict.fromkeys(requests, 0)
    drafts = []
    for rids in order:
        sampled = []
        for rid in rids:
            tokens[rid].append(requests[rid][1][made[rid]])
            sampled.append([tokens[rid][-1]])
            made[rid] += 1
        for rid in rids:  # a request the test gave sampling parameters keeps them
            runner.requests.setdefault(rid, SimpleNamespace(sampling_params=None))
        runner.place(rids, tokens, prompts)
        drafts.append(dict(zip(rids, runner.step(sampled), strict=True)))
    return drafts


def test_best_chain_follows_the_path_worth_verifying():
    # root -> 5 (0.9) -> 6 (0.8) -> 7 (0.02); root -> 9 (0.5) -> 10 (0.45) -> 11 (0.4)
    tree = DraftTree((5, 9, 6, 10, 7, 11), (-1, -1, 0, 1, 2, 3), (0.9, 0.5, 0.8, 0.45, 0.02, 0.4))
    assert best_chain(tree, 4, 0.05) == [5, 6]  # 7's estimate is under what a token costs
    assert best_chain(tree, 1, 0.05) == [5]
    assert best_chain(tree, 4, 0.0) == [5, 6, 7]  # 1.72 beats 9 10 11's 1.35
    assert best_chain(tree, 4, 0.95) == []  # nothing pays
    assert best_chain(tree, 0, 0.0) == []


def test_settings_come_from_the_environment():
    s = ProposerSettings.from_env({"DRAFTER_ADDRESS": "h:1", "DRAFTER_NAMESPACE": "llama", "DRAFTER_TIMEOUT": "0.02",
                                   "DRAFTER_MAX_NODES": "24", "DRAFTER_CHAIN_MIN_PROB": "0.2",
                                   "DRAFTER_TOKEN": "secret"})
    assert (s.address, s.namespace, s.timeout, s.max_nodes, s.min_prob) == ("h:1", "llama", 0.02, 24, 0.2)
    assert s.security.metadata() == (("authorization", "Bearer secret"),)
    with pytest.raises(ValueError, match="DRAFTER_TIMEOUT"):
        ProposerSettings.from_env({"DRAFTER_TIMEOUT": "soon"})
    with pytest.raises(ValueError, match="DRAFTER_CHAIN_MIN_PROB"):
        ProposerSettings.from_env({"DRAFTER_CHAIN_MIN_PROB": "2"})


def test_chains_are_cut_by_a_fixed_estimate_only_without_the_cost_rule():
    assert ProposerSettings().chain_min_prob == 0.0  # the step-cost rule alone decides what to verify
    assert ProposerSettings(cost_aware=False).chain_min_prob == FIXED_MIN_PROB == 0.05
    assert ProposerSettings.from_env({"DRAFTER_COST_AWARE": "0"}).chain_min_prob == 0.05
    assert ProposerSettings.from_env({"DRAFTER_CHAIN_MIN_PROB": "0.1"}).chain_min_prob == 0.1
    assert ProposerSettings.from_env({"DRAFTER_COST_AWARE": "0", "DRAFTER_CHAIN_MIN_PROB": "0"}).chain_min_prob == 0.0


def test_requests_are_followed_across_moving_rows_and_stored_when_finished(service):
    _, address = service
    proposer, runner = proposer_with_runner()
    rng = np.random.default_rng(1)
    reqs = {f"r{i}": (rng.integers(0, VOCAB, 12).tolist(), rng.integers(0, VOCAB, 8).tolist()) for i in range(3)}
    # rows move: r1 and r0 swap places, r2 joins late and takes row 0
    order = [["r0", "r1"], ["r1", "r0"], ["r2", "r1", "r0"], ["r0", "r2", "r1"], ["r1", "r0", "r2"],
             ["r0", "r1", "r2"], ["r2"]]
    generate(runner, reqs, order)
    for rid in ("r0", "r1"):  # finished: the runner drops them, the next step ends their sessions
        del runner.requests[rid]
    tokens = reqs["r2"][0] + reqs["r2"][1][:6]
    runner.place(["r2"], {"r2": tokens}, {"r2": 12})
    runner.step([[tokens[-1]]])
    wait_stored(address, 2)  # ended from the sender's thread, off the step
    assert stored_requests(address) == 2
    assert runner.step([[]]) == [[]]  # a row without sampled tokens (a prefill in progress) gets no draft
    del runner.requests["r2"]
    wait_stored(address, 3)  # the engine is idle: the watcher ends it
    figures = proposer._tracker.figures
    assert (figures.opened, figures.ended, figures.failures) == (3, 3, 0)
    # the service holds each request whole: a new request with r0's prompt is drafted r0's output
    proposer2, runner2 = proposer_with_runner()
    prompt, output = reqs["r0"]
    drafts = generate(runner2, {"n0": (prompt, output)}, [["n0"], ["n0"]])
    assert drafts[0]["n0"] == output[1:1 + K]
    assert drafts[1]["n0"] == output[2:2 + K]


def test_chains_are_plain_ints_within_k_and_the_model_length(service):
    proposer, runner = proposer_with_runner()
    prompt = list(range(1, 40)) * 3
    with DrafterClient(service[1]) as client:
        client.ingest([(prompt, list(range(40, 100)))])
    reqs = {"a": (prompt, list(range(40, 100)))}
    drafts = generate(runner, reqs, [["a"]] * 5)
    assert all(len(d["a"]) == K and all(type(t) is int for t in d["a"]) for d in drafts)
    assert drafts[-1]["a"] == list(range(45, 45 + K))
    # near max_model_len a chain shrinks to what still fits
    pattern = (list(range(1, 40)) * 7)[:MAX_LEN - 3]
    runner.requests["c"] = SimpleNamespace(sampling_params=None)
    runner.place(["c"], {"c": pattern}, {"c": len(pattern) - 1})
    short = runner.step([[pattern[-1]]])[0]
    assert 0 < len(short) <= 2 and short == pattern[len(pattern) - 39:][:len(short)]


def test_output_past_max_tokens_or_a_stop_token_is_neither_stored_nor_drafted(service):
    _, address = service
    proposer, runner = proposer_with_runner()
    rng = np.random.default_rng(2)
    prompt, output = rng.integers(0, VOCAB - 1, 10).tolist(), rng.integers(0, VOCAB - 1, 8).tolist()
    runner.requests["a"] = SimpleNamespace(sampling_params=sampling(5))
    runner.requests["b"] = SimpleNamespace(sampling_params=sampling(50, eos=VOCAB - 1))
    tokens = {"a": prompt + output, "b": prompt[::-1] + output[:3] + [VOCAB - 1] + output[3:]}
    runner.place(["a", "b"], tokens, {"a": 10, "b": 10})  # both overshot in one step (accepted drafts)
    assert runner.step([output, output[:3] + [VOCAB - 1] + output[3:]]) == [[], []]
    runner.requests.clear()
    wait_stored(address, 2)
    with DrafterClient(address) as client:
        # a: prompt and max_tokens; b: up to its stop token; the store puts one separator after each request
        assert client.stats()["stored_tokens"] == (10 + 5 + 1) + (10 + 4 + 1)


def sampling(max_tokens: int, eos: int | None = None, stops: tuple[int, ...] = (), ignore_eos: bool = False
             ) -> SimpleNamespace:
    """What the proposer reads of vLLM's SamplingParams: under ``ignore_eos`` its ``eos_token_id`` is None while
    ``all_stop_token_ids`` still holds the end-of-sequence token (vLLM keeps it there for ``min_tokens``)."""
    everything = set(stops) | ({eos} if eos is not None else set())
    return SimpleNamespace(max_tokens=max_tokens, stop_token_ids=list(stops),
                           eos_token_id=None if ignore_eos else eos, all_stop_token_ids=everything)


def test_stop_tokens_are_the_stop_ids_and_the_end_of_sequence_token_unless_ignored():
    assert stop_tokens(sampling(5, eos=7, stops=(3, 4))) == {3, 4, 7}
    assert stop_tokens(sampling(5, eos=7, stops=(3,), ignore_eos=True)) == {3}
    assert stop_tokens(None) == frozenset()


def test_a_request_that_ignores_its_end_of_sequence_token_is_followed_and_stored_whole(service):
    _, address = service
    proposer, runner = proposer_with_runner()
    eos = VOCAB - 1
    prompt = DOC[:6] * 2
    output = DOC[:3] + [eos] + DOC[:6] * 5  # generation goes on past the end-of-sequence token
    runner.requests["a"] = SimpleNamespace(sampling_params=sampling(len(output), eos=eos, ignore_eos=True))
    drafts = generate(runner, {"a": (prompt, output)}, [["a"]] * len(output))
    assert any(d["a"] for d in drafts[len(drafts) // 2:]), "no draft after the end-of-sequence token"
    runner.requests.clear()
    wait_stored(address, 1)
    with DrafterClient(address) as client:
        assert client.stats()["stored_tokens"] == len(prompt) + len(output) + 1  # and one separator


def test_a_request_the_engine_takes_past_a_stop_token_is_followed_again(service):
    _, address = service
    proposer, runner = proposer_with_runner()
    stop = VOCAB - 1
    prompt, output = DOC[:6] * 2, DOC[:3] + [stop] + DOC[:6] * 5
    # the engine stops at none of the proposer's stop tokens (a stop the proposer cannot see the engine lift)
    runner.requests["a"] = SimpleNamespace(sampling_params=sampling(len(output), stops=(stop,)))
    drafts = generate(runner, {"a": (prompt, output)}, [["a"]] * len(output))
    assert any(d["a"] for d in drafts[len(drafts) // 2:])
    runner.requests.clear()
    wait_stored(address, 1)
    with DrafterClient(address) as client:
        assert client.stats()["stored_tokens"] == len(prompt) + len(output) + 1


def test_the_service_away_means_empty_drafts_and_no_exception(service):
    server, _ = service
    proposer, runner = proposer_with_runner()
    server.stop(0).wait()
    rng = np.random.default_rng(3)
    reqs = {"a": (rng.integers(0, VOCAB, 10).tolist(), rng.integers(0, VOCAB, 4).tolist())}
    drafts = generate(runner, reqs, [["a"]] * 4)
    assert all(d == {"a": []} for d in drafts)


def test_propose_never_raises_into_the_engine(service):
    proposer, runner = proposer_with_runner()
    runner.input_batch = None  # whatever breaks inside, the step gets empty drafts
    assert runner.step([[1], [2]]) == [[], []]


def test_a_namespace_of_another_vocabulary_is_refused_with_a_clear_error(service, caplog):
    config = vllm_config()
    config.model_config.get_vocab_size = lambda: VOCAB * 2
    proposer = DrafterProposer(config)
    runner = Runner(proposer)
    runner.load_model()
    assert "vocabulary of 300 tokens, this model 600" in caplog.text
    runner.requests["a"] = SimpleNamespace(sampling_params=None)
    runner.place(["a"], {"a": [1, 2, 3, 4]}, {"a": 3})
    assert runner.step([[4]]) == [[]]


DOC = [(11 * i) % 97 + 3 for i in range(90)]


def costed_drafts(monkeypatch, address: str, per_token: float, idle_after: int = -1) -> list[int]:
    """Draft tokens per step for two requests repeating a stored document, on an engine whose step takes 10 ms per
    row plus ``per_token`` times that per draft token (a fake clock the proposer reads).

    With ``idle_after`` >= 0 the two requests stop after that many steps, the engine idles 5 s, and two new ones
    take their rows."""
    monkeypatch.setenv("DRAFTER_COST_AWARE", "1")
    with DrafterClient(address) as client:
        client.ingest([(DOC[:8], DOC[8:], f"doc{i}") for i in range(3)])
    proposer, runner = proposer_with_runner()
    now = [0.0]
    proposer._tracker.clock = lambda: now[0]
    propose = runner.step

    def timed(sampled):
        out = propose(sampled)
        now[0] += 0.01 * (len(sampled) + per_token * sum(len(c) for c in out))
        return out

    def idle_then_place(rids, tokens, prompts):
        if rids == ["c", "d"] and "c" not in runner.placed:
            now[0] += 5.0
        runner.placed.update(rids)
        place(rids, tokens, prompts)

    runner.step = timed
    place, runner.placed = runner.place, set()
    runner.place = idle_then_place
    reqs = {"a": (DOC[:8], DOC[8:70]), "b": (DOC[:10], DOC[10:72])}
    if idle_after < 0:
        steps = generate(runner, reqs, [["a", "b"]] * 50)
    else:
        reqs |= {"c": (DOC[:9], DOC[9:71]), "d": (DOC[:11], DOC[11:73])}
        steps = generate(runner, reqs, [["a", "b"]] * idle_after + [["c", "d"]] * 50)
    return [sum(len(c) for c in step.values()) for step in steps]


def test_cost_aware_chains_are_whole_where_tokens_are_cheap(service, monkeypatch):
    drafted = costed_drafts(monkeypatch, service[1], per_token=0.01)
    assert drafted[0] == 0  # the first step is plain: it measures the step time without drafts
    assert sum(drafted[10:]) >= 0.8 * 2 * K * 40  # later steps verify nearly whole chains


def test_cost_aware_chains_stop_where_tokens_cost_more_than_they_bring(service, monkeypatch):
    drafted = costed_drafts(monkeypatch, service[1], per_token=5.0)  # a draft token costs 5 plain rows
    assert sum(drafted[25:]) == 0


def test_an_idle_engine_between_batches_does_not_make_drafts_look_free(service, monkeypatch):
    # The step that starts a new batch after 5 s idle must not be timed as a 5 s step: that would make every
    # smaller size look as slow as the large ones, and every token worth verifying.
    drafted = costed_drafts(monkeypatch, service[1], per_token=5.0, idle_after=30)
    assert sum(drafted[25:30]) == 0 and sum(drafted[40:]) == 0


def test_one_requests_cut_is_chosen_in_the_background_and_equals_choosing_it_on_the_step(service, monkeypatch):
    """With one request running, the sender's thread chooses the cut of every chain the next step may propose (once
    that step's tree landed); the step then looks its chain up instead of choosing, with the same answer."""
    monkeypatch.setenv("DRAFTER_COST_AWARE", "1")
    monkeypatch.setenv("DRAFTER_PRESPECULATE", "1")
    with DrafterClient(service[1]) as client:
        client.ingest([(DOC[:8], DOC[8:], f"doc{i}") for i in range(3)])
    proposer, runner = proposer_with_runner()
    tracker = proposer._tracker
    now = [0.0]
    tracker.clock = lambda: now[0]
    budget = tracker._learning.budget
    choose_one = budget._choose_one
    on_step: list[int] = []  # the step at which the engine's thread chose for itself
    chosen: list[tuple[list[float], int]] = []  # each step's chain estimates and cut

    def choose_on_the_engine_thread(probs, limit, base):
        if threading.current_thread() is threading.main_thread():
            on_step.append(len(chosen))
        return choose_one(probs, limit, base)

    choose_batch = budget.choose_batch

    def recorded(chains, limit, base_tokens=None):
        keep = choose_batch(chains, limit, base_tokens)
        chosen.append((list(chains[0]), keep[0], VerifyBudget(budget.curve, budget.calibration).choose_batch(
            chains, limit, base_tokens)[0]))
        return keep

    monkeypatch.setattr(budget, "_choose_one", choose_on_the_engine_thread)
    monkeypatch.setattr(budget, "choose_batch", recorded)
    propose = runner.step

    def step_then_settle(sampled):
        out = propose(sampled)
        now[0] += 0.01 * (1 + 0.01 * sum(len(c) for c in out))
        assert tracker.speculator.drain()  # the sender sent the step, landed its tree and did its chore
        return out

    runner.step = step_then_settle
    generate(runner, {"a": (DOC[:8], DOC[8:70])}, [["a"]] * 40)
    assert len(chosen) >= 30
    assert all(keep == fresh for _, keep, fresh in chosen)  # a lookup answers what choosing answers
    assert not [step for step in on_step if step >= 3]  # after the first steps, every cut was chosen ahead


def parallel_config(rank: int, tp: int, pp: int = 1, backend: str | None = "mp") -> SimpleNamespace:
    return SimpleNamespace(rank=rank, world_size=tp * pp, tensor_parallel_size=tp, prefill_context_parallel_size=1,
                           distributed_executor_backend=backend)


@pytest.mark.parametrize(("tp", "pp", "drafting"), [(1, 1, {0}), (2, 1, {0}), (4, 1, {0}), (2, 2, {2}),
                                                    (2, 4, {6}), (1, 3, {2})])
def test_only_the_rank_whose_drafts_vllm_uses_drafts(tp, pp, drafting):
    # vLLM's executor takes the model runner output of rank world_size - tensor_parallel_size: the first
    # tensor-parallel rank of the last pipeline stage
    ranks = {rank for rank in range(tp * pp) if drafting_rank(SimpleNamespace(parallel_config=parallel_config(
        rank, tp, pp)))}
    assert ranks == drafting


def test_external_launcher_with_several_ranks_is_refused_at_start():
    config = vllm_config()
    config.parallel_config = parallel_config(0, 2, backend="external_launcher")
    with pytest.raises(ValueError, match="external_launcher"):
        DrafterProposer(config)
    config.parallel_config = parallel_config(0, 1, backend="external_launcher")  # one rank: nothing to agree on
    assert DrafterProposer(config).drafts


def test_a_rank_whose_drafts_are_dropped_neither_drafts_nor_stores(service):
    _, address = service
    config = vllm_config()
    config.parallel_config = parallel_config(1, 2)
    proposer = DrafterProposer(config)
    runner = Runner(proposer)
    runner.load_model()
    assert proposer._tracker is None  # no client, no connection
    rng = np.random.default_rng(5)
    reqs = {"a": (rng.integers(0, VOCAB, 10).tolist(), rng.integers(0, VOCAB, 6).tolist())}
    drafts = generate(runner, reqs, [["a"]] * 4)
    assert all(d == {"a": []} for d in drafts)
    runner.requests.clear()
    runner.step([])
    with DrafterClient(address) as client:
        figures = client.stats()
    assert (figures["stored_requests"], figures["active_sessions"]) == (0, 0)


def test_by_default_chains_come_from_trees_drafted_one_step_ahead(service, monkeypatch):
    monkeypatch.setenv("DRAFTER_PRESPECULATE", "1")
    prompt, output = list(range(1, 40)) * 3, list(range(40, 100))
    with DrafterClient(service[1]) as client:
        client.ingest([(prompt, output)])
    proposer, runner = proposer_with_runner()
    tokens, drafts = list(prompt), []
    runner.requests["a"] = SimpleNamespace(sampling_params=None)
    for pos in range(12):  # one token a step, each step after the previous step's answer could land
        tokens.append(output[pos])
        runner.place(["a"], {"a": tokens}, {"a": len(prompt)})
        drafts.append(runner.step([[output[pos]]])[0])
        time.sleep(0.05)
    figures = proposer._tracker.figures
    proposer._tracker.sync_figures()
    assert drafts[-1] == output[12:12 + K]
    assert figures.prespec_hits >= 10  # every step but the first ones: cut from the tree that was already there
    assert figures.late_answers == 0


def test_the_vllm_releases_it_follows_are_served_older_ones_refused_newer_ones_warned_about():
    for version in ("0.32.0", "0.32.0+cpu", "0.33.0", "0.33.1.dev12+gabc", None):
        assert check_vllm(version) == "", version
    assert "0.34.0" in check_vllm("0.34.0") and "may differ" in check_vllm("0.34.0")
    assert "checked against" in check_vllm("nightly")
    with pytest.raises(ValueError, match="0.32 or 0.33"):
        check_vllm("0.31.2")
    with pytest.raises(ValueError, match="VLLM_USE_V2_MODEL_RUNNER"):
        check_vllm("0.33.0", uses_v2_runner=True)


def test_a_proposer_built_under_model_runner_v2_refuses_at_start():
    config = vllm_config()
    config.use_v2_model_runner = True
    with pytest.raises(ValueError, match="V1 model runner"):
        DrafterProposer(config)

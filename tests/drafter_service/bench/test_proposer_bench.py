"""``drafter bench proposer``'s engine-step replay: greedy acceptance, rows as vLLM keeps them, and DrafterProposer
driven through the bench's runner against a real service (no vLLM needed: the rows are ``SimpleInputBatch``)."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest

from drafter_service.bench.proposer_bench import format_results, warm_service
from drafter_service.bench.proposer_replay import (
    FIGURES,
    BenchRunner,
    SimpleInputBatch,
    StepLoop,
    close_proposer,
    greedy_accept,
    proposer_figures,
)
from drafter_service.core.config import DrafterConfig
from drafter_service.datasets.request_files import Request
from drafter_service.rpc.server import create_server
from drafter_service.service.config import ServiceConfig

VOCAB = 300


class ScriptedProposer:
    """Proposes ``chains[last token]`` (or nothing) and checks every row holds its request's tokens so far."""

    def __init__(self, chains: dict[int, list[int]], requests: dict[str, Request]) -> None:
        self.chains, self.requests = chains, requests
        self.batch: Any = None
        self.rows: list[list[str]] = []  # each call's requests, by row
        self.sampled: list[list[list[int]]] = []

    def propose(self, sampled: list[list[int]], num_tokens: np.ndarray, token_ids: np.ndarray,
                slot_mappings: Any = None) -> list[list[int]]:
        rows = list(self.batch.req_ids)
        self.rows.append([r.split("-", 1)[1] for r in rows])
        self.sampled.append(sampled)
        out = []
        for i, req_id in enumerate(rows):
            req = self.requests[req_id.split("-", 1)[1]]
            n = int(num_tokens[i])
            full = np.concatenate([req.prompt, req.output])
            assert token_ids[i, :n].tolist() == full[:n].tolist()  # the row is its request, up to its last token
            assert int(self.batch.num_prompt_tokens[i]) == req.prompt.size
            out.append(list(self.chains.get(int(token_ids[i, n - 1]), [])))
        return out

    def load_model(self, *args: Any) -> None:
        pass


def _loop(held: list[Request], batch: int, chains: dict[int, list[int]]) -> tuple[StepLoop, ScriptedProposer]:
    proposer = ScriptedProposer(chains, {r.request_id: r for r in held})
    input_batch = SimpleInputBatch(batch, 64)
    proposer.batch = input_batch
    runner = BenchRunner(proposer, "custom_class", input_batch, k=4)
    return StepLoop(runner, held, batch, step_ms=0), proposer


def test_greedy_acceptance_is_the_matching_prefix():
    assert greedy_accept([5, 6, 7], [5, 6, 9, 7]) == 2
    assert greedy_accept([5, 6], [5, 6, 7]) == 2
    assert greedy_accept([5, 6, 7], [5]) == 1  # the output ends first
    assert greedy_accept([], [5]) == 0
    assert greedy_accept([4], [5]) == 0


def test_rows_gain_the_accepted_prefix_and_the_bonus_token_then_the_next_request_takes_the_row():
    held = [Request("a", [1, 2], [10, 11, 12, 13, 14]), Request("b", [3], [20, 21, 22])]
    # after 10: 11 12 accepted, 99 rejected, 13 the bonus; after 13: 14 accepted, a ends (no bonus past its end);
    # b's prefill gives 20; after 20 no draft (21 alone); after 21: 22 accepted, b ends
    loop, proposer = _loop(held, 1, {10: [11, 12, 99], 13: [14, 15], 21: [22]})
    run = loop.run(steps=10)
    assert proposer.sampled == [[[10]], [[11, 12, 13]], [[14]], [[20]], [[21]], [[22]]]
    assert proposer.rows == [["a"]] * 3 + [["b"]] * 3
    assert run.row_tokens == [3, 1, 1, 1]  # decode rows only: prefills verify no draft
    assert run.tokens_per_step == 1.5
    assert (run.drafted, run.draft_tokens, run.accepted, run.completed) == (3, 6, 4, 2)
    assert len(run.propose_ms) == 6 and not run.exhausted
    assert run.summary()["steps"] == 6


def test_finished_requests_free_their_rows_new_ones_fill_the_lowest_and_the_rest_is_compacted():
    lengths = {"r0": 3, "r1": 1, "r2": 2, "r3": 5, "r4": 5, "r5": 5}
    held = [Request(name, [100 + i], list(range(10 * i, 10 * i + n))) for i, (name, n) in enumerate(lengths.items())]
    loop, proposer = _loop(held, 3, {})  # no drafts: one token per row per step
    run = loop.run(steps=20)
    assert proposer.rows == [
        ["r0", "r1", "r2"],  # r1 ends at its prefill
        ["r0", "r3", "r2"],  # r3 takes r1's row; r2 ends
        ["r0", "r3", "r4"],  # r0 ends
        ["r5", "r3", "r4"],
        ["r5", "r3", "r4"],
        ["r5", "r3", "r4"],  # r3 ends; no request left to take its row
        ["r5", "r4"],  # r4 moved down from the last row into r3's
        ["r5"],
    ]
    assert run.row_tokens == [1] * (sum(lengths.values()) - len(lengths)) and run.exhausted
    assert run.completed == 6


def test_simple_input_batch_moves_the_last_rows_into_the_gaps():
    batch = SimpleInputBatch(5, 8)
    for name in "abcde":
        batch.add_request(SimpleNamespace(req_id=name, prompt_token_ids=[ord(name)], output_token_ids=[]))
    for name in "bd":
        batch.remove_request(name)
    batch.add_request(SimpleNamespace(req_id="f", prompt_token_ids=[ord("f"), 1], output_token_ids=[2]))
    batch.condense()
    assert batch.req_ids == ["a", "f", "c", "e"]  # f in b's row, e moved into d's
    assert batch.token_ids_cpu[1, :3].tolist() == [ord("f"), 1, 2] and batch.token_ids_cpu[3, 0] == ord("e")
    assert batch.num_tokens_no_spec[:4].tolist() == [1, 3, 1, 1]
    assert batch.num_prompt_tokens[:4].tolist() == [1, 2, 1, 1]
    assert batch.req_id_to_index == {"a": 0, "f": 1, "c": 2, "e": 3}


@pytest.fixture
def service(monkeypatch):
    server, port = create_server(ServiceConfig(drafter=DrafterConfig(capacity=1 << 16), default_vocab_size=VOCAB),
                                 "127.0.0.1:0")
    address = f"127.0.0.1:{port}"
    monkeypatch.setenv("DRAFTER_ADDRESS", address)
    monkeypatch.setenv("DRAFTER_TIMEOUT", "2")
    monkeypatch.setenv("DRAFTER_COST_AWARE", "0")
    yield address
    server.stop(0)


def test_drafter_proposer_drafts_a_request_the_service_was_warmed_with(service):
    from engines.vllm import DrafterProposer

    rng = np.random.default_rng(3)
    reqs = [Request(f"q{i}", rng.integers(0, VOCAB, 12), rng.integers(0, VOCAB, 30)) for i in range(2)]
    warm_service(service, reqs, wait_indexed=False)
    config = SimpleNamespace(speculative_config=SimpleNamespace(num_speculative_tokens=4),
                             model_config=SimpleNamespace(max_model_len=128, get_vocab_size=lambda: VOCAB))
    proposer = DrafterProposer(config)
    runner = BenchRunner(proposer, "custom_class", SimpleInputBatch(2, 128), k=4)
    runner.load_model()
    loop = StepLoop(runner, reqs, 2, step_ms=5)
    try:
        run = loop.run(steps=30)
        figures = proposer_figures(proposer)
    finally:
        close_proposer(proposer)
    assert run.completed == 2 and len(run.propose_ms) < 30  # both replayed to their end
    assert run.drafted > 0 and run.accepted > 0
    assert run.tokens_per_step > 2.0  # the warmed requests come back: most drafts are right
    assert set(figures) == set(FIGURES)  # fields the proposer lacks read as 0
    assert figures["steps"] == len(run.propose_ms) and figures["drafted_rows"] > 0 and figures["failures"] == 0
    assert figures["sender_cpu_ms"] > 0  # the background thread's time is counted


def test_the_table_compares_with_suffix_and_the_synchronous_run_and_reads_missing_figures_as_absent():
    base = {"batch": 16, "steps": 50, "p50_ms": 1.0, "p99_ms": 2.0, "mean_ms": 1.2, "rows": 100, "drafted": 50}
    results = [
        {**base, "method": "drafter", "tokens_per_step": 2.4, "p50_ms": 0.5,
         "figures": {"steps": 50, "prespec_hits": 30, "prespec_misses": 10, "sync_waits": 5, "looked_up": 4,
                     "sender_cpu_ms": 25.0}},
        {**base, "method": "drafter-sync", "tokens_per_step": 2.5, "figures": {"steps": 50}},
        {**base, "method": "suffix", "tokens_per_step": 2.0},
    ]
    lines = format_results(results, "header").splitlines()
    assert lines[0] == "header"
    rows = {cells[2]: cells for cells in ([c.strip() for c in line.split("|")] for line in lines[4:])}
    assert rows["drafter"][4:6] == ["0.500", "0.50×"]
    assert rows["drafter"][9:16] == ["1.20×", "0.96×", "50.0%", "75.0%", "10.0%", "0.10", "0.500"]
    assert rows["drafter-sync"][9:16] == ["1.25×", "-", "50.0%", "-", "-", "0.00", "0.000"]
    assert rows["suffix"][5] == "-" and rows["suffix"][9:16] == ["-", "-", "50.0%", "-", "-", "-", "-"]

"""drafter behind vLLM's OpenAI-compatible server, started as users start it, beside a real ``drafter serve``.

The server is ``python -m vllm.entrypoints.openai.api_server`` of vLLM's CPU build (``make vllm``) with
SmolLM2-135M (float32, token ids in and out). The same completions go to the server without speculation, then to
the server with ``engines.vllm.DrafterProposer``: one after the other, never both at once (two cores).
Without vLLM's venv these tests are skipped, unless DRAFTER_REQUIRE_VLLM=1 (``make test`` sets it) makes them fail.
"""

from __future__ import annotations

from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest

from drafter_service.api.drafter.v1 import drafter_pb2 as pb
from drafter_service.api.drafter.v1 import drafter_pb2_grpc as pb_grpc
from drafter_service.bench.e2e_prompts import load_prompts
from drafter_service.bench.serve_bench import ServiceProcess
from drafter_service.bench.vllm_process import wait_for
from drafter_service.bench.vllm_server import VllmApiServer
from drafter_service.datasets.target_model import smollm2_checkpoint

K = 4
LONG, SHORT = 64, 48  # tokens asked for: the batched requests, and the single ones sent at the same time
PROMPTS = 8

pytestmark = pytest.mark.timeout(900)

ACCEPTED = "vllm:spec_decode_num_accepted_tokens"
DRAFTS = "vllm:spec_decode_num_drafts"
GENERATED = "vllm:generation_tokens"


@dataclass
class Run:
    """One server's answers to the workload and vLLM's counters after it."""

    outputs: list[list[int]]
    counters: dict[str, float]


def workload(server: VllmApiServer, prompts: list[list[int]]) -> Run:
    """Prompt 0 alone; then, all at once, prompts 1-3 in one request and 4-7 in one request each."""
    outputs: list[list[int]] = [[] for _ in prompts]
    outputs[0] = server.complete(prompts[:1], LONG)[0]
    with ThreadPoolExecutor(max_workers=5) as pool:
        batched = pool.submit(server.complete, prompts[1:4], LONG)
        singles = {i: pool.submit(server.complete, prompts[i:i + 1], SHORT) for i in range(4, len(prompts))}
        outputs[1:4] = batched.result()
        for i, single in singles.items():
            outputs[i] = single.result()[0]
    return Run(outputs, server.counters())


@pytest.fixture(scope="module")
def workdir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("vllm-server")


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    return [p.token_ids.tolist() for p in load_prompts("gsm8k", PROMPTS)]


@pytest.fixture(scope="module")
def model() -> str:
    return str(smollm2_checkpoint())


@pytest.fixture(scope="module")
def plain(model: str, prompts: list[list[int]], workdir: Path) -> Run:
    """The server without speculation, stopped once it answered: the outputs the proposer's server must match."""
    with VllmApiServer(model, "none", workdir / "plain.log") as server:
        return workload(server, prompts)


@pytest.fixture(scope="module")
def service(workdir: Path, plain: Run) -> Iterator[ServiceProcess]:
    svc = ServiceProcess(workdir / "service", 1 << 20)
    svc.start()
    yield svc
    if svc.proc is not None and svc.proc.poll() is None:
        svc.stop()


@pytest.fixture(scope="module")
def speculative(model: str, service: ServiceProcess, prompts: list[list[int]], workdir: Path
                ) -> Iterator[tuple[VllmApiServer, Run]]:
    """The server with drafter's proposer (started after the plain one stopped) and its answers to the workload."""
    env = {"DRAFTER_ADDRESS": service.address, "DRAFTER_TIMEOUT": "2",
           "DRAFTER_PROPOSER_STATS": str(workdir / "proposer.json"),
           "DRAFTER_COST_AWARE": "0"}  # whole chains, so drafts are proposed whatever this machine's step costs
    with VllmApiServer(model, "drafter", workdir / "drafter.log", k=K, env=env) as server:
        yield server, workload(server, prompts)


def stats(service: ServiceProcess) -> pb.GetStatsResponse:
    with grpc.insecure_channel(service.address) as channel:
        return pb_grpc.DrafterStub(channel).GetStats(pb.GetStatsRequest(), timeout=10)


def test_completions_with_drafter_equal_the_server_without_speculation(speculative, plain):
    server, run = speculative
    assert len(run.outputs) == PROMPTS and all(plain.outputs)
    assert run.outputs == plain.outputs, server.log_tail()


def test_vllms_metrics_show_accepted_draft_tokens(speculative, plain):
    server, run = speculative
    assert plain.counters[DRAFTS] == 0
    assert run.counters[DRAFTS] > 0, server.log_tail()
    assert run.counters[ACCEPTED] > 0
    assert run.counters[GENERATED] == plain.counters[GENERATED] == sum(len(o) for o in plain.outputs)


def test_the_service_stores_every_completion(speculative, service, prompts):
    _, run = speculative
    wait_for(lambda: stats(service).stored_requests >= PROMPTS, 30, f"{PROMPTS} requests stored")
    figures = stats(service)
    assert figures.stored_requests == PROMPTS
    # each request whole (prompt and output), followed by the store's separator
    assert figures.stored_tokens == sum(len(p) + len(o) + 1 for p, o in zip(prompts, run.outputs, strict=True))


def test_a_prompt_sent_again_is_drafted_from_the_stored_request(speculative, service, prompts, plain):
    server, run = speculative
    wait_for(lambda: stats(service).stored_requests >= PROMPTS, 30, f"{PROMPTS} requests stored")
    before = server.counters()
    again = server.complete(prompts[:1], LONG)[0]
    after = server.counters()
    assert again == plain.outputs[0]
    rate = (after[ACCEPTED] - before[ACCEPTED]) / (after[GENERATED] - before[GENERATED])
    assert rate >= 0.6, rate
    wait_for(lambda: stats(service).stored_requests >= PROMPTS + 1, 30, "the repeated request stored")

"""drafter inside a real vLLM engine (CPU, SmolLM2-135M, float32) beside a real ``drafter serve`` process.

vLLM lives in its own venv (``make vllm``); each engine runs there as a child process (``bench.vllm_engine``), its
engine core and model runner inside that process (vLLM's own layout, two more processes, is what the API server tests
start; in one process an engine starts in half the time here).
Without that venv these tests are skipped, unless DRAFTER_REQUIRE_VLLM=1 (``make test`` sets it) makes them fail.
"""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from pathlib import Path

import pytest

from drafter_service.bench.e2e_prompts import load_prompts
from drafter_service.bench.serve_bench import ServiceProcess
from drafter_service.bench.vllm_process import Generation, VllmEngineProcess, wait_for
from drafter_service.datasets.target_model import smollm2_checkpoint
from engine_client import DrafterClient

K = 4
SHORT = 64  # tokens generated for the GSM8K prompts
LONG = 128  # and for the HumanEval ones (the service is killed while they generate)

pytestmark = pytest.mark.timeout(1200)

ACCEPTED = "vllm:spec_decode_num_accepted_tokens"
DRAFTS = "vllm:spec_decode_num_drafts"
GENERATED = "vllm:generation_tokens"


def delta(after: Generation, before: Generation | None, name: str) -> float:
    return after.counters[name] - (before.counters[name] if before is not None else 0.0)


@pytest.fixture(scope="module")
def workdir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("vllm")


@pytest.fixture(scope="module")
def prompts() -> dict[str, list[list[int]]]:
    return {"gsm8k": [p.token_ids.tolist() for p in load_prompts("gsm8k", 8)],
            "humaneval": [p.token_ids.tolist() for p in load_prompts("humaneval", 4)]}


@pytest.fixture(scope="module")
def model() -> str:
    return str(smollm2_checkpoint())


def engine(model: str, method: str, workdir: Path, name: str, env: dict[str, str] | None = None
           ) -> VllmEngineProcess:
    log = open(workdir / f"{name}.log", "w")  # noqa: SIM115 (closed with the module's files)
    return VllmEngineProcess(model, method, K, env={"VLLM_CPU_KVCACHE_SPACE": "1", **(env or {})}, log=log,
                             one_process=True)


#: The generation the service is stopped in: requests that end while it is stopped, and longer ones that go on
#: well past its return (every prompt ignores the end token, so the lengths are exact).
STOPPED_LIMITS = [40, 40, 48, 56, 480, 480, 480, 480]
#: The stop lasts 20 s, or until the engine made this many steps without the service (a fast machine would
#: otherwise finish the long requests during the stop: 480 steps of 40 ms take less than 20 s)
STOPPED_STEPS = 240


@pytest.fixture(scope="module")
def plain(model, prompts, workdir) -> dict[str, list[list[int]]]:
    """vLLM without speculation: the outputs every speculative run must reproduce."""
    with engine(model, "none", workdir, "plain") as eng:
        return {"gsm8k": eng.generate(prompts["gsm8k"], SHORT).outputs,
                "humaneval": eng.generate(prompts["humaneval"], LONG).outputs,
                "stopped": eng.generate(stopped_prompts(prompts), STOPPED_LIMITS, ignore_eos=True).outputs}


def stopped_prompts(prompts: dict[str, list[list[int]]]) -> list[list[int]]:
    return prompts["gsm8k"][4:] + prompts["humaneval"]


@pytest.fixture(scope="module")
def service(workdir):
    svc = ServiceProcess(workdir / "service", 1 << 20)
    svc.start()
    yield svc
    if svc.proc is not None and svc.proc.poll() is None:
        svc.stop()


def proposer_env(service: ServiceProcess, workdir: Path, name: str) -> dict[str, str]:
    return {"DRAFTER_ADDRESS": service.address, "DRAFTER_TIMEOUT": "2",
            "DRAFTER_PROPOSER_STATS": str(workdir / f"{name}.json"),
            "DRAFTER_COST_AWARE": "0"}  # whole chains, so drafts are proposed whatever this machine's step costs


@pytest.fixture(scope="module")
def first(model, service, workdir, plain, prompts):
    """The first engine with drafter and its generation of the GSM8K prompts in one batch."""
    eng = engine(model, "drafter", workdir, "first", proposer_env(service, workdir, "first"))
    yield eng, eng.generate(prompts["gsm8k"], SHORT)
    eng.close()


@pytest.fixture(scope="module")
def second(model, service, workdir, first):
    """A second engine process on the same service, started while the first still runs."""
    eng = engine(model, "drafter", workdir, "second", proposer_env(service, workdir, "second"))
    yield eng
    eng.close()


def stats(service: ServiceProcess) -> dict:
    with DrafterClient(service.address) as client:
        return client.stats()


def test_greedy_outputs_with_drafter_equal_vllm_without_speculation(first, plain):
    _, generation = first
    assert len(generation.outputs) == 8
    assert generation.outputs == plain["gsm8k"]


def test_vllms_counters_show_accepted_draft_tokens(first):
    _, generation = first
    assert generation.counters[DRAFTS] > 0
    assert generation.counters[ACCEPTED] > 0


def test_the_service_stores_every_request_vllm_completed(first, service, prompts):
    _, generation = first
    wait_for(lambda: stats(service)["stored_requests"] >= 8, 30, "8 requests stored")
    figures = stats(service)
    assert figures["stored_requests"] == 8
    # each request whole (prompt and output), followed by the store's separator
    assert figures["stored_tokens"] == sum(len(p) + len(o) + 1 for p, o in zip(prompts["gsm8k"], generation.outputs,
                                                                             strict=True))


def test_a_second_engine_is_drafted_what_the_first_wrote(first, second, plain, prompts, service):
    wait_for(lambda: stats(service)["stored_requests"] >= 8, 30, "the first engine's requests stored")
    before = second.generate(prompts["humaneval"][:1], 8)  # a prompt neither engine has seen
    novel = second.generate(prompts["humaneval"][1:2], SHORT)
    seen = second.generate(prompts["gsm8k"][:1], SHORT)  # the first engine completed this one
    assert seen.outputs == plain["gsm8k"][:1]
    novel_rate = delta(novel, before, ACCEPTED) / delta(novel, before, GENERATED)
    seen_rate = delta(seen, novel, ACCEPTED) / delta(seen, novel, GENERATED)
    assert seen_rate >= 0.6, (seen_rate, novel_rate)
    assert seen_rate > novel_rate + 0.2, (seen_rate, novel_rate)


def figures_file(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return {}


def test_a_service_stopped_for_20_s_never_stalls_the_engine_and_drafts_resume(first, second, service, plain, prompts,
                                                                             workdir):
    """SIGSTOP (a hung service, not a dead one) in the middle of a generation, SIGCONT 20 s later (or after
    STOPPED_STEPS engine steps if sooner; either way well past the client's 2 s timeout)."""
    stats_file = workdir / "second.json"

    def earlier_requests_stored() -> bool:  # the proposer ends an idle engine's finished requests within 0.2 s
        figures = figures_file(stats_file)
        opened = int(figures.get("opened", 0))
        return int(figures.get("ended", 0)) == opened and \
            stats(service)["stored_requests"] >= len(first[1].outputs) + opened

    wait_for(earlier_requests_stored, 30, "the requests of the generations before this one ended and stored")
    before_stop = stats(service)
    stored_before, tokens_before = before_stop["stored_requests"], before_stop["stored_tokens"]
    # (time, steps, answers from the service, chains from its trees) of the proposer, every 20 ms; chains from its
    # trees: those cut from a landed tree plus waits its answer ended (prompt lookup drafts some rows without the
    # service, so draft tokens would not tell)
    seen: list[tuple[float, int, int, int]] = []
    stopped: list[float] = []
    resumed: list[float] = []
    finished = threading.Event()

    def watch() -> None:
        while not finished.is_set():
            figures = figures_file(stats_file)
            if figures:
                served = figures["prespec_hits"] + figures["sync_waits"] - figures["late_answers"]
                seen.append((time.monotonic(), int(figures["steps"]), int(figures["answers"]), int(served)))
            time.sleep(0.02)

    def stop_midway() -> None:
        start = seen[-1][1] if seen else 0
        wait_for(lambda: bool(seen) and seen[-1][1] >= start + 10, 300, "ten engine steps", poll=0.02)
        os.kill(service.proc.pid, signal.SIGSTOP)
        stopped.append(time.monotonic())
        at_stop = seen[-1][1]
        while time.monotonic() < stopped[0] + 20 and seen[-1][1] < at_stop + STOPPED_STEPS:
            time.sleep(0.02)
        os.kill(service.proc.pid, signal.SIGCONT)
        resumed.append(time.monotonic())

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    time.sleep(0.3)
    stopper = threading.Thread(target=stop_midway, daemon=True)
    stopper.start()
    try:
        generation = second.generate(stopped_prompts(prompts), STOPPED_LIMITS, ignore_eos=True)
    finally:
        stopper.join(60)
        if not resumed and service.proc.poll() is None:
            os.kill(service.proc.pid, signal.SIGCONT)
        finished.set()
        watcher.join(5)
    assert stopped and resumed, "the service was not stopped and resumed during the generation"
    assert generation.outputs == plain["stopped"]
    # the engine's steps while the service was stopped, against its steps before: the mean step over each second
    # or so, between updates of the figures file (read every 20 ms, rewritten every 0.2 s when steps were made)
    updates = [row for prev, row in zip(seen, seen[1:], strict=False) if row[1] != prev[1]]

    def per_step(lo: float, hi: float) -> list[float]:
        within = [row for row in updates if lo <= row[0] <= hi]
        if not within:
            return []
        means: list[float] = []
        start = within[0]
        for row in within[1:]:
            if row[0] - start[0] >= 1.0:
                means.append((row[0] - start[0]) / (row[1] - start[1]))
                start = row
        return means

    # before the stop the batch is still in its prefills (the stop comes ten steps in), so the steps after the
    # service is back, with drafts from it again, are the plain steps the stop is weighed against
    during, after = per_step(stopped[0], resumed[0]), per_step(resumed[0] + 1.0, float("inf"))
    assert during, "no engine step while the service was stopped"
    steps_at_resume = max(n for t, n, _, _ in seen if t <= resumed[0])
    assert any(n > steps_at_resume for t, n, _, _ in seen if t > resumed[0] + 1.0), \
        "the generation ended before the service had been back a second: lengthen STOPPED_LIMITS' long requests"

    def first_rise(column: int) -> float | None:  # seconds after SIGCONT until the column passed its value then
        at_resume = max(row[column] for row in seen if row[0] <= resumed[0])
        return next((row[0] - resumed[0] for row in seen if row[0] > resumed[0] and row[column] > at_resume), None)

    answers_again, drafts_again = first_rise(2), first_rise(3)
    tail = [(round(t - resumed[0], 2), n, a, d) for t, n, a, d in seen if t > resumed[0] - 1.0][:150:5]
    assert answers_again is not None and answers_again <= 1.0 + 0.25, \
        f"the service's answers did not resume within a second: {tail}"  # + the figures file's lag
    answers = [a for t, _, a, _ in seen if t > resumed[0]]
    def median(values: list[float]) -> float:
        return sorted(values)[len(values) // 2] if values else 0.0

    longest = figures_file(stats_file)["longest_step_ms"]
    print(f"service stopped {resumed[0] - stopped[0]:.1f} s: engine step during the stop "
          f"{max(during) * 1e3:.0f} ms at most, median "
          f"{median(during) * 1e3:.0f} ms (mean over each second); {median(after) * 1e3:.0f} ms once it was back "
          f"(median of the same, from a second after SIGCONT); longest step "
          f"of the engine's whole run {longest:.0f} ms (a prefill included); answers again "
          f"{answers_again * 1e3:.0f} ms after SIGCONT ({answers[-1] - answers[0]} more answers in the "
          f"{seen[-1][0] - resumed[0]:.0f} s after); chains from the service's trees "
          f"{'none' if drafts_again is None else f'{drafts_again * 1e3:.0f} ms'} after SIGCONT")
    assert drafts_again is not None and drafts_again <= 1.0 + 0.25, \
        f"no chain cut from the service's trees within a second of SIGCONT: {tail}"
    assert max(during) < 1.0 and longest < 1500  # no step waited out DRAFTER_TIMEOUT (2 s) on the stopped service
    wait_for(lambda: stats(service)["stored_requests"] >= stored_before + len(STOPPED_LIMITS), 30,
             "every request of the generation stored, those that ended during the stop included")
    after = stats(service)
    assert after["stored_requests"] == stored_before + len(STOPPED_LIMITS)
    # whole: prompt and every output token (the prompts' outputs go on past the end-of-sequence token), and the
    # store's separator after each
    whole = sum(len(p) + len(o) + 1 for p, o in zip(stopped_prompts(prompts), generation.outputs, strict=True))
    assert after["stored_tokens"] == tokens_before + whole


def test_generation_completes_with_the_same_output_when_the_service_is_killed(second, service, plain, prompts,
                                                                               workdir):
    stats_file = workdir / "second.json"

    def steps() -> int:
        try:
            return int(json.loads(stats_file.read_text())["steps"])
        except (OSError, ValueError, KeyError):
            return 0

    start = steps()
    killed: list[tuple[int, float]] = []

    def kill_midway() -> None:
        wait_for(lambda: steps() >= start + 10, 300, "ten engine steps", poll=0.05)
        service.stop(9)  # SIGKILL
        killed.append((steps(), time.monotonic()))

    killer = threading.Thread(target=kill_midway, daemon=True)
    killer.start()
    generation = second.generate(prompts["humaneval"], LONG)
    done = time.monotonic()
    killer.join(10)
    assert killed and killed[0][1] < done, "the service was not killed while vLLM generated"
    assert generation.outputs == plain["humaneval"]
    wait_for(lambda: steps() > killed[0][0], 5, "steps after the kill")

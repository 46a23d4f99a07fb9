"""Engine steps replayed for ``drafter bench proposer``: rows, greedy acceptance and request turnover as vLLM's
model runner keeps them, around one timed ``propose`` per step.

This module imports no vLLM: the worker (``proposer_worker``, in vLLM's venv) hands it vLLM's own ``InputBatch``
and proposers; tests hand it ``SimpleInputBatch``, which keeps rows the same way, and small fake proposers.
"""

from __future__ import annotations

import time
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

import numpy as np

from drafter_service.datasets.request_files import Request

__all__ = ["FIGURES", "BenchRunner", "ReplayRun", "SimpleInputBatch", "StepLoop", "close_proposer", "greedy_accept",
           "proposer_figures", "simple_state"]

#: How each kind of proposer is called (vLLM 0.32's ``GPUModelRunner.propose_draft_token_ids``).
PROPOSER_KINDS = ("custom_class", "ngram", "suffix")

#: DrafterProposer's step figures a run reports (differences over the timed steps). Fields a proposer does not
#: have (one from before pre-speculation) read as 0.
FIGURES = ("steps", "rows", "drafted_rows", "draft_tokens", "seconds", "failures", "prespec_hits", "prespec_misses",
           "sync_waits", "late_answers", "looked_up", "sender_cpu_ms")


def greedy_accept(chain: Sequence[int], expected: Sequence[int]) -> int:
    """Draft tokens a greedy target accepts: the longest prefix of ``chain`` equal to ``expected``'s start."""
    n = 0
    for proposed, actual in zip(chain, expected, strict=False):
        if proposed != actual:
            break
        n += 1
    return n


def simple_state(req_id: str, prompt: Sequence[int], max_tokens: int) -> SimpleNamespace:
    """A request's cached state with the fields vLLM's ``CachedRequestState`` gives the proposers."""
    return SimpleNamespace(req_id=req_id, prompt_token_ids=list(prompt), num_prompt_tokens=len(prompt),
                           output_token_ids=[], sampling_params=SimpleNamespace(
                               max_tokens=max_tokens, stop_token_ids=[], eos_token_id=None))


class SimpleInputBatch:
    """The rows of vLLM's ``InputBatch`` (``vllm/v1/worker/gpu_input_batch.py``) without its sampling state.

    Same placement rules: a new request takes the lowest row freed this step, else the next row at the end;
    ``condense`` then moves the last rows down into the rows still free, so rows stay packed from 0.
    """

    def __init__(self, max_num_reqs: int, max_model_len: int) -> None:
        self.max_num_reqs, self.max_model_len = max_num_reqs, max_model_len
        self._req_ids: list[str | None] = []
        self.req_id_to_index: dict[str, int] = {}
        self.token_ids_cpu = np.zeros((max_num_reqs, max_model_len), dtype=np.int32)  # (rows, max_model_len)
        self.num_tokens_no_spec = np.zeros(max_num_reqs, dtype=np.int32)  # (rows,) tokens without drafts
        self.num_prompt_tokens = np.zeros(max_num_reqs, dtype=np.int32)  # (rows,)
        self.spec_token_ids: list[list[int]] = []
        self._removed: list[int] = []

    @property
    def req_ids(self) -> list[str]:
        """The request of each row, packed after ``condense`` (vLLM's property returns its list as it is, too)."""
        return self._req_ids  # type: ignore[return-value]

    @property
    def num_reqs(self) -> int:
        return len(self.req_id_to_index)

    def add_request(self, state: Any) -> int:
        """Place a request (its prompt and any output) in the lowest freed row, else after the last."""
        if self._removed:
            self._removed.sort()
            index = self._removed.pop(0)
        else:
            index = self.num_reqs
        assert index < self.max_num_reqs, "more requests than rows"
        if index == len(self._req_ids):
            self._req_ids.append(state.req_id)
            self.spec_token_ids.append([])
        else:
            self._req_ids[index] = state.req_id
            self.spec_token_ids[index] = []
        self.req_id_to_index[state.req_id] = index
        tokens = list(state.prompt_token_ids) + list(state.output_token_ids)
        self.token_ids_cpu[index, :len(tokens)] = tokens
        self.num_prompt_tokens[index] = len(state.prompt_token_ids)
        self.num_tokens_no_spec[index] = len(tokens)
        return index

    def remove_request(self, req_id: str) -> int | None:
        """Free a request's row (``condense`` must follow)."""
        index = self.req_id_to_index.pop(req_id, None)
        if index is not None:
            self._req_ids[index] = None
            self.spec_token_ids[index] = []
            self._removed.append(index)
        return index

    def update_req_spec_token_ids(self, state: Any, scheduled: dict[str, list[int]]) -> None:
        """Write the drafts scheduled for verification after the row's tokens, as vLLM does."""
        index = self.req_id_to_index[state.req_id]
        drafts = list(scheduled.get(state.req_id, ()))
        self.spec_token_ids[index] = drafts
        start = int(self.num_tokens_no_spec[index])
        self.token_ids_cpu[index, start:start + len(drafts)] = drafts

    def condense(self) -> None:
        """Move the last requests down into the rows freed and not refilled."""
        empty = sorted(self._removed)
        self._removed = []
        last = len(self._req_ids) - 1
        for index in empty:
            while last >= 0 and self._req_ids[last] is None:
                last -= 1
            if index >= last:
                break
            req_id = self._req_ids[last]
            assert req_id is not None
            n = int(self.num_tokens_no_spec[last]) + len(self.spec_token_ids[last])
            self._req_ids[index], self._req_ids[last] = req_id, None
            self.req_id_to_index[req_id] = index
            self.token_ids_cpu[index, :n] = self.token_ids_cpu[last, :n]
            self.num_tokens_no_spec[index] = self.num_tokens_no_spec[last]
            self.num_prompt_tokens[index] = self.num_prompt_tokens[last]
            self.spec_token_ids[index], self.spec_token_ids[last] = self.spec_token_ids[last], []
            last -= 1
        while self._req_ids and self._req_ids[-1] is None:
            self._req_ids.pop()
            self.spec_token_ids.pop()

    def refresh_metadata(self) -> None:
        """Nothing to refresh: no sampling state here."""


class BenchRunner:
    """The parts of vLLM's ``GPUModelRunner`` a proposer sees: ``drafter``, ``input_batch`` and ``requests``.

    ``propose_draft_token_ids`` calls the proposer exactly as the runner does for its method (DrafterProposer finds
    the runner through its caller's frame, so the call must come from a method of this object).
    """

    def __init__(self, drafter: Any, kind: str, input_batch: Any, k: int) -> None:
        if kind not in PROPOSER_KINDS:
            raise ValueError(f"unknown proposer kind {kind!r}: {', '.join(PROPOSER_KINDS)}")
        self.drafter, self.kind, self.input_batch, self.k = drafter, kind, input_batch, k
        self.requests: dict[str, Any] = {}

    def load_model(self) -> None:
        self.drafter.load_model(None)

    def propose_draft_token_ids(self, sampled_token_ids: list[list[int]]) -> list[list[int]]:
        batch = self.input_batch
        if self.kind == "ngram":
            return list(self.drafter.propose(self.k, sampled_token_ids, batch.num_tokens_no_spec,
                                             batch.token_ids_cpu, slot_mappings=None))
        if self.kind == "suffix":
            return list(self.drafter.propose(self.k, batch, sampled_token_ids, slot_mappings=None))
        return list(self.drafter.propose(sampled_token_ids, batch.num_tokens_no_spec, batch.token_ids_cpu,
                                         slot_mappings=None))


@dataclass
class ReplayRun:
    """What one proposer did over one replay.

    Attributes:
        propose_ms: time inside each timed ``propose``, in milliseconds.
        row_tokens: tokens each decode row gained per timed step (accepted draft tokens + the bonus token).
        drafted: decode rows of the timed steps that had a non-empty draft to verify.
        draft_tokens: draft tokens verified over the timed steps.
        accepted: draft tokens accepted over the timed steps.
        completed: held-back requests finished during the timed steps.
        exhausted: the held-back requests ran out during the timed steps (rows were left empty).
    """

    propose_ms: list[float] = field(default_factory=list)
    row_tokens: list[int] = field(default_factory=list)
    drafted: int = 0
    draft_tokens: int = 0
    accepted: int = 0
    completed: int = 0
    exhausted: bool = False

    @property
    def tokens_per_step(self) -> float:
        """Mean tokens a decode row gains per step (1.0 without speculation)."""
        return float(np.mean(self.row_tokens)) if self.row_tokens else 0.0

    def summary(self) -> dict[str, Any]:
        ms = np.asarray(self.propose_ms, dtype=np.float64)  # (steps,)
        return {"steps": len(self.propose_ms), "rows": len(self.row_tokens),
                "p50_ms": float(np.percentile(ms, 50)) if ms.size else 0.0,
                "p99_ms": float(np.percentile(ms, 99)) if ms.size else 0.0,
                "mean_ms": float(ms.mean()) if ms.size else 0.0, "tokens_per_step": self.tokens_per_step,
                "drafted": self.drafted, "draft_tokens": self.draft_tokens, "accepted": self.accepted,
                "completed": self.completed, "exhausted": self.exhausted}


class StepLoop:
    """B running requests replaying held-back ones, stepped as vLLM's engine steps them.

    Each step: the requests finished last step leave the batch and held-back ones take their rows (vLLM's
    ``_update_states``: remove, add into the lowest freed rows, condense); the drafts proposed last step are
    scheduled; the forward pass is simulated by ``sleep(step_ms)``; each row then gains its sampled tokens (greedy:
    the longest prefix of its draft matching the recorded output, then the target's own next token; a new request
    gains its first output token from the prefill) and ``propose`` is called and timed.

    Args:
        runner: a ``BenchRunner`` holding the proposer and the input batch.
        held: the held-back requests, replayed in order, each once.
        batch: B, the requests running at once.
        make_state: (request id, prompt, max_tokens) -> the runner's state of a new request.
        step_ms: simulated forward pass between two ``propose`` calls.
        sleep: how to wait ``step_ms`` (tests pass a no-op).
    """

    def __init__(self, runner: BenchRunner, held: Sequence[Request], batch: int,
                 make_state: Callable[[str, Sequence[int], int], Any] = simple_state, step_ms: float = 20.0,
                 sleep: Callable[[float], object] = time.sleep) -> None:
        self.runner, self.held, self.batch = runner, held, batch
        self.make_state, self.step_ms, self.sleep = make_state, step_ms, sleep
        self.next = 0  # the next held-back request to start
        self.outputs: dict[str, np.ndarray] = {}  # running request -> its recorded output
        self.pos: dict[str, int] = {}  # running request -> output tokens it holds
        self.drafts: dict[str, list[int]] = {}  # request -> draft proposed last step
        self.finished: list[str] = []  # requests done last step, to leave the batch this step
        self.order: list[str] = []  # request ids in the order they were started

    def _admit(self) -> list[str]:
        """vLLM's ``_update_states``: finished requests leave, held-back ones fill the free rows."""
        runner, batch = self.runner, self.runner.input_batch
        for req_id in self.finished:
            runner.requests.pop(req_id, None)
            batch.remove_request(req_id)
            self.outputs.pop(req_id)
            self.pos.pop(req_id)
            self.drafts.pop(req_id, None)
        self.finished = []
        new: list[str] = []
        for req_id in list(self.outputs):
            state = runner.requests[req_id]
            batch.update_req_spec_token_ids(state, {req_id: self.drafts.get(req_id, [])})
        while len(self.outputs) < self.batch and self.next < len(self.held):
            req = self.held[self.next]
            self.next += 1
            req_id = f"{self.next - 1}-{req.request_id}"
            state = self.make_state(req_id, req.prompt.tolist(), int(req.output.size))
            runner.requests[req_id] = state
            batch.add_request(state)
            self.outputs[req_id], self.pos[req_id] = req.output, 0
            self.order.append(req_id)
            new.append(req_id)
        batch.condense()
        batch.refresh_metadata()
        return new

    def step(self, run: ReplayRun | None) -> bool:
        """One engine step; its figures go to ``run`` (None: not timed). False once no request is left."""
        new = set(self._admit())
        batch = self.runner.input_batch
        rows = list(batch.req_ids)
        if not rows:
            return False
        if run is not None and self.next >= len(self.held) and len(rows) < self.batch:
            run.exhausted = True
        if self.step_ms > 0:
            self.sleep(self.step_ms / 1e3)
        sampled: list[list[int]] = []
        for i, req_id in enumerate(rows):
            out, pos = self.outputs[req_id], self.pos[req_id]
            draft = self.drafts.pop(req_id, [])
            accepted = 0 if req_id in new else greedy_accept(draft, out[pos:].tolist())
            gained = out[pos:pos + accepted + 1].tolist()
            start = int(batch.num_tokens_no_spec[i])
            batch.token_ids_cpu[i, start:start + len(gained)] = gained
            batch.num_tokens_no_spec[i] = start + len(gained)
            self.runner.requests[req_id].output_token_ids.extend(gained)
            self.pos[req_id] = pos + len(gained)
            sampled.append(gained)
            if run is not None and req_id not in new:
                run.row_tokens.append(len(gained))
                run.drafted += bool(draft)
                run.draft_tokens += len(draft)
                run.accepted += accepted
        t0 = time.perf_counter()
        drafts = self.runner.propose_draft_token_ids(sampled)
        elapsed = time.perf_counter() - t0
        if run is not None:
            run.propose_ms.append(elapsed * 1e3)
        for req_id, draft in zip(rows, drafts, strict=True):
            if self.pos[req_id] >= self.outputs[req_id].size:
                self.finished.append(req_id)
                if run is not None:
                    run.completed += 1
            else:
                self.drafts[req_id] = [int(t) for t in draft]
        return True

    def run(self, steps: int, warmup: int = 0) -> ReplayRun:
        """``warmup`` untimed steps, then up to ``steps`` timed ones (fewer when the held-back requests run out)."""
        run = ReplayRun()
        for _ in range(warmup):
            if not self.step(None):
                return run
        for _ in range(steps):
            if not self.step(run):
                break
        return run


def proposer_figures(proposer: Any) -> dict[str, float]:
    """DrafterProposer's ``FIGURES`` now (all 0 before it connects)."""
    tracker = getattr(proposer, "_tracker", None)
    if tracker is not None and hasattr(tracker, "sync_figures"):
        tracker.sync_figures()  # pre-speculation's counts join the figures when they are written
    figures = vars(tracker.figures) if tracker is not None else {}
    return {name: float(figures.get(name, 0)) for name in FIGURES}


def close_proposer(proposer: Any) -> None:
    """Stop a DrafterProposer's threads and channel, so that nothing of it runs during later runs (best effort:
    whichever of these the proposer has)."""
    closing = getattr(proposer, "_closing", None)
    if closing is not None:
        closing.set()
    tracker = getattr(proposer, "_tracker", None)
    speculator = getattr(tracker, "speculator", None)
    calls = [getattr(proposer, "close", None), getattr(speculator, "close_all", None),
             getattr(getattr(tracker, "client", None), "close", None)]
    for call in calls:
        if callable(call):
            try:
                call()
            except Exception:  # a proposer that fails to close does not fail the benchmark
                traceback.print_exc()

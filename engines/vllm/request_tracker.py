"""vLLM's rows turned into requests, their new tokens and their chains: the proposer's per-step work.

vLLM passes rows, not requests: row ``i`` of a step belongs to ``req_ids[i]`` (the model runner's input batch), and
rows move as requests finish. Per row this does a dictionary lookup and a few list operations (a row's new tokens
are normally its sampled tokens; vLLM's token buffer is read only where they do not line up); chains come from the
``PreSpeculator``.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable, Container, Sequence
from dataclasses import dataclass, field
from functools import partial
from typing import Any

from drafter_service.api.verify_budget import VerifyBudget
from engine_client.prespeculation import PreSpeculator, Tracked
from engines.vllm.budget_learning import DeferredLearning

__all__ = ["RequestTracker", "StepFigures", "RequestLimits"]

RequestLimits = Callable[[str, int], tuple[int, frozenset[int]]]
"""(request id, prompt length) -> (most tokens the request may hold, token ids that end it)."""


def no_limits(req_id: str, prompt_len: int) -> tuple[int, frozenset[int]]:
    """No token limit and no stop tokens."""
    return sys.maxsize, frozenset()


@dataclass
class StepFigures:
    """What the proposer did so far (written to ``ProposerSettings.stats_file``)."""

    steps: int = 0  # propose calls
    rows: int = 0  # request rows seen over all steps
    drafted_rows: int = 0  # rows given a non-empty chain
    draft_tokens: int = 0
    opened: int = 0  # requests followed
    ended: int = 0  # requests ended (stored by the service)
    failures: int = 0  # steps that raised inside the proposer (no drafts that step)
    seconds: float = 0.0  # time inside propose
    seconds_max: float = 0.0
    offered_tokens: int = 0  # chain tokens before the verify budget cut them (equal to draft_tokens without one)
    cost_points: list[tuple[float, float]] = field(default_factory=list)  # the budget's (tokens, seconds) per step
    acceptance_gamma: float = 1.0  # the budget's calibration exponent
    prespec_hits: int = 0  # rows whose chain came from a tree drafted one step ahead (no network)
    prespec_misses: int = 0  # rows whose pre-speculated tree held no chain
    sync_waits: int = 0  # steps that waited for their own answer
    late_answers: int = 0  # waits that ended without an answer (the breaker opened)
    looked_up: int = 0  # missed rows given a chain by prompt lookup over their own context
    answers: int = 0  # DraftBatch answers that landed
    round_trip_ms: float = 0.0  # running mean of a DraftBatch round trip
    step_ms: float = 0.0  # running mean of the engine's step
    longest_step_ms: float = 0.0  # the longest time from one step to the next, no request joining between
    sender_cpu_ms: float = 0.0  # CPU time of pre-speculation's background thread so far


class _Request:
    """One request: its pre-speculation handle and what limits it."""

    __slots__ = ("req", "known", "limit", "stops", "done", "probs")

    def __init__(self, req: Tracked, known: int, limit: int, stops: frozenset[int]) -> None:
        self.req = req
        self.known = known  # tokens recorded (prompt and output)
        self.limit = limit  # most tokens the request may hold: later ones are vLLM's overshoot
        self.stops = stops  # token ids that end it
        self.done = False  # a stop token or the limit reached: nothing more to send or draft (unless it goes on)
        self.probs: list[float] = []  # the estimates of the chain proposed last, for the calibration


class RequestTracker:
    """Follows vLLM's requests across engine steps; ``step`` returns each row's chain.

    A request is followed from the first time it has a row with sampled tokens; each step records the tokens its
    row gained since (so a skipped step loses nothing); a request the runner no longer holds is ended (the service
    stores it).

    Args:
        speculator: where chains come from and tokens go.
        k: most tokens per chain.
        max_model_len: vLLM's limit on a request's tokens.
        limits: each request's token limit and stop tokens.
        budget: cuts the chains to what pays for the batch (its curve's sizes are the step's query tokens: one per
            row plus the draft tokens); None proposes every chain whole.
        clock: seconds, for the step times (between consecutive steps).
    """

    def __init__(self, speculator: PreSpeculator, k: int, max_model_len: int, limits: RequestLimits = no_limits,
                 budget: VerifyBudget | None = None, clock: Callable[[], float] = time.perf_counter) -> None:
        self.speculator, self.k, self.max_model_len = speculator, k, max_model_len
        self.limits, self.clock = limits, clock
        self._learning = DeferredLearning(budget) if budget is not None else None
        self.requests: dict[str, _Request] = {}
        self.figures = StepFigures()
        self.last_rows: tuple[str, ...] = ()  # the request of each row, last step
        self._last_step: tuple[float, int] | None = None  # (time, query tokens) of the previous step
        self._last_began = 0.0
        self._alone: tuple[Tracked, int] | None = None  # (request, rows) of the last step that drafted one request

    def step(self, req_ids: Sequence[str], prompt_lens: Sequence[int], sampled: Sequence[Sequence[int]],
             num_tokens: Any, token_ids: Any, ids: tuple[str, ...] | None = None) -> list[list[int]]:
        """Drafts for one engine step: a chain (plain ints, at most ``k``) per row of ``sampled``.

        Args:
            req_ids: the request id of each row.
            prompt_lens: each row's prompt length (read for the rows of requests seen for the first time).
            sampled: tokens each row gained this step ([] for a prefill still in progress: it gets no draft).
            num_tokens: (rows,) each row's token count (prompt and output, this step's tokens included).
            token_ids: (rows, max_model_len) array; row i's first ``num_tokens[i]`` entries are its tokens.
            ids: ``tuple(req_ids[:len(sampled)])`` when the caller has it already.
        """
        began = self.clock()
        rows = len(sampled)
        fig = self.figures
        fig.steps += 1
        fig.rows += rows
        if ids is None:
            ids = tuple(req_ids[:rows])
        counts = num_tokens[:rows].tolist() if hasattr(num_tokens, "tolist") else list(num_tokens[:rows])
        at: list[int] = []
        reqs: list[_Request] = []
        new: list[list[int]] = []
        room: list[int] = []
        requests, k, max_len = self.requests, self.k, self.max_model_len
        for i, (rid, got, n) in enumerate(zip(ids, sampled, counts, strict=True)):
            if not got:
                continue
            q = requests.get(rid)
            if q is None:
                q = self._open(rid, int(prompt_lens[i]), token_ids[i])
            if q.done:
                if n <= q.known or q.known >= q.limit:
                    continue
                # the engine went on past a token taken for a stop (it applies stops it was not given): follow the
                # request again, to its token limit alone
                q.done, q.stops = False, frozenset()
            if q.known + len(got) == n and n <= q.limit:
                toks = list(got)  # the usual step: the sampled tokens are exactly what the row gained
            else:
                upto = min(n, q.limit)
                toks = token_ids[i, q.known:upto].tolist() if upto > q.known else []
            if q.stops and not q.stops.isdisjoint(toks):
                stop = next(j for j, tok in enumerate(toks) if tok in q.stops)
                del toks[stop + 1:]
                q.done = True
            q.known += len(toks)
            if q.done or q.known >= q.limit:
                q.done = True
                room.append(0)
            else:
                room.append(min(k, max_len - n - 1) if max_len - n - 1 > 0 else 0)
            at.append(i)
            reqs.append(q)
            new.append(toks)
        draft_tokens = 0
        if not reqs:
            out: list[list[int]] = [[] for _ in range(rows)]
        elif len(at) == rows:  # every row has its request's new tokens: chains in row order
            out, draft_tokens = self._draft(reqs, new, room, rows)
        else:
            out = [[] for _ in range(rows)]
            chains, draft_tokens = self._draft(reqs, new, room, rows)
            for i, chain in zip(at, chains, strict=True):
                out[i] = chain
        self._time_step(began, ids, all(sampled), rows + draft_tokens)
        return out

    def _open(self, req_id: str, prompt_len: int, row: Any) -> _Request:
        limit, stops = self.limits(req_id, prompt_len)
        q = self.requests[req_id] = _Request(self.speculator.open(row[:prompt_len].tolist()), prompt_len, limit,
                                             stops)
        self.figures.opened += 1
        return q

    def _draft(self, reqs: list[_Request], new: list[list[int]], room: list[int], rows: int
               ) -> tuple[list[list[int]], int]:
        """Record the rows' new tokens and cut their chains (by the budget, when there is one); returns the chains
        and their tokens."""
        handles = [q.req for q in reqs]
        learning = self._learning  # None without a budget
        if learning is not None:
            self._learn(reqs, new)
        tokens, probs = self.speculator.step(handles, new, room)
        offered = sum(map(len, tokens))
        fig = self.figures
        fig.offered_tokens += offered
        if learning is not None:
            self._alone = (handles[0], rows) if len(handles) == 1 else None
            if offered:
                learning.catch_up()  # the earlier steps' lessons; this step's wait for ``release``
                keep = learning.budget.choose_batch(probs, self.k, base_tokens=rows)  # each <= its chain's length
                self.speculator.proposed(handles, keep)
                offered = sum(keep)
                cut: list[list[int]] = []  # one loop for both cuts
                for q, t, p, n in zip(reqs, tokens, probs, keep, strict=True):
                    cut.append(t[:n])
                    q.probs = p[:n]
                tokens = cut
        fig.drafted_rows += sum(map(bool, tokens))
        fig.draft_tokens += offered
        return tokens, offered

    def _learn(self, reqs: list[_Request], new: list[list[int]]) -> None:
        """Teach the budget's calibration which tokens of the chains proposed last were accepted (a row gains its
        accepted draft tokens plus the target's own). Only with a budget."""
        chains: list[tuple[list[float], int]] = []
        for q, toks in zip(reqs, new, strict=True):
            if q.probs:  # its new tokens are the accepted draft tokens and the target's own
                chains.append((q.probs, len(toks) - 1))
                q.probs = []
        if chains and self._learning is not None:
            self._learning.outcomes(chains)

    def _time_step(self, began: float, ids: tuple[str, ...], all_sampled: bool, tokens: int) -> None:
        """Teach the budget's curve what the previous step cost (from the end of the previous ``step`` to the
        start of this one). A step is timed only when it ran the same requests in the same rows as the one before:
        a request that joined (its prefill would count as draft tokens), left or was still in prefill, or a new
        batch after the engine idled, is not timed."""
        last, self._last_step = self._last_step, (self.clock(), tokens)
        same = ids == self.last_rows
        if last is not None and self._last_began and (same or set(ids) <= set(self.last_rows)):
            self.figures.longest_step_ms = max(self.figures.longest_step_ms, (began - self._last_began) * 1e3)
        self._last_began = began
        self.last_rows = ids
        if self._learning is not None and last is not None and same and all_sampled:
            self._learning.step_time(last[1], began - last[0])

    def end_finished(self, live: Container[str]) -> None:
        """End the sessions of requests no longer in ``live`` (a container of the runner's request ids)."""
        for req_id in [r for r in self.requests if r not in live]:
            req = self.requests.pop(req_id)
            self.speculator.close(req.req)
            self.figures.ended += 1

    def release(self) -> None:
        """The engine's step is done here: what it queued may be sent now, and the budget may learn this step's
        lessons (in the sender's thread, after its call)."""
        learning = self._learning
        if learning is None:
            self.speculator.release()
            return
        alone = self._alone
        self.speculator.release(learning.hand_over(partial(self._upcoming, *alone) if alone is not None else None))

    def _upcoming(self, req: Tracked, rows: int) -> tuple[list[list[float]], int, int] | None:
        """The chains the next step may cut for ``req``, the one request the last step drafted (of ``rows``), to be
        chosen ahead (``VerifyBudget.prepare``): in the sender's thread, once that request's next tree landed."""
        chains = self.speculator.upcoming_estimates(req, self.k)
        return (chains, self.k, rows) if chains else None

    def sync_figures(self) -> None:
        """Copy the speculator's figures, and the budget's curve and calibration, into ``figures``."""
        spec, fig = self.speculator.figures, self.figures
        if self._learning is not None:
            fig.cost_points, fig.acceptance_gamma = self._learning.read(
                lambda b: (b.curve.points(), b.calibration.gamma))
        fig.prespec_hits, fig.prespec_misses, fig.sync_waits, fig.late_answers = (spec.hits, spec.misses,
                                                                                  spec.waits, spec.late)
        fig.looked_up, fig.answers = spec.looked_up, spec.answers
        fig.round_trip_ms, fig.step_ms = spec.round_trip_seconds * 1e3, spec.step_seconds * 1e3
        fig.sender_cpu_ms = self.speculator.sender_cpu_seconds * 1e3

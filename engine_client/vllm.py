"""drafter as vLLM's speculative proposer: one DraftBatch round trip per engine step for every running request.

vLLM (0.32) loads it with ``speculative_config={"method": "custom_class", "model":
"engine_client.vllm.DrafterProposer", "num_speculative_tokens": k}``, builds it in each worker as
``DrafterProposer(vllm_config)`` and calls ``propose`` once per engine step. It is configured from the environment
(see ``ProposerSettings.from_env``). This module imports neither vLLM nor torch.
"""

from __future__ import annotations

import json
import logging
import os
import sys
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

from drafter_service.api.tree import best_chain_nodes
from engine_client.client import DrafterClient
from engine_client.client_common import DrafterRequestError
from engine_client.security import ClientSecurity
from engine_client.verify_budget import VerifyBudget

logger = logging.getLogger(__name__)

__all__ = ["DrafterProposer", "ProposerSettings", "RequestTracker"]

_D = TypeVar("_D")


def _env_float(env: Mapping[str, str], name: str, default: _D) -> float | _D:
    """``name`` from ``env`` as a number; ``default`` when unset or blank."""
    raw = env.get(name, "").strip()
    try:
        return float(raw) if raw else default
    except ValueError:
        raise ValueError(f"{name}={raw!r} is not a number") from None


#: The chain cut without the cost-aware budget: a token must be expected to be accepted this often.
FIXED_MIN_PROB = 0.05


@dataclass(frozen=True)
class ProposerSettings:
    """How the proposer reaches the service and cuts its trees into chains.

    Attributes:
        address: host:port of the drafter service.
        namespace: the namespace of the model's tokenizer ("" = default).
        timeout: seconds one step's DraftBatch call may take; past it the step gets no drafts.
        max_nodes: nodes of the tree asked for per request (0: twice the speculative length, at least 16).
        min_prob: acceptance estimate a chain token must reach to be proposed (what verifying one more token
            costs, in accepted tokens); None: ``chain_min_prob`` decides.
        stats_file: a JSON file the proposer rewrites with its step counts and times ("" = none).
        cost_aware: cut each step's chains to the tokens worth verifying by the step time measured against tokens
            in the batch (``VerifyBudget.choose_batch``, the rule the reference engine and the service use), so
            nothing is proposed where speculation would slow the engine down.
        security: TLS and bearer token.
    """

    address: str = "127.0.0.1:50051"
    namespace: str = ""
    timeout: float = 0.1
    max_nodes: int = 0
    min_prob: float | None = None
    stats_file: str = ""
    cost_aware: bool = True
    security: ClientSecurity = field(default_factory=ClientSecurity)

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> ProposerSettings:
        """Settings from the environment (unset variables keep the defaults).

        DRAFTER_ADDRESS, DRAFTER_NAMESPACE, DRAFTER_TIMEOUT, DRAFTER_MAX_NODES, DRAFTER_CHAIN_MIN_PROB,
        DRAFTER_PROPOSER_STATS, DRAFTER_COST_AWARE (0 turns it off), and the TLS and token variables the
        ``drafter`` commands read (DRAFTER_TOKEN, DRAFTER_TLS, DRAFTER_TLS_ROOT_CA, DRAFTER_TLS_CLIENT_CERT,
        DRAFTER_TLS_CLIENT_KEY, DRAFTER_TLS_SERVER_NAME).

        Raises:
            ValueError: a value that is not a number, or inconsistent TLS settings.
        """
        env = os.environ if environ is None else environ
        default = cls()
        settings = cls(address=env.get("DRAFTER_ADDRESS", "").strip() or default.address,
                       namespace=env.get("DRAFTER_NAMESPACE", default.namespace),
                       timeout=_env_float(env, "DRAFTER_TIMEOUT", default.timeout),
                       max_nodes=int(_env_float(env, "DRAFTER_MAX_NODES", default.max_nodes)),
                       min_prob=_env_float(env, "DRAFTER_CHAIN_MIN_PROB", default.min_prob),
                       stats_file=env.get("DRAFTER_PROPOSER_STATS", ""),
                       cost_aware=_env_float(env, "DRAFTER_COST_AWARE", 1.0) != 0.0,
                       security=ClientSecurity.from_env(env))
        if settings.timeout <= 0 or settings.max_nodes < 0 or not 0.0 <= settings.chain_min_prob <= 1.0:
            raise ValueError(f"DRAFTER_TIMEOUT must be > 0, DRAFTER_MAX_NODES >= 0 and DRAFTER_CHAIN_MIN_PROB in "
                             f"[0, 1]; got {settings.timeout}, {settings.max_nodes}, {settings.chain_min_prob}")
        return settings

    @property
    def chain_min_prob(self) -> float:
        """The minimum estimate of a chain token: ``min_prob`` when set; else none with ``cost_aware`` (the
        step-cost rule alone decides what is worth verifying) and ``FIXED_MIN_PROB`` without it."""
        if self.min_prob is not None:
            return self.min_prob
        return 0.0 if self.cost_aware else FIXED_MIN_PROB

    def tree_nodes(self, k: int) -> int:
        """Nodes of the tree asked for per request when the engine verifies chains of at most ``k`` tokens."""
        return self.max_nodes or max(16, 2 * k)


@dataclass
class _Request:
    session: str  # the client's session id
    known: int  # tokens of the request the session holds (prompt and output)
    limit: int  # most tokens the request may hold (prompt and max_tokens): later ones are vLLM's overshoot
    stops: frozenset[int]  # token ids that end it
    done: bool = False  # a stop token or the limit reached: nothing more to send or draft


RequestLimits = Callable[[str, int], tuple[int, frozenset[int]]]
"""(request id, prompt length) -> (most tokens the request may hold, token ids that end it)."""


def _no_limits(req_id: str, prompt_len: int) -> tuple[int, frozenset[int]]:
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
    failures: int = 0  # steps whose DraftBatch call raised (no drafts that step)
    seconds: float = 0.0  # time inside propose
    seconds_max: float = 0.0
    offered_tokens: int = 0  # chain tokens before the verify budget cut them (equal to draft_tokens without one)
    cost_points: list[tuple[float, float]] = field(default_factory=list)  # the budget's (tokens, seconds) per step
    acceptance_gamma: float = 1.0  # the budget's calibration exponent


class RequestTracker:
    """Follows vLLM's requests across engine steps and turns each step into one ``draft_batch`` call.

    vLLM passes rows, not requests: row ``i`` of a step belongs to ``req_ids[i]`` (from the model runner's input
    batch), and rows move as requests finish. A request gets a session the first time it has a row with sampled
    tokens, each step sends the tokens its row gained since, and a request the runner no longer holds is ended
    (the service stores it).
    """

    def __init__(self, client: DrafterClient, k: int, max_model_len: int, max_nodes: int, min_prob: float,
                 limits: RequestLimits = _no_limits, budget: VerifyBudget | None = None,
                 clock: Callable[[], float] = time.perf_counter) -> None:
        """Args (besides the client and vLLM's figures):
            budget: cuts the chains to what pays for the batch (its curve's sizes are the step's query tokens:
                one per row plus the draft tokens); None proposes every chain whole.
            clock: seconds, for the step times (between consecutive steps).
        """
        self.client, self.k, self.max_model_len = client, k, max_model_len
        self.max_nodes, self.min_prob, self.limits = max_nodes, min_prob, limits
        self.budget, self.clock = budget, clock
        self.requests: dict[str, _Request] = {}
        self.figures = StepFigures()
        self._proposed: dict[str, tuple[list[int], list[float]]] = {}  # request -> last chain and its estimates
        # (time, requests, query tokens) of the previous step
        self._last_step: tuple[float, tuple[str, ...], int] | None = None

    def step(self, req_ids: Sequence[str], prompt_lens: Sequence[int], sampled: Sequence[Sequence[int]],
             num_tokens: Sequence[int], token_ids: Any) -> list[list[int]]:
        """Drafts for one engine step: a chain (plain ints, at most ``k``) per row of ``sampled``.

        Args:
            req_ids: the request id of each row.
            prompt_lens: each row's prompt length.
            sampled: tokens each row gained this step ([] for a prefill still in progress: it gets no draft).
            num_tokens: each row's token count (prompt and output, this step's tokens included).
            token_ids: (rows, max_model_len) array; row i's first ``num_tokens[i]`` entries are its tokens.
        """
        out: list[list[int]] = [[] for _ in sampled]
        items: list[tuple[str, list[int]]] = []
        rows: list[int] = []
        self._learn(req_ids, sampled)
        for i, new in enumerate(sampled):
            n = int(num_tokens[i])
            if not len(new) or n >= self.max_model_len - 1:
                continue
            req = self.requests.get(req_ids[i])
            if req is None:
                prompt_len = int(prompt_lens[i])
                session = self.client.start(token_ids[i, :prompt_len].tolist(), open_now=False)
                req = self.requests[req_ids[i]] = _Request(session, prompt_len, *self.limits(req_ids[i], prompt_len))
                self.figures.opened += 1
            if req.done:
                continue
            gained = token_ids[i, req.known:min(n, req.limit)].tolist()
            for j, tok in enumerate(gained):
                if tok in req.stops:
                    del gained[j + 1:]
                    req.done = True
                    break
            req.known += len(gained)
            req.done = req.done or req.known >= req.limit
            items.append((req.session, gained))
            rows.append(i)
        self.figures.steps += 1
        self.figures.rows += len(sampled)
        if not items:
            return out
        trees = self.client.draft_batch(items, self.max_nodes)
        chains: list[tuple[int, list[int], list[float]]] = []
        for i, tree in zip(rows, trees, strict=True):
            if self.requests[req_ids[i]].done:
                continue
            nodes = best_chain_nodes(tree, min(self.k, self.max_model_len - int(num_tokens[i]) - 1), self.min_prob)
            if nodes:
                chains.append((i, [tree.token_ids[j] for j in nodes], [tree.probs[j] for j in nodes]))
        self.figures.offered_tokens += sum(len(toks) for _, toks, _ in chains)
        if self.budget is not None:
            keep = self.budget.choose_batch([probs for *_, probs in chains], self.k, base_tokens=len(sampled))
            chains = [(i, toks[:n], probs[:n]) for (i, toks, probs), n in zip(chains, keep, strict=True)]
            self.figures.cost_points = self.budget.curve.points()
            self.figures.acceptance_gamma = self.budget.calibration.gamma
        for i, toks, probs in chains:
            if toks:
                out[i] = toks
                self._proposed[req_ids[i]] = (toks, probs)
                self.figures.drafted_rows += 1
                self.figures.draft_tokens += len(toks)
        self._last_step = (self.clock(), tuple(req_ids), len(sampled) + sum(len(c) for c in out))
        return out

    def _learn(self, req_ids: Sequence[str], sampled: Sequence[Sequence[int]]) -> None:
        """Teach the budget what the previous step cost and which proposed tokens were accepted.

        A step is timed from the previous ``step`` call to this one, and only when it ran the same requests in the
        same rows: a request that joined (its prefill tokens would count as draft tokens), left or was still in
        prefill, or a new batch after the engine idled (the idle time would count as the step's), is not timed.
        """
        proposed, self._proposed = self._proposed, {}
        last, self._last_step = self._last_step, None
        if self.budget is None or last is None:
            return
        estimates: list[float] = []
        outcomes: list[bool] = []
        for req_id, new in zip(req_ids, sampled, strict=True):
            chain = proposed.get(req_id)
            if chain is not None and len(new):
                toks, probs = chain
                accepted = 0
                while accepted < min(len(toks), len(new) - 1) and new[accepted] == toks[accepted]:
                    accepted += 1
                estimates += probs
                outcomes += [j < accepted for j in range(len(toks))]
        self.budget.calibration.observe(estimates, outcomes)  # one step: its evidence decays once
        at, requests, tokens = last
        if requests == tuple(req_ids) and all(len(new) for new in sampled):
            self.budget.curve.observe(tokens, self.clock() - at)

    def end_finished(self, live: Any) -> None:
        """End the sessions of requests no longer in ``live`` (a container of the runner's request ids)."""
        for req_id in [r for r in self.requests if r not in live]:
            req = self.requests.pop(req_id)
            self.client.end(req.session, [])
            self.figures.ended += 1


class DrafterProposer:
    """vLLM's ``custom_class`` proposer backed by a drafter service.

    Every ``propose`` is one DraftBatch round trip for all rows; each tree is cut to its best chain (see
    ``best_chain``). Requests are followed through the model runner that calls ``load_model``; finished ones are
    ended (stored) by the next step or, when the engine goes idle, by a watcher thread within a fraction of a
    second. Nothing here raises into vLLM: the service away, slow or refusing means empty drafts for that step.
    """

    def __init__(self, vllm_config: Any) -> None:
        spec = vllm_config.speculative_config
        self.k = int(spec.num_speculative_tokens)
        self.max_model_len = int(vllm_config.model_config.max_model_len)
        self.vocab_size = int(vllm_config.model_config.get_vocab_size())
        self.settings = ProposerSettings.from_env()
        self._runner: Any = None
        self._lock = threading.Lock()
        self._last_step = time.monotonic()
        self._tracker: RequestTracker | None = None
        self._closing = threading.Event()
        self._watcher: threading.Thread | None = None

    # -- vLLM's interface --------------------------------------------------------------------------------

    def load_model(self, *args: Any, **kwargs: Any) -> None:
        """Called by the model runner once its model is loaded: find that runner and connect to the service."""
        self._find_runner(sys._getframe(1))
        self._connect()

    def propose(self, sampled_token_ids: list[list[int]], num_tokens_no_spec: Any, token_ids_cpu: Any,
                slot_mappings: Any = None, **kwargs: Any) -> list[list[int]]:
        """Draft token ids for each row of this step (``[]`` where there is no draft)."""
        t0 = time.perf_counter()
        rows = len(sampled_token_ids)
        try:
            if self._runner is None:
                self._find_runner(sys._getframe(1))
            tracker = self._tracker
            if tracker is None or self._runner is None:
                return [[] for _ in range(rows)]
            batch = self._runner.input_batch
            with self._lock:
                try:
                    drafts = tracker.step(batch.req_ids[:rows], batch.num_prompt_tokens[:rows], sampled_token_ids,
                                          num_tokens_no_spec, token_ids_cpu)
                except DrafterRequestError as exc:  # vLLM's own tokens refused: a configuration mistake
                    logger.error("drafter: the service refused this engine's requests (%s); is DRAFTER_NAMESPACE "
                                 "the namespace of this model's tokenizer? No drafts from now on", exc)
                    self._tracker = None
                    drafts = [[] for _ in range(rows)]
                except Exception:
                    tracker.figures.failures += 1
                    logger.exception("drafter: this step gets no drafts")
                    drafts = [[] for _ in range(rows)]
                self._end_finished(tracker)
                self._timed(tracker, time.perf_counter() - t0)
            return drafts
        except Exception:
            logger.exception("drafter: this step gets no drafts")
            return [[] for _ in range(rows)]
        finally:
            self._last_step = time.monotonic()

    # -- internals -----------------------------------------------------------------------------------------

    def _find_runner(self, frame: Any) -> None:
        """Keep the model runner that called us: its input batch names the request of each row."""
        runner = frame.f_locals.get("self") if frame is not None else None
        if runner is not None and getattr(runner, "drafter", None) is self and hasattr(runner, "input_batch"):
            self._runner = runner
        elif self._runner is None:
            logger.error("drafter: the caller is not a vLLM model runner holding this proposer; no drafts (the "
                         "proposer follows vLLM 0.32's runner)")

    def _connect(self) -> None:
        if self._tracker is not None:
            return
        s = self.settings
        try:
            client = DrafterClient(s.address, s.namespace, timeout=s.timeout, reuse=False,
                                   max_nodes=s.tree_nodes(self.k), security=s.security)
        except Exception:
            logger.exception("drafter: could not set up a client for %s; no drafts", s.address)
            return
        vocab = client.vocab_size
        if vocab is not None and vocab < self.vocab_size:
            logger.error("drafter: namespace %r of %s has a vocabulary of %d tokens, this model %d; no drafts (set "
                         "DRAFTER_NAMESPACE to a namespace of this model's tokenizer)", s.namespace, s.address, vocab,
                         self.vocab_size)
            client.close()
            return
        self._tracker = RequestTracker(client, self.k, self.max_model_len, 0, s.chain_min_prob, self._limits,
                                       VerifyBudget() if s.cost_aware else None)
        logger.info("drafter: proposing up to %d tokens per request from %s (namespace %r)", self.k, s.address,
                    s.namespace)
        self._watcher = threading.Thread(target=self._watch, name="drafter-proposer", daemon=True)
        self._watcher.start()

    def _limits(self, req_id: str, prompt_len: int) -> tuple[int, frozenset[int]]:
        """A request's token limit and stop tokens, from its sampling parameters (none when unknown)."""
        params = getattr(self._runner.requests.get(req_id), "sampling_params", None)
        max_tokens = getattr(params, "max_tokens", None)
        stops = frozenset(getattr(params, "all_stop_token_ids", None) or ())
        return (prompt_len + max_tokens if max_tokens else sys.maxsize), stops

    def _end_finished(self, tracker: RequestTracker) -> None:
        try:
            tracker.end_finished(self._runner.requests)
        except Exception:
            logger.exception("drafter: could not end finished requests")

    def _watch(self) -> None:
        """While the engine is idle, end the requests it finished (no step comes to do it)."""
        last_written = -1
        while not self._closing.wait(0.2):
            tracker = self._tracker
            if tracker is None or self._runner is None:
                continue
            if time.monotonic() - self._last_step > 0.2 and self._lock.acquire(blocking=False):
                try:
                    self._end_finished(tracker)
                finally:
                    self._lock.release()
            figures = tracker.figures
            if self.settings.stats_file and figures.steps + figures.ended != last_written:
                last_written = figures.steps + figures.ended
                self._write_figures(figures)

    def _timed(self, tracker: RequestTracker, seconds: float) -> None:
        figures = tracker.figures
        figures.seconds += seconds
        figures.seconds_max = max(figures.seconds_max, seconds)

    def _write_figures(self, figures: StepFigures) -> None:
        path = self.settings.stats_file
        try:
            tmp = f"{path}.{os.getpid()}.tmp"
            with open(tmp, "w") as f:
                json.dump(vars(figures), f)
            os.replace(tmp, path)
        except OSError:
            logger.exception("drafter: could not write %s", path)

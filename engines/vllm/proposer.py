"""drafter as vLLM's speculative proposer: chains ready before vLLM asks, the service reached off the critical path.

vLLM (0.32) loads it with ``speculative_config={"method": "custom_class", "model":
"engines.vllm.DrafterProposer", "num_speculative_tokens": k}``, builds it in each worker as
``DrafterProposer(vllm_config)`` and calls ``propose`` once per engine step, synchronously. Each chain is cut from
a tree the service drafted one step ahead (``PreSpeculator``); the step's tokens go to the service from a
background thread. It is configured from the environment (see ``ProposerSettings.from_env``). This module imports
neither vLLM nor torch.
"""

from __future__ import annotations

import json
import logging
import os
import sys
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, TypeVar

from drafter_service.api.verify_budget import VerifyBudget
from engine_client.client import DrafterClient
from engine_client.prespeculation import PreSpeculator
from engine_client.security import ClientSecurity
from engines.vllm.request_tracker import RequestTracker, StepFigures

logger = logging.getLogger(__name__)

__all__ = ["DrafterProposer", "ProposerSettings", "FIXED_MIN_PROB", "SUPPORTED_VLLM", "check_vllm", "drafting_rank",
           "stop_tokens"]

_D = TypeVar("_D")


def _env_float(env: Mapping[str, str], name: str, default: _D) -> float | _D:
    """``name`` from ``env`` as a number; ``default`` when unset or blank."""
    raw = env.get(name, "").strip()
    try:
        return float(raw) if raw else default
    except ValueError:
        raise ValueError(f"{name}={raw!r} is not a number") from None


#: How many times ``ProposerSettings.timeout`` the background DraftBatch may take (a step waits at most the timeout).
BACKGROUND_DEADLINE = 10

#: vLLM releases (major, minor) whose ``custom_class`` interface the proposer follows: the V1 model runner's call
#: ``propose(sampled_token_ids, num_tokens_no_spec, token_ids_cpu, slot_mappings=...)``, its ``input_batch``
#: (``req_ids``, ``num_prompt_tokens``) and ``requests`` (``sampling_params``). 0.33 kept 0.32's.
SUPPORTED_VLLM = ((0, 32), (0, 33))


def check_vllm(version: str | None, uses_v2_runner: bool = False) -> str:
    """Refuse a vLLM the proposer cannot serve; return a warning for one it was not checked against ("" if none).

    Args:
        version: ``vllm.__version__`` (None: unknown, e.g. a stand-in runner).
        uses_v2_runner: vLLM runs its Model Runner V2 (``VLLM_USE_V2_MODEL_RUNNER=1``), which has no
            ``custom_class`` proposers.

    Raises:
        ValueError: a release before 0.32 (no ``custom_class`` interface of this shape), or Model Runner V2.
    """
    if uses_v2_runner:
        raise ValueError("drafter's proposer needs vLLM's V1 model runner: unset VLLM_USE_V2_MODEL_RUNNER (vLLM picks "
                         "the V1 runner for custom_class proposers by itself)")
    if version is None:
        return ""
    parts = version.split("+")[0].split(".")
    try:
        release = (int(parts[0]), int(parts[1]))
    except (IndexError, ValueError):
        return f"drafter's proposer was checked against vLLM 0.32 and 0.33; this vLLM says it is {version!r}"
    if release < SUPPORTED_VLLM[0]:
        raise ValueError(f"drafter's proposer needs vLLM 0.32 or 0.33 (custom_class proposers), not {version}")
    if release not in SUPPORTED_VLLM:
        return (f"drafter's proposer follows vLLM 0.32 and 0.33's custom_class interface; vLLM {version} may "
                "differ (drafts stop, with an error in this log, if its model runner changed)")
    return ""

#: The chain cut without the cost-aware budget: a token must be expected to be accepted this often.
FIXED_MIN_PROB = 0.05


@dataclass(frozen=True)
class ProposerSettings:
    """How the proposer reaches the service and cuts its trees into chains.

    Attributes:
        address: host:port of the drafter service.
        namespace: the namespace of the model's tokenizer ("" = default).
        timeout: the longest a step ever waits for the service; the background DraftBatch may take
            ``BACKGROUND_DEADLINE`` times as long (a late answer still brings the next steps' trees).
        max_nodes: nodes of the tree asked for per request (0: four times the speculative length, at least 32:
            deep enough that the chain after the next verification's outcome is in it).
        min_prob: acceptance estimate a chain token must reach to be proposed (what verifying one more token
            costs, in accepted tokens); None: ``chain_min_prob`` decides.
        stats_file: a JSON file the proposer rewrites with its step counts and times ("" = none).
        cost_aware: cut each step's chains to the tokens worth verifying by the step time measured against tokens
            in the batch (``VerifyBudget.choose_batch``, the rule the reference engine and the service use), so
            nothing is proposed where speculation would slow the engine down.
        prespeculate: cut chains from trees drafted one step ahead and wait for the service only where it pays;
            False waits for every step's answer (the synchronous proposer).
        security: TLS and bearer token.
    """

    address: str = "127.0.0.1:50051"
    namespace: str = ""
    timeout: float = 0.1
    max_nodes: int = 0
    min_prob: float | None = None
    stats_file: str = ""
    cost_aware: bool = True
    prespeculate: bool = True
    security: ClientSecurity = field(default_factory=ClientSecurity)

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> ProposerSettings:
        """Settings from the environment (unset variables keep the defaults).

        DRAFTER_ADDRESS, DRAFTER_NAMESPACE, DRAFTER_TIMEOUT, DRAFTER_MAX_NODES, DRAFTER_CHAIN_MIN_PROB,
        DRAFTER_PROPOSER_STATS, DRAFTER_COST_AWARE (0 turns it off), DRAFTER_PRESPECULATE (0 turns it off),
        and the TLS and token variables the
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
                       prespeculate=_env_float(env, "DRAFTER_PRESPECULATE", 1.0) != 0.0,
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
        return self.max_nodes or max(32, 4 * k)


def stop_tokens(params: Any) -> frozenset[int]:
    """The token ids that end a request with vLLM ``SamplingParams`` ``params``: its ``stop_token_ids`` and its
    end-of-sequence token (None under ``ignore_eos``). Not ``all_stop_token_ids``: that set keeps the end-of-sequence
    token under ``ignore_eos`` too (for ``min_tokens``), and such a request goes on past it."""
    stops = set(getattr(params, "stop_token_ids", None) or ())
    eos = getattr(params, "eos_token_id", None)
    if eos is not None:
        stops.add(int(eos))
    return frozenset(stops)


def drafting_rank(vllm_config: Any) -> bool:
    """Whether this worker's drafts are the ones vLLM uses: the first tensor-parallel rank of the last pipeline
    stage (the executor's output rank, ``world_size - tensor_parallel_size``). The other ranks' drafts are
    dropped, so they neither draft nor store requests.

    Raises:
        ValueError: ``distributed_executor_backend="external_launcher"`` with several ranks: each rank schedules
            for itself there and every rank would have to propose identical drafts, which a remote service
            answering each rank on its own cannot promise.
    """
    parallel = getattr(vllm_config, "parallel_config", None)
    world = int(getattr(parallel, "world_size", 1) or 1)
    if world <= 1:
        return True
    if getattr(parallel, "distributed_executor_backend", None) == "external_launcher":
        raise ValueError("drafter's proposer does not support distributed_executor_backend='external_launcher' "
                         f"with {world} ranks: every rank schedules for itself and would have to propose "
                         "identical drafts; use vLLM's default executor (mp) or ray")
    group = int(getattr(parallel, "tensor_parallel_size", 1) or 1) * int(
        getattr(parallel, "prefill_context_parallel_size", 1) or 1)
    return int(getattr(parallel, "rank", 0)) == world - group


class DrafterProposer:
    """vLLM's ``custom_class`` proposer backed by a drafter service.

    ``propose`` reads each row's new tokens, follows them down the tree the service drafted for the request one
    step ahead and returns the chain below (see ``PreSpeculator``); the step's tokens go to the service from a
    background thread. Requests are followed through the model runner that calls ``load_model``; finished ones are
    ended (stored) by the next step or, when the engine goes idle, by a watcher thread within a fraction of a
    second. Only the rank whose drafts vLLM uses talks to the service (``drafting_rank``). Nothing here raises into
    vLLM: the service away, slow or refusing means empty drafts.
    """

    def __init__(self, vllm_config: Any) -> None:
        spec = vllm_config.speculative_config
        self.k = int(spec.num_speculative_tokens)
        self.max_model_len = int(vllm_config.model_config.max_model_len)
        self.vocab_size = int(vllm_config.model_config.get_vocab_size())
        self.settings = ProposerSettings.from_env()
        note = check_vllm(getattr(sys.modules.get("vllm"), "__version__", None),
                          bool(getattr(vllm_config, "use_v2_model_runner", False)))
        if note:
            logger.warning("%s", note)
        self.drafts = drafting_rank(vllm_config)
        self._runner: Any = None
        self._lock = threading.Lock()
        self._last_step = time.monotonic()
        self._tracker: RequestTracker | None = None
        self._closing = threading.Event()
        self._watcher: threading.Thread | None = None

    # -- vLLM's interface --------------------------------------------------------------------------------

    def load_model(self, *args: Any, **kwargs: Any) -> None:
        """Called by the model runner once its model is loaded: find that runner and connect to the service."""
        if not self.drafts:
            logger.info("drafter: this rank's drafts are not used by vLLM; it neither drafts nor stores requests")
            return
        self._find_runner(sys._getframe(1))
        self._connect()

    def propose(self, sampled_token_ids: list[list[int]], num_tokens_no_spec: Any, token_ids_cpu: Any,
                slot_mappings: Any = None, **kwargs: Any) -> list[list[int]]:
        """Draft token ids for each row of this step (``[]`` where there is no draft)."""
        t0 = time.perf_counter()
        rows = len(sampled_token_ids)
        if not self.drafts:
            return [[] for _ in range(rows)]
        try:
            if self._runner is None:
                self._find_runner(sys._getframe(1))
            tracker = self._tracker
            if tracker is None or self._runner is None:
                return [[] for _ in range(rows)]
            batch = self._runner.input_batch
            with self._lock:
                if tracker.speculator.refused:  # vLLM's own tokens refused: a configuration mistake
                    logger.error("drafter: the service refused this engine's requests (%s); is DRAFTER_NAMESPACE "
                                 "the namespace of this model's tokenizer? No drafts from now on",
                                 tracker.speculator.refused)
                    self._tracker = None
                    return [[] for _ in range(rows)]
                try:
                    req_ids = batch.req_ids[:rows]
                    ids = tuple(req_ids)
                    if ids != tracker.last_rows:  # rows changed: some requests may have finished
                        self._end_finished(tracker)
                    drafts = tracker.step(req_ids, batch.num_prompt_tokens, sampled_token_ids, num_tokens_no_spec,
                                          token_ids_cpu, ids)
                except Exception:
                    tracker.figures.failures += 1
                    logger.exception("drafter: this step gets no drafts")
                    drafts = [[] for _ in range(rows)]
                finally:
                    tracker.release()
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
                         "proposer follows the V1 model runner of vLLM 0.32 and 0.33)")

    def _connect(self) -> None:
        if self._tracker is not None:
            return
        s = self.settings
        try:
            # a short backoff: drafts come back within half a second of the service (only the sender's thread
            # pays for the attempts while it is away)
            # the background call may take ten times what a step may wait: a late answer still brings trees
            client = DrafterClient(s.address, s.namespace, timeout=BACKGROUND_DEADLINE * s.timeout, reuse=False,
                                   max_nodes=s.tree_nodes(self.k), security=s.security, fixed_budget=True,
                                   initial_backoff=0.05, max_backoff=0.5)
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
        speculator = PreSpeculator(client, self.k, s.tree_nodes(self.k), s.chain_min_prob, s.timeout,
                                   s.prespeculate)
        self._tracker = RequestTracker(speculator, self.k, self.max_model_len, self._limits,
                                       VerifyBudget() if s.cost_aware else None)
        logger.info("drafter: proposing up to %d tokens per request from %s (namespace %r, pre-speculation %s)",
                    self.k, s.address, s.namespace, "on" if s.prespeculate else "off")
        self._watcher = threading.Thread(target=self._watch, name="drafter-proposer", daemon=True)
        self._watcher.start()

    def _limits(self, req_id: str, prompt_len: int) -> tuple[int, frozenset[int]]:
        """A request's token limit and stop tokens, from its sampling parameters (none when unknown)."""
        params = getattr(self._runner.requests.get(req_id), "sampling_params", None)
        max_tokens = getattr(params, "max_tokens", None)
        return (prompt_len + max_tokens if max_tokens else sys.maxsize), stop_tokens(params)

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
                    tracker.release()
                finally:
                    self._lock.release()
            figures = tracker.figures
            if self.settings.stats_file and figures.steps + figures.ended != last_written:
                last_written = figures.steps + figures.ended
                tracker.sync_figures()
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

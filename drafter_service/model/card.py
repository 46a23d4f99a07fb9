"""The optional draft model of a namespace: one CARD candidate cache per session, grown on its own thread.

``DraftModelDrafts`` holds what a namespace shares (the model, the settings, the calibration of the model's
probabilities); ``CardSession`` is one request's cache and worker thread. Imported only when a namespace has a
draft model, so the service runs without torch otherwise.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from drafter_service.api.tree import EMPTY_TREE, DraftTree
from drafter_service.core.config import CardSettings, DraftModelSpec
from drafter_service.model.card_cache import CachedNode, CandidateCache
from drafter_service.model.hardware import own_cpus

if TYPE_CHECKING:
    import numpy as np

logger = logging.getLogger(__name__)

#: Source name of nodes proposed by the draft model.
MODEL_SOURCE = "model"


class ProbabilityCalibration:
    """How often a draft-model node is accepted given the model's own probability for it, learned online.

    Probabilities fall into ten buckets; each bucket's rate starts at its midpoint (the model taken at its word)
    with ``prior`` pseudo-trials and follows the verification outcomes.
    """

    BUCKETS = 10

    def __init__(self, prior: float = 8.0) -> None:
        self._accepted = [prior * (b + 0.5) / self.BUCKETS for b in range(self.BUCKETS)]
        self._trials = [prior] * self.BUCKETS
        self._lock = threading.Lock()

    def _bucket(self, prob: float) -> int:
        return min(self.BUCKETS - 1, int(prob * self.BUCKETS))

    def _bucket_rate(self, b: int) -> float:
        return self._accepted[b] / self._trials[b]

    def rate(self, prob: float) -> float:
        """Estimated P(accepted | parent accepted) for a node the model gives ``prob``.

        Interpolated between the rates at the buckets' midpoints (from 0 at probability 0), so two tokens of one
        bucket keep the model's order: a step function would tie them, and the depth below would decide.
        """
        x = prob * self.BUCKETS - 0.5  # in bucket widths from the first midpoint
        if x <= 0:
            r = self._bucket_rate(0) * max(0.0, x + 0.5) * 2
        elif x >= self.BUCKETS - 1:
            r = self._bucket_rate(self.BUCKETS - 1)
        else:
            b = int(x)
            r = (b + 1 - x) * self._bucket_rate(b) + (x - b) * self._bucket_rate(b + 1)
        return max(1e-4, min(1.0, r))

    def record(self, outcomes: Sequence[tuple[float, bool]]) -> None:
        """Add (model probability, accepted?) outcomes of tested nodes."""
        with self._lock:
            for prob, hit in outcomes:
                b = self._bucket(prob)
                self._accepted[b] += 1.0 if hit else 0.0
                self._trials[b] += 1.0


class CardSession:
    """One request's candidate cache and the thread that grows it.

    Args:
        cache: the request's cache (its context is the prompt).
        calibration: the namespace's calibration of the model's probabilities.
        name: thread name, for logs.
    """

    def __init__(self, cache: CandidateCache, calibration: ProbabilityCalibration, name: str = "card",
                 nice: int = 0, idle_priority: bool = False, running: threading.Event | None = None) -> None:
        self.cache = cache
        self.nice = nice
        self.idle_priority = idle_priority
        self.calibration = calibration
        self.failed = False
        self._last: list[CachedNode] = []
        self._stop = threading.Event()
        self._wake = threading.Event()
        if running is None:
            running = threading.Event()
            running.set()
        self._running = running  # cleared: the worker pauses (the namespace's model gate decides)
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def _lower_priority(self) -> None:
        """Apply ``nice`` / ``idle_priority`` to this thread (Linux treats a thread id as a process id here)."""
        try:
            if self.idle_priority and hasattr(os, "SCHED_IDLE"):
                os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
            elif self.nice and hasattr(os, "setpriority"):
                os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), self.nice)
        except OSError as exc:
            logger.debug("could not lower the priority of %s: %s", self._thread.name, exc)

    def _run(self) -> None:
        self._lower_priority()
        try:
            while not self._stop.is_set():
                if not self._running.is_set():
                    self._running.wait(0.5)
                    continue
                if self.cache.grow() == 0 and not self.cache.wants_growth():
                    self._wake.wait(0.5)
                    self._wake.clear()
        except Exception:  # the session drafts on without the model
            logger.exception("draft model worker %s failed", self._thread.name)
            self.failed = True

    def correct(self, accepted: Sequence[int] | np.ndarray) -> bool | None:
        """Score the last draft, then move the cache to the verified prefix and wake the worker.

        Returns:
            None when the cache served nothing last time; else whether at least one draft token was accepted
            and every accepted draft token lay in the cache (a cache hit).
        """
        hit = self._score(accepted)
        self.cache.correct(accepted)
        self._wake.set()
        return hit

    def _score(self, accepted: Sequence[int] | np.ndarray) -> bool | None:
        """Teach the calibration from the last draft; say whether it was a cache hit.

        ``accepted`` is the true continuation (the accepted draft tokens, then the target's own), so every served
        node whose parent lies on it is judged against the true token there, verified or not. Steps where nothing
        was accepted count too: learning only from steps where something was (the predictable ones) overrates
        the model, most where one path is verified and most drafts are refused.
        """
        nodes, self._last = self._last, []
        if not nodes:
            return None
        kids: dict[int, dict[int, int]] = {}
        for i, n in enumerate(nodes):
            kids.setdefault(n.parent, {})[n.token] = i
        outcomes: list[tuple[float, bool]] = []
        node, depth = -1, 0
        while node in kids and depth < len(accepted):
            nxt = kids[node].get(int(accepted[depth]))
            outcomes.extend((nodes[c].prob, c == nxt) for c in kids[node].values())
            if nxt is None:
                break
            node, depth = nxt, depth + 1
        self.calibration.record(outcomes)
        return len(accepted) >= 2 and depth >= len(accepted) - 1

    def query(self, budget: int) -> DraftTree:
        """The cache's best ``budget`` nodes as a tree, with calibrated acceptance estimates."""
        if self.failed or budget <= 0:
            return EMPTY_TREE
        nodes = self.cache.query(budget)
        self._last = nodes
        if not nodes:
            return EMPTY_TREE
        probs: list[float] = []
        for n in nodes:
            parent = probs[n.parent] if n.parent >= 0 else 1.0
            probs.append(max(1e-6, parent * self.calibration.rate(n.prob)))
        return DraftTree(tuple(n.token for n in nodes), tuple(n.parent for n in nodes), tuple(probs),
                         float(sum(probs)), (MODEL_SOURCE,) * len(nodes))

    def settle(self, timeout: float = 60.0) -> None:
        """Wait until the worker has nothing left to grow (for replays that fix the communication ratio)."""
        deadline = time.monotonic() + timeout
        while (self.alive and not self.failed and self._running.is_set() and self.cache.wants_growth()
               and time.monotonic() < deadline):
            time.sleep(0.0005)

    def close(self, timeout: float = 5.0) -> bool:
        """Stop the worker after its current forward pass; returns whether it stopped within ``timeout``."""
        self._stop.set()
        self._wake.set()
        self._thread.join(timeout)
        return not self._thread.is_alive()

    @property
    def alive(self) -> bool:
        """Whether the worker thread is running."""
        return self._thread.is_alive()


class DraftModelDrafts:
    """A namespace's draft model: opens a ``CardSession`` per request, up to ``settings.max_sessions`` at once.

    Args:
        model: the draft model (a transformers causal LM with full attention), already on its device.
        settings: cache sizes and policies.
    """

    def __init__(self, model: Any, settings: CardSettings | None = None, base_counts: Any = None) -> None:
        self.model = model
        self.settings = settings or CardSettings()
        self.calibration = ProbabilityCalibration()
        self._running = threading.Event()  # shared by every session's worker
        self._running.set()
        self._open = 0
        self._lock = threading.Lock()
        self.steps = 0
        self.hits = 0
        self._base_counts = base_counts  # (V,) token frequencies of the model's training data, or None
        self._head: tuple[Any, Any] | None = None
        self.set_frequencies(None)

    def set_frequencies(self, tokens: Any) -> None:
        """Choose the draft vocabulary (``settings.vocab`` most frequent tokens) for sessions opened from now on.

        The whole vocabulary stays until the frequencies name at least that many tokens (a checkpoint without
        token counts, in a store that has seen few requests).

        Args:
            tokens: (n,) recent tokens of the namespace's store, or None; their frequencies are averaged with
                the model's own ``base_counts``.
        """
        import numpy as np
        import torch

        size = max(0, self.settings.vocab)
        weight = self.model.get_output_embeddings().weight  # (V, hidden)
        vocab = int(weight.shape[0])
        if not size or size >= vocab:
            return
        freq = np.zeros(vocab, dtype=np.float64)
        for counts in (self._base_counts, None if tokens is None else np.bincount(
                tokens[(tokens >= 0) & (tokens < vocab)], minlength=vocab)):
            if counts is not None and counts.sum() > 0:
                freq[:vocab] += counts[:vocab] / counts.sum()
        if np.count_nonzero(freq) < size:  # too few tokens seen to choose from: keep the whole vocabulary
            return
        ids = np.sort(np.argsort(-freq, kind="stable")[:size])
        index = torch.as_tensor(ids, dtype=torch.long, device=weight.device)
        with torch.no_grad():
            head = (weight.index_select(0, index).contiguous(), index)
        with self._lock:
            self._head = head

    def open(self, prompt: Sequence[int] | np.ndarray, name: str = "card") -> CardSession | None:
        """A session for a request with ``prompt``; None when ``max_sessions`` are open."""
        s = self.settings
        with self._lock:
            if self._open >= s.max_sessions:
                return None
            self._open += 1
        try:
            cache = CandidateCache(self.model, [int(t) for t in prompt], width=s.width, top_k=s.top_k,
                                   layers_ahead=s.layers_ahead, max_nodes=s.max_nodes, correction=s.correction,
                                   head=self._head)
            return CardSession(cache, self.calibration, name, s.nice, s.idle_priority == 1, self._running)
        except Exception:
            with self._lock:
                self._open -= 1
            raise

    def close(self, session: CardSession) -> None:
        """Stop a session's worker and free its slot."""
        if not session.close():
            logger.warning("draft model worker %s did not stop in time", session)
        with self._lock:
            self._open -= 1

    def set_running(self, running: bool) -> None:
        """Let every session's worker grow its cache (True), or pause them after their current forward pass."""
        if running:
            self._running.set()
        else:
            self._running.clear()

    def record_step(self, hit: bool) -> None:
        """Count a verification step and whether its accepted path came from the cache."""
        with self._lock:
            self.steps += 1
            self.hits += int(hit)

    @property
    def open_sessions(self) -> int:
        """Sessions with a cache right now."""
        with self._lock:
            return self._open


def load_drafts(spec: DraftModelSpec, vocab_size: int) -> DraftModelDrafts:
    """Load ``spec``'s model for a namespace of ``vocab_size`` tokens.

    Raises:
        DraftModelError: the model is missing or unreadable, its vocabulary differs from the namespace's, or it
            has attention layers other than full attention (the cache keeps every past entry).
    """
    import numpy as np
    import torch

    from drafter_service.model.draft_model import TOKEN_COUNTS, DraftModelError, load_draft_model
    from engines.reference.tree_attention import model_layer_types

    spec = for_this_machine(spec)
    if spec.threads:
        torch.set_num_threads(spec.threads)
    model = load_draft_model(spec.path, vocab_size, dtype=getattr(torch, spec.dtype), device=spec.device,
                             namespace=spec.namespace)
    kinds = set(model_layer_types(model.config))
    if kinds != {"full_attention"}:
        raise DraftModelError(f"draft model at {spec.path} has {sorted(kinds)} layers; only full attention "
                              "is supported")
    counts_file = Path(spec.path) / TOKEN_COUNTS
    counts = np.load(counts_file) if counts_file.is_file() else None
    c = spec.card
    logger.info("namespace %s: draft model %s on %s (%s, %s threads, %s, %s-token head, gate %s)", spec.namespace,
                spec.path, spec.device, spec.dtype, spec.threads or "torch's default",
                "SCHED_IDLE" if c.idle_priority == 1 else f"nice {c.nice}", c.vocab or "whole", c.gate)
    return DraftModelDrafts(model, spec.card, counts)


#: Output-head vocabulary of a draft model on a CPU when none is set (``--card-vocab -1``).
CPU_HEAD_VOCAB = 8192


def for_this_machine(spec: DraftModelSpec) -> DraftModelSpec:
    """``spec`` with its automatic settings chosen: head vocabulary by device; on a CPU the service may share with
    an engine (``own_cpus`` is 0), one thread under SCHED_IDLE, so that the model only takes cycles the engine
    leaves; on CPUs of its own, one thread per CPU at normal priority."""
    card = spec.card
    on_cpu = spec.device == "cpu"
    vocab = (CPU_HEAD_VOCAB if on_cpu else 0) if card.vocab == -1 else card.vocab
    own = own_cpus() if on_cpu else 0
    idle = int(on_cpu and not own) if card.idle_priority == -1 else card.idle_priority
    threads = spec.threads or (own or 1 if on_cpu else 0)
    return replace(spec, threads=threads, card=replace(card, vocab=vocab, idle_priority=idle))

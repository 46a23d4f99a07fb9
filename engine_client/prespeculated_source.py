"""A DraftSource whose trees are pre-speculated: an engine that verifies trees (the reference engine) gets each
step's tree from the one the service drafted a step ahead, without waiting on the network.

``DrafterClient.draft`` also keeps deep trees and serves subtrees locally, but it reads the previous prefetch's
answer on the engine's thread, and a miss is a round trip there. ``PreSpeculatedSource`` is built on
``PreSpeculator`` (what the vLLM proposer uses): each step's tokens go to the service from a background thread once
``draft`` returns, the answer lands there while the engine runs its forward pass, and ``draft`` only follows the
step's tokens down the trees that landed (``PreSpeculator.step_trees``). On a miss, prompt lookup over the request's
own context may give a chain; otherwise the wait rule decides between no draft and waiting for the step's own answer,
and a breaker stops all waiting while the service answers late.
"""

from __future__ import annotations

import itertools
import logging
import threading
from collections.abc import Sequence
from dataclasses import asdict
from typing import Any

from drafter_service.api.tree import DraftTree
from engine_client.client import DrafterClient
from engine_client.client_common import DrafterRequestError, check_tokens
from engine_client.draft_sender import Tracked
from engine_client.prespeculation import PreSpeculationFigures, PreSpeculator

logger = logging.getLogger(__name__)

__all__ = ["PreSpeculatedSource", "BACKGROUND_DEADLINE"]

#: How many times ``timeout`` the background DraftBatch may take (a step waits at most ``timeout``; a late answer
#: still brings the next steps' trees), for a client the source makes itself.
BACKGROUND_DEADLINE = 10


class PreSpeculatedSource:
    """Trees for an engine that verifies one tree per step, cut from trees the service drafted one step ahead.

    ``start`` opens a tracked request and asks for its prompt's tree at once (drafted while the engine prefills).
    Each ``draft`` records the step's tokens, returns the best-first subtree below them in the latest tree that
    landed (EMPTY_TREE when none and waiting does not pay), and lets the background thread send the tokens before
    returning, so that the next tree is drafted while the engine verifies this one. ``end`` closes the request: the
    service stores it whole, exactly once (in the next DraftBatch, or by Ingest once the service is back).

    Like ``DrafterClient`` it never raises for the service's trouble (a service that is away or slow gives empty
    trees at once); the caller's mistakes (an unknown session, bad token ids) raise ``DrafterRequestError``. A
    refusal of the engine's tokens by the service is logged once, and drafts come only from local lookups after.
    Meant for one engine thread at a time (calls are serialised by a lock).

    ``verify_cost`` and ``estimate_exponent`` are accepted and left to the engine: the trees were drafted before
    the step, so the engine's own budget (``VerifyBudget.choose``) cuts them. The service sees no step times.

    Args:
        client: a ``DrafterClient`` made with ``reuse=False`` and ``fixed_budget=True`` (used from the background
            thread alone; the caller closes it), or the service's address: the source then makes its own client
            with those settings, a deadline of ``BACKGROUND_DEADLINE * timeout`` and a short backoff
            (``client_options`` override them), and closes it in ``close``.
        max_nodes: nodes of the trees asked for, deeper than what the engine verifies (e.g. 4x its budget), so
            that the next steps' subtrees are in them.
        timeout: the longest a step waits for its own answer.
        min_prob: nodes estimated under this, given the step's context, are left out.
        prespeculate: False waits for every step's own answer (the synchronous source, for comparison).
        **client_options: keyword arguments of ``DrafterClient`` when ``client`` is an address.
    """

    def __init__(self, client: DrafterClient | str, max_nodes: int = 128, timeout: float = 0.1,
                 min_prob: float = 0.0, prespeculate: bool = True, **client_options: Any) -> None:
        if max_nodes <= 0 or timeout <= 0:
            raise ValueError(f"max_nodes and timeout must be positive, got {max_nodes} and {timeout}")
        if isinstance(client, str):
            options: dict[str, Any] = {"timeout": BACKGROUND_DEADLINE * timeout, "reuse": False,
                                       "max_nodes": max_nodes, "fixed_budget": True, "initial_backoff": 0.05,
                                       "max_backoff": 0.5}
            options.update(client_options)
            self.client = DrafterClient(client, **options)
            self._owns_client = True
        else:
            self.client = client
            self._owns_client = False
        self.max_nodes = max_nodes
        # a step may append a whole branch of the tree: follow as many tokens as the tree has nodes
        self.speculator = PreSpeculator(self.client, max_nodes, max_nodes, min_prob, timeout, prespeculate)
        self._sessions: dict[str, tuple[Tracked, int]] = {}  # session id -> (its request, its default budget)
        self._ids = itertools.count()
        self._lock = threading.Lock()
        self._refusal_logged = False
        self._closed = False

    def start(self, prompt: Sequence[int], max_nodes: int = 0) -> str:
        """Open a session for a request whose prompt is ``prompt`` (its prompt's tree is asked for now); returns its
        id.

        Args:
            prompt: the request's prompt tokens.
            max_nodes: most nodes the engine verifies per step for this session (0: ``max_nodes``).

        Raises:
            DrafterRequestError: bad token ids or budget.
        """
        if max_nodes < 0:
            raise DrafterRequestError(f"max_nodes must be >= 0, got {max_nodes}")
        tokens = check_tokens(prompt, self.client.vocab_size, "prompt")
        with self._lock:
            req = self.speculator.open(tokens, draft=True)
            self.speculator.release()  # drafted while the engine prefills
            session = f"pre-{next(self._ids)}"
            self._sessions[session] = (req, max_nodes or self.max_nodes)
        return session

    def draft(self, session: str, accepted: Sequence[int], max_nodes: int = 0,
              step_seconds: float = 0.0, plain_step_seconds: float = 0.0,
              verify_cost: Sequence[tuple[float, float]] = (), estimate_exponent: float = 0.0) -> DraftTree:
        """The next tree of a session, from the trees that landed (see the class); EMPTY_TREE when none.

        Args:
            session: the id ``start`` returned.
            accepted: tokens appended since the previous call (accepted draft tokens plus the target's own); empty
                on the first call.
            max_nodes: most nodes the engine verifies (0: the session's default).
            step_seconds, plain_step_seconds, verify_cost, estimate_exponent: as ``DraftSource.draft``; the step
                time is measured here between calls, and the cost cut is the engine's (see the class).

        Raises:
            DrafterRequestError: unknown session, bad token ids or budget (nothing is recorded).
        """
        req, default = self._session(session)
        if max_nodes < 0:
            raise DrafterRequestError(f"max_nodes must be >= 0, got {max_nodes}")
        tokens = check_tokens(accepted, self.client.vocab_size, "accepted")
        with self._lock:
            try:
                tree = self.speculator.step_trees([req], [tokens], [max_nodes or default])[0]
            finally:
                self.speculator.release()  # the sender sends while the engine verifies
        if self.speculator.refused and not self._refusal_logged:
            self._refusal_logged = True
            logger.error("drafter: the service refused this engine's requests (%s); is the namespace that of the "
                         "model's tokenizer? Drafts come from prompt lookup alone from now on",
                         self.speculator.refused)
        return tree

    def end(self, session: str, accepted: Sequence[int]) -> None:
        """Close a session with the tokens appended since the last ``draft``: the whole request is stored by the
        service (with the next DraftBatch, sent now), or buffered by the client until it can be.

        Raises:
            DrafterRequestError: unknown session or bad token ids (the session then stays open).
        """
        req, _ = self._session(session)
        tokens = check_tokens(accepted, self.client.vocab_size, "accepted")
        with self._lock:
            del self._sessions[session]
            if tokens:  # recorded as a step that wants no tree
                self.speculator.step_trees([req], [tokens], [0])
            self.speculator.close(req)
            self.speculator.release()

    def _session(self, session: str) -> tuple[Tracked, int]:
        found = self._sessions.get(session)
        if found is None:
            raise DrafterRequestError(f"unknown session {session!r}", "NOT_FOUND")
        return found

    @property
    def figures(self) -> PreSpeculationFigures:
        """What pre-speculation did: hits, misses, waits, late waits, prompt lookups, answers, and the running
        means of the engine's step, the round trip and the tokens accepted per tree."""
        return self.speculator.figures

    @property
    def refused(self) -> str:
        """The service's refusal of this engine's tokens ("" while none)."""
        return self.speculator.refused

    def stats_local(self) -> dict[str, float]:
        """``figures`` as a dictionary, with the background thread's CPU time (``sender_cpu_seconds``)."""
        out: dict[str, float] = asdict(self.speculator.figures)
        out["sender_cpu_seconds"] = self.speculator.sender_cpu_seconds
        return out

    def drain(self, timeout: float = 5.0) -> bool:
        """Send what is queued (opened, stepped and ended requests) and wait until it was sent; False when
        ``timeout`` passed first."""
        return self.speculator.drain(timeout)

    def close(self, timeout: float = 5.0) -> None:
        """Send what is queued (ended requests included), stop the background thread, and close the client when
        the source made it. Sessions still open are not ended (their requests are not stored)."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            if self._sessions:
                logger.warning("drafter: source closed with %d sessions open (not stored)", len(self._sessions))
            if not self.speculator.drain(timeout):
                logger.warning("drafter: source closed before what was queued was sent")
            self.speculator.close_all()
            if self._owns_client:
                self.client.close()

    def __enter__(self) -> PreSpeculatedSource:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return (f"PreSpeculatedSource({self.client.address!r}, max_nodes={self.max_nodes}, "
                f"timeout={self.speculator.timeout})")


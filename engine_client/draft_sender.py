"""The background half of pre-speculation: one thread sends each engine step's tokens in a DraftBatch and packs
the trees that come back, while the engine verifies.

The engine's thread only queues what happened (requests opened, tokens appended, requests ended); this thread does
everything that costs: session bookkeeping, the round trip, decoding and packing the reply. Steps queued while a
call is out go together in the next call, so the service sees every session's tokens in order, one call at a time.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from engine_client.client import DrafterClient
from engine_client.client_common import DrafterRequestError
from engine_client.context_ngrams import ContextNgrams
from engine_client.packed_trees import PackedTrees

logger = logging.getLogger(__name__)

__all__ = ["DraftSender", "Landed", "Opened", "Stepped", "Ended", "Tracked"]


class Tracked:
    """One request as pre-speculation follows it (a handle: the engine's thread owns ``recent``, ``total`` and
    ``proposed``; the sender's thread sets ``landed`` and ``session`` and fills ``ngrams``)."""

    __slots__ = ("recent", "total", "proposed", "landed", "earlier", "session", "unsent", "ngrams")

    def __init__(self, recent: list[int], total: int) -> None:
        self.recent = recent  # its last tokens (at least the history pre-speculation follows)
        self.total = total  # tokens it holds (prompt and output)
        self.proposed = 0  # tokens of the chain proposed last
        # (context length it was drafted for, its trees, its root code): the latest tree, one tuple so the engine's
        # thread reads the three together; no tree yet: (-1, None, -1)
        self.landed: tuple[int, PackedTrees | None, int] = (-1, None, -1)
        self.earlier: tuple[int, PackedTrees | None, int] = self.landed  # the tree before it (see PreSpeculator)
        self.session = ""  # the client's session id ("" until opened, or refused)
        self.unsent: list[int] = []  # tokens recorded and not yet sent
        self.ngrams = ContextNgrams()  # its whole context, for prompt lookup where its tree holds no chain


@dataclass(frozen=True)
class Opened:
    """A request started: ``prompt`` is its whole context so far. ``ticket`` >= 0: its prompt's tree is drafted in
    the next call, as if a step with that ticket appended nothing (-1: its first tree is its first step's)."""

    req: Tracked
    prompt: list[int]
    ticket: int = -1


@dataclass(frozen=True)
class Stepped:
    """One engine step: row i's request ``reqs[i]`` appended ``new[i]`` and then held ``totals[i]`` tokens."""

    ticket: int
    reqs: list[Tracked]
    new: list[list[int]]
    totals: list[int]


@dataclass(frozen=True)
class Ended:
    """A request finished: the service stores it."""

    req: Tracked


@dataclass(frozen=True)
class Landed:
    """Trees that came back: ``reqs[i]`` has tree ``i`` of ``trees``, drafted for its context of ``totals[i]``
    tokens. ``ticket``: the last step whose tokens the call carried; ``answered``: False when the service did not
    answer (the trees are empty)."""

    ticket: int
    reqs: list[Tracked]
    totals: list[int]
    trees: PackedTrees
    seconds: float
    answered: bool = True


class DraftSender:
    """Sends queued steps from a daemon thread; ``on_landed`` gets each reply indexed (chains of at most ``width``
    tokens, cut under ``min_prob``), ``on_refused`` the service's refusal of this engine's tokens.

    Args:
        client: the drafter client (used from this thread only, besides ``close``).
        max_nodes: nodes of the tree asked for per request.
    """

    def __init__(self, client: DrafterClient, max_nodes: int, on_landed: Callable[[Landed], None],
                 on_refused: Callable[[str], None], width: int, min_prob: float = 0.0) -> None:
        self.client, self.max_nodes, self.width, self.min_prob = client, max_nodes, width, min_prob
        self._on_landed, self._on_refused = on_landed, on_refused
        self._queue: list[Opened | Stepped | Ended] = []
        self._cv = threading.Condition()
        self._closing = False
        self._busy = False
        self._ready = False  # woken: what is queued may go
        self._call_since = 0.0  # time.monotonic() when the call out began (0: none)
        self.cpu_seconds = 0.0  # CPU time this thread spent on what was queued (time it may take from the engine's)
        self._live: dict[int, Tracked] = {}  # id -> request, in the order they opened
        self._thread = threading.Thread(target=self._run, name="drafter-sender", daemon=True)
        self._thread.start()

    def put(self, item: Opened | Stepped | Ended, wake: bool = True) -> None:
        """Queue what happened (never blocks on the network); ``wake=False`` leaves it for the next ``wake``."""
        with self._cv:
            self._queue.append(item)
            if wake:
                self._ready = True
                self._cv.notify()

    def wake(self) -> None:
        """Send what is queued."""
        with self._cv:
            self._ready = True
            self._cv.notify()

    @property
    def busy(self) -> bool:
        """Whether a call is out or queued items wait for one."""
        return self._busy or bool(self._queue)

    def drain(self, timeout: float) -> bool:
        """Send what is queued and wait until nothing is left to send; False when ``timeout`` passed first."""
        self.wake()
        deadline = time.monotonic() + timeout
        while self.busy:
            if time.monotonic() > deadline:
                return False
            time.sleep(0.002)
        return True

    def stuck(self, seconds: float) -> bool:
        """Whether the call out has taken longer than ``seconds`` so far."""
        since = self._call_since
        return bool(since) and time.monotonic() - since > seconds

    def close(self, timeout: float = 5.0) -> None:
        """Send what is queued (ending every open request's session is the caller's part), then stop."""
        with self._cv:
            self._closing = True
            self._cv.notify()
        self._thread.join(timeout)

    def _run(self) -> None:
        while True:
            with self._cv:
                while not (self._queue and self._ready) and not self._closing:
                    self._cv.wait()
                items, self._queue, self._ready = self._queue, [], False
                if not items and self._closing:
                    return
                self._busy = True
            started = time.thread_time()
            try:
                self._handle(items)
            except Exception:
                logger.exception("drafter: a step's drafts were lost")
            finally:
                self.cpu_seconds += time.thread_time() - started
                self._busy = False

    def _handle(self, items: Sequence[Opened | Stepped | Ended]) -> None:
        ended: list[Tracked] = []
        ticket = -1
        totals: dict[int, int] = {}
        fresh: set[int] = set()  # requests drafted for though they appended nothing (their prompt's tree)
        for item in items:
            if isinstance(item, Opened):
                self._open(item)
                if item.ticket >= 0 and item.req.session:
                    ticket = item.ticket
                    totals[id(item.req)] = len(item.prompt)
                    fresh.add(id(item.req))
            elif isinstance(item, Stepped):
                ticket = item.ticket
                for req, toks, total in zip(item.reqs, item.new, item.totals, strict=True):
                    req.unsent += toks
                    req.ngrams.extend(toks)
                    totals[id(req)] = total
            else:
                ended.append(item.req)
                self._live.pop(id(item.req), None)
        self._draft(ticket, totals, [req for req in ended if req.session], fresh)

    def _open(self, item: Opened) -> None:
        item.req.ngrams.extend(item.prompt)
        try:
            item.req.session = self.client.start(item.prompt, open_now=False)
        except DrafterRequestError as exc:
            self._on_refused(str(exc))
            return
        self._live[id(item.req)] = item.req

    def _draft(self, ticket: int, totals: dict[int, int], ended: list[Tracked], fresh: set[int]) -> None:
        """One DraftBatch with every live request's unsent tokens (and the requests of ``fresh``, by id, with none),
        each getting a tree for its new context, that also ends the requests in ``ended`` (the service stores
        them)."""
        reqs = [r for r in self._live.values() if r.unsent or id(r) in fresh]
        if not reqs and not ended:
            return
        items = [(r.session, r.unsent) for r in reqs]
        t0 = time.perf_counter()
        self._call_since = time.monotonic()
        try:
            trees = self.client.draft_batch_packed(items, self.max_nodes, ends=[(r.session, r.unsent) for r in ended])
        except DrafterRequestError as exc:
            self._on_refused(str(exc))
            return
        finally:
            self._call_since = 0.0
        for r in (*reqs, *ended):
            r.unsent = []
        answered = self.client.available
        if answered and self.client.buffered:  # requests that ended while the service was away
            self.client.flush()
        if reqs:
            self._on_landed(Landed(ticket, reqs, [totals.get(id(r), r.total) for r in reqs],
                                   PackedTrees.of_batch(trees, self.width, self.min_prob),
                                   time.perf_counter() - t0, answered))

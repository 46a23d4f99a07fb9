"""The background half of pre-speculation: one thread sends each engine step's tokens in a DraftBatch and packs
the trees that come back, while the engine verifies.

The engine's thread only hands over what happened (requests opened, tokens appended, requests ended), once per
step; this thread does everything that costs: session bookkeeping, the round trip, decoding and packing the reply,
and indexing each request's context for prompt lookup (after the reply landed, so that it never delays one). Steps
handed over while a call is out go together in the next call, so the service sees every session's tokens in order,
one call at a time. While the engine's thread is inside its step (``hold`` to ``send``), this thread starts no work
of its own: the two never take turns on the interpreter lock in the middle of a step.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from engine_client.client import DrafterClient
from engine_client.client_common import DrafterRequestError
from engine_client.context_ngrams import ContextNgrams
from engine_client.packed_trees import PackedTrees

logger = logging.getLogger(__name__)

__all__ = ["DraftSender", "Landed", "Opened", "Stepped", "Ended", "Chore", "Tracked"]


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


@dataclass(frozen=True, slots=True)
class Opened:
    """A request started: ``prompt`` is its whole context so far. ``ticket`` >= 0: its prompt's tree is drafted in
    the next call, as if a step with that ticket appended nothing (-1: its first tree is its first step's)."""

    req: Tracked
    prompt: list[int]
    ticket: int = -1


@dataclass(slots=True)
class Stepped:
    """One engine step: row i's request ``reqs[i]`` appended ``new[i]`` and then held ``totals[i]`` tokens."""

    ticket: int
    reqs: list[Tracked]
    new: list[list[int]]
    totals: list[int]


@dataclass(frozen=True, slots=True)
class Ended:
    """A request finished: the service stores it."""

    req: Tracked


@dataclass(slots=True)  # not frozen, as Stepped: a frozen dataclass sets its fields through object.__setattr__
class Chore:
    """Work the engine hands this thread with a step (an engine's own learning), done after the step's call: the
    engine wakes one thread per step, not two."""

    work: Callable[[], None]


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


Item = Opened | Stepped | Ended | Chore


class DraftSender:
    """Sends what the engine hands over from a daemon thread; ``on_landed`` gets each reply indexed (chains of at
    most ``width`` tokens, cut under ``min_prob``), ``on_refused`` the service's refusal of this engine's tokens.

    Args:
        client: the drafter client (used from this thread only, besides ``close``).
        max_nodes: nodes of the tree asked for per request.
    """

    def __init__(self, client: DrafterClient, max_nodes: int, on_landed: Callable[[Landed], None],
                 on_refused: Callable[[str], None], width: int, min_prob: float = 0.0) -> None:
        self.client, self.max_nodes, self.width, self.min_prob = client, max_nodes, width, min_prob
        self._on_landed, self._on_refused = on_landed, on_refused
        self._inbox: queue.SimpleQueue[list[Item] | None] = queue.SimpleQueue()
        self._sent = 0  # lists handed over (the engine's thread counts them)
        self._handled = 0  # lists handled (this thread counts them)
        self._gate = threading.Lock()  # held by the engine's thread during its step (``hold``)
        self._held = False
        self._call_since = 0.0  # time.monotonic() when the call out began (0: none)
        self.cpu_seconds = 0.0  # CPU time this thread spent on what was queued (time it may take from the engine's)
        self._live: dict[int, Tracked] = {}  # id -> request, in the order they opened
        self._thread = threading.Thread(target=self._run, name="drafter-sender", daemon=True)
        self._thread.start()

    # -- the engine's thread ------------------------------------------------------------------------------

    def hold(self) -> None:
        """The engine's step begins: this thread starts no new work until ``send`` (or ``let_go``)."""
        if not self._held:
            self._gate.acquire()
            self._held = True

    def let_go(self) -> None:
        """This thread may work again (the engine's step ended, or it waits for this thread)."""
        if self._held:
            self._held = False
            self._gate.release()

    def send(self, items: list[Item]) -> None:
        """Hand over what the engine queued (never blocks on the network), and ``let_go``."""
        self.let_go()
        if items:
            self._sent += 1
            self._inbox.put(items)

    @property
    def busy(self) -> bool:
        """Whether a call is out or what was handed over waits for one."""
        return self._handled < self._sent

    def drain(self, timeout: float) -> bool:
        """Wait until nothing handed over is left to send; False when ``timeout`` passed first."""
        self.let_go()
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
        """Send what was handed over (ending every open request's session is the caller's part), then stop."""
        self.let_go()
        self._inbox.put(None)
        self._thread.join(timeout)

    # -- this thread ------------------------------------------------------------------------------------------

    def _wait_turn(self) -> None:
        """Wait while the engine's thread is inside its step."""
        with self._gate:
            pass

    def _run(self) -> None:
        inbox = self._inbox
        while True:
            first = inbox.get()
            closing = first is None
            items = first or []
            taken = 0 if closing else 1
            while not closing:  # whatever else was handed over goes in the same call
                try:
                    more = inbox.get_nowait()
                except queue.Empty:
                    break
                if more is None:
                    closing = True
                else:
                    items += more
                    taken += 1
            if items:
                self._wait_turn()
                started = time.thread_time()
                try:
                    self._handle(items)
                except Exception:
                    logger.exception("drafter: a step's drafts were lost")
                finally:
                    self.cpu_seconds += time.thread_time() - started
            self._handled += taken
            if closing:
                return

    def _handle(self, items: Sequence[Item]) -> None:
        ended: list[Tracked] = []
        ticket = -1
        totals: dict[int, int] = {}
        fresh: set[int] = set()  # requests drafted for though they appended nothing (their prompt's tree)
        index: list[tuple[Tracked, list[int]]] = []  # what prompt lookup indexes once the reply landed
        chores: list[Chore] = []
        for item in items:
            if isinstance(item, Stepped):
                ticket = item.ticket
                for req, toks, total in zip(item.reqs, item.new, item.totals, strict=True):
                    req.unsent += toks
                    index.append((req, toks))
                    totals[id(req)] = total
            elif isinstance(item, Opened):
                index.append((item.req, item.prompt))
                self._open(item)
                if item.ticket >= 0 and item.req.session:
                    ticket = item.ticket
                    totals[id(item.req)] = len(item.prompt)
                    fresh.add(id(item.req))
            elif isinstance(item, Chore):
                chores.append(item)
            else:
                ended.append(item.req)
                self._live.pop(id(item.req), None)
        try:
            self._draft(ticket, totals, [req for req in ended if req.session], fresh)
        finally:
            self._wait_turn()
            for req, toks in index:
                req.ngrams.extend(toks)
            for chore in chores:
                self._wait_turn()
                try:
                    chore.work()
                except Exception:
                    logger.exception("drafter: a chore handed with a step failed")

    def _open(self, item: Opened) -> None:
        try:
            item.req.session = self.client.start(item.prompt, open_now=False)
        except DrafterRequestError as exc:
            self._on_refused(str(exc))
            return
        self._live[id(item.req)] = item.req

    def _draft(self, ticket: int, totals: dict[int, int], ended: list[Tracked], fresh: set[int]) -> None:
        """One DraftBatch with every live request's unsent tokens (and the requests of ``fresh``, by id, with none),
        each getting a tree for its new context; the requests in ``ended`` end (the service stores them) in a call
        of their own beside it, whose answer is settled once the trees landed."""
        reqs = [r for r in self._live.values() if r.unsent or id(r) in fresh]
        if not reqs and not ended:
            return
        items = [(r.session, r.unsent) for r in reqs]
        t0 = time.perf_counter()
        self._call_since = time.monotonic()
        settle: Callable[[], None] | None = None
        try:
            if ended:
                settle = self.client.end_batch_async([(r.session, r.unsent) for r in ended])
                for r in ended:
                    r.unsent = []
            trees = self.client.draft_batch_packed(items, self.max_nodes) if reqs else None
            self._call_since = 0.0
            for r in reqs:
                r.unsent = []
            if trees is not None:
                answered = self.client.available
                waited = time.perf_counter()
                self._wait_turn()
                waited = time.perf_counter() - waited  # the engine's step, not part of the round trip
                packed = PackedTrees.of_batch(trees, self.width, self.min_prob)
                self._on_landed(Landed(ticket, reqs, [totals.get(id(r), r.total) for r in reqs], packed,
                                       time.perf_counter() - t0 - waited, answered))
        except DrafterRequestError as exc:
            self._on_refused(str(exc))
        finally:
            self._call_since = 0.0
            if settle is not None:  # the ends' own call, whatever became of the step's
                settle()
        if self.client.available and self.client.buffered:  # requests that ended while the service was away
            self.client.flush()

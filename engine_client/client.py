"""The synchronous drafter client: one DraftStream per client, draft reuse, and drafting that survives outages."""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Sequence
from time import perf_counter_ns
from typing import Any

import grpc

from drafter_service.api.drafter.v1 import drafter_pb2 as pb
from drafter_service.api.drafter.v1 import drafter_pb2_grpc as pb_grpc
from drafter_service.api.tree import DraftTree
from engine_client import step_batch
from engine_client.client_common import (
    CALLER_ERRORS,
    INGEST_BATCH,
    Backoff,
    ClientStats,
    DrafterRequestError,
    DrafterUnavailable,
    IngestBuffer,
    ServiceDown,
    channel_options,
    rpc_code,
    stats_dict,
    to_sequences,
)
from engine_client.draft_reuse import LocalFigures, Pending, SessionBook, SessionState, settle_all
from engine_client.security import PLAINTEXT, ClientSecurity

logger = logging.getLogger(__name__)

__all__ = ["DrafterClient", "DrafterRequestError", "DrafterUnavailable", "ClientStats"]


class _Stream:
    """One DraftStream call: requests fed from a queue; answers read in order by whoever holds ``lock``.

    Answers to requests posted earlier (reports not waited for) are matched on the way. The client's watchdog
    cancels the call when a read outlives the deadline; whatever the stream still owed is then settled as failed.
    """

    def __init__(self, stub: pb_grpc.DrafterStub, book: SessionBook) -> None:
        self._book = book
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._inflight: deque[Pending] = deque()
        self.lock = threading.Lock()
        self.closed = False
        self.reading_since = 0.0  # time.monotonic() when the read in progress began (0: none)
        self._expired = False
        self._call = stub.DraftStream(self._requests())

    def _requests(self) -> Iterator[pb.DraftRequest]:
        while True:
            item = self._queue.get()
            if item is None:
                return
            yield item

    def post(self, request: pb.DraftRequest, entry: Pending) -> bool:
        """Send a request (hold ``lock``); False when the stream is already broken (nothing was sent)."""
        if self.closed:
            return False
        entry.waiter = self
        self._inflight.append(entry)
        self._queue.put(request)
        return True

    def settle(self, entry: Pending) -> None:
        """Read answers (hold ``lock``) until ``entry`` is answered or the stream breaks."""
        self.reading_since = time.monotonic()
        try:
            while not entry.done and not self.closed:
                try:
                    resp = next(self._call)
                except StopIteration:
                    self._break("UNAVAILABLE", "the service closed the draft stream")
                    return
                except grpc.RpcError as exc:
                    code, details = rpc_code(exc)
                    if self._expired:
                        code, details = "DEADLINE_EXCEEDED", "no answer within the deadline"
                    self._break(code, details)
                    return
                if not self._inflight:
                    self._break("INTERNAL", "an answer with no request")
                    return
                self._book.answered(self._inflight.popleft(), resp)
        finally:
            self.reading_since = 0.0

    def _break(self, code: str, details: str) -> None:
        self.closed = True
        rest = list(self._inflight)
        self._inflight.clear()
        self._queue.put(None)
        self._call.cancel()
        settle_all(self._book, rest, code, details)

    def expire(self, since: float) -> None:
        """Cancel the read that began at ``since`` and outlived the deadline (the watchdog's call, no ``lock``)."""
        if self.reading_since == since:
            self._expired = True
            self._call.cancel()

    def close(self) -> None:
        """End the call; what it still owed is settled as failed."""
        with self.lock:
            if not self.closed:
                self._break("CANCELLED", "client closed")


class DrafterClient(LocalFigures):
    """A DraftSource backed by a drafter service; never lets the service's trouble stop the engine.

    Draft calls go over one bidirectional ``DraftStream``; answers come back in request order, so sessions of
    several engine threads share it. With ``reuse`` the client asks for ``max_nodes * reuse_factor`` nodes, gives
    the engine the first ``max_nodes`` and keeps the rest: when the next ``accepted`` tokens are a path of that
    tree, the next draft is the subtree below it, served locally, and the service is only told the tokens
    (``report_only``, not waited for).

    Errors: the caller's mistakes (token ids outside the vocabulary, bad budgets, unknown sessions or namespace;
    INVALID_ARGUMENT from the service) raise ``DrafterRequestError`` from ``start``, ``draft``, ``end``, ``ingest``.
    Availability trouble (UNAVAILABLE, DEADLINE_EXCEEDED, CANCELLED, a broken stream) never raises: ``draft``
    returns EMPTY_TREE, ``start`` still returns a session id, and the client retries with exponential backoff
    (no call waits while backing off). Sessions the service lost are reopened with every token known so far;
    one whose remote copy is out of step (an answer lost) is reopened as ``<id>~N``, the old copy abandoned.
    Requests ended while the service is away are buffered (``max_buffered``, oldest dropped with a warning) and
    sent by ``Ingest`` once it is back; so is one whose EndSession answer was lost, under its session id with
    ``skip_duplicate_ids``, so it is stored once whether or not the lost call landed.

    Args:
        address: host:port of the service.
        namespace: token space of the engine's tokenizer ("" = default).
        timeout: deadline in seconds of one draft (its stream answer).
        max_nodes: default tree size the engine verifies.
        reuse: draft deeper trees and serve subtrees locally.
        reuse_factor: how many times ``max_nodes`` to ask for (capped by the service's limit).
        min_reuse_nodes: smallest subtree served locally instead of asking the service (0: the step's
            ``max_nodes``, so reuse never gives the engine a smaller tree than a round trip would).
        connect_timeout: how long the constructor waits for the service (0: do not wait).
        call_timeout: deadline of StartSession, EndSession, Ingest and GetStats.
        initial_backoff, max_backoff: first and longest wait between attempts while the service is away.
        max_buffered: completed requests kept while the service is away.
        service_max_nodes: the service's ``max_nodes_limit`` (learnt from its refusals when lower).
        security: TLS and bearer token (``ClientSecurity``; None: plaintext without a token). A token the
            service refuses raises ``DrafterRequestError`` (UNAUTHENTICATED or PERMISSION_DENIED).
        fixed_budget: ask the service to keep every tree at the budget asked for (not shrunk while a session's
            drafts are rarely accepted): what pre-speculation, which cuts later steps' chains from the trees, needs.
    """

    def __init__(self, address: str, namespace: str = "", timeout: float = 0.5, max_nodes: int = 32,
                 reuse: bool = True, reuse_factor: int = 4, min_reuse_nodes: int = 0, connect_timeout: float = 1.0,
                 call_timeout: float = 5.0, initial_backoff: float = 0.1, max_backoff: float = 5.0,
                 max_buffered: int = 1000, service_max_nodes: int = 1024,
                 security: ClientSecurity | None = None, fixed_budget: bool = False) -> None:
        if timeout <= 0 or call_timeout <= 0:
            raise ValueError(f"timeouts must be positive, got {timeout} and {call_timeout}")
        self.address, self.namespace, self.timeout, self.call_timeout = address, namespace, timeout, call_timeout
        self._book = SessionBook(max_nodes, reuse, reuse_factor, min_reuse_nodes, service_max_nodes, fixed_budget)
        self._buffer = IngestBuffer(self._book.stats, max_buffered)
        self._backoff = Backoff(address, initial_backoff, max_backoff)
        self._channel = (security or PLAINTEXT).channel(address, options=channel_options(max_backoff))
        self._stub = pb_grpc.DrafterStub(self._channel)
        self._stream: _Stream | None = None
        self._stream_lock = threading.Lock()
        self._closing = threading.Event()
        # started with the first stream: a client that only batches has no reads to watch, and no thread waking
        # every 10 ms beside the engine
        self._watchdog: threading.Thread | None = None
        if connect_timeout > 0:
            ready = grpc.channel_ready_future(self._channel)
            try:
                ready.result(timeout=connect_timeout)
                self._learn_vocab()
            except grpc.FutureTimeoutError:
                ready.cancel()
                self._backoff.failure(f"not reachable within {connect_timeout} s")
            except ServiceDown:
                pass
            except DrafterRequestError:
                self.close()
                raise

    @property
    def vocab_size(self) -> int | None:
        """Vocabulary size of the client's namespace (None until the service has been reached)."""
        return self._book.vocab_size

    def _unary(self, method: Callable[..., Any], request: Any) -> Any:
        """Call a unary method; raises ServiceDown (backoff counted) or returns (reply, code name, details)."""
        try:
            reply = method(request, timeout=self.call_timeout)
        except grpc.RpcError as exc:
            code, details = rpc_code(exc)
            if code in CALLER_ERRORS or code in ("NOT_FOUND", "ALREADY_EXISTS"):
                return None, code, details
            self._backoff.failure(f"{code}: {details}")
            raise ServiceDown from None
        self._backoff.success()
        return reply, "OK", ""

    def _learn_vocab(self) -> None:
        if self._book.vocab_size is None:
            reply, code, details = self._unary(self._stub.GetStats, pb.GetStatsRequest(namespace=self.namespace))
            if reply is None:
                raise DrafterRequestError(f"namespace {self.namespace!r}: {details}", code)
            self._book.vocab_size = reply.vocab_size

    def _get_stream(self) -> _Stream:
        with self._stream_lock:
            if self._stream is None or self._stream.closed:
                self._stream = _Stream(self._stub, self._book)
                if self._watchdog is None and not self._closing.is_set():
                    self._watchdog = threading.Thread(target=self._watch, name="drafter-deadline", daemon=True)
                    self._watchdog.start()
            return self._stream

    def _watch(self) -> None:
        """Cancel the stream when a read outlives ``timeout`` (reads themselves cannot time out)."""
        poll = min(0.01, self.timeout / 4)
        while not self._closing.wait(poll):
            stream = self._stream
            since = stream.reading_since if stream is not None else 0.0
            if stream is not None and since and time.monotonic() - since > self.timeout:
                stream.expire(since)

    def _open_remote(self, state: SessionState) -> None:
        """(Re)open the service's copy of a session with every token known so far."""
        for _ in range(3):
            req, n, reopened = self._book.start_request(state, self.namespace)
            reply, code, details = self._unary(self._stub.StartSession, req)
            if reply is not None:
                self._book.opened(state, n, reopened)
                self._learn_vocab()
                return
            if code != "ALREADY_EXISTS":
                raise DrafterRequestError(f"StartSession refused: {details}", code)
            self._book.bump(state)
        raise ServiceDown

    def _send(self, seqs: list[pb.Sequence], strict: bool) -> list[pb.Sequence]:
        """Ingest ``seqs`` in batches while the service is there; returns those left when it went away.

        Refused batches raise DrafterRequestError when ``strict``; otherwise they are dropped with a warning.
        Buffered requests (not ``strict``) may be retries of calls whose answer was lost: the service leaves out
        those whose request id it already stored.
        """
        while seqs and self._backoff.ready():
            batch, seqs = seqs[:INGEST_BATCH], seqs[INGEST_BATCH:]
            req = pb.IngestRequest(namespace=self.namespace, requests=batch, skip_duplicate_ids=not strict)
            try:
                reply, code, details = self._unary(self._stub.Ingest, req)
            except ServiceDown:
                return batch + seqs
            if reply is None and strict:
                raise DrafterRequestError(f"Ingest refused: {details}", code)
            if not strict:
                self._buffer.sent(batch, reply is not None, details)
        return seqs

    def _flush(self) -> None:
        """Send requests buffered while the service was away."""
        if len(self._buffer) and self._backoff.ready():
            self._buffer.add(self._send(self._buffer.take(len(self._buffer)), False), front=True)

    def flush(self) -> None:
        """Send the completed requests buffered while the service was away, if it is back (``start``, ``end`` and
        ``ingest`` do it on the way; an engine that only drafts calls this now and then)."""
        self._flush()

    def start(self, prompt: Sequence[int], max_nodes: int = 0, open_now: bool = True) -> str:
        """Open a session for a request; returns its id even when the service is away (opened there later).

        Args:
            prompt: the request's prompt tokens.
            max_nodes: nodes the engine verifies per step for this session (0: the client's ``max_nodes``).
            open_now: open the service's session now (a StartSession round trip); False leaves it to the
                session's first ``draft`` or ``draft_batch`` call, which opens it on the way.

        Raises:
            DrafterRequestError: bad token ids or budget, or an unknown namespace.
        """
        state = self._book.open(prompt, max_nodes)
        if open_now and self._backoff.ready():
            try:
                self._open_remote(state)
                self._flush()
            except ServiceDown:
                pass
            except DrafterRequestError:
                self._book.close(state)
                raise
        return state.local_id

    def draft(self, session: str, accepted: Sequence[int], max_nodes: int = 0,
              step_seconds: float = 0.0, plain_step_seconds: float = 0.0,
              verify_cost: Sequence[tuple[float, float]] = (), estimate_exponent: float = 0.0) -> DraftTree:
        """The next draft tree of a session: a reused subtree, a fresh one, or EMPTY_TREE when the service is away.

        Args:
            session: the id ``start`` returned.
            accepted: tokens appended since the previous call (accepted draft tokens plus the target's own).
            max_nodes: most nodes the engine verifies (0: the session's default).
            step_seconds: time of the verification step that produced ``accepted`` (passed to the service).
            plain_step_seconds: time a plain decode step (one token, no draft) takes on the engine now, 0 when
                unknown (passed to the service, which estimates the speedup from the two).
            verify_cost: the engine's step time against draft nodes as ``(nodes, seconds)`` points (at most 64;
                ``StepCostCurve.points``); the service then returns only the prefix worth verifying.
            estimate_exponent: the engine's calibration of the estimates (``AcceptanceCalibration.gamma``; 0:
                none): the service's cut uses ``p ** exponent``.

        Raises:
            DrafterRequestError: unknown session, bad token ids, budget or step time (nothing is recorded).
        """
        t0 = perf_counter_ns()
        book = self._book
        state = book.get(session)
        cost = book.cost_points(verify_cost, estimate_exponent)  # checked before anything is recorded
        toks = book.record(state, accepted, step_seconds, max_nodes, plain_step_seconds)
        waiting = book.waiting_prefetch(state)
        if waiting is not None and waiting.waiter is not None and self._backoff.ready():
            with waiting.waiter.lock:  # asked for a step ago: normally the answer is already here
                waiting.waiter.settle(waiting)
            if waiting.outcome() == "down":
                self._backoff.failure(f"{waiting.code}: {waiting.details}")
        tree = book.try_reuse(state, max_nodes)
        if tree is not None:
            if self._backoff.ready() and book.can_report(state):  # fetch the new context's tree, do not wait
                req, entry = book.prefetch_request(state, max_nodes, step_seconds, plain_step_seconds)
                stream = self._get_stream()
                with stream.lock:
                    if not stream.post(req, entry):
                        book.failed(entry, "UNAVAILABLE", "stream closed", definite=True)
            book.reused(t0)
            return tree
        if not self._backoff.ready():
            return book.empty(state)
        try:
            for _ in range(4):
                if book.needs_open(state):
                    self._open_remote(state)
                req, entry = book.draft_request(state, max_nodes, False, step_seconds, plain_step_seconds, cost)
                stream = self._get_stream()
                with stream.lock:
                    if stream.post(req, entry):
                        stream.settle(entry)
                    else:
                        book.failed(entry, "UNAVAILABLE", "stream closed", definite=True)
                action = book.action(entry, len(toks))
                if action == "done":
                    self._backoff.success()
                    return book.fetched(state, entry, max_nodes, t0)
                if action == "down":
                    self._backoff.failure(f"{entry.code}: {entry.details}")
                    break
        except ServiceDown:
            pass
        return book.empty(state)

    def draft_batch(self, items: Sequence[tuple[str, Sequence[int]]], max_nodes: int = 0,
                    step_seconds: float = 0.0, plain_step_seconds: float = 0.0) -> list[DraftTree]:
        """The next draft tree of every session of an engine step, in one round trip (DraftBatch) for all of them.

        Each session's tree is what ``draft`` would return: a reused subtree, a fresh one, or EMPTY_TREE when the
        service is away or slow. Sessions the service does not hold (opened while it was away, or lost by a
        restart) are opened in the same call with every token known so far.

        Args:
            items: (session id from ``start``, tokens appended since its previous step) per session.
            max_nodes: most nodes the engine verifies per session (0: each session's default).
            step_seconds: time of the batched verification step that produced the tokens (passed to the service).
            plain_step_seconds: time of a plain decode step of the batch now (0 when unknown).

        Raises:
            DrafterRequestError: an unknown or repeated session, bad token ids, budget or step time; nothing is
                recorded then.
        """
        batch = step_batch.begin(self._book, items, max_nodes, step_seconds, plain_step_seconds)
        self._fetch_batch(batch, max_nodes, step_seconds, plain_step_seconds, False)
        return step_batch.finish(self._book, batch)

    def draft_batch_packed(self, items: Sequence[tuple[str, Sequence[int]]], max_nodes: int = 0,
                           step_seconds: float = 0.0, plain_step_seconds: float = 0.0,
                           ends: Sequence[tuple[str, Sequence[int]]] = ()) -> step_batch.PackedBatch:
        """``draft_batch`` with the trees as flat arrays. A reply that answers every session at once (the usual
        case without reuse) is taken as it came, with no tree object per session.

        ``ends``: sessions to close with their last tokens, as ``end`` would (stored now, or buffered until the
        service is back), in the same call rather than one EndSession each.

        Raises:
            DrafterRequestError: as ``draft_batch``; an unknown session in ``ends``, one that is also in ``items``,
                or bad token ids there (nothing recorded then).
        """
        closing, last = step_batch.check_ends(self._book, ends, items) if ends else ([], [])
        batch = step_batch.begin(self._book, items, max_nodes, step_seconds, plain_step_seconds)
        self._book.record_all(closing, last)
        whole = self._fetch_batch(batch, max_nodes, step_seconds, plain_step_seconds, True, closing)
        return whole if whole is not None else step_batch.PackedBatch.of_trees(step_batch.finish(self._book, batch))

    def end_batch_async(self, ends: Sequence[tuple[str, Sequence[int]]]) -> Callable[[], None]:
        """End sessions as ``draft_batch_packed([], ends=ends)`` would, in a DraftBatch of their own whose answer
        is not waited for: the service stores them (waiting on its durable log) while the caller's next step call
        runs beside.

        Returns:
            ``settle``: call it once, from one thread, before ending more sessions this way: it waits for the
            answer and settles the sessions (those the service may not have stored go by Ingest), then ends the
            sessions the service did not hold in step as ``end`` ends them.

        Raises:
            DrafterRequestError: an unknown session, one that appears twice, or bad token ids (nothing recorded).
        """
        book = self._book
        closing, last = step_batch.check_ends(book, ends, ())
        book.record_all(closing, last)
        call = step_batch.BatchCall(pb.DraftBatchRequest(), [], [])
        ending = step_batch.add_ends(book, call, closing) if self._backoff.ready() else []
        future = self._stub.DraftBatch.future(call.request, timeout=self.timeout) if ending else None

        def settle() -> None:
            if future is not None:
                try:
                    reply = future.result()
                except (grpc.RpcError, grpc.FutureCancelledError) as exc:
                    if isinstance(exc, grpc.RpcError):
                        step_batch.call_failed(book, self._backoff, call, exc)
                    self._ended(ending, None)
                else:
                    self._backoff.success()
                    self._ended(ending, reply)
            self._end_each([state for state in closing if state not in ending])

        return settle

    def _fetch_batch(self, batch: step_batch.StepBatch, max_nodes: int, step_seconds: float,
                     plain_step_seconds: float, packed: bool, closing: Sequence[SessionState] = ()
                     ) -> step_batch.PackedBatch | None:
        """Fetch what ``batch`` still lacks in up to four DraftBatch calls; with ``packed``, a first reply that
        answers every session is returned as flat arrays (None: the trees are in ``batch``). The sessions of
        ``closing`` end in the first call (one without steps, if need be); without a call, one by one."""
        book = self._book
        out: step_batch.PackedBatch | None = None
        for attempt in range(4 if self._backoff.ready() else 0):
            call = step_batch.next_call(book, batch, self.namespace, max_nodes, step_seconds, plain_step_seconds)
            if call is None and closing and not attempt:
                call = step_batch.BatchCall(pb.DraftBatchRequest(), [], [])
            if call is None:
                break
            ending = step_batch.add_ends(book, call, closing) if not attempt else []
            closing = [state for state in closing if state not in ending]
            try:
                reply = self._stub.DraftBatch(call.request, timeout=self.timeout)
            except grpc.RpcError as exc:
                step_batch.call_failed(book, self._backoff, call, exc)
                self._ended(ending, None)
                break
            self._ended(ending, reply)
            if packed and not attempt and step_batch.answers_whole(book, batch, call, reply):
                out = step_batch.take_packed(book, self._backoff, batch, call, reply)
                break
            if not step_batch.took(book, self._backoff, batch, call, reply, max_nodes):
                break
        self._end_each(closing)  # not in a call
        return out

    def _end_each(self, states: Sequence[SessionState]) -> None:
        """End sessions one by one, as ``end`` does (a refusal is logged: the request is not stored)."""
        for state in states:
            try:
                self.end(state.local_id, ())
            except DrafterRequestError as exc:
                logger.error("drafter: the service refused a finished request (%s); not stored", exc)

    def _ended(self, sent: Sequence[SessionState], reply: pb.DraftBatchResponse | None) -> None:
        """Settle the ends a DraftBatch carried: requests it may not have stored go by Ingest (under the session's
        id, skipped if it did store them)."""
        if not sent:
            return
        resend, refused = step_batch.ends_settled(self._book, sent, reply)
        for reason in refused:
            logger.error("drafter: the service refused a finished request (%s); not stored", reason)
        if resend:
            self._buffer.add([self._book.sequence(state) for state in resend])

    def end(self, session: str, accepted: Sequence[int]) -> None:
        """Close a session with its last tokens; the whole request is stored now, or buffered until it can be.

        A session the service has in step gets EndSession; otherwise (never opened there, lost in a restart,
        out of step) the request goes by Ingest. While the service is away it waits in a bounded buffer.

        Raises:
            DrafterRequestError: unknown session or bad token ids (the session then stays open).
        """
        book = self._book
        state = book.get(session)
        toks = book.record(state, accepted)
        for entry in list(state.pending):  # reports must land before EndSession, which takes another path
            with entry.waiter.lock:
                entry.waiter.settle(entry)
        if self._backoff.ready() and book.can_report(state):
            try:
                reply, code, details = self._unary(self._stub.EndSession, book.end_request(state))
            except ServiceDown:
                reply, code, details = None, "UNAVAILABLE", ""
            if reply is not None:
                book.close(state)
                self._flush()
                return
            book.refused_end(state, len(toks), code, details)
        book.close(state)
        self._buffer.add([book.sequence(state)])
        self._flush()

    def ingest(self, requests: Iterable[Sequence[Any]]) -> int:
        """Store completed requests given as (prompt, output[, request_id]); buffered while the service is away.

        Returns:
            How many of ``requests`` the service stored now (the rest wait in the buffer).

        Raises:
            DrafterRequestError: bad token ids, or requests the service refuses (over its limits).
        """
        seqs = to_sequences(requests, self._book.vocab_size)
        rest = self._send(seqs, True)
        self._buffer.add(rest)
        self._flush()
        return len(seqs) - len(rest)

    def stats(self) -> dict[str, Any]:
        """GetStats of the client's namespace as a dictionary; DrafterUnavailable when it cannot be reached."""
        try:
            reply = self._stub.GetStats(pb.GetStatsRequest(namespace=self.namespace), timeout=self.call_timeout)
        except grpc.RpcError as exc:
            raise DrafterUnavailable(f"GetStats failed: {rpc_code(exc)}") from None
        return stats_dict(reply)

    def close(self) -> None:
        """Send what is buffered (when the service is there), then close the stream and the channel."""
        self._flush()
        if len(self._buffer):
            logger.warning("drafter client closed with %d completed requests unsent", len(self._buffer))
        self._closing.set()
        with self._stream_lock:
            stream, self._stream = self._stream, None
        if stream is not None:
            stream.close()
        self._channel.close()

    def __enter__(self) -> DrafterClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

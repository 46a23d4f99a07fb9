"""The asyncio drafter client: the same API and rules as ``DrafterClient``, on ``grpc.aio``."""

from __future__ import annotations

import asyncio
import logging
from collections import deque
from collections.abc import Callable, Iterable, Sequence
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

__all__ = ["AsyncDrafterClient"]


class _AsyncStream:
    """One DraftStream call; whoever holds ``lock`` writes requests and reads answers, matched in order."""

    def __init__(self, stub: pb_grpc.DrafterStub, book: SessionBook) -> None:
        self._book = book
        self._inflight: deque[Pending] = deque()
        self.lock = asyncio.Lock()
        self.closed = False
        self._call = stub.DraftStream()

    async def post(self, request: pb.DraftRequest, entry: Pending) -> bool:
        """Write a request (hold ``lock``); False when the stream is already broken (nothing was sent)."""
        if self.closed:
            return False
        entry.waiter = self
        self._inflight.append(entry)
        try:
            await self._call.write(request)
        except Exception as exc:  # the call is over; its status says why
            self._break(*rpc_code(exc))
        return True

    async def settle(self, entry: Pending, timeout: float) -> None:
        """Read answers (hold ``lock``) until ``entry`` is answered, the stream breaks or ``timeout`` passes."""
        deadline = asyncio.get_running_loop().time() + timeout
        while not entry.done and not self.closed:
            try:
                resp = await asyncio.wait_for(self._call.read(), deadline - asyncio.get_running_loop().time())
            except TimeoutError:
                self._break("DEADLINE_EXCEEDED", f"no answer within {timeout} s")
                return
            except Exception as exc:
                self._break(*rpc_code(exc))
                return
            if resp is grpc.aio.EOF:
                self._break("UNAVAILABLE", "the service closed the draft stream")
            elif not self._inflight:
                self._break("INTERNAL", "an answer with no request")
            else:
                self._book.answered(self._inflight.popleft(), resp)

    def _break(self, code: str, details: str) -> None:
        if self.closed:
            return
        self.closed = True
        rest = list(self._inflight)
        self._inflight.clear()
        self._call.cancel()
        settle_all(self._book, rest, code, details)

    def close(self) -> None:
        """End the call; what it still owed is settled as failed."""
        self._break("CANCELLED", "client closed")


class AsyncDrafterClient(LocalFigures):
    """``DrafterClient`` for asyncio engines: every method is a coroutine; same arguments, reuse and errors.

    Use ``async with AsyncDrafterClient(address) as client:`` or call ``await client.close()``. The channel is
    made on first use, inside the running event loop.
    """

    def __init__(self, address: str, namespace: str = "", timeout: float = 0.5, max_nodes: int = 32,
                 reuse: bool = True, reuse_factor: int = 4, min_reuse_nodes: int = 0, connect_timeout: float = 1.0,
                 call_timeout: float = 5.0, initial_backoff: float = 0.1, max_backoff: float = 5.0,
                 max_buffered: int = 1000, service_max_nodes: int = 1024,
                 security: ClientSecurity | None = None, fixed_budget: bool = False) -> None:
        if timeout <= 0 or call_timeout <= 0:
            raise ValueError(f"timeouts must be positive, got {timeout} and {call_timeout}")
        self.address, self.namespace, self.timeout, self.call_timeout = address, namespace, timeout, call_timeout
        self.connect_timeout, self._max_backoff = connect_timeout, max_backoff
        self._security = security or PLAINTEXT
        self._book = SessionBook(max_nodes, reuse, reuse_factor, min_reuse_nodes, service_max_nodes, fixed_budget)
        self._buffer = IngestBuffer(self._book.stats, max_buffered)
        self._backoff = Backoff(address, initial_backoff, max_backoff)
        self._channel: grpc.aio.Channel | None = None
        self._stub: pb_grpc.DrafterStub | None = None
        self._stream: _AsyncStream | None = None

    @property
    def _connected(self) -> pb_grpc.DrafterStub:
        """The stub of the channel ``connect`` made (every call path connects first)."""
        if self._stub is None:
            raise RuntimeError("the client is not connected: call connect() first")
        return self._stub

    async def connect(self) -> None:
        """Make the channel and wait up to ``connect_timeout`` for the service (never raises when it is away)."""
        if self._channel is not None:
            return
        self._channel = self._security.aio_channel(self.address, options=channel_options(self._max_backoff))
        self._stub = pb_grpc.DrafterStub(self._channel)
        if self.connect_timeout > 0:
            try:
                await asyncio.wait_for(self._channel.channel_ready(), self.connect_timeout)
                await self._learn_vocab()
            except TimeoutError:
                self._backoff.failure(f"not reachable within {self.connect_timeout} s")
            except ServiceDown:
                pass
            except DrafterRequestError:
                await self.close()
                raise

    async def _unary(self, method: Callable[..., Any], request: Any) -> tuple[Any, str, str]:
        """Call a unary method; raises ServiceDown (backoff counted) or returns (reply or None, code name, details)."""
        try:
            reply = await method(request, timeout=self.call_timeout)
        except grpc.RpcError as exc:
            code, details = rpc_code(exc)
            if code in CALLER_ERRORS or code in ("NOT_FOUND", "ALREADY_EXISTS"):
                return None, code, details
            self._backoff.failure(f"{code}: {details}")
            raise ServiceDown from None
        self._backoff.success()
        return reply, "OK", ""

    async def _learn_vocab(self) -> None:
        if self._book.vocab_size is None:
            reply, code, details = await self._unary(self._connected.GetStats,
                                                     pb.GetStatsRequest(namespace=self.namespace))
            if reply is None:
                raise DrafterRequestError(f"namespace {self.namespace!r}: {details}", code)
            self._book.vocab_size = reply.vocab_size

    def _get_stream(self) -> _AsyncStream:
        if self._stream is None or self._stream.closed:
            self._stream = _AsyncStream(self._connected, self._book)
        return self._stream

    async def _open_remote(self, state: SessionState) -> None:
        """(Re)open the service's copy of a session with every token known so far."""
        for _ in range(3):
            req, n, reopened = self._book.start_request(state, self.namespace)
            reply, code, details = await self._unary(self._connected.StartSession, req)
            if reply is not None:
                self._book.opened(state, n, reopened)
                await self._learn_vocab()
                return
            if code != "ALREADY_EXISTS":
                raise DrafterRequestError(f"StartSession refused: {details}", code)
            self._book.bump(state)
        raise ServiceDown

    async def _send(self, seqs: list[pb.Sequence], strict: bool) -> list[pb.Sequence]:
        """Ingest ``seqs`` in batches while the service is there; returns those left when it went away.

        Refused batches raise DrafterRequestError when ``strict``; otherwise they are dropped with a warning.
        Buffered requests (not ``strict``) may be retries of calls whose answer was lost: the service leaves out
        those whose request id it already stored.
        """
        while seqs and self._backoff.ready():
            batch, seqs = seqs[:INGEST_BATCH], seqs[INGEST_BATCH:]
            req = pb.IngestRequest(namespace=self.namespace, requests=batch, skip_duplicate_ids=not strict)
            try:
                reply, code, details = await self._unary(self._connected.Ingest, req)
            except ServiceDown:
                return batch + seqs
            if reply is None and strict:
                raise DrafterRequestError(f"Ingest refused: {details}", code)
            if not strict:
                self._buffer.sent(batch, reply is not None, details)
        return seqs

    async def _flush(self) -> None:
        """Send requests buffered while the service was away."""
        if len(self._buffer) and self._backoff.ready():
            self._buffer.add(await self._send(self._buffer.take(len(self._buffer)), False), front=True)

    async def start(self, prompt: Sequence[int], max_nodes: int = 0, open_now: bool = True) -> str:
        """Open a session; returns its id even when the service is away. See ``DrafterClient.start``."""
        await self.connect()
        state = self._book.open(prompt, max_nodes)
        if open_now and self._backoff.ready():
            try:
                await self._open_remote(state)
                await self._flush()
            except ServiceDown:
                pass
            except DrafterRequestError:
                self._book.close(state)
                raise
        return state.local_id

    async def draft(self, session: str, accepted: Sequence[int], max_nodes: int = 0,
                    step_seconds: float = 0.0, plain_step_seconds: float = 0.0,
                    verify_cost: Sequence[tuple[float, float]] = (), estimate_exponent: float = 0.0) -> DraftTree:
        """The next draft tree of a session (EMPTY_TREE when the service is away). See ``DrafterClient.draft``."""
        t0 = perf_counter_ns()
        await self.connect()
        book = self._book
        state = book.get(session)
        cost = book.cost_points(verify_cost, estimate_exponent)  # checked before anything is recorded
        toks = book.record(state, accepted, step_seconds, max_nodes, plain_step_seconds)
        waiting = book.waiting_prefetch(state)
        if waiting is not None and waiting.waiter is not None and self._backoff.ready():
            async with waiting.waiter.lock:  # asked for a step ago: normally the answer is already here
                await waiting.waiter.settle(waiting, self.timeout)
            if waiting.outcome() == "down":
                self._backoff.failure(f"{waiting.code}: {waiting.details}")
        tree = book.try_reuse(state, max_nodes)
        if tree is not None:
            if self._backoff.ready() and book.can_report(state):  # fetch the new context's tree, do not wait
                req, entry = book.prefetch_request(state, max_nodes, step_seconds, plain_step_seconds)
                stream = self._get_stream()
                async with stream.lock:
                    if not await stream.post(req, entry):
                        book.failed(entry, "UNAVAILABLE", "stream closed", definite=True)
            book.reused(t0)
            return tree
        if not self._backoff.ready():
            return book.empty(state)
        try:
            for _ in range(4):
                if book.needs_open(state):
                    await self._open_remote(state)
                req, entry = book.draft_request(state, max_nodes, False, step_seconds, plain_step_seconds, cost)
                stream = self._get_stream()
                async with stream.lock:
                    if await stream.post(req, entry):
                        await stream.settle(entry, self.timeout)
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

    async def draft_batch(self, items: Sequence[tuple[str, Sequence[int]]], max_nodes: int = 0,
                          step_seconds: float = 0.0, plain_step_seconds: float = 0.0) -> list[DraftTree]:
        """The next draft tree of every session of an engine step in one round trip. See
        ``DrafterClient.draft_batch``."""
        await self.connect()
        book = self._book
        batch = step_batch.begin(book, items, max_nodes, step_seconds, plain_step_seconds)
        for _ in range(4 if self._backoff.ready() else 0):
            call = step_batch.next_call(book, batch, self.namespace, max_nodes, step_seconds, plain_step_seconds)
            if call is None:
                break
            try:
                reply = await self._connected.DraftBatch(call.request, timeout=self.timeout)
            except grpc.RpcError as exc:
                step_batch.call_failed(book, self._backoff, call, exc)
                break
            if not step_batch.took(book, self._backoff, batch, call, reply, max_nodes):
                break
        return step_batch.finish(book, batch)

    async def end(self, session: str, accepted: Sequence[int]) -> None:
        """Close a session; stored now, or buffered until the service is back. See ``DrafterClient.end``."""
        await self.connect()
        book = self._book
        state = book.get(session)
        toks = book.record(state, accepted)
        for entry in list(state.pending):  # reports must land before EndSession, which takes another path
            async with entry.waiter.lock:
                await entry.waiter.settle(entry, self.timeout)
        if self._backoff.ready() and book.can_report(state):
            try:
                reply, code, details = await self._unary(self._connected.EndSession, book.end_request(state))
            except ServiceDown:
                reply, code, details = None, "UNAVAILABLE", ""
            if reply is not None:
                book.close(state)
                await self._flush()
                return
            book.refused_end(state, len(toks), code, details)
        book.close(state)
        self._buffer.add([book.sequence(state)])
        await self._flush()

    async def ingest(self, requests: Iterable[Sequence[Any]]) -> int:
        """Store completed requests (prompt, output[, request_id]). See ``DrafterClient.ingest``."""
        await self.connect()
        seqs = to_sequences(requests, self._book.vocab_size)
        rest = await self._send(seqs, True)
        self._buffer.add(rest)
        await self._flush()
        return len(seqs) - len(rest)

    async def stats(self) -> dict[str, Any]:
        """GetStats of the client's namespace as a dictionary; DrafterUnavailable when unreachable."""
        await self.connect()
        try:
            reply = await self._connected.GetStats(pb.GetStatsRequest(namespace=self.namespace),
                                              timeout=self.call_timeout)
        except grpc.RpcError as exc:
            raise DrafterUnavailable(f"GetStats failed: {rpc_code(exc)}") from None
        return stats_dict(reply)

    async def close(self) -> None:
        """Send what is buffered (when the service is there), close the stream and the channel."""
        if self._channel is None:
            return
        await self._flush()
        if len(self._buffer):
            logger.warning("drafter client closed with %d completed requests unsent", len(self._buffer))
        if self._stream is not None:
            self._stream.close()
            self._stream = None
        await self._channel.close()
        self._channel = None

    async def __aenter__(self) -> AsyncDrafterClient:
        await self.connect()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

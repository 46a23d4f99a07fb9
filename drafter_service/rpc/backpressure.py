"""Back-pressure on the gRPC server: a bound on open streaming calls, each of which holds a worker thread."""

from __future__ import annotations

import inspect
import logging
import threading
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from typing import Any

import grpc
import grpc.aio

from drafter_service.api.errors import ResourceExhausted
from drafter_service.rpc.interceptor import behaviour_of, rebuilt

logger = logging.getLogger(__name__)


class StreamLimit:
    """Counts open streaming calls and refuses one beyond ``limit``.

    A DraftStream, a PutFrozenTable upload or a health Watch keeps a worker thread for as long as the client keeps
    it open, so with more of them than threads every other call would wait for one. Keeping them below the thread count
    leaves threads for unary calls; the stream that would cross the bound is refused at once instead of queued.

    Attributes:
        limit: most streams open at once.
        refused: streams refused so far.
        peak: most streams that were open at once.
    """

    def __init__(self, limit: int) -> None:
        if limit < 1:
            raise ValueError(f"limit must be at least 1, got {limit}")
        self.limit = int(limit)
        self.refused = 0
        self.peak = 0
        self._open = 0
        self._lock = threading.Lock()

    @property
    def open(self) -> int:
        """Streams open now."""
        return self._open

    def acquire(self, method: str = "") -> Callable[[], None]:
        """Count one more open stream; returns its release (safe to call more than once).

        Raises:
            ResourceExhausted: ``limit`` streams are open already (nothing is counted).
        """
        with self._lock:
            taken = self._open < self.limit
            if taken:
                self._open += 1
                self.peak = max(self.peak, self._open)
            else:
                self.refused += 1
            refused = self.refused
        if not taken:
            if refused == 1 or refused % 1000 == 0:
                logger.warning("%d streams open: refusing %s (%d refused so far)", self.limit, method or "a stream",
                               refused)
            raise ResourceExhausted(f"{self.limit} streams are open, the most this service takes "
                                    "(--max-streams); retry later or close some")
        released = threading.Event()

        def release() -> None:
            with self._lock:
                if not released.is_set():
                    released.set()
                    self._open -= 1
        return release


class StreamLimitInterceptor(grpc.aio.ServerInterceptor):
    """Applies a ``StreamLimit`` to every streaming method (request or response streams, health Watch included).

    Place it after the error interceptor, so that the refusal becomes RESOURCE_EXHAUSTED.
    """

    def __init__(self, limit: StreamLimit) -> None:
        self.limit = limit

    async def intercept_service(self, continuation: Callable[[Any], Awaitable[grpc.RpcMethodHandler | None]],
                                handler_call_details: grpc.HandlerCallDetails) -> grpc.RpcMethodHandler | None:
        handler = await continuation(handler_call_details)
        if handler is None or not (handler.request_streaming or handler.response_streaming):
            return handler
        method, limit, inner = handler_call_details.method, self.limit, behaviour_of(handler)
        if inspect.isasyncgenfunction(inner):
            async def async_stream(request: Any, context: Any) -> AsyncIterator[Any]:
                release = limit.acquire(method)
                context.add_done_callback(lambda _: release())  # also when the call ends without closing this
                try:
                    async for reply in inner(request, context):
                        yield reply
                finally:
                    release()
            return rebuilt(handler, async_stream)
        if inspect.iscoroutinefunction(inner):
            async def async_unary(requests: Any, context: Any) -> Any:
                release = limit.acquire(method)
                context.add_done_callback(lambda _: release())
                try:
                    return await inner(requests, context)
                finally:
                    release()
            return rebuilt(handler, async_unary)
        if handler.response_streaming:
            def stream(request: Any, context: Any) -> Iterator[Any]:
                release = limit.acquire(method)
                try:
                    yield from inner(request, context)
                finally:
                    release()
            return rebuilt(handler, stream)

        def unary(requests: Iterator[Any], context: Any) -> Any:
            release = limit.acquire(method)
            try:
                return inner(requests, context)
            finally:
                release()
        return rebuilt(handler, unary)

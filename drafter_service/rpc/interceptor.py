"""The one error boundary of the gRPC server: domain errors become status codes, anything else INTERNAL."""

from __future__ import annotations

import inspect
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import grpc
import grpc.aio

from drafter_service.api.errors import (
    AlreadyExists,
    DrafterError,
    InvalidArgument,
    NotFound,
    PermissionDenied,
    ResourceExhausted,
    Unauthenticated,
    Unavailable,
)

logger = logging.getLogger(__name__)

STATUS = {
    InvalidArgument: grpc.StatusCode.INVALID_ARGUMENT,
    NotFound: grpc.StatusCode.NOT_FOUND,
    AlreadyExists: grpc.StatusCode.ALREADY_EXISTS,
    ResourceExhausted: grpc.StatusCode.RESOURCE_EXHAUSTED,
    Unavailable: grpc.StatusCode.UNAVAILABLE,
    Unauthenticated: grpc.StatusCode.UNAUTHENTICATED,
    PermissionDenied: grpc.StatusCode.PERMISSION_DENIED,
}


def status_of(exc: BaseException) -> tuple[grpc.StatusCode, str]:
    """The status code and message an exception is reported with."""
    for kind, code in STATUS.items():
        if isinstance(exc, kind):
            return code, str(exc)
    if isinstance(exc, DrafterError):
        return grpc.StatusCode.INVALID_ARGUMENT, str(exc)
    return grpc.StatusCode.INTERNAL, "internal error (logged by the service)"


class MalformedMessage(InvalidArgument):
    """Request bytes that do not parse as the method's message."""


class _Unparsed:
    """Stands for a request whose bytes did not parse, so the handler can refuse it with INVALID_ARGUMENT."""

    def __init__(self, error: Exception) -> None:
        self.error = error


def _lenient(deserializer: Callable[[bytes], Any] | None) -> Callable[[bytes], Any] | None:
    if deserializer is None:
        return None

    def parse(data: bytes) -> Any:
        try:
            return deserializer(data)
        except Exception as exc:
            return _Unparsed(exc)
    return parse


def _checked(request: Any) -> Any:
    if isinstance(request, _Unparsed):
        raise MalformedMessage(f"malformed request message: {request.error}")
    return request


def rebuilt(handler: grpc.RpcMethodHandler, behaviour: Callable, request_deserializer: Any = None
            ) -> grpc.RpcMethodHandler:
    """``handler`` with ``behaviour`` in place of its own (same kind of call, same serializers; the request
    deserializer replaced when one is given)."""
    parse = request_deserializer or handler.request_deserializer
    out = handler.response_serializer
    if handler.request_streaming and handler.response_streaming:
        return grpc.stream_stream_rpc_method_handler(behaviour, parse, out)
    if handler.response_streaming:
        return grpc.unary_stream_rpc_method_handler(behaviour, parse, out)
    if handler.request_streaming:
        return grpc.stream_unary_rpc_method_handler(behaviour, parse, out)
    return grpc.unary_unary_rpc_method_handler(behaviour, parse, out)


def behaviour_of(handler: grpc.RpcMethodHandler) -> Callable:
    """The function that serves a handler's calls."""
    return handler.unary_unary or handler.unary_stream or handler.stream_unary or handler.stream_stream


class ErrorInterceptor(grpc.aio.ServerInterceptor):
    """Wraps every handler: maps domain errors to status codes; logs anything else and returns INTERNAL.

    Requests that do not parse reach the handler as a marker and are refused with INVALID_ARGUMENT. Handlers run on
    the event loop (coroutines and async generators) keep running there; plain functions stay plain, so the server
    runs them in its thread pool, and a single request message of theirs is parsed there too (the loop gets its
    bytes): parsing a large Ingest takes milliseconds, which no Draft on the loop should wait for.
    """

    def __init__(self) -> None:
        self._guarded: dict[str, grpc.RpcMethodHandler] = {}  # the handlers are fixed once the server starts

    async def intercept_service(self, continuation: Callable[[Any], Awaitable[grpc.RpcMethodHandler | None]],
                                handler_call_details: grpc.HandlerCallDetails) -> grpc.RpcMethodHandler | None:
        method = handler_call_details.method
        guarded = self._guarded.get(method)
        if guarded is None:
            handler = await continuation(handler_call_details)
            if handler is None:  # an unknown method: not kept, so unknown names cannot fill the dict
                return None
            guarded = self._guarded[method] = self._guard(handler, method)
        return guarded

    @staticmethod
    def _guard(handler: grpc.RpcMethodHandler, method: str) -> grpc.RpcMethodHandler:
        fn, streaming = behaviour_of(handler), handler.request_streaming
        parse = _lenient(handler.request_deserializer)
        if inspect.iscoroutinefunction(fn):
            return rebuilt(handler, _guard_coroutine(fn, method, streaming), parse)
        if inspect.isasyncgenfunction(fn):
            return rebuilt(handler, _guard_async_stream(fn, method, streaming), parse)
        if streaming or parse is None:
            in_pool = None
        else:  # parsed in the pool thread that serves the call
            in_pool, parse = parse, _bytes
        guard = (_guard_stream if handler.response_streaming else _guard_unary)(fn, method, streaming, in_pool)
        return rebuilt(handler, guard, parse)


def _aborted(exc: BaseException) -> bool:
    """The call already ended with a status (an abort, here or further in)."""
    return isinstance(exc, (grpc.aio.AbortError, grpc.RpcError))


def _abort(context: Any, exc: BaseException, method: str) -> None:
    """From a thread-pool handler: end the call with the exception's status (raises the server's AbortError)."""
    code, message = _logged_status(exc, method)
    context.abort(code, message)


def _logged_status(exc: BaseException, method: str) -> tuple[grpc.StatusCode, str]:
    code, message = status_of(exc)
    if code == grpc.StatusCode.INTERNAL:
        logger.error("%s failed", method, exc_info=exc)
    return code, message


def _bytes(data: bytes) -> bytes:
    """A request message left unparsed by the loop (see ErrorInterceptor)."""
    return data


def _requests(request: Any, streaming: bool, parse: Callable[[bytes], Any] | None = None) -> Any:
    if streaming:
        return (_checked(r) for r in request)
    return _checked(parse(request) if parse is not None else request)


async def _async_requests(requests: AsyncIterator[Any]) -> AsyncIterator[Any]:
    async for request in requests:
        yield _checked(request)


def _guard_unary(fn: Callable, method: str, streaming: bool, parse: Callable[[bytes], Any] | None) -> Callable:
    def call(request: Any, context: Any) -> Any:
        try:
            return fn(_requests(request, streaming, parse), context)
        except Exception as exc:
            if _aborted(exc):
                raise
            _abort(context, exc, method)
    return call


def _guard_stream(fn: Callable, method: str, streaming: bool, parse: Callable[[bytes], Any] | None) -> Callable:
    def call(request: Any, context: Any) -> Any:
        try:
            yield from fn(_requests(request, streaming, parse), context)
        except Exception as exc:
            if _aborted(exc):
                raise
            _abort(context, exc, method)
    return call


def _guard_coroutine(fn: Callable, method: str, streaming: bool) -> Callable:
    async def call(request: Any, context: grpc.aio.ServicerContext) -> Any:
        try:
            if streaming:
                return await fn(_async_requests(request), context)
            return await fn(_checked(request), context)
        except Exception as exc:
            if _aborted(exc):
                raise
            await context.abort(*_logged_status(exc, method))
    return call


def _guard_async_stream(fn: Callable, method: str, streaming: bool) -> Callable:
    async def call(request: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
        try:
            async for reply in fn(_async_requests(request) if streaming else _checked(request), context):
                yield reply
        except Exception as exc:
            if _aborted(exc):
                raise
            await context.abort(*_logged_status(exc, method))
    return call

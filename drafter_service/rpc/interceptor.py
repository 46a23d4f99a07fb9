"""The one error boundary of the gRPC server: domain errors become status codes, anything else INTERNAL."""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import grpc

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


class ErrorInterceptor(grpc.ServerInterceptor):
    """Wraps every handler: maps domain errors to status codes; logs anything else and returns INTERNAL.

    Requests that do not parse reach the handler as a marker and are refused with INVALID_ARGUMENT.
    """

    def intercept_service(self, continuation: Callable[[Any], grpc.RpcMethodHandler | None],
                          handler_call_details: grpc.HandlerCallDetails) -> grpc.RpcMethodHandler | None:
        handler = continuation(handler_call_details)
        if handler is None:
            return None
        method = handler_call_details.method
        parse, out = _lenient(handler.request_deserializer), handler.response_serializer
        if handler.unary_unary is not None:
            return grpc.unary_unary_rpc_method_handler(_guard_unary(handler.unary_unary, method, False), parse, out)
        if handler.stream_stream is not None:
            return grpc.stream_stream_rpc_method_handler(_guard_stream(handler.stream_stream, method, True), parse,
                                                         out)
        if handler.unary_stream is not None:
            return grpc.unary_stream_rpc_method_handler(_guard_stream(handler.unary_stream, method, False), parse,
                                                        out)
        return grpc.stream_unary_rpc_method_handler(_guard_unary(handler.stream_unary, method, True), parse, out)


def _abort(context: grpc.ServicerContext, exc: BaseException, method: str) -> None:
    code, message = status_of(exc)
    if code == grpc.StatusCode.INTERNAL:
        logger.error("%s failed", method, exc_info=exc)
    context.abort(code, message)


def _requests(request: Any, streaming: bool) -> Any:
    return (_checked(r) for r in request) if streaming else _checked(request)


def _guard_unary(fn: Callable, method: str, streaming: bool) -> Callable:
    def call(request: Any, context: grpc.ServicerContext) -> Any:
        try:
            return fn(_requests(request, streaming), context)
        except Exception as exc:
            if isinstance(exc, grpc.RpcError) or context.code() is not None:
                raise  # already aborted with a status
            _abort(context, exc, method)
    return call


def _guard_stream(fn: Callable, method: str, streaming: bool) -> Callable:
    def call(request: Any, context: grpc.ServicerContext) -> Any:
        try:
            yield from fn(_requests(request, streaming), context)
        except Exception as exc:
            if isinstance(exc, grpc.RpcError) or context.code() is not None:
                raise
            _abort(context, exc, method)
    return call

"""Bearer-token authentication for the TCP listener (the Unix socket relies on file mode 0600)."""

from __future__ import annotations

import hmac
from collections.abc import Awaitable, Callable
from typing import Any

import grpc

_HEALTH_PREFIX = "/grpc.health.v1.Health/"


class TokenInterceptor(grpc.aio.ServerInterceptor):
    """Rejects calls without `authorization: Bearer <token>` with UNAUTHENTICATED.

    Tokens are compared in constant time and never logged. Health checks are open so load
    balancers and orchestrators can probe the port.
    """

    def __init__(self, token: str) -> None:
        if not token:
            raise ValueError("TokenInterceptor needs a non-empty token")
        self._expected = f"Bearer {token}".encode()

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        if handler_call_details.method.startswith(_HEALTH_PREFIX):
            return await continuation(handler_call_details)
        presented = b""
        for key, value in handler_call_details.invocation_metadata or ():
            if key == "authorization":
                presented = value.encode() if isinstance(value, str) else value
        handler = await continuation(handler_call_details)
        if handler is None or hmac.compare_digest(presented, self._expected):
            return handler
        return _deny_like(handler)


def _deny_like(handler: grpc.RpcMethodHandler) -> grpc.RpcMethodHandler:
    async def deny_unary(request: Any, context: grpc.aio.ServicerContext) -> None:
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, "missing or invalid token")

    async def deny_stream(request: Any, context: grpc.aio.ServicerContext):  # type: ignore[no-untyped-def]
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, "missing or invalid token")
        yield  # pragma: no cover - makes this an async generator

    des, ser = handler.request_deserializer, handler.response_serializer
    if handler.request_streaming and handler.response_streaming:
        return grpc.stream_stream_rpc_method_handler(deny_stream, des, ser)
    if handler.request_streaming:
        return grpc.stream_unary_rpc_method_handler(deny_unary, des, ser)
    if handler.response_streaming:
        return grpc.unary_stream_rpc_method_handler(deny_stream, des, ser)
    return grpc.unary_unary_rpc_method_handler(deny_unary, des, ser)

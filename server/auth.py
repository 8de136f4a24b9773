"""Bearer-token authentication for the TCP listener (the Unix socket relies on file mode 0600).

The token a caller presents names its tenant (`server.tenancy`): the admin `token` is
unscoped, each token of `tenant_tokens_file` scopes the call to its tenant.
"""

from __future__ import annotations

import inspect
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, TypeAlias

import grpc

from kvstore.server.tenancy import TokenTable, current_tenant

_HEALTH_PREFIX = "/grpc.health.v1.Health/"
Handler: TypeAlias = "grpc.RpcMethodHandler[Any, Any]"
Context: TypeAlias = "grpc.aio.ServicerContext[Any, Any]"


class TokenInterceptor(grpc.aio.ServerInterceptor):
    """Rejects calls without a known `authorization: Bearer <token>` with UNAUTHENTICATED, and
    runs the others with their token's tenant set (`current_tenant`).

    Tokens are compared in constant time and never logged. Health checks are open so load
    balancers and orchestrators can probe the port.
    """

    def __init__(self, token: str | TokenTable) -> None:
        if isinstance(token, str):
            if not token:
                raise ValueError("TokenInterceptor needs a non-empty token")
            token = TokenTable(token)
        self._table = token

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[Handler | None]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> Handler | None:
        if handler_call_details.method.startswith(_HEALTH_PREFIX):
            return await continuation(handler_call_details)
        presented = b""
        for key, value in handler_call_details.invocation_metadata or ():
            if key == "authorization":
                presented = value.encode() if isinstance(value, str) else value
        handler = await continuation(handler_call_details)
        if handler is None:
            return handler
        tenant = self._table.tenant_for(presented)
        if tenant is None:
            return _deny_like(handler)
        return _with_tenant(handler, tenant) if tenant else handler


def _rebuild(handler: Handler, unary: Any, stream: Any) -> Handler:
    """A handler of `handler`'s kind whose behaviour is `unary` or `stream`."""
    des, ser = handler.request_deserializer, handler.response_serializer
    if handler.request_streaming and handler.response_streaming:
        return grpc.stream_stream_rpc_method_handler(stream, des, ser)
    if handler.request_streaming:
        return grpc.stream_unary_rpc_method_handler(unary, des, ser)
    if handler.response_streaming:
        return grpc.unary_stream_rpc_method_handler(stream, des, ser)
    return grpc.unary_unary_rpc_method_handler(unary, des, ser)


def _behaviour(handler: Handler) -> Any:
    return (handler.stream_stream or handler.stream_unary or handler.unary_stream
            or handler.unary_unary)


def _with_tenant(handler: Handler, tenant: str) -> Handler:
    """Run `handler` with `current_tenant` set to `tenant` (the call's own task context)."""
    inner = _behaviour(handler)

    async def unary(request: Any, context: Context) -> Any:
        current_tenant.set(tenant)
        return await inner(request, context)

    async def stream(request: Any, context: Context) -> AsyncIterator[Any]:
        current_tenant.set(tenant)
        async for item in inner(request, context):
            yield item

    # A streaming response is a coroutine writing with `context.write` (Fetch) or an async
    # generator; wrap it as what it is.
    return _rebuild(handler, unary, stream if inspect.isasyncgenfunction(inner) else unary)


def _deny_like(handler: Handler) -> Handler:
    async def deny_unary(request: Any, context: Context) -> None:
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, "missing or invalid token")

    async def deny_stream(request: Any, context: Context) -> AsyncIterator[None]:
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, "missing or invalid token")
        yield  # pragma: no cover - makes this an async generator

    return _rebuild(handler, deny_unary, deny_stream)

"""`AsyncKVClient._attempt`: a CancelledError that gRPC raises for a call it cancelled itself
(its request stream ended as its deadline passed) is a failed call, a miss; the caller's own
cancellation still propagates. (The first escaped `publish_with` over TCP as CancelledError.)"""

from __future__ import annotations

import asyncio

import pytest

from kvstore.client.aio import AsyncKVClient
from tests.conftest import small_layout


def test_a_call_grpc_cancelled_is_a_miss_not_an_escaping_cancel():
    async def main() -> tuple[bool, object]:
        client = AsyncKVClient("unix:///nonexistent/kv.sock", small_layout())

        async def cancelled_by_grpc() -> int:
            raise asyncio.CancelledError  # what awaiting a call gRPC cancelled raises

        try:
            return await client._attempt(cancelled_by_grpc, until=None)
        finally:
            await client.close()

    assert asyncio.run(main()) == (False, None)


def test_the_callers_own_cancel_still_propagates():
    async def main() -> None:
        client = AsyncKVClient("unix:///nonexistent/kv.sock", small_layout())
        started = asyncio.Event()

        async def slow() -> int:
            started.set()
            await asyncio.sleep(30)
            return 1

        task = asyncio.ensure_future(client._attempt(slow, until=None))
        await started.wait()
        task.cancel()
        try:
            with pytest.raises(asyncio.CancelledError):
                await task
        finally:
            await client.close()

    asyncio.run(main())

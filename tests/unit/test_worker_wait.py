"""`kvstore.worker_wait.wait_out`: a cancelled caller waits for its worker thread, however often
it is cancelled meanwhile (the thread moves bytes in memory the caller frees when it unwinds)."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest

from kvstore.worker_wait import wait_out


def test_a_caller_cancelled_twice_still_waits_for_its_worker() -> None:
    release = threading.Event()
    finished: list[float] = []

    def work() -> None:
        release.wait(5)
        finished.append(time.monotonic())

    async def caller() -> None:
        fut = asyncio.get_running_loop().run_in_executor(None, work)
        try:
            await asyncio.shield(fut)
        except asyncio.CancelledError:
            await wait_out(fut)
            raise

    async def main() -> float:
        task = asyncio.ensure_future(caller())
        await asyncio.sleep(0.05)
        task.cancel()
        await asyncio.sleep(0.05)
        task.cancel()  # a second cancellation while it waits for the worker
        await asyncio.sleep(0.05)
        assert not task.done()  # still waiting: the worker runs
        asyncio.get_running_loop().call_later(0.1, release.set)
        with pytest.raises(asyncio.CancelledError):
            await task
        return time.monotonic()

    unwound = asyncio.run(main())
    assert finished and finished[0] <= unwound


def test_wait_out_of_a_finished_future_returns_at_once() -> None:
    async def main() -> None:
        fut = asyncio.get_running_loop().create_future()
        fut.set_result(1)
        await wait_out(fut)

    asyncio.run(main())

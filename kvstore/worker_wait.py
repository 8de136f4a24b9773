"""Waiting out a worker thread whose caller was cancelled.

Byte movement runs in worker threads on memory the caller owns (arena slots under a lease or a
reservation, a tensor, a socket's destination). A cancelled caller must not unwind, and free or
reuse that memory, while the thread still reads or writes it; and a second cancellation while
it waits must not cut that wait short either.
"""

from __future__ import annotations

import asyncio
from typing import Any


async def wait_out(fut: asyncio.Future[Any]) -> None:
    """Wait until `fut` is done, through any number of cancellations; if there was one, raise
    `CancelledError` once it is done."""
    cancelled = False
    while not fut.done():
        try:
            await asyncio.wait([fut])
        except asyncio.CancelledError:
            cancelled = True
    if cancelled:
        raise asyncio.CancelledError

"""The bounded queue of blocks waiting to be written through to the remote tier.

It holds keys, not bytes: the writer reads each block from wherever it lives when its turn
comes (host, or disk if it was demoted meanwhile), so a queued block costs a few dozen bytes and
enqueueing never copies a payload on the event loop. A full queue sheds the new block (counted)
instead of blocking or growing: a publishing engine never waits for the remote tier, and a slow
or dead Cluster costs at most `capacity` keys of memory. A write that failed for a reason that
may pass (a connection, a timeout) goes back to the front for a few more attempts.
"""

from __future__ import annotations

import asyncio
from collections import OrderedDict
from collections.abc import Callable, Iterable
from dataclasses import dataclass


@dataclass
class QueuedWrite:
    key: bytes
    # Queued by a demotion: the block was probably written when it was published, so the
    # writer first checks that the remote tier lacks it.
    check_exists: bool = False
    attempts: int = 0  # failed attempts so far


@dataclass
class QueueStats:
    depth: int
    capacity: int
    queued: int  # blocks accepted
    shed: int  # blocks refused because the queue was full (or no room to retry them)


class WriteThroughQueue:
    """FIFO of `QueuedWrite`s, one per key, at most `capacity`."""

    def __init__(self, capacity: int) -> None:
        if capacity < 1:
            raise ValueError(f"write-through queue capacity must be >= 1, got {capacity}")
        self.capacity = capacity
        self.queued = 0
        self.shed = 0
        self._items: OrderedDict[bytes, QueuedWrite] = OrderedDict()
        self._ready = asyncio.Event()
        self._busy = 0  # batches taken and not yet marked done

    def __len__(self) -> int:
        return len(self._items)

    def put(self, key: bytes, check_exists: bool = False) -> bool:
        """Queue a block; False when it was shed. A key already queued is not queued twice."""
        queued = self._items.get(key)
        if queued is not None:
            queued.check_exists = queued.check_exists and check_exists  # one write covers both
            return True
        if len(self._items) >= self.capacity:
            self.shed += 1
            return False
        self._items[key] = QueuedWrite(key, check_exists)
        self.queued += 1
        self._ready.set()
        return True

    def discard(self, key: bytes) -> None:
        """Forget a queued block (it was cleared: writing it would bring it back)."""
        self._items.pop(key, None)

    def requeue(self, writes: Iterable[QueuedWrite]) -> None:
        """Put writes that failed back at the front, in their order, while there is room."""
        back = [w for w in writes if w.key not in self._items]
        room = self.capacity - len(self._items)
        self.shed += max(0, len(back) - room)
        for w in reversed(back[: max(room, 0)]):
            self._items[w.key] = w
            self._items.move_to_end(w.key, last=False)
        if self._items:
            self._ready.set()

    async def take(self, max_blocks: int, max_bytes: int,
                   size_of: Callable[[bytes], int]) -> list[QueuedWrite]:
        """The oldest entries, at least one and within both limits, waiting while the queue is
        empty; call `done` when the batch is written (or given up)."""
        while not self._items:
            self._ready.clear()
            await self._ready.wait()
        batch: list[QueuedWrite] = []
        total = 0
        while self._items and len(batch) < max_blocks:
            key = next(iter(self._items))
            total += size_of(key)
            if batch and total > max_bytes:
                break
            batch.append(self._items.popitem(last=False)[1])
        self._busy += 1
        return batch

    def done(self) -> None:
        self._busy -= 1

    def idle(self) -> bool:
        """Nothing queued and no batch being written."""
        return not self._items and not self._busy

    def stats(self) -> QueueStats:
        return QueueStats(len(self._items), self.capacity, self.queued, self.shed)

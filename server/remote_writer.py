"""The write-through task: blocks queued in `WriteThroughQueue`, framed and sent to the remote tier.

One task per daemon takes a batch of queued keys, finds each block where it lives now (where a
fetch would read it: host, else gpu or disk), pins it just long enough to frame it in a worker
thread (a disk copy is verified on the way, so a rotten local copy is never shared), and hands
the batch to a second task, which writes it in one pipeline while the first frames the next
batch: a consumer waiting for a producer's blocks (disaggregated prefill) gets them after the
framing of one batch plus the sending of all, not after both of every batch. Blocks queued by
a demotion are sent only where the remote tier lacks them.

While the remote tier's breaker is open the task waits rather than fail each batch, and a write
that failed for a transient reason goes back to the front of the queue, up to
`REMOTE_WRITE_ATTEMPTS` times: a short outage delays writes instead of losing them (the bounded
queue sheds what arrives meanwhile), and a block that can never be written does not keep the
breaker open for everyone's reads. The task never dies of an error, which would silently
disable write-through.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any

from kvstore.errors import IntegrityError
from kvstore.server.write_through import QueuedWrite, WriteThroughQueue
from kvstore.tiers.base import BlockEntry, Tier
from kvstore.tiers.disk import DiskTier
from kvstore.tiers.gpu import GpuTier
from kvstore.tiers.remote import (
    RemoteSkippedError,
    RemoteTier,
    RemoteUnavailableError,
    RemoteWrite,
    frame_value,
    new_frame,
    payload_view,
    seal_frame,
)

if TYPE_CHECKING:
    from kvstore.server.store import TieredStore

log = logging.getLogger(__name__)
# A batch: enough blocks to amortize a round trip, few enough bytes to stay well inside the
# remote timeout and to keep its frames (copies, held until sent) modest.
WRITE_BATCH_BYTES = 16 << 20
WRITE_BATCH_BLOCKS = 64
REMOTE_WRITE_ATTEMPTS = 3  # a write-through that failed this often is given up (counted)


class RemoteWriter:
    def __init__(self, store: TieredStore, remote: RemoteTier, queue: WriteThroughQueue,
                 run_io: Callable[..., Awaitable[Any]]) -> None:
        self.store, self.remote, self.queue = store, remote, queue
        self._run_io = run_io  # the store's byte-movement workers
        # Batches taken from the queue and not yet sent or given up (by id), each with a
        # future that ends with it: a Clear waits for those before it clears the remote tier.
        self._in_flight: dict[int, asyncio.Future[None]] = {}

    async def run(self) -> None:
        """Frame queued blocks a batch at a time, and send each framed batch, until cancelled;
        one framed batch waits for the sender at most (its frames are copies)."""
        framed: asyncio.Queue[tuple[list[QueuedWrite], list[RemoteWrite]]] = asyncio.Queue(1)
        sender = asyncio.create_task(self._send_framed(framed))
        try:
            while True:
                delay = self.remote.breaker.wait_s()
                if delay > 0:
                    await asyncio.sleep(min(delay, 0.5))
                    continue
                batch = await self.queue.take(WRITE_BATCH_BLOCKS, WRITE_BATCH_BYTES,
                                              self._local_length)
                self._in_flight[id(batch)] = asyncio.get_running_loop().create_future()
                try:
                    writes = await self._frame(batch)
                    await framed.put((batch, writes))
                except BaseException as e:
                    await self._settle(batch, e)
                    if not isinstance(e, Exception):
                        raise
                    continue
                # Until the sender takes it: then the next batch is framed while this one is
                # sent. (Taking the next at once would hold a third batch out of the queue.)
                await framed.join()
        finally:
            sender.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await sender  # its batch settled
            while not framed.empty():  # framed, never sent: back in the queue
                batch = framed.get_nowait()[0]
                self._done(batch)
                self.queue.requeue(batch)

    async def _send_framed(self, framed: asyncio.Queue[tuple[list[QueuedWrite],
                                                            list[RemoteWrite]]]) -> None:
        while True:
            batch, writes = await framed.get()
            framed.task_done()  # taken: the framer frames the next batch meanwhile
            try:
                retry = await self._send(batch, writes)
            except BaseException as e:
                await self._settle(batch, e)
                if not isinstance(e, Exception):
                    raise
                continue
            self._done(batch)
            self.queue.requeue(retry)

    def _done(self, batch: list[QueuedWrite]) -> None:
        """A batch's turn is over: sent, given up or back in the queue."""
        self.queue.done()
        if (ended := self._in_flight.pop(id(batch), None)) is not None and not ended.done():
            ended.set_result(None)

    async def settled(self, budget_s: float) -> bool:
        """Wait up to `budget_s` for the batches taken so far to be sent or given up (not
        those taken meanwhile); True if they were. A Clear calls it before clearing the
        remote tier: a batch framed before the Clear would land after it otherwise. (A write
        past its deadline may still land, from the write thread, within its socket timeout.)"""
        pending = list(self._in_flight.values())
        if not pending:
            return True
        _, late = await asyncio.wait(pending, timeout=budget_s)
        return not late

    async def _settle(self, batch: list[QueuedWrite], error: BaseException) -> None:
        """A batch whose framing or sending raised: requeued for another attempt, or given up
        (counted); either way its turn is over."""
        retry: list[QueuedWrite] = []
        if isinstance(error, RemoteSkippedError):  # another call is probing: try again later
            retry = batch
        elif isinstance(error, RemoteUnavailableError):
            log.debug("write-through of %d blocks failed: %s", len(batch), error)
            retry = self._failed_attempt(batch)
        elif isinstance(error, Exception):
            log.error("write-through of %d blocks failed", len(batch), exc_info=error)
            self.store.counters.remote_dropped_writes += len(batch)
        else:  # cancelled: queued again, for a writer that runs later
            retry = batch
        self._done(batch)
        self.queue.requeue(retry)
        if isinstance(error, RemoteSkippedError):
            await asyncio.sleep(0.05)

    async def drain(self, budget_s: float) -> bool:
        """Wait up to `budget_s` for the queue to empty; True if it did. Gives up at once
        while the remote tier is unreachable."""
        end = time.monotonic() + budget_s
        while not self.queue.idle():
            if time.monotonic() >= end or not self.remote.available:
                return False
            await asyncio.sleep(0.01)
        return True

    def _failed_attempt(self, writes: list[QueuedWrite]) -> list[QueuedWrite]:
        """Count a failed attempt; the writes worth another one."""
        again = []
        for w in writes:
            w.attempts += 1
            if w.attempts < REMOTE_WRITE_ATTEMPTS:
                again.append(w)
            else:
                self.store.counters.remote_dropped_writes += 1
        return again

    def _local(self, key: bytes) -> tuple[Tier, BlockEntry] | None:
        """Where to read a queued block from: the level a fetch reads it from (host, else the
        fastest level holding it; the placement engine's `source`), or None."""
        level = self.store.placement.source(key)
        if level is None:
            return None
        tier = self.store.tiers[level]
        entry = tier.get(key)
        return (tier, entry) if entry is not None else None

    def _local_length(self, key: bytes) -> int:
        found = self._local(key)
        return found[1].length if found is not None else 0

    async def _frame(self, batch: list[QueuedWrite]) -> list[RemoteWrite]:
        """The framed values of a batch's blocks (those still held locally, and, for blocks
        queued by a demotion, not in the remote tier yet)."""
        store = self.store
        checks: dict[bytes, list[bytes]] = {}  # namespace -> keys to check first
        for w in batch:
            found = self._local(w.key) if w.check_exists else None
            if found is not None:
                checks.setdefault(found[1].namespace, []).append(w.key)
        skip: set[bytes] = set()
        for namespace, keys in checks.items():  # before pinning: no pin waits on the network
            present = await self.remote.exists(namespace, keys)
            skip.update(k for k, p in zip(keys, present, strict=True) if p)
        sources: list[tuple[Tier, BlockEntry]] = []
        for w in batch:
            found = self._local(w.key)
            if found is None:
                store.counters.remote_lost_writes += 1  # evicted everywhere before its turn
            elif w.key not in skip:
                tier = found[0]
                sources.append((tier, tier.prepare_load(w.key)))  # pinned while framed
        try:
            views = [store.host.memview(e) if t is store.host else None
                     for t, e in sources]
            frames = await self._run_io(_frames, sources, views)
        finally:
            for tier, entry in sources:
                tier.complete_load(entry)
        writes = []
        for (tier, entry), frame in zip(sources, frames, strict=True):
            if isinstance(frame, Exception):
                store._integrity_failure(tier, entry, frame)  # counted, the bad copy deleted
            else:
                writes.append(RemoteWrite(entry.namespace, entry.key, frame))
        return writes

    async def _send(self, batch: list[QueuedWrite], writes: list[RemoteWrite],
                    ) -> list[QueuedWrite]:
        """Send one framed batch; returns the writes to try again (transient failures)."""
        if not writes:
            return []
        result = await self.remote.put(writes)
        self.store.counters.remote_dropped_writes += len(result.rejected)
        transient = set(result.transient)
        return self._failed_attempt([w for w in batch if w.key in transient])


def _frames(sources: list[tuple[Tier, BlockEntry]], views: list[memoryview | None],
            ) -> list[bytearray | Exception]:
    """Worker thread: the framed value of each pinned block, from its host view, its disk
    record (verified) or its gpu copy."""
    out: list[bytearray | Exception] = []
    for (tier, entry), view in zip(sources, views, strict=True):
        if view is not None:
            out.append(frame_value(entry.key, entry.layout_digest, view))
            continue
        frame = new_frame(entry.length)
        checksum = None  # computed by `seal_frame`, unless the disk verified one
        try:
            if isinstance(tier, DiskTier):
                tier.read_into(entry, payload_view(frame))
                checksum = entry.checksum or None
            elif isinstance(tier, GpuTier):
                tier.read_into(entry, payload_view(frame))
            else:
                raise TypeError(f"no way to read a {tier.name} block without a host view")
        except (IntegrityError, OSError) as e:
            out.append(e)
            continue
        out.append(seal_frame(frame, entry.key, entry.layout_digest, checksum))
    return out

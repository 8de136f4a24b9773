"""The bounded queue of blocks waiting to be written through to the remote tier.

It holds keys, not bytes: the writer reads each block from wherever it lives when its turn
comes (host, or disk if it was demoted meanwhile), so a queued block costs a few dozen bytes and
enqueueing never copies a payload on the event loop. A full queue sheds the new block (counted)
instead of blocking or growing: a publishing engine never waits for the remote tier, and a slow
or dead Cluster costs at most `capacity` keys of memory. A write that failed for a reason that
may pass (a connection, a timeout) goes back to the front for a few more attempts.

**Tenants share it** (the owners of `kvstore.tiering.owner_of`). Each owner has a FIFO of its
own; batches take from the owners in turn, and a full queue makes room for a block by
shedding the newest block of the owner with the most queued, unless that is the block's own
owner. So a tenant publishing faster than the remote tier takes blocks neither delays other
tenants' writes behind its backlog nor has their blocks shed. With one owner it is one FIFO.

With weights (`tenant_weights`, `set_weights`), "most queued" is per unit of weight, and an
owner's turn takes as many blocks as its weight over the least weight of those queued (the
fraction carried to its next turn): a tenant of weight 3 beside one of weight 1 gets three
blocks written to each one of the other's, and holds three times as many queued when full.
"""

from __future__ import annotations

import asyncio
from collections import OrderedDict
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass


@dataclass
class QueuedWrite:
    key: bytes
    # Queued by a demotion: the block was probably written when it was published, so the
    # writer first checks that the remote tier lacks it.
    check_exists: bool = False
    attempts: int = 0  # failed attempts so far
    owner: bytes = b""  # its tenant's (`kvstore.tiering.owner_of`); b"": unscoped


@dataclass
class QueueStats:
    depth: int
    capacity: int
    queued: int  # blocks accepted
    shed: int  # blocks refused because the queue was full (or no room to retry them)


class WriteThroughQueue:
    """A FIFO of `QueuedWrite`s per owner, one per key, at most `capacity` in all."""

    def __init__(self, capacity: int) -> None:
        if capacity < 1:
            raise ValueError(f"write-through queue capacity must be >= 1, got {capacity}")
        self.capacity = capacity
        self.queued = 0
        self.shed = 0
        self._owners: dict[bytes, OrderedDict[bytes, QueuedWrite]] = {}  # in turn order
        self._owner_of: dict[bytes, bytes] = {}  # queued key -> its owner
        self._ready = asyncio.Event()
        self._busy = 0  # batches taken and not yet marked done
        self._weights: dict[bytes, float] = {}  # owners not named weigh 1
        self._turn_left: dict[bytes, float] = {}  # blocks left in an owner's turn now

    def set_weights(self, weights: Mapping[bytes, float]) -> None:
        """Each owner's weight (`owner_of` tags; b"": the unscoped callers); 1 if not named."""
        for owner, w in weights.items():
            if not (w > 0 and w < float("inf")):
                raise ValueError(f"write-through queue: weight of owner {owner.hex()!r} must be "
                                 f"a positive number, got {w!r}")
        self._weights = {o: float(w) for o, w in weights.items() if w != 1}

    def _weight(self, owner: bytes) -> float:
        return self._weights.get(owner, 1.0)

    def __len__(self) -> int:
        return len(self._owner_of)

    def _fifo(self, owner: bytes) -> OrderedDict[bytes, QueuedWrite]:
        fifo = self._owners.get(owner)
        if fifo is None:
            fifo = self._owners[owner] = OrderedDict()
        return fifo

    def _pop(self, owner: bytes, last: bool) -> QueuedWrite:
        fifo = self._owners[owner]
        write = fifo.popitem(last=last)[1]
        del self._owner_of[write.key]
        if not fifo:
            del self._owners[owner]
            self._turn_left.pop(owner, None)
        return write

    def _room_for(self, owner: bytes) -> bool:
        """Whether a block of `owner` may be queued: there is room, or the owner with the
        most queued holds more than `owner` would and gives up its newest (shed)."""
        if len(self._owner_of) < self.capacity:
            return True
        mine = len(self._owners.get(owner, ()))
        if not self._weights:  # as before weights: in whole blocks
            most = max(self._owners, key=lambda o: len(self._owners[o]))
            if most == owner or len(self._owners[most]) <= mine + 1:
                return False
        else:
            w = self._weight
            most = max(self._owners, key=lambda o: len(self._owners[o]) / w(o))
            if most == owner or len(self._owners[most]) / w(most) <= (mine + 1) / w(owner):
                return False
        self._pop(most, last=True)
        self.shed += 1
        return True

    def put(self, key: bytes, check_exists: bool = False, owner: bytes = b"") -> bool:
        """Queue a block of `owner`; False when it was shed. A key already queued is not
        queued twice."""
        if key in self._owner_of:
            queued = self._owners[self._owner_of[key]][key]
            queued.check_exists = queued.check_exists and check_exists  # one write covers both
            return True
        if not self._room_for(owner):
            self.shed += 1
            return False
        self._fifo(owner)[key] = QueuedWrite(key, check_exists, owner=owner)
        self._owner_of[key] = owner
        self.queued += 1
        self._ready.set()
        return True

    def discard(self, key: bytes) -> None:
        """Forget a queued block (it was cleared: writing it would bring it back)."""
        owner = self._owner_of.get(key)
        if owner is not None:
            fifo = self._owners[owner]
            del fifo[key], self._owner_of[key]
            if not fifo:
                del self._owners[owner]
                self._turn_left.pop(owner, None)

    def requeue(self, writes: Iterable[QueuedWrite]) -> None:
        """Put writes that failed back at the front of their owners' FIFOs, in their order,
        while there is room, shared as `put` shares it: while a batch was out, another
        owner may have filled the queue, and it gives way to these as to new blocks."""
        back: dict[bytes, list[QueuedWrite]] = {}
        for w in writes:
            if w.key in self._owner_of:
                continue
            if not self._room_for(w.owner):
                self.shed += 1
                continue
            self._fifo(w.owner)[w.key] = w  # at the back for now: counted in the shares
            self._owner_of[w.key] = w.owner
            back.setdefault(w.owner, []).append(w)
        for owner, ws in back.items():
            fifo = self._owners.get(owner)
            for w in reversed(ws):  # then to the front, in their order
                if fifo is not None and w.key in fifo:  # (not shed by a later one meanwhile)
                    fifo.move_to_end(w.key, last=False)
        if self._owner_of:
            self._ready.set()

    async def take(self, max_blocks: int, max_bytes: int,
                   size_of: Callable[[bytes], int]) -> list[QueuedWrite]:
        """The oldest entries of each owner in turn, at least one and within both limits,
        waiting while the queue is empty; call `done` when the batch is written (or given
        up)."""
        while not self._owner_of:
            self._ready.clear()
            await self._ready.wait()
        batch: list[QueuedWrite] = []
        total = 0
        while self._owner_of and len(batch) < max_blocks:
            owner = next(iter(self._owners))
            key = next(iter(self._owners[owner]))
            total += size_of(key)
            if batch and total > max_bytes:
                break
            if self._turn_left.get(owner, 0.0) < 1:  # its turn begins
                self._turn_left[owner] = self._turn_left.get(owner, 0.0) + self._turn(owner)
            batch.append(self._pop(owner, last=False))
            if owner in self._owners:
                self._turn_left[owner] -= 1
                if self._turn_left[owner] < 1:  # its turn is over: to the back of the line
                    self._owners[owner] = self._owners.pop(owner)
        self._busy += 1
        return batch

    def _turn(self, owner: bytes) -> float:
        """Blocks in a turn of `owner`: its weight over the least of the owners queued."""
        if not self._weights:
            return 1.0
        return self._weight(owner) / min(self._weight(o) for o in self._owners)

    def done(self) -> None:
        self._busy -= 1

    def idle(self) -> bool:
        """Nothing queued and no batch being written."""
        return not self._owner_of and not self._busy

    def stats(self) -> QueueStats:
        return QueueStats(len(self._owner_of), self.capacity, self.queued, self.shed)

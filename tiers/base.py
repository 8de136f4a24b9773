"""The tier interface and the block bookkeeping all tiers share.

Lifecycle, as vLLM's offload API: a block is written with `prepare_store` (space reserved,
invisible to readers, not evictable) then `complete_store` (visible) or `abort_store` (space
returned); it is read between `prepare_load` (pinned: cannot be evicted or removed under the
reader) and `complete_load`. Tiers move bytes; which blocks to keep is `kvstore.tiering`'s call.
All bookkeeping runs on the daemon's event-loop thread; only byte movement runs in workers.
"""

from __future__ import annotations

import logging
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator
from dataclasses import dataclass

from kvstore.errors import CapacityError, InvalidArgumentError
from kvstore.extents import ExtentAllocator
from kvstore.tiering import TierPolicy, owner_of

log = logging.getLogger(__name__)

PAGE = 4096  # allocation unit: page-aligned blocks allow O_DIRECT and aligned vector copies


@dataclass
class BlockEntry:
    """Where one block lives in a tier, and what it is bound to."""

    key: bytes
    namespace: bytes
    layout_digest: bytes
    length: int  # payload bytes
    unit: int  # first allocation unit
    units: int  # allocation units held
    committed: bool = False
    checksum: bytes = b""  # xxh3-128 of the payload, where the tier keeps one
    scratch_owner: bytes = b""  # scratch space only: the owner whose share counts it

    @property
    def offset(self) -> int:
        return self.unit * PAGE


@dataclass
class TierStats:
    name: str
    blocks: int
    used_bytes: int
    capacity_bytes: int
    pinned_blocks: int
    evictions: int
    degraded: str = ""  # why the tier takes no writes (disk full, read-only); "" when it does


class Tier(ABC):
    """Blocks in fixed-capacity, page-allocated space, with the two-phase lifecycle."""

    name: str = "tier"

    def __init__(self, capacity_bytes: int) -> None:
        if capacity_bytes < 0:
            raise InvalidArgumentError(f"{self.name}: capacity must be >= 0")
        self.capacity_bytes = capacity_bytes - capacity_bytes % PAGE
        self.policy = TierPolicy(self.name, self.capacity_bytes)
        self.alloc = ExtentAllocator(self.capacity_bytes // PAGE)
        self.entries: dict[bytes, BlockEntry] = {}
        # Committed blocks and their bytes per namespace, kept as blocks come and go, so that
        # Stats, metrics scrapes and Inspect never walk every entry on the daemon's loop.
        self.committed_blocks = 0
        self.by_namespace: dict[bytes, list[int]] = {}  # namespace -> [blocks, bytes]
        # Told (tier, entry, stored) when a block becomes visible (True) or leaves (False):
        # the daemon's KV events (`server.kv_events`); None costs one test per change.
        self.listener: Callable[[Tier, BlockEntry, bool], None] | None = None
        self.listener_failures = 0  # errors `_tell` kept out of the tier
        # Called once when a write in flight ends (`when_landed`).
        self._landing: dict[bytes, list[Callable[[], object]]] = {}
        # Committed blocks removed (`discard`) while a reader pinned them: gone for every
        # query now, their space freed when the last pin goes (`complete_load`).
        self._doomed: set[bytes] = set()

    # ---- sizes
    def units_for(self, length: int) -> int:
        """Allocation units a payload of `length` bytes takes in this tier."""
        return -(-length // PAGE)

    # ---- queries
    def contains(self, key: bytes) -> bool:
        e = self.entries.get(key)
        return e is not None and e.committed and key not in self._doomed

    def holds(self, key: bytes) -> bool:
        """Committed or being written."""
        return key in self.entries

    def get(self, key: bytes) -> BlockEntry | None:
        e = self.entries.get(key)
        return e if e is not None and e.committed and key not in self._doomed else None

    def keys(self, namespace: bytes | None = None) -> Iterator[bytes]:
        """Committed keys, of one namespace when given."""
        for k, e in list(self.entries.items()):
            if e.committed and (namespace is None or e.namespace == namespace) \
                    and k not in self._doomed:
                yield k

    # ---- store
    def prepare_store(self, key: bytes, namespace: bytes, layout_digest: bytes,
                      length: int) -> BlockEntry | None:
        """Reserve space for a block; None when the caller must evict first (`next_victim`).

        Raises `CapacityError` when the block could never fit, and `InvalidArgumentError` when
        the key is already present or being written.
        """
        if key in self.entries:
            raise InvalidArgumentError(f"{self.name}: block already present or being written")
        got = self._allocate(length, f"a {length}-byte block exceeds")
        if got is None:
            return None
        entry = BlockEntry(key, namespace, layout_digest, length, *got)
        self.entries[key] = entry
        self.policy.add(key, entry.units * PAGE, owner_of(namespace))
        self.policy.pin(key)  # in flight: not evictable
        return entry

    def complete_store(self, entry: BlockEntry) -> None:
        if not entry.committed:
            entry.committed = True
            self._count(entry, 1)
            self._tell(entry, True)
        self.policy.unpin(entry.key)
        self._landed(entry.key)

    def when_landed(self, key: bytes, fn: Callable[[], object]) -> None:
        """Call `fn` once the write of `key` in flight here ends: committed, aborted or
        detached (at once if none is in flight)."""
        e = self.entries.get(key)
        if e is None or e.committed:
            fn()
        else:
            self._landing.setdefault(key, []).append(fn)

    def _landed(self, key: bytes) -> None:
        for fn in self._landing.pop(key, ()):
            fn()

    def _count(self, entry: BlockEntry, sign: int) -> None:
        """Account a committed block in (`sign` 1) or out (-1) of the counts."""
        self.committed_blocks += sign
        counts = self.by_namespace.setdefault(entry.namespace, [0, 0])
        counts[0] += sign
        counts[1] += sign * entry.length
        if counts[0] == 0:
            del self.by_namespace[entry.namespace]

    def _forget_all(self) -> None:
        """Drop every entry and its counts (a tier being closed)."""
        self.entries.clear()
        for key in list(self._landing):
            self._landed(key)
        self.committed_blocks = 0
        self.by_namespace.clear()
        self._doomed.clear()

    def abort_store(self, entry: BlockEntry) -> None:
        if self.entries.get(entry.key) is entry:
            self._drop(entry)

    def detach(self, entry: BlockEntry) -> BlockEntry | None:
        """End a reservation but keep its space, as scratch under no key (`free_scratch`):
        the key can be written again while the old slots stay out of use. None when `entry`
        is not a reservation of this tier."""
        if self.entries.get(entry.key) is not entry or entry.committed:
            return None
        del self.entries[entry.key]
        self.policy.remove(entry.key)
        owner = owner_of(entry.namespace)
        self.policy.take_scratch(entry.units * PAGE, owner)
        self._landed(entry.key)
        return BlockEntry(b"", b"", b"", entry.length, entry.unit, entry.units,
                          scratch_owner=owner)

    def _allocate(self, length: int, what: str) -> tuple[int, int] | None:
        """(first unit, units) for `length` bytes; None when the policy or the allocator has
        no room now (the caller evicts first), `CapacityError` ("{name}: {what} the tier's
        capacity") when it could never fit."""
        units = self.units_for(length)
        if units > self.alloc.total:
            raise CapacityError(f"{self.name}: {what} the tier's "
                                f"{self.capacity_bytes}-byte capacity")
        if not self.policy.fits(units * PAGE):
            return None
        unit = self.alloc.allocate(units)
        return None if unit is None else (unit, units)

    # ---- scratch: space for bytes passing through, owned by the caller until it frees it
    def prepare_scratch(self, length: int, owner: bytes = b"") -> BlockEntry | None:
        """Space for `length` bytes that hold no block: allocated and counted as used, but
        under no key, so never visible, never a victim; counted in `owner`'s share (the
        reader's it is taken for, `kvstore.tiering.owner_of`). None when the caller must evict
        first (`next_victim`); `CapacityError` when it could never fit. Free with
        `free_scratch`."""
        got = self._allocate(length, f"{length} bytes exceed")
        if got is None:
            return None
        self.policy.take_scratch(got[1] * PAGE, owner)
        return BlockEntry(b"", b"", b"", length, *got, scratch_owner=owner)

    def free_scratch(self, entry: BlockEntry) -> None:
        """Give back space from `prepare_scratch` or `detach` (once)."""
        self.alloc.free(entry.unit, entry.units)
        self.policy.give_scratch(entry.units * PAGE, entry.scratch_owner)

    # ---- load
    def prepare_load(self, key: bytes) -> BlockEntry:
        entry = self.get(key)
        if entry is None:
            raise InvalidArgumentError(f"{self.name}: no committed block to load")
        self.policy.pin(key)
        return entry

    def complete_load(self, entry: BlockEntry) -> None:
        if self.entries.get(entry.key) is entry:
            self.policy.unpin(entry.key)
            if entry.key in self._doomed and not self.policy.is_pinned(entry.key):
                self._doomed.discard(entry.key)
                self._drop(entry, counted=False)  # its last reader let go

    # ---- eviction and removal
    def next_victim(self) -> bytes | None:
        """The committed, unpinned block the eviction policy gives up next, or None."""
        return self.policy.next_victim()

    def use_eviction(self, name: str) -> None:
        """Order evictions with policy `name` (`kvstore.eviction.POLICIES`); the blocks held
        (a reopened disk tier's) and their pins carry over, oldest first."""
        self.policy = self.policy.with_eviction(name)

    def remove(self, key: bytes) -> bool:
        """Forget a committed, unpinned block; False when absent or pinned."""
        entry = self.get(key)
        if entry is None or self.policy.is_pinned(key):
            return False
        self._drop(entry)
        return True

    def discard(self, key: bytes) -> bool:
        """Forget a committed block even while readers pin it (a Clear, a corrupt block):
        gone at once for every query, counts and listener; its space (and on disk its
        record) stays until the last reader lets go, so no read in flight sees it reused.
        False when absent."""
        entry = self.get(key)
        if entry is None:
            return False
        if not self.policy.is_pinned(key):
            self._drop(entry)
            return True
        self._doomed.add(key)
        self._count(entry, -1)
        self._tell(entry, False)
        return True

    def evict(self, key: bytes) -> bool:
        removed = self.remove(key)
        if removed:
            self.policy.count_eviction()
        return removed

    def _drop(self, entry: BlockEntry, counted: bool = True) -> None:
        """Free `entry`; `counted` False: already taken out of the counts and told
        (`discard`)."""
        del self.entries[entry.key]
        if entry.committed and counted:
            self._count(entry, -1)
        self.policy.remove(entry.key)
        self.alloc.free(entry.unit, entry.units)
        self._on_drop(entry)
        if not entry.committed:
            self._landed(entry.key)
        elif counted:
            self._tell(entry, False)

    def _tell(self, entry: BlockEntry, stored: bool) -> None:
        """The listener, which must not undo a change half made: an error in it (the KV
        events' store failing on a full disk) is logged, never raised into the tier."""
        if self.listener is None:
            return
        try:
            self.listener(self, entry, stored)
        except Exception:
            self.listener_failures += 1
            if self.listener_failures == 1:  # then only counted: one traceback, not a flood
                log.exception("%s tier: the listener of block changes failed (events of "
                              "this change lost; later failures are only counted)", self.name)

    def _on_drop(self, entry: BlockEntry) -> None:  # noqa: B027 - optional hook
        """Hook for tiers with persistent state (the disk index)."""

    def touch_chain(self, keys: list[bytes]) -> None:
        self.policy.touch_chain(keys)

    def stats(self) -> TierStats:
        s = self.policy.stats()
        return TierStats(self.name, self.committed_blocks, s.used_bytes, s.capacity_bytes,
                         s.pinned_blocks, s.evictions)

    @abstractmethod
    def close(self) -> None:
        """Release the tier's resources (memory, files)."""

"""The tiering policy: which blocks a tier keeps and which it gives up, as metadata only.

One `TierPolicy` per tier: byte capacity, pins, and an eviction policy (`kvstore.eviction`:
`lru`, `arc`, `s3fifo`, `prefix`) that orders the victims. It moves no bytes, so the daemon and
the trace simulator run the same code.

- **Leaf before parent.** A prefix with a hole is useless past the hole, so a block's parent
  must outlive it. Blocks are only ever touched as whole prefixes, and `touch_chain` touches a
  chain from its last block to its first, so under LRU a parent is always at least as recent as
  any of its children and LRU reaches children first; `prefix` evicts only leaves.
- **Pinned blocks are never evicted.** Pins are counts (several readers may hold one block).
- **Demotion, promotion.** Victims are handed back to the caller, which moves them to the next
  tier down; hits in a lower tier are copied up by the caller.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

from kvstore.errors import CapacityError, InvalidArgumentError
from kvstore.eviction import Clock, EvictionPolicy, make_policy


@dataclass
class PolicyStats:
    blocks: int
    used_bytes: int
    capacity_bytes: int
    pinned_blocks: int
    evictions: int


class TierPolicy:
    """The blocks of one tier: sizes, byte capacity, pins, and the eviction order."""

    def __init__(self, name: str, capacity_bytes: int, eviction: str = "lru",
                 clock: Clock = time.monotonic) -> None:
        if capacity_bytes < 0:
            raise InvalidArgumentError(f"{name}: capacity must be >= 0 bytes, got {capacity_bytes}")
        self.name = name
        self.capacity_bytes = capacity_bytes
        self.used_bytes = 0
        self.evictions = 0
        self._sizes: dict[bytes, int] = {}  # key -> bytes
        self._pins: dict[bytes, int] = {}
        self.eviction: EvictionPolicy = make_policy(eviction, capacity_bytes, self._pins, clock)

    def with_eviction(self, eviction: str) -> TierPolicy:
        """A copy of this tier's state under another eviction policy: blocks enter it in this
        policy's eviction order (pinned ones last), as if used in that order."""
        other = TierPolicy(self.name, self.capacity_bytes, eviction, self.eviction.clock)
        first = list(self.eviction_order())
        for key in first + [k for k in self._sizes if k in self._pins]:
            other.add(key, self._sizes[key])
        other._pins.update(self._pins)
        other.evictions = self.evictions
        other.used_bytes = self.used_bytes  # scratch space too (`Tier.prepare_scratch`)
        return other

    def __contains__(self, key: bytes) -> bool:
        return key in self._sizes

    def __len__(self) -> int:
        return len(self._sizes)

    def size_of(self, key: bytes) -> int:
        return self._sizes[key]

    def fits(self, nbytes: int) -> bool:
        return self.used_bytes + nbytes <= self.capacity_bytes

    def add(self, key: bytes, nbytes: int) -> None:
        """Account a block as most recent; the caller has made room (see `victims`)."""
        if key in self._sizes:
            self.eviction.touch_chain((key,))
            return
        if nbytes > self.capacity_bytes:
            raise CapacityError(f"{self.name}: a {nbytes}-byte block exceeds the tier's "
                                f"{self.capacity_bytes}-byte capacity")
        self._sizes[key] = nbytes
        self.used_bytes += nbytes
        self.eviction.insert(key, nbytes)

    def remove(self, key: bytes) -> int:
        """Forget a block (evicted, deleted or corrupt); returns its size, 0 if absent."""
        nbytes = self._sizes.pop(key, None)
        if nbytes is None:
            return 0
        self.used_bytes -= nbytes
        self._pins.pop(key, None)
        self.eviction.remove(key)
        return nbytes

    def touch_chain(self, keys: Sequence[bytes]) -> None:
        """Mark a prefix chain used, root first (the policy ranks parents after children)."""
        self.eviction.touch_chain(keys)

    def end_session(self, keys: Sequence[bytes]) -> int:
        """A client's hint that the conversation of prompt `keys` ended: its own blocks go
        first (`EvictionPolicy.end_session`); returns how many blocks that marked."""
        return self.eviction.end_session(keys)

    def pin(self, key: bytes) -> None:
        if key not in self._sizes:
            raise InvalidArgumentError(f"{self.name}: cannot pin a block the tier does not hold")
        self._pins[key] = self._pins.get(key, 0) + 1

    def unpin(self, key: bytes) -> None:
        count = self._pins.get(key, 0)
        if count > 1:
            self._pins[key] = count - 1
        elif count == 1:
            del self._pins[key]
            self.eviction.unpinned(key)

    def is_pinned(self, key: bytes) -> bool:
        return key in self._pins

    def pin_count(self, key: bytes) -> int:
        return self._pins.get(key, 0)

    def eviction_order(self) -> Iterator[bytes]:
        """Unpinned keys, the next victim first (O(n) or more: not for the hot path)."""
        return self.eviction.order()

    lru_order = eviction_order  # the name callers used when LRU was the only policy

    def next_victim(self) -> bytes | None:
        """The unpinned block to evict next, or None; not removed."""
        return self.eviction.victim()

    def victims(self, nbytes: int) -> list[bytes]:
        """The unpinned blocks to evict, in order, to make room for `nbytes` more.

        Raises `CapacityError` when even evicting every unpinned block would not be enough.
        Does not remove them: the caller demotes each, then calls `remove`.
        """
        need = self.used_bytes + nbytes - self.capacity_bytes
        chosen: list[bytes] = []
        if need <= 0:
            return chosen
        aside: list[bytes] = []  # pinned for a moment, so the policy names the next one
        try:
            while (key := self.eviction.victim()) is not None:
                chosen.append(key)
                need -= self._sizes[key]
                if need <= 0:
                    return chosen
                self._pins[key] = 1
                aside.append(key)
            raise CapacityError(
                f"{self.name}: cannot make room for {nbytes} bytes; "
                f"{len(self._pins) - len(aside)} pinned blocks hold the rest of "
                f"{self.capacity_bytes} bytes")
        finally:
            for key in reversed(aside):  # last set aside first: each goes back where it was
                del self._pins[key]
                self.eviction.unpinned(key)

    def count_eviction(self, n: int = 1) -> None:
        self.evictions += n

    def stats(self) -> PolicyStats:
        return PolicyStats(blocks=len(self._sizes), used_bytes=self.used_bytes,
                           capacity_bytes=self.capacity_bytes, pinned_blocks=len(self._pins),
                           evictions=self.evictions)


class RecentChains:
    """The prefix chains requests used most recently, as lists of keys, up to `max_keys` keys
    in all (the oldest chains forgotten first).

    A chain is named by its last key: keys are chained hashes, so the last key fixes every
    key before it. The shutdown flush writes these chains from their first block: a tier's
    eviction order ranks blocks, not prompts, and may put a prompt's tail, or a segment of it
    past blocks held by another tier, ahead of its head.
    """

    def __init__(self, max_keys: int) -> None:
        self.max_keys = max(1, max_keys)
        self._chains: OrderedDict[bytes, Sequence[bytes]] = OrderedDict()
        self._keys = 0

    def add(self, keys: Sequence[bytes]) -> None:
        """`keys` (root first) was used now: O(1) amortised, the list is kept, not copied."""
        if not keys:
            return
        self.forget(keys)
        self._chains[keys[-1]] = keys
        self._keys += len(keys)
        while self._keys > self.max_keys and len(self._chains) > 1:
            self._keys -= len(self._chains.popitem(last=False)[1])

    def forget(self, keys: Sequence[bytes]) -> None:
        """The chain `keys` is no longer worth writing first (its conversation ended)."""
        if keys:
            old = self._chains.pop(keys[-1], None)
            if old is not None:
                self._keys -= len(old)

    def newest_first(self) -> Iterator[Sequence[bytes]]:
        return reversed(self._chains.values())

    def __len__(self) -> int:
        return len(self._chains)

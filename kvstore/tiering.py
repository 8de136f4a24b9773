"""The tiering policy: which blocks a tier keeps and which it gives up, as metadata only.

One `TierPolicy` per tier: LRU order, byte capacity, pins. It moves no bytes, so the daemon
and the trace simulator run the same code.

- **Leaf before parent.** A prefix with a hole is useless past the hole, so a block's parent
  must outlive it. Blocks are only ever touched as whole prefixes, and `touch_chain` touches a
  chain from its last block to its first, so a parent is always at least as recent as any of its
  children and LRU reaches children first.
- **Pinned blocks are never evicted.** Pins are counts (several readers may hold one block).
- **Demotion, promotion.** Victims are handed back to the caller, which moves them to the next
  tier down; hits in a lower tier are copied up by the caller.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

from kvstore.errors import CapacityError, InvalidArgumentError


@dataclass
class PolicyStats:
    blocks: int
    used_bytes: int
    capacity_bytes: int
    pinned_blocks: int
    evictions: int


class TierPolicy:
    """LRU over the blocks of one tier, with byte capacity and pins."""

    def __init__(self, name: str, capacity_bytes: int) -> None:
        if capacity_bytes < 0:
            raise InvalidArgumentError(f"{name}: capacity must be >= 0 bytes, got {capacity_bytes}")
        self.name = name
        self.capacity_bytes = capacity_bytes
        self.used_bytes = 0
        self.evictions = 0
        self._lru: OrderedDict[bytes, int] = OrderedDict()  # key -> bytes; oldest first
        self._pins: dict[bytes, int] = {}

    def __contains__(self, key: bytes) -> bool:
        return key in self._lru

    def __len__(self) -> int:
        return len(self._lru)

    def size_of(self, key: bytes) -> int:
        return self._lru[key]

    def fits(self, nbytes: int) -> bool:
        return self.used_bytes + nbytes <= self.capacity_bytes

    def add(self, key: bytes, nbytes: int) -> None:
        """Account a block as most recent; the caller has made room (see `victims`)."""
        if key in self._lru:
            self._lru.move_to_end(key)
            return
        if nbytes > self.capacity_bytes:
            raise CapacityError(f"{self.name}: a {nbytes}-byte block exceeds the tier's "
                                f"{self.capacity_bytes}-byte capacity")
        self._lru[key] = nbytes
        self.used_bytes += nbytes

    def remove(self, key: bytes) -> int:
        """Forget a block (evicted, deleted or corrupt); returns its size, 0 if absent."""
        nbytes = self._lru.pop(key, 0)
        self.used_bytes -= nbytes
        self._pins.pop(key, None)
        return nbytes

    def touch_chain(self, keys: Sequence[bytes]) -> None:
        """Mark a prefix chain used, last block first so parents end up most recent."""
        lru = self._lru  # local names: every lookup touches its whole chain (512 keys at 128k)
        move = lru.move_to_end
        for key in reversed(keys):
            if key in lru:
                move(key)

    def pin(self, key: bytes) -> None:
        if key not in self._lru:
            raise InvalidArgumentError(f"{self.name}: cannot pin a block the tier does not hold")
        self._pins[key] = self._pins.get(key, 0) + 1

    def unpin(self, key: bytes) -> None:
        count = self._pins.get(key, 0)
        if count <= 1:
            self._pins.pop(key, None)
        else:
            self._pins[key] = count - 1

    def is_pinned(self, key: bytes) -> bool:
        return key in self._pins

    def lru_order(self) -> Iterator[bytes]:
        """Unpinned keys, least recently used first."""
        return (k for k in self._lru if k not in self._pins)

    def victims(self, nbytes: int) -> list[bytes]:
        """Least recent unpinned blocks whose removal makes room for `nbytes` more.

        Raises `CapacityError` when even evicting every unpinned block would not be enough.
        Does not remove them: the caller demotes each, then calls `remove`.
        """
        need = self.used_bytes + nbytes - self.capacity_bytes
        chosen: list[bytes] = []
        if need <= 0:
            return chosen
        for key in self.lru_order():
            chosen.append(key)
            need -= self._lru[key]
            if need <= 0:
                return chosen
        raise CapacityError(
            f"{self.name}: cannot make room for {nbytes} bytes; "
            f"{len(self._pins)} pinned blocks hold the rest of {self.capacity_bytes} bytes")

    def count_eviction(self, n: int = 1) -> None:
        self.evictions += n

    def stats(self) -> PolicyStats:
        return PolicyStats(blocks=len(self._lru), used_bytes=self.used_bytes,
                           capacity_bytes=self.capacity_bytes, pinned_blocks=len(self._pins),
                           evictions=self.evictions)

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
- **Tenants share a tier fairly.** Each block has an owner: the tenant whose scoped namespace it
  is in (`owner_of`; b"" for unscoped callers). An owner's share of a tier is the tier's
  capacity times its weight over the weights of the owners holding space there (`set_weights`;
  1 each unless the operator says otherwise, so equal shares by default). Each owner's blocks
  have an eviction policy of their own, and the owner that would hold the most bytes per unit
  of weight, counting the block coming in, gives way first (on a tie, the block's own owner),
  its own policy naming which of its blocks. Only the owner needing the room and owners over
  their share may give way, so pins (an owner all of whose blocks are pinned) never pass the
  turn to an owner within its share. Each owner's policy is sized by its share (its ghosts
  and queues). So a tenant publishing without end evicts only its own blocks once it holds
  its share, and a tenant holding at most its share of a full tier keeps everything against
  any other's flood. With one owner (no tenants) this is the policy alone.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass

from kvstore.errors import CapacityError, InvalidArgumentError
from kvstore.eviction import Clock, EvictionPolicy, make_policy

# A tenant's stored namespace (`server.tenancy`) ends with this tag and 4 bytes naming the
# tenant, so every tier can tell a block's owner from its namespace, a reopened disk tier's too.
# At the end: the namespace's first bytes stay its own hash, which names it in Redis keys.
TENANT_NAMESPACE_TAG = b"\xa7kvT"
OWNER_BYTES = 8  # the tag and the tenant's 4 bytes


def owner_of(namespace: bytes) -> bytes:
    """The owner of a block in `namespace`: its tenant's 8 bytes, or b"" (unscoped)."""
    if len(namespace) == 32 and namespace[-OWNER_BYTES:].startswith(TENANT_NAMESPACE_TAG):
        return namespace[-OWNER_BYTES:]
    return b""


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
        self._kind, self._clock = eviction, clock
        # One eviction policy per owner, and the bytes and blocks each owner holds. b"" always
        # exists (`eviction`); a tenant's is made at its first block, dropped with its last.
        self._policies: dict[bytes, EvictionPolicy] = {b"": self._new_policy()}
        self._held: dict[bytes, int] = {b"": 0}
        self._blocks: dict[bytes, int] = {b"": 0}
        self._owner: dict[bytes, bytes] = {}  # key -> owner, for owners other than b""
        # Scratch space (`Tier.prepare_scratch`: under no key, never a victim) per owner: the
        # caller it was taken for holds it, so it counts in that owner's share.
        self._scratch: dict[bytes, int] = {}
        self._weights: dict[bytes, float] = {}  # owner -> weight, for owners other than 1

    def _new_policy(self) -> EvictionPolicy:
        return make_policy(self._kind, self.capacity_bytes, self._pins, self._clock)

    def set_weights(self, weights: Mapping[bytes, float]) -> None:
        """Each owner's weight (`owner_of` tags; b"": the unscoped callers); 1 for owners
        not named. An owner's share of the tier is proportional to its weight."""
        for owner, w in weights.items():
            if not (w > 0 and w < float("inf")):
                raise InvalidArgumentError(f"{self.name}: weight of owner {owner.hex()!r} "
                                           f"must be a positive number, got {w!r}")
        self._weights = {o: float(w) for o, w in weights.items() if w != 1}
        self._share_out()

    def weight(self, owner: bytes) -> float:
        return self._weights.get(owner, 1.0)

    def share_among(self, owner: bytes, owners: set[bytes]) -> int:
        """`owner`'s share of the tier between `owners` (which it joins if absent)."""
        owners = owners | {owner}
        if not self._weights:  # equal shares, in integers as before weights
            return self.capacity_bytes // len(owners)
        total = sum(self.weight(o) for o in owners)
        return int(self.capacity_bytes * self.weight(owner) / total)

    def _share_out(self) -> None:
        """Size each owner's policy by its share of the tier (its small queue, ghost lists
        and bounds are fractions of its capacity), once the owners holding blocks change.
        With one owner: the whole tier, as without tenants."""
        present = {o for o, n in self._blocks.items() if n}
        for owner, policy in self._policies.items():
            policy.capacity_bytes = self.share_among(owner, present)

    @property
    def eviction(self) -> EvictionPolicy:
        """The eviction policy of unscoped blocks (the only one without tenants)."""
        return self._policies[b""]

    def _policy_of(self, key: bytes) -> EvictionPolicy:
        return self._policies[self._owner.get(key, b"")]

    def owner(self, key: bytes) -> bytes:
        """The owner of a block the tier holds (b"": unscoped)."""
        return self._owner.get(key, b"")

    def owners(self) -> dict[bytes, int]:
        """Bytes each owner holds in the tier, blocks and scratch space, as evictions count
        them (b"": unscoped, always there)."""
        return self._holding()

    def share_of(self, owner: bytes) -> int:
        """The capacity `owner`'s eviction policy is sized by (its share)."""
        return self._policies[owner].capacity_bytes if owner in self._policies else 0

    def fair_share(self, owner: bytes = b"") -> int:
        """`owner`'s share of the tier between the owners holding space in it (blocks or
        scratch) and itself, by their weights (the whole tier without tenants)."""
        return self.share_among(owner, {o for o, n in self._holding().items() if n > 0})

    def take_scratch(self, nbytes: int, owner: bytes = b"") -> None:
        """Count `nbytes` of scratch space taken for `owner` (under no key, never a victim)."""
        self.used_bytes += nbytes
        self._scratch[owner] = self._scratch.get(owner, 0) + nbytes

    def give_scratch(self, nbytes: int, owner: bytes = b"") -> None:
        """Count back scratch space taken by `take_scratch`."""
        left = self._scratch.get(owner, 0) - nbytes
        if left < 0:
            raise InvalidArgumentError(f"{self.name}: {nbytes} bytes of scratch space given "
                                       f"back, {left + nbytes} taken")
        self.used_bytes -= nbytes
        if left:
            self._scratch[owner] = left
        else:
            del self._scratch[owner]

    def held_by(self, owner: bytes) -> int:
        """Bytes of `owner`'s blocks in the tier (its scratch space not counted)."""
        return self._held.get(owner, 0)

    def with_eviction(self, eviction: str) -> TierPolicy:
        """A copy of this tier's state under another eviction policy: blocks enter it in this
        policy's eviction order (pinned ones last), as if used in that order."""
        other = TierPolicy(self.name, self.capacity_bytes, eviction, self._clock)
        other._weights = dict(self._weights)
        first = list(self.eviction_order())
        for key in first + [k for k in self._sizes if k in self._pins]:
            other.add(key, self._sizes[key], self.owner(key))
        other._pins.update(self._pins)
        other.evictions = self.evictions
        other.used_bytes = self.used_bytes  # scratch space too (`Tier.prepare_scratch`)
        other._scratch = dict(self._scratch)
        return other

    def __contains__(self, key: bytes) -> bool:
        return key in self._sizes

    def __len__(self) -> int:
        return len(self._sizes)

    def size_of(self, key: bytes) -> int:
        return self._sizes[key]

    def fits(self, nbytes: int) -> bool:
        return self.used_bytes + nbytes <= self.capacity_bytes

    def add(self, key: bytes, nbytes: int, owner: bytes = b"") -> None:
        """Account a block of `owner` (`owner_of` its namespace) as most recent; the caller
        has made room (see `victims`)."""
        if key in self._sizes:
            self._policy_of(key).touch_chain((key,))
            return
        if nbytes > self.capacity_bytes:
            raise CapacityError(f"{self.name}: a {nbytes}-byte block exceeds the tier's "
                                f"{self.capacity_bytes}-byte capacity")
        self._sizes[key] = nbytes
        self.used_bytes += nbytes
        if owner:
            self._owner[key] = owner
            if owner not in self._policies:
                self._policies[owner] = self._new_policy()
                self._held[owner] = self._blocks[owner] = 0
        self._held[owner] += nbytes
        self._blocks[owner] += 1
        self._policies[owner].insert(key, nbytes)
        if self._blocks[owner] == 1 and len(self._policies) > 1:
            self._share_out()

    def remove(self, key: bytes) -> int:
        """Forget a block (evicted, deleted or corrupt); returns its size, 0 if absent."""
        nbytes = self._sizes.pop(key, None)
        if nbytes is None:
            return 0
        self.used_bytes -= nbytes
        self._pins.pop(key, None)
        owner = self._owner.pop(key, b"")
        self._policies[owner].remove(key)
        self._held[owner] -= nbytes
        self._blocks[owner] -= 1
        if not self._blocks[owner] and len(self._policies) > 1:
            if owner:  # its last block: a tenant gone costs nothing
                del self._policies[owner], self._held[owner], self._blocks[owner]
            self._share_out()
        return nbytes

    def _owners_in(self, keys: Sequence[bytes]) -> list[EvictionPolicy]:
        """The policies of the owners of `keys` (one in practice: a chain's blocks share a
        namespace)."""
        if len(self._policies) == 1:
            return [self.eviction]
        owners = {self._owner.get(k, b"") for k in keys if k in self._sizes}
        return [self._policies[o] for o in owners]

    def touch_chain(self, keys: Sequence[bytes]) -> None:
        """Mark a prefix chain used, root first (the policy ranks parents after children)."""
        for policy in self._owners_in(keys):
            policy.touch_chain(keys)  # each skips the keys it lacks

    def end_session(self, keys: Sequence[bytes]) -> int:
        """A client's hint that the conversation of prompt `keys` ended: its own blocks go
        first (`EvictionPolicy.end_session`); returns how many blocks that marked."""
        return sum(policy.end_session(keys) for policy in self._owners_in(keys))

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
            self._policy_of(key).unpinned(key)

    def is_pinned(self, key: bytes) -> bool:
        return key in self._pins

    def pin_count(self, key: bytes) -> int:
        return self._pins.get(key, 0)

    def eviction_order(self) -> Iterator[bytes]:
        """Unpinned keys, least valuable first: with one owner the next victim first; with
        several, each owner's order interleaved by what each holds per unit of weight, without
        the bound of a share that `victims` keeps (O(n) or more: not for the hot path)."""
        if len(self._policies) == 1:
            return self.eviction.order()
        return self._fair_order()

    def _fair_order(self) -> Iterator[bytes]:
        orders = {o: p.order() for o, p in self._policies.items()}
        held = dict(self._held)
        while orders:
            owner = max(orders, key=lambda o: held[o] / self.weight(o))
            key = next(orders[owner], None)
            if key is None:
                del orders[owner]
                continue
            held[owner] -= self._sizes[key]
            yield key

    lru_order = eviction_order  # the name callers used when LRU was the only policy

    def _victim(self, held: dict[bytes, int], owner: bytes) -> bytes | None:
        """The next victim: the owner holding the most per unit of weight (by `held`) that
        has an unpinned block gives up its policy's victim; on a tie, `owner` (whose block
        needs the room).

        While the tier is full by its byte count, only `owner` itself and owners holding more
        than their share (blocks and scratch space) may give way. The shares add up to at
        most the capacity, so a full tier has an owner over its share; if that is only
        `owner` and it has no unpinned block (a newcomer whose weighted share is smaller than
        its block), nobody gives way. Without this bound an owner's pins would pass its
        eviction on to an owner within its share (a tenant fetching its own blocks to keep
        them pinned while it publishes would evict another's). With room by the count (an
        allocator short of contiguous space) any owner may give way, as before.
        """
        if len(self._policies) == 1 and self._scratch.keys() <= {b""} and not self._weights:
            # One owner: the policy's order alone. (With weights the unscoped callers' share
            # may exceed a newcomer's due, so the bound below applies even to them alone.)
            return self.eviction.victim()
        full = sum(held.values()) > self.capacity_bytes  # every used byte is someone's
        present = {o for o, n in held.items() if n > 0}
        for o in sorted(self._policies,
                        key=lambda o: (held.get(o, 0) / self.weight(o), o == owner),
                        reverse=True):
            if full and o != owner and held.get(o, 0) <= self.share_among(o, present):
                continue
            if (key := self._policies[o].victim()) is not None:
                return key
        return None

    def _holding(self) -> dict[bytes, int]:
        """What each owner holds: its blocks and its scratch space."""
        held = dict(self._held)
        for o, n in self._scratch.items():
            held[o] = held.get(o, 0) + n
        return held

    def _held_with(self, owner: bytes, nbytes: int) -> dict[bytes, int]:
        """What each owner holds once `owner`'s `nbytes` more are in."""
        held = self._holding()
        held[owner] = held.get(owner, 0) + nbytes
        return held

    def next_victim(self, owner: bytes = b"", nbytes: int = 0) -> bytes | None:
        """The unpinned block to evict next to make room for `nbytes` of `owner`, or None;
        not removed."""
        return self._victim(self._held_with(owner, nbytes), owner)

    def victims(self, nbytes: int, owner: bytes = b"") -> list[bytes]:
        """The unpinned blocks to evict, in order, to make room for `nbytes` more of `owner`:
        each from the owner that would hold the most per unit of weight, counting those bytes
        in.

        Raises `CapacityError` when even evicting every unpinned block would not be enough.
        Does not remove them: the caller demotes each, then calls `remove`.
        """
        need = self.used_bytes + nbytes - self.capacity_bytes
        chosen: list[bytes] = []
        if need <= 0:
            return chosen
        aside: list[bytes] = []  # pinned for a moment, so the policy names the next one
        held = self._held_with(owner, nbytes)  # less the blocks chosen so far, as they go
        try:
            while (key := self._victim(held, owner)) is not None:
                chosen.append(key)
                need -= self._sizes[key]
                held[self.owner(key)] -= self._sizes[key]
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
                self._policy_of(key).unpinned(key)

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

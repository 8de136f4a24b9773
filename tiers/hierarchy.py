"""The placement engine: which tier holds each block and what gives way, as decisions only.

The daemon (`server/store.py`) and the trace simulator (`benchmarks/simulate.py`) ask the same
`Hierarchy`: the daemon carries its plans out with real bytes (a plan's victims are claimed
before the first byte moves, so concurrent calls never pick the same block), the simulator
applies them to metadata (`apply`, `place`). No I/O happens here.

Levels are the local tiers, fastest first (gpu when configured, host, then disk). One of them
is where clients meet the store (`serve`: host in the daemon): they write new blocks there and
read every fetched block from there. The rules:
- **Lookup** walks a prompt's keys through the levels and stops at the first key no level
  holds: a prefix with a hole is useless past the hole. A key is read from the serve level
  when it holds it (no copy), else from the fastest level holding it (`source`); a client
  that maps the gpu level's slab reads it from the fastest level holding it, gpu first.
- **Room** at a level is made from its eviction policy's victims (`kvstore.tiering`). A victim
  moves to the level below unless that level holds it already (a promoted block stays on
  disk, a block copied up to gpu stays in host), and is dropped from the last level; room
  below is made by the same rule.
- **A prompt read up from below** is promoted whole when it fits the level, else only its
  first blocks, up to its share (`PromptShare`): promoted whole it would push itself out.
  Into the serve level that is a fetch's disk and remote hits; into a level above it (gpu),
  the blocks a fetch served that it lacks (`lift`).
- **The shared remote tier** is not a level (no local space): a committed block is offered to
  it, and offered again when it leaves the serve level for a level below that keeps it
  (`share_on_leave`).
- **A shutdown flush** writes the blocks of the levels above the persistent one, chains used
  most recently first, each from its start, never a block past a hole (`flush_order`).
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from kvstore.errors import CapacityError
from kvstore.tiering import RecentChains, TierPolicy


class Level(Protocol):
    """What the engine reads of a tier: its name, its policy, and which keys it holds."""

    name: str
    policy: TierPolicy

    def contains(self, key: bytes) -> bool:
        """Committed: a reader may use it."""
        ...

    def holds(self, key: bytes) -> bool:
        """Committed or being written: no second copy may be started."""
        ...


@dataclass(frozen=True)
class Move:
    """One block leaving `src` to make room: copied to level `dst` first, or, when `dst` is
    None, dropped (the last level, or the level below holds it already)."""

    key: bytes
    src: int
    dst: int | None


@dataclass
class RoomPlan:
    """How to make `nbytes` of room at `level`: its moves, in order. `short` says why no
    room can be made ("" when it can): the rest of the level is pinned or in flight."""

    level: int
    nbytes: int
    moves: list[Move] = field(default_factory=list)
    short: str = ""


class Hierarchy:
    """The ordered local levels and the placement rules over them. `serve` is the level
    clients read from and write to; `recent`, when given, remembers the chains used most
    recently (the flush writes them head first); `remote`: a shared remote tier is configured
    (write-through)."""

    def __init__(self, levels: Sequence[Level], recent: RecentChains | None = None,
                 serve: int = 0, remote: bool = False) -> None:
        self.levels = list(levels)
        self.recent = recent
        self.serve = serve
        self.remote = remote
        # The order a fetch looks for a key in: the serve level first (its hits cost no copy).
        self._search = [self.levels[serve]] + [lv for i, lv in enumerate(self.levels)
                                                if i != serve]
        self._index = {id(lv): i for i, lv in enumerate(self.levels)}

    # ---- lookup
    def level_of(self, key: bytes) -> int | None:
        """The first level holding `key` (committed), or None."""
        for i, level in enumerate(self.levels):
            if level.contains(key):
                return i
        return None

    def source(self, key: bytes, fastest: bool = False) -> int | None:
        """The level a fetch reads `key` from: the serve level if it holds it, else the first
        level holding it; None when none does. `fastest`: the first level holding it, the
        serve level or not (a client that maps the gpu level's slab reads a block there,
        device to device, rather than from host across the bus)."""
        for level in self.levels if fastest else self._search:
            if level.contains(key):
                return self._index[id(level)]
        return None

    def walk(self, keys: Sequence[bytes]) -> list[str]:
        """Names of the levels a fetch would read the longest held prefix of `keys` from."""
        # Key by key, not a binary search: a chain's blocks need not be a contiguous prefix (a
        # block published while its unpinned parent was evicted, a corrupt block dropped).
        # Plain loops: a generator per key cost ~1 us, 0.6 ms of a 512-key lookup.
        found: list[str] = []
        append = found.append
        levels = self._search
        for key in keys:
            for level in levels:
                if level.contains(key):
                    append(level.name)
                    break
            else:
                break
        return found

    def touch(self, keys: Sequence[bytes]) -> None:
        """`keys` (a chain, root first) was used now, on every level."""
        keys = list(keys)
        for level in self.levels:
            level.policy.touch_chain(keys)
        if self.recent is not None:
            self.recent.add(keys)

    def end_session(self, keys: Sequence[bytes]) -> int:
        """A client says the conversation of prompt `keys` ended: each level's policy marks
        its own blocks to go first, and the flush no longer writes its chain first. Returns
        the blocks marked, counted once per level."""
        if self.recent is not None:
            self.recent.forget(keys)
        return sum(level.policy.end_session(keys) for level in self.levels)

    # ---- room
    def below(self, level: int, key: bytes) -> int | None:
        """Where a victim of `level` goes: the next level down, unless it holds the block
        already or there is none (then the block is dropped)."""
        nxt = level + 1
        if nxt >= len(self.levels) or self.levels[nxt].holds(key):
            return None
        return nxt

    def move(self, level: int, key: bytes) -> Move:
        """The move of one victim of `level`."""
        return Move(key, level, self.below(level, key))

    def room(self, level: int, nbytes: int, partial: bool = False,
             owner: bytes = b"") -> RoomPlan:
        """The moves that make `nbytes` of room at `level` for a block of `owner`
        (`kvstore.tiering.owner_of`: tenants share a level fairly), by its policy's byte count.

        `partial` is the daemon's: its allocator may be fragmented, and concurrent calls free
        and take room while its moves run, so it evicts what it can and tries again. With it,
        a plan names at least one victim while any exists, even where the count says the room
        is there or cannot be made; without it (the simulator's byte-exact levels) a plan
        that cannot make the room is `short` and moves nothing.
        """
        policy = self.levels[level].policy
        try:
            victims = policy.victims(nbytes, owner)
        except CapacityError as e:
            if not partial:
                return RoomPlan(level, nbytes, short=str(e))
            victims = []
        if not victims and partial:
            victim = policy.next_victim(owner, nbytes)
            if victim is None:
                return RoomPlan(level, nbytes, short=(
                    f"{self.levels[level].name} tier is full of pinned or in-flight blocks"))
            victims = [victim]
        return RoomPlan(level, nbytes, [self.move(level, v) for v in victims])

    # ---- promotion above the serve level
    def lift(self, prompt: Sequence[bytes], served: Collection[bytes], block: int) -> list[bytes]:
        """The blocks a fetch copies up into the level above the serve level (gpu), in order:
        of `prompt` (root first, the earlier calls' keys included), those the fetch `served`
        that the level lacks, from the prompt's start, while the prompt's blocks there stay
        within the level's capacity (`block`: a block's size there). A prompt larger than the
        level keeps its first blocks: the daemon pins the prompt's blocks there while it
        lifts, so it never pushes itself out. Empty when no level is above the serve level."""
        if self.serve == 0:
            return []
        top = self.levels[self.serve - 1]
        room = top.policy.capacity_bytes - sum(block for k in prompt if top.holds(k))
        todo = [k for k in prompt if k in served and not top.holds(k)]
        return todo[: max(0, room // block)] if block > 0 else []

    # ---- the shared remote tier (write-through)
    def share_on_commit(self) -> bool:
        """A committed block is offered to the remote tier at once (unchecked: it is new)."""
        return self.remote

    def share_on_leave(self, move: Move) -> bool:
        """Once carried out: whether a block that left its level is offered to the remote tier
        again (checked there first): it left the serve level, and a level below keeps it to
        read back from. Its write at commit may have been shed or failed, or it came up from
        below; a block no level keeps cannot be sent."""
        return (self.remote and move.src == self.serve
                and any(lv.contains(move.key) for lv in self.levels[self.serve + 1 :]))

    # ---- metadata-only execution (the simulator's; the daemon moves bytes instead)
    def place(self, level: int, key: bytes, nbytes: int,
              on_change: Callable[[str, bytes, bool], None] | None = None) -> bool:
        """Add `key` to `level`, making room by `room`; False (nothing changed at this level)
        when it cannot fit. `on_change(level name, key, stored)` hears every block that
        enters (True) or leaves (False) a level. Metadata only: for a `MetaLevel` chain."""
        tier = self.levels[level]
        policy = tier.policy
        if nbytes > policy.capacity_bytes:
            return False
        if not policy.fits(nbytes):
            plan = self.room(level, nbytes)
            if plan.short:
                return False
            self.apply(plan, on_change)
        policy.add(key, nbytes)
        if on_change is not None:
            on_change(tier.name, key, True)
        return True

    def apply(self, plan: RoomPlan, on_change: Callable[[str, bytes, bool], None] | None = None,
              ) -> None:
        """Carry `plan` out on metadata: each block copied down (where room below allows),
        then dropped from its level."""
        src = self.levels[plan.level]
        for move in plan.moves:
            nbytes = src.policy.size_of(move.key)
            if move.dst is not None:
                self.place(move.dst, move.key, nbytes, on_change)  # no room below: dropped
            src.policy.remove(move.key)
            src.policy.count_eviction()
            if on_change is not None:
                on_change(src.name, move.key, False)

    # ---- shutdown flush
    def flush_order(self, below: int) -> Iterator[bytes]:
        """Blocks of the levels above `below` that `below` lacks, in the order a flush cut
        short should write them there. A generator, read while the flush runs: each step sees
        the writes, and the evictions they caused, of the steps before it.

        A block is worth writing only if a restart can reach it: every block before it in its
        chain is below. So the chains used most recently come first, each from its start; a
        chain ends at a block no level holds, at one whose write did not land, or where a
        block before it has left `below` meanwhile (evicted to make room for the flush): past
        a hole nothing is reachable, and the budget goes to the next prompt's start instead.
        Then the rest of the levels, hottest first, less the blocks known to lie past a hole.
        (The eviction order alone ranks blocks, not prompts: it may put a prompt's tail, or a
        segment past blocks held below, ahead of its head.)
        """
        upper, low = self.levels[:below], self.levels[below]
        tried: set[bytes] = set()
        dead: set[bytes] = set()
        for chain in self.recent.newest_first() if self.recent is not None else ():
            stamp, i = low.policy.evictions, 0
            while i < len(chain):
                if low.policy.evictions != stamp:  # a write evicted something below: the start?
                    # O(i) lookups, only after a write that evicted: small beside that write.
                    stamp = low.policy.evictions
                    i = next((j for j in range(i) if not low.contains(chain[j])), i)
                key = chain[i]
                if not low.contains(key):
                    # Written already (and gone again), held nowhere, or its write failed: a
                    # hole, so the rest of the chain is worth nothing. (Each key is yielded
                    # once: the walk ends.)
                    if key in tried or not any(lv.contains(key) for lv in upper):
                        dead.update(chain[i + 1 :])
                        break
                    tried.add(key)
                    yield key
                    continue  # checked again: written, or a hole
                i += 1
        for level in upper:
            for key in reversed(list(level.policy.eviction_order())):
                if key in tried or key in dead or low.holds(key) or not level.contains(key):
                    continue
                tried.add(key)
                yield key


@dataclass
class PromptShare:
    """How much of a level one prompt read up from below may hold (the daemon's fetch).

    If the prompt's cached blocks fit the level it is promoted whole. A larger prompt, promoted
    whole, would push itself out: each promotion evicting (and writing down) another block of
    the same prompt, which this fetch or the next reads back. It keeps its first blocks up to
    its share (`limit`: the capacity less two fetch windows, the one the client copies and the
    one read meanwhile); past that its blocks are served from scratch space. A prompt holding
    more than its share gives way from its deepest block when scratch space is needed.
    """

    keep: int = 0  # promote while the prompt's bytes in the level stay within this
    limit: int = 0  # its share when it does not fit; past it, its deepest blocks give way
    used: int = 0  # bytes of the prompt in the level

    @classmethod
    def size(cls, capacity: int, window: int, block: int, used: int, rest: int,
             open_ended: bool, local: bool) -> PromptShare:
        """The share of a prompt holding `used` bytes of the level with `rest` more below.
        `open_ended`: a shared tier may extend the prompt past what was counted (`local`:
        every key was found in a local level); then the prompt fits only if it leaves the
        scratch room free anyway."""
        limit = max(0, capacity - 2 * max(window, block))
        fits = used + rest <= (limit if open_ended and not local else capacity)
        return cls(keep=capacity if fits else limit, limit=limit, used=used)

    def promotes(self, block: int) -> bool:
        """Whether the next block read up is promoted (else it goes to scratch space)."""
        return self.used + block <= self.keep

    def over(self) -> bool:
        """Whether the prompt holds more than its share (its deepest blocks give way)."""
        return self.used > self.limit

    def giving_way(self, movable: Sequence[bool]) -> int | None:
        """Which of the prompt's blocks in the level (chain order; `movable`: only this fetch
        pins it) gives way when scratch space is needed: while the prompt holds more than its
        share, its deepest movable block (a lookup stops at a hole: never its head); else
        None."""
        if not self.over():
            return None
        return next((i for i in range(len(movable) - 1, -1, -1) if movable[i]), None)


class MetaLevel:
    """A level as metadata only (the simulator's): its policy is all it has."""

    def __init__(self, policy: TierPolicy, name: str | None = None) -> None:
        self.name = name or policy.name
        self.policy = policy

    def contains(self, key: bytes) -> bool:
        return key in self.policy

    holds = contains
